"""Smoke tests: the benchmarks run end to end with tiny sizes, so they never rot."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_bench_smoke(tmp_path):
    step_bench = _load("step_bench")
    report = step_bench.main(
        num_rows=(256, 512),
        batch=8,
        bag=4,
        num_batches=2,
        steps=2,
        passes=1,
        out=str(tmp_path),
    )
    assert len(report["rows"]) == 2 * 4 * 3
    for row in report["rows"]:
        assert row["median_ms"] > 0 and row["steps_timed"] == 2
        assert row["final_loss"] == pytest.approx(row["final_loss"])  # not NaN
    saved = json.loads((tmp_path / f"step_bench_{report['backend']}.json").read_text())
    assert saved["table"] == report["table"]
    assert (tmp_path / f"step_bench_{report['backend']}.png").stat().st_size > 1000
    # No table-sized temporary on the jaxslices path: temp bytes don't grow with V.
    temps = {
        (r["num_rows"], r["optimizer"]): r["temp_bytes"]
        for r in report["rows"]
        if r["path"] == "jaxslices"
    }
    for opt in ("sgd", "clip_sgd", "adagrad", "adam"):
        assert temps[(512, opt)] <= temps[(256, opt)], opt


def test_scatter_contention_smoke(tmp_path):
    bench = _load("scatter_contention")
    report = bench.main(num_rows=(64,), batch=32, dim=4, steps=2, out=str(tmp_path))
    (row,) = report["results"]
    assert set(row["median_ms"]) == {"raw", "coalesced", "distinct_ids"}
    assert row["distinct_ids"] <= 32
