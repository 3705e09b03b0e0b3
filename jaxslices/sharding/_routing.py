"""Sparse gradients over a device mesh: data-parallel and row-sharded tables.

JAX's own SPMD is the engine (``jax.jit`` with ``NamedSharding``,
``shard_map``, ``jax.distributed``); this module makes sparse gradients stay
sparse across it. Per step, communication is O(rows in the batch x D), never
O(V x D). See ``docs/scale_out.md``.

* **Data parallel** (tables replicated, batch sharded), under plain ``jax.jit``:
  nothing to call. Every jaxslices scatter into a table or its optimizer state
  (:func:`jaxslices.apply_updates`, the transforms' state updates) goes through
  :func:`replicate_rows`, which asks the partitioner for the slices' rows on
  every device (an all-gather of ``N x D``) before the scatter. Without it XLA
  scatters each device's rows into a local zero table and all-reduces the
  ``V x D`` tables.
* **Row-sharded tables** (model parallel): the table and its optimizer state
  are sharded by rows over a mesh axis (:func:`shard_rows`,
  :func:`sharded_init`). :func:`sharded_lookup` and :func:`sharded_update` take
  the routing scheme as an argument:

  - ``"masked"``: every device sees the rows of the whole global batch and
    serves the ones it owns (what GSPMD does with a row-sharded gather). No
    capacity limit; O(global batch x D) per device.
  - ``"all_to_all"``: each device deduplicates its local ids and sends them
    (and, for the update, their summed gradient rows) to the owner shard in a
    fixed-size buffer of ``capacity`` slots per destination (TorchRec's
    row-wise sharding, TPU embeddings). O(devices x capacity x D) per device.
    If a device has more distinct ids for one shard than ``capacity``, the step
    raises an error at run time (like :func:`jaxslices.check_ids`); no row or
    gradient is ever dropped silently.

Neither scheme gathers, all-reduces or replicates a table: outputs keep the
table's row sharding.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from .. import _coalesce, _errors, _ids, _spmd, _tape
from .. import updates as updates_
from .._jax_compat import abstract_mesh as _abstract_mesh
from .._jax_compat import all_gather_invariant as _all_gather_invariant
from .._jax_compat import shard_map as _shard_map
from ..embedding import embedding_lookup
from ..slices import IndexedSlices, coalesce, is_indexed_slices
from ._placement import check_axis as _check_axis
from ._placement import state_specs

__all__ = ["Routing", "sharded_lookup", "sharded_update"]

Routing = Literal["masked", "all_to_all"]
_ROUTINGS = ("masked", "all_to_all")


# ------------------------------------------------------------------ routing


def _check_routing(routing: str, where: str, capacity: Any = None) -> None:
    if routing not in _ROUTINGS:
        raise ValueError(
            f"{where}: `routing` must be one of {_ROUTINGS}, got {routing!r}."
        )
    if capacity is not None and (
        not isinstance(capacity, (int, np.integer)) or capacity < 1
    ):
        raise ValueError(
            f"{where}: `capacity` must be a positive int (slots per destination "
            f"shard) or None (never overflows), got {capacity!r}."
        )


def _overflow_error(needed: int, *, capacity: int, where: str) -> ValueError:
    return ValueError(
        f"{where}(routing='all_to_all'): a device has {needed} distinct ids for "
        f"one shard, more than capacity={capacity} slots. Nothing was dropped: "
        f"the step stops here, on every device. Pass capacity >= {needed} (or "
        "capacity=None, which never overflows), or use routing='masked'."
    )


def _bucket(ids: jax.Array, rows_per_shard: int, shards: int, capacity: int, where):
    """Destination (shard, slot) of each of ``ids`` (sorted unique, padding last).

    Returns ``(shard, slot, ok)``; ``ok`` is False for padding and for ids past a
    destination's capacity. Called inside ``shard_map``: if any device has more
    ids for one shard than ``capacity``, every device raises (the largest
    count over all devices in the message) before any exchange, because
    every buffer sent is built from the checked ``slot``
    (:func:`jaxslices._errors.raise_if`).
    """
    valid = _ids.valid(ids, rows_per_shard * shards)
    shard = jnp.where(valid, ids // rows_per_shard, shards).astype(jnp.int32)
    start = jnp.searchsorted(shard, jnp.arange(shards, dtype=jnp.int32), side="left")
    pos = jnp.arange(ids.shape[0], dtype=jnp.int32)
    slot = pos - start[jnp.minimum(shard, shards - 1)]
    needed = jnp.max(jnp.where(valid, slot + 1, 0))
    slot = _errors.raise_if(
        needed > capacity,
        slot,
        functools.partial(_overflow_error, capacity=capacity, where=where),
        needed,
        reduce=("max",),
    )
    over = valid & (slot >= capacity)
    return shard, slot, valid & ~over


def _send(x: jax.Array, shard, slot, ok, shards: int, capacity: int, fill):
    """Pack ``x`` (one entry per id) into a ``[shards, capacity, ...]`` buffer."""
    buf = jnp.full((shards, capacity, *x.shape[1:]), fill, x.dtype)
    s = jnp.where(ok, shard, shards)
    return buf.at[s, slot].set(x, mode="drop")


def _exchange(x: jax.Array, axis: str) -> jax.Array:
    """Buffer ``[shards, capacity, ...]``: slot block ``i`` goes to shard ``i``."""
    return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def _all_axes(mesh: Any) -> tuple[str, ...]:
    return tuple(mesh.axis_names)


def _resolve(table: Any, mesh: Any, axis: str, where: str):
    mesh = mesh if mesh is not None else _abstract_mesh(table)
    if mesh is None:
        raise ValueError(
            f"{where}(routing='all_to_all') needs a device mesh: pass `mesh=`, or "
            "call it under jax.jit on arrays placed on a mesh."
        )
    shards = _check_axis(mesh, axis, where)
    if table.shape[0] % shards:
        raise ValueError(
            f"{where}: the table has {table.shape[0]} rows, not a multiple of the "
            f"{shards} shards of mesh axis {axis!r}; place it with "
            "jaxslices.sharding.shard_rows, which pads the rows."
        )
    return mesh, shards, table.shape[0] // shards


def _batch_size_check(n: int, devices: int, where: str) -> None:
    if n % devices:
        raise ValueError(
            f"{where}(routing='all_to_all'): the batch's leading dimension ({n}) "
            f"must be divisible by the number of devices ({devices}): each device "
            "routes its own part of the batch."
        )


def _routed_gather(table, ids, *, mesh, axis, shards, rows, capacity):
    """``table[ids]`` for a row-sharded table, ids routed to their owners."""
    devices = mesh.size
    _batch_size_check(ids.shape[0], devices, "sharded_lookup")
    n_local = int(np.prod(ids.shape)) // devices
    cap = n_local if capacity is None else int(capacity)
    row_shape = table.shape[1:]
    batch = P(_all_axes(mesh))

    def local(shard_rows_, ids_):
        flat = ids_.reshape(-1)
        total = rows * shards
        uniq, inv = _coalesce.unique_with_inverse(_ids.safe_ids(flat, total), total)
        dest, slot, ok = _bucket(uniq, rows, shards, cap, "sharded_lookup")
        offset = jnp.where(ok, uniq - dest * rows, rows)
        want = _exchange(_send(offset, dest, slot, ok, shards, cap, rows), axis)
        got = shard_rows_.at[want].get(mode="fill", fill_value=0)
        back = _exchange(got, axis)
        mine = back[jnp.where(ok, dest, 0), jnp.where(ok, slot, 0)]
        mine = jnp.where(ok.reshape(-1, *([1] * len(row_shape))), mine, 0)
        return mine[inv].reshape(*ids_.shape, *row_shape)

    return _shard_map(local, mesh, (P(axis), batch), batch)(table, ids)


def sharded_lookup(
    table: jax.Array,
    ids: jax.Array,
    *,
    axis: str,
    routing: Routing = "masked",
    capacity: int | None = None,
    mesh: Any = None,
) -> jax.Array:
    """``table[ids]`` for a table sharded by rows over mesh axis ``axis``.

    Use it inside a loss under ``jax.jit``, as :func:`jaxslices.embedding_lookup`:
    :func:`jaxslices.value_and_grad` gives the table an
    :class:`~jaxslices.IndexedSlices` gradient (global ids, the batch's
    sharding). Ids outside ``[0, rows)`` read zeros and get no gradient.

    Args:
      table: ``[V, ...]``, placed with ``P(axis)`` (:func:`shard_rows`).
      ids: integer array whose leading (batch) dimension is split over all
        devices for ``"all_to_all"`` (it must divide evenly).
      axis: the mesh axis the table's rows are sharded over.
      routing: ``"masked"`` (every device handles the global batch, no
        capacity) or ``"all_to_all"`` (ids routed to their owner shard).
      capacity: ``"all_to_all"`` only: distinct ids a device may send to one
        shard per lookup. ``None``: the device's whole batch (never overflows;
        as many bytes as ``"masked"``). A smaller value cuts communication to
        ``devices x capacity`` rows; overflow raises at run time.
        :func:`jaxslices.capacity.estimate_all_to_all_capacity` estimates it
        from sample batches.
      mesh: the mesh; ``None``: the one the table is placed on (under ``jit``).

    Returns:
      ``ids.shape + table.shape[1:]``, sharded like ``ids``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxslices
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
      >>> table = jnp.arange(8.0).reshape(4, 2)
      >>> table = jaxslices.sharding.shard_rows(table, mesh, "model")
      >>> f = jax.jit(lambda t, i: jaxslices.sharding.sharded_lookup(
      ...     t, i, axis="model", routing="all_to_all", mesh=mesh))
      >>> f(table, jnp.array([[3, 0]]))
      Array([[[6., 7.],
              [0., 1.]]], dtype=float32)
    """
    _check_routing(routing, "sharded_lookup", capacity)
    if routing == "masked":
        return embedding_lookup(table, ids)
    ids = ids if hasattr(ids, "dtype") else np.asarray(ids)  # no narrowing
    if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.ndim < 1:
        raise TypeError(
            "sharded_lookup: `ids` must be an integer array with a batch dimension, "
            f"got {jnp.dtype(ids.dtype).name}{list(ids.shape)}."
        )
    mesh, shards, rows = _resolve(table, mesh, axis, "sharded_lookup")
    gather = functools.partial(
        _routed_gather,
        mesh=mesh,
        axis=axis,
        shards=shards,
        rows=rows,
        capacity=capacity,
    )
    safe = _ids.safe_ids(ids, table.shape[0])  # the ids policy: invalid ids -> V
    out = _tape.lookup(table, safe, gather)  # sparse under value_and_grad
    return gather(table, safe) if out is None else out


# ------------------------------------------------------------------- update


def _pad_slices(g: IndexedSlices, multiple: int) -> IndexedSlices:
    pad = -g.num_slices % multiple
    if not pad:
        return g
    v = g.dense_shape[0]
    return IndexedSlices(
        jnp.concatenate([g.values, jnp.zeros((pad, *g.row_shape), g.dtype)]),
        jnp.concatenate([g.indices, jnp.full((pad,), v, g.indices.dtype)]),
        g.dense_shape,
    )


def _route_to_owner(g, *, axis, others, shards, rows, capacity):
    """Local slices (global ids) -> the slices this device owns (local ids)."""
    c = coalesce(g)
    dest, slot, ok = _bucket(c.indices, rows, shards, capacity, "sharded_update")
    offset = jnp.where(ok, c.indices - dest * rows, rows).astype(c.indices.dtype)
    ids = _exchange(_send(offset, dest, slot, ok, shards, capacity, rows), axis)
    vals = _exchange(_send(c.values, dest, slot, ok, shards, capacity, 0), axis)
    if others:  # table replicas on the other mesh axes get every replica's rows
        ids, vals = _all_gather_invariant((ids, vals), others)
    return IndexedSlices(
        vals.reshape(-1, *g.row_shape), ids.reshape(-1), (rows, *g.row_shape)
    )


def sharded_update(
    tx: optax.GradientTransformation,
    grads: Any,
    state: Any,
    params: Any,
    *,
    axis: str,
    routing: Routing = "masked",
    capacity: int | None = None,
    mesh: Any = None,
) -> tuple[Any, Any]:
    """One optimizer step for params whose tables are sharded by rows over ``axis``.

    Returns ``(new_params, new_state)``, i.e. ``tx.update`` then
    :func:`jaxslices.apply_updates`, laid out like the inputs. Call it under
    ``jax.jit`` with the gradients of :func:`jaxslices.value_and_grad`. Every
    parameter whose gradient is an :class:`~jaxslices.IndexedSlices` is a
    table sharded by rows over ``axis`` (:func:`shard_rows`); every other
    parameter is replicated; the state is laid out like its parameters
    (:func:`sharded_init`). (A table whose gradient fell back to dense, e.g.
    tied weights, counts as replicated under ``"all_to_all"``: correct, but it
    is gathered whole; use ``"masked"`` for such tables.)

    * ``routing="masked"``: ``tx.update`` + ``apply_updates`` as written, each
      device handling the rows of the whole global batch and writing those it
      owns. Any transform works (``clip_by_global_norm`` included).
    * ``routing="all_to_all"``: each device sums its local gradient rows per id
      and sends them to their owner shard (``capacity`` slots per shard; see
      :func:`sharded_lookup`); the optimizer then runs on each shard, on the
      rows it owns. Every jaxslices transform works: the row-wise ones need
      nothing else, and the two that look at all rows at once sum over the
      shards (:func:`jaxslices.clip_by_global_norm`'s norm,
      :func:`jaxslices.apply_if_finite`'s test). A stock Optax transform that
      reduces over a table's gradient would see one shard's rows; JAX's
      ``shard_map`` check then raises where such a per-shard value reaches a
      replicated parameter.

    Args:
      tx: the optimizer, e.g. ``jaxslices.lazy_adam(1e-3)``.
      grads: gradients, sharded like the batch (sparse) or replicated (dense).
      state: the optimizer state (:func:`sharded_init`).
      params: the parameters.
      axis: the mesh axis the tables' rows are sharded over.
      routing: ``"masked"`` or ``"all_to_all"``.
      capacity: ``"all_to_all"`` only: distinct ids a device may send to one
        shard; ``None``: its whole part of the batch (never overflows).
        :func:`jaxslices.capacity.estimate_all_to_all_capacity` estimates it.
      mesh: the mesh; ``None``: the one the parameters are placed on.

    Returns:
      ``(new_params, new_state)``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxslices
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
      >>> emb = jaxslices.sharding.shard_rows(jnp.ones((4, 2)), mesh, "model")
      >>> params = {"emb": emb}
      >>> tx = jaxslices.sgd(0.5)
      >>> g = {"emb": jaxslices.IndexedSlices(jnp.ones((2, 2)), jnp.array([1, 1]),
      ...                                     (4, 2))}
      >>> step = jax.jit(lambda g, s, p: jaxslices.sharding.sharded_update(
      ...     tx, g, s, p, axis="model", routing="all_to_all", mesh=mesh))
      >>> new, _ = step(g, jaxslices.sharding.sharded_init(tx, params), params)
      >>> new["emb"][:, 0]
      Array([1., 0., 1., 1.], dtype=float32)
    """
    _check_routing(routing, "sharded_update", capacity)
    if routing == "masked":
        upd, state = tx.update(grads, state, params)
        return updates_.apply_updates(params, upd), state
    tables = [
        is_indexed_slices(g) for g in jax.tree.leaves(grads, is_leaf=is_indexed_slices)
    ]
    leaves, treedef = jax.tree.flatten(params)
    g_leaves = treedef.flatten_up_to(grads)
    if len(tables) != len(leaves):
        raise ValueError(
            "sharded_update: `grads` must have the structure of `params` (one "
            f"gradient per parameter), got {len(tables)} and {len(leaves)} leaves."
        )
    first = next((p for p, t in zip(leaves, tables, strict=True) if t), None)
    if first is None:
        upd, state = tx.update(grads, state, params)
        return updates_.apply_updates(params, upd), state
    mesh, shards, _ = _resolve(first, mesh, axis, "sharded_update")
    devices = mesh.size
    others = tuple(a for a in mesh.axis_names if a != axis)
    batch = P(_all_axes(mesh))

    p_specs = [P(axis) if t else P() for t in tables]
    num_rows = [p.shape[0] if p.ndim else 0 for p in leaves]
    g_in, g_specs = [], []
    for g, t, p in zip(g_leaves, tables, leaves, strict=True):
        if t:
            _resolve(p, mesh, axis, "sharded_update")  # rows divide evenly
            if g.dense_shape != tuple(p.shape):
                raise ValueError(
                    f"sharded_update: a gradient has dense shape {g.dense_shape} "
                    f"but its parameter has shape {tuple(p.shape)}."
                )
            g = _pad_slices(g, devices)
            g_in.append(g)
            g_specs.append(jax.tree.unflatten(jax.tree.structure(g), [batch, batch]))
        else:
            g_in.append(g)
            g_specs.append(P())
    p_spec_tree = jax.tree.unflatten(treedef, p_specs)
    s_specs = state_specs(tx, state, p_spec_tree, P())

    def local(g_flat, state, p_flat):
        local_grads = []
        for g, t, v in zip(g_flat, tables, num_rows, strict=True):
            if t:
                rows = v // shards
                n_local = g.num_slices
                cap = n_local if capacity is None else int(capacity)
                g = _route_to_owner(
                    g,
                    axis=axis,
                    others=others,
                    shards=shards,
                    rows=rows,
                    capacity=cap,
                )
            local_grads.append(g)
        grads_ = jax.tree.unflatten(treedef, local_grads)
        params_ = jax.tree.unflatten(treedef, p_flat)
        with _spmd.rows_sharded_over(axis):  # global norms sum over shards
            updates, new_state = tx.update(grads_, state, params_)
        return jax.tree.leaves(updates_.apply_updates(params_, updates)), new_state

    new_leaves, new_state = _shard_map(
        local,
        mesh,
        (g_specs, s_specs, p_specs),
        (p_specs, s_specs),
    )(g_in, state, leaves)
    return jax.tree.unflatten(treedef, new_leaves), new_state
