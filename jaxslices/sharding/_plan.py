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

How: the plan lays the tables out in buffers (:mod:`jaxslices._buffers`) —
data-parallel tables stacked in replicated buffers as on one device;
row-wise and table-wise tables of one ``(dim, dtype)`` in one buffer whose
rows are sharded over ``axis``, device ``k`` holding region ``k`` (chunk ``k``
of every row-wise table, then its table-wise tables); column-wise tables in a
buffer of ``dim / n`` wide rows, piece ``j`` of every row in region ``j``.
Lookups are the collection's (one gather per buffer, pooled as on one
device) with each id mapped to its buffer row; under ``jax.jit`` the
partitioner serves a gather from a row-sharded buffer with each device
reading the rows it owns, and every jaxslices scatter lays the gradient rows
out first (:func:`jaxslices.sharding.replicate_rows`). So per step a device
moves ``O(ids in the global batch x dim)`` bytes, never a table: the tests
read the compiled HLO's collectives (``tools/hlo.py``).

:func:`plan` chooses a kind per table from its size, its dim, the device
memory and an estimate of the per-step communication, like TorchRec's
planner; ``overrides`` fixes a table's kind (and, table-wise, its device).
A :class:`ShardingPlan` turns one device's params into the plan's
(:meth:`ShardingPlan.shard`) and back (:meth:`ShardingPlan.unshard`), looks
up like the collection (:meth:`ShardingPlan.__call__`, :meth:`concat`) and
gives the per-table transforms for its layout. Every plan trains to one
device's numbers (``tests/scale/test_plans.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..collection import EmbeddingCollection, TableConfig, _buffers, _pooling
from ..transforms import _per_table
from . import _cost

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
        from the ids the table sees per step.
    """

    table: str
    kind: str
    device: int | None
    memory_bytes: int
    comm_bytes: int


class ShardingPlan:
    """A placement of every table of a collection over one mesh axis.

    Build one with :func:`plan` (or directly, from ``{table: kind}`` or
    ``{table: ("table_wise", device)}``).

    Args:
      collection: the :class:`jaxslices.EmbeddingCollection`.
      mesh: a ``jax.sharding.Mesh``.
      axis: the mesh axis to place over (the batch is split over it too).
      kinds: ``{table: kind}``; a table-wise table may give its device,
        ``("table_wise", k)`` (default: round robin).
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
    """

    def __init__(
        self,
        collection: EmbeddingCollection,
        mesh: Any,
        axis: str,
        kinds: Mapping[str, Any],
        *,
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
        self.tables = {
            t.name: TablePlan(
                t.name,
                placed[t.name][0],
                placed[t.name][1],
                _cost.memory_bytes(t, placed[t.name][0], n, state_bytes_per_row),
                _cost.comm_bytes(t, placed[t.name][0], ids[t.name], n),
            )
            for t in collection.tables
        }
        self.layout = _plan_layout(collection, placed, n)
        self.buffers = self.layout.buffers

    # -- what the plan is -----------------------------------------------------
    def __repr__(self) -> str:
        kinds = {k: sum(p.kind == k for p in self.tables.values()) for k in KINDS}
        kinds = ", ".join(f"{v} {k}" for k, v in kinds.items() if v)
        return f"ShardingPlan({kinds} over {self.devices} devices of {self.axis!r})"

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
        )
        return {**seqs, **_pooling.per_feature(pooled, batch_major)}

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
