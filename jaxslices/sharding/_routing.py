"""The routing engine: lookups and gradients reach the devices that own the rows.

One engine serves every row-sharded buffer: a table placed with
:func:`~jaxslices.sharding.shard_rows` (a plan of one), and the sharded
buffers of a :class:`~jaxslices.sharding.ShardingPlan` (row-wise,
table-wise and column-wise tables, device ``k`` owning rows ``[k * R, (k + 1)
* R)`` of the buffer). A :class:`Route` says how one buffer is reached:

* ``"masked"``: every device sees the ids of the whole global batch and
  serves the rows it owns (what ``jax.jit``'s partitioner does with a gather
  from a row-sharded array); the optimizer step is the partitioner's too.
  No capacity; ``O(global batch x D)`` per device.
* ``"all_to_all"`` (TorchRec's input and output distribution): inside
  ``shard_map`` each device deduplicates the rows its own part of the batch
  asks for, sends each to its owner in a fixed buffer of ``capacity`` slots
  per destination (:func:`jax.lax.all_to_all`), the owner gathers them from
  its shard, and the rows come back by the reverse all-to-all; the requester
  pools them (:mod:`jaxslices.collection._pooling`). The gradient is the
  batch's, with the requester's ids; the optimizer step (:func:`update`)
  sums each device's gradient rows per row and sends them the same way to
  their owners, where the optimizer runs on the rows each shard owns (every
  jaxslices transform; the native kernels run per device there). Per device
  ``O(devices x capacity x D)``: with a capacity sized from the data
  (:mod:`jaxslices.capacity`) it follows the device's own batch, not the
  global one. More distinct rows for one owner than ``capacity`` raise on
  every device (:func:`jaxslices._errors.raise_if`); nothing is dropped.

Neither scheme gathers, all-reduces or replicates a table: the tables keep
their row sharding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
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

__all__ = [
    "ROUTINGS",
    "Route",
    "Routing",
    "check_routing",
    "gather",
    "sharded_lookup",
    "sharded_update",
    "update",
]

Routing = Literal["masked", "all_to_all"]
ROUTINGS = ("masked", "all_to_all")


def check_routing(routing: Any, where: str, capacity: Any = None) -> None:
    if routing not in ROUTINGS:
        raise ValueError(
            f"{where}: `routing` must be one of {ROUTINGS}, got {routing!r}."
        )
    if capacity is not None and (
        isinstance(capacity, bool)
        or not isinstance(capacity, (int, np.integer))
        or capacity < 1
    ):
        raise ValueError(
            f"{where}: `capacity` must be a positive int (slots per destination "
            f"shard) or None (never overflows), got {capacity!r}."
        )


@dataclasses.dataclass(frozen=True)
class Route:
    """How one row-sharded buffer is reached (static: part of a compiled step).

    Attributes:
      mesh: the mesh (concrete or abstract).
      axis: the mesh axis the buffer's rows are split over; the batch is
        split over every axis of the mesh.
      routing: ``"masked"`` or ``"all_to_all"``.
      capacity: ``"all_to_all"``: the distinct rows one device may send to
        one shard per step; ``None``: the device's whole part of the batch
        (never overflows).
      where: what the user called, for messages (``"sharded_lookup(routing=
        'all_to_all')"``).
      fix: how to raise the capacity, for the overflow message.
      step: the routed step that takes the lookup's gradients back, for the
        warning when a step without a route scatters them.
    """

    mesh: Any
    axis: str
    routing: str = "masked"
    capacity: int | None = None
    where: str = "sharded_lookup(routing='all_to_all')"
    fix: str = "Pass capacity >= {needed} (or capacity=None, which never overflows)"
    step: str = "jaxslices.sharding.sharded_update(..., routing='all_to_all')"

    @property
    def shards(self) -> int:
        return int(self.mesh.shape[self.axis])

    @property
    def devices(self) -> int:
        return int(self.mesh.size)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    @property
    def others(self) -> tuple[str, ...]:
        return tuple(a for a in self.mesh.axis_names if a != self.axis)


# ------------------------------------------------------------ the exchange


def _overflow_error(needed: int, *, capacity: int, where: str, fix: str) -> ValueError:
    return ValueError(
        f"{where}: a device has {needed} distinct ids for "
        f"one shard, more than capacity={capacity} slots. Nothing was dropped: "
        f"the step stops here, on every device. {fix.format(needed=needed)}, or "
        "use routing='masked'."
    )


def _bucket(ids: jax.Array, rows_per_shard: int, shards: int, capacity: int, route):
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
        functools.partial(
            _overflow_error, capacity=capacity, where=route.where, fix=route.fix
        ),
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


# ------------------------------------------------------------------ lookups


def gather(
    table: jax.Array, ids: jax.Array, route: Route | None, batch_dim: int = 0
) -> jax.Array:
    """``table[ids]`` for a row-sharded buffer, reached as ``route`` says.

    ``ids``: buffer rows in ``[0, V]`` (``V``: padding, reads zeros), of the
    index dtype, any shape; ``batch_dim``: the dimension split over the
    devices (padded to a multiple of them if it does not divide). Under
    :func:`jaxslices.value_and_grad` the buffer gets an
    :class:`~jaxslices.IndexedSlices` gradient with these ids (the batch's
    gradient, laid out like the batch). ``route`` ``None`` or masked: the
    partitioner's gather.
    """
    if route is None or route.routing == "masked":
        return embedding_lookup(table, ids)
    fn = functools.partial(_routed, route=route, batch_dim=batch_dim)
    out = _tape.lookup(table, ids, fn)  # the batch's sparse gradient
    if out is None:
        return fn(table, ids)
    _spmd.expect_routed_step(table, _unrouted_message(route))
    return out


def _unrouted_message(route: Route) -> str:
    return (
        f"{route.where.split(' (')[0]}: its gradient reached a scatter outside "
        f"{route.step}, e.g. tx.update + jaxslices.apply_updates written as on "
        "one device. The result is right, but the rows take the partitioner's "
        "way (every device gets the global batch's gradient rows) instead of "
        f"the lookup's all-to-all. Call {route.step} for the step to route them."
    )


def _routed(table, ids, *, route: Route, batch_dim: int):
    """The all-to-all gather: ids to their owners, rows back (one ``shard_map``)."""
    shards, devices, axis = route.shards, route.devices, route.axis
    num_rows = table.shape[0]
    rows = num_rows // shards
    row_shape = table.shape[1:]
    size = ids.shape[batch_dim]
    pad = -size % devices
    if pad:  # every device routes an equal part; the extra slots are padding
        widths = [(0, 0)] * ids.ndim
        widths[batch_dim] = (0, pad)
        ids = jnp.pad(ids, widths, constant_values=num_rows)
    n_local = int(np.prod(ids.shape)) // devices
    cap = n_local if route.capacity is None else int(route.capacity)
    spec = P(*([None] * batch_dim), route.batch_axes)

    def local(shard, ids_):
        flat = _ids.safe_ids(ids_.reshape(-1), num_rows)
        uniq, inv = _coalesce.unique_with_inverse(flat, num_rows)
        dest, slot, ok = _bucket(uniq, rows, shards, cap, route)
        offset = jnp.where(ok, uniq - dest * rows, rows).astype(uniq.dtype)
        want = _exchange(_send(offset, dest, slot, ok, shards, cap, rows), axis)
        got = shard.at[want].get(mode="fill", fill_value=0)  # the owner's gather
        back = _exchange(got, axis)
        mine = back[jnp.where(ok, dest, 0), jnp.where(ok, slot, 0)]
        mine = jnp.where(_coalesce.rows_where(ok, mine.ndim), mine, 0)
        return mine[inv].reshape(*ids_.shape, *row_shape)

    out = _shard_map(local, route.mesh, (P(axis), spec), spec)(table, ids)
    if pad:
        out = jax.lax.slice_in_dim(out, 0, size, axis=batch_dim)
    return out


# --------------------------------------------------------- the optimizer step


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


def _to_owner(g: IndexedSlices, route: Route, rows: int) -> IndexedSlices:
    """Local slices (buffer ids) -> the slices this device owns (its shard's ids).

    Each device sums its gradient rows per row (one coalesce) and sends them
    to their owner in the buffers of the lookup's capacity; replicas of a
    shard on the mesh's other axes all get every replica's rows.
    """
    shards = route.shards
    cap = g.num_slices if route.capacity is None else int(route.capacity)
    c = coalesce(g)
    dest, slot, ok = _bucket(c.indices, rows, shards, cap, route)
    offset = jnp.where(ok, c.indices - dest * rows, rows).astype(c.indices.dtype)
    ids = _exchange(_send(offset, dest, slot, ok, shards, cap, rows), route.axis)
    vals = _exchange(_send(c.values, dest, slot, ok, shards, cap, 0), route.axis)
    if route.others:  # table replicas on the other mesh axes get every replica's rows
        ids, vals = _all_gather_invariant((ids, vals), route.others)
    return IndexedSlices(
        vals.reshape(-1, *g.row_shape), ids.reshape(-1), (rows, *g.row_shape)
    )


def _owned(g: IndexedSlices, route: Route, rows: int) -> IndexedSlices:
    """Masked, inside ``shard_map``: every device's slices, this shard's rows kept."""
    every = _all_gather_invariant((g.values, g.indices), route.batch_axes)
    values, indices = every
    first = jax.lax.axis_index(route.axis).astype(indices.dtype) * rows
    local = indices - first
    mine = (local >= 0) & (local < rows) & (indices < g.dense_shape[0])
    local = jnp.where(mine, local, rows)
    return IndexedSlices(values, local, (rows, *g.row_shape))


def update(
    tx: optax.GradientTransformation,
    grads: Any,
    state: Any,
    params: Any,
    routes: Sequence[Route | None],
    where: str,
    *,
    stochastic_rounding: bool | None = None,
    key: Any = None,
    origins: Sequence[Any] | None = None,
) -> tuple[Any, Any]:
    """``tx.update`` then ``apply_updates``, each sharded leaf on its owners.

    ``origins``: one per leaf of ``params`` (``None``, or where the
    rounding noise reads the leaf's global rows:
    :func:`jaxslices.collection._buffers.noise_origin`).

    ``routes``: one per leaf of ``params`` (in ``jax.tree.leaves`` order), a
    :class:`Route` for a row-sharded table, ``None`` for a replicated leaf.
    Without an all-to-all route the step is the partitioner's (``tx.update``
    and :func:`jaxslices.apply_updates` under ``jax.jit``; any Optax
    transform). Otherwise one ``shard_map``: a sharded leaf's slices reach its
    owners (:func:`_to_owner`, or every device's slices, masked), a
    replicated leaf's slices are gathered from every device (the
    data-parallel exchange), dense gradients stay as they are (replicated),
    and the optimizer runs per device on the rows each owns, the transforms
    that reduce over all rows summing over the shards
    (:func:`jaxslices._spmd.rows_sharded_over`).
    """
    leaves, treedef = jax.tree.flatten(params)
    flat_with_paths = jax.tree_util.tree_flatten_with_path(params)[0]
    routes = list(routes)
    g_leaves = treedef.flatten_up_to(grads)
    if len(routes) != len(leaves):
        raise ValueError(f"{where}: one route per parameter leaf.")
    routed = [r for r in routes if r is not None and r.routing == "all_to_all"]
    _spmd.routed_step_taken(p for p, r in zip(leaves, routes, strict=True) if r)
    rounding = (stochastic_rounding, key)
    statics = list(origins) if origins is not None else [None] * len(leaves)

    def origin(i: int, base: Any = 0) -> Any:
        """Leaf ``i``'s row origin, its local row 0 being global row ``base``."""
        if statics[i] is None:
            return None
        st = jnp.asarray(statics[i])
        return jnp.concatenate([jnp.asarray(base, st.dtype)[None], st])

    if not routed:
        upd, state = tx.update(grads, state, params)
        return updates_.apply_leaves(params, upd, *rounding, origin), state
    route0 = routed[0]
    mesh, axis = route0.mesh, route0.axis
    for r in routes:
        if r is not None and (r.axis != axis or r.mesh.shape != mesh.shape):
            raise ValueError(
                f"{where}: every sharded table must be sharded over one mesh axis; "
                f"got {axis!r} and {r.axis!r}."
            )
    shards, devices = route0.shards, route0.devices
    batch = P(route0.batch_axes)

    p_specs = [P() if r is None else P(axis) for r in routes]
    g_in, g_specs, kinds = [], [], []
    for g, r, p in zip(g_leaves, routes, leaves, strict=True):
        if is_indexed_slices(g):
            if g.dense_shape != tuple(p.shape):
                raise ValueError(
                    f"{where}: a gradient has dense shape {g.dense_shape} but its "
                    f"parameter has shape {tuple(p.shape)}."
                )
            g = _pad_slices(g, devices)
            g_specs.append(jax.tree.unflatten(jax.tree.structure(g), [batch, batch]))
            kinds.append("slices")
        elif r is not None and g is not None and getattr(g, "ndim", 0):
            g_specs.append(P(axis))  # a dense gradient of a sharded table: its rows
            kinds.append("dense")
        else:
            g_specs.append(P())
            kinds.append("dense")
        g_in.append(g)
    p_spec_tree = jax.tree.unflatten(treedef, p_specs)
    s_specs = state_specs(tx, state, p_spec_tree, P())
    num_rows = [p.shape[0] if getattr(p, "ndim", 0) else 0 for p in leaves]

    def local(g_flat, state, p_flat):
        local_grads = []
        for g, r, kind, v in zip(g_flat, routes, kinds, num_rows, strict=True):
            if kind == "slices":
                if r is None:  # a replicated table: every device's rows
                    vals, idx = _all_gather_invariant(
                        (g.values, g.indices), route0.batch_axes
                    )
                    g = IndexedSlices(vals, idx, g.dense_shape)
                elif r.routing == "all_to_all":
                    g = _to_owner(g, r, v // shards)
                else:
                    g = _owned(g, r, v // shards)
            local_grads.append(g)
        grads_ = jax.tree.unflatten(treedef, local_grads)
        params_ = jax.tree.unflatten(treedef, p_flat)
        paths = [jax.tree_util.keystr(k) for k, _ in flat_with_paths]
        by_path = {k: (statics[i], routes[i] is not None) for i, k in enumerate(paths)}
        # global norms sum over shards; state rows round where the apply's do
        with _spmd.rows_sharded_over(axis, shards, by_path):
            updates, new_state = tx.update(grads_, state, params_)
        shard = jax.lax.axis_index(axis)

        def local_origin(i):  # a sharded leaf's local rows start at its shard's
            rows = num_rows[i] // shards if routes[i] is not None else 0
            return origin(i, shard * rows)

        new = updates_.apply_leaves(params_, updates, *rounding, local_origin)
        return jax.tree.leaves(new), new_state

    new_leaves, new_state = _shard_map(
        local, mesh, (g_specs, s_specs, p_specs), (p_specs, s_specs)
    )(g_in, state, leaves)
    return jax.tree.unflatten(treedef, new_leaves), new_state


# ------------------------------------------------------ one table: a plan of one


def _resolve(table: Any, mesh: Any, axis: str, where: str) -> Any:
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
    return mesh


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
    sharding). Ids outside ``[0, rows)`` read zeros and get no gradient. The
    table is a plan of one: the gather is the one a
    :class:`~jaxslices.sharding.ShardingPlan`'s sharded buffers use.

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
    check_routing(routing, "sharded_lookup", capacity)
    if routing == "masked":
        return embedding_lookup(table, ids)
    ids = ids if hasattr(ids, "dtype") else np.asarray(ids)  # no narrowing
    if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.ndim < 1:
        raise TypeError(
            "sharded_lookup: `ids` must be an integer array with a batch dimension, "
            f"got {jnp.dtype(ids.dtype).name}{list(ids.shape)}."
        )
    mesh = _resolve(table, mesh, axis, "sharded_lookup")
    if ids.shape[0] % mesh.size:
        raise ValueError(
            f"sharded_lookup(routing='all_to_all'): the batch's leading dimension "
            f"({ids.shape[0]}) must be divisible by the number of devices "
            f"({mesh.size}): each device routes its own part of the batch."
        )
    route = Route(mesh, axis, "all_to_all", capacity)
    safe = _ids.safe_ids(ids, table.shape[0])  # the ids policy: invalid ids -> V
    return gather(table, safe, route)


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
    stochastic_rounding: bool | None = None,
    key: Any = None,
) -> tuple[Any, Any]:
    """One optimizer step for params whose tables are sharded by rows over ``axis``.

    Returns ``(new_params, new_state)``, i.e. ``tx.update`` then
    :func:`jaxslices.apply_updates`, laid out like the inputs. Call it under
    ``jax.jit`` with the gradients of :func:`jaxslices.value_and_grad`. Every
    parameter whose gradient is an :class:`~jaxslices.IndexedSlices` is a
    table sharded by rows over ``axis`` (:func:`shard_rows`); every other
    parameter is replicated; the state is laid out like its parameters
    (:func:`sharded_init`). The step is a plan's
    (:meth:`~jaxslices.sharding.ShardingPlan.update`), for a plan of one.

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
      stochastic_rounding, key: how bfloat16/float16 tables are written, as
        in :func:`jaxslices.apply_updates` (the same bits as on one device).

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
    where = "sharded_update"
    check_routing(routing, where, capacity)
    rounding = {"stochastic_rounding": stochastic_rounding, "key": key}
    if routing == "masked":
        upd, state = tx.update(grads, state, params)
        return updates_.apply_updates(params, upd, **rounding), state
    leaves, treedef = jax.tree.flatten(params)
    g_leaves = jax.tree.leaves(grads, is_leaf=is_indexed_slices)
    if len(g_leaves) != len(leaves):
        raise ValueError(
            f"{where}: `grads` must have the structure of `params` (one gradient "
            f"per parameter), got {len(g_leaves)} and {len(leaves)} leaves."
        )
    g_leaves = treedef.flatten_up_to(grads)
    tables = [is_indexed_slices(g) for g in g_leaves]
    first = next((p for p, t in zip(leaves, tables, strict=True) if t), None)
    if first is None:
        upd, state = tx.update(grads, state, params)
        return updates_.apply_updates(params, upd, **rounding), state
    mesh = _resolve(first, mesh, axis, where)
    route = Route(mesh, axis, "all_to_all", capacity, f"{where}(routing='all_to_all')")
    for p, t in zip(leaves, tables, strict=True):
        if t:
            _resolve(p, mesh, axis, where)  # rows divide evenly
    routes = [route if t else None for t in tables]
    # A sharded table's rows round where they are in the whole table.
    origins = [np.zeros((2,), np.int32) if t else None for t in tables]
    return update(tx, grads, state, params, routes, where, **rounding, origins=origins)
