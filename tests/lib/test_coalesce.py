"""coalesce(s, method=...): every method against NumPy, flags, coalesce once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import dense_reference
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxslices as js
from jaxslices import IndexedSlices
from jaxslices._coalesce import (
    _by_id_sort,
    _by_pair_sort,
    _segment_sum_by_scan,
    _segment_sum_by_scatter,
)

METHODS = ["sort", "pair_sort", "hash", "auto"]
SORTED = {"sort", "pair_sort"}


def zipf_slices(rng, num_rows=30, n=200, row_shape=(3,), dtype=jnp.float32):
    idx = np.r_[rng.zipf(1.3, size=n - 4) % num_rows, [num_rows, num_rows, -1, 99]]
    rng.shuffle(idx)
    vals = rng.normal(size=(n, *row_shape)).astype(np.float32)
    vals[idx == num_rows] = 0.0
    return IndexedSlices(
        jnp.asarray(vals, dtype), jnp.asarray(idx, jnp.int32), (num_rows, *row_shape)
    )


def check_coalesced(c, s, method, flags=True):
    """Unique valid ids first, padding after; same dense equivalent.

    ``flags``: check the static flags too (a jit output loses them).
    """
    idx, num_rows = np.asarray(c.indices), s.dense_shape[0]
    valid = idx < num_rows
    u = int(valid.sum())
    assert valid[:u].all() and not valid[u:].any(), "padding must be at the end"
    assert (idx[u:] == num_rows).all() and not np.asarray(c.values)[u:].any()
    assert len(np.unique(idx[:u])) == u
    want_ids = sorted({int(i) for i in np.asarray(s.indices) if 0 <= i < num_rows})
    if method in SORTED:
        np.testing.assert_array_equal(idx[:u], want_ids)
    else:
        np.testing.assert_array_equal(np.sort(idx[:u]), want_ids)
    np.testing.assert_allclose(
        np.asarray(c.to_dense(), np.float64), dense_reference(s), rtol=1e-5, atol=1e-5
    )
    if flags:
        assert c.unique_indices and c.indices_sorted == (method in SORTED)


# Under jit for every row shape; eagerly (op by op, where the static flags
# survive) once per method.
@pytest.mark.parametrize(
    "row_shape, use_jit", [((), True), ((3,), True), ((2, 2), True), ((3,), False)]
)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_matches_numpy(method, row_shape, use_jit):
    s = zipf_slices(np.random.default_rng(0), row_shape=row_shape)
    f = lambda s: js.coalesce(s, method=method)  # noqa: E731
    check_coalesced(jax.jit(f)(s) if use_jit else f(s), s, method, flags=not use_jit)


@settings(deadline=None, max_examples=15)
@given(
    # a fixed length (one compile per method): ids drawn, padding among them
    ids=st.lists(st.integers(-2, 9), min_size=24, max_size=24),
    method=st.sampled_from(METHODS),
)
def test_property_methods_match_numpy(ids, method):
    num_rows = 9  # 9 is padding, negatives invalid
    idx = np.asarray(ids, np.int32)
    vals = np.arange(1.0, len(ids) + 1, dtype=np.float32)[:, None] * [1.0, -2.0]
    vals[idx == num_rows] = 0.0
    s = IndexedSlices(jnp.asarray(vals, jnp.float32), jnp.asarray(idx), (num_rows, 2))
    c = jax.jit(lambda s: js.coalesce(s, method=method))(s)
    check_coalesced(c, s, method, flags=False)


def test_hash_keeps_first_appearance_order_and_is_deterministic():
    s = IndexedSlices(jnp.arange(6.0), jnp.array([5, 2, 5, 7, 2, 0]), (8,))
    c = js.coalesce(s, method="hash")
    np.testing.assert_array_equal(c.indices, [5, 2, 7, 0, 8, 8])
    np.testing.assert_array_equal(c.values, [2.0, 5.0, 3.0, 5.0, 0.0, 0.0])
    big = zipf_slices(np.random.default_rng(1), num_rows=1000, n=4096)
    f = jax.jit(lambda s: js.coalesce(s, method="hash"))
    first = f(big)
    for _ in range(3):
        again = f(big)
        np.testing.assert_array_equal(again.indices, first.indices)
        np.testing.assert_array_equal(again.values, first.values)


def test_hash_all_distinct_and_all_equal_ids():
    for idx in [np.arange(300)[::-1], np.full(300, 7)]:
        s = IndexedSlices(jnp.ones((300, 2)), jnp.asarray(idx, jnp.int32), (300, 2))
        check_coalesced(js.coalesce(s, method="hash"), s, "hash")


def test_bfloat16_duplicates_sum_in_float32():
    s = IndexedSlices(
        jnp.full((256,), 1.0, jnp.bfloat16), jnp.zeros(256, jnp.int32), (2,)
    )
    for method in METHODS:
        c = js.coalesce(s, method=method)
        assert c.dtype == jnp.bfloat16 and float(c.values[0]) == 256.0  # bf16: exact


def test_coalesce_of_coalesced_is_free_and_flags_survive_value_ops():
    s = zipf_slices(np.random.default_rng(2))
    assert not s.unique_indices and not s.indices_sorted
    c = js.coalesce(s)
    assert js.coalesce(c) is c and js.coalesce(c, method="hash") is c
    h = js.coalesce(s, method="hash")
    assert js.coalesce(h, method="auto") is h
    assert js.coalesce(h).indices_sorted  # "sort" promises sorted: re-sorts
    for out in [2 * c, c / 3, -c, c.astype(jnp.float16)]:
        assert out.unique_indices and out.indices_sorted
    # Flattening drops the flags (conservative: same tree structure as raw).
    leaves, treedef = jax.tree.flatten(c)
    assert not jax.tree.unflatten(treedef, leaves).unique_indices
    assert jax.tree.structure(c) == jax.tree.structure(s)


def test_unknown_method_is_refused_early():
    s = zipf_slices(np.random.default_rng(3))
    with pytest.raises(ValueError, match=r"unknown coalescing method 'fast'.*'hash'"):
        js.coalesce(s, method="fast")
    with pytest.raises(ValueError, match=r"jaxslices\.lazy_adam: unknown coalescing"):
        js.lazy_adam(0.1, coalesce_method="fast")


def _sorts_and_loops(tx, grads, params):
    text = jax.jit(tx.update).lower(grads, tx.init(params), params).as_text()
    return text.count("stablehlo.sort"), text.count("stablehlo.while")


@pytest.mark.usefixtures("xla_path")  # XLA's structure; native: test_kernels
@pytest.mark.parametrize("method", ["sort", "hash"])
def test_a_chain_coalesces_once_per_step(method):
    """clip_by_global_norm passes on what it coalesced; lazy Adam reuses it."""
    s = zipf_slices(np.random.default_rng(4))
    params = {"emb": jnp.zeros(s.dense_shape), "w": jnp.zeros(3)}
    grads = {"emb": s, "w": jnp.ones(3)}
    m = dict(coalesce_method=method)
    chains = [
        optax.chain(js.clip_by_global_norm(1.0, **m), js.lazy_adam(0.1, **m)),
        optax.chain(
            js.clip(1.0, **m), js.clip_by_row_norm(1.0, **m), js.sgd(0.1, 0.9, **m)
        ),
        js.lazy_adamw(0.1, **m),
        optax.chain(js.clip_by_global_norm(1.0, **m), js.rowwise_adagrad(0.1, **m)),
        optax.chain(js.add_decayed_weights(0.1, **m), js.ftrl(0.1, **m)),
    ]
    for tx in chains:
        sorts, loops = _sorts_and_loops(tx, grads, params)
        # One coalesce: "sort" on CPU is one sort + one searchsorted loop,
        # "hash" one while loop and no sort.
        assert (sorts, loops) == ((1, 1) if method == "sort" else (0, 1)), tx


@pytest.mark.usefixtures("xla_path")  # XLA's structure; native: test_kernels
def test_clip_sgd_default_method_on_cpu_is_the_hash():
    s = zipf_slices(np.random.default_rng(5))
    tx = optax.chain(js.clip_by_global_norm(1.0), js.sgd(0.1))
    params = jnp.zeros(s.dense_shape)
    sorts, loops = _sorts_and_loops(tx, s, params)
    if jax.default_backend() == "cpu":
        assert (sorts, loops) == (0, 1)
    else:
        assert sorts == 1


@pytest.mark.parametrize("method", METHODS)
def test_transforms_give_the_same_numbers_with_every_method(method):
    rng = np.random.default_rng(6)
    s = zipf_slices(rng)
    params = jnp.asarray(rng.normal(size=s.dense_shape), jnp.float32)
    tx = optax.chain(js.clip_by_global_norm(5.0, coalesce_method=method),
                     js.lazy_adamw(0.1, coalesce_method=method))  # fmt: skip
    ref = optax.chain(js.clip_by_global_norm(5.0, coalesce_method="sort"),
                      js.lazy_adamw(0.1, coalesce_method="sort"))  # fmt: skip
    u, _ = jax.jit(tx.update)(s, tx.init(params), params)
    want, _ = jax.jit(ref.update)(s, ref.init(params), params)
    np.testing.assert_allclose(u.to_dense(), want.to_dense(), rtol=1e-5, atol=1e-6)


# ------------------------------------------- the algorithms, on CPU as in CI


@pytest.mark.parametrize("row_shape", [(), (3,), (2, 2)])
def test_both_segment_sum_strategies_agree(row_shape):
    """The GPU strategy (fixed-tree scan) is tested on CPU too."""
    rng = np.random.default_rng(15)
    ids = np.sort(rng.integers(0, 40, size=300))
    segment = jnp.asarray(np.cumsum(np.r_[1, np.diff(ids) != 0]) - 1, jnp.int32)
    vals = jnp.asarray(rng.normal(size=(300, *row_shape)), jnp.float32)
    ref = np.zeros((300, *row_shape))
    np.add.at(ref, np.asarray(segment), np.asarray(vals, np.float64))
    by_scan = jax.jit(_segment_sum_by_scan, static_argnums=2)(vals, segment, 300)
    by_scatter = jax.jit(_segment_sum_by_scatter, static_argnums=2)(vals, segment, 300)
    np.testing.assert_allclose(by_scan, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(by_scatter, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("row_shape", [(), (3,)])
def test_cpu_and_gpu_sort_strategies_agree(row_shape):
    """CI has no GPU: run the GPU strategy on CPU against the CPU one."""
    rng = np.random.default_rng(16)
    idx = jnp.asarray(np.r_[rng.zipf(1.3, size=200) % 30, [30, 30]], jnp.int32)
    vals = jnp.asarray(rng.normal(size=(202, *row_shape)), jnp.float32)
    a_vals, a_idx, a_count = jax.jit(_by_id_sort, static_argnums=(2, 3))(
        vals, idx, 30, 202
    )
    b_vals, b_idx, b_count = jax.jit(_by_pair_sort, static_argnums=(2, 3))(
        vals, idx, 30, 202
    )
    np.testing.assert_array_equal(a_idx, b_idx)
    assert int(a_count) == int(b_count) == len(np.unique(np.asarray(idx))) - 1
    np.testing.assert_allclose(a_vals, b_vals, rtol=1e-5, atol=1e-5)
    u = len(np.unique(np.asarray(idx)))
    np.testing.assert_array_equal(a_idx[:u], np.unique(np.asarray(idx)))


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint32, jnp.int8, jnp.int16])
def test_integer_values_sum_as_integers(method, dtype, use_jit):
    """Issue 18: int32 values rounded through float32 (2**24 + 1 changed)."""
    big = 2**24 + 1 if jnp.dtype(dtype).itemsize == 4 else 100
    vals = jnp.asarray([big, 1, 5, big, 3], dtype)
    ids = jnp.asarray([1, 1, 0, 3, 9])  # repeats and an invalid id
    s = js.IndexedSlices(vals, ids, (4,))

    def fn(s):
        return js.coalesce(s, method=method)

    c = (jax.jit(fn) if use_jit else fn)(s)
    assert c.dtype == jnp.dtype(dtype)
    want = np.zeros(4, np.int64)
    for v, i in zip(np.asarray(vals, np.int64), np.asarray(ids), strict=True):
        if i < 4:
            want[i] += v
    np.testing.assert_array_equal(c.to_dense(), want.astype(np.dtype(dtype)))
    np.testing.assert_array_equal(c.to_dense(), s.to_dense())  # dense: a scatter
