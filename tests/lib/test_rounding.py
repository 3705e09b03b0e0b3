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


@functools.partial(jax.jit, static_argnums=1)
def _round_jit(x, dtype, seed):
    out = _rounding.round_to(x, dtype, stochastic=True, seed=_rounding.seed_from(seed))
    return out.astype(jnp.float32)


def _round(x, dtype, seed=0):
    """``x`` rounded stochastically (padded to 64 entries: one compilation)."""
    x = np.asarray(x, np.float32)
    n = x.size
    flat = np.zeros(max(64, n), np.float32)
    flat[:n] = x.ravel()
    return np.asarray(_round_jit(flat, dtype, seed))[:n].reshape(x.shape)


def _round_per_key(x, dtype, keys: int):
    """``x`` rounded with each of ``keys`` seeds: ``[keys, *x.shape]``."""
    x = jnp.asarray(x, jnp.float32)

    def one(k):
        seed = _rounding.seed_from(k)
        return _rounding.round_to(x, dtype, stochastic=True, seed=seed)

    out = jax.jit(jax.vmap(one))(jnp.arange(keys))
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("dtype", LOW)
@settings(max_examples=20, deadline=None)
@given(
    data=st.lists(
        st.floats(-6e4, 6e4, width=32, allow_subnormal=True), min_size=64, max_size=64
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_result_is_one_of_the_two_neighbours(dtype, data, seed):
    x = np.asarray(data, np.float32)
    out = _round(x, dtype, seed=seed)
    lo, hi = _neighbours(x, dtype)
    assert np.all((out == lo) | (out == hi)), (x[(out != lo) & (out != hi)],)


@pytest.mark.parametrize("dtype", LOW)
def test_tiny_and_subnormal_values_round_between_their_neighbours(dtype):
    fi = jnp.finfo(dtype)
    tiny = float(fi.smallest_subnormal) if hasattr(fi, "smallest_subnormal") else 0.0
    x = np.array(
        [tiny * 0.3, tiny * 1.7, -tiny * 0.5, float(fi.tiny) * 1.1], np.float32
    )
    out = _round_per_key(x, dtype, 2048)
    lo, hi = _neighbours(x, dtype)
    assert np.all((out == lo) | (out == hi))
    # each value's mean over the seeds within 5 sigma of it
    p = (x - lo) / (hi - lo)
    sigma = (hi - lo) * np.sqrt(p * (1 - p) / 2048)
    assert np.all(np.abs(out.mean(axis=0) - x) <= 5 * sigma + 1e-45)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("frac", [0.01, 0.3, 0.5, 0.93])
def test_the_mean_of_many_rounded_updates_is_the_float32_update(dtype, frac):
    """128 weights (a row of a sparse table) given ``frac`` of an ulp each,
    applied with 512 seeds: the mean moves by ``frac`` ulps within 5 binomial
    standard deviations; round to nearest moves none (``frac <= 0.5``, ties
    to even: the weights here are even) or all of them."""
    ulp = float(jnp.finfo(dtype).eps)  # ulp of values in [1, 2)
    w = 1.0 + 2 * ulp * np.arange(64)  # 64 distinct even weights in [1, 2)
    params = {"t": jnp.asarray(w[None, :], dtype)}
    upd = js.IndexedSlices(jnp.full((1, 64), frac * ulp), jnp.array([0]), (1, 64))

    def apply(k, sr=True):
        return js.apply_updates(params, {"t": upd}, stochastic_rounding=sr, key=k)["t"]

    got = np.asarray(jax.jit(jax.vmap(apply))(jnp.arange(512)).astype(jnp.float32))
    moved = (got - w) / ulp
    assert set(np.unique(moved)) <= {0.0, 1.0}
    sigma = np.sqrt(frac * (1 - frac) / moved.size)
    assert abs(moved.mean() - frac) <= 5 * sigma
    nearest = np.asarray(apply(0, sr=False).astype(jnp.float32))[0]
    np.testing.assert_array_equal(nearest, w if frac <= 0.5 else w + ulp)


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
    out = _round_per_key(x[0], dtype, 64)
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
        step = jax.jit(
            lambda p, u, sr=sr: js.apply_updates(p, u, stochastic_rounding=sr, key=7)
        )
        sparse = step({"t": table}, {"t": s})["t"]
        ref = step({"t": table}, {"t": dense})["t"]
        np.testing.assert_array_equal(np.asarray(sparse), np.asarray(ref))
        assert sparse.dtype == dtype
    # rows no id touched stay bitwise what they were
    untouched = np.setdiff1d(np.arange(V), ids)
    np.testing.assert_array_equal(
        np.asarray(sparse)[untouched], np.asarray(table)[untouched]
    )


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
    bad = r"`stochastic_rounding` must be None, True or False \(a Python.*got 'yes'"
    with pytest.raises(TypeError, match=bad):
        js.apply_updates(p, u, stochastic_rounding="yes")
    with pytest.raises(TypeError, match=r"`key` must be an integer.*dtype float32"):
        js.apply_updates(p, u, key=1.5)


# ------------------------------------------------- optimizer state


def _distinct_values(dtype, n_binades=16):
    """2048 (bf16) distinct positive values over 16 binades, and their ulps."""
    mant = int(jnp.finfo(dtype).nmant)
    j = np.arange(2 ** min(mant, 7))
    k = np.arange(-8, -8 + n_binades)
    base = (2.0 ** k[:, None]) * (1 + j[None, :] / 2 ** min(mant, 7))
    ulp = (2.0 ** k[:, None]) * 2.0**-mant * np.ones_like(base)
    return base.ravel().astype(np.float32), ulp.ravel().astype(np.float32)


@pytest.mark.parametrize("dtype", LOW)
def test_a_low_precision_trace_is_rounded_stochastically(dtype):
    """Momentum 1 on a bf16/f16 trace of 2048 distinct values, each given 0.2
    of its ulp: the trace rows move by 0.2 ulp on average (one draw per
    distinct value); rounded to nearest they do not move."""
    t0, ulp = _distinct_values(dtype)
    n = t0.size
    params = jnp.zeros((n, 1), dtype)
    g = js.IndexedSlices(jnp.asarray(0.2 * ulp)[:, None], jnp.arange(n), (n, 1))
    for sr, expect in ((None, 0.2), (False, 0.0)):
        tx = js.trace(1.0, stochastic_rounding=sr)
        state = js.TraceState(trace=jnp.asarray(t0[:, None], dtype))
        _, new = jax.jit(tx.update)(g, state, params)
        moved = (np.asarray(new.trace.astype(jnp.float32))[:, 0] - t0) / ulp
        assert set(np.unique(moved)) <= {0.0, 1.0}
        assert abs(moved.mean() - expect) <= 5 * np.sqrt(0.16 / n)


@pytest.mark.parametrize("dtype", LOW)
def test_sparse_adagrad_state_equals_dense_with_stochastic_rounding(dtype):
    """Adagrad's bf16/f16 accumulator, rounded stochastically, sparse vs
    dense on the dense gradient: the same bits (the noise reads the same
    row and column on both; gradients are multiples of 2**-8, so float32 sums are
    exact), over three steps with repeated ids and padding."""
    V, D = 16, 4
    rng = np.random.default_rng(1)
    params = {"t": jnp.asarray(rng.normal(size=(V, D)), dtype)}
    tx = js.adagrad(0.1, stochastic_rounding=True)
    s_state = d_state = tx.init(params)
    for _ in range(3):
        ids = rng.integers(0, V + 1, 24)  # V: padding
        vals = jnp.asarray(rng.integers(-64, 64, (24, D)) * 2.0**-8)
        g = js.IndexedSlices(vals, jnp.asarray(ids, jnp.int32), (V, D))
        su, s_state = jax.jit(tx.update)({"t": g}, s_state, params)
        du, d_state = jax.jit(tx.update)({"t": g.to_dense()}, d_state, params)
        np.testing.assert_array_equal(
            np.asarray(s_state[0].sum_of_squares["t"]),
            np.asarray(d_state[0].sum_of_squares["t"]),
        )
        # the float32 updates (not rounded): Optax's arithmetic, to float
        # rounding (JAX 0.12 fuses the sparse and dense rsqrt differently)
        np.testing.assert_allclose(
            np.asarray(su["t"].to_dense()), np.asarray(du["t"]), rtol=1e-6, atol=0
        )
        assert s_state[0].sum_of_squares["t"].dtype == dtype


OPTIMIZERS = {
    "sgd_momentum": lambda sr: js.sgd(0.05, momentum=0.9, stochastic_rounding=sr),
    "adagrad": lambda sr: js.adagrad(0.05, stochastic_rounding=sr),
    "rowwise_adagrad": lambda sr: js.rowwise_adagrad(0.05, stochastic_rounding=sr),
    "lazy_adam": lambda sr: js.lazy_adam(1e-3, stochastic_rounding=sr),
    "lazy_adamw": lambda sr: js.lazy_adamw(1e-3, stochastic_rounding=sr),
    "ftrl": lambda sr: js.ftrl(0.05, stochastic_rounding=sr),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_trains_a_bf16_table_like_float32(name):
    """A bf16 table and bf16 state, rounded stochastically: 20 steps of a
    least-squares embedding problem end within bf16 resolution of the
    float32 run of the same optimizer, state dtypes kept (two optimizers
    also with round to nearest)."""
    V, D, N = 32, 8, 64
    rng = np.random.default_rng(2)
    target = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
    batches = [jnp.asarray(rng.integers(0, V, N), jnp.int32) for _ in range(20)]

    def loss(table, ids):
        rows = js.embedding_lookup(table, ids, dtype=jnp.float32)
        return jnp.mean((rows - target[ids]) ** 2)

    def run(dtype, sr):
        params = {"t": jnp.zeros((V, D), dtype)}
        tx = OPTIMIZERS[name](sr)
        state = tx.init(params)

        @jax.jit
        def step(params, state, ids, k):
            g = js.grad(lambda p: loss(p["t"], ids))(params)
            u, state = tx.update(g, state, params)
            return js.apply_updates(params, u, stochastic_rounding=sr, key=k), state

        for k, ids in enumerate(batches):
            params, state = step(params, state, ids, k)
        return params["t"].astype(jnp.float32), state

    ref, _ = run(jnp.float32, None)
    for sr in (None, False) if name in ("adagrad", "lazy_adam") else (None,):
        got, state = run(jnp.bfloat16, sr)
        assert got.dtype == jnp.float32
        err = float(jnp.max(jnp.abs(got - ref)))
        assert err < 0.1, (sr, err)
        lows = [x for x in jax.tree.leaves(state) if x.ndim >= 2]
        assert (
            lows
            and all(x.dtype == jnp.bfloat16 for x in lows)
            or name in ("rowwise_adagrad",)
        )


def test_bad_switch_on_an_optimizer_names_it():
    with pytest.raises(TypeError, match=r"jaxslices.adagrad: `stochastic_rounding`"):
        js.adagrad(0.1, stochastic_rounding="yes")


# ------------------------------------------- collections and checkpoints


def _bf16_model():
    coll = js.EmbeddingCollection(
        [
            js.TableConfig("a", rows=30, dim=4, dtype=jnp.bfloat16),
            js.TableConfig("b", rows=50, dim=4, dtype=jnp.bfloat16),
        ]
    )
    tx = js.adagrad(0.05)  # bf16 accumulators, rounded stochastically

    def loss(emb, ids):
        return jnp.sum(jnp.tanh(coll.concat(emb, ids).astype(jnp.float32)) ** 2)

    @jax.jit
    def step(emb, state, ids, k):
        g = js.grad(loss)(emb, ids)
        u, state = tx.update(g, state, emb)
        return js.apply_updates(emb, u, key=k), state

    def batch(k):
        rng = np.random.default_rng(k)
        return {f: rng.integers(-1, 60, (6, 3)).astype(np.int32) for f in "ab"}

    return coll, tx, step, batch


def test_a_collection_rounds_like_its_tables_alone():
    """Two bf16 tables stacked in one buffer: rounded to nearest, each
    table's rows are bitwise those of the table trained alone (gradients are
    multiples of 2**-8, so float32 sums agree in any order); rounded
    stochastically, within one ulp of them (the noise reads the row of the
    array written: a buffer row draws other bits than the table's row)."""
    coll, _, _, _ = _bf16_model()
    emb = coll.init(jax.random.key(0))
    tables = coll.unstack(emb)
    rng = np.random.default_rng(3)
    vals = {t: jnp.asarray(rng.integers(-32, 32, (10, 4)) * 2.0**-8) for t in "ab"}
    ids = {t: jnp.asarray(rng.integers(0, 30, 10), jnp.int32) for t in "ab"}
    buf = next(iter(emb))
    offs = {name: start for start, _, name in coll.buffers[0].segments}
    stacked = js.IndexedSlices(
        jnp.concatenate([vals["a"], vals["b"]]),
        jnp.concatenate([ids["a"] + offs["a"], ids["b"] + offs["b"]]),
        emb[buf].shape,
    )
    for sr in (False, True):
        tx = js.adagrad(0.05, stochastic_rounding=sr)
        u, _ = tx.update({buf: stacked}, tx.init(emb), emb)
        together = coll.unstack(js.apply_updates(emb, u, stochastic_rounding=sr))
        for t in "ab":
            g = js.IndexedSlices(vals[t], ids[t], tables[t].shape)
            ut, _ = tx.update({t: g}, tx.init({t: tables[t]}), {t: tables[t]})
            alone = js.apply_updates({t: tables[t]}, ut, stochastic_rounding=sr)[t]
            assert alone.dtype == jnp.bfloat16
            a, b = np.asarray(together[t], np.float32), np.asarray(alone, np.float32)
            if not sr:
                np.testing.assert_array_equal(a, b)
            else:
                ulp = np.abs(b) * 2.0**-7 + 2.0**-133
                assert np.all(np.abs(a - b) <= ulp), t


def test_a_bf16_run_checkpoints_and_resumes_bitwise(tmp_path):
    """bf16 tables and accumulators, rounded stochastically with the step as
    key: saved with Orbax after 2 steps, restored (dtypes kept) and resumed,
    bitwise the uninterrupted 4 steps."""
    ocp = pytest.importorskip("orbax.checkpoint")
    coll, tx, step, batch = _bf16_model()
    emb = coll.init(jax.random.key(1))
    state = tx.init(emb)
    for k in range(2):
        emb, state = step(emb, state, batch(k), k)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"emb": emb, "opt": state})
    ckptr.wait_until_finished()
    abstract = jax.eval_shape(lambda: {"emb": emb, "opt": state})
    restored = ckptr.restore(tmp_path / "ckpt", abstract)
    ckptr.close()
    for k in range(2, 4):
        emb, state = step(emb, state, batch(k), k)
    r_emb, r_state = restored["emb"], restored["opt"]
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(r_emb))
    for k in range(2, 4):
        r_emb, r_state = step(r_emb, r_state, batch(k), k)
    pairs = zip(
        jax.tree.leaves((emb, state)), jax.tree.leaves((r_emb, r_state)), strict=True
    )
    for a, b in pairs:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.dtype == b.dtype
