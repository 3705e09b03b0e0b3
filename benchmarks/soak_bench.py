"""Soak: thousands of donated jaxslices training steps, the process's memory as it goes.

The step and workload of ``peers_bench.py`` (``_common.peers_step``: one
``V x 64`` float32 table, V = 131072 by default, 1024 bags x 16 Zipf ids,
mean pooling, a linear head, MSE; ``jax.jit(step, donate_argnums=(0, 1))``),
``--steps`` steps (default 4000) per optimizer, cycling 20 batches. A step
that leaks (a buffer kept per call, a copy of the table that is never freed,
a native kernel's allocation) shows as resident memory growing with the step
count.

Each (mode, optimizer) runs in its own child process (a fresh process: its
memory is its own): mode ``xla`` with ``JAXSLICES_NATIVE=0`` (jaxslices' XLA
path), ``native`` with ``JAXSLICES_NATIVE=1`` (its native path where built;
until it exists, the XLA path again), JAX on the CPU. The child blocks on every
step's result (``--async-dispatch``: only on the samples', as a training
loop that never reads its loss) and records its resident set size
(``/proc/self/statm``) every ``--every`` steps, with the wall time of those
steps. Reported per run: the growth from step ``--baseline-step`` (default
500: compilation, first allocations and the allocator's warm-up are over by
then) to the last step (``no_growth``: at most ``--tolerance-mb``, default
1 MB; a shrink is not a leak), the largest excursions above and below the
baseline, the one-off jumps between two samples (``--tolerance-mb`` or
more), and the steady growth: the median change between two samples times
the number of intervals. A leak adds memory at every interval and shows in
the steady growth (``no_steady_growth``). With ``--async-dispatch`` a step
can be dispatched while the one before still runs: resident memory may then
jump once, at a step that varies from run to run, by the size of the step's
temporaries (``temp_mb``: a second set of them, kept), with glibc's defaults
and with ``--keep-freed-memory`` (``_common.MALLOC_ENV`` for the children);
blocking on every step, no such jump was seen.

Run: ``python benchmarks/soak_bench.py --out benchmarks/results/<yyyy-mm>-cpu``
(writes ``soak_bench_cpu.json`` and ``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import MALLOC_ENV, PEERS_OPTIMIZERS, environment, progress, save_json

MODES = ("xla", "native")
NATIVE_ENV = {"xla": "0", "native": "1"}


# =========================================================== the child


def child(a: argparse.Namespace) -> None:
    """Run the soak in this process; stream one JSON line per sample."""
    import jax
    import jax.numpy as jnp
    from _common import (
        custom_call_targets,
        peers_data,
        peers_optimizer,
        peers_step,
        rss_mb,
    )

    import jaxslices as js

    data = peers_data(a.num_rows, a.dim, a.batch, a.bag, a.num_batches, a.seed)
    tx = peers_optimizer(a.optimizer)
    params = {"emb": jnp.asarray(data["table"]), "w": jnp.asarray(data["w"])}
    state = jax.jit(tx.init)(params)
    ids = [jnp.asarray(x) for x in data["ids"]]
    ys = [jnp.asarray(x) for x in data["y"]]
    del data
    compiled = peers_step(tx).lower(params, state, ids[0], ys[0]).compile()
    temp_mb = compiled.memory_analysis().temp_size_in_bytes / 2**20
    table_ptr = params["emb"].unsafe_buffer_pointer()
    print(
        json.dumps(
            {
                "kind": "start",
                "rss_mb": rss_mb()["rss_mb"],
                "custom_calls": custom_call_targets(compiled),
                "temp_mb": temp_mb,
                "JAXSLICES_NATIVE": os.environ.get("JAXSLICES_NATIVE"),
                "jaxslices_file": js.__file__,
                "jax": jax.__version__,
            }
        ),
        flush=True,
    )
    t0, last, loss = time.perf_counter(), 0, None
    for k in range(1, a.steps + 1):
        i = (k - 1) % len(ids)
        params, state, loss = compiled(params, state, ids[i], ys[i])
        sample = k % a.every == 0 or k == a.steps
        if sample or not a.async_dispatch:
            jax.block_until_ready((params, state, loss))
        if sample:
            t = time.perf_counter()
            print(
                json.dumps(
                    {
                        "kind": "sample",
                        "step": k,
                        "rss_mb": rss_mb()["rss_mb"],
                        "ms_per_step": 1e3 * (t - t0) / (k - last),
                    }
                ),
                flush=True,
            )
            t0, last = t, k
    print(
        json.dumps(
            {
                "kind": "end",
                "final_loss": float(loss),
                "table_in_place": params["emb"].unsafe_buffer_pointer() == table_ptr,
                "peak_rss_mb": rss_mb()["peak_rss_mb"],
            }
        ),
        flush=True,
    )


# ========================================================== the parent


def _run(mode: str, optimizer: str, a: dict[str, Any], bar: Any) -> dict[str, Any]:
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--child",
        f"--mode={mode}", f"--optimizer={optimizer}",
        f"--num-rows={a['num_rows']}", f"--dim={a['dim']}", f"--batch={a['batch']}",
        f"--bag={a['bag']}", f"--num-batches={a['num_batches']}",
        f"--steps={a['steps']}", f"--every={a['every']}", f"--seed={a['seed']}",
        *(["--async-dispatch"] if a["async_dispatch"] else []),
    ]  # fmt: skip
    env = {**os.environ, "JAXSLICES_NATIVE": NATIVE_ENV[mode], "JAX_PLATFORMS": "cpu"}
    if a["keep_freed_memory"]:
        env.update(MALLOC_ENV)
    load = os.getloadavg()[0]
    start, samples, end = None, [], None
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if msg["kind"] == "start":
                start = msg
            elif msg["kind"] == "sample":
                if bar is not None:
                    bar.update(msg["step"] - (samples[-1]["step"] if samples else 0))
                samples.append({k: msg[k] for k in ("step", "rss_mb", "ms_per_step")})
            else:
                end = msg
        err = proc.stderr.read()
    if proc.returncode or start is None or end is None:
        raise RuntimeError(f"soak child {mode}/{optimizer} failed:\n{err[-3000:]}")
    base = next((s for s in samples if s["step"] >= a["baseline_step"]), samples[0])
    after = [s for s in samples if s["step"] >= base["step"]]
    rss = np.asarray([s["rss_mb"] for s in after])
    deltas = np.diff(rss)
    growth = float(rss[-1] - rss[0])
    # A leak adds memory at every interval; the allocator moves in one-off
    # steps (often the size of the step's temporaries, taken or returned).
    steady = float(np.median(deltas) * len(deltas)) if len(deltas) else 0.0
    jumps = [
        {"step": s["step"], "mb": round(float(d), 2)}
        for s, d in zip(after[1:], deltas, strict=True)
        if abs(d) >= a["tolerance_mb"]
    ]
    result = {
        "mode": mode,
        "optimizer": optimizer,
        "baseline_step": base["step"],
        "rss_at_compile_mb": start["rss_mb"],
        "rss_baseline_mb": base["rss_mb"],
        "rss_end_mb": samples[-1]["rss_mb"],
        "growth_mb": growth,
        "steady_growth_mb": steady,
        "max_above_baseline_mb": float(rss.max() - rss[0]),
        "min_below_baseline_mb": float(rss[0] - rss.min()),
        "jumps": jumps,
        "temp_mb": start["temp_mb"],
        "no_growth": growth <= a["tolerance_mb"],
        "no_steady_growth": steady <= a["tolerance_mb"],
        "median_ms_per_step": float(np.median([s["ms_per_step"] for s in samples])),
        "load_avg_1m": {"before": load, "after": os.getloadavg()[0]},
        **{k: start[k] for k in ("custom_calls", "JAXSLICES_NATIVE", "jaxslices_file")},
        **{k: end[k] for k in ("final_loss", "table_in_place", "peak_rss_mb")},
        "samples": samples,
        "command": " ".join(shlex.quote(x) for x in cmd[1:]),
    }
    return result


def main(
    num_rows: int = 131072,
    optimizers: tuple[str, ...] = PEERS_OPTIMIZERS,
    modes: tuple[str, ...] = MODES,
    dim: int = 64,
    batch: int = 1024,
    bag: int = 16,
    num_batches: int = 20,
    steps: int = 4000,
    every: int = 50,
    async_dispatch: bool = False,
    baseline_step: int = 500,
    tolerance_mb: float = 1.0,
    seed: int = 0,
    keep_freed_memory: bool = False,
    out: str | None = None,
    tag: str = "",
    plot: bool = True,
    command: str | None = None,
) -> dict[str, Any]:
    a = dict(locals())
    bar = progress(steps * len(modes) * len(optimizers), "soak_bench")
    runs = []
    for mode in modes:
        for opt in optimizers:
            if bar is not None:
                bar.set_description(f"soak {mode} {opt}")
            runs.append(_run(mode, opt, a, bar))
    if bar is not None:
        bar.close()
    env = environment()
    report = {
        "benchmark": "soak_bench",
        "command": command,
        "settings": {k: x for k, x in a.items() if k not in ("command", "out", "plot")},
        "environment": env,
        "no_growth": all(r["no_growth"] for r in runs),
        "no_steady_growth": all(r["no_steady_growth"] for r in runs),
        "runs": runs,
    }
    report["table"] = markdown(runs)
    name = "soak_bench_cpu" + (f"_{tag}" if tag else "")
    saved = save_json(report, out, name + ".json")
    if saved is not None and plot:
        save_plot(runs, str(saved.with_suffix(".png")), env, a)
    print(
        f"soak_bench: V = {num_rows:,}, {steps} donated steps; resident memory "
        f"from step {baseline_step} to the end (no growth: at most {tolerance_mb} MB)"
    )
    print(report["table"])
    return report


def markdown(runs: list[dict]) -> str:
    lines = [
        "| mode | optimizer | RSS at baseline MB | growth MB | steady growth MB "
        "| one-off jumps (step: MB) | temp MB | ms / step | table in place |",
        "|" + " --- |" * 9,
    ]
    for r in runs:
        jumps = ", ".join(f"{j['step']}: {j['mb']:+.2f}" for j in r["jumps"]) or "-"
        lines.append(
            f"| {r['mode']} | {r['optimizer']} | {r['rss_baseline_mb']:.1f} "
            f"(step {r['baseline_step']}) | {r['growth_mb']:+.2f} | "
            f"{r['steady_growth_mb']:+.2f} | {jumps} | {r['temp_mb']:.2f} | "
            f"{r['median_ms_per_step']:.2f} | {r['table_in_place']} |"
        )
    return "\n".join(lines)


def save_plot(runs: list[dict], path: str, env: dict, a: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for r in runs:
        x = [s["step"] for s in r["samples"]]
        y = [s["rss_mb"] - r["rss_baseline_mb"] for s in r["samples"]]
        ax.plot(
            x,
            y,
            "-" if r["mode"] == "xla" else "--",
            label=f"{r['mode']} {r['optimizer']}",
        )
    ax.axvline(a["baseline_step"], color="k", lw=0.6, ls=":")
    ax.axhspan(-a["tolerance_mb"], a["tolerance_mb"], color="g", alpha=0.08)
    ax.set_xlabel("step")
    ax.set_ylabel(f"RSS - RSS at step {a['baseline_step']} (MB)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(
        f"Soak: V = {a['num_rows']:,}, donated jaxslices step ({env['cpu']} "
        f"x{env['nproc']}, jax {env['jax']})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-rows", type=int, default=131072)
    p.add_argument(
        "--optimizers",
        nargs="+",
        default=list(PEERS_OPTIMIZERS),
        choices=PEERS_OPTIMIZERS,
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=MODES,
        help="xla: JAXSLICES_NATIVE=0; native: JAXSLICES_NATIVE=1",
    )
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--bag", type=int, default=16)
    p.add_argument("--num-batches", type=int, default=20)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--every", type=int, default=50, help="steps between RSS samples")
    p.add_argument(
        "--async-dispatch",
        action="store_true",
        help="block only at the samples, not after every step",
    )
    p.add_argument("--baseline-step", type=int, default=500)
    p.add_argument("--tolerance-mb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="run the children with _common.MALLOC_ENV (glibc keeps freed memory)",
    )
    p.add_argument("--out", default=None, help="folder for soak_bench_cpu.json/.png")
    p.add_argument("--tag", default="", help="appended to the files' names")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="xla", help=argparse.SUPPRESS)
    p.add_argument("--optimizer", default="sgd", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    if args.child:
        child(args)
    else:
        main(
            num_rows=args.num_rows,
            optimizers=tuple(args.optimizers),
            modes=tuple(args.modes),
            dim=args.dim,
            batch=args.batch,
            bag=args.bag,
            num_batches=args.num_batches,
            steps=args.steps,
            every=args.every,
            async_dispatch=args.async_dispatch,
            baseline_step=args.baseline_step,
            tolerance_mb=args.tolerance_mb,
            seed=args.seed,
            keep_freed_memory=args.keep_freed_memory,
            out=args.out,
            tag=args.tag,
            command="python " + " ".join(shlex.quote(x) for x in sys.argv),
        )
