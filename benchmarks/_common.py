"""Shared helpers for the benchmark scripts: timing, progress, environment, output.

Kept tiny on purpose; each script stays readable on its own. Scripts import
this as a sibling module (``python benchmarks/<script>.py`` puts
``benchmarks/`` on ``sys.path``; the smoke tests do the same), and the
repository's ``tools/`` and ``examples/`` through ``_repo.load``; no script
edits ``sys.path`` (tests/repo/test_benchmarks.py checks it).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jax
import numpy as np


def progress(total: int, desc: str) -> Any:
    """A tqdm bar (or ``None`` without tqdm); call ``.update(n)`` and ``.close()``."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is an examples extra
        return None
    return tqdm(total=total, desc=desc, leave=False)


def time_call(fn: Callable[[], Any]) -> float:
    """Milliseconds for one call of ``fn`` (which must block on its result)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def interleave(
    fns: dict[str, Callable[[], Any]],
    steps: int,
    passes: int,
    bar: Any = None,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Time ``steps`` calls of each function per turn, round robin over ``passes``.

    Interleaving spreads slow phases of a shared, noisy machine over every
    configuration, so that ratios measured in one run compare like with like.
    Two biases are removed: the order is shuffled every pass (seeded), so no
    function always runs right after the one that flushes the caches (a dense
    step over a 1 GB table, say), and each turn starts with ``warmup`` untimed
    calls, so that what is timed is the steady state of that function, not the
    switch. Each function must run one step and block until its result is
    ready.
    """
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    rng = np.random.default_rng(0)
    for _ in range(passes):
        for i in rng.permutation(len(names)):
            name = names[i]
            for _ in range(warmup):
                fns[name]()
            times[name] += [time_call(fns[name]) for _ in range(steps)]
            if bar is not None:
                bar.update(steps)
    return times


def summary(times: list[float]) -> dict[str, float]:
    """Median, min and max (ms) and the number of timed calls."""
    t = np.asarray(times)
    return {
        "median_ms": float(np.median(t)),
        "min_ms": float(t.min()),
        "max_ms": float(t.max()),
        "steps_timed": int(t.size),
    }


def timed_report(
    env: dict[str, Any],
    workload: dict[str, Any],
    times: dict[str, list[float]],
    **extra,
) -> dict[str, Any]:
    """A micro-benchmark's JSON: where it ran (load at start and end), what, times."""
    return {
        "environment": {**env, "load_avg_1m_end": environment()["load_avg_1m"]},
        "workload": workload,
        "ms": {name: summary(t) for name, t in times.items()},
        **extra,
    }


def rows_passes_out(doc: str | None) -> Any:
    """The command line of a kernel micro-benchmark: --num-rows, --passes, --out."""
    import argparse

    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument("--num-rows", type=int, default=1 << 20)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def rss_mb() -> dict[str, float]:
    """Current and peak resident set size of this process, in MB (Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        current = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):  # not Linux
        current = float("nan")
    return {"rss_mb": current, "peak_rss_mb": peak}


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    for line in out.stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def environment() -> dict[str, Any]:
    """Hardware and versions, recorded with every result file."""
    import optax

    return {
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "cpu": _cpu_model(),
        "nproc": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "jax": jax.__version__,
        "jaxlib": version("jaxlib"),
        "optax": optax.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def save_json(report: dict[str, Any], out: str | None, name: str) -> Path | None:
    """Write ``report`` to ``out/name`` (``None``: do nothing)."""
    if not out:
        return None
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    return path


def fmt_ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``"1.23x"`` (``"-"`` when either is missing)."""
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


# ------------------------------------------- hand-written O(N) hash dedup
# The floor of step_bench.py and a method of coalesce_bench.py: independent of
# jaxslices (jaxslices' own version is ``coalesce(s, method="hash")``).


def hash_representatives(safe, valid, load: int = 4):
    """A representative slot per distinct id (O(N) memory, a few rounds).

    Each round, every unresolved slot writes its position into the cell
    ``hash_r(id)`` of an ``M >= load * N`` buffer and reads the cell back; the
    slots of the id that won the cell are resolved, the others retry with the
    next round's hash. The buffer is never cleared: a cell is always written
    in the round it is read. (XLA:CPU scatters run in order, so the winner is
    deterministic there.)
    """
    import jax.numpy as jnp

    n = safe.shape[0]
    log_m = max(1, (load * n - 1).bit_length())
    m = 1 << log_m
    iota = jnp.arange(n, dtype=jnp.int32)
    u = safe.astype(jnp.uint32)

    def body(carry):
        rep, buf, r = carry
        todo = rep < 0
        a = (jnp.uint32(0x9E3779B1) + r * jnp.uint32(0x6A09E668)) | jnp.uint32(1)
        cell = ((u * a) >> (32 - log_m)).astype(jnp.int32)
        cell = jnp.where(todo, cell, m)  # resolved slots write nothing
        buf = buf.at[cell].set(iota, mode="drop")
        winner = buf.at[cell].get(mode="fill", fill_value=0)
        won = todo & (safe[winner] == safe)
        return jnp.where(won, winner, rep), buf, r + jnp.uint32(1)

    rep0 = jnp.where(valid, -1, iota)
    buf0 = jnp.zeros((m,), jnp.int32)
    rep, _, _ = jax.lax.while_loop(
        lambda c: jnp.any(c[0] < 0), body, (rep0, buf0, jnp.uint32(0))
    )
    return rep


def from_representatives(rep, safe, valid, rows, num_rows: int):
    """Sum the rows of each id into compact slots: distinct ids, then padding."""
    import jax.numpy as jnp

    n = rep.shape[0]
    is_rep = valid & (rep == jnp.arange(n, dtype=rep.dtype))
    pos = jnp.cumsum(is_rep.astype(jnp.int32)) - 1
    seg = jnp.where(valid, pos[rep], n)  # invalid slots: out of range, dropped
    summed = jax.ops.segment_sum(rows, seg, n)
    target = jnp.where(is_rep, pos, n)
    idx = jnp.full((n,), num_rows, safe.dtype).at[target].set(safe, mode="drop")
    return idx, summed


def hash_dedup(ids, rows, num_rows: int, load: int = 4):
    """(unique ids with padding ``num_rows``, summed rows), hand-written."""
    import jax.numpy as jnp

    valid = (ids >= 0) & (ids < num_rows)
    safe = jnp.where(valid, ids, num_rows)
    rep = hash_representatives(safe, valid, load)
    return from_representatives(rep, safe, valid, rows, num_rows)


# glibc's malloc serves blocks over 32 MB (its largest mmap threshold), and
# blocks too large for a thread arena's heap, with fresh pages from the kernel
# and returns them on free: an XLA:CPU step whose temporaries exceed that pays
# a page fault per page touched, every step. These settings (one arena, no
# trimming) keep freed memory in the process (dlrm_bench.py, peers_bench.py and
# soak_bench.py, ``--keep-freed-memory``: both sides run with them). An
# explicit mmap threshold also turns off glibc's dynamic one, which otherwise
# moves as blocks are freed, so a step's temporaries may come from fresh pages
# or from the heap depending on the process's history.
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 31),
    "MALLOC_TOP_PAD_": str(1 << 28),
}


# ------------------------------------------- the peers workload (issue 31)
# ``peers_bench.py`` (against FBGEMM) and ``soak_bench.py`` train the same
# step: one ``V x 64`` float32 table, 1024 bags x 16 Zipf ids, mean pooling,
# a linear head ``pooled @ w`` and the mean squared error against targets.

PEERS_OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad")

#: Hyperparameters of each optimizer, chosen so that both sides compute the
#: same update (FBGEMM's CPU rules: ``fbgemm_gpu/codegen/genscript/optimizers.py``).
#: Learning rate 0.1; optimizer state from 0; the head ``w`` by plain SGD.
#: SGD: ``w -= lr * g``. Row-wise Adagrad: the same formula on both sides
#: (``acc += mean(g**2)``, ``w -= lr * g / (sqrt(acc) + eps)``), the same eps.
#: Adagrad: FBGEMM's ``EXACT_ADAGRAD`` adds ``eps`` outside the square root
#: (``w -= lr * g / (sqrt(acc) + eps)``), ``jaxslices.adagrad`` (Optax's
#: formula) inside it (``w -= lr * g / sqrt(acc + eps)``); no pair of values
#: makes them equal. Here FBGEMM gets ``eps = 1e-10`` and jaxslices
#: ``eps = 1e-20`` (its square): both are then the eps-free rule to a relative
#: ``eps / sqrt(acc)`` (``1e-5`` where a gradient entry is ``1e-5``, this
#: workload's scale). With one ``eps`` of ``1e-8`` on both sides they would
#: differ by a factor ``sqrt(1 + 1e-8 / acc)`` (7x where ``acc = g**2 = 1e-10``).
PEERS_HPARAMS: dict[str, dict[str, float]] = {
    "sgd": {"lr": 0.1},
    "rowwise_adagrad": {"lr": 0.1, "eps": 1e-8, "eps_fbgemm": 1e-8},
    "adagrad": {"lr": 0.1, "eps": 1e-20, "eps_fbgemm": 1e-10},
}


def peers_data(
    num_rows: int,
    dim: int = 64,
    batch: int = 1024,
    bag: int = 16,
    num_batches: int = 20,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """The peers workload as NumPy arrays (the same on every side).

    ``table`` ``[V, dim]`` (``0.01 * normal``), ``w`` ``[dim]`` (``0.1 *
    normal``), ``ids`` ``[num_batches, batch, bag]`` int32 (``zipf(1.2) % V``),
    ``y`` ``[num_batches, batch]`` (normal targets).
    """
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.2, size=(num_batches, batch, bag)) % num_rows).astype(np.int32)
    y = rng.standard_normal((num_batches, batch), dtype=np.float32)
    w = 0.1 * rng.standard_normal(dim, dtype=np.float32)
    table = rng.standard_normal((num_rows, dim), dtype=np.float32)
    table *= np.float32(0.01)
    return {"table": table, "w": w, "ids": ids, "y": y}


def peers_optimizer(name: str) -> Any:
    """The peers step's optimizer: ``name`` on the table, SGD on ``w``."""
    import optax

    import jaxslices as js

    hp = PEERS_HPARAMS[name]
    lr = hp["lr"]
    emb = {
        "sgd": lambda: js.sgd(lr),
        "rowwise_adagrad": lambda: js.rowwise_adagrad(
            lr, initial_accumulator_value=0.0, eps=hp["eps"]
        ),
        "adagrad": lambda: js.adagrad(lr, initial_accumulator_value=0.0, eps=hp["eps"]),
    }[name]()
    return optax.multi_transform(
        {"emb": emb, "head": optax.sgd(lr)},
        {"emb": "emb", "w": "head"},
    )


def peers_step(tx: Any) -> Callable:
    """The donated, jitted jaxslices training step of the peers workload.

    Public API only: :func:`jaxslices.embedding_bag` (padded ``[B, L]`` ids,
    mean), :func:`jaxslices.value_and_grad`, ``tx.update``,
    :func:`jaxslices.apply_updates`. Call as ``step(params, state, ids, y)``
    with ``params = {"emb": table, "w": w}``; returns ``(params, state, loss)``.
    """
    import jax.numpy as jnp

    import jaxslices as js

    def loss_fn(p, ids, y):
        pooled = js.embedding_bag(p["emb"], ids)  # [B, D], mean of each bag
        return jnp.mean((pooled @ p["w"] - y) ** 2)

    def step(p, state, ids, y):
        loss, grads = js.value_and_grad(loss_fn)(p, ids, y)
        updates, state = tx.update(grads, state, p)
        return js.apply_updates(p, updates), state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def custom_call_targets(compiled: Any) -> list[str]:
    """The distinct custom-call targets of a compiled step's HLO (an FFI kernel
    shows up here; the XLA path has none but callbacks)."""
    import re

    text = compiled.as_text()
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))


def page_faults() -> int:
    """Page faults (minor + major) of this process so far: a step whose
    temporaries come from fresh pages pays one per page touched."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt + r.ru_majflt


def cpu_seconds() -> float:
    """CPU seconds (user + system, every thread) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
