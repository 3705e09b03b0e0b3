"""apply_updates: scatter-add for slices, + for arrays, in place under donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import FLOAT_DTYPES, ROW_SHAPES, dense_reference, random_slices, tol
from hypothesis import given
from hypothesis import strategies as st

import jaxslices as js
from jaxslices import IndexedSlices

JIT = [False, True]


def maybe_jit(f, use_jit):
    return jax.jit(f) if use_jit else f


@pytest.mark.parametrize("use_jit", JIT)
@pytest.mark.parametrize("row_shape", ROW_SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_sparse_and_dense_leaves(dtype, row_shape, use_jit):
    rng = np.random.default_rng(0)
    s = random_slices(rng, num_rows=7, n=12, row_shape=row_shape, dtype=dtype)
    params = {
        "emb": jnp.asarray(rng.normal(size=(7, *row_shape)), dtype),
        "w": jnp.asarray(rng.normal(size=(3,)), dtype),
    }
    dw = jnp.asarray(rng.normal(size=(3,)), dtype)
    out = maybe_jit(js.apply_updates, use_jit)(params, {"emb": s, "w": dw})
    assert out["emb"].dtype == dtype and out["w"].dtype == dtype
    want = np.asarray(params["emb"], np.float64) + dense_reference(s)
    np.testing.assert_allclose(np.asarray(out["emb"], np.float32), want, **tol(dtype))
    np.testing.assert_array_equal(out["w"], optax.apply_updates(params["w"], dw))


def test_padding_and_invalid_indices_write_nothing():
    params = jnp.zeros((4, 2))
    s = IndexedSlices(jnp.ones((4, 2)), jnp.array([4, -1, 9, 2]), (4, 2))
    out = js.apply_updates(params, s)
    np.testing.assert_array_equal(out, [[0, 0], [0, 0], [1, 1], [0, 0]])


def test_result_keeps_parameter_dtype():
    params = {"emb": jnp.zeros((3, 2), jnp.bfloat16), "w": jnp.zeros(2, jnp.bfloat16)}
    upd = {
        "emb": IndexedSlices(jnp.ones((1, 2), jnp.float32), jnp.array([1]), (3, 2)),
        "w": jnp.ones(2, jnp.float32),
    }
    out = js.apply_updates(params, upd)
    assert out["emb"].dtype == jnp.bfloat16 and out["w"].dtype == jnp.bfloat16


def test_none_leaves():
    params = {"a": None, "b": jnp.ones(2), "c": jnp.ones(2)}
    out = js.apply_updates(params, {"a": None, "b": None, "c": jnp.ones(2)})
    assert out["a"] is None
    np.testing.assert_array_equal(out["b"], [1.0, 1.0])
    np.testing.assert_array_equal(out["c"], [2.0, 2.0])


def test_optax_apply_updates_works_with_slices():
    rng = np.random.default_rng(1)
    params = {"emb": jnp.zeros((7, 3)), "w": jnp.ones(3)}
    grads = {"emb": random_slices(rng), "w": jnp.ones(3)}
    tx = optax.chain(js.clip_by_global_norm(1.0), js.sgd(0.1))
    updates, _ = tx.update(grads, tx.init(params), params)
    ours = js.apply_updates(params, updates)
    theirs = optax.apply_updates(params, updates)
    # Same scatter-add; on GPU its duplicate ids sum in no fixed order.
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_in_place_under_donation():
    def temp_bytes(num_rows):
        params = {"emb": jax.ShapeDtypeStruct((num_rows, 32), jnp.float32)}
        upd = {
            "emb": IndexedSlices(
                jax.ShapeDtypeStruct((128, 32), jnp.float32),
                jax.ShapeDtypeStruct((128,), jnp.int32),
                (num_rows, 32),
            )
        }
        step = jax.jit(js.apply_updates, donate_argnums=0)
        compiled = step.lower(params, upd).compile()
        mem = compiled.memory_analysis()
        # The table's buffer is reused for the output (aliased), not copied.
        assert mem.alias_size_in_bytes >= num_rows * 32 * 4
        return mem.temp_size_in_bytes

    small, large = temp_bytes(1_000), temp_bytes(20_000)
    assert large <= small + 1024, (small, large)  # no (V, D) temporary

    params = {"emb": jnp.zeros((5, 2))}
    s = IndexedSlices(jnp.ones((2, 2)), jnp.array([3, 3]), (5, 2))
    old = params["emb"]
    out = jax.jit(js.apply_updates, donate_argnums=0)(params, {"emb": s})
    assert old.is_deleted()
    np.testing.assert_array_equal(out["emb"][3], [2.0, 2.0])


@given(
    # one shape (empty batches: tests/lib/test_empty_batches.py)
    ids=st.lists(st.integers(-3, 8), min_size=16, max_size=16),
    seed=st.integers(0, 999),
)
def test_property_equals_dense_reference(ids, seed):
    rng = np.random.default_rng(seed)
    num_rows = 6
    idx = np.asarray(ids, np.int32).reshape(-1)
    vals = rng.normal(size=(idx.shape[0], 2)).astype(np.float32)
    s = IndexedSlices(jnp.asarray(vals), jnp.asarray(idx), (num_rows, 2))
    params = jnp.asarray(rng.normal(size=(num_rows, 2)), jnp.float32)
    out = js.apply_updates({"t": params}, {"t": s})["t"]
    want = np.asarray(params, np.float64) + dense_reference(s)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------- errors


def test_shape_mismatch_names_the_leaf():
    params = {"layer": {"emb": jnp.zeros((4, 2))}, "w": jnp.zeros(3)}
    bad = IndexedSlices(jnp.ones((1, 2)), jnp.array([0]), (5, 2))
    with pytest.raises(
        ValueError,
        match=r"jaxslices\.apply_updates \(leaf \['layer'\]\['emb'\]\): the parameter "
        r"has shape \(4, 2\) but the IndexedSlices update has dense shape \(5, 2\)",
    ):
        js.apply_updates(params, {"layer": {"emb": bad}, "w": jnp.zeros(3)})
    with pytest.raises(
        ValueError,
        match=r"\(leaf \['w'\]\): the parameter has shape \(3,\) but the update has "
        r"shape \(1,\)",
    ):
        js.apply_updates(
            params, {"layer": {"emb": jnp.zeros((4, 2))}, "w": jnp.zeros(1)}
        )


def test_tree_mismatch_names_the_leaf():
    params = {"emb": jnp.zeros((4, 2)), "w": jnp.zeros(3)}
    with pytest.raises(
        ValueError,
        match=r"jaxslices\.apply_updates: `params` and `updates` must have the same "
        r"tree structure; leaf \['w'\] is in `params` but not in `updates`",
    ):
        js.apply_updates(params, {"emb": jnp.zeros((4, 2))})
    with pytest.raises(
        ValueError, match=r"leaf \['x'\] is in `updates` but not in `params`"
    ):
        js.apply_updates(params, {**params, "x": jnp.zeros(1)})


def test_float_indices_are_refused_with_the_hint():
    s = IndexedSlices(jnp.ones((2, 2)), jnp.array([0, 1]), (3, 2))
    # What optax.scale did to plain indices (typed indices now make it raise).
    corrupted = jax.tree.unflatten(
        jax.tree.structure(s), [0.5 * s.values, 0.5 * s.indices]
    )
    with pytest.raises(
        TypeError,
        match=r"jaxslices\.apply_updates \(leaf \['emb'\]\): `indices` must have an "
        r"integer dtype, got float32\[2\]. .*optax\.scale",
    ):
        jax.jit(js.apply_updates)({"emb": jnp.zeros((3, 2))}, {"emb": corrupted})


@pytest.mark.parametrize("use_jit", JIT)
def test_numpy_and_list_params_and_updates(use_jit):
    """What JAX accepts as params: NumPy arrays, Python lists and floats."""
    rng = np.random.default_rng(7)
    s = random_slices(rng, num_rows=7, n=12, row_shape=(3,))
    table = rng.normal(size=(7, 3)).astype(np.float32)
    params = {"emb": table, "bias": [0.5, -1.0], "scale": 2.0}
    updates = {"emb": s, "bias": [np.float32(1.0), 2.0], "scale": np.ones(())}
    out = maybe_jit(js.apply_updates, use_jit)(params, updates)
    np.testing.assert_allclose(out["emb"], table + dense_reference(s), rtol=1e-6)
    assert isinstance(out["bias"], list)
    np.testing.assert_allclose(np.stack(out["bias"]), [1.5, 1.0])
    np.testing.assert_allclose(out["scale"], 3.0)
