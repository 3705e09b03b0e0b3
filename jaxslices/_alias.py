"""Optimizer aliases: Optax's ``alias.py`` for trees holding ``IndexedSlices``.

Each alias is an :func:`optax.chain` of building blocks (same state layout as
its Optax namesake) or, for FTRL, one rule given to the row-wise helper.
"""

from __future__ import annotations

from typing import Any

import optax
from jax.typing import ArrayLike

from . import _transform
from ._rowwise import ScalarOrSchedule
from ._transform import (
    scale_by_lazy_adam,
    scale_by_learning_rate,
    scale_by_rss,
    trace,
)

__all__ = ["adagrad", "lazy_adam", "lazy_adamw", "sgd"]


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
        _transform._add_decayed_weights(weight_decay, mask, coalesced=True),
        scale_by_learning_rate(learning_rate),
    )
