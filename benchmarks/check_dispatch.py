"""What a run-time check costs each call of a jitted step: pure callback vs effect.

jaxslices' run-time checks (``jaxslices._errors.raise_if``: ``max_distinct``,
jagged ``max_total``, ``all_to_all`` capacity, ``MultiSteps``, the lookups'
``check_ids=True``) are pure callbacks inside a ``lax.cond``; the public
``jaxslices.check_ids`` is a ``jax.debug.callback`` (an effect, so that an
unused result is still checked). A JAX effect sends every call of the step
through JAX's Python dispatch instead of its C++ fast path. This script times,
in one process and taking turns, the same steps three ways:

* ``no_check``: no check at all (the scatter step only);
* ``pure``: the check as jaxslices' internal checks make it (``always=False``);
* ``effect``: the check as an effect (``always=True``, as ``check_ids``).

Ratios and extra time are against ``pure``.

Steps: ``scatter`` (a 64-row scatter-add into a donated ``(1024, 8)`` table:
dispatch is most of it) and ``clip_sgd`` (``jaxslices.clip_by_global_norm``
with a ``max_distinct`` bound + ``jaxslices.sgd``, a lookup model, V = 2**16,
D = 32, 256 x 8 ids, donated). Both checks pass: what is timed is the cost of
having one.

Run: ``python benchmarks/check_dispatch.py --out benchmarks/results/<folder>``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

CHECKS = ("no_check", "pure", "effect")


def _scatter_steps(num_rows: int, dim: int, n: int):
    import jax
    import jax.numpy as jnp

    from jaxslices._errors import raise_if

    def make(check):
        def step(table, ids):
            if check != "no_check":
                ids = raise_if(
                    ids >= num_rows,
                    ids,
                    lambda c: ValueError(f"{c} ids out of range"),
                    jnp.sum(ids >= num_rows),
                    always=check == "effect",
                )
            return table.at[ids].add(1.0)

        return jax.jit(step, donate_argnums=0)

    ids = jnp.arange(n, dtype=jnp.int32) * 7 % num_rows
    out = {}
    for check in CHECKS:
        step, box = make(check), [jnp.zeros((num_rows, dim), jnp.float32)]

        def call(step=step, box=box):
            box[0] = step(box[0], ids)
            box[0].block_until_ready()

        out[check] = call
    return out


def _clip_sgd_steps(num_rows: int, dim: int, batch: int, bag: int, seed: int):
    import jax
    import jax.numpy as jnp
    import optax

    import jaxslices as js
    from jaxslices import _errors

    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.zipf(1.2, size=(batch, bag)) % num_rows, jnp.int32)
    y = jnp.asarray(rng.normal(size=(batch,)), jnp.float32)
    bound = int(js.capacity.estimate_max_distinct([np.asarray(ids)]))

    def loss_fn(p, ids, y):
        h = js.embedding_lookup(p["emb"], ids).mean(1)
        return jnp.mean((h @ p["w"] - y) ** 2)

    def make():
        tx = optax.chain(js.clip_by_global_norm(1.0, max_distinct=bound), js.sgd(0.1))

        def step(p, state, ids, y):
            loss, g = js.value_and_grad(loss_fn)(p, ids, y)
            u, state = tx.update(g, state, p)
            return js.apply_updates(p, u), state, loss

        return tx, jax.jit(step, donate_argnums=(0, 1))

    out = {}
    real = _errors.raise_if
    for check in CHECKS[1:]:  # a bound always has its check
        tx, step = make()
        p = {
            "emb": 0.01 * jax.random.normal(jax.random.key(seed), (num_rows, dim)),
            "w": jnp.ones((dim,), jnp.float32) / dim,
        }
        box = [p, tx.init(p)]

        def always(*a, **k):
            return real(*a, **{**k, "always": True})

        # The effect variant: the same step with the bound's check as an effect.
        _errors.raise_if = always if check == "effect" else real
        try:
            box[0], box[1], _ = step(box[0], box[1], ids, y)  # traced here
        finally:
            _errors.raise_if = real

        def call(step=step, box=box):
            box[0], box[1], loss = step(box[0], box[1], ids, y)
            loss.block_until_ready()

        out[check] = call
    return out, bound


def main(
    steps: int = 200,
    passes: int = 5,
    num_rows: int = 2**16,
    dim: int = 32,
    batch: int = 256,
    bag: int = 8,
    seed: int = 0,
    out: str | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Time every (step, check) pair, taking turns; print and save."""
    from _common import environment, interleave, progress, save_json, summary

    fns = {f"scatter/{k}": f for k, f in _scatter_steps(1024, 8, 64).items()}
    clip, bound = _clip_sgd_steps(num_rows, dim, batch, bag, seed)
    fns.update({f"clip_sgd/{k}": f for k, f in clip.items()})
    for f in fns.values():
        f()  # compiled and warm
    bar = progress(len(fns) * steps * passes, "check_dispatch")
    times = interleave(fns, steps, passes, bar)
    if bar is not None:
        bar.close()
    rows = []
    for name, t in times.items():
        step, check = name.split("/")
        rows.append({"step": step, "check": check, **summary(t)})
    med = {(r["step"], r["check"]): r["median_ms"] for r in rows}
    for r in rows:
        base = med[(r["step"], "pure")]
        r["ratio_to_pure"] = r["median_ms"] / base
        r["extra_us"] = (r["median_ms"] - base) * 1e3
    report = {
        "command": command,
        "workload": {
            "steps": steps,
            "passes": passes,
            "scatter": {"num_rows": 1024, "dim": 8, "ids": 64},
            "clip_sgd": {
                "num_rows": num_rows,
                "dim": dim,
                "batch": batch,
                "bag": bag,
                "max_distinct": bound,
            },
        },
        "environment": environment(),
        "rows": rows,
    }
    for r in rows:
        print(
            f"{r['step']:9s} {r['check']:9s} {r['median_ms'] * 1e3:9.1f} us "
            f"({r['ratio_to_pure']:.2f}x, {r['extra_us']:+.1f} us)"
        )
    save_json(report, out, "check_dispatch_cpu.json")
    return report


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    main(a.steps, a.passes, out=a.out, command="python " + " ".join(sys.argv))
