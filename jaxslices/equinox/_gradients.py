"""Equinox gradient entry points: ``filter_value_and_grad``, ``filter_grad``, sparse."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx

from .. import autodiff

_VG = "jaxslices.equinox.filter_value_and_grad"


def _label(i: int, path: str) -> str:
    return f"model{path}"


def filter_value_and_grad(
    fun: Callable[..., Any], *, has_aux: bool = False, strict: bool = False
) -> Callable[..., Any]:
    """``eqx.filter_value_and_grad`` with sparse gradients for embedding tables.

    Differentiates ``fun`` with respect to the inexact arrays of its first
    argument (other leaves get ``None``), as Equinox does; a table read only
    through :func:`jaxslices.embedding_lookup` (e.g. by :class:`Embedding`)
    gets an :class:`~jaxslices.IndexedSlices` gradient, every other leaf
    exactly what ``eqx.filter_value_and_grad`` gives. The loss is traced three
    times (see :func:`jaxslices.value_and_grad`). Apply the updates with
    :func:`apply_updates`. ``strict=True``: a table that would get a dense
    gradient (a stock ``eqx.nn.Embedding``, ``weight[ids]``, a cast) raises
    :class:`jaxslices.DenseGradientError` at trace time.

    Args:
      fun: ``fun(model, *args, **kwargs)``, returning a scalar, or
        ``(scalar, aux)`` with ``has_aux``.
      has_aux: as in ``eqx.filter_value_and_grad``.
      strict: raise instead of giving a table a dense gradient.

    Returns:
      A function returning ``(value, grads)`` or ``((value, aux), grads)``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices.equinox as jse
      >>> emb = jse.Embedding(10, 2, key=jax.random.key(0))
      >>> loss = lambda m, ids: jnp.sum(jax.vmap(m)(ids))
      >>> value, grads = jse.filter_value_and_grad(loss)(emb, jnp.array([3, 3]))
      >>> grads.weight.to_dense()[3]
      Array([2., 2.], dtype=float32)
    """

    @functools.wraps(fun)
    def wrapper(x: Any, /, *args: Any, **kwargs: Any) -> Any:
        diff, static = eqx.partition(x, eqx.is_inexact_array)

        def call(diff: Any, static: Any, *args: Any, **kwargs: Any) -> Any:
            return fun(eqx.combine(diff, static), *args, **kwargs)

        vg = autodiff.differentiate(call, 0, has_aux, strict, _VG, _label)
        return vg(diff, static, *args, **kwargs)

    return wrapper


def filter_grad(
    fun: Callable[..., Any], *, has_aux: bool = False, strict: bool = False
) -> Callable:
    """``eqx.filter_grad`` with sparse gradients; see :func:`filter_value_and_grad`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices.equinox as jse
      >>> emb = jse.Embedding(10, 2, key=jax.random.key(0))
      >>> jse.filter_grad(lambda m: m(jnp.array(4)).sum())(emb).weight.indices
      Array([4], dtype=int32)
    """
    vg = filter_value_and_grad(fun, has_aux=has_aux, strict=strict)
    return autodiff.grad_from_value_and_grad(vg, fun, has_aux)
