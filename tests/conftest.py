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
    return f"jaxslices native kernels: {KERNELS_STATUS}"


@pytest.fixture
def xla_path():
    """Trace on the XLA path (the native kernels off), for tests of its structure.

    The native path has its own structural tests (tests/lib/test_kernels.py).
    """
    import jaxslices

    with jaxslices.kernels.disabled():
        yield
