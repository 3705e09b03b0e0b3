"""Low-precision tables: one float32 sum per row, rounded to nearest or stochastically.

The rounding itself (``jaxslices._rounding``) against a NumPy model of the
two neighbours, its unbiasedness (the mean of many rounded updates is the
float32 update, within a binomial bound), special values, and
``apply_updates`` on sparse leaves against the dense reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxslices as js
from jaxslices import _rounding

LOW = [jnp.bfloat16, jnp.float16]
NP_LOW = {jnp.bfloat16: ml_dtypes.bfloat16, jnp.float16: np.float16}


def _neighbours(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """The representable values below and above ``x`` (NumPy model; ties: x)."""
    nd = NP_LOW[dtype]
    near = x.astype(nd)
    nearf = near.astype(np.float32)
    step = np.where(nearf > x, -np.inf, np.inf).astype(nd)
    other = np.nextafter(near, step).astype(np.float32)
    lo = np.minimum(nearf, other)
    hi = np.maximum(nearf, other)
    exact = nearf == x
    return np.where(exact, x, lo), np.where(exact, x, hi)


def _round(x, dtype, rows=None, seed=0):
    x = jnp.asarray(x, jnp.float32)
    flat = x.reshape(x.shape[0], -1)
    rows = jnp.arange(x.shape[0]) if rows is None else rows
    seed = _rounding.seed_from(seed)
    out = _rounding.round_rows(flat, dtype, rows, stochastic=True, seed=seed)
    return np.asarray(out.astype(jnp.float32)).reshape(x.shape)


@pytest.mark.parametrize("dtype", LOW)
@settings(max_examples=20, deadline=None)
@given(
    data=st.lists(
        st.floats(-6e4, 6e4, width=32, allow_subnormal=True), min_size=1, max_size=64
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_result_is_one_of_the_two_neighbours(dtype, data, seed):
    x = np.asarray(data, np.float32)[:, None]
    out = _round(x, dtype, seed=seed)
    lo, hi = _neighbours(x, dtype)
    assert np.all((out == lo) | (out == hi)), (x[(out != lo) & (out != hi)],)


@pytest.mark.parametrize("dtype", LOW)
def test_tiny_and_subnormal_values_round_between_their_neighbours(dtype):
    fi = jnp.finfo(dtype)
    tiny = float(fi.smallest_subnormal) if hasattr(fi, "smallest_subnormal") else 0.0
    x = np.array([[tiny * 0.3], [tiny * 1.7], [-tiny * 0.5], [float(fi.tiny) * 1.1]])
    out = _round(np.repeat(x, 512, axis=1), dtype)
    lo, hi = _neighbours(np.repeat(x, 512, axis=1).astype(np.float32), dtype)
    assert np.all((out == lo) | (out == hi))
    # each row's mean within 5 sigma of its value
    p = (x[:, 0] - lo[:, 0]) / (hi[:, 0] - lo[:, 0])
    sigma = (hi[:, 0] - lo[:, 0]) * np.sqrt(p * (1 - p) / 512)
    assert np.all(np.abs(out.mean(axis=1) - x[:, 0]) <= 5 * sigma + 1e-45)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("frac", [0.01, 0.3, 0.5, 0.93])
def test_the_mean_of_many_rounded_updates_is_the_float32_update(dtype, frac):
    """4096 x 16 entries of one weight, each given ``frac`` of an ulp: the
    mean lands on the float32 result within 5 binomial standard deviations;
    round to nearest moves none (``frac <= 0.5``) or all of them."""
    w = 1.5
    ulp = float(jnp.finfo(dtype).eps) * 1.0  # ulp of values in [1, 2)
    V, D = 4096, 16
    params = {"t": jnp.full((V, D), w, dtype)}
    upd = js.IndexedSlices(jnp.full((V, D), frac * ulp), jnp.arange(V), (V, D))
    step = jax.jit(js.apply_updates, static_argnames="stochastic_rounding")
    got = np.asarray(step(params, {"t": upd})["t"].astype(jnp.float32))
    n = V * D
    sigma = ulp * np.sqrt(frac * (1 - frac) / n)
    assert abs(got.mean() - (w + frac * ulp)) <= 5 * sigma
    assert set(np.unique(got)) <= {w, w + ulp}
    nearest = step(params, {"t": upd}, stochastic_rounding=False)["t"]
    # a tie (0.5) goes to the even neighbour, 1.5
    assert float(nearest.astype(jnp.float32).mean()) == (w if frac <= 0.5 else w + ulp)


@pytest.mark.parametrize("dtype", LOW)
def test_repeated_steps_on_one_row_track_the_float32_sum(dtype):
    """One row, 400 steps of a tenth of an ulp, the step as ``key``: the row
    moves by about 40 ulps (round to nearest: not at all)."""
    ulp = float(jnp.finfo(dtype).eps)
    upd = js.IndexedSlices(jnp.full((1, 8), 0.1 * ulp), jnp.array([0]), (2, 8))

    @functools.partial(jax.jit, static_argnums=1)
    def run(p, sr):
        def body(i, p):
            return js.apply_updates(p, {"t": upd}, stochastic_rounding=sr, key=i)

        return jax.lax.fori_loop(0, 400, body, p)

    p = {"t": jnp.ones((2, 8), dtype)}
    moved = (np.asarray(run(p, True)["t"].astype(jnp.float32)) - 1.0) / ulp
    assert np.all(moved[1] == 0)  # untouched row
    # 400 draws of p = 0.1 per entry: mean 40, sd 6; 8 entries
    assert abs(moved[0].mean() - 40) < 5 * 6 / np.sqrt(8)
    stuck = run(p, False)["t"].astype(jnp.float32)
    assert np.all(np.asarray(stuck) == 1.0)


@pytest.mark.parametrize("dtype", LOW)
def test_special_values(dtype):
    big = float(jnp.finfo(dtype).max)
    x = np.array(
        [[np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, big * 1.0001, -big * 1.0001]],
        np.float32,
    )
    out = _round(np.repeat(x, 64, axis=0), dtype)
    assert np.all(np.isnan(out[:, 0]))
    assert np.all(out[:, 1] == np.inf) and np.all(out[:, 2] == -np.inf)
    assert np.all(out[:, 3] == 0) and np.all(np.signbit(out[:, 4]))
    assert np.all(out[:, 5] == 1.0)
    assert np.all(out[:, 6] == big) and np.all(out[:, 7] == -big)  # never to inf


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("row_shape", [(), (3,), (2, 3)])
def test_sparse_apply_equals_the_dense_reference(dtype, row_shape):
    """Repeated ids, padding and out-of-range ids: the sparse apply (one
    float32 sum per row, rounded once) equals the dense apply of the dense
    update with the same rounding, bitwise (updates are multiples of 2**-20,
    so every float32 sum is exact in any order)."""
    V, N = 12, 40
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(V, *row_shape)), dtype)
    vals = jnp.asarray(rng.integers(-300, 300, (N, *row_shape)) * 2.0**-20)
    ids = rng.integers(0, V, N)
    ids[::7] = V  # padding
    ids[3] = -2  # invalid: dropped
    s = js.IndexedSlices(vals, jnp.asarray(ids, jnp.int32), (V, *row_shape))
    dense = s.to_dense()
    for sr in (True, False):
        step = jax.jit(lambda p, u, sr=sr: js.apply_updates(p, u, stochastic_rounding=sr, key=7))
        sparse = step({"t": table}, {"t": s})["t"]
        ref = step({"t": table}, {"t": dense})["t"]
        np.testing.assert_array_equal(np.asarray(sparse), np.asarray(ref))
        assert sparse.dtype == dtype
    # rows no id touched stay bitwise what they were
    untouched = np.setdiff1d(np.arange(V), ids)
    np.testing.assert_array_equal(np.asarray(sparse)[untouched], np.asarray(table)[untouched])


def test_nearest_rounds_the_float32_sum_once():
    """300 duplicates of 1 on a bf16 zero: 300 (one float32 sum, one rounding
    to 300, which bf16 holds), where rounding each duplicate would stop at 256."""
    s = js.IndexedSlices(jnp.ones((300, 1)), jnp.zeros(300, jnp.int32), (2, 1))
    out = js.apply_updates({"t": jnp.zeros((2, 1), jnp.bfloat16)}, {"t": s})
    assert float(out["t"][0, 0]) == 300.0


def test_key_seeds_the_draws():
    ulp = float(jnp.finfo(jnp.bfloat16).eps)
    s = js.IndexedSlices(jnp.full((64, 8), 0.5 * ulp), jnp.arange(64), (64, 8))
    p = {"t": jnp.ones((64, 8), jnp.bfloat16)}
    a = js.apply_updates(p, {"t": s}, key=1)["t"]
    b = js.apply_updates(p, {"t": s}, key=1)["t"]
    c = js.apply_updates(p, {"t": s}, key=jax.random.key(2))["t"]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))


def test_float32_tables_are_unaffected():
    s = js.IndexedSlices(jnp.full((3, 2), 1e-9), jnp.array([0, 0, 1]), (4, 2))
    p = {"t": jnp.ones((4, 2))}
    a = js.apply_updates(p, {"t": s})["t"]
    b = js.apply_updates(p, {"t": s}, stochastic_rounding=True, key=3)["t"]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_settings_say_what_was_given():
    p = {"t": jnp.ones((4, 2), jnp.bfloat16)}
    u = {"t": jnp.zeros((4, 2))}
    with pytest.raises(TypeError, match=r"`stochastic_rounding` must be None, True or False; got 'yes'"):
        js.apply_updates(p, u, stochastic_rounding="yes")
    with pytest.raises(TypeError, match=r"`key` must be an integer.*dtype float32"):
        js.apply_updates(p, u, key=1.5)
