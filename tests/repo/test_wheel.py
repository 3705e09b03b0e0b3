"""A built wheel installs into a fresh venv and runs, native kernels included.

The wheel carries the kernels' C++ sources (``jaxslices/kernels/csrc``); the
installed package compiles them on first use against the installed jaxlib's
headers, into its own cache (here with a stand-in compiler that checks the
wheel's sources are the checkout's and copies this session's library:
``tests/_reused_build.py``). Without a C++ compiler (CI's run without one,
.ci/without-compiler) it installs and runs all the same, on the XLA path:
the test asserts the path that ``js.kernels.available()`` names, and that it
is this machine's (native exactly where this session's kernels load). The
fresh venv gets jaxslices from the wheel only: JAX and the rest come from
this environment's site-packages through a path file (no network, no second
copy of JAX), and the script runs outside the repository so the checkout
cannot be imported instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import _reused_build
import pytest
from helpers import KERNELS_AVAILABLE, KERNELS_STATUS

import jaxslices as js

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import sys, jax, jax.numpy as jnp, numpy as np
    import jaxslices as js
    assert js.__file__.startswith(sys.argv[1]), js.__file__
    native = js.kernels.available()
    p = {"emb": jnp.arange(40.0).reshape(10, 4)}
    tx = js.rowwise_adagrad(0.1)
    def loss(p, ids):
        return js.embedding_bag(p["emb"], ids).sum()
    def step(p, s, ids):
        u, s = tx.update(js.grad(loss)(p, ids), s, p)
        return js.apply_updates(p, u), s
    ids = jnp.array([[1, 1, 3]])
    report = js.kernels.explain(step, p, tx.init(p), ids)
    assert report.native == native and report.decisions, str(report)
    got = jax.jit(step)(p, tx.init(p), ids)[0]["emb"]
    with js.kernels.disabled():
        want = jax.jit(step)(p, tx.init(p), ids)[0]["emb"]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    print("wheel ok, native", native, js.kernels.library_path())
    print("status", js.kernels.status())
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX venv layout")
def test_built_wheel_installs_and_runs_in_a_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(dist), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    (wheel,) = dist.glob("jaxslices-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for src in ("common.h", "bag.cc", "rowwise.cc", "apply.cc"):
        assert f"jaxslices/kernels/csrc/{src}" in names, names

    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    install = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # This environment's packages (JAX, Optax, ...), after the wheel's own.
    Path(site, "zz_parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {
        **os.environ,
        "JAXSLICES_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": "",
    }
    if KERNELS_AVAILABLE:
        # The wheel's package builds its own library into its own cache, with
        # a stand-in compiler that checks the wheel's sources are the
        # checkout's and copies this session's library, which the real
        # compiler made from them (tests/_reused_build.py): the build logic
        # is tested, not g++ a second time (80 s on 2 cores).
        env.update(_reused_build.install(tmp_path, js.kernels.library_path()))
    run = subprocess.run(
        [str(py), "-c", _SCRIPT, site],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0 and "wheel ok" in run.stdout, run.stderr[-3000:]
    assert f"wheel ok, native {KERNELS_AVAILABLE}" in run.stdout, run.stdout
    if KERNELS_AVAILABLE:  # built by the wheel's package, into its own cache
        assert str(tmp_path / "cache") in run.stdout
    else:  # the same cause as this session's (no compiler, JAXSLICES_NATIVE=0)
        assert f"status {KERNELS_STATUS}" in run.stdout, (run.stdout, KERNELS_STATUS)
