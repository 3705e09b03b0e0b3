"""Sharding plans: where each table of an ``EmbeddingCollection`` lives on a mesh.

TorchRec's vocabulary, on JAX's own SPMD (``jax.jit`` over a
``NamedSharding``; no collective is written by hand). With ``n`` devices on
the mesh axis ``axis``:

* ``"data_parallel"``: the table is replicated on every device; each device
  looks up its part of the batch, and the gradient rows (``N x dim``, never
  the table) are gathered before every device applies them.
* ``"table_wise"``: the whole table on one device (a planned one).
* ``"row_wise"``: the table's rows split in ``n`` equal chunks, one per
  device.
* ``"column_wise"``: the table's columns split in ``n`` pieces of
  ``dim / n``, one per device (``dim`` must divide).

How: the plan lays the tables out in buffers
(:mod:`jaxslices.collection._buffers`): data-parallel tables stacked in
replicated buffers as on one device; row-wise and table-wise tables of one
``(dim, dtype)`` in one buffer whose rows are sharded over ``axis``, device
``k`` holding region ``k`` (chunk ``k`` of every row-wise table, then its
table-wise tables); column-wise tables in a buffer of ``dim / n`` wide rows,
piece ``j`` of every row in region ``j``. Lookups are the collection's (one
gather per buffer, pooled as on one device) with each id mapped to its
buffer row; a sharded buffer's gather is routed (:mod:`._routing`, the
engine :func:`jaxslices.sharding.sharded_lookup` uses for one table):

* ``"all_to_all"`` (TorchRec's): each device's ids, deduplicated, go to the
  devices that own their rows in buffers of a static capacity, the owners
  gather, the rows come back and the requester pools them; in
  :meth:`ShardingPlan.update` the gradient rows take the reverse route and
  the optimizer runs where the rows live. A device's work and bytes follow
  its own batch.
* ``"masked"``: the partitioner's gather (every device sees the global
  batch's ids and serves the rows it owns) and its scatters; ``O(ids in the
  global batch x dim)`` per device, no capacity.

The plan chooses per buffer by the cost model (:mod:`._cost`), or takes the
routing given; no step moves a table (``tools/hlo.py`` reads the compiled
collectives in the tests).

:func:`plan_collection` chooses a kind per table from its size, its dim, the
device memory and an estimate of the per-step communication, like TorchRec's
planner; ``overrides`` fixes a table's kind (and, table-wise, its device).
A :class:`ShardingPlan` turns one device's params into the plan's
(:meth:`ShardingPlan.shard`) and back (:meth:`ShardingPlan.unshard`), looks
up like the collection (:meth:`ShardingPlan.__call__`, :meth:`concat`),
trains (:meth:`ShardingPlan.update`) and gives the per-table transforms for
its layout. Every plan trains to one device's numbers
(``tests/scale/test_plans.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import capacity as _capacity
from ..collection import EmbeddingCollection, TableConfig, _buffers, _pooling
from ..keyed import KeyedJaggedIds
from ..transforms import _per_table
from . import _cost, _routing

__all__ = ["KINDS", "ShardingPlan", "TablePlan", "kind_and_device"]

Kind = Literal["data_parallel", "table_wise", "row_wise", "column_wise"]
KINDS: tuple[str, ...] = ("data_parallel", "table_wise", "row_wise", "column_wise")


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """One table's placement and what it costs.

    Attributes:
      table: the table's name.
      kind: one of :data:`KINDS`.
      device: ``"table_wise"``: the position on the mesh axis of the device
        holding it; else ``None``.
      memory_bytes: the table's bytes on the device that holds most of it
        (with optimizer state, ``state_bytes_per_row`` per row).
      comm_bytes: estimated bytes per device per step (forward and backward),
        from the ids the table sees per step (:mod:`jaxslices.sharding._cost`).
      routing: the routing of the table's buffer (``"masked"`` or
        ``"all_to_all"``); ``None`` for a data-parallel table.
      capacity: ``"all_to_all"``: the buffer's slots per destination
        (``None``: never overflows).
    """

    table: str
    kind: str
    device: int | None
    memory_bytes: int
    comm_bytes: int
    routing: str | None = None
    capacity: int | None = None


class ShardingPlan:
    """A placement of every table of a collection over one mesh axis.

    Build one with :func:`plan_collection` (or directly, from ``{table:
    kind}`` or ``{table: ("table_wise", device)}``).

    The tables live in buffers (:attr:`buffers`): data-parallel tables
    stacked in replicated buffers; row-wise and table-wise tables of one
    ``(dim, dtype)`` in one buffer whose rows are split over ``axis`` (device
    ``k`` holding chunk ``k`` of every row-wise table and its own table-wise
    ones); column-wise tables as ``dim / n`` wide pieces, piece ``j`` on
    device ``j``. Each sharded buffer is reached by a routing
    (:attr:`routing`, :mod:`jaxslices.sharding._routing`): ``"all_to_all"``,
    TorchRec's (each device's own ids, deduplicated, to their owners and the
    rows back; a static capacity per destination, :attr:`capacity`), or
    ``"masked"`` (the partitioner's gather, every device seeing the global
    batch). Train with :meth:`update`, which sends the gradients the reverse
    way and runs the optimizer where the rows live.

    Args:
      collection: the :class:`jaxslices.EmbeddingCollection`.
      mesh: a ``jax.sharding.Mesh``.
      axis: the mesh axis to place over (the batch is split over the whole
        mesh).
      kinds: ``{table: kind}``; a table-wise table may give its device,
        ``("table_wise", k)`` (default: round robin).
      routing: ``"masked"`` or ``"all_to_all"`` for every sharded buffer, a
        dict ``{buffer or table name: routing}`` (a table stands for its
        buffer), or ``None``: each buffer's cheaper one by the cost model
        (:mod:`jaxslices.sharding._cost`), given its capacity.
      capacity: the all-to-all capacity, an int for every sharded buffer or
        a dict like ``routing``'s; a buffer without one is estimated from
        ``samples`` (:meth:`estimate_capacity`), or is ``None`` (never
        overflows, as many bytes as masked).
      samples: sample batches, as the step receives them (padded dicts of
        ``[B, L]`` ids, or ``KeyedJaggedIds``), to estimate capacities from.
      padding_id: the padded samples' padding id (it counts as no row).
      ids_per_step: ``{table: ids in the global batch}`` for the estimates
        (default: 1 per example of ``batch_size`` per feature).
      batch_size: the global batch, for the default ``ids_per_step``.
      state_bytes_per_row: optimizer state per table row, for the memory
        estimates (row-wise Adagrad: 4).

    Example:
      >>> import jax, numpy as np, jaxslices as js
      >>> coll = js.EmbeddingCollection(
      ...     [js.TableConfig("a", 8, 4), js.TableConfig("b", 12, 4)])
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
      >>> kinds = {"a": "data_parallel", "b": "row_wise"}
      >>> p = js.sharding.ShardingPlan(coll, mesh, "model", kinds)
      >>> {k: v.shape for k, v in p.shard(coll.init(jax.random.key(0))).items()}
      {'dim4_float32': (8, 4), 'dim4_float32_sharded': (12, 4)}
      >>> p.routing  # one device: nothing to route
      {'dim4_float32_sharded': 'masked'}
    """

    def __init__(
        self,
        collection: EmbeddingCollection,
        mesh: Any,
        axis: str,
        kinds: Mapping[str, Any],
        *,
        routing: Any = None,
        capacity: Any = None,
        samples: Any = None,
        padding_id: int | None = None,
        ids_per_step: Mapping[str, int] | None = None,
        batch_size: int = 1,
        state_bytes_per_row: float = 4.0,
    ):
        where = "ShardingPlan"
        if not isinstance(collection, EmbeddingCollection):
            raise TypeError(
                f"{where}: `collection` must be a jaxslices.EmbeddingCollection, "
                f"got {type(collection).__name__}."
            )
        if axis not in mesh.axis_names:
            raise ValueError(
                f"{where}: `axis` must name an axis of the mesh {dict(mesh.shape)}, "
                f"got {axis!r}."
            )
        self.collection, self.mesh, self.axis = collection, mesh, axis
        n = int(mesh.shape[axis])
        self.devices = n
        names = [t.name for t in collection.tables]
        missing = [t for t in names if t not in kinds]
        unknown = [t for t in kinds if t not in names]
        if missing or unknown:
            raise ValueError(
                f"{where}: give a kind for every table; missing {missing}, unknown "
                f"{unknown} (tables: {names})."
            )
        ids = dict(ids_per_step or {})
        for t in collection.tables:
            ids.setdefault(t.name, batch_size * len(t.features))
        placed: dict[str, tuple[str, int | None]] = {}
        robin = 0
        for t in collection.tables:
            kind, device = kind_and_device(kinds[t.name], t, n, where)
            if kind == "table_wise" and device is None:
                device, robin = robin % n, robin + 1
            placed[t.name] = (kind, device)
        self.layout = _plan_layout(collection, placed, n)
        self.buffers = self.layout.buffers
        sharded = [b for b in self.buffers if b.sharded]
        # rows each sharded buffer reads per step (a column piece is a row)
        reads = {b.name: sum(ids[t] for t in b.tables) * b.pieces for b in sharded}
        caps = self._per_buffer(capacity, "capacity", where)
        for c in caps.values():
            _routing.check_routing("all_to_all", where, c)
        if samples is not None:
            todo = [b.name for b in sharded if caps.get(b.name) is None]
            caps.update(
                self.estimate_capacity(samples, padding_id=padding_id, buffers=todo)
            )
        given = self._per_buffer(routing, "routing", where)
        self.capacity: dict[str, int | None] = {}
        self.routing: dict[str, str] = {}
        for b in sharded:
            c = caps.get(b.name)
            r = given.get(b.name)
            if r is None:
                row = b.dim * int(np.dtype(b.dtype).itemsize)
                r = min(
                    _routing.ROUTINGS,
                    key=lambda k: (
                        _cost.routing_cost(reads[b.name], n, row, k, c),
                        k != "masked",
                    ),
                )
            _routing.check_routing(r, where, c)
            self.routing[b.name], self.capacity[b.name] = r, c
        self._routes = {
            b.name: _routing.Route(
                mesh,
                axis,
                self.routing[b.name],
                self.capacity[b.name],
                f"ShardingPlan buffer {b.name!r} (routing='all_to_all')",
                fix=(
                    "Give the plan capacity={{"
                    + repr(b.name)
                    + ": {needed}}} or more (ShardingPlan.estimate_capacity "
                    "sizes it from sample batches)"
                ),
            )
            for b in sharded
        }
        buffer_of = {t: b for b in self.buffers for t in b.tables}
        tables = {}
        for t in collection.tables:
            kind, device = placed[t.name]
            b = buffer_of[t.name]
            r, c = self.routing.get(b.name), self.capacity.get(b.name)
            comm = _cost.comm_bytes(
                t, kind, ids[t.name], n, r or "masked", c, reads.get(b.name)
            )
            memory = _cost.memory_bytes(t, kind, n, state_bytes_per_row)
            tables[t.name] = TablePlan(t.name, kind, device, memory, comm, r, c)
        self.tables = tables

    def _per_buffer(self, given: Any, what: str, where: str) -> dict[str, Any]:
        """``{sharded buffer: value}`` from one value, or a dict by buffer or table."""
        sharded = {b.name: b for b in self.buffers if b.sharded}
        if given is None:
            return {}
        if not isinstance(given, Mapping):
            return dict.fromkeys(sharded, given)
        buffer_of = {t: b.name for b in self.buffers for t in b.tables}
        out: dict[str, Any] = {}
        for key, value in given.items():
            name = key if key in sharded else buffer_of.get(key)
            if name not in sharded:
                raise ValueError(
                    f"{where}: `{what}` names {key!r}, which is no sharded buffer "
                    f"({list(sharded)}) nor a table of one."
                )
            if name in out and out[name] != value:
                raise ValueError(
                    f"{where}: `{what}` gives buffer {name!r} two values, "
                    f"{out[name]!r} and {value!r} (its tables share it)."
                )
            out[name] = value
        return out

    # -- what the plan is -----------------------------------------------------
    def __repr__(self) -> str:
        kinds = {k: sum(p.kind == k for p in self.tables.values()) for k in KINDS}
        kinds = ", ".join(f"{v} {k}" for k, v in kinds.items() if v)
        routed = sorted(set(self.routing.values()))
        how = f", routed {'/'.join(routed)}" if routed else ""
        return (
            f"ShardingPlan({kinds} over {self.devices} devices of {self.axis!r}{how})"
        )

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """``{buffer name: (rows, dim)}`` of the plan's params."""
        return {b.name: b.shape for b in self.buffers}

    def shardings(self) -> dict[str, NamedSharding]:
        """``{buffer name: NamedSharding}``: replicated, or rows over ``axis``."""
        return {
            b.name: NamedSharding(self.mesh, P(self.axis) if b.sharded else P())
            for b in self.buffers
        }

    def memory_per_device(self) -> list[int]:
        """Bytes of table (and estimated state) on each device of the axis.

        Example:
          >>> import jax, numpy as np, jaxslices as js
          >>> coll = js.EmbeddingCollection(
          ...     [js.TableConfig("a", 8, 4), js.TableConfig("b", 12, 4)])
          >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
          >>> kinds = {"a": "data_parallel", "b": "row_wise"}
          >>> plan = js.sharding.ShardingPlan(coll, mesh, "model", kinds)
          >>> plan.memory_per_device()  # (8 + 12) rows x (16 + 4 state) bytes
          [400]
        """
        out = [0] * self.devices
        for p in self.tables.values():
            if p.kind == "table_wise":
                out[p.device] += p.memory_bytes
            else:
                out = [m + p.memory_bytes for m in out]
        return out

    # -- params ---------------------------------------------------------------
    def shard(self, params: Mapping[str, Any]) -> dict[str, jax.Array]:
        """The plan's params from one device's (``collection.init`` layout).

        Built on the host and placed with :meth:`shardings` (every process
        of a multi-host mesh passes the same values and keeps its devices'
        rows).
        """
        self.collection._check_params(params, "ShardingPlan.shard")
        tables = {k: np.asarray(v) for k, v in self.collection.unstack(params).items()}
        host = self._assemble(tables)
        out = {}
        for name, sharding in self.shardings().items():
            x = host[name]
            out[name] = jax.make_array_from_callback(
                x.shape, sharding, lambda idx, x=x: x[idx]
            )
        return out

    def _assemble(self, tables: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for b in self.buffers:
            buf = np.zeros(b.shape, np.dtype(b.dtype))
            for name in b.tables:
                where = self.layout.placement(name)
                x = tables[name]
                rows = np.arange(x.shape[0])
                for j in range(b.pieces):
                    buf[where.rows_of(rows, j)] = x[:, j * b.dim : (j + 1) * b.dim]
            out[b.name] = buf
        return out

    def unshard(self, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """One device's params (``collection.init`` layout) from the plan's.

        ``params`` must be readable on this host (a multi-host caller first
        gathers them, e.g. ``multihost_utils.process_allgather``).

        Example:
          >>> import jax, numpy as np, jaxslices as js
          >>> coll = js.EmbeddingCollection(
          ...     [js.TableConfig("a", 8, 4), js.TableConfig("b", 12, 4)])
          >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
          >>> kinds = {"a": "table_wise", "b": "row_wise"}
          >>> plan = js.sharding.ShardingPlan(coll, mesh, "model", kinds)
          >>> params = coll.init(jax.random.key(0))
          >>> back = plan.unshard(plan.shard(params))  # a round trip
          >>> bool(np.array_equal(back["dim4_float32"], params["dim4_float32"]))
          True
        """
        host = {k: np.asarray(jax.device_get(v)) for k, v in params.items()}
        tables = {}
        for b in self.buffers:
            for name in b.tables:
                where = self.layout.placement(name)
                rows = np.arange(self.collection.table_config(name).rows)
                tables[name] = np.concatenate(
                    [host[b.name][where.rows_of(rows, j)] for j in range(b.pieces)],
                    axis=1,
                )
        return {k: np.asarray(v) for k, v in self.collection.stack(tables).items()}

    # -- lookups --------------------------------------------------------------
    def __call__(
        self,
        params: Mapping[str, Any],
        features: Any,
        *,
        padding_id: int | None = None,
        weights: Mapping[str, Any] | None = None,
        check_ids: bool = False,
    ) -> dict[str, jax.Array]:
        """As :meth:`jaxslices.EmbeddingCollection.__call__`, on the plan's params."""
        out = self._lookup(params, features, padding_id, weights, check_ids, False)
        return {f: out[f] for f in self.collection.features}

    def concat(
        self,
        params: Mapping[str, Any],
        features: Any,
        *,
        padding_id: int | None = None,
        weights: Mapping[str, Any] | None = None,
        check_ids: bool = False,
    ) -> jax.Array:
        """As :meth:`jaxslices.EmbeddingCollection.concat`, on the plan's params."""
        self.collection._refuse_sequences("ShardingPlan.concat")
        cols = self._lookup(params, features, padding_id, weights, check_ids, True)
        return jnp.concatenate([cols[f] for f in self.collection.features], axis=1)

    def _lookup(self, params, features, padding_id, weights, check_ids, batch_major):
        for b in self.buffers:
            x = params.get(b.name) if isinstance(params, Mapping) else None
            if x is None or tuple(x.shape) != b.shape:
                raise ValueError(
                    f"ShardingPlan: buffer {b.name!r} must have shape {b.shape}, got "
                    f"{None if x is None else tuple(x.shape)}. Pass the params "
                    "`ShardingPlan.shard` made."
                )
        pooled, seqs = _pooling.lookup(
            self.collection,
            self.layout,
            params,
            features,
            padding_id=padding_id,
            weights=weights,
            check_ids=check_ids,
            batch_major=batch_major,
            gathers=self._gathers(),
        )
        return {**seqs, **_pooling.per_feature(pooled, batch_major)}

    def _gathers(self) -> dict[str, Any]:
        """The routed gathers of the buffers routed all-to-all."""
        return {
            name: functools.partial(_gather, route=route)
            for name, route in self._routes.items()
            if route.routing == "all_to_all"
        }

    # -- training ---------------------------------------------------------------
    def update(
        self,
        tx: optax.GradientTransformation,
        grads: Any,
        state: Any,
        params: Any,
    ) -> tuple[Any, Any]:
        """One optimizer step: ``tx.update`` then ``apply_updates``, on the owners.

        Call it under ``jax.jit`` with the gradients of
        :func:`jaxslices.value_and_grad` of a loss that reads the plan's params
        through the plan (``params`` may hold them anywhere, under their
        buffer names, e.g. ``{"emb": plan_params, "w": ...}``; other leaves
        are replicated). With every buffer routed ``"masked"`` it is
        ``tx.update`` + :func:`jaxslices.apply_updates` under the partitioner
        (any Optax transform). With an ``"all_to_all"`` buffer it runs in
        ``shard_map``: each device sums its gradient rows of such a buffer
        per row and sends them to their owners (the lookup's route,
        reversed), a masked buffer's owners take their rows of every
        device's, a replicated buffer gets every device's rows, and the
        optimizer runs on each device on the rows it owns (every jaxslices
        transform; :func:`jaxslices.clip_by_global_norm` and
        :func:`jaxslices.apply_if_finite` sum over the shards; the native
        kernels run per device). The state is laid out like the params
        (:func:`jaxslices.sharding.sharded_init`).

        Returns:
          ``(new_params, new_state)``.
        """
        by_name = {b.name: b for b in self.buffers}
        found = jax.tree_util.tree_flatten_with_path(params)[0]
        routes = []
        for path, leaf in found:
            names = [_key_name(e) for e in path]
            name = next(
                (k for k in reversed(names) if isinstance(k, str) and k in by_name),
                None,
            )
            b = by_name.get(name)
            shape = tuple(getattr(leaf, "shape", ()))
            routes.append(
                self._routes.get(b.name) if b is not None and shape == b.shape else None
            )
        return _routing.update(tx, grads, state, params, routes, "ShardingPlan.update")

    def estimate_capacity(
        self,
        samples: Any,
        *,
        padding_id: int | None = None,
        margin: float = 1.25,
        multiple: int = 8,
        buffers: Any = None,
    ) -> dict[str, int]:
        """All-to-all capacities of the sharded buffers from sample batches.

        Replays the routing on host, as the step splits the batch: padded
        ids ``{feature: [B, L]}`` by examples over the mesh's devices, a
        ``KeyedJaggedIds``'s slots in equal parts; each device's ids become
        buffer rows, are deduplicated and counted per owner
        (:func:`jaxslices.capacity.estimate_all_to_all_capacity`, with
        ``margin`` and ``multiple``).

        Args:
          samples: sample batches (padded dicts or ``KeyedJaggedIds``).
          padding_id: the padded ids' padding id.
          margin: the factor on the largest count seen.
          multiple: round up to a multiple of this.
          buffers: the buffers to estimate (default: every sharded one).

        Returns:
          ``{buffer name: capacity}``, to pass as ``capacity``.
        """
        names = [b.name for b in self.buffers if b.sharded]
        names = names if buffers is None else [n for n in names if n in buffers]
        per = {name: [] for name in names}
        for sample in samples:
            rows = _host_rows(self, sample, padding_id, self.mesh.size)
            for name in names:
                per[name].append(rows[name])
        return {
            name: _capacity.estimate_all_to_all_capacity(
                per[name],
                num_rows=self.layout.buffer(name).rows,
                num_shards=self.devices,
                num_devices=self.mesh.size,
                margin=margin,
                multiple=multiple,
            )
            for name in names
        }

    # -- per-table hyperparameters -------------------------------------------
    def scale_by_table(self, factors: Mapping[str, Any], *, default: Any = 1.0):
        """:func:`jaxslices.transforms.scale_by_table` for the plan's buffers."""
        return _per_table.scale_by_table(_PlanView(self), factors, default=default)

    def add_decayed_weights_by_table(
        self, rates: Mapping[str, Any], *, default: Any = 0.0
    ):
        """:func:`jaxslices.transforms.add_decayed_weights_by_table`, plan layout."""
        return _per_table.add_decayed_weights_by_table(
            _PlanView(self), rates, default=default
        )


def _gather(table, gids, batch_dim, *, route):
    return _routing.gather(table, gids, route, batch_dim)


def _key_name(entry: Any) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return None


def _host_rows(
    plan: ShardingPlan, sample: Any, padding_id: int | None, devices: int
) -> dict[str, np.ndarray]:
    """Per sharded buffer, a sample's buffer rows as the step splits them.

    Padded ids: ``[B, ids of the buffer's features per example]`` (the
    batch splits by examples); a ``KeyedJaggedIds``: ``[slots, pieces]``,
    padded to a multiple of ``devices`` (its slots split in equal parts).
    ``-1`` where a slot reads no row (padding, out of its table's range,
    another buffer's feature).
    """
    coll = plan.collection
    sharded = [b for b in plan.buffers if b.sharded]
    out = {}
    if isinstance(sample, KeyedJaggedIds):
        values = np.asarray(sample.values).astype(np.int64)
        offsets = np.asarray(sample.offsets)
        n, batch = values.shape[0], max(sample.batch_size, 1)
        slot = np.arange(n)
        bag = np.searchsorted(offsets, slot, side="right") - 1
        key = np.where(slot < offsets[-1], bag // batch, -1)
        for b in sharded:
            rows = np.full((n + (-n % devices), b.pieces), -1, np.int64)
            for i, k in enumerate(sample.keys):
                if k not in coll.features or coll.table_of(k) not in b.tables:
                    continue
                t = coll.table_config(coll.table_of(k))
                sel = (key == i) & (values >= 0) & (values < t.rows)
                where = plan.layout.placement(t.name)
                for j in range(b.pieces):
                    rows[np.flatnonzero(sel), j] = where.rows_of(values[sel], j)
            out[b.name] = rows
        return out
    if not isinstance(sample, Mapping):
        raise TypeError(
            "ShardingPlan.estimate_capacity: a sample is a dict {feature: [B, L] "
            f"ids}} or a KeyedJaggedIds, got {type(sample).__name__}."
        )
    for b in sharded:
        parts = []
        for f in coll.features:
            t = coll.table_config(coll.table_of(f))
            if t.name not in b.tables:
                continue
            ids = np.asarray(sample[f]).astype(np.int64)
            ids = ids.reshape(ids.shape[0], -1)
            ok = (ids >= 0) & (ids < t.rows)
            if padding_id is not None:
                ok &= ids != padding_id
            where = plan.layout.placement(t.name)
            r = np.full((*ids.shape, b.pieces), -1, np.int64)
            for j in range(b.pieces):
                r[ok, j] = where.rows_of(ids[ok], j)
            parts.append(r.reshape(ids.shape[0], -1))
        out[b.name] = np.concatenate(parts, axis=1)
    return out


class _PlanView:
    """What the per-table transforms read: tables, buffers, shapes."""

    def __init__(self, p: ShardingPlan):
        self.tables, self.buffers, self.shapes = (
            p.collection.tables,
            p.buffers,
            p.shapes,
        )


def kind_and_device(given: Any, t: TableConfig, n: int, where: str):
    device = None
    if isinstance(given, tuple):
        if len(given) != 2 or given[0] != "table_wise":
            raise ValueError(
                f"{where}: table {t.name!r}: a (kind, device) pair is for "
                f"table-wise tables, got {given!r}."
            )
        given, device = given
        if not isinstance(device, int | np.integer) or not 0 <= device < n:
            raise ValueError(
                f"{where}: table {t.name!r}: device {device!r} is not in [0, {n})."
            )
    if given not in KINDS:
        raise ValueError(
            f"{where}: table {t.name!r}: kind must be one of {KINDS}, got {given!r}."
        )
    if given == "column_wise" and t.dim % n:
        raise ValueError(
            f"{where}: table {t.name!r}: column-wise over {n} devices needs a dim "
            f"divisible by {n}, got dim {t.dim}. Use row_wise or table_wise."
        )
    if given == "column_wise" and t.combiner is None:
        raise ValueError(
            f"{where}: table {t.name!r} is a sequence table; place it data-parallel, "
            "table-wise or row-wise."
        )
    return given, (None if device is None else int(device))


def _plan_layout(coll: EmbeddingCollection, placed: dict, n: int) -> _buffers.Layout:
    """Buffers and placements for ``{table: (kind, device)}`` over ``n`` devices."""
    groups: dict[tuple, list[TableConfig]] = {}
    for t in coll.tables:
        kind = placed[t.name][0]
        cls = {"data_parallel": "rep", "table_wise": "sh", "row_wise": "sh"}.get(
            kind, "col"
        )
        groups.setdefault((cls, t.dim, t.dtype), []).append(t)
    buffers, placements = [], []
    for (cls, dim, dtype), ts in groups.items():
        base = f"dim{dim}_{dtype.name}"
        if cls == "rep":
            start, segments = 0, []
            for t in ts:
                segments.append((start, t.rows, t.name))
                placements.append((t.name, _buffers.Placement(base, start, t.rows)))
                start += t.rows
            buffers.append(_buffers.Buffer(base, dim, dtype, start, tuple(segments)))
        elif cls == "sh":
            name = f"{base}_sharded"
            rw = [t for t in ts if placed[t.name][0] == "row_wise"]
            tw = [t for t in ts if placed[t.name][0] == "table_wise"]
            chunk = {t.name: -(-t.rows // n) for t in rw}
            offset, o = {}, 0
            for t in rw:
                offset[t.name], o = o, o + chunk[t.name]
            fill = [o] * n  # table-wise tables after the row-wise chunks
            for t in tw:
                k = placed[t.name][1]
                offset[t.name], fill[k] = fill[k], fill[k] + t.rows
            region = max(max(fill), 1)
            segments = []
            for k in range(n):
                here = [(offset[t.name], chunk[t.name], t) for t in rw]
                here += [
                    (offset[t.name], t.rows, t) for t in tw if placed[t.name][1] == k
                ]
                for o, length, t in here:
                    if t.name in chunk:  # the last chunks of a table may be short
                        length = max(0, min(length, t.rows - k * chunk[t.name]))
                    segments.append((k * region + o, length, t.name))
            for t in rw:
                placements.append(
                    (
                        t.name,
                        _buffers.Placement(name, offset[t.name], chunk[t.name], region),
                    )
                )
            for t in tw:
                b0 = placed[t.name][1] * region + offset[t.name]
                placements.append(
                    (t.name, _buffers.Placement(name, b0, t.rows, region))
                )
            buffers.append(
                _buffers.Buffer(
                    name,
                    dim,
                    dtype,
                    n * region,
                    _cover(segments, n * region),
                    sharded=True,
                )
            )
        else:  # column-wise: pieces of dim // n, piece j in region j
            d = dim // n
            name = f"dim{d}x{n}_{dtype.name}_columns"
            offset, o = {}, 0
            for t in ts:
                offset[t.name], o = o, o + t.rows
            region = max(o, 1)
            segments = [
                (j * region + offset[t.name], t.rows, t.name)
                for j in range(n)
                for t in ts
            ]
            for t in ts:
                placements.append(
                    (t.name, _buffers.Placement(name, offset[t.name], t.rows, region))
                )
            buffers.append(
                _buffers.Buffer(
                    name, d, dtype, n * region, _cover(segments, n * region),
                    pieces=n, sharded=True,
                )
            )  # fmt: skip
    return _buffers.Layout(tuple(buffers), tuple(placements))


def _cover(segments: list, rows: int) -> tuple:
    """Sorted segments with the gaps between them as unused (``None``) ones."""
    out, at = [], 0
    for start, length, t in sorted(s for s in segments if s[1] > 0):
        if start > at:
            out.append((at, start - at, None))
        out.append((start, length, t))
        at = start + length
    if at < rows:
        out.append((at, rows - at, None))
    return tuple(out)
