"""Building the native kernels, and the XLA path where they cannot be built.

Each test runs a fresh Python (the build, the one-time warning and the
status belong to a process), with its own kernel cache:

* without a C++ compiler (nothing on ``PATH``, no ``$CXX``), with a compiler
  that fails, and with ``JAXSLICES_NATIVE=0``, a step runs on the XLA path,
  ``explain`` and ``status`` say why, and only the first two warn, once;
* ``python -m jaxslices.kernels`` prints the status, with no other output;
* processes that start at once build one library into a fresh cache (with
  a stand-in compiler that copies this session's library:
  ``tests/_reused_build.py``).

These run on every machine: the ones without a compiler are what CI's run
without a compiler checks (.ci/without-compiler). Only the build itself
needs a compiler (``needs_kernels``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import _reused_build
import pytest
from helpers import KERNELS_AVAILABLE, needs_kernels

import jaxslices as js

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("CXX", "JAXSLICES_CXX")}
    return subprocess.run(
        [sys.executable, "-W", "default", *(args or ("-c", textwrap.dedent(code)))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**full, **env},
        timeout=600,
    )


_STEP = """
import jax, jax.numpy as jnp, numpy as np, jaxslices as js
p = {"emb": jnp.arange(40.0).reshape(10, 4)}
tx = js.adagrad(0.1)
def loss(p, ids):
    return js.embedding_bag(p["emb"], ids).sum()
@jax.jit
def step(p, s, ids):
    u, s = tx.update(js.grad(loss)(p, ids), s, p)
    return js.apply_updates(p, u), s
out = step(p, tx.init(p), jnp.array([[1, 1, 3]]))[0]["emb"]
out = step(p, tx.init(p), jnp.array([[1, 1, 3]]))[0]["emb"]
print("rows", np.asarray(out[1]).round(4).tolist())
report = js.kernels.explain(step, p, tx.init(p), jnp.array([[1, 2]]))
print("report", report.native)
print("reasons", sorted({d.reason for d in report.decisions}))
print("status", js.kernels.status())
"""


def _rows(out: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in out.stdout.splitlines() if ln.startswith("rows")]


def test_without_a_compiler_the_xla_path_runs_and_says_so_once(tmp_path):
    # No compiler: nothing on PATH at all (the Python runs by its full path).
    (tmp_path / "bin").mkdir()
    env = {"PATH": str(tmp_path / "bin"), "JAXSLICES_CACHE_DIR": str(tmp_path / "c")}
    out = _run(_STEP, env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "report False" in out.stdout
    assert "status unavailable: no C++ compiler found" in out.stdout
    assert out.stderr.count("KernelsUnavailableWarning") == 1, out.stderr
    (reasons,) = [ln for ln in out.stdout.splitlines() if ln.startswith("reasons")]
    assert "no C++ compiler found" in reasons, reasons
    # the same numbers as this machine's path (native where it has a compiler)
    ref = _run(_STEP, {})
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert _rows(out) == _rows(ref) and _rows(out), (out.stdout, ref.stdout)


def test_explain_names_the_cause_once(tmp_path):
    env = {
        "JAXSLICES_CXX": str(tmp_path / "none"),
        "JAXSLICES_CACHE_DIR": str(tmp_path),
    }
    out = _run(_STEP, env)
    assert out.returncode == 0, out.stderr[-3000:]
    (reasons,) = [ln for ln in out.stdout.splitlines() if ln.startswith("reasons")]
    assert "the kernels are unavailable: no C++ compiler found" in reasons, reasons
    assert reasons.count("unavailable") == 1, reasons


def test_a_failing_build_falls_back_with_the_compiler_error(tmp_path):
    fake = tmp_path / "broken-c++"
    fake.write_text("#!/bin/sh\necho 'fatal: this compiler is broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    out = _run(
        _STEP,
        {"JAXSLICES_CXX": str(fake), "JAXSLICES_CACHE_DIR": str(tmp_path / "c")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "report False" in out.stdout
    assert "this compiler is broken" in out.stdout  # in status()
    assert out.stderr.count("KernelsUnavailableWarning") == 1, out.stderr


def test_off_by_environment_without_a_warning_or_a_build(tmp_path):
    cache = tmp_path / "c"
    out = _run(_STEP, {"JAXSLICES_NATIVE": "0", "JAXSLICES_CACHE_DIR": str(cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "report False" in out.stdout and "disabled by" in out.stdout
    assert "KernelsUnavailableWarning" not in out.stderr
    assert not cache.exists() or not list(cache.iterdir()), "it built"


def test_status_says_why_without_warning(tmp_path):
    fake = tmp_path / "broken-c++"
    fake.write_text("#!/bin/sh\necho 'fatal: this compiler is broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    code = """
    import jaxslices as js
    print("status", js.kernels.status())
    print("available", js.kernels.available())
    """
    env = {"JAXSLICES_CXX": str(fake), "JAXSLICES_CACHE_DIR": str(tmp_path / "c")}
    out = _run(code, env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "status unavailable: the C++ build failed" in out.stdout
    assert "available False" in out.stdout
    # status() returned the cause (no warning); available() then warned once
    assert out.stderr.count("KernelsUnavailableWarning") == 1, out.stderr


@pytest.mark.parametrize("case", ["no compiler", "off", "here"])
def test_the_command_line_prints_the_status_and_what_the_kernels_use(tmp_path, case):
    (tmp_path / "bin").mkdir()
    env = {
        "no compiler": {"PATH": str(tmp_path / "bin")},
        "off": {"JAXSLICES_NATIVE": "0"},
        "here": {},
    }[case]
    if case != "here":  # here: this session's kernels (built, or not) are found
        env["JAXSLICES_CACHE_DIR"] = str(tmp_path / "c")
    out = _run("", env, "-m", "jaxslices.kernels")
    assert out.stderr == "", out.stderr[-3000:]  # no runpy or kernels warning
    line, *rest = out.stdout.splitlines()
    loaded = case == "here" and KERNELS_AVAILABLE
    assert line.startswith("loaded: " if loaded else ("unavailable: ", "disabled"))
    assert out.returncode == (0 if loaded else 1), line
    if case == "off":  # nothing is built: nothing else to say
        assert rest == [], rest
        return
    keys = [r.split(":")[0] for r in rest]
    assert keys[:4] == ["compiler", "flags", "threads", "cache"], rest
    assert "-O3" in rest[1] and "threads: " in rest[2]
    if case == "no compiler":
        assert "no C++ compiler found" in line and rest[0] == "compiler: none found"
        assert str(tmp_path / "c") in rest[3]


def test_the_command_line_answers_help():
    out = _run("", {"JAXSLICES_NATIVE": "0"}, "-m", "jaxslices.kernels", "--help")
    assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
    assert out.stdout.startswith("usage: python -m jaxslices.kernels")
    for word in ("compiler", "flags", "threads", "cache", "JAXSLICES_CACHE_DIR"):
        assert word in out.stdout, word


@needs_kernels  # it copies this session's library
def test_parallel_builds_into_one_fresh_cache(tmp_path):
    # The build logic races here, not g++: a stand-in compiler checks the
    # sources are the checkout's and copies this session's library
    # (tests/_reused_build.py); the session built it with the real one.
    env = {
        **os.environ,
        "JAXSLICES_CACHE_DIR": str(tmp_path / "cache"),
        **_reused_build.install(tmp_path, js.kernels.library_path()),
    }
    code = "import jaxslices as js; assert js.kernels.available(); print('ok')"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    notices = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        assert p.returncode == 0 and "ok" in stdout, stderr[-3000:]
        notices += [ln for ln in stderr.splitlines() if "building the native" in ln]
    assert len(notices) == 1, notices  # one process built, and said so in a line
    assert notices[0].startswith("jaxslices: building the native CPU kernels with ")
    libs = list((tmp_path / "cache").glob("libjaxslices_kernels-*.so"))
    assert len(libs) == 1, libs
    assert not list((tmp_path / "cache").glob("*.tmp")), "a temporary was left"


def test_cis_machine_without_a_compiler_has_none(tmp_path):
    """``.ci/without-compiler`` (CI's run without one) leaves jaxslices no compiler."""
    code = "import jaxslices as js; print('status', js.kernels.status())"
    out = subprocess.run(
        [str(ROOT / ".ci" / "without-compiler"), sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={
            **os.environ,
            # this Python first on PATH, as in CI's activated venv: the
            # script asks `python` whether jaxslices finds a compiler
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "CXX": "g++",  # it unsets them
            "JAXSLICES_CXX": "g++",
        },
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "status unavailable: no C++ compiler found" in out.stdout, out.stdout


def test_the_stand_in_compiler_refuses_sources_not_the_checkouts(
    tmp_path, capsys, monkeypatch
):
    src = tmp_path / "csrc"
    shutil.copytree(_reused_build.CHECKOUT_SOURCES, src)
    library = tmp_path / "lib.so"
    library.write_bytes(b"library")
    args = ["-O3", "-o", str(tmp_path / "out.so"), str(src / "bag.cc")]
    monkeypatch.setenv(_reused_build.LIBRARY_VARIABLE, str(library))
    assert _reused_build.main(args) == 0
    assert (tmp_path / "out.so").read_bytes() == b"library"
    (src / "common.h").write_text("// edited\n")
    assert _reused_build.main(args) == 1
    assert "common.h is not the checkout's" in capsys.readouterr().err
