"""Plain SGD's native update: duplicate ids added in turn, or summed first.

SGD's update reaches ``apply_updates`` as the pooled gradient (a recipe: the
``[B, D]`` bag gradient, the ids and their weights). The apply kernel
(``jaxslices/kernels/csrc/apply.cc``) can add each id's row to the table in
turn (what the XLA path's scatter-add computes), or sum the rows of each
distinct id first (a hash pass over the ids, then each distinct row written
once). This script measures both on one workload, interleaved, and the
accuracy of each where they differ: 1,000 duplicates of an update of -1e-8 on
an entry of 1.0 (float32 spacing there: 6e-8, so each in-turn addition rounds
back to 1.0 while their sum, -1e-5, moves it).

The kernel option is internal (the library's choice, not a user's), so this
script calls the op directly: ``jaxslices.kernels._ops.apply``.

Run: ``python benchmarks/sgd_duplicates_bench.py --passes 30 --out
benchmarks/results/2026-11-cpu-native``.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from _common import environment, interleave, rows_passes_out, save_json, timed_report


def main(
    num_rows: int = 1 << 20,
    dim: int = 64,
    batch: int = 1024,
    bag: int = 16,
    num_batches: int = 20,
    steps: int = 20,
    passes: int = 10,
    seed: int = 0,
    out: str | None = None,
) -> dict:
    from jaxslices.kernels import _ops

    rng = np.random.default_rng(seed)
    batches = [
        (
            # optimizer_floor_bench.py's ids: zipf(1.2) % V, bags flattened
            jnp.asarray(rng.zipf(1.2, size=(batch, bag)).ravel() % num_rows, jnp.int32),
            jnp.asarray(rng.normal(size=(batch, dim)), jnp.float32),
            jnp.asarray(rng.uniform(size=batch * bag), jnp.float32),
        )
        for _ in range(num_batches)
    ]

    def update(sum_duplicates):
        def fn(table, ids, grad, weight):
            recipe = _ops.PooledGradient(grad, length=bag, weight=weight, scale=-0.1)
            return _ops.apply(table, recipe, ids, sum_duplicates=sum_duplicates)

        return jax.jit(fn, donate_argnums=0)

    fns, tables = {}, {}
    for name, flag in (("in_turn", False), ("summed_first", True)):
        step, cycle = update(flag), itertools.cycle(batches)
        tables[name] = jnp.zeros((num_rows, dim), jnp.float32)

        def run(name=name, step=step, cycle=cycle):
            tables[name] = step(tables[name], *next(cycle))
            tables[name].block_until_ready()

        fns[name] = run
    env = environment()
    times = interleave(fns, steps, passes)
    distinct = [len(np.unique(np.asarray(ids))) for ids, _, _ in batches]

    # Accuracy: 1,000 duplicates of -1e-8 added to 1.0.
    one = jnp.ones((1, 1), jnp.float32)
    tiny = _ops.PooledGradient(jnp.full((1000, 1), -1e-8, jnp.float32))
    zeros = jnp.zeros(1000, jnp.int32)
    accuracy = {
        name: float(
            jax.jit(lambda t, f=flag: _ops.apply(t, tiny, zeros, sum_duplicates=f))(
                one
            )[0, 0]
        )
        for name, flag in (("in_turn", False), ("summed_first", True))
    }
    accuracy["exact"] = 1.0 - 1000 * 1e-8
    report = timed_report(
        env,
        {
            "num_rows": num_rows,
            "dim": dim,
            "batch": batch,
            "bag": bag,
            "zipf": 1.2,
            "num_batches": num_batches,
            "mean_distinct_ids": float(np.mean(distinct)),
            "steps": steps,
            "passes": passes,
        },
        times,
        **{"accuracy_1000_duplicates_of_minus_1e-8_on_1": accuracy},
    )
    save_json(report, out, "sgd_duplicates_bench_cpu.json")
    return report


if __name__ == "__main__":
    args = rows_passes_out(__doc__)
    result = main(num_rows=args.num_rows, passes=args.passes, out=args.out)
    for name, s in result["ms"].items():
        print(name, s)
    print(result["accuracy_1000_duplicates_of_minus_1e-8_on_1"])
