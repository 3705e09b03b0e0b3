"""``apply_if_finite`` for inner transforms that change the updates' types."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from .. import _leaves, _spmd
from .._leaves import is_leaf
from ..slices import IndexedSlices

__all__ = ["apply_if_finite"]


def _all_finite(updates) -> jax.Array:
    """``True`` when every float in ``updates`` (slices: their values) is finite.

    In a row-sharded step (``sharded_update(routing="all_to_all")``) the slices'
    non-finite counts are summed over the shards, so every shard decides alike.
    """
    leaves = jax.tree.leaves(updates, is_leaf=is_leaf)
    bad = [
        _spmd.sum_over_shards(jnp.sum(~jnp.isfinite(x.values)))
        if isinstance(x, IndexedSlices)
        else jnp.sum(~jnp.isfinite(x))
        for x in leaves
        if x is not None
    ]
    return sum(bad) == 0 if bad else jnp.array(True)


def apply_if_finite(
    inner: optax.GradientTransformation, max_consecutive_errors: int
) -> optax.GradientTransformationExtraArgs:
    """Skip steps whose gradients hold a NaN or Inf; :func:`optax.apply_if_finite`.

    Same behaviour, arguments and state (:class:`optax.ApplyIfFiniteState`) as
    :func:`optax.apply_if_finite`: a step whose updates are not all finite
    returns zero updates and keeps the inner state, until more than
    ``max_consecutive_errors`` such steps in a row, when the update is applied
    anyway. The difference: a rejected step returns zeros shaped like what
    ``inner`` *returns*, where Optax returns zeros shaped like its input. Use
    it when ``inner`` changes the updates' types, e.g. a chain that starts
    with :func:`jaxslices.densify` (slices in, dense arrays out), where
    ``optax.apply_if_finite`` fails in ``lax.cond`` because its two branches
    return different types. Around every other jaxslices transform the two
    are interchangeable except for what a rejected step returns for slices:
    here all-padding slices (they touch no row, also in a transform chained
    after this one), in Optax zeros at row 0 (which add nothing, but a lazy
    transform chained after it would count row 0 as touched).

    Args:
      inner: the transformation to protect.
      max_consecutive_errors: how many non-finite steps in a row are skipped.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`optax.ApplyIfFiniteState`.

    Example:
      >>> import jax.numpy as jnp, optax, jaxslices
      >>> tx = jaxslices.apply_if_finite(
      ...     optax.chain(jaxslices.densify(), jaxslices.sgd(0.1)), 3)
      >>> bad = jaxslices.IndexedSlices(jnp.array([jnp.nan]), jnp.array([0]), (2,))
      >>> u, state = tx.update(bad, tx.init(jnp.zeros(2)))
      >>> u, int(state.notfinite_count)
      (Array([0., 0.], dtype=float32), 1)
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return optax.ApplyIfFiniteState(
            notfinite_count=jnp.zeros([], jnp.int32),
            last_finite=jnp.array(True, jnp.bool_),
            total_notfinite=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        isfinite = _all_finite(updates)
        notfinite_count = jnp.where(
            isfinite,
            jnp.zeros([], jnp.int32),
            optax.safe_increment(state.notfinite_count),
        )

        def do_update(_):
            return inner.update(updates, state.inner_state, params, **extra_args)

        out_shape = jax.eval_shape(do_update, None)

        def reject_update(_):
            zeros = _leaves.zero_updates(out_shape[0])
            return zeros, state.inner_state

        new_updates, new_inner = jax.lax.cond(
            jnp.logical_or(isfinite, notfinite_count > max_consecutive_errors),
            do_update,
            reject_update,
            None,
        )
        return new_updates, optax.ApplyIfFiniteState(
            notfinite_count=notfinite_count,
            last_finite=isfinite,
            total_notfinite=jnp.where(
                isfinite,
                state.total_notfinite,
                optax.safe_increment(state.total_notfinite),
            ),
            inner_state=new_inner,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
