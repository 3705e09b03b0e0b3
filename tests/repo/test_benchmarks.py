"""Smoke tests: the benchmarks run end to end with tiny sizes, so they never rot."""

import ast
import importlib
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import KERNELS_AVAILABLE

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """Import a benchmark script as its command line does (siblings importable)."""
    monkeypatch.syspath_prepend(str(BENCH))

    def load(name):
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    return load


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
@pytest.mark.parametrize(
    "optimizer", ["sgd", "clip_sgd", "adagrad", "adam", "rowwise_adagrad", "ftrl"]
)
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
    want = [p for p in step_bench.PATHS if step_bench.runs(p, optimizer)]
    assert [r["path"] for r in report["rows"]] == want
    for row in report["rows"]:
        assert row["median_ms"] > 0 and row["steps_timed"] == 2
        assert math.isfinite(row["final_loss"])
        assert row["temp_bytes"] >= 0 and row["peak_rss_mb"] > 0
        assert row["state_bytes"] >= 0
    saved = json.loads((tmp_path / f"step_bench_{report['backend']}.json").read_text())
    assert saved["table"] == report["table"]
    has_floor = optimizer not in step_bench.NO_FLOOR
    assert ("jaxslices / floor" in report["table"]) == has_floor
    assert "js_sort / jaxslices" in report["table"]
    assert (tmp_path / f"step_bench_{report['backend']}.png").stat().st_size > 1000
    if optimizer == "sgd":
        assert "V=256 SGD: jaxslices / floor <= 1.25" in [
            t["target"] for t in report["targets"]
        ]


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
@pytest.mark.parametrize("lookup", ["rows", "bag"])
def test_optimizer_floor_bench_smoke(bench, tmp_path, lookup):
    """Every path of one code tree, in this process, saved with its command."""
    ofb = bench("optimizer_floor_bench")
    report = ofb.main(
        trees=(str(BENCH.parent),),
        labels=("new",),
        num_rows=(256,),
        optimizers=("adam",),
        batch=8,
        bag=4,
        num_batches=2,
        steps=2,
        passes=1,
        out=str(tmp_path),
        command="smoke",
        in_process=True,
        lookup=lookup,
    )
    run = report["runs"]["new"][0]
    assert run["lookup"] == lookup
    assert {r["path"] for r in run["rows"]} == set(ofb.PATHS)
    assert "| 256 | adam |" in report["native_table"]
    assert all(math.isfinite(r["final_loss"]) for r in run["rows"])
    assert 0 < run["max_distinct"]["256"] <= 32
    assert "| 256 | adam |" in report["table"]
    saved = tmp_path / f"optimizer_floor_bench_{run['backend']}.json"
    assert json.loads(saved.read_text())["command"] == "smoke"


def test_optimizer_floor_bench_goals(bench):
    """Ratios: median over repeats per tree; the goals met and missed."""
    ofb = bench("optimizer_floor_bench")

    def run(ratios):
        return {
            "rows": [
                {"num_rows": v, "optimizer": o, "path": p, "ratio_to_floor_sgd": r}
                for (v, o, p), r in ratios.items()
            ]
        }

    big, small = 2**20, 2**14
    new = {(big, "adam", "bounded"): 1.9, (small, "adam", "jaxslices"): 2.2}
    old = {(big, "adam", "jaxslices"): 3.0, (small, "adam", "jaxslices"): 2.0}
    runs = {
        "new": [run(new), run({**new, (big, "adam", "bounded"): 2.3})],
        "old": [run(old)],
    }
    summary = ofb.summarize(runs, ["new", "old"])
    (row,) = [r for r in summary["rows"] if r["num_rows"] == big]
    assert row["new/bounded"] == pytest.approx(2.1) and row["old/jaxslices"] == 3.0
    goals = {g["goal"]: g for g in ofb.goals(summary, ["new", "old"])}
    assert not goals[f"V={big} adam: jaxslices / floor SGD <= 2.0"]["met"]
    assert not goals[f"V={small} adam: not slower than old"]["met"]  # 2.2 vs 2.0
    assert "2.10x" in ofb.markdown(summary, ["new", "old"])


def test_optimizer_floor_bench_native_goals(bench):
    """Issue 31: native optimizer <= 1.5x native SGD; not slower than XLA at 16K."""
    ofb = bench("optimizer_floor_bench")
    small = 2**14
    ratios = {
        (small, "sgd", "jaxslices"): 0.8,
        (small, "sgd", "xla"): 1.0,
        (small, "adam", "jaxslices"): 1.6,
        (small, "adam", "xla"): 1.5,
    }
    run = {
        "rows": [
            {"num_rows": v, "optimizer": o, "path": p, "ratio_to_floor_sgd": r}
            for (v, o, p), r in ratios.items()
        ]
    }
    summary = ofb.summarize({"new": [run]}, ["new"])
    goals = {g["goal"]: g for g in ofb.native_goals(summary, ["new"])}
    over = goals[f"V={small} adam: native / native SGD <= 1.5"]
    assert over["value"] == pytest.approx(2.0) and not over["met"]
    assert not goals[f"V={small} adam: native not slower than the XLA path"]["met"]
    assert goals[f"V={small} sgd: native not slower than the XLA path"]["met"]
    assert "2.00x" in ofb.native_markdown(summary, ["new"])


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
def test_step_bench_donation_smoke(bench):
    """The opt-in paths without donation, and what table_copies finds."""
    step_bench = bench("step_bench")
    paths = ("dense", "jaxslices", "js_nodonate", "dense_nodonate")
    report = step_bench.main(
        num_rows=(256,),
        batch=8,
        bag=4,
        num_batches=2,
        steps=2,
        passes=1,
        optimizers=("sgd",),
        paths=paths,
        plot=False,
    )
    rows = {r["path"]: r for r in report["rows"]}
    assert list(rows) == list(paths)
    assert rows["jaxslices"]["copied_bytes"] == 0
    assert rows["js_nodonate"]["copied_bytes"] >= 256 * 64 * 4  # the table
    assert rows["dense_nodonate"]["alias_bytes"] == 0
    assert "js_nodonate / jaxslices" in report["table"]
    assert "copied MB" in report["table"]


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


def test_benchmarks_do_not_import_each_other():
    """Shared code lives in _common.py; no script imports another script."""
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_")}
    for path in BENCH.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            node.module.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert not imported & (scripts - {path.stem}), path.name


def test_step_bench_selects_coalescing_through_the_public_argument(bench):
    step_bench = bench("step_bench")
    text = inspect.getsource(step_bench) + inspect.getsource(bench("coalesce_bench"))
    assert "_coalesce_for_update" not in text and "jaxslices._" not in text
    opt = step_bench._sparse_opt("clip_sgd", method="sort")
    assert opt is not None


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
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
    assert {"sgd:raw", "sgd:hash", "sgd:library_hash"} <= timed
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


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
def test_scatter_contention_smoke(bench):
    scatter_contention = bench("scatter_contention")
    report = scatter_contention.main(num_rows=(64,), batch=32, dim=4, steps=2)
    (row,) = report["results"]
    assert set(row["median_ms"]) == {"raw", "coalesced", "distinct_ids"}
    assert row["distinct_ids"] <= 32


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
def test_checks_cost_smoke(bench, tmp_path):
    checks_cost = bench("checks_cost")
    root = str(BENCH.parent)
    report = checks_cost.main(
        trees=(root,),
        labels=("this",),
        num_rows=256,
        dim=4,
        batch=16,
        bag=2,
        steps=2,
        hlo_sizes=(512, 4, 16, 2),
        out=str(tmp_path / "c.json"),
    )
    (run,) = report["runs"]
    assert run["jaxslices"].startswith(root)
    assert set(run["hlo"]) == set(checks_cost.HLO_STEPS)
    assert run["hlo"]["sharded_all_to_all"]["all-to-all"] >= 2
    assert all(math.isfinite(v) and v > 0 for v in run["median_ms"].values())
    assert json.loads((tmp_path / "c.json").read_text())["runs"][0]["code"] == "this"


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
def test_dlrm_bench_smoke(bench, tmp_path):
    """Every JAX path computes the same losses; timings, memory, JSON written.
    (The TorchRec worker needs torchrec's environment; it is not run here.)"""
    dlrm_bench = bench("dlrm_bench")
    report = dlrm_bench.main(
        batch=16,
        dim=4,
        scale=1 / 8192,
        head="linear",
        tables=4,
        steps=1,
        passes=1,
        pool=2,
        check_steps=2,
        out=str(tmp_path),
    )
    assert list(report["paths"]) == list(dlrm_bench.PATHS)
    for p, row in report["paths"].items():
        assert row["median_ms"] > 0 and row["cpu_ms"] >= 0 and row["temp_mb"] >= 0
        assert report["check_max_abs_diff"][p] < 1e-5, report["check_losses"]
    saved = json.loads((tmp_path / "dlrm_bench_cpu_linear_b16.json").read_text())
    assert saved["time_over_collection"] == report["time_over_collection"]
    assert saved["tables"] == 4 and "torchrec" not in saved


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
def test_check_dispatch_smoke(bench, tmp_path):
    check_dispatch = bench("check_dispatch")
    report = check_dispatch.main(
        steps=2, passes=1, num_rows=256, dim=4, batch=8, bag=2, out=str(tmp_path)
    )
    got = {(r["step"], r["check"]) for r in report["rows"]}
    assert got == {
        ("scatter", "no_check"),
        ("scatter", "pure"),
        ("scatter", "effect"),
        ("clip_sgd", "pure"),
        ("clip_sgd", "effect"),
    }
    assert all(r["median_ms"] > 0 for r in report["rows"])
    saved = json.loads((tmp_path / "check_dispatch_cpu.json").read_text())
    assert saved["workload"]["clip_sgd"]["max_distinct"] >= 1


# The torch environment of the FBGEMM side (torch, fbgemm-gpu-cpu; see
# benchmarks/README.md): when set, the peers smoke test runs FBGEMM too.
TORCHREC_PYTHON = os.environ.get("JAXSLICES_TORCHREC_PYTHON")


def _fbgemm_rules_step(p, acc, ids, y, optimizer, hp):
    """One peers step in NumPy (float64) with FBGEMM's optimizer rules
    (fbgemm_gpu/codegen/genscript/optimizers.py, CPU) and SGD on ``w``."""
    table, w = p
    b, bag = ids.shape
    pooled = table[ids].mean(1)
    err = pooled @ w - y
    loss = np.mean(err**2)
    d_pooled = (2 * err / b)[:, None] * w[None, :]
    g_w = pooled.T @ (2 * err / b)
    g = np.zeros_like(table)
    np.add.at(g, ids.reshape(-1), np.repeat(d_pooled / bag, bag, axis=0))
    rows = np.unique(ids)
    lr, eps = hp["lr"], hp.get("eps_fbgemm", 0.0)
    table = table.copy()
    if optimizer == "sgd":
        table[rows] -= lr * g[rows]
    elif optimizer == "rowwise_adagrad":
        acc = acc.copy()
        acc[rows] += np.mean(g[rows] ** 2, axis=1)
        table[rows] -= lr * g[rows] / (np.sqrt(acc[rows]) + eps)[:, None]
    else:
        acc = acc.copy()
        acc[rows] += g[rows] ** 2
        table[rows] -= lr * g[rows] / (np.sqrt(acc[rows]) + eps)
    return (table, w - lr * g_w), acc, loss


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_peers_step_follows_fbgemms_rules(bench, optimizer):
    """The jaxslices step of peers_bench/soak_bench, with PEERS_HPARAMS, computes
    FBGEMM's updates, with many duplicate ids (Adagrad: FBGEMM's eps outside
    the square root, jaxslices' inside, eps**2: equal to a relative
    eps / sqrt(acc), 1e-5 here)."""
    import jax.numpy as jnp

    common = bench("_common")
    d = common.peers_data(64, dim=8, batch=16, bag=4, num_batches=3)
    assert len(np.unique(d["ids"][0])) < d["ids"][0].size  # duplicates
    tx = common.peers_optimizer(optimizer)
    step = common.peers_step(tx)
    params = {"emb": jnp.asarray(d["table"]), "w": jnp.asarray(d["w"])}
    state = tx.init(params)
    ref = (d["table"].astype(np.float64), d["w"].astype(np.float64))
    acc = np.zeros(64) if optimizer == "rowwise_adagrad" else np.zeros((64, 8))
    for i in range(3):
        params, state, loss = step(params, state, d["ids"][i], d["y"][i])
        ref, acc, ref_loss = _fbgemm_rules_step(
            ref, acc, d["ids"][i], d["y"][i], optimizer, common.PEERS_HPARAMS[optimizer]
        )
        assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
        np.testing.assert_allclose(params["emb"], ref[0], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(params["w"], ref[1], rtol=1e-4, atol=1e-6)


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
def test_peers_bench_smoke(bench, tmp_path):
    """The jaxslices workers (XLA and native switches) against each other, and
    FBGEMM's when JAXSLICES_TORCHREC_PYTHON names a torch environment."""
    peers_bench = bench("peers_bench")
    configs = ("xla", "native")
    if TORCHREC_PYTHON:
        configs = ("fbgemm_1thread", *configs)
    report = peers_bench.main(
        num_rows=(256,),
        optimizers=("adagrad",),
        configs=configs,
        torchrec_python=TORCHREC_PYTHON,
        dim=8,
        batch=8,
        bag=4,
        num_batches=2,
        steps=2,
        rounds=1,
        repeats=2,
        out=str(tmp_path),
        command="smoke",
    )
    assert [r["config"] for r in report["rows"]] == list(configs)
    for row in report["rows"]:
        assert row["median_ms"] > 0 and row["cpu_ms"] >= 0
        assert row["page_faults_per_step"] >= 0
        assert row["steps_timed"] == 4 and len(row["repeats"]) == 2
        assert row["check"]["agree"], row["check_losses"]
    assert report["losses_agree"]
    workers = report["workers"]
    assert workers["256/adagrad/xla"]["JAXSLICES_NATIVE"] == "0"
    assert workers["256/adagrad/native"]["JAXSLICES_NATIVE"] == "1"
    assert "| adagrad | 256 |" in report["table"]
    saved = json.loads((tmp_path / "peers_bench_cpu.json").read_text())
    assert saved["command"] == "smoke" and saved["reference"] == configs[0]
    assert (tmp_path / "peers_bench_cpu.png").stat().st_size > 1000


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
def test_soak_bench_smoke(bench, tmp_path):
    soak_bench = bench("soak_bench")
    report = soak_bench.main(
        num_rows=256,
        optimizers=("rowwise_adagrad",),
        modes=("xla", "native"),
        dim=8,
        batch=8,
        bag=4,
        num_batches=2,
        steps=40,
        every=10,
        baseline_step=20,
        out=str(tmp_path),
    )
    assert [(r["mode"], r["optimizer"]) for r in report["runs"]] == [
        ("xla", "rowwise_adagrad"),
        ("native", "rowwise_adagrad"),
    ]
    for run in report["runs"]:
        assert [s["step"] for s in run["samples"]] == [10, 20, 30, 40]
        assert run["baseline_step"] == 20 and math.isfinite(run["growth_mb"])
        assert math.isfinite(run["steady_growth_mb"]) and run["temp_mb"] > 0
        assert math.isfinite(run["final_loss"]) and run["table_in_place"]
    saved = json.loads((tmp_path / "soak_bench_cpu.json").read_text())
    assert saved["table"] == report["table"]
    assert (tmp_path / "soak_bench_cpu.png").stat().st_size > 1000


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
def test_pooled_form_bench_smoke(bench, tmp_path):
    report = bench("pooled_form_bench").main(
        num_rows=256, dim=4, batch=8, bag=4, num_batches=2, steps=2, passes=1,
        out=str(tmp_path),
    )  # fmt: skip
    assert set(report["ms"]) == {"plain", "tree_scale", "tree_map_identity"}
    # js.tree_scale keeps the pooled form; an identity jax.tree.map rebuilds
    # the slices from their leaves (pure unflattening) and loses it, so the
    # kernel reads the materialised rows, and explain says so.
    if KERNELS_AVAILABLE:
        read = report["kernels_read"]
        assert read["plain"] == [] and read["tree_scale"] == [], read
        (line,) = read["tree_map_identity"]
        assert "reading the [32, 4] values" in line, read
    assert (tmp_path / "pooled_form_bench_cpu.json").exists()


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
def test_sgd_duplicates_bench_smoke(bench, tmp_path):
    report = bench("sgd_duplicates_bench").main(
        num_rows=256, dim=4, batch=8, bag=4, num_batches=2, steps=2, passes=1,
        out=str(tmp_path),
    )  # fmt: skip
    assert set(report["ms"]) == {"in_turn", "summed_first"}
    accuracy = report["accuracy_1000_duplicates_of_minus_1e-8_on_1"]
    assert accuracy["in_turn"] == 1.0 and accuracy["summed_first"] < 1.0
    assert (tmp_path / "sgd_duplicates_bench_cpu.json").exists()


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
@pytest.mark.skipif(not KERNELS_AVAILABLE, reason="times the native kernels")
def test_threads_bench_smoke(bench, tmp_path):
    report = bench("threads_bench").main(
        num_rows=256, dim=4, bags=(2, 4), bag=4, num_batches=2, steps=2, passes=1,
        out=str(tmp_path),
    )  # fmt: skip
    got = {(r["workload"]["kernel"], r["workload"]["bags"]) for r in report["results"]}
    assert got == {(k, b) for k in ("bag_forward", "rowwise_adagrad", "sgd_apply")
                   for b in (2, 4)}  # fmt: skip
    assert all(set(r["ratio_to_1_thread"]) == {"2"} for r in report["results"])
    assert (tmp_path / "threads_bench_cpu.json").exists()
    assert (tmp_path / "threads_bench_cpu.png").exists()


def _edits_sys_path(tree: ast.AST) -> list[int]:
    """Lines that change ``sys.path`` (a call on it, or an assignment to it)."""
    lines = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value  # sys.path.insert(...), .append(...)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t for t in targets if isinstance(t, ast.Attribute)), None)
        if (
            isinstance(target, ast.Attribute)
            and target.attr == "path"
            and isinstance(target.value, ast.Name)
            and target.value.id == "sys"
        ):
            lines.append(node.lineno)
    return lines


def test_no_script_edits_sys_path():
    """Benchmarks and examples import what they need as their command line runs them.

    ``python benchmarks/<script>.py`` (``examples/``) puts the script's folder
    on ``sys.path``; what lives elsewhere comes through ``benchmarks/_repo.py``,
    child processes get a ``PYTHONPATH``.
    """
    assert _edits_sys_path(ast.parse("import sys\nsys.path.insert(0, 'x')")) == [2]
    assert _edits_sys_path(ast.parse("import sys\nsys.path += ['x']")) == [2]
    root = BENCH.parent
    found = {
        str(path.relative_to(root)): lines
        for folder in ("benchmarks", "examples")
        for path in sorted((root / folder).glob("*.py"))
        if (lines := _edits_sys_path(ast.parse(path.read_text())))
    }
    assert not found, f"these edit sys.path (file: lines): {found}"


@pytest.mark.parametrize(
    "script",
    ["scale_bench", "plan_scale_bench", "dlrm_bench", "checks_cost", "step_bench"],
)
def test_scripts_start_from_their_command_line(tmp_path, script):
    """``python benchmarks/<script>.py --help`` outside the repository: imports work."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, str(BENCH / f"{script}.py"), "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository: its root is not on sys.path
        env=env,
        timeout=300,
    )
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-3000:]


def test_repo_modules_load_without_the_root_on_sys_path(tmp_path):
    # An editable install puts the root on sys.path (its .pth file): take it
    # off first, so that only _repo.load can find tools/ and examples/.
    code = (
        "import sys, _repo; "
        "sys.path[:] = [p for p in sys.path if p.rstrip('/') != str(_repo.ROOT)]; "
        "hlo = _repo.load('tools.hlo'); synth = _repo.load('examples.criteo_synth'); "
        "assert not any(p.rstrip('/') == str(_repo.ROOT) for p in sys.path), sys.path; "
        "print(hlo.__file__); print(synth.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(BENCH)}
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    root = BENCH.parent.resolve()
    assert run.stdout.split() == [
        str(root / "tools" / "hlo.py"),
        str(root / "examples" / "criteo_synth.py"),
    ]


@pytest.mark.newest_leg  # tests/conftest.py: a benchmark run, newest JAX line
def test_managed_bench_smoke(bench, tmp_path):
    report = bench("managed_bench").main(
        num_rows=512, dim=4, batch=16, bag=2, num_batches=2, warmup_batches=2,
        steps=1, passes=1, out=str(tmp_path),
    )  # fmt: skip
    assert set(report["ms"]) == {
        "pre_remapped", "with_remap", "with_remap_evicting", "evict_then_refill",
        "with_remap_filtered", "with_remap_evicting_decayed",
    }  # fmt: skip
    assert report["workload"]["distinct_ids"] == 4 * 512
    assert (tmp_path / "managed_bench_cpu.json").exists()
