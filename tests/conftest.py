"""Test configuration: 8 CPU devices for sharding tests, hypothesis profiles,
the native kernels asked for once (their status in the report's header)."""

import os

# Must be set before JAX initialises its backends. The suite compiles some
# 10,000 small programs and runs each for microseconds: LLVM's optimisation
# passes (XLA:CPU's backend) were about a third of the time of the heaviest
# files (tests/lib/test_kernels.py, tests/scale/test_plans.py and
# tests/lib/test_kernels_lowp.py on 2 cores, 2026-12-07: 214 s at XLA's
# default level 2, 144 s at level 1, 126 s at level 0). Level 1 keeps XLA's
# HLO passes and the arithmetic users get: the bitwise tests (native against
# XLA, jaxslices against Optax and the stock layers) pass as at level 2.
# Level 0 does not: it moved one entry of an Adagrad step against Optax by an
# ulp (tests/lib/test_nnx.py). Benchmarks and examples run outside the suite
# at XLA's default level.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=1",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


# ------------------------------------------- one compilation cache per session
#: The session's programs compiled once for all its processes: the xdist
#: workers and the subprocesses the tests start (examples, notebooks, meshes)
#: share one JAX persistent compilation cache, a fresh directory per session
#: that the controlling process removes at its end. A program one process
#: compiled is loaded by the others instead of compiled again (the same
#: executable: the cache key is the program, the JAX version, the devices and
#: the XLA flags). Every program is cached (no minimum compile time). The
#: cache has no size bound: a bound makes JAX scan every entry under a file
#: lock on each write, quadratic in the session's some 10,000 programs (it
#: made the suite slower, not faster). Without the lock a worker may read an
#: entry another is still writing: JAX then warns ("Error reading persistent
#: compilation cache entry", pyproject's filterwarnings lets it pass) and
#: compiles the program itself. Off where JAX is already given a cache
#: (``JAX_COMPILATION_CACHE_DIR``) or with ``JAXSLICES_TEST_COMPILE_CACHE=0``.
#:
#: Off on jaxlib 0.12 and later: there an 8-device step loaded from the cache
#: deadlocks (XLA aborts after 40 s, "Termination timeout for all reduce"; one
#: device leaves a while loop whose condition is all-reduced while the others
#: stay in it), where the same program compiled afresh runs. Seen on jaxlib
#: 0.12.0.1, not on 0.10.2; reproduce with ``JAXSLICES_TEST_COMPILE_CACHE=1
#: pytest tests/scale/test_plans.py -k "trains_like_one_device and
#: data_parallel"`` (the all-to-all case loads the masked case's step).
#: docs/scale_out.md, "Limits", tells users.
_CACHE_OWNER = "JAXSLICES_TEST_COMPILE_CACHE_OWNER"
_CACHE_SAFE_BEFORE_JAXLIB = (0, 12)


def _cache_is_safe_here() -> bool:
    from importlib.metadata import version

    line = tuple(int(p) for p in version("jaxlib").split(".")[:2])
    return line < _CACHE_SAFE_BEFORE_JAXLIB


def _share_one_compilation_cache() -> None:
    asked = os.environ.get("JAXSLICES_TEST_COMPILE_CACHE")
    if asked == "0" or (asked != "1" and not _cache_is_safe_here()):
        return
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return  # given by the caller, or made by this session's controller
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
        prefix="jaxslices-tests-jit-"
    )
    os.environ[_CACHE_OWNER] = str(os.getpid())
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


_share_one_compilation_cache()

import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.register_profile("dev", max_examples=50, deadline=None)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "dev")


import pytest  # noqa: E402

# Builds or finds the native kernels now, in every process (xdist workers
# too), with their one-time warning caught: no test meets it as an error.
from helpers import KERNELS_STATUS  # noqa: E402


def pytest_report_header(config):
    lines = [f"jaxslices native kernels: {KERNELS_STATUS}"]
    if os.environ.get(_CACHE_OWNER) is not None:
        cache = "on, this session's"
    elif "JAX_COMPILATION_CACHE_DIR" in os.environ:
        cache = "JAX_COMPILATION_CACHE_DIR's"
    else:
        cache = "off (JAXSLICES_TEST_COMPILE_CACHE=0, or jaxlib 0.12 and later)"
    lines.append(f"shared compilation cache: {cache}")
    if not _runs_one_leg_here():  # (xdist: the workers deselect, the header says)
        lines.append(
            "notebook, long example and benchmark runs (newest_leg): deselected on "
            "this JAX line, run on the newest tested one; JAXSLICES_EVERY_LEG=1 "
            "runs them"
        )
    return lines


# .ci/run prints the time of each part of a leg (venv, tests, docs, the
# compiler-less pass); the tests' part is stamped here, by the controlling
# process (not the xdist workers), into the file it names.
def _stamp_ci_times(config, what):
    path = os.environ.get("JAXSLICES_CI_TIMES")
    if path and not hasattr(config, "workerinput"):
        import time

        with open(path, "a") as f:
            f.write(f"{what} {time.time():.1f}\n")


def pytest_sessionstart(session):
    _stamp_ci_times(session.config, "tests_start")


def pytest_sessionfinish(session, exitstatus):
    _stamp_ci_times(session.config, "tests_end")


def pytest_unconfigure(config):
    if os.environ.get(_CACHE_OWNER) == str(os.getpid()):
        import shutil

        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def xla_path():
    """Trace on the XLA path (the native kernels off), for tests of its structure.

    The native path has its own structural tests (tests/lib/test_kernels.py).
    """
    import jaxslices

    with jaxslices.kernels.disabled():
        yield


# ------------------------------------------------ runs made on one leg only

#: Marks a test that runs a notebook, a long example or a benchmark end to
#: end: minutes of the library code that the rest of the suite tests on every
#: leg (the benchmarks' smoke runs call the same public API the library's
#: tests check on each leg; their static checks still run on every leg). It runs on
#: the newest tested JAX line (what Colab runs; CI's newest leg) and is
#: deselected on older lines, where the committed outputs are still checked
#: (tests/repo/test_notebooks.py's other tests), as the compiler-less pass
#: runs a selection for its leg. ``JAXSLICES_EVERY_LEG=1`` runs them anyway.
ONE_LEG = "newest_leg"


def _runs_one_leg_here() -> bool:
    from jaxslices import _jax_compat as compat

    newest = compat.parse_version(compat.NEWEST_TESTED)[:2]
    return (
        compat.JAX_VERSION[:2] >= newest or os.environ.get("JAXSLICES_EVERY_LEG") == "1"
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{ONE_LEG}: a notebook, long example or benchmark run, made on the "
        "newest tested JAX line only (tests/conftest.py)",
    )


def pytest_collection_modifyitems(config, items):
    if _runs_one_leg_here():
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker(ONE_LEG) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
        config._jaxslices_one_leg = len(drop)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    dropped = getattr(config, "_jaxslices_one_leg", 0)
    if dropped:
        import jax

        from jaxslices import _jax_compat as compat

        terminalreporter.write_line(
            f"{dropped} notebook, long example and benchmark runs deselected: "
            f"they run on the newest tested JAX line ({compat.NEWEST_TESTED}), "
            f"not on JAX {jax.__version__}; JAXSLICES_EVERY_LEG=1 runs them here"
        )
