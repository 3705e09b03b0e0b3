"""Sharding plans on 8 CPU devices: every plan trains to one device's numbers,
with masked or all-to-all routing and every optimizer, and no step moves a
table (the compiled HLO's collectives grow with the batch, not with the
tables). How the all-to-all routing scales with the devices:
``test_plan_scaling.py``."""

from __future__ import annotations

import functools

import _mesh
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxslices as js
from tools import hlo as _hlo

B = 16  # global batch, split over the 8 devices

# dim 8 splits over 8 devices column-wise; "e" (dim 4) cannot
TABLES = (
    js.TableConfig("a", rows=37, dim=8),  # not a multiple of 8: short chunks
    js.TableConfig("b", rows=300, dim=8),
    js.TableConfig("c", rows=12, dim=8, features=("c1", "c2"), combiner="mean"),
    js.TableConfig("d", rows=64, dim=8, combiner="sqrtn"),
    js.TableConfig("e", rows=30, dim=4),
)
COLL = js.EmbeddingCollection(TABLES)
FEATURES = COLL.features


def _batch(seed, scale=1):
    """Padded [B, 3] ids per feature (repeats, -1 padding, an out-of-range id)."""
    rng = np.random.default_rng(seed)
    out = {}
    for f in FEATURES:
        rows = COLL.table_config(COLL.table_of(f)).rows * scale
        ids = rng.integers(0, max(2, rows // 3), size=(B, 3)).astype(np.int32)
        ids[rng.random((B, 3)) < 0.25] = -1
        out[f] = ids
    out["b"][0, 0] = 10**6  # out of range: reads zeros, no gradient
    return out, rng.normal(size=(B,)).astype(np.float32)


def _tx(coll, elementwise=False):
    """Row-wise Adagrad, or lazy Adam (element-wise) where a plan has column-wise
    tables: a column piece is a row to a row-wise optimizer (docs/collections.md)."""
    first = js.lazy_adam(0.05) if elementwise else js.rowwise_adagrad(0.3)
    return optax.chain(first, coll.scale_by_table({"c": 0.5}))


def _loss(lookup, params, ids, y):
    h = jnp.tanh(lookup.concat(params["emb"], ids, padding_id=-1))
    return jnp.mean((h @ params["w"] - y) ** 2)


def _train(lookup, params, batches, sharding=None, elementwise=False, tx=None):
    """Train on ``batches``; a plan with routed buffers steps with ``update``."""
    tx = _tx(lookup, elementwise) if tx is None else tx
    state = (
        js.sharding.sharded_init(tx, params)
        if sharding is not None
        else tx.init(params)
    )
    routed = isinstance(lookup, js.sharding.ShardingPlan)

    @jax.jit
    def step(params, state, ids, y):
        loss, g = js.value_and_grad(functools.partial(_loss, lookup))(params, ids, y)
        if routed:
            params, state = lookup.update(tx, g, state, params)
            return params, state, loss
        u, state = tx.update(g, state, params)
        return js.apply_updates(params, u), state, loss

    losses = []
    for ids, y in batches:
        if sharding is not None:
            ids, y = jax.device_put((ids, y), sharding)
        params, state, loss = step(params, state, ids, y)
        losses.append(float(loss))
    return params, losses, step


@functools.lru_cache
def _single(elementwise, optimizer=None):
    """One device's run on the batches of the plan tests (computed once)."""
    params = {"emb": COLL.init(jax.random.key(0)), "w": jnp.linspace(-1, 1, 44)}
    batches = [_batch(s) for s in range(2)]
    tx = None if optimizer is None else _optimizer(COLL, optimizer)
    return params, _train(COLL, params, batches, elementwise=elementwise, tx=tx)[:2]


def _optimizer(coll, name):
    return optax.chain(_mesh.OPTIMIZERS[name](), coll.scale_by_table({"c": 0.5}))


PLANS = {
    "data_parallel": {t.name: "data_parallel" for t in TABLES},
    "table_wise": {t.name: "table_wise" for t in TABLES},
    "row_wise": {t.name: "row_wise" for t in TABLES},
    "column_wise": {**{t.name: "column_wise" for t in TABLES}, "e": "row_wise"},
    "mixed": {
        "a": ("table_wise", 3),
        "b": "row_wise",
        "c": "data_parallel",
        "d": "column_wise",
        "e": "table_wise",
    },
}


#: The mixed plan without column-wise tables: exact for row-wise optimizers.
ROWS_ONLY = {**PLANS["mixed"], "d": "row_wise"}


def _replicated(m, x):
    return jax.device_put(x, NamedSharding(m, P()))


def _samples():
    return [_batch(s)[0] for s in range(2)]


@pytest.mark.parametrize("routing", ["masked", "all_to_all"])
@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_plan_trains_like_one_device(name, routing):
    """Masked: the step written as on one device (the partitioner's). All-to-all
    (capacities from the batches): ``plan.update``, the gradients routed back."""
    m = _mesh.mesh((8,), ("model",))
    plan = js.sharding.ShardingPlan(
        COLL,
        m,
        "model",
        PLANS[name],
        batch_size=B,
        routing=routing,
        samples=_samples() if routing == "all_to_all" else None,
        padding_id=-1,
    )
    if name != "data_parallel":
        assert set(plan.routing.values()) == {routing}, plan.routing
    batches = [_batch(s) for s in range(2)]
    elementwise = any(p.kind == "column_wise" for p in plan.tables.values())
    params0, (want, want_losses) = _single(elementwise)
    params = {
        "emb": plan.shard(params0["emb"]),
        "w": jax.device_put(params0["w"], NamedSharding(m, P())),
    }
    for buf, sharding in plan.shardings().items():
        assert params["emb"][buf].sharding.is_equivalent_to(sharding, 2)
    back = plan.unshard(params["emb"])  # shard then unshard: the same params
    for k in back:
        np.testing.assert_array_equal(back[k], params0["emb"][k])
    batch = NamedSharding(m, P("model"))
    got, losses, _ = _train(plan, params, batches, batch, elementwise)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    emb = plan.unshard(got["emb"])
    for k in emb:
        np.testing.assert_allclose(emb[k], want["emb"][k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-6)
    for buf, sharding in plan.shardings().items():  # the step keeps the layout
        assert got["emb"][buf].sharding.is_equivalent_to(sharding, 2)


@pytest.mark.parametrize("optimizer", sorted(_mesh.OPTIMIZERS))
def test_every_optimizer_on_a_routed_plan_trains_like_one_device(optimizer):
    """Table-wise, row-wise and data-parallel tables, all-to-all routing: the
    optimizer runs on the rows each device owns (clipping's global norm summed
    over the shards, the replicated buffer's and the dense leaf's counted once)."""
    m = _mesh.mesh((8,), ("model",))
    plan = js.sharding.ShardingPlan(
        COLL, m, "model", ROWS_ONLY, routing="all_to_all", samples=_samples(),
        padding_id=-1,
    )  # fmt: skip
    params0, (want, want_losses) = _single(False, optimizer)
    params = {
        "emb": plan.shard(params0["emb"]),
        "w": jax.device_put(params0["w"], NamedSharding(m, P())),
    }
    tx = _optimizer(plan, optimizer)
    batch = NamedSharding(m, P("model"))
    got, losses, step = _train(plan, params, [_batch(s) for s in range(2)], batch,
                               tx=tx)  # fmt: skip
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    emb = plan.unshard(got["emb"])
    for k in emb:
        np.testing.assert_allclose(emb[k], want["emb"][k], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-6)


def test_a_routed_plan_runs_the_native_kernels_on_every_device():
    """The optimizer of the routed buffers runs in shard_map: native there."""
    if not js.kernels.available():
        pytest.skip(f"needs the kernels: {js.kernels.status()}")
    m = _mesh.mesh((8,), ("model",))
    plan = js.sharding.ShardingPlan(
        COLL, m, "model", ROWS_ONLY, routing="all_to_all", samples=_samples(),
        padding_id=-1,
    )  # fmt: skip
    params0, _ = _single(False)
    params = {"emb": plan.shard(params0["emb"]), "w": _replicated(m, params0["w"])}
    tx = _tx(plan)
    state = js.sharding.sharded_init(tx, params)
    ids, y = jax.device_put(_batch(0), NamedSharding(m, P("model")))

    def step(params, state, ids, y):
        g = js.grad(functools.partial(_loss, plan))(params, ids, y)
        return plan.update(tx, g, state, params)

    report = js.kernels.explain(jax.jit(step), params, state, ids, y)
    sharded = [d for d in report.decisions if "_sharded" in d.op]
    assert sharded and all(d.native for d in sharded), str(report)


def test_masked_and_all_to_all_buffers_in_one_step():
    """One buffer routed each way: the masked one's owners take their rows of
    every device's gradient inside the same shard_map."""
    m = _mesh.mesh((8,), ("model",))
    kinds = {t.name: "row_wise" for t in TABLES}
    plan = js.sharding.ShardingPlan(
        COLL, m, "model", kinds, samples=_samples(), padding_id=-1,
        routing={"b": "all_to_all", "e": "masked"},
    )  # fmt: skip
    assert plan.routing == {
        "dim8_float32_sharded": "all_to_all",
        "dim4_float32_sharded": "masked",
    }
    assert plan.tables["e"].routing == "masked" and plan.tables["a"].capacity
    params0, (want, want_losses) = _single(False)
    params = {"emb": plan.shard(params0["emb"]), "w": _replicated(m, params0["w"])}
    batch = NamedSharding(m, P("model"))
    got, losses, _ = _train(plan, params, [_batch(s) for s in range(2)], batch)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    emb = plan.unshard(got["emb"])
    for k in emb:
        np.testing.assert_allclose(emb[k], want["emb"][k], rtol=1e-5, atol=1e-6)


def test_the_step_written_as_on_one_device_is_right_on_a_routed_plan():
    """``tx.update`` + ``apply_updates`` under jit on a routed plan's gradient
    (the batch's, laid out like it): right, if not routed (the partitioner),
    and it says so once per routed buffer and traced step, naming
    ``plan.update``."""
    m = _mesh.mesh((8,), ("model",))
    plan = js.sharding.ShardingPlan(
        COLL, m, "model", ROWS_ONLY, routing="all_to_all", samples=_samples(),
        padding_id=-1,
    )  # fmt: skip
    params0, (want, want_losses) = _single(False)
    params = {"emb": plan.shard(params0["emb"]), "w": _replicated(m, params0["w"])}
    tx = _tx(plan)
    state = js.sharding.sharded_init(tx, params)

    @jax.jit
    def step(params, state, ids, y):
        loss, g = js.value_and_grad(functools.partial(_loss, plan))(params, ids, y)
        u, state = tx.update(g, state, params)
        return js.apply_updates(params, u), state, loss

    losses = []
    for i, (ids, y) in enumerate([_batch(s) for s in range(2)]):
        ids, y = jax.device_put((ids, y), NamedSharding(m, P("model")))
        if i == 0:  # traced here: the warning, once per routed buffer
            with pytest.warns(UserWarning) as record:
                params, state, loss = step(params, state, ids, y)
            got = sorted(str(w.message).split(":")[0] for w in record)
            assert got == [f"ShardingPlan buffer {b!r}" for b in sorted(plan.routing)]
            for w in record:
                message = str(w.message)
                assert "outside ShardingPlan.update" in message, message
                assert "Call ShardingPlan.update for the step" in message, message
        else:  # compiled: nothing to say
            params, state, loss = step(params, state, ids, y)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    emb = plan.unshard(params["emb"])
    for k in emb:
        np.testing.assert_allclose(emb[k], want["emb"][k], rtol=1e-5, atol=1e-6)


def test_only_a_routed_tables_unrouted_scatter_warns():
    """``plan.update`` takes the routed gradient: no warning (warnings are
    errors here), also where another table of the same shape and layout is
    scattered by the partitioner first in the same step (the warning is for
    the routed table's own tracer); a gradient computed in one trace and
    applied in another is not that tracer either."""
    m = _mesh.mesh((8,), ("model",))
    coll = js.EmbeddingCollection([js.TableConfig("t", rows=64, dim=8)])
    plan = js.sharding.ShardingPlan(
        coll, m, "model", {"t": "row_wise"}, routing="all_to_all"
    )
    params = plan.shard(coll.init(jax.random.key(0)))
    other = jax.device_put(jnp.zeros((64, 8)), NamedSharding(m, P("model")))
    tx = js.sgd(0.1)
    state = js.sharding.sharded_init(tx, params)
    ids = jax.device_put({"t": np.arange(16).reshape(16, 1)}, NamedSharding(m, P()))
    loss = lambda p, ids: jnp.sum(plan.concat(p, ids) ** 2)  # noqa: E731

    @jax.jit
    def step(params, state, other, ids):
        g = js.grad(loss)(params, ids)
        rows = js.IndexedSlices(jnp.ones((2, 8)), jnp.array([1, 2]), (64, 8))
        other = js.apply_updates(other, rows)  # before the routed step
        new, state = plan.update(tx, g, state, params)
        return new, state, other

    new, _, other = step(params, state, other, ids)
    assert float(other.sum()) == 16.0
    g = jax.jit(js.grad(loss))(params, ids)  # traced alone: nothing pending
    u, _ = tx.update(g, tx.init(params), params)
    jax.jit(js.apply_updates)(params, u)


def test_the_default_routing_counts_the_ids_of_the_samples_and_says_why():
    """Built as docs/collections.md builds a plan (samples, no routing, no
    batch_size): the cost model counts the ids per step in the samples (not
    batch_size's default, 1), so the plan routes; without samples or a
    capacity it stays masked and its repr and explain() say why.
    plan_collection follows the same rule; ids_per_step, given, wins."""
    m = _mesh.mesh((8,), ("model",))
    coll = js.EmbeddingCollection([js.TableConfig("t", rows=65536, dim=16)])
    kinds, name = {"t": "row_wise"}, "dim16_float32_sharded"
    rng = np.random.default_rng(0)
    samples = [{"t": rng.integers(0, 65536, (256 * 8, 8)).astype(np.int32)}]
    plan = js.sharding.ShardingPlan(coll, m, "model", kinds, samples=samples)
    assert plan.routing == {name: "all_to_all"}, plan.explain()
    assert plan.choices[name].reads == 256 * 8 * 8
    assert "counted in the samples (1 batch)" in plan.choices[name].why
    assert "no samples" not in repr(plan)
    assert f"buffer {name!r}: all_to_all, capacity {plan.capacity[name]}: cost" in (
        plan.explain()
    )
    bare = js.sharding.ShardingPlan(coll, m, "model", kinds)
    assert bare.routing == {name: "masked"}
    assert repr(bare).endswith(
        "routed masked (no samples or capacity to size an all-to-all: see explain()))"
    )
    why = bare.choices[name].why
    assert "no samples, ids_per_step or batch_size: 1 id per feature" in why, why
    assert "no all-to-all capacity (pass samples= or capacity=)" in why, why
    chosen = js.sharding.plan_collection(
        coll, m, "model", samples=samples, overrides=kinds
    )
    assert chosen.routing == plan.routing and chosen.capacity == plan.capacity
    few = js.sharding.ShardingPlan(
        coll, m, "model", kinds, samples=samples, ids_per_step={"t": 8}
    )
    assert few.routing == {name: "masked"}, few.explain()
    assert "ids_per_step given" in few.choices[name].why
    given = js.sharding.ShardingPlan(coll, m, "model", kinds, routing="masked")
    assert given.choices[name].why == "given (routing='masked')"
    assert "no samples" not in repr(given)
    # a KeyedJaggedIds sample: the slots of the table's features
    kjt = js.KeyedJaggedIds.from_lengths(
        ["t", "u"], np.arange(20, dtype=np.int32), np.array([3, 4, 5, 8]),
        max_total=24,
    )  # fmt: skip
    two = js.EmbeddingCollection([js.TableConfig("t", rows=64, dim=16)])
    jagged = js.sharding.ShardingPlan(two, m, "model", kinds, samples=[kjt])
    assert jagged.choices[name].reads == 7


def test_a_capacity_overflow_raises_on_every_device_and_names_the_buffer():
    m = _mesh.mesh((8,), ("model",))
    kinds = {t.name: "row_wise" for t in TABLES}
    plan = js.sharding.ShardingPlan(
        COLL, m, "model", kinds, routing="all_to_all", capacity=1
    )
    params = plan.shard(COLL.init(jax.random.key(0)))
    ids = jax.device_put(_batch(0)[0], NamedSharding(m, P("model")))
    with pytest.raises(Exception, match=r"more than capacity=1 slots") as info:
        jax.block_until_ready(jax.jit(plan.concat)(params, ids))
    message = str(info.value)
    name = "dim8" if "buffer 'dim8_float32_sharded'" in message else "dim4"
    assert f"ShardingPlan buffer '{name}_float32_sharded' (routing=" in message
    assert f"Give the plan capacity={{'{name}_float32_sharded': " in message


def test_the_capacity_estimate_is_the_smallest_that_runs():
    """margin=1, multiple=1: the estimate runs, one less overflows."""
    m = _mesh.mesh((8,), ("model",))
    kinds = {t.name: "row_wise" for t in TABLES}
    plan = js.sharding.ShardingPlan(COLL, m, "model", kinds)
    samples = _samples()
    caps = plan.estimate_capacity(samples, padding_id=-1, margin=1.0, multiple=1)
    params = plan.shard(COLL.init(jax.random.key(0)))
    batches = [jax.device_put(s, NamedSharding(m, P("model"))) for s in samples]
    for name, cap in caps.items():
        for c, ok in ((cap, True), (cap - 1, False)):
            if c < 1:
                continue
            routed = js.sharding.ShardingPlan(
                COLL, m, "model", kinds, routing="all_to_all",
                capacity={**caps, name: c},
            )  # fmt: skip
            run = jax.jit(functools.partial(routed.concat, padding_id=-1))
            if ok:
                for ids in batches:
                    jax.block_until_ready(run(params, ids))
            else:
                with pytest.raises(Exception, match="more than capacity"):
                    for ids in batches:
                        jax.block_until_ready(run(params, ids))


def test_the_cost_model_chooses_the_routing():
    """Without a capacity an all-to-all moves what masked routing moves, so
    masked is chosen; with one from the data it moves less; a tiny batch on two
    devices stays masked (the collectives' latency)."""
    m = _mesh.mesh((8,), ("model",))
    big = js.EmbeddingCollection([js.TableConfig("t", rows=100_000, dim=64)])
    kinds = {"t": "row_wise"}
    rng = np.random.default_rng(0)
    samples = [{"t": rng.integers(0, 100_000, (4096, 4))} for _ in range(2)]
    unsized = js.sharding.ShardingPlan(big, m, "model", kinds, batch_size=4096 * 4)
    assert unsized.routing == {"dim64_float32_sharded": "masked"}
    routed = js.sharding.ShardingPlan(
        big, m, "model", kinds, samples=samples, batch_size=4096 * 4
    )
    assert routed.routing == {"dim64_float32_sharded": "all_to_all"}
    masked = js.sharding.ShardingPlan(
        big, m, "model", kinds, capacity=routed.capacity, batch_size=4096 * 4,
        routing="masked",
    )  # fmt: skip
    assert routed.tables["t"].comm_bytes < masked.tables["t"].comm_bytes / 4
    two = _mesh.mesh((2,), ("model",))
    tiny = [{"t": rng.integers(0, 100_000, (4, 1))}]
    assert js.sharding.ShardingPlan(big, two, "model", kinds, samples=tiny,
                                    batch_size=4).routing == {
        "dim64_float32_sharded": "masked"}  # fmt: skip
    chosen = js.sharding.plan_collection(
        big, m, "model", batch_size=4096 * 4, samples=samples,
        overrides={"t": "row_wise"},
    )  # fmt: skip
    assert chosen.routing == {"dim64_float32_sharded": "all_to_all"}


def test_communication_is_batch_sized_not_table_sized():
    """The mixed plan's step at two table scales: the same collectives. (With
    tiny tables XLA may all-gather one, cheaper than routing rows: the tables
    here are large enough that it does not.)"""
    m = _mesh.mesh((8,), ("model",))
    totals = []
    for scale in (32, 128):
        tables = [
            js.TableConfig(t.name, t.rows * scale, t.dim, t.features, t.combiner)
            for t in TABLES
        ]
        coll = js.EmbeddingCollection(tables)
        ids_per_step = {t.name: 3 * B * len(t.features) for t in tables}
        plan = js.sharding.ShardingPlan(
            coll, m, "model", PLANS["mixed"], ids_per_step=ids_per_step
        )
        emb = plan.shard(coll.init(jax.random.key(0)))
        params = {"emb": emb, "w": jax.device_put(jnp.zeros(44), NamedSharding(m, P()))}
        tx = _tx(plan)
        state = js.sharding.sharded_init(tx, params)
        ids, y = jax.device_put(_batch(0, scale), NamedSharding(m, P("model")))

        def step(params, state, ids, y, plan=plan, tx=tx):
            g = js.grad(functools.partial(_loss, plan))(params, ids, y)
            u, state = tx.update(g, state, params)
            return js.apply_updates(params, u), state

        compiled = jax.jit(step).lower(params, state, ids, y).compile()
        # no collective holds 4800 elements: a shard of "b" holds 9600 (1200
        # rows of 8) at the smaller scale; the largest batch array, 2048
        _hlo.assert_no_table_sized(compiled, 4800, 1)
        totals.append(_hlo.total_bytes(compiled))
        est = sum(p.comm_bytes for p in plan.tables.values())
        assert est / 4 <= totals[-1] <= 4 * est, (totals[-1], est)  # its order
    assert totals[0] == totals[1], totals  # independent of the tables' sizes


def test_planner_chooses_by_size_and_memory_and_takes_overrides():
    m = _mesh.mesh((8,), ("model",))
    coll = js.EmbeddingCollection(
        [
            js.TableConfig("tiny", rows=10, dim=8),
            js.TableConfig("mid", rows=40_000, dim=8),
            js.TableConfig("huge", rows=1_000_000, dim=8),
            js.TableConfig("wide", rows=50_000, dim=16),
            js.TableConfig("narrow", rows=10, dim=4),
        ]
    )
    limit = 8_000_000  # bytes per device: "huge" (36 MB with state) is split
    p = js.sharding.plan_collection(
        coll, m, "model", batch_size=64, device_memory=limit
    )
    kinds = {t: p.tables[t].kind for t in p.tables}
    assert kinds == {
        "tiny": "data_parallel",
        "mid": "table_wise",
        "huge": "row_wise",
        "wide": "table_wise",
        "narrow": "data_parallel",
    }
    assert p.tables["mid"].device != p.tables["wide"].device  # spread out
    assert max(p.memory_per_device()) <= limit
    q = js.sharding.plan_collection(
        coll, m, "model", batch_size=64, device_memory=limit,
        overrides={"wide": "column_wise", "mid": ("table_wise", 5)},
    )  # fmt: skip
    assert q.tables["wide"].kind == "column_wise" and q.tables["mid"].device == 5
    with pytest.raises(ValueError, match="'huge' .* does not fit"):
        js.sharding.plan_collection(
            coll, m, "model", batch_size=64, device_memory=100_000
        )
    with pytest.raises(ValueError, match="dim divisible by 8"):
        js.sharding.plan_collection(
            coll, m, "model", batch_size=64, overrides={"narrow": "column_wise"}
        )
    with pytest.raises(ValueError, match="missing"):
        js.sharding.ShardingPlan(coll, m, "model", {"tiny": "row_wise"})
    with pytest.raises(ValueError, match="kind must be one of"):
        js.sharding.ShardingPlan(
            coll, m, "model", {t.name: "rows" for t in coll.tables}
        )


@pytest.mark.parametrize("routing", ["masked", "all_to_all"])
def test_a_jagged_input_on_a_plan(routing):
    """A KeyedJaggedIds (replicated) through the mixed plan: the same pooling
    (all-to-all: its slots split in equal parts over the devices)."""
    m = _mesh.mesh((8,), ("model",))
    plan = js.sharding.ShardingPlan(
        COLL, m, "model", PLANS["mixed"], batch_size=B, routing=routing
    )
    params = COLL.init(jax.random.key(1))
    ids, _ = _batch(3)
    lists = {
        f: [[i for i in row if i != -1] for row in ids[f].tolist()] for f in FEATURES
    }
    kjt = js.KeyedJaggedIds.from_lists(lists, max_total=len(FEATURES) * B * 3)
    want = COLL(params, kjt)
    got = jax.jit(plan)(plan.shard(params), kjt)
    for f in FEATURES:
        np.testing.assert_allclose(got[f], want[f], rtol=1e-6, atol=1e-7)
    if routing == "all_to_all":  # the estimate from a jagged sample runs
        caps = plan.estimate_capacity([kjt], margin=1.0, multiple=1)
        tight = js.sharding.ShardingPlan(
            COLL, m, "model", PLANS["mixed"], routing=routing, capacity=caps
        )
        got = jax.jit(tight)(plan.shard(params), kjt)
        for f in FEATURES:
            np.testing.assert_allclose(got[f], want[f], rtol=1e-6, atol=1e-7)


def test_a_plans_concat_refuses_sequence_tables_like_the_collection():
    coll = js.EmbeddingCollection(
        [js.TableConfig("s", 16, 8, combiner=None, max_sequence_length=2)]
    )
    m = _mesh.mesh((8,), ("model",))
    plan = js.sharding.ShardingPlan(coll, m, "model", {"s": "row_wise"}, batch_size=B)
    params = plan.shard(coll.init(jax.random.key(0)))
    ids = {"s": jnp.zeros((B, 2), jnp.int32)}
    with pytest.raises(ValueError, match=r"ShardingPlan.concat: sequence tables"):
        plan.concat(params, ids)
    assert plan(params, ids)["s"].shape == (B, 2, 8)


def test_a_routed_plan_checkpoints_with_orbax_and_resumes(tmp_path):
    """The user's loop: train a routed plan (the DLRM-like mixed plan, lazy
    Adam state), save ``(params, state)`` with Orbax, restore into the plan's
    shardings in a fresh tree, resume: bitwise the uninterrupted run, and every
    restored array back on its device layout."""
    import orbax.checkpoint as ocp

    m = _mesh.mesh((8,), ("model",))
    plan = js.sharding.ShardingPlan(
        COLL, m, "model", ROWS_ONLY, routing="all_to_all", samples=_samples(),
        padding_id=-1,
    )  # fmt: skip
    tx = _optimizer(plan, "lazy_adam")
    params0 = {"emb": plan.shard(COLL.init(jax.random.key(0))),
               "w": _replicated(m, jnp.linspace(-1, 1, 44))}  # fmt: skip
    state0 = js.sharding.sharded_init(tx, params0)
    batch = NamedSharding(m, P("model"))
    batches = [jax.device_put(_batch(s), batch) for s in range(3)]

    @jax.jit
    def step(params, state, ids, y):
        g = js.grad(functools.partial(_loss, plan))(params, ids, y)
        return plan.update(tx, g, state, params)

    def run(params, state, part):
        for ids, y in part:
            params, state = step(params, state, ids, y)
        return params, state

    want = run(params0, state0, batches)
    saved = run(params0, state0, batches[:2])
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", saved)
    ckptr.wait_until_finished()
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), saved
    )
    restored = ckptr.restore(tmp_path / "ckpt", target)
    ckptr.close()
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got = run(*restored, batches[2:])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    one = plan.unshard(got[0]["emb"])  # and leave the mesh in coll.init's layout
    fresh = COLL.init(jax.random.key(0))
    assert {k: v.shape for k, v in one.items()} == {
        k: v.shape for k, v in fresh.items()
    }
