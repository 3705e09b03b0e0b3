"""Optax gradient transformations that understand ``IndexedSlices``.

Every transform here is an :class:`optax.GradientTransformationExtraArgs`
usable in :func:`optax.chain`. Update trees may mix dense arrays and
:class:`~jaxslices.IndexedSlices`; slices stay slices, and on dense leaves each
transform computes the same numbers as the Optax transform of the same name.

Conventions (see ``docs/optax.md``):

* **Sparse leaves touch only their rows.** State for a table is a dense
  ``(V, D)`` array (like the table), but a sparse update gathers the touched
  rows, updates them and scatters them back: no ``(V, D)`` temporary is made,
  and under ``jax.jit(..., donate_argnums=...)`` the state is updated in place.
  Stateful sparse updates are therefore *lazy*: an untouched row's state and
  parameters do not move (momentum does not coast, Adam moments do not decay).
* **Coalescing.** Transforms that need one value per row (clipping, Adagrad,
  lazy Adam, weight decay, momentum) sum duplicate indices first, through
  :func:`_coalesce_for_update`; their sparse outputs are coalesced (sorted
  unique indices, padding at the end).
* **Guard.** Every entry point checks at trace time that the indices of every
  slices leaf are integers; float indices mean a stock leaf-wise Optax
  transform (``optax.scale``, ``optax.sgd``, ...) mapped over them earlier in
  the chain, and the error says so.
* ``None`` updates are passed through, as in Optax.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from . import sharding, slices
from .slices import IndexedSlices, _replace_values, check_slices

__all__ = [
    "TraceState",
    "ScaleByScheduleState",
    "AddDecayedWeightsState",
    "ScaleByRssState",
    "ScaleByLazyAdamState",
    "scale",
    "scale_by_schedule",
    "scale_by_learning_rate",
    "trace",
    "sgd",
    "clip",
    "clip_by_global_norm",
    "clip_by_row_norm",
    "add_decayed_weights",
    "scale_by_rss",
    "adagrad",
    "scale_by_lazy_adam",
    "lazy_adam",
    "lazy_adamw",
    "densify",
]

ScalarOrSchedule = ArrayLike | Callable[[ArrayLike], ArrayLike]


# ----------------------------------------------------------------- internals


def _coalesce_for_update(s: IndexedSlices) -> IndexedSlices:
    """The one place where transforms coalesce (swap a faster method in here).

    Must return slices with the same dense equivalent whose valid indices are
    unique, every other slot being padding (index ``V``, values zero).
    """
    return slices.coalesce(s)


def _is_leaf(x: Any) -> bool:
    return x is None or isinstance(x, IndexedSlices)


class _Out:
    """Several per-leaf results; a plain object, so a tree map keeps it whole."""

    __slots__ = ("items",)

    def __init__(self, *items: Any):
        self.items = items


def _unzip(tree: Any, n: int) -> tuple[Any, ...]:
    """Split a tree of ``_Out`` leaves into ``n`` trees."""

    def item(i):
        return jax.tree.map(
            lambda o: o.items[i], tree, is_leaf=lambda x: isinstance(x, _Out)
        )

    return tuple(item(i) for i in range(n))


def _where(name: str, path: Any) -> str:
    return f"jaxslices.{name} (leaf {jax.tree_util.keystr(path) or '<root>'})"


def _check_leaf(name: str, path: Any, g: Any, x: Any, x_name: str) -> None:
    """``x`` (state or params) must have the dense shape of update ``g``."""
    if isinstance(g, IndexedSlices):
        check_slices(g, _where(name, path))
    if x is None:
        return
    if not hasattr(x, "shape") or tuple(x.shape) != tuple(g.shape):
        got = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
        raise ValueError(
            f"{_where(name, path)}: the update has dense shape {tuple(g.shape)} but "
            f"`{x_name}` has {got} there. Updates, params and optimizer state must "
            "describe the same parameters; was `init` called on these params?"
        )


def _map(name: str, fn: Callable[..., Any], updates: Any, *others: Any) -> Any:
    """``fn(path, g, *others_leaves)`` over the leaves of ``updates``.

    ``None`` and ``IndexedSlices`` are leaves of ``updates``; ``others``
    (``(name, tree)`` pairs: state, params) must have the same leaf paths.
    """
    for other_name, other in others:
        slices._check_tree_match(
            f"jaxslices.{name}", updates, "updates", other, other_name
        )
    return jax.tree_util.tree_map_with_path(
        fn, updates, *(tree for _, tree in others), is_leaf=_is_leaf
    )


def _check_all(name: str, updates: Any) -> None:
    """The integer-indices guard on every slices leaf of ``updates``."""

    def leaf(path, g):
        if isinstance(g, IndexedSlices):
            check_slices(g, _where(name, path))

    jax.tree_util.tree_map_with_path(leaf, updates, is_leaf=_is_leaf)


def _map_values(name: str, fn: Callable[[jax.Array], jax.Array], updates: Any):
    """Apply ``fn`` to each dense leaf and to the values of each slices leaf."""

    def leaf(path, g):
        if g is None:
            return None
        if isinstance(g, IndexedSlices):
            check_slices(g, _where(name, path))
            return _replace_values(g, fn(g.values))
        return fn(g)

    return jax.tree_util.tree_map_with_path(leaf, updates, is_leaf=_is_leaf)


def _rows(x: jax.Array, c: IndexedSlices) -> jax.Array:
    """Gather the rows of state/params ``x`` at ``c``'s indices (padding: 0)."""
    return x.at[slices.safe_indices(c)].get(mode="fill", fill_value=0)


def _set_rows(x: jax.Array, c: IndexedSlices, rows: jax.Array) -> jax.Array:
    """Write ``rows`` into ``x`` at ``c``'s (unique) indices; padding dropped."""
    c, rows = sharding.replicate_rows(x, (c, rows))
    return x.at[slices.safe_indices(c)].set(rows.astype(x.dtype), mode="drop")


def _mask_padding(c: IndexedSlices, rows: jax.Array) -> jax.Array:
    """Zero the rows of padding slots (keeps the padding convention exact)."""
    valid = slices._expand(slices.valid_mask(c), rows.ndim)
    return jnp.where(valid, rows, jnp.zeros((), rows.dtype))


def _abs_sq(x: jax.Array) -> jax.Array:
    return (x.conj() * x).real


def _zeros_like(tree: Any, dtype: Any = None) -> Any:
    return jax.tree.map(lambda p: jnp.zeros_like(p, dtype=dtype), tree)


def _global_norm(updates: Any) -> jax.Array:
    """:func:`jaxslices.global_norm`, coalescing through ``_coalesce_for_update``.

    The sum of squares of a coalesced slices' values is the exact squared norm
    of its dense equivalent, so this returns the same numbers.
    """

    def sum_sq(x):
        if isinstance(x, IndexedSlices):
            x = _coalesce_for_update(x).values
        return slices.sum_of_squares(x)

    leaves = jax.tree.leaves(updates, is_leaf=slices.is_indexed_slices)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(sum(sum_sq(x) for x in leaves))


# ---------------------------------------------------------------- scaling


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: the number of updates so far."""

    count: jax.Array  # int32 scalar


def scale(step_size: ArrayLike) -> optax.GradientTransformationExtraArgs:
    """Scale updates by a fixed scalar; slices keep their indices.

    Same numbers as :func:`optax.scale` on dense leaves (``step_size * g``); on an
    :class:`~jaxslices.IndexedSlices` only ``values`` are scaled.

    Args:
      step_size: the scalar factor.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> g = jaxslices.IndexedSlices(jnp.ones((2, 1)), jnp.array([0, 2]), (3, 1))
      >>> tx = jaxslices.scale(0.5)
      >>> u, _ = tx.update({"emb": g}, tx.init({"emb": jnp.zeros((3, 1))}))
      >>> u["emb"].values.ravel(), u["emb"].indices
      (Array([0.5, 0.5], dtype=float32), Array([0, 2], dtype=int32))
    """

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return _map_values("scale", lambda g: step_size * g, updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def scale_by_schedule(
    step_size_fn: Callable[[jax.Array], ArrayLike],
) -> optax.GradientTransformationExtraArgs:
    """Scale updates by ``step_size_fn(count)``, ``count`` the number of steps so far.

    Same numbers as :func:`optax.scale_by_schedule` on dense leaves; on slices
    only ``values`` are scaled.

    Args:
      step_size_fn: an Optax schedule, ``count -> step size``.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`ScaleByScheduleState`.

    Example:
      >>> import jax.numpy as jnp, optax, jaxslices
      >>> tx = jaxslices.scale_by_schedule(optax.linear_schedule(1.0, 0.0, 4))
      >>> g = jaxslices.IndexedSlices(jnp.ones(1), jnp.array([1]), (2,))
      >>> state = tx.init(jnp.zeros(2))
      >>> u, state = tx.update(g, state)
      >>> u, state = tx.update(g, state)
      >>> u.values, state.count
      (Array([0.75], dtype=float32), Array(2, dtype=int32))
    """

    def init_fn(params):
        del params
        return ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        step_size = step_size_fn(state.count)
        updates = _map_values(
            "scale_by_schedule",
            lambda g: jnp.array(step_size, dtype=g.dtype) * g,
            updates,
        )
        return updates, ScaleByScheduleState(optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule | None, *, flip_sign: bool = True
) -> optax.GradientTransformationExtraArgs:
    """Scale by ``-learning_rate`` (a constant or an Optax schedule).

    Same numbers as :func:`optax.scale_by_learning_rate` on dense leaves.

    Args:
      learning_rate: a scalar or a schedule ``count -> learning rate``; ``None``
        gives the identity.
      flip_sign: multiply by ``-learning_rate`` (descent) when ``True``.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> tx = jaxslices.scale_by_learning_rate(0.1)
      >>> g = jaxslices.IndexedSlices(jnp.ones(1), jnp.array([0]), (2,))
      >>> tx.update(g, tx.init(jnp.zeros(2)))[0].values
      Array([-0.1], dtype=float32)
    """
    if learning_rate is None:
        return optax.with_extra_args_support(optax.identity())
    m = -1 if flip_sign else 1
    if callable(learning_rate):
        return scale_by_schedule(lambda count: m * learning_rate(count))
    return scale(m * learning_rate)


# --------------------------------------------------------------- momentum


class TraceState(NamedTuple):
    """State of :func:`trace`: one momentum buffer per parameter (dense)."""

    trace: Any


def trace(
    decay: ArrayLike,
    *,
    nesterov: bool = False,
    accumulator_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Momentum ``t <- g + decay * t``, lazy for sparse leaves.

    Dense leaves: exactly :func:`optax.trace`. Sparse leaves: duplicates are
    summed, then only the touched rows of the ``(V, ...)`` trace are read and
    written (gather, update, scatter); untouched rows keep their trace and get
    no update. This is *lazy* momentum: with dense momentum an untouched row
    keeps moving by ``decay * t``, here it does not.

    Args:
      decay: the momentum coefficient.
      nesterov: use Nesterov momentum (``g + decay * t`` as the update).
      accumulator_dtype: dtype of the trace; ``None`` uses the parameter's.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`TraceState`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> tx = jaxslices.trace(0.5)
      >>> g = jaxslices.IndexedSlices(jnp.ones((2, 1)), jnp.array([1, 1]), (3, 1))
      >>> state = tx.init(jnp.zeros((3, 1)))
      >>> u, state = tx.update(g, state)
      >>> u, state = tx.update(g, state)
      >>> state.trace.ravel()
      Array([0., 3., 0.], dtype=float32)
    """
    dtype = None if accumulator_dtype is None else jnp.dtype(accumulator_dtype)

    def init_fn(params):
        return TraceState(trace=_zeros_like(params, dtype))

    def leaf(path, g, t):
        if g is None:
            return _Out(None, t)
        _check_leaf("trace", path, g, t, "state.trace")
        if isinstance(g, IndexedSlices):
            c = _coalesce_for_update(g)
            new_rows = c.values + decay * _rows(t, c)
            upd = c.values + decay * new_rows if nesterov else new_rows
            return _Out(_replace_values(c, upd), _set_rows(t, c, new_rows))
        new_t = g + decay * t
        upd = g + decay * new_t if nesterov else new_t
        return _Out(upd, new_t if dtype is None else new_t.astype(dtype))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        out = _map("trace", leaf, updates, ("state.trace", state.trace))
        updates, new_trace = _unzip(out, 2)
        return updates, TraceState(trace=new_trace)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: ArrayLike | None = None,
    nesterov: bool = False,
    *,
    accumulator_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Stochastic gradient descent, with optional lazy momentum.

    Dense leaves: exactly :func:`optax.sgd`. Sparse leaves: without momentum
    the update is ``-learning_rate * values`` on the same indices (nothing is
    coalesced; :func:`jaxslices.apply_updates` sums duplicates). With momentum
    the trace is **lazy**: only the rows touched by the step have their
    momentum updated and move; an untouched row's momentum is kept, unchanged,
    until the row is touched again (see :func:`trace`). Without momentum the
    result equals dense SGD on the dense gradient.

    Args:
      learning_rate: a scalar or an Optax schedule.
      momentum: the momentum coefficient, or ``None`` for plain SGD.
      nesterov: use Nesterov momentum.
      accumulator_dtype: dtype of the momentum buffer; ``None``: the parameter's.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`; its state is the
      :func:`optax.chain` state of ``(trace or identity, learning rate)``, like
      :func:`optax.sgd`.

    Example:
      >>> import jax.numpy as jnp, optax, jaxslices
      >>> params = {"emb": jnp.ones((4, 2)), "w": jnp.ones(2)}
      >>> vals = jnp.array([[3.0, 4.0], [3.0, 4.0]])  # row 3 twice: norm 10
      >>> g = jaxslices.IndexedSlices(vals, jnp.array([3, 3]), (4, 2))
      >>> tx = optax.chain(jaxslices.clip_by_global_norm(1.0), jaxslices.sgd(0.1))
      >>> updates, _ = tx.update({"emb": g, "w": jnp.zeros(2)}, tx.init(params))
      >>> new = jaxslices.apply_updates(params, updates)
      >>> [round(float(x), 4) for x in new["emb"][3]], new["emb"][0]
      ([0.94, 0.92], Array([1., 1.], dtype=float32))
    """
    first = (
        optax.identity()
        if momentum is None
        else trace(momentum, nesterov=nesterov, accumulator_dtype=accumulator_dtype)
    )
    return optax.chain(first, scale_by_learning_rate(learning_rate))


# --------------------------------------------------------------- clipping


def clip(max_delta: ArrayLike) -> optax.GradientTransformationExtraArgs:
    """Clip every entry to ``[-max_delta, max_delta]``.

    Dense leaves: exactly :func:`optax.clip`. Sparse leaves are coalesced first,
    so the per-row **sum** is clipped, as clipping the dense gradient would;
    the result is coalesced.

    Args:
      max_delta: the largest absolute value kept.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> g = jaxslices.IndexedSlices(jnp.array([0.5, 0.7]), jnp.array([1, 1]), (2,))
      >>> tx = jaxslices.clip(1.0)
      >>> u, _ = tx.update(g, tx.init(jnp.zeros(2)))
      >>> u.indices, u.values
      (Array([1, 2], dtype=int32), Array([1., 0.], dtype=float32))
    """

    def leaf(path, g):
        if g is None:
            return None
        _check_leaf("clip", path, g, None, "")
        if isinstance(g, IndexedSlices):
            c = _coalesce_for_update(g)
            return _replace_values(c, jnp.clip(c.values, -max_delta, max_delta))
        return jnp.clip(g, -max_delta, max_delta)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return _map("clip", leaf, updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def clip_by_global_norm(max_norm: ArrayLike) -> optax.GradientTransformationExtraArgs:
    """Scale all updates by ``max_norm / norm`` when their global norm exceeds it.

    The norm is exact: it is the L2 norm of the dense equivalent of every leaf,
    duplicate indices summed before squaring (as :func:`jaxslices.global_norm`;
    TensorFlow squares raw values and under-clips when ids repeat). Squares are
    summed in at least float32. On float32 dense leaves this is
    :func:`optax.clip_by_global_norm`; slices keep their indices (not coalesced).

    Args:
      max_norm: the largest global norm let through unscaled.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> g = jaxslices.IndexedSlices(jnp.array([3.0, 3.0]), jnp.array([0, 0]), (2,))
      >>> tx = jaxslices.clip_by_global_norm(1.0)
      >>> u, _ = tx.update({"emb": g, "w": jnp.array([8.0])}, tx.init(None))
      >>> u["emb"].values, u["w"]
      (Array([0.3, 0.3], dtype=float32), Array([0.8], dtype=float32))
    """

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        _check_all("clip_by_global_norm", updates)
        g_norm = _global_norm(updates)
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip_fn(t):
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

        return _map_values("clip_by_global_norm", clip_fn, updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def _row_norm_scale(x: jax.Array, max_norm: ArrayLike) -> jax.Array:
    """Rows of ``x`` (leading axis) with L2 norm above ``max_norm`` scaled to it."""
    if x.ndim == 0:
        return _row_norm_scale(x[None], max_norm)[0]
    axes = tuple(range(1, x.ndim))
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    norm = jnp.sqrt(jnp.sum(_abs_sq(wide), axis=axes))
    over = norm > max_norm
    factor = jnp.where(over, max_norm / jnp.where(over, norm, 1.0), 1.0)
    return x * slices._expand(factor.astype(x.dtype), x.ndim)


def clip_by_row_norm(max_norm: ArrayLike) -> optax.GradientTransformationExtraArgs:
    """Scale every row whose L2 norm exceeds ``max_norm`` down to ``max_norm``.

    A row is a slice along the leading axis of the dense equivalent. Sparse
    leaves are coalesced first, so each *distinct* row is clipped by the norm
    of its summed gradient (as clipping the dense gradient would); the result is
    coalesced. Dense leaves use the same rule with rows along their leading
    axis: a ``(V, D)`` array has ``V`` rows of ``D`` entries, a ``(D,)`` vector
    has ``D`` rows of one entry (so this clips magnitudes elementwise), a scalar
    is one row. Norms are computed in at least float32. Optax has no such
    transform.

    Args:
      max_norm: the largest row norm let through unscaled.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> vals = jnp.array([[3.0, 0.0], [0.0, 4.0], [0.5, 0.0]])
      >>> g = jaxslices.IndexedSlices(vals, jnp.array([0, 0, 1]), (2, 2))
      >>> tx = jaxslices.clip_by_row_norm(1.0)
      >>> u, _ = tx.update(g, tx.init(None))
      >>> u.to_dense()
      Array([[0.6, 0.8],
             [0.5, 0. ]], dtype=float32)
    """

    def leaf(path, g):
        if g is None:
            return None
        _check_leaf("clip_by_row_norm", path, g, None, "")
        if isinstance(g, IndexedSlices):
            c = _coalesce_for_update(g)
            return _replace_values(c, _row_norm_scale(c.values, max_norm))
        return _row_norm_scale(g, max_norm)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return _map("clip_by_row_norm", leaf, updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


# ------------------------------------------------------------ weight decay


class AddDecayedWeightsState(NamedTuple):
    """State of :func:`add_decayed_weights` with a scheduled weight decay."""

    count: jax.Array  # int32 scalar


def add_decayed_weights(
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Add ``weight_decay * params`` to the updates; touched rows only for slices.

    Dense leaves: exactly :func:`optax.add_decayed_weights`. A sparse leaf is
    coalesced (each row decays once per step) and gets ``weight_decay *
    params[row]`` added for the rows it touches only: untouched rows are not
    decayed (lazy weight decay, as in sparse optimizers). The result is
    coalesced.

    Args:
      weight_decay: a scalar or an Optax schedule.
      mask: ``None`` (decay every leaf), a tree of bools with the structure of
        the params (or a prefix of it), or a callable ``params -> such a tree``.
        ``False`` leaves pass through unchanged. Unlike :func:`optax.masked`, a
        callable is always given the *params* (dense arrays), never the
        updates, so it does not need to know about ``IndexedSlices``.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> params = jnp.array([1.0, 2.0, 3.0])
      >>> g = jaxslices.IndexedSlices(jnp.zeros(2), jnp.array([2, 2]), (3,))
      >>> tx = jaxslices.add_decayed_weights(0.1)
      >>> u, _ = tx.update(g, tx.init(params), params)
      >>> u.to_dense()
      Array([0. , 0. , 0.3], dtype=float32)
    """
    return _add_decayed_weights(weight_decay, mask, coalesced=False)


def _add_decayed_weights(
    weight_decay: ScalarOrSchedule, mask: Any, *, coalesced: bool
) -> optax.GradientTransformationExtraArgs:
    """``coalesced=True``: the caller guarantees slices arrive coalesced."""
    name = "add_decayed_weights"
    scheduled = callable(weight_decay)

    def init_fn(params):
        del params
        if scheduled:
            return AddDecayedWeightsState(count=jnp.zeros([], jnp.int32))
        return optax.EmptyState()

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError(
                f"jaxslices.{name} needs the params: call "
                "`tx.update(updates, state, params)`."
            )
        new_state = state
        if scheduled:
            new_state = AddDecayedWeightsState(optax.safe_increment(state.count))
        if isinstance(weight_decay, (int, float)) and weight_decay == 0.0:
            return updates, new_state
        wd = weight_decay(state.count) if scheduled else weight_decay

        def leaf(prefix, path, g, p):
            if g is None:
                return None
            _check_leaf(name, prefix + path, g, p, "params")
            if isinstance(g, IndexedSlices):
                c = g if coalesced else _coalesce_for_update(g)
                return _replace_values(c, c.values + wd * _rows(p, c))
            return g + wd * p

        def decay(prefix, u, p):
            return _map(name, lambda *a: leaf(prefix, *a), u, ("params", p))

        if mask is None:
            return decay((), updates, params), new_state
        mask_tree = mask(params) if callable(mask) else mask
        updates = jax.tree_util.tree_map_with_path(
            lambda path, m, u, p: decay(path, u, p) if m else u,
            mask_tree,
            updates,
            params,
        )
        return updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ---------------------------------------------------------------- adagrad


class ScaleByRssState(NamedTuple):
    """State of :func:`scale_by_rss`: accumulated squared gradients (dense)."""

    sum_of_squares: Any


def scale_by_rss(
    initial_accumulator_value: ArrayLike = 0.1, eps: ArrayLike = 1e-7
) -> optax.GradientTransformationExtraArgs:
    """Adagrad's scaling, ``g / sqrt(sum of g**2 + eps)``, touched rows only.

    Dense leaves: exactly :func:`optax.scale_by_rss`. Sparse leaves are
    coalesced; the accumulator rows they touch are gathered, updated and
    scattered back. An untouched row has a zero dense gradient, so its
    accumulator would not change in dense Adagrad either: the result equals
    the dense transform on the dense gradient.

    Args:
      initial_accumulator_value: starting value of the accumulator.
      eps: added under the square root.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`ScaleByRssState`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> tx = jaxslices.scale_by_rss(initial_accumulator_value=0.0, eps=0.0)
      >>> g = jaxslices.IndexedSlices(jnp.array([1.0, 1.0]), jnp.array([0, 0]), (2,))
      >>> u, state = tx.update(g, tx.init(jnp.zeros(2)))
      >>> u.values, state.sum_of_squares
      (Array([1., 0.], dtype=float32), Array([4., 0.], dtype=float32))
    """

    def init_fn(params):
        return ScaleByRssState(
            sum_of_squares=jax.tree.map(
                lambda p: jnp.full_like(p, initial_accumulator_value), params
            )
        )

    def scaled(acc, g):
        return jnp.where(acc > 0, jax.lax.rsqrt(acc + eps), 0.0) * g

    def leaf(path, g, t):
        if g is None:
            return _Out(None, t)
        _check_leaf("scale_by_rss", path, g, t, "state.sum_of_squares")
        if isinstance(g, IndexedSlices):
            c = _coalesce_for_update(g)
            acc = _abs_sq(c.values) + _rows(t, c)
            return _Out(_replace_values(c, scaled(acc, c.values)), _set_rows(t, c, acc))
        acc = _abs_sq(g) + t
        return _Out(scaled(acc, g), acc)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        out = _map("scale_by_rss", leaf, updates, ("state", state.sum_of_squares))
        updates, acc = _unzip(out, 2)
        return updates, ScaleByRssState(sum_of_squares=acc)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adagrad(
    learning_rate: ScalarOrSchedule,
    initial_accumulator_value: ArrayLike = 0.1,
    eps: ArrayLike = 1e-7,
) -> optax.GradientTransformationExtraArgs:
    """Adagrad that keeps sparse gradients sparse; equals :func:`optax.adagrad`.

    Rows a sparse gradient does not touch have a zero dense gradient, and in
    Adagrad a zero gradient changes neither the accumulator nor the parameter,
    so sparse and dense Adagrad agree exactly (up to float rounding of
    duplicate sums). Each step costs what the batch touches.

    Args:
      learning_rate: a scalar or an Optax schedule.
      initial_accumulator_value: starting value of the accumulator.
      eps: added under the square root.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`; the state is the
      :func:`optax.chain` state of ``(scale_by_rss, learning rate)``.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> params = jnp.zeros((3, 2))
      >>> g = jaxslices.IndexedSlices(jnp.ones((2, 2)), jnp.array([1, 1]), (3, 2))
      >>> tx = jaxslices.adagrad(1.0)
      >>> u, state = tx.update(g, tx.init(params))
      >>> jaxslices.apply_updates(params, u)[:, 0].round(4)
      Array([ 0.    , -0.9877,  0.    ], dtype=float32)
    """
    return optax.chain(
        scale_by_rss(initial_accumulator_value, eps),
        scale_by_learning_rate(learning_rate),
    )


# -------------------------------------------------------------- lazy adam


@functools.partial(jax.jit, inline=True)
def _bias_correction(decay: ArrayLike, count: jax.Array) -> jax.Array:
    """``1 - decay**count``, once per step and in float32 (Optax computes it so)."""
    return 1 - decay**count


def _debias(moment: jax.Array, correction: jax.Array) -> jax.Array:
    return moment / correction.astype(moment.dtype)


class ScaleByLazyAdamState(NamedTuple):
    """State of :func:`scale_by_lazy_adam`: global step count and dense moments."""

    count: jax.Array  # int32 scalar
    mu: Any
    nu: Any


def scale_by_lazy_adam(
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    eps_root: ArrayLike = 0.0,
    mu_dtype: Any = None,
    *,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Adam's scaling (:func:`optax.scale_by_adam`), lazy for sparse leaves.

    Dense leaves: exactly :func:`optax.scale_by_adam`. Sparse leaves are
    coalesced; the first and second moments of the touched rows are gathered,
    updated with Adam's rule and scattered back, and only those rows get an
    update. Untouched rows' moments do not decay and their parameters do not
    move (the LazyAdam of TF Addons, PyTorch's ``SparseAdam``).

    **Bias correction** uses the one global step count of the state (number of
    ``update`` calls), like TF Addons' LazyAdam and PyTorch's SparseAdam, not a
    per-row count: a row first touched at step ``t`` is corrected by
    ``1 - b1**t``, so its first update is smaller than Adam's first step would
    be (by ``(1 - b1) / (1 - b1**t)``). This keeps the state to two moments and
    one scalar and makes dense leaves identical to Optax.

    Args:
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added to the second moment inside the square root.
      mu_dtype: dtype of the first moment; ``None``: the parameter's.
      nesterov: use Nesterov momentum (NAdam), as in Optax.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`ScaleByLazyAdamState`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> tx = jaxslices.scale_by_lazy_adam()
      >>> g = jaxslices.IndexedSlices(jnp.array([2.0]), jnp.array([1]), (3,))
      >>> u, state = tx.update(g, tx.init(jnp.zeros(3)))
      >>> u.to_dense().round(4), state.mu
      (Array([0., 1., 0.], dtype=float32), Array([0. , 0.2, 0. ], dtype=float32))
    """
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def init_fn(params):
        return ScaleByLazyAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=_zeros_like(params, mu_dtype),
            nu=_zeros_like(params),
        )

    def adam_rows(g, m, v, bc):
        """Adam on aligned arrays: returns (update, new mu, new nu)."""
        mu = optax.tree.update_moment(g, m, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(g, v, b2, 2)
        if nesterov:
            mu_hat = b1 * _debias(mu, bc["mu_next"]) + (1 - b1) * _debias(g, bc["mu"])
        else:
            mu_hat = _debias(mu, bc["mu"])
        upd = mu_hat / (jnp.sqrt(_debias(nu, bc["nu"]) + eps_root) + eps)
        return upd, mu if mu_dtype is None else mu.astype(mu_dtype), nu.astype(v.dtype)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        count = optax.safe_increment(state.count)
        # One global step count for every leaf and row (see the docstring).
        bc = {
            "mu": _bias_correction(b1, count),
            "mu_next": _bias_correction(b1, optax.safe_increment(count)),
            "nu": _bias_correction(b2, count),
        }

        def leaf(path, g, m, v):
            if g is None:
                return _Out(None, m, v)
            _check_leaf("scale_by_lazy_adam", path, g, m, "state.mu")
            _check_leaf("scale_by_lazy_adam", path, g, v, "state.nu")
            if not isinstance(g, IndexedSlices):
                return _Out(*adam_rows(g, m, v, bc))
            c = _coalesce_for_update(g)
            upd, mu, nu = adam_rows(c.values, _rows(m, c), _rows(v, c), bc)
            return _Out(
                _replace_values(c, _mask_padding(c, upd)),
                _set_rows(m, c, mu),
                _set_rows(v, c, nu),
            )

        out = _map(
            "scale_by_lazy_adam",
            leaf,
            updates,
            ("state.mu", state.mu),
            ("state.nu", state.nu),
        )
        updates, mu, nu = _unzip(out, 3)
        return updates, ScaleByLazyAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def lazy_adam(
    learning_rate: ScalarOrSchedule,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    eps_root: ArrayLike = 0.0,
    mu_dtype: Any = None,
    *,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Lazy Adam: :func:`optax.adam` on dense leaves, touched rows only on slices.

    For an :class:`~jaxslices.IndexedSlices` gradient only the rows it touches
    have their moments updated and move; untouched rows' moments and parameters
    do not change (TF Addons' ``LazyAdam``, PyTorch's ``SparseAdam``). Bias
    correction uses one global step count (see :func:`scale_by_lazy_adam`).
    Where every row is touched at every step this is exactly Adam.

    Args:
      learning_rate: a scalar or an Optax schedule.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added to the second moment inside the square root.
      mu_dtype: dtype of the first moment; ``None``: the parameter's.
      nesterov: use Nesterov momentum (NAdam), as in Optax.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`; the state is the
      :func:`optax.chain` state of ``(scale_by_lazy_adam, learning rate)``.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> params = jnp.zeros((3, 1))
      >>> g = jaxslices.IndexedSlices(jnp.ones((1, 1)), jnp.array([2]), (3, 1))
      >>> tx = jaxslices.lazy_adam(0.1)
      >>> u, state = tx.update(g, tx.init(params))
      >>> [round(float(x), 4) for x in jaxslices.apply_updates(params, u).ravel()]
      [0.0, 0.0, -0.1]
    """
    return optax.chain(
        scale_by_lazy_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
        scale_by_learning_rate(learning_rate),
    )


def lazy_adamw(
    learning_rate: ScalarOrSchedule,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    eps_root: ArrayLike = 0.0,
    mu_dtype: Any = None,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: Any = None,
    *,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Lazy AdamW: :func:`optax.adamw` on dense leaves, touched rows only on slices.

    :func:`lazy_adam` followed by decoupled weight decay: for a sparse leaf only
    the touched rows decay (see :func:`add_decayed_weights`), so untouched
    rows' moments and parameters do not change at all.

    Args:
      learning_rate: a scalar or an Optax schedule.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added to the second moment inside the square root.
      mu_dtype: dtype of the first moment; ``None``: the parameter's.
      weight_decay: a scalar or an Optax schedule.
      mask: which leaves decay, as in :func:`add_decayed_weights`.
      nesterov: use Nesterov momentum, as in Optax.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`; the state is the
      :func:`optax.chain` state of ``(scale_by_lazy_adam, add_decayed_weights,
      learning rate)``, like :func:`optax.adamw`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> params = jnp.ones(3)
      >>> g = jaxslices.IndexedSlices(jnp.ones(1), jnp.array([2]), (3,))
      >>> tx = jaxslices.lazy_adamw(0.1, weight_decay=0.5)
      >>> u, state = tx.update(g, tx.init(params), params)
      >>> [round(float(x), 4) for x in jaxslices.apply_updates(params, u)]
      [1.0, 1.0, 0.85]
    """
    return optax.chain(
        scale_by_lazy_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
        # scale_by_lazy_adam's slices are coalesced already: no second sort.
        _add_decayed_weights(weight_decay, mask, coalesced=True),
        scale_by_learning_rate(learning_rate),
    )


def densify(max_rows: int | None = None) -> optax.GradientTransformationExtraArgs:
    """Turn sparse updates of small tables into dense arrays (opt-in fallback).

    Replaces each :class:`~jaxslices.IndexedSlices` whose table has at most
    ``max_rows`` rows (all of them if ``None``) by its dense equivalent, and
    leaves larger tables sparse. Put it first in a chain: for small tables a
    dense step is cheaper than gathering and scattering rows (measured in
    ``benchmarks/RESULTS.md``: on a 2-core CPU the dense path wins below about
    100k rows of width 64 for clipping, Adagrad and Adam). The maths changes
    with it: a densified table gets the dense (non-lazy) update of the
    transforms that follow, e.g. Adam moments of untouched rows decay.

    Args:
      max_rows: the largest table (``dense_shape[0]``) to densify.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` with empty state.

    Example:
      >>> import jax.numpy as jnp, optax, jaxslices
      >>> g = jaxslices.IndexedSlices(jnp.ones((2, 1)), jnp.array([0, 0]), (3, 1))
      >>> tx = optax.chain(jaxslices.densify(max_rows=1000), jaxslices.lazy_adam(0.1))
      >>> u, _ = tx.update({"emb": g}, tx.init({"emb": jnp.zeros((3, 1))}))
      >>> type(u["emb"]).__name__
      'ArrayImpl'
    """

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        _check_all("densify", updates)

        def leaf(g):
            small = max_rows is None or (
                isinstance(g, IndexedSlices) and g.dense_shape[0] <= max_rows
            )
            return g.to_dense() if isinstance(g, IndexedSlices) and small else g

        return jax.tree.map(leaf, updates, is_leaf=_is_leaf), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)
