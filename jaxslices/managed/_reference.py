"""The managed-collision remap's XLA reference: the algorithm in jax.numpy.

:func:`lookup_and_admit` and :func:`evict` are the contract of the two
native ops of :mod:`jaxslices.managed._ops` (``csrc/remap.cc`` gives the same
state bit for bit) and what they lower to wherever the kernels do not run;
``tests/lib/test_managed_remap.py`` checks them against a NumPy model of the
policy (:mod:`jaxslices.managed._table`).

Why a sorted copy and binary search, not open addressing with a fixed number
of probes: a probe sequence can run out while free slots remain, so an id
would fall back to the default (or collide) with room in the table; the
sorted copy finds a slot for every id while one is free, deterministically.

Costs per ``remap`` of ``N`` ids: a sort of the ``N`` ids' low words (one
array; duplicates are admitted once; a batch with two ids of one low word and
different high words sorts the pairs instead), ``N`` binary searches, and, in
steps that admit, a merge of the admitted ids into the sorted copy: ``O(S)``
element-wise work and scatters, no sort (a ``lax.cond``: skipped in steps that
admit nothing). Eviction finds the lowest scores by three binary searches on
the score values (``O(S)`` counts each, no sort), compacts the small copy of
recent admissions (``O(K)``) and marks the evicted ids' entries of the main
sorted copy as stale (a binary search each; *lazy deletion*: a stale entry
keeps its id, so the copy stays sorted, and slot ``S``, so lookups skip it),
leaving them in place until the next merge into the main copy, which drops
them. Measured figures: ``docs/managed.md``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._rounding import mix32
from ._state import RemapState

__all__ = [
    "INT32_MAX",
    "admission_draw",
    "decayed_counts",
    "evict",
    "id_hash",
    "lookup_and_admit",
    "rebuild_search",
    "saturating_add",
]

INT32_MAX = np.iinfo(np.int32).max


def decayed_counts(counts: jax.Array, last_seen: jax.Array, step, half_life: int):
    """The lookup counts as of ``step`` when they halve every ``half_life``
    steps (at each step that is a multiple of it, before its lookups): a
    count last updated at step ``l`` has halved ``step // h - l // h`` times
    since (``half_life`` 0: no decay)."""
    if not half_life:
        return counts
    halvings = jnp.asarray(step) // half_life - last_seen // half_life
    return counts >> jnp.clip(halvings, 0, 31)


def evict(
    state: RemapState,
    policy: str,
    evict_count: int,
    half_life: int = 0,
    ttl: int = 0,
) -> tuple[RemapState, jax.Array]:
    """Free slots until ``evict_count`` are free: the ``max(0, E - free)``
    occupied slots lowest by the policy's scores (``"lfu"``: lookups, decayed
    with a ``half_life``, then the step last seen; ``"lru"``: the other way
    round; then the slot). With a ``ttl``, the ids not looked up in the last
    ``ttl`` steps (``step - last_seen > ttl``) go first (least recently seen
    first, then the lower slot), and go whatever the pressure:
    ``min(E, max(E - free, expired))`` slots.

    Returns ``(new_state, evicted)``: the evicted slots in increasing order,
    ``int32[evict_count]``, unused entries ``S``.
    """
    S, E = state.num_slots, evict_count
    need = jnp.maximum(E - state.num_free, 0)
    counts = decayed_counts(state.counts, state.last_seen, state.step, half_life)
    if policy == "lfu":
        first, then = counts, state.last_seen
    else:
        first, then = state.last_seen, counts
    if ttl:
        expired = state.occupied & (state.step - state.last_seen > ttl)
        need = jnp.minimum(E, jnp.maximum(need, jnp.sum(expired, dtype=jnp.int32)))
        first = jnp.where(expired, 0, jnp.minimum(first, INT32_MAX - 1) + 1)
        then = jnp.where(expired, state.last_seen, then)  # least recent first
    chosen = _lowest(first, then, state.occupied, need)
    # the evicted slots in increasing order, unused entries S
    evicted = jnp.nonzero(chosen, size=E, fill_value=S)[0].astype(jnp.int32)
    rank = jnp.arange(E, dtype=jnp.int32)
    # the evicted ids (their main-copy entries are marked stale below)
    gone = (
        evicted,
        state.ids_hi.at[evicted].get(mode="fill", fill_value=0),
        state.ids_lo.at[evicted].get(mode="fill", fill_value=0),
    )
    occupied = state.occupied.at[evicted].set(False, mode="drop")
    zero_u, zero_i = jnp.uint32(0), jnp.int32(0)
    # push onto the free stack, in slot order
    push_at = jnp.where(rank < need, state.num_free + rank, S)
    state = state._replace(
        occupied=occupied,
        ids_hi=state.ids_hi.at[evicted].set(zero_u, mode="drop"),
        ids_lo=state.ids_lo.at[evicted].set(zero_u, mode="drop"),
        counts=state.counts.at[evicted].set(zero_i, mode="drop"),
        last_seen=state.last_seen.at[evicted].set(zero_i, mode="drop"),
        free_slots=state.free_slots.at[push_at].set(evicted, mode="drop"),
        num_free=state.num_free + need,
        evictions=saturating_add(state.evictions, need),
    )
    return jax.lax.cond(need > 0, _drop_evicted, lambda *a: a[0], state, *gone), evicted


def _kth_smallest(x: jax.Array, k: jax.Array, candidate: jax.Array) -> jax.Array:
    """The ``k``-th smallest of the candidates of ``x`` (``1 <= k <=`` their
    number; non-negative ``int32``).

    A binary search on the value between the candidates' least and greatest:
    ``log2(range) + 2`` passes of a count over ``x``, ``O(S)`` each, no sort
    (a sort of ``2**20`` slots costs about 1 s on XLA's CPU).
    """
    low = jnp.min(jnp.where(candidate, x, INT32_MAX))
    high = jnp.max(jnp.where(candidate, x, 0))

    def body(bounds):
        low, high = bounds
        mid = low + (high - low) // 2
        enough = jnp.sum(candidate & (x <= mid), dtype=jnp.int32) >= k
        return jnp.where(enough, low, mid + 1), jnp.where(enough, mid, high)

    low, _ = jax.lax.while_loop(lambda b: b[0] < b[1], body, (low, high))
    return low


def _lowest(
    first: jax.Array, then: jax.Array, occupied: jax.Array, need: jax.Array
) -> jax.Array:
    """The ``need`` occupied slots lowest by ``(first, then, slot)``, as a mask.

    Exactly the first ``need`` of a sort by that key, found with three
    value searches (:func:`_kth_smallest`): below the threshold of ``first``
    every slot goes; at it, the lowest by ``then``; at both, the lowest slots.
    """
    S = occupied.shape[0]
    k = jnp.maximum(need, 1)
    t1 = _kth_smallest(first, k, occupied)
    below1, at1 = occupied & (first < t1), occupied & (first == t1)
    k2 = k - jnp.sum(below1, dtype=jnp.int32)
    t2 = _kth_smallest(then, k2, at1)
    below2, at2 = at1 & (then < t2), at1 & (then == t2)
    k3 = k2 - jnp.sum(below2, dtype=jnp.int32)
    slot = jnp.arange(S, dtype=jnp.int32)
    t3 = _kth_smallest(slot, k3, at2)
    chosen = below1 | below2 | (at2 & (slot <= t3))
    return chosen & (need > 0)


def saturating_add(a: jax.Array, b: Any) -> jax.Array:
    b = jnp.asarray(b, jnp.int32)
    return jnp.where(a > INT32_MAX - b, INT32_MAX, a + b)


def _less(al, ah, bl, bh):
    """``(al, ah) < (bl, bh)``: ids ordered by their low word, then high."""
    return (al < bl) | ((al == bl) & (ah < bh))


def _search(
    copy: tuple[jax.Array, jax.Array, jax.Array],
    n: jax.Array,
    hi: jax.Array,
    lo: jax.Array,
    missing: int,
) -> tuple[jax.Array, jax.Array]:
    """Each id's slot in a sorted copy of ``n`` entries (``missing`` if absent)
    and its place there (the first entry not below it)."""
    sorted_hi, sorted_lo, sorted_slots = copy
    L = sorted_hi.shape[0]
    low = jnp.zeros(hi.shape, jnp.int32)
    high = jnp.broadcast_to(n, hi.shape).astype(jnp.int32)

    def body(_, bounds):
        low, high = bounds
        mid = (low + high) // 2
        m = jnp.minimum(mid, L - 1)
        go_right = (low < high) & _less(sorted_lo[m], sorted_hi[m], lo, hi)
        return (
            jnp.where(go_right, mid + 1, low),
            jnp.where(go_right | (low >= high), high, mid),
        )

    low, _ = jax.lax.fori_loop(0, math.ceil(math.log2(L + 1)), body, (low, high))
    at = jnp.minimum(low, L - 1)
    hit = (low < n) & (sorted_hi[at] == hi) & (sorted_lo[at] == lo)
    return jnp.where(hit, sorted_slots[at], missing), low


def _main(state: RemapState) -> tuple[jax.Array, jax.Array, jax.Array]:
    return state.sorted_hi, state.sorted_lo, state.sorted_slots


def _recent(state: RemapState) -> tuple[jax.Array, jax.Array, jax.Array]:
    return state.recent_hi, state.recent_lo, state.recent_slots


def _num_main(state: RemapState) -> jax.Array:
    """The entries of the main sorted copy, stale ones included."""
    return state.num_slots - state.num_free - state.num_recent + state.num_stale


def _flush(state: RemapState) -> RemapState:
    """The main copy without its stale entries, then the recent copy merged
    into it (``O(S)``) and emptied."""
    S, K = state.num_slots, state.recent_slots.shape[0]
    main, _ = _compact_sorted(_main(state), _num_main(state), state.sorted_slots < S)
    state = state._replace(
        sorted_hi=main[0],
        sorted_lo=main[1],
        sorted_slots=main[2],
        num_stale=jnp.zeros((), jnp.int32),
    )
    n_main = _num_main(state)
    _, place = _search(_main(state), n_main, state.recent_hi, state.recent_lo, S)
    rank = jnp.arange(K, dtype=jnp.int32)
    slots = jnp.where(rank < state.num_recent, state.recent_slots, S)
    merged = _merge_sorted(
        _main(state), n_main, (state.recent_hi, state.recent_lo, slots, place, rank), S
    )
    zeros_u, zeros_i = jnp.zeros((K,), jnp.uint32), jnp.zeros((K,), jnp.int32)
    return state._replace(
        sorted_hi=merged[0],
        sorted_lo=merged[1],
        sorted_slots=merged[2],
        recent_hi=zeros_u,
        recent_lo=zeros_u,
        recent_slots=zeros_i,
        num_recent=jnp.zeros((), jnp.int32),
    )


def _groups_by_low_word(
    hi: jax.Array, lo: jax.Array, valid: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Each id's group (the first place of its low word among the batch's
    sorted low words) and whether two valid ids of one group differ.

    A sort of one array: an order of magnitude cheaper on XLA's CPU than a
    sort with the ids' positions as a second operand. Two ids of one low word
    and different high words (rare for hashed 64-bit ids) send the batch to
    the exact path, :func:`_admit_exact`.
    """
    N = lo.shape[0]
    group = jnp.searchsorted(jax.lax.sort(lo), lo, side="left").astype(jnp.int32)
    at = jnp.where(valid, group, N)
    top = jnp.full((N,), 0, jnp.uint32).at[at].max(hi, mode="drop")
    bottom = jnp.full((N,), 0xFFFFFFFF, jnp.uint32).at[at].min(hi, mode="drop")
    mixed = jnp.any(valid & (top[group] != bottom[group]))
    return group, mixed


def _admit_fast(group, hi, lo, valid, found, place, num_free, free_slots):
    """Admission when a group is one id: per id, in batch order."""
    N, S = hi.shape[0], free_slots.shape[0]
    pos = jnp.arange(N, dtype=jnp.int32)
    at = jnp.where(valid, group, N)
    first_pos = jnp.full((N,), N, jnp.int32).at[at].min(pos, mode="drop")
    first = valid & (first_pos[group] == pos)
    new = first & (found == S)
    # rank of the new ids in the order of their low words (their groups)
    flags = jnp.zeros((N,), jnp.int32).at[jnp.where(new, group, N)].set(1, mode="drop")
    rank = (jnp.cumsum(flags, dtype=jnp.int32) - 1)[group]
    admitted = new & (rank < num_free)
    take = jnp.clip(num_free - 1 - rank, 0, S - 1)
    assigned = jnp.where(admitted, free_slots[take], S)
    slot_of_group = (
        jnp.full((N,), S, jnp.int32)
        .at[jnp.where(admitted, group, N)]
        .set(assigned, mode="drop")
    )
    rows = jnp.where(valid, jnp.where(found < S, found, slot_of_group[group]), S)
    return rows, hi, lo, assigned, place, rank


def _admit_exact(group, hi, lo, valid, found, place, num_free, free_slots):
    """Admission by a sort of the batch by (low, high) word: any ids."""
    del group
    N, S = hi.shape[0], free_slots.shape[0]
    pos = jnp.arange(N, dtype=jnp.int32)
    invalid = (~valid).astype(jnp.int32)
    inv_s, lo_s, hi_s, perm = jax.lax.sort((invalid, lo, hi, pos), num_keys=3)
    valid_s = inv_s == 0
    first = valid_s & jnp.concatenate(
        [jnp.ones((1,), bool), (hi_s[1:] != hi_s[:-1]) | (lo_s[1:] != lo_s[:-1])]
    )
    found, place = found[perm], place[perm]
    new = first & (found == S)
    rank = jnp.cumsum(new, dtype=jnp.int32) - 1
    admitted = new & (rank < num_free)
    take = jnp.clip(num_free - 1 - rank, 0, S - 1)
    assigned = jnp.where(admitted, free_slots[take], S)
    slot_first = jnp.where(found < S, found, assigned)
    run = jnp.cumsum(first, dtype=jnp.int32) - 1
    run_slot = (
        jnp.full((N,), S, jnp.int32)
        .at[jnp.where(first, run, N)]
        .set(slot_first, mode="drop")
    )
    slot_s = jnp.where(valid_s, run_slot[jnp.maximum(run, 0)], S)
    rows = (
        jnp.zeros((N,), jnp.int32)
        .at[perm]
        .set(slot_s, mode="drop", unique_indices=True)
    )
    return rows, hi_s, lo_s, assigned, place, rank


def id_hash(hi: jax.Array, lo: jax.Array) -> jax.Array:
    """A raw id's 32-bit hash (``uint32``): its admission filter bucket is
    ``id_hash % W``; the admission draw mixes it with the step."""
    return mix32(lo ^ mix32(hi + np.uint32(0x9E3779B9)))


def admission_draw(h: jax.Array, step: jax.Array) -> jax.Array:
    """The ``uint32`` draw of probabilistic admission of the id of hash ``h``
    at ``step``: an id is admissible when it is below the threshold
    ``floor(admit_probability * 2**32)``."""
    s = jnp.asarray(step).astype(jnp.uint32)
    return mix32(h ^ mix32(s * np.uint32(0x85EBCA6B) + np.uint32(0x7F4A7C15)))


def _count_in_filter(state, hi, lo, new):
    """The admission filter's count of each new id after this batch, and a
    function of the admitted ids giving the filter's new arrays.

    The rule (``docs/managed.md``, "Admission"), in the order of the
    distinct new ids' (low, high) words: an id whose bucket holds it adds
    its occurrences in the batch to the bucket's count; any other id takes
    the bucket (the id there loses its count) with its occurrences. After
    admission an admitted id's bucket, if it still holds it, is emptied.
    One sort of the batch by (bucket, low, high).
    """
    N, W = hi.shape[0], state.filter_counts.shape[0]
    bucket = (id_hash(hi, lo) % np.uint32(W)).astype(jnp.int32)
    pos = jnp.arange(N, dtype=jnp.int32)
    not_new = (~new).astype(jnp.int32)
    ns, b, lo_s, hi_s, perm = jax.lax.sort((not_new, bucket, lo, hi, pos), num_keys=4)
    new_s = ns == 0
    start = jnp.ones((1,), bool)
    same_bucket = jnp.concatenate([~start, b[1:] == b[:-1]]) & new_s
    same_id = same_bucket & jnp.concatenate(
        [~start, (lo_s[1:] == lo_s[:-1]) & (hi_s[1:] == hi_s[:-1])]
    )
    first_id = new_s & ~same_id
    run = jnp.cumsum(first_id, dtype=jnp.int32) - 1
    at = jnp.where(new_s, run, N)
    occ = jnp.zeros((N,), jnp.int32).at[at].add(1, mode="drop")[jnp.maximum(run, 0)]
    b_safe = jnp.where(new_s, b, 0)
    old_hi, old_lo = state.filter_hi[b_safe], state.filter_lo[b_safe]
    old_count = state.filter_counts[b_safe]
    held = (
        first_id & ~same_bucket & (old_count > 0) & (old_hi == hi_s) & (old_lo == lo_s)
    )
    counted = saturating_add(jnp.where(held, old_count, 0), occ)
    count_run = (
        jnp.zeros((N,), jnp.int32)
        .at[jnp.where(first_id, run, N)]
        .set(counted, mode="drop")
    )
    count_s = jnp.where(new_s, count_run[jnp.maximum(run, 0)], 0)
    count = jnp.zeros((N,), jnp.int32).at[perm].set(count_s, unique_indices=True)
    # the last entry of each bucket: its id is what the bucket holds after
    last = new_s & jnp.concatenate([b[1:] != b[:-1], start]) | (
        new_s & jnp.concatenate([~new_s[1:], start])
    )

    def written(admitted: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        keep = last & ~admitted[perm]
        to = jnp.where(last, b, W)
        return (
            state.filter_hi.at[to].set(jnp.where(keep, hi_s, 0), mode="drop"),
            state.filter_lo.at[to].set(jnp.where(keep, lo_s, 0), mode="drop"),
            state.filter_counts.at[to].set(jnp.where(keep, count_s, 0), mode="drop"),
        )

    return count, written


def lookup_and_admit(
    state: RemapState,
    hi: jax.Array,
    lo: jax.Array,
    valid: jax.Array,
    min_count: int = 1,
    threshold: int = -1,
    half_life: int = 0,
) -> tuple[jax.Array, RemapState]:
    """Each valid id's slot (``[N]``, ``S``: no row), the new ones admitted.

    ``hi``/``lo``: the ids' words (``uint32[N]``), ``valid``: ``bool[N]``.
    Counts and last-seen steps of the looked-up slots updated; the state's
    ``step`` is the caller's (already advanced). A new id is admissible when
    the admission filter has seen it ``min_count`` times (this batch's
    occurrences included; the filter counts only when ``min_count > 1``) and,
    with a ``threshold`` (``-1``: none), when its draw is below it; an id
    that is not admissible is served by the default. With a ``half_life``
    the looked-up slots' counts are decayed to this step before they count
    this batch (:func:`decayed_counts`).
    """
    S, K = state.num_slots, state.recent_slots.shape[0]
    N = hi.shape[0]
    if N == 0:
        return jnp.zeros((0,), jnp.int32), state
    # Admissions go to the recent copy when the whole batch would fit there
    # (static: N <= K), after a flush if it might not; else to the main copy.
    # A flush also drops the stale entries of the main copy: admissions into
    # it (N > K) need them gone first.
    into_recent = N <= K
    if into_recent:
        full = state.num_recent + N > K
    else:
        full = (state.num_recent > 0) | (state.num_stale > 0)
    state = jax.lax.cond(full, _flush, lambda s: s, state)
    found, place = _search(_main(state), _num_main(state), hi, lo, S)
    if into_recent:
        in_recent, place = _search(_recent(state), state.num_recent, hi, lo, S)
        found = jnp.where(in_recent < S, in_recent, found)
    looked_up = valid
    filtered = min_count > 1 or threshold >= 0
    if filtered:  # new ids that may not take a slot yet: served by the default
        new = valid & (found == S)
        admissible = new
        if min_count > 1:
            count, written = _count_in_filter(state, hi, lo, new)
            admissible = admissible & (count >= min_count)
        if threshold >= 0:
            draw = admission_draw(id_hash(hi, lo), state.step)
            admissible = admissible & (draw < np.uint32(threshold))
        valid = valid & ((found < S) | admissible)
    group, mixed = _groups_by_low_word(hi, lo, valid)
    rows, hi_s, lo_s, assigned, place, rank = jax.lax.cond(
        mixed,
        _admit_exact,
        _admit_fast,
        group, hi, lo, valid, found, place, state.num_free, state.free_slots,
    )  # fmt: skip
    admitted = assigned < S
    if min_count > 1:  # the filter after admission
        f_hi, f_lo, f_counts = written(valid & (found == S) & (rows < S))
        state = state._replace(filter_hi=f_hi, filter_lo=f_lo, filter_counts=f_counts)

    n_admitted = jnp.sum(admitted, dtype=jnp.int32)
    target = jnp.where(admitted, assigned, S)  # admitted ids' slots, else dropped
    counts = state.counts.at[target].set(0, mode="drop")
    if half_life:  # the looked-up counts decayed to this step first
        decayed = decayed_counts(
            counts.at[rows].get(mode="fill", fill_value=0),
            state.last_seen.at[rows].get(mode="fill", fill_value=0),
            state.step,
            half_life,
        )
        counts = counts.at[rows].set(decayed, mode="drop")
    before = counts.at[rows].get(mode="fill", fill_value=0)
    counts = counts.at[rows].add(1, mode="drop")
    wrapped = counts.at[rows].get(mode="fill", fill_value=0) < before
    counts = counts.at[jnp.where(wrapped, rows, S)].set(INT32_MAX, mode="drop")
    new = (hi_s, lo_s, assigned, place, rank)
    if into_recent:
        copy, n_old = _recent(state), state.num_recent
    else:
        copy, n_old = _main(state), _num_main(state)
    copy = jax.lax.cond(
        n_admitted > 0,
        lambda c: _merge_sorted(c, n_old, new, S),
        lambda c: c,
        copy,
    )
    fields = ("recent" if into_recent else "sorted") + "_{}"
    state = state._replace(
        ids_hi=state.ids_hi.at[target].set(hi_s, mode="drop"),
        ids_lo=state.ids_lo.at[target].set(lo_s, mode="drop"),
        occupied=state.occupied.at[target].set(True, mode="drop"),
        counts=counts,
        last_seen=state.last_seen.at[rows].set(state.step, mode="drop"),
        num_free=state.num_free - n_admitted,
        num_recent=state.num_recent + (n_admitted if into_recent else 0),
        admissions=saturating_add(state.admissions, n_admitted),
        defaulted=saturating_add(
            state.defaulted, jnp.sum(looked_up & (rows == S), dtype=jnp.int32)
        ),
        **dict(zip(map(fields.format, ("hi", "lo", "slots")), copy, strict=True)),
    )
    return rows, state


def _prefix_sum(x: jax.Array) -> jax.Array:
    # associative_scan: 4x faster than jnp.cumsum on XLA's CPU (measured, 2**20)
    return jax.lax.associative_scan(jnp.add, x)


def _merge_sorted(
    copy: tuple[jax.Array, jax.Array, jax.Array],
    n_old: jax.Array,
    new: tuple,
    S: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Admitted ids merged into a sorted copy of ``n_old`` entries: O(L), no sort.

    ``new``: ids, their slots (``S`` where not admitted), their insertion
    places in the old copy and their ranks among the admitted. An old entry
    ``j`` moves up by the number of admitted ids placed at or before it;
    admitted id ``r`` goes to ``place + r``.
    """
    hi, lo, slots, place, rank = new
    L = copy[0].shape[0]
    admitted = slots < S
    per_place = (
        jnp.zeros((L + 1,), jnp.int32)
        .at[jnp.where(admitted, place, L + 1)]
        .add(1, mode="drop")
    )
    j = jnp.arange(L, dtype=jnp.int32)
    old_to = jnp.where(j < n_old, j + _prefix_sum(per_place)[:L], L)
    new_to = jnp.where(admitted, place + rank, L)

    def merged(old: jax.Array, added: jax.Array) -> jax.Array:
        out = jnp.zeros_like(old).at[old_to].set(old, mode="drop", unique_indices=True)
        return out.at[new_to].set(added.astype(old.dtype), mode="drop")

    return tuple(map(merged, copy, (hi, lo, slots)))


def _compact_sorted(
    copy: tuple[jax.Array, jax.Array, jax.Array],
    n_old: jax.Array,
    live: jax.Array,
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
    """A sorted copy with only its ``live`` entries (``[L]``): O(L), no sort.

    Returns the copy and its new number of entries.
    """
    L = copy[0].shape[0]
    j = jnp.arange(L, dtype=jnp.int32)
    keep = (j < n_old) & live
    to = jnp.where(keep, _prefix_sum(keep.astype(jnp.int32)) - 1, L)

    def compact(x: jax.Array) -> jax.Array:
        return jnp.zeros_like(x).at[to].set(x, mode="drop", unique_indices=True)

    return tuple(map(compact, copy)), jnp.sum(keep, dtype=jnp.int32)


def _drop_evicted(
    state: RemapState, evicted: jax.Array, hi: jax.Array, lo: jax.Array
) -> RemapState:
    """The evicted ids out of the sorted copies: the recent copy compacted
    (``O(K)``), their entries of the main copy marked stale (slot ``S``; a
    binary search each, ``O(E log S)``), not moved.

    ``evicted``: the evicted slots (``S`` in unused entries) and their ids.
    ``state`` is the state after the eviction's other updates (slots
    freed); its main copy still holds the evicted ids, so its entries are
    the count before them.
    """
    S = state.num_slots
    K = state.recent_slots.shape[0]
    recent_slots = state.recent_slots
    in_recent = (jnp.arange(K) < state.num_recent) & state.occupied[recent_slots]
    recent, num_recent = _compact_sorted(_recent(state), state.num_recent, in_recent)
    n_evicted = jnp.sum(evicted < S, dtype=jnp.int32)
    n_main = _num_main(state) + n_evicted
    found, place = _search(_main(state), n_main, hi, lo, S)
    stale = (evicted < S) & (found == evicted)
    sorted_slots = state.sorted_slots.at[jnp.where(stale, place, S)].set(S, mode="drop")
    return state._replace(
        sorted_slots=sorted_slots,
        recent_hi=recent[0],
        recent_lo=recent[1],
        recent_slots=recent[2],
        num_recent=num_recent,
        num_stale=state.num_stale + jnp.sum(stale, dtype=jnp.int32),
    )


def rebuild_search(state: RemapState) -> RemapState:
    """The search structure made again from the slot table alone.

    The main sorted copy holds every tracked id (the occupied slots' ids,
    sorted by low word, then high word, and their slots; zeros after them),
    the recent copy is empty and nothing is stale: the state a long run of
    flushes would have reached. Every lookup, admission and eviction from it
    gives what the original state gives (they read only which raw id owns
    which slot, the counters and the free stack); only when later flushes
    happen differs.
    """
    S, K = state.num_slots, state.recent_slots.shape[0]
    slot = jnp.arange(S, dtype=jnp.int32)
    free = (~state.occupied).astype(jnp.int32)
    _, lo, hi, slots = jax.lax.sort(
        (free, state.ids_lo, state.ids_hi, slot), num_keys=3
    )
    live = slot < jnp.sum(state.occupied, dtype=jnp.int32)
    zeros_u, zeros_i = jnp.zeros((K,), jnp.uint32), jnp.zeros((K,), jnp.int32)
    return state._replace(
        sorted_hi=jnp.where(live, hi, jnp.uint32(0)),
        sorted_lo=jnp.where(live, lo, jnp.uint32(0)),
        sorted_slots=jnp.where(live, slots, 0),
        recent_hi=zeros_u,
        recent_lo=zeros_u,
        recent_slots=zeros_i,
        num_recent=jnp.zeros((), jnp.int32),
        num_stale=jnp.zeros((), jnp.int32),
    )
