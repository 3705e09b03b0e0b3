"""A step with a tree operation between the gradient and the optimizer.

``embedding_bag``'s gradient carries its pooled form (``IndexedSlices.recipe``:
the ``[B, D]`` bag gradient, the ids and their weights), which the native
kernels read instead of the ``[N, D]`` per-id rows. jaxslices' own tree
functions keep it (``js.tree_scale``); generic tree code that rebuilds the
slices from their leaves (``jax.tree.map(lambda x: x, g)``, what wrappers do)
loses it, since flattening and unflattening are pure, and the kernels then
read the materialised rows (``explain`` says so; the cost is what this
script measures).
This script times the same donated row-wise Adagrad step three ways,
interleaved in one process: plain, with ``js.tree_scale(0.5, g)`` and with an
identity ``jax.tree.map`` between ``value_and_grad`` and ``tx.update``; and
records which rows the kernels read (``js.kernels.explain``).

Run: ``python benchmarks/pooled_form_bench.py --passes 20 --out
benchmarks/results/2026-11-cpu-native``.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from _common import environment, interleave, rows_passes_out, save_json, timed_report

import jaxslices as js

VARIANTS = {
    "plain": lambda g: g,
    "tree_scale": lambda g: js.tree_scale(0.5, g),
    "tree_map_identity": lambda g: jax.tree.map(lambda x: x, g),
}


def main(
    num_rows: int = 1 << 20,
    dim: int = 64,
    batch: int = 1024,
    bag: int = 16,
    num_batches: int = 20,
    steps: int = 10,
    passes: int = 10,
    seed: int = 0,
    out: str | None = None,
) -> dict:
    rng = np.random.default_rng(seed)
    # optimizer_floor_bench.py's ids: zipf(1.2) % V
    batches = [
        jnp.asarray(rng.zipf(1.2, size=(batch, bag)) % num_rows, jnp.int32)
        for _ in range(num_batches)
    ]
    y = jnp.asarray(rng.normal(size=batch), jnp.float32)
    tx = js.rowwise_adagrad(0.1)

    def loss(p, ids, y):
        h = js.embedding_bag(p["emb"], ids, combiner="mean")
        return jnp.mean((h @ p["w"] - y) ** 2)

    def make(between):
        def step(p, s, ids, y):
            g = js.grad(loss)(p, ids, y)
            u, s = tx.update(between(g), s, p)
            return js.apply_updates(p, u), s

        return jax.jit(step, donate_argnums=(0, 1))

    fns, carry, reads = {}, {}, {}
    for name, between in VARIANTS.items():
        step, cycle = make(between), itertools.cycle(batches)
        key = jax.random.key(seed)
        p = {"emb": 0.01 * jax.random.normal(key, (num_rows, dim)), "w": jnp.ones(dim)}
        carry[name] = (p, tx.init(p))
        report = js.kernels.explain(step, *carry[name], batches[0], y)
        reads[name] = [f"{d.op}: {d.materialised}" for d in report.materialised]

        def run(name=name, step=step, cycle=cycle):
            carry[name] = step(*carry[name], next(cycle), y)
            jax.block_until_ready(carry[name])

        fns[name] = run
    env = environment()
    times = interleave(fns, steps, passes)
    result = timed_report(
        env,
        {
            "num_rows": num_rows,
            "dim": dim,
            "batch": batch,
            "bag": bag,
            "zipf": 1.2,
            "optimizer": "rowwise_adagrad",
            "steps": steps,
            "passes": passes,
        },
        times,
        kernels_read=reads,
    )
    save_json(result, out, "pooled_form_bench_cpu.json")
    return result


if __name__ == "__main__":
    args = rows_passes_out(__doc__)
    result = main(num_rows=args.num_rows, passes=args.passes, out=args.out)
    for name, s in result["ms"].items():
        print(f"{name:18s} {s}  materialised reads: {result['kernels_read'][name]}")
