"""Build, cache and load the native CPU kernels (C++ through the XLA FFI).

The kernels are compiled on first use, against the headers of the jaxlib
that is installed (``jax.ffi.include_dir()``), so that the library speaks
that jaxlib's FFI version; installing jaxslices never needs a compiler.

* **Compiler.** ``$JAXSLICES_CXX``, else ``$CXX``, else the first of ``c++``,
  ``g++``, ``clang++`` on ``PATH``. Flags: ``-O3 -std=c++17 -shared -fPIC
  -fno-math-errno -ffp-contract=off`` (products and sums rounded as the XLA
  reference rounds them) and ``-march=native`` (tuned for this CPU: the
  prototype's kernels ran in 0.8x the time of a plain ``-O3`` build), retried
  without it if the compiler refuses; ``$JAXSLICES_CXXFLAGS`` adds flags.
* **Cache.** ``$JAXSLICES_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxslices``,
  else ``~/.cache/jaxslices``: one ``libjaxslices_kernels-<key>.so`` per
  (sources, compiler, flags, jaxlib, CPU), so a new jaxlib, a new compiler or
  another machine sharing the directory builds its own.
* **Cost.** The first build compiles every kernel with ``-O3``: 40 to 80
  seconds on a laptop-class CPU (one compiler process; measured 40 s with
  g++ 12 on two cores, about 80 s reported on a fresh clone), once per
  cache key; every later process loads the cached library in milliseconds.
  While it builds, one line on stderr says so (``jaxslices: building the
  native CPU kernels ...``); ``python -m jaxslices.kernels`` builds ahead of
  time and prints what was used.
* **Parallel workers** (``pytest -n``, several processes starting at once):
  a file lock makes one process build while the others wait, and the library
  is written under a temporary name and renamed into place, so no process
  ever loads a half-written file.
* **Without a compiler**, or if the build or the loading fails, jaxslices
  runs the XLA path and says so once (a :class:`KernelsUnavailableWarning`
  naming the cause, the first time a step or :func:`load` asks for the
  kernels); :func:`status` tells the same at any time, without warning, and
  :func:`reason` gives the cause alone. ``JAXSLICES_NATIVE=0`` turns the
  kernels off: nothing is built and nothing warns.
* **Command line**: ``python -m jaxslices.kernels`` builds (or finds) the
  library and prints :func:`status`, the compiler, the flags, the threads
  and the cache (``jaxslices/kernels/__main__.py``; ``--help``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import jax

__all__ = [
    "KernelsUnavailableWarning",
    "build_info",
    "cache_dir",
    "library_path",
    "load",
    "reason",
    "status",
]

SOURCES = (
    "common.h", "parallel.h", "bag.cc", "rowwise.cc", "apply.cc", "pool.cc", "remap.cc"
)  # fmt: skip
# FFI target name -> exported handler symbol: each kernel once per ids dtype.
TARGETS = {
    f"jaxslices_{kernel}_{ids}": f"Jaxslices{symbol}{ids.upper()}"
    for kernel, symbol in (
        ("bag_forward", "BagForward"),
        ("rowwise", "Rowwise"),
        ("apply", "Apply"),
    )
    for ids in ("s32", "s64")
}
TARGETS["jaxslices_pool_threads"] = "JaxslicesPoolThreads"
# The managed-collision remap (jaxslices/managed/_ops.py): no ids dtype (raw
# ids are pairs of uint32 words), one registration each.
TARGETS["jaxslices_managed_admit"] = "JaxslicesManagedAdmit"
TARGETS["jaxslices_managed_evict"] = "JaxslicesManagedEvict"
#: ``-ffp-contract=off``: no fused multiply-adds, so that a kernel rounds each
#: product and each sum as its XLA reference does (a contracted ``a + f * x``
#: rounds once, and a bfloat16 table's stochastic rounding, a hash of the
#: float32 total, then drew other bits for a few entries of an SGD step).
BASE_FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    "-ffp-contract=off",
)


class KernelsUnavailableWarning(UserWarning):
    """The native CPU kernels could not be built or loaded: the XLA path runs."""


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.ok = False
        self.reason = "not built yet (built on first use)"
        self.path: Path | None = None
        self.warned = False
        self.compiler: str | None = None  # what built (or would build) it
        self.flags: tuple[str, ...] = ()
        self.seconds: float | None = None  # this process's build, if it built
        self.cache: Path | None = None  # the cache used (a fallback if unwritable)


_STATE = _State()


def _source_dir() -> Path:
    return Path(__file__).resolve().parent / "csrc"


def _compiler() -> str | None:
    for var in ("JAXSLICES_CXX", "CXX"):
        value = os.environ.get(var)
        if value:
            return shutil.which(value) or (value if Path(value).exists() else None)
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def cache_dir() -> Path:
    env = os.environ.get("JAXSLICES_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "jaxslices"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the machine and its CPU flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{flags}"


def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=30
        )
        return out.stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _key(cxx: str, extra: list[str]) -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((_source_dir() / name).read_bytes())
    include = Path(jax.ffi.include_dir())
    for header in ("xla/ffi/api/ffi.h", "xla/ffi/api/api.h", "xla/ffi/api/c_api.h"):
        path = include / header
        if path.exists():
            h.update(path.read_bytes())
    h.update(_compiler_version(cxx).encode())
    h.update(" ".join([*BASE_FLAGS, *extra]).encode())
    h.update(_cpu_signature().encode())
    return h.hexdigest()[:16]


def _compile(cxx: str, out: Path, extra: list[str]) -> str | None:
    """Compile into ``out``; the compiler's error text, or ``None`` on success."""
    src = _source_dir()
    cmd = [
        cxx,
        *BASE_FLAGS,
        *extra,
        "-isystem",
        jax.ffi.include_dir(),
        "-o",
        str(out),
        *(str(src / n) for n in SOURCES if n.endswith(".cc")),
    ]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    if res.returncode != 0:
        return (res.stderr or res.stdout).strip()[-2000:]
    return None


class _FileLock:
    """An exclusive lock on a file (``fcntl``), a no-op where that is missing."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> _FileLock:
        try:
            import fcntl
        except ImportError:  # Windows: the atomic rename alone keeps it safe
            return self
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


def _build() -> tuple[Path | None, str]:
    """The cached library, built if needed: ``(path, "")`` or ``(None, why)``."""
    cxx = _compiler()
    if cxx is None:
        return None, (
            "no C++ compiler found (looked for $JAXSLICES_CXX, $CXX, c++, g++, "
            "clang++); install one (e.g. `apt install g++`) to get the native path"
        )
    extra = os.environ.get("JAXSLICES_CXXFLAGS", "").split()
    cache = cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=cache, delete=True)
        probe.close()
    except OSError:
        cache = Path(tempfile.gettempdir()) / f"jaxslices-{os.getuid()}"
        cache.mkdir(parents=True, exist_ok=True)
    attempts = [["-march=native", *extra], extra]
    errors = []
    _STATE.compiler, _STATE.cache = cxx, cache
    for flags in attempts:
        _STATE.flags = (*BASE_FLAGS, *flags)
        key = _key(cxx, flags)
        final = cache / f"libjaxslices_kernels-{key}.so"
        if final.exists():
            return final, ""
        with _FileLock(cache / f"libjaxslices_kernels-{key}.lock"):
            if final.exists():  # another process built it meanwhile
                return final, ""
            fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so.tmp")
            os.close(fd)
            _notice(
                f"jaxslices: building the native CPU kernels with {cxx} (once per "
                f"jaxlib, compiler and CPU; about a minute), cached in {cache}"
            )
            start = time.perf_counter()
            err = _compile(cxx, Path(tmp), flags)
            if err is None:
                os.replace(tmp, final)
                _STATE.seconds = time.perf_counter() - start
                return final, ""
            Path(tmp).unlink(missing_ok=True)
            errors.append(f"{cxx} {' '.join(flags)}: {err}")
    return None, "the C++ build failed:\n" + "\n".join(errors)


def _notice(line: str) -> None:
    """One line on stderr: what a process is doing that takes long."""
    print(line, file=sys.stderr, flush=True)


def _register(path: Path) -> None:
    lib = ctypes.CDLL(str(path))
    jax.devices("cpu")  # the CPU backend first: a bad handler is then an error
    for target, symbol in TARGETS.items():
        capsule = jax.ffi.pycapsule(getattr(lib, symbol))
        jax.ffi.register_ffi_target(target, capsule, platform="cpu")


def enabled_by_env() -> bool:
    """``False`` when ``JAXSLICES_NATIVE`` is ``0`` (or ``false``/``off``/``no``)."""
    value = os.environ.get("JAXSLICES_NATIVE", "1").strip().lower()
    return value not in ("0", "false", "off", "no")


def load(*, warn: bool = True) -> bool:
    """Build (once, cached), load and register the kernels; ``True`` if usable.

    ``False`` without building when ``JAXSLICES_NATIVE=0``. On failure,
    returns ``False`` (callers then take the XLA path) and, with ``warn``,
    warns once per process (:class:`KernelsUnavailableWarning`, naming the
    cause); ``warn=False`` (:func:`status`, the command line) leaves the
    warning to the next caller. Thread-safe.
    """
    if not enabled_by_env():
        return False
    st = _STATE
    if not st.done:
        with st.lock:
            if not st.done:
                try:
                    path, why = _build()
                    if path is not None:
                        _register(path)
                        st.path, st.ok, st.reason = path, True, str(path)
                    else:
                        st.reason = why
                except Exception as e:  # noqa: BLE001 - any failure means "XLA path"
                    st.reason = f"loading the kernels failed: {type(e).__name__}: {e}"
                st.done = True
    if warn and not st.ok and not st.warned:
        st.warned = True
        warnings.warn(
            "jaxslices: the native CPU kernels are unavailable, so every step "
            f"runs on the XLA path (correct, slower on CPU). Cause: {st.reason}. "
            "jaxslices.kernels.status() repeats this; JAXSLICES_NATIVE=0 "
            "silences it.",
            KernelsUnavailableWarning,
            stacklevel=3,
        )
    return st.ok


def reason() -> str:
    """Why the kernels do not run, the cause alone; ``""`` when they are loaded.

    :func:`status` is the same with its prefix (``"unavailable: "``), and says
    "not built yet" before the first :func:`load`.
    """
    if not enabled_by_env():
        return "disabled by JAXSLICES_NATIVE=0"
    return "" if _STATE.ok else _STATE.reason


def status() -> str:
    """One line on the kernels: ``"loaded: <library path>"``, or why not."""
    if not enabled_by_env():
        return "disabled by JAXSLICES_NATIVE=0: the XLA path runs"
    return ("loaded: " if _STATE.ok else "unavailable: ") + _STATE.reason


def library_path() -> Path | None:
    """The loaded library's path, or ``None``."""
    return _STATE.path


def build_info() -> dict[str, object]:
    """What builds the kernels here: compiler, flags, cache, this build's time.

    ``compiler`` is the one :func:`load` used (else the one it would use,
    ``None`` without any), ``flags`` the flags of the library loaded (else
    the first the build tries), ``seconds`` the time this process spent
    compiling (``None``: found in the cache, or not built).
    """
    cxx = _STATE.compiler or _compiler()
    extra = os.environ.get("JAXSLICES_CXXFLAGS", "").split()
    return {
        "compiler": cxx,
        "version": next(iter(_compiler_version(cxx).splitlines()), "") if cxx else "",
        "flags": _STATE.flags or (*BASE_FLAGS, "-march=native", *extra),
        "cache": _STATE.cache or cache_dir(),
        "seconds": _STATE.seconds,
    }


if __name__ == "__main__":  # the command line moved: runpy warned on this name
    sys.exit(
        "run `python -m jaxslices.kernels` to build the kernels and see their status"
    )
