"""The native CPU kernels (jaxslices.kernels) against the XLA path.

Every comparison runs the same step twice, once as it comes (the native path,
when the kernels load) and once traced under ``jaxslices.kernels.disabled()``
(the XLA path), on random inputs with heavy duplicates (Zipf ids), padding
ids, out-of-range ids, weights, empty bags and empty batches. The two paths
sum rows in different orders, so they agree to float32 rounding:
``rtol=2e-5, atol=2e-6`` over three steps (``TOL``); that is the tolerance
the docs state (docs/kernels.md, "Same numbers, to float rounding").
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import registry
from helpers import needs_kernels
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxslices as js
from jaxslices.kernels import _ops, _path

ROOT = Path(__file__).resolve().parents[2]
TOL = {"rtol": 2e-5, "atol": 2e-6}

pytestmark = [
    pytest.mark.skipif(
        jax.default_backend() != "cpu",
        reason="the kernels are CPU-only: tests/lib/test_kernels_platform.py "
        "checks that other platforms take the XLA path",
    ),
    needs_kernels,  # the fallbacks: tests/lib/test_kernels_build.py
]

#: Every rule of the kernels, each clipping or decay kernel before a rule, the
#: max_distinct capacity (tests/registry.py: shared with the other files).
OPTIMIZERS = registry.pick(
    "sgd",
    "sgd_schedule",
    "sgd_momentum",
    "sgd_nesterov",
    "trace",
    "adagrad",
    "rowwise_adagrad",
    "lazy_adam",
    "lazy_adam_nesterov",
    "lazy_adamw",
    "ftrl",
    "ftrl_power",
    "add_decayed_weights",
    "clip_by_global_norm_adagrad",
    "clip_by_global_norm_tight",
    "clip_by_row_norm_tight",
    "clip_lazy_adam",
    "max_distinct",
)


def _xla():
    return js.kernels.disabled()


def _zipf_ids(rng, shape, num_rows):
    return ((rng.zipf(1.3, size=shape) - 1) % num_rows).astype(np.int32)


def _batches(rng, num_rows=40, bags=6, length=5, steps=3, extra=()):
    out = []
    for _ in range(steps):
        ids = _zipf_ids(rng, (bags, length), num_rows)
        ids[0, 1] = num_rows + 3  # out of range
        ids[1, :] = num_rows  # an empty bag (all padding)
        ids[2, 2] = -2  # negative: out of range
        out.append((jnp.asarray(ids), jnp.asarray(rng.normal(size=bags), jnp.float32)))
    return out


@functools.cache  # one function per setting: harness.fit's steps are cached on it
def _loss(combiner="mean", padding_id=None):
    def loss(p, ids, y, weights=None):
        h = js.embedding_bag(
            p["emb"], ids, combiner=combiner, padding_id=padding_id, weights=weights
        )
        return jnp.mean((h @ p["w"] - y) ** 2) + 0.1 * jnp.sum(p["w"] ** 2)

    return loss


def _train(tx, loss, params, batches, *, native, jit=True, donate=False):
    """``harness.fit`` on the native path (as it comes) or the XLA path: the
    session's one compiled step per (tx, loss, shapes, path)."""
    with contextlib.nullcontext() if native else _xla():
        return harness.fit(tx, loss, params, batches, jit=jit, donate=donate)


def _params(rng, num_rows=40, dim=4, row_shape=None):
    row = (dim,) if row_shape is None else row_shape
    return {
        "emb": jnp.asarray(rng.normal(size=(num_rows, *row)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=row), jnp.float32),
    }


def _assert_trees_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL)


# ------------------------------------------------ every optimizer, both paths


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_native_equals_xla(name):
    rng = np.random.default_rng(0)
    params = _params(rng)
    batches = _batches(rng)
    loss = _loss(padding_id=40)
    tx = OPTIMIZERS[name]()
    native = _train(tx, loss, params, batches, native=True)
    xla = _train(tx, loss, params, batches, native=False)
    _assert_trees_close(native, xla)

    # And the step did take the native path, every jaxslices operation of it
    # (the step just run: its trace and lowering are reused).
    step = harness.jitted_loss_step(tx, loss)
    report = js.kernels.explain(step, params, tx.init(params), *batches[0])
    assert report.native and report.native_calls >= 2, str(report)


# The matrix under jit; op by op (eager), one smoke case: the kernels are the
# same calls either way (donation has no meaning outside jit).
@pytest.mark.parametrize(
    "combiner, jit, donate",
    [
        *((c, True, d) for c in ("mean", "sum", "sqrtn") for d in (True, False)),
        ("sqrtn", False, False),
    ],
)
def test_bags_weights_and_combiners_eager_jit_donated(combiner, jit, donate):
    rng = np.random.default_rng(1)
    params = _params(rng)
    batches = _batches(rng)
    weights = jnp.asarray(rng.uniform(0.1, 2.0, size=(6, 5)), jnp.float32)
    batches = [(ids, y, weights) for ids, y in batches]
    loss = _loss(combiner, padding_id=40)
    tx = registry.optimizer("adagrad")
    native = _train(tx, loss, params, batches, native=True, jit=jit, donate=donate)
    xla = _train(tx, loss, params, batches, native=False, jit=jit)
    _assert_trees_close(native, xla)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "lazy_adam", "ftrl"])
def test_jagged_bags_and_row_shapes(name):
    rng = np.random.default_rng(2)
    params = _params(rng, row_shape=(2, 3))
    lists = [[1, 1, 7], [], [3], [39, 1, 1, 1], [45]]  # 45: out of range

    def loss(p, bags, y):
        h = js.embedding_bag(p["emb"], bags, combiner="sqrtn")
        return jnp.mean((jnp.sum(h * p["w"], axis=(1, 2)) - y) ** 2)

    bags = js.JaggedIds.from_lists(lists, max_total=12)
    batches = [(bags, jnp.arange(5.0))] * 3
    tx = OPTIMIZERS[name]()
    _assert_trees_close(
        _train(tx, loss, params, batches, native=True),
        _train(tx, loss, params, batches, native=False),
    )


def test_several_lookups_of_one_table_and_plain_lookups():
    rng = np.random.default_rng(3)
    params = _params(rng)

    def loss(p, ids, y):
        a = js.embedding_bag(p["emb"], ids, combiner="mean")
        b = js.embedding_bag(p["emb"], ids[:, :2], combiner="sum")
        c = js.embedding_lookup(p["emb"], ids[:, 0])
        return jnp.mean(((a + b + c) @ p["w"] - y) ** 2)

    batches = _batches(rng)
    for name in ["sgd", "rowwise_adagrad", "lazy_adamw"]:
        tx = OPTIMIZERS[name]()
        _assert_trees_close(
            _train(tx, loss, params, batches, native=True),
            _train(tx, loss, params, batches, native=False),
        )


@pytest.mark.parametrize("kind", ["empty_batch", "all_padding"])
@pytest.mark.parametrize(
    "name", ["sgd", "adagrad", "lazy_adam", "ftrl", "clip_lazy_adam"]
)
def test_empty_and_all_padding_batches_touch_nothing(kind, name):
    rng = np.random.default_rng(4)
    params = _params(rng)
    shape = (0, 5) if kind == "empty_batch" else (4, 5)
    ids = jnp.full(shape, 40, jnp.int32)
    y = jnp.zeros(shape[0])
    tx = OPTIMIZERS[name]()
    new, state = _train(tx, _loss(padding_id=40), params, [(ids, y)], native=True)
    np.testing.assert_array_equal(new["emb"], params["emb"])


def test_int64_ids_in_the_kernels_under_x64():
    """Ids are int32 below 2**31 rows (the index dtype policy); above, int64.

    No test table has 2**31 rows, so the int64 kernels are run directly on
    int64 ids (x64 on), against their XLA references.
    """
    code = textwrap.dedent(
        """
        import jax
        jax.config.update("jax_enable_x64", True)
        import contextlib
        import jax.numpy as jnp, numpy as np
        from jaxslices.kernels import _ops, _path
        rng = np.random.default_rng(0)
        table = jnp.asarray(rng.normal(size=(30, 4)), jnp.float32)
        state = jnp.asarray(rng.uniform(size=(30, 4)), jnp.float32)
        ids = jnp.asarray(rng.integers(-2, 33, size=12), jnp.int64)
        src = jnp.asarray(rng.normal(size=(12, 4)), jnp.float32)
        spec = _ops.RuleSpec(
            "rss",
            lambda g, st, p, hp, cfg: (
                g / jnp.sqrt(g * g + st[0] + hp[0]), (g * g + st[0],)
            ),
        )
        rec = _ops.PooledGradient(src)
        for native in (True, False):
            with contextlib.nullcontext() if native else _path.disabled():
                out = jax.jit(lambda s: _ops.rowwise(
                    rec, ids, num_rows=30, spec=spec, hp=(1e-7,), state=s,
                    capacity=12))(state)
                tab = jax.jit(lambda t: _ops.apply(t, rec, ids))(table)
                fwd = jax.jit(lambda t: _ops.bag_forward(
                    t, ids, weight=None, scale=None, num_bags=4, length=3))(table)
            if native:
                a = (out, tab, fwd)
            else:
                b = (out, tab, fwd)
        assert a[0][1].dtype == jnp.int64
        n = int(a[0][3])
        np.testing.assert_array_equal(a[0][1], b[0][1])
        np.testing.assert_allclose(a[0][2][:n], b[0][2][:n], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(a[0][0], b[0][0], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(a[1], b[1], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(a[2], b[2], rtol=2e-5, atol=2e-6)
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    num_rows=st.integers(1, 64),
    bags=st.integers(0, 6),
    length=st.integers(1, 6),
    name=st.sampled_from(sorted(OPTIMIZERS)),
)
def test_property_native_equals_xla(seed, num_rows, bags, length, name):
    rng = np.random.default_rng(seed)
    params = _params(rng, num_rows=num_rows)
    ids = rng.integers(-2, num_rows + 3, size=(bags, length)).astype(np.int32)
    batches = [(jnp.asarray(ids), jnp.asarray(rng.normal(size=bags), jnp.float32))]
    tx = OPTIMIZERS[name]()
    loss = _loss(padding_id=num_rows)
    _assert_trees_close(
        _train(tx, loss, params, batches * 2, native=True),
        _train(tx, loss, params, batches * 2, native=False),
    )


# --------------------------------------------------------- the optax split


def test_optax_apply_updates_and_plain_slices_take_the_native_path():
    rng = np.random.default_rng(5)
    params = _params(rng)
    vals = jnp.asarray(rng.normal(size=(9, 4)), jnp.float32)
    idx = jnp.asarray([3, 3, 0, 40, 7, 3, -1, 0, 12])
    g = {"emb": js.IndexedSlices(vals, idx, (40, 4)), "w": jnp.ones(4)}
    tx = js.lazy_adam(0.1)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    a = jax.jit(step)(params, tx.init(params), g)
    with _xla():
        b = jax.jit(step)(params, tx.init(params), g)
    _assert_trees_close(a, b)
    report = js.kernels.explain(step, params, tx.init(params), g)
    assert report.native, str(report)


def test_donated_step_writes_table_and_state_in_place():
    rng = np.random.default_rng(6)
    num_rows = 4096
    params = _params(rng, num_rows=num_rows, dim=16)
    for name in ["sgd", "adagrad", "rowwise_adagrad", "lazy_adam", "ftrl"]:
        tx = OPTIMIZERS[name]()
        step = harness.jitted_loss_step(tx, _loss(), donate=True)
        ids = jnp.zeros((8, 4), jnp.int32)
        compiled = step.lower(params, tx.init(params), ids, jnp.zeros(8)).compile()
        assert js.table_copies(compiled) == [], name
        text = compiled.as_text()
        assert 'custom_call_target="jaxslices_apply_s32"' in text, name
        # No copy of anything with the table's rows (table or its state).
        copies = [
            line
            for line in text.splitlines()
            if " copy(" in line and f"[{num_rows}," in line.split("copy(")[0]
        ]
        assert not copies, (name, copies)


def test_max_distinct_overflow_raises_and_changes_nothing():
    rng = np.random.default_rng(7)
    params = _params(rng)
    tx = js.rowwise_adagrad(0.1, max_distinct=2)
    ids = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)

    @jax.jit
    def step(p, s, ids):
        u, s = tx.update(js.grad(_loss())(p, ids, jnp.zeros(1)), s, p)
        return js.apply_updates(p, u), s

    with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="max_distinct"):
        jax.block_until_ready(step(params, tx.init(params), ids))


def _rowwise_eqns(fun, *args):
    jaxpr = jax.make_jaxpr(fun)(*args)
    out = []

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "jaxslices_rowwise":
                out.append(e.params)
            for v in e.params.values():
                for sub in v if isinstance(v, (list, tuple)) else [v]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr.jaxpr)
    return out


@pytest.mark.parametrize(
    "name,kernels,hashed",
    [
        ("sgd", 0, 0),
        ("adagrad", 1, 1),
        ("lazy_adamw", 2, 1),  # adam, then the decay on the coalesced rows
        ("clip_by_global_norm_adagrad", 2, 1),  # coalesce (+ norm), then adagrad
        ("clip_lazy_adam", 2, 1),
    ],
)
def test_a_chain_sums_duplicates_once(name, kernels, hashed):
    """One hashing pass per table and step; later kernels read coalesced rows."""
    rng = np.random.default_rng(13)
    params = _params(rng)
    ids, y = _batches(rng)[0]
    tx = OPTIMIZERS[name]()

    def step(p, s, ids, y):
        return tx.update(js.grad(_loss())(p, ids, y), s, p)[0]

    eqns = _rowwise_eqns(step, params, tx.init(params), ids, y)
    assert len(eqns) == kernels
    assert sum(not e["coalesced"] for e in eqns) == hashed


# ---------------------------------------------------------- the forward bag


def test_forward_matches_and_differentiates_like_the_xla_bag():
    rng = np.random.default_rng(8)
    table = jnp.asarray(rng.normal(size=(20, 3)), jnp.float32)
    ids = jnp.asarray(_zipf_ids(rng, (4, 6), 23))
    w = jnp.asarray(rng.uniform(0.5, 1.5, size=(4, 6)), jnp.float32)

    def f(t, w):
        return jnp.sum(js.embedding_bag(t, ids, weights=w, combiner="sqrtn") ** 3)

    native = (f(table, w), jax.grad(f, argnums=(0, 1))(table, w))
    with _xla():
        xla = (f(table, w), jax.grad(f, argnums=(0, 1))(table, w))
    _assert_trees_close(native, xla)
    # Forward mode too (the XLA lookup is a custom_vjp, which refuses jvp).
    t_out = jax.jvp(lambda t: f(t, w), (table,), (jnp.ones_like(table),))[1]
    eps = 1e-3
    fd = (f(table + eps, w) - f(table - eps, w)) / (2 * eps)
    np.testing.assert_allclose(t_out, fd, rtol=2e-2)


def test_vmap_takes_the_xla_path_and_says_so():
    rng = np.random.default_rng(9)
    table = jnp.asarray(rng.normal(size=(20, 3)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 20, size=(5, 4, 3)))

    def f(t, ids):
        return js.embedding_bag(t, ids)

    out = jax.vmap(f, in_axes=(None, 0))(table, ids)
    with _xla():
        ref = jax.vmap(f, in_axes=(None, 0))(table, ids)
    np.testing.assert_allclose(out, ref, **TOL)
    report = js.kernels.explain(jax.vmap(f, in_axes=(None, 0)), table, ids)
    assert not report.native
    assert any("vmap" in d.reason for d in report.decisions), str(report)


def test_explain_names_every_reason():
    rng = np.random.default_rng(10)
    params = _params(rng)
    ids, y = _batches(rng)[0]
    tx = js.lazy_adam(0.01, mu_dtype=jnp.bfloat16)

    def step(p, s, ids, y):
        u, s = tx.update(js.grad(_loss())(p, ids, y), s, p)
        return js.apply_updates(p, u), s

    report = js.kernels.explain(step, params, tx.init(params), ids, y)
    text = str(report)
    assert "mu_dtype=bfloat16" in text and "native" in text, text

    def step2(p, s, ids, y):  # a new function: jit traced `step` already
        return step(p, s, ids, y)

    with _xla():
        report = js.kernels.explain(step2, params, tx.init(params), ids, y)
    assert not any(d.native for d in report.decisions), str(report)
    assert sum("are off" in d.reason for d in report.decisions) == 2, str(report)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    tx = registry.optimizer("lazy_adam")
    report = js.kernels.explain(step, bf16, tx.init(bf16), ids, y)
    assert any("bfloat16" in d.reason for d in report.decisions), str(report)


def test_strict_mode_still_catches_a_dense_gradient_of_a_native_bag():
    table = jnp.ones((10, 2))

    def loss(t):
        return js.embedding_bag(t, jnp.array([[1, 2]]), strict=True).sum()

    with pytest.raises(js.DenseGradientError):
        jax.grad(loss)(table)
    assert js.grad(loss)(table).indices.shape == (2,)


def test_higher_order_differentiation_through_the_native_path():
    rng = np.random.default_rng(11)
    params = _params(rng)
    ids, y = _batches(rng)[0]
    loss = _loss(padding_id=40)

    def penalty(p):
        g = js.grad(loss)(p, ids, y)
        return jnp.sum(g["w"] ** 2)

    native = jax.grad(penalty)(params)
    with _xla():
        xla = jax.grad(penalty)(params)
    _assert_trees_close(native, xla)


# -------------------------------------- accelerators: no CPU call in exports


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_steps_export_for_cuda_and_tpu_without_a_cpu_only_call(name):
    rng = np.random.default_rng(12)
    params = _params(rng)
    ids, y = _batches(rng)[0]
    tx = OPTIMIZERS[name]()
    # the step test_every_optimizer_native_equals_xla runs (its trace reused)
    step = harness.jitted_loss_step(tx, _loss(padding_id=40))
    exported = jax.export.export(step, platforms=("cuda", "tpu"))(
        params, tx.init(params), ids, y
    )
    text = exported.mlir_module()
    # The ops are there (their names label the code), lowered as XLA.
    assert "jaxslices_" in text
    assert "custom_call @jaxslices" not in text and "@jaxslices_" not in text


def test_table_copies_sees_a_copy_behind_a_reshape():
    """A reshape between a donated buffer and an in-place kernel makes XLA copy it.

    (jaxslices passes state whole for that reason; ``table_copies`` must see
    such a copy, which hides behind a bitcast and inside a fusion.)
    """
    num_rows = 1 << 15

    def step(state, ids):
        flat = state.reshape(num_rows, -1)
        out = _ops.apply(flat, _ops.PooledGradient(jnp.ones((4, 128))), ids)
        return out.reshape(state.shape)

    state = jnp.zeros((num_rows, 2, 64))
    compiled = jax.jit(step, donate_argnums=0).lower(state, jnp.arange(4)).compile()
    (copy,) = js.table_copies(compiled)
    assert copy.argument == "state" and copy.donated


def _exported_text(step, *args):
    exported = jax.export.export(jax.jit(step), platforms=("cuda", "tpu"))(*args)
    return exported.mlir_module()


def test_collection_and_plan_steps_export_for_cuda_and_tpu():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    coll = js.EmbeddingCollection(
        [
            js.TableConfig("a", rows=40, dim=8, combiner="mean"),
            js.TableConfig("b", rows=64, dim=8, features=("b1", "b2")),
        ]
    )
    tx = js.rowwise_adagrad(0.1)
    rng = np.random.default_rng(14)
    ids = {f: jnp.asarray(rng.integers(-1, 40, size=(8, 3))) for f in coll.features}
    kjt = js.KeyedJaggedIds.from_lists(
        {f: [[1, 2], [3]] * 4 for f in coll.features}, max_total=64
    )

    def make_step(lookup):
        def loss(p, feats, y):
            extra = {} if isinstance(feats, js.KeyedJaggedIds) else {"padding_id": -1}
            h = lookup.concat(p["emb"], feats, **extra)
            return jnp.mean((h @ p["w"] - y) ** 2)

        def step(p, s, feats, y):
            u, s = tx.update(js.grad(loss)(p, feats, y), s, p)
            return js.apply_updates(p, u), s

        return step

    params = {"emb": coll.init(jax.random.key(0)), "w": jnp.ones(24)}
    y = jnp.zeros(8)
    step = make_step(coll)
    for feats in (ids, kjt):
        # the step runs natively on this CPU ...
        assert js.kernels.explain(step, params, tx.init(params), feats, y).native
        # ... and exports for the accelerators with no CPU-only call.
        text = _exported_text(step, params, tx.init(params), feats, y)
        assert "@jaxslices_" not in text
    mesh = Mesh(np.array(jax.devices()[:8]), ("model",))
    plan = js.sharding.ShardingPlan(
        coll, mesh, "model", {"a": "row_wise", "b": "table_wise"}, batch_size=8
    )
    pparams = {
        "emb": plan.shard(params["emb"]),
        "w": jax.device_put(params["w"], NamedSharding(mesh, P())),
    }
    pstate = js.sharding.sharded_init(tx, pparams)
    pids = jax.device_put(ids, NamedSharding(mesh, P("model")))
    text = _exported_text(make_step(plan), pparams, pstate, pids, y)
    assert "@jaxslices_" not in text


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
def test_apply_max_norm_native_equals_xla(norm_type):
    rng = np.random.default_rng(15)
    table = jnp.asarray(rng.normal(size=(30, 2, 3)) * 2, jnp.float32)
    ids = jnp.asarray([[1, 1, 5], [7, 33, -1], [5, 0, 0]])
    bags = js.JaggedIds.from_lists([[1, 1], [5, 7], [29]], max_total=8)

    def f(t, ids):
        return js.apply_max_norm(t, ids, 1.5, norm_type=norm_type)

    for x in (ids, bags):
        got = jax.jit(f)(table, x)
        with _xla():  # a fresh trace (jit keeps the path of f's first trace)
            want = jax.jit(lambda t, x: f(t, x))(table, x)
        np.testing.assert_allclose(got, want, **TOL)
    assert js.kernels.explain(f, table, ids).native
    report = js.kernels.explain(
        lambda t, i: js.embedding_bag(t, i, max_norm=1.0), table, ids
    )
    assert "max_norm" in str(report) and not report.native


@pytest.mark.parametrize("first", ["native", "xla"])
@pytest.mark.parametrize("name", ["rowwise_adagrad", "lazy_adam", "ftrl"])
def test_orbax_resume_across_the_two_paths(tmp_path, first, name):
    """Train on one path, checkpoint with Orbax, resume on the other."""
    import orbax.checkpoint as ocp

    rng = np.random.default_rng(16)
    params = _params(rng)
    batches = _batches(rng, steps=4)
    loss = _loss(padding_id=40)
    tx = OPTIMIZERS[name]()
    second = "xla" if first == "native" else "native"
    p, s = _train(tx, loss, params, batches[:2], native=first == "native")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": p, "state": s})
    ckptr.wait_until_finished()
    target = jax.eval_shape(lambda: {"params": p, "state": s})
    restored = ckptr.restore(tmp_path / "ckpt", target)
    _assert_trees_close(restored, {"params": p, "state": s})  # bit for bit, in fact

    p2, s2 = restored["params"], restored["state"]
    with contextlib.nullcontext() if second == "native" else _xla():
        p2, s2 = harness.fit(tx, loss, p2, batches[2:], state=s2)
    whole = _train(tx, loss, params, batches, native=True)
    _assert_trees_close((p2, s2), whole)


def test_flax_nnx_and_equinox_steps_take_the_native_path():
    import equinox as eqx
    from flax import nnx

    import jaxslices.equinox as jse
    import jaxslices.nnx as jnnx

    ids, y = jnp.array([[1, 2, 3], [4, 4, 0]]), jnp.ones(2)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.bag = jnnx.EmbedBag(100, 8, combiner="mean", rngs=rngs)
            self.out = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, ids):
            return self.out(self.bag(ids))[:, 0]

    def loss_fn(m, ids, y):
        return jnp.mean((m(ids) - y) ** 2)

    def run(native):
        m = Model(nnx.Rngs(0))
        opt = nnx.Optimizer(m, js.rowwise_adagrad(0.1), wrt=nnx.Param)

        @nnx.jit
        def step(m, opt, ids, y):
            loss, g = jnnx.value_and_grad(loss_fn)(m, ids, y)
            opt.update(m, g)
            return loss

        if native:
            assert js.kernels.explain(step, m, opt, ids, y).native
        with contextlib.nullcontext() if native else _xla():
            for _ in range(3):
                step(m, opt, ids, y)
        return nnx.state(m, nnx.Param)

    _assert_trees_close(run(True), run(False))

    emb = jse.EmbeddingBag(100, 8, key=jax.random.key(0))
    tx = js.adagrad(0.1)

    @eqx.filter_jit
    def step(m, st, ids):
        g = jse.filter_grad(lambda m, ids: jnp.sum(m(ids) ** 2))(m, ids)
        u, st = tx.update(g, st, m)
        return jse.apply_updates(m, u), st

    st = tx.init(eqx.filter(emb, eqx.is_array))
    assert js.kernels.explain(step, emb, st, ids).native


@pytest.mark.parametrize("length", [0, 4])
def test_apply_with_and_without_summing_duplicates_first(length):
    rng = np.random.default_rng(17)
    table = jnp.asarray(rng.normal(size=(50, 3)), jnp.float32)
    n = 24
    ids = jnp.asarray(_zipf_ids(rng, (n,), 53))  # duplicates, some out of range
    src = jnp.asarray(rng.normal(size=(n // max(length, 1), 3)), jnp.float32)
    rec = _ops.PooledGradient(
        src, length=length, weight=jnp.asarray(rng.normal(size=n))
    )
    want = table.at[jnp.where(ids < 50, ids, 50)].add(rec.values(n), mode="drop")
    for sum_duplicates in (True, False):
        got = jax.jit(
            lambda t, s=sum_duplicates: _ops.apply(t, rec, ids, sum_duplicates=s)
        )(table)
        np.testing.assert_allclose(got, want, **TOL)


def test_a_gate_that_changes_its_answer_between_traces_keeps_the_first_path(
    monkeypatch,
):
    """The native gate is asked on every trace of the loss; if discovery's trace
    took the XLA path and a later one is told "native" (JAX 0.11.2 gave a
    tracer the mesh of an earlier eager op on a mesh, not a concrete array:
    tests/scale/test_sharding.py), the later trace follows discovery instead
    of failing with "different embedding lookups on different traces"."""
    answers = iter(["XLA for the first trace"])
    real = _path.decide
    monkeypatch.setattr(
        _path, "decide", lambda *a, **k: next(answers, None) or real(*a, **k)
    )
    table = jnp.arange(40.0).reshape(10, 4)
    ids = jnp.array([[1, 2, 2], [9, 0, -1]], jnp.int32)

    def loss(t):
        return jnp.sum(js.embedding_bag(t, ids, combiner="mean") ** 2)

    g = js.grad(loss)(table)
    assert next(answers, "used") == "used"  # the first trace did take XLA
    want = jax.grad(loss)(table)
    np.testing.assert_allclose(js.to_dense(g), want, rtol=1e-6)
