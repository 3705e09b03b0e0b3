"""The ``IndexedSlices`` pytree type and every operation on it.

An ``IndexedSlices(values, indices, dense_shape)`` stands for the dense array
``zeros(dense_shape).at[indices].add(values)``: ``values[k]`` is added to row
``indices[k]``. It is TensorFlow's ``tf.IndexedSlices`` for JAX.

Conventions (see ``docs/design.md``):

* **Duplicates sum.** An index may appear several times; its rows add up.
* **Padding.** A slot whose index equals ``dense_shape[0]`` is a padding slot.
  It contributes nothing anywhere (dropped by scatters, zero in ``to_dense``,
  ignored by norms). Operations that create padding (``coalesce``,
  ``sparse_mask``) also zero its values. Fixed-size results (needed under
  ``jit``) use padding to say "fewer rows".
* **Invalid indices.** A negative index, or one greater than ``dense_shape[0]``,
  is treated like padding: it contributes nothing. JAX scatters would wrap a
  negative index to the end of the array even with ``mode="drop"``; every
  scatter here masks them first, so no row is ever written that was not asked
  for. ``check_ids=True`` on the lookups (or ``jaxslices.check_ids``) raises on
  out-of-range ids instead (opt-in).
* **Typed indices.** The ``indices`` pytree child is not a plain integer array
  but the ids wrapped in an extended dtype (``key<IndexedSlices.indices: ...>``,
  see :mod:`jaxslices._typed_indices`), so generic pytree arithmetic
  (``jax.tree.map(jnp.add, g1, g2)``, ``2 * g``, ``lax.psum``,
  ``optax.global_norm``, stock Optax) raises a ``TypeError`` naming
  ``IndexedSlices`` and the jaxslices way instead of silently changing which
  rows are updated. ``s.indices`` returns the plain int32 (or int64) ids; the
  unwrapping compiles to nothing. Code that builds an ``IndexedSlices`` without
  the constructor goes through ``_build``.
* **Static shapes.** ``dense_shape`` is a tuple of Python ints, part of the
  pytree's static aux data; ``values`` and ``indices`` are the children.
* **The pooled form.** A gradient of ``embedding_bag`` also carries its
  pooled gradient (:attr:`IndexedSlices.recipe`, a
  :class:`~jaxslices.PooledGradient`), which the native kernels read instead
  of the ``[N, D]`` values. It is static, not a pytree child. jaxslices'
  scaling, negation, ``astype`` to the same dtype, concatenation
  (``tree_add``, ``+``) and index flags keep it. Flattening and
  unflattening are pure: slices rebuilt from their leaves (any tree
  operation outside jaxslices, ``jax.tree.map(lambda x: x, g)`` included)
  have no pooled form, and the kernels then read the values, which
  :func:`jaxslices.kernels.explain` reports (:func:`kernel_input`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _coalesce, _errors, _ids, _recipe, _rounding, _spmd, _typed_indices
from ._recipe import PooledGradient
from .kernels import _ops as kernel_ops
from .kernels import _path as kernel_path

__all__ = [
    "IndexedSlices",
    "is_indexed_slices",
    "to_dense",
    "from_dense",
    "coalesce",
    "sparse_mask",
    "global_norm",
    "scatter_add",
    "scatter_sub",
    "scatter_update",
    "valid_mask",
]

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
        return coalesce(self, method=method, max_distinct=max_distinct)

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
        if isinstance(other, IndexedSlices):
            return concatenate([self, other])
        return _scatter_add(_dense_operand(other, self, "+"), self, _PLUS)

    def __radd__(self, other: Any) -> Any:
        if isinstance(other, IndexedSlices):
            return concatenate([other, self])
        return _scatter_add(_dense_operand(other, self, "+"), self, _PLUS)

    def __sub__(self, other: Any) -> Any:
        if isinstance(other, IndexedSlices):
            return concatenate([self, -other])
        # s - x = -x + s
        return scatter_add(-_dense_operand(other, self, "-"), self)

    def __rsub__(self, other: Any) -> Any:
        if isinstance(other, IndexedSlices):
            return concatenate([other, -self])
        return scatter_sub(_dense_operand(other, self, "-"), self)


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


def to_dense(tree: Any) -> Any:
    """Densify every :class:`IndexedSlices` in a pytree; other leaves unchanged.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> s = jaxslices.IndexedSlices(jnp.ones((1, 2)), jnp.array([1]), (2, 2))
      >>> jaxslices.to_dense({"table": s, "bias": jnp.zeros(2)})["table"]
      Array([[0., 0.],
             [1., 1.]], dtype=float32)
    """
    return jax.tree.map(
        lambda x: x.to_dense() if isinstance(x, IndexedSlices) else x,
        tree,
        is_leaf=is_indexed_slices,
    )


def from_dense(x: jax.Array, indices: Any) -> IndexedSlices:
    """Gather rows ``x[indices]`` into an :class:`IndexedSlices` of shape ``x.shape``.

    Invalid indices (negative, or ``>= x.shape[0]``) gather zeros, so
    ``from_dense(x, i).to_dense()`` is ``x`` masked to the valid rows
    (duplicates counted as often as they appear).

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> x = jnp.arange(6.0).reshape(3, 2)
      >>> jaxslices.from_dense(x, jnp.array([2, 0])).values
      Array([[4., 5.],
             [0., 1.]], dtype=float32)
    """
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(
            f"from_dense: `x` must have at least one dimension, got a scalar "
            f"(shape {x.shape})."
        )
    indices = jnp.asarray(indices)
    s = IndexedSlices(
        jnp.zeros((indices.shape[0] if indices.ndim else 0, *x.shape[1:]), x.dtype),
        indices,
        x.shape,
    )
    values = x.at[safe_indices(s)].get(mode="fill", fill_value=0)
    return _replace_values(s, values)


def concatenate(slices: Sequence[IndexedSlices]) -> IndexedSlices:
    """Concatenate slices of one dense shape (TF's gradient aggregation)."""
    slices = list(slices)
    if not slices:
        raise ValueError("concatenate: need at least one IndexedSlices, got none.")
    first = slices[0]
    for i, s in enumerate(slices):
        check_slices(s, "concatenate")
        if s.dense_shape != first.dense_shape:
            raise ValueError(
                "IndexedSlices + IndexedSlices: both must have the same dense "
                f"shape, got {first.dense_shape} and {s.dense_shape} (operand {i})."
            )
    if len(slices) == 1:
        return first
    dtype = jnp.result_type(*[s.values.dtype for s in slices])
    itype = jnp.result_type(*[s.indices.dtype for s in slices])
    out = IndexedSlices(
        jnp.concatenate([s.values.astype(dtype) for s in slices]),
        jnp.concatenate([s.indices.astype(itype) for s in slices]),
        first.dense_shape,
    )
    # The parts' pooled gradients side by side (a part without one: its rows).
    if any(s._recipe is not None for s in slices) and dtype == jnp.float32:
        parts = [
            (
                PooledGradient.of_rows(s.values) if s._recipe is None else s._recipe,
                s.num_slices,
            )
            for s in slices
        ]
        out._recipe = _recipe.concatenate(parts)
    else:
        lost = [s._lost_by for s in slices if s._lost_by is not None]
        out._lost_by = lost[0] if lost else None
    return out


def coalesce(
    s: IndexedSlices, *, method: str = "sort", max_distinct: int | None = None
) -> IndexedSlices:
    """Sum duplicate indices: unique indices, same static size ``N``.

    The result has the same dense equivalent. Its first ``u`` slots hold the
    ``u`` distinct valid indices with their summed rows (summed in at least
    float32; integers in at least 32-bit integers, never through a float); the
    remaining ``N - u`` slots are padding (index ``dense_shape[0]``, values
    zero). Invalid indices are dropped (become padding). Deterministic: the
    same input gives the same bits on every run, on every platform. The result
    records that it is coalesced (:attr:`IndexedSlices.unique_indices`), so
    coalescing it again returns it as is.

    Args:
      s: the slices.
      method: how to find duplicates (``jaxslices._coalesce`` explains each and
        ``benchmarks/RESULTS.md`` measures them):

        * ``"sort"`` (default): indices in increasing order (GPU: pair sort and
          a fixed-tree scan; CPU/TPU: sort of the ids and ``searchsorted``).
        * ``"pair_sort"``: sorted, the GPU algorithm on every platform.
        * ``"hash"``: O(N) hash deduplication, indices in order of first
          appearance (on GPU: ``"sort"``); about 2x faster on CPU.
        * ``"auto"``: the fastest measured per platform, sorted or not
          (``"hash"`` on CPU, ``"sort"`` elsewhere); what the transforms use.
      max_distinct: a static bound on the number of distinct valid indices:
        the result has ``min(max_distinct, N)`` slots instead of ``N``, so
        whatever consumes it (a scatter, an optimizer's state rows) works on
        fewer rows. More distinct indices than that raise a ``ValueError``
        (eagerly; under ``jit`` a ``JaxRuntimeError``, or ``ValueError`` on
        later calls, with the same message, on every device of a mesh):
        nothing is dropped silently.
        :func:`jaxslices.capacity.estimate_max_distinct` estimates it from
        sample batches.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> vals, ids = jnp.array([1., 2., 3.]), jnp.array([4, 1, 4])
      >>> s = jaxslices.IndexedSlices(vals, ids, (5,))
      >>> c = jaxslices.coalesce(s)
      >>> c.indices, c.values
      (Array([1, 4, 5], dtype=int32), Array([2., 4., 0.], dtype=float32))
      >>> h = jaxslices.coalesce(s, method="hash")  # first appearance: 4, then 1
      >>> h.indices, h.values, h.unique_indices, h.indices_sorted
      (Array([4, 1, 5], dtype=int32), Array([4., 2., 0.], dtype=float32), True, False)
      >>> jaxslices.coalesce(s, max_distinct=2).indices  # two slots
      Array([1, 4], dtype=int32)
    """
    check_slices(s, "coalesce")
    _coalesce.check_method(method, "jaxslices.coalesce")
    size = check_max_distinct(max_distinct, "jaxslices.coalesce")
    return coalesce_bounded(s, method, size, "jaxslices.coalesce")


def check_max_distinct(max_distinct: Any, where: str) -> int | None:
    """``max_distinct`` as a positive int or ``None``; anything else raises."""
    if max_distinct is None:
        return None
    ok = isinstance(max_distinct, (int, np.integer)) and not isinstance(
        max_distinct, bool
    )
    if not ok or max_distinct < 1:
        raise ValueError(
            f"{where}: `max_distinct` must be a positive int (a static bound on "
            f"the distinct rows of one gradient) or None, got {max_distinct!r}. "
            "jaxslices.capacity.estimate_max_distinct(sample_ids) estimates one."
        )
    return int(max_distinct)


def _too_many_rows(count: int, *, size: int, where: str) -> ValueError:
    return ValueError(
        f"{where}: this step's gradient touches {count} distinct rows, more "
        f"than max_distinct={size}. Nothing was dropped: the step stops here. "
        f"Pass max_distinct >= {count} (a margin above the largest count seen; "
        "jaxslices.capacity.estimate_max_distinct(sample_ids, margin=...) "
        "estimates one from sample batches), or max_distinct=None (one slot per "
        "lookup, which never overflows)."
    )


def coalesce_bounded(
    s: IndexedSlices, method: str, size: int | None, where: str
) -> IndexedSlices:
    """:func:`coalesce` into ``min(size, N)`` slots; more distinct rows raise.

    ``where`` names the caller in the overflow message. Slices that are
    coalesced already (distinct valid indices first, padding after) are cut
    to ``size`` slots (after checking that the cut slots are padding).
    """
    unsorted_ok = method in _coalesce.UNSORTED_OK
    n = s.num_slices
    size = n if size is None else min(size, n)
    if s.unique_indices and (s.indices_sorted or unsorted_ok):
        if size == n:
            return s  # coalesced already: free
        count = jnp.sum(valid_mask(s), dtype=jnp.int32)
        kept = _build(s.values[:size], s._indices[:size], s.dense_shape)
        return _guard_count(kept, count, size, where, s.indices_sorted)
    if n == 0:
        return s
    values, indices, count = _coalesce.coalesce_rows(
        s.values, safe_indices(s), s.dense_shape[0], method, size
    )
    out = IndexedSlices(values, indices, s.dense_shape)
    if size == n:  # every distinct row fits: nothing to check
        return _with_flags(out, unique_indices=True, indices_sorted=not unsorted_ok)
    return _guard_count(out, count, size, where, not unsorted_ok)


def _guard_count(
    s: IndexedSlices, count: Any, size: int, where: str, sorted_: bool
) -> IndexedSlices:
    """``s`` (coalesced), its indices guarded by ``count <= size``."""
    # Both guarded: a caller may use only the values (a norm) or the indices.
    values, indices = _errors.raise_if(
        count > size,
        (s.values, s.indices),
        functools.partial(_too_many_rows, size=size, where=where),
        count,
    )
    out = IndexedSlices(values, indices, s.dense_shape)
    return _with_flags(out, unique_indices=True, indices_sorted=sorted_)


def sparse_mask(s: IndexedSlices, mask_indices: Any) -> IndexedSlices:
    """Remove the slices whose index is in ``mask_indices`` (TF semantics).

    Removed slots become padding (index ``dense_shape[0]``, values zero), so the
    static size is unchanged.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> s = jaxslices.IndexedSlices(jnp.ones((3, 1)), jnp.array([0, 2, 3]), (4, 1))
      >>> jaxslices.sparse_mask(s, jnp.array([2])).indices
      Array([0, 4, 3], dtype=int32)
    """
    check_slices(s, "sparse_mask")
    mask_indices = jnp.asarray(mask_indices)
    if not jnp.issubdtype(mask_indices.dtype, jnp.integer):
        raise TypeError(
            "sparse_mask: `mask_indices` must be integers, got "
            f"{jnp.dtype(mask_indices.dtype).name}{list(mask_indices.shape)}."
        )
    mask_indices = mask_indices.reshape(-1)
    if mask_indices.shape[0] == 0:
        return s
    m = jnp.sort(mask_indices.astype(s.indices.dtype))
    pos = jnp.clip(jnp.searchsorted(m, s.indices), 0, m.shape[0] - 1)
    hit = m[pos] == s.indices
    v = s.dense_shape[0]
    indices = jnp.where(hit, jnp.asarray(v, s.indices.dtype), s.indices)
    hit_rows = _coalesce.rows_where(hit, s.values.ndim)
    values = jnp.where(hit_rows, jnp.zeros((), s.dtype), s.values)
    return IndexedSlices(values, indices, s.dense_shape)


def sum_of_squares(x: Any) -> jax.Array:
    """Exact squared L2 norm of the dense equivalent of ``x`` (array or slices)."""
    if isinstance(x, IndexedSlices):
        c = coalesce(x)
        vals = c.values.astype(jnp.promote_types(c.dtype, jnp.float32))
        return jnp.sum(jnp.real(vals * jnp.conj(vals)))
    x = jnp.asarray(x)
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return jnp.sum(jnp.real(x * jnp.conj(x)))


def global_norm(updates: Any) -> jax.Array:
    """Exact L2 norm of the dense equivalent of every leaf of ``updates``.

    Duplicate indices are summed before squaring (unlike ``tf.linalg.global_norm``,
    which squares the raw values and under-reports the norm when ids repeat).
    Padding and invalid slots are ignored. Computed in at least float32.

    Inside a row-sharded optimizer step (:func:`jaxslices.sharding.sharded_update`,
    :meth:`jaxslices.sharding.ShardingPlan.update`), where each shard holds the
    rows it owns, a sharded table's squared norm is summed over the shards, so
    every device gets the norm of the whole gradient (the one
    :func:`jaxslices.clip_by_global_norm` clips by).

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> vals, ids = jnp.array([[3.], [3.]]), jnp.array([0, 0])
      >>> s = jaxslices.IndexedSlices(vals, ids, (2, 1))
      >>> float(jaxslices.global_norm({"emb": s, "w": jnp.array([8.0])}))
      10.0
    """
    return norm_of_leaves(jax.tree.leaves(updates, is_leaf=is_indexed_slices))


def norm_of_leaves(
    leaves: Sequence[Any], measured: Sequence[jax.Array | None] | None = None
) -> jax.Array:
    """:func:`global_norm` of ``leaves`` (``None`` leaves skipped).

    ``measured[i]``, where given, is leaf ``i``'s squared norm already
    measured (the native coalescing kernel's, ``clip_by_global_norm``), used
    instead of summing its rows again.
    """
    measured = [None] * len(leaves) if measured is None else measured
    squares = [
        _squared_norm(x, m)
        for x, m in zip(leaves, measured, strict=True)
        if x is not None
    ]
    if not squares:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(sum(squares))


def _squared_norm(x: Any, measured: jax.Array | None = None) -> jax.Array:
    """:func:`sum_of_squares`, summed over row shards (see :func:`global_norm`)."""
    if not isinstance(x, IndexedSlices):
        return sum_of_squares(x)
    if measured is not None:
        sq = measured
    elif x.unique_indices:  # coalesced (sorted or not): no duplicate to sum
        vals = x.values.astype(jnp.promote_types(x.dtype, jnp.float32))
        keep = _coalesce.rows_where(valid_mask(x), vals.ndim)
        vals = jnp.where(keep, vals, jnp.zeros((), vals.dtype))
        sq = jnp.sum(jnp.real(vals * jnp.conj(vals)))
    else:
        sq = sum_of_squares(x)
    return _spmd.sum_over_shards(sq)


def _check_target(
    x: Any, s: IndexedSlices, where: str
) -> tuple[jax.Array, IndexedSlices]:
    check_slices(s, where)
    x = jnp.asarray(x)
    if tuple(x.shape) != s.dense_shape:
        raise ValueError(
            f"{where}: `x` must have the slices' dense shape {s.dense_shape}, got "
            f"shape {tuple(x.shape)}."
        )
    # Under jit over a mesh: the slices' rows on every device before the
    # scatter, so XLA never scatters into a zero table and all-reduces it.
    return x, _spmd.replicate_rows(x, s)


_PLUS = "IndexedSlices + array (optax.apply_updates)"


def scatter_add(x: jax.Array, s: IndexedSlices) -> jax.Array:
    """``x.at[s.indices].add(s.values)`` with padding and invalid slots dropped.

    The result keeps ``x``'s dtype. Under ``jax.jit`` with ``x`` donated the
    update happens in place.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> s = jaxslices.IndexedSlices(jnp.ones((2,)), jnp.array([1, 1]), (3,))
      >>> jaxslices.scatter_add(jnp.zeros(3), s)
      Array([0., 2., 0.], dtype=float32)
    """
    return _scatter_add(x, s, "scatter_add")


def _scatter_add(x: Any, s: IndexedSlices, where: str) -> jax.Array:
    """:func:`scatter_add`; ``where`` names the caller's leaf for ``explain``.

    On the native path (:mod:`jaxslices.kernels`) a kernel adds the rows in
    place, reading a bag's pooled gradient directly when the slices carry
    it, and adding each id's row in turn, as XLA's scatter-add does
    (docs/kernels.md, "Plain SGD adds each id's row to the table in turn").
    """
    return _apply(x, s, where)


def _scatter_rounded(
    x: Any,
    s: IndexedSlices,
    where: str,
    *,
    stochastic: bool,
    seed: Any,
    origin: Any = None,
) -> jax.Array:
    """Add ``s`` to a bfloat16/float16 ``x`` in float32, one rounding per row.

    Duplicates are summed in float32 first, each touched row is read,
    ``row + sum`` computed in float32 and written back rounded (to nearest,
    or stochastically: :mod:`jaxslices._rounding`), so a row is rounded once
    per step whatever its number of duplicates. The rows added are the
    pooled gradient's float32 rows where the slices carry it (a scaled
    gradient, ``-lr * g``, is not rounded to the table's dtype first), on
    both paths. ``origin``: where the noise reads each row
    (:func:`jaxslices.kernels._ops.noise_rows`; ``None``: the row itself).
    """
    return _apply(
        x, s, where, low=True, stochastic=stochastic, seed=seed, origin=origin
    )


def _apply(
    x: Any,
    s: IndexedSlices,
    where: str,
    *,
    low: bool = False,
    stochastic: bool = False,
    seed: Any = None,
    origin: Any = None,
) -> jax.Array:
    """The one apply: ``kernel_ops.apply``, bound on either path.

    :func:`jaxslices.kernels._path.decide` decides (and the op records) the
    path; its lowering runs the kernel or the op's XLA reference. On the XLA
    path the rows are laid out on a mesh first (``_check_target``); a
    low-precision table reads the pooled gradient's float32 rows there too.
    """
    given = s
    x, s = _check_target(x, s, where)
    if low and s.num_slices == 0:
        return x
    # Coalesced slices (distinct valid ids; padding is out of bounds, so
    # dropped) promise XLA unique (and maybe sorted) indices: a cheaper scatter.
    flags = {"coalesced": s.unique_indices, "indices_sorted": s.indices_sorted}
    if low:
        flags.update(
            sum_duplicates=True, stochastic=stochastic, seed=seed, origin=origin
        )
    reason = kernel_path.decide(tables=(x, s.values))
    if not reason:
        # The table whole (a reshape in between would make XLA copy it).
        recipe = kernel_input(given, where)
    elif low:  # the float32 rows the kernel would read, laid out as `s`
        rows = _spmd.replicate_rows(x, float32_rows(given).values)
        recipe = PooledGradient.of_rows(rows)
    else:
        recipe = PooledGradient.of_rows(s.values)
    return kernel_ops.apply(
        x,
        recipe,
        s.indices,
        **flags,
        reason=reason,
        label=where,
    )


def scatter_sub(x: jax.Array, s: IndexedSlices) -> jax.Array:
    """``x.at[s.indices].add(-s.values)`` with padding and invalid slots dropped."""
    x, s = _check_target(x, s, "scatter_sub")
    return x.at[safe_indices(s)].add(-s.values.astype(x.dtype), mode="drop")


def scatter_update(x: jax.Array, s: IndexedSlices) -> jax.Array:
    """Overwrite rows: ``x[i] = v`` for each slice; padding and invalid dropped.

    With duplicate indices the **last** occurrence wins, deterministically on
    every platform (XLA leaves the order of colliding writes unspecified, so
    earlier duplicates are removed before the scatter).

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> s = jaxslices.IndexedSlices(jnp.array([1., 2.]), jnp.array([0, 0]), (2,))
      >>> jaxslices.scatter_update(jnp.zeros(2), s)
      Array([2., 0.], dtype=float32)
    """
    x, s = _check_target(x, s, "scatter_update")
    if s.num_slices == 0:
        return x
    target, perm = _coalesce.last_writes(safe_indices(s), pad=s.dense_shape[0])
    values = s.values[perm].astype(x.dtype)
    return x.at[target].set(values, mode="drop", unique_indices=False)
