"""Optimizer aliases: Optax's ``alias.py`` for trees holding ``IndexedSlices``.

Each alias is an :func:`optax.chain` of building blocks (same state layout as
its Optax namesake) or, for FTRL, one rule given to the row-wise helper.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from .._coalesce import check_method
from ..kernels import _ops as kernel_ops
from ._rowwise import (
    Native,
    ScalarOrSchedule,
    check_max_distinct,
    check_stochastic_rounding,
    packed_pair,
    packed_zeros,
    rowwise_update,
    unpacked,
)
from ._transform import (
    add_decayed_weights,
    scale_by_lazy_adam,
    scale_by_learning_rate,
    scale_by_rowwise_rss,
    scale_by_rss,
    trace,
)

__all__ = [
    "FtrlState",
    "adagrad",
    "ftrl",
    "lazy_adam",
    "lazy_adamw",
    "rowwise_adagrad",
    "sgd",
]


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: ArrayLike | None = None,
    nesterov: bool = False,
    accumulator_dtype: Any = None,
    *,
    coalesce_method: str = "auto",
    max_distinct: Any = None,
    stochastic_rounding: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Stochastic gradient descent, with optional lazy momentum.

    With ``m = momentum`` (``None``: plain SGD, no trace), each step computes,
    per entry, from the gradient ``g`` and the trace ``t`` (the state, zeros
    at first)::

        t      = g + m * t
        update = -learning_rate * (g + m * t if nesterov else t)

    Dense leaves: exactly :func:`optax.sgd`. Sparse leaves without momentum:
    ``-learning_rate * values`` on the same indices (nothing is coalesced;
    :func:`jaxslices.apply_updates` sums duplicates), which equals dense SGD
    on the dense gradient. With momentum, duplicate ids are summed first and
    the trace is **lazy**: only the rows the step touches have their trace
    updated and move; an untouched row keeps its trace, unchanged, until it is
    touched again (dense momentum keeps moving it by ``m * t``).

    Args:
      learning_rate: a scalar or an Optax schedule.
      momentum: the momentum coefficient, or ``None`` for plain SGD.
      nesterov: use Nesterov momentum.
      accumulator_dtype: dtype of the momentum buffer; ``None``: the parameter's.
      coalesce_method: how duplicate ids are summed (:func:`jaxslices.coalesce`).
      max_distinct: with momentum only (plain SGD does not coalesce): the
        distinct-row bound of sparse leaves, as in :func:`lazy_adam`.
      stochastic_rounding: with momentum only (plain SGD has no state): how
        a bfloat16/float16 trace is written, as in :func:`lazy_adam`.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`; its state is the
      :func:`optax.chain` state of ``(trace or identity, learning rate)``, like
      :func:`optax.sgd`.

    References:
      Robbins and Monro, 1951, `A Stochastic Approximation Method
      <https://doi.org/10.1214/aoms/1177729586>`_; Polyak, 1964 (momentum);
      :func:`optax.sgd`; lazy sparse momentum as in TensorFlow's
      ``SparseApplyMomentum``.

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
    sparse = _sparse_options("sgd", coalesce_method, max_distinct, stochastic_rounding)
    first = (
        optax.identity()
        if momentum is None
        else trace(
            momentum,
            nesterov=nesterov,
            accumulator_dtype=accumulator_dtype,
            **sparse,
        )
    )
    return optax.chain(first, scale_by_learning_rate(learning_rate))


def adagrad(
    learning_rate: ScalarOrSchedule,
    initial_accumulator_value: ArrayLike = 0.1,
    eps: ArrayLike = 1e-7,
    *,
    coalesce_method: str = "auto",
    max_distinct: Any = None,
    stochastic_rounding: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Adagrad that keeps sparse gradients sparse; equals :func:`optax.adagrad`.

    Per entry, with the accumulator ``acc`` (the state) starting at
    ``initial_accumulator_value``::

        acc    = acc + g ** 2
        update = -learning_rate * g / sqrt(acc + eps)     (0 where acc == 0)

    Sparse leaves are coalesced (duplicate ids summed, then squared) and only
    the touched rows' accumulators are read and written. A row the gradient
    does not touch has a zero dense gradient, and in Adagrad a zero gradient
    changes neither the accumulator nor the parameter, so sparse and dense
    Adagrad agree exactly (up to float rounding of duplicate sums). Each step
    costs what the batch touches.

    Args:
      learning_rate: a scalar or an Optax schedule.
      initial_accumulator_value: starting value of the accumulator.
      eps: added under the square root.
      coalesce_method, max_distinct, stochastic_rounding: as in :func:`lazy_adam`.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`; the state is the
      :func:`optax.chain` state of ``(scale_by_rss, learning rate)``.

    References:
      Duchi et al., 2011, `Adaptive Subgradient Methods
      <https://jmlr.org/papers/v12/duchi11a.html>`_; :func:`optax.adagrad`;
      TensorFlow's ``SparseApplyAdagrad``.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> params = jnp.zeros((3, 2))
      >>> g = jaxslices.IndexedSlices(jnp.ones((2, 2)), jnp.array([1, 1]), (3, 2))
      >>> tx = jaxslices.adagrad(1.0)
      >>> u, state = tx.update(g, tx.init(params))
      >>> jaxslices.apply_updates(params, u)[:, 0].round(4)
      Array([ 0.    , -0.9877,  0.    ], dtype=float32)
    """
    options = (coalesce_method, max_distinct, stochastic_rounding)
    iav = initial_accumulator_value
    return _chain("adagrad", options, learning_rate, scale_by_rss, iav, eps)


def lazy_adam(
    learning_rate: ScalarOrSchedule,
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
    """Lazy Adam: :func:`optax.adam` on dense leaves, touched rows only on slices.

    Per entry, with the moments ``mu``, ``nu`` (the state, zeros at first) and
    ``k`` the number of steps so far, counting this one::

        mu     = b1 * mu + (1 - b1) * g
        nu     = b2 * nu + (1 - b2) * g ** 2
        update = -learning_rate * mu_hat / (sqrt(nu / (1 - b2 ** k) + eps_root) + eps)

    with ``mu_hat = mu / (1 - b1 ** k)`` (``nesterov``: ``b1 * mu / (1 - b1 **
    (k + 1)) + (1 - b1) * g / (1 - b1 ** k)``, Optax's NAdam). Dense leaves:
    exactly :func:`optax.adam`. Sparse leaves are coalesced, and only the rows
    a gradient touches have their moments updated and move; untouched rows'
    moments and parameters do not change (TF Addons' ``LazyAdam``, PyTorch's
    ``SparseAdam``). Where every row is touched at every step this is Adam.

    **Bias correction** uses the one global step count ``k`` of the state,
    like TF Addons' LazyAdam and PyTorch's SparseAdam, not a per-row count: a
    row first touched at step ``k`` is corrected by ``1 - b1 ** k``, so its
    first update is smaller than Adam's first step would be (by ``(1 - b1) /
    (1 - b1 ** k)``). This keeps the state to two moments and one scalar and
    makes dense leaves identical to Optax.

    Args:
      learning_rate: a scalar or an Optax schedule.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added to the second moment inside the square root.
      mu_dtype: dtype of the first moment; ``None``: the parameter's.
      nesterov: use Nesterov momentum (NAdam), as in Optax.
      coalesce_method: how duplicate ids are summed (:func:`jaxslices.coalesce`).
      max_distinct: a static bound on the distinct rows one step's gradient
        touches: an ``int``, or a pytree prefix of the params with an ``int``
        or ``None`` per table. Sparse leaves are coalesced into that many
        slots instead of one per lookup, so every gather, scatter and state
        update runs over the bound. More distinct rows raise an error
        (eagerly, under ``jit``, on every device of a mesh); nothing is
        dropped. ``None`` (default): one slot per lookup, never overflows.
        :func:`jaxslices.capacity.estimate_max_distinct` estimates it from
        sample batches; ``docs/optax.md`` ("Distinct-row bound") says how to
        choose it.
      stochastic_rounding: how bfloat16/float16 optimizer state is written
        (docs/optax.md, "Low-precision tables"): ``None`` (default)
        stochastically for sparse leaves, to nearest for dense ones (Optax's
        numbers); ``True`` stochastically for both; ``False`` to nearest.
        The state is read and updated in float32 and rounded once when
        written. (The table itself is rounded by
        :func:`jaxslices.apply_updates`, which has the same switch.)

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`; the state is the
      :func:`optax.chain` state of ``(scale_by_lazy_adam, learning rate)``.

    References:
      Kingma and Ba, 2014, `Adam <https://arxiv.org/abs/1412.6980>`_;
      :func:`optax.adam`; TF Addons ``LazyAdam``; PyTorch ``SparseAdam``.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> params = jnp.zeros((3, 1))
      >>> g = jaxslices.IndexedSlices(jnp.ones((1, 1)), jnp.array([2]), (3, 1))
      >>> tx = jaxslices.lazy_adam(0.1)
      >>> u, state = tx.update(g, tx.init(params))
      >>> [round(float(x), 4) for x in jaxslices.apply_updates(params, u).ravel()]
      [0.0, 0.0, -0.1]
    """
    options = (coalesce_method, max_distinct, stochastic_rounding)
    adam = (scale_by_lazy_adam, b1, b2, eps, eps_root, mu_dtype)
    return _chain("lazy_adam", options, learning_rate, *adam, nesterov=nesterov)


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
    coalesce_method: str = "auto",
    max_distinct: Any = None,
    stochastic_rounding: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Lazy AdamW: :func:`optax.adamw` on dense leaves, touched rows only on slices.

    :func:`lazy_adam` followed by decoupled weight decay, per entry::

        update = -learning_rate * (adam_update + weight_decay * p)

    with ``adam_update`` the scaled moment of :func:`lazy_adam` and ``p`` the
    parameter. For a sparse leaf only the touched rows decay (see
    :func:`add_decayed_weights`), so untouched rows' moments and parameters do
    not change at all.

    Args:
      learning_rate, b1, b2, eps, eps_root, mu_dtype: as in :func:`lazy_adam`.
      weight_decay: a scalar or an Optax schedule.
      mask: which leaves decay, as in :func:`add_decayed_weights`.
      nesterov, coalesce_method, max_distinct, stochastic_rounding: as in
        :func:`lazy_adam`.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`; the state is the
      :func:`optax.chain` state of ``(scale_by_lazy_adam, add_decayed_weights,
      learning rate)``, like :func:`optax.adamw`.

    References:
      Loshchilov and Hutter, 2019, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_; :func:`optax.adamw`; TF Addons
      ``LazyAdam``.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> params = jnp.ones(3)
      >>> g = jaxslices.IndexedSlices(jnp.ones(1), jnp.array([2]), (3,))
      >>> tx = jaxslices.lazy_adamw(0.1, weight_decay=0.5)
      >>> u, state = tx.update(g, tx.init(params), params)
      >>> [round(float(x), 4) for x in jaxslices.apply_updates(params, u)]
      [1.0, 1.0, 0.85]
    """
    options = (coalesce_method, max_distinct, stochastic_rounding)
    adam = (scale_by_lazy_adam, b1, b2, eps, eps_root, mu_dtype)
    decay = (weight_decay, mask)
    return _chain(
        "lazy_adamw", options, learning_rate, *adam, nesterov=nesterov, decay=decay
    )


def rowwise_adagrad(
    learning_rate: ScalarOrSchedule,
    initial_accumulator_value: ArrayLike = 0.0,
    eps: ArrayLike = 1e-8,
    *,
    coalesce_method: str = "auto",
    max_distinct: Any = None,
    stochastic_rounding: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Row-wise Adagrad: one accumulator per table row (FBGEMM's exact rule).

    For a table (rank >= 2, rows on axis 0) the state is one float per row.
    For each row ``r`` a step touches (duplicate ids summed first), with the
    accumulator ``acc`` (the state) starting at ``initial_accumulator_value``::

        acc[r]    = acc[r] + mean(g[r] ** 2)          # over the row's elements
        update[r] = -learning_rate * g[r] / (sqrt(acc[r]) + eps)

    Rank-0 and rank-1 leaves keep one accumulator per element, same formula
    (the mean of one square is that square). **Sparse equals dense:** a row
    with a zero gradient keeps its accumulator and does not move in the dense
    rule either, so untouched rows and their state are unchanged and the
    sparse update is the dense one. Optimizer state for a ``(V, D)`` float32
    table is ``4 V`` bytes instead of Adagrad's ``4 V D``.

    Args:
      learning_rate: a scalar or an Optax schedule.
      initial_accumulator_value: starting value of every accumulator.
      eps: added to the square root in the denominator.
      coalesce_method, max_distinct, stochastic_rounding: as in :func:`lazy_adam`.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`; the state is the
      :func:`optax.chain` state of ``(scale_by_rowwise_rss, learning rate)``.

    References:
      FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` (``fbgemm_gpu`` split table-batched
      embeddings; TorchRec's default for embedding tables);
      Duchi et al., 2011, `Adaptive Subgradient Methods
      <https://jmlr.org/papers/v12/duchi11a.html>`_.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> params = jnp.zeros((3, 2))
      >>> g = jaxslices.IndexedSlices(jnp.ones((2, 2)), jnp.array([1, 1]), (3, 2))
      >>> tx = jaxslices.rowwise_adagrad(1.0)
      >>> u, state = tx.update(g, tx.init(params))
      >>> state[0].sum_of_squares  # one float per row: mean((1 + 1) ** 2)
      Array([0., 4., 0.], dtype=float32)
      >>> jaxslices.apply_updates(params, u)[1]
      Array([-1., -1.], dtype=float32)
    """
    options = (coalesce_method, max_distinct, stochastic_rounding)
    rss = (scale_by_rowwise_rss, initial_accumulator_value, eps)
    return _chain("rowwise_adagrad", options, learning_rate, *rss)


def _sparse_options(
    name: str, coalesce_method: str, max_distinct: Any, stochastic_rounding: Any
) -> dict[str, Any]:
    """An alias's options for sparse leaves, checked (messages name the alias),
    as keyword arguments for its transforms."""
    check_method(coalesce_method, f"jaxslices.{name}")
    check_max_distinct(max_distinct, name)
    check_stochastic_rounding(stochastic_rounding, name)
    return dict(
        coalesce_method=coalesce_method,
        max_distinct=max_distinct,
        stochastic_rounding=stochastic_rounding,
    )


def _chain(
    name: str,
    options: tuple[str, Any, Any],
    learning_rate: ScalarOrSchedule,
    scaling: Any,
    *args: Any,
    decay: tuple[Any, Any] | None = None,
    **kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
    """An alias as Optax chains it: ``scaling(*args, **kwargs)``, then (with
    ``decay = (weight_decay, mask)``, AdamW's) the decoupled weight decay,
    then the learning rate. The alias's sparse ``options``
    (``coalesce_method, max_distinct, stochastic_rounding``) are checked
    first (messages name the alias) and given to ``scaling``."""
    sparse = _sparse_options(name, *options)
    parts = [scaling(*args, **kwargs, **sparse)]
    if decay is not None:
        # The scaling's slices are coalesced already: no second sort.
        coalescing = {k: sparse[k] for k in ("coalesce_method", "max_distinct")}
        parts.append(add_decayed_weights(*decay, **coalescing))
    return optax.chain(*parts, scale_by_learning_rate(learning_rate))


class _FtrlFields(NamedTuple):
    count: jax.Array  # int32 scalar, for learning-rate schedules
    n_z: Any


class FtrlState(_FtrlFields):
    """State of :func:`ftrl`: the step count and, row-major, ``n`` and ``z``.

    For a parameter of shape ``(V, *row)``, ``n_z`` holds one array of shape
    ``(V, 2, *row)``: the accumulator ``n`` at ``[:, 0]`` and the linear term
    ``z`` at ``[:, 1]`` (a scalar parameter: shape ``(2,)``), so one gather
    and one scatter serve both. :attr:`accumulator` and :attr:`linear` give
    them as two trees (copies, for reading).

    Attributes:
      count: the number of steps so far (int32), for learning-rate schedules.
      n_z: per parameter, ``n`` and ``z`` side by side.
    """

    __slots__ = ()

    def __new__(cls, count: Any, n_z: Any, *old: Any) -> FtrlState:
        # Pickles of the separate layout (count, accumulator, linear) load.
        n_z = packed_pair("FtrlState", "(count, n_z)", n_z, old)
        return super().__new__(cls, count, n_z)

    accumulator = unpacked("n_z", 0, "The accumulators ``n``.")
    linear = unpacked("n_z", 1, "The linear terms ``z``.")


def _power(x: jax.Array, k: ArrayLike) -> jax.Array:
    """``x ** k``; the paper's ``k = 0.5`` as a square root (cheaper, as exact)."""
    if isinstance(k, (int, float)) and k == 0.5:
        return jnp.sqrt(x)
    return jnp.power(x, k)


def _ftrl_math(g, n, z, p, lr, k, l1, l2, l2_shrinkage, beta, power):
    """FTRL-proximal on rows: ``(update, new n, new z)`` (Keras 3's formula)."""
    n_new = n + jnp.square(g)
    pow_new = power(n_new, k)
    sigma_p = (pow_new - power(n, k)) / lr * p
    z_new = z + (g + 2 * l2_shrinkage * p) - sigma_p
    q = pow_new / lr + 2 * (l2 + beta / (2.0 * lr))
    p_new = (jnp.clip(z_new, -l1, l1) - z_new) / q
    return p_new - p, n_new, z_new


def _ftrl_native(g, st, p, hp, sqrt_power):
    def power(x, k):
        return jnp.sqrt(x) if sqrt_power else jnp.power(x, k)

    upd, n, z = _ftrl_math(g, *st, p, *hp, power)
    return upd, (n, z)


def _check_nonnegative(**kwargs: Any) -> None:
    for name, value in kwargs.items():
        if isinstance(value, (int, float)) and value < 0:
            raise ValueError(f"jaxslices.ftrl: `{name}` must be >= 0, got {value}.")


def ftrl(
    learning_rate: ScalarOrSchedule,
    learning_rate_power: ArrayLike = -0.5,
    initial_accumulator_value: ArrayLike = 0.1,
    l1: ArrayLike = 0.0,
    l2: ArrayLike = 0.0,
    l2_shrinkage: ArrayLike = 0.0,
    beta: ArrayLike = 0.0,
    *,
    coalesce_method: str = "auto",
    max_distinct: Any = None,
    stochastic_rounding: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""FTRL-proximal (Keras 3 ``Ftrl``), touched rows only for sparse leaves.

    Per element, with ``lr`` the learning rate, ``p`` the parameter, ``n`` the
    accumulator and ``z`` the linear state (``k = -learning_rate_power``)::

        g_s   = g + 2 * l2_shrinkage * p
        n_new = n + g ** 2
        z    += g_s - (n_new ** k - n ** k) / lr * p
        q     = n_new ** k / lr + 2 * (l2 + beta / (2 * lr))
        p_new = (clip(z, -l1, l1) - z) / q
        update = p_new - p

    The update is the new parameter minus the old one, so ``update`` needs the
    ``params``, and ``ftrl`` includes its learning rate (do not chain a
    ``scale_by_learning_rate`` after it). Dense leaves: Keras 3's formula
    exactly, in the parameter's dtype (adding the update back may round the
    new parameter in its last bit).

    Sparse leaves are **lazy**: duplicate ids are summed, then the formula
    runs on the touched rows only, and untouched rows keep their parameters,
    ``n`` and ``z`` (TensorFlow's ``SparseApplyFtrl``). This differs from
    dense FTRL on the dense gradient in two places: dense FTRL sets every row
    to its closed form ``p_new`` each step, so a row never touched since
    initialisation moves from its initial value to ``0`` (sparse: it keeps its
    initial value until first touched); and with ``l2_shrinkage > 0`` dense
    FTRL updates ``z`` (and the parameter) of every row every step through the
    ``2 * l2_shrinkage * p`` term, sparse FTRL only for touched rows. With
    ``l2_shrinkage = 0`` and every row touched each step they agree.

    Args:
      learning_rate: a positive scalar or an Optax schedule.
      learning_rate_power: ``<= 0``; ``-0.5`` is the paper's rule, ``0`` a fixed
        learning rate.
      initial_accumulator_value: starting value of ``n`` (``>= 0``).
      l1: L1 regularization strength (``>= 0``); drives parameters to exactly 0.
      l2: L2 regularization strength (``>= 0``), the "online" L2 of the paper.
      l2_shrinkage: L2 shrinkage strength (``>= 0``): an L2 penalty added to the
        loss gradient.
      beta: the paper's ``beta``, added to ``l2`` as ``beta / (2 * lr)``.
      coalesce_method, max_distinct, stochastic_rounding: as in :func:`lazy_adam`.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`FtrlState`.

    References:
      McMahan et al., 2013, `Ad Click Prediction: a View from the Trenches
      <https://research.google.com/pubs/archive/41159.pdf>`_ (Algorithm 1);
      Keras 3 ``keras.optimizers.Ftrl``; TensorFlow ``ApplyFtrlV2`` /
      ``SparseApplyFtrlV2``.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> params = jnp.array([0.5, 0.5, 0.5])
      >>> g = jaxslices.IndexedSlices(jnp.array([1.0]), jnp.array([1]), (3,))
      >>> tx = jaxslices.ftrl(0.1, l1=0.01)
      >>> u, state = tx.update(g, tx.init(params), params)
      >>> jaxslices.apply_updates(params, u).round(4)  # rows 0 and 2 untouched
      Array([0.5   , 0.2529, 0.5   ], dtype=float32)
    """
    _sparse_options("ftrl", coalesce_method, max_distinct, stochastic_rounding)
    _check_nonnegative(
        initial_accumulator_value=initial_accumulator_value,
        l1=l1,
        l2=l2,
        l2_shrinkage=l2_shrinkage,
    )
    if isinstance(learning_rate_power, (int, float)) and learning_rate_power > 0:
        raise ValueError(
            "jaxslices.ftrl: `learning_rate_power` must be <= 0 (-0.5 is the "
            f"paper's rule), got {learning_rate_power}."
        )
    if isinstance(learning_rate, (int, float)) and learning_rate <= 0:
        raise ValueError(
            f"jaxslices.ftrl: `learning_rate` must be > 0, got {learning_rate}."
        )

    sqrt_power = isinstance(learning_rate_power, (int, float)) and (
        learning_rate_power == -0.5
    )
    spec = kernel_ops.RuleSpec(
        "ftrl",
        _ftrl_native,
        cfg=sqrt_power,
        sqrt_power=bool(sqrt_power),
    )

    def init_fn(params):
        return FtrlState(
            count=jnp.zeros([], jnp.int32),
            n_z=packed_zeros(params, (initial_accumulator_value, 0)),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError(
                "jaxslices.ftrl needs the params (its update is the new parameter "
                "minus the old): call `tx.update(updates, state, params)`."
            )
        lr_now = learning_rate
        if callable(learning_rate):
            lr_now = learning_rate(state.count)

        k = -learning_rate_power
        hp = (lr_now, k, l1, l2, l2_shrinkage, beta)

        def rule(g, states, p):
            n, z = states
            lr = jnp.asarray(lr_now, p.dtype)
            g = g.astype(p.dtype)
            upd, n_new, z_new = _ftrl_math(g, n, z, p, lr, *hp[1:], _power)
            return upd, (n_new, z_new)

        updates, (n_z,) = rowwise_update(
            "ftrl",
            rule,
            updates,
            [("state.n_z", state.n_z, 2)],
            params,
            method=coalesce_method,
            max_distinct=max_distinct,
            stochastic_rounding=stochastic_rounding,
            native=Native(spec, hp),
        )
        count = optax.safe_increment(state.count)
        return updates, FtrlState(count=count, n_z=n_z)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
