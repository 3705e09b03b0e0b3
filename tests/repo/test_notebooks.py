"""Every notebook executes top to bottom, and its committed outputs are current.

The notebooks are committed with the outputs of a full run (plots included,
made by ``python tools/execute_notebooks.py``), which the documentation site
and a reader on the web see. The tests run each notebook at tiny sizes
(``JAXSLICES_SMOKE=1``) and check that those outputs are current:

* the digest of the code cells stamped by the tool matches the cells (an
  edited cell means its outputs are stale);
* the smoke run prints what the committed outputs print, numbers masked
  (``execute_notebooks.skeleton``): same lines, same plots, no error.

The smoke runs execute on the newest tested JAX line (what Colab runs; CI's
newest leg) and are deselected on older ones (``newest_leg``,
tests/conftest.py); the committed outputs are checked on every leg.
"""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tools import execute_notebooks

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
RERUN = "run `python tools/execute_notebooks.py {}` and commit the notebook"


def test_there_are_the_notebooks():
    assert [p.name for p in NOTEBOOKS] == [
        "01_indexed_slices.ipynb",
        "02_movielens.ipynb",
        "03_word2vec.ipynb",
        "04_flax_nnx.ipynb",
        "05_dlrm.ipynb",
        "06_managed_ids.ipynb",
        "07_low_precision.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_outputs_are_current(path):
    nb = nbformat.read(path, as_version=4)
    stamp = nb.metadata.get("jaxslices", {})
    assert stamp.get("sources_sha256") == execute_notebooks.sources_digest(nb), (
        f"{path.name}: its code cells changed since its outputs were made; "
        + RERUN.format(path.stem)
    )
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.name}: not executed top to bottom in one run ({counts}); "
        + RERUN.format(path.stem)
    )
    kinds = [o.get("output_type") for c in code for o in c.outputs]
    assert "error" not in kinds
    # A cell that shows a plot carries it: a reader on the web sees the figure.
    for cell in code:
        if "plt.show()" in cell.source:
            shown = [o for o in cell.outputs if "image/png" in o.get("data", {})]
            assert shown, f"{path.name}: a plot is missing; " + RERUN.format(path.stem)
    # Nothing that changes from run to run without meaning (progress bars,
    # timing metadata) is committed.
    assert not execute_notebooks.strip_volatile(nbformat.read(path, as_version=4))
    assert not any("execution" in c.metadata for c in code)


@pytest.mark.newest_leg  # tests/conftest.py: on the newest JAX line only
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSLICES_SMOKE", "1")
    # The kernel's own (inline) backend: plots become outputs, as in a full run.
    monkeypatch.delenv("MPLBACKEND", raising=False)
    committed = nbformat.read(path, as_version=4)
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
    # The committed outputs show what this code prints now (numbers aside).
    ran, shown = (execute_notebooks.skeleton(n) for n in (nb, committed))
    for i, (now, then) in enumerate(zip(ran, shown, strict=True)):
        assert now == then, (
            f"{path.name}, code cell {i + 1}: the committed outputs differ from "
            "what the notebook prints now; " + RERUN.format(path.stem)
        )
