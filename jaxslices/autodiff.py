"""``value_and_grad`` and ``grad`` whose gradients hold ``IndexedSlices`` leaves.

JAX requires a ``custom_vjp`` backward rule to return a cotangent of exactly
the primal's shape, so no rule can hand back a row-sparse gradient for a
``(V, D)`` table. These wrappers get it anyway, with "taps" (see
``docs/sparse_gradients.md``):

1. **Discover** (``jax.eval_shape``): trace the loss once and record which
   parameter leaves are read by :func:`~jaxslices.embedding_lookup` at the
   loss's top level, and with which id shapes.
2. **Probe** (``jax.make_jaxpr``): trace the loss again with every recorded
   lookup rewritten as ``stop_gradient(table)[ids] + tap``. A table whose
   variable feeds anything but ``stop_gradient`` in that jaxpr is also read
   some other way (tied weights, transformed before the lookup, looked up
   inside ``scan``/``cond``/an inner ``jit``/``checkpoint``): it falls back to
   JAX's dense gradient, which is always correct. Lookups under ``jax.vmap``
   (nested too) are moved to the top level and stay sparse.
3. **Differentiate** ``jax.value_and_grad`` with respect to the dense leaves and
   the taps, never the sparse tables, with each lookup read as
   ``table[ids] + tap``: the cotangent of each tap is exactly the rows'
   gradient, which is packed with the ids into an ``IndexedSlices``. The table
   is a constant to this inner differentiation but not to an outer one, so
   ``jax.grad``/``jax.jvp`` on top of these wrappers (gradient penalties, MAML,
   Hessians) is what it is on top of ``jax.value_and_grad``.

So the loss is traced three times per call when a table gets a sparse
gradient, and two or three times when every table falls back to dense
(discover, the probe if there was a lookup, then ``jax.value_and_grad``); a
loss with no float leaf to differentiate is traced once. This is at trace
time: under ``jax.jit`` it happens once per compilation, not per step. The
loss must make the same lookups each time it is traced.

The mechanism lives in ``jaxslices/_tape.py`` (the tap backend), which this
module uses through four functions: ``discover``, ``probe``, ``run`` and
``pack``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _strict, _tape

__all__ = ["value_and_grad", "grad", "differentiate"]


def _argnums_tuple(argnums: int | Sequence[int], nargs: int) -> tuple[int, ...]:
    """Positive argnums; NumPy integers accepted, as ``jax.value_and_grad`` does."""
    nums = (argnums,) if _is_index(argnums) else tuple(argnums)
    for i in nums:
        if not _is_index(i) or not -nargs <= operator.index(i) < nargs:
            raise ValueError(
                f"jaxslices.value_and_grad: argnums {argnums!r} out of range for a "
                f"call with {nargs} positional arguments."
            )
    return tuple(operator.index(i) % nargs for i in nums)


def _is_index(x: Any) -> bool:
    try:
        operator.index(x)
    except TypeError:
        return False
    return not isinstance(x, bool)


def _as_jax(x: Any) -> Any:
    """NumPy leaves become JAX arrays (as ``jax.value_and_grad`` would see them).

    The lookups recognise a table by identity with its leaf, and a NumPy table
    has no ``.at``: converting once here serves both.
    """
    return jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    strict: bool = False,
) -> Callable[..., Any]:
    """Like ``jax.value_and_grad``, with sparse gradients for embedding tables.

    A parameter leaf that the loss reads only through
    :func:`~jaxslices.embedding_lookup` / :func:`~jaxslices.embedding_bag` gets
    an :class:`~jaxslices.IndexedSlices` gradient: one row per looked-up id
    (several lookups of one table concatenate; ids repeat as they did in the
    batch; out-of-range ids are padding). Every other leaf gets exactly what
    ``jax.value_and_grad`` gives, and so does a table that is also read any other
    way (tied weights, transformed before the lookup, looked up inside ``scan``,
    ``cond``, an inner ``jit`` or ``checkpoint``). Lookups under ``jax.vmap``,
    nested or not (Equinox-style per-example code), stay sparse.

    ``strict=True`` turns those silent dense gradients into a
    :class:`jaxslices.DenseGradientError` at trace time, naming each table
    (a float leaf that is looked up or read by indexing, ``table[ids]``), why
    its gradient would be dense (read by indexing, cast before its lookup,
    also used another way, looked up inside ``scan``) and the fix. It costs
    one more trace when no table is sparse, none otherwise.

    The loss is traced three times per call (discover, probe, differentiate;
    two or three when everything falls back to dense); under ``jax.jit`` that
    cost is paid once per compilation. Any JAX transformation on top of this
    function (``jax.grad`` of the value, ``jax.jvp``, a gradient penalty, MAML)
    gives what it gives on top of ``jax.value_and_grad``. Tracing is
    thread-safe.

    Args:
      fun: the loss; returns a scalar, or ``(scalar, aux)`` with ``has_aux``.
      argnums: which positional argument(s) to differentiate.
      has_aux: as in ``jax.value_and_grad``.
      strict: raise instead of giving a table a dense gradient.

    Returns:
      A function returning ``(value, grads)`` or ``((value, aux), grads)``.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> def loss(params, ids):
      ...     rows = jaxslices.embedding_lookup(params["emb"], ids)
      ...     return jnp.sum(rows @ params["w"])
      >>> params = {"emb": jnp.ones((10, 4)), "w": jnp.ones(4)}
      >>> value, grads = jaxslices.value_and_grad(loss)(params, jnp.array([6, 1, 1]))
      >>> grads["emb"]
      IndexedSlices(float32[10, 4], rows=3)
      >>> grads["emb"].indices
      Array([6, 1, 1], dtype=int32)
      >>> dense = lambda params, ids: jnp.sum(params["emb"][ids] @ params["w"])
      >>> jaxslices.value_and_grad(dense, strict=True)(params, jnp.array([6]))
      Traceback (most recent call last):
      ...
      jaxslices.DenseGradientError: jaxslices.value_and_grad(strict=True): 1 table ...
        * argument 0['emb'] (shape (10, 4)): it is read by indexing (`gather`: ...
    """
    return differentiate(fun, argnums, has_aux, strict, "jaxslices.value_and_grad")


def differentiate(
    fun: Callable[..., Any],
    argnums: int | Sequence[int],
    has_aux: bool,
    strict: bool,
    where: str,
    label: Callable[[int, str], str] | None = None,
) -> Callable[..., Any]:
    """:func:`value_and_grad`, as every jaxslices gradient function calls it.

    ``where`` names the caller's function in strict mode's messages, and
    ``label(argnum, keystr)`` a differentiated leaf (default: ``argument 0['emb']``).
    """
    label = label or (lambda i, path: f"argument {i}{path}")

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nums = _argnums_tuple(argnums, len(args))
        leaves, treedef = jax.tree.flatten([args[i] for i in nums])
        leaves = [_as_jax(x) for x in leaves]

        def call(leaf_values: Sequence[Any]) -> Any:
            new_args = list(args)
            for i, a in zip(
                nums, jax.tree.unflatten(treedef, list(leaf_values)), strict=True
            ):
                new_args[i] = a
            return fun(*new_args, **kwargs)

        def dense_fallback():
            single = nums[0] if _is_index(argnums) else nums
            return jax.value_and_grad(fun, single, has_aux)(*args, **kwargs)

        others = jax.tree.leaves(
            ([a for i, a in enumerate(args) if i not in nums], kwargs)
        )
        lookups = _tape.discover(call, leaves, others)
        watch = [k for k, x in enumerate(leaves) if _is_float(x)] if strict else ()
        lookups = _tape.probe(call, leaves, lookups, has_aux, watch=watch)
        if strict:
            _strict.raise_if_dense(
                where,
                _labels(args, nums, label),
                [tuple(jnp.shape(x)) for x in leaves],
                lookups.nested,
                lookups.looked_up,
                lookups.uses,
            )
        with _strict.differentiating(strict, where):
            if not lookups.sparse:
                return dense_fallback()
            (value, aux), g_dense, tapped = _tape.run(call, leaves, lookups, has_aux)
        grads = {**g_dense, **_tape.pack(lookups, tapped, leaves)}
        per_arg = jax.tree.unflatten(treedef, [grads[k] for k in range(len(leaves))])
        g = per_arg[0] if _is_index(argnums) else tuple(per_arg)
        return ((value, aux) if has_aux else value), g

    return wrapped


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _labels(args: tuple, nums: tuple[int, ...], label: Callable) -> list[str]:
    """A name for each differentiated leaf, in ``jax.tree.flatten`` order."""
    out = []
    for i in nums:
        for path, _ in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            out.append(label(i, jax.tree_util.keystr(path)))
    return out


def grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    strict: bool = False,
) -> Callable[..., Any]:
    """Like ``jax.grad``, with sparse gradients for embedding tables.

    See :func:`value_and_grad` (``strict`` included).

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> loss = lambda t, i: jnp.sum(jaxslices.embedding_lookup(t, i) ** 2)
      >>> jaxslices.grad(loss)(jnp.ones((5, 2)), jnp.array([4, 4])).to_dense()[4]
      Array([4., 4.], dtype=float32)
    """
    vg = value_and_grad(fun, argnums, has_aux, strict=strict)
    return grad_from_value_and_grad(vg, fun, has_aux)


def grad_from_value_and_grad(
    vg: Callable[..., Any], fun: Callable[..., Any], has_aux: bool
) -> Callable[..., Any]:
    """The ``grad`` of a ``value_and_grad``: returns ``grads`` or ``(grads, aux)``.

    The one way every ``grad`` of jaxslices is made (:func:`grad`,
    ``jaxslices.nnx.grad``, ``jaxslices.equinox.filter_grad``), as JAX makes
    ``jax.grad`` from ``jax.value_and_grad``; ``fun`` gives the name and
    docstring (``functools.wraps``).
    """

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out, g = vg(*args, **kwargs)
        return (g, out[1]) if has_aux else g

    return wrapped
