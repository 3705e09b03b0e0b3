"""Test configuration: 8 CPU devices for sharding tests, hypothesis profiles,
the native kernels asked for once (their status in the report's header)."""

import os

# Must be set before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
    if not _runs_one_leg_here():  # (xdist: the workers deselect, the header says)
        lines.append(
            "notebook and long example runs (newest_leg): deselected on this JAX "
            "line, run on the newest tested one; JAXSLICES_EVERY_LEG=1 runs them"
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


@pytest.fixture
def xla_path():
    """Trace on the XLA path (the native kernels off), for tests of its structure.

    The native path has its own structural tests (tests/lib/test_kernels.py).
    """
    import jaxslices

    with jaxslices.kernels.disabled():
        yield


# ------------------------------------------------ runs made on one leg only

#: Marks a test that runs a notebook or a long example end to end: minutes of
#: the library code that the rest of the suite tests on every leg. It runs on
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
        f"{ONE_LEG}: a notebook or long example run, made on the newest tested "
        "JAX line only (tests/conftest.py)",
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
            f"{dropped} notebook and long example runs deselected: they run on "
            f"the newest tested JAX line ({compat.NEWEST_TESTED}), not on JAX "
            f"{jax.__version__}; JAXSLICES_EVERY_LEG=1 runs them here"
        )
