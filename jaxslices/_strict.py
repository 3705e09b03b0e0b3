"""Strict mode: a table that would get a dense gradient raises, at trace time.

A table read only through the jaxslices lookups gets a sparse gradient under
the jaxslices gradient functions. Everything else still works but gives the
table JAX's dense ``(V, ...)`` gradient, silently: a stock ``jax.grad`` /
``nnx.grad`` / ``eqx.filter_grad``, a cast of the params before ``apply``, a
direct read (``table[ids]``, ``jnp.take``, a stock embedding layer), a second
use of the table (tied weights), a lookup inside ``scan``. Strict mode turns
each into a :class:`DenseGradientError` that names the table, the reason and
the fix. Two switches, either enough:

* **the gradient functions** (``strict=True`` on
  :func:`jaxslices.value_and_grad` / :func:`~jaxslices.grad`, the NNX and
  Equinox ones): every float leaf of the differentiated arguments that is
  looked up or read by indexing must get a sparse gradient (:func:`raise_if_dense`,
  from what the wrapper's discovery and probe traces saw, see
  :func:`findings`);
* **the layers and lookups** (``strict=True`` on the jaxslices layers,
  :func:`jaxslices.embedding_lookup`, :func:`jaxslices.embedding_bag`): the
  lookup's dense gradient rule raises when JAX runs it
  (:func:`on_dense_lookup`, called by the lookup's ``custom_vjp`` forward
  rule, which JAX runs only when it differentiates the table: under a stock
  gradient function, or a jaxslices one that fell back to dense).

Both raise while JAX traces the step: never at run time, never silently.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = [
    "DenseGradientError",
    "raise_if_dense",
    "differentiating",
    "findings",
    "on_dense_lookup",
]


class DenseGradientError(TypeError):
    """A table would get a dense gradient in strict mode (raised at trace time).

    The message names the table, why its gradient would be dense and how to
    keep it sparse. Turn strict mode off (``strict=False``, the default) to
    accept the dense gradient, which is always correct.
    """


DenseGradientError.__module__ = "jaxslices"  # its public name


# What reads a table, as the probe's jaxpr shows it.
INDEXING = frozenset({"gather", "dynamic_slice"})
"""Primitives that read rows of an array: a table read by indexing."""
ALIASES = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})
"""Primitives whose result is the same table in another form (a cast)."""


# ------------------------------------------------------------ the jaxpr walk


def _sub_jaxprs(eqn: Any) -> Iterator[Any]:
    """The jaxprs an equation calls (pjit, scan, cond branches, custom rules...)."""
    for name, value in eqn.params.items():
        if name == "cond_jaxpr":  # a while loop's predicate: booleans only
            continue
        for v in value if isinstance(value, tuple | list) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(getattr(v, "jaxpr", None), "eqns"):
                yield v.jaxpr


def findings(jaxpr: Any, watched: Mapping[int, int]) -> dict[int, set[tuple]]:
    """How each watched variable is used: ``{leaf: {(primitive, via), ...}}``.

    ``watched`` maps ``id(var)`` of the jaxpr's input variables to leaf
    numbers. A use is the primitive that consumes the variable, or a cast of
    it (``via`` then names the cast's primitive), looking inside the jaxprs
    that equations call (an inner ``jit``, ``jnp.take``'s own ``jit``,
    ``scan``, ``cond``, custom rules) with their inputs mapped to the
    caller's; ``stop_gradient`` is no use (it is how the tap mechanism reads
    a sparse table).
    """
    out: dict[int, set[tuple]] = {}
    _walk(jaxpr, {k: (leaf, None) for k, leaf in watched.items()}, out)
    return out


def _walk(jaxpr: Any, tracked: dict[int, tuple[int, str | None]], out: dict) -> None:
    for eqn in jaxpr.eqns:
        hits = [tracked[id(v)] for v in eqn.invars if id(v) in tracked]
        if not hits:
            continue
        name = eqn.primitive.name
        if name == "stop_gradient":
            continue
        if name in ALIASES:
            leaf, via = hits[0]
            for v in eqn.outvars:
                tracked[id(v)] = (leaf, via or name)
            continue
        subs = list(_sub_jaxprs(eqn))
        if not subs:
            for leaf, via in hits:
                out.setdefault(leaf, set()).add((name, via))
            continue
        for sub in subs:
            k = len(sub.invars)
            outer = eqn.invars[len(eqn.invars) - k :] if k <= len(eqn.invars) else ()
            inner = {
                id(iv): tracked[id(ov)]
                for iv, ov in zip(sub.invars, outer, strict=True)
                if id(ov) in tracked
            }
            if inner:
                _walk(sub, inner, out)


# ------------------------------------------------------------ the messages

_FIX_LOOKUP = (
    "read it only through jaxslices.embedding_lookup / embedding_bag, or swap "
    "in the jaxslices layer (jaxslices.nnx.Embed / EmbedBag, "
    "jaxslices.linen.Embed / EmbedBag, jaxslices.equinox.Embedding / "
    "EmbeddingBag)"
)


def _reason(uses: set[tuple], looked_up: bool) -> str:
    """One table's reason and fix, from its uses (see :func:`findings`)."""
    casts = sorted({via for p, via in uses if via and p in INDEXING})
    if casts:
        return (
            f"it is cast (`{casts[0]}`, e.g. `table.astype(jnp.bfloat16)` or a "
            "`jax.tree.map` of the params before `apply`) before it is read, and "
            "the cast's gradient is dense. Fix: pass the parameter itself and "
            "ask the lookup or layer for the compute dtype (`dtype=`): the cast "
            "then happens after the gather, on the looked-up rows"
        )
    prims = sorted({p for p, _ in uses})
    if looked_up and not set(prims) & INDEXING:
        return (
            f"besides its jaxslices lookups it is also used by `{'`, `'.join(prims)}` "
            "(tied input and output embeddings, `attend`, a regulariser on the "
            "whole table), and that use's gradient is dense. Fix: use the table "
            "only through the lookups (e.g. regularise the looked-up rows), or "
            "leave strict mode off for this model: the dense gradient is exact"
        )
    return (
        f"it is read by indexing (`{'`, `'.join(sorted(set(prims) & INDEXING))}`: "
        "`table[ids]`, `jnp.take`, a stock `nnx.Embed` / `nn.Embed` / "
        f"`eqx.nn.Embedding`), whose gradient is dense. Fix: {_FIX_LOOKUP}"
    )


_NESTED = (
    "it is looked up inside a nested transformation (`jax.lax.scan`, `cond`, "
    "`while_loop`, an inner `jax.jit`, `jax.checkpoint`), where the sparse "
    "mechanism cannot see the lookup. Fix: look the ids up at the loss's top "
    "level (e.g. all of a scan's ids before the scan, then scan over the rows), "
    "or use the opt-in native backend (jaxslices.native), which handles scan"
)


def raise_if_dense(
    where: str,
    labels: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    nested: Sequence[int],
    looked_up: set[int],
    uses: Mapping[int, set[tuple]],
) -> None:
    """Raise if a table of the differentiated arguments would get a dense gradient.

    A table here is a leaf that is looked up (and did not stay sparse) or is
    read by indexing; ``uses`` (from :func:`findings`) holds how the leaves
    that did not stay sparse are used, ``nested`` the leaves looked up in a
    nested transformation.
    """
    problems = []
    for k in sorted(set(nested) | set(uses)):
        if k in nested:
            reason = _NESTED
        else:
            u = uses[k]
            indexed = any(p in INDEXING for p, _ in u)
            if k not in looked_up and not indexed:
                continue  # an ordinary dense parameter (a kernel, a bias)
            reason = _reason(u, k in looked_up)
        problems.append(f"  * {labels[k]} (shape {shapes[k]}): {reason}.")
    if problems:
        raise DenseGradientError(
            f"{where}(strict=True): {len(problems)} "
            f"{'table' if len(problems) == 1 else 'tables'} would get a dense "
            "gradient:\n" + "\n".join(problems) + "\nWithout strict=True the "
            "gradient is JAX's exact dense one; see docs/sparse_gradients.md."
        )


# ------------------------------------------------ the lookups' dense rule


@dataclasses.dataclass(frozen=True)
class _Context:
    strict: bool
    where: str


class _State(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Context] = []


_STATE = _State()


@contextmanager
def differentiating(strict: bool, where: str) -> Iterator[None]:
    """A jaxslices gradient function is differentiating (its dense pass)."""
    _STATE.stack.append(_Context(strict, where))
    try:
        yield
    finally:
        _STATE.stack.pop()


_STOCK = (
    "embedding lookup (strict=True): JAX's own gradient is differentiating this "
    "table (`jax.grad`, `jax.value_and_grad`, `nnx.grad`, `nnx.value_and_grad`, "
    "`eqx.filter_grad`, `eqx.filter_value_and_grad` ...), which gives it a dense "
    "{shape} gradient. Fix: use the jaxslices gradient function with the same "
    "arguments: jaxslices.value_and_grad / grad, jaxslices.nnx.value_and_grad / "
    "grad, jaxslices.equinox.filter_value_and_grad / filter_grad."
)

_INSIDE = (
    "embedding lookup (strict=True) under {where}: this table gets JAX's dense "
    "{shape} gradient. Either the array the lookup reads is not a parameter "
    "leaf itself but computed from one (a cast such as "
    "`jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)` before `apply`, "
    "a scaling, a slice), or the table is also used another way (tied weights, "
    "`attend`) or looked up inside `scan` / `cond` / an inner `jit`. Fix: pass "
    "the parameter itself to the lookup (`dtype=` for a compute dtype) and read "
    "it only through the lookups; {where}(..., strict=True) names the table "
    "and the reason."
)


def on_dense_lookup(shape: tuple[int, ...], strict: bool) -> None:
    """The dense gradient rule of a lookup is about to run: raise if strict.

    Called by the lookup's ``custom_vjp`` forward rule, which JAX runs only
    when it differentiates the table. ``strict``: the lookup's own switch;
    the active jaxslices gradient function's switch counts too.
    """
    ctx = _STATE.stack[-1] if _STATE.stack else None
    if not (strict or (ctx is not None and ctx.strict)):
        return
    shape = tuple(int(d) for d in shape)
    if ctx is None:
        raise DenseGradientError(_STOCK.format(shape=shape))
    raise DenseGradientError(_INSIDE.format(where=ctx.where, shape=shape))
