"""The native step on a bfloat16 table against the same step on a float32 one.

One whole training step, jitted and donated, on one ``V x 64`` table (``V =
2**20``): the forward bag (``B`` bags x 16 Zipf ids, mean pooling) through a
linear head, the sparse gradient, the optimizer (``sgd``, ``rowwise_adagrad``
with float32 state) and ``jaxslices.apply_updates`` (a bfloat16 table:
stochastic rounding, one rounding per touched row; also to nearest, to
see what the rounding's hash costs). Every configuration runs the
native kernels (checked with ``jaxslices.kernels.explain``); the
configurations take turns call by call (``_common.interleave``), so the
ratio bfloat16 / float32 per optimizer is of medians measured side by side.
The issue's goal: the bfloat16 step <= 0.7x the float32 step (half the
bytes of every row read and written).

Run: ``python benchmarks/lowp_bench.py --passes 10 --out
benchmarks/results/<yyyy-mm>-cpu-lowp`` (writes ``lowp_bench_cpu.json``).
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from _common import environment, interleave, progress, save_json, timed_report

OPTIMIZERS = ("sgd", "rowwise_adagrad")
# Configurations: the table's dtype, and a bfloat16 table rounded to nearest
# (what the stochastic rounding's hash costs).
DTYPES = ("float32", "bfloat16", "bfloat16_nearest")


def _step(optimizer: str, config: str, num_rows: int, dim: int):
    import jaxslices as js

    dtype, _, rounding = config.partition("_")
    sr = rounding != "nearest"

    tx = js.sgd(0.1) if optimizer == "sgd" else js.rowwise_adagrad(0.1)

    def loss(p, ids, y):
        h = js.embedding_bag(p["emb"], ids, combiner="mean")
        return jnp.mean((h.astype(jnp.float32) @ p["w"] - y) ** 2)

    def step(p, s, ids, y, key):
        g = js.grad(loss)(p, ids, y)
        u, s = tx.update(g, s, p)
        return js.apply_updates(p, u, key=key, stochastic_rounding=sr), s

    params = {
        "emb": jnp.zeros((num_rows, dim), jnp.dtype(dtype)),
        "w": jnp.ones((dim,), jnp.float32),
    }
    state = jax.tree.map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        tx.init(params),
    )
    return step, params, state


def main(
    num_rows: int = 1 << 20,
    dim: int = 64,
    bags: int = 1024,
    bag: int = 16,
    optimizers: tuple[str, ...] = OPTIMIZERS,
    num_batches: int = 8,
    steps: int = 10,
    passes: int = 10,
    seed: int = 0,
    out: str | None = None,
) -> dict:
    import jaxslices as js

    rng = np.random.default_rng(seed)
    env = environment()
    batches = [
        (
            jnp.asarray(rng.zipf(1.2, size=(bags, bag)) % num_rows, jnp.int32),
            jnp.asarray(rng.normal(size=bags), jnp.float32),
        )
        for _ in range(num_batches)
    ]
    results = []
    bar = progress(len(optimizers), "optimizer")
    for optimizer in optimizers:
        fns, native = {}, {}
        for dtype in DTYPES:
            step, params, state = _step(optimizer, dtype, num_rows, dim)
            decisions = js.kernels.explain(step, params, state, *batches[0], 0)
            native[dtype] = all(d.native for d in decisions.decisions)
            compiled = (
                jax.jit(step, donate_argnums=(0, 1))
                .lower(params, state, *batches[0], 0)
                .compile()
            )
            cycle = itertools.cycle(batches)
            box = {"p": params, "s": state, "k": 0}

            def run(compiled=compiled, cycle=cycle, box=box):
                ids, y = next(cycle)
                box["p"], box["s"] = compiled(box["p"], box["s"], ids, y, box["k"])
                box["k"] += 1
                jax.block_until_ready(box["p"])

            for _ in range(3):
                run()
            fns[dtype] = run
        times = interleave(fns, steps, passes)
        rep = timed_report(
            env, {"optimizer": optimizer, "ids": bags * bag}, times, native=native
        )
        rep["ratio_bf16_to_f32"] = (
            rep["ms"]["bfloat16"]["median_ms"] / rep["ms"]["float32"]["median_ms"]
        )
        results.append(rep)
        bar.update(1)
    bar.close()
    report = {
        "environment": {**env, "load_avg_1m_end": environment()["load_avg_1m"]},
        "settings": {
            "num_rows": num_rows,
            "dim": dim,
            "bags": bags,
            "bag": bag,
            "steps": steps,
            "passes": passes,
            "zipf": 1.2,
            "goal_ratio": 0.7,
        },
        "results": results,
        "command": f"python benchmarks/lowp_bench.py --passes {passes} --out {out}",
    }
    save_json(report, out, "lowp_bench_cpu.json")
    return report


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-rows", type=int, default=1 << 20)
    p.add_argument("--bags", type=int, default=1024)
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--passes", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rep = main(
        num_rows=a.num_rows, bags=a.bags, optimizers=tuple(a.optimizers),
        steps=a.steps, passes=a.passes, out=a.out,
    )  # fmt: skip
    for r in rep["results"]:
        print(
            r["workload"]["optimizer"],
            {k: round(v["median_ms"], 3) for k, v in r["ms"].items()},
            f"bf16/f32 {r['ratio_bf16_to_f32']:.3f}",
            r["native"],
        )
