"""Every example runs with tiny settings and reports sensible metrics.

The long runs (``newest_leg``) execute on the newest tested JAX line only
(tests/conftest.py); the library code they exercise is tested on every leg.
"""

import importlib
import json
import math
import sys
from pathlib import Path

import jax
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

data = importlib.import_module("data")


def _has(package):
    try:
        data.packaged_file(package, "")
        return True
    except data.DataNotFound:
        return False


needs_recbole = pytest.mark.skipif(
    not _has("recbole"), reason="pip install --no-deps recbole==1.2.1 (CI installs it)"
)
needs_gensim = pytest.mark.skipif(
    not _has("gensim"), reason="pip install --no-deps gensim==4.4.0 (CI installs it)"
)


def test_checkpoint_resumes_bit_for_bit(tmp_path):
    """A Flax NNX two-tower and an Equinox model with gradient accumulation,
    saved with Orbax, restored into new objects, resumed: equal to the
    uninterrupted runs (the MultiSteps buffer holds IndexedSlices when saved)."""
    out = importlib.import_module("checkpoint").main(directory=str(tmp_path))
    for name in ("nnx", "equinox_multisteps"):
        assert out[name]["resumed_vs_uninterrupted"] == 0.0, out
        assert out[name]["moved_after_save"] > 1e-3, out  # training went on
    assert out["equinox_multisteps"]["buffer_is_slices"]
    assert out["equinox_multisteps"]["buffer_slots_filled_at_save"] == 2 * 8 * 4


def test_equinox_optimizers_per_parameter_group():
    """optax.multi_transform with jaxslices.adagrad for the tables and Adam for the
    rest, labels from jaxslices.equinox.param_labels: equal to the dense run."""
    out = importlib.import_module("equinox_optimizers").main(
        steps=6, batch=8, num_items=300, dim=4
    )
    assert out["sparse_vs_dense_max_diff"] < 1e-5, out
    assert out["untouched_rows_unchanged"]
    assert out["first_batch_loss_after"] < out["first_loss"], out


def test_pytorch_port(tmp_path):
    """docs/embeddings.md as a user follows it: an NNX EmbedBag model (strict,
    jagged input, padding_idx, max_norm), donated, checkpointed and resumed."""
    out = importlib.import_module("pytorch_port").main(
        steps=16, batch=16, vocab=2000, directory=str(tmp_path)
    )
    assert out["table_copies"] == [], out  # donated: updated in place
    assert out["resumed_vs_uninterrupted"] == 0.0, out
    assert out["padding_row_max_abs"] == 0.0  # padding_idx: never trained
    assert out["last_rows_max_norm"] < 1.1  # max_norm 1 in the table, then a step
    assert out["last_loss"] < out["first_loss"]
    assert out["test_accuracy"] > 0.5  # 4 classes: chance is 0.25


def test_quickstart():
    out = importlib.import_module("quickstart").main()
    assert (
        out["exact_norm"] < out["naive_norm"] or out["exact_norm"] > out["naive_norm"]
    )


@pytest.mark.newest_leg  # tests/conftest.py: a long run, newest JAX line
@needs_recbole
def test_movielens_tiny(tmp_path):
    movielens = importlib.import_module("movielens")
    r = movielens.main(
        epochs=1,
        max_steps=25,
        out=str(tmp_path),
        progress=False,
        big_rows=5000,
        speed_steps=8,
    )
    for path in ("sparse", "dense"):
        assert math.isfinite(r[path]["test_rmse"]) and r[path]["steps"] == 25
    # Adagrad is exact on both paths: same model, same numbers, same curve.
    assert r["sparse"]["test_rmse"] == pytest.approx(r["dense"]["test_rmse"], abs=1e-4)
    assert r["max_loss_gap"] < 1e-4 and r["large"]["max_loss_gap"] < 1e-4
    assert r["global_mean_rmse"] > r["item_mean_rmse"] > 0.9
    big = r["large"]
    assert big["item_rows"] == 5000 and big["steps"] == 8
    assert big["speedup"] == pytest.approx(
        big["dense"]["median_step_ms"] / big["sparse"]["median_step_ms"]
    )
    assert (tmp_path / "movielens.png").stat().st_size > 1000
    record = json.loads((tmp_path / "movielens.json").read_text())
    assert record["sparse"]["test_rmse"] == r["sparse"]["test_rmse"]
    assert record["settings"]["batch_size"] == 512
    assert record["environment"]["jax"] == jax.__version__


def test_committed_demo_results_are_a_demo_run():
    """docs/examples.md quotes this file (via tools/render_docs.py)."""
    path = EXAMPLES.parent / "benchmarks" / "results" / "2026-11-cpu" / "movielens.json"
    r = json.loads(path.read_text())
    assert r["dataset"] == "MovieLens-100K" and r["num_ratings"] == 100_000
    assert r["sparse"]["steps"] == r["dense"]["steps"] > 1000
    assert r["max_loss_gap"] < 1e-4
    # The claims the docs make: parity, clearly better than the item-mean
    # baseline, and the speed-up where tables are large.
    assert abs(r["sparse"]["test_rmse"] - r["dense"]["test_rmse"]) < 1e-3
    assert r["sparse"]["test_rmse"] < r["item_mean_rmse"] - 0.05
    assert r["large"]["item_rows"] >= 2**20 and r["large"]["speedup"] > 10


@needs_recbole
def test_movielens_loader_matches_the_file():
    ds = data.load_movielens()
    assert len(ds["rating"]) == 100_000
    assert int(ds["num_users"]) == 943 and int(ds["num_items"]) == 1682
    assert ds["rating"].min() == 1 and ds["rating"].max() == 5


def test_missing_data_says_what_to_install(monkeypatch):
    def missing(name):
        raise data.PackageNotFoundError(name)

    monkeypatch.setattr(data, "distribution", missing)
    with pytest.raises(data.DataNotFound, match="pip install --no-deps recbole==1.2.1"):
        data.load_movielens()
    with pytest.raises(data.DataNotFound, match="gensim"):
        data.load_lee_corpus()


def test_demo_falls_back_to_synthetic_data(monkeypatch, tmp_path, capsys):
    demo = importlib.import_module("demo")

    def missing(path=None):
        raise data.DataNotFound("not installed")

    monkeypatch.setattr(data, "movielens_path", missing)
    movielens = importlib.import_module("movielens")
    real_main = movielens.main
    monkeypatch.setattr(
        movielens, "main", lambda **kw: real_main(**{**kw, "max_steps": 10})
    )
    r = demo.main(
        out=str(tmp_path), progress=False, epochs=1, big_rows=3000, speed_steps=6
    )
    assert "synthetic ratings" in capsys.readouterr().out
    assert math.isfinite(r["sparse"]["test_rmse"])
    assert r["dataset"] == "synthetic ratings" and r["num_items"] == 900


@pytest.mark.newest_leg  # tests/conftest.py: a long run, newest JAX line
@needs_gensim
def test_word2vec_tiny(tmp_path):
    word2vec = importlib.import_module("word2vec")
    r = word2vec.main(epochs=1, max_steps=15, out=str(tmp_path), progress=False)
    assert r["steps"] == 15 and r["vocab"] > 1000
    assert math.isfinite(r["wordsim_spearman"]) and r["wordsim_pairs"] > 50
    assert r["losses"][-1] < r["losses"][0]
    assert (tmp_path / "word2vec.png").stat().st_size > 1000


def test_spearman_matches_definition():
    word2vec = importlib.import_module("word2vec")
    import numpy as np

    a = np.array([1.0, 2.0, 3.0, 4.0])
    assert word2vec.spearman(a, a * 10) == pytest.approx(1.0)
    assert word2vec.spearman(a, -a) == pytest.approx(-1.0)
    assert word2vec.spearman(a, np.array([1.0, 1.0, 2.0, 2.0])) == pytest.approx(
        0.894427, rel=1e-5
    )


@pytest.mark.newest_leg  # tests/conftest.py: a long run, newest JAX line
def test_dlrm_tiny(tmp_path):
    """26 Criteo-shaped tables in one buffer; the loss falls; plot and JSON."""
    dlrm = importlib.import_module("dlrm")
    r = dlrm.main(
        steps=8,
        batch=64,
        dim=8,
        scale=1 / 4096,
        eval_every=4,
        eval_batches=1,
        out=str(tmp_path),
        progress=False,
    )
    assert r["tables"] == 26 and list(r["buffers"]) == ["dim8_float32"]
    assert r["buffers"]["dim8_float32"] == [r["rows"], 8]
    losses = [loss for _, loss in r["eval"]]
    assert all(math.isfinite(x) for x in r["train_losses"] + losses)
    assert losses[-1] < losses[0]  # it learns (from 0.69, far above the entropy)
    assert (tmp_path / "dlrm.png").stat().st_size > 1000
    assert json.loads((tmp_path / "dlrm.json").read_text())["eval"] == [
        list(e) for e in r["eval"]
    ]


@pytest.mark.newest_leg  # tests/conftest.py: a long run, newest JAX line
def test_managed_ids_compares_the_ways(tmp_path):
    """Modulo hashing, a managed LRU table (LFU: the same code, in the full
    run) and one row per id on one drifting Zipf stream: the managed table
    gives every lookup a row of its own while it makes room each step, modulo
    shares rows; files written."""
    out = importlib.import_module("managed_ids").main(
        steps=30, batch=16, slots=24, policies=("lru", "lru_min2"), out=str(tmp_path)
    )
    summary = out["summary"]
    assert set(summary) == {"unbounded", "modulo", "managed_lru", "managed_lru_min2"}
    # the filter keeps the one-off ids out: fewer admissions, some defaulted
    filtered = out["managed_lru_min2_stats"]
    assert filtered["admissions"] < out["managed_lru_stats"]["admissions"], out
    assert filtered["defaulted"] > 0, filtered
    assert summary["unbounded"]["collision_rate_second_half"] == 0.0
    assert summary["modulo"]["collision_rate_second_half"] > 0.2, summary
    assert summary["managed_lru"]["collision_rate_second_half"] == 0.0
    stats = out["managed_lru_stats"]
    assert stats["evictions"] > 0 and stats["occupancy"] <= 24, stats
    for row in summary.values():
        assert 0.0 < row["log_loss_all"] < 1.0, summary
    assert (tmp_path / "managed_ids.json").exists()
    assert (tmp_path / "managed_ids.png").exists()


@pytest.mark.newest_leg  # tests/conftest.py: a long run, newest JAX line
@needs_recbole
def test_low_precision_compares_the_precisions(tmp_path):
    """MovieLens and the DLRM, float32 / bf16 nearest / bf16 stochastic: the
    tables are half the bytes, every variant learns, plot and JSON written."""
    r = importlib.import_module("low_precision").main(
        epochs=1, max_steps=15, dlrm_steps=4, dlrm_scale=1 / 4096, dlrm_batch=32,
        dlrm_dim=8, out=str(tmp_path), progress=False,
    )  # fmt: skip
    v = r["variants"]
    assert set(v) == {"float32", "bf16_nearest", "bf16_stochastic",
                      "bf16_stochastic_f32_state"}  # fmt: skip
    f32 = sum(v["float32"]["table_bytes"].values())
    assert sum(v["bf16_stochastic"]["table_bytes"].values()) * 2 == f32
    assert (
        v["bf16_stochastic"]["optimizer_state_bytes"] * 2
        == (v["bf16_stochastic_f32_state"]["optimizer_state_bytes"])
    )
    for x in v.values():
        assert math.isfinite(x["test_rmse"]) and x["losses"][-1] < x["losses"][0]
    assert (
        r["dlrm"]["bf16_stochastic"]["table_bytes"] * 2
        == (r["dlrm"]["float32"]["table_bytes"])
    )
    assert (tmp_path / "low_precision.png").stat().st_size > 1000
    assert json.loads((tmp_path / "low_precision.json").read_text())["settings"]
