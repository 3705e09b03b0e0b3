"""The public names of jaxslices, and the ones the API reference documents.

The public API is what ``jaxslices/__init__.py`` exports (``__all__``) plus
the ``__all__`` of each public namespace (``jaxslices/README.md``).
``docs/conf.py`` warns (an error under ``-W``) when the built reference
misses one, and ``tests/repo/test_docs_site.py`` checks the reference's
sources without building it, so a new public name cannot go undocumented.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
API_DIR = ROOT / "docs" / "api"

#: Namespaces whose ``__all__`` is public, besides ``jaxslices`` itself.
NAMESPACES = (
    "jaxslices.transforms",
    "jaxslices.sharding",
    "jaxslices.capacity",
    "jaxslices.kernels",
    "jaxslices.native",
    "jaxslices.nnx",
    "jaxslices.linen",
    "jaxslices.equinox",
)


def public_names() -> list[str]:
    """Every public name, fully qualified (``jaxslices.sgd``, ...), sorted.

    A namespace (a public module) counts as a name of its own, documented by
    its ``py:module`` (or ``automodule``) entry.
    """
    names = {"jaxslices"}
    for module_name in ("jaxslices", *NAMESPACES):
        module = importlib.import_module(module_name)
        names.add(module_name)
        names.update(f"{module_name}.{name}" for name in module.__all__)
    return sorted(names)


def aliases(namespace: str) -> dict[str, str]:
    """The names of ``namespace`` that are top-level names under another name.

    ``{"jaxslices.transforms.sgd": "jaxslices.sgd", ...}``: the reference
    documents the object once, as the top-level name, and lists these with a
    link (the ``jaxslices-aliases`` directive of ``docs/conf.py``).
    """
    import jaxslices

    top = {id(getattr(jaxslices, name)): name for name in jaxslices.__all__}
    module = importlib.import_module(namespace)
    out = {}
    for name in module.__all__:
        target = top.get(id(getattr(module, name)))
        if target is not None:
            out[f"{namespace}.{name}"] = f"jaxslices.{target}"
    return out


# ``.. autofunction:: jaxslices.sgd``, ``.. py:function:: jaxslices.transforms.sgd``,
# ``.. automodule:: jaxslices.capacity``, ``.. py:module:: jaxslices.native``
_DIRECTIVE = re.compile(
    r"^\s*\.\.\s+(?:auto(?:function|class|data|module|exception)"
    r"|py:(?:function|class|data|module|exception|attribute))::\s+([\w.]+)",
    re.M,
)
_ALIASES = re.compile(r"^\s*\.\.\s+jaxslices-aliases::\s+([\w.]+)", re.M)
_CURRENT_MODULE = re.compile(r"^\s*\.\.\s+(?:py:)?currentmodule::\s+([\w.]+)", re.M)


def documented_names(api_dir: Path = API_DIR) -> set[str]:
    """The fully qualified names that the reference's ``.rst`` sources document."""
    found = set()
    for page in sorted(api_dir.glob("*.rst")):
        text = page.read_text()
        # Names are written fully qualified; a ``currentmodule`` is not used.
        if _CURRENT_MODULE.search(text):
            raise ValueError(f"{page}: write names fully qualified, no currentmodule")
        found.update(_DIRECTIVE.findall(text))
        for namespace in _ALIASES.findall(text):
            found.update(aliases(namespace))
    return found
