"""Static capacities over a device mesh (8 CPU devices).

``max_distinct`` data parallel under plain ``jit`` (the batch sharded) and in
the row-sharded ``all_to_all`` update (the optimizer inside ``shard_map``): a
bound that holds gives one device's result; one that does not raises a
``JaxRuntimeError`` naming the bound on every device (no collective left
waiting), and the next, correct step runs. And
:func:`jaxslices.capacity.estimate_all_to_all_capacity` with no margin is
exactly the smallest ``capacity`` the lookups of its batches run with.
"""

from __future__ import annotations

import _mesh
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import registry
from helpers import CHECK_FAILED

import jaxslices as js

V, D, B, BAG = 64, 4, 16, 4


def _batch(distinct: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = rng.choice(V, size=distinct, replace=False)
    ids = np.r_[rows, rng.choice(rows, size=B * BAG - distinct)]
    rng.shuffle(ids)
    y = rng.normal(size=(B,)).astype(np.float32)
    return jnp.asarray(ids.reshape(B, BAG), jnp.int32), jnp.asarray(y)


def test_data_parallel_bound_holds_and_overflow_raises_on_every_device():
    m = _mesh.mesh()
    params = _mesh.init_params(V, D)
    ids, y = _batch(20)
    ref_tx = registry.optimizer("lazy_adam")
    ref = _mesh.reference_step(ref_tx)(params, ref_tx.init(params), ids, y)
    tx = js.lazy_adam(0.05, max_distinct=24)  # ref_tx with a bound
    step = jax.jit(_mesh.make_step(tx))
    got = step(*_mesh.data_parallel_args(m, tx, params, ids, y))
    _mesh.assert_trees_close(got[:2], ref[:2])
    bad_ids, bad_y = _batch(30, seed=1)
    with pytest.raises(CHECK_FAILED, match="max_distinct=24"):
        jax.block_until_ready(
            step(*_mesh.data_parallel_args(m, tx, params, bad_ids, bad_y))
        )
    after = step(*_mesh.data_parallel_args(m, tx, params, ids, y))
    assert np.isfinite(float(after[2]))


def test_all_to_all_update_with_a_bound_raises_inside_shard_map():
    m = _mesh.mesh(names=("model",))
    params = _mesh.init_params(V, D)
    tx = js.adagrad(0.5, max_distinct=4)  # per shard, after routing
    placed = {
        "emb": js.sharding.shard_rows(params["emb"], m, "model"),
        "w": jax.device_put(params["w"], _mesh.replicated(m)),
    }

    @jax.jit
    def step(params, state, ids, y):
        _, grads = js.value_and_grad(_mesh.loss_fn)(params, ids, y)
        return js.sharding.sharded_update(
            tx, grads, state, params, axis="model", routing="all_to_all", mesh=m
        )

    state = js.sharding.sharded_init(tx, placed)
    y = jnp.asarray(np.random.default_rng(0).normal(size=(B,)), jnp.float32)
    # One row on each of the 8 shards (8 rows each): 1 <= 4 distinct per shard.
    ids = jnp.asarray((np.arange(B * BAG) % 8 * 8).reshape(B, BAG), jnp.int32)
    new, _ = step(placed, state, ids, y)
    ref_tx = js.adagrad(0.5)
    ref_p, _ = js.sharding.sharded_update(
        ref_tx,
        js.value_and_grad(_mesh.loss_fn)(params, ids, y)[1],
        ref_tx.init(params),
        params,
        axis="model",
        routing="masked",
    )
    np.testing.assert_allclose(new["emb"], ref_p["emb"], rtol=1e-5, atol=1e-6)
    # Rows 0..7, all on shard 0: 8 distinct rows there.
    crowded = jnp.asarray((np.arange(B * BAG) % 8).reshape(B, BAG), jnp.int32)
    with pytest.raises(CHECK_FAILED, match="max_distinct=4"):
        jax.block_until_ready(step(placed, state, crowded, y))


def test_the_all_to_all_estimate_is_the_smallest_capacity_that_runs():
    m = _mesh.mesh(names=("model",))
    rng = np.random.default_rng(5)
    batches = [rng.zipf(1.3, size=(B, BAG)) % V for _ in range(3)]
    need = js.capacity.estimate_all_to_all_capacity(
        batches, num_rows=V, num_shards=8, margin=1.0, multiple=1
    )
    rows = jnp.arange(V * D, dtype=jnp.float32).reshape(V, D)
    table = js.sharding.shard_rows(rows, m, "model")

    def lookup(capacity):
        return jax.jit(
            lambda t, i: js.sharding.sharded_lookup(
                t, i, axis="model", routing="all_to_all", capacity=capacity, mesh=m
            )
        )

    assert need > 1
    for ids in batches:
        got = lookup(need)(table, jnp.asarray(ids, jnp.int32))
        np.testing.assert_array_equal(got, np.asarray(table)[ids])
    worst = max(
        batches,
        key=lambda b: js.capacity.estimate_all_to_all_capacity(
            [b], num_rows=V, num_shards=8, margin=1.0, multiple=1
        ),
    )
    with pytest.raises(CHECK_FAILED, match=f"capacity={need - 1}"):
        jax.block_until_ready(lookup(need - 1)(table, jnp.asarray(worst, jnp.int32)))
