"""Row-major optimizer state: one packed array per parameter, one gather/scatter.

Lazy Adam's two moments and FTRL's ``n`` and ``z`` live side by side per row
(``(V, 2, *row)``); the maths is checked against NumPy and Optax in
``test_transforms.py`` (through the ``mu``/``nu``/``accumulator``/``linear``
views). Here: the layout, the single gather and scatter, ``mu_dtype``, and
checkpoints of the old separate layout.
"""

from __future__ import annotations

import pickle
import re
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import random_slices, tol

import jaxslices as js
from jaxslices import IndexedSlices

V, D = 9, 3


def params():
    rng = np.random.default_rng(0)
    return {
        "emb": jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(D,)), jnp.float32),
        "b": jnp.float32(0.5),
    }


PACKED = {
    "lazy_adam": (lambda: js.lazy_adam(0.1), lambda s: s[0], "mu_nu", ("mu", "nu")),
    "ftrl": (lambda: js.ftrl(0.1), lambda s: s, "n_z", ("accumulator", "linear")),
}


@pytest.mark.parametrize("name", list(PACKED))
def test_states_of_a_row_are_side_by_side(name):
    make, get, field, views = PACKED[name]
    state = get(make().init(params()))
    packed = getattr(state, field)
    assert packed["emb"].shape == (V, 2, D)
    assert packed["w"].shape == (D, 2)
    assert packed["b"].shape == (2,)
    for i, view in enumerate(views):
        got = getattr(state, view)
        np.testing.assert_array_equal(got["emb"], packed["emb"][:, i])
        np.testing.assert_array_equal(got["w"], packed["w"][:, i])
        np.testing.assert_array_equal(got["b"], packed["b"][i])


@pytest.mark.usefixtures("xla_path")  # XLA's structure; native: test_kernels
@pytest.mark.parametrize("name", list(PACKED))
def test_one_gather_and_one_scatter_serve_all_of_a_rows_state(name):
    make, *_ = PACKED[name]
    tx = make()
    p = {"emb": params()["emb"]}
    g = {"emb": random_slices(np.random.default_rng(1), num_rows=V, row_shape=(D,))}
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    hlo = step.lower(g, tx.init(p), p).compiler_ir("hlo").as_hlo_text()

    def ops(op, shape):  # HLO ops of `op` whose result has `shape` (rows: \d+)
        return len(re.findall(rf"= f32\[{shape}\]\S* {op}\(", hlo))

    # The packed (V, 2, D) state is read and written as (V, 2 * D) rows
    # (inside the row-wise op's reference: read in the HLO).
    assert ops("gather", rf"\d+,{2 * D}") == 1, hlo
    assert ops("scatter", f"{V},{2 * D}") == 1, hlo
    # The test can fail: the separate layout had two of each on (V, D); FTRL
    # also reads the parameters' rows.
    assert ops("gather", rf"\d+,{D}") == (1 if name == "ftrl" else 0), hlo
    assert ops("scatter", f"{V},{D}") == 0, hlo


def test_mu_dtype_keeps_each_moment_in_its_dtype():
    # bf16 table, float32 first moment: the packed array is float32, the
    # second moment is still rounded to bf16 at every step.
    rng = np.random.default_rng(2)
    p = {"emb": jnp.asarray(rng.normal(size=(V, D)), jnp.bfloat16)}
    tx = js.lazy_adam(0.05, mu_dtype=jnp.float32)
    state = tx.init(p)
    assert state[0].mu_nu["emb"].dtype == jnp.float32
    # Every row touched once per step, no duplicates: lazy Adam is Adam.
    ids = jnp.arange(V)
    grads = [
        IndexedSlices(jnp.asarray(rng.normal(size=(V, D)), jnp.bfloat16), ids, (V, D))
        for _ in range(3)
    ]
    ref = optax.adam(0.05, mu_dtype=jnp.float32)
    ref_p, ref_s = p, ref.init(p)
    step = jax.jit(lambda p, s, g: tx.update({"emb": g}, s, p))
    for g in grads:
        u, state = step(p, state, g)
        p = js.apply_updates(p, u)
        ru, ref_s = ref.update({"emb": g.to_dense()}, ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, ru)
    nu = np.asarray(state[0].nu["emb"])
    np.testing.assert_array_equal(nu, nu.astype(jnp.bfloat16).astype(np.float32))
    np.testing.assert_allclose(
        np.asarray(p["emb"], np.float32),
        np.asarray(ref_p["emb"], np.float32),
        **tol(jnp.bfloat16),
    )
    np.testing.assert_allclose(
        state[0].mu["emb"], ref_s[0].mu["emb"], rtol=1e-2, atol=1e-3
    )


# ------------------------------------------- checkpoints of the old layout


class _OldAdam(NamedTuple):  # the fields the separate layout had
    count: Any
    mu: Any
    nu: Any


class _OldFtrl(NamedTuple):
    count: Any
    accumulator: Any
    linear: Any


def _old_pickle(state: Any) -> bytes:
    """Bytes as the old code pickled its states: the old fields, the same class.

    The stand-in classes are put where the real ones live while pickling,
    so the stream names ``ScaleByLazyAdamState`` / ``FtrlState``, as an old
    checkpoint does.
    """
    pairs = [(_OldAdam, js.ScaleByLazyAdamState), (_OldFtrl, js.FtrlState)]
    saved = [(old.__module__, old.__qualname__) for old, _ in pairs]
    try:
        for old, new in pairs:
            old.__module__, old.__qualname__ = new.__module__, new.__qualname__
            setattr(sys.modules[new.__module__], new.__qualname__, old)
        return pickle.dumps(state)
    finally:
        for (old, new), (mod, qual) in zip(pairs, saved, strict=True):
            setattr(sys.modules[new.__module__], new.__qualname__, new)
            old.__module__, old.__qualname__ = mod, qual


def _old_states(p):
    rng = np.random.default_rng(3)
    r = lambda: jax.tree.map(  # noqa: E731
        lambda x: jnp.asarray(rng.normal(size=np.shape(x)), jnp.float32), p
    )
    mu, nu, n, z = r(), r(), r(), r()
    adam = (_OldAdam(jnp.int32(4), mu, nu), optax.EmptyState())
    return adam, _OldFtrl(jnp.int32(4), n, z), (mu, nu, n, z)


def _check_new(adam, ftrl, ref):
    mu, nu, n, z = ref
    assert isinstance(adam[0], js.ScaleByLazyAdamState)
    assert isinstance(ftrl, js.FtrlState)
    for got, want in [
        (adam[0].mu, mu),
        (adam[0].nu, nu),
        (ftrl.accumulator, n),
        (ftrl.linear, z),
    ]:
        jax.tree.map(np.testing.assert_array_equal, got, want)
    assert int(adam[0].count) == int(ftrl.count) == 4


def test_pickles_of_the_old_layout_load_as_the_new_one():
    p = params()
    adam, ftrl, ref = _old_states(p)
    data = _old_pickle((adam, ftrl))
    assert b"ScaleByLazyAdamState" in data and b"_OldAdam" not in data
    new_adam, new_ftrl = pickle.loads(data)
    _check_new(new_adam, new_ftrl, ref)
    # ... and the loaded state trains on.
    tx = js.lazy_adam(0.1)
    g = jax.tree.map(jnp.ones_like, p)
    _, after = tx.update(g, new_adam, p)
    assert after[0].mu_nu["emb"].shape == (V, 2, D)
    with pytest.raises(TypeError, match=r"takes \(count, mu_nu\), got 4 fields"):
        js.ScaleByLazyAdamState(1, 2, 3, 4)


def test_msgpack_checkpoints_of_the_old_layout_upgrade():
    serialization = pytest.importorskip("flax.serialization")
    p = params()
    adam, ftrl, ref = _old_states(p)
    data = serialization.to_bytes((adam, ftrl))
    targets = (js.lazy_adam(0.1).init(p), js.ftrl(0.1).init(p))
    with pytest.raises(ValueError, match="field names"):
        serialization.from_bytes(targets, data)  # Flax refuses the old fields
    new_adam, new_ftrl = js.upgrade_state(serialization.msgpack_restore(data), targets)
    _check_new(new_adam, new_ftrl, ref)
    # A checkpoint of the new layout comes back unchanged.
    same = js.upgrade_state(
        serialization.msgpack_restore(serialization.to_bytes(targets)), targets
    )
    jax.tree.map(np.testing.assert_array_equal, same, targets)


def test_upgrade_state_names_a_missing_or_reshaped_leaf():
    p = params()
    target = js.lazy_adam(0.1).init(p)
    old = {"0": {"count": 1, "mu": p, "nu": {**p, "w": jnp.zeros(D + 1)}}, "1": {}}
    with pytest.raises(ValueError, match=r"0/mu/w, 0/nu/w have shapes \(3,\) and"):
        js.upgrade_state(old, target)
    old = {"0": {"count": 1, "mu_nu": {**target[0].mu_nu, "w": jnp.zeros(2)}}}
    with pytest.raises(ValueError, match=r"leaf \[0\]\.mu_nu\['w'\] has shape"):
        js.upgrade_state(old, target)
    with pytest.raises(ValueError, match="no leaf at 0/mu_nu/b"):
        js.upgrade_state({"0": {"count": 1, "mu": {}, "nu": {}}, "1": {}}, target)


def test_a_low_precision_state_saved_before_its_step_count_upgrades():
    """A constant learning rate's state on bf16 params is a step counter
    now, empty before: the checkpoint without it upgrades, the count at 0."""
    serialization = pytest.importorskip("flax.serialization")
    p = {"t": jnp.full((4, 2), 0.5, jnp.bfloat16)}
    tx = js.adagrad(0.1)
    g = {"t": js.IndexedSlices(jnp.ones((1, 2), jnp.bfloat16), jnp.array([1]), (4, 2))}
    _, state = tx.update(g, tx.init(p), p)
    saved = serialization.to_state_dict(state)
    assert set(saved["1"]) == {"count"}  # what the counter adds
    old = {**saved, "1": {}}  # the same state saved when it was empty
    got = js.upgrade_state(old, tx.init(p))
    assert int(got[1].count) == 0
    jax.tree.map(np.testing.assert_array_equal, got[0], state[0])
    # A counter the checkpoint holds is taken as it is.
    assert int(js.upgrade_state(saved, tx.init(p))[1].count) == 1
