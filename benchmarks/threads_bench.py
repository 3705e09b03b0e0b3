"""The native kernels on 1 and 2 threads, by batch size: where threads pay.

Each kernel call of a training step, alone, on one ``V x 64`` table
(``V = 2**20``): the forward bag (``B`` bags x 16 ids, mean pooling), the
row-wise Adagrad rule (the pooled gradient summed per distinct id, the rule
and its state in place) and SGD's update (each id's row added in turn), for
``B`` from 16 to 1024 bags (256 to 16,384 ids: Zipf, ``zipf(1.2) % V``).
Every (kernel, B) is jitted once per thread count, forced with
``jaxslices.kernels.threads(n, min_slots=0)``, and the thread counts take
turns call by call (``_common.interleave``): the ratio 2 threads / 1 thread
per (kernel, B) is of medians measured side by side. Where the ratio drops
below 1 is the threshold (``jaxslices.kernels._threads.MIN_SLOTS``: calls
with fewer ids stay on one thread).

Run: ``python benchmarks/threads_bench.py --passes 20 --out
benchmarks/results/<yyyy-mm>-cpu-threads`` (writes ``threads_bench_cpu.json``
and ``.png``).
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from _common import environment, interleave, progress, save_json, timed_report

KERNELS = ("bag_forward", "rowwise_adagrad", "sgd_apply")


def _ops_for(kernel, num_rows, dim, bag):
    from jaxslices.kernels import _ops
    from jaxslices.transforms import _transform

    if kernel == "bag_forward":

        def fn(table, state, ids, grad):
            out = _ops.bag_forward(
                table, ids, weight=None, scale=None, num_bags=grad.shape[0],
                length=bag,
            )  # fmt: skip
            return table, state, out

    elif kernel == "rowwise_adagrad":

        def fn(table, state, ids, grad):
            recipe = _ops.PooledGradient(grad, length=bag, scale=1.0 / bag)
            state, uids, rows, _, _ = _ops.rowwise(
                recipe, ids, num_rows=num_rows, spec=_transform._ROWWISE_RSS_SPEC,
                hp=(1e-10,), state=state, capacity=ids.shape[0],
            )  # fmt: skip
            return table, state, rows

    else:

        def fn(table, state, ids, grad):
            recipe = _ops.PooledGradient(grad, length=bag, scale=-0.1 / bag)
            return _ops.apply(table, recipe, ids), state, grad

    return jax.jit(fn, donate_argnums=(0, 1))


def main(
    num_rows: int = 1 << 20,
    dim: int = 64,
    bags: tuple[int, ...] = (16, 64, 128, 256, 512, 1024),
    bag: int = 16,
    threads: tuple[int, ...] = (1, 2),
    kernels: tuple[str, ...] = KERNELS,
    num_batches: int = 8,
    steps: int = 20,
    passes: int = 10,
    seed: int = 0,
    out: str | None = None,
    plot: bool = True,
) -> dict:
    import jaxslices as js

    rng = np.random.default_rng(seed)
    env = environment()
    results = []
    bar = progress(len(kernels) * len(bags), "kernel x batch")
    for kernel, b in itertools.product(kernels, bags):
        batches = [
            (
                jnp.asarray(rng.zipf(1.2, size=b * bag) % num_rows, jnp.int32),
                jnp.asarray(rng.normal(size=(b, dim)), jnp.float32),
            )
            for _ in range(num_batches)
        ]
        fns, state = {}, {}
        for n in threads:
            with js.kernels.threads(n, min_slots=0):
                step = _ops_for(kernel, num_rows, dim, bag)
                tab = jnp.zeros((num_rows, dim), jnp.float32)
                st = jnp.zeros((num_rows,), jnp.float32)
                state[n] = (tab, st)
                # Compile inside the setting (a user context jit keys on).
                compiled = step.lower(tab, st, *batches[0]).compile()
            cycle = itertools.cycle(batches)

            def run(n=n, compiled=compiled, cycle=cycle, state=state):
                tab, st, out = compiled(*state[n], *next(cycle))
                out.block_until_ready()
                state[n] = (tab, st)

            for _ in range(3):
                run()
            fns[f"{n}"] = run
        times = interleave(fns, steps, passes)
        rep = timed_report(env, {"kernel": kernel, "bags": b, "ids": b * bag}, times)
        base = rep["ms"][str(threads[0])]["median_ms"]
        rep["ratio_to_1_thread"] = {
            k: v["median_ms"] / base
            for k, v in rep["ms"].items()
            if k != str(threads[0])
        }
        results.append(rep)
        bar.update(1)
    bar.close()
    report = {
        "environment": {**env, "load_avg_1m_end": environment()["load_avg_1m"]},
        "settings": {
            "num_rows": num_rows,
            "dim": dim,
            "bag": bag,
            "threads": list(threads),
            "steps": steps,
            "passes": passes,
            "zipf": 1.2,
        },  # fmt: skip
        "results": results,
        "command": f"python benchmarks/threads_bench.py --passes {passes} --out {out}",
    }
    path = save_json(report, out, "threads_bench_cpu.json")
    if plot and path is not None:
        save_plot(report, path.with_suffix(".png"))
    return report


def save_plot(report: dict, png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for kernel in KERNELS:
        rows = [r for r in report["results"] if r["workload"]["kernel"] == kernel]
        if not rows:
            continue
        ids = [r["workload"]["ids"] for r in rows]
        ratio = [
            r["ratio_to_1_thread"]["2"] for r in rows if "2" in r["ratio_to_1_thread"]
        ]
        ax.plot(ids[: len(ratio)], ratio, marker="o", label=kernel.replace("_", " "))
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ids per call")
    ax.set_ylabel("2 threads / 1 thread (median time)")
    env = report["environment"]
    ax.set_title(f"Kernel calls on 2 threads ({env['nproc']} CPUs, jax {env['jax']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-rows", type=int, default=1 << 20)
    p.add_argument("--bags", type=int, nargs="+", default=[16, 64, 128, 256, 512, 1024])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--passes", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rep = main(
        num_rows=a.num_rows, bags=tuple(a.bags), kernels=tuple(a.kernels),
        steps=a.steps, passes=a.passes, out=a.out,
    )  # fmt: skip
    for r in rep["results"]:
        w = r["workload"]
        print(
            w["kernel"],
            w["ids"],
            {k: round(v, 3) for k, v in r["ratio_to_1_thread"].items()},
        )
