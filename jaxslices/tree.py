"""Sparse-aware operations on gradient trees (pytrees with ``IndexedSlices`` leaves).

Generic pytree code maps over the ``indices`` of an
:class:`~jaxslices.IndexedSlices` as if they were numbers; jaxslices stores them
in a typed form so that such code raises instead of silently changing which rows
an update lands on (see ``docs/design.md``, "Generic tree operations"). These
are the operations to use instead:

=====================================  =====================================
generic code (raises on slices)        jaxslices
=====================================  =====================================
``jax.tree.map(jnp.add, g1, g2)``      :func:`tree_add` ``(g1, g2)``
``jax.tree.map(lambda g: c * g, g)``   :func:`tree_scale` ``(c, g)``
``jax.tree.map(f, g)`` (on values)     :func:`tree_map_values` ``(f, g)``
``optax.global_norm(g)``               :func:`jaxslices.global_norm` ``(g)``
``jax.lax.psum(g, axis)``              :func:`tree_psum` ``(g, axis)``
``jax.lax.pmean(g, axis)``             :func:`tree_pmean` ``(g, axis)``
``optax.MultiSteps``                   :class:`jaxslices.MultiSteps`
=====================================  =====================================

Every function treats ``None`` and ``IndexedSlices`` as leaves; dense leaves
get exactly the dense operation.

**The pooled form.** The gradient of an ``embedding_bag`` carries its pooled
gradient (:attr:`jaxslices.IndexedSlices.recipe`), which the native kernels
read instead of the ``[N, D]`` values. :func:`tree_scale` keeps it (scaled),
:func:`tree_add` keeps it (the parts' pooled gradients side by side; a part
without one contributes its rows); :func:`tree_map_values` cannot (``fn`` is
any row-wise map: it makes new values, and a kernel after it reads them), nor
can :func:`tree_psum` / :func:`tree_pmean` (the slices are all-gathered as
rows). :func:`jaxslices.kernels.explain` names the operation that lost it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from . import _indexed, _jax_compat, _leaves, slices
from ._indexed import IndexedSlices, _replace_values, check_slices

__all__ = [
    "tree_add",
    "tree_scale",
    "tree_map_values",
    "tree_psum",
    "tree_pmean",
]

AxisName = Hashable | Sequence[Hashable]


_is_leaf = _leaves.is_leaf


def _where(name: str, path: Any) -> str:
    return _leaves.label(f"jaxslices.{name}", path)


def tree_add(*trees: Any) -> Any:
    """Add gradient trees leaf by leaf; slices concatenate, arrays add.

    Two :class:`~jaxslices.IndexedSlices` of one dense shape concatenate (TF's
    gradient aggregation: the result has the slots of both, so the sizes add
    up; duplicates mean "sum"; pooled gradients stay pooled,
    :attr:`jaxslices.IndexedSlices.recipe`); arrays add; an array plus
    slices is the dense array with the rows added (``x + s``). ``None`` plus
    ``None`` is ``None``. The sum of the dense equivalents is exact:
    ``to_dense(tree_add(a, b)) == to_dense(a) + to_dense(b)``. Use it for
    manual gradient accumulation (``jax.tree.map(jnp.add, g1, g2)`` raises
    on slices); for accumulation in a fixed-size buffer see
    :class:`jaxslices.MultiSteps`.

    Args:
      *trees: one or more trees of the same structure (``None`` and
        ``IndexedSlices`` count as leaves).

    Returns:
      The leafwise sum, same structure.

    Raises:
      ValueError: the trees differ in structure (the first differing leaf is
        named) or two slices leaves differ in dense shape.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> from jaxslices import IndexedSlices
      >>> g1 = {"emb": IndexedSlices(jnp.ones((1, 2)), jnp.array([0]), (3, 2)),
      ...       "w": jnp.ones(2)}
      >>> g2 = {"emb": IndexedSlices(jnp.ones((2, 2)), jnp.array([0, 2]), (3, 2)),
      ...       "w": jnp.ones(2)}
      >>> total = jaxslices.tree_add(g1, g2)
      >>> total["emb"].indices, total["w"]
      (Array([0, 0, 2], dtype=int32), Array([2., 2.], dtype=float32))
    """
    if not trees:
        raise ValueError("jaxslices.tree_add: need at least one tree, got none.")
    first = trees[0]
    for i, t in enumerate(trees[1:], start=1):
        _leaves.check_structure(
            "jaxslices.tree_add", first, "trees[0]", t, f"trees[{i}]"
        )

    def leaf(path, *xs):
        if all(x is None for x in xs):
            return None
        if any(x is None for x in xs):
            raise ValueError(
                f"{_where('tree_add', path)}: some trees have None here and some "
                "do not; cannot add a gradient to a missing one."
            )
        parts = [x for x in xs if isinstance(x, IndexedSlices)]
        dense = [x for x in xs if not isinstance(x, IndexedSlices)]
        for p in parts:
            check_slices(p, _where("tree_add", path))
        if not dense:
            return slices.concatenate(parts)
        total = dense[0]
        for d in dense[1:]:
            total = total + d
        for p in parts:
            total = total + p  # dense + slices: scatter-add of the rows
        return total

    return jax.tree_util.tree_map_with_path(leaf, *trees, is_leaf=_is_leaf)


def tree_map_values(fn: Callable[[jax.Array], jax.Array], tree: Any) -> Any:
    """Apply ``fn`` to every dense leaf and to the ``values`` of every slices leaf.

    The indices of slices leaves are kept. Only correct for functions that act
    row by row with ``fn(0) == 0`` on the dense equivalent (scaling, casting,
    clipping values): ``fn`` sees the slots, not the summed rows. The result
    has no pooled form (:attr:`jaxslices.IndexedSlices.recipe`): ``fn`` is
    applied to the materialised rows; to scale, use :func:`tree_scale`, which
    keeps it.

    Args:
      fn: array -> array. On a slices leaf it must keep the values' shape
        ``[N, *dense_shape[1:]]`` (a ``ValueError`` names the leaf otherwise);
        its dtype may change.
      tree: a gradient tree.

    Returns:
      The mapped tree (``None`` leaves stay ``None``).

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> g = jaxslices.IndexedSlices(jnp.ones((2, 1)), jnp.array([1, 2]), (3, 1))
      >>> half = jaxslices.tree_map_values(lambda v: v.astype(jnp.bfloat16), g)
      >>> half.dtype, half.indices
      (dtype(bfloat16), Array([1, 2], dtype=int32))
    """
    return _map_values("tree_map_values", fn, tree)


def _map_values(
    name: str,
    fn: Callable[[jax.Array], jax.Array],
    tree: Any,
    factor: Any = None,
) -> Any:
    """:func:`tree_map_values`, its errors naming ``jaxslices.<name>``.

    The one value-wise map of gradient trees: :func:`tree_map_values` and the
    value-wise transforms (``scale``, ``scale_by_schedule``) use it.
    ``factor``: a scalar with ``fn(x) == factor * x`` (up to rounding), so
    slices keep their native recipe, scaled (:func:`jaxslices._indexed.scale_values`).
    """

    def leaf(path, g):
        if g is None:
            return None
        if isinstance(g, IndexedSlices):
            check_slices(g, _where(name, path))
            values = fn(g.values)
            want = (g.num_slices, *g.row_shape)
            got = getattr(values, "shape", None)
            if got is None or tuple(got) != want:
                what = type(values).__name__ if got is None else f"shape {got}"
                raise ValueError(
                    f"{_where(name, path)}: `fn` must keep the shape "
                    f"of the values of an IndexedSlices, {want} (one row of shape "
                    f"dense_shape[1:] = {g.row_shape} per slot), but it returned "
                    f"{what}. fn sees the slots' rows, so it must act row by row "
                    "and keep the row shape (scaling, casting, clipping values). To "
                    "reduce or reshape rows, densify first: "
                    "fn(jaxslices.to_dense(tree))."
                )
            if factor is None:
                return _replace_values(
                    g, values, f"jaxslices.{name} (a map of the rows)"
                )
            return _indexed.scale_values(g, values, factor, f"jaxslices.{name}")
        return fn(g)

    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=_is_leaf)


def tree_scale(scalar: Any, tree: Any) -> Any:
    """Multiply every leaf by ``scalar``; slices scale their values only.

    The sparse-aware ``jax.tree.map(lambda g: scalar * g, tree)`` (which raises
    on slices): ``to_dense(tree_scale(c, g)) == c * to_dense(g)``. Like
    :func:`optax.tree.scale`, the result keeps each leaf's dtype. Slices keep
    their pooled form, scaled (:attr:`jaxslices.IndexedSlices.recipe`), so
    a native optimizer step after it still reads the pooled gradient.

    Args:
      scalar: a scalar (Python number or 0-d array).
      tree: a gradient tree.

    Returns:
      The scaled tree.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> g = {"emb": jaxslices.IndexedSlices(jnp.ones((1, 2)), jnp.array([2]), (3, 2))}
      >>> jaxslices.tree_scale(0.5, g)["emb"].values
      Array([[0.5, 0.5]], dtype=float32)
    """
    if jnp.ndim(scalar) != 0:
        raise ValueError(
            "jaxslices.tree_scale: `scalar` must be a scalar, got shape "
            f"{tuple(jnp.shape(scalar))}. To scale rows differently use "
            "jaxslices.tree_map_values."
        )

    def scale(x):
        return (jnp.asarray(scalar) * x).astype(x.dtype)

    return _map_values("tree_scale", scale, tree, factor=scalar)


def _axis_size(axis_name: AxisName) -> Any:
    return jax.lax.psum(1, axis_name)


def _axes(axis_name: AxisName) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _typed_axis(axis: Any) -> bool:
    """Whether values carry their varying axes over ``axis``.

    True inside ``shard_map(check_vma=True)`` (the default), where
    ``axis_index`` varies over the axis; False with ``check_vma=False``, under
    ``pmap`` and ``vmap``, where nothing records what varies.
    """
    return axis in (_jax_compat.varying_axes(jax.lax.axis_index(axis)) or ())


def _sum_slices(
    s: IndexedSlices, axis_name: AxisName, where: str
) -> tuple[IndexedSlices, Any]:
    """The sum over ``axis_name`` of per-device slices, and the axes' size.

    Slices that vary over an axis (each device has its own) are all-gathered
    over it, ``n * N`` slots, into a value every device holds alike. Slices
    known to be the same on every device of an axis (inside
    ``shard_map(check_vma=True)``: e.g. the gradient of a replicated table,
    which JAX, and :func:`jaxslices.value_and_grad`, sum over the devices
    already) are not gathered: their sum over the axis is ``n`` times them, as
    ``jax.lax.psum`` of such a dense value is.
    """
    check_slices(s, where)
    known = [_jax_compat.varying_axes(x) for x in (s.values, s._indices)]
    # Unknown (None): treated as varying over every axis, i.e. gathered.
    varying = None if None in known else known[0] | known[1]
    gather, repeat = [], []
    for axis in _axes(axis_name):
        typed = _typed_axis(axis)
        same = typed and varying is not None and axis not in varying
        (repeat if same else gather).append((axis, typed))
    values, indices = s.values, s.indices
    if gather:
        names = tuple(a for a, _ in gather)
        if all(typed for _, typed in gather):  # the result is the same everywhere
            values, indices = _jax_compat.all_gather_invariant((values, indices), names)
        else:
            values = jax.lax.all_gather(values, names, axis=0, tiled=True)
            indices = jax.lax.all_gather(indices, names, axis=0, tiled=True)
    copies = _axis_size(tuple(a for a, _ in repeat)) if repeat else 1
    out = IndexedSlices(values, indices, s.dense_shape)
    lost = "jaxslices.tree_psum / tree_pmean (slices are all-gathered as rows)"
    return _indexed.lost_from(out, s, lost), copies


def tree_psum(tree: Any, axis_name: AxisName) -> Any:
    """Sum a gradient tree over a named axis: arrays ``psum``, slices all-gather.

    The data-parallel reduction: inside :func:`jax.shard_map`, ``jax.pmap`` or
    ``jax.vmap(..., axis_name=...)``, dense leaves are :func:`jax.lax.psum`-ed
    and every :class:`~jaxslices.IndexedSlices` leaf is all-gathered (values and
    indices, concatenated in axis order) so each device holds the slots of all
    devices: ``n * N`` slots for ``n`` devices of ``N``. Its dense equivalent is
    the sum of the devices' dense equivalents; communication is
    ``O(n * N * row)``, never ``O(V * row)``, and indices are never summed
    (``jax.lax.psum`` of the tree raises on slices for that reason). Coalesce
    afterwards (:func:`jaxslices.coalesce`) if the consumer needs unique rows;
    the jaxslices optimizers do that themselves.

    Args:
      tree: a gradient tree (``None`` and ``IndexedSlices`` are leaves).
      axis_name: the named axis (or tuple of axes) to reduce over.

    Returns:
      The reduced tree; slices leaves have ``n`` times as many slots.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices
      >>> def per_device(v, i):
      ...     g = {"emb": jaxslices.IndexedSlices(v, i, (4, 1)), "w": v.sum()}
      ...     return jaxslices.tree_psum(g, "data")
      >>> out = jax.vmap(per_device, axis_name="data")(
      ...     jnp.ones((2, 1, 1)), jnp.array([[1], [3]]))
      >>> out["emb"].indices[0], out["w"]
      (Array([1, 3], dtype=int32), Array([2., 2.], dtype=float32))
    """

    def leaf(path, g):
        if g is None:
            return None
        if isinstance(g, IndexedSlices):
            s, copies = _sum_slices(g, axis_name, _where("tree_psum", path))
            if isinstance(copies, int) and copies == 1:
                return s
            return _replace_values(s, (s.values * copies).astype(s.dtype))
        return jax.lax.psum(g, axis_name)

    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=_is_leaf)


def tree_pmean(tree: Any, axis_name: AxisName) -> Any:
    """Average a gradient tree over a named axis: :func:`tree_psum` / axis size.

    Dense leaves are :func:`jax.lax.pmean`-ed; slices leaves are all-gathered
    as in :func:`tree_psum` and their values divided by the axis size, so the
    dense equivalent is the mean of the devices' dense equivalents.

    Args:
      tree, axis_name: as in :func:`tree_psum`.

    Returns:
      The averaged tree; slices leaves have ``n`` times as many slots.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices
      >>> def per_device(v, i):
      ...     g = jaxslices.IndexedSlices(v, i, (4,))
      ...     return jaxslices.tree_pmean(g, "data").to_dense()
      >>> jax.vmap(per_device, axis_name="data")(
      ...     jnp.array([[2.0], [4.0]]), jnp.array([[1], [1]]))[0]
      Array([0., 3., 0., 0.], dtype=float32)
    """

    def leaf(path, g):
        if g is None:
            return None
        if isinstance(g, IndexedSlices):
            s, copies = _sum_slices(g, axis_name, _where("tree_pmean", path))
            n = _axis_size(_axes(axis_name))
            if isinstance(copies, int) and copies == 1:
                return _replace_values(s, (s.values / n).astype(s.dtype))
            # n copies summed, divided by n: the slices themselves.
            scale = copies / n
            return _replace_values(s, (s.values * scale).astype(s.dtype))
        return jax.lax.pmean(g, axis_name)

    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=_is_leaf)
