"""Internal: the gradient type of a marked table, ``RowSparse``, and how it is read.

A :class:`RowSparse` holds ``capacity`` row slots and a count of the slots the
lookups asked for. Its JAX type, :class:`RowSparseType`, is the cotangent
type of :class:`~jaxslices.native.SparseTableType`: JAX's ``jax.grad``
accumulates it with ``vspace_add`` (the slots of both) and starts from
``vspace_zero``. The primitives here build, unpack and add such values, under
``vmap`` too (per-example gradients carry a batch shape). Reading a gradient
(:func:`to_indexed_slices`, :meth:`RowSparse.to_dense`) checks its capacity:
at trace time where the count is known, else with
:func:`jaxslices._errors.raise_if` (eagerly, under ``jit``, on every device).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import jax
import jax.numpy as jnp

from .. import _errors, _ids
from ..slices import IndexedSlices
from . import _hijax
from ._hijax import NativeBackendError

_typeof = _hijax.typeof


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
        return _ids.index_dtype(self.dense_shape[0])

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


def _row_sparse_type(x: RowSparse) -> RowSparseType:
    return RowSparseType(
        x.dense_shape, jnp.dtype(x.values.dtype), x.capacity, tuple(x.count.shape)
    )


_hijax.register_hitype(RowSparse, _row_sparse_type)


def is_row_sparse(x: Any) -> bool:
    """True for a :class:`RowSparse` gradient (concrete or traced)."""
    return isinstance(_typeof(x), RowSparseType)


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


def _overflow_error(count: int, *, capacity: int) -> ValueError:
    return ValueError(
        f"jaxslices.native: the gradient of a SparseTable needed {count} row "
        f"slots but its capacity is {capacity}, so rows were dropped. Mark the "
        f"table with capacity >= {count} (one slot per id looked up in the "
        "step, every scan step included)."
    )


def _unpack_checked(x: Any, check: bool = True) -> tuple[Any, Any, Any, RowSparseType]:
    """``(values, indices, count, type)`` of a RowSparse, its capacity checked.

    The check (:func:`jaxslices._errors.raise_if`: eager, under ``jit``, on
    every device) guards ``count``, and the indices are read through the
    checked count, so nothing computed from them runs before the check.
    """
    ty = _typeof(x)
    if not isinstance(ty, RowSparseType):
        raise TypeError(f"jaxslices.native: expected a RowSparse gradient, got {ty}.")
    values, indices, count = _unpack(x)
    known = _static_count(x)
    if known is not None and known <= ty.capacity:
        check = False  # the count is known at trace time: no run-time check
    if check:
        over = count > ty.capacity
        count = _errors.raise_if(
            over,
            count,
            functools.partial(_overflow_error, capacity=ty.capacity),
            jnp.max(count),
            reduce=("max",),
        )
        # Slots of an overflowed gradient are padding (the check raised anyway).
        dropped = (count > ty.capacity).reshape(count.shape + (1,))
        indices = jnp.where(dropped, ty.dense_shape[0], indices)
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
    capacity, raises ``ValueError`` (under ``jit`` when the step runs, as
    ``jax.errors.JaxRuntimeError`` or ``ValueError``, through
    :func:`jaxslices._errors.raise_if`).
    Other leaves are returned as they are.

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
