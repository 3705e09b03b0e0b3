"""``padding_id`` / ``padding_idx`` and ``max_norm``: PyTorch's meanings.

The reference is a NumPy (float64) model of PyTorch's documented behaviour
(``torch.nn.functional.embedding``, ``nn.Embedding``, ``nn.EmbeddingBag``):

* ``padding_idx``: the row is read as it is and gets no gradient;
  ``EmbeddingBag`` also leaves it out of every bag.
* ``max_norm``: before the lookup, every row the ids read whose
  ``norm_type``-norm exceeds ``max_norm`` is scaled in the table, in place,
  by ``max_norm / (norm + 1e-7)`` (``torch.embedding_renorm_``); the lookup
  reads the scaled rows and the gradient is a plain lookup's.

The literal numbers of ``test_the_numbers_pytorch_prints`` were printed by
PyTorch 2 for the same inputs (checked by hand; torch is not a test dependency).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxslices as js

V, D = 7, 3


def _norm(x, p):
    x = np.abs(np.asarray(x, np.float64)).reshape(-1)
    return x.max() if math.isinf(p) else (x**p).sum() ** (1 / p)


def torch_renorm_(w, ids, max_norm, p):
    """``torch.embedding_renorm_``: the distinct ids' rows, in place."""
    for i in np.unique(ids):
        if 0 <= i < w.shape[0]:
            n = _norm(w[i], p)
            if n > max_norm:
                w[i] *= max_norm / (n + 1e-7)


def torch_lookup_grad(ids, ct, num_rows, padding_idx):
    """The gradient of ``F.embedding`` w.r.t. the weight: no padding row."""
    g = np.zeros((num_rows, ct.shape[-1]))
    np.add.at(g, ids.reshape(-1), ct.reshape(-1, ct.shape[-1]))
    if padding_idx is not None:
        g[padding_idx] = 0
    return g


def test_the_numbers_pytorch_prints():
    # F.embedding(ids, w, padding_idx=3, max_norm=1.0), loss sum(out * [1..5]).
    w = jnp.array([[3.0, 4.0], [0.3, 0.4], [6.0, 8.0], [1.0, 0.0]])
    ids = jnp.array([0, 2, 2, 3, 1])
    out = js.embedding_lookup(w, ids, padding_id=3, max_norm=1.0)
    torch_out = [[0.6, 0.8], [0.6, 0.8], [0.6, 0.8], [1.0, 0.0], [0.3, 0.4]]
    np.testing.assert_allclose(out, torch_out, rtol=1e-6)
    torch_w = [[0.6, 0.8], [0.3, 0.4], [0.6, 0.8], [1.0, 0.0]]  # weight after
    np.testing.assert_allclose(js.apply_max_norm(w, ids, 1.0), torch_w, rtol=1e-6)
    scale = jnp.arange(1.0, 6.0)[:, None]

    def loss(w):
        return jnp.sum(js.embedding_lookup(w, ids, padding_id=3, max_norm=1.0) * scale)

    torch_grad = [[1.0, 1.0], [5.0, 5.0], [5.0, 5.0], [0.0, 0.0]]
    g = js.grad(loss)(w)
    np.testing.assert_allclose(g.to_dense(), torch_grad)
    assert int(g.indices[3]) == 4  # the padding slot is padding: touches no row
    np.testing.assert_allclose(jax.grad(loss)(w), torch_grad)  # plain JAX too
    # EmbeddingBag(mode="mean", padding_idx=1, max_norm=1.0) on
    # input [0, 1, 2, 1], offsets [0, 2]: the padding row is renormalised in
    # the weight too, and left out of the bags.
    wb = jnp.array([[3.0, 4.0], [3.0, 4.0], [6.0, 8.0], [1.0, 0.0]])
    bags = js.JaggedIds.from_lengths(jnp.array([0, 1, 2, 1]), jnp.array([2, 2]))
    out = js.embedding_bag(wb, bags, padding_id=1, max_norm=1.0)
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.6, 0.8]], rtol=1e-6)
    torch_wb = [[0.6, 0.8], [0.6, 0.8], [0.6, 0.8], [1.0, 0.0]]
    np.testing.assert_allclose(js.apply_max_norm(wb, bags, 1.0), torch_wb, rtol=1e-6)


CONFIGS = [  # (padding_idx, max_norm, norm_type): every norm, with and without
    (None, None, 2.0),
    (0, 0.7, 1.0),
    (4, 1.6, 2.0),
    (4, 0.7, 3.0),
    (0, 0.7, math.inf),
]


@pytest.mark.parametrize(("padding_idx", "max_norm", "norm_type"), CONFIGS)
@settings(max_examples=2)
@given(seed=st.integers(0, 2**16))
def test_training_steps_equal_pytorch(seed, padding_idx, max_norm, norm_type):
    """Three SGD steps with decay on the touched rows: renorm, lookup, grad, update."""
    rng = np.random.default_rng(seed)
    w0 = rng.normal(size=(V, D))
    head0 = rng.normal(size=D)
    batches = [rng.integers(0, 5, (4, 3)) for _ in range(3)]  # repeats, padding
    ys = [rng.normal(size=4) for _ in range(3)]
    lr, wd = 0.1, 0.05

    # NumPy model of PyTorch (float64).
    w, head = w0.copy(), head0.copy()
    for ids, y in zip(batches, ys, strict=True):
        if max_norm is not None:
            torch_renorm_(w, ids, max_norm, norm_type)
        rows = w[ids]  # (B, L, D); the padding row is read as it is
        h = rows.mean(1)
        err = h @ head - y
        d_h = (2 * err / len(y))[:, None] * head
        g_w = torch_lookup_grad(ids, np.repeat(d_h[:, None] / 3, 3, 1), V, padding_idx)
        g_head = h.T @ (2 * err / len(y))
        touched = np.unique(ids)
        touched = touched[touched != padding_idx]
        w[touched] -= lr * (g_w[touched] + wd * w[touched])
        head -= lr * (g_head + wd * head)  # dense: decayed everywhere

    # jaxslices: the same step, functionally, jitted (one compilation per
    # example, whatever the number of steps).
    step = _step(padding_idx, max_norm, norm_type, lr, wd)
    tx = _tx(lr, wd)
    params = {
        "w": jnp.asarray(w0, jnp.float32),
        "head": jnp.asarray(head0, jnp.float32),
    }
    # (the padding row is not zero here: it is read as it is, never trained)
    state = tx.init(params)
    for ids, y in zip(batches, ys, strict=True):
        params, state = step(params, state, ids.astype(np.int32), y.astype(np.float32))
    np.testing.assert_allclose(params["w"], w, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(params["head"], head, rtol=2e-5, atol=2e-6)


def _tx(lr, wd):
    return optax.chain(js.add_decayed_weights(wd), js.sgd(lr))


def _step(padding_idx, max_norm, norm_type, lr, wd):
    kw = dict(padding_id=padding_idx, max_norm=max_norm, norm_type=norm_type)
    tx = _tx(lr, wd)

    def loss(params, ids, y):
        h = js.embedding_lookup(params["w"], ids, **kw).mean(1)
        return jnp.mean((h @ params["head"] - y) ** 2)

    @jax.jit
    def step(params, state, ids, y):
        _, grads = js.value_and_grad(loss)(params, ids, y)
        assert isinstance(grads["w"], js.IndexedSlices)
        if max_norm is not None:  # PyTorch's in-place renormalisation
            w = js.apply_max_norm(params["w"], ids, max_norm, norm_type=norm_type)
            params = {**params, "w": w}
        updates, state = tx.update(grads, state, params)
        return js.apply_updates(params, updates), state

    return step
