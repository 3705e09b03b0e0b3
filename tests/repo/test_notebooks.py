"""Every notebook executes top to bottom (tiny sizes via JAXSLICES_SMOKE=1)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_there_are_five_notebooks():
    assert [p.name for p in NOTEBOOKS] == [
        "01_indexed_slices.ipynb",
        "02_movielens.ipynb",
        "03_word2vec.ipynb",
        "04_flax_nnx.ipynb",
        "05_dlrm.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSLICES_SMOKE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    assert "colab-badge" in nb.cells[0].source
    assert "find_spec" in nb.cells[2].source or "find_spec" in nb.cells[1].source
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors
