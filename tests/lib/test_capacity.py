"""``jaxslices.capacity``: estimates of static sizes from sample batches.

Each estimate with ``margin=1, multiple=1`` must be exactly the count a
brute-force replay gives, and (for ``MultiSteps``) exactly the smallest
capacity that runs; the all-to-all estimate is checked on a mesh in
``tests/scale/test_capacity_mesh.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CHECK_FAILED

import jaxslices as js
from jaxslices import capacity

EXACT = {"margin": 1.0, "multiple": 1}


def zipf_batches(n=4, shape=(64, 4), num_rows=500, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.zipf(1.2, size=shape) % num_rows for _ in range(n)]


def test_distinct_rows_counts_valid_ids_only():
    assert capacity.distinct_rows([[3, 1, 3], [7, -1, 1]]) == 3
    assert capacity.distinct_rows(jnp.array([3, 1, 3, 7, -1, 1]), num_rows=5) == 2
    with pytest.raises(TypeError, match="ids must be integers"):
        capacity.distinct_rows([0.5])


def test_max_distinct_is_the_largest_count_with_margin_and_rounding():
    batches = zipf_batches()
    most = max(len(np.unique(b)) for b in batches)
    assert capacity.estimate_max_distinct(batches, **EXACT) == most
    got = capacity.estimate_max_distinct(batches, margin=1.5, multiple=32)
    assert got % 32 == 0 and most * 1.5 <= got < most * 1.5 + 32
    # Never more than the lookups of a batch (that bound never overflows).
    assert capacity.estimate_max_distinct(batches, margin=100.0) == 64 * 4
    # Invalid ids are not rows.
    assert capacity.estimate_max_distinct([[0, 1, 9, -2]], num_rows=5, **EXACT) == 2


def test_max_distinct_per_table_and_the_bound_it_gives_runs():
    batches = [{"user": b, "item": b // 2} for b in zipf_batches()]
    got = capacity.estimate_max_distinct(batches, **EXACT)
    assert set(got) == {"user", "item"} and got["item"] <= got["user"]
    # The estimate is a bound the optimizer accepts for every sample batch,
    # and one slot fewer is not (for the batch that set it).
    v = 500
    params = {"emb": jnp.zeros((v, 2))}
    for k, raises in [(got["user"], False), (got["user"] - 1, True)]:
        tx = js.adagrad(0.1, max_distinct=k)
        state = tx.init(params)
        update = jax.jit(tx.update)
        outcomes = []
        for b in [x["user"] for x in batches]:
            ids = jnp.asarray(b.reshape(-1), jnp.int32)
            g = {"emb": js.IndexedSlices(jnp.ones((ids.size, 2)), ids, (v, 2))}
            try:
                jax.block_until_ready(update(g, state, params))
                outcomes.append(False)
            except CHECK_FAILED:
                outcomes.append(True)
        assert any(outcomes) == raises


def test_multisteps_estimate_is_the_smallest_capacity_that_runs():
    k, v = 3, 200
    micro = zipf_batches(n=6, shape=(8, 4), num_rows=v, seed=1)
    need = capacity.estimate_multisteps_capacity(micro, every_k=k, **EXACT)
    windows = [len(np.unique(np.concatenate(micro[i : i + k]))) for i in range(4)]
    assert need == max(windows) and 32 < need < k * 32
    params = {"emb": jnp.zeros((v, 2))}

    def accumulate(cap):
        ms = js.MultiSteps(js.sgd(0.1), every_k_schedule=k, capacity={"emb": cap})
        update = jax.jit(ms.update)
        for start in range(len(micro) - k + 1):  # every window, as estimated
            state = ms.init(params)
            for b in micro[start : start + k]:
                ids = jnp.asarray(b.reshape(-1), jnp.int32)
                g = {"emb": js.IndexedSlices(jnp.ones((32, 2)), ids, (v, 2))}
                _, state = update(g, state, params)
        return state

    accumulate(need)
    with pytest.raises(CHECK_FAILED, match=f"capacity={need - 1} slots"):
        jax.block_until_ready(accumulate(need - 1))
    # Bounds: one micro-batch's slots at least, k times that at most.
    assert capacity.estimate_multisteps_capacity(micro, every_k=1, **EXACT) == 32
    assert capacity.estimate_multisteps_capacity(micro, every_k=3, margin=9.0) == 96


def test_all_to_all_estimate_replays_the_routing():
    # 2 devices x 2 shards of 4 rows: device 0 sends {0, 1} to shard 0,
    # device 1 sends {6, 7} to shard 1 and {3} to shard 0.
    ids = np.array([[0, 1], [1, 1], [6, 7], [3, 7]])
    assert (
        capacity.estimate_all_to_all_capacity([ids], num_rows=8, num_shards=2, **EXACT)
        == 2
    )
    # Four devices (two replicas of each shard): each sends at most 2.
    assert (
        capacity.estimate_all_to_all_capacity(
            [ids], num_rows=8, num_shards=2, num_devices=4, **EXACT
        )
        == 2
    )
    with pytest.raises(ValueError, match="does not split evenly over 3 devices"):
        capacity.estimate_all_to_all_capacity(
            [ids], num_rows=8, num_shards=2, num_devices=3
        )
    with pytest.raises(ValueError, match="not a multiple of num_shards=3"):
        capacity.estimate_all_to_all_capacity(
            [ids], num_rows=8, num_shards=3, num_devices=2
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"margin": 0.5}, "`margin` must be >= 1"),
        ({"multiple": 0}, "`multiple` must be a positive int"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        capacity.estimate_max_distinct([[1, 2]], **kwargs)
    with pytest.raises(ValueError, match="no sample batches"):
        capacity.estimate_max_distinct([])
    with pytest.raises(ValueError, match="at least every_k=3"):
        capacity.estimate_multisteps_capacity([[1], [2]], every_k=3)
    with pytest.raises(ValueError, match="structure of the first"):
        capacity.estimate_max_distinct([{"a": [1]}, {"b": [1]}])


def test_all_to_all_estimate_refuses_a_dict_of_tables():
    batch = {"user": np.arange(4), "item": np.arange(4)}
    with pytest.raises(TypeError, match=r"a batch is a dict .* once per table"):
        js.capacity.estimate_all_to_all_capacity([batch], num_rows=8, num_shards=2)
