"""jaxslices against FBGEMM's fused CPU kernels (TorchRec's): one training step.

Issue 31's comparison. Workload: one ``V x 64`` float32 table, V in
{131072, 1048576}; 1024 bags x 16 ids per step, ids ``zipf(1.2) % V`` (seed
0, 20 batches cycled); mean pooling; a linear head ``pooled [1024, 64] @ w
[64]`` and the mean squared error against normal targets. The table is trained
by SGD, row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``,
``jaxslices.rowwise_adagrad``) or Adagrad (``EXACT_ADAGRAD``,
``jaxslices.adagrad``), learning rate 0.1, optimizer state starting at 0;
``w`` by plain SGD on both sides. The batches and the initial values are
made once (NumPy, ``_common.peers_data``) and fed to both sides, so their
first losses must agree (checked; recorded as ``check``).

Configurations, each in its own child process:

* ``fbgemm_1thread``, ``fbgemm_2threads``: ``benchmarks/peers_torchrec.py`` run
  by the torch environment's Python (``--torchrec-python``) with
  ``torch.set_num_threads(1)`` / ``(2)``: FBGEMM's
  ``SplitTableBatchedEmbeddingBagsCodegen`` (host table, CPU compute), its
  optimizer fused into ``loss.backward()``.
* ``native_1thread``: ``native`` with ``JAXSLICES_THREADS=1`` (the kernels
  on the calling thread; XLA's own ops still use its pool).
* ``native_1core``, ``fbgemm_1core``: ``native`` and ``fbgemm_1thread``
  pinned to one core with ``taskset -c 0`` (XLA's thread pool, and so the
  kernels, then have one thread; issue 39's one-core and two-core goals
  compare ``native`` with ``native_1core`` and ``native_1core`` with
  ``fbgemm_1core``).
* ``xla``, ``native``: this script's ``--worker`` mode with
  ``JAXSLICES_NATIVE=0`` / ``=1``: ``jax.jit(step, donate_argnums=(0, 1))`` of
  ``jaxslices.value_and_grad`` (``jaxslices.embedding_bag`` on padded
  ``[B, L]`` ids) + ``tx.update`` + ``jaxslices.apply_updates``
  (``_common.peers_step``), JAX on the CPU (``JAX_PLATFORMS=cpu``).
  ``JAXSLICES_NATIVE=0`` forces jaxslices' XLA path; ``1`` lets its native
  path run where it is built (until it exists both run the XLA path). Each
  records the custom-call targets of its compiled step (``custom_calls``):
  a native kernel shows up there.

How it measures: for each (V, optimizer) every configuration's worker is
started, builds, checks its first losses and warms up; then ``--rounds``
rounds, the configurations taking turns in a shuffled order each round
(slow phases of a shared machine hit all alike; the idle ones wait on a
pipe), each turn one untimed and ``--steps`` timed steps. Per configuration:
the median step time over all timed steps (wall), and the medians over rounds
of the CPU time per step (user + system of the worker, every thread: wall x
cores busy) and of the page faults per step. Ratios are to
``fbgemm_1thread``, which stays stable under load where FBGEMM with 2 threads
does not. The whole sweep runs ``--repeats`` times (fresh workers each
time, so that another phase of the machine's load is sampled); the report
gives the median over repeats of each median and of each ratio measured
within one repeat, and every repeat's values. The load average is recorded
before every round.

Memory: with glibc's defaults, temporaries above its mmap threshold come
from fresh pages and cost a page fault per page touched, every step (what
``dlrm_bench.py`` found for 50-90 MB of XLA:CPU temporaries). Each worker
records its page faults per step (``page_faults_per_step``);
``--keep-freed-memory`` runs every worker (both sides) with
``_common.MALLOC_ENV`` (one arena, a fixed mmap threshold, no trimming).

Run: ``python benchmarks/peers_bench.py --torchrec-python
.venv-torchrec/bin/python --out benchmarks/results/<yyyy-mm>-cpu-peers``
(writes ``peers_bench_cpu.json`` and ``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    MALLOC_ENV,
    PEERS_HPARAMS,
    PEERS_OPTIMIZERS,
    cpu_seconds,
    environment,
    fmt_ratio,
    page_faults,
    peers_data,
    progress,
    save_json,
)

CONFIGS = (
    "fbgemm_1thread",
    "fbgemm_2threads",
    "xla",
    "native",
    "native_1thread",
    "native_1core",
    "fbgemm_1core",
)
FBGEMM_THREADS = {"fbgemm_1thread": 1, "fbgemm_2threads": 2, "fbgemm_1core": 1}
NATIVE_ENV = {"xla": "0", "native": "1", "native_1thread": "1", "native_1core": "1"}
#: ``JAXSLICES_THREADS`` of a configuration (unset: XLA's pool, one per CPU).
NATIVE_THREADS = {"native_1thread": "1"}
#: Configurations pinned to one core (``taskset -c 0``): XLA's pool then has
#: one thread, and so have the kernels.
PINNED = ("native_1core", "fbgemm_1core")
REFERENCE = "fbgemm_1thread"
HERE = Path(__file__).resolve().parent
#: Largest relative difference of the check losses before they "disagree".
LOSS_RTOL = 1e-4


# =========================================== worker: the jaxslices side


def worker(a: argparse.Namespace) -> None:
    """One jaxslices configuration: build, check, warm up, then serve ``run K``."""
    import jax
    import jax.numpy as jnp
    from _common import custom_call_targets, peers_optimizer, peers_step, rss_mb

    import jaxslices as js

    data = dict(np.load(a.data))
    t0 = time.perf_counter()
    tx = peers_optimizer(a.optimizer)
    params = {"emb": jnp.asarray(data["table"]), "w": jnp.asarray(data["w"])}
    state = jax.jit(tx.init)(params)
    ids = [jnp.asarray(x) for x in data["ids"]]
    ys = [jnp.asarray(x) for x in data["y"]]
    del data
    compiled = peers_step(tx).lower(params, state, ids[0], ys[0]).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    i = 0

    def step() -> float:
        nonlocal params, state, i
        params, state, loss = compiled(
            params, state, ids[i % len(ids)], ys[i % len(ys)]
        )
        i += 1
        jax.block_until_ready((params, state))  # the whole step, not the loss
        return float(loss)

    check = [step() for _ in range(a.check_steps)]
    for _ in range(a.warmup):
        step()
    info = {
        "ready": True,
        "check_losses": check,
        "build_s": round(compile_s, 2),
        "temp_mb": round(mem.temp_size_in_bytes / 2**20, 2),
        "alias_mb": round(mem.alias_size_in_bytes / 2**20, 2),
        "custom_calls": custom_call_targets(compiled),
        "JAXSLICES_NATIVE": os.environ.get("JAXSLICES_NATIVE"),
        "jaxslices_file": js.__file__,
        "state_bytes": int(
            sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
        ),
        "rss_mb": round(rss_mb()["rss_mb"], 1),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "run":
            break
        n = int(words[1])
        step()  # untimed: the first step after another process ran
        times, c0, f0 = [], cpu_seconds(), page_faults()
        for _ in range(n):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        out = {
            "times": times,
            "cpu_ms": 1e3 * (cpu_seconds() - c0) / n,
            "faults": (page_faults() - f0) / n,
            "rss_mb": rss_mb()["rss_mb"],
        }
        print(json.dumps(out), flush=True)


# ===================================================== parent: the turns


class Worker:
    """A configuration's child process, driven over pipes (``run K``)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path):
        self.name, self.cmd, self.log_path = name, cmd, log
        self.log = open(log, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.info: dict[str, Any] = {}

    def _reply(self, what: str) -> dict[str, Any]:
        """The worker's next JSON line (other lines on its stdout are skipped)."""
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.proc.kill()
        self.close()
        tail = self.log_path.read_text()[-3000:]
        raise RuntimeError(f"worker {self.name} {what} ({self.cmd}):\n{tail}")

    def ready(self) -> dict[str, Any]:
        self.info = self._reply("failed to start")
        return self.info

    def run(self, n: int) -> dict[str, Any]:
        self.proc.stdin.write(f"run {n}\n")
        self.proc.stdin.flush()
        return self._reply("died")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait(timeout=60)
        self.proc.stdout.close()
        self.log.close()


def _start(
    config: str, data: Path, optimizer: str, a: dict[str, Any], log: Path
) -> Worker:
    hp = PEERS_HPARAMS[optimizer]
    if config in FBGEMM_THREADS:
        cmd = [
            a["torchrec_python"], str(HERE / "peers_torchrec.py"), "--serve",
            f"--data={data}", f"--optimizer={optimizer}", f"--lr={hp['lr']}",
            f"--eps={hp.get('eps_fbgemm', 1e-8)}",
            f"--threads={FBGEMM_THREADS[config]}",
            f"--check-steps={a['check_steps']}", f"--warmup={a['warmup']}",
        ]  # fmt: skip
        env = dict(os.environ)
    else:
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "--worker",
            f"--data={data}", f"--optimizer={optimizer}",
            f"--check-steps={a['check_steps']}", f"--warmup={a['warmup']}",
        ]  # fmt: skip
        env = {**os.environ, "JAXSLICES_NATIVE": NATIVE_ENV[config]}
        env.pop("JAXSLICES_THREADS", None)
        if config in NATIVE_THREADS:
            env["JAXSLICES_THREADS"] = NATIVE_THREADS[config]
        env["JAX_PLATFORMS"] = "cpu"  # FBGEMM runs on the CPU: so does JAX
    if a["keep_freed_memory"]:
        env.update(MALLOC_ENV)
    if config in PINNED:
        cmd = ["taskset", "-c", "0", *cmd]
    return Worker(config, cmd, env, log)


def _loss_gap(check: dict[str, list[float]], ref: str) -> dict[str, dict[str, float]]:
    base = np.asarray(check[ref], np.float64)
    out = {}
    for name, losses in check.items():
        x = np.asarray(losses, np.float64)
        rel = np.abs(x - base) / np.maximum(np.abs(base), 1e-30)
        out[name] = {
            "first_rel_diff": float(rel[0]),
            "max_rel_diff": float(rel.max()),
            "agree": bool(rel.max() <= LOSS_RTOL),
        }
    return out


def _group(
    v: int,
    opt: str,
    data: Path,
    configs: tuple[str, ...],
    ref: str,
    a: dict[str, Any],
    rng: np.random.Generator,
    bar: Any,
) -> dict[str, Any]:
    """Every configuration of one (V, optimizer), taking turns over the rounds."""
    if bar is not None:
        bar.set_description(f"V={v} {opt}: starting")
    logs = data.parent
    workers = {c: _start(c, data, opt, a, logs / f"{c}_{v}_{opt}.log") for c in configs}
    times: dict[str, list[float]] = {c: [] for c in configs}
    cpu: dict[str, list[float]] = {c: [] for c in configs}
    busy: dict[str, list[float]] = {c: [] for c in configs}
    faults: dict[str, list[float]] = {c: [] for c in configs}
    loads = []
    try:
        info = {c: w.ready() for c, w in workers.items()}
        if bar is not None:
            bar.set_description(f"V={v} {opt}")
        for _ in range(a["rounds"]):
            loads.append(os.getloadavg()[0])
            for k in rng.permutation(len(configs)):
                c = configs[k]
                r = workers[c].run(a["steps"])
                ms = [1e3 * t for t in r["times"]]
                times[c] += ms
                cpu[c].append(r["cpu_ms"])
                busy[c].append(r["cpu_ms"] / float(np.mean(ms)))
                faults[c].append(r["faults"])
                info[c]["rss_mb_last"] = round(r["rss_mb"], 1)
                if bar is not None:
                    bar.update(1)
    finally:
        for w in workers.values():
            w.close()
    check = {c: info[c]["check_losses"] for c in configs}
    gaps = _loss_gap(check, ref)
    base, base_cpu = float(np.median(times[ref])), float(np.median(cpu[ref]))
    rows = []
    for c in configs:
        t = np.asarray(times[c])
        med, med_cpu = float(np.median(t)), float(np.median(cpu[c]))
        rows.append(
            {
                "num_rows": v,
                "optimizer": opt,
                "config": c,
                "median_ms": med,
                "p25_ms": float(np.percentile(t, 25)),
                "p75_ms": float(np.percentile(t, 75)),
                "min_ms": float(t.min()),
                "max_ms": float(t.max()),
                "steps_timed": int(t.size),
                "cpu_ms": med_cpu,
                "cores_busy": float(np.median(busy[c])),
                "page_faults_per_step": float(np.median(faults[c])),
                f"ratio_to_{ref}": med / base,
                f"cpu_ratio_to_{ref}": med_cpu / base_cpu,
                "check_losses": check[c],
                "check": gaps[c],
                "load_avg_1m": {"min": min(loads), "max": max(loads)},
            }
        )
    described = {
        f"{v}/{opt}/{c}": {
            **{k: x for k, x in info[c].items() if k != "check_losses"},
            "command": " ".join(shlex.quote(x) for x in workers[c].cmd[1:]),
        }
        for c in configs
    }
    return {"rows": rows, "workers": described, "loads": loads}


def _key(row: dict) -> tuple:
    return row["num_rows"], row["optimizer"], row["config"]


def _combine(runs: list[dict], ref: str) -> dict[str, Any]:
    """One configuration over the repeats: medians of each repeat's medians
    (ratios: of the ratios measured within each repeat)."""
    med = ("median_ms", "p25_ms", "p75_ms", "cpu_ms", "cores_busy")
    med += ("page_faults_per_step", f"ratio_to_{ref}", f"cpu_ratio_to_{ref}")
    per_run = ("median_ms", "cpu_ms", f"ratio_to_{ref}", f"cpu_ratio_to_{ref}")
    first = runs[0]
    return {
        "num_rows": first["num_rows"],
        "optimizer": first["optimizer"],
        "config": first["config"],
        **{k: float(np.median([r[k] for r in runs])) for k in med},
        "min_ms": min(r["min_ms"] for r in runs),
        "max_ms": max(r["max_ms"] for r in runs),
        "steps_timed": sum(r["steps_timed"] for r in runs),
        "check_losses": first["check_losses"],
        "check": max((r["check"] for r in runs), key=lambda c: c["max_rel_diff"]),
        "load_avg_1m": {
            "min": min(r["load_avg_1m"]["min"] for r in runs),
            "max": max(r["load_avg_1m"]["max"] for r in runs),
        },
        "repeats": [
            {
                "repeat": r["repeat"],
                **{k: r[k] for k in per_run},
                "load_avg_1m": r["load_avg_1m"],
            }
            for r in runs
        ],  # fmt: skip
    }


def main(
    num_rows: tuple[int, ...] = (131072, 1048576),
    optimizers: tuple[str, ...] = PEERS_OPTIMIZERS,
    configs: tuple[str, ...] = CONFIGS,
    torchrec_python: str | None = None,
    dim: int = 64,
    batch: int = 1024,
    bag: int = 16,
    num_batches: int = 20,
    steps: int = 40,
    rounds: int = 8,
    repeats: int = 3,
    check_steps: int = 3,
    warmup: int = 3,
    seed: int = 0,
    keep_freed_memory: bool = False,
    out: str | None = None,
    tag: str = "",
    plot: bool = True,
    command: str | None = None,
) -> dict[str, Any]:
    a = dict(locals())
    if not torchrec_python:
        configs = tuple(c for c in configs if c not in FBGEMM_THREADS)
    ref = REFERENCE if REFERENCE in configs else configs[0]
    turns = repeats * len(num_rows) * len(optimizers) * rounds * len(configs)
    bar = progress(turns, "peers_bench")
    loads: list[float] = [os.getloadavg()[0]]
    runs, workers_info = [], {}
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="peers_bench_") as tmp:
        paths = {v: Path(tmp) / f"data_{v}.npz" for v in num_rows}
        for v, path in paths.items():
            np.savez(path, **peers_data(v, dim, batch, bag, num_batches, seed))
        for rep in range(repeats):  # the whole sweep again: another load phase
            for v, path in paths.items():
                for opt in optimizers:
                    group = _group(v, opt, path, configs, ref, a, rng, bar)
                    runs += [{**r, "repeat": rep} for r in group["rows"]]
                    workers_info.update(group["workers"])
                    loads += group["loads"]
    if bar is not None:
        bar.close()
    rows = [
        _combine([r for r in runs if _key(r) == key], ref)
        for key in dict.fromkeys(_key(r) for r in runs)
    ]
    loads.append(os.getloadavg()[0])
    env = environment()
    report = {
        "benchmark": "peers_bench",
        "command": command,
        "settings": {
            k: x
            for k, x in a.items()
            if k not in ("command", "out", "plot", "torchrec_python")
        },
        "hyperparameters": PEERS_HPARAMS,
        "reference": ref,
        "environment": env,
        "load_avg_1m": {
            "start": loads[0],
            "end": loads[-1],
            "min": min(loads),
            "max": max(loads),
        },
        "rows": rows,
        "workers": workers_info,  # the last repeat's workers
    }
    report["losses_agree"] = all(r["check"]["agree"] for r in rows)
    report["table"] = markdown(rows, configs, ref)
    name = "peers_bench_cpu" + (f"_{tag}" if tag else "")
    saved = save_json(report, out, name + ".json")
    if saved is not None and plot:
        png = str(saved.with_suffix(".png"))
        save_plot(rows, configs, png, env, report["load_avg_1m"])
    print(
        f"peers_bench: ms per step, wall (CPU); load average "
        f"{min(loads):.2f}-{max(loads):.2f}"
    )
    print(report["table"])
    if not report["losses_agree"]:
        bad = [
            (r["num_rows"], r["optimizer"], r["config"], r["check"])
            for r in rows
            if not r["check"]["agree"]
        ]
        print(f"WARNING: check losses disagree with {ref}: {bad}")
    return report


def markdown(rows: list[dict], configs: tuple[str, ...], ref: str) -> str:
    """Wall ms (CPU ms) per configuration and the ratios to ``ref``."""
    others = [c for c in configs if c != ref]
    head = ["optimizer", "V", *configs, *(f"{c} / {ref}" for c in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    keys = dict.fromkeys((r["optimizer"], r["num_rows"]) for r in rows)
    for key in keys:
        opt, v = key
        by = {
            r["config"]: r for r in rows if (r["optimizer"], r["num_rows"]) == (opt, v)
        }
        cells = [opt, f"{v:,}"]
        cells += [f"{by[c]['median_ms']:.2f} ({by[c]['cpu_ms']:.2f})" for c in configs]
        cells += [
            f"{fmt_ratio(by[c]['median_ms'], by[ref]['median_ms'])} "
            f"({fmt_ratio(by[c]['cpu_ms'], by[ref]['cpu_ms'])})"
            for c in others
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def save_plot(
    rows: list[dict], configs: tuple[str, ...], path: str, env: dict, load: dict
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs = sorted({r["num_rows"] for r in rows})
    opts = list(dict.fromkeys(r["optimizer"] for r in rows))
    fig, axes = plt.subplots(1, len(vs), figsize=(5 * len(vs), 3.8), squeeze=False)
    width = 0.8 / len(configs)
    for ax, v in zip(axes[0], vs, strict=True):
        for j, c in enumerate(configs):
            pts = [
                next(r for r in rows if (r["num_rows"], r["optimizer"], r["config"])
                     == (v, o, c))
                for o in opts
            ]  # fmt: skip
            x = np.arange(len(opts)) + (j - (len(configs) - 1) / 2) * width
            med = np.array([r["median_ms"] for r in pts])
            err = np.array(
                [
                    [m - r["p25_ms"], r["p75_ms"] - m]
                    for m, r in zip(med, pts, strict=True)
                ]
            ).T
            ax.bar(x, med, width, yerr=err, capsize=2, label=c)
            ax.plot(
                x,
                [r["cpu_ms"] for r in pts],
                "k.",
                ms=5,
                label="CPU ms / step" if j == 0 else None,
            )
        ax.set_xticks(np.arange(len(opts)), opts)
        ax.set_yscale("log")
        ax.set_title(f"V = {v:,}")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel("ms / step (median, p25-p75; log)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        f"jaxslices vs FBGEMM, one step ({env['cpu']} x{env['nproc']}, "
        f"jax {env['jax']}, load average {load['min']:.1f}-{load['max']:.1f})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-rows", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument(
        "--optimizers",
        nargs="+",
        default=list(PEERS_OPTIMIZERS),
        choices=PEERS_OPTIMIZERS,
    )
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument(
        "--torchrec-python",
        default=None,
        help="the torch environment's python (torch, fbgemm-gpu-cpu); "
        "without it only the jaxslices configurations run",
    )
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--bag", type=int, default=16)
    p.add_argument("--num-batches", type=int, default=20)
    p.add_argument("--steps", type=int, default=40, help="timed steps per turn")
    p.add_argument("--rounds", type=int, default=8, help="turns per configuration")
    p.add_argument(
        "--repeats", type=int, default=3,
        help="sweeps over every (V, optimizer), fresh workers each time",
    )  # fmt: skip
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="run every worker with _common.MALLOC_ENV (glibc keeps freed memory)",
    )
    p.add_argument("--out", default=None, help="folder for peers_bench_cpu.json/.png")
    p.add_argument("--tag", default="", help="appended to the files' names")
    # the jaxslices worker (started by the parent; not for the command line)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--optimizer", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    if args.worker:
        worker(args)
    else:
        main(
            num_rows=tuple(args.num_rows),
            optimizers=tuple(args.optimizers),
            configs=tuple(args.configs),
            torchrec_python=args.torchrec_python,
            dim=args.dim,
            batch=args.batch,
            bag=args.bag,
            num_batches=args.num_batches,
            steps=args.steps,
            rounds=args.rounds,
            repeats=args.repeats,
            check_steps=args.check_steps,
            warmup=args.warmup,
            seed=args.seed,
            keep_freed_memory=args.keep_freed_memory,
            out=args.out,
            tag=args.tag,
            command="python " + " ".join(shlex.quote(x) for x in sys.argv),
        )
