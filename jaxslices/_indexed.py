"""The ``IndexedSlices`` pytree type: what a slice is, not what is done with it.

The type (typed indices, validation, repr, pickling), the static facts it
carries beside its leaves (the index flags, the pooled gradient
:attr:`IndexedSlices.recipe` and why it was lost, an update's step count)
and the helpers that keep them (``_build``, ``_replace_values``,
``_with_flags``, ``with_recipe``, ``scale_values``, ``with_step``,
``float32_rows``, ``kernel_input``), and the checks of slices
(``check_slices``, ``valid_mask``, ``safe_indices``). The conventions
(duplicates sum, padding, invalid and typed indices) are
:mod:`jaxslices.slices`' docstring; the operations on slices live there,
and it re-exports every name of this module that others import.

The methods and operators that are operations (``coalesce``, ``+``, ``-``)
call them in :mod:`jaxslices.slices`, which imports this module and binds
itself here (:func:`bind_operations`) when it is imported, as
``import jaxslices`` always does first.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _ids, _rounding, _typed_indices
from ._recipe import PooledGradient
from .kernels import _path as kernel_path

#: :mod:`jaxslices.slices`, whose operations the methods call (see above).
_operations: Any = None


def bind_operations(module: Any) -> None:
    """Make ``module`` (:mod:`jaxslices.slices`) the operations the methods call."""
    global _operations
    _operations = module


_PLUS = "IndexedSlices + array (optax.apply_updates)"

_CORRUPTED_INDICES_HINT = (
    "Indices of an IndexedSlices must be integers. Other indices usually mean a "
    "function was mapped over every leaf of a gradient tree, indices included: "
    "jax.tree.map(f, grads) (jnp.isnan gives bools), or a leaf-wise Optax "
    "transform (optax.scale, optax.sgd, optax.adam, ...). To apply f to the "
    "values and keep the ids, use jaxslices.tree_map_values(f, grads); for "
    "optimizers, the jaxslices transform of the same name (jaxslices.sgd, "
    "jaxslices.scale, jaxslices.lazy_adam, ...), or route the sparse leaves away "
    "from stock Optax with optax.multi_transform."
)


def _as_array(x: Any, name: str) -> Any:
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return x
    try:
        return jnp.asarray(x)
    except TypeError as e:
        raise TypeError(
            f"IndexedSlices: `{name}` must be an array, got {type(x).__name__}: {x!r}"
        ) from e


def _check_dense_shape(dense_shape: Any) -> tuple[int, ...]:
    if isinstance(dense_shape, (int, np.integer)):
        dense_shape = (dense_shape,)
    try:
        shape = tuple(operator.index(d) for d in dense_shape)
    except TypeError as e:
        raise TypeError(
            "IndexedSlices: `dense_shape` must be a tuple of Python ints (static, "
            f"as JAX shapes are), got {dense_shape!r}. If it came from a traced "
            "array, use `x.shape` instead of `jnp.shape(x)` values computed at "
            "run time."
        ) from e
    if len(shape) < 1:
        raise ValueError(
            "IndexedSlices: `dense_shape` must have at least one dimension "
            f"(rows), got {shape!r}."
        )
    if any(d < 0 for d in shape):
        raise ValueError(
            f"IndexedSlices: `dense_shape` must be non-negative, got {shape!r}."
        )
    return shape


def _check_integer_indices(indices: Any, where: str) -> None:
    dtype = indices.dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        name = getattr(dtype, "name", str(dtype))
        raise TypeError(
            f"{where}: `indices` must have an integer dtype, got "
            f"{name}{list(indices.shape)}. {_CORRUPTED_INDICES_HINT}"
        )


class _IndexedSlicesType(type):
    """Metaclass whose only job is the class's repr in other libraries' errors.

    Generic pytree code that assumes dense gradients (``optax.MultiSteps``
    keeps a dense accumulator per parameter, ``optax.adam`` dense moments)
    fails on an ``IndexedSlices`` with JAX's "pytree structure error ...
    subtree of type <class ...>"; this repr makes that message say what to use.
    """

    def __repr__(cls) -> str:
        if cls.__name__ != "IndexedSlices":
            return super().__repr__()
        return (
            "<class 'jaxslices.IndexedSlices'> (a sparse gradient; code that "
            "expects a dense array there cannot take it: use jaxslices.MultiSteps "
            "for gradient accumulation, jaxslices.tree_add/tree_scale/tree_psum "
            "for tree arithmetic, jaxslices transforms for optimizers, or "
            "jaxslices.to_dense)"
        )


@jax.tree_util.register_pytree_with_keys_class
class IndexedSlices(metaclass=_IndexedSlicesType):
    """Row-sparse representation of a dense array: rows ``values`` at ``indices``.

    Represents ``jnp.zeros(dense_shape).at[indices].add(values)``. Duplicate
    indices sum; an index equal to ``dense_shape[0]`` is a padding slot that
    contributes nothing.

    Args:
      values: array of shape ``[N, *dense_shape[1:]]``, the rows.
      indices: integer array of shape ``[N]``, the row of each slice.
      dense_shape: tuple of Python ints, the shape of the dense equivalent.

    Raises:
      TypeError: ``indices`` are not integers, or ``dense_shape`` is not static.
      ValueError: the shapes of ``values``, ``indices`` and ``dense_shape``
        disagree.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxslices import IndexedSlices
      >>> s = IndexedSlices(jnp.ones((3, 2)), jnp.array([0, 2, 0]), (4, 2))
      >>> s
      IndexedSlices(float32[4, 2], rows=3)
      >>> s.to_dense()
      Array([[2., 2.],
             [0., 0.],
             [1., 1.],
             [0., 0.]], dtype=float32)
    """

    __slots__ = (
        "values",
        "_indices",
        "dense_shape",
        "_unique",
        "_sorted",
        "_recipe",
        "_lost_by",
        "_step",
    )
    __hash__ = None  # type: ignore[assignment]
    # Make NumPy defer to our reflected operators (np.ndarray + IndexedSlices).
    __array_ufunc__ = None

    values: jax.Array
    _indices: Any  # typed indices (see _typed_indices), the pytree child
    dense_shape: tuple[int, ...]

    def __init__(self, values: Any, indices: Any, dense_shape: Sequence[int]):
        dense_shape = _check_dense_shape(dense_shape)
        values = _as_array(values, "values")
        indices = _as_array(indices, "indices")
        typed = _typed_indices.is_typed(indices)
        if not typed:
            _check_integer_indices(indices, "IndexedSlices")
        if indices.ndim != 1:
            raise ValueError(
                "IndexedSlices: `indices` must be 1-D (one row index per slice), "
                f"got shape {tuple(indices.shape)}. Flatten ids first, e.g. "
                "`ids.reshape(-1)` with `values.reshape(-1, *row_shape)`."
            )
        if values.ndim < 1 or values.shape[0] != indices.shape[0]:
            raise ValueError(
                "IndexedSlices: `values.shape[0]` must equal `indices.shape[0]` "
                f"(one row per index), got values shape {tuple(values.shape)} and "
                f"indices shape {tuple(indices.shape)}."
            )
        if tuple(values.shape[1:]) != dense_shape[1:]:
            raise ValueError(
                "IndexedSlices: each row of `values` must have shape "
                f"dense_shape[1:] = {dense_shape[1:]}, got values shape "
                f"{tuple(values.shape)} (rows of shape {tuple(values.shape[1:])}) "
                f"for dense_shape {dense_shape}."
            )
        plain = _typed_indices.unwrap(indices) if typed else indices
        _ids.check_index_width(jnp.dtype(plain.dtype), dense_shape[0])
        if not typed:
            indices = _typed_indices.wrap(indices, dense_shape[0])
        self.values = values
        self._indices = indices
        self.dense_shape = dense_shape
        self._unique = self._sorted = False
        self._recipe = self._lost_by = self._step = None

    # -- pytree ---------------------------------------------------------------
    def tree_flatten_with_keys(self):
        children = (
            (jax.tree_util.GetAttrKey("values"), self.values),
            (jax.tree_util.GetAttrKey("indices"), self._indices),
        )
        return children, self.dense_shape

    def tree_flatten(self):
        return (self.values, self._indices), self.dense_shape

    @classmethod
    def tree_unflatten(cls, dense_shape, children):
        # No validation: JAX unflattens with placeholder leaves (object(), None,
        # batching sentinels), see the JAX docs on custom pytrees.
        # Pure: slices rebuilt from leaves know only their leaves (no index
        # flags, no pooled form; see `IndexedSlices.recipe`).
        values, indices = children
        return _build(values, indices, dense_shape)

    # -- properties -----------------------------------------------------------
    @property
    def indices(self) -> jax.Array:
        """The row ids, a plain int32 (or int64) array ``[N]``.

        The pytree child is the typed form (see the module docstring); this
        unwraps it, which compiles to nothing under ``jit``.
        """
        return _typed_indices.unwrap(self._indices)

    @property
    def unique_indices(self) -> bool:
        """``True`` when the valid indices are known to be distinct (static).

        Set by :func:`coalesce` and kept by value-only operations (scaling,
        ``astype``, the jaxslices transforms), so coalescing again is free; like
        ``BCOO.unique_indices``. Not part of the pytree: flattening (``jit``
        boundaries, ``lax.cond``) drops it, which only costs a re-coalesce, and
        two slices differing only in it have the same tree structure.
        """
        return self._unique

    @property
    def indices_sorted(self) -> bool:
        """``True`` when the indices are known to be sorted (static; see above)."""
        return self._sorted

    @property
    def recipe(self) -> PooledGradient | None:
        """The pooled form of the values, or ``None`` (the values are the rows).

        The gradient of an ``embedding_bag`` (float32) carries the bags'
        pooled gradient ``G`` ``[B, D]`` with each slot's bag and weight
        (a :class:`jaxslices.PooledGradient`): ``values[s] = scale *
        weight[s] * G[bag[s]]``. The native kernels read it instead of the
        ``[N, D]`` values, which XLA then never computes. Static, like the
        index flags, and not a pytree child: jaxslices' own operations keep
        it where they can (scaling, negation, concatenation, ``tree_scale``,
        ``tree_add``, the transforms' scalings), and anything that rebuilds
        the slices from their leaves loses it (flattening is pure: a ``jit``
        boundary, any ``jax.tree.map``, the identity included); the kernels
        then read the values, the same numbers (see
        ``docs/sparse_gradients.md``, "The pooled gradient", and
        :func:`jaxslices.kernels.explain`).
        """
        return self._recipe

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense shape (like ``to_dense().shape``)."""
        return self.dense_shape

    @property
    def dtype(self) -> Any:
        """The dtype of ``values`` (and of the dense equivalent)."""
        return self.values.dtype

    @property
    def ndim(self) -> int:
        """Number of dimensions of the dense equivalent."""
        return len(self.dense_shape)

    @property
    def num_rows(self) -> int:
        """Number of dense rows, ``dense_shape[0]`` (also the padding index)."""
        return self.dense_shape[0]

    @property
    def num_slices(self) -> int:
        """Number of slots ``N`` (static), padding slots included."""
        return self._indices.shape[0]

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row, ``dense_shape[1:]``."""
        return self.dense_shape[1:]

    @property
    def padding_index(self) -> int:
        """The index that marks a padding slot: ``dense_shape[0]``."""
        return self.dense_shape[0]

    def __repr__(self) -> str:
        dims = ", ".join(str(d) for d in self.dense_shape)
        if _typed_indices.is_typed(self._indices) and hasattr(self.values, "dtype"):
            dtype = jnp.dtype(self.values.dtype).name
            return f"IndexedSlices({dtype}[{dims}], rows={self._indices.shape[0]})"
        # Rebuilt from other leaves: placeholders (object(), None, specs) or the
        # results of a function mapped over every leaf (jax.tree.map(jnp.isnan,
        # grads) gives bool "indices"). Describe the leaves, never fail.
        return (
            f"IndexedSlices(values={_describe(self.values)}, "
            f"indices={_describe(self._indices)}, dense_shape=({dims}))"
        )

    # -- pickling -------------------------------------------------------------
    def __reduce__(self):
        """Pickle as plain arrays: values, integer ids, dense shape, flags.

        Independent of how JAX pickles the typed indices (unpickling needs
        ``jaxslices`` importable, nothing else), and bit for bit: the ids are
        wrapped again exactly as the constructor wraps them.
        """
        if not _typed_indices.is_typed(self._indices):  # leaves of a tree map
            return (_build, (self.values, self._indices, self.dense_shape))
        flags = (self._unique, self._sorted)
        return (_unpickle, (self.values, self.indices, self.dense_shape, *flags))

    # -- conversions ----------------------------------------------------------
    def to_dense(self) -> jax.Array:
        """The dense array: duplicates summed, padding and invalid slots dropped."""
        out = jnp.zeros(self.dense_shape, self.values.dtype)
        return out.at[safe_indices(self)].add(self.values, mode="drop")

    def astype(self, dtype: Any) -> IndexedSlices:
        """Cast ``values`` to ``dtype`` (indices unchanged)."""
        if jnp.dtype(dtype) == jnp.dtype(self.values.dtype):
            return self  # the same values (and recipe)
        return _replace_values(self, self.values.astype(dtype), "astype")

    def coalesce(
        self, *, method: str = "sort", max_distinct: int | None = None
    ) -> IndexedSlices:
        """See :func:`jaxslices.coalesce`."""
        return _operations.coalesce(self, method=method, max_distinct=max_distinct)

    # -- arithmetic -----------------------------------------------------------
    def _scale(self, c: Any, op, opname: str) -> IndexedSlices:
        if isinstance(c, IndexedSlices):
            raise TypeError(
                f"IndexedSlices {opname} IndexedSlices is not supported: the product "
                "of two sparse arrays is not row-sparse in general. Densify one "
                "with .to_dense() first."
            )
        c = jnp.asarray(c)
        if jnp.ndim(c) > len(self.row_shape) or not _broadcasts_to(
            c.shape, self.row_shape
        ):
            raise ValueError(
                f"IndexedSlices {opname} c: `c` must be a scalar or broadcastable to "
                f"one row of shape {self.row_shape}, got shape {tuple(c.shape)}. "
                "To scale by a dense array of the full shape, densify first."
            )
        values = op(self.values, c)
        if self._recipe is None or jnp.ndim(c) != 0:
            return _replace_values(self, values, f"IndexedSlices {opname} an array")
        factor = 1 / c if op is operator.truediv else c
        return scale_values(self, values, factor)

    def __mul__(self, c: Any) -> IndexedSlices:
        return self._scale(c, operator.mul, "*")

    def __rmul__(self, c: Any) -> IndexedSlices:
        return self._scale(c, lambda v, k: k * v, "*")

    def __truediv__(self, c: Any) -> IndexedSlices:
        return self._scale(c, operator.truediv, "/")

    def __neg__(self) -> IndexedSlices:
        return scale_values(self, -self.values, -1.0)

    def __pos__(self) -> IndexedSlices:
        return self

    def __add__(self, other: Any) -> Any:
        ops = _operations
        if isinstance(other, IndexedSlices):
            return ops.concatenate([self, other])
        return ops._scatter_add(_dense_operand(other, self, "+"), self, _PLUS)

    def __radd__(self, other: Any) -> Any:
        ops = _operations
        if isinstance(other, IndexedSlices):
            return ops.concatenate([other, self])
        return ops._scatter_add(_dense_operand(other, self, "+"), self, _PLUS)

    def __sub__(self, other: Any) -> Any:
        ops = _operations
        if isinstance(other, IndexedSlices):
            return ops.concatenate([self, -other])
        # s - x = -x + s
        return ops.scatter_add(-_dense_operand(other, self, "-"), self)

    def __rsub__(self, other: Any) -> Any:
        ops = _operations
        if isinstance(other, IndexedSlices):
            return ops.concatenate([other, -self])
        return ops.scatter_sub(_dense_operand(other, self, "-"), self)


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False


def _describe(x: Any) -> str:
    """``float32[3, 2]`` for an array-like, the type's name for anything else."""
    dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    if dtype is None or shape is None:
        return f"<{type(x).__name__}>"
    if _typed_indices.is_typed(x):
        name = "typed ids"
    else:
        try:
            name = jnp.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    return f"{name}[{', '.join(str(d) for d in shape)}]"


def _unpickle(values, indices, dense_shape, unique=False, sorted_=False):
    return _with_flags(
        IndexedSlices(values, indices, dense_shape),
        unique_indices=unique,
        indices_sorted=sorted_,
    )


def _build(values: Any, typed_indices: Any, dense_shape: tuple[int, ...]):
    """The one way to make an IndexedSlices without the constructor.

    No validation and no wrapping: ``typed_indices`` is an existing typed
    indices child (or a placeholder leaf during unflattening).
    """
    out = object.__new__(IndexedSlices)
    out.values, out._indices, out.dense_shape = values, typed_indices, dense_shape
    out._unique = out._sorted = False
    out._recipe = out._lost_by = out._step = None
    return out


def _replace_values(
    s: IndexedSlices,
    values: jax.Array,
    lost_by: str = "a jaxslices operation that computes new values",
) -> IndexedSlices:
    """``s`` with new ``values`` (same indices, dense shape and index flags).

    The new values have no recipe; if ``s`` had one, the result records that
    ``lost_by`` lost it (reported where a native kernel reads the values).
    """
    out = _with_flags(
        _build(values, s._indices, s.dense_shape),
        unique_indices=s._unique,
        indices_sorted=s._sorted,
    )
    out._recipe, out._lost_by = None, _lost(s, lost_by)
    return out


def lost_from(out: IndexedSlices, s: IndexedSlices, by: str) -> IndexedSlices:
    """``out``, made from ``s`` without its recipe, noting that ``by`` lost it."""
    out._lost_by = _lost(s, by)
    return out


def _lost(s: IndexedSlices, by: str) -> str | None:
    """Why slices made from ``s`` have no recipe, if ``s`` had (or lost) one."""
    if s._lost_by is not None:
        return s._lost_by
    return by if s._recipe is not None else None


def _with_flags(
    s: IndexedSlices, *, unique_indices: bool, indices_sorted: bool
) -> IndexedSlices:
    """``s`` recorded as coalesced (see ``IndexedSlices.unique_indices``)."""
    out = _build(s.values, s._indices, s.dense_shape)
    out._unique, out._sorted = bool(unique_indices), bool(indices_sorted)
    out._recipe, out._lost_by = s._recipe, s._lost_by  # the same values
    out._step = s._step
    return out


def with_step(s: IndexedSlices, step: Any) -> IndexedSlices:
    """``s`` (an update) carrying the optimizer's step count, which seeds the
    stochastic rounding of a low-precision table's apply
    (:func:`jaxslices._rounding.step_seed`). Not a pytree child: what
    rebuilds the slices from their leaves drops it (the rounding then
    draws per entry, not per step, unless ``apply_updates`` has a ``key``)."""
    out = _with_flags(s, unique_indices=s._unique, indices_sorted=s._sorted)
    out._step = step
    return out


def step_of(s: IndexedSlices) -> Any:
    """The step count :func:`with_step` gave ``s``, or ``None``."""
    return s._step


def with_recipe(s: IndexedSlices, recipe: PooledGradient) -> IndexedSlices:
    """``s`` holding ``recipe``: how its values are made (:attr:`IndexedSlices.recipe`).

    The recipe must describe ``s.values`` (float32) slot by slot, padding
    slots excepted: a native kernel then reads it instead of the values, and
    under ``jit`` the values XLA would compute for nobody are dropped.
    """
    if not isinstance(recipe, PooledGradient):
        raise TypeError(
            f"with_recipe: expected a jaxslices.PooledGradient, got "
            f"{type(recipe).__name__}."
        )
    out = _with_flags(s, unique_indices=s._unique, indices_sorted=s._sorted)
    out._recipe, out._lost_by = recipe, None
    return out


def scale_values(
    s: IndexedSlices, values: jax.Array, factor: Any, by: str = "a scaling"
) -> IndexedSlices:
    """``s`` with ``values`` (which are ``factor * s.values``), recipe scaled too.

    A ``factor`` that is not a scalar (one per row element) cannot scale the
    recipe: the result has none, and records that ``by`` lost it.
    """
    out = _replace_values(s, values, lost_by=f"{by} by a non-scalar factor")
    if jnp.ndim(factor) != 0:
        return out
    if s._recipe is not None:  # (a lost pooled form stays lost: its rows)
        out._recipe, out._lost_by = s._recipe.scaled(factor), s._lost_by
    elif _rounding.is_low_precision(s.values.dtype):
        # A low-precision gradient scaled (-lr * g): its product kept in
        # float32 as the rows' recipe, so the apply rounds it once, on both
        # paths (the values hold it rounded to their dtype).
        rows = PooledGradient.of_rows(s.values.astype(jnp.float32))
        out._recipe = rows.scaled(factor)
    return out


def float32_rows(s: IndexedSlices) -> IndexedSlices:
    """``s`` with float32 values: the rows its pooled gradient makes where it
    carries one (the rows a native kernel reads: a scaled gradient's
    ``-lr * g`` before any rounding to a low-precision dtype), else its
    values widened; indices, flags and recipe kept, padding slots zero.

    The XLA path of a low-precision table computes on these, so that it
    rounds once, where the kernels do, and to the same bits.
    """
    if s._recipe is None:
        values = s.values.astype(jnp.float32)
    else:
        rows = s._recipe.values(s.num_slices).astype(jnp.float32)
        valid = valid_mask(s).reshape((-1, 1))
        rows = jnp.where(valid, rows, jnp.zeros((), rows.dtype))
        values = rows.reshape((s.num_slices, *s.row_shape))
    out = _with_flags(
        _build(values, s._indices, s.dense_shape),
        unique_indices=s._unique,
        indices_sorted=s._sorted,
    )
    out._recipe, out._lost_by = s._recipe, s._lost_by
    return out


def kernel_input(s: IndexedSlices, where: str) -> PooledGradient:
    """What a native kernel reads for ``s``: its recipe, else its values.

    A kernel that reads the materialised ``[N, D]`` values records it for
    :func:`jaxslices.kernels.explain`, with why (the operation that lost the
    pooled gradient, when the slices had one).
    """
    if s._recipe is not None and s._lost_by is None:
        return s._recipe
    rows = f"[{s.num_slices}, {max(1, int(np.prod(s.row_shape)))}]"
    if s._lost_by is not None:
        why = (
            f"reading materialised {rows} rows: the pooled gradient was lost by "
            f"{s._lost_by}; jaxslices.tree_scale, tree_add and the jaxslices "
            "transforms keep it"
        )
    else:
        why = (
            f"reading the {rows} values: the slices carry no pooled gradient (a "
            "per-id lookup's gradient, slices built by hand, or a gradient "
            "rebuilt from its leaves: a jit boundary, any jax.tree.map, a Flax "
            "NNX variable's value)"
        )
    kernel_path.note_materialised(where, why)
    # (a low-precision gradient's scaled rows keep their float32 product)
    return PooledGradient.of_rows(s.values) if s._recipe is None else s._recipe


def _dense_operand(x: Any, s: IndexedSlices, opname: str) -> jax.Array:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        if isinstance(x, (int, float, complex)):
            raise TypeError(
                f"IndexedSlices {opname} scalar is not supported: adding a scalar "
                "to every entry makes the result dense. Use s.to_dense() "
                f"{opname} c if that is what you mean."
            )
        x = jnp.asarray(x)
    if tuple(x.shape) != s.dense_shape:
        raise ValueError(
            f"IndexedSlices {opname} dense array: the dense operand must have the "
            f"slices' dense shape {s.dense_shape}, got shape {tuple(x.shape)}."
        )
    return jnp.asarray(x)


def is_indexed_slices(x: Any) -> bool:
    """``True`` for an :class:`IndexedSlices`; use as ``is_leaf`` in tree maps."""
    return isinstance(x, IndexedSlices)


def check_slices(s: Any, where: str) -> IndexedSlices:
    """Trace-time guard for entry points that consume slices (free under jit)."""
    if not isinstance(s, IndexedSlices):
        raise TypeError(f"{where}: expected an IndexedSlices, got {type(s).__name__}.")
    if not _typed_indices.is_typed(s._indices):
        # Rebuilt by tree_unflatten from leaves that were not typed indices.
        _check_integer_indices(s._indices, where)
        s.indices  # noqa: B018 - raises the "rebuilt from plain leaves" error
    return s


def valid_mask(s: IndexedSlices) -> jax.Array:
    """Boolean ``[N]``: ``True`` where the slot's index is a real row (0 <= i < V)."""
    check_slices(s, "valid_mask")
    return _ids.valid(s.indices, s.dense_shape[0])


def safe_indices(s: IndexedSlices) -> jax.Array:
    """Indices with padding, negative and too-large ones all mapped to ``V``.

    ``V = dense_shape[0]`` is out of bounds, so a ``mode="drop"`` scatter
    drops it and a ``mode="fill"`` gather fills it. This is what stops JAX
    from wrapping ``-1`` to the last row (the ids policy,
    :func:`jaxslices._ids.safe_ids`; the stored indices have its dtype).
    """
    check_slices(s, "IndexedSlices")
    return _ids.safe_ids(s.indices, s.dense_shape[0])


# Pickles name these at the public module, as before the type had its own:
# pickles load in either layout (jaxslices.slices re-exports them).
for _f in (IndexedSlices, _unpickle, _build):
    _f.__module__ = "jaxslices.slices"
del _f
