"""A plan's layout: the kinds, and the buffers they make over one mesh axis.

With ``n`` devices on the axis (TorchRec's kinds):

* ``"data_parallel"``: tables stacked in replicated buffers, as on one
  device (:func:`jaxslices.collection._buffers.stacked`);
* ``"row_wise"`` and ``"table_wise"``: tables of one ``(dim, dtype)`` in one
  buffer whose rows are split over the axis in ``n`` regions; region ``k``
  holds chunk ``k`` of every row-wise table (``ceil(rows / n)`` rows each),
  then the table-wise tables placed on device ``k``;
* ``"column_wise"``: tables as ``n`` pieces of ``dim / n`` columns, piece
  ``j`` of every row in region ``j``.

Also the host side of a layout: one device's tables into the plan's buffers
(:func:`assemble`) and back (:func:`disassemble`), as NumPy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..collection import TableConfig, _buffers

__all__ = ["KINDS", "assemble", "disassemble", "kind_and_device", "plan_layout"]

KINDS: tuple[str, ...] = ("data_parallel", "table_wise", "row_wise", "column_wise")


def kind_and_device(given: Any, t: TableConfig, n: int, where: str):
    """``(kind, device or None)`` from ``kind`` or ``("table_wise", device)``."""
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


def plan_layout(tables: Any, placed: Mapping[str, tuple], n: int) -> _buffers.Layout:
    """Buffers and placements for ``{table: (kind, device)}`` over ``n`` devices."""
    groups: dict[tuple, list[TableConfig]] = {}
    for t in tables:
        cls = {"data_parallel": "rep", "column_wise": "col"}.get(placed[t.name][0])
        groups.setdefault((cls or "sh", t.dim, t.dtype), []).append(t)
    buffers, placements = [], []
    for (cls, _, _), ts in groups.items():
        if cls == "rep":
            part = _buffers.stacked(ts)
        elif cls == "sh":
            part = _sharded(ts, placed, n)
        else:
            part = _columns(ts, n)
        buffers += part.buffers
        placements += part.placements
    return _buffers.Layout(tuple(buffers), tuple(placements))


def _sharded(ts: list, placed: Mapping[str, tuple], n: int) -> _buffers.Layout:
    """One buffer of row-wise chunks and table-wise tables, region ``k`` on ``k``."""
    name = f"dim{ts[0].dim}_{ts[0].dtype.name}_sharded"
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
        for t in rw:  # the last chunks of a table may be short
            length = max(0, min(chunk[t.name], t.rows - k * chunk[t.name]))
            segments.append((k * region + offset[t.name], length, t.name))
        segments += [
            (k * region + offset[t.name], t.rows, t.name)
            for t in tw
            if placed[t.name][1] == k
        ]
    placements = [
        (t.name, _buffers.Placement(name, offset[t.name], chunk[t.name], region))
        for t in rw
    ]
    placements += [
        (
            t.name,
            _buffers.Placement(
                name, placed[t.name][1] * region + offset[t.name], t.rows, region
            ),
        )
        for t in tw
    ]
    buffer = _buffers.Buffer(
        name, ts[0].dim, ts[0].dtype, n * region, _cover(segments, n * region),
        sharded=True,
    )  # fmt: skip
    return _buffers.Layout((buffer,), tuple(placements))


def _columns(ts: list, n: int) -> _buffers.Layout:
    """One buffer of column pieces of ``dim / n``, piece ``j`` in region ``j``."""
    d = ts[0].dim // n
    name = f"dim{d}x{n}_{ts[0].dtype.name}_columns"
    offset, o = {}, 0
    for t in ts:
        offset[t.name], o = o, o + t.rows
    region = max(o, 1)
    segments = [
        (j * region + offset[t.name], t.rows, t.name) for j in range(n) for t in ts
    ]
    placements = tuple(
        (t.name, _buffers.Placement(name, offset[t.name], t.rows, region)) for t in ts
    )
    buffer = _buffers.Buffer(
        name, d, ts[0].dtype, n * region, _cover(segments, n * region),
        pieces=n, sharded=True,
    )  # fmt: skip
    return _buffers.Layout((buffer,), placements)


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


# ------------------------------------------------------------ host side


def assemble(
    layout: _buffers.Layout, tables: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The layout's buffers from ``{table: [rows, dim]}`` (NumPy)."""
    out = {}
    for b in layout.buffers:
        buf = np.zeros(b.shape, np.dtype(b.dtype))
        for name in b.tables:
            where = layout.placement(name)
            x = tables[name]
            rows = np.arange(x.shape[0])
            for j in range(b.pieces):
                buf[where.rows_of(rows, j)] = x[:, j * b.dim : (j + 1) * b.dim]
        out[b.name] = buf
    return out


def disassemble(
    layout: _buffers.Layout, buffers: Mapping[str, np.ndarray], rows: Mapping[str, int]
) -> dict[str, np.ndarray]:
    """``{table: [rows, dim]}`` (NumPy) from the buffers; ``rows`` per table."""
    tables = {}
    for b in layout.buffers:
        for name in b.tables:
            where = layout.placement(name)
            ids = np.arange(rows[name])
            tables[name] = np.concatenate(
                [buffers[b.name][where.rows_of(ids, j)] for j in range(b.pieces)],
                axis=1,
            )
    return tables
