"""Embedding lookups whose gradient ``jaxslices.value_and_grad`` makes sparse.

Ids policy (forward and backward agree): an id outside ``[0, V)`` (negative or
``>= V``, with ``V = table.shape[0]``) reads a row of zeros and receives no
gradient; in a sparse gradient its slot is padding (index ``V``). JAX's own
``table[ids]`` would instead clamp out-of-range ids to the last row and wrap
negative ones from the end, reading (and training) rows nobody asked for. Pass
``check_ids=True`` to raise an error instead, also under ``jax.jit``.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from . import _tape

__all__ = ["embedding_lookup", "embedding_bag", "check_ids"]


def _safe_ids(ids: jax.Array, num_rows: int) -> jax.Array:
    ids = ids.astype(jnp.int32 if num_rows < np.iinfo(np.int32).max else jnp.int64)
    return jnp.where((ids >= 0) & (ids < num_rows), ids, num_rows)


def _gather(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]`` with invalid ids reading zeros (no clamping, no wrapping)."""
    return table.at[_safe_ids(ids, table.shape[0])].get(mode="fill", fill_value=0)


@jax.custom_vjp
def _lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    return _gather(table, ids)


def _lookup_fwd(table, ids):
    # The table itself is a residual only to carry its (static) shape and dtype;
    # XLA does not copy it.
    return _gather(table, ids), (table, ids)


def _lookup_bwd(res, ct):
    table, ids = res
    grad = jnp.zeros(table.shape, ct.dtype)
    grad = grad.at[_safe_ids(ids, table.shape[0])].add(ct, mode="drop")
    return grad.astype(table.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def _raise_bad_ids(bad: np.ndarray, lo: np.ndarray, hi: np.ndarray, num_rows: int):
    if bool(bad):
        raise ValueError(
            f"embedding_lookup(check_ids=True): ids must be in [0, {num_rows}) for a "
            f"table with {num_rows} rows, got ids with min {int(lo)} and max "
            f"{int(hi)}. Out-of-range ids would read zeros and get no gradient."
        )


def check_ids(ids: jax.Array, num_rows: int) -> None:
    """Raise ``ValueError``, also under ``jit``, for an id outside ``[0, num_rows)``.

    Under ``jit`` the error surfaces when the result is computed (a host
    callback raises it), wrapped in JAX's runtime error with this message.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> jaxslices.check_ids(jnp.array([0, 4]), num_rows=5)  # fine
    """
    ids = jnp.asarray(ids)
    if ids.size == 0:
        return
    bad = jnp.any((ids < 0) | (ids >= num_rows))
    jax.debug.callback(
        _raise_bad_ids, bad, jnp.min(ids), jnp.max(ids), num_rows, ordered=False
    )


_check_ids = check_ids


def _check_lookup_args(table: Any, ids: Any, where: str) -> tuple[Any, jax.Array]:
    if not hasattr(table, "shape") or not hasattr(table, "dtype"):
        table = jnp.asarray(table)
    if table.ndim < 1:
        raise ValueError(
            f"{where}: `table` must have at least one dimension (rows), got a "
            f"scalar of shape {tuple(table.shape)}."
        )
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(
            f"{where}: `ids` must be integers, got {jnp.dtype(ids.dtype).name}"
            f"{list(ids.shape)}. Cast them, e.g. `ids.astype(jnp.int32)`."
        )
    return table, ids


def embedding_lookup(
    table: jax.Array,
    ids: jax.Array,
    *,
    dtype: Any = None,
    check_ids: bool = False,
) -> jax.Array:
    """Look up rows: ``table[ids]``, of shape ``ids.shape + table.shape[1:]``.

    Under :func:`jaxslices.value_and_grad`, a table read only through this
    function gets an :class:`~jaxslices.IndexedSlices` gradient holding one row
    per id. Under plain ``jax.grad`` the gradient is JAX's ordinary dense one
    (the lookup is a ``jax.custom_vjp``, so forward-mode ``jax.jvp`` is not
    supported through it).

    Args:
      table: ``[V, ...]`` array.
      ids: integer array of any shape. Ids outside ``[0, V)`` read zeros and
        get no gradient (see the module docstring for the policy).
      dtype: if given, cast the gathered rows to it (after the gather, so a
        bf16 compute path keeps the sparse gradient, in the table's dtype).
      check_ids: raise an error (also under ``jit``) if an id is out of range.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> table = jnp.arange(8.0).reshape(4, 2)
      >>> jaxslices.embedding_lookup(table, jnp.array([[3, 0]]))
      Array([[[6., 7.],
              [0., 1.]]], dtype=float32)
    """
    table, ids = _check_lookup_args(table, ids, "embedding_lookup")
    if check_ids:
        _check_ids(ids, table.shape[0])
    native = getattr(table, "_jaxslices_native_lookup", None)  # a native.mark-ed table
    if native is not None:
        return native(table, ids, dtype=dtype)
    tape = _tape.current()
    out = tape.lookup(table, ids, _gather) if tape is not None else None
    if out is None:
        out = _lookup(table, ids)
    if dtype is not None:
        out = out.astype(dtype)
    return out


_COMBINERS = ("mean", "sum", "sqrtn")


def embedding_bag(
    table: jax.Array,
    ids: jax.Array,
    *,
    weights: jax.Array | None = None,
    combiner: Literal["mean", "sum", "sqrtn"] = "mean",
    padding_id: int | None = None,
    dtype: Any = None,
    check_ids: bool = False,
) -> jax.Array:
    """Look up and reduce bags of ids over the last axis of ``ids``.

    Like ``tf.nn.embedding_lookup_sparse`` and ``torch.nn.EmbeddingBag`` on a
    dense ``[..., L]`` id array. With weights ``w`` (ones if ``None``) and rows
    ``r``: ``"sum"`` is ``Σ w·r``, ``"mean"`` is ``Σ w·r / Σ w`` and ``"sqrtn"``
    is ``Σ w·r / sqrt(Σ w²)``. Ids equal to ``padding_id`` contribute nothing,
    forward or backward (their slots become padding in a sparse gradient). A
    bag with nothing in it gives zeros, not NaN. The table's gradient under
    :func:`jaxslices.value_and_grad` is sparse, as for :func:`embedding_lookup`.

    Args:
      table: ``[V, ...]`` array.
      ids: integer ``[..., L]`` array of bags of length ``L``.
      weights: optional ``[..., L]`` per-id weights.
      combiner: ``"mean"``, ``"sum"`` or ``"sqrtn"``.
      padding_id: id that marks an empty slot in a bag.
      dtype: cast the looked-up rows to this dtype.
      check_ids: raise if a (non-padding) id is out of range.

    Returns:
      ``ids.shape[:-1] + table.shape[1:]``.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> table = jnp.array([[1.0], [3.0], [5.0]])
      >>> jaxslices.embedding_bag(table, jnp.array([[0, 2, 9]]), padding_id=9)
      Array([[3.]], dtype=float32)
    """
    table, ids = _check_lookup_args(table, ids, "embedding_bag")
    if combiner not in _COMBINERS:
        raise ValueError(
            f"embedding_bag: `combiner` must be one of {_COMBINERS}, got {combiner!r}."
        )
    if ids.ndim < 1:
        raise ValueError(
            "embedding_bag: `ids` must have at least one axis (the bag), got a "
            "scalar. Use embedding_lookup for single ids."
        )
    if weights is not None:
        weights = jnp.asarray(weights)
        if weights.shape != ids.shape:
            raise ValueError(
                "embedding_bag: `weights` must have the shape of `ids` "
                f"{tuple(ids.shape)}, got {tuple(weights.shape)}."
            )
    num_rows = table.shape[0]
    if padding_id is not None:
        present = ids != padding_id
        # Padding reads zeros and gets no gradient: send it out of range.
        ids = jnp.where(present, _safe_ids(ids, num_rows), num_rows)
    else:
        present = jnp.ones(ids.shape, bool)
    if check_ids:
        _check_ids(jnp.where(present, ids, 0), num_rows)
    rows = embedding_lookup(table, ids, dtype=dtype)
    compute = rows.dtype
    w = present.astype(compute)
    if weights is not None:
        w = w * weights.astype(compute)
    w_rows = w.reshape(w.shape + (1,) * (rows.ndim - w.ndim))
    total = jnp.sum(rows * w_rows, axis=ids.ndim - 1)
    if combiner == "sum":
        return total
    denom = jnp.sum(w, axis=-1) if combiner == "mean" else jnp.sqrt(jnp.sum(w * w, -1))
    safe = jnp.where(denom == 0, jnp.ones((), compute), denom)
    scale = jnp.where(denom == 0, jnp.zeros((), compute), 1 / safe)
    return total * scale.reshape(scale.shape + (1,) * (total.ndim - scale.ndim))
