"""Weak scaling of sharding plans: per-device rows and bytes from the compiled HLO.

The global batch grows with the devices (a fixed batch per device), the
tables do not. For each device count ``n`` (2, 4, 8, and more where the host
has them), each plan kind, each routing of the sharded buffers and each
optimizer, the step (lookup, ``jaxslices.value_and_grad``,
``ShardingPlan.update``) is compiled on a mesh of ``n`` CPU devices and its
HLO read (``tools/hlo.py``):

* ``gathered_rows``: rows one device reads from its tables and their
  optimizer state (the lookups' and the optimizer's gathers, compiled with
  the native kernels off so that every read is an HLO gather);
* ``comm_bytes``: bytes one device sends or receives in the step's
  collectives (each collective's larger side);
* the cost model's estimate of both (``jaxslices.sharding._cost``).

Workloads (uniform ids; ``--ids zipf`` for skewed ones):

* ``8 tables``: 8 tables of 8192 x 16 (65,536 rows), one feature each, one
  id per feature (Criteo's shape), ``--batch`` examples per device; plans:
  data-parallel, table-wise, row-wise, column-wise, mixed (2 of each kind);
* ``1 table``: one 65,536 x 16 table, row-wise, bags of 8 ids,
  ``--batch`` bags per device (the workload of issue 29's measurement).

Routings: ``masked`` (the partitioner's, every device sees the global
batch: the plans before issue 29) and ``all_to_all`` with capacities
estimated from the benchmark's batches (``ShardingPlan.estimate_capacity``,
margin 1.25, multiples of 8). Each configuration runs one step (its loss
must be finite); CPU devices share the machine's cores, so no time is
reported: the rows and bytes are the scaling figures.

Run: ``python benchmarks/plan_scale_bench.py --out
benchmarks/results/<yyyy-mm>-cpu-plans``. Sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` when XLA_FLAGS is unset.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _common import environment, progress, save_json  # noqa: E402
from _repo import load  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxslices as js  # noqa: E402

hlo = load("tools.hlo")  # the HLO parser shared with the tests

OPTIMIZERS = {
    "sgd": lambda: js.sgd(0.1),
    "sgd_momentum": lambda: js.sgd(0.1, momentum=0.9),
    "clip_sgd": lambda: optax.chain(js.clip_by_global_norm(1.0), js.sgd(0.1)),
    "adagrad": lambda: js.adagrad(0.1),
    "rowwise_adagrad": lambda: js.rowwise_adagrad(0.1),
    "lazy_adam": lambda: js.lazy_adam(0.01),
    "lazy_adamw": lambda: js.lazy_adamw(0.01, weight_decay=0.01),
    "ftrl": lambda: js.ftrl(0.1),
}
PLANS = ("data_parallel", "table_wise", "row_wise", "column_wise", "mixed")
ROUTINGS = ("masked", "all_to_all")
#: The plan kinds the goal is about: per-device rows and bytes at 8 devices
#: within 1.25x of 2 devices, all-to-all routing.
GOAL_KINDS = ("table_wise", "row_wise", "row_wise (1 table)")
GOAL = 1.25


def workload(name: str, rows: int, dim: int):
    """``(collection, bag length)`` of a workload."""
    if name == "1 table":
        return js.EmbeddingCollection([js.TableConfig("t", rows, dim)]), 8
    per = rows // 8
    tables = [js.TableConfig(f"t{i}", per, dim) for i in range(8)]
    return js.EmbeddingCollection(tables), 1


def kinds_of(plan: str, coll) -> dict:
    names = [t.name for t in coll.tables]
    if plan == "mixed":
        kinds = ["data_parallel", "table_wise", "row_wise", "column_wise"]
        return {t: kinds[i // 2] for i, t in enumerate(names)}
    if plan == "row_wise (1 table)":
        return {t: "row_wise" for t in names}
    return {t: plan for t in names}


def batches(coll, n: int, per_device: int, bag: int, num: int, seed: int, dist):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        b = {}
        for f in coll.features:
            rows = coll.table_config(coll.table_of(f)).rows
            shape = (per_device * n, bag)
            if dist == "zipf":
                ids = rng.zipf(1.2, size=shape) % rows
            else:
                ids = rng.integers(0, rows, size=shape)
            b[f] = ids.astype(np.int32)
        out.append(b)
    return out


def loss_fn(plan, params, ids, y):
    h = plan.concat(params["emb"], ids)
    return jnp.mean((jnp.tanh(h) @ params["w"] - y) ** 2)


def shard_rows(plan) -> set[int]:
    """The rows each device holds of each buffer (what a table gather reads)."""
    out = set()
    for b in plan.buffers:
        out.add(b.rows // plan.devices if b.sharded else b.rows)
    return out


def measure(workload_name, plan_name, routing, optimizer, n, args) -> dict:
    coll, bag = workload(workload_name, args.rows, args.dim)
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    samples = batches(coll, n, args.batch, bag, 2, args.seed, args.ids)
    kinds = kinds_of(plan_name, coll)
    ids_per_step = {t.name: args.batch * n * bag * len(t.features) for t in coll.tables}
    plan = js.sharding.ShardingPlan(
        coll,
        mesh,
        "x",
        kinds,
        routing=routing,
        samples=samples if routing == "all_to_all" else None,
        ids_per_step=ids_per_step,
    )
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    params = {
        "emb": plan.shard(coll.init(jax.random.key(args.seed))),
        "w": jax.device_put(jnp.zeros(args.dim * len(coll.features)), rep),
    }
    tx = OPTIMIZERS[optimizer]()
    state = js.sharding.sharded_init(tx, params)
    y = jax.device_put(np.ones(args.batch * n, np.float32), split)
    ids = jax.device_put(samples[0], split)

    def step(params, state, ids, y):
        loss, g = js.value_and_grad(functools.partial(loss_fn, plan))(params, ids, y)
        params, state = plan.update(tx, g, state, params)
        return params, state, loss

    start = time.perf_counter()
    with js.kernels.disabled():  # every table read an HLO gather
        compiled = jax.jit(step).lower(params, state, ids, y).compile()
    compile_s = time.perf_counter() - start
    found = hlo.collectives(compiled)
    _, _, loss = compiled(params, state, ids, y)
    sharded = [p for p in plan.tables.values() if p.kind != "data_parallel"]
    return {
        "workload": workload_name,
        "plan": plan_name,
        "routing": routing,
        "optimizer": optimizer,
        "devices": n,
        "global_batch": args.batch * n,
        "ids_per_device": args.batch * bag * len(coll.features),
        "capacity": {k: v for k, v in plan.capacity.items() if v is not None},
        "routing_of_buffers": dict(plan.routing),
        "gathered_rows": hlo.gathered_rows(compiled, shard_rows(plan)),
        "comm_bytes": sum(c.bytes for c in found),
        "collectives": {k: sum(c.kind == k for c in found) for k in hlo.KINDS},
        "largest_collective_bytes": max((c.bytes for c in found), default=0),
        "model_comm_bytes": sum(p.comm_bytes for p in plan.tables.values()),
        "model_sharded_comm_bytes": sum(p.comm_bytes for p in sharded),
        "loss": float(loss),
        "compile_s": round(compile_s, 2),
    }


def configs(args):
    for optimizer in args.optimizers:
        for plan in args.plans:
            for routing in ROUTINGS:
                if plan == "data_parallel" and routing == "all_to_all":
                    continue  # nothing to route
                yield "8 tables", plan, routing, optimizer
        if "row_wise" in args.plans:
            for routing in ROUTINGS:
                yield "1 table", "row_wise (1 table)", routing, optimizer


def ratios(rows: list[dict], devices: tuple[int, ...]) -> list[dict]:
    """Per (plan, routing, optimizer): each figure at n devices over the first n."""
    out = []
    keys = sorted({(r["plan"], r["routing"], r["optimizer"]) for r in rows})
    lo = devices[0]
    for plan, routing, opt in keys:
        mine = {
            r["devices"]: r
            for r in rows
            if (r["plan"], r["routing"], r["optimizer"]) == (plan, routing, opt)
        }
        if lo not in mine:
            continue
        entry = {"plan": plan, "routing": routing, "optimizer": opt}
        for n in devices[1:]:
            if n in mine:
                for k in ("gathered_rows", "comm_bytes"):
                    base = mine[lo][k]
                    entry[f"{k}_{n}_over_{lo}"] = (
                        None if not base else round(mine[n][k] / base, 3)
                    )
        out.append(entry)
    return out


def goal(report: dict) -> dict:
    """The goal's verdict: all-to-all, 8 devices over 2, row-wise and table-wise."""
    out = {}
    for r in report["ratios"]:
        if r["routing"] != "all_to_all" or r["plan"] not in GOAL_KINDS:
            continue
        g, c = r.get("gathered_rows_8_over_2"), r.get("comm_bytes_8_over_2")
        if g is None or c is None:
            continue
        out[f"{r['plan']} / {r['optimizer']}"] = {
            "gathered_rows": g,
            "comm_bytes": c,
            "met": g <= GOAL and c <= GOAL,
        }
    return out


def main(args) -> dict:
    devices = tuple(n for n in args.devices if n <= len(jax.devices()))
    todo = [(c, n) for c in configs(args) for n in devices]
    bar = progress(len(todo), "plan_scale_bench")
    rows = []
    for (wl, plan, routing, opt), n in todo:
        rows.append(measure(wl, plan, routing, opt, n, args))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    report = {
        **environment(),
        "workload": {
            "rows": args.rows,
            "dim": args.dim,
            "batch_per_device": args.batch,
            "ids": args.ids,
            "capacity": "estimated from the batches, margin 1.25, multiple 8",
            "xla_path": "compiled with jaxslices.kernels.disabled()",
        },
        "devices": list(devices),
        "rows": rows,
    }
    report["ratios"] = ratios(rows, devices)
    report["goal"] = goal(report)
    report["table"] = markdown_table(report)
    print(report["table"])
    name = "plan_scale_bench_cpu" + ("" if args.ids == "uniform" else f"_{args.ids}")
    save_json(report, args.out, f"{name}.json")
    return report


def markdown_table(report: dict, optimizer: str = "rowwise_adagrad") -> str:
    """Per plan and routing (one optimizer): rows and KB per device, by devices."""
    rows = [r for r in report["rows"] if r["optimizer"] == optimizer]
    if not rows:
        rows = [
            r
            for r in report["rows"]
            if r["optimizer"] == report["rows"][0]["optimizer"]
        ]
    devices = report["devices"]
    head = ["plan", "routing"]
    head += [f"rows @{n}" for n in devices] + [f"KB @{n}" for n in devices]
    head += [f"{devices[-1]} / {devices[0]} (rows, bytes)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    keys = []
    for r in rows:
        if (r["plan"], r["routing"]) not in keys:
            keys.append((r["plan"], r["routing"]))
    for plan, routing in keys:
        by_n = {
            r["devices"]: r
            for r in rows
            if (r["plan"], r["routing"]) == (plan, routing)
        }
        cells = [plan, routing]
        cells += [
            f"{by_n[n]['gathered_rows']:,}" if n in by_n else "-" for n in devices
        ]
        cells += [
            f"{by_n[n]['comm_bytes'] / 1024:,.0f}" if n in by_n else "-"
            for n in devices
        ]
        lo, hi = by_n.get(devices[0]), by_n.get(devices[-1])
        if lo and hi and lo["gathered_rows"] and lo["comm_bytes"]:
            cells.append(
                f"{hi['gathered_rows'] / lo['gathered_rows']:.2f}x, "
                f"{hi['comm_bytes'] / lo['comm_bytes']:.2f}x"
            )
        else:
            cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse(argv=None):
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--devices", type=int, nargs="+", default=[2, 4, 8])
    a.add_argument("--rows", type=int, default=65536)
    a.add_argument("--dim", type=int, default=16)
    a.add_argument("--batch", type=int, default=256, help="examples per device")
    a.add_argument("--plans", nargs="+", default=list(PLANS))
    a.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    a.add_argument("--ids", default="uniform", choices=["uniform", "zipf"])
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--out", default=None)
    return a.parse_args(argv)


if __name__ == "__main__":
    main(parse())
