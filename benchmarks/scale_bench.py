"""Scale-out: communication, per-device memory and step time over 1-8 devices.

Workload: a ``V x D`` float32 table (default 131072 x 64) and a dense head;
a global batch of 1024 examples x 8 ids, ids ``zipf(1.2) % V`` (fixed seed,
the hot rows are skewed towards shard 0), split over the devices; mean of the
embeddings -> Linear -> MSE; Adam (lazy Adam on the sparse paths). For each
device count ``n`` in 1, 2, 4, 8 (a mesh over the first ``n`` devices):

* ``dense_dp``: what a JAX user writes today: ``jax.value_and_grad`` +
  ``optax.adam``, table replicated, batch sharded (``jax.jit`` +
  ``NamedSharding``).
* ``js_dp``: the same with jaxslices (``value_and_grad``, ``lazy_adam``,
  ``apply_updates``): data parallel, table replicated.
* ``rows_masked``: table and Adam moments sharded by rows
  (``jaxslices.sharding.shard_rows``), ``sharded_lookup``/``sharded_update`` with
  ``routing="masked"``.
* ``rows_a2a``: the same with ``routing="all_to_all"``; the capacity is the
  largest number of distinct ids any device sends to one shard in the
  benchmark's batches (reported), so no step overflows.

Figures per configuration: bytes moved per device per step, summed over the
compiled HLO's collectives (``tools/hlo.py``: for each collective the larger
of its operands and results); per-device memory from XLA's
``memory_analysis()`` (arguments, i.e. the table or its shard, optimizer state
and batch, plus temporaries); median step time and its ratio to one device.
CPU "devices" share the machine's cores, so step times do not scale here: the
bytes and the memory are the scaling figures.

Run: ``python benchmarks/scale_bench.py --out
benchmarks/results/<yyyy-mm>-<backend>``. Sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` when XLA_FLAGS is unset.
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _common import environment, interleave, progress, save_json, summary  # noqa: E402
from _repo import load  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxslices as js  # noqa: E402

hlo = load("tools.hlo")  # the HLO parser shared with the tests

PATHS = ("dense_dp", "js_dp", "rows_masked", "rows_a2a")
LR = 1e-3


def make_batches(num_rows, batch, bag, num_batches, seed, dist="zipf"):
    rng = np.random.default_rng(seed)

    def draw():
        if dist == "uniform":
            return rng.integers(0, num_rows, size=(batch, bag))
        return rng.zipf(1.2, size=(batch, bag)) % num_rows

    ids = [draw().astype(np.int32) for _ in range(num_batches)]
    return ids, rng.normal(size=(batch,)).astype(np.float32)


def needed_capacity(ids_list, n: int, num_rows: int) -> int:
    """Most distinct ids one device sends to one shard (rows split in n)."""
    rows = -(-num_rows // n)
    worst = 1
    for ids in ids_list:
        for part in np.split(ids, n):
            owners = np.unique(part) // rows
            worst = max(worst, int(np.bincount(owners, minlength=n).max()))
    return worst


def init_params(num_rows, dim, seed):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "emb": 0.01 * jax.random.normal(k1, (num_rows, dim), jnp.float32),
        "w": 0.1 * jax.random.normal(k2, (dim,), jnp.float32),
    }


def loss_fn(params, ids, y, lookup):
    h = lookup(params["emb"], ids).mean(1)
    return jnp.mean((h @ params["w"] - y) ** 2)


def _take(table, ids):
    return jnp.take(table, ids, axis=0)


def build(path, n, num_rows, dim, ids, y, capacity, seed):
    """Place params/state/batch on an n-device mesh; return a compiled step."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    params = init_params(num_rows, dim, seed)
    if path == "dense_dp":
        tx = optax.adam(LR)
        grad, lookup, update = jax.value_and_grad, _take, None
    else:
        tx = js.lazy_adam(LR)
        grad, lookup, update = js.value_and_grad, js.embedding_lookup, None
    if path.startswith("rows"):
        routing = "masked" if path == "rows_masked" else "all_to_all"
        cap = capacity if routing == "all_to_all" else None
        lookup = functools.partial(
            js.sharding.sharded_lookup, axis="x", routing=routing, capacity=cap
        )
        update = functools.partial(
            js.sharding.sharded_update, tx, axis="x", routing=routing, capacity=cap
        )
        params = {
            "emb": js.sharding.shard_rows(params["emb"], mesh, "x"),
            "w": jax.device_put(params["w"], rep),
        }
        state = js.sharding.sharded_init(tx, params)
    else:
        params = jax.device_put(params, rep)
        state = jax.device_put(tx.init(params), rep)
    apply = optax.apply_updates if path == "dense_dp" else js.apply_updates

    def step(params, state, ids, y):
        loss, g = grad(loss_fn)(params, ids, y, lookup)
        if update is not None:
            params, state = update(g, state, params)
        else:
            u, state = tx.update(g, state, params)
            params = apply(params, u)
        return params, state, loss

    batches = [(jax.device_put(i, split), jax.device_put(y, split)) for i in ids]
    compiled = (
        jax.jit(step, donate_argnums=(0, 1)).lower(params, state, *batches[0]).compile()
    )
    return compiled, params, state, batches


class Runner:
    def __init__(self, path, n, num_rows, dim, ids, y, capacity, seed):
        self.step, self.params, self.state, self.batches = build(
            path, n, num_rows, dim, ids, y, capacity, seed
        )
        mem = self.step.memory_analysis()
        found = hlo.collectives(self.step)
        self.figures = {
            "comm_bytes": sum(c.bytes for c in found),
            "collectives": {k: sum(c.kind == k for c in found) for k in hlo.KINDS},
            "largest_collective_bytes": max((c.bytes for c in found), default=0),
            "argument_bytes": int(mem.argument_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
            "device_bytes": int(mem.argument_size_in_bytes + mem.temp_size_in_bytes),
        }
        self.i, self.loss = 0, float("nan")
        for _ in range(2):
            self()

    def __call__(self):
        ids, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.params, self.state, loss = self.step(self.params, self.state, ids, y)
        jax.block_until_ready((self.params, self.state, loss))
        self.loss = loss


def main(
    devices: tuple[int, ...] = (1, 2, 4, 8),
    num_rows: int = 131072,
    dim: int = 64,
    batch: int = 1024,
    bag: int = 8,
    num_batches: int = 4,
    steps: int = 5,
    passes: int = 4,
    paths: tuple[str, ...] = PATHS,
    seed: int = 0,
    ids_dist: str = "zipf",
    out: str | None = None,
    plot: bool = True,
) -> dict:
    """Run every (device count, path); returns the report (printed and saved)."""
    devices = tuple(n for n in devices if n <= len(jax.devices()))
    if ids_dist not in ("zipf", "uniform"):
        raise ValueError(f"ids_dist must be 'zipf' or 'uniform', got {ids_dist!r}")
    ids, y = make_batches(num_rows, batch, bag, num_batches, seed, ids_dist)
    rows = []
    bar = progress(len(devices) * len(paths) * steps * passes, "scale_bench")
    for n in devices:
        cap = needed_capacity(ids, n, num_rows)
        runners = {p: Runner(p, n, num_rows, dim, ids, y, cap, seed) for p in paths}
        times = interleave(runners, steps, passes, bar)
        for p, r in runners.items():
            rows.append(
                {
                    "devices": n,
                    "path": p,
                    "capacity": cap if p == "rows_a2a" else None,
                    **summary(times[p]),
                    "final_loss": float(r.loss),
                    **r.figures,
                }
            )
        del runners
    if bar is not None:
        bar.close()
    for r in rows:
        one = next(
            (o for o in rows if o["devices"] == 1 and o["path"] == r["path"]), None
        )
        r["time_vs_1_device"] = (
            None if one is None else r["median_ms"] / one["median_ms"]
        )
    report = {
        **environment(),
        "workload": {
            "num_rows": num_rows,
            "dim": dim,
            "batch": batch,
            "bag": bag,
            "ids": "zipf(1.2) % V" if ids_dist == "zipf" else "uniform",
            "optimizer": "adam / lazy_adam",
        },
        "steps_per_pass": steps,
        "passes": passes,
        "rows": rows,
    }
    report["table"] = markdown_table(rows)
    print(
        f"{report['cpu']} x{report['nproc']} ({report['backend']}), jax {report['jax']}"
    )
    print(report["table"])
    name = f"scale_bench_{report['backend']}"
    name += "" if ids_dist == "zipf" else f"_{ids_dist}"
    save_json(report, out, f"{name}.json")
    if out and plot:
        save_plot(rows, str(Path(out) / f"{name}.png"), report)
    return report


def markdown_table(rows: list[dict]) -> str:
    head = [
        "devices",
        "path",
        "comm KB/step",
        "collectives",
        "per-device MB (args + temp)",
        "median ms",
        "time / 1 device",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        kinds = (
            ", ".join(f"{v} {k}" for k, v in r["collectives"].items() if v) or "none"
        )
        ratio = r["time_vs_1_device"]
        cap = f" (capacity {r['capacity']})" if r["capacity"] else ""
        lines.append(
            f"| {r['devices']} | {r['path']}{cap} | {r['comm_bytes'] / 1024:.1f} | "
            f"{kinds} | {r['device_bytes'] / 2**20:.1f} | {r['median_ms']:.2f} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} |"
        )
    return "\n".join(lines)


def save_plot(rows: list[dict], path: str, env: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [
        ("comm_bytes", "bytes moved / device / step", 1.0),
        ("device_bytes", "per-device memory (MB)", 2.0**-20),
        ("time_vs_1_device", "step time / 1 device", 1.0),
    ]
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        for p in PATHS:
            pts = [
                (r["devices"], r[key] * scale)
                for r in rows
                if r["path"] == p
                and r[key] is not None
                and (key != "comm_bytes" or r[key] > 0)  # log axis: 1 device sends 0
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", label=p)
        ax.set_xscale("log", base=2)
        if key == "comm_bytes":
            ax.set_yscale("log")
        ax.set_xlabel("devices")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"Scale-out, V={env['workload']['num_rows']} x {env['workload']['dim']} "
        f"({env['cpu']}, {env['backend']}, jax {env['jax']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    a.add_argument("--num-rows", type=int, default=131072)
    a.add_argument("--dim", type=int, default=64)
    a.add_argument("--batch", type=int, default=1024)
    a.add_argument("--steps", type=int, default=5, help="timed steps per turn")
    a.add_argument("--passes", type=int, default=4, help="round-robin turns")
    a.add_argument("--paths", nargs="+", default=list(PATHS))
    a.add_argument(
        "--ids",
        default="zipf",
        choices=["zipf", "uniform"],
        help="id distribution (uniform: output files get a _uniform suffix)",
    )
    a.add_argument("--out", default=None)
    args = a.parse_args()
    main(
        devices=tuple(args.devices),
        num_rows=args.num_rows,
        dim=args.dim,
        batch=args.batch,
        steps=args.steps,
        passes=args.passes,
        paths=tuple(args.paths),
        ids_dist=args.ids,
        out=args.out,
    )
