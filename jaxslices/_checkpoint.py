"""Checkpoints of trees that hold ``IndexedSlices``: Orbax, Flax msgpack, pickle.

Parameters are dense arrays, and so are the optimizer states of the jaxslices
transforms; :class:`jaxslices.MultiSteps` keeps each sparse leaf's
accumulation buffer as an :class:`~jaxslices.IndexedSlices`, and a user's own
train state may hold gradients. Every way of saving such a tree restores it
bit for bit, with nothing to register by hand:

* **Orbax** (``StandardCheckpointer``, ``CheckpointManager`` with
  ``StandardSave`` / ``StandardRestore``) flattens the
  tree with JAX's pytree functions and saves the typed indices as what they are
  to JAX, an extended-dtype (key) array: its ``uint32`` words plus the name of
  its implementation, with which it rebuilds them on restore. jaxslices
  registers those names with JAX at import (``_jax_compat.register_key_impl_names``),
  so a restore into the live state, into an abstract target from
  ``jax.eval_shape``, or with no target at all gives the same ids.
* **Flax msgpack** (``flax.serialization.to_bytes`` / ``from_bytes``,
  ``to_state_dict``): an ``IndexedSlices`` is saved as ``{"values": ...,
  "indices": integer ids}`` and rebuilt from its target. The registration with
  Flax happens when ``flax.serialization`` is imported, before or after
  ``import jaxslices`` (a post-import hook: ``import jaxslices`` never imports
  Flax itself).
* **pickle** (and ``copy.deepcopy``): ``IndexedSlices.__reduce__`` pickles the
  values, the integer ids and the dense shape; unpickling needs only
  ``jaxslices`` importable.

Code that converts every leaf to NumPy itself (``np.savez(*jax.tree.leaves(
state))``) fails when it saves, with a ``TypeError`` naming ``IndexedSlices``
(the typed indices refuse ``np.asarray``): use one of the ways above. See
``docs/checkpointing.md``.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

from .slices import IndexedSlices

__all__ = ["install_flax_serialization"]

_FLAX_MODULE = "flax.serialization"


def _to_state_dict(s: IndexedSlices) -> dict[str, Any]:
    from .slices import check_slices

    check_slices(s, "flax.serialization.to_state_dict")
    return {"values": s.values, "indices": s.indices}


def _from_state_dict(target: IndexedSlices, state: dict[str, Any]) -> IndexedSlices:
    if not isinstance(state, dict) or set(state) != {"values", "indices"}:
        raise ValueError(
            "flax.serialization.from_state_dict: the target holds an "
            f"IndexedSlices{target.dense_shape} but the saved state there is "
            f"{type(state).__name__}"
            + (f" with keys {sorted(state)}" if isinstance(state, dict) else "")
            + ", not {'values', 'indices'}. The checkpoint was saved from a "
            "different tree: restore into a target of the saved structure."
        )
    return IndexedSlices(state["values"], state["indices"], target.dense_shape)


def _register_with(module: Any) -> None:
    module.register_serialization_state(
        IndexedSlices, _to_state_dict, _from_state_dict, override=True
    )


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader of ``flax.serialization``, then registers."""

    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _register_with(module)

    def __getattr__(self, name: str) -> Any:  # get_source, resource readers, ...
        return getattr(self._loader, name)


class _FlaxSerializationHook(importlib.abc.MetaPathFinder):
    """Finds ``flax.serialization`` with the other finders, wraps its loader."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _FLAX_MODULE:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]  # once
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # pragma: no cover - an unusual loader: leave it alone
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


def install_flax_serialization() -> None:
    """Make Flax's msgpack serialization save and restore ``IndexedSlices``.

    Registers at once if ``flax.serialization`` is imported already, else when
    it is (called by ``import jaxslices``; idempotent).
    """
    module = sys.modules.get(_FLAX_MODULE)
    if module is not None:
        _register_with(module)
        return
    if not any(isinstance(f, _FlaxSerializationHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _FlaxSerializationHook())
