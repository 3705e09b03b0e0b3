"""One process of the multi-host test (``tests/scale/test_sharding_multihost.py``).

Run as ``python _multihost_worker.py PORT PROCESS_ID NUM_PROCESSES OUT_JSON``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``: joins the others
through ``jax.distributed`` on 127.0.0.1, builds one mesh over every process's
CPU devices, trains a few data-parallel and row-sharded (all-to-all) steps and
writes the largest difference to a single-device reference, computed in this
process on one local device, to ``OUT_JSON`` (also for an embedding
collection on a sharding plan, ``run_plan``, and a DLRM on a routed plan,
``run_dlrm``); then runs the steps of
``tests/_failure_cases.py`` that fail on one device (a device of process 1)
and writes what each raised in this process.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

js: Any = None  # jaxslices, imported after jax.distributed.initialize (see main)

V, D, B, L = 1024, 8, 32, 4


def loss_fn(params, ids, y, lookup):
    h = lookup(params["emb"], ids).mean(1)
    return jnp.mean((jnp.tanh(h) @ params["w"] - y) ** 2)


def reference(tx, params, batches):
    local = jax.local_devices()[0]
    params = jax.device_put(params, local)
    state = jax.device_put(tx.init(params), local)

    @jax.jit
    def step(params, state, ids, y):
        loss, g = js.value_and_grad(loss_fn)(params, ids, y, js.embedding_lookup)
        u, state = tx.update(g, state, params)
        return js.apply_updates(params, u), state

    for ids, y in batches:
        params, state = step(params, state, *jax.device_put((ids, y), local))
    return params


def global_array(x, sharding):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def run(mode: str) -> float:
    mesh = Mesh(np.array(jax.devices()), ("model",))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("model"))
    rng = np.random.default_rng(0)  # same data in every process
    params0 = {
        "emb": rng.normal(size=(V, D)).astype(np.float32),
        "w": rng.normal(size=(D,)).astype(np.float32),
    }
    batches = [
        (
            rng.integers(0, V // 8, size=(B, L)).astype(np.int32) * 7 % V,
            rng.normal(size=(B,)).astype(np.float32),
        )
        for _ in range(2)
    ]
    tx = js.lazy_adam(0.05)
    expect = reference(tx, params0, batches)

    table_sharding = rep if mode == "data_parallel" else rows
    params = {
        "emb": global_array(params0["emb"], table_sharding),
        "w": global_array(params0["w"], rep),
    }
    if mode == "data_parallel":
        state = jax.jit(tx.init, out_shardings=rep)(params)
        lookup = js.embedding_lookup

        def update(g, s, p):
            u, s = tx.update(g, s, p)
            return js.apply_updates(p, u), s

    else:
        state = js.sharding.sharded_init(tx, params)
        lookup = functools.partial(
            js.sharding.sharded_lookup, axis="model", routing="all_to_all"
        )
        update = functools.partial(
            js.sharding.sharded_update, tx, axis="model", routing="all_to_all"
        )

    @jax.jit
    def step(params, state, ids, y):
        loss, g = js.value_and_grad(loss_fn)(params, ids, y, lookup)
        return update(g, state, params)

    for ids, y in batches:
        params, state = step(
            params, state, global_array(ids, rows), global_array(y, rows)
        )
    assert params["emb"].sharding.is_equivalent_to(table_sharding, 2)
    got = multihost_utils.process_allgather(params, tiled=True)
    return max(
        float(np.max(np.abs(np.asarray(got[k]) - np.asarray(expect[k]))))
        for k in ("emb", "w")
    )


def run_plan() -> float:
    """A collection on a sharding plan (row-wise, table-wise, data-parallel
    tables) over every process's devices, against one local device."""
    mesh = Mesh(np.array(jax.devices()), ("model",))
    rows = NamedSharding(mesh, P("model"))
    coll = js.EmbeddingCollection(
        [
            js.TableConfig("big", 4000, D),
            js.TableConfig("mid", 900, D, features=("mid", "mid2"), combiner="mean"),
            js.TableConfig("small", 20, D),
        ]
    )
    plan = js.sharding.ShardingPlan(
        coll,
        mesh,
        "model",
        {"big": "row_wise", "mid": ("table_wise", 5), "small": "data_parallel"},
    )
    rng = np.random.default_rng(1)  # same data in every process
    emb0 = coll.init(jax.random.key(0))
    batches = [
        {f: rng.integers(-1, 300, size=(B, 2)).astype(np.int32) for f in coll.features}
        for _ in range(2)
    ]
    tx = js.rowwise_adagrad(0.3)

    def loss(lookup, emb, ids):
        return jnp.sum(jnp.tanh(lookup.concat(emb, ids, padding_id=-1)) ** 2)

    def train(lookup, emb, place):
        state = js.sharding.sharded_init(tx, emb) if place else tx.init(emb)

        @jax.jit
        def step(emb, state, ids):
            g = js.grad(functools.partial(loss, lookup))(emb, ids)
            u, state = tx.update(g, state, emb)
            return js.apply_updates(emb, u), state

        for ids in batches:
            ids = {f: global_array(x, rows) for f, x in ids.items()} if place else ids
            emb, state = step(emb, state, ids)
        return emb

    local = jax.local_devices()[0]
    expect = train(coll, jax.device_put(emb0, local), False)
    got = train(plan, plan.shard(emb0), True)
    got = plan.unshard(multihost_utils.process_allgather(got, tiled=True))
    return max(float(np.max(np.abs(got[k] - np.asarray(expect[k])))) for k in got)


def run_dlrm() -> float:
    """TorchRec's DLRM (``examples/dlrm.py``: 26 Criteo-shaped tables, dense
    and over arch, row-wise Adagrad and SGD) on a routed sharding plan over
    every process's devices (row-wise, table-wise and data-parallel tables,
    all-to-all routing, ``ShardingPlan.update``), against one local device."""
    from examples import criteo_synth as synth
    from examples import dlrm

    mesh = Mesh(np.array(jax.devices()), ("model",))
    rows = NamedSharding(mesh, P("model"))
    rep = NamedSharding(mesh, P())
    dim, batch = 8, 64
    sizes = synth.table_sizes(scale=1 / 2000, keep=40)
    coll = dlrm.make_collection(sizes, dim)
    kinds = {
        t.name: "row_wise" if t.rows > 1000 else "table_wise" if t.rows > 40
        else "data_parallel"
        for t in coll.tables
    }  # fmt: skip
    data = synth.CriteoSynth(tuple(sizes), batch, 1, seed=0)
    raw = [data.batch_at(i) for i in range(2)]
    batches = [
        (
            b.dense,
            {f: b.padded(1)[k] for k, f in enumerate(coll.features)},
            b.labels,
        )
        for b in raw
    ]
    plan = js.sharding.ShardingPlan(
        coll, mesh, "model", kinds, routing="all_to_all",
        samples=[ids for _, ids, _ in batches], padding_id=-1,
    )  # fmt: skip
    assert set(plan.routing.values()) == {"all_to_all"}, plan.routing
    init = dlrm.init_params(coll, synth.init_dlrm(sizes, dim, seed=0))
    tx = dlrm.make_optimizer(0.05, 0.1)

    def loss(lookup, params, dense, ids, labels):
        emb = lookup.concat(params["emb"], ids, padding_id=-1)
        emb = emb.reshape(emb.shape[0], len(coll.features), dim)
        return dlrm.head_loss(params, dense, emb, labels)

    local = jax.local_devices()[0]
    params = jax.device_put(init, local)
    state = tx.init(params)

    @jax.jit
    def one(params, state, dense, ids, labels):
        g = js.grad(functools.partial(loss, coll))(params, dense, ids, labels)
        u, state = tx.update(g, state, params)
        return js.apply_updates(params, u), state

    for dense, ids, labels in batches:
        params, state = one(params, state, *jax.device_put((dense, ids, labels), local))
    expect = params

    host = jax.tree.map(np.asarray, init)
    params = {
        "emb": plan.shard(host["emb"]),
        "bottom": [
            (global_array(w, rep), global_array(b, rep)) for w, b in host["bottom"]
        ],
        "top": [(global_array(w, rep), global_array(b, rep)) for w, b in host["top"]],
    }
    state = js.sharding.sharded_init(tx, params)

    @jax.jit
    def step(params, state, dense, ids, labels):
        g = js.grad(functools.partial(loss, plan))(params, dense, ids, labels)
        return plan.update(tx, g, state, params)

    for dense, ids, labels in batches:
        params, state = step(
            params,
            state,
            global_array(dense, rows),
            {f: global_array(x, rows) for f, x in ids.items()},
            global_array(labels, rows),
        )
    got = multihost_utils.process_allgather(params, tiled=True)
    emb = plan.unshard(got["emb"])
    diffs = [float(np.max(np.abs(emb[k] - np.asarray(expect["emb"][k])))) for k in emb]
    for part in ("bottom", "top"):
        for a, b in zip(
            jax.tree.leaves(got[part]), jax.tree.leaves(expect[part]), strict=True
        ):
            diffs.append(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))))
    return max(diffs)


def main(port: str, pid: int, nproc: int, out_path: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=nproc,
        process_id=pid,
        initialization_timeout=60,
        heartbeat_timeout_seconds=30,
        shutdown_timeout_seconds=30,
    )
    global js
    js = importlib.import_module("jaxslices")  # before or after initialize()
    failures = importlib.import_module("_failure_cases")
    result: dict = {"process": pid, "devices": jax.device_count(), "failures": {}}
    try:
        for mode in ("data_parallel", "row_sharded_all_to_all"):
            result[mode] = run(mode)
        result["collection_plan"] = run_plan()
        result["dlrm_plan"] = run_dlrm()
        # Steps that fail on one device (of process 1): every process raises.
        mesh = Mesh(np.array(jax.devices()), ("model",))
        for case in failures.CASES:
            result["failures"][case] = failures.run_case(case, mesh)
    except Exception:  # reported to the test, which fails with it
        result["error"] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
