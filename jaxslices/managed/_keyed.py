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

On a :class:`~jaxslices.sharding.ShardingPlan` (``collection=plan``) the
remap runs before the lookup's routing, on a **replicated** remap state:
every device remaps the ids of the whole batch (the same computation, so
the same rows and states on every device and as on one device), and the
rows are then routed to the devices that own them by the plan's own
routing (masked or all-to-all, by the remapped row). The evicted slots come
back as rows of the plan's buffer (a row-wise table's slot ``i`` in chunk
``i // chunk``). Column-wise managed tables are refused (one slot would be
``n`` buffer rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._jax_compat import shard_map
from ..collection import EmbeddingCollection
from ..collection._buffers import Layout
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
      collection: the collection the batch is for, or a
        :class:`~jaxslices.sharding.ShardingPlan` of it (the evicted rows are
        then rows of the plan's buffers).
      high_words: optional ``uint32 [max_total]``, the high 32 bits of each
        raw id (64-bit ids under 32-bit JAX); ``ids``' values are then the
        low 32 bits (``uint32`` or ``int32``, bit for bit).

    Returns:
      ``(remapped ids, new states, {table: evicted buffer rows})``.

    Raises:
      KeyError: a manager for a table the collection does not have.
      TypeError: ``collection`` is neither a collection nor a plan of one.
      ValueError: a manager's ``num_slots`` differs from its table's rows,
        ``states`` and ``managers`` name different tables, or a plan places
        a managed table column-wise.

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
    coll, layout, mesh = _collection_and_layout(collection, where)
    feature, used = _feature_of_slots(ids)
    values = ids.values
    if high_words is None:
        raw = as_raw_ids(values, f"{where} (the ids' values)")
    else:
        raw = _with_high_words(values, high_words, where)
    out = jnp.zeros(values.shape, jnp.int32)
    handled = jnp.zeros(values.shape, bool)
    new_states, evicted = {}, {}
    for table in sorted(managers):  # every table checked before any remap
        mc, config = managers[table], coll.table_config(table)
        if mc.num_slots != config.rows:
            raise ValueError(
                f"{where}: ManagedCollision({mc.name!r}) has num_slots="
                f"{mc.num_slots} but table {table!r} has rows={config.rows}: "
                "they must be equal (the slots are the table's rows)."
            )
        if layout.buffer(layout.placement(table).buffer).pieces != 1:
            raise ValueError(
                f"{where}: table {table!r} is placed column-wise (each row in "
                "pieces on every device): a managed table must be data-parallel, "
                "table-wise or row-wise, so that an evicted slot is one buffer row."
            )
    for table in sorted(managers):
        mc = managers[table]
        mine = [f for f, k in enumerate(ids.keys) if coll.table_of(k) == table]
        mask = used & jnp.isin(feature, jnp.asarray(mine, jnp.int32))
        if not mine:
            mask = jnp.zeros_like(used)
        rows, new_states[table], slots = _remap_replicated(
            mesh, mc, states[table], raw, mask
        )
        out = jnp.where(mask, rows, out)
        handled = handled | mask
        evicted[table] = _buffer_rows(layout, table, slots, mc.num_slots)
    # rows fit any integer dtype of 32 bits or more; narrower ids widen
    dtype = values.dtype if values.dtype.itemsize >= 4 else jnp.dtype(jnp.int32)
    out = jnp.where(handled, out.astype(dtype), values.astype(dtype))
    remapped = ids.ids._replace(values=out)
    return KeyedJaggedIds._made(ids.keys, remapped), new_states, evicted


def _collection_and_layout(
    collection: Any, where: str
) -> tuple[EmbeddingCollection, Layout, Any]:
    """The collection, the layout of its params (its own, or a plan's) and
    the plan's mesh (``None`` for a collection)."""
    if isinstance(collection, EmbeddingCollection):
        return collection, collection.layout, None
    inner = getattr(collection, "collection", None)
    layout = getattr(collection, "layout", None)
    if isinstance(inner, EmbeddingCollection) and isinstance(layout, Layout):
        return inner, layout, getattr(collection, "mesh", None)  # a ShardingPlan
    raise TypeError(
        f"{where}: `collection` must be a jaxslices.EmbeddingCollection or a "
        f"jaxslices.sharding.ShardingPlan of one, got {type(collection).__name__}."
    )


def _remap_replicated(
    mesh: Any, mc: ManagedCollision, state: RemapState, raw: RawIds, mask: jax.Array
) -> tuple[jax.Array, RemapState, jax.Array]:
    """``mc.remap``; on a mesh of several devices, in ``shard_map`` with every
    operand replicated: each device remaps the whole batch on its copy of the
    state (the native kernels run per device; the XLA remap under the
    partitioner compiles to a large program) and every copy stays equal."""
    if mesh is None or mesh.size == 1:
        return mc.remap(state, raw, mask)
    return shard_map(mc.remap, mesh, (P(), P(), P()), (P(), P(), P()))(state, raw, mask)


def _buffer_rows(
    layout: Layout, table: str, slots: jax.Array, num_slots: int
) -> jax.Array:
    """The buffer rows of evicted ``slots`` (``num_slots``: unused, which
    become the buffer's row count)."""
    at = layout.placement(table)
    buffer = layout.buffer(at.buffer)
    rows = at.rows_of(slots)
    return jnp.where(slots < num_slots, rows, buffer.rows).astype(jnp.int32)


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
