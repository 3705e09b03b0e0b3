"""examples/sharded.py trains on an 8-device mesh and matches one device."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import data  # noqa: E402


def _has_recbole():
    try:
        data.packaged_file("recbole", "")
        return True
    except data.DataNotFound:
        return False


@pytest.mark.skipif(
    not _has_recbole(), reason="pip install --no-deps recbole==1.2.1 (CI installs it)"
)
@pytest.mark.parametrize("routing", ["all_to_all"])  # masked: test_sharding_rows
def test_sharded_example_matches_one_device(tmp_path, routing):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "sharded.py"),
        "--steps",
        "20",
        "--dim",
        "8",
        "--routing",
        routing,
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "sharded.json").read_text())
    assert r["devices"] == 8 and r["mesh"] == [2, 4]
    assert r["sharded"]["table_spec"] == ["model"]
    single, sharded = r["single"], r["sharded"]
    assert single["steps"] == sharded["steps"] == 20
    assert math.isfinite(sharded["test_rmse"])
    # Adagrad is exact: the mesh reaches the one-device metric.
    assert sharded["test_rmse"] == pytest.approx(single["test_rmse"], abs=1e-4)
    assert sharded["losses"] == pytest.approx(single["losses"], rel=1e-4)
    assert "test RMSE" in proc.stdout
