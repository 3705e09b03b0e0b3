"""The host replay of a plan's step on sample batches: what its routing will see.

Sample batches are given as the step receives them: padded ids
``{feature: [B, L] ids}`` (the batch splits over the mesh's devices by
examples) or a :class:`~jaxslices.KeyedJaggedIds` (its slots split in equal
parts). From them, on the host (NumPy):

* :func:`buffer_rows`: per sharded buffer, each slot's buffer row, laid out
  as the step splits the batch; :func:`estimate_capacities` deduplicates
  them per device and counts them per owner
  (:func:`jaxslices.capacity.estimate_all_to_all_capacity`);
* :func:`ids_per_table`: the ids each table reads per step (every slot of
  its features: the masked gather reads padding slots too), which the cost
  model (:mod:`._cost`) weighs the routings with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import capacity as _capacity
from ..collection import _buffers
from ..keyed import KeyedJaggedIds

__all__ = ["buffer_rows", "estimate_capacities", "ids_per_table"]

_WHERE = "ShardingPlan"


def _check_sample(sample: Any) -> None:
    if not isinstance(sample, KeyedJaggedIds | Mapping):
        raise TypeError(
            f"{_WHERE}: a sample is a dict {{feature: [B, L] ids}} or a "
            f"KeyedJaggedIds, got {type(sample).__name__}."
        )


def ids_per_table(coll: Any, samples: Any) -> dict[str, int]:
    """``{table: ids it reads per step}``, the most over ``samples``.

    Example:
      >>> import numpy as np, jaxslices as js
      >>> coll = js.EmbeddingCollection([js.TableConfig("t", 10, 4,
      ...     features=("a", "b"))])
      >>> ids_per_table(coll, [{"a": np.zeros((3, 2)), "b": np.zeros((3, 1))}])
      {'t': 9}
    """
    out = dict.fromkeys((t.name for t in coll.tables), 0)
    for sample in samples:
        _check_sample(sample)
        seen = dict.fromkeys(out, 0)
        if isinstance(sample, KeyedJaggedIds):
            offsets = np.asarray(sample.offsets)
            batch = sample.batch_size
            for i, k in enumerate(sample.keys):
                if k in coll.features:
                    n = offsets[(i + 1) * batch] - offsets[i * batch]
                    seen[coll.table_of(k)] += int(n)
        else:
            for f in coll.features:
                seen[coll.table_of(f)] += int(np.size(sample[f]))
        out = {t: max(out[t], seen[t]) for t in out}
    return out


def buffer_rows(
    coll: Any,
    layout: _buffers.Layout,
    sample: Any,
    padding_id: int | None,
    devices: int,
) -> dict[str, np.ndarray]:
    """Per sharded buffer, a sample's buffer rows as the step splits them.

    Padded ids: ``[B, ids of the buffer's features per example]`` (the
    batch splits by examples); a ``KeyedJaggedIds``: ``[slots, pieces]``,
    padded to a multiple of ``devices`` (its slots split in equal parts).
    ``-1`` where a slot reads no row (padding, out of its table's range,
    another buffer's feature).
    """
    _check_sample(sample)
    sharded = [b for b in layout.buffers if b.sharded]
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
                where = layout.placement(t.name)
                for j in range(b.pieces):
                    rows[np.flatnonzero(sel), j] = where.rows_of(values[sel], j)
            out[b.name] = rows
        return out
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
            where = layout.placement(t.name)
            r = np.full((*ids.shape, b.pieces), -1, np.int64)
            for j in range(b.pieces):
                r[ok, j] = where.rows_of(ids[ok], j)
            parts.append(r.reshape(ids.shape[0], -1))
        out[b.name] = np.concatenate(parts, axis=1)
    return out


def estimate_capacities(
    coll: Any,
    layout: _buffers.Layout,
    samples: Any,
    buffers: list[str],
    *,
    shards: int,
    devices: int,
    padding_id: int | None = None,
    margin: float = 1.25,
    multiple: int = 8,
) -> dict[str, int]:
    """``{buffer: all-to-all capacity}`` of ``buffers`` from sample batches."""
    per: dict[str, list] = {name: [] for name in buffers}
    for sample in samples:
        rows = buffer_rows(coll, layout, sample, padding_id, devices)
        for name in buffers:
            per[name].append(rows[name])
    return {
        name: _capacity.estimate_all_to_all_capacity(
            per[name],
            num_rows=layout.buffer(name).rows,
            num_shards=shards,
            num_devices=devices,
            margin=margin,
            multiple=multiple,
        )
        for name in buffers
    }
