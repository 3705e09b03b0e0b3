"""Smoke test: benchmarks/scale_bench.py runs end to end with tiny sizes."""

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
def test_scale_bench_smoke(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("scale_bench", None)
    scale_bench = importlib.import_module("scale_bench")
    report = scale_bench.main(
        devices=(1, 4),
        num_rows=2048,
        dim=4,
        batch=32,
        bag=2,
        num_batches=2,
        steps=1,
        passes=1,
        out=str(tmp_path),
    )
    rows = {(r["devices"], r["path"]): r for r in report["rows"]}
    assert set(rows) == {(n, p) for n in (1, 4) for p in scale_bench.PATHS}
    for r in rows.values():
        assert math.isfinite(r["final_loss"]) and r["median_ms"] > 0
    for p in scale_bench.PATHS:
        assert rows[1, p]["comm_bytes"] == 0  # one device: no collective
    # The dense path all-reduces the whole table; jaxslices moves batch rows.
    table_bytes = 2048 * 4 * 4
    assert rows[4, "dense_dp"]["largest_collective_bytes"] >= table_bytes
    for p in ("js_dp", "rows_masked", "rows_a2a"):
        assert 0 < rows[4, p]["largest_collective_bytes"] < table_bytes / 4, p
    assert rows[4, "rows_a2a"]["collectives"]["all-to-all"] > 0
    # Row sharding splits the table (and Adam's moments) over the devices.
    assert rows[4, "rows_a2a"]["argument_bytes"] < rows[4, "js_dp"]["argument_bytes"]
    saved = json.loads((tmp_path / f"scale_bench_{report['backend']}.json").read_text())
    assert saved["table"] == report["table"]
    assert (tmp_path / f"scale_bench_{report['backend']}.png").stat().st_size > 1000


def test_scale_bench_uniform_ids(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("scale_bench", None)
    scale_bench = importlib.import_module("scale_bench")
    report = scale_bench.main(
        devices=(2,),
        num_rows=1024,
        dim=4,
        batch=16,
        bag=2,
        num_batches=1,
        steps=1,
        passes=1,
        paths=("rows_a2a",),
        ids_dist="uniform",
        out=str(tmp_path),
        plot=False,
    )
    assert report["workload"]["ids"] == "uniform"
    assert (tmp_path / f"scale_bench_{report['backend']}_uniform.json").exists()


def test_needed_capacity(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("scale_bench", None)
    scale_bench = importlib.import_module("scale_bench")
    import numpy as np

    ids = [np.array([[0, 0], [1, 5], [4, 5], [6, 7]], np.int32)]
    # 2 devices (2 rows of ids each), rows 0-3 on shard 0, 4-7 on shard 1:
    # device 0 has {0, 1} -> shard 0 (2) and {5} -> shard 1; device 1: {4,5,6,7}.
    assert scale_bench.needed_capacity(ids, 2, 8) == 4


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
def test_plan_scale_bench_smoke(monkeypatch, tmp_path):
    """benchmarks/plan_scale_bench.py end to end, tiny: every row's figures
    come from the HLO, and all-to-all moves less than masked at 4 devices."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("plan_scale_bench", None)
    bench = importlib.import_module("plan_scale_bench")
    args = bench.parse(
        [
            "--devices", "2", "4", "--rows", "8192", "--dim", "4", "--batch", "32",
            "--plans", "row_wise", "table_wise", "--optimizers", "sgd",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    report = bench.main(args)
    keys = {(r["plan"], r["routing"], r["devices"]) for r in report["rows"]}
    plans = ("row_wise", "table_wise", "row_wise (1 table)")
    assert keys == {
        (p, r, n) for p in plans for r in ("masked", "all_to_all") for n in (2, 4)
    }
    for r in report["rows"]:
        assert math.isfinite(r["loss"]) and r["gathered_rows"] > 0, r
        assert r["comm_bytes"] > 0 and r["model_comm_bytes"] > 0, r
    at4 = {(r["plan"], r["routing"]): r for r in report["rows"] if r["devices"] == 4}
    for p in plans:
        assert at4[p, "all_to_all"]["comm_bytes"] < at4[p, "masked"]["comm_bytes"]
    saved = json.loads((tmp_path / "plan_scale_bench_cpu.json").read_text())
    assert saved["table"] == report["table"] and saved["ratios"]
