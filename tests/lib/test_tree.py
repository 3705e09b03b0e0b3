"""Sparse-aware tree operations against their dense references."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FLOAT_DTYPES, dense_reference, random_slices, tol
from jax.sharding import Mesh, PartitionSpec

import jaxslices as js
from jaxslices import IndexedSlices


def grad_tree(seed, dtype=jnp.float32, n=10, num_rows=8):
    rng = np.random.default_rng(seed)
    return {
        "emb": random_slices(rng, num_rows=num_rows, n=n, dtype=dtype, padding=2),
        "w": jnp.asarray(rng.normal(size=(3, 2)), dtype),
        "none": None,
    }


def dense_of(tree):
    """NumPy float64 dense equivalent of every leaf."""

    def leaf(x):
        if isinstance(x, IndexedSlices):
            return dense_reference(x)
        return np.asarray(jnp.asarray(x, jnp.float32), np.float64)

    return jax.tree.map(leaf, tree, is_leaf=js.is_indexed_slices)


def assert_dense_close(tree, ref, dtype=jnp.float32):
    got = js.to_dense(tree)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, **tol(dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("use_jit", [False, True])
def test_tree_add_matches_dense_add(dtype, use_jit):
    trees = [grad_tree(s, dtype, n=4 + 3 * s) for s in range(3)]
    f = jax.jit(js.tree_add) if use_jit else js.tree_add
    out = f(*trees)
    assert isinstance(out["emb"], IndexedSlices) and out["none"] is None
    assert out["emb"].num_slices == 4 + 7 + 10  # concatenated
    assert out["w"].dtype == dtype and out["emb"].dtype == dtype
    refs = [dense_of(t) for t in trees]
    ref = jax.tree.map(lambda *x: sum(x), *refs)
    assert_dense_close(out, ref, dtype)


def test_tree_add_mixed_dense_and_slices_gives_dense():
    a = grad_tree(0)
    b = {**grad_tree(1), "emb": js.to_dense(grad_tree(1)["emb"])}
    out = js.tree_add(a, b)
    assert not isinstance(out["emb"], IndexedSlices)
    ref = jax.tree.map(lambda x, y: x + y, dense_of(a), dense_of(b))
    assert_dense_close(out, ref)


def test_tree_add_errors_name_the_leaf():
    a, b = grad_tree(0), grad_tree(1)
    del b["w"]
    with pytest.raises(ValueError, match=r"jaxslices\.tree_add.*\['w'\]"):
        js.tree_add(a, b)
    c = {**grad_tree(1), "emb": random_slices(np.random.default_rng(2), num_rows=9)}
    with pytest.raises(ValueError, match="same dense shape"):
        js.tree_add(a, c)
    with pytest.raises(ValueError, match="at least one tree"):
        js.tree_add()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scalar", [0.5, -1.0, 3])
def test_tree_scale_matches_dense_scale(dtype, scalar):
    t = grad_tree(3, dtype)
    out = jax.jit(js.tree_scale)(scalar, t)
    np.testing.assert_array_equal(out["emb"].indices, t["emb"].indices)
    assert out["emb"].dtype == dtype and out["w"].dtype == dtype
    ref = jax.tree.map(lambda x: scalar * x, dense_of(t))
    assert_dense_close(out, ref, dtype)
    with pytest.raises(ValueError, match="must be a scalar"):
        js.tree_scale(jnp.ones(2), t)


def test_tree_map_values_keeps_indices():
    t = grad_tree(4)
    out = js.tree_map_values(lambda v: v.astype(jnp.bfloat16), t)
    assert out["emb"].dtype == jnp.bfloat16 and out["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(out["emb"].indices, t["emb"].indices)
    assert_dense_close(out, dense_of(t), jnp.bfloat16)


def test_global_norm_is_the_norm_for_logging():
    t = grad_tree(5)
    ref = np.sqrt(sum(np.sum(x**2) for x in jax.tree.leaves(dense_of(t))))
    np.testing.assert_allclose(js.global_norm(t), ref, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(js.global_norm)(t), ref, rtol=1e-5)


def stacked(trees):
    return jax.tree.map(lambda *x: jnp.stack(x), *trees)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("mean", [False, True])
def test_tree_psum_under_vmap_matches_dense_psum(dtype, mean):
    n = 3
    trees = [{k: v for k, v in grad_tree(s, dtype).items() if k != "none"}
             for s in range(n)]  # fmt: skip
    reduce = js.tree_pmean if mean else js.tree_psum

    def per_device(t):
        out = reduce(t, "data")
        return out, js.to_dense(out)

    out, dense = jax.jit(jax.vmap(per_device, axis_name="data"))(stacked(trees))
    assert out["emb"].values.shape[:2] == (n, n * 10)  # n devices x n*N slots
    refs = [dense_of(t) for t in trees]
    ref = jax.tree.map(lambda *x: sum(x) / (n if mean else 1), *refs)
    for d in range(n):
        for key in ("emb", "w"):
            np.testing.assert_allclose(
                np.asarray(dense[key][d], np.float32), ref[key], **tol(dtype)
            )
    # Indices are gathered, never summed: every device sees all devices' ids.
    all_ids = np.concatenate([np.asarray(t["emb"].indices) for t in trees])
    for d in range(n):
        np.testing.assert_array_equal(out["emb"].indices[d], all_ids)


def test_tree_psum_keeps_none_and_rejects_plain_psum():
    trees = [grad_tree(s) for s in range(2)]
    stacked_trees = stacked(trees)
    out = jax.vmap(lambda t: js.tree_psum(t, "d"), axis_name="d")(stacked_trees)
    assert out["none"] is None
    with pytest.raises(TypeError, match=r"IndexedSlices.*jaxslices\.tree_psum"):
        jax.vmap(lambda t: jax.lax.psum(t, "d"), axis_name="d")(stacked_trees)


def _shard_map():
    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map  # JAX < 0.6

    return shard_map


@pytest.mark.parametrize("mean", [False, True])
def test_tree_psum_under_shard_map(mean):
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("data",))
    trees = [{k: v for k, v in grad_tree(s).items() if k != "none"} for s in range(n)]
    batch = jax.tree.map(lambda *x: jnp.concatenate(x), *trees)  # shard by rows
    reduce = js.tree_pmean if mean else js.tree_psum

    def per_device(t):
        # Each device holds one tree: its slices, and its (3, 2) dense leaf.
        return js.to_dense(reduce(t, "data"))

    f = _shard_map()(
        per_device,
        mesh=mesh,
        in_specs=(PartitionSpec("data"),),
        out_specs=PartitionSpec(),
        **({"check_vma": False} if hasattr(jax, "shard_map") else {"check_rep": False}),
    )
    got = jax.jit(f)(batch)
    refs = [dense_of(t) for t in trees]
    ref = jax.tree.map(lambda *x: sum(x) / (n if mean else 1), *refs)
    for key in ("emb", "w"):
        np.testing.assert_allclose(np.asarray(got[key]), ref[key], rtol=1e-5, atol=1e-5)


def test_tree_psum_communicates_rows_not_tables():
    """The compiled reduction all-gathers slots; it never all-reduces (V, D)."""
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("data",))
    v, d, slots = 4096, 8, 16
    s = IndexedSlices(jnp.ones((n * slots, d)), jnp.zeros(n * slots, jnp.int32), (v, d))
    f = _shard_map()(
        functools.partial(js.tree_psum, axis_name="data"),
        mesh=mesh,
        in_specs=(PartitionSpec("data"),),
        out_specs=PartitionSpec(),
        **({"check_vma": False} if hasattr(jax, "shard_map") else {"check_rep": False}),
    )
    hlo = jax.jit(f).lower(s).compile().as_text()
    assert f"{v},{d}" not in hlo.replace(", ", ",")
    if n > 1:
        assert "all-gather" in hlo and "all-reduce" not in hlo
