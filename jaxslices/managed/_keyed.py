"""``remap_keyed``: the raw ids of a ``KeyedJaggedIds``, remapped per table.

An :class:`~jaxslices.EmbeddingCollection` reads a
:class:`~jaxslices.KeyedJaggedIds` whose ids are rows of each feature's
table. With managed-collision tables the ids are raw ids: each managed
table has its own :class:`~jaxslices.ManagedCollision` and
:class:`~jaxslices.RemapState`, and the ids of every feature that reads it
(several features may share a table) are remapped together, so one raw id
gets one row whichever feature it came from. The result is the same
``KeyedJaggedIds`` with rows in place of raw ids, ready for the collection.
Tables without a manager keep their ids. An id not admitted becomes its
table's ``rows`` (out of that table's range), which a collection reads as
zeros, with no gradient, never reaching a neighbouring table.

The slots each table evicted come back as rows of the table's **buffer**
(the table's first row in the buffer added; unused entries the buffer's
row count, which :func:`jaxslices.reset_rows` ignores), ready for
``reset_rows(..., where=lambda p: p[buffer])``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ..collection import EmbeddingCollection
from ..keyed import KeyedJaggedIds
from ._raw import RawIds, as_raw_ids
from ._table import ManagedCollision, RemapState

__all__ = ["remap_keyed"]


def _feature_of_slots(ids: KeyedJaggedIds) -> tuple[jax.Array, jax.Array]:
    """The feature index of every id slot, and which slots hold ids."""
    slot = jnp.arange(ids.max_total, dtype=jnp.int32)
    bag = jnp.searchsorted(ids.offsets, slot, side="right").astype(jnp.int32) - 1
    used = slot < ids.offsets[-1]
    return jnp.where(used, bag // ids.batch_size, -1), used


def remap_keyed(
    managers: Mapping[str, ManagedCollision],
    states: Mapping[str, RemapState],
    ids: KeyedJaggedIds,
    collection: EmbeddingCollection,
    *,
    high_words: Any = None,
) -> tuple[KeyedJaggedIds, dict[str, RemapState], dict[str, jax.Array]]:
    """Remap the raw ids of ``ids`` per managed table of ``collection``.

    Args:
      managers: ``{table name: ManagedCollision}``; each one's ``num_slots``
        is its table's ``rows``.
      states: ``{table name: RemapState}``, the same keys.
      ids: the batch, its values raw ids (an integer dtype: ``int32`` or
        ``uint32``, or ``int64`` with ``jax_enable_x64``).
      collection: the collection the batch is for.
      high_words: optional ``uint32 [max_total]``, the high 32 bits of each
        raw id (64-bit ids under 32-bit JAX); ``ids``' values are then the
        low 32 bits (``uint32`` or ``int32``, bit for bit).

    Returns:
      ``(remapped ids, new states, {table: evicted buffer rows})``.

    Raises:
      KeyError: a manager for a table the collection does not have.
      ValueError: a manager's ``num_slots`` differs from its table's rows,
        or ``states`` and ``managers`` name different tables.

    Example:
      >>> import jaxslices as js
      >>> table = js.TableConfig("t", 4, 2, features=("a", "b"))
      >>> coll = js.EmbeddingCollection([table])
      >>> mc = {"t": js.ManagedCollision("t", num_slots=4)}
      >>> kjt = js.KeyedJaggedIds.from_lists(
      ...     {"a": [[900], [7]], "b": [[7, 900], []]})
      >>> out, states, evicted = js.remap_keyed(mc, {"t": mc["t"].init()}, kjt, coll)
      >>> out.values.tolist()
      [1, 0, 0, 1]
    """
    where = "jaxslices.remap_keyed"
    if set(managers) != set(states):
        raise ValueError(
            f"{where}: `states` must have one RemapState per manager: managers "
            f"{sorted(managers)}, states {sorted(states)}."
        )
    if not isinstance(ids, KeyedJaggedIds):
        raise TypeError(
            f"{where}: `ids` must be KeyedJaggedIds, got {type(ids).__name__}."
        )
    feature, used = _feature_of_slots(ids)
    values = ids.values
    if high_words is None:
        raw = as_raw_ids(values, f"{where} (the ids' values)")
    else:
        raw = _with_high_words(values, high_words, where)
    out = jnp.zeros(values.shape, jnp.int32)
    handled = jnp.zeros(values.shape, bool)
    new_states, evicted = {}, {}
    for table in sorted(managers):
        mc = managers[table]
        config = collection.table_config(table)
        if mc.num_slots != config.rows:
            raise ValueError(
                f"{where}: ManagedCollision({mc.name!r}) has num_slots="
                f"{mc.num_slots} but table {table!r} has rows={config.rows}: "
                "they must be equal (the slots are the table's rows)."
            )
        mine = [f for f, k in enumerate(ids.keys) if collection.table_of(k) == table]
        mask = used & jnp.isin(feature, jnp.asarray(mine, jnp.int32))
        if not mine:
            mask = jnp.zeros_like(used)
        rows, new_states[table], slots = mc.remap(states[table], raw, mask)
        out = jnp.where(mask, rows, out)
        handled = handled | mask
        buffer, base = collection.placement(table)
        total = collection.shapes[buffer][0]
        evicted[table] = jnp.where(slots < mc.num_slots, slots + base, total)
    # rows fit any integer dtype of 32 bits or more; narrower ids widen
    dtype = values.dtype if values.dtype.itemsize >= 4 else jnp.dtype(jnp.int32)
    out = jnp.where(handled, out.astype(dtype), values.astype(dtype))
    remapped = ids.ids._replace(values=out)
    return KeyedJaggedIds._made(ids.keys, remapped), new_states, evicted


def _with_high_words(values: Any, high_words: Any, where: str) -> RawIds:
    values = jnp.asarray(values)
    if values.dtype not in (jnp.int32, jnp.uint32):
        raise TypeError(
            f"{where}: with `high_words`, the ids' values must be the low 32 bits "
            f"as int32 or uint32, got {values.dtype}."
        )
    high = jnp.asarray(high_words)
    if high.dtype != jnp.uint32 or high.shape != values.shape:
        raise ValueError(
            f"{where}: `high_words` must be uint32 of the values' shape "
            f"{list(values.shape)}, got {high.dtype}{list(high.shape)}."
        )
    return RawIds(high, jax.lax.bitcast_convert_type(values, jnp.uint32))
