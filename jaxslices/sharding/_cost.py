"""The cost model of sharding plans: memory and communication per device.

What the planner (:mod:`._planner`) compares and what a
:class:`~jaxslices.sharding.TablePlan` reports: a table's bytes on the
device that holds most of it (with its optimizer state), and the bytes a
device sends and receives per step (forward and backward) for the ids the
table sees.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["comm_bytes", "itemsize", "memory_bytes"]


def itemsize(t: Any) -> int:
    return int(np.dtype(t.dtype).itemsize)


def memory_bytes(t: Any, kind: str, n: int, state_bytes_per_row: float) -> int:
    per_row = t.dim * itemsize(t) + state_bytes_per_row
    if kind == "row_wise":
        return int(math.ceil(t.rows / n) * per_row)
    if kind == "column_wise":
        return int(t.rows * (t.dim // n * itemsize(t) + state_bytes_per_row))
    return int(t.rows * per_row)


def comm_bytes(t: Any, kind: str, ids: int, n: int) -> int:
    """Bytes per device per step for ``ids`` looked-up ids in the global batch.

    Data parallel: the gradient rows are all-gathered (``ids x dim``, plus
    their int32 ids). Sharded kinds: also the forward's rows (the devices
    that own them send them) and the ids themselves.
    """
    row = t.dim * itemsize(t) + 4
    if kind == "data_parallel":
        return int(ids * row)
    return int(2 * ids * row + 4 * ids)
