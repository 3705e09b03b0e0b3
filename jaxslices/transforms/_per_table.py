"""Per-table hyperparameters for the stacked buffers of an ``EmbeddingCollection``.

An :class:`~jaxslices.EmbeddingCollection` keeps many tables in one buffer,
so an optimizer sees one parameter where the user thinks of several tables.
These transforms give each table its own number anyway: the table of a
gradient row is found from the buffer's static row offsets (a
``searchsorted`` of the row ids over the buffer's segments: O(rows in the
batch), no per-row array of the buffer's size is kept; this also holds for
the chunked layouts of a sharding plan).

* :func:`scale_by_table`: multiply each table's updates by its factor. Put
  it after an optimizer whose update is linear in its learning rate (``sgd``
  with or without momentum, ``adagrad``, ``rowwise_adagrad``, ``lazy_adam``,
  ``lazy_adamw`` with the decay before it, clipping before it): the factor is
  then exactly a per-table learning rate. Not for ``ftrl``, whose learning
  rate enters its state.
* :func:`add_decayed_weights_by_table`: per-table weight decay, touched rows
  only for slices (as :func:`jaxslices.add_decayed_weights`).

Both act on the leaves of the updates tree that are a buffer of the
collection: a key of the leaf's path is the buffer's name (as in
``{"emb": {"dim64_float32": ...}}``, or an NNX state's
``["emb"]["buffers"]["dim64_float32"]``) and its (dense) shape is the
buffer's.
Other leaves pass through unchanged; a tree without any buffer of the
collection raises an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import _leaves, _spmd
from .._indexed import IndexedSlices, _replace_values, check_slices
from ._rowwise import coalesce_for_update, mask_padding, rows

__all__ = ["PerTableState", "add_decayed_weights_by_table", "scale_by_table"]


class PerTableState(NamedTuple):
    """State of the per-table transforms: the step count (for schedules)."""

    count: jax.Array  # int32 scalar


def _per_table_values(coll: Any, given: Mapping[str, Any], default: Any, where: str):
    if not isinstance(given, Mapping):
        raise TypeError(
            f"{where}: give a dict {{table name: value}}, got {type(given).__name__}."
        )
    unknown = [n for n in given if n not in {t.name for t in coll.tables}]
    if unknown:
        raise ValueError(
            f"{where}: no tables {unknown} in the collection; its tables: "
            f"{[t.name for t in coll.tables]}."
        )
    return {t.name: given.get(t.name, default) for t in coll.tables}


def _segments(b: Any) -> tuple[np.ndarray, np.ndarray]:
    """Segment starts and each segment's table position (``-1``: unused rows)."""
    tables = b.tables
    starts = np.array([s for s, _, _ in b.segments], np.int64)
    owner = np.array([-1 if t is None else tables.index(t) for _, _, t in b.segments])
    return starts, owner


def _per_row(b: Any, per_table: jax.Array, indices: jax.Array) -> jax.Array:
    """Each row id's table value (0 for unused rows and padding)."""
    starts, owner = _segments(b)
    seg = jnp.searchsorted(
        jnp.asarray(starts.astype(indices.dtype)), indices, side="right"
    )
    t = jnp.asarray(owner)[jnp.clip(seg - 1, 0, len(owner) - 1)]
    vals = jnp.concatenate([per_table, jnp.zeros((1,), per_table.dtype)])
    unused = (t < 0) | (indices >= b.rows)  # unused rows; padding (index V)
    return vals[jnp.where(unused, len(b.tables), t)]


def _dense_rows(b: Any, per_table: jax.Array) -> jax.Array:
    """``[rows]``: each row's table value (the dense path; O(rows) anyway)."""
    starts, owner = _segments(b)
    lengths = np.array([n for _, n, _ in b.segments])
    vals = jnp.concatenate([per_table, jnp.zeros((1,), per_table.dtype)])
    per_seg = vals[np.where(owner < 0, len(b.tables), owner)]
    return jnp.repeat(per_seg, lengths, total_repeat_length=b.rows)


def _map_buffers(coll: Any, updates: Any, fn: Any, where: str, *others: Any) -> Any:
    """``fn(b, g, *xs, rows=...)`` on every leaf that is a buffer ``b``.

    ``rows(indices)`` maps the leaf's row ids to the buffer's: the identity,
    except inside a sharded optimizer step
    (:func:`jaxslices._spmd.rows_sharded_over`), where a sharded buffer's
    leaf is this shard's rows and its row ``i`` is buffer row ``first + i``.
    """
    by_name = {b.name: b for b in coll.buffers}
    found = []

    def leaf(path, g, *xs):
        if g is None:
            return None
        name = _leaves.named_in_path(path, by_name)
        b = by_name.get(name)
        shape = tuple(g.shape) if hasattr(g, "shape") else None
        if b is None:
            return g
        local = _spmd.shard_rows(b.rows) if getattr(b, "sharded", False) else None
        if shape == b.shape:
            span = None
        elif local is not None and shape == (local[0], b.dim):
            span = local  # this shard's rows of a sharded buffer
        else:
            return g
        if isinstance(g, IndexedSlices):
            check_slices(g, _leaves.label(where, path))
        found.append(name)
        return fn(b, g, *xs, span=span)

    out = jax.tree_util.tree_map_with_path(
        leaf, updates, *others, is_leaf=_leaves.is_leaf
    )
    if not found:
        raise ValueError(
            f"{where}: the updates hold no buffer of this collection (a leaf "
            f"named one of {list(by_name)} with its shape {list(coll.shapes.values())}"
            "). Apply it to the gradients of the params `EmbeddingCollection.init` "
            "made (or a tree that contains them under their names)."
        )
    return out


def _buffer_rows(b: Any, indices: jax.Array, span: Any) -> jax.Array:
    """Buffer rows of a leaf's row ids (``span``: a shard's ``(R, first)``)."""
    if span is None:
        return indices
    rows, first = span
    return jnp.where(indices < rows, indices + first.astype(indices.dtype), b.rows)


def _leaf_rows(b: Any, values: jax.Array, span: Any) -> jax.Array:
    """:func:`_dense_rows` of the leaf's rows (a shard's, in a sharded step)."""
    per_row = _dense_rows(b, values)
    if span is None:
        return per_row
    rows, first = span
    return jax.lax.dynamic_slice_in_dim(per_row, first, rows)


def _resolve(values: dict, count: jax.Array, tables: tuple) -> list[Any]:
    return [v(count) if callable(v) else v for v in (values[t] for t in tables)]


def scale_by_table(
    coll: Any, factors: Mapping[str, Any], *, default: Any = 1.0
) -> optax.GradientTransformationExtraArgs:
    """Multiply each table's updates by its factor (a per-table learning rate).

    Args:
      coll: the :class:`~jaxslices.EmbeddingCollection`.
      factors: ``{table name: factor}``; a factor is a scalar or an Optax
        schedule (of the number of updates so far).
      default: the factor of the tables not in ``factors``.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` (state:
      :class:`PerTableState`).

    Example:
      >>> import jax, optax, jaxslices as js
      >>> coll = js.EmbeddingCollection(
      ...     [js.TableConfig("a", rows=3, dim=2), js.TableConfig("b", rows=2, dim=2)])
      >>> params = coll.init(jax.random.key(0))
      >>> tx = optax.chain(js.sgd(1.0), coll.scale_by_table({"b": 0.1}))
      >>> g = js.IndexedSlices(jax.numpy.ones((2, 2)), jax.numpy.array([0, 3]), (5, 2))
      >>> u, _ = tx.update({"dim2_float32": g}, tx.init(params))
      >>> u["dim2_float32"].values[:, 0].tolist()  # row 3 is table "b"'s row 0
      [-1.0, -0.10000000149011612]
    """
    where = "EmbeddingCollection.scale_by_table"
    values = _per_table_values(coll, factors, default, where)

    def init_fn(params):
        del params
        return PerTableState(jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, **extra):
        del params, extra

        def fn(b, g, span):
            f = jnp.stack(
                [
                    jnp.asarray(v, jnp.float32)
                    for v in _resolve(values, state.count, b.tables)
                ]
            )
            if isinstance(g, IndexedSlices):
                k = _per_row(b, f, _buffer_rows(b, g.indices, span))
                k = k.astype(g.values.dtype)
                return _replace_values(g, g.values * k[:, None])
            g = jnp.asarray(g)
            return (g * _leaf_rows(b, f, span)[:, None]).astype(g.dtype)

        out = _map_buffers(coll, updates, fn, where)
        return out, PerTableState(optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def add_decayed_weights_by_table(
    coll: Any, rates: Mapping[str, Any], *, default: Any = 0.0
) -> optax.GradientTransformationExtraArgs:
    """Add ``rate(table) * params`` to the updates; touched rows only for slices.

    As :func:`jaxslices.add_decayed_weights` with one rate per table: a dense
    buffer update decays every row, a sparse one is coalesced (each touched
    row decays once per step) and only its rows decay. The result is
    coalesced.

    Args:
      coll: the :class:`~jaxslices.EmbeddingCollection`.
      rates: ``{table name: rate}`` (scalars or Optax schedules).
      default: the rate of the tables not in ``rates``.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` (state:
      :class:`PerTableState`); ``update`` needs the params.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices as js
      >>> coll = js.EmbeddingCollection(
      ...     [js.TableConfig("a", rows=3, dim=1), js.TableConfig("b", rows=2, dim=1)])
      >>> params = {"dim1_float32": jnp.ones((5, 1))}
      >>> tx = coll.add_decayed_weights_by_table({"b": 0.5})
      >>> g = js.IndexedSlices(jnp.zeros((3, 1)), jnp.array([0, 4, 4]), (5, 1))
      >>> u, _ = tx.update({"dim1_float32": g}, tx.init(params), params)
      >>> u["dim1_float32"].to_dense().ravel().tolist()
      [0.0, 0.0, 0.0, 0.0, 0.5]
    """
    where = "EmbeddingCollection.add_decayed_weights_by_table"
    values = _per_table_values(coll, rates, default, where)

    def init_fn(params):
        del params
        return PerTableState(jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, **extra):
        del extra
        if params is None:
            raise ValueError(
                f"{where} needs the params: call `tx.update(updates, state, params)`."
            )
        _leaves.check_structure(where, updates, "updates", params, "params")

        def fn(b, g, p, span):
            r = jnp.stack(
                [
                    jnp.asarray(v, jnp.float32)
                    for v in _resolve(values, state.count, b.tables)
                ]
            )
            p = jnp.asarray(p)
            if isinstance(g, IndexedSlices):
                c = coalesce_for_update(g)
                k = _per_row(b, r, _buffer_rows(b, c.indices, span))
                k = k.astype(c.values.dtype)
                new = c.values + k[:, None] * rows(p, c).astype(c.values.dtype)
                return _replace_values(c, mask_padding(c, new))
            g = jnp.asarray(g)
            return (g + _leaf_rows(b, r, span)[:, None] * p).astype(g.dtype)

        out = _map_buffers(coll, updates, fn, where, params)
        return out, PerTableState(optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
