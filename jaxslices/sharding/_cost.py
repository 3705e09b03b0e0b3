"""The cost model of sharding plans: memory and communication per device.

What the planner (:mod:`._planner`) compares and what a
:class:`~jaxslices.sharding.TablePlan` reports, per device and step, with
``N`` the ids a table (or buffer) sees in the global batch, ``n`` the
devices, ``R = dim x itemsize + 4`` the bytes of a row and its int32 id,
``c`` the all-to-all capacity (slots per destination):

* memory: the table's bytes on the device that holds most of it, with its
  optimizer state (``state_bytes_per_row`` per row);
* data parallel: the gradient rows are all-gathered, ``N x R``;
* sharded, ``"masked"`` routing (the partitioner's gather, every device
  sees the global batch): the ids, the forward's rows and the backward's
  gradient rows, ``2 N R`` (plus ``4 N``), and ``N`` rows gathered;
* sharded, ``"all_to_all"``: ids and rows to the owners and back in the
  forward, ids and summed gradient rows to the owners in the update,
  ``2 n c R``, and ``n c`` rows gathered. Without a capacity (``c`` the
  device's whole part of the batch, ``N / n``) this is the masked figure.

The bytes are what ``tools/hlo.py`` counts on the compiled step (each
collective's larger side); ``benchmarks/plan_scale_bench.py`` checks the
model against it. Routing is chosen per buffer by ``bytes + LATENCY_BYTES x
collectives`` (:func:`choose_routing`, which also says why): the all-to-all
routing runs more collectives (two exchanges each way and its capacity
checks), so where the batch is tiny or the devices few, masked wins. ``N``
is what the plan is given (``ids_per_step``), else what it counts in its
sample batches (:mod:`._replay`), else ``batch_size`` per feature: a plan
built with samples sees the batch it will run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ._routing import ROUTINGS

__all__ = [
    "COLLECTIVES",
    "LATENCY_BYTES",
    "RoutingChoice",
    "choose_routing",
    "comm_bytes",
    "gathered_rows",
    "itemsize",
    "memory_bytes",
    "routing_cost",
]

#: What one collective costs beyond its bytes, in bytes: a few microseconds
#: of latency at tens of GB/s.
LATENCY_BYTES = 64 * 1024

#: Collectives per step and buffer of each routing (forward and update).
COLLECTIVES = {"masked": 4, "all_to_all": 6}


def itemsize(t: Any) -> int:
    return int(np.dtype(t.dtype).itemsize)


def memory_bytes(t: Any, kind: str, n: int, state_bytes_per_row: float) -> int:
    per_row = t.dim * itemsize(t) + state_bytes_per_row
    if kind == "row_wise":
        return int(math.ceil(t.rows / n) * per_row)
    if kind == "column_wise":
        return int(t.rows * (t.dim // n * itemsize(t) + state_bytes_per_row))
    return int(t.rows * per_row)


def _slots(ids: float, n: int, capacity: int | None) -> float:
    """Slots a device sends per destination: the capacity, or its whole part."""
    return max(ids / max(n, 1), 1.0) if capacity is None else float(capacity)


@dataclasses.dataclass(frozen=True)
class RoutingChoice:
    """A sharded buffer's routing, its capacity, and why the plan took it.

    Attributes:
      routing: ``"masked"`` or ``"all_to_all"``.
      capacity: the all-to-all's slots per destination (``None``: the
        device's whole part of the batch; never overflows).
      reads: the rows the buffer reads per step (a column piece is a row).
      why: one line: given, or the cost model's figures and where the ids
        per step came from.
      given: whether the routing was given (else the cost model chose it).
    """

    routing: str
    capacity: int | None
    reads: int
    why: str
    given: bool = False


def choose_routing(
    reads: int, n: int, row_bytes: int, capacity: int | None, given: str | None,
    ids_from: str,
) -> RoutingChoice:  # fmt: skip
    """The routing of one sharded buffer: ``given``, else the cheaper by the model.

    ``reads``: rows the buffer reads per step; ``row_bytes``: a stored row's
    bytes; ``ids_from``: where the ids per step came from, for ``why``.
    A tie goes to ``"masked"`` (fewer collectives, no capacity to outgrow).
    """
    if given is not None:
        why = f"given (routing={given!r})"
        return RoutingChoice(given, capacity, reads, why, given=True)
    cost = {r: routing_cost(reads, n, row_bytes, r, capacity) for r in ROUTINGS}
    routing = min(ROUTINGS, key=lambda r: (cost[r], r != "masked"))
    other = next(r for r in ROUTINGS if r != routing)
    why = (
        f"cost model: {routing} {cost[routing]:,.0f} <= {other} {cost[other]:,.0f} "
        f"bytes per device and step (latency included) for {reads:,} rows read "
        f"per step ({ids_from})"
    )
    if capacity is None:
        why += (
            "; no all-to-all capacity (pass samples= or capacity=), so an "
            "all-to-all would send a device's whole part of the batch to every owner"
        )
    return RoutingChoice(routing, capacity, reads, why)


def comm_bytes(
    t: Any, kind: str, ids: int, n: int, choice: RoutingChoice | None = None
) -> int:
    """Bytes per device per step for ``ids`` looked-up ids in the global batch.

    ``choice``: the routing of the table's buffer (sharded kinds; ``None``:
    masked); its ``reads`` are the buffer's rows per step, of which the
    table's share is counted (an all-to-all's capacity is the buffer's).
    """
    pieces = n if kind == "column_wise" else 1
    row = (t.dim // pieces) * itemsize(t) + 4
    if kind == "data_parallel":
        return int(ids * row)
    rows = ids * pieces  # a column-wise id reads one piece on every device
    if choice is not None and choice.routing == "all_to_all":
        total = max(choice.reads or rows, 1)
        return int(rows / total * 2 * n * _slots(total, n, choice.capacity) * row)
    return int(2 * rows * row + 4 * ids)


def gathered_rows(ids: int, n: int, routing: str, capacity: int | None) -> int:
    """Table rows one device gathers per step for a sharded buffer's ``ids``."""
    if routing == "all_to_all":
        return int(n * _slots(ids, n, capacity))
    return int(ids)


def routing_cost(
    ids: int, n: int, row_bytes: int, routing: str, capacity: int | None
) -> float:
    """What the planner minimises for one sharded buffer: bytes + latency."""
    row = row_bytes + 4
    if routing == "all_to_all":
        moved = 2 * n * _slots(ids, n, capacity) * row
    else:
        moved = 2 * ids * row + 4 * ids
    return moved + COLLECTIVES[routing] * LATENCY_BYTES
