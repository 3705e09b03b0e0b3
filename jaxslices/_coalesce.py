"""Coalescing: summing the rows of duplicate indices, by several methods.

Every method returns slices of the same static size ``N`` and the same dense
equivalent whose valid indices are unique, every other slot being padding
(index ``V = dense_shape[0]``, values zero) at the end, and records that in
the result (``unique_indices``; ``indices_sorted`` when sorted), so coalescing
it again is free. Rows are summed in at least float32 (floats) or in at least
32-bit integers (integers and booleans, never through a float): see
:func:`sum_dtype`. Every method gives the
same bits on every run, on every backend.

Methods (``benchmarks/coalesce_bench.py`` measures them; results and the
reasons for the defaults in ``benchmarks/RESULTS.md``):

* ``"sort"`` (the default of :func:`jaxslices.coalesce`): sorted indices. On
  CPU/TPU: sort the ids alone, find each slot's segment with
  ``searchsorted`` and segment-sum by scatter-add (XLA:CPU and TPU scatters
  run in a fixed order). On GPU: a stable sort of (id, slot) pairs and a
  fixed-tree segmented scan, because GPU scatter-adds use atomics whose order
  changes from run to run.
* ``"pair_sort"``: the GPU algorithm on every backend.
* ``"hash"``: O(N) deduplication without sorting: each round, every
  unresolved slot writes its position into the cell ``hash_r(id)`` of a
  ``4N``-cell buffer with a scatter-*min* (order independent), and reads the
  winner back; the slots whose id won are resolved, the rest retry with the
  next round's hash (almost all resolve in one or two rounds). Unique indices
  come out in order of first appearance, not sorted. Summation is a
  scatter-add, so on GPU this method runs ``"sort"`` instead.
* ``"auto"`` (the default of the transforms): the fastest measured method per
  backend, sorted or not: ``"hash"`` on CPU (about 2x faster than ``"sort"``
  there), ``"sort"`` on GPU (nothing measured faster by enough to matter) and
  on TPU (not measured).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from . import slices
from .slices import IndexedSlices, check_slices

__all__ = ["METHODS", "coalesce"]

METHODS = ("auto", "sort", "pair_sort", "hash")
_UNSORTED_OK = ("auto", "hash")  # methods that do not promise sorted indices


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


def coalesce(s: IndexedSlices, method: str = "sort") -> IndexedSlices:
    """Implementation of :func:`jaxslices.coalesce` (see the module docstring)."""
    check_slices(s, "coalesce")
    check_method(method, "jaxslices.coalesce")
    if s.unique_indices and (s.indices_sorted or method in _UNSORTED_OK):
        return s  # coalesced already: free
    n, v = s.num_slices, s.dense_shape[0]
    if n == 0:
        return s
    idx = slices.safe_indices(s)
    values = s.values.astype(sum_dtype(s.dtype))
    gpu = {"cuda": _by_pair_sort, "rocm": _by_pair_sort}
    if method == "pair_sort":
        summed, unique_idx = _by_pair_sort(values, idx)
    elif method == "sort":
        summed, unique_idx = jax.lax.platform_dependent(
            values, idx, **gpu, default=_by_id_sort
        )
    elif method == "hash":
        summed, unique_idx = jax.lax.platform_dependent(
            values, idx, **gpu, default=functools.partial(_by_hash, num_rows=v)
        )
    else:  # auto
        summed, unique_idx = jax.lax.platform_dependent(
            values,
            idx,
            **gpu,
            cpu=functools.partial(_by_hash, num_rows=v),
            default=_by_id_sort,
        )
    unique_idx = jnp.minimum(unique_idx, v).astype(s.indices.dtype)
    # Padding slots (index V) may hold the sum of padding/invalid rows: zero.
    pad = slices._expand(unique_idx == v, summed.ndim)
    summed = jnp.where(pad, jnp.zeros((), summed.dtype), summed)
    out = IndexedSlices(summed.astype(s.dtype), unique_idx, s.dense_shape)
    return slices._with_flags(
        out, unique_indices=True, indices_sorted=method not in _UNSORTED_OK
    )


# ------------------------------------------------------------ the algorithms
# Each takes (values [N, ...] in the summing dtype, safe indices [N] with every
# invalid slot at V) and returns (summed rows [N, ...], unique ids [N]) with the
# distinct valid ids first and ids >= V (clamped by the caller) after them.


def _by_id_sort(values: jax.Array, idx: jax.Array):
    """Sort the ids alone, rank each slot's id, segment-sum unsorted.

    XLA's CPU sort of (id, position) pairs plus permuting the rows costs ~5x
    more than sorting the ids and binary-searching each id's first position.
    """
    n = idx.shape[0]
    sorted_idx = jnp.sort(idx)
    is_new = jnp.concatenate([jnp.ones((1,), bool), sorted_idx[1:] != sorted_idx[:-1]])
    segment_of_sorted = jnp.cumsum(is_new.astype(jnp.int32)) - 1
    first = jnp.searchsorted(sorted_idx, idx, side="left", method="scan")
    summed = _segment_sum_by_scatter(values, segment_of_sorted[first], n)
    return summed, _unique_ids(sorted_idx, segment_of_sorted, n)


def _by_pair_sort(values: jax.Array, idx: jax.Array):
    """Stable sort of (id, position), then a fixed-tree segmented scan."""
    n = idx.shape[0]
    iota = jnp.arange(n, dtype=jnp.int32)
    sorted_idx, perm = jax.lax.sort((idx, iota), num_keys=1, is_stable=True)
    is_new = jnp.concatenate([jnp.ones((1,), bool), sorted_idx[1:] != sorted_idx[:-1]])
    segment = jnp.cumsum(is_new.astype(jnp.int32)) - 1
    summed = _segment_sum_by_scan(values[perm], segment, n)
    return summed, _unique_ids(sorted_idx, segment, n)


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


def _by_hash(values: jax.Array, idx: jax.Array, num_rows: int):
    """Representatives by hashing, rows summed straight into compact slots."""
    n = idx.shape[0]
    valid = idx < num_rows  # safe indices: every invalid slot is V
    rep = _hash_representatives(idx, valid)
    iota = jnp.arange(n, dtype=jnp.int32)
    is_rep = valid & (rep == iota)
    pos = jnp.cumsum(is_rep.astype(jnp.int32)) - 1  # compact position of each id
    segment = jnp.where(valid, pos[rep], n)  # invalid slots: dropped
    summed = _segment_sum_by_scatter(values, segment, n)
    pad = jnp.iinfo(idx.dtype).max
    unique = jnp.full((n,), pad, idx.dtype)
    return summed, unique.at[jnp.where(is_rep, pos, n)].set(idx, mode="drop")


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
    starts = jnp.concatenate([jnp.ones((1,), bool), segment[1:] != segment[:-1]])
    ends = jnp.concatenate([segment[1:] != segment[:-1], jnp.ones((1,), bool)])

    def combine(a, b):
        (start_a, sum_a), (start_b, sum_b) = a, b
        return start_a | start_b, jnp.where(
            slices._expand(start_b, sum_b.ndim), sum_b, sum_a + sum_b
        )

    _, running = jax.lax.associative_scan(combine, (starts, values))
    target = jnp.where(ends, segment, n)
    out = jnp.zeros((n, *values.shape[1:]), values.dtype)
    return out.at[target].set(running, mode="drop", unique_indices=True)
