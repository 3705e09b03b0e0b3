"""``IndexedSlices`` and every operation on it (the type: :mod:`jaxslices._indexed`).

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
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _coalesce, _errors, _indexed, _recipe, _spmd
from ._indexed import (
    IndexedSlices,
    _build,
    _replace_values,
    _with_flags,
    check_slices,
    float32_rows,
    is_indexed_slices,
    kernel_input,
    safe_indices,
    valid_mask,
)

# The type's other names, re-exported: importers of an earlier layout (the
# kernels' seam, transforms/_rowwise) and old pickles find them here.
from ._indexed import _unpickle as _unpickle
from ._indexed import lost_from as lost_from
from ._indexed import scale_values as scale_values
from ._indexed import step_of as step_of
from ._indexed import with_recipe as with_recipe
from ._indexed import with_step as with_step
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


_indexed.bind_operations(sys.modules[__name__])
