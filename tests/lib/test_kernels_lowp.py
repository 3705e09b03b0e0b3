"""bfloat16 and float16 tables on the native path: the same numbers as XLA.

The kernels read a low-precision table's rows in float32 and write each
touched row back rounded once (``csrc/common.h``): to nearest, or
stochastically with the hash of :mod:`jaxslices._rounding`. The XLA path
(:func:`jaxslices.kernels.disabled`) is the reference:

* the rounding itself (every 16-bit pattern of a table, totals of every
  magnitude, inf and NaN) and the apply (duplicates summed in float32 in
  slot order, padding, ids out of range, an empty batch, int32 and int64
  ids) are **bitwise** equal;
* the forward bag of every form and whole optimizer steps are bitwise equal
  on dyadic values (every float32 sum exact on both paths); on random values
  each entry is within a few units in the last place (ulp) of the table's
  dtype: both paths compute one float32 result per entry and round it once,
  but sum in other orders (and the XLA path's bags round their backward in
  the table's dtype), and the stochastic rounding hashes the float32 total,
  so a last-bit difference there draws another rounding
  (``test_random_steps_match_xla_to_a_few_ulps``); plain SGD on sum bags and
  a bf16 Adagrad accumulator are bitwise;
* the kernels' results do not depend on the thread count (1, 2, 4 threads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import needs_kernels

import jaxslices as js
from jaxslices._recipe import PooledGradient
from jaxslices.kernels import _ops

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU-only kernels"),
    needs_kernels,  # the fallbacks: tests/lib/test_kernels_build.py
]

LOW = [jnp.bfloat16, jnp.float16]
THREADS = (1, 2, 4)


def _bits(x) -> np.ndarray:
    """The 16-bit patterns of a low-precision array, NaNs made one pattern."""
    x = np.asarray(x)
    bits = x.view(np.uint16).astype(np.int32)
    return np.where(np.isnan(x.astype(np.float32)), -1, bits)


def _assert_bitwise(a, b, what: str) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, what
        if x.dtype.itemsize == 2:
            diff = _bits(x) != _bits(y)
        else:  # float32 state: bit patterns, NaN == NaN
            f = x.astype(np.float32)
            g = y.astype(np.float32)
            diff = (f.view(np.int32) != g.view(np.int32)) & ~(np.isnan(f) & np.isnan(g))
        assert not diff.any(), f"{what}: {int(diff.sum())} entries differ"


def _ulps(a, b) -> np.ndarray:
    """Per entry: the distance in units in the last place of two low-precision
    arrays (NaN must match NaN)."""
    a, b = np.asarray(a), np.asarray(b)
    nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    np.testing.assert_array_equal(nan_a, nan_b)

    def ordered(x):
        bits = x.view(np.uint16).astype(np.int64)
        mag = bits & 0x7FFF
        return np.where(bits & 0x8000, -mag, mag)

    return np.where(nan_a, 0, np.abs(ordered(a) - ordered(b)))


def _both_paths(fn, *args):
    """``jax.jit(fn)(*args)`` natively and on the XLA path."""
    native = jax.jit(fn)(*args)
    with js.kernels.disabled():
        xla = jax.jit(fn)(*args)
    return native, xla


def _every_pattern(dtype) -> jax.Array:
    """A ``[4096, 16]`` table holding each of the 65536 bit patterns once."""
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(4096, 16)
    return jnp.asarray(bits.view(jnp.dtype(dtype)))


# ------------------------------------------------------------- rounding


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("stochastic", [False, True])
def test_rounding_is_bitwise_xlas_on_every_pattern_and_any_total(dtype, stochastic):
    """Every 16-bit pattern read (subnormals, inf, NaN) plus float32 updates of
    every magnitude (so the totals cover ties, subnormals of both formats,
    overflow past the largest finite value), rounded to nearest or
    stochastically: the kernel writes the bits XLA writes."""
    rng = np.random.default_rng(0)
    table = _every_pattern(dtype)
    n = table.shape[0]
    ids = jnp.asarray(rng.permutation(n), jnp.int32)
    scales = 2.0 ** rng.integers(-40, 20, size=(n, 1))
    values = rng.normal(size=(n, 16)) * scales
    values[::7] = 0.0  # the table's own values, rounded again
    values[1::97, 3] = np.inf
    values[2::89, 5] = np.nan
    values[3::53] = 65504.0 + 8.0 * rng.integers(0, 4, size=(1, 16))  # ties at the top
    values = jnp.asarray(values, jnp.float32)

    def apply(t, seed):
        return _ops.apply(
            t, PooledGradient.of_rows(values), ids, sum_duplicates=True,
            stochastic=stochastic, seed=seed,
        )  # fmt: skip

    for seed in (0, 12345):
        native, xla = _both_paths(apply, table, jnp.uint32(seed))
        _assert_bitwise(native, xla, f"{jnp.dtype(dtype).name} seed {seed}")
    # The rounding was exercised: some totals rounded up, some down.
    assert (_bits(native) != _bits(table)).mean() > 0.3


@pytest.mark.parametrize("dtype", LOW)
def test_stochastic_rounding_on_the_native_path_is_unbiased(dtype):
    """A tenth of an ulp added to 1024 distinct entries, with 4 seeds (the
    noise hashes the seed, the entry and its value): about a tenth round up."""
    mant = int(jnp.finfo(dtype).nmant)
    j = np.arange(128)
    w = (2.0 ** np.arange(-4, 4)[:, None] * (1 + j / 128)).ravel()
    ulp = 2.0 ** np.floor(np.log2(w)) * 2.0**-mant
    table = jnp.asarray(w.reshape(64, 16), dtype)
    ids = jnp.arange(64, dtype=jnp.int32)
    values = jnp.asarray((0.1 * ulp).reshape(64, 16), jnp.float32)
    apply = jax.jit(
        lambda t, s: _ops.apply(
            t, PooledGradient.of_rows(values), ids, sum_duplicates=True,
            stochastic=True, seed=s,
        )
    )  # fmt: skip
    outs = [apply(table, jnp.uint32(s)) for s in range(4)]
    up = np.mean([np.asarray(o.astype(jnp.float32)).ravel() > w for o in outs])
    # Binomial(4096, 0.1): sd 0.0047; 5 sd either side.
    assert abs(up - 0.1) < 0.024, up
    nearest = jax.jit(
        lambda t: _ops.apply(
            t, PooledGradient.of_rows(values), ids, sum_duplicates=True
        )
    )(table)
    np.testing.assert_array_equal(np.asarray(nearest, np.float32).ravel(), w)


# ---------------------------------------------------------------- apply


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("id_dtype", [jnp.int32, jnp.int64])
def test_apply_updates_is_bitwise_xlas(dtype, id_dtype):
    """Repeated ids (summed in float32 first), padding, ids out of range, NaN
    and inf in the table and the updates, coalesced or not, stochastic or
    to nearest, an empty batch: jaxslices.apply_updates on both paths."""
    if id_dtype == jnp.int64 and not jax.config.jax_enable_x64:
        pytest.skip("int64 ids need jax_enable_x64")
    rng = np.random.default_rng(1)
    v, d, n = 300, 8, 700
    table = rng.normal(size=(v, d))
    table[5, 2], table[6, 3], table[7] = np.nan, np.inf, -np.inf
    table = jnp.asarray(table, dtype)
    ids = (rng.zipf(1.2, size=n) - 1) % v
    ids[::17] = v  # padding
    ids[5::23] = -3  # out of range
    ids[9::31] = v + 40
    ids[:6] = [5, 6, 7, 5, 6, 7]
    values = rng.normal(size=(n, d)) * 1e-2
    values[11, 1], values[12, 4] = np.nan, -np.inf
    values = jnp.asarray(values, jnp.float32)
    s = js.IndexedSlices(values, jnp.asarray(ids, id_dtype), (v, d))
    c = s.coalesce()
    empty = js.IndexedSlices(jnp.zeros((0, d)), jnp.zeros((0,), id_dtype), (v, d))
    for sr in (True, False):

        def step(t, u, key, sr=sr):
            return js.apply_updates(t, u, stochastic_rounding=sr, key=key)

        for u in (empty, c, s):
            native, xla = _both_paths(step, table, u, 7)
            _assert_bitwise(native, xla, f"sr={sr} {u}")
    # Not a no-op: the touched rows changed, the others are as they were.
    touched = np.unique(ids[(ids >= 0) & (ids < v)])
    rest = np.setdiff1d(np.arange(v), touched)
    _assert_bitwise(native[rest], table[rest], "untouched rows")
    assert (_bits(native[touched]) != _bits(table[touched])).any()
    _assert_bitwise(jax.jit(step)(table, empty, 7), table, "empty batch")


def _all_native(fn, *args) -> bool:
    """Whether explain reports every operation of ``fn`` native."""
    decisions = js.kernels.explain(fn, *args).decisions
    return bool(decisions) and all(d.native for d in decisions)


def test_apply_explains_the_native_path_and_the_state_that_is_not():
    table = jnp.ones((50, 4), jnp.bfloat16)
    ids = jnp.array([[1, 2], [2, 3]])

    def loss(t):
        return jnp.sum(js.embedding_bag(t, ids) ** 2)

    def step(t, s, tx):
        u, s = tx.update(js.grad(loss)(t), s, t)
        return js.apply_updates(t, u), s

    tx = js.rowwise_adagrad(0.1)
    fn = lambda t, s: step(t, s, tx)  # noqa: E731
    decisions = js.kernels.explain(fn, table, tx.init(table)).decisions
    assert [d.native for d in decisions] == [True] * 3, decisions
    # Low-precision optimizer state stays on the XLA path, and says why.
    tx = js.adagrad(0.1)
    state = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tx.init(table))
    text = str(js.kernels.explain(lambda t, s: step(t, s, tx), table, state))
    assert "a bfloat16 array where the kernels take float32" in text, text
    assert "apply_updates (leaf <root>): native" in text, text


# ----------------------------------------------------------- forward bag


def _bag_cases(rng, v, bags, length):
    ids = rng.integers(-1, v + 2, size=(bags, length))  # invalid ids too
    weights = jnp.asarray(rng.choice([0.5, 1.0, 2.0, -1.0], size=(bags, length)))
    lengths = rng.integers(0, 6, size=bags)
    jagged = js.JaggedIds.from_lengths(
        rng.integers(-1, v + 1, size=int(lengths.sum())), lengths
    )
    ids = jnp.asarray(ids, jnp.int32)
    return {
        "sum_weights": lambda t: js.embedding_bag(t, ids, weights=weights),
        "mean_padding": lambda t: js.embedding_bag(
            t, ids, combiner="mean", padding_id=v
        ),
        "sqrtn": lambda t: js.embedding_bag(t, ids, combiner="sqrtn"),
        "jagged_mean": lambda t: js.embedding_bag(t, jagged, combiner="mean"),
        "jagged_sum": lambda t: js.embedding_bag(t, jagged, combiner="sum"),
    }


@pytest.mark.parametrize("dtype", LOW)
def test_every_bag_form_matches_xla(dtype):
    """Dyadic rows and weights (every partial sum exact): bitwise. Random rows:
    the kernel is within one ulp of float32 pooling rounded once, and of the
    XLA path for padded bags (which rounds each weighted row, the sum and
    the scaled sum to the table's dtype). Jagged bags: the XLA path sums in
    the table's dtype (measured: up to 11 bfloat16 / 128 float16 ulps off
    float32 pooling where a bag's rows cancel); the kernel pools in float32."""
    rng = np.random.default_rng(2)
    v, d = 60, 16
    # Every partial sum exact in 8 significant bits (XLA may sum in the
    # table's dtype, in its own order).
    dyadic = jnp.asarray(rng.integers(-7, 8, size=(v, d)) / 8.0, dtype)
    noisy = jnp.asarray(rng.normal(size=(v, d)), dtype)
    for name, bag in _bag_cases(rng, v, 40, 4).items():
        native, xla = _both_paths(bag, dyadic)
        assert native.dtype == xla.dtype == jnp.dtype(dtype)
        _assert_bitwise(native, xla, name)
        assert _all_native(bag, dyadic), name
        native, xla = _both_paths(bag, noisy)
        with js.kernels.disabled():
            pooled = jax.jit(bag)(noisy.astype(jnp.float32)).astype(dtype)
        assert _ulps(native, pooled).max() <= 1, name
        if not name.startswith("jagged"):
            assert _ulps(native, xla).max() <= 1, name


# ------------------------------------------------------ optimizer steps


def _optimizers() -> dict:
    adagrad = js.adagrad(0.25)
    return {
        "sgd": js.sgd(0.25),
        "sgd_momentum": js.sgd(0.25, 0.5),
        "adagrad": adagrad,
        "rowwise_adagrad": js.rowwise_adagrad(0.25),
        "lazy_adam": js.lazy_adam(0.25),
        "lazy_adamw": js.lazy_adamw(0.25, weight_decay=0.5),
        "ftrl": js.ftrl(0.25, l1=0.01, l2=0.01, l2_shrinkage=0.01, beta=0.1),
        "decay_adagrad": optax.chain(js.add_decayed_weights(0.5), adagrad),
        "clip_by_global_norm": optax.chain(js.clip_by_global_norm(4.0), js.sgd(0.25)),
        "clip_by_row_norm": optax.chain(js.clip_by_row_norm(2.0), js.sgd(0.25)),
        "clip": optax.chain(js.clip(0.5), js.rowwise_adagrad(0.25)),
        "clip_sgd": optax.chain(js.clip(0.5), js.sgd(0.25)),
    }


def _problem(rng, dtype, *, dyadic: bool, v=80, d=8, bags=24, length=4):
    if dyadic:
        table = jnp.asarray(rng.integers(-15, 16, size=(v, d)) / 4.0, dtype)
        target = jnp.asarray(rng.integers(-3, 4, size=(bags, d)) / 2.0, jnp.float32)
    else:
        table = jnp.asarray(rng.normal(size=(v, d)), dtype)
        target = jnp.asarray(rng.normal(size=(bags, d)), jnp.float32)
    ids = jnp.asarray((rng.zipf(1.3, size=(bags, length)) - 1) % (v + 1), jnp.int32)
    ids = ids.at[0, 0].set(-2)  # out of range: reads zeros, no gradient

    def loss(t):
        h = js.embedding_bag(t, ids, combiner="sum", padding_id=v)
        return jnp.sum(h.astype(jnp.float32) * target)  # gradient: target (dyadic)

    return table, loss


def _step(tx, loss):
    def step(t, s, key):
        u, s = tx.update(js.grad(loss)(t), s, t)
        return js.apply_updates(t, u, key=key), s

    return step


def _float32_state(tx, table):
    """The optimizer's state in float32 (low-precision state: XLA path)."""
    return jax.tree.map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        tx.init(table),
    )


def _run(step, table, state, steps=3):
    jitted = jax.jit(step)
    for k in range(steps):
        table, state = jitted(table, state, k)
    return table, state


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", ["sgd", "sgd_momentum", "clip_sgd"])
def test_dyadic_steps_are_bitwise_xlas(dtype, name):
    """Three steps on dyadic data (every float32 sum exact on both paths, so
    each rounding draws the same noise): bitwise, state included; explain
    reports every operation native."""
    tx = _optimizers()[name]
    table, loss = _problem(np.random.default_rng(3), dtype, dyadic=True)
    step = _step(tx, loss)
    state = _float32_state(tx, table)
    native = _run(step, table, state)
    with js.kernels.disabled():
        xla = _run(step, table, state)
    _assert_bitwise(native, xla, name)
    assert (_bits(native[0]) != _bits(table)).any()
    assert _all_native(step, table, state, 0)


def _ulp(x, dtype) -> np.ndarray:
    """The spacing of ``dtype`` at ``|x|`` (float32 array)."""
    info = jnp.finfo(dtype)
    x = np.maximum(np.abs(x), float(info.tiny))
    return np.exp2(np.floor(np.log2(x))) * float(info.eps)


@pytest.mark.parametrize("dtype", LOW)
def test_random_steps_match_xla_to_a_few_ulps(dtype):
    """Every optimizer, one step on random values, every operation native (no
    dtype fallback). Plain SGD: bitwise (both paths sum the update in
    float32 and round once). The other rules: both paths compute them in
    float32 and round once, but the float32 totals differ in their last
    bits (sums in another order; the XLA bags' backward in the table's
    dtype) and the stochastic rounding (a hash of the total) draws again:
    none by more than 4 ulps of the larger of the old entry and the
    results. Lazy Adam on float16 is left out of the bound: dividing by the
    root of the second moment amplifies a last-bit difference of small
    gradients. The float32 state agrees to float rounding. float16: a
    subset (the same code; CI time)."""
    rng = np.random.default_rng(4)
    table, loss = _problem(rng, dtype, dyadic=False)
    old = np.asarray(table, np.float32)
    subset = ("sgd", "adagrad", "rowwise_adagrad", "ftrl", "clip")
    for name, tx in _optimizers().items():
        if dtype == jnp.float16 and name not in subset:
            continue
        step = _step(tx, loss)
        state = _float32_state(tx, table)
        assert _all_native(step, table, state, 0), name
        native = _run(step, table, state, steps=1)
        with js.kernels.disabled():
            xla = _run(step, table, state, steps=1)
        if name == "sgd":
            _assert_bitwise(native, xla, name)
            continue
        if "adam" in name and dtype == jnp.float16:
            continue
        a, b = np.asarray(native[0], np.float32), np.asarray(xla[0], np.float32)
        big = np.maximum(np.maximum(np.abs(old), np.abs(a)), np.abs(b))
        bad = np.abs(a - b) > 4 * _ulp(big, dtype)
        assert not bad.any(), f"{name}: {a[bad]} vs {b[bad]} (was {old[bad]})"
        for x, y in zip(
            jax.tree.leaves(native[1]), jax.tree.leaves(xla[1]), strict=True
        ):
            np.testing.assert_allclose(
                np.asarray(x, np.float32), np.asarray(y, np.float32),
                rtol=2e-2, atol=1e-3, err_msg=name,
            )  # fmt: skip


# -------------------------------------------------------------- threads


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_steps_are_bitwise_the_same_on_1_2_and_4_threads(dtype):
    rng = np.random.default_rng(5)
    table, loss = _problem(rng, dtype, dyadic=False, v=400, bags=64, length=8)
    for name in ("sgd", "rowwise_adagrad", "ftrl"):
        tx = _optimizers()[name]
        step = _step(tx, loss)
        state = _float32_state(tx, table)
        runs = []
        for t in THREADS:
            with js.kernels.threads(t, min_slots=0):
                runs.append(_run(step, table, state, steps=2))
        for t, r in zip(THREADS[1:], runs[1:], strict=True):
            _assert_bitwise(runs[0], r, f"{name}: 1 thread vs {t}")


# ------------------------------------------- one rounding, per-entry noise


def _sgd_on_ones(steps: int):
    """A 512 x 16 bf16 table of ones, each row updated by -1e-4 per step
    (js.sgd(1e-4) on a sum bag whose ids cover each row once), no key."""
    tx = js.sgd(1e-4)
    ids = jnp.arange(512, dtype=jnp.int32).reshape(512, 1)

    def loss(p):
        return jnp.sum(js.embedding_bag(p["t"], ids, combiner="sum"), dtype=jnp.float32)

    def run(p):
        def body(_, carry):
            p, s = carry
            u, s = tx.update(js.grad(loss)(p), s, p)
            return js.apply_updates(p, u), s

        return jax.lax.fori_loop(0, steps, body, (p, tx.init(p)))[0]["t"]

    return run


def test_equal_entries_with_sub_ulp_updates_move_as_float32_does():
    """200 updates of -1e-4 (a fortieth of an ulp of 1.0) on every entry of
    a bf16 table of ones, no key: the mean is within 0.002 of float32's
    0.98 and the entries spread over several values (the noise is drawn
    per entry and per step), bitwise alike on both paths."""
    p = {"t": jnp.ones((512, 16), jnp.bfloat16)}
    native, xla = _both_paths(_sgd_on_ones(200), p)
    _assert_bitwise(native, xla, "sgd on ones")
    out = np.asarray(native, np.float32)
    assert abs(out.mean() - 0.98) < 0.002, out.mean()
    assert len(np.unique(out)) > 1


#: The pooled rows' loss: a linear one (gradient rows exact in bf16) and a
#: squared one (cotangents that are not, summed over several slots).
SGD_LOSSES = {
    "linear": lambda h: jnp.sum(h * jnp.arange(8, dtype=jnp.float32)),
    "squared": lambda h: jnp.sum(h**2),
}


@pytest.mark.parametrize("loss_name", sorted(SGD_LOSSES))
def test_sgd_steps_a_bf16_table_bitwise_alike_on_both_paths(loss_name):
    """One js.sgd(0.1) step on a random 40 x 8 bf16 table (sum bags): the
    update -lr * g is kept in float32 into the apply on both paths, so the
    paths write the same bits (stochastically and to nearest). The squared
    loss can fail: kernels built with fused multiply-adds
    (``JAXSLICES_CXXFLAGS=-ffp-contract=fast``) round ``acc + f * x`` once,
    and 10 of the 320 entries drew the other neighbour."""
    table = jax.random.normal(jax.random.key(0), (40, 8)).astype(jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(1), (16, 3), 0, 40)
    of_pooled = SGD_LOSSES[loss_name]
    tx = js.sgd(0.1)

    def step(p, sr):
        def loss(p):
            pooled = js.embedding_bag(p["t"], ids, combiner="sum")
            return of_pooled(pooled.astype(jnp.float32))

        u, _ = tx.update(js.grad(loss)(p), tx.init(p), p)
        return js.apply_updates(p, u, stochastic_rounding=sr)

    p = {"t": table}
    for sr in (False, True):
        native, xla = _both_paths(lambda p, sr=sr: step(p, sr), p)
        _assert_bitwise(native, xla, f"sgd(0.1), {loss_name}, stochastic={sr}")
        assert (_bits(native["t"]) != _bits(table)).any()


def test_a_bf16_adagrad_accumulator_is_rounded_once():
    """Adagrad's bf16 accumulator, 0.3 plus a gradient of 0.6171875 squared:
    the float32 total 0.68170166 rounded once to nearest is 0.68359375 (not
    0.6796875: g * g rounded to bf16 before the add), on both paths."""
    tx = js.adagrad(0.1, initial_accumulator_value=0.3, stochastic_rounding=False)
    p = {"t": jnp.ones((1, 1), jnp.bfloat16)}
    g = js.IndexedSlices(
        jnp.full((1, 1), 0.6171875, jnp.bfloat16), jnp.array([0]), (1, 1)
    )

    def step(p):
        return tx.update({"t": g}, tx.init(p), p)[1][0].sum_of_squares["t"]

    native, xla = _both_paths(step, p)
    _assert_bitwise(native, xla, "accumulator")
    assert float(native[0, 0]) == 0.68359375


def test_the_apply_binds_one_op_on_either_path():
    """The apply is one body: its primitive is bound natively and on the XLA
    path (its lowering picks the kernel or its XLA reference, by the reason
    bound with it: empty when native), and explain reads the decision from
    it, once per table."""
    table = jnp.ones((8, 4), jnp.bfloat16)
    s = js.IndexedSlices(jnp.ones((3, 4)), jnp.array([1, 1, 2]), (8, 4))

    def step(t):
        return js.apply_updates({"t": t}, {"t": s})["t"]

    def applies(fn):
        jaxpr = jax.make_jaxpr(fn)(table).jaxpr
        return [e for e in jaxpr.eqns if e.primitive.name == "jaxslices_apply"]

    (native,) = applies(step)
    assert native.params["reason"] == ""
    with js.kernels.disabled():
        (xla,) = applies(step)
        report = js.kernels.explain(step, table)
    assert "the native kernels are off" in xla.params["reason"]
    assert [d.native for d in report.decisions] == [False]
    assert "the native kernels are off" in report.decisions[0].reason
    native_out, xla_out = _both_paths(step, table)
    _assert_bitwise(native_out, xla_out, "apply")
