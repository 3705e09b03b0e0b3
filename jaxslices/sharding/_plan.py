"""Sharding plans: where each table of an ``EmbeddingCollection`` lives on a mesh.

TorchRec's vocabulary, on JAX's own SPMD (``jax.jit`` over a
``NamedSharding``; no collective is written by hand). A
:class:`ShardingPlan` is data (the kinds, the layout, a routing per sharded
buffer, what each table costs) plus a thin step; each job has its module:

* the kinds and the buffers they make (:mod:`._layout`): data-parallel
  tables stacked in replicated buffers; row-wise and table-wise tables of
  one ``(dim, dtype)`` in one buffer whose rows are split over the axis;
  column-wise tables as ``dim / n`` wide pieces;
* the lookups: the collection's own (:class:`~jaxslices.collection._face.
  CollectionFace`, one gather per buffer, pooled as on one device), with a
  sharded buffer's gather routed (:mod:`._routing`);
* the routing of each sharded buffer (:mod:`._cost`): ``"all_to_all"``
  (TorchRec's: each device's ids, deduplicated, to the devices that own
  their rows, in buffers of a static capacity; a device's work and bytes
  follow its own batch) or ``"masked"`` (the partitioner's gather: every
  device sees the global batch's ids), given or the cheaper by the cost
  model, from the ids per step and the capacity that sample batches give
  (:mod:`._replay`, the host replay of the step's routing);
* the step (:meth:`ShardingPlan.update`): the gradients take the lookup's
  route back and the optimizer runs where the rows live
  (:func:`jaxslices.sharding._routing.update`).

:func:`~jaxslices.sharding.plan_collection` (:mod:`._planner`) chooses the
kinds. Every plan trains to one device's numbers
(``tests/scale/test_plans.py``); no step moves a table (``tools/hlo.py``
reads the compiled collectives in the tests).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _leaves
from ..collection import EmbeddingCollection
from ..collection._buffers import noise_origin
from ..collection._face import CollectionFace
from . import _cost, _layout, _replay, _routing
from ._layout import KINDS, kind_and_device
from ._placement import check_axis

__all__ = ["KINDS", "ShardingPlan", "TablePlan", "kind_and_device"]


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


class ShardingPlan(CollectionFace):
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

    By default each sharded buffer gets the routing the cost model finds
    cheaper for the ids it reads per step: ``ids_per_step`` if given, else
    counted in ``samples`` (which also size the all-to-all capacities),
    else ``batch_size`` per feature. With samples of a batch that is not
    tiny the all-to-all wins, and a device's work follows its own batch;
    without samples or a capacity the all-to-all would send a device's whole
    batch to every owner, so masked routing wins. :meth:`explain` says what
    was chosen and why; the ``repr`` says when no samples or capacity were
    given.

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
        ``[B, L]`` ids, or ``KeyedJaggedIds``): the capacities are estimated
        from them, and the ids per step counted in them.
      padding_id: the padded samples' padding id (it counts as no row).
      ids_per_step: ``{table: ids in the global batch}`` for the estimates
        (default: counted in ``samples``, else 1 per example of
        ``batch_size`` per feature).
      batch_size: the global batch, for the default ``ids_per_step`` without
        samples (``None``: 1).
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

    _WHERE = "ShardingPlan"
    _PARAMS_FROM = "`ShardingPlan.shard`"

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
        batch_size: int | None = None,
        state_bytes_per_row: float = 4.0,
    ):
        where = "ShardingPlan"
        if not isinstance(collection, EmbeddingCollection):
            raise TypeError(
                f"{where}: `collection` must be a jaxslices.EmbeddingCollection, "
                f"got {type(collection).__name__}."
            )
        n = self.devices = check_axis(mesh, axis, where)
        self.collection, self.mesh, self.axis = collection, mesh, axis
        names = [t.name for t in collection.tables]
        missing = [t for t in names if t not in kinds]
        unknown = [t for t in kinds if t not in names]
        if missing or unknown:
            raise ValueError(
                f"{where}: give a kind for every table; missing {missing}, unknown "
                f"{unknown} (tables: {names})."
            )
        samples = None if samples is None else list(samples)
        placed: dict[str, tuple[str, int | None]] = {}
        robin = 0
        for t in collection.tables:
            kind, device = kind_and_device(kinds[t.name], t, n, where)
            if kind == "table_wise" and device is None:
                device, robin = robin % n, robin + 1
            placed[t.name] = (kind, device)
        self.layout = _layout.plan_layout(collection.tables, placed, n)
        self.buffers = self.layout.buffers
        sharded = [b for b in self.buffers if b.sharded]
        ids, ids_from = self._ids_per_step(ids_per_step, samples, batch_size)
        caps = self._per_buffer(capacity, "capacity", where)
        for c in caps.values():
            _routing.check_routing("all_to_all", where, c)
        if samples is not None:
            todo = [b.name for b in sharded if caps.get(b.name) is None]
            caps.update(
                self.estimate_capacity(samples, padding_id=padding_id, buffers=todo)
            )
        given = self._per_buffer(routing, "routing", where)
        for r in given.values():
            _routing.check_routing(r, where)
        #: ``{sharded buffer: RoutingChoice}``: its routing, capacity and why.
        self.choices: dict[str, _cost.RoutingChoice] = {}
        for b in sharded:
            reads = sum(ids[t] for t in b.tables) * b.pieces  # a piece is a row
            row = b.dim * int(np.dtype(b.dtype).itemsize)
            c = caps.get(b.name)
            choice = _cost.choose_routing(reads, n, row, c, given.get(b.name), ids_from)
            _routing.check_routing(choice.routing, where, c)
            self.choices[b.name] = choice
        self.routing = {k: c.routing for k, c in self.choices.items()}
        self.capacity = {k: c.capacity for k, c in self.choices.items()}
        self._routes = {name: self._route(name) for name in self.choices}
        buffer_of = {t: b.name for b in self.buffers for t in b.tables}
        self.tables = {}
        for t in collection.tables:
            kind, device = placed[t.name]
            choice = self.choices.get(buffer_of[t.name])
            self.tables[t.name] = TablePlan(
                t.name, kind, device,
                _cost.memory_bytes(t, kind, n, state_bytes_per_row),
                _cost.comm_bytes(t, kind, ids[t.name], n, choice),
                None if choice is None else choice.routing,
                None if choice is None else choice.capacity,
            )  # fmt: skip

    def _ids_per_step(self, given, samples, batch_size) -> tuple[dict[str, int], str]:
        """``({table: ids per step}, where they came from)``: given, else counted
        in the samples, else ``batch_size`` per feature."""
        coll = self.collection
        counted = {} if samples is None else _replay.ids_per_table(coll, samples)
        ids = {**counted, **dict(given or {})}
        for t in coll.tables:
            ids.setdefault(t.name, (batch_size or 1) * len(t.features))
        if given:
            return ids, "ids_per_step given"
        if samples is not None:
            k = len(samples)
            return ids, f"counted in the samples ({k} batch{'es' if k != 1 else ''})"
        if batch_size is not None:
            return ids, f"batch_size={batch_size}, one id per example and feature"
        return ids, (
            "no samples, ids_per_step or batch_size: 1 id per feature, the default"
        )

    def _route(self, name: str) -> _routing.Route:
        return _routing.Route(
            self.mesh,
            self.axis,
            self.routing[name],
            self.capacity[name],
            f"ShardingPlan buffer {name!r} (routing='all_to_all')",
            fix=(
                "Give the plan capacity={{"
                + repr(name)
                + ": {needed}}} or more (ShardingPlan.estimate_capacity "
                "sizes it from sample batches)"
            ),
            step="ShardingPlan.update",
        )

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
        if self.devices > 1 and any(
            c.capacity is None and not c.given for c in self.choices.values()
        ):
            how += " (no samples or capacity to size an all-to-all: see explain())"
        return (
            f"ShardingPlan({kinds} over {self.devices} devices of {self.axis!r}{how})"
        )

    def explain(self) -> str:
        """What the plan chose for each table and sharded buffer, and why.

        Example:
          >>> import jax, numpy as np, jaxslices as js
          >>> coll = js.EmbeddingCollection([js.TableConfig("t", 64, 4)])
          >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
          >>> plan = js.sharding.ShardingPlan(coll, mesh, "model", {"t": "row_wise"})
          >>> print(plan.explain().splitlines()[1])
            table 't': row_wise, in buffer 'dim4_float32_sharded'
        """
        lines = [repr(self)]
        buffer_of = {t: b.name for b in self.buffers for t in b.tables}
        for p in self.tables.values():
            at = "" if p.device is None else f" on device {p.device}"
            lines.append(
                f"  table {p.table!r}: {p.kind}{at}, in buffer {buffer_of[p.table]!r}"
            )
        for name, c in self.choices.items():
            cap = "" if c.capacity is None else f", capacity {c.capacity}"
            lines.append(f"  buffer {name!r}: {c.routing}{cap}: {c.why}")
        return "\n".join(lines)

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
          >>> coll = js.EmbeddingCollection([js.TableConfig("t", 20, 4)])
          >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
          >>> plan = js.sharding.ShardingPlan(coll, mesh, "model", {"t": "row_wise"})
          >>> plan.memory_per_device()  # 20 rows x (16 + 4 state) bytes
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
        host = _layout.assemble(self.layout, tables)
        out = {}
        for name, sharding in self.shardings().items():
            x = host[name]
            out[name] = jax.make_array_from_callback(
                x.shape, sharding, lambda idx, x=x: x[idx]
            )
        return out

    def unshard(self, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """One device's params (``collection.init`` layout) from the plan's.

        ``params`` must be readable on this host (a multi-host caller first
        gathers them, e.g. ``multihost_utils.process_allgather``).

        Example:
          >>> import jax, numpy as np, jaxslices as js
          >>> coll = js.EmbeddingCollection([js.TableConfig("a", 8, 4),
          ...     js.TableConfig("b", 12, 4), js.TableConfig("c", 4, 2)])
          >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
          >>> plan = js.sharding.ShardingPlan(coll, mesh, "model",
          ...     {"a": "table_wise", "b": "row_wise", "c": "column_wise"})
          >>> params = coll.init(jax.random.key(0))
          >>> back = plan.unshard(plan.shard(params))  # a round trip
          >>> all(np.array_equal(back[k], params[k]) for k in params)
          True
        """
        host = {k: np.asarray(jax.device_get(v)) for k, v in params.items()}
        rows = {t.name: t.rows for t in self.collection.tables}
        tables = _layout.disassemble(self.layout, host, rows)
        return {k: np.asarray(v) for k, v in self.collection.stack(tables).items()}

    # -- lookups (CollectionFace: __call__, concat, per-table transforms) -----
    def _lookup_source(self):
        gathers = {
            name: functools.partial(_gather, route=route)
            for name, route in self._routes.items()
            if route.routing == "all_to_all"
        }
        return self.collection, self.layout, gathers

    def _per_table_view(self) -> Any:
        return _PlanView(self)

    # -- training ---------------------------------------------------------------
    def update(
        self,
        tx: optax.GradientTransformation,
        grads: Any,
        state: Any,
        params: Any,
        *,
        stochastic_rounding: bool | None = None,
        key: Any = None,
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

        The step written as on one device (``tx.update`` and
        :func:`jaxslices.apply_updates`) is right on a routed plan too, but
        its gradients then take the partitioner's way (every device gets
        the global batch's rows): it warns, once per traced step, naming
        this method.

        ``stochastic_rounding`` and ``key``: how bfloat16/float16 buffers
        are written, as in :func:`jaxslices.apply_updates` (the rounding
        noise of a buffer row, and of its optimizer state row, reads the row
        of the collection's buffer it holds, so a plan rounds its tables as
        the collection on one device, column-wise pieces excepted).

        Returns:
          ``(new_params, new_state)``.
        """
        by_name = {b.name: b for b in self.buffers}
        found = jax.tree_util.tree_flatten_with_path(params)[0]
        routes, origins = [], []
        for path, leaf in found:
            b = by_name.get(_leaves.named_in_path(path, by_name))
            shape = tuple(getattr(leaf, "shape", ()))
            mine = b is not None and shape == b.shape
            routes.append(self._routes.get(b.name) if mine else None)
            home = self.collection.layout
            origins.append(noise_origin(self.layout, home, b.name) if mine else None)
        return _routing.update(
            tx,
            grads,
            state,
            params,
            routes,
            "ShardingPlan.update",
            stochastic_rounding=stochastic_rounding,
            key=key,
            origins=origins,
        )

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
        return _replay.estimate_capacities(
            self.collection, self.layout, samples, names,
            shards=self.devices, devices=self.mesh.size, padding_id=padding_id,
            margin=margin, multiple=multiple,
        )  # fmt: skip


def _gather(table, gids, batch_dim, *, route):
    return _routing.gather(table, gids, route, batch_dim)


class _PlanView:
    """What the per-table transforms read: tables, buffers, shapes."""

    def __init__(self, p: ShardingPlan):
        self.tables, self.buffers, self.shapes = (
            p.collection.tables,
            p.buffers,
            p.shapes,
        )
