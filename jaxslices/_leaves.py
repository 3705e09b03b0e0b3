"""Internal: how jaxslices walks gradient trees, and names and fills their leaves.

One home for the tree conventions every tree-level function follows
(:mod:`jaxslices.tree`, :mod:`jaxslices.updates`, the transforms,
:class:`jaxslices.MultiSteps`, :func:`jaxslices.apply_if_finite`, the Equinox
layer):

* :func:`is_leaf`: ``None`` and :class:`~jaxslices.IndexedSlices` are leaves
  (an ``IndexedSlices`` update matches a dense parameter or state array; a
  ``None`` update means "no update", as in Optax).
* :func:`label`: the leaf named in an error message, ``jaxslices.fn (leaf
  ['emb'])``.
* :func:`named_in_path`: which of some names (a collection's buffers) a leaf
  is, by the last entry of its path that names one.
* :func:`check_structure`: two trees must have the same leaf paths; the error
  names the first path that is in one and not the other.
* :func:`zero_updates`: zero updates shaped like a tree: zeros for arrays,
  all-padding slices (they touch no row) for slices, varying over the mesh
  axes its model varies over (inside ``shard_map``, so that both branches of
  a ``lax.cond`` have one type). :func:`padding_slices` is one such leaf.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import _ids, _jax_compat
from .slices import IndexedSlices

__all__ = [
    "check_structure",
    "is_leaf",
    "label",
    "named_in_path",
    "padding_slices",
    "zero_updates",
]


def is_leaf(x: Any) -> bool:
    """``None`` and ``IndexedSlices`` are leaves of a gradient tree."""
    return x is None or isinstance(x, IndexedSlices)


def label(where: str, path: Any) -> str:
    """``where`` and the leaf at ``path``, for error messages.

    Example:
      >>> import jax
      >>> from jaxslices import _leaves
      >>> _leaves.label("jaxslices.sgd", (jax.tree_util.DictKey("emb"),))
      "jaxslices.sgd (leaf ['emb'])"
    """
    return f"{where} (leaf {jax.tree_util.keystr(path) or '<root>'})"


def named_in_path(path: Any, names: Any) -> str | None:
    """The last entry of a leaf's ``path`` that is one of ``names``, or ``None``.

    An entry is a dict key, an attribute name or a sequence index; the last
    one that names, e.g., a collection's buffer wins (Flax NNX and Equinox
    add entries below it: ``['dim4_float32'].value``).

    Example:
      >>> import jax
      >>> from jaxslices import _leaves
      >>> path = jax.tree_util.tree_flatten_with_path({"m": {"b": [1]}})[0][0][0]
      >>> _leaves.named_in_path(path, {"b", "c"})
      'b'
    """
    for entry in reversed(tuple(path)):
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                name = getattr(entry, attr)
                if isinstance(name, str) and name in names:
                    return name
                break
    return None


def check_structure(where: str, tree: Any, name: str, other: Any, other_name: str):
    """Raise a ``ValueError`` naming the first tree path where two trees differ.

    ``None`` and ``IndexedSlices`` count as leaves in both trees, so an
    ``IndexedSlices`` update matches a dense parameter or state array.
    """

    def paths(t):
        leaves = jax.tree_util.tree_flatten_with_path(t, is_leaf=is_leaf)[0]
        return [jax.tree_util.keystr(p) for p, _ in leaves]

    a, b = paths(tree), paths(other)
    if a == b:
        return
    only_a = [p for p in a if p not in set(b)]
    only_b = [p for p in b if p not in set(a)]
    if only_a or only_b:
        detail = (
            f"leaf {(only_a or only_b)[0] or '<root>'} is in `"
            f"{name if only_a else other_name}` but not in `"
            f"{other_name if only_a else name}`"
        )
    else:
        detail = "the same leaves are in a different order"
    raise ValueError(
        f"{where}: `{name}` and `{other_name}` must have the same tree structure; "
        f"{detail} ({len(a)} leaves vs {len(b)})."
    )


def padding_slices(num_slices: int, dense_shape: tuple[int, ...], dtype: Any):
    """``num_slices`` padding slots (index ``V``, zero values): touch no row."""
    num_rows = dense_shape[0]
    return IndexedSlices(
        jnp.zeros((num_slices, *dense_shape[1:]), dtype),
        jnp.full((num_slices,), num_rows, _ids.index_dtype(num_rows)),
        dense_shape,
    )


def _vary_as(zeros: jax.Array, like: Any) -> jax.Array:
    axes = tuple(sorted(_jax_compat.varying_axes(like) or ()))
    if axes and _jax_compat.AVAILABLE["pcast_varying"]:
        return _jax_compat.pcast_varying(zeros, axes)
    return zeros


def zero_updates(tree: Any) -> Any:
    """Zero updates shaped like ``tree`` (arrays, slices or their shapes).

    Arrays become zeros, slices all-padding slices with the same number of
    slots; ``None`` stays ``None``. Inside ``shard_map`` each zero varies over
    the mesh axes its model leaf varies over.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> from jaxslices import _leaves
      >>> s = jaxslices.IndexedSlices(jnp.ones((2, 1)), jnp.array([0, 1]), (3, 1))
      >>> z = _leaves.zero_updates({"emb": s, "w": jnp.ones(2)})
      >>> z["emb"].indices, z["w"]
      (Array([3, 3], dtype=int32), Array([0., 0.], dtype=float32))
    """

    def leaf(x):
        if x is None:
            return None
        if isinstance(x, IndexedSlices):
            pad = padding_slices(x.num_slices, x.dense_shape, x.values.dtype)
            return IndexedSlices(
                _vary_as(pad.values, x.values),
                _vary_as(pad.indices, x._indices),
                x.dense_shape,
            )
        return _vary_as(jnp.zeros(x.shape, x.dtype), x)

    return jax.tree.map(leaf, tree, is_leaf=is_leaf)
