"""The one home of the transforms' private helpers, and the row-wise rule helper.

A jaxslices optimizer is written once, as a *rule* on aligned arrays::

    rule(g, states, p) -> (update, new_states)

``g`` is a gradient (a whole dense leaf, or the coalesced rows of a sparse
one), ``states`` a tuple of the matching state arrays (rows), ``p`` the
matching parameter (rows) or ``None``. :func:`rowwise_update` maps a rule over
an updates tree:

* a dense leaf gets ``rule(g, states, p)`` on the whole arrays, so dense
  leaves compute exactly what Optax computes;
* an :class:`~jaxslices.IndexedSlices` leaf is coalesced (duplicates summed),
  the touched rows of every state array (and of the parameter) are gathered,
  the rule is applied to those rows, the new state rows are scattered back,
  and the update rows come out as slices on the coalesced indices, with
  padding slots zeroed. No ``(V, ...)`` temporary is made; under donation the
  state is updated in place. Untouched rows' state does not change: that is
  what makes a stateful sparse update *lazy* (or exact, when a zero gradient
  leaves state and parameter unchanged in the dense rule too).

State arrays have the parameter's leading axis ``V``; their other axes are
the rule's business (``rowwise_adagrad`` keeps one float per row).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from .. import _coalesce, _layout, _leaves, slices
from ..slices import IndexedSlices, _replace_values, check_slices
from ..tree import _map_values

ScalarOrSchedule = ArrayLike | Callable[[ArrayLike], ArrayLike]
Rule = Callable[[jax.Array, tuple[jax.Array, ...], Any], tuple[Any, tuple[Any, ...]]]


def coalesce_for_update(s: IndexedSlices, method: str = "auto") -> IndexedSlices:
    """Where every transform coalesces: unique valid indices, padding elsewhere.

    Free for slices that are coalesced already (``s.unique_indices``).
    """
    return slices.coalesce(s, method=method)


is_leaf = _leaves.is_leaf


class Out:
    """Several per-leaf results; a plain object, so a tree map keeps it whole."""

    __slots__ = ("items",)

    def __init__(self, *items: Any):
        self.items = items


def unzip(tree: Any, n: int) -> tuple[Any, ...]:
    """Split a tree of ``Out`` leaves into ``n`` trees."""

    def item(i):
        return jax.tree.map(
            lambda o: o.items[i], tree, is_leaf=lambda x: isinstance(x, Out)
        )

    return tuple(item(i) for i in range(n))


def where(name: str, path: Any) -> str:
    return _leaves.label(f"jaxslices.{name}", path)


def check_leaf(
    name: str, path: Any, g: Any, x: Any, x_name: str, shape: Any = None
) -> None:
    """``x`` (state or params) must have ``shape`` (default: ``g``'s dense shape)."""
    if isinstance(g, IndexedSlices):
        check_slices(g, where(name, path))
    if x is None:
        return
    want = tuple(g.shape) if shape is None else tuple(shape)
    if not hasattr(x, "shape") or tuple(x.shape) != want:
        got = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
        expect = "" if shape is None else f" (so `{x_name}` should have {want})"
        raise ValueError(
            f"{where(name, path)}: the update has dense shape {tuple(g.shape)}"
            f"{expect} but `{x_name}` has {got} there. Updates, params and "
            "optimizer state must describe the same parameters; was `init` called "
            "on these params?"
        )


def tree_map(name: str, fn: Callable[..., Any], updates: Any, *others: Any) -> Any:
    """``fn(path, g, *others_leaves)`` over the leaves of ``updates``.

    ``None`` and ``IndexedSlices`` are leaves of ``updates``; ``others``
    (``(name, tree)`` pairs: state, params) must have the same leaf paths.
    """
    for other_name, other in others:
        _leaves.check_structure(
            f"jaxslices.{name}", updates, "updates", other, other_name
        )
    return jax.tree_util.tree_map_with_path(
        fn, updates, *(tree for _, tree in others), is_leaf=is_leaf
    )


def check_all(name: str, updates: Any) -> None:
    """The integer-indices guard on every slices leaf of ``updates``."""

    def leaf(path, g):
        if isinstance(g, IndexedSlices):
            check_slices(g, where(name, path))

    jax.tree_util.tree_map_with_path(leaf, updates, is_leaf=is_leaf)


def map_values(name: str, fn: Callable[[jax.Array], jax.Array], updates: Any):
    """Apply ``fn`` to each dense leaf and to the values of each slices leaf.

    For value-wise maths (scaling) that needs neither state nor distinct rows:
    slices keep their indices and are not coalesced (:func:`jaxslices.tree_map_values`,
    its errors naming ``jaxslices.<name>``).
    """
    return _map_values(name, lambda x: fn(jnp.asarray(x)), updates)


def rows(x: Any, c: IndexedSlices) -> jax.Array:
    """Gather the rows of state/params ``x`` at ``c``'s indices (padding: 0)."""
    return jnp.asarray(x).at[slices.safe_indices(c)].get(mode="fill", fill_value=0)


def set_rows(x: Any, c: IndexedSlices, new_rows: jax.Array) -> jax.Array:
    """Write ``new_rows`` into ``x`` at ``c``'s (unique) indices; padding dropped."""
    x = jnp.asarray(x)
    c, new_rows = _layout.replicate_rows(x, (c, new_rows))
    return x.at[slices.safe_indices(c)].set(new_rows.astype(x.dtype), mode="drop")


def mask_padding(c: IndexedSlices, new_rows: jax.Array) -> jax.Array:
    """Zero the rows of padding slots (keeps the padding convention exact)."""
    valid = _coalesce.rows_where(slices.valid_mask(c), new_rows.ndim)
    return jnp.where(valid, new_rows, jnp.zeros((), new_rows.dtype))


def abs_sq(x: jax.Array) -> jax.Array:
    return (x.conj() * x).real


def zeros_like(tree: Any, dtype: Any = None) -> Any:
    return jax.tree.map(lambda p: jnp.zeros_like(p, dtype=dtype), tree)


def coalesce_all(updates: Any, method: str = "auto") -> Any:
    """Every slices leaf of ``updates`` coalesced (free where it is already)."""

    def leaf(x):
        return coalesce_for_update(x, method) if isinstance(x, IndexedSlices) else x

    return jax.tree.map(leaf, updates, is_leaf=is_leaf)


def global_norm(updates: Any) -> jax.Array:
    """:func:`jaxslices.global_norm` of an updates tree whose slices are coalesced.

    The sum of squares of a coalesced slices' values is the exact squared norm
    of its dense equivalent, so this returns the same numbers.
    """

    def sum_sq(x):
        if isinstance(x, IndexedSlices):
            values = coalesce_for_update(x).values  # free: coalesced by the caller
            # Row-sharded step (all_to_all): each shard holds its own rows.
            return _layout.sum_over_shards(slices.sum_of_squares(values))
        return slices.sum_of_squares(x)

    leaves = [x for x in jax.tree.leaves(updates, is_leaf=is_leaf) if x is not None]
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(sum(sum_sq(x) for x in leaves))


def rowwise_update(
    name: str,
    rule: Rule,
    updates: Any,
    states: Sequence[tuple[str, Any]] = (),
    params: Any = None,
    *,
    state_shape: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None,
    method: str = "auto",
) -> tuple[Any, tuple[Any, ...]]:
    """Apply ``rule`` to every leaf of ``updates``: dense whole, sparse by rows.

    Args:
      name: the public transform's name, for error messages.
      rule: ``rule(g, states, p) -> (update, new_states)`` (module docstring).
      updates: the updates tree (dense arrays, slices, ``None``).
      states: ``(name, tree)`` pairs, each tree with the leaf paths of
        ``updates``; the rule receives their leaves in this order.
      params: the params tree, or ``None`` when the rule does not read them
        (the rule then gets ``p=None``).
      state_shape: ``dense_shape -> shape`` of each state leaf; default: the
        same shape as the parameter.
      method: the coalescing method (:func:`jaxslices.coalesce`); slices that
        arrive coalesced (``unique_indices``) are not coalesced again.

    Returns:
      ``(new_updates, new_state_trees)``; a ``None`` update keeps its state.
    """
    names = [n for n, _ in states]
    others = list(states) + ([("params", params)] if params is not None else [])
    n_states = len(names)

    def leaf(path, g, *xs):
        st, p = xs[:n_states], (xs[n_states] if params is not None else None)
        if g is None:
            return Out(None, *st)
        # NumPy arrays, Python scalars: what JAX accepts, made arrays once here.
        g = g if isinstance(g, IndexedSlices) else jnp.asarray(g)
        st = tuple(jnp.asarray(x) for x in st)
        p = None if p is None else jnp.asarray(p)
        shape = None if state_shape is None else state_shape(tuple(g.shape))
        for x, x_name in zip(st, names, strict=True):
            check_leaf(name, path, g, x, x_name, shape)
        check_leaf(name, path, g, p, "params")
        if not isinstance(g, IndexedSlices):
            upd, new = rule(g, st, p)
            return Out(upd, *new)
        c = coalesce_for_update(g, method)
        p_rows = None if p is None else rows(p, c)
        upd, new = rule(c.values, tuple(rows(x, c) for x in st), p_rows)
        new_st = tuple(set_rows(x, c, r) for x, r in zip(st, new, strict=True))
        upd = mask_padding(c, jnp.asarray(upd))
        return Out(_replace_values(c, upd), *new_st)

    out = tree_map(name, leaf, updates, *others)
    new_updates, *new_states = unzip(out, 1 + n_states)
    return new_updates, tuple(new_states)
