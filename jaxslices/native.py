"""Experimental: sparse gradients from plain ``jax.grad`` (JAX hijax types).

:func:`jaxslices.value_and_grad` (the default backend) rewrites the loss to get
row-sparse gradients. This module takes another route: it gives the *table* a
new JAX type whose cotangent type is row-sparse, so that JAX's own
``jax.grad``, ``jax.value_and_grad``, ``jax.vjp`` (and framework wrappers built
on them) return a row-sparse gradient for it, also for lookups inside
``lax.scan`` and ``vmap``, from one trace of the loss.

Usage::

    @jax.jit
    def step(params, opt_state, ids, y):
        marked = {**params, "emb": native.mark(params["emb"], capacity=ids.size)}
        loss, g = jax.value_and_grad(loss_fn)(marked, ids, y)
        g = native.to_indexed_slices(g)  # RowSparse leaves -> IndexedSlices
        updates, opt_state = tx.update(g, opt_state, params)
        return jaxslices.apply_updates(params, updates), opt_state, loss

* :func:`mark` wraps a ``(V, ...)`` array into a :class:`SparseTable` with a
  static row ``capacity``. The loss reads it only through :func:`lookup` (or
  :func:`jaxslices.embedding_lookup` / :func:`jaxslices.embedding_bag`, which
  dispatch to :func:`lookup` for a marked table).
* The gradient of a :class:`SparseTable` is a :class:`RowSparse`: ``capacity``
  slots of ``(row, index)``, one slot per looked-up id (duplicates kept, ids
  outside ``[0, V)`` and unused slots are padding with index ``V``, as in
  :class:`~jaxslices.IndexedSlices`). :func:`to_indexed_slices` turns every
  ``RowSparse`` in a tree into an :class:`~jaxslices.IndexedSlices`, which the
  jaxslices transforms and :func:`~jaxslices.apply_updates` take.

Capacity (never silently wrong): every id looked up from a table in one
gradient computation takes one slot, whether the lookups are at top level,
under ``vmap`` (the whole batch) or inside ``lax.scan`` (every step). If they
need more slots than ``capacity``, you get an error, never a truncated
gradient: at trace time where the shapes decide it (one lookup, or several
lookups added in one backward pass), otherwise (``scan``) when the gradient is
read by :func:`to_indexed_slices` / :meth:`RowSparse.to_dense` (a
``jax.debug.callback`` under ``jit``, like :func:`jaxslices.check_ids`).

Not supported, each raising a :class:`NativeBackendError` that names the
limit and the default backend: reading a marked table other than through
:func:`lookup` (e.g. ``table @ x``, tied output embeddings), ``jax.checkpoint``
around a lookup, forward-mode AD (``jax.jvp``), ``vmap`` over a batch of
tables. Shardings are not modelled on the types (no ``shard_map``/explicit
sharding support; JAX raises its own error). This module needs JAX >= 0.10.2
and < 0.13 (tested on 0.10.2 and 0.12.0.1; see ``jaxslices/_hijax.py``);
importing it on another JAX raises ``UnsupportedJaxError`` (an
``ImportError``) naming the default backend.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _backend, _hijax
from .slices import IndexedSlices

_hijax.require()

__all__ = [
    "NativeBackendError",
    "RowSparse",
    "RowSparseType",
    "SparseTable",
    "SparseTableType",
    "is_marked",
    "is_row_sparse",
    "lookup",
    "mark",
    "to_indexed_slices",
]

_DEFAULT_PATH = (
    "Use the default backend instead: jaxslices.value_and_grad with "
    "jaxslices.embedding_lookup on the plain array."
)


class NativeBackendError(TypeError):
    """An operation the native backend does not support (see the message)."""


def _index_dtype(num_rows: int) -> Any:
    return jnp.int32 if num_rows < np.iinfo(np.int32).max else jnp.int64


def _safe_ids(ids: Any, num_rows: int) -> Any:
    """Ids as the index dtype, invalid ones (< 0 or >= V) replaced by ``V``.

    Range-checked in the ids' own dtype before narrowing, so that a large
    int64 id cannot wrap into a valid row.
    """
    info = jnp.iinfo(ids.dtype)
    valid = ids >= 0
    if num_rows <= info.max:
        valid = valid & (ids < num_rows)
    idt = _index_dtype(num_rows)
    return jnp.where(valid, ids.astype(idt), jnp.asarray(num_rows, idt))


def _dense_read_error(*_: Any, **__: Any) -> Any:
    raise NativeBackendError(
        "A jaxslices.native.SparseTable can only be read through "
        "jaxslices.native.lookup / jaxslices.embedding_lookup / "
        "jaxslices.embedding_bag: its gradient type is row-sparse, so a dense "
        "read (indexing, arithmetic, matmul, jnp functions, tied input/output "
        "embeddings) has no gradient. " + _DEFAULT_PATH
    )


def _add_dense_read_errors(cls: type) -> None:
    # Tracers forward these to their type; concrete values get them directly.
    for name in ("_getitem", "_add", "_radd", "_sub", "_rsub", "_mul", "_rmul"):
        setattr(cls, name, _dense_read_error)
    for name in ("matmul", "rmatmul", "truediv", "rtruediv", "neg", "pow"):
        setattr(cls, f"_{name}", _dense_read_error)


# --------------------------------------------------------------------------
# Types
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SparseTableType(_hijax.HiType):
    """The JAX type of a :class:`SparseTable`: a ``(V, ...)`` table, marked."""

    dense_shape: tuple[int, ...]
    dtype: Any
    capacity: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.dense_shape

    @property
    def ndim(self) -> int:
        return len(self.dense_shape)

    @property
    def mat(self) -> Any:  # read by lax.cond on branch outputs
        return _hijax.EMPTY_MAT

    def str_short(self, short_dtypes: bool = False, **_: Any) -> str:
        dims = ",".join(map(str, self.dense_shape))
        return f"SparseTable[{jnp.dtype(self.dtype).name}[{dims}], cap={self.capacity}]"

    __repr__ = str_short

    def lo_ty(self) -> list[Any]:
        return [_hijax.ShapedArray(self.dense_shape, self.dtype)]

    def lower_val(self, value: SparseTable) -> list[Any]:
        return [value.table]

    def raise_val(self, table: Any) -> SparseTable:
        return SparseTable(table, self.capacity)

    def to_tangent_aval(self) -> RowSparseType:
        return RowSparseType(self.dense_shape, self.dtype, self.capacity)

    def dec_rank(self, size: Any, spec: Any) -> Any:
        raise NativeBackendError(
            "jaxslices.native: vmap over a batch of SparseTables is not "
            "supported (vmap over the ids is: keep the table unbatched, "
            "in_axes=None). " + _DEFAULT_PATH
        )

    inc_rank = dec_rank

    def leading_axis_spec(self) -> Any:
        return 0


_add_dense_read_errors(SparseTableType)
SparseTableType.__jax_array__ = _hijax.aval_method(_dense_read_error)


@dataclasses.dataclass(frozen=True)
class RowSparseType(_hijax.HiType):
    """The JAX type of a :class:`RowSparse`: the gradient of a SparseTable.

    ``batch_shape`` is non-empty only for per-example gradients (``vmap`` of
    ``jax.grad``): then every component has those leading axes.
    """

    dense_shape: tuple[int, ...]
    dtype: Any
    capacity: int
    batch_shape: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return self.batch_shape + self.dense_shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def index_dtype(self) -> Any:
        return _index_dtype(self.dense_shape[0])

    @property
    def mat(self) -> Any:
        return _hijax.EMPTY_MAT

    def str_short(self, short_dtypes: bool = False, **_: Any) -> str:
        dims = ",".join(map(str, self.shape))
        return f"RowSparse[{jnp.dtype(self.dtype).name}[{dims}], cap={self.capacity}]"

    __repr__ = str_short

    def lo_ty(self) -> list[Any]:
        b, n, row = self.batch_shape, self.capacity, self.dense_shape[1:]
        return [
            _hijax.ShapedArray(b + (n,) + row, self.dtype),
            _hijax.ShapedArray(b + (n,), self.index_dtype),
            _hijax.ShapedArray(b, jnp.int32),
        ]

    def lower_val(self, value: RowSparse) -> list[Any]:
        return [value.values, value.indices, value.count]

    def raise_val(self, values: Any, indices: Any, count: Any) -> RowSparse:
        return RowSparse(values, indices, count, self.dense_shape, self.capacity)

    def to_tangent_aval(self) -> RowSparseType:
        return self

    def vspace_zero(self) -> Any:
        n, row, b = self.capacity, self.dense_shape[1:], self.batch_shape
        zero = _make(
            jnp.zeros(b + (n,) + row, self.dtype),
            jnp.full(b + (n,), self.dense_shape[0], self.index_dtype),
            jnp.zeros(b, jnp.int32),
            self.dense_shape,
            self.capacity,
        )
        return _remember_count(zero, 0) if not b else zero

    def vspace_add(self, x: Any, y: Any) -> Any:
        nx, ny = _static_count(x), _static_count(y)
        if ny is None and nx is not None:  # slot order does not matter
            x, y, nx, ny = y, x, ny, nx
        if ny is not None and ny > self.capacity:
            ny = None  # (cannot happen: every counted value fits)
        # With y's slot count known at trace time (e.g. one scan step's lookups
        # added to the gradient carried through the loop), only its first `ny`
        # slots are copied: O(ny) per add instead of O(capacity).
        out = _Add(self, ny)(x, y)
        if nx is None or ny is None:
            return out
        if nx + ny > self.capacity:
            raise ValueError(
                f"jaxslices.native: the gradient of a SparseTable with capacity "
                f"{self.capacity} needs {nx + ny} row slots (lookups added "
                f"together): one per looked-up id (gradient {self.str_short()}). "
                f"Mark the table with capacity >= {nx + ny}."
            )
        return _remember_count(out, nx + ny)

    def dec_rank(self, size: Any, spec: Any) -> RowSparseType:
        if spec != 0 or not self.batch_shape or self.batch_shape[0] != size:
            raise NativeBackendError(
                f"jaxslices.native: a batched RowSparse is mapped along its leading "
                f"axis only (in_axes/out_axes 0), got {spec!r} for {self}."
            )
        return dataclasses.replace(self, batch_shape=self.batch_shape[1:])

    def inc_rank(self, size: Any, spec: Any) -> RowSparseType:
        if spec != 0:
            raise NativeBackendError(
                f"jaxslices.native: a batched RowSparse is mapped along its leading "
                f"axis only (in_axes/out_axes 0), got {spec!r}."
            )
        return dataclasses.replace(self, batch_shape=(size,) + self.batch_shape)

    def leading_axis_spec(self) -> Any:
        return 0

    # Methods also available on traced values (a tracer forwards to its type).
    to_indexed_slices = _hijax.aval_method(lambda self: to_indexed_slices(self))
    to_dense = _hijax.aval_method(lambda self: _row_sparse_to_dense(self))


# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------


class SparseTable:
    """A ``(V, ...)`` table whose gradient under ``jax.grad`` is a :class:`RowSparse`.

    Create it with :func:`mark`; read it with :func:`lookup`. Under a JAX
    transformation a marked table is a tracer of type :class:`SparseTableType`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxslices import native
      >>> t = native.mark(jnp.ones((5, 2)), capacity=3)
      >>> t
      SparseTable(float32[5,2], capacity=3)
    """

    __slots__ = ("table", "capacity")

    def __init__(self, table: Any, capacity: int):
        self.table = table
        self.capacity = capacity

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.table.shape)

    @property
    def dtype(self) -> Any:
        return self.table.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        dims = ",".join(map(str, self.shape))
        return (
            f"SparseTable({jnp.dtype(self.dtype).name}[{dims}], "
            f"capacity={self.capacity})"
        )

    def __jax_array__(self) -> Any:
        _dense_read_error()

    __getitem__ = _dense_read_error
    __add__ = __radd__ = __sub__ = __rsub__ = _dense_read_error
    __mul__ = __rmul__ = __matmul__ = __rmatmul__ = _dense_read_error
    __truediv__ = __rtruediv__ = __neg__ = __pow__ = _dense_read_error


class RowSparse:
    """The gradient of a :class:`SparseTable`: ``capacity`` row slots.

    Slot ``k`` adds ``values[k]`` to row ``indices[k]`` (duplicates sum; index
    ``V`` is padding). ``count`` is the number of slots the lookups asked for;
    if it exceeds ``capacity`` the gradient is incomplete and reading it
    (:meth:`to_indexed_slices`, :meth:`to_dense`) raises.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxslices import native
      >>> t = native.mark(jnp.ones((5, 2)), capacity=3)
      >>> g = jax.grad(lambda t: native.lookup(t, jnp.array([4, 1])).sum())(t)
      >>> g
      RowSparse(float32[5,2], capacity=3)
      >>> g.to_indexed_slices().indices
      Array([4, 1, 5], dtype=int32)
    """

    __slots__ = ("values", "indices", "count", "dense_shape", "capacity")

    def __init__(self, values, indices, count, dense_shape, capacity):
        self.values = values
        self.indices = indices
        self.count = count
        self.dense_shape = tuple(dense_shape)
        self.capacity = capacity

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.count.shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.batch_shape + self.dense_shape

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    def __repr__(self) -> str:
        dims = ",".join(map(str, self.shape))
        return (
            f"RowSparse({jnp.dtype(self.dtype).name}[{dims}], capacity={self.capacity})"
        )

    def to_indexed_slices(self) -> IndexedSlices:
        """This gradient as an :class:`~jaxslices.IndexedSlices` (checked)."""
        return to_indexed_slices(self)

    def to_dense(self) -> jax.Array:
        """The dense ``(V, ...)`` gradient (checked)."""
        return _row_sparse_to_dense(self)


def _table_type(x: SparseTable) -> SparseTableType:
    return SparseTableType(tuple(x.table.shape), jnp.dtype(x.table.dtype), x.capacity)


def _row_sparse_type(x: RowSparse) -> RowSparseType:
    return RowSparseType(
        x.dense_shape, jnp.dtype(x.values.dtype), x.capacity, tuple(x.count.shape)
    )


_hijax.register_hitype(SparseTable, _table_type)
_hijax.register_hitype(RowSparse, _row_sparse_type)


def _typeof(x: Any) -> Any:
    try:
        return jax.typeof(x)
    except TypeError:
        return None


def is_marked(x: Any) -> bool:
    """True for a :class:`SparseTable` (concrete or traced).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxslices import native
      >>> native.is_marked(native.mark(jnp.ones((3, 2)), capacity=2))
      True
    """
    return isinstance(_typeof(x), SparseTableType)


def is_row_sparse(x: Any) -> bool:
    """True for a :class:`RowSparse` gradient (concrete or traced)."""
    return isinstance(_typeof(x), RowSparseType)


# --------------------------------------------------------------------------
# Primitives
# --------------------------------------------------------------------------


class _Mark(_hijax.HiPrimitive):
    """array -> SparseTable. Its VJP densifies (marking inside a loss is dense)."""

    def __init__(self, table_aval: Any, capacity: int):
        self.in_avals = (table_aval,)
        self.out_aval = SparseTableType(
            tuple(table_aval.shape), jnp.dtype(table_aval.dtype), capacity
        )
        self.params = dict(table_aval=table_aval, capacity=capacity)
        super().__init__()

    def expand(self, table):
        return SparseTable(table, self.params["capacity"])

    def vjp_fwd(self, nzs_in, table):
        return self(table), None

    def vjp_bwd_retval(self, res, g):
        if isinstance(g, _hijax.Zero):
            return (None,)
        return (_row_sparse_to_dense(g, check=False).astype(self.out_aval.dtype),)

    def batch(self, axis_data, args, dims):
        if dims[0] is not None:
            self.out_aval.dec_rank(None, None)  # raises
        return self(*args), None


class _Lookup(_hijax.HiPrimitive):
    """(SparseTable, ids) -> rows; its VJP accumulates a RowSparse."""

    def __init__(self, table_ty: SparseTableType, ids_aval: Any):
        self.in_avals = (table_ty, ids_aval)
        row = table_ty.dense_shape[1:]
        self.out_aval = _hijax.ShapedArray(tuple(ids_aval.shape) + row, table_ty.dtype)
        self.params = dict(table_ty=table_ty, ids_aval=ids_aval)
        super().__init__()

    def expand(self, table, ids):
        num_rows = table.table.shape[0]
        safe = _safe_ids(ids, num_rows)
        return table.table.at[safe].get(mode="fill", fill_value=0)

    def vjp_fwd(self, nzs_in, table, ids):
        _check_slots(ids.size, self.params["table_ty"], "")
        return self(table, ids), ids

    def vjp_bwd(self, ids, g, table_acc, ids_acc):
        if isinstance(g, _hijax.Zero) or not _hijax.is_grad_accum(table_acc):
            return
        ty = self.params["table_ty"]
        total = _TALLY.get(table_acc, 0) + ids.size
        _check_slots(total, ty, " (all lookups of this table added together)")
        _TALLY[table_acc] = total
        table_acc.accum(_slots_from_rows(g, ids, ty))

    def batch(self, axis_data, args, dims):
        table, ids = args
        dt, di = dims
        if dt is not None:
            self.params["table_ty"].dec_rank(None, None)  # raises
        if di is None:
            return self(table, ids), None
        ids = jnp.moveaxis(ids, di, 0)
        return _lookup(table, ids), 0

    def jvp(self, primals, tangents):
        raise NativeBackendError(
            "jaxslices.native.lookup: forward-mode AD through a lookup of a "
            "SparseTable is not supported: jax.jvp, jax.jacfwd, jax.linearize, "
            "and jax.checkpoint/jax.remat around the lookup (JAX differentiates "
            "checkpointed code in forward mode first). Keep lookups outside "
            "checkpointed functions (checkpoint what consumes the rows), or "
            + _DEFAULT_PATH[0].lower()
            + _DEFAULT_PATH[1:]
        )

    remat = _hijax.remat_error_hook(
        NativeBackendError,
        "jaxslices.native.lookup: jax.checkpoint (jax.remat) around a lookup of a "
        "SparseTable is not supported (JAX's remat of hijax types fails). Keep the "
        "lookup outside the checkpointed function (checkpoint what consumes the "
        "rows), or " + _DEFAULT_PATH[0].lower() + _DEFAULT_PATH[1:],
    )


# Per backward pass: slots already accumulated into each table's accumulator.
_TALLY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Gradient values (concrete or traced) whose slot count is known at trace time,
# by id with a weak reference (tracers are not hashable). A value not found here
# (the carry out of a scan, a cond's output, a vmapped result) is checked at run
# time instead; losing an entry only costs that check, never correctness.
_STATIC_COUNT: dict[int, tuple[Any, int]] = {}


def _remember_count(x: Any, count: int) -> Any:
    key = id(x)
    try:
        ref = weakref.ref(x, lambda _: _STATIC_COUNT.pop(key, None))
    except TypeError:
        return x
    _STATIC_COUNT[key] = (ref, count)
    return x


def _static_count(x: Any) -> int | None:
    entry = _STATIC_COUNT.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry[1]


def _check_slots(needed: int, ty: SparseTableType, what: str) -> None:
    if needed > ty.capacity:
        raise ValueError(
            f"jaxslices.native: the gradient of a SparseTable with capacity "
            f"{ty.capacity} needs {needed} row slots{what}: one per looked-up id "
            f"(table {ty.str_short()}). Mark the table with capacity >= {needed}, "
            "e.g. jaxslices.native.mark(table, capacity=<ids looked up per step>)."
        )


def _slots_from_rows(g: Any, ids: Any, ty: SparseTableType) -> Any:
    """Pack a lookup's row cotangents and ids into ``capacity`` slots."""
    num_rows, row, cap = ty.dense_shape[0], ty.dense_shape[1:], ty.capacity
    n = ids.size
    idt = _index_dtype(num_rows)
    flat = _safe_ids(ids.reshape(-1), num_rows)
    valid = flat < num_rows
    values = g.reshape((n,) + row).astype(ty.dtype)
    values = jnp.where(valid.reshape((n,) + (1,) * len(row)), values, 0)
    pad = cap - n
    values = jnp.concatenate([values, jnp.zeros((pad,) + row, ty.dtype)])
    flat = jnp.concatenate([flat, jnp.full((pad,), num_rows, idt)])
    out = _make(values, flat, jnp.asarray(n, jnp.int32), ty.dense_shape, cap)
    return _remember_count(out, n)


def _vectorize(f: Any, batch_ndim: int) -> Any:
    for _ in range(batch_ndim):
        f = jax.vmap(f)
    return f


class _Make(_hijax.HiPrimitive):
    """(values, indices, count) -> RowSparse."""

    def __init__(self, in_avals: tuple, out_ty: RowSparseType):
        self.in_avals = in_avals
        self.out_aval = out_ty
        self.params = dict(in_avals=in_avals, out_ty=out_ty)
        super().__init__()

    def expand(self, values, indices, count):
        ty = self.out_aval
        return RowSparse(values, indices, count, ty.dense_shape, ty.capacity)

    def batch(self, axis_data, args, dims):
        size = axis_data.size
        args = [
            jnp.broadcast_to(a, (size,) + a.shape)
            if d is None
            else jnp.moveaxis(a, d, 0)
            for a, d in zip(args, dims, strict=True)
        ]
        ty = self.out_aval
        return _make(*args, ty.dense_shape, ty.capacity), 0


def _make(values, indices, count, dense_shape, capacity) -> Any:
    avals = (jax.typeof(values), jax.typeof(indices), jax.typeof(count))
    ty = RowSparseType(
        tuple(dense_shape), jnp.dtype(values.dtype), capacity, tuple(count.shape)
    )
    return _Make(avals, ty)(values, indices, count)


class _Unpack(_hijax.HiPrimitive):
    """RowSparse -> (values, indices, count)."""

    def __init__(self, ty: RowSparseType):
        self.in_avals = (ty,)
        self.out_aval = tuple(ty.lo_ty())
        self.params = dict(ty=ty)
        super().__init__()

    def expand(self, x):
        # A scalar count may have been folded into a jaxpr literal (a NumPy
        # scalar); JAX's lowering needs every lo output to be a traced value.
        return tuple(_as_traced(a) for a in (x.values, x.indices, x.count))

    def batch(self, axis_data, args, dims):
        (x,) = args
        if dims[0] is None:
            return self(x), (None, None, None)
        return _unpack(x), (0, 0, 0)


def _as_traced(x: Any) -> Any:
    if isinstance(x, jax.core.Tracer):
        return x
    return jax.lax.add(jnp.asarray(x), jnp.zeros((), jnp.asarray(x).dtype))


def _unpack(x: Any) -> tuple[Any, Any, Any]:
    return _Unpack(jax.typeof(x))(x)


def _combine(dense_shape, cap, xv, xi, xc, yv, yi, yc):
    """Slots of x, then those of y from slot ``xc`` on (unbatched)."""
    num_rows = dense_shape[0]
    start = cap - jnp.minimum(xc, cap)
    yv = jax.lax.dynamic_slice_in_dim(
        jnp.concatenate([jnp.zeros_like(yv), yv]), start, cap
    )
    yi = jax.lax.dynamic_slice_in_dim(
        jnp.concatenate([jnp.full_like(yi, num_rows), yi]), start, cap
    )
    mine = jnp.arange(cap) < xc
    values = jnp.where(mine.reshape((cap,) + (1,) * (xv.ndim - 1)), xv, yv)
    return values, jnp.where(mine, xi, yi), xc + yc


class _Add(_hijax.HiPrimitive):
    """RowSparse + RowSparse: the slots of both (the count adds up)."""

    def __init__(self, ty: RowSparseType, y_slots: int | None = None):
        self.in_avals = (ty, ty)
        self.out_aval = ty
        self.params = dict(ty=ty, y_slots=y_slots)
        super().__init__()

    def expand(self, x, y):
        ty, y_slots = self.out_aval, self.params["y_slots"]
        if y_slots is None:
            combine = functools.partial(_combine, ty.dense_shape, ty.capacity)
        else:
            combine = functools.partial(_append, ty.capacity, y_slots)
        f = _vectorize(combine, len(ty.batch_shape))
        v, i, c = f(x.values, x.indices, x.count, y.values, y.indices, y.count)
        return RowSparse(v, i, c, ty.dense_shape, ty.capacity)

    def batch(self, axis_data, args, dims):
        size = axis_data.size
        args = [
            _broadcast(a, size) if d is None else a
            for a, d in zip(args, dims, strict=True)
        ]
        return _Add(jax.typeof(args[0]), self.params["y_slots"])(*args), 0


def _append(cap, y_slots, xv, xi, xc, yv, yi, yc):
    """Like ``_combine`` when only y's first ``y_slots`` slots can be in use.

    On overflow (``xc + y_slots > cap``) the update is clamped and overwrites
    some of x's slots; the count still says so, and reading the gradient raises.
    """
    if y_slots == 0:
        return xv, xi, xc + yc
    start = jnp.clip(xc, 0, cap - y_slots)
    values = jax.lax.dynamic_update_slice_in_dim(xv, yv[:y_slots], start, 0)
    indices = jax.lax.dynamic_update_slice_in_dim(xi, yi[:y_slots], start, 0)
    return values, indices, xc + yc


def _broadcast(x: Any, size: int) -> Any:
    v, i, c = _unpack(x)
    ty = jax.typeof(x)
    b = lambda a: jnp.broadcast_to(a, (size,) + a.shape)  # noqa: E731
    return _make(b(v), b(i), b(c), ty.dense_shape, ty.capacity)


# --------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------


def mark(table: Any, capacity: int) -> Any:
    """Mark a ``(V, ...)`` table: ``jax.grad`` gives it a row-sparse gradient.

    Call it outside the differentiated function (typically at the start of the
    jitted step) and differentiate with respect to the marked table: its
    gradient is then a :class:`RowSparse` with ``capacity`` slots. (Marking
    inside the differentiated function is allowed and correct, but the
    gradient of the unmarked array is then dense.)

    Args:
      table: a ``(V, ...)`` floating-point array.
      capacity: static number of row slots of the gradient: at least the
        number of ids looked up from this table per gradient computation
        (all lookups, all ``vmap`` batch elements and ``scan`` steps). A
        smaller capacity raises an error (see the module docstring).

    Returns:
      A :class:`SparseTable` (a tracer of :class:`SparseTableType` under
      transformations).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxslices import native
      >>> t = native.mark(jnp.arange(6.0).reshape(3, 2), capacity=4)
      >>> native.lookup(t, jnp.array([2, 0]))
      Array([[4., 5.],
             [0., 1.]], dtype=float32)
    """
    if is_marked(table):
        raise NativeBackendError(
            f"jaxslices.native.mark: the table is already marked ({jax.typeof(table)})."
        )
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
        raise TypeError(
            "jaxslices.native.mark: `capacity` must be a Python int (static: the "
            f"gradient's number of row slots), got {capacity!r}."
        )
    capacity = int(capacity)
    if not hasattr(table, "shape") or not hasattr(table, "dtype"):
        table = jnp.asarray(table)
    if table.ndim < 1 or not jnp.issubdtype(table.dtype, jnp.floating):
        raise TypeError(
            "jaxslices.native.mark: `table` must be a floating-point array with at "
            f"least one axis (rows), got {jnp.dtype(table.dtype).name}"
            f"{list(table.shape)}."
        )
    if capacity < 1:
        raise ValueError(
            f"jaxslices.native.mark: `capacity` must be >= 1, got {capacity}."
        )
    return _Mark(jax.typeof(table), capacity)(table)


def _lookup(table: Any, ids: Any) -> Any:
    return _Lookup(jax.typeof(table), jax.typeof(ids))(table, ids)


def lookup(
    table: Any, ids: Any, *, dtype: Any = None, check_ids: bool = False
) -> jax.Array:
    """Rows of a marked table: ``table[ids]``, shape ``ids.shape + table.shape[1:]``.

    Ids policy as :func:`jaxslices.embedding_lookup`: an id outside ``[0, V)``
    reads zeros and gets no gradient (a padding slot). The gradient, under
    plain ``jax.grad``, is a :class:`RowSparse` with one slot per id.

    Args:
      table: a :class:`SparseTable` (see :func:`mark`).
      ids: integer array of any shape.
      dtype: cast the rows to it after the gather.
      check_ids: raise an error (also under ``jit``) for an out-of-range id.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxslices import native
      >>> t = native.mark(jnp.ones((4, 2)), capacity=2)
      >>> g = jax.grad(lambda t: native.lookup(t, jnp.array([3, 3])).sum())(t)
      >>> g.to_dense()[3]
      Array([2., 2.], dtype=float32)
    """
    if not is_marked(table):
        raise TypeError(
            "jaxslices.native.lookup: `table` must be marked with "
            f"jaxslices.native.mark(table, capacity=...), got {_typeof(table)}. "
            "For a plain array use jaxslices.embedding_lookup."
        )
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(
            f"jaxslices.native.lookup: `ids` must be integers, got "
            f"{jnp.dtype(ids.dtype).name}{list(ids.shape)}. Cast them, e.g. "
            "`ids.astype(jnp.int32)`."
        )
    if check_ids:
        from .embedding import check_ids as _check

        _check(ids, table.shape[0])
    out = _lookup(table, ids)
    return out if dtype is None else out.astype(dtype)


def _raise_overflow(count: Any, capacity: int) -> None:
    count = int(np.max(count))
    if count > capacity:
        raise ValueError(
            f"jaxslices.native: the gradient of a SparseTable needed {count} row "
            f"slots but its capacity is {capacity}, so rows were dropped. Mark the "
            f"table with capacity >= {count} (one slot per id looked up in the "
            "step, every scan step included)."
        )


def _unpack_checked(x: Any, check: bool = True) -> tuple[Any, Any, Any, RowSparseType]:
    ty = _typeof(x)
    if not isinstance(ty, RowSparseType):
        raise TypeError(f"jaxslices.native: expected a RowSparse gradient, got {ty}.")
    values, indices, count = _unpack(x)
    known = _static_count(x)
    if known is not None and known <= ty.capacity:
        check = False  # the count is known at trace time: no run-time check
    if check:
        if isinstance(count, jax.core.Tracer):
            jax.debug.callback(_raise_overflow, jnp.max(count), ty.capacity)
        else:
            _raise_overflow(np.asarray(count), ty.capacity)
    return values, indices, count, ty


def _row_sparse_to_dense(x: Any, check: bool = True) -> jax.Array:
    values, indices, _, ty = _unpack_checked(x, check)

    def scatter(v, i):
        return jnp.zeros(ty.dense_shape, ty.dtype).at[i].add(v, mode="drop")

    return _vectorize(scatter, len(ty.batch_shape))(values, indices)


def _make_slices(values: Any, indices: Any, dense_shape: tuple[int, ...]) -> Any:
    return IndexedSlices(values, indices, dense_shape)


def to_indexed_slices(tree: Any) -> Any:
    """Turn each :class:`RowSparse` in ``tree`` into an ``IndexedSlices``.

    Checks the capacity: if the lookups needed more slots than the table's
    capacity, raises ``ValueError`` (under ``jit`` through a host callback,
    when the step runs). Other leaves are returned as they are.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxslices import native
      >>> params = {"emb": native.mark(jnp.ones((6, 2)), capacity=2), "w": jnp.ones(2)}
      >>> loss = lambda p: native.lookup(p["emb"], jnp.array([5, 0])) @ p["w"]
      >>> g = native.to_indexed_slices(jax.grad(lambda p: loss(p).sum())(params))
      >>> g["emb"]
      IndexedSlices(float32[6, 2], rows=2)
    """

    def convert(x: Any) -> Any:
        if not is_row_sparse(x):
            return x
        values, indices, _, ty = _unpack_checked(x)
        if ty.batch_shape:  # per-example gradients: batched leaves, as vmap makes
            build = functools.partial(_make_slices, dense_shape=ty.dense_shape)
            return _vectorize(build, len(ty.batch_shape))(values, indices)
        return IndexedSlices(values, indices, ty.dense_shape)

    return jax.tree.map(convert, tree, is_leaf=is_row_sparse)


# jaxslices.embedding_lookup / embedding_bag hand marked tables to this backend
# (after their own ids checks; the ids arrive in [0, V], V being padding).
def _claims(table: Any) -> bool:
    try:
        return is_marked(table)
    except Exception:  # never raise for a table that is not ours
        return False


_backend.register_lookup_handler(
    _backend.LookupHandler(
        name="jaxslices.native",
        claims=_claims,
        num_rows=lambda table: jax.typeof(table).dense_shape[0],
        lookup=_lookup,
    )
)
