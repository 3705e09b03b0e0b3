"""Sharding plans on 8 CPU devices: every plan trains to one device's numbers,
and no step moves a table (the compiled HLO's collectives grow with the batch,
not with the tables)."""

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


def _train(lookup, params, batches, sharding=None, elementwise=False):
    tx = _tx(lookup, elementwise)
    state = (
        js.sharding.sharded_init(tx, params)
        if sharding is not None
        else tx.init(params)
    )

    @jax.jit
    def step(params, state, ids, y):
        loss, g = js.value_and_grad(functools.partial(_loss, lookup))(params, ids, y)
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
def _single(elementwise):
    """One device's run on the batches of the plan tests (computed once)."""
    params = {"emb": COLL.init(jax.random.key(0)), "w": jnp.linspace(-1, 1, 44)}
    batches = [_batch(s) for s in range(2)]
    return params, _train(COLL, params, batches, elementwise=elementwise)[:2]


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


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_plan_trains_like_one_device(name):
    m = _mesh.mesh((8,), ("model",))
    plan = js.sharding.ShardingPlan(COLL, m, "model", PLANS[name], batch_size=B)
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


def test_a_jagged_input_on_a_plan():
    """A KeyedJaggedIds (replicated) through the mixed plan: the same pooling."""
    m = _mesh.mesh((8,), ("model",))
    plan = js.sharding.ShardingPlan(COLL, m, "model", PLANS["mixed"], batch_size=B)
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
