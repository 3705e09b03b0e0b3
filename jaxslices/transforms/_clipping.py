"""Clipping: Optax's ``clipping.py`` for trees holding ``IndexedSlices``.

Clipping acts on the dense gradient, so sparse leaves are coalesced first
(duplicate ids summed): ``clip`` clips each row's sum, ``clip_by_row_norm``
each distinct row's norm, and ``clip_by_global_norm`` uses the exact norm of
the dense equivalent.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from .. import _coalesce
from .._coalesce import check_method
from .._leaves import is_leaf
from ..kernels import _ops as kernel_ops
from ..slices import norm_of_leaves
from ._rowwise import (
    Native,
    abs_sq,
    check_all,
    check_max_distinct,
    coalesce_all,
    map_values,
    rowwise_update,
)

__all__ = ["clip", "clip_by_global_norm", "clip_by_row_norm"]


def clip(
    max_delta: ArrayLike, *, coalesce_method: str = "auto", max_distinct: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Clip every entry to ``[-max_delta, max_delta]``.

    Dense leaves: exactly :func:`optax.clip`. Sparse leaves are coalesced first,
    so the per-row **sum** is clipped, as clipping the dense gradient would;
    the result is coalesced.

    Args:
      max_delta: the largest absolute value kept.
      coalesce_method: how duplicate ids are summed (:func:`jaxslices.coalesce`).
      max_distinct: the distinct-row bound of sparse leaves (as in
        :func:`jaxslices.lazy_adam`); the result has that many slots.

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
    return _stateless(
        "clip",
        lambda g: jnp.clip(g, -max_delta, max_delta),
        Native(_CLIP_SPEC, (max_delta,)),
        coalesce_method,
        max_distinct,
    )


def _stateless(
    name: str,
    rule: Any,
    native: Native,
    coalesce_method: str,
    max_distinct: Any,
) -> optax.GradientTransformationExtraArgs:
    """A transform without state: ``rule`` on dense leaves and coalesced rows."""
    check_method(coalesce_method, f"jaxslices.{name}")
    check_max_distinct(max_distinct, name)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        out = rowwise_update(
            name,
            lambda g, states, p: (rule(g), ()),
            updates,
            method=coalesce_method,
            max_distinct=max_distinct,
            native=native,
        )
        return out[0], state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def clip_by_global_norm(
    max_norm: ArrayLike, *, coalesce_method: str = "auto", max_distinct: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Scale all updates by ``max_norm / norm`` when their global norm exceeds it.

    The norm is exact: it is the L2 norm of the dense equivalent of every leaf,
    duplicate indices summed before squaring (as :func:`jaxslices.global_norm`;
    TensorFlow squares raw values and under-clips when ids repeat). Squares are
    summed in at least float32. On float32 dense leaves this is
    :func:`optax.clip_by_global_norm`. Slices come out coalesced (the norm
    needs the per-row sums; passing them on means a following transform does
    not coalesce again).

    Args:
      max_norm: the largest global norm let through unscaled.
      coalesce_method, max_distinct: as in :func:`jaxslices.clip`.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` (stateless); its
      slices come out coalesced, scaled by one global factor.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> g = jaxslices.IndexedSlices(jnp.array([3.0, 3.0]), jnp.array([0, 0]), (2,))
      >>> tx = jaxslices.clip_by_global_norm(1.0)
      >>> u, _ = tx.update({"emb": g, "w": jnp.array([8.0])}, tx.init(None))
      >>> u["emb"].to_dense(), u["w"]  # norm 10: (3 + 3, 8) scaled by 1/10
      (Array([0.6, 0. ], dtype=float32), Array([0.8], dtype=float32))
    """
    check_method(coalesce_method, "jaxslices.clip_by_global_norm")
    check_max_distinct(max_distinct, "clip_by_global_norm")

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        check_all("clip_by_global_norm", updates)
        # Coalesce once: the norm needs per-row sums, and the coalesced slices
        # are passed on, so a following transform does not coalesce again.
        updates, measured = coalesce_all(
            "clip_by_global_norm", updates, coalesce_method, max_distinct
        )
        leaves = jax.tree.leaves(updates, is_leaf=is_leaf)
        g_norm = norm_of_leaves(leaves, measured)
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip_fn(t):
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

        # The same factor, for the native recipes of coalesced slices.
        factor = jnp.where(trigger, 1.0, max_norm / g_norm).astype(jnp.float32)
        return map_values("clip_by_global_norm", clip_fn, updates, factor), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def _clip_native(g, st, p, hp, cfg):
    return jnp.clip(g, -hp[0], hp[0]), ()


def _row_norm_native(g, st, p, hp, cfg):
    return _row_norm_scale(g, hp[0]), ()


_CLIP_SPEC = kernel_ops.RuleSpec("clip", _clip_native)
_ROW_NORM_SPEC = kernel_ops.RuleSpec("row_norm", _row_norm_native)


def _row_norm_scale(x: jax.Array, max_norm: ArrayLike) -> jax.Array:
    """Rows of ``x`` (leading axis) with L2 norm above ``max_norm`` scaled to it."""
    if x.ndim == 0:
        return _row_norm_scale(x[None], max_norm)[0]
    axes = tuple(range(1, x.ndim))
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    norm = jnp.sqrt(jnp.sum(abs_sq(wide), axis=axes))
    over = norm > max_norm
    factor = jnp.where(over, max_norm / jnp.where(over, norm, 1.0), 1.0)
    return x * _coalesce.rows_where(factor.astype(x.dtype), x.ndim)


def clip_by_row_norm(
    max_norm: ArrayLike, *, coalesce_method: str = "auto", max_distinct: Any = None
) -> optax.GradientTransformationExtraArgs:
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
      coalesce_method, max_distinct: as in :func:`jaxslices.clip`.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` (stateless); each
      distinct row of its coalesced slices is at most ``max_norm`` long.

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
    return _stateless(
        "clip_by_row_norm",
        lambda g: _row_norm_scale(g, max_norm),
        Native(_ROW_NORM_SPEC, (max_norm,)),
        coalesce_method,
        max_distinct,
    )
