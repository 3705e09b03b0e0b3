"""Managed-collision tables: raw ids of any value to the rows of a fixed-size table.

* :class:`ManagedCollision` (a static policy) and :class:`RemapState` (its
  state, a pytree kept beside the table): remap with admission into free
  slots, LFU / LRU eviction, a documented default (no row) for ids not
  admitted (:mod:`jaxslices.managed._table`).
* :class:`RawIds`: how 64-bit ids and hashed strings reach the device under
  JAX's default 32-bit mode (:mod:`jaxslices.managed._raw`).
* :func:`reset_rows`: evicted rows of a table and of its optimizer state
  re-initialised (:mod:`jaxslices.managed._reset`).
* :func:`remap_keyed`: a :class:`~jaxslices.KeyedJaggedIds` remapped per
  table of an :class:`~jaxslices.EmbeddingCollection`
  (:mod:`jaxslices.managed._keyed`).

The guide is ``docs/managed.md``.
"""

from ._keyed import remap_keyed as remap_keyed
from ._raw import RawIds as RawIds
from ._reset import reset_rows as reset_rows
from ._table import ManagedCollision as ManagedCollision
from ._table import RemapState as RemapState

__all__ = ["ManagedCollision", "RawIds", "RemapState", "remap_keyed", "reset_rows"]
