"""No table-sized temporary in a donated training step, whatever the loss does.

A full step is ``js.value_and_grad`` + an update (``js.sgd`` and
``js.apply_updates``, or a hand-written ``js.scatter_add``) under
``jax.jit(..., donate_argnums=0)``. XLA's compiled temporary bytes must be the
same for two table sizes: a table-sized copy would grow with ``V``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxslices as js

B, L, D, S = 32, 4, 8, 6  # batch, bag length, row width, sampled classes
SMALL, LARGE = 2**12, 2**15


def _linear(p, ids, y):  # the gradient does not depend on the rows
    return jnp.mean(js.embedding_lookup(p["emb"], ids) @ p["w"])


def _mse(p, ids, y):
    h = js.embedding_bag(p["emb"], ids, combiner="mean")
    return jnp.mean((h @ p["w"] - y) ** 2)


def _sampled_softmax(p, ids, y):
    h = js.embedding_lookup(p["emb"], ids).mean(1)  # (B, D)
    out = js.embedding_lookup(p["out"], ids[:, :1] + jnp.arange(S))  # (B, S, D)
    logits = jnp.einsum("bd,bsd->bs", h, out)
    return -jnp.mean(jax.nn.log_softmax(logits)[:, 0])


def _unused_rows(p, ids, y):  # looked up, but the rows do not reach the output
    js.embedding_lookup(p["emb"], ids)
    return jnp.sum(p["w"] ** 2)


def _several_tables(p, ids, y):
    u = js.embedding_lookup(p["emb"], ids[:, 0])
    i = js.embedding_lookup(p["out"], ids[:, 1:]).sum(1)
    lin = js.embedding_lookup(p["emb"], ids[:, 2]) @ p["w"]  # linear part
    return jnp.mean(jnp.sum(u * i, -1) - y) ** 2 + jnp.mean(lin)


LOSSES = [_linear, _mse, _sampled_softmax, _unused_rows, _several_tables]


def _scatter_step(loss, lr=0.1):
    def step(params, ids, y):
        g = js.grad(loss)(params, ids, y)
        return {
            k: js.scatter_add(v, -lr * g[k])
            if isinstance(g[k], js.IndexedSlices)
            else v - lr * g[k]
            for k, v in params.items()
        }

    return step


def _optax_step(loss):
    tx = js.sgd(0.1)

    def step(params, ids, y):
        _, g = js.value_and_grad(loss)(params, ids, y)
        updates, _ = tx.update(g, tx.init(params), params)
        return js.apply_updates(params, updates)

    return step


def _params(num_rows, abstract=True):
    shapes = {"emb": (num_rows, D), "out": (num_rows, D), "w": (D,)}
    if abstract:
        return {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    rng = np.random.default_rng(0)
    return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}


def _temp_bytes(step, num_rows):
    ids = jax.ShapeDtypeStruct((B, L), jnp.int32)
    y = jax.ShapeDtypeStruct((B,), jnp.float32)
    compiled = jax.jit(step, donate_argnums=0).lower(_params(num_rows), ids, y)
    return compiled.compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("make_step", [_scatter_step, _optax_step])
@pytest.mark.parametrize("loss", LOSSES, ids=lambda f: f.__name__)
def test_temp_bytes_do_not_grow_with_the_table(loss, make_step):
    step = make_step(loss)
    small, large = _temp_bytes(step, SMALL), _temp_bytes(step, LARGE)
    assert small == large, (small, large)
    assert large < SMALL * D * 4  # smaller than even the small table


@pytest.mark.parametrize("loss", LOSSES, ids=lambda f: f.__name__)
def test_the_steps_are_right(loss):
    """The steps measured above equal dense SGD (so the check is of real steps)."""
    params = _params(64, abstract=False)
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, 64 - S, size=(B, L)), jnp.int32)
    y = jnp.asarray(rng.normal(size=B), jnp.float32)
    dense = optax.sgd(0.1)
    g = jax.grad(loss)(params, ids, y)
    want = optax.apply_updates(params, dense.update(g, dense.init(params))[0])
    for make_step in (_scatter_step, _optax_step):
        got = jax.jit(make_step(loss))(params, ids, y)
        for k in params:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_dense_steps_do_grow_so_the_check_can_fail():
    def step(params, ids, y):
        g = jax.grad(_linear)(params, ids, y)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g)

    assert _temp_bytes(step, LARGE) > _temp_bytes(step, SMALL) + (LARGE - SMALL) * D
