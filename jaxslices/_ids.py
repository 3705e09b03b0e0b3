"""The ids policy: which ids are rows, their dtype, and the opt-in check.

One home for the rules every lookup, scatter, router and gradient type of
jaxslices follows (:mod:`jaxslices.embedding`, :mod:`jaxslices.slices`,
:mod:`jaxslices.sharding`, :mod:`jaxslices.native`, the framework layers):

* **Valid ids** are ``0 <= id < V`` (``V = num_rows``), decided in the ids'
  own dtype, before any narrowing, so a large int64 or uint32 id can never
  wrap into a valid row (:func:`valid`).
* **Invalid ids are padding.** An id outside ``[0, V)`` reads zeros, gets no
  gradient and is dropped by every scatter: it is mapped to ``V``, the padding
  index, which a ``mode="drop"`` scatter drops and a ``mode="fill"`` gather
  fills (:func:`safe_ids`). JAX's own ``table[ids]`` would clamp it to the
  last row, and wrap a negative one from the end, even with ``mode="drop"``.
* **Index dtype.** Ids inside jaxslices are int32 unless the padding index
  ``V`` does not fit in int32 (tables of more than ``2**31 - 1`` rows), then
  int64 (which needs ``jax_enable_x64``) (:func:`index_dtype`). The typed
  indices of :class:`~jaxslices.IndexedSlices` store exactly this dtype.
* **Checked mode** (opt-in): :func:`check_ids` raises an error naming the
  caller's function, how many ids are out of range and their min and max,
  eagerly for concrete ids and under ``jit`` through
  :func:`jaxslices._errors.raise_if` (on every device of a mesh).
* **Bags: one rule for every pooled lookup** (:func:`in_bags`). A slot of a
  bag counts when its id is valid (in ``[0, V)`` of its own table) and is
  not the padding id. Any other slot (an out-of-range id, the padding id,
  an unused slot of jagged ids) is padding: it adds no row, weighs nothing
  in the ``"mean"`` and ``"sqrtn"`` denominators, is no candidate for
  ``"max"``, and gets no gradient; a bag with no counted slot pools to
  zeros. Every entry point follows it, on the XLA path and the native
  kernels' alike: :func:`jaxslices.embedding_bag` (padded and jagged ids),
  the bag layers of :mod:`jaxslices.nnx`, ``.linen`` and ``.equinox``,
  :class:`jaxslices.EmbeddingCollection` (padded ids and
  :class:`~jaxslices.KeyedJaggedIds`) and its sharding plans. It is
  PyTorch's treatment of ``padding_idx`` in ``EmbeddingBag`` extended to
  the ids PyTorch refuses (its CPU kernel raises on an out-of-range id);
  ``check_ids=True`` raises instead, as PyTorch does (``docs/embeddings.md``
  compares PyTorch's, FBGEMM's and TorchRec's behaviour).
* **Framework layers** (``nnx.Embed``, ``linen.Embed``,
  ``equinox.Embedding``) first let negative ids count from the end, as the
  stock layers do (:func:`wrap_negative`), and refuse non-integer ids
  (:func:`integer_ids`); what is still out of range then follows the policy
  above. The bag layers do not wrap: a negative id in a bag (a ``-1``
  fill) is out of range, hence padding.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from . import _errors

__all__ = [
    "INT32_MAX",
    "OUT_OF_RANGE_HINT",
    "as_ids",
    "raise_if_out_of_range",
    "check_index_width",
    "check_ids",
    "in_bags",
    "index_dtype",
    "integer_ids",
    "needs_int64",
    "not_padding",
    "safe_ids",
    "valid",
    "valid_per_table",
    "wrap_negative",
    "x64_enabled",
]

INT32_MAX = int(np.iinfo(np.int32).max)


def needs_int64(num_rows: int) -> bool:
    """Whether the padding index ``num_rows`` needs int64 ids (> ``2**31 - 1``)."""
    return num_rows > INT32_MAX


def index_dtype(num_rows: int) -> Any:
    """The dtype of ids inside jaxslices: int32, int64 when ``V`` needs it.

    Example:
      >>> from jaxslices import _ids
      >>> _ids.index_dtype(2**31 - 1).__name__, _ids.index_dtype(2**31).__name__
      ('int32', 'int64')
    """
    return jnp.int64 if needs_int64(num_rows) else jnp.int32


def x64_enabled() -> bool:
    """Whether JAX has 64-bit integers now (``jax_enable_x64``)."""
    return jax.dtypes.canonicalize_dtype(jnp.int64) == jnp.int64


def check_index_width(dtype: Any, num_rows: int) -> None:
    """The ids' dtype, and JAX, can hold the padding index ``num_rows``."""
    wide = needs_int64(num_rows)
    if num_rows > jnp.iinfo(dtype).max:
        wider = (
            "int64 (with jax.config.update('jax_enable_x64', True))"
            if wide
            else "int32"
        )
        raise ValueError(
            f"IndexedSlices: indices of dtype {dtype.name} cannot hold the padding "
            f"index dense_shape[0] = {num_rows}; use {wider} indices."
        )
    if wide and not x64_enabled():
        raise ValueError(
            f"IndexedSlices: a dense shape with {num_rows} rows (more than "
            "2**31 - 1) needs int64 row ids, which JAX has only with "
            "jax.config.update('jax_enable_x64', True) (set it at start-up), got "
            f"{dtype.name} ids with 64-bit integers disabled."
        )


def valid(ids: Any, num_rows: int) -> Any:
    """``0 <= ids < num_rows``, computed in the ids' own dtype (no narrowing).

    NumPy ids give a NumPy mask (nothing passes through JAX's conversion).
    """
    xp = np if isinstance(ids, np.ndarray) else jnp
    info = np.iinfo(ids.dtype)
    ok = ids >= 0 if info.min < 0 else xp.ones(ids.shape, bool)
    if num_rows <= info.max:  # else every non-negative id of this dtype is valid
        ok = ok & (ids < num_rows)
    return ok


def valid_per_table(ids: Any, rows: np.ndarray, table: Any) -> Any:
    """``0 <= id < rows[table]`` (each id's own table), in the ids' own dtype.

    ``rows``: a NumPy array of rows per table (``0``: no table, nothing
    valid); ``table``: each id's table position (broadcast with ``ids``).
    """
    info = np.iinfo(ids.dtype)
    rows = np.asarray(rows)
    big = rows > info.max  # every non-negative id of this dtype is valid
    lim = jnp.asarray(np.where(big, info.max, rows).astype(ids.dtype))[table]
    ok = ids < lim
    if big.any():
        ok = ok | jnp.asarray(big)[table]
    if info.min < 0:
        ok = ok & (ids >= 0)
    return ok & jnp.asarray(rows > 0)[table]


def not_padding(ids: Any, padding_id: Any) -> Any:
    """``ids != padding_id`` (``None`` when nothing can equal it).

    A padding id outside the ids' dtype (or ``None``) marks nothing.
    """
    if padding_id is None:
        return None
    info = np.iinfo(ids.dtype)
    if not info.min <= padding_id <= info.max:
        return None
    return ids != padding_id


def in_bags(
    ids: Any,
    num_rows: int | np.ndarray,
    padding_id: Any = None,
    *,
    table: Any = None,
) -> Any:
    """Which slots of bags count: valid ids other than ``padding_id``.

    THE BAGS RULE (module docstring): every pooled lookup multiplies its
    per-id weights (ones if none) by this mask, so a slot outside it adds
    no row, no weight to a ``"mean"`` / ``"sqrtn"`` denominator, is no
    ``"max"`` candidate and gets no gradient. ``num_rows`` is ``V``, or
    (with ``table``, each id's table position) the rows of each table, as
    :func:`valid_per_table`. Decided on the caller's ids, in their own
    dtype (before any narrowing).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxslices import _ids
      >>> _ids.in_bags(jnp.array([[0, -1, 4, 2]]), num_rows=4, padding_id=2)
      Array([[ True, False, False, False]], dtype=bool)
    """
    if table is None:
        ok = valid(ids, num_rows)
    else:
        ok = valid_per_table(ids, num_rows, table)
    keep = not_padding(ids, padding_id)
    return ok if keep is None else ok & keep


def safe_ids(ids: Any, num_rows: int) -> jax.Array:
    """Ids in the index dtype with every invalid id (range-checked first) set to V.

    NumPy ids are mapped in NumPy, before JAX's conversion could narrow them
    (without ``jax_enable_x64``, ``jnp.asarray`` wraps int64 ``2**32 + 1`` to 1).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxslices import _ids
      >>> _ids.safe_ids(jnp.array([0, -1, 4, 2]), num_rows=4)
      Array([0, 4, 4, 2], dtype=int32)
    """
    dtype = index_dtype(num_rows)
    if isinstance(ids, np.ndarray):
        return jnp.asarray(np.where(valid(ids, num_rows), ids, num_rows).astype(dtype))
    return jnp.where(
        valid(ids, num_rows), ids.astype(dtype), jnp.asarray(num_rows, dtype)
    )


def has_tracer(x: Any) -> bool:
    """Whether any leaf of ``x`` is traced (else it can be checked in NumPy now)."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x))


def as_ids(ids: Any, where: str) -> Any:
    """Integer ids as a JAX array, or (concrete inputs) a NumPy array.

    NumPy arrays, lists and NumPy scalars stay in NumPy so that the range
    check happens before JAX's conversion could narrow them. Non-integer ids
    raise a ``TypeError`` naming ``where``.
    """
    if not isinstance(ids, jax.Array):
        ids = jnp.asarray(ids) if has_tracer(ids) else np.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(
            f"{where}: `ids` must be integers, got {jnp.dtype(ids.dtype).name}"
            f"{list(ids.shape)}. Cast them, e.g. `ids.astype(jnp.int32)`."
        )
    return ids


def to_jax(ids: Any, where: str) -> jax.Array:
    """Integer ids as a JAX array, never wrapped onto a valid row.

    Without ``jax_enable_x64`` JAX holds 64-bit ids in 32 bits, and
    ``jnp.asarray`` would wrap ``2**32 + 1`` to ``1``: a valid row. Concrete
    ids that the narrower dtype cannot hold become that dtype's extreme of
    the same sign instead, outside every table JAX can index without x64, so
    a range check still refuses them and a lookup treats them as padding.
    """
    ids = as_ids(ids, where)
    if isinstance(ids, np.ndarray):
        narrow = np.dtype(jax.dtypes.canonicalize_dtype(ids.dtype))
        if narrow != ids.dtype:
            info = np.iinfo(narrow)
            ids = np.clip(ids, info.min, info.max).astype(narrow)
    return jnp.asarray(ids)


# ------------------------------------------------------------ checked mode


#: How every ``check_ids`` message ends: what an out-of-range id does, and
#: the two ways out.
OUT_OF_RANGE_HINT = (
    "Out-of-range ids would read zeros and get no gradient; fix the ids, or "
    "pass check_ids=False to treat them as padding."
)


def _bad_ids_error(n_bad: int, lo: int, hi: int, *, num_rows: int, where: str):
    return ValueError(
        f"{where}: ids must be in [0, {num_rows}) for a table with {num_rows} rows; "
        f"{n_bad} {'id is' if n_bad == 1 else 'ids are'} out of range (the ids "
        f"checked have min {lo} and max {hi}). {OUT_OF_RANGE_HINT}"
    )


def raise_if_out_of_range(
    ids: Any,
    num_rows: int,
    where: str,
    counted: Any = None,
    like: Any = (),
    always: bool = False,
) -> Any:
    """Check ``ids`` (the caller's own, before any remapping or narrowing).

    ``counted`` (bool, like ``ids``) excludes slots from the check (padding).
    Concrete ids are checked at once (``ValueError``); traced ids by
    :func:`jaxslices._errors.raise_if`, which JAX re-raises as
    ``jax.errors.JaxRuntimeError`` (``ValueError`` on later calls), on every
    device of a mesh (``like``: arrays whose mesh decides where the check
    runs). Returns ``ids``; under
    ``jit`` what is computed from the result waits for the check.
    """
    if ids.size == 0:
        return ids
    if not isinstance(ids, jax.core.Tracer) and not has_tracer(counted):
        given, ids = ids, np.asarray(ids)
        counted = np.ones(ids.shape, bool) if counted is None else np.asarray(counted)
        bad = counted & ~valid(ids, num_rows)
        if bad.any():
            checked = ids[counted]
            raise _bad_ids_error(
                int(bad.sum()),
                int(checked.min()),
                int(checked.max()),
                num_rows=num_rows,
                where=where,
            )
        return given
    ids = jnp.asarray(ids)
    counted = jnp.ones(ids.shape, bool) if counted is None else jnp.asarray(counted)
    info = jnp.iinfo(ids.dtype)
    bad = counted & ~valid(ids, num_rows)
    lo = jnp.min(jnp.where(counted, ids, jnp.array(info.max, ids.dtype)))
    hi = jnp.max(jnp.where(counted, ids, jnp.array(info.min, ids.dtype)))
    return _errors.raise_if(
        bad,
        ids,
        functools.partial(_bad_ids_error, num_rows=num_rows, where=where),
        jnp.sum(bad.astype(jnp.int32)),
        lo,
        hi,
        reduce=("sum", "min", "max"),
        like=(ids, *like),
        always=always,
    )


def check_ids(ids: ArrayLike, num_rows: int) -> Any:
    """Raise an error if an id is outside ``[0, num_rows)``, also under ``jit``.

    The message gives the ids' min and max and how many are out of range,
    computed on the ids as given (before any narrowing to the index dtype).
    Concrete ids (NumPy, lists, JAX arrays outside ``jit``) raise ``ValueError``
    at once. Traced ids (under ``jax.jit``) are checked when the step runs, and
    JAX raises ``jax.errors.JaxRuntimeError`` (on later calls of the compiled
    step, its C++ dispatch path, a ``ValueError``) carrying this message:
    catch ``(jax.errors.JaxRuntimeError, ValueError)`` around the jitted call (and
    ``jax.block_until_ready`` its result). Over a device mesh (ids sharded by
    ``jit``, or inside ``shard_map``) every device checks the ids of all and
    every process raises; no collective is left waiting.

    Returns the ids (NumPy or JAX, as given). Under ``jit``, look up with the
    result, ``ids = jaxslices.check_ids(ids, V)``: what is computed from it
    (the lookup, and the collectives after it) then waits for the check. An
    unused result is still checked, without that ordering: the check is a JAX
    effect (``jax.debug.callback``), so a step that calls ``check_ids`` goes
    through JAX's Python dispatch path (0.14-0.25 ms a call on CPU,
    ``benchmarks/check_dispatch.py``). The
    lookups' own ``check_ids=True`` guard the ids they use and cost no
    dispatch time.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> jaxslices.check_ids(jnp.array([0, 4]), num_rows=5)  # fine
      Array([0, 4], dtype=int32)
      >>> jaxslices.check_ids([0, 7, -1], num_rows=5)
      Traceback (most recent call last):
      ...
      ValueError: check_ids: ids must be in [0, 5) for a table with 5 rows; 2 ids ...
    """
    return raise_if_out_of_range(
        as_ids(ids, "check_ids"), num_rows, "check_ids", always=True
    )


# ----------------------------------------------------- framework layers


def wrap_negative(ids: jax.Array, num_rows: int) -> jax.Array:
    """Negative ids count from the end, as in the stock Flax/Equinox layers."""
    return jnp.where(ids < 0, ids + num_rows, ids)


def integer_ids(inputs: Any, where: str) -> jax.Array:
    """``inputs`` as an array, or a ``ValueError`` naming ``where`` if not integer."""
    inputs = jnp.asarray(inputs)
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
        raise ValueError(
            f"{where}: input ids must be integers, got {inputs.dtype.name}"
            f"{list(inputs.shape)}. Cast them, e.g. `ids.astype(jnp.int32)`."
        )
    return inputs
