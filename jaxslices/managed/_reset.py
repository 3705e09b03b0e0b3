"""``reset_rows``: rows of a table, and their optimizer state, started afresh.

When a managed-collision table evicts an id, its slot goes to another id,
which must not inherit the old id's row nor its optimizer state (Adagrad's
accumulator, Adam's moments, momentum). :func:`reset_rows` writes fresh
values into those rows of the table and the optimizer's *initial* values
into the same rows of every state leaf that belongs to the table.

Which state leaves belong to the table, and what their initial rows are, is
asked of the optimizer itself: ``optimizer.init`` is called on the params
with the table replaced by the ``E`` fresh rows, so every state leaf built
from the table comes out with ``E`` rows, in any layout a transform uses
(``[S, D]`` like the table, row-wise ``[S]``, packed ``[S, k, D]``), with the
optimizer's own initial values (Adagrad's ``initial_accumulator_value``, not
zeros). A leaf whose shape does not follow the table's rows (a step count,
the state of other params) is left as it is. This holds for the jaxslices
transforms and for stock Optax ones alike. Under ``jit`` the ``init`` of the
other params is dead code; eagerly it is computed and dropped.

Sparse buffers in a state (:class:`jaxslices.MultiSteps`' accumulated
gradients) are left alone: an accumulated gradient of an evicted row is
applied to the row's new id at the end of the accumulation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._leaves import is_leaf

__all__ = ["reset_rows"]


def _find(params: Any, where: Callable[[Any], Any], name: str) -> tuple[list, Any, int]:
    leaves, treedef = jax.tree_util.tree_flatten(params, is_leaf=is_leaf)
    target = where(params)
    hits = [i for i, leaf in enumerate(leaves) if leaf is target]
    if len(hits) != 1:
        raise ValueError(
            f"{name}: `where(params)` must return one leaf of `params` (the "
            f"table), e.g. where=lambda p: p['emb']; it returned "
            f"{type(target).__name__}, found {len(hits)} times among the leaves."
        )
    return leaves, treedef, hits[0]


def reset_rows(
    params: Any,
    opt_state: Any,
    rows: Any,
    new_rows: Any,
    *,
    where: Callable[[Any], Any],
    optimizer: Any = None,
) -> tuple[Any, Any]:
    """Re-initialise ``rows`` of one table in ``params`` and in ``opt_state``.

    Args:
      params: the params tree that holds the table.
      opt_state: ``optimizer.init(params)``'s state, or ``None``.
      rows: integer ``[E]``, the rows to reset; entries outside ``[0, V)``
        (the ``V`` of an eviction's unused entries) are ignored.
      new_rows: the rows' fresh values, ``[E, *row]`` or broadcastable to it
        (e.g. ``0.0``, or an initializer's output).
      where: ``params -> table`` (the leaf, as ``equinox.tree_at``'s
        ``where``).
      optimizer: the ``optax.GradientTransformation`` whose state
        ``opt_state`` is (jaxslices or Optax); ``None`` resets the table only.

    Returns:
      ``(params, opt_state)`` with those rows reset.

    Raises:
      TypeError: ``rows`` not integers.
      ValueError: ``where`` does not pick a leaf, ``opt_state`` is not the
        optimizer's state for ``params``, or a state leaf built from the
        table does not keep the table's rows on its first axis.

    Example:
      >>> import jax.numpy as jnp, jaxslices as js
      >>> params = {"emb": jnp.ones((4, 2))}
      >>> opt = js.adagrad(0.1, initial_accumulator_value=0.5)
      >>> state = opt.init(params)
      >>> params, state = js.reset_rows(params, state, jnp.array([1, 4]), 0.0,
      ...                               where=lambda p: p["emb"], optimizer=opt)
      >>> params["emb"][:, 0].tolist()
      [1.0, 0.0, 1.0, 1.0]
    """
    name = "jaxslices.reset_rows"
    rows = jnp.asarray(rows)
    if not jnp.issubdtype(rows.dtype, jnp.integer) or rows.ndim != 1:
        raise TypeError(
            f"{name}: `rows` must be a 1-D integer array (the slots an eviction "
            f"returned), got {rows.dtype}{list(rows.shape)}."
        )
    leaves, treedef, i = _find(params, where, name)
    table = jnp.asarray(leaves[i])
    V, E = table.shape[0], rows.shape[0]
    rows = jnp.where((rows < 0) | (rows >= V), V, rows)  # out of range: dropped
    fresh_rows = jnp.broadcast_to(
        jnp.asarray(new_rows, table.dtype), (E, *table.shape[1:])
    )
    leaves = list(leaves)

    def reset(table, opt_state):
        leaves[i] = table.at[rows].set(fresh_rows, mode="drop")
        if optimizer is None or opt_state is None or E == 0:
            return leaves[i], opt_state
        return leaves[i], _reset_state(
            optimizer, opt_state, leaves, treedef, i, rows, fresh_rows, V, name
        )

    # A step that evicted nothing skips the E-row scatters (a lax.cond: the
    # table and its state pass through in place).
    leaves[i], opt_state = jax.lax.cond(
        jnp.any(rows < V), reset, lambda t, s: (t, s), table, opt_state
    )
    return jax.tree_util.tree_unflatten(treedef, leaves), opt_state


def _reset_state(optimizer, opt_state, leaves, treedef, i, rows, fresh_rows, V, name):
    def params_with(table_like):
        swapped = list(leaves)
        swapped[i] = table_like
        return jax.tree_util.tree_unflatten(treedef, swapped)

    E = fresh_rows.shape[0]
    fresh = optimizer.init(params_with(fresh_rows))
    other = jax.ShapeDtypeStruct((E + 1, *fresh_rows.shape[1:]), fresh_rows.dtype)
    probe = jax.eval_shape(optimizer.init, params_with(other))
    state_leaves, state_def = jax.tree_util.tree_flatten(opt_state, is_leaf=is_leaf)
    fresh_leaves, fresh_def = jax.tree_util.tree_flatten(fresh, is_leaf=is_leaf)
    probe_leaves = jax.tree_util.tree_leaves(probe, is_leaf=is_leaf)
    if state_def != fresh_def:
        raise ValueError(
            f"{name}: `opt_state` is not the state of `optimizer` for `params`: "
            f"its structure {state_def} differs from optimizer.init(params)'s "
            f"{fresh_def}."
        )
    out = []
    for k, (full, new, probed) in enumerate(
        zip(state_leaves, fresh_leaves, probe_leaves, strict=True)
    ):
        shape = getattr(new, "shape", None)
        if shape is None or shape == getattr(probed, "shape", None):
            out.append(full)  # not built from the table's rows
            continue
        full = jnp.asarray(full)
        if shape[0] != E or full.shape != (V, *shape[1:]):
            raise ValueError(
                f"{name}: state leaf {k} is built from the table but is "
                f"{full.dtype}{list(full.shape)}, and the optimizer makes "
                f"{list(shape)} for {E} rows: only states that keep the table's "
                f"{V} rows on their first axis can be reset."
            )
        out.append(full.at[rows].set(new.astype(full.dtype), mode="drop"))
    return jax.tree_util.tree_unflatten(state_def, out)
