"""Internal: the marked table, ``SparseTable``, and its primitives.

:func:`mark` wraps a ``(V, ...)`` array into a :class:`SparseTable` (JAX type
:class:`SparseTableType`, whose cotangent type is
:class:`~jaxslices.native.RowSparseType`); :func:`lookup` reads its rows. The
lookup primitive's backward rule packs the rows' cotangents and ids into the
table's gradient accumulator, counting slots against the capacity at trace
time; any other read of the table raises :class:`NativeBackendError`.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ids
from . import _hijax
from ._hijax import DEFAULT_PATH, NativeBackendError
from ._row_sparse import (
    RowSparseType,
    _make,
    _remember_count,
    _row_sparse_to_dense,
    _typeof,
)


def _dense_read_error(*_: Any, **__: Any) -> Any:
    raise NativeBackendError(
        "A jaxslices.native.SparseTable can only be read through "
        "jaxslices.native.lookup / jaxslices.embedding_lookup / "
        "jaxslices.embedding_bag: its gradient type is row-sparse, so a dense "
        "read (indexing, arithmetic, matmul, jnp functions, tied input/output "
        "embeddings) has no gradient. " + DEFAULT_PATH
    )


def _add_dense_read_errors(cls: type) -> None:
    # Tracers forward these to their type; concrete values get them directly.
    for name in ("_getitem", "_add", "_radd", "_sub", "_rsub", "_mul", "_rmul"):
        setattr(cls, name, _dense_read_error)
    for name in ("matmul", "rmatmul", "truediv", "rtruediv", "neg", "pow"):
        setattr(cls, f"_{name}", _dense_read_error)


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
            "in_axes=None). " + DEFAULT_PATH
        )

    inc_rank = dec_rank

    def leading_axis_spec(self) -> Any:
        return 0


_add_dense_read_errors(SparseTableType)
SparseTableType.__jax_array__ = _hijax.aval_method(_dense_read_error)


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


def _table_type(x: SparseTable) -> SparseTableType:
    return SparseTableType(tuple(x.table.shape), jnp.dtype(x.table.dtype), x.capacity)


_hijax.register_hitype(SparseTable, _table_type)


def is_marked(x: Any) -> bool:
    """True for a :class:`SparseTable` (concrete or traced).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxslices import native
      >>> native.is_marked(native.mark(jnp.ones((3, 2)), capacity=2))
      True
    """
    return isinstance(_typeof(x), SparseTableType)


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
        safe = _ids.safe_ids(ids, num_rows)
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
            + DEFAULT_PATH[0].lower()
            + DEFAULT_PATH[1:]
        )

    remat = _hijax.remat_error_hook(
        NativeBackendError,
        "jaxslices.native.lookup: jax.checkpoint (jax.remat) around a lookup of a "
        "SparseTable is not supported (JAX's remat of hijax types fails). Keep the "
        "lookup outside the checkpointed function (checkpoint what consumes the "
        "rows), or " + DEFAULT_PATH[0].lower() + DEFAULT_PATH[1:],
    )


# Per backward pass: slots already accumulated into each table's accumulator.
_TALLY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
    idt = _ids.index_dtype(num_rows)
    flat = _ids.safe_ids(ids.reshape(-1), num_rows)
    valid = flat < num_rows
    values = g.reshape((n,) + row).astype(ty.dtype)
    values = jnp.where(valid.reshape((n,) + (1,) * len(row)), values, 0)
    pad = cap - n
    values = jnp.concatenate([values, jnp.zeros((pad,) + row, ty.dtype)])
    flat = jnp.concatenate([flat, jnp.full((pad,), num_rows, idt)])
    out = _make(values, flat, jnp.asarray(n, jnp.int32), ty.dense_shape, cap)
    return _remember_count(out, n)


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
    num_rows = table.shape[0]
    ids = _ids.as_ids(ids, "jaxslices.native.lookup")
    if check_ids:
        ids = _ids.raise_if_out_of_range(
            ids, num_rows, "jaxslices.native.lookup(check_ids=True)"
        )
    out = _lookup(table, _ids.safe_ids(ids, num_rows))
    return out if dtype is None else out.astype(dtype)
