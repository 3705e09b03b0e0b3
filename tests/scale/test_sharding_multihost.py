"""Multi-host: 2 processes x 4 CPU devices, ``jax.distributed`` on loopback.

Both processes run ``tests/_multihost_worker.py`` (data parallel, then a
row-sharded table with all-to-all routing, then an embedding collection on a
sharding plan, then a DLRM step on a plan routed all-to-all) over one
8-device mesh and compare
with a single-device reference; then steps whose check fails on one device of
process 1 (``tests/_failure_cases.py``), which must raise in both processes.
The test ends by itself: every wait has a timeout and the children are killed
if anything goes wrong.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _failure_cases import CASES, EXPECTED
from helpers import JAX_FIRST_LINE, LOGGED

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "_multihost_worker.py"
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_four_devices_each(tmp_path):
    port = _free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    logs = [open(tmp_path / f"log{i}.txt", "w") for i in range(2)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i), "2", str(outs[i])],
            env=env,
            cwd=str(ROOT),
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"multi-host workers did not finish in {TIMEOUT_S} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for f in logs:
            f.close()
    tails = [(tmp_path / f"log{i}.txt").read_text()[-3000:] for i in range(2)]
    for i, p in enumerate(procs):
        assert p.returncode == 0 and outs[i].exists(), tails[i]
        result = json.loads(outs[i].read_text())
        assert "error" not in result, result.get("error")
        assert result["devices"] == 8
        assert result["data_parallel"] < 1e-5, result
        assert result["row_sharded_all_to_all"] < 1e-5, result
        assert result["collection_plan"] < 1e-5, result
        assert result["dlrm_plan"] < 1e-5, result
    # A check that fails on one device (of process 1) raises in both processes,
    # with the same message, and leaves no collective waiting: both went on to
    # run a correct step, with the same result.
    results = [json.loads(o.read_text()) for o in outs]
    logs = [(tmp_path / f"log{i}.txt").read_text() for i in range(2)]
    for case in CASES:
        got = [r["failures"][case] for r in results]
        for r, log in zip(got, logs, strict=True):
            assert r["raised"], (case, r)
            assert r["first"] == JAX_FIRST_LINE, (case, r)
            assert EXPECTED[case] in r["message"], (case, r)
            # Logged as one line, once for the process's 4 devices.
            assert log.count(LOGGED + EXPECTED[case]) == 1, (case, log[-3000:])
        assert got[0]["message"] == got[1]["message"], case
        assert got[0]["after"] == got[1]["after"], case


def test_import_does_not_start_the_backend():
    code = (
        "import jax, jaxslices\n"
        "jax.distributed.initialize(coordinator_address='127.0.0.1:"
        f"{_free_port()}', num_processes=1, process_id=0, "
        "initialization_timeout=30)\n"
        "jax.distributed.shutdown()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
