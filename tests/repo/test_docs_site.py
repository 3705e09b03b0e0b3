"""The documentation site's sources are complete, without building the site.

CI builds the site (``docs/conf.py``) on the newest leg with warnings as
errors; these checks run on every leg and take no time:

* every public name (``jaxslices.__all__`` and the ``__all__`` of each public
  namespace) has an entry in the API reference (``docs/api/*.rst``), and
  every entry there is a public name;
* every guide in ``docs/`` and every notebook is a page of the site;
* the README gives the build command, and CI runs it verbatim.
"""

from __future__ import annotations

import re
from pathlib import Path

from tools import public_api

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_name_is_in_the_api_reference():
    missing = sorted(set(public_api.public_names()) - public_api.documented_names())
    assert not missing, (
        f"public names missing from the API reference: {missing}. Add an "
        "`.. autofunction::` / `.. autoclass::` entry (fully qualified) to the "
        "page of docs/api/ where it belongs."
    )


def test_the_api_reference_documents_only_public_names():
    extra = sorted(public_api.documented_names() - set(public_api.public_names()))
    assert not extra, f"docs/api/ documents names that are not public: {extra}"


def test_a_namespace_name_that_is_a_top_level_name_is_an_alias():
    # ``jaxslices.transforms.sgd`` is ``jaxslices.sgd``: listed as an alias of
    # the one entry, not documented twice.
    aliases = public_api.aliases("jaxslices.transforms")
    assert aliases["jaxslices.transforms.sgd"] == "jaxslices.sgd"
    assert "jaxslices.capacity.estimate_max_distinct" not in public_api.aliases(
        "jaxslices.capacity"
    )


def _toctree_entries() -> set[str]:
    text = (ROOT / "docs" / "index.md").read_text()
    entries = set()
    for block in re.findall(r"```\{toctree\}\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.strip()
            if not line or line.startswith(":"):
                continue
            target = re.search(r"<([^>]+)>$", line)
            path = target.group(1) if target else line
            entries.add(str((ROOT / "docs" / path).resolve().relative_to(ROOT)))
    return entries


def test_every_guide_and_notebook_is_on_the_site():
    entries = {re.sub(r"\.(md|ipynb)$", "", e) for e in _toctree_entries()}
    pages = [
        *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "index.md"),
        *sorted((ROOT / "notebooks").glob("*.ipynb")),
        ROOT / "README.md",
    ]
    missing = [
        str(p.relative_to(ROOT))
        for p in pages
        if str(p.relative_to(ROOT).with_suffix("")) not in entries
    ]
    assert not missing, f"not in a toctree of docs/index.md: {missing}"


def _bash_lines(text: str) -> list[str]:
    return [
        line.strip()
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
        for line in block.splitlines()
    ]


def test_ci_builds_the_site_with_the_readme_command_warnings_as_errors():
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in _bash_lines(readme) if "-m sphinx" in line]
    assert len(commands) == 1, "the README gives no (or several) docs commands"
    build = commands[0][commands[0].index("pip install") :]
    assert " -W " in build and "-c docs . build/docs" in build
    assert build in (ROOT / ".ci" / "run").read_text(), (
        build,
        ".ci/run does not build the documentation with the README's command",
    )
    assert "build/docs/index.html" in readme
