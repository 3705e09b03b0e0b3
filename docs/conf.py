"""Sphinx configuration of the documentation site.

Build it from the repository root (what CI runs, warnings are errors)::

    python -m sphinx -W --keep-going -E -b html -c docs . build/docs

then open ``build/docs/index.html``. The source directory is the repository
root, so README.md, the guides in docs/, the notebooks and the benchmark
results keep their relative links; ``include_patterns`` picks the pages.
Notebooks are not executed here: they carry the outputs of a full run
(``tools/execute_notebooks.py``). The API reference (``docs/api/``) is made
from the docstrings by autodoc and napoleon (Google style), so the ``>>>``
examples it shows are the ones ``pytest --doctest-modules`` runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Document this checkout's code, whatever jaxslices is installed elsewhere.
sys.path.insert(0, str(ROOT))

import jaxslices  # noqa: E402
from tools import public_api  # noqa: E402

project = "jaxslices"
author = "jaxslices developers"
copyright = "jaxslices developers"
release = jaxslices.__version__
version = release

extensions = [
    "myst_nb",  # Markdown (MyST) pages and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

root_doc = "docs/index"
include_patterns = [
    "README.md",
    "docs/*.md",
    "docs/api/*.rst",
    "notebooks/*.ipynb",
    "benchmarks/README.md",
    "benchmarks/RESULTS.md",
    "benchmarks/results/README.md",
]
exclude_patterns = [".*", "build", "**/.ipynb_checkpoints", "jaxslices/README.md"]

# Markdown: GitHub's heading anchors (the pages link to them: optax.md#...).
myst_heading_anchors = 4
myst_enable_extensions = ["dollarmath"]

# Notebooks: rendered with the outputs they carry, never executed here.
nb_execution_mode = "off"
nb_merge_streams = True

# Docstrings: Google style, type hints in the signature.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# Only jaxslices' own docstrings: an inherited one (Flax's, Equinox's) would
# show examples that jaxslices' doctests do not run.
autodoc_inherit_docstrings = False
add_module_names = True
python_display_short_literal_types = True

html_theme = "sphinx_book_theme"
html_title = f"jaxslices {release}"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,
    "use_fullscreen_button": False,
}
html_last_updated_fmt = None
html_copy_source = False
html_show_sourcelink = False


# --------------------------------------------------------------- the checks


def _check_public_names(app, env) -> None:
    """Warn (an error under -W) for each public name the reference misses."""
    from sphinx.util import logging

    documented = set(env.get_domain("py").objects)
    missing = [n for n in public_api.public_names() if n not in documented]
    for name in missing:
        logging.getLogger(__name__).warning(
            "%s is public but missing from the API reference (docs/api/*.rst)", name
        )


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    """A NamedTuple's fields are its docstring's ``Attributes``: not again as
    members (whose docstring would be Python's "Alias for field number 0")."""
    if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None


# Napoleon reads an attribute's or property's first line "X: Y" as "type:
# description"; here such a line is prose ("The number of bags (static):
# ``offsets.shape[0] - 1``"), and autodoc takes the type from the annotation.
# So these docstrings bypass napoleon: set aside before it, put back after.
_ATTRIBUTE_DOCSTRINGS: dict[str, list[str]] = {}


def _set_aside(app, what, name, obj, options, lines) -> None:
    if what in ("attribute", "property", "data"):
        _ATTRIBUTE_DOCSTRINGS[name] = lines[:]
        lines[:] = []


def _put_back(app, what, name, obj, options, lines) -> None:
    if name in _ATTRIBUTE_DOCSTRINGS:
        lines[:] = _ATTRIBUTE_DOCSTRINGS.pop(name)


def _redirect_index(app, exception) -> None:
    """``build/docs/index.html`` opens the site (its root page is docs/index)."""
    if exception is not None or app.builder.format != "html":
        return
    Path(app.outdir, "index.html").write_text(
        '<!DOCTYPE html>\n<meta charset="utf-8">\n'
        '<meta http-equiv="refresh" content="0; url=docs/index.html">\n'
        '<a href="docs/index.html">jaxslices documentation</a>\n'
    )


# ---------------------------------------------- aliases of top-level names


def _aliases_directive():
    from docutils import nodes
    from sphinx import addnodes
    from sphinx.util.docutils import SphinxDirective

    class Aliases(SphinxDirective):
        """``.. jaxslices-aliases:: jaxslices.transforms``: a namespace's names
        that are top-level names (``jaxslices.transforms.sgd`` is
        ``jaxslices.sgd``), listed with a link to the one entry that documents
        each; a reference to such a name leads to that entry (on the same
        page, after it) or to its line here."""

        required_arguments = 1

        def run(self):
            namespace = self.arguments[0]
            domain = self.env.get_domain("py")
            items = nodes.bullet_list()
            for alias, name in public_api.aliases(namespace).items():
                node_id = "alias-" + alias.replace(".", "-")
                target = nodes.target("", "", ids=[node_id])
                entry = domain.objects.get(name)
                if entry is not None and entry.docname == self.env.docname:
                    # A reference to the alias goes straight to the entry.
                    domain.note_object(
                        alias, entry.objtype, entry.node_id, location=target
                    )
                else:
                    domain.note_object(alias, "data", node_id, location=target)
                ref = addnodes.pending_xref(
                    "",
                    refdomain="py",
                    reftype="obj",
                    reftarget=name,
                    refexplicit=False,
                    refwarn=True,
                )
                ref += nodes.literal(name, name)
                para = nodes.paragraph()
                para += nodes.literal(alias, alias)
                para += nodes.Text(" is ")
                para += ref
                items += nodes.list_item("", target, para)
            return [items]

    return Aliases


def setup(app):
    app.add_directive("jaxslices-aliases", _aliases_directive())
    app.connect("env-check-consistency", _check_public_names)
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    app.connect("autodoc-process-docstring", _set_aside, priority=400)  # napoleon: 500
    app.connect("autodoc-process-docstring", _put_back, priority=600)
    app.connect("build-finished", _redirect_index)
    return {"parallel_read_safe": True}
