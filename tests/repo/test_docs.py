"""The docs are executable and their numbers come from benchmarks/results/.

* Every ```python block of README.md and docs/*.md runs: the blocks of one page
  are executed in order in one namespace, as a reader pastes them.
* Every generated block (``<!-- BEGIN GENERATED: name -->``) matches what
  ``tools/render_docs.py`` makes from the results files.
* No measured quantity (``12 ms``, ``3.4x``, ``5 MB``) is written by hand in the
  prose of those pages: it must live in a generated block.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))]


def _page_path(page: str) -> Path:
    return ROOT / page if page == "README.md" else ROOT / "docs" / page


def _render_docs():
    spec = importlib.util.spec_from_file_location(
        "render_docs", ROOT / "tools" / "render_docs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
_GENERATED = re.compile(
    r"<!-- BEGIN GENERATED: ([\w.-]+) -->.*?<!-- END GENERATED: \1 -->", re.S
)
# A number followed by a unit of time, memory, or a ratio ("3x", but not the
# "1024 x 16" of a shape).
_MEASURED = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|µs|us|MB|GB|kB|KB|MiB|GiB|x(?!\s*\d)|×(?!\s*\d))"
    r"(?![\w])"
)


def python_blocks(page: str) -> list[str]:
    text = _page_path(page).read_text()
    return [body for lang, body in _FENCE.findall(text) if lang == "python"]


def prose(page: str) -> str:
    text = _page_path(page).read_text()
    text = _FENCE.sub("", text)
    text = _GENERATED.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)  # inline code: names, not measurements


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)])
def test_python_blocks_run(page):
    namespace: dict = {"__name__": f"docs_{Path(page).stem}"}
    for i, block in enumerate(python_blocks(page)):
        code = compile(block, f"{page} (python block {i + 1})", "exec")
        exec(code, namespace)


def test_generated_blocks_are_up_to_date():
    stale = _render_docs().stale_pages()
    assert not stale, (
        f"{stale}: generated blocks differ from benchmarks/results/; run "
        "`python tools/render_docs.py`"
    )


@pytest.mark.parametrize("page", PAGES)
def test_no_hand_written_measurements(page):
    found = _MEASURED.findall(prose(page))
    assert not found, (
        f"{page} quotes measurements by hand: {found}. Quote them from a results "
        "file through a generated block (see tools/render_docs.py)."
    )


def test_the_checker_finds_hand_written_numbers():
    # The regex above must catch what it is for, and leave shapes alone.
    text = "SGD is 79x faster, 0.15-0.38 ms/step, 2.1 MB; a 1024 x 16 batch, 64-wide"
    assert _MEASURED.findall(text) == ["79x", "0.38 ms", "2.1 MB"]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (ROOT / "README.md").read_text()
    commands = [
        line.strip()
        for block in _bash_blocks(readme)
        for line in block.splitlines()
        if "pytest" in line
    ]
    assert commands, "the README gives no test command"
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[0] in ci, (commands[0], ".ci/run does not run it verbatim")
    # Two legs, oldest and newest supported JAX, each on its Python.
    assert "run_leg oldest 3.11" in ci and "run_leg newest 3.12" in ci
    # And once without a C++ compiler: the whole suite collected, the kernel
    # tests and their fallbacks run (the wheel's among them), the demo.
    assert ".ci/without-compiler python -m pytest --collect-only -q" in ci
    assert ".ci/without-compiler python -m pytest -n 2 -rs $KERNEL_TESTS" in ci
    assert "tests/repo/test_wheel.py" in ci.split("KERNEL_TESTS=")[1]
    assert ".ci/without-compiler python examples/demo.py" in ci
    assert "`.ci/without-compiler`" in readme and "collects\nthe whole suite" in readme


def test_readme_states_the_tested_jax_range():
    # The decision (docs/design.md, "JAX compatibility"): a lower bound only,
    # the oldest tested JAX; the newest tested one is NEWEST_TESTED in
    # jaxslices/_jax_compat.py, which CI reads.
    pyproject = (ROOT / "pyproject.toml").read_text()
    compat = (ROOT / "jaxslices" / "_jax_compat.py").read_text()
    for name in ("jax", "jaxlib"):
        bound = re.findall(rf'^ *"{name}([<>=!~][^"]*)",', pyproject, flags=re.M)
        assert len(bound) == 1 and re.fullmatch(r">=[0-9.]+", bound[0]), (
            f"pyproject must give {name} a lower bound and no upper bound: {bound}"
        )
    oldest = re.search(r'^ *"jax>=([0-9.]+)",', pyproject, flags=re.M).group(1)
    newest = re.search(r'^NEWEST_TESTED = "([0-9.]+)"', compat, flags=re.M).group(1)
    assert re.search(rf'^OLDEST_TESTED = "{re.escape(oldest)}"', compat, flags=re.M)
    readme = (ROOT / "README.md").read_text()
    assert f"`jax>={oldest}`" in readme and f"({newest})" in readme
    # .ci/run reads both from there (the sed patterns match these lines).
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pyproject.toml" in ci and "jaxslices/_jax_compat.py" in ci
    assert 's/^NEWEST_TESTED = "' in ci and 's/^ *"jax>=' in ci
