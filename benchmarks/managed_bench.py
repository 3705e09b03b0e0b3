"""The step with a managed-collision remap vs the same step on pre-remapped ids.

One training step (``embedding_bag`` + ``value_and_grad`` + Adagrad +
``apply_updates``, donated) over a table of ``--num-rows`` slots, on a
stream of raw 64-bit ids drawn with Zipf popularity from ``4 x num_rows``
distinct ids (the remap state warmed up on it first, so the table is full
and ids keep arriving). Configurations, interleaved:

* ``pre_remapped``: the step on the rows the managed table gave those ids
  (the remap done beforehand: the floor);
* ``with_remap``: remap + ``reset_rows`` + the step, no eviction due;
* ``with_remap_evicting``: the same with an eviction in every step (down to
  ``batch`` free slots);
* ``with_remap_filtered``: ``with_remap`` behind an admission filter
  (``min_count=2``, ``filter_size = num_rows``; the filter's cost: one sort
  of the batch by bucket on the XLA path, a pass over the new ids natively);
* ``with_remap_evicting_decayed``: ``with_remap_evicting`` with a decayed
  LFU (``half_life=5``; the eviction decays every slot's count as it
  reads it);
* ``evict_then_refill``: an on-demand eviction (donated, jitted) down to
  ``batch * bag`` free slots, then a remap of one batch into the freed slots
  (no training step).

The remap state starts full (``num_rows`` distinct ids admitted), then
``warmup_batches`` of the stream. The remapping configurations then read
fresh batches of the stream, one per call (never a batch seen before), so
that every evicting step evicts for real (``evictions_per_step`` in the
workload: the ids the evicting step evicted per call, on average).
The path is the native one where the kernels load (``jaxslices.kernels``);
``JAXSLICES_NATIVE=0`` runs the XLA path.

The issue's goals: ``with_remap`` within 1.3x of ``pre_remapped``, and an
eviction within one step's time at ``num_rows = 2**20``
(``with_remap_evicting - with_remap <= with_remap``).

Run: ``python benchmarks/managed_bench.py --num-rows 1048576 --passes 10
--out benchmarks/results/<yyyy-mm>-cpu-managed``.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from _common import environment, interleave, rows_passes_out, save_json, timed_report

import jaxslices as js


def main(
    num_rows: int = 1 << 20,
    dim: int = 64,
    batch: int = 1024,
    bag: int = 4,
    num_batches: int = 8,
    warmup_batches: int = 16,
    steps: int = 10,
    passes: int = 10,
    seed: int = 0,
    out: str | None = None,
) -> dict:
    rng = np.random.default_rng(seed)
    distinct = 4 * num_rows
    raw_of = rng.integers(0, 2**62, size=distinct, dtype=np.int64)

    def draw():
        ranks = np.minimum(rng.zipf(1.2, size=(batch, bag)) - 1, distinct - 1)
        return js.RawIds.from_int64(raw_of[ranks])

    opt = js.adagrad(0.05)
    managers = {
        name: js.ManagedCollision(
            "bench",
            num_slots=num_rows,
            evict_every=every,
            evict_count=batch * bag,
            **extra,
        )
        for name, every, extra in (
            ("with_remap", None, {}),
            ("with_remap_evicting", 1, {}),
            ("with_remap_filtered", None, {"min_count": 2}),
            ("with_remap_evicting_decayed", 1, {"half_life": 5}),
        )
    }
    warm = managers["with_remap_evicting"]
    fill = jax.jit(lambda s, raw: warm.remap(s, raw)[1], donate_argnums=0)
    remap_state = warm.init()
    # a full table first (every slot taken by a distinct id, in batches, with
    # an eviction due every call: none happens while slots are free) ...
    chunk = batch * bag
    for start in range(0, num_rows, chunk):
        ids = raw_of[start : min(start + chunk, num_rows)]
        ids = np.concatenate([ids, np.full(chunk - ids.size, ids[-1])])
        remap_state = fill(remap_state, js.RawIds.from_int64(ids.reshape(batch, bag)))
    # ... then the stream, which keeps evicting and admitting
    for _ in range(warmup_batches):
        remap_state = fill(remap_state, draw())
    batches = [draw() for _ in range(num_batches)]
    rows = []
    for raw in batches:
        r, _, _ = warm.remap(remap_state, raw)
        rows.append(r)
    # one fresh batch per call of a remapping configuration (warmup included)
    stream = [draw() for _ in range(passes * (steps + 1))]
    y = jnp.asarray(rng.normal(size=batch), jnp.float32)

    def loss(params, rows):
        e = js.embedding_bag(params["emb"], rows, combiner="sum")
        return jnp.mean((e @ params["w"] - y) ** 2)

    def train(params, opt_state, rows):
        _, grads = js.value_and_grad(loss)(params, rows)
        updates, opt_state = opt.update(grads, opt_state, params)
        return js.apply_updates(params, updates), opt_state

    def remapped(mc):
        def step(params, opt_state, remap_state, raw):
            rows, remap_state, evicted = mc.remap(remap_state, raw)
            params, opt_state = js.reset_rows(
                params, opt_state, evicted, 0.0, where=lambda p: p["emb"], optimizer=opt
            )
            return (*train(params, opt_state, rows), remap_state)

        return jax.jit(step, donate_argnums=(0, 1, 2))

    def fresh():
        params = {
            "emb": jnp.zeros((num_rows, dim), jnp.float32),
            "w": jnp.ones((dim,), jnp.float32),
        }
        return params, opt.init(params)

    live: dict = {}
    fns = {}
    plain = jax.jit(train, donate_argnums=(0, 1))
    live["pre_remapped"] = fresh()
    cycle_rows = itertools.cycle(rows)

    def run_plain():
        live["pre_remapped"] = plain(*live["pre_remapped"], next(cycle_rows))
        jax.block_until_ready(live["pre_remapped"])

    fns["pre_remapped"] = run_plain
    for name, mc in managers.items():
        step, cycle = remapped(mc), iter(stream)
        state = jax.tree.map(jnp.copy, remap_state)
        if mc.min_count > 1:  # the warm slot table, with an empty admission filter
            saved = state._asdict()
            state = mc.restore({k: v for k, v in saved.items() if "filter" not in k})
        live[name] = (*fresh(), state)

        def run(name=name, step=step, cycle=cycle):
            live[name] = step(*live[name], next(cycle))
            jax.block_until_ready(live[name])

        fns[name] = run

    def evict_refill(state, raw):
        state, _ = warm.evict(state)
        return warm.remap(state, raw)[1]

    evict = jax.jit(evict_refill, donate_argnums=0)
    full = {"state": jax.tree.map(jnp.copy, remap_state)}
    cycle_fill = iter(stream)

    def run_evict():
        # evict (on demand) down to `batch * bag` free slots, then refill
        full["state"] = jax.block_until_ready(evict(full["state"], next(cycle_fill)))

    fns["evict_then_refill"] = run_evict
    env = environment()
    evictions_before = int(live["with_remap_evicting"][2].evictions)
    times = interleave(fns, steps, passes)
    evicted = int(live["with_remap_evicting"][2].evictions) - evictions_before
    report = timed_report(
        env,
        {
            "num_rows": num_rows,
            "dim": dim,
            "batch": batch,
            "bag": bag,
            "distinct_ids": distinct,
            "zipf": 1.2,
            "num_batches": num_batches,
            "steps": steps,
            "passes": passes,
            "evictions_per_step": evicted / len(stream),
        },
        times,
    )
    save_json(report, out, f"managed_bench_{jax.default_backend()}.json")
    return report


if __name__ == "__main__":
    args = rows_passes_out(__doc__)
    result = main(num_rows=args.num_rows, passes=args.passes, out=args.out)
    for name, s in result["ms"].items():
        print(name, s)
