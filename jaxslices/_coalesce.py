"""Pure-array kernels for duplicate ids: coalescing, run starts, last writes.

A leaf of the package: it imports JAX only and knows nothing of
:class:`~jaxslices.IndexedSlices`. :func:`jaxslices.coalesce` (in
:mod:`jaxslices.slices`), the scatters, the transforms and
:mod:`jaxslices.sharding` call it on arrays: ids already mapped by the ids
policy (every invalid id is ``V``, :func:`jaxslices._ids.safe_ids`) and their
rows.

* :func:`coalesce_rows`: sum the rows of duplicate ids by one of several
  methods (below).
* :func:`sort_pairs`, :func:`run_starts`, :func:`run_ends`: the sort of
  (id, position) pairs and the ends of runs of equal ids that every
  duplicate-finding step is built from; :func:`last_writes` (the last
  occurrence of each id wins: ``scatter_update``) and
  :func:`unique_with_inverse` (sorted distinct ids and where each id went:
  the ``all_to_all`` routing) are written with them.

Every coalescing method returns ``N`` rows whose valid ids are unique, every
other slot being padding (id ``V``, values zero) at the end; the caller
records that in the slices it builds (``unique_indices``; ``indices_sorted``
when sorted), so coalescing them again is free. Rows are summed in at least
float32 (floats) or in at least 32-bit integers (integers and booleans, never
through a float): see :func:`sum_dtype`. Every method gives the same bits on
every run, on every platform.

Methods (``benchmarks/coalesce_bench.py`` measures them; results and the
reasons for the defaults in ``benchmarks/RESULTS.md``):

* ``"sort"`` (the default of :func:`jaxslices.coalesce`): sorted indices. On
  CPU/TPU: sort the ids alone, find each slot's segment with
  ``searchsorted`` and segment-sum by scatter-add (XLA:CPU and TPU scatters
  run in a fixed order). On GPU: a stable sort of (id, slot) pairs and a
  fixed-tree segmented scan, because GPU scatter-adds use atomics whose order
  changes from run to run.
* ``"pair_sort"``: the GPU algorithm on every platform.
* ``"hash"``: O(N) deduplication without sorting: each round, every
  unresolved slot writes its position into the cell ``hash_r(id)`` of a
  ``4N``-cell buffer with a scatter-*min* (order independent), and reads the
  winner back; the slots whose id won are resolved, the rest retry with the
  next round's hash (almost all resolve in one or two rounds). Unique indices
  come out in order of first appearance, not sorted. Summation is a
  scatter-add, so on GPU this method runs ``"sort"`` instead.
* ``"auto"`` (the default of the transforms): the fastest measured method per
  platform, sorted or not: ``"hash"`` on CPU (about 2x faster than ``"sort"``
  there), ``"sort"`` on GPU (nothing measured faster by enough to matter) and
  on TPU (not measured).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "METHODS",
    "check_method",
    "coalesce_rows",
    "last_writes",
    "rows_where",
    "run_ends",
    "run_starts",
    "sort_pairs",
    "sum_dtype",
    "unique_with_inverse",
]

METHODS = ("auto", "sort", "pair_sort", "hash")
UNSORTED_OK = ("auto", "hash")  # methods that do not promise sorted indices


def check_method(method: str, where: str) -> str:
    if method not in METHODS:
        raise ValueError(
            f"{where}: unknown coalescing method {method!r}; expected one of "
            f"{', '.join(repr(m) for m in METHODS)} (see jaxslices.coalesce)."
        )
    return method


def sum_dtype(dtype: Any) -> Any:
    """The dtype duplicate rows are summed in (the result is cast back).

    Floats: at least float32 (300 bf16 ones sum to 300, not 256). Integers: at
    least 32 bits of the same signedness, never a float (an int32 ``2**24 + 1``
    survives); booleans as int32.
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.promote_types(dtype, jnp.float32)
    if dtype == jnp.bool_:
        return jnp.dtype(jnp.int32)
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return jnp.promote_types(dtype, jnp.uint32)
    return jnp.promote_types(dtype, jnp.int32)


def rows_where(mask: jax.Array, ndim: int) -> jax.Array:
    """``mask [N]`` reshaped to broadcast over rows of rank ``ndim`` (``[N, 1...]``)."""
    return mask.reshape(mask.shape + (1,) * (ndim - 1))


def coalesce_rows(
    values: jax.Array,
    idx: jax.Array,
    num_rows: int,
    method: str,
    size: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sum the rows of duplicate ids: ``(summed values, unique ids, count)``.

    Args:
      values: ``[N, ...]`` rows.
      idx: ``[N]`` safe ids (every invalid one is ``num_rows``).
      num_rows: ``V``, the padding id.
      method: one of :data:`METHODS` (module docstring).
      size: the number of slots of the result (``None``: ``N``). Distinct ids
        past ``size`` are left out (their rows are dropped): the caller
        compares ``count`` with ``size`` and raises.

    Returns:
      ``size`` slots: the distinct valid ids first (sorted unless ``method``
      is in ``UNSORTED_OK``) with their summed rows, in ``values``' dtype
      (summed in :func:`sum_dtype`), then padding: id ``num_rows``, values
      zero; and ``count``, the number of distinct valid ids (int32 scalar).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxslices import _coalesce
      >>> summed, ids, count = _coalesce.coalesce_rows(
      ...     jnp.array([1., 2., 3.]), jnp.array([4, 1, 4]), 5, "sort")
      >>> summed, ids, int(count)
      (Array([2., 4., 0.], dtype=float32), Array([1, 4, 5], dtype=int32), 2)
    """
    v = num_rows
    size = idx.shape[0] if size is None else int(size)
    summing = values.astype(sum_dtype(values.dtype))
    pair = functools.partial(_by_pair_sort, num_rows=v, size=size)
    by_sort = functools.partial(_by_id_sort, num_rows=v, size=size)
    by_hash = functools.partial(_by_hash, num_rows=v, size=size)
    gpu = {"cuda": pair, "rocm": pair}
    if method == "pair_sort":
        summed, unique_idx, count = pair(summing, idx)
    elif method == "sort":
        summed, unique_idx, count = jax.lax.platform_dependent(
            summing, idx, **gpu, default=by_sort
        )
    elif method == "hash":
        summed, unique_idx, count = jax.lax.platform_dependent(
            summing, idx, **gpu, default=by_hash
        )
    else:  # auto
        summed, unique_idx, count = jax.lax.platform_dependent(
            summing, idx, **gpu, cpu=by_hash, default=by_sort
        )
    unique_idx = jnp.minimum(unique_idx, v).astype(idx.dtype)
    # Padding slots (index V) may hold the sum of padding/invalid rows: zero.
    pad = rows_where(unique_idx == v, summed.ndim)
    summed = jnp.where(pad, jnp.zeros((), summed.dtype), summed)
    return summed.astype(values.dtype), unique_idx, count


# --------------------------------------------------- runs of duplicate ids


def sort_pairs(idx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stable sort of (id, position): ``(sorted ids, permutation)``.

    Equal ids keep their order of appearance, so the last of a run is the
    last occurrence.
    """
    iota = jnp.arange(idx.shape[0], dtype=jnp.int32)
    return jax.lax.sort((idx, iota), num_keys=1, is_stable=True)


def run_starts(sorted_keys: jax.Array) -> jax.Array:
    """``True`` at the first element of each run of equal (sorted) keys."""
    head = jnp.ones((1,), bool)
    return jnp.concatenate([head, sorted_keys[1:] != sorted_keys[:-1]])


def run_ends(sorted_keys: jax.Array) -> jax.Array:
    """``True`` at the last element of each run of equal (sorted) keys."""
    tail = jnp.ones((1,), bool)
    return jnp.concatenate([sorted_keys[1:] != sorted_keys[:-1], tail])


def _segments(sorted_keys: jax.Array) -> jax.Array:
    """The run number (0, 1, ...) of each element of sorted keys."""
    return jnp.cumsum(run_starts(sorted_keys).astype(jnp.int32)) - 1


def last_writes(idx: jax.Array, pad: int) -> tuple[jax.Array, jax.Array]:
    """Where each (permuted) row goes when the last occurrence of an id wins.

    Returns ``(target, perm)``: scattering ``rows[perm]`` to ``target`` with
    ``mode="drop"`` writes each id's last row once; every other slot's target
    is ``pad`` (out of bounds: dropped). Deterministic on every platform.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxslices import _coalesce
      >>> target, perm = _coalesce.last_writes(jnp.array([2, 0, 2]), pad=3)
      >>> target, perm
      (Array([0, 3, 2], dtype=int32), Array([1, 0, 2], dtype=int32))
    """
    sorted_idx, perm = sort_pairs(idx)
    target = jnp.where(
        run_ends(sorted_idx), sorted_idx, jnp.asarray(pad, sorted_idx.dtype)
    )
    return target, perm


def unique_with_inverse(ids: jax.Array, sentinel: int) -> tuple[jax.Array, jax.Array]:
    """Sorted distinct ids (``sentinel``-padded, static size) and each id's slot.

    ``uniq[inverse[k]] == ids[k]`` for every ``k``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxslices import _coalesce
      >>> _coalesce.unique_with_inverse(jnp.array([5, 2, 5]), sentinel=9)
      (Array([2, 5, 9], dtype=int32), Array([1, 0, 1], dtype=int32))
    """
    n = ids.shape[0]
    key, perm = sort_pairs(ids)
    seg = _segments(key)
    uniq = jnp.full((n,), sentinel, ids.dtype).at[seg].set(key)
    inverse = jnp.zeros((n,), jnp.int32).at[perm].set(seg)
    return uniq, inverse


# ------------------------------------------------------------ the algorithms
# Each takes (values [N, ...] in the summing dtype, safe indices [N] with every
# invalid slot at V) and returns (summed rows [size, ...], unique ids [size],
# the number of distinct valid ids) with the distinct valid ids first and ids
# >= V (clamped by the caller) after them; segments past ``size`` are dropped.


def _by_id_sort(values: jax.Array, idx: jax.Array, num_rows: int, size: int):
    """Sort the ids alone, rank each slot's id, segment-sum unsorted.

    XLA's CPU sort of (id, position) pairs plus permuting the rows costs ~5x
    more than sorting the ids and binary-searching each id's first position.
    """
    sorted_idx = jnp.sort(idx)
    starts = run_starts(sorted_idx)
    segment_of_sorted = jnp.cumsum(starts.astype(jnp.int32)) - 1
    first = jnp.searchsorted(sorted_idx, idx, side="left", method="scan")
    summed = _segment_sum_by_scatter(values, segment_of_sorted[first], size)
    count = _count_valid_runs(sorted_idx, starts, num_rows)
    return summed, _unique_ids(sorted_idx, segment_of_sorted, size), count


def _by_pair_sort(values: jax.Array, idx: jax.Array, num_rows: int, size: int):
    """Stable sort of (id, position), then a fixed-tree segmented scan."""
    sorted_idx, perm = sort_pairs(idx)
    starts = run_starts(sorted_idx)
    segment = jnp.cumsum(starts.astype(jnp.int32)) - 1
    summed = _segment_sum_by_scan(values[perm], segment, size)
    count = _count_valid_runs(sorted_idx, starts, num_rows)
    return summed, _unique_ids(sorted_idx, segment, size), count


def _count_valid_runs(sorted_idx: jax.Array, starts: jax.Array, num_rows: int):
    """Distinct valid ids of sorted safe ids (every invalid one is ``V``, last)."""
    if sorted_idx.shape[0] == 0:
        return jnp.zeros((), jnp.int32)
    runs = jnp.sum(starts, dtype=jnp.int32)
    return runs - (sorted_idx[-1] >= num_rows).astype(jnp.int32)


def _hash_representatives(idx: jax.Array, valid: jax.Array) -> jax.Array:
    """For every slot, the first slot holding the same id (invalid: itself)."""
    n = idx.shape[0]
    log_m = max(1, (4 * n - 1).bit_length())  # 4N cells or more
    m = 1 << log_m
    iota = jnp.arange(n, dtype=jnp.int32)
    key = idx.astype(jnp.uint32)  # only hashed; ids are compared in full

    def round_(carry):
        rep, r = carry
        todo = rep < 0
        mult = (jnp.uint32(0x9E3779B1) + r * jnp.uint32(0x6A09E668)) | jnp.uint32(1)
        cell = ((key * mult) >> (32 - log_m)).astype(jnp.int32)
        cell = jnp.where(todo, cell, m)  # resolved slots write nothing
        # scatter-min: the smallest slot wins a cell whatever the write order.
        buf = jnp.full((m,), n, jnp.int32).at[cell].min(iota, mode="drop")
        winner = buf.at[cell].get(mode="fill", fill_value=0)
        # Every slot of the winning id read the same cell: all resolved (>= 1
        # id per round), each to the id's first slot among those competing.
        won = todo & (idx[winner] == idx)
        return jnp.where(won, winner, rep), r + jnp.uint32(1)

    rep0 = jnp.where(valid, -1, iota)
    rep, _ = jax.lax.while_loop(
        lambda c: jnp.any(c[0] < 0), round_, (rep0, jnp.uint32(0))
    )
    return rep


def _by_hash(values: jax.Array, idx: jax.Array, num_rows: int, size: int):
    """Representatives by hashing, rows summed straight into compact slots."""
    n = idx.shape[0]
    valid = idx < num_rows  # safe indices: every invalid slot is V
    rep = _hash_representatives(idx, valid)
    iota = jnp.arange(n, dtype=jnp.int32)
    is_rep = valid & (rep == iota)
    pos = jnp.cumsum(is_rep.astype(jnp.int32)) - 1  # compact position of each id
    segment = jnp.where(valid, pos[rep], size)  # invalid slots: dropped
    summed = _segment_sum_by_scatter(values, segment, size)
    pad = jnp.iinfo(idx.dtype).max
    unique = jnp.full((size,), pad, idx.dtype)
    unique = unique.at[jnp.where(is_rep, pos, size)].set(idx, mode="drop")
    count = pos[-1] + 1 if n else jnp.zeros((), jnp.int32)
    return summed, unique, count


def _unique_ids(sorted_idx: jax.Array, segment: jax.Array, n: int) -> jax.Array:
    pad = jnp.iinfo(sorted_idx.dtype).max  # unused slots; the caller clamps to V
    out = jnp.full((n,), pad, sorted_idx.dtype)
    return out.at[segment].set(sorted_idx, mode="drop")


def _segment_sum_by_scatter(values: jax.Array, segment: jax.Array, n: int):
    return jax.ops.segment_sum(values, segment, num_segments=n)


def _segment_sum_by_scan(values: jax.Array, segment: jax.Array, n: int):
    """Segmented sum with a fixed summation tree: same bits on every run.

    A segmented inclusive ``associative_scan`` restarts at each new segment; the
    last element of each segment then holds its total, which is written to the
    segment's own slot (no two writes collide).
    """
    starts, ends = run_starts(segment), run_ends(segment)

    def combine(a, b):
        (start_a, sum_a), (start_b, sum_b) = a, b
        return start_a | start_b, jnp.where(
            rows_where(start_b, sum_b.ndim), sum_b, sum_a + sum_b
        )

    _, running = jax.lax.associative_scan(combine, (starts, values))
    target = jnp.where(ends, segment, n)
    out = jnp.zeros((n, *values.shape[1:]), values.dtype)
    return out.at[target].set(running, mode="drop", unique_indices=True)
