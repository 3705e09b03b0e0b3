"""Does a compiled training step copy its tables? :func:`table_copies` says.

A sparse step writes a few rows of each table in place, but only when the
table's buffer is *donated* to the jitted step (``jax.jit(step,
donate_argnums=...)``, ``nnx.jit(..., donate_argnums=...)``,
``eqx.filter_jit(donate=...)``). Without donation the step's output cannot
reuse the input's buffer, so XLA first copies the whole table (and every
table-sized optimizer state), and the step costs about what a dense step
costs. Nothing in the results shows it: the numbers are right, only slow.

:func:`table_copies` reads the compiled step (``compiled.as_text()``, the HLO
after XLA's optimisations) and lists every argument that the step copies whole
(a ``copy`` of an entry parameter), with its size and whether it was donated:

* not donated: donate it;
* donated and still copied: the step reads the table after writing it (or
  returns it twice), so XLA keeps the old buffer alive; see
  ``docs/sparse_gradients.md`` ("Memory").

Complement: ``compiled.memory_analysis()`` gives ``alias_size_in_bytes``,
the output bytes written in place into donated inputs.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import jax

__all__ = ["TableCopy", "table_copies"]


class TableCopy(NamedTuple):
    """One argument that a compiled step copies whole.

    Attributes:
      argument: the argument's name in the compiled step (JAX's, e.g.
        ``params['emb']``), or ``parameter <k>`` when it has none.
      shape: its shape.
      dtype: its element type in XLA's spelling (``f32``, ``bf16``, ``s32``).
      nbytes: the bytes copied per step.
      donated: whether the argument was donated.
    """

    argument: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    donated: bool


def _itemsize(hlo_dtype: str) -> float:
    """Bytes per element of an HLO element type: its bit width / 8 (``f32``: 4,
    ``bf16``: 2, ``f8e4m3fn``: 1, ``s4``: 0.5; ``pred``: 1 byte)."""
    if hlo_dtype == "pred":
        return 1
    m = re.match(r"[a-z]+?(\d+)", hlo_dtype)
    return int(m[1]) / 8 if m else 4


_TYPE = r"(?P<dtype>\w+)\[(?P<dims>[\d,]*)\]"
_PARAM = re.compile(
    rf"%(?P<name>\S+) = {_TYPE}\S* parameter\((?P<k>\d+)\)"
    r"(?:.*op_name=\"(?P<op>(?:[^\"\\]|\\.)*)\")?"
)
_COPY = re.compile(rf"= {_TYPE}\S* copy(?:-start)?\(%(?P<src>[^\s,)]+)")
# A fusion XLA names after a copy at its root (``bitcast_copy_fusion``): the
# copy of a bitcast (a reshape) of its operand.
_COPY_FUSION = re.compile(rf"%\S*copy\S* = {_TYPE}\S* fusion\(%(?P<src>[^\s,)]+)\)")
_BITCAST = re.compile(r"%(?P<name>\S+) = \S+ bitcast\(%(?P<src>[^\s,)]+)\)")


def _entry(text: str) -> list[str]:
    """The lines of the HLO module's entry computation."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("ENTRY"):
            body = []
            for inner in lines[i + 1 :]:
                if inner.startswith("}"):
                    break
                body.append(inner.strip())
            return body
    return []


def table_copies(compiled: Any, *, min_bytes: int = 1 << 20) -> list[TableCopy]:
    """The arguments of a compiled step that it copies whole, each step.

    Read from the compiled HLO: a ``copy`` of an entry parameter (or of a
    reshape of it, also inside a fusion) of at least ``min_bytes`` bytes
    (smaller copies cost little). An empty list means the
    step updates its tables in place.

    Args:
      compiled: ``jax.jit(step, donate_argnums=...).lower(*args).compile()``
        (a ``jax.stages.Compiled``; a ``Lowered`` is compiled here), or the
        same from ``nnx.jit`` or ``eqx.filter_jit``.
      min_bytes: the smallest copy reported.

    Returns:
      One :class:`TableCopy` per copied argument, largest first.

    Example:
      >>> import functools, jax, jax.numpy as jnp, jaxslices
      >>> def step(table, ids):
      ...     return jaxslices.scatter_add(table, jaxslices.IndexedSlices(
      ...         jnp.ones((2, 8)), ids, table.shape))
      >>> table, ids = jnp.zeros((100_000, 8)), jnp.array([3, 7])
      >>> copied = jax.jit(step).lower(table, ids).compile()
      >>> jaxslices.table_copies(copied)  # doctest: +NORMALIZE_WHITESPACE
      [TableCopy(argument='table', shape=(100000, 8), dtype='f32',
                 nbytes=3200000, donated=False)]
      >>> donated = jax.jit(step, donate_argnums=0).lower(table, ids).compile()
      >>> jaxslices.table_copies(donated)
      []
    """
    compiled = _unwrap(compiled)
    body = _entry(compiled.as_text() or "")
    params = {}
    for line in body:
        m = _PARAM.match(line)
        if m:
            params[m["name"]] = m
    bitcasts = {}
    for line in body:
        b = _BITCAST.match(line)
        if b:
            bitcasts[b["name"]] = b["src"]

    def source(name: str) -> str:  # through bitcasts (reshapes): the same buffer
        for _ in range(len(bitcasts) + 1):
            if name not in bitcasts:
                break
            name = bitcasts[name]
        return name

    infos = jax.tree.leaves(getattr(compiled, "args_info", ()))
    out, seen = [], set()
    for line in body:
        c = _COPY.search(line) or _COPY_FUSION.search(line)
        src = None if c is None else source(c["src"])
        if src is None or src not in params or src in seen:
            continue
        p = params[src]
        if math.prod(int(d) for d in c["dims"].split(",") if d) != math.prod(
            int(d) for d in p["dims"].split(",") if d
        ):
            continue  # a part of it, not the whole argument
        c = {"src": src}
        shape = tuple(int(d) for d in p["dims"].split(",") if d)
        nbytes = math.ceil(math.prod(shape) * _itemsize(p["dtype"]))
        if nbytes < min_bytes:
            continue
        seen.add(src)
        k = int(p["k"])
        name = (p["op"] or "").replace("\\'", "'") or f"parameter {k}"
        donated = _donated(infos, k, shape, aligned=len(params) == len(infos))
        out.append(TableCopy(name, shape, p["dtype"], nbytes, donated))
    return sorted(out, key=lambda t: -t.nbytes)


def _unwrap(obj: Any) -> jax.stages.Compiled:
    """JAX's ``Compiled`` from it, a ``Lowered``, or Flax's / Equinox's wrapper."""
    given = obj
    for _ in range(4):
        if isinstance(obj, jax.stages.Compiled):
            return obj
        if isinstance(obj, jax.stages.Lowered):
            obj = obj.compile()
            continue
        inner = getattr(obj, "compiled", None)  # nnx.jit's and eqx.filter_jit's
        if inner is None or callable(inner) and not hasattr(inner, "as_text"):
            break
        obj = inner
    raise TypeError(
        "table_copies: expected a compiled step, `jax.jit(step, "
        "donate_argnums=...).lower(*args).compile()` (or nnx.jit's, "
        f"eqx.filter_jit's), got {type(given).__name__}."
    )


def _donated(
    infos: list[Any], k: int, shape: tuple[int, ...], *, aligned: bool
) -> bool:
    """Whether entry parameter ``k`` (of ``shape``) was donated.

    JAX passes the arguments' leaves in order, but drops unused ones (its
    default ``keep_unused=False``), and then parameter ``k`` need not be leaf
    ``k``. So position decides only when every leaf is a parameter
    (``aligned``) and the shapes agree; else the leaves of that shape decide,
    donated only if all of them are.
    """
    if aligned and k < len(infos) and tuple(infos[k].shape) == shape:
        return bool(infos[k].donated)
    same = [i for i in infos if tuple(i.shape) == shape]
    return bool(same) and all(i.donated for i in same)
