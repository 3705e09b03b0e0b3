"""Shared helpers for the benchmark scripts: timing, progress, environment, output.

Kept tiny on purpose; each script stays readable on its own. Scripts import
this as a sibling module (``python benchmarks/<script>.py`` puts
``benchmarks/`` on ``sys.path``; the smoke tests do the same).
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
