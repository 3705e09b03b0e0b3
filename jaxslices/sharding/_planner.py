"""The planner: a placement for every table of a collection, like TorchRec's.

:func:`plan_collection` walks the tables biggest first and gives each the
cheapest kind that fits the device memory, by the cost model
(:mod:`._cost`); ``overrides`` fix kinds first. It returns a
:class:`~jaxslices.sharding.ShardingPlan`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..collection import EmbeddingCollection
from . import _cost
from ._layout import kind_and_device
from ._placement import check_axis
from ._plan import ShardingPlan

__all__ = ["plan_collection"]


def plan_collection(
    collection: EmbeddingCollection,
    mesh: Any,
    axis: str,
    *,
    batch_size: int | None = None,
    device_memory: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    ids_per_step: Mapping[str, int] | None = None,
    replicate_below: int = 1 << 20,
    state_bytes_per_row: float = 4.0,
    routing: Any = None,
    capacity: Any = None,
    samples: Any = None,
    padding_id: int | None = None,
) -> ShardingPlan:
    """Choose a placement for every table, like TorchRec's planner.

    Greedy, biggest table first (bytes with optimizer state):

    * a table of at most ``replicate_below`` bytes is **data parallel** (a
      replica costs little memory, and its lookups no communication);
    * else **table-wise** on the device with the most free memory, if it fits
      there (the estimated per-step communication of table-wise and
      row-wise placement is the same, ``O(ids x dim)``, and a whole table
      on one device keeps its lookups local to it);
    * else **row-wise** (a chunk on every device), if the chunks fit;
    * else ``ValueError``, saying what does not fit.

    ``overrides`` (``{table: kind}`` or ``{table: ("table_wise", device)}``)
    fixes those tables first; column-wise placement is chosen only there.

    Then each sharded buffer gets its routing as :class:`ShardingPlan`
    gives it (the same rule): the one the cost model finds cheaper
    (:mod:`jaxslices.sharding._cost`: bytes per device and step, plus a
    latency per collective) for the ids per step (``ids_per_step``, else
    counted in ``samples``, else ``batch_size`` per feature) and the
    all-to-all capacity (given, or estimated from ``samples``). Without a
    capacity the all-to-all would move as much as masked routing, so masked
    is chosen; with samples of a batch that is not tiny, all-to-all wins.
    :meth:`ShardingPlan.explain` says what was chosen and why.

    Args:
      collection: the :class:`jaxslices.EmbeddingCollection`.
      mesh: a ``jax.sharding.Mesh``.
      axis: the mesh axis to place over.
      batch_size: the global batch (examples per step), for the ids per
        step without ``samples`` (``None``: 1).
      device_memory: bytes each device may hold for tables and their state
        (``None``: no limit).
      overrides: tables whose kind is given.
      ids_per_step: ``{table: ids per step}`` (default: counted in
        ``samples``, else ``batch_size`` per feature reading the table).
      replicate_below: the largest table (bytes) to replicate.
      state_bytes_per_row: optimizer state per row (row-wise Adagrad: 4;
        Adam: ``8 * dim``).
      routing: as :class:`ShardingPlan`'s (``None``: by the cost model).
      capacity: as :class:`ShardingPlan`'s.
      samples: sample batches, as the step receives them: the capacities
        are estimated and the ids per step counted from them.
      padding_id: the padded samples' padding id.

    Returns:
      A :class:`ShardingPlan`.

    Example:
      >>> import jax, numpy as np, jaxslices as js
      >>> coll = js.EmbeddingCollection([js.TableConfig("small", 10, 4),
      ...                                js.TableConfig("big", 100_000, 4)])
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
      >>> p = js.sharding.plan_collection(coll, mesh, "model", batch_size=32)
      >>> {t: p.tables[t].kind for t in p.tables}
      {'small': 'data_parallel', 'big': 'table_wise'}
    """
    where = "jaxslices.sharding.plan_collection"
    n = check_axis(mesh, axis, where)
    overrides = dict(overrides or {})
    unknown = [t for t in overrides if t not in {c.name for c in collection.tables}]
    if unknown:
        raise ValueError(
            f"{where}: overrides name no table of the collection: {unknown}."
        )
    limit = math.inf if device_memory is None else float(device_memory)
    used = [0.0] * n
    kinds: dict[str, Any] = {}

    def take(t, kind, device=None):
        m = _cost.memory_bytes(t, kind, n, state_bytes_per_row)
        if kind == "table_wise":
            used[device] += m
        else:
            for k in range(n):
                used[k] += m

    for t in collection.tables:
        if t.name in overrides:
            kind, device = kind_and_device(overrides[t.name], t, n, where)
            if kind == "table_wise" and device is None:
                device = int(np.argmin(used))
            kinds[t.name] = ("table_wise", device) if kind == "table_wise" else kind
            take(t, kind, device)
    rest = sorted(
        (t for t in collection.tables if t.name not in overrides),
        key=lambda t: -_cost.memory_bytes(t, "data_parallel", n, state_bytes_per_row),
    )
    for t in rest:
        whole = _cost.memory_bytes(t, "data_parallel", n, state_bytes_per_row)
        if whole <= replicate_below and max(used) + whole <= limit:
            kinds[t.name] = "data_parallel"
            take(t, "data_parallel")
            continue
        k = int(np.argmin(used))
        if used[k] + whole <= limit:
            kinds[t.name] = ("table_wise", k)
            take(t, "table_wise", k)
            continue
        part = _cost.memory_bytes(t, "row_wise", n, state_bytes_per_row)
        if max(used) + part <= limit:
            kinds[t.name] = "row_wise"
            take(t, "row_wise")
            continue
        raise ValueError(
            f"{where}: table {t.name!r} ({whole} bytes with state; {part} per device "
            f"row-wise) does not fit: the devices hold {[int(u) for u in used]} of "
            f"device_memory={device_memory} bytes already. Use more devices, a "
            "larger device_memory, or smaller tables."
        )
    return ShardingPlan(
        collection, mesh, axis, kinds, routing=routing, capacity=capacity,
        samples=samples, padding_id=padding_id, ids_per_step=ids_per_step,
        batch_size=batch_size, state_bytes_per_row=state_bytes_per_row,
    )  # fmt: skip
