"""Managed-collision remap (``jaxslices.managed``): the state against a NumPy model.

The model (:class:`Model`) is the policy of ``docs/managed.md`` written with
Python dicts and lists: admission of a batch's distinct new ids into free
slots in the order of their (unsigned 64-bit) values, the free slots a stack,
eviction every ``evict_every`` calls before admission, LFU / LRU scores with
their tie-breaks. Hypothesis draws id streams (64-bit values, repeats, masked
entries); every call's rows, evicted slots and the whole state must equal the
model's.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxslices as js

U64 = 2**64


M32 = 0xFFFFFFFF


def mix32(h: int) -> int:
    """MurmurHash3's 32-bit finaliser on a Python int."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def id_hash(v: int) -> int:
    """docs/managed.md's hash of the raw id ``v`` (unsigned 64-bit)."""
    hi, lo = v >> 32, v & M32
    return mix32(lo ^ mix32((hi + 0x9E3779B9) & M32))


def admission_draw(h: int, step: int) -> int:
    return mix32(h ^ mix32((step * 0x85EBCA6B + 0x7F4A7C15) & M32))


class Model:
    """The remap policy in plain Python."""

    def __init__(
        self, S: int, policy: str, evict_every: int | None, E: int,
        min_count: int = 1, threshold: int = -1, W: int = 1,
        half_life: int = 0, ttl: int = 0,
    ):  # fmt: skip
        self.S, self.policy, self.every, self.E = S, policy, evict_every, E
        self.half_life, self.ttl = half_life, ttl
        self.min_count, self.threshold, self.W = min_count, threshold, W
        self.ids: list[int | None] = [None] * S
        self.counts, self.last = [0] * S, [0] * S
        self.free = list(range(S - 1, -1, -1))
        self.step = self.admissions = self.evictions = self.defaulted = 0
        self.filter: list[tuple[int, int]] = [(0, 0)] * W  # (id, count); 0: empty

    def admissible(self, new: list[int], seen: dict[int, int]) -> list[int]:
        """The admission filter and draw over the new ids (in admission order)."""
        out = []
        for v in new:
            h, ok = id_hash(v), True
            if self.min_count > 1:
                b = h % self.W
                held, count = self.filter[b]
                c = min((count if count and held == v else 0) + seen[v], 2**31 - 1)
                self.filter[b] = (v, c)
                ok = c >= self.min_count
            if self.threshold >= 0:
                ok = ok and admission_draw(h, self.step) < self.threshold
            if ok:
                out.append(v)
        return out

    def count(self, s: int) -> int:
        """Slot ``s``'s lookups as of this step (halved every half_life steps)."""
        if not self.half_life:
            return self.counts[s]
        h = self.half_life
        return self.counts[s] >> min(max(self.step // h - self.last[s] // h, 0), 31)

    def evict(self) -> list[int]:
        need = max(0, self.E - len(self.free))
        occupied = [s for s in range(self.S) if self.ids[s] is not None]
        expired = {
            s for s in occupied if self.ttl and self.step - self.last[s] > self.ttl
        }
        need = min(self.E, max(need, len(expired)))

        def key(s):
            if s in expired:  # first, least recently seen first
                return (0, self.last[s], s)
            if self.policy == "lfu":
                return (1, self.count(s), self.last[s], s)
            return (1, self.last[s], self.count(s), s)

        occupied.sort(key=key)
        gone = sorted(occupied[:need])  # returned and freed in slot order
        for s in gone:
            self.ids[s], self.counts[s], self.last[s] = None, 0, 0
            self.free.append(s)
        self.evictions += need
        return gone + [self.S] * (self.E - need)

    def remap(self, ids: list[int], mask: list[bool]) -> tuple[list[int], list[int]]:
        self.step += 1
        due = self.every is not None and self.step % self.every == 0
        evicted = self.evict() if due else [self.S] * self.E
        where = {v: s for s, v in enumerate(self.ids) if v is not None}
        new = {i % U64 for i, m in zip(ids, mask, strict=True) if m} - set(where)
        new = sorted(new, key=lambda v: (v & 0xFFFFFFFF, v >> 32))  # low word first
        seen: dict[int, int] = {}
        for i, m in zip(ids, mask, strict=True):
            if m:
                seen[i % U64] = seen.get(i % U64, 0) + 1
        for v in self.admissible(new, seen):
            if not self.free:
                break
            s = self.free.pop()
            where[v], self.ids[s], self.counts[s] = s, v, 0
            self.admissions += 1
            if self.min_count > 1 and self.filter[id_hash(v) % self.W][0] == v:
                self.filter[id_hash(v) % self.W] = (0, 0)  # it leaves the filter
        rows = [
            where.get(i % U64, self.S) if m else self.S
            for i, m in zip(ids, mask, strict=True)
        ]
        for r, m in zip(rows, mask, strict=True):
            if m and r < self.S:
                self.counts[r] = self.count(r) + 1  # decayed first
                self.last[r] = self.step
            elif m:
                self.defaulted += 1
        return rows, evicted

    def check(self, state: js.RemapState) -> None:
        hi = np.asarray(state.ids_hi).astype(np.uint64)
        lo = np.asarray(state.ids_lo).astype(np.uint64)
        got = [int(h) << 32 | int(low) for h, low in zip(hi, lo, strict=True)]
        occupied = np.asarray(state.occupied).tolist()
        assert occupied == [v is not None for v in self.ids]
        assert [
            g if o else None for g, o in zip(got, occupied, strict=True)
        ] == self.ids
        assert np.asarray(state.counts).tolist() == self.counts
        assert np.asarray(state.last_seen).tolist() == self.last
        n = int(state.num_free)
        assert np.asarray(state.free_slots)[:n].tolist() == self.free
        check_sorted_copies(state)
        held = (np.asarray(state.filter_hi).astype(np.uint64) << np.uint64(32)) | (
            np.asarray(state.filter_lo).astype(np.uint64)
        )
        got_filter = list(zip(held.tolist(), state.filter_counts.tolist(), strict=True))
        assert got_filter == [(v if c else 0, c) for v, c in self.filter]
        stats = {k: int(v) for k, v in state.stats().items()}
        assert stats == {
            "occupancy": self.S - len(self.free),
            "admissions": self.admissions,
            "evictions": self.evictions,
            "defaulted": self.defaulted,
            "step": self.step,
        }


def check_sorted_copies(state: js.RemapState) -> None:
    """The sorted copies hold every tracked id once, with its slot, in order.

    The main copy's first ``occupancy - num_recent + num_stale`` entries and
    the recent copy's ``num_recent`` are strictly increasing by (low, high)
    word, zeros after them; ``num_stale`` main entries are stale (slot ``S``,
    an id no longer tracked in the main copy: lazy deletion), the others are
    the tracked ids and their slots.
    """
    S = state.num_slots
    tracked = {
        (int(lo), int(hi)): s
        for s, (hi, lo, o) in enumerate(
            zip(
                state.ids_hi.tolist(),
                state.ids_lo.tolist(),
                state.occupied.tolist(),
                strict=True,
            )
        )
        if o
    }
    n_recent, n_stale = int(state.num_recent), int(state.num_stale)
    n_main = len(tracked) - n_recent + n_stale
    live = {}
    for prefix, n in (("sorted", n_main), ("recent", n_recent)):
        hi, lo, slots = (np.asarray(getattr(state, f"{prefix}_{f}")) for f in
                         ("hi", "lo", "slots"))  # fmt: skip
        keys = list(zip(lo[:n].tolist(), hi[:n].tolist(), strict=True))
        assert keys == sorted(set(keys)), f"{prefix}: not strictly increasing"
        assert not (hi[n:].any() or lo[n:].any() or slots[n:].any()), prefix
        stale = slots[:n] == S
        if prefix == "sorted":
            assert int(stale.sum()) == n_stale
        else:
            assert not stale.any()
        for key, slot in zip(keys, slots[:n].tolist(), strict=True):
            if slot < S:
                assert key not in live, f"{key} twice"
                live[key] = slot
    assert live == tracked


BATCH = 6
#: a small pool of raw ids (64-bit, negative, 32-bit edges): streams repeat ids
POOL = [0, 1, 7, -1, 2**31 - 1, 2**32, 2**32 + 1, 2**40 + 7, -(2**63), 2**63 - 1]

stream = st.lists(
    st.lists(
        st.tuples(st.sampled_from(POOL), st.booleans() | st.just(True)),
        min_size=BATCH,
        max_size=BATCH,
    ),
    min_size=1,
    max_size=7,
)


#: (policy, slots, recent copy, ids per call): batches straight into the main
#: sorted copy (more ids than the recent copy holds), and through the recent
#: copy with a flush every call or two
MODEL_CONFIGS = [("lfu", 4, None, BATCH), ("lru", 4, None, BATCH), ("lru", 6, 5, 4)]


@pytest.mark.parametrize("policy,slots,recent,size", MODEL_CONFIGS)
@settings(max_examples=12, deadline=None)
@given(batches=stream)
def test_remap_equals_the_numpy_model(policy, slots, recent, size, batches):
    mc = js.ManagedCollision(
        "t", num_slots=slots, policy=policy, evict_every=2, evict_count=2,
        recent_size=recent,
    )  # fmt: skip
    remap = mc.remap  # compiled once per policy and shape, eagerly too
    model = Model(slots, policy, 2, 2)
    state = mc.init()
    for batch in batches:
        ids = [i for i, _ in batch][:size]
        mask = [m for _, m in batch][:size]
        rows, state, evicted = remap(
            state, js.RawIds.from_int64(np.array(ids, np.int64)), np.array(mask)
        )
        want_rows, want_evicted = model.remap(ids, mask)
        assert np.asarray(rows).tolist() == want_rows
        assert np.asarray(evicted).tolist() == want_evicted
        model.check(state)
    state, evicted = mc.evict(state)  # on demand too
    assert np.asarray(evicted).tolist() == model.evict()
    model.check(state)


#: The policies beyond admission and plain LFU / LRU, each against the model:
#: an admission filter small enough that ids take each other's buckets, the
#: admission draw alone, both; a decayed LFU, a time-to-live with LRU, and
#: both with a filter (streams of up to 7 calls: several halvings, expiries).
POLICY_CONFIGS = {
    "filter": dict(policy="lfu", min_count=2, filter_size=3),
    "draw": dict(policy="lru", admit_probability=0.5),
    "filter_draw": dict(
        policy="lru", min_count=3, admit_probability=0.7, filter_size=2
    ),
    "decayed_lfu": dict(policy="lfu", half_life=2),
    "ttl_lru": dict(policy="lru", ttl=2, evict_every=1),
    "decayed_ttl_filter": dict(half_life=3, ttl=2, evict_every=1, min_count=2),
}


@pytest.mark.parametrize("native", [True, False], ids=["native", "xla"])
@pytest.mark.parametrize("config", sorted(POLICY_CONFIGS))
@settings(max_examples=10, deadline=None)
@given(batches=stream)
def test_the_policies_equal_the_numpy_model(native, config, batches):
    """Every call's rows, evictions and state as the model's, then an
    eviction on demand, on one path."""
    mc = js.ManagedCollision(
        "t", **{"num_slots": 5, "evict_every": 2, "evict_count": 2,
                **POLICY_CONFIGS[config]},
    )  # fmt: skip
    model = Model(
        mc.num_slots, mc.policy, mc.evict_every, mc.evict_count, mc.min_count,
        mc.admit_threshold, mc.filter_capacity, mc.half_life or 0, mc.ttl or 0,
    )  # fmt: skip
    state = mc.init()
    with contextlib.nullcontext() if native else js.kernels.disabled():
        for batch in batches:
            ids, mask = [i for i, _ in batch], [m for _, m in batch]
            rows, state, evicted = mc.remap(
                state, js.RawIds.from_int64(np.array(ids, np.int64)), np.array(mask)
            )
            assert (rows.tolist(), evicted.tolist()) == model.remap(ids, mask)
            model.check(state)
        state, evicted = mc.evict(state)
    assert evicted.tolist() == model.evict()
    model.check(state)


def test_ttl_evicts_without_pressure_and_half_life_forgets():
    """An id unseen for ``ttl`` calls goes though slots are free; under a
    decayed LFU an id popular long ago loses to one popular now."""
    mc = js.ManagedCollision("t", num_slots=8, evict_every=1, evict_count=2, ttl=2)
    _, state, _ = mc.remap(mc.init(), [1, 2])
    for _ in range(2):
        _, state, evicted = mc.remap(state, [2])
    assert evicted.tolist() == [8, 8]  # 1 unseen for 2 calls: not yet
    _, state, evicted = mc.remap(state, [2])
    assert evicted.tolist() == [0, 8]  # unseen for 3 calls > ttl: evicted
    plain = js.ManagedCollision("p", num_slots=2, evict_count=1)
    decayed = js.ManagedCollision("d", num_slots=2, evict_count=1, half_life=2)
    for mc, gone in ((plain, [1]), (decayed, [0])):
        _, state, _ = mc.remap(mc.init(), [5, 5, 5, 5, 5, 5])  # 5: popular once
        for _ in range(5):
            _, state, _ = mc.remap(state, [6])  # 6: popular now, 5 lookups
        state, evicted = mc.evict(state)
        assert evicted.tolist() == gone, mc  # plain LFU keeps the stale 5


def test_an_id_seen_once_never_takes_a_slot():
    """min_count=2 on a stream where half the distinct ids come once: none of
    those ever gets a row (the filter never counts more than it saw), while
    the ids seen again do, on both paths alike."""
    rng = np.random.default_rng(0)
    repeated = rng.choice(2**40, 300, replace=False)
    once = rng.choice(2**40, 300, replace=False) + 2**41
    stream = np.concatenate([repeated, repeated, once])
    rng.shuffle(stream)
    batches = stream.reshape(-1, 50)
    mc = js.ManagedCollision(
        "t", num_slots=256, min_count=2, filter_size=512, evict_every=1,
        evict_count=8,
    )  # fmt: skip
    results = []
    for native in (True, False):
        state, got = mc.init(), set()
        with contextlib.nullcontext() if native else js.kernels.disabled():
            for b in batches:
                rows, state, _ = mc.remap(state, b.astype(np.int64))
                got |= {
                    int(i) for i, r in zip(b, rows.tolist(), strict=True) if r < 256
                }
        assert not got & set(once.tolist())
        assert len(got) > 150, len(got)  # most repeated ids made it
        results.append(jax.tree.leaves(state))
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_state_saved_before_the_filter_restores_with_an_empty_one():
    mc = js.ManagedCollision("t", num_slots=8, min_count=2)
    _, state, _ = mc.remap(mc.init(), [3, 3, 4])
    assert int(state.filter_counts.sum()) == 1  # 4 counted once; 3 admitted
    old = {k: v for k, v in state._asdict().items() if not k.startswith("filter")}
    restored = mc.restore(old)
    assert int(restored.filter_counts.sum()) == 0
    rows, _, _ = mc.remap(restored, [3, 4])
    assert rows.tolist() == [0, 8]  # 3 tracked; 4 counted afresh, once


def test_admission_filter_arguments():
    with pytest.raises(ValueError, match=r"`min_count` must be an int >= 1.* got 0"):
        js.ManagedCollision("t", num_slots=4, min_count=0)
    with pytest.raises(ValueError, match=r"`admit_probability` .*\(0, 1\], got 0"):
        js.ManagedCollision("t", num_slots=4, admit_probability=0)
    with pytest.raises(ValueError, match=r"filter_size=8.*min_count"):
        js.ManagedCollision("t", num_slots=4, filter_size=8)
    with pytest.raises(ValueError, match=r"`half_life=3` decays LFU.*'lru'"):
        js.ManagedCollision("t", num_slots=4, policy="lru", half_life=3)
    with pytest.raises(ValueError, match=r"`ttl` must be a positive int.*got 0"):
        js.ManagedCollision("t", num_slots=4, ttl=0)
    mc = js.ManagedCollision("t", num_slots=4, min_count=2)
    assert mc.filter_capacity == 4 and mc.admit_threshold == -1
    with pytest.raises(ValueError, match=r"admission filter: \(4,\), the table \(1,\)"):
        js.ManagedCollision("t", num_slots=4).remap(mc.init(), [1])


@settings(max_examples=15, deadline=None)
@given(
    batches=st.lists(
        st.lists(st.integers(-(2**63), 2**63 - 1), min_size=5, max_size=5),
        min_size=1,
        max_size=5,
    )
)
def test_no_collision_while_free_slots_remain(batches):
    """Every distinct id gets its own row as long as the table has room."""
    mc = js.ManagedCollision("t", num_slots=25)  # 5 batches x 5 ids fit
    remap = mc.remap
    state, seen = mc.init(), {}
    for batch in batches:
        rows, state, _ = remap(state, js.RawIds.from_int64(np.array(batch, np.int64)))
        for i, r in zip(batch, np.asarray(rows).tolist(), strict=True):
            assert r < 25  # never the default while slots are free
            assert seen.setdefault(i, r) == r  # one id, one row, every time
    assert len(set(seen.values())) == len(seen)  # no two ids share a row
    assert int(state.occupancy) == len(seen) and int(state.defaulted) == 0


@pytest.mark.parametrize("native", [True, False])
def test_an_evicted_id_is_stale_in_the_main_copy_until_the_next_flush(native):
    """Lazy deletion: eviction marks the main copy's entry, moves nothing."""
    mc = js.ManagedCollision(
        "t", num_slots=4, policy="lru", evict_count=1, recent_size=4
    )
    model = Model(4, "lru", None, 1)

    def remap(state, ids):
        with contextlib.nullcontext() if native else js.kernels.disabled():
            rows, state, _ = mc.remap(state, np.array(ids, np.int64))
        assert rows.tolist() == model.remap(ids, [True] * len(ids))[0]
        model.check(state)
        return rows.tolist(), state

    _, state = remap(mc.init(), [1, 2, 3, 4])  # into the recent copy
    _, state = remap(state, [1])  # a flush: 1..4 into the main copy
    assert int(state.num_recent) == 0
    with contextlib.nullcontext() if native else js.kernels.disabled():
        state, evicted = mc.evict(state)
    assert evicted.tolist() == model.evict() == [1]  # id 2, least recently seen
    model.check(state)
    assert int(state.num_stale) == 1
    assert state.sorted_slots.tolist() == [0, 4, 2, 3]  # id 2's entry, stale
    assert state.sorted_lo.tolist() == [1, 2, 3, 4]  # in place: nothing moved
    rows, state = remap(state, [2, 3])  # 2 again: skips its stale entry
    assert rows == [1, 2] and int(state.num_stale) == 1
    assert int(state.num_recent) == 1  # 2 admitted into the recent copy
    rows, state = remap(state, [2, 5, 6, 7])  # a flush: the stale entry dropped
    assert rows == [1, 4, 4, 4] and int(state.num_stale) == 0
    assert state.sorted_slots.tolist() == [0, 1, 2, 3]


def test_a_state_restored_from_its_slot_table_remaps_as_the_saved_one():
    """The search structure is derived: ``restore`` rebuilds it from the slot
    table (what any version's checkpoint keeps), stale entries and the
    recent copy included, and the stream goes on as from the saved state."""
    S, E = 12, 4
    mc = js.ManagedCollision(
        "t", num_slots=S, evict_every=3, evict_count=E, recent_size=4
    )
    model = Model(S, "lfu", 3, E)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 40, size=3).tolist() for _ in range(10)]
    state = mc.init()
    for ids in batches[:6]:
        rows, state, evicted = mc.remap(state, np.array(ids, np.int64))
        assert (rows.tolist(), evicted.tolist()) == model.remap(ids, [True] * 3)
    assert int(state.num_stale) > 0 and int(state.num_recent) > 0
    search = ("sorted", "recent", "num_recent", "num_stale")  # what it rebuilds
    saved = {f: x for f, x in state._asdict().items() if not f.startswith(search)}
    restored = mc.restore(saved)
    model.check(restored)
    assert int(restored.num_stale) == int(restored.num_recent) == 0
    for ids in batches[6:]:
        rows, restored, evicted = mc.remap(restored, np.array(ids, np.int64))
        assert (rows.tolist(), evicted.tolist()) == model.remap(ids, [True] * 3)
        model.check(restored)
    del saved["counts"]
    with pytest.raises(ValueError, match="the saved state's `counts` is absent"):
        mc.restore(saved)
    with pytest.raises(
        ValueError,
        match="saved state.s `ids_hi` is uint32.12.; this table.s is uint32.13.",
    ):
        js.ManagedCollision("t", num_slots=S + 1).restore(state)
    with pytest.raises(ValueError, match="belongs to another table"):
        js.ManagedCollision("u", num_slots=S, evict_count=E).restore(state)


def test_full_table_serves_the_default_and_counts_it():
    mc = js.ManagedCollision("t", num_slots=2)
    rows, state, evicted = mc.remap(mc.init(), [5, 6, 7, 7])
    assert rows.tolist() == [0, 1, 2, 2] and evicted.tolist() == [2]
    assert int(state.defaulted) == 2 and int(state.occupancy) == 2


def test_eager_and_jit_are_bitwise_equal():
    mc = js.ManagedCollision(
        "t", num_slots=5, policy="lfu", evict_every=3, evict_count=2
    )
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 12, size=(2, 4)) for _ in range(4)]
    eager = jitted = mc.init()
    remap = jax.jit(mc.remap)
    for ids in batches:
        r1, eager, e1 = mc.remap(eager, ids.astype(np.int32))
        r2, jitted, e2 = remap(jitted, jnp.asarray(ids, jnp.int32))
        assert r1.shape == (2, 4)
        np.testing.assert_array_equal(r1, r2)
        np.testing.assert_array_equal(e1, e2)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_array_equal(a, b)


def test_remap_compiles_once_in_a_loop():
    mc = js.ManagedCollision("t", num_slots=8, evict_every=2)
    traces = []

    @jax.jit
    def step(state, ids):
        traces.append(1)
        return mc.remap(state, ids)

    state = mc.init()
    for k in range(4):
        _, state, _ = step(state, jnp.arange(3, dtype=jnp.int32) + 3 * k)
    assert len(traces) == 1


def test_raw_id_dtypes_name_one_value():
    """int32 -1, int64 -1 and RawIds of -1 are one id; uint32 0xFFFFFFFF another."""
    mc = js.ManagedCollision("t", num_slots=4)
    state = mc.init()
    r, state, _ = mc.remap(state, jnp.array([-1], jnp.int32))
    r64, state, _ = mc.remap(state, np.array([-1], np.int64))
    rraw, state, _ = mc.remap(state, js.RawIds.from_int64(np.array([-1])))
    ru, state, _ = mc.remap(state, jnp.array([0xFFFFFFFF], jnp.uint32))
    r8, state, _ = mc.remap(state, np.array([-1], np.int8))
    assert r.tolist() == r64.tolist() == rraw.tolist() == r8.tolist() == [0]
    assert ru.tolist() == [1]


def test_raw_ids_from_int64_and_strings():
    ids = np.array([0, 1, -1, 2**40 + 5, -(2**63)], np.int64)
    raw = js.RawIds.from_int64(ids)
    back = (np.asarray(raw.hi).astype(np.uint64) << np.uint64(32)) | np.asarray(
        raw.lo
    ).astype(np.uint64)
    np.testing.assert_array_equal(back.view(np.int64), ids)
    a = js.RawIds.from_strings(["user:1", "user:2", "user:1"])
    b = js.RawIds.from_strings(["user:1"])
    assert a.hi[0] == a.hi[2] == b.hi[0] and a.lo[0] == a.lo[2] == b.lo[0]
    assert (a.hi[0], a.lo[0]) != (a.hi[1], a.lo[1])
    # stable across processes: BLAKE2b, not Python's salted hash
    assert (int(b.hi[0]), int(b.lo[0])) == _blake("user:1")
    mc = js.ManagedCollision("t", num_slots=4)
    rows, _, _ = mc.remap(mc.init(), a)
    assert rows.tolist()[0] == rows.tolist()[2] != rows.tolist()[1]


def _blake(text: str) -> tuple[int, int]:
    import hashlib

    v = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest())
    return v >> 32, v & 0xFFFFFFFF


# -- bad input -----------------------------------------------------------------


def test_table_too_small_for_its_policy():
    with pytest.raises(ValueError, match=r"evict_count=5 .*num_slots=4"):
        js.ManagedCollision("t", num_slots=4, evict_count=5)
    with pytest.raises(ValueError, match=r"`num_slots` .* got 0"):
        js.ManagedCollision("t", num_slots=0)
    with pytest.raises(ValueError, match=r"`policy` must be one of .* got 'fifo'"):
        js.ManagedCollision("t", num_slots=4, policy="fifo")
    with pytest.raises(ValueError, match=r"`evict_every` .* got 0"):
        js.ManagedCollision("t", num_slots=4, evict_every=0)


@pytest.mark.parametrize("ids", [np.array([1.0, 2.0]), np.array([True, False])])
def test_ids_of_the_wrong_dtype(ids):
    mc = js.ManagedCollision("t", num_slots=4)
    with pytest.raises(
        TypeError, match=rf"raw ids must be integers.*got dtype {ids.dtype}"
    ):
        mc.remap(mc.init(), ids)
    with pytest.raises(TypeError, match=r"`hi` must be uint32 .* got int32"):
        js.RawIds(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.uint32))
    with pytest.raises(TypeError, match=r"every item must be a str, got int"):
        js.RawIds.from_strings(["a", 3])


def test_mask_of_the_wrong_shape():
    mc = js.ManagedCollision("t", num_slots=4)
    with pytest.raises(
        ValueError, match=r"`mask` must be booleans of the ids' shape \[3\]"
    ):
        mc.remap(mc.init(), [1, 2, 3], mask=np.ones(2, bool))


def test_a_state_from_another_table_is_refused():
    a = js.ManagedCollision("a", num_slots=4)
    b = js.ManagedCollision("b", num_slots=4)
    wrong = a.init()
    with pytest.raises(
        ValueError, match=r"belongs to another table .*ManagedCollision\('b'"
    ):
        b.remap(wrong, [1])
    with pytest.raises(ValueError, match=r"belongs to another table"):
        b.evict(wrong)
    with pytest.raises(Exception, match=r"belongs to another table") as info:
        jax.block_until_ready(jax.jit(b.remap)(wrong, jnp.array([1], jnp.int32)))
    assert isinstance(info.value, (ValueError, jax.errors.JaxRuntimeError))
    # the right state passes under jit
    rows, _, _ = jax.jit(b.remap)(b.init(), jnp.array([1], jnp.int32))
    assert rows.tolist() == [0]
    with pytest.raises(ValueError, match=r"it has 3 slots, the table 4"):
        b.remap(js.ManagedCollision("b", num_slots=3).init(), [1])
    with pytest.raises(TypeError, match=r"`state` must be the RemapState"):
        b.remap({"not": "a state"}, [1])


X64_CASE = """
import jax, jax.numpy as jnp, numpy as np, jaxslices as js
mc = js.ManagedCollision("t", num_slots=4, evict_every=2, evict_count=3,
                         min_count=2, admit_probability=0.9, half_life=2, ttl=3)
s0 = s = r0 = mc.init()
ids = [[2**40, 5, 5], [7, 8, -1], [2**40, -1, 3], [11, 12, 13]]
for b in ids:
    rows, s, _ = jax.jit(mc.remap)(s, jnp.asarray(b, jnp.int64))  # split on device
    raw, r0, _ = mc.remap(r0, js.RawIds.from_int64(np.array(b)))
    assert rows.tolist() == raw.tolist(), (rows, raw)
drift = [n for n, a, b in zip(s._fields, s0, s) if a.dtype != b.dtype]
assert not drift, drift
print("ok")
"""


def test_x64_ids_and_a_state_whose_dtypes_do_not_drift():
    """Under ``jax_enable_x64`` int64 ids split on the device equal RawIds, and
    the state keeps its int32 / uint32 dtypes (sums are int64 there)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    run = subprocess.run(
        [sys.executable, "-c", X64_CASE], capture_output=True, text=True, env=env,
        cwd=Path(__file__).resolve().parents[2], timeout=300,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
