"""The module paths of earlier layouts, kept importable.

A pickle names each class by the module that defines it
(``jaxslices._transform.TraceState``), and code written for an earlier layout
imports modules by their old names (``from jaxslices.accumulate import
MultiSteps``). When the package was grouped into ``transforms/`` and
``native/`` those modules moved; :data:`MOVED` maps each old path to the
module that holds its contents now, and :func:`install` (run by
``jaxslices/__init__.py``) adds an import hook that serves the new module
under the old name, only when the old name is imported. The hook comes last
on ``sys.meta_path``, so it never hides a module that exists.

Pickles made by the old layout load (``tests/lib/test_checkpoint.py``). A
module that moves again gets its line here.

Names work the same way one level up: :data:`OLD_NAMES` lists the top-level
names that the export rule of ``jaxslices/README.md`` ("What the top level
exports") moved into a namespace (``jaxslices.shard_rows`` is
``jaxslices.sharding.shard_rows``) or replaced (``jaxslices.jagged_from_lists``
by ``JaggedIds.from_lists``). ``jaxslices.__getattr__`` serves them
(:func:`old_name`): they import as before, but are not in ``__all__`` and
are documented once, under their new names.

Example:
  >>> import jaxslices
  >>> from jaxslices.accumulate import MultiSteps  # jaxslices.transforms now
  >>> MultiSteps is jaxslices.MultiSteps
  True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any

__all__ = ["MOVED", "OLD_NAMES", "install", "old_name"]

#: Old module path -> the module that holds its contents now.
MOVED = {
    # The transforms as Optax groups them, the native backend a unit.
    "jaxslices.accumulate": "jaxslices.transforms._accumulation",
    "jaxslices._alias": "jaxslices.transforms._alias",
    "jaxslices._clipping": "jaxslices.transforms._clipping",
    "jaxslices._conditionality": "jaxslices.transforms._conditionality",
    "jaxslices._rowwise": "jaxslices.transforms._rowwise",
    "jaxslices._transform": "jaxslices.transforms._transform",
    "jaxslices._hijax": "jaxslices.native._hijax",
    "jaxslices._backend": "jaxslices._lookup_handlers",
    "jaxslices._layers": "jaxslices._ids",
    # Sharding, collections and per-table transforms as units.
    "jaxslices.plans": "jaxslices.sharding",
    "jaxslices.per_table": "jaxslices.transforms._per_table",
    "jaxslices._buffers": "jaxslices.collection._buffers",
    "jaxslices._pooling": "jaxslices.collection._pooling",
    "jaxslices._layout": "jaxslices._spmd",
}

#: Old top-level name -> (module, name) that holds it now (the export rule).
OLD_NAMES = {
    "shard_rows": ("jaxslices.sharding", "shard_rows"),
    "sharded_init": ("jaxslices.sharding", "sharded_init"),
    "sharded_lookup": ("jaxslices.sharding", "sharded_lookup"),
    "sharded_update": ("jaxslices.sharding", "sharded_update"),
    "ShardingPlan": ("jaxslices.sharding", "ShardingPlan"),
    "TablePlan": ("jaxslices.sharding", "TablePlan"),
    "plan": ("jaxslices.sharding", "plan_collection"),
    "jagged_from_lists": ("jaxslices.jagged", "jagged_from_lists"),
    "jagged_from_lengths": ("jaxslices.jagged", "jagged_from_lengths"),
    "jagged_from_padded": ("jaxslices.jagged", "jagged_from_padded"),
    "per_table": ("jaxslices.transforms._per_table", None),
}


def old_name(name: str) -> Any:
    """The object an old top-level name stands for; ``AttributeError`` if none."""
    if name not in OLD_NAMES:
        raise AttributeError(f"module 'jaxslices' has no attribute {name!r}")
    module, attr = OLD_NAMES[name]
    mod = importlib.import_module(module)
    return mod if attr is None else getattr(mod, attr)


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module that holds its contents now."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: Any) -> None:
        return None  # a placeholder, replaced in sys.modules by exec_module

    def exec_module(self, module: Any) -> None:
        # The import system returns what sys.modules holds after exec_module.
        sys.modules[module.__name__] = importlib.import_module(self.target)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        del path, target
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Add the hook to ``sys.meta_path`` (once, last)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
