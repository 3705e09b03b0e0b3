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

So the loss is traced three times per call (at trace time: under ``jax.jit``
this happens once per compilation, not per step). It must make the same
lookups each time it is traced.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _tape
from .slices import IndexedSlices

__all__ = ["value_and_grad", "grad"]


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


def _uses_only_stop_gradient(jaxpr: Any, var: Any) -> bool:
    """True if ``var`` feeds nothing but ``stop_gradient`` at top level."""
    if any(var is v for v in jaxpr.outvars):
        return False
    for eqn in jaxpr.eqns:
        if any(var is v for v in eqn.invars) and eqn.primitive.name != "stop_gradient":
            return False
    return True


def _pack(
    cts: list[jax.Array],
    ids: list[jax.Array],
    rows: list[jax.Array],
    shape: tuple[int, ...],
) -> IndexedSlices:
    """Concatenate the taps' cotangents and ids (already in ``[0, V]``).

    ``rows`` are the forward gathers of the table (zeros at padding slots).
    The values are made to depend on them: the padding slots' zeros are taken
    as ``0 * rows`` there. An in-place update of the table (donated params)
    then depends on every read of it through the lookups. Without that, a loss
    linear in the rows has a gradient that does not depend on them, nothing
    orders the gather before the scatter, and XLA copies the whole table to
    keep the gather's input alive (``lax.optimization_barrier`` with an unused
    output does not help: XLA drops it before copy insertion).
    """
    num_rows = shape[0]
    flat_ids = jnp.concatenate([i.reshape(-1) for i in ids])
    values = jnp.concatenate([r.reshape(-1, *shape[1:]) for r in cts])
    read = jnp.concatenate([r.reshape(-1, *shape[1:]) for r in rows])
    valid = flat_ids < num_rows  # padding slots (V) get zero values
    mask = valid.reshape(valid.shape + (1,) * (values.ndim - 1))
    values = jnp.where(mask, values, jnp.zeros((), values.dtype) * read)
    return IndexedSlices(values, flat_ids, shape)


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
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

    The loss is traced three times per call (discover, probe, differentiate);
    under ``jax.jit`` that cost is paid once per compilation.

    Args:
      fun: the loss; returns a scalar, or ``(scalar, aux)`` with ``has_aux``.
      argnums: which positional argument(s) to differentiate.
      has_aux: as in ``jax.value_and_grad``.

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
    """

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

        candidates = [
            k
            for k, x in enumerate(leaves)
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
        ]
        if not candidates:
            return dense_fallback()

        # 1. Discover lookups at the loss's top level.
        discover = _tape.Tape("discover", candidates=[])

        def discover_fn(*cands):
            values = list(leaves)
            for k, c in zip(candidates, cands, strict=True):
                values[k] = c
            discover.candidates = values
            with _tape.active(discover):
                call(values)

        jax.eval_shape(discover_fn, *[leaves[k] for k in candidates])
        looked_up = {r.leaf for r in discover.records}
        sparse = sorted((looked_up - discover.nested) & set(candidates))
        if not sparse:
            return dense_fallback()
        records = [r for r in discover.records if r.leaf in sparse]

        def run_tapped(replace, replacements, taps, sparse, records, sever):
            """Run the loss with some leaves replaced and sparse lookups tapped."""
            values = list(leaves)
            for k, v in zip(replace, replacements, strict=True):
                values[k] = v
            tape = _tape.Tape(
                "tap",
                candidates=values,
                sparse_leaves=frozenset(sparse),
                taps=list(taps),
                expected=records,
                sever=sever,
            )
            with _tape.active(tape):
                out = call(values)
            if tape.cursor != len(records):
                raise RuntimeError(_tape._NONDETERMINISTIC)
            return out, (tape.ids, tape.rows)

        # 2. Probe: is each table read any other way than through its taps?
        def probe_fn(tables, taps):
            out, _ = run_tapped(sparse, tables, taps, sparse, records, True)
            return out[0] if has_aux else out

        taps = [_tape.zeros_tap(r) for r in records]
        closed = jax.make_jaxpr(probe_fn)([leaves[k] for k in sparse], taps)
        table_vars = closed.jaxpr.invars[: len(sparse)]
        sparse = [
            k
            for k, var in zip(sparse, table_vars, strict=True)
            if _uses_only_stop_gradient(closed.jaxpr, var)
        ]
        if not sparse:
            return dense_fallback()
        records = [r for r in records if r.leaf in sparse]
        taps = [_tape.zeros_tap(r) for r in records]
        dense = [k for k in range(len(leaves)) if k not in sparse]

        # 3. Differentiate w.r.t. the dense leaves and the taps.
        def diff_fn(dense_values, taps):
            out, ids = run_tapped(dense, dense_values, taps, sparse, records, False)
            if has_aux:
                value, aux = out
                return value, (aux, ids)
            return out, (None, ids)

        (value, (aux, (ids, rows))), (g_dense, g_taps) = jax.value_and_grad(
            diff_fn, argnums=(0, 1), has_aux=True
        )([leaves[k] for k in dense], taps)

        grads: list[Any] = [None] * len(leaves)
        for k, g in zip(dense, g_dense, strict=True):
            grads[k] = g
        for k in sparse:
            mine = [j for j, r in enumerate(records) if r.leaf == k]
            grads[k] = _pack(
                [g_taps[j] for j in mine],
                [ids[j] for j in mine],
                [rows[j] for j in mine],
                leaves[k].shape,
            )
        per_arg = jax.tree.unflatten(treedef, grads)
        g = per_arg[0] if _is_index(argnums) else tuple(per_arg)
        return ((value, aux) if has_aux else value), g

    return wrapped


def grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """Like ``jax.grad``, with sparse gradients for embedding tables.

    See :func:`value_and_grad`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> loss = lambda t, i: jnp.sum(jaxslices.embedding_lookup(t, i) ** 2)
      >>> jaxslices.grad(loss)(jnp.ones((5, 2)), jnp.array([4, 4])).to_dense()[4]
      Array([4., 4.], dtype=float32)
    """
    vg = value_and_grad(fun, argnums, has_aux)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        (out, g) = vg(*args, **kwargs)
        return (g, out[1]) if has_aux else g

    return wrapped
