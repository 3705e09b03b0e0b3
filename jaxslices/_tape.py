"""Internal: the tap backend of ``value_and_grad`` (the default, and only one).

``value_and_grad`` talks to it through four functions, so that another backend
(JAX's backward-pass logs, when they ship) is one module with the same four:

* :func:`discover` (``jax.eval_shape``): which float leaves the loss looks up at
  its top level (or below ``vmap``s only), with the shapes of their ids; leaves
  looked up in other nested scopes (``scan``, ``cond``, inner ``jit``,
  ``checkpoint``) are left dense. Returns a :class:`Lookups`.
* :func:`probe` (``jax.make_jaxpr``): each lookup read as
  ``stop_gradient(table)[ids] + tap``; a table whose jaxpr variable feeds
  anything else is read some other way and is dropped.
* :func:`run`: ``jax.value_and_grad`` with respect to the dense leaves and the
  taps, each lookup read as ``table[ids] + tap`` (the table is a constant to
  this differentiation, not to an outer one): the cotangent of a tap is exactly
  the rows' gradient.
* :func:`pack`: the taps' cotangents and ids as one ``IndexedSlices`` per table.

``embedding_lookup`` reaches the active tape through :func:`lookup`. Active
tapes live on a per-thread stack: JAX traces in the calling thread (also under
``jax.jit``) and keeps its own trace state per thread, so concurrent traces in
several threads never see each other's tapes.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from . import _jax_compat, _strict
from . import _recipe as recipes
from . import slices as slices_mod
from ._recipe import PooledGradient, flat_rows
from .kernels import _path as kernel_path
from .slices import IndexedSlices

trace_state = _jax_compat.trace_state


@dataclasses.dataclass
class LookupRecord:
    leaf: int
    ids_shape: tuple[int, ...]
    row_shape: tuple[int, ...]
    dtype: Any
    # Mesh axes (inside ``shard_map`` with ``check_vma``) over which the ids
    # vary but the table does not: see ``_varying_axes``.
    axes: tuple[str, ...] = ()
    # A bag lookup (``Tape.bag``): its tap is the pooled output, of this
    # shape (``None``: a lookup of rows, tapped per id).
    pooled: tuple[int, ...] | None = None

    @property
    def tap_shape(self) -> tuple[int, ...]:
        return (
            self.pooled if self.pooled is not None else self.ids_shape + self.row_shape
        )


@dataclasses.dataclass
class Tape:
    """State of one pass of ``value_and_grad`` over the loss."""

    mode: str  # "discover" or "tap"
    candidates: list[Any]  # leaf objects (tracers or arrays), compared with `is`
    state: Any = None  # opaque token of the loss's top-level trace
    trace: Any = None  # the trace itself (private JAX; see _jax_compat)
    records: list[LookupRecord] = dataclasses.field(default_factory=list)
    # Leaves that take JAX's dense gradient: looked up in a nested scope, or
    # somewhere JAX's types could not be read (see ``_varying_axes``).
    dense: set[int] = dataclasses.field(default_factory=set)
    # tap mode
    sparse_leaves: frozenset[int] = frozenset()
    taps: list[Any] = dataclasses.field(default_factory=list)
    expected: list[LookupRecord] = dataclasses.field(default_factory=list)
    ids: list[Any] = dataclasses.field(default_factory=list)
    rows: list[Any] = dataclasses.field(default_factory=list)  # the gathers
    # per lookup: a bag's (weight, scale, bag ids) or None (a lookup of rows)
    bags: list[Any] = dataclasses.field(default_factory=list)
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

    def bag(self, table: Any, ids: jax.Array, bag: BagLookup) -> Any:
        """Handle a bag lookup tapped at its pooled output (native path).

        Returns the pooled rows (tapped at the loss's top level), ``None``
        when no tape is interested in ``table`` (the caller does a plain
        lookup), or :data:`ROWS` below the top level: the caller then looks
        the rows up through :meth:`lookup` (which moves lookups under
        ``vmap`` to the top) and pools them itself.

        ``bag.forward(table)`` computes the pooled rows; the tap's cotangent,
        the pooled gradient ``G``, stands for the rows' gradient
        ``weight[s] * (scale * G)[bag(s)]``, which :func:`pack` hands on as
        a recipe (:mod:`jaxslices.kernels`) without materialising it.
        """
        ks = self.leaves_of(table)
        if not ks or (self.mode == "tap" and not self.sparse_leaves.intersection(ks)):
            return None
        if trace_state() != self.state:
            return ROWS
        if self.mode == "discover":
            self._record(ks, table, ids, bag.dtype, bag.pooled_shape)
            return None
        tap = self._next_tap(ks, ids, bag.pooled_shape)
        if self.sever:
            table = jax.lax.stop_gradient(table)
        pooled = bag.forward(table)
        self.rows.append(pooled)
        self.bags.append((bag.weight, bag.scale, bag.bag))
        return pooled + tap

    def expects_pooled(self, table: Any) -> bool | None:
        """Whether discovery looked the next lookup of ``table`` up as a bag.

        ``None`` where the tape has no say (discovery itself, a table it does
        not watch, below the loss's top level). The path of a bag lookup (the
        pooled native bag or rows) is decided once per ``value_and_grad``, on
        discovery's trace: the native path's gate can answer differently on
        a later trace of the same loss (under an outer ``jax.vmap`` discovery
        sees unbatched ids and the differentiating pass batched ones; JAX
        0.11 gives a tracer the mesh of an earlier eager op on a mesh).
        """
        ks = self.leaves_of(table)
        if self.mode != "tap" or not self.sparse_leaves.intersection(ks):
            return None
        if trace_state() != self.state or self.cursor >= len(self.expected):
            return None
        rec = self.expected[self.cursor]
        return (rec.pooled is not None) if rec.leaf in ks else None

    def _record(self, ks, table, ids, dtype, pooled=None) -> None:
        """Discovery: record a top-level lookup (or make its table dense)."""
        # Discovery traces every candidate as its own tracer: one leaf.
        axes = _varying_axes(ids, table)
        if axes is None:  # unknown to this JAX: its dense gradient
            self.dense.update(ks)
            return
        self.records.append(
            LookupRecord(
                ks[0],
                tuple(ids.shape),
                tuple(table.shape[1:]),
                dtype,
                axes,
                pooled=pooled,
            )
        )

    def _next_tap(self, ks, ids, pooled=None) -> Any:
        """Tap mode: the tap of the next recorded lookup, which this one must be.

        One array object may be bound to several leaves ({"user": z, "item":
        z}): the lookups come in the order discovery recorded them, as bags
        or as lookups of rows, with the same id shapes.
        """
        if self.cursor >= len(self.expected):
            raise RuntimeError(_NONDETERMINISTIC)
        rec = self.expected[self.cursor]
        same = rec.leaf in ks and rec.ids_shape == tuple(ids.shape)
        if not same or rec.pooled != pooled:
            raise RuntimeError(_NONDETERMINISTIC)
        tap = self.taps[self.cursor]
        self.cursor += 1
        self.ids.append(ids)
        return tap

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
        inner ``jax.grad``, or JAX internals unavailable in
        :mod:`jaxslices._jax_compat`) falls back to dense.
        """
        route = _jax_compat.vmap_route(self.trace, ids)
        if route is None:
            if self.mode == "tap":  # the earlier passes saw this lookup on top
                raise RuntimeError(_NONDETERMINISTIC)
            self.dense.update(ks)
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
            self._record(ks, table, ids, table.dtype)
            return None
        tap = self._next_tap(ks, ids)
        if self.sever:
            table = jax.lax.stop_gradient(table)
        rows = gather(table, ids)
        self.rows.append(rows)
        self.bags.append(None)
        return rows + tap


#: What :meth:`Tape.bag` returns below the loss's top level.
ROWS = object()


@dataclasses.dataclass(frozen=True)
class BagLookup:
    """A bag lookup as the tape sees it (see :meth:`Tape.bag`).

    ``forward(table)`` gives the pooled rows ``[B, *row]`` in ``dtype``;
    ``weight`` ``[N]`` and ``scale`` ``[B]`` (or ``None``) in ``dtype``;
    ``bag`` ``[N]`` the bag of each slot (``None``: padded bags of
    ``length`` slots).
    """

    forward: Callable[[Any], Any]
    pooled_shape: tuple[int, ...]
    dtype: Any
    weight: Any
    scale: Any
    bag: Any = None
    length: int = 0


_NONDETERMINISTIC = (
    "jaxslices.value_and_grad: the loss function made different embedding lookups "
    "on different traces. The loss is traced several times (to discover lookups, "
    "then to differentiate); it must make the same lookups, in the same order and "
    "with the same id shapes, every time it is traced. (This also happens when one "
    "array object is both a differentiated leaf and looked up through a variable "
    "the loss closes over: pass it as an argument instead.)"
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


@contextmanager
def _active(tape: Tape) -> Iterator[Tape]:
    tape.state = trace_state()
    tape.trace = _jax_compat.current_trace()
    stack = _STATE.stack
    stack.append(tape)
    try:
        yield tape
    finally:
        stack.pop()


def _varying_axes(ids: Any, table: Any) -> tuple[str, ...] | None:
    """Mesh axes over which ``ids`` vary and ``table`` does not (``None``: unknown).

    Inside ``shard_map`` with ``check_vma=True`` (the default), JAX sums the
    cotangent of an invariant value over the axes its uses vary on. A tap made
    invariant would then receive the *sum over devices* of row gradients whose
    ids differ: wrong. So the tap is made varying over these axes (each device
    keeps its own rows), and ``pack`` all-gathers the slices over them, which
    is JAX's own semantics for the gradient of a replicated parameter (the sum
    over devices), kept sparse.

    ``None`` where this cannot be done right: the varying-axes types are
    unknown to :mod:`jaxslices._jax_compat` (answering "no axes" would be
    wrong under ``check_vma``), or the tap cannot be made varying. The table
    then takes JAX's dense gradient.
    """
    ids_axes = _jax_compat.varying_axes(ids)
    table_axes = _jax_compat.varying_axes(table)
    if ids_axes is None or table_axes is None:
        return None
    axes = tuple(sorted(ids_axes - table_axes))
    if axes and not _jax_compat.AVAILABLE["pcast_varying"]:
        return None
    return axes


def _zeros_tap(rec: LookupRecord) -> jax.Array:
    tap = jnp.zeros(rec.tap_shape, rec.dtype)
    return _jax_compat.pcast_varying(tap, rec.axes) if rec.axes else tap


def lookup(
    table: Any, ids: jax.Array, gather: Callable[[Any, jax.Array], Any]
) -> Any | None:
    """The active tape's version of a lookup, or ``None`` for a plain one."""
    stack = _STATE.stack
    return stack[-1].lookup(table, ids, gather) if stack else None


def expects_pooled(table: Any) -> bool | None:
    """The active tape's path for the next bag lookup of ``table`` (or ``None``).

    See :meth:`Tape.expects_pooled`: a bag lookup asks this before the native
    path's gate, so that every trace of one ``value_and_grad`` takes the path
    its discovery took.
    """
    stack = _STATE.stack
    return stack[-1].expects_pooled(table) if stack else None


def bag(table: Any, ids: jax.Array, lookup: BagLookup) -> Any:
    """The active tape's version of a bag lookup (:meth:`Tape.bag`), or ``None``."""
    stack = _STATE.stack
    return stack[-1].bag(table, ids, lookup) if stack else None


# ------------------------------------------------- the interface value_and_grad uses

Call = Callable[[Sequence[Any]], Any]
"""Runs the loss with the given values for the differentiated leaves."""


@dataclasses.dataclass(frozen=True)
class Lookups:
    """The leaves that get sparse gradients and their lookups, in call order.

    For strict mode (``jaxslices/_strict.py``) it also says why other leaves
    are dense: ``looked_up``, every leaf a lookup read at all; ``nested``, the
    leaves looked up in a nested scope; ``uses``, how the probe saw the
    dropped tables and the watched leaves used (``_strict.findings``).
    """

    sparse: tuple[int, ...]
    records: tuple[LookupRecord, ...]
    looked_up: frozenset[int] = frozenset()
    nested: frozenset[int] = frozenset()
    uses: Mapping[int, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Tapped:
    """What :func:`run` hands to :func:`pack`: one entry per recorded lookup."""

    cts: list[Any]  # the taps' cotangents: the rows' (or pooled) gradients
    ids: list[Any]  # the ids, in [0, V] (V: padding)
    rows: list[Any]  # the forward gathers (pooled rows for a bag)
    bags: list[Any]  # per lookup: a bag's (weight, scale, bag ids), or None


def discover(call: Call, leaves: Sequence[Any], others: Sequence[Any] = ()) -> Lookups:
    """Trace the loss abstractly and record its top-level lookups.

    ``others``: the leaves of the arguments that are not differentiated. A
    differentiated leaf that is also one of them (the same object) stays dense:
    the lookups recognise tables by identity, so its two roles could not be
    told apart.
    """
    shared = {id(x) for x in others}
    candidates = [
        k
        for k, x in enumerate(leaves)
        if hasattr(x, "dtype")
        and jnp.issubdtype(x.dtype, jnp.inexact)
        and id(x) not in shared
    ]
    tape = Tape("discover", candidates=[])

    def fn(*cands):
        values = list(leaves)
        for k, c in zip(candidates, cands, strict=True):
            values[k] = c
        tape.candidates = values
        with _active(tape):
            call(values)

    if candidates:
        jax.eval_shape(fn, *[leaves[k] for k in candidates])
    looked_up = {r.leaf for r in tape.records}
    sparse = tuple(sorted((looked_up - tape.dense) & set(candidates)))
    return Lookups(
        sparse,
        tuple(r for r in tape.records if r.leaf in sparse),
        looked_up=frozenset(looked_up | tape.dense),
        nested=frozenset(tape.dense),
    )


def _run_tapped(call, leaves, lookups, replace, replacements, taps, sever):
    """Run the loss with some leaves replaced and its lookups tapped."""
    values = list(leaves)
    for k, v in zip(replace, replacements, strict=True):
        values[k] = v
    tape = Tape(
        "tap",
        candidates=values,
        sparse_leaves=frozenset(lookups.sparse),
        taps=list(taps),
        expected=list(lookups.records),
        sever=sever,
    )
    with _active(tape):
        out = call(values)
    if tape.cursor != len(lookups.records):
        raise RuntimeError(_NONDETERMINISTIC)
    return out, tape


def probe(
    call: Call,
    leaves: Sequence[Any],
    lookups: Lookups,
    has_aux: bool,
    watch: Sequence[int] = (),
) -> Lookups:
    """Keep the tables the loss reads through their lookups only.

    ``watch`` (strict mode): further leaves whose uses the returned :class:`Lookups`
    reports in ``uses`` (with those of the dropped tables); they are inputs
    of the probe's jaxpr too, so a probe runs even without a sparse table.
    """
    watch = [k for k in watch if k not in lookups.sparse]
    if not lookups.sparse and not watch:
        return lookups
    replace = [*lookups.sparse, *watch]

    def fn(values, taps):
        out, _ = _run_tapped(call, leaves, lookups, replace, values, taps, True)
        return out[0] if has_aux else out

    taps = [_zeros_tap(r) for r in lookups.records]
    closed = jax.make_jaxpr(fn)([leaves[k] for k in replace], taps)
    invars = closed.jaxpr.invars[: len(replace)]
    table_vars = invars[: len(lookups.sparse)]
    sparse = tuple(
        k
        for k, var in zip(lookups.sparse, table_vars, strict=True)
        if _uses_only_stop_gradient(closed.jaxpr, var)
    )
    uses = {}
    if watch:  # strict mode: how every leaf that is not sparse is used
        dense = {id(v): k for k, v in zip(replace, invars, strict=True)}
        dense = {i: k for i, k in dense.items() if k not in sparse}
        uses = _strict.findings(closed.jaxpr, dense)
    return dataclasses.replace(
        lookups,
        sparse=sparse,
        records=tuple(r for r in lookups.records if r.leaf in sparse),
        uses=uses,
    )


def _uses_only_stop_gradient(jaxpr: Any, var: Any) -> bool:
    """True if ``var`` feeds nothing but ``stop_gradient`` at top level."""
    if any(var is v for v in jaxpr.outvars):
        return False
    for eqn in jaxpr.eqns:
        if any(var is v for v in eqn.invars) and eqn.primitive.name != "stop_gradient":
            return False
    return True


def run(
    call: Call, leaves: Sequence[Any], lookups: Lookups, has_aux: bool
) -> tuple[tuple[Any, Any], dict[int, Any], Tapped]:
    """Differentiate: ``((value, aux), {dense leaf: gradient}, tapped lookups)``."""
    dense = [k for k in range(len(leaves)) if k not in lookups.sparse]
    taps = [_zeros_tap(r) for r in lookups.records]

    def fn(dense_values, taps):
        out, tape = _run_tapped(call, leaves, lookups, dense, dense_values, taps, False)
        value, aux = out if has_aux else (out, None)
        return value, (aux, tape.ids, tape.rows, tape.bags)

    (value, (aux, ids, rows, bags)), (g_dense, g_taps) = jax.value_and_grad(
        fn, argnums=(0, 1), has_aux=True
    )([leaves[k] for k in dense], taps)
    g_dense = dict(zip(dense, g_dense, strict=True))
    return (value, aux), g_dense, Tapped(g_taps, ids, rows, bags)


def pack(
    lookups: Lookups, tapped: Tapped, leaves: Sequence[Any]
) -> dict[int, IndexedSlices]:
    """One ``IndexedSlices`` per sparse leaf: its lookups, concatenated."""
    out = {}
    for k in lookups.sparse:
        mine = [j for j, r in enumerate(lookups.records) if r.leaf == k]
        s = _pack(
            [tapped.cts[j] for j in mine],
            [tapped.ids[j] for j in mine],
            [tapped.rows[j] for j in mine],
            tuple(leaves[k].shape),
            [tapped.bags[j] for j in mine],
            [lookups.records[j] for j in mine],
            leaves[k].dtype,
        )
        axes = tuple(sorted({a for j in mine for a in lookups.records[j].axes}))
        if axes:  # shard_map(check_vma=True): the sum over devices, as slices
            values = _jax_compat.all_gather_invariant(s.values, axes)
            indices = _jax_compat.all_gather_invariant(s.indices, axes)
            s = IndexedSlices(values, indices, s.dense_shape)
        out[k] = s
    return out


def _pack(cts, ids, rows, shape, bags, records, dtype) -> IndexedSlices:
    """Concatenate the taps' cotangents and ids (already in ``[0, V]``).

    ``rows`` are the forward gathers of the table (zeros at padding slots).
    The values are made to depend on them: the padding slots' zeros are taken
    as ``0 * rows`` there. An in-place update of the table (donated params)
    then depends on every read of it through the lookups. Without that, a loss
    linear in the rows has a gradient that does not depend on them, nothing
    orders the gather before the scatter, and XLA copies the whole table to
    keep the gather's input alive (``lax.optimization_barrier`` with an unused
    output does not help: XLA drops it before copy insertion).

    A bag lookup's tap is its pooled output: its rows' gradient is made here
    from the pooled gradient (``weight * (scale * G)[bag]``, the order JAX's
    own transpose of the pooling computes it in), and the slices also carry
    it unmade, as a recipe, for the native kernels (:mod:`jaxslices.kernels`).
    """
    num_rows = shape[0]
    parts, pieces = [], []
    for ct, i, read, bag, rec in zip(cts, ids, rows, bags, records, strict=True):
        flat_ids = i.reshape(-1)
        if bag is None:
            values = ct.reshape(-1, *shape[1:])
            read = read.reshape(-1, *shape[1:])
            pieces.append(None)
        else:
            values, read, piece = _unpool(ct, read, bag, rec, flat_ids.shape[0])
            pieces.append(piece)
        parts.append((flat_ids, values.astype(dtype), read))
    flat_ids = jnp.concatenate([p[0] for p in parts])
    values = jnp.concatenate([p[1] for p in parts])
    read = jnp.concatenate([p[2] for p in parts])
    valid = flat_ids < num_rows  # padding slots (V) get zero values
    mask = valid.reshape(valid.shape + (1,) * (values.ndim - 1))
    values = jnp.where(mask, values, jnp.zeros((), values.dtype) * read)
    out = IndexedSlices(values, flat_ids, shape)
    recipe = _recipe(pieces, dtype)
    return out if recipe is None else slices_mod.with_recipe(out, recipe)


def _unpool(ct, pooled, bag, rec, num_slots):
    """A bag's per-slot gradient ``[N, *row]`` (and what it read) from ``G``."""
    weight, scale, bag_ids = bag
    g = ct.reshape(-1, *rec.row_shape)  # [B, *row], in the compute dtype
    if scale is not None:
        g = g * scale.reshape(scale.shape + (1,) * (g.ndim - 1))
    expand = (1,) * len(rec.row_shape)
    if bag_ids is None:  # padded bags: slot s is in bag s // L
        length = num_slots // max(g.shape[0], 1)
        per_slot = jnp.repeat(g, length, axis=0, total_repeat_length=num_slots)
        read = jnp.repeat(
            pooled.reshape(g.shape), length, axis=0, total_repeat_length=num_slots
        )
    else:
        per_slot = g.at[bag_ids].get(mode="fill", fill_value=0)
        read = pooled.reshape(g.shape).at[bag_ids].get(mode="fill", fill_value=0)
        length = 0
    values = per_slot * weight.reshape(weight.shape + expand)
    piece = (g, bag_ids, length, weight)
    return values, jnp.zeros((), read.dtype) * read, piece


def _recipe(pieces, dtype) -> PooledGradient | None:
    """The recipe of concatenated lookups, if every one is a bag of a dtype the
    kernels read (float32; bfloat16 and float16, widened to float32)."""
    kinds = kernel_path.TABLE_DTYPES
    if any(p is None for p in pieces) or jnp.dtype(dtype) not in kinds:
        return None
    if any(jnp.dtype(p[0].dtype) not in kinds for p in pieces):
        return None
    parts = [
        (
            PooledGradient(flat_rows(g), bag=bag_ids, length=length, weight=weight),
            weight.shape[0],
        )
        for g, bag_ids, length, weight in pieces
    ]
    return recipes.concatenate(parts)
