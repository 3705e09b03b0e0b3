"""Static capacities from sample batches: how many slots a buffer needs.

JAX shapes are static, so every buffer whose real fill depends on the ids of
a batch has its size fixed up front, and the step raises when a batch needs
more (nothing is ever dropped silently). Three such sizes exist in
jaxslices, each with its estimator here:

* ``max_distinct`` of the optimizers (:func:`jaxslices.lazy_adam` and every
  transform that coalesces): the distinct rows one step's gradient touches.
  :func:`estimate_max_distinct`.
* ``capacity`` of :func:`jaxslices.sharding.sharded_lookup` /
  :func:`jaxslices.sharding.sharded_update` with ``routing="all_to_all"``: the
  distinct ids one device sends to one shard. :func:`estimate_all_to_all_capacity`.
* ``capacity`` of :class:`jaxslices.MultiSteps`: the distinct rows of ``k``
  accumulated micro-batches (at least one micro-batch's slots).
  :func:`estimate_multisteps_capacity`.

Each estimator counts on host (NumPy) what the step would need for every
sample batch, takes the largest count, multiplies it by ``margin`` and
rounds it up to a multiple of ``multiple``, never beyond the size that
cannot overflow. The counts are exact for the samples; the margin is the
only guess. How to choose it, and what happens when a batch needs more than
the estimate, is in ``docs/optax.md`` ("Distinct-row bound").

The ids given are what the step looks up in one table: every lookup of that
table in one step, concatenated (any shape; flattened). Invalid ids
(negative, or ``>= num_rows`` when ``num_rows`` is given) touch no row and
are not counted. For :func:`estimate_max_distinct` and
:func:`estimate_multisteps_capacity` a batch may also be a dict of id arrays
(one per table, e.g. ``{"user": ids_u, "item": ids_i}``, nested dicts
allowed); the result is then the same dict of estimates, ready to pass as
``max_distinct`` or ``capacity`` (a ``num_rows`` given applies to every
table). :func:`estimate_all_to_all_capacity` sizes one table's routing and
takes plain id arrays.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from . import _ids

__all__ = [
    "distinct_rows",
    "estimate_all_to_all_capacity",
    "estimate_max_distinct",
    "estimate_multisteps_capacity",
]


def _valid(ids: Any, num_rows: int | None) -> np.ndarray:
    ids = np.asarray(ids).reshape(-1)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(
            f"jaxslices.capacity: ids must be integers, got {ids.dtype} "
            f"{list(ids.shape)}."
        )
    keep = ids >= 0 if num_rows is None else _ids.valid(ids, num_rows)
    return ids[keep]


def distinct_rows(ids: Any, num_rows: int | None = None) -> int:
    """The number of distinct valid ids in ``ids`` (the rows a lookup touches).

    Example:
      >>> from jaxslices import capacity
      >>> capacity.distinct_rows([[3, 1, 3], [7, -1, 1]], num_rows=5)
      2
    """
    return int(np.unique(_valid(ids, num_rows)).size)


def _round(count: float, margin: float, multiple: int, lo: int, hi: int) -> int:
    need = math.ceil(count * margin)
    need = -(-need // multiple) * multiple
    return int(max(lo, min(hi, need)))


def _check(margin: float, multiple: int, where: str) -> None:
    if not margin >= 1.0:
        raise ValueError(
            f"jaxslices.capacity.{where}: `margin` must be >= 1 (a factor on "
            f"the largest count seen), got {margin!r}."
        )
    if not isinstance(multiple, (int, np.integer)) or multiple < 1:
        raise ValueError(
            f"jaxslices.capacity.{where}: `multiple` must be a positive int, "
            f"got {multiple!r}."
        )


def _per_table(batches: Iterable[Any], where: str) -> tuple[list[list[Any]], Any]:
    """Batches as one list of id arrays per table, and the tables' treedef."""
    batches = list(batches)
    if not batches:
        raise ValueError(f"jaxslices.capacity.{where}: no sample batches given.")
    # A dict is one id array per table; anything else is one table's ids.
    is_ids = lambda x: not isinstance(x, dict)  # noqa: E731
    leaves0, treedef = jax.tree.flatten(batches[0], is_leaf=is_ids)
    tables: list[list[Any]] = [[] for _ in leaves0]
    for b in batches:
        leaves, td = jax.tree.flatten(b, is_leaf=is_ids)
        if td != treedef:
            raise ValueError(
                f"jaxslices.capacity.{where}: every sample batch must have the "
                f"structure of the first ({treedef}), got {td}."
            )
        for t, x in zip(tables, leaves, strict=True):
            t.append(x)
    return tables, treedef


def estimate_max_distinct(
    batches: Iterable[Any],
    *,
    num_rows: int | None = None,
    margin: float = 1.25,
    multiple: int = 128,
) -> Any:
    """``max_distinct`` for the optimizers, from sample batches of ids.

    The largest number of distinct valid ids of one batch, times ``margin``,
    rounded up to a multiple of ``multiple``, and at most the lookups of the
    largest batch (a bound that large never overflows).

    Args:
      batches: sample batches, each the ids one step looks up in the table
        (or a dict of such arrays, one per table).
      num_rows: the table's rows; ids outside ``[0, num_rows)`` are not
        counted. ``None``: only negative ids are invalid.
      margin: the factor on the largest count seen (``>= 1``).
      multiple: the estimate is rounded up to a multiple of this.

    Returns:
      An ``int`` (or the batches' dict of ints).

    Example:
      >>> import numpy as np, jaxslices
      >>> rng = np.random.default_rng(0)
      >>> batches = [rng.zipf(1.2, size=(1024, 16)) % 100_000 for _ in range(5)]
      >>> k = jaxslices.capacity.estimate_max_distinct(batches, num_rows=100_000)
      >>> max(jaxslices.capacity.distinct_rows(b) for b in batches) < k <= 16384
      True
    """
    _check(margin, multiple, "estimate_max_distinct")
    tables, treedef = _per_table(batches, "estimate_max_distinct")
    out = []
    for ids in tables:
        most = max(distinct_rows(b, num_rows) for b in ids)
        slots = max(np.asarray(b).size for b in ids)
        out.append(_round(most, margin, multiple, 1, max(slots, 1)))
    return jax.tree.unflatten(treedef, out)


def estimate_all_to_all_capacity(
    batches: Iterable[Any],
    *,
    num_rows: int,
    num_shards: int,
    num_devices: int | None = None,
    margin: float = 1.25,
    multiple: int = 8,
) -> int:
    """``capacity`` of ``routing="all_to_all"``, from sample batches of ids.

    Replays the routing of :func:`jaxslices.sharding.sharded_lookup` and
    :func:`jaxslices.sharding.sharded_update`: each batch's leading (batch) dimension
    is split evenly over ``num_devices`` devices; each device deduplicates
    its part and sends each id to the shard owning its row (rows are split
    into ``num_shards`` equal blocks of ``num_rows / num_shards``). The
    estimate is the most distinct ids one device sent one shard, over every
    batch, times ``margin``, rounded up to a multiple of ``multiple``, and at
    most one device's lookups (which never overflows).

    Args:
      batches: sample batches of ids, batch dimension first.
      num_rows: the rows of the table as placed (``table.shape[0]`` after
        :func:`jaxslices.sharding.shard_rows`, which pads it to a multiple of the
        shards).
      num_shards: the size of the mesh axis the rows are sharded over.
      num_devices: the devices of the mesh (``mesh.size``); default
        ``num_shards`` (a mesh with one axis).
      margin: the factor on the largest count seen (``>= 1``).
      multiple: the estimate is rounded up to a multiple of this.

    Returns:
      An ``int``.

    Example:
      >>> import numpy as np, jaxslices
      >>> ids = np.array([[0, 1], [1, 5], [6, 7], [7, 7]])  # 2 devices, 2 shards
      >>> jaxslices.capacity.estimate_all_to_all_capacity(
      ...     [ids], num_rows=8, num_shards=2, margin=1.0, multiple=1)
      2
    """
    where = "estimate_all_to_all_capacity"
    _check(margin, multiple, where)
    devices = num_shards if num_devices is None else int(num_devices)
    if num_rows % num_shards:
        raise ValueError(
            f"jaxslices.capacity.{where}: num_rows={num_rows} is not a multiple "
            f"of num_shards={num_shards}; pass the rows of the table as placed "
            "by jaxslices.sharding.shard_rows (padded)."
        )
    rows_per_shard = num_rows // num_shards
    most, local_slots = 0, 1
    for b in batches:
        if isinstance(b, dict):
            raise TypeError(
                f"jaxslices.capacity.{where}: a batch is a dict (keys "
                f"{list(b)}); this estimator sizes one table's routing. Call it "
                "once per table with that table's ids."
            )
        b = np.asarray(b)
        if b.ndim < 1 or b.shape[0] % devices:
            raise ValueError(
                f"jaxslices.capacity.{where}: a batch of shape {list(b.shape)} "
                f"does not split evenly over {devices} devices."
            )
        for part in np.split(b, devices):
            local_slots = max(local_slots, part.size)
            owners = np.unique(_valid(part, num_rows)) // rows_per_shard
            if owners.size:
                most = max(most, int(np.bincount(owners).max()))
    return _round(most, margin, multiple, 1, local_slots)


def estimate_multisteps_capacity(
    batches: Iterable[Any],
    every_k: int,
    *,
    num_rows: int | None = None,
    margin: float = 1.25,
    multiple: int = 128,
) -> Any:
    """``capacity`` of :class:`jaxslices.MultiSteps`, from sample micro-batches.

    :class:`~jaxslices.MultiSteps` appends each micro-batch's gradient slots
    to a buffer and coalesces it when full; it raises when the distinct rows
    accumulated so far do not fit. The estimate is the most distinct valid
    ids of any ``every_k`` consecutive sample micro-batches, times
    ``margin``, rounded up to a multiple of ``multiple``; at least one
    micro-batch's lookups (a smaller buffer cannot take one gradient) and at
    most ``every_k`` times that (a buffer that large never coalesces).

    Args:
      batches: consecutive sample micro-batches of ids (or dicts of them,
        one array per table); at least ``every_k`` of them.
      every_k: the micro-steps per update (``every_k_schedule``).
      num_rows: the table's rows; ids outside ``[0, num_rows)`` are not
        counted. ``None``: only negative ids are invalid.
      margin: the factor on the largest count seen (``>= 1``).
      multiple: the estimate is rounded up to a multiple of this.

    Returns:
      An ``int`` (or the batches' dict of ints; give dense leaves ``None``
      when passing it as ``capacity``).

    Example:
      >>> import numpy as np, jaxslices
      >>> rng = np.random.default_rng(0)
      >>> micro = [rng.zipf(1.2, size=(256, 16)) % 50_000 for _ in range(8)]
      >>> cap = jaxslices.capacity.estimate_multisteps_capacity(micro, every_k=4)
      >>> 256 * 16 <= cap <= 4 * 256 * 16
      True
    """
    where = "estimate_multisteps_capacity"
    _check(margin, multiple, where)
    if not isinstance(every_k, (int, np.integer)) or every_k < 1:
        raise ValueError(
            f"jaxslices.capacity.{where}: `every_k` must be a positive int, got "
            f"{every_k!r}."
        )
    tables, treedef = _per_table(batches, where)
    if len(tables[0]) < every_k:
        raise ValueError(
            f"jaxslices.capacity.{where}: give at least every_k={every_k} "
            f"consecutive micro-batches, got {len(tables[0])}."
        )
    out = []
    for ids in tables:
        valid = [_valid(b, num_rows) for b in ids]
        most = 0
        for start in range(len(valid) - every_k + 1):
            window = np.concatenate(valid[start : start + every_k])
            most = max(most, int(np.unique(window).size))
        slots = max(np.asarray(b).size for b in ids)
        out.append(_round(most, margin, multiple, slots, every_k * slots))
    return jax.tree.unflatten(treedef, out)
