"""Embedding lookups whose gradient ``jaxslices.value_and_grad`` makes sparse.

Ids policy (forward and backward agree; written once, in
:mod:`jaxslices._ids`): an id outside ``[0, V)`` (negative or ``>= V``, with
``V = table.shape[0]``) reads a row of zeros and receives no gradient; in a
sparse gradient its slot is padding (index ``V``). JAX's own ``table[ids]``
would instead clamp out-of-range ids to the last row and wrap negative ones
from the end, reading (and training) rows nobody asked for. Ids of any integer
dtype are range-checked in their own dtype before being cast to the index
dtype (``int32``, ``int64`` for tables of ``2**31`` rows or more). In a bag
(:func:`embedding_bag`) an out-of-range id is padding, like ``padding_id``:
it adds nothing, is not counted by ``"mean"`` / ``"sqrtn"`` and is no
candidate for ``"max"`` (:func:`jaxslices._ids.in_bags`, the one rule of
every pooled lookup).

Pass ``check_ids=True`` (or call :func:`check_ids`) to raise an error instead.
The message names the function you called and gives how many of your ids are
out of range and their min and max (your ids as passed: for
:func:`embedding_bag`, the non-padding ones). What to catch:

* concrete ids (NumPy arrays, lists, JAX arrays outside any transformation):
  ``ValueError``, raised at the call;
* traced ids (under ``jax.jit``, and other transformations that trace the ids):
  the check runs on the device (:func:`jaxslices._errors.raise_if`, on every
  device of a mesh) and JAX raises ``jax.errors.JaxRuntimeError`` (a
  ``ValueError`` on later calls of the compiled step) with the message, on
  every process, when the result is computed: catch both around the jitted
  call and ``jax.block_until_ready`` of its result.

Lookups consult the lookup handlers (:mod:`jaxslices._lookup_handlers`) first:
a table type of the opt-in native backend is looked up by its own handler.
Plain arrays go to the tap backend of :func:`jaxslices.value_and_grad`
(:mod:`jaxslices._tape`), or, outside it, to a lookup with JAX's dense
gradient.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from . import _ids, _lookup_handlers, _strict, _tape
from ._ids import check_ids
from .jagged import JaggedIds, check_jagged, segment_ids, weights_like
from .kernels import _ops as kernel_ops
from .kernels import _path as kernel_path
from .max_norm import check_max_norm, renorm_rows

__all__ = ["embedding_lookup", "embedding_bag", "check_ids"]


def _gather(table: jax.Array, safe_ids: jax.Array) -> jax.Array:
    """``table[ids]`` for safe ids (:func:`jaxslices._ids.safe_ids`): V reads 0."""
    return table.at[safe_ids].get(mode="fill", fill_value=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table: jax.Array, ids: jax.Array, strict: bool) -> jax.Array:
    return _gather(table, ids)


def _lookup_fwd(table, ids, strict):
    # JAX runs this rule only when it differentiates the table, densely: in
    # strict mode that is an error (jaxslices/_strict.py).
    _strict.on_dense_lookup(table.shape, strict)
    # The table itself is a residual only to carry its (static) shape and dtype;
    # XLA does not copy it.
    return _gather(table, ids), (table, ids)


def _lookup_bwd(strict, res, ct):
    table, ids = res
    # The gather's own transpose (a scatter-add into zeros, padding dropped),
    # taken by JAX: inside shard_map(check_vma=True) with ids varying over
    # axes the table does not, JAX also sums it over those axes, as the
    # cotangent of the (invariant) table must be.
    (grad,) = jax.linear_transpose(lambda t: _gather(t, ids), table)(ct)
    return grad, None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def _prepare(table: Any, ids: Any, where: str) -> tuple[Any, Any, int, Any]:
    """Validate the arguments: ``(table, ids, num_rows, handler)``.

    LOOKUP HANDLERS: a handler registered in :mod:`jaxslices._lookup_handlers`
    (e.g. the opt-in native backend's table type) may claim ``table``; its
    ``lookup`` then replaces the default path in :func:`_lookup_rows`. This
    is the one place where lookups consult the handlers.
    """
    handler = _lookup_handlers.handler_for(table)
    if handler is not None:
        return table, _ids.as_ids(ids, where), int(handler.num_rows(table)), handler
    if not isinstance(table, jax.Array):  # NumPy arrays, lists
        table = jnp.asarray(table)
    if table.ndim < 1:
        raise ValueError(
            f"{where}: `table` must have at least one dimension (rows), got a "
            f"scalar of shape {tuple(table.shape)}."
        )
    return table, _ids.as_ids(ids, where), table.shape[0], None


def embedding_lookup(
    table: jax.Array,
    ids: jax.Array,
    *,
    dtype: Any = None,
    check_ids: bool = False,
    padding_id: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    strict: bool = False,
) -> jax.Array:
    """Look up rows: ``table[ids]``, of shape ``ids.shape + table.shape[1:]``.

    Under :func:`jaxslices.value_and_grad`, a table read only through this
    function gets an :class:`~jaxslices.IndexedSlices` gradient holding one row
    per id. Under plain ``jax.grad`` the gradient is JAX's ordinary dense one
    (the lookup is a ``jax.custom_vjp``, so forward-mode ``jax.jvp`` is not
    supported through it).

    ``padding_id`` and ``max_norm`` are ``torch.nn.functional.embedding``'s
    ``padding_idx`` and ``max_norm``: the padding row is read as it is but
    gets no gradient (its slots are padding in a sparse gradient, so no
    optimizer ever touches it); with ``max_norm`` every row read whose norm
    exceeds it is returned renormalised, with PyTorch's (unscaled) gradient.
    PyTorch also renormalises those rows in the table, in place: here that is
    :func:`jaxslices.apply_max_norm`, a row-sparse scatter to run first in the
    training step (see :mod:`jaxslices.max_norm`).

    Args:
      table: ``[V, ...]`` array.
      ids: integer array of any shape. Ids outside ``[0, V)`` read zeros and
        get no gradient (see the module docstring for the policy).
      dtype: if given, cast the gathered rows to it (after the gather, so a
        bf16 compute path keeps the sparse gradient, in the table's dtype).
      check_ids: raise an error (also under ``jit``) if an id is out of range.
      padding_id: a row id (in ``[0, V)``; other values are out of range
        anyway) whose row is read but never gets a gradient.
      max_norm: renormalise rows whose norm exceeds it (PyTorch's rule:
        ``row * max_norm / (norm + 1e-7)``).
      norm_type: the ``p`` of the p-norm for ``max_norm``.
      strict: raise :class:`jaxslices.DenseGradientError` at trace time if
        the table would get a dense gradient (JAX's own ``jax.grad``, or a
        jaxslices gradient function that falls back to dense): see
        :mod:`jaxslices._strict`.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> table = jnp.arange(8.0).reshape(4, 2)
      >>> jaxslices.embedding_lookup(table, jnp.array([[3, 0]]))
      Array([[[6., 7.],
              [0., 1.]]], dtype=float32)
      >>> jaxslices.grad(lambda t: jaxslices.embedding_lookup(
      ...     t, jnp.array([3, 0, 0]), padding_id=0).sum())(table).indices
      Array([3, 4, 4], dtype=int32)
    """
    where = "embedding_lookup"
    table, ids, num_rows, handler = _prepare(table, ids, where)
    check_max_norm(max_norm, norm_type, where)
    if check_ids:
        ids = _ids.raise_if_out_of_range(
            ids, num_rows, f"{where}(check_ids=True)", like=(table,)
        )
    safe = _ids.safe_ids(ids, num_rows)
    pad_row = _padding_row(padding_id, num_rows, where)
    if pad_row is None:
        rows = _lookup_rows(table, safe, handler, strict)
    else:
        if handler is not None:
            raise ValueError(
                f"{where}: `padding_id` is not supported for a table of the native "
                "backend; use an array table, or embedding_bag(padding_id=...), "
                "which drops padding ids from the bags."
            )
        # Padding slots are looked up as padding (no gradient, never updated)
        # and read the padding row through stop_gradient.
        is_pad = safe == pad_row
        padded = jnp.where(is_pad, num_rows, safe)
        rows = _lookup_rows(table, padded, handler, strict)
        held = jax.lax.stop_gradient(table)[pad_row]
        rows = jnp.where(is_pad.reshape(is_pad.shape + (1,) * held.ndim), held, rows)
    return _finish(rows, table, max_norm, norm_type, dtype)


def _padding_row(padding_id: Any, num_rows: int, where: str) -> int | None:
    """``padding_id`` if it names a row (an int in ``[0, V)``), else ``None``."""
    if padding_id is None:
        return None
    if isinstance(padding_id, jax.core.Tracer) or not isinstance(
        padding_id, int | np.integer
    ):
        raise TypeError(
            f"{where}: `padding_id` must be a Python int (static), got {padding_id!r}."
        )
    return int(padding_id) if 0 <= padding_id < num_rows else None


def _lookup_rows(table: Any, safe_ids: jax.Array, handler: Any, strict: bool) -> Any:
    """The lookup proper, on ids from :func:`jaxslices._ids.safe_ids`.

    A claimed table goes to its handler; an array to the tap backend
    (active under ``value_and_grad``, else ``None``), then the plain lookup.
    """
    if handler is not None:
        return handler.lookup(table, safe_ids)
    out = _tape.lookup(table, safe_ids, _gather)
    return _lookup(table, safe_ids, bool(strict)) if out is None else out


def _finish(rows: Any, table: Any, max_norm: Any, norm_type: Any, dtype: Any) -> Any:
    """``max_norm`` (in the table's dtype, as PyTorch), then the ``dtype`` cast."""
    if max_norm is not None:
        row_ndim = len(jnp.shape(table)) - 1
        rows = renorm_rows(rows, max_norm, norm_type=norm_type, row_ndim=row_ndim)
    return rows if dtype is None else rows.astype(dtype)


_COMBINERS = ("mean", "sum", "sqrtn", "max")


def embedding_bag(
    table: jax.Array,
    ids: jax.Array | JaggedIds,
    *,
    weights: jax.Array | None = None,
    combiner: Literal["mean", "sum", "sqrtn", "max"] = "mean",
    padding_id: int | None = None,
    dtype: Any = None,
    check_ids: bool = False,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    strict: bool = False,
) -> jax.Array:
    """Look up and reduce bags of ids: padded ``[..., L]`` or jagged.

    Like ``tf.nn.embedding_lookup_sparse`` and ``torch.nn.EmbeddingBag``. The
    bags are either the last axis of a dense ``[..., L]`` id array, or the bags
    of a :class:`~jaxslices.JaggedIds` (flat ids plus offsets, as
    ``EmbeddingBag(input, offsets)``; see :mod:`jaxslices.jagged`). With
    weights ``w`` (ones if ``None``) and rows ``r``: ``"sum"`` is ``Σ w·r``,
    ``"mean"`` is ``Σ w·r / Σ w`` and ``"sqrtn"`` is ``Σ w·r / sqrt(Σ w²)``.
    ``"max"`` is PyTorch's ``mode="max"``: the elementwise max of the bag's
    rows (no weights allowed); each element's gradient goes to the first
    slot of the bag holding its max (PyTorch's CPU tie rule), so the sparse
    gradient's other slots hold zeros. It runs on the XLA path (the native
    bag kernel sums; :func:`jaxslices.kernels.explain` says so).

    Only valid ids other than ``padding_id`` are in a bag (the one rule of
    every pooled lookup, :func:`jaxslices._ids.in_bags`): an id equal to
    ``padding_id``, or outside ``[0, V)`` (a ``-1`` fill, say), contributes
    nothing, forward or backward: no row, no weight in a ``"mean"`` /
    ``"sqrtn"`` denominator, no ``"max"`` candidate, and its slot is padding
    in a sparse gradient. ``check_ids=True`` raises on out-of-range ids
    instead. A bag with nothing in it gives zeros, not NaN. The table's
    gradient under :func:`jaxslices.value_and_grad` is sparse, as for
    :func:`embedding_lookup`: one slot per id slot (for jagged ids
    ``max_total`` slots, the unused ones padding).

    Args:
      table: ``[V, ...]`` array.
      ids: integer ``[..., L]`` array of bags of length ``L``, or a
        :class:`~jaxslices.JaggedIds` (its offsets are checked with
        :func:`jaxslices.check_jagged`).
      weights: optional per-id weights shaped like ``ids`` (for jagged ids,
        ``[max_total]``, or give them in the ``JaggedIds``, not both); not
        with ``"max"`` (a ``ValueError``).
      combiner: ``"mean"``, ``"sum"``, ``"sqrtn"`` or ``"max"``.
      padding_id: id that marks an empty slot in a bag.
      dtype: cast the looked-up rows to this dtype.
      check_ids: raise if a (non-padding) id is out of range.
      max_norm: renormalise the rows read whose norm exceeds it, before
        weighting (``torch.nn.EmbeddingBag``'s ``max_norm``; the table's own
        update is :func:`jaxslices.apply_max_norm`, see
        :func:`embedding_lookup`).
      norm_type: the ``p`` of the p-norm for ``max_norm``.
      strict: raise if the table would get a dense gradient (see
        :func:`embedding_lookup`).

    Returns:
      ``ids.shape[:-1] + table.shape[1:]``; for jagged ids
      ``(num_bags,) + table.shape[1:]``.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> table = jnp.array([[1.0], [3.0], [5.0]])
      >>> jaxslices.embedding_bag(table, jnp.array([[0, 2, 9]]), padding_id=9)
      Array([[3.]], dtype=float32)
      >>> bags = jaxslices.JaggedIds.from_lists([[0, 2], [1]], max_total=4)
      >>> jaxslices.embedding_bag(table, bags, combiner="sum")
      Array([[6.],
             [3.]], dtype=float32)

      Max pooling; the gradient goes to the slot holding each max:

      >>> table = jnp.array([[1.0, 8.0], [3.0, 2.0], [3.0, 0.0]])
      >>> ids = jnp.array([[0, 1, 2], [2, -1, -1]])  # -1: out of range, padding
      >>> jaxslices.embedding_bag(table, ids, combiner="max")
      Array([[3., 8.],
             [3., 0.]], dtype=float32)
      >>> g = jaxslices.grad(
      ...     lambda t: jaxslices.embedding_bag(t, ids, combiner="max").sum())(table)
      >>> g.indices, g.values[:3]
      (Array([0, 1, 2, 2, 3, 3], dtype=int32), Array([[0., 1.],
             [1., 0.],
             [0., 0.]], dtype=float32))
    """
    where = "embedding_bag"
    check_max_norm(max_norm, norm_type, where)
    if combiner not in _COMBINERS:
        raise ValueError(
            f"{where}: `combiner` must be one of {_COMBINERS}, got {combiner!r}."
        )
    segments = None
    if isinstance(ids, JaggedIds):
        jagged = check_jagged(ids, where)
        if weights is not None and jagged.weights is not None:
            raise ValueError(
                f"{where}: weights given twice, in `weights` and in the JaggedIds; "
                "pass one of them."
            )
        weights = jagged.weights if weights is None else weights
        ids = jagged.values
        segments = (segment_ids(jagged.offsets, jagged.max_total), jagged.num_bags)
    table, ids, num_rows, handler = _prepare(table, ids, where)
    if ids.ndim < 1:
        raise ValueError(
            f"{where}: `ids` must have at least one axis (the bag), got a "
            "scalar. Use embedding_lookup for single ids."
        )
    if combiner == "max" and weights is not None:
        raise ValueError(MAX_WEIGHTS.format(where=where))
    weights = weights_like(weights, ids.shape, "ids", where)
    present = _ids.not_padding(ids, padding_id)  # on the caller's own ids
    used = None
    if segments is not None:  # unused slots of jagged ids are padding
        used = jnp.asarray(segments[0] < segments[1])
        present = used if present is None else jnp.asarray(present) & used
    if check_ids:
        ids = _ids.raise_if_out_of_range(
            ids,
            num_rows,
            f"{where}(check_ids=True)",
            counted=present,
            like=(table,),
        )
    # The bags rule (jaxslices._ids.in_bags): only valid, non-padding ids
    # count; every other slot is padding (index V: reads zeros, no gradient)
    # and weighs nothing.
    counted = jnp.asarray(_ids.in_bags(ids, num_rows, padding_id))
    if used is not None:
        counted = counted & used
    safe = jnp.where(counted, _ids.safe_ids(ids, num_rows), num_rows)
    if combiner == "max":
        if handler is None:
            kernel_path.note(where, "combiner max (the bag kernel sums)")
        rows = _finish(
            _lookup_rows(table, safe, handler, strict),
            table,
            max_norm,
            norm_type,
            dtype,
        )
        return _max_pool(rows, counted, segments)
    if max_norm is not None and handler is None:
        kernel_path.note(where, "max_norm (the bag kernel does not renormalise rows)")
    why = _not_expressed(table, handler, max_norm, dtype)
    expected = _tape.expects_pooled(table) if handler is None else None
    if expected is False and not why:  # this value_and_grad's discovery took rows
        why = "rows looked up by this value_and_grad's first trace"
    if not why:  # the bag op, on either path (its reference is the XLA path)
        w = counted.astype(table.dtype)
        if weights is not None:
            w = w * weights.astype(table.dtype)
        reason = kernel_path.decide(safe, tables=(table, weights))
        return _bag(table, safe, w, segments, combiner, strict, reason)
    if handler is None and max_norm is None:
        kernel_path.note(where, why)
    rows = _finish(
        _lookup_rows(table, safe, handler, strict), table, max_norm, norm_type, dtype
    )
    w = counted.astype(rows.dtype)
    if weights is not None:
        w = w * weights.astype(rows.dtype)
    return _combine(rows, w, segments, combiner)


def _not_expressed(table: Any, handler: Any, max_norm: Any, dtype: Any) -> str:
    """Why the bag op (:func:`kernel_ops.bag_forward`) does not express this
    lookup (``""``: it does): it pools a float32, bfloat16 or float16 array
    table's own rows in float32 into the table's dtype."""
    if handler is not None:
        return "a table of a lookup handler"
    if max_norm is not None:
        return "max_norm (the bag kernel does not renormalise rows)"
    why = kernel_path.dtype_reason(tables=(table,))
    if why:
        return why
    if dtype is not None and jnp.dtype(dtype) != table.dtype:
        return "a dtype cast of the rows (the bag op pools in the table's dtype)"
    return ""


def _layout(
    ids_shape: tuple[int, ...], segments: tuple[jax.Array, int] | None
) -> tuple[tuple[int, ...], dict[str, Any], Any]:
    """The bags of ``ids_shape`` (padded) or of ``segments`` (jagged):
    ``(lead, bags, reduce)``, ``lead`` the result's leading shape, ``bags``
    :func:`kernel_ops.pool_rows`' ``num_bags``, ``length`` and ``bag``,
    ``reduce`` a sum over each bag's slots (of the weights, for
    :func:`combiner_scale`)."""
    if segments is None:
        lead = tuple(ids_shape[:-1])
        bags = {"num_bags": math.prod(lead), "length": int(ids_shape[-1])}
        return lead, bags, functools.partial(jnp.sum, axis=len(ids_shape) - 1)
    bag_ids, num_bags = segments
    bags = {"num_bags": num_bags, "bag": jnp.asarray(bag_ids, jnp.int32)}
    return (num_bags,), bags, functools.partial(_segment_sum, segments=segments)


def _bag(
    table: jax.Array,
    safe: jax.Array,
    w: jax.Array,
    segments: tuple[jax.Array, int] | None,
    combiner: str,
    strict: bool,
    reason: str,
) -> jax.Array:
    """:func:`embedding_bag` through the bag op, on either path: ``reason``
    (:func:`jaxslices.kernels._path.decide`'s) sends its lowering to its XLA
    reference, which pools as the kernel does (the rows read in float32, the
    result rounded once into the table's dtype); see :func:`pool`."""
    lead, bags, reduce = _layout(tuple(safe.shape), segments)
    scale = combiner_scale(combiner, w, reduce)
    out = pool(
        table,
        safe.reshape(-1),
        weight=w.reshape(-1),
        scale=None if scale is None else scale.reshape(-1),
        strict=strict,
        reason=reason,
        **bags,
    )
    if out is _tape.ROWS:  # below the loss's top level (vmap): the rows path
        kernel_path.note("embedding_bag", reason or kernel_path.VMAP)
        # pooled as the op pools: in float32, rounded once
        wide = jnp.promote_types(table.dtype, jnp.float32)
        rows = _lookup_rows(table, safe, None, strict).astype(wide)
        scale = None if scale is None else scale.astype(wide)
        out = _pooled(rows, w.astype(wide), scale, segments).astype(table.dtype)
        return out
    return out.reshape(lead + tuple(table.shape[1:]))


def pool(table: jax.Array, ids: jax.Array, *, strict: bool = False, **bags: Any) -> Any:
    """Pooled rows ``[num_bags, *row]`` through the bag op
    (:func:`kernel_ops.bag_forward`, whose arguments ``bags`` are:
    ``weight``, ``scale``, ``num_bags``, ``length``, ``bag``, ``reason``).

    ``out[b] = scale[b] * sum_{s in bag b} weight[s] * table[ids[s]]``, with
    ``ids`` ``[N]`` safe ids (padding ``V``), bags padded (``length`` slots
    each) or given per slot (``bag``, ``num_bags`` for an unused slot).
    ``reason`` (:func:`jaxslices.kernels._path.decide`'s; default ``""``,
    native): why the op's XLA reference runs. Under
    :func:`jaxslices.value_and_grad` the tap is the pooled output, so the
    table's gradient is the pooled gradient with the bags' ids and weights
    (a recipe), never the ``[N, D]`` rows, on either path. Returns
    :data:`_tape.ROWS` below the loss's top level (``vmap``): the caller
    looks the rows up instead.
    """
    row_shape = tuple(table.shape[1:])
    num_bags, weight = bags["num_bags"], bags.get("weight")

    def forward(t, *, dense_check):
        out = kernel_ops.bag_forward(
            t, ids, strict=strict, dense_check=dense_check, **bags
        )
        return out.reshape((num_bags, *row_shape))

    lookup = _tape.BagLookup(
        functools.partial(forward, dense_check=False),
        (num_bags, *row_shape),
        table.dtype,
        jnp.ones(ids.shape, table.dtype) if weight is None else weight,
        bags.get("scale"),
        bags.get("bag"),
        bags.get("length", 0),
    )
    out = _tape.bag(table, ids, lookup)
    if out is None:
        out = forward(table, dense_check=True)
    return out


def _max_pool(
    rows: jax.Array, counted: jax.Array, segments: tuple[jax.Array, int] | None
) -> jax.Array:
    """PyTorch's ``mode="max"``: per element, the max over a bag's counted slots.

    ``rows``: ``counted.shape + row_shape``, the slots' rows; a bag's slots
    are the last axis of ``counted`` (padded ids) or its segment (jagged).
    Per element the first counted slot holding the max is picked (PyTorch's
    CPU kernel replaces its running max only by a strictly greater value),
    so the gradient of that element goes to that slot alone; a bag with no
    counted slot gives zeros and no gradient. A NaN among a bag's values
    makes that element NaN. The picking is by comparisons on
    ``stop_gradient(rows)``, the result a masked sum of ``rows``: no
    gather, no scatter beyond the jagged segment sum.
    """
    row_nd = rows.ndim - counted.ndim
    mask = counted.reshape(counted.shape + (1,) * row_nd)
    r = jax.lax.stop_gradient(rows)
    if jnp.issubdtype(rows.dtype, jnp.inexact):
        low = jnp.array(-jnp.inf, rows.dtype)
    else:
        low = jnp.array(jnp.iinfo(rows.dtype).min, rows.dtype)
    candidates = jnp.where(mask, r, low)

    def holds(m):  # the counted slots holding the max (a NaN max: the NaNs)
        same = r == m
        if jnp.issubdtype(rows.dtype, jnp.inexact):
            same = same | (jnp.isnan(m) & jnp.isnan(r))
        return mask & same

    zero = jnp.zeros((), rows.dtype)
    if segments is None:
        axis = counted.ndim - 1
        length = counted.shape[-1]
        hit = holds(jnp.max(candidates, axis=axis, keepdims=True))
        first = jnp.argmax(hit, axis=axis, keepdims=True)
        slot = jnp.arange(length).reshape((length,) + (1,) * row_nd)
        pick = hit & (slot == first)
        return jnp.sum(jnp.where(pick, rows, zero), axis=axis)
    seg, num_bags = segments
    n = counted.shape[0]
    top = jax.ops.segment_max(
        candidates, seg, num_segments=num_bags + 1, indices_are_sorted=True
    )
    hit = holds(top[seg])
    slot = jnp.arange(n, dtype=jnp.int32).reshape((n,) + (1,) * row_nd)
    first = jax.ops.segment_min(
        jnp.where(hit, slot, n), seg, num_segments=num_bags + 1, indices_are_sorted=True
    )
    pick = hit & (slot == first[seg])
    return _segment_sum(jnp.where(pick, rows, zero), segments)


MAX_WEIGHTS = (
    "{where}: per-id weights are not defined for combiner='max' (torch.nn."
    "EmbeddingBag also refuses per_sample_weights with mode='max'). Drop the "
    "weights (for jagged ids, also those held in the JaggedIds), or pool with "
    "'sum', 'mean' or 'sqrtn'."
)


def _segment_sum(x: jax.Array, segments: tuple[jax.Array, int]) -> jax.Array:
    """Sum ``x``'s slots per bag (unused slots, segment ``num_bags``, dropped)."""
    seg, num_bags = segments
    out = jnp.zeros((num_bags, *x.shape[1:]), x.dtype)
    return out.at[seg].add(x, mode="drop", indices_are_sorted=True)


def _combine(
    rows: jax.Array,
    w: jax.Array,
    segments: tuple[jax.Array, int] | None,
    combiner: str,
) -> jax.Array:
    """Each bag's sum of ``w·rows``, scaled by the combiner, in ``rows``' dtype
    (the lookups the bag op does not express)."""
    _, _, reduce = _layout(tuple(w.shape), segments)
    return _pooled(rows, w, combiner_scale(combiner, w, reduce), segments)


def _pooled(
    rows: jax.Array,
    w: jax.Array,
    scale: jax.Array | None,
    segments: tuple[jax.Array, int] | None,
) -> jax.Array:
    """:func:`kernel_ops.pool_rows` (the bag op's pooling) of rows laid out as
    their ids (``w.shape + row``), the result laid out as the bags."""
    lead, bags, _ = _layout(tuple(w.shape), segments)
    row_shape = tuple(rows.shape[w.ndim :])
    out = kernel_ops.pool_rows(
        rows.reshape(math.prod(w.shape), math.prod(row_shape)),
        w.reshape(-1),
        None if scale is None else scale.reshape(-1),
        bags_sorted=segments is not None,
        **bags,
    )
    return out.reshape(lead + row_shape)


def combiner_scale(
    combiner: str | Sequence[str],
    w: jax.Array,
    reduce: Any,
    feature_axis: int = 0,
    dtype: Any = None,
) -> jax.Array | None:
    """The factor of each bag's weighted sum: the combiners' one rule.

    ``1 / Σ w`` (``"mean"``), ``1 / sqrt(Σ w²)`` (``"sqrtn"``), 1 (``"sum"``,
    ``"max"``), and 0 for a bag whose denominator is 0 (no slot counts);
    ``reduce`` sums over a bag's slots (``w`` holds the slots' weights, 0
    for a slot the bags rule leaves out). ``combiner``: one name, or one
    per feature along ``feature_axis`` of the reduced sums; ``dtype``: the
    denominators' dtype (default: ``w``'s). ``None`` when every factor is 1.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxslices.embedding import combiner_scale
      >>> w = jnp.array([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
      >>> combiner_scale("mean", w, lambda x: x.sum(-1))  # an empty bag: 0
      Array([0.5, 0. ], dtype=float32)
      >>> combiner_scale(["sqrtn", "sum"], w, lambda x: x.sum(-1))
      Array([0.70710677, 1.        ], dtype=float32)
    """
    names = [combiner] if isinstance(combiner, str) else list(combiner)
    code = np.array([{"mean": 1, "sqrtn": 2}.get(c, 0) for c in names], np.int32)
    if not code.any():
        return None
    mean_d = reduce(w) if (code == 1).any() else None
    sqrtn_d = jnp.sqrt(reduce(w * w)) if (code == 2).any() else None
    if isinstance(combiner, str):
        denom = mean_d if code[0] == 1 else sqrtn_d
    else:
        d = mean_d if mean_d is not None else sqrtn_d
        shape = [1] * d.ndim
        shape[feature_axis] = len(code)
        code = jnp.asarray(code.reshape(shape))
        one = jnp.ones((), d.dtype)
        denom = jnp.where(
            code == 1,
            one if mean_d is None else mean_d,
            jnp.where(code == 2, one if sqrtn_d is None else sqrtn_d, one),
        )
    denom = denom if dtype is None else denom.astype(dtype)
    safe = jnp.where(denom == 0, jnp.ones((), denom.dtype), denom)
    return jnp.where(denom == 0, jnp.zeros((), denom.dtype), 1 / safe)
