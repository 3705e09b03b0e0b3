"""Internal: the "tape" that connects embedding lookups to ``value_and_grad``.

This is the one small interface behind which the sparse-gradient mechanism
lives (see ``docs/sparse_gradients.md``). ``embedding_lookup`` asks the active
tape, if any, to handle a lookup; ``value_and_grad`` runs the loss under a tape
in one of two modes:

* ``discover``: record which parameter leaves are looked up at the loss's top
  level (or below ``vmap``s only), with the shapes of their ids; mark leaves
  seen in other nested scopes (``scan``, ``cond``, inner ``jit``,
  ``checkpoint``) as dense.
* ``tap``: replace each recorded lookup by ``table[ids] + tap``, so that the
  cotangent of ``tap`` is exactly the row gradient, and collect the ids (the
  probe reads ``stop_gradient(table)[ids] + tap`` instead, to see other uses).

A future backend (JAX's backward-pass logs) would replace this module only.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from . import _jax_private

try:  # public since JAX 0.4.36 (stackless tracing)
    from jax.extend.core import get_opaque_trace_state as _trace_state
except ImportError:  # pragma: no cover - older or newer layouts
    from jax._src.core import get_opaque_trace_state as _trace_state


def trace_state() -> Any:
    """An opaque token for the current trace, comparable with ``==``."""
    return _trace_state(convention="jaxslices")


@dataclasses.dataclass
class LookupRecord:
    leaf: int
    ids_shape: tuple[int, ...]
    row_shape: tuple[int, ...]
    dtype: Any


@dataclasses.dataclass
class Tape:
    """State of one pass of ``value_and_grad`` over the loss."""

    mode: str  # "discover" or "tap"
    candidates: list[Any]  # leaf objects (tracers or arrays), compared with `is`
    state: Any = None  # opaque token of the loss's top-level trace
    trace: Any = None  # the trace itself (private JAX; see _jax_private)
    records: list[LookupRecord] = dataclasses.field(default_factory=list)
    nested: set[int] = dataclasses.field(default_factory=set)
    # tap mode
    sparse_leaves: frozenset[int] = frozenset()
    taps: list[Any] = dataclasses.field(default_factory=list)
    expected: list[LookupRecord] = dataclasses.field(default_factory=list)
    ids: list[Any] = dataclasses.field(default_factory=list)
    rows: list[Any] = dataclasses.field(default_factory=list)  # the gathers
    cursor: int = 0
    # Probe only: read the table through ``stop_gradient`` so that any other use
    # of it shows in the jaxpr. The differentiating pass reads it directly: the
    # inner differentiation is only with respect to the taps (the table is a
    # constant to it), while an outer ``jax.grad``/``jax.jvp`` of the table still
    # flows through the gather (higher-order AD, gradient penalties, MAML).
    sever: bool = False

    def leaves_of(self, table: Any) -> list[int]:
        """The candidate leaves that are ``table`` (one array may be several)."""
        return [k for k, leaf in enumerate(self.candidates) if leaf is table]

    def lookup(
        self, table: Any, ids: jax.Array, gather: Callable[[Any, jax.Array], Any]
    ) -> Any | None:
        """Handle a lookup, or return ``None`` to let the caller do a plain one.

        ``ids`` are already mapped into ``[0, V]`` (``V``: padding) and of the
        index dtype; ``gather(table, ids)`` reads zeros for padding.
        """
        ks = self.leaves_of(table)
        if not ks or (self.mode == "tap" and not self.sparse_leaves.intersection(ks)):
            return None
        if trace_state() == self.state:
            return self._top_level(ks, table, ids, gather)
        return self._below_top(ks, table, ids, gather)

    def _below_top(self, ks, table, ids, gather):
        """A lookup below the top level: sparse if only ``vmap``s lie between.

        A tap closed over by a ``scan`` body or a ``vmap``ped function would
        receive a sum over iterations or batch elements while the ids differ.
        If every trace between this lookup and the loss's top level is a
        ``jax.vmap`` (Equinox-style per-example code, nested ``vmap``s of any
        depth and ``in_axes``), the lookup is moved up to the top level:

        * ids batched by none of those ``vmap``s (the same ids for every batch
          element): the lookup's operations run at the top level already, so
          it is tapped here (the tap's cotangent is the sum over the batch of
          identical rows' gradients, which is right);
        * otherwise a ``custom_vmap`` function, whose batching rule receives
          the whole batch of ids one level up, where this is repeated.

        Anything else (``scan``, ``cond``, inner ``jit``, ``checkpoint``, an
        inner ``jax.grad``, or JAX internals unknown to
        :mod:`jaxslices._jax_private`) falls back to dense.
        """
        route = _jax_private.vmap_route(self.trace, ids)
        if route is None:
            if self.mode == "tap":  # the earlier passes saw this lookup on top
                raise RuntimeError(_NONDETERMINISTIC)
            self.nested.update(ks)
            return None
        if not route:
            return self._top_level(ks, table, ids, gather)

        @custom_vmap
        def lookup(ids):
            return gather(table, ids)

        @lookup.def_vmap
        def rule(axis_size, in_batched, ids):
            if trace_state() == self.state:
                out = self._top_level(ks, table, ids, gather)
            else:
                out = self._below_top(ks, table, ids, gather)
            return (gather(table, ids) if out is None else out), True

        return lookup(ids)

    def _top_level(self, ks, table, ids, gather):
        if self.mode == "discover":
            # Discovery traces every candidate as its own tracer: one leaf.
            self.records.append(
                LookupRecord(
                    ks[0], tuple(ids.shape), tuple(table.shape[1:]), table.dtype
                )
            )
            return None
        # One array object may be bound to several leaves ({"user": z, "item": z}):
        # the lookups come in the order discovery recorded them.
        if self.cursor >= len(self.expected):
            raise RuntimeError(_NONDETERMINISTIC)
        rec = self.expected[self.cursor]
        if rec.leaf not in ks or rec.ids_shape != tuple(ids.shape):
            raise RuntimeError(_NONDETERMINISTIC)
        tap = self.taps[self.cursor]
        self.cursor += 1
        self.ids.append(ids)
        if self.sever:
            table = jax.lax.stop_gradient(table)
        rows = gather(table, ids)
        self.rows.append(rows)
        return rows + tap


_NONDETERMINISTIC = (
    "jaxslices.value_and_grad: the loss function made different embedding lookups "
    "on different traces. The loss is traced several times (to discover lookups, "
    "then to differentiate); it must make the same lookups, in the same order and "
    "with the same id shapes, every time it is traced. (This also happens when one "
    "array object is both a differentiated leaf and read through a closure or a "
    "non-differentiated argument: pass it once.)"
)


class _State(threading.local):
    """Per-thread stack of active tapes.

    JAX traces a function in the thread that calls it (also under ``jax.jit``),
    and JAX's own trace state is thread-local, so two threads tracing
    ``value_and_grad`` at the same time must not see each other's tapes.
    """

    def __init__(self) -> None:
        self.stack: list[Tape] = []


_STATE = _State()


def current() -> Tape | None:
    stack = _STATE.stack
    return stack[-1] if stack else None


@contextmanager
def active(tape: Tape) -> Iterator[Tape]:
    tape.state = trace_state()
    tape.trace = _jax_private.current_trace()
    stack = _STATE.stack
    stack.append(tape)
    try:
        yield tape
    finally:
        stack.pop()


def zeros_tap(rec: LookupRecord) -> jax.Array:
    return jnp.zeros(rec.ids_shape + rec.row_shape, rec.dtype)
