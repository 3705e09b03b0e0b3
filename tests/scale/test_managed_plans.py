"""Managed-collision tables in sharding plans on 8 CPU devices.

The remap runs before the lookup's routing on a replicated remap state
(``remap_keyed(..., plan)``): every device remaps the whole batch, and the
plan routes the remapped rows (masked or all-to-all). A run with a managed
table placed row-wise or table-wise, admitting and evicting (rows and their
optimizer state reset), equals one device's run: the remap states bitwise,
the losses, tables and optimizer state to float tolerance.
"""

from __future__ import annotations

import functools

import _mesh
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxslices as js

B, D, STEPS = 16, 8, 3
TABLES = (
    js.TableConfig("items", rows=20, dim=D, features=("item", "clicked")),
    js.TableConfig("users", rows=12, dim=D),
    js.TableConfig("country", rows=10, dim=D),
)
COLL = js.EmbeddingCollection(TABLES)
MANAGERS = {
    "items": js.ManagedCollision(
        "items", num_slots=20, policy="lru", evict_every=2, evict_count=6, ttl=3
    ),
    # a decayed LFU (and the items' time-to-live): the policies on a plan
    "users": js.ManagedCollision(
        "users",
        num_slots=12,
        policy="lfu",
        evict_every=2,
        evict_count=4,
        half_life=2,
    ),  # fmt: skip
}
#: one plan holds both kinds: items row-wise, users table-wise (one buffer)
KINDS = {"items": "row_wise", "users": ("table_wise", 5), "country": "data_parallel"}
MAX_TOTAL = 4 * B * 3  # four features of bags up to 3 ids: divisible by 8


def _batches():
    """Keyed jagged batches of raw ids: the items' pool drifts (evictions)."""
    rng = np.random.default_rng(0)
    out = []
    for t in range(STEPS):
        lists = {}
        for f, pool in (("item", 24), ("clicked", 24), ("users", 9), ("country", 10)):
            lengths = rng.integers(0, 4, size=B)
            base = 0 if f == "country" else 10**9 + 9 * t
            lists[f] = [
                (base + rng.integers(0, pool, size=n)).tolist() for n in lengths
            ]
        kjt = js.KeyedJaggedIds.from_lists(lists, max_total=MAX_TOTAL)
        out.append((kjt, rng.normal(size=(B,)).astype(np.float32)))
    return out


def _tx():
    return js.adagrad(0.3, initial_accumulator_value=0.1)


def _train(face, params, batches, routed):
    tx = _tx()
    state = js.sharding.sharded_init(tx, params) if routed else tx.init(params)
    rstates = {k: m.init() for k, m in MANAGERS.items()}

    def loss(params, kjt, y):
        h = jnp.tanh(face.concat(params["emb"], kjt))
        return jnp.mean((h @ params["w"] - y) ** 2)

    @jax.jit
    def step(params, state, rstates, kjt, y, t):
        kjt, rstates, evicted = js.remap_keyed(MANAGERS, rstates, kjt, face)
        for table, rows in evicted.items():
            buffer = face.layout.placement(table).buffer
            fresh = 0.1 * jax.random.normal(
                jax.random.fold_in(jax.random.key(5), t), (rows.shape[0], D)
            )
            params, state = js.reset_rows(
                params, state, rows, fresh,
                where=lambda p, b=buffer: p["emb"][b], optimizer=tx,
            )  # fmt: skip
        value, grads = js.value_and_grad(loss)(params, kjt, y)
        if routed:
            params, state = face.update(tx, grads, state, params)
        else:
            updates, state = tx.update(grads, state, params)
            params = js.apply_updates(params, updates)
        return params, state, rstates, value

    losses = []
    for t, (kjt, y) in enumerate(batches):
        params, state, rstates, value = step(params, state, rstates, kjt, y, t)
        losses.append(float(value))
    return params, state, rstates, losses


@functools.lru_cache
def _one_device():
    params = {"emb": COLL.init(jax.random.key(0)), "w": jnp.linspace(-1, 1, 4 * D)}
    return _train(COLL, params, _batches(), routed=False)


def _accumulators(state):
    """The Adagrad accumulators of the embedding buffers."""
    return state[0].sum_of_squares["emb"]


@pytest.mark.parametrize("routing", ["all_to_all", "masked"])
def test_managed_tables_in_a_plan_train_like_one_device(routing):
    """A row-wise and a table-wise managed table, evicting in step 2."""
    m = _mesh.mesh((8,), ("model",))
    plan = js.sharding.ShardingPlan(COLL, m, "model", KINDS, routing=routing)
    assert set(plan.routing.values()) == {routing}
    want_params, want_state, want_rstates, want_losses = _one_device()
    params0 = {"emb": COLL.init(jax.random.key(0)), "w": jnp.linspace(-1, 1, 4 * D)}
    params = {
        "emb": plan.shard(params0["emb"]),
        "w": jax.device_put(params0["w"], NamedSharding(m, P())),
    }
    got, state, rstates, losses = _train(plan, params, _batches(), routed=True)
    for table, mc in MANAGERS.items():
        stats = {k: int(v) for k, v in rstates[table].stats().items()}
        assert stats["evictions"] > 0 and stats["admissions"] > mc.num_slots, stats
    for a, b in zip(
        jax.tree.leaves(rstates), jax.tree.leaves(want_rstates), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    emb = plan.unshard(got["emb"])
    for k in emb:
        np.testing.assert_allclose(emb[k], want_params["emb"][k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["w"], want_params["w"], rtol=1e-5, atol=1e-6)
    acc = plan.unshard(_accumulators(state))
    want_acc = _accumulators(want_state)
    for k in acc:
        np.testing.assert_allclose(acc[k], want_acc[k], rtol=1e-5, atol=1e-6)
    for buf, sharding in plan.shardings().items():  # the step keeps the layout
        assert got["emb"][buf].sharding.is_equivalent_to(sharding, 2)


def test_evicted_slots_are_rows_of_the_plans_buffer():
    """A row-wise table's slot ``i`` lives in chunk ``i // ceil(rows / n)``;
    the remap runs the native kernels (in ``shard_map``) where they exist."""
    m = _mesh.mesh((8,), ("model",))
    plan = js.sharding.ShardingPlan(COLL, m, "model", KINDS)
    # the second call evicts every slot (evict_count = num_slots)
    mc = js.ManagedCollision("items", num_slots=20, evict_every=2, evict_count=20)
    full = {"items": mc.remap(mc.init(), np.arange(20) + 10**6)[1]}
    kjt = js.KeyedJaggedIds.from_lists(
        {"item": [[5]], "clicked": [[]], "users": [[]], "country": [[1]]},
        max_total=8,
    )
    remap = jax.jit(lambda s, k: js.remap_keyed({"items": mc}, s, k, plan))
    compiled = remap.lower(full, kjt).compile()
    if js.kernels.available():  # in shard_map: the native kernels on every device
        assert "jaxslices_managed_admit" in compiled.as_text()
    _, _, evicted = compiled(full, kjt)
    placement = plan.layout.placement("items")
    assert placement.chunk == 3  # ceil(20 / 8)
    want = placement.rows_of(np.arange(20))  # slots 0..19, in increasing order
    np.testing.assert_array_equal(evicted["items"], want)
    buffer = plan.layout.buffer(placement.buffer)
    # every evicted row is a row of the table, none of another
    owners = {r: t for start, n, t in buffer.segments for r in range(start, start + n)}
    assert {owners[int(r)] for r in evicted["items"]} == {"items"}


def test_a_column_wise_managed_table_is_refused():
    m = _mesh.mesh((8,), ("model",))
    plan = js.sharding.ShardingPlan(COLL, m, "model", {**KINDS, "items": "column_wise"})
    kjt = js.KeyedJaggedIds.from_lists(
        {"item": [[5]], "clicked": [[]], "users": [[]], "country": [[1]]},
        max_total=8,
    )
    states = {k: m.init() for k, m in MANAGERS.items()}
    with pytest.raises(ValueError, match=r"'items' is placed column-wise"):
        js.remap_keyed(MANAGERS, states, kjt, plan)
    with pytest.raises(TypeError, match=r"EmbeddingCollection or a .*ShardingPlan"):
        js.remap_keyed(MANAGERS, states, kjt, object())
