"""Tool: the collectives of a compiled step, read from its HLO text.

``collectives(jax.jit(f).lower(*args).compile())`` lists every all-reduce,
all-gather, reduce-scatter, all-to-all and collective-permute of the compiled
(SPMD-partitioned, per-device) module with its operand and result shapes;
``table_sized`` picks those that move a table-sized array, which a sparse step
must never do. ``gathers`` lists the module's gathers and ``gathered_rows``
counts the rows one device reads from its tables and their optimizer state
(gathers from arrays of at least a table shard's rows). The tests
(``tests/scale/``) check steps with it and the benchmarks
(``benchmarks/scale_bench.py``, ``benchmarks/plan_scale_bench.py``) count
bytes and rows with it: all import it as
``from tools import hlo`` with the repository root on ``sys.path`` (pytest's
``pythonpath`` in ``pyproject.toml``; the benchmark inserts it).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

# `%name = <shape> <op>(<operands>), ...`; <shape> is `f32[4,2]{1,0}` or a tuple.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_OPERAND = re.compile(r"%?([\w.\-]+)")

_ITEMSIZE = {"pred": 1, "s4": 1, "u4": 1}


def _itemsize(dtype: str) -> int:
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    bits = re.sub(r"^[a-z]+", "", dtype)
    return max(1, int(bits) // 8) if bits else 4


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (dt, tuple(int(d) for d in dims.split(",") if d))
        for dt, dims in _ARRAY.findall(shape_text)
    ]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled module (shapes are per device)."""

    kind: str  # one of KINDS
    name: str
    results: tuple[tuple[str, tuple[int, ...]], ...]
    operands: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def arrays(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return self.results + self.operands

    @property
    def bytes(self) -> int:
        """Bytes this device sends or receives: the larger of operands and results.

        An all-gather receives its result, a reduce-scatter sends its operand,
        an all-reduce moves (about) its operand; a ring implementation moves up
        to twice that, which this per-step figure does not model.
        """

        def total(arrays):
            return sum(math.prod(s) * _itemsize(dt) for dt, s in arrays)

        return max(total(self.results), total(self.operands))

    def __str__(self) -> str:
        def fmt(arrays):
            return ", ".join(f"{dt}{list(s)}" for dt, s in arrays)

        return (
            f"{self.kind} {self.name}: ({fmt(self.operands)}) -> ({fmt(self.results)})"
        )


def _hlo_text(compiled_or_text: Any) -> str:
    if isinstance(compiled_or_text, str):
        return compiled_or_text
    return compiled_or_text.as_text()


def _instructions(compiled_or_text: Any) -> Iterator[tuple[str, str, str, str, dict]]:
    """``(name, shape, op, rest of the line, shapes so far)`` per instruction.

    ``shapes`` maps every instruction seen so far (this one included) to its
    shape text, so an operand's shape can be looked up by its name.
    """
    shapes: dict[str, str] = {}
    for line in _hlo_text(compiled_or_text).splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape_text, op, rest = m.groups()
        name = name.lstrip("%")
        shapes[name] = shape_text
        yield name, shape_text, op, rest, shapes


def collectives(compiled_or_text: Any) -> list[Collective]:
    """Every collective of a compiled executable (or its HLO text).

    Async pairs (``all-gather-start`` / ``-done``) count once, at the start.
    """
    found = []
    for name, shape_text, op, rest, shapes in _instructions(compiled_or_text):
        kind = op[: -len("-start")] if op.endswith("-start") else op
        if kind not in KINDS:
            continue
        args = rest.split(")", 1)[0]
        operands = []
        for a in args.split(","):
            om = _OPERAND.search(a.strip().split(" ")[-1])
            if om and om.group(1) in shapes:
                operands += _arrays(shapes[om.group(1)])
        found.append(
            Collective(kind, name, tuple(_arrays(shape_text)), tuple(operands))
        )
    return found


@dataclasses.dataclass(frozen=True)
class Gather:
    """One gather of a compiled module (per device): what it reads from."""

    name: str
    operand: tuple[str, tuple[int, ...]]
    result: tuple[str, tuple[int, ...]]

    @property
    def rows(self) -> int:
        """Rows read: the result's elements over one row of the operand."""
        row = math.prod(self.operand[1][1:]) or 1
        return math.prod(self.result[1]) // row


def gathers(compiled_or_text: Any) -> list[Gather]:
    """Every ``gather`` of a compiled executable (or its HLO text), fused ones too."""
    found = []
    for name, shape_text, op, rest, shapes in _instructions(compiled_or_text):
        if op != "gather":
            continue
        first = rest.split(")", 1)[0].split(",")[0].strip().split(" ")[-1]
        om = _OPERAND.search(first)
        operand = _arrays(shapes.get(om.group(1), "")) if om else []
        result = _arrays(shape_text)
        if operand and result:
            found.append(Gather(name, operand[0], result[0]))
    return found


def gathered_rows(compiled_or_text: Any, table_rows: Any) -> int:
    """Rows one device reads per step from arrays of ``table_rows`` rows.

    ``table_rows``: the rows of each table (or table shard) as a device holds
    it (an int or a collection of them): the rows read from the tables and
    their optimizer state (``[rows, ...]`` too), i.e. the lookups' gathers and
    the optimizers' state gathers (on the XLA path; a native kernel's reads
    are inside its custom call). Only float arrays count: tables and their
    state are floats, while a batch-sized integer array (ids being sorted)
    may happen to have as many rows.
    """
    sizes = {table_rows} if isinstance(table_rows, int) else set(table_rows)
    return sum(
        g.rows
        for g in gathers(compiled_or_text)
        if g.operand[1] and g.operand[1][0] in sizes and g.operand[0][0] in "fb"
    )


def total_bytes(compiled_or_text: Any) -> int:
    """Sum of :attr:`Collective.bytes` over a module: bytes moved per device."""
    return sum(c.bytes for c in collectives(compiled_or_text))


def table_sized(
    compiled_or_text: Any, num_rows: int, row_size: int = 1
) -> list[Collective]:
    """Collectives with an array of ``>= num_rows`` rows or ``>= num_rows * row_size``
    elements (a table or a table shard reshaped): these must not exist in a sparse
    step. Pick ``num_rows`` well above the global batch so no batch array qualifies.
    """
    out = []
    for c in collectives(compiled_or_text):
        for _, shape in c.arrays:
            size = int(np.prod(shape)) if shape else 1
            if (shape and shape[0] >= num_rows) or size >= num_rows * row_size:
                out.append(c)
                break
    return out


def assert_no_table_sized(compiled_or_text: Any, num_rows: int, row_size: int = 1):
    """Fail with the offending collectives listed."""
    bad = table_sized(compiled_or_text, num_rows, row_size)
    assert not bad, f"table-sized collectives (>= {num_rows} rows): " + "; ".join(
        str(c) for c in bad
    )
