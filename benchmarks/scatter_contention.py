"""Raw scatter-add vs coalesce-then-scatter under heavy duplicate ids.

openxla/xla#46225 reports that a float32 scatter-add with many updates to the
same row became very slow on GPU in jaxlib 0.10.2. This measures, for Zipf ids
(``zipf(1.2) % V``, so a few rows take most updates), the SGD-style update
``table.at[ids].add(-lr * rows)`` done directly and after
``jaxslices.coalesce`` (one write per distinct row), with the table donated.

Run: ``python benchmarks/scatter_contention.py --out
benchmarks/results/<yyyy-mm>-<backend>``
(``--num-rows``, ``--batch``, ``--dim``, ``--steps`` to change the workload).
Prints a markdown table of medians and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxslices as js


def _raw(table, ids, rows):
    return table.at[ids].add(-0.1 * rows, mode="drop")


def _coalesced(table, ids, rows):
    s = js.coalesce(js.IndexedSlices(rows, ids, table.shape))
    return js.scatter_add(table, -0.1 * s)


def _uniform(table, ids, rows):
    del ids  # same work, distinct rows: what a scatter costs without contention
    distinct = jnp.arange(rows.shape[0], dtype=jnp.int32) % table.shape[0]
    return table.at[distinct].add(-0.1 * rows, mode="drop")


METHODS = {"raw": _raw, "coalesced": _coalesced, "distinct_ids": _uniform}


def _time(fn, table, ids, rows, steps: int) -> list[float]:
    f = jax.jit(fn, donate_argnums=0)
    table = f(table, ids, rows)
    table.block_until_ready()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        table = f(table, ids, rows)
        table.block_until_ready()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main(
    num_rows: tuple[int, ...] = (1024, 65536),
    batch: int = 256,
    dim: int = 8,
    steps: int = 5,
    passes: int = 1,
    seed: int = 0,
    out: str | None = None,
) -> dict:
    rng = np.random.default_rng(seed)
    results = []
    for v in num_rows:
        ids = jnp.asarray(rng.zipf(1.2, size=batch) % v, jnp.int32)
        rows = jnp.asarray(rng.normal(size=(batch, dim)), jnp.float32)
        samples = {m: [] for m in METHODS}
        for _ in range(passes):  # interleaved passes against machine noise
            for name, fn in METHODS.items():
                table = jnp.zeros((v, dim), jnp.float32)
                samples[name] += _time(fn, table, ids, rows, steps)
        med = {m: float(np.median(t)) for m, t in samples.items()}
        top = np.bincount(np.asarray(ids)).max()
        results.append(
            {
                "num_rows": v,
                "distinct_ids": int(len(np.unique(np.asarray(ids)))),
                "max_repeats": int(top),
                "median_ms": med,
                "raw_over_coalesced": med["raw"] / med["coalesced"],
            }
        )
    header = (
        "| V | distinct ids | max repeats of one id | raw ms | coalesced ms | "
        "distinct-ids ms | raw / coalesced |\n|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for r in results:
        m = r["median_ms"]
        lines.append(
            f"| {r['num_rows']} | {r['distinct_ids']} | {r['max_repeats']} | "
            f"{m['raw']:.3f} | {m['coalesced']:.3f} | {m['distinct_ids']:.3f} | "
            f"{r['raw_over_coalesced']:.2f}x |"
        )
    report = {
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "batch": batch,
        "dim": dim,
        "results": results,
    }
    print(f"{report['device']} ({report['backend']}), jax {report['jax']}")
    print("\n".join(lines))
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        name = f"scatter_contention_{report['backend']}.json"
        (Path(out) / name).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-rows", type=int, nargs="+", default=[1 << 20, 1 << 24])
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    main(tuple(a.num_rows), a.batch, a.dim, a.steps, a.passes, a.seed, a.out)
