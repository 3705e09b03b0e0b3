"""Where a collection's tables live: buffers, and each table's rows in them.

A :class:`Layout` is static: a tuple of :class:`Buffer` s (``[rows, dim]``
arrays of one dtype holding several tables) and, per table, a
:class:`Placement` giving the buffer row of each table row::

    row(i, j) = base + (i // chunk) * stride + i % chunk + j * stride

for table row ``i`` and piece ``j < buffer.pieces``. The collection's own
layout (:func:`stacked`) puts the tables of one ``(dim, dtype)`` one after
the other (``chunk = rows``: the row is ``base + i``, one piece). A sharding
plan (:mod:`jaxslices.sharding`) makes others: a row-wise table split in chunks
of ``chunk`` rows, one per shard region of ``stride`` rows; a column-wise
table stored as ``pieces`` narrower rows, piece ``j`` in region ``j``.

``Buffer.segments`` cover the buffer's rows in order, each ``(start,
length, table or None)``: the table a row belongs to (``None``: unused
rows), which the per-table transforms
(:func:`jaxslices.transforms.scale_by_table`) look up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

__all__ = ["Buffer", "Layout", "Placement", "noise_origin", "stacked"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """The buffer rows of one table (see the module docstring)."""

    buffer: str
    base: int
    chunk: int
    stride: int = 0

    def rows_of(self, ids: Any, piece: int = 0) -> Any:
        """Buffer rows of table rows ``ids``, for one piece (the formula above).

        NumPy ids are read as int64; JAX ids keep their dtype (traced too).
        """
        if not isinstance(ids, jax.Array):
            ids = np.asarray(ids, np.int64)
        return placed_rows(ids, self.base, self.chunk, self.stride, piece)


def placed_rows(ids: Any, base: Any, chunk: Any, stride: Any, piece: Any = 0) -> Any:
    """``base + (ids // chunk) * stride + ids % chunk + piece * stride``.

    The placement formula of the module docstring, written once for every
    array type (NumPy or JAX) and for per-id placements (``base``, ``chunk``
    and ``stride`` arrays broadcast with ``ids``).
    """
    q = ids // chunk
    rows = base + q * stride + (ids - q * chunk)
    return rows if isinstance(piece, int) and piece == 0 else rows + piece * stride


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One ``[rows, dim]`` array holding tables of one dtype.

    ``pieces > 1``: each table row is stored as ``pieces`` rows of ``dim``
    (a lookup returns ``pieces * dim`` wide rows). ``sharded``: the rows are
    split over a mesh axis (a plan's buffer); else replicated. ``segments``:
    ``(first row, length, table)`` per stretch of rows (``None``: unused).

    Example:
      >>> import jaxslices as js
      >>> coll = js.EmbeddingCollection([
      ...     js.TableConfig("user", rows=10, dim=4),
      ...     js.TableConfig("item", rows=6, dim=4)])
      >>> b = coll.buffers[0]
      >>> b.name, b.shape, b.segments
      ('dim4_float32', (16, 4), ((0, 10, 'user'), (10, 6, 'item')))
    """

    name: str
    dim: int
    dtype: Any
    rows: int
    segments: tuple[tuple[int, int, str | None], ...]
    pieces: int = 1
    sharded: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.dim)

    @property
    def width(self) -> int:
        """The width of a looked-up row: ``pieces * dim``."""
        return self.pieces * self.dim

    @property
    def tables(self) -> tuple[str, ...]:
        """The tables in this buffer, in the order of their first segment."""
        out: list[str] = []
        for _, _, t in self.segments:
            if t is not None and t not in out:
                out.append(t)
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class Layout:
    buffers: tuple[Buffer, ...]
    placements: tuple[tuple[str, Placement], ...]  # (table, placement), hashable

    def placement(self, table: str) -> Placement:
        return dict(self.placements)[table]

    def buffer(self, name: str) -> Buffer:
        return next(b for b in self.buffers if b.name == name)


def stacked(tables: Any) -> Layout:
    """The collection's layout: tables of one ``(dim, dtype)`` one after another."""
    groups: dict[tuple[int, Any], list[Any]] = {}
    for t in tables:
        groups.setdefault((t.dim, t.dtype), []).append(t)
    buffers, placements = [], []
    for (dim, dtype), ts in groups.items():
        name = f"dim{dim}_{dtype.name}"
        start, segments = 0, []
        for t in ts:
            segments.append((start, t.rows, t.name))
            placements.append((t.name, Placement(name, start, t.rows)))
            start += t.rows
        buffers.append(Buffer(name, dim, dtype, start, tuple(segments)))
    return Layout(tuple(buffers), tuple(placements))


def noise_origin(layout: Layout, home: Layout, name: str) -> np.ndarray | None:
    """Where the stochastic rounding's noise reads the rows of ``layout``'s
    buffer ``name``: the rows of ``home`` (the collection's own layout)
    that they hold, as the static part of an apply's row origin (pairs
    ``first, coord`` sorted by ``first``; ``kernels._ops.noise_rows``), so
    a plan's buffers round as the collection's on one device. ``None``: no
    table there. Column pieces map to their row (their columns are the
    piece's own).
    """
    rows = {t: n for b in home.buffers for _, n, t in b.segments if t is not None}
    buffer = layout.buffer(name)
    pairs = []
    for table, placed in layout.placements:
        if placed.buffer != name:
            continue
        at_home = home.placement(table)
        for q in range(-(-rows[table] // placed.chunk)):
            first = np.asarray([q * placed.chunk])
            for j in range(buffer.pieces):
                pairs.append(
                    (int(placed.rows_of(first, j)[0]), int(at_home.rows_of(first)[0]))
                )
    if not pairs:
        return None
    flat = np.asarray(sorted(pairs), np.int64).reshape(-1)
    small = flat.max(initial=0) < 2**31
    return flat.astype(np.int32 if small else np.int64)
