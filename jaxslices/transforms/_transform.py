"""Building blocks: Optax's ``transform.py`` for trees holding ``IndexedSlices``.

Scaling (value-wise: slices keep their indices, nothing is coalesced), momentum,
weight decay, Adagrad's and Adam's scalings, and ``densify``. The stateful
ones are rules given to :func:`jaxslices.transforms._rowwise.rowwise_update`, which
applies them to dense leaves whole and to the touched rows of sparse leaves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from .. import _indexed, _rounding
from .._coalesce import check_method
from ..kernels import _ops as kernel_ops
from ..slices import IndexedSlices
from ._rowwise import (
    Native,
    ScalarOrSchedule,
    abs_sq,
    check_all,
    check_max_distinct,
    check_stochastic_rounding,
    grad_dtype,
    is_leaf,
    leaf_bounds,
    map_values,
    packed_pair,
    packed_zeros,
    rowwise_update,
    state_as,
    unpacked,
    zeros_like,
)

__all__ = [
    "AddDecayedWeightsState",
    "ScaleByLazyAdamState",
    "ScaleByRowwiseRssState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "TraceState",
    "add_decayed_weights",
    "densify",
    "scale",
    "scale_by_lazy_adam",
    "scale_by_learning_rate",
    "scale_by_rowwise_rss",
    "scale_by_rss",
    "scale_by_schedule",
    "trace",
]


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
        factor = step_size if jnp.ndim(step_size) == 0 else None
        return map_values("scale", lambda g: step_size * g, updates, factor), state

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
        updates = map_values(
            "scale_by_schedule",
            lambda g: jnp.array(step_size, dtype=g.dtype) * g,
            updates,
            step_size if jnp.ndim(step_size) == 0 else None,
        )
        return updates, ScaleByScheduleState(optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule | None = None, *, flip_sign: bool = True
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
        schedule = scale_by_schedule(lambda count: m * learning_rate(count))
        return _counting_steps(schedule, counts=True)
    return _counting_steps(scale(m * learning_rate), counts=False)


class _EitherState:
    """What :func:`_counting_steps` inits on optax's params placeholder."""


_EITHER_STATE = _EitherState()


def _counting_steps(
    inner: optax.GradientTransformationExtraArgs, *, counts: bool
) -> optax.GradientTransformationExtraArgs:
    """``inner`` (the learning-rate scaling every jaxslices optimizer ends
    with), giving each sparse update its step count: the per-step seed of a
    low-precision table's stochastic rounding (no ``key`` needed).

    A schedule (``counts``) counts its steps already
    (:class:`ScaleByScheduleState`); a constant learning rate keeps a count
    only for params with a bfloat16 or float16 leaf (its state a
    :class:`ScaleByScheduleState`, else Optax's empty state).
    """

    def init_fn(params):
        state = inner.init(params)
        if type(params).__name__ == "_ParamsPlaceholder":
            # optax.tree_utils.tree_map_params inits on a placeholder that has
            # no dtypes: a leaf stands for either state (not params-like).
            return _EITHER_STATE
        low = any(
            _rounding.is_low_precision(getattr(x, "dtype", None))
            for x in jax.tree.leaves(params)
        )
        if counts or not low:
            return state
        return ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, ScaleByScheduleState):
            return inner.update(updates, state, params, **extra_args)
        count = state.count
        if counts:
            updates, state = inner.update(updates, state, params, **extra_args)
        else:
            updates, _ = inner.update(updates, optax.EmptyState(), params, **extra_args)
            state = ScaleByScheduleState(optax.safe_increment(count))

        def stamp(u):
            return _indexed.with_step(u, count) if isinstance(u, IndexedSlices) else u

        return jax.tree.map(stamp, updates, is_leaf=is_leaf), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------- momentum


class TraceState(NamedTuple):
    """State of :func:`trace`: one momentum buffer per parameter (dense)."""

    trace: Any


def trace(
    decay: ArrayLike,
    nesterov: bool = False,
    accumulator_dtype: Any = None,
    *,
    coalesce_method: str = "auto",
    max_distinct: Any = None,
    stochastic_rounding: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Momentum ``t <- g + decay * t``, lazy for sparse leaves: :func:`sgd`'s trace.

    The building block of :func:`jaxslices.sgd` with momentum, which has the
    maths, what *lazy* means for sparse leaves, and the references. Dense
    leaves: exactly :func:`optax.trace`. Sparse leaves: duplicates are summed,
    then only the touched rows of the ``(V, ...)`` trace are read and written.

    Args:
      decay: the momentum coefficient (``momentum`` of :func:`jaxslices.sgd`).
      nesterov, accumulator_dtype, coalesce_method, max_distinct: as in
        :func:`jaxslices.sgd`.
      stochastic_rounding: as in :func:`jaxslices.sgd`.

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
    check_method(coalesce_method, "jaxslices.trace")
    check_max_distinct(max_distinct, "trace")
    check_stochastic_rounding(stochastic_rounding, "trace")
    dtype = None if accumulator_dtype is None else jnp.dtype(accumulator_dtype)

    def init_fn(params):
        return TraceState(trace=zeros_like(params, dtype))

    def rule(g, states, p):
        (t,) = states
        upd, new_t = _trace_math(g, t, decay, nesterov)
        return upd, (new_t if dtype is None else state_as(new_t, dtype),)

    refuse = None
    if dtype is not None and dtype != jnp.float32:
        refuse = f"accumulator_dtype={dtype.name} (the kernels keep a float32 trace)"
    spec = kernel_ops.RuleSpec(
        "trace", _trace_native, cfg=bool(nesterov), nesterov=bool(nesterov)
    )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        updates, (new_trace,) = rowwise_update(
            "trace",
            rule,
            updates,
            [("state.trace", state.trace)],
            method=coalesce_method,
            max_distinct=max_distinct,
            stochastic_rounding=stochastic_rounding,
            native=Native(spec, (decay,), refuse=refuse),
        )
        return updates, TraceState(trace=new_trace)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _trace_math(g, t, decay, nesterov):
    """Momentum: ``(update, new trace)`` (the one place of this maths)."""
    new_t = g + decay * t
    return (g + decay * new_t if nesterov else new_t), new_t


def _trace_native(g, st, p, hp, nesterov):
    """:func:`trace`'s rule on ``[K, R]`` rows, for the native kernel's reference."""
    upd, t = _trace_math(g, st[0], hp[0], nesterov)
    return upd, (t,)


# ------------------------------------------------------------ weight decay


class AddDecayedWeightsState(NamedTuple):
    """State of :func:`add_decayed_weights` with a scheduled weight decay."""

    count: jax.Array  # int32 scalar


def add_decayed_weights(
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
    *,
    coalesce_method: str = "auto",
    max_distinct: Any = None,
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
      coalesce_method: how duplicate ids are summed (:func:`jaxslices.coalesce`).
      max_distinct: the distinct-row bound of sparse leaves (see
        :func:`jaxslices.lazy_adam`).

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    References:
      Loshchilov and Hutter, 2019, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_; :func:`optax.add_decayed_weights`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> params = jnp.array([1.0, 2.0, 3.0])
      >>> g = jaxslices.IndexedSlices(jnp.zeros(2), jnp.array([2, 2]), (3,))
      >>> tx = jaxslices.add_decayed_weights(0.1)
      >>> u, _ = tx.update(g, tx.init(params), params)
      >>> u.to_dense()
      Array([0. , 0. , 0.3], dtype=float32)
    """
    check_method(coalesce_method, "jaxslices.add_decayed_weights")
    check_max_distinct(max_distinct, "add_decayed_weights")
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

        def rule(g, states, p):
            return _decay_math(g, p, wd), ()

        def decay(u, p, bound):
            return rowwise_update(
                name,
                rule,
                u,
                params=p,
                method=coalesce_method,
                max_distinct=bound,
                native=Native(_DECAY_SPEC, (wd,)),
            )[0]

        if mask is None:
            return decay(updates, params, max_distinct), new_state
        mask_tree = mask(params) if callable(mask) else mask
        bounds = leaf_bounds(name, max_distinct, updates)
        updates = jax.tree.map(
            lambda m, u, p, b: decay(u, p, b) if m else u,
            mask_tree,
            updates,
            params,
            bounds,
            is_leaf=lambda x: x is None,
        )
        return updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _decay_math(g, p, wd):
    """Weight decay: the update plus ``wd * p``."""
    return g + wd * p


def _decay_native(g, st, p, hp, cfg):
    return _decay_math(g, p, hp[0]), ()


_DECAY_SPEC = kernel_ops.RuleSpec("decay", _decay_native)


# ---------------------------------------------------------------- adagrad


class ScaleByRssState(NamedTuple):
    """State of :func:`scale_by_rss`: accumulated squared gradients (dense)."""

    sum_of_squares: Any


def scale_by_rss(
    initial_accumulator_value: ArrayLike = 0.1,
    eps: ArrayLike = 1e-7,
    *,
    coalesce_method: str = "auto",
    max_distinct: Any = None,
    stochastic_rounding: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Adagrad's scaling, ``g / sqrt(sum of g**2 + eps)``, touched rows only.

    The building block of :func:`jaxslices.adagrad`, which has the maths, why
    the sparse result equals the dense one, and the references. Dense leaves:
    exactly :func:`optax.scale_by_rss`. Sparse leaves are coalesced; the
    accumulator rows they touch are gathered, updated and scattered back.

    Args:
      initial_accumulator_value, eps, coalesce_method, max_distinct: as in
        :func:`jaxslices.adagrad`.
      stochastic_rounding: as in :func:`jaxslices.adagrad`.

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
    check_method(coalesce_method, "jaxslices.scale_by_rss")
    check_max_distinct(max_distinct, "scale_by_rss")
    check_stochastic_rounding(stochastic_rounding, "scale_by_rss")

    def init_fn(params):
        return ScaleByRssState(
            sum_of_squares=jax.tree.map(
                lambda p: jnp.full_like(p, initial_accumulator_value), params
            )
        )

    def rule(g, states, p):
        upd, acc = _rss_math(g, states[0], eps)
        return upd, (acc,)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        updates, (acc,) = rowwise_update(
            "scale_by_rss",
            rule,
            updates,
            [("state", state.sum_of_squares)],
            method=coalesce_method,
            max_distinct=max_distinct,
            stochastic_rounding=stochastic_rounding,
            native=Native(_RSS_SPEC, (eps,)),
        )
        return updates, ScaleByRssState(sum_of_squares=acc)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _rss_math(g, acc, eps):
    """Adagrad: ``(update, new accumulator)``."""
    acc = abs_sq(g) + acc
    return jnp.where(acc > 0, jax.lax.rsqrt(acc + eps), 0.0) * g, acc


def _rss_native(g, st, p, hp, cfg):
    upd, acc = _rss_math(g, st[0], hp[0])
    return upd, (acc,)


_RSS_SPEC = kernel_ops.RuleSpec("rss", _rss_native)


class ScaleByRowwiseRssState(NamedTuple):
    """State of :func:`scale_by_rowwise_rss`: one accumulator per table row.

    For a parameter of rank >= 2 the accumulator has shape ``(V,)``; for rank
    0 and 1, the parameter's shape. Its dtype is at least float32.
    """

    sum_of_squares: Any


def _rowwise_state_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[:1] if len(shape) >= 2 else shape


def _rowwise_state_dtype(dtype: Any) -> Any:
    wide = jnp.promote_types(dtype, jnp.float32)
    return jnp.finfo(wide).dtype if jnp.issubdtype(wide, jnp.inexact) else wide


def scale_by_rowwise_rss(
    initial_accumulator_value: ArrayLike = 0.0,
    eps: ArrayLike = 1e-8,
    *,
    coalesce_method: str = "auto",
    max_distinct: Any = None,
    stochastic_rounding: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Row-wise Adagrad's scaling: one accumulator per row, ``g / (sqrt(acc) + eps)``.

    The building block of :func:`jaxslices.rowwise_adagrad`, which has the
    maths, why the sparse result equals the dense one, and the references.
    For a table (rank >= 2, rows on axis 0) the state holds one float per row;
    rank-0 and rank-1 leaves keep one accumulator per element. Sparse leaves
    are coalesced first; only the touched rows' accumulators change.

    Args:
      initial_accumulator_value, eps, coalesce_method, max_distinct: as in
        :func:`jaxslices.rowwise_adagrad`.
      stochastic_rounding: as in :func:`jaxslices.rowwise_adagrad`.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`ScaleByRowwiseRssState`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> tx = jaxslices.scale_by_rowwise_rss(eps=0.0)
      >>> g = jaxslices.IndexedSlices(jnp.array([[1.0, 7.0]]), jnp.array([1]), (3, 2))
      >>> u, state = tx.update(g, tx.init(jnp.zeros((3, 2))))
      >>> state.sum_of_squares  # row 1: mean(1**2, 7**2) = 25
      Array([ 0., 25.,  0.], dtype=float32)
      >>> u.values  # g / sqrt(25)
      Array([[0.2, 1.4]], dtype=float32)
    """
    check_method(coalesce_method, "jaxslices.scale_by_rowwise_rss")
    check_max_distinct(max_distinct, "scale_by_rowwise_rss")
    check_stochastic_rounding(stochastic_rounding, "scale_by_rowwise_rss")

    def init_leaf(p):
        if not (hasattr(p, "shape") and hasattr(p, "dtype")):
            p = jnp.asarray(p)  # lists, Python scalars
        return jnp.full(
            _rowwise_state_shape(tuple(p.shape)),
            initial_accumulator_value,
            _rowwise_state_dtype(p.dtype),
        )

    def init_fn(params):
        return ScaleByRowwiseRssState(sum_of_squares=jax.tree.map(init_leaf, params))

    def rule(g, states, p):
        upd, new_acc = _rowwise_rss_math(g, states[0], eps)
        return upd, (new_acc,)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        updates, (acc,) = rowwise_update(
            "scale_by_rowwise_rss",
            rule,
            updates,
            [("state.sum_of_squares", state.sum_of_squares)],
            state_shape=_rowwise_state_shape,
            method=coalesce_method,
            max_distinct=max_distinct,
            stochastic_rounding=stochastic_rounding,
            native=Native(_ROWWISE_RSS_SPEC, (eps,)),
        )
        return updates, ScaleByRowwiseRssState(sum_of_squares=acc)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _rowwise_rss_math(g, acc, eps):
    """Row-wise Adagrad: ``(update, new accumulator)``, one accumulator per row."""
    sq = abs_sq(g).astype(acc.dtype)
    if g.ndim >= 2:
        sq = jnp.mean(sq, axis=tuple(range(1, g.ndim)))
    new_acc = acc + sq
    shape = new_acc.shape + (1,) * (g.ndim - new_acc.ndim)
    # new_acc == 0 only where g == 0: divide by 1 there (no 0 / 0).
    denom = jnp.where(new_acc > 0, jnp.sqrt(new_acc) + eps, 1.0)
    return (g / denom.reshape(shape)).astype(g.dtype), new_acc


def _rowwise_rss_native(g, st, p, hp, cfg):
    (acc,) = st  # [K, 1]
    upd, acc = _rowwise_rss_math(g, acc.reshape(acc.shape[0]), hp[0])
    return upd, (acc.reshape(acc.shape[0], 1),)


_ROWWISE_RSS_SPEC = kernel_ops.RuleSpec("rowwise_rss", _rowwise_rss_native)


# -------------------------------------------------------------- lazy adam


@functools.partial(jax.jit, inline=True)
def _bias_correction(decay: ArrayLike, count: jax.Array) -> jax.Array:
    """``1 - decay**count``, once per step and in float32 (Optax computes it so)."""
    return 1 - decay**count


def _debias(moment: jax.Array, correction: jax.Array) -> jax.Array:
    return moment / correction.astype(moment.dtype)


def _adam_math(
    g, m, v, b1, b2, eps, eps_root, bc_mu, bc_nu, bc_mu_next, nesterov, c1=None, c2=None
):
    """Adam on rows: ``(update, new first moment, new second moment)``.

    ``c1`` and ``c2`` are ``1 - b1`` and ``1 - b2`` as Optax computes them
    (from Python floats, in float64); the kernel's rule passes them in.
    """
    c1 = 1 - b1 if c1 is None else c1
    c2 = 1 - b2 if c2 is None else c2
    sq = g**2 if jnp.isrealobj(g) else (g.conj() * g).real
    mu = c1 * g + b1 * m
    nu = c2 * sq + b2 * v
    if nesterov:
        mu_hat = b1 * _debias(mu, bc_mu_next) + c1 * _debias(g, bc_mu)
    else:
        mu_hat = _debias(mu, bc_mu)
    upd = mu_hat / (jnp.sqrt(_debias(nu, bc_nu) + eps_root) + eps)
    return upd, mu, nu


def _adam_native(g, st, p, hp, nesterov):
    upd, mu, nu = _adam_math(g, *st, *hp[:7], nesterov, c1=hp[7], c2=hp[8])
    return upd, (mu, nu)


class _ScaleByLazyAdamFields(NamedTuple):
    count: jax.Array  # int32 scalar
    mu_nu: Any


class ScaleByLazyAdamState(_ScaleByLazyAdamFields):
    """State of :func:`scale_by_lazy_adam`: the global step count and both moments.

    The moments are **row-major**: for a parameter of shape ``(V, *row)``,
    ``mu_nu`` holds one array of shape ``(V, 2, *row)`` with the first moment
    at ``[:, 0]`` and the second at ``[:, 1]`` (a scalar parameter: shape
    ``(2,)``), so one gather and one scatter read and write both moments of
    the rows a step touches. :attr:`mu` and :attr:`nu` give them as two trees
    (copies, for reading). The array's dtype is the parameter's, or the wider
    of it and ``mu_dtype``; each moment is still rounded to its own dtype
    every step (``docs/optax.md``, "Row-major state").

    Attributes:
      count: the number of steps so far (int32).
      mu_nu: per parameter, both moments side by side.
    """

    __slots__ = ()

    def __new__(cls, count: Any, mu_nu: Any, *old: Any) -> ScaleByLazyAdamState:
        # Pickles of the separate layout (count, mu, nu) load as the new one.
        mu_nu = packed_pair("ScaleByLazyAdamState", "(count, mu_nu)", mu_nu, old)
        return super().__new__(cls, count, mu_nu)

    mu = unpacked("mu_nu", 0, "The first moments.")
    nu = unpacked("mu_nu", 1, "The second moments.")


def scale_by_lazy_adam(
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    eps_root: ArrayLike = 0.0,
    mu_dtype: Any = None,
    *,
    nesterov: bool = False,
    coalesce_method: str = "auto",
    max_distinct: Any = None,
    stochastic_rounding: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Adam's scaling (:func:`optax.scale_by_adam`), lazy for sparse leaves.

    The building block of :func:`jaxslices.lazy_adam`, which has the maths,
    what *lazy* means for sparse leaves, the bias correction (one global step
    count), and the references. Dense leaves: exactly
    :func:`optax.scale_by_adam`. Sparse leaves are coalesced; both moments of
    the touched rows are gathered (one gather: the state is row-major, see
    :class:`ScaleByLazyAdamState`), updated and scattered back, and only those
    rows get an update.

    Args:
      b1, b2, eps, eps_root, mu_dtype, nesterov, coalesce_method, max_distinct:
        as in :func:`jaxslices.lazy_adam`.
      stochastic_rounding: as in :func:`jaxslices.lazy_adam`.

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
      >>> state.mu_nu.shape  # (V, 2): both moments of a row side by side
      (3, 2)
    """
    check_method(coalesce_method, "jaxslices.scale_by_lazy_adam")
    check_max_distinct(max_distinct, "scale_by_lazy_adam")
    check_stochastic_rounding(stochastic_rounding, "scale_by_lazy_adam")
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
    refuse = None
    if mu_dtype is not None and mu_dtype != jnp.float32:
        refuse = f"mu_dtype={mu_dtype.name} (the kernels keep float32 moments)"
    spec = kernel_ops.RuleSpec(
        "adam", _adam_native, cfg=bool(nesterov), nesterov=bool(nesterov)
    )

    def init_fn(params):
        def dtype(p):
            p_dtype = jnp.result_type(p)
            return p_dtype if mu_dtype is None else jnp.promote_types(mu_dtype, p_dtype)

        return ScaleByLazyAdamState(
            count=jnp.zeros([], jnp.int32),
            mu_nu=jax.tree.map(lambda p: packed_zeros(p, (0, 0), dtype(p)), params),
        )

    def _refuse(updates):
        # With mu_dtype given, Optax keeps the second moment in the gradient's
        # dtype: a bfloat16 gradient's is rounded to bfloat16 every step,
        # where the kernel keeps float32.
        low = any(
            _rounding.is_low_precision(getattr(g, "dtype", None))
            for g in jax.tree.leaves(updates, is_leaf=is_leaf)
        )
        if refuse is None and mu_dtype is not None and low:
            return (
                "mu_dtype with a bfloat16/float16 gradient (Optax keeps the second "
                "moment in the gradient's dtype; the kernels in float32)"
            )
        return refuse

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        count = optax.safe_increment(state.count)
        # One global step count for every leaf and row (see the docstring).
        bc_mu = _bias_correction(b1, count)
        bc_mu_next = _bias_correction(b1, optax.safe_increment(count))
        bc_nu = _bias_correction(b2, count)

        hp = (b1, b2, eps, eps_root, bc_mu, bc_nu, bc_mu_next)

        def rule(g, states, p):
            m, v = states
            if mu_dtype is not None:
                # Each moment in its own dtype (the buffer holds the wider).
                m, v = state_as(m, mu_dtype), state_as(v, grad_dtype(g))
            upd, mu, nu = _adam_math(g, m, v, *hp, nesterov)
            new_mu = mu if mu_dtype is None else state_as(mu, mu_dtype)
            return upd, (new_mu, nu.astype(v.dtype))

        updates, (mu_nu,) = rowwise_update(
            "scale_by_lazy_adam",
            rule,
            updates,
            [("state.mu_nu", state.mu_nu, 2)],
            method=coalesce_method,
            max_distinct=max_distinct,
            stochastic_rounding=stochastic_rounding,
            # The kernel also takes 1 - b1 and 1 - b2 as the XLA rule makes
            # them (in Python's float64 for float hyperparameters).
            native=Native(spec, (*hp, 1 - b1, 1 - b2), refuse=_refuse(updates)),
        )
        return updates, ScaleByLazyAdamState(count=count, mu_nu=mu_nu)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ------------------------------------------------------------- densify


def densify(max_rows: int | None = None) -> optax.GradientTransformationExtraArgs:
    """Turn sparse updates of small tables into dense arrays (opt-in fallback).

    Replaces each :class:`~jaxslices.IndexedSlices` whose table has at most
    ``max_rows`` rows (all of them if ``None``) by its dense equivalent, and
    leaves larger tables sparse. Put it first in a chain: for small tables a
    dense step is cheaper than gathering and scattering rows for clipping,
    Adagrad and Adam (never for plain SGD); the measured crossover, which
    depends on the machine and the row width, is in ``docs/optax.md`` ("Small
    tables") and ``benchmarks/RESULTS.md``. The maths changes
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
        check_all("densify", updates)

        def leaf(g):
            small = max_rows is None or (
                isinstance(g, IndexedSlices) and g.dense_shape[0] <= max_rows
            )
            return g.to_dense() if isinstance(g, IndexedSlices) and small else g

        return jax.tree.map(leaf, updates, is_leaf=is_leaf), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)
