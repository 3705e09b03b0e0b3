"""Execute the notebooks at full size and write their outputs into them.

The committed notebooks carry the outputs of a full run (the plots, the test
RMSE, the timings), so the documentation site and a reader on the web see
results, not only code. This script makes those outputs::

    python tools/execute_notebooks.py                 # every notebooks/*.ipynb
    python tools/execute_notebooks.py 02_movielens    # some of them
    python tools/execute_notebooks.py --check         # which ones are stale

It runs each notebook top to bottom in a fresh kernel, from ``notebooks/``,
without ``JAXSLICES_SMOKE`` (full sizes: minutes per notebook on a 2-core CPU),
then removes what changes from run to run without meaning anything (progress
bars, timing metadata) and stamps the notebook's metadata with a digest of its
code cells, the JAX version and the platform (``metadata.jaxslices``).

``tests/repo/test_notebooks.py`` keeps the outputs current: the stamp must
match the code cells (edit a cell, rerun this script), and the smoke run the
tests make of every notebook must print what the committed outputs print, with
the numbers left out (:func:`skeleton`): a changed repr, a new line or a lost
plot makes the test fail until this script is rerun.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

# A tqdm progress bar ("skip-gram:  40%|####      | 2/5 [00:01<00:01, 2.0it/s]")
# and tqdm's warning when ipywidgets is missing: they say nothing once the run
# is over, and change with every run.
_PROGRESS = re.compile(r"\|[^|\n]*\|\s*\d+/\d+\s*\[|\r|TqdmWarning|IProgress not found")


def notebook_paths(names: list[str] | None = None) -> list[Path]:
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if not names:
        return paths
    chosen = [p for p in paths if p.stem in names or p.name in names]
    missing = set(names) - {p.stem for p in chosen} - {p.name for p in chosen}
    if missing:
        raise SystemExit(f"no such notebook in notebooks/: {sorted(missing)}")
    return chosen


def sources_digest(nb) -> str:
    """SHA-256 of the notebook's code cells, in order: what its outputs depend on."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            h.update(cell.source.encode())
            h.update(b"\0")
    return h.hexdigest()


def _is_progress(output) -> bool:
    return (
        output.get("output_type") == "stream"
        and output.get("name") == "stderr"
        and (
            not output.get("text", "").strip()  # what a closed bar leaves
            or bool(_PROGRESS.search(output.get("text", "")))
        )
    )


def strip_volatile(nb) -> list[str]:
    """Remove progress bars and timing metadata in place; return what was removed."""
    removed = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)
        keep = []
        for output in cell.outputs:
            if _is_progress(output):
                removed.append(output.get("text", ""))
            else:
                keep.append(output)
        cell.outputs = keep
    return removed


_NUMBER = re.compile(r"[-+]?\d[\d,_]*(?:\.\d+)?(?:e[-+]?\d+)?", re.I)


def _mask(text: str) -> str:
    return _NUMBER.sub("#", text)


def skeleton(nb) -> list[list[str]]:
    """What each code cell shows, numbers masked: the loose comparison of outputs.

    For every code cell, one entry per output: ``stdout: <line>`` for each
    printed line (numbers replaced by ``#``), ``result: <line>`` for each
    line of a cell's value, ``display: <mime types>`` for a plot or other
    display, ``error: <name>`` for an exception. Standard error (warnings,
    progress bars) is left out: it depends on the machine. Cells tagged
    ``loose-output`` (cell metadata) keep only the kinds of their outputs, in
    order: what they print depends on the run's size (a word2vec's nearest
    neighbours, progress lines that only a full run prints).
    """
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        loose = "loose-output" in cell.metadata.get("tags", [])
        entries: list[str] = []
        for kind, text in _merged(cell.outputs):
            lines = text.splitlines()
            if kind in ("stdout", "result") and loose:
                entries.append(f"{kind}: ...")
            elif kind in ("stdout", "result"):
                entries += [f"{kind}: {_mask(line)}" for line in lines]
            else:
                entries.append(f"{kind}: {text}")
        cells.append(entries)
    return cells


def _merged(outputs) -> list[tuple[str, str]]:
    # (kind, text) per output; consecutive stdout outputs (a print split over
    # flushes) are one text.
    out: list[tuple[str, str]] = []
    for output in outputs:
        kind = output.get("output_type")
        if kind == "stream":
            if output.get("name") != "stdout":
                continue
            text = output.get("text", "")
            if out and out[-1][0] == "stdout":
                out[-1] = ("stdout", out[-1][1] + text)
            else:
                out.append(("stdout", text))
        elif kind in ("execute_result", "display_data"):
            data = output.get("data", {})
            if set(data) == {"text/plain"}:
                out.append(("result", data["text/plain"]))
            else:
                out.append(("display", ", ".join(sorted(data))))
        elif kind == "error":
            out.append(("error", output.get("ename", "")))
    return out


def stale(paths: list[Path] | None = None) -> list[str]:
    """Notebooks whose committed outputs were not made from their code cells."""
    import nbformat

    out = []
    for path in paths or notebook_paths():
        nb = nbformat.read(path, as_version=4)
        stamp = nb.metadata.get("jaxslices", {}).get("sources_sha256")
        if stamp != sources_digest(nb):
            out.append(path.name)
    return out


def execute(path: Path, *, timeout: int = 3600) -> float:
    """Run ``path`` full size in a fresh kernel and write it back; return seconds."""
    import jax
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    seconds = time.perf_counter() - start
    for line in strip_volatile(nb):
        if line.strip() and "IProgress" not in line and "\r" not in line:
            print(f"  {path.name}: removed {line.strip()[:100]!r}")
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("output_type") == "error"
    ]
    if errors:
        raise SystemExit(f"{path.name}: {errors[0].get('ename')}: not written")
    device = jax.devices()[0]
    nb.metadata["jaxslices"] = {
        "sources_sha256": sources_digest(nb),
        "jax": jax.__version__,
        "platform": device.platform,
        "device": device.device_kind,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "seconds": round(seconds),
    }
    nbformat.write(nb, path)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebooks (stem or file name)")
    parser.add_argument(
        "--check", action="store_true", help="list stale notebooks, exit 1 if any"
    )
    args = parser.parse_args(argv)
    paths = notebook_paths(args.names)
    if args.check:
        found = stale(paths)
        for name in found:
            print(f"{name}: outputs are stale; run python tools/execute_notebooks.py")
        return 1 if found else 0
    # Full sizes, and the notebook's own matplotlib backend (inline plots).
    os.environ.pop("JAXSLICES_SMOKE", None)
    os.environ.pop("MPLBACKEND", None)
    for path in paths:
        print(f"{path.name} ...", flush=True)
        seconds = execute(path)
        print(f"{path.name}: {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
