"""Smoke tests: the benchmarks run end to end with tiny sizes, so they never rot."""

import importlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """Import a benchmark script as its command line does (siblings importable)."""
    monkeypatch.syspath_prepend(str(BENCH))

    def load(name):
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    return load


@pytest.mark.parametrize("optimizer", ["sgd", "clip_sgd", "adagrad", "adam"])
def test_step_bench_smoke(bench, tmp_path, optimizer):
    step_bench = bench("step_bench")
    report = step_bench.main(
        num_rows=(256,),
        batch=8,
        bag=4,
        num_batches=2,
        steps=2,
        passes=1,
        optimizers=(optimizer,),
        out=str(tmp_path),
    )
    assert [r["path"] for r in report["rows"]] == list(step_bench.PATHS)
    for row in report["rows"]:
        assert row["median_ms"] > 0 and row["steps_timed"] == 2
        assert math.isfinite(row["final_loss"])
        assert row["temp_bytes"] >= 0 and row["peak_rss_mb"] > 0
    saved = json.loads((tmp_path / f"step_bench_{report['backend']}.json").read_text())
    assert saved["table"] == report["table"]
    assert "jaxslices / floor" in report["table"]
    assert (tmp_path / f"step_bench_{report['backend']}.png").stat().st_size > 1000
    if optimizer == "sgd":
        assert "V=256 SGD: jaxslices / floor <= 1.25" in [
            t["target"] for t in report["targets"]
        ]


def test_step_bench_flags_temp_growth(bench):
    step_bench = bench("step_bench")
    rows = [
        {
            "num_rows": v,
            "optimizer": "adam",
            "path": p,
            "temp_bytes": t,
            "argument_bytes": a,
        }
        for v, p, t, a in [
            (16, "dense", 100, 300),
            (32, "dense", 200, 600),  # temp grows like the table: flagged
            (16, "floor", 50, 300),
            (32, "floor", 52, 600),  # a few bytes of layout: not flagged
            (16, "jaxslices", 50, 300),
            (32, "jaxslices", 50, 600),
        ]
    ]
    assert step_bench.temp_growth(rows) == ["dense/adam"]


def test_step_bench_hash_prototype_restores_library(bench):
    step_bench = bench("step_bench")
    from jaxslices import transforms

    original = transforms._coalesce_for_update
    with step_bench.hash_coalescing():
        assert transforms._coalesce_for_update is not original
    assert transforms._coalesce_for_update is original


def test_coalesce_bench_smoke(bench, tmp_path):
    coalesce_bench = bench("coalesce_bench")
    report = coalesce_bench.main(
        num_rows=(256,),
        n=64,
        dim=4,
        num_batches=2,
        steps=2,
        passes=1,
        out=str(tmp_path),
        check_results=False,  # test_coalesce_methods_agree_with_numpy does it
    )
    (row,) = report["results"]
    timed = set(row["timings"])
    assert set(coalesce_bench.METHODS) <= timed
    assert {"sgd:raw", "sgd:hash"} <= timed
    assert (tmp_path / f"coalesce_bench_{report['backend']}.json").exists()


@pytest.mark.parametrize("num_rows", [300, 1 << 20])
def test_coalesce_methods_agree_with_numpy(bench, num_rows):
    """Every method, invalid ids included (``check`` asserts against NumPy)."""
    coalesce_bench = bench("coalesce_bench")
    rng = np.random.default_rng(1)
    ids = (rng.zipf(1.2, size=200) % num_rows).astype(np.int32)
    rows = rng.normal(size=(200, 3)).astype(np.float32)
    for method in coalesce_bench.METHODS:
        coalesce_bench.check(method, ids, rows, num_rows)


def test_scatter_contention_smoke(bench):
    scatter_contention = bench("scatter_contention")
    report = scatter_contention.main(num_rows=(64,), batch=32, dim=4, steps=2)
    (row,) = report["results"]
    assert set(row["median_ms"]) == {"raw", "coalesced", "distinct_ids"}
    assert row["distinct_ids"] <= 32
