"""``max_norm``: PyTorch's renormalisation of looked-up rows, functionally.

PyTorch's ``nn.Embedding(max_norm=m)`` (and ``F.embedding``,
``EmbeddingBag``) renormalises, before each lookup, every row the lookup reads
whose ``norm_type``-norm exceeds ``m``: ``row *= m / (norm + 1e-7)``, **in the
table, in place**, outside autograd. The lookup then reads the renormalised
rows, and the gradient is that of a plain lookup of them (the scaling is not
differentiated). (Keras' nearest counterpart is an
``embeddings_constraint=MaxNorm(m, axis=1)``, which rescales rows after each
update, every row of the table, with its own epsilon.)

JAX arrays are immutable, so jaxslices splits the two effects:

* **The lookup** (:func:`jaxslices.embedding_lookup`,
  :func:`jaxslices.embedding_bag` and the layers, with ``max_norm=m``)
  returns the renormalised rows (:func:`renorm_rows`) with PyTorch's gradient:
  the cotangent of each output row goes, unscaled, to its table row, so the
  table's gradient stays sparse.
* **The table** is renormalised by :func:`apply_max_norm` (PyTorch's
  in-place step: the rows the ids read that exceed ``m`` are scaled, the
  others untouched): a scatter of the touched rows only, in place and
  O(batch) under donation. Call it on the params with the step's ids first
  in the step (before the lookups, as PyTorch does; anywhere before the
  optimizer's update is exact too, but then the lookups need the old table
  and XLA keeps it with a whole-table copy, which
  :func:`jaxslices.table_copies` reports) and a step is PyTorch's step: the
  same outputs, gradients and new table
  (``tests/lib/test_padding_max_norm.py`` checks it against a NumPy model of
  PyTorch's documented behaviour, SGD and weight decay included).

Without it the outputs still never exceed ``max_norm``, but the optimizer
moves the un-renormalised rows, and the table drifts from PyTorch's.
The padding row (``padding_id``) is renormalised when looked up, as PyTorch
does (it gets no gradient, but ``max_norm`` is not a gradient).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from . import _coalesce, _ids
from .jagged import JaggedIds, check_jagged, segment_ids
from .kernels import _ops as kernel_ops
from .kernels import _path as kernel_path

__all__ = ["apply_max_norm", "check_max_norm", "renorm_rows"]

EPS = 1e-7
"""PyTorch's ``embedding_renorm_`` divides by ``norm + 1e-7``."""


def check_max_norm(max_norm: Any, norm_type: Any, where: str) -> None:
    """``max_norm`` a positive number (or ``None``), ``norm_type`` > 0."""
    if max_norm is None:
        return
    if (
        isinstance(max_norm, jax.core.Tracer)
        or not isinstance(max_norm, int | float)
        or isinstance(max_norm, bool)
        or not max_norm > 0
    ):
        raise ValueError(
            f"{where}: `max_norm` must be a positive Python number (or None), got "
            f"{max_norm!r}."
        )
    if not isinstance(norm_type, int | float) or not norm_type > 0:
        raise ValueError(
            f"{where}: `norm_type` must be a positive number (2.0 for the "
            f"Euclidean norm, math.inf for the largest entry), got {norm_type!r}."
        )


def _norms(rows: jax.Array, norm_type: float) -> jax.Array:
    """The ``norm_type``-norm of each row (``rows [N, ...]``), in float32 or wider."""
    flat = rows.reshape(rows.shape[0], math.prod(rows.shape[1:]))  # no -1: N may be 0
    x = jnp.abs(flat.astype(_coalesce.sum_dtype(rows.dtype)))
    if math.isinf(norm_type):
        return jnp.max(x, axis=1, initial=0)
    if norm_type == 2:
        return jnp.sqrt(jnp.sum(x * x, axis=1))
    if norm_type == 1:
        return jnp.sum(x, axis=1)
    return jnp.sum(x**norm_type, axis=1) ** (1 / norm_type)


def _scales(rows: jax.Array, max_norm: float, norm_type: float) -> jax.Array:
    """Per row: ``max_norm / (norm + 1e-7)`` where the norm exceeds it, else 1."""
    norms = _norms(rows, norm_type)
    return jnp.where(norms > max_norm, max_norm / (norms + EPS), 1.0)


def renorm_rows(
    rows: jax.Array, max_norm: float, *, norm_type: float = 2.0, row_ndim: int = 1
) -> jax.Array:
    """Rows renormalised as PyTorch's ``max_norm``, with a lookup's gradient.

    Each row (the trailing ``row_ndim`` axes of ``rows``: ``table.ndim - 1``
    for rows looked up from ``table``) whose ``norm_type``-norm exceeds
    ``max_norm`` is scaled by ``max_norm / (norm + 1e-7)``. The value is the
    renormalised rows; the gradient is the identity (the scaling is not
    differentiated, as in PyTorch, where it happens in place outside
    autograd), so a sparse gradient stays one unscaled row per id.

    Args:
      rows: ``[..., *row_shape]`` looked-up rows.
      max_norm: the largest norm a row may have.
      norm_type: the ``p`` of the p-norm (``math.inf``: largest entry).
      row_ndim: how many trailing axes make one row.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxslices.max_norm import renorm_rows
      >>> renorm_rows(jnp.array([[3.0, 4.0], [0.3, 0.4]]), 1.0)
      Array([[0.6, 0.8],
             [0.3, 0.4]], dtype=float32)
    """
    check_max_norm(max_norm, norm_type, "renorm_rows")
    lead = rows.shape[: rows.ndim - row_ndim]
    held = jax.lax.stop_gradient(rows).reshape((-1, *rows.shape[len(lead) :]))
    scale = _scales(held, max_norm, norm_type).astype(rows.dtype)
    scaled = (held * _coalesce.rows_where(scale, held.ndim)).reshape(rows.shape)
    # value: the scaled rows, exactly; gradient: the identity.
    return scaled + (rows - jax.lax.stop_gradient(rows))


def _max_norm_native(g, st, p, hp, cfg):
    """The kernel's rule on ``[K, R]`` rows (its XLA reference): rows scaled."""
    max_norm, norm_type = cfg
    (rows,) = st
    scale = _scales(rows, max_norm, norm_type)
    return g, (rows * scale[:, None],)


def apply_max_norm(
    table: ArrayLike,
    ids: ArrayLike | JaggedIds,
    max_norm: float,
    *,
    norm_type: float = 2.0,
) -> jax.Array:
    """The table with the rows ``ids`` read renormalised: PyTorch's in-place step.

    Every row that ``ids`` reads (out-of-range ids and the unused slots of
    jagged ids read nothing) and whose ``norm_type``-norm exceeds
    ``max_norm`` is scaled by ``max_norm / (norm + 1e-7)``, exactly as
    ``torch.embedding_renorm_`` does; every other row is unchanged. Only the
    rows that change are written (a scatter of at most one slot per id): in
    place, O(batch) work, when the table is donated to the jitted step. Apply
    it with the step's ids first in the step, before the lookups, and a step
    is PyTorch's step (see the module docstring).

    Args:
      table: the ``[V, ...]`` table.
      ids: the ids the step looks up: an integer array of any shape or a
        :class:`~jaxslices.JaggedIds`.
      max_norm: the largest norm a row may have.
      norm_type: the ``p`` of the p-norm (``math.inf``: largest entry).

    Returns:
      The new table (same shape and dtype).

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> table = jnp.array([[3.0, 4.0], [0.3, 0.4], [6.0, 8.0]])
      >>> jaxslices.apply_max_norm(table, jnp.array([0, 1, 0]), 1.0)  # not row 2
      Array([[0.6, 0.8],
             [0.3, 0.4],
             [6. , 8. ]], dtype=float32)
    """
    where = "jaxslices.apply_max_norm"
    if max_norm is None:
        raise ValueError(f"{where}: `max_norm` must be a positive number, got None.")
    check_max_norm(max_norm, norm_type, where)
    table = jnp.asarray(table)
    num_rows = table.shape[0]
    if isinstance(ids, JaggedIds):
        jagged = check_jagged(ids, where)
        flat = _ids.safe_ids(_ids.as_ids(jagged.values, where), num_rows)
        used = segment_ids(jagged.offsets, jagged.max_total) < jagged.num_bags
        flat = jnp.where(used, flat, num_rows)
    else:
        flat = _ids.safe_ids(_ids.as_ids(ids, where), num_rows).reshape(-1)
    if table.ndim >= 1 and kernel_path.route(where, table, flat):
        # One kernel: each distinct row read, renormalised in place if needed.
        hp = (max_norm, norm_type, EPS)
        spec = kernel_ops.RuleSpec(
            "max_norm",
            _max_norm_native,
            cfg=(float(max_norm), float(norm_type)),
        )
        new, *_ = kernel_ops.rowwise(
            kernel_ops.PooledGradient(
                jnp.zeros((1, math.prod(table.shape[1:])), table.dtype)
            ),
            flat,
            num_rows=num_rows,
            spec=spec,
            hp=hp,
            state=table,
            capacity=flat.shape[0],
            label=where,
        )
        return new
    uniq, _ = _coalesce.unique_with_inverse(flat, sentinel=num_rows)
    rows = table.at[uniq].get(mode="fill", fill_value=0)
    scale = _scales(rows, max_norm, norm_type)
    new = (rows * _coalesce.rows_where(scale, rows.ndim)).astype(table.dtype)
    # Rows within max_norm are not written (their slots go to V: dropped).
    target = jnp.where(scale != 1.0, uniq, jnp.asarray(num_rows, uniq.dtype))
    return table.at[target].set(new, mode="drop")
