"""``ManagedCollision``: raw ids to the rows of a fixed-size table, under ``jit``.

Recommendation ids have no vocabulary. Hashing them into ``S`` rows
(``hash(id) % S``) makes unrelated ids share a row and train it against each
other. A managed-collision table tracks which raw id owns which of its ``S``
rows (*slots*) in a :class:`RemapState` kept beside the table (a pytree,
checkpointed with it), as TorchRec's ``MCHManagedCollisionModule`` does:

* **Remap** (:meth:`ManagedCollision.remap`): each raw id is looked up among
  the tracked ids (a sorted copy of the tracked ids and a binary search of
  ``ceil(log2(S + 1))`` fixed steps, on the pairs of 32-bit words of
  :class:`~jaxslices.RawIds`); it gets its slot.
* **Admission**: a raw id not tracked yet is admitted into a free slot, if one
  is left: the distinct new ids of a batch take free slots in the order of
  their raw ids' low 32-bit words (then high words). While free slots
  remain, no two raw ids ever share a row.
* **Admission filter** (``min_count``, ``admit_probability``): a new id may
  take a slot only once the table has seen it ``min_count`` times, counted
  in a fixed-size filter (``filter_size`` buckets, each holding one id and
  its count; an id that lands in a bucket held by another takes it, and the
  other's count is lost), and, with ``admit_probability < 1``, only when its
  draw (a hash of the id and the step) admits it. The filter never counts
  an id more often than it was seen, so with ``min_count >= 2`` an id seen
  once never takes a slot; it may count less (a bucket taken from it), which
  only delays an admission.
* **Default**: an id not admitted (no free slot left, or not yet
  admissible) is served by **no row**: its slot is ``S``, out of the
  table's range, which every jaxslices lookup reads as zeros and which gets
  no gradient and touches no optimizer state
  (the padding rule of :func:`jaxslices.embedding_lookup`,
  :func:`jaxslices.embedding_bag` and collections). It trains nothing wrong:
  the other rows of its bag train as if it were absent, and ``"mean"`` /
  ``"sqrtn"`` bags do not count it.
* **Eviction** (:meth:`ManagedCollision.evict`, on demand, and every
  ``evict_every`` calls of ``remap``, before that call's admissions): when
  fewer than ``evict_count`` slots are free, the tracked ids with the lowest
  score lose their slots until ``evict_count`` are free. LFU scores by the
  number of lookups of the id since it was admitted (with ``half_life``,
  halved every ``half_life`` steps: a decayed LFU; ties: least recently
  seen first), LRU by the step it was last seen (ties: fewest lookups
  first); remaining ties go to the lower slot. With ``ttl``, ids not looked
  up in the last ``ttl`` steps go first, whatever the pressure (at most
  ``evict_count`` an eviction). An id is never evicted while
  ``evict_count`` slots are free. The evicted slots are returned, and
  become free, in increasing order.
* **Re-initialisation**: ``remap`` returns the slots it evicted (``[E]``, the
  unused entries ``S``); :func:`jaxslices.reset_rows` gives those rows of the
  table fresh values and their optimizer state its initial values, before
  the step reads the table.

The state's counters (``admissions``, ``evictions``, ``defaulted``, per-slot
``counts``, ``step``) are ``int32`` and saturate at ``2**31 - 1``.

This module is the policy (:class:`ManagedCollision`: its configuration,
its state's identity, when eviction is due); the state is
:mod:`jaxslices.managed._state`, the algorithm (a sorted copy of the
tracked ids and binary search; its costs) is its XLA reference,
:mod:`jaxslices.managed._reference`, and admission and eviction are bound
as native ops (a C++ kernel on one CPU device, the reference elsewhere) in
:mod:`jaxslices.managed._ops`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from .. import _errors
from . import _ops
from ._raw import RawIds, as_raw_ids
from ._reference import INT32_MAX, rebuild_search, saturating_add
from ._state import FILTER, SLOT_TABLE, RemapState

__all__ = ["ManagedCollision", "RemapState"]

Policy = Literal["lfu", "lru"]
_POLICIES = ("lfu", "lru")


@dataclasses.dataclass(frozen=True)
class ManagedCollision:
    """A managed-collision table's policy: raw ids to ``num_slots`` rows.

    The configuration is static (hashable, a valid ``jax.jit`` static
    argument); the state it works on is a :class:`RemapState` from
    :meth:`init`. The rules (admission, the default, eviction) are those of
    the guide ``docs/managed.md`` ("Managed-collision tables").

    Args:
      name: the table's name; part of the state's identity, so a state made
        for another table is refused.
      num_slots: ``S``, the rows of the table the remapped ids index.
      policy: ``"lfu"`` (least frequently used first) or ``"lru"`` (least
        recently used first).
      evict_every: evict in every ``evict_every``-th call of :meth:`remap`
        (``None``: only on demand, :meth:`evict`).
      evict_count: the free slots an eviction makes available (``E``): it
        evicts ``max(0, E - free)`` ids. ``1 <= E <= num_slots``.
      recent_size: ``K``, the entries of the small sorted copy that takes
        admissions before they are merged into the main one (``None``:
        ``min(num_slots, 64 * isqrt(num_slots))``, 65536 at ``2**20``
        slots). A call of :meth:`remap` with ``N`` ids merges the small copy
        into the main one first when it holds more than ``K - N``; with
        ``N > K`` every admission goes to the main copy (``O(S)``). Only
        the speed depends on it, never the rows.
      min_count: a new id takes a slot only once it has been seen this many
        times (its occurrences in earlier batches and this one, counted by
        the admission filter); until then it is served by the default.
        ``1``: no filter.
      admit_probability: each time a new id could take a slot, it does with
        this probability (its draw: a hash of the id and the step, so a run
        is reproducible). ``1.0``: always.
      half_life: with ``policy="lfu"``, the lookup counts halve every
        ``half_life`` calls of :meth:`remap` (a *decayed* LFU: ids that were
        popular long ago lose their place to those popular now; ``None``: the
        counts never decay).
      ttl: evict, at each eviction, the ids not looked up in the last ``ttl``
        calls of :meth:`remap` whatever the pressure (up to ``evict_count``
        an eviction, before any other id; ``None``: no time-to-live).
      filter_size: ``W``, the admission filter's buckets (``None``:
        ``num_slots`` when ``min_count > 1``; 1, unused, without a filter);
        three words each. A larger
        filter loses fewer counts to other ids.

    Raises:
      ValueError: ``num_slots`` < 1 or above ``2**31 - 2``, an unknown
        policy, ``evict_every`` < 1, or an ``evict_count`` the table cannot
        hold (the table is too small for its policy).

    Example:
      >>> import jaxslices as js
      >>> mc = js.ManagedCollision("items", num_slots=2, evict_count=1)
      >>> rows, state, evicted = mc.remap(mc.init(), [10**12, 5, 5, 8])
      >>> rows.tolist()  # 5 and 8 admitted (in id order); 10**12 gets no row
      [2, 0, 0, 1]
    """

    name: str
    num_slots: int
    policy: Policy = "lfu"
    evict_every: int | None = None
    evict_count: int = 1
    recent_size: int | None = None
    min_count: int = 1
    admit_probability: float = 1.0
    filter_size: int | None = None
    half_life: int | None = None
    ttl: int | None = None

    def __post_init__(self):
        where = f"ManagedCollision({self.name!r})"
        if not isinstance(self.name, str):
            raise TypeError(f"{where}: `name` must be a str, got {self.name!r}.")
        if not _is_int(self.num_slots) or not 1 <= self.num_slots <= INT32_MAX - 1:
            raise ValueError(
                f"{where}: `num_slots` must be an int in [1, {INT32_MAX - 1}], "
                f"got {self.num_slots!r}."
            )
        if self.policy not in _POLICIES:
            raise ValueError(
                f"{where}: `policy` must be one of {_POLICIES}, got {self.policy!r}."
            )
        _check_positive_or_none(
            where,
            "evict_every",
            self.evict_every,
            "calls of remap between evictions",
            "on demand only",
        )
        if not _is_int(self.evict_count) or not 1 <= self.evict_count <= self.num_slots:
            raise ValueError(
                f"{where}: the table is too small for its eviction policy: "
                f"evict_count={self.evict_count!r} free slots per eviction, but "
                f"num_slots={self.num_slots}. Give 1 <= evict_count <= num_slots "
                "(evict_count is how many slots an eviction frees for new ids)."
            )
        _check_positive_or_none(
            where,
            "recent_size",
            self.recent_size,
            "entries of the small sorted copy of recent admissions",
            "the default",
        )
        if not _is_int(self.min_count) or self.min_count < 1:
            raise ValueError(
                f"{where}: `min_count` must be an int >= 1 (the times a new id "
                f"is seen before it takes a slot; 1: at once), got {self.min_count!r}."
            )
        p = self.admit_probability
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(
                f"{where}: `admit_probability` must be a number in (0, 1], got {p!r}."
            )
        _check_positive_or_none(
            where,
            "filter_size",
            self.filter_size,
            "buckets of the admission filter",
            "num_slots",
        )
        _check_positive_or_none(
            where, "half_life", self.half_life, "calls between halvings", "no decay"
        )
        if self.half_life is not None and self.policy != "lfu":
            raise ValueError(
                f"{where}: `half_life={self.half_life}` decays LFU's counts; "
                f"policy={self.policy!r} does not rank by them. Give policy='lfu'."
            )
        _check_positive_or_none(
            where, "ttl", self.ttl, "calls without a lookup", "no time-to-live"
        )
        if self.filter_size is not None and self.min_count == 1:
            raise ValueError(
                f"{where}: `filter_size={self.filter_size}` sizes the admission "
                "filter, which counts only with `min_count` > 1; give min_count "
                "or leave filter_size None."
            )

    @property
    def recent_capacity(self) -> int:
        """``K``: the entries of the recent sorted copy (static)."""
        if self.recent_size is not None:
            return min(self.num_slots, int(self.recent_size))
        return min(self.num_slots, 64 * math.isqrt(self.num_slots))

    @property
    def filter_capacity(self) -> int:
        """``W``: the admission filter's buckets (static). Without a filter,
        one bucket that nothing reads (Orbax saves no empty array)."""
        if self.min_count == 1:
            return 1
        return self.num_slots if self.filter_size is None else int(self.filter_size)

    @property
    def admit_threshold(self) -> int:
        """The draw below which a new id is admissible (``-1``: every one)."""
        if self.admit_probability >= 1:
            return -1
        return min(int(self.admit_probability * 2**32), 2**32 - 1)

    # -- the state ------------------------------------------------------------
    @property
    def table_key(self) -> np.ndarray:
        """The identity a state of this table carries: ``uint32[2]``."""
        text = f"{self.name}\x00{self.num_slots}\x00{self.policy}".encode()
        digest = hashlib.blake2b(text, digest_size=8).digest()
        return np.frombuffer(digest, np.uint32).copy()

    def init(self) -> RemapState:
        """An empty state: every slot free, counters zero.

        Example:
          >>> import jaxslices as js
          >>> js.ManagedCollision("t", num_slots=3).init().num_free.item()
          3
        """
        S, K = self.num_slots, self.recent_capacity

        # a buffer per field: a state can be donated to a jitted step
        def zeros_u(n):
            return jnp.zeros((n,), jnp.uint32)

        def zeros_i(n):
            return jnp.zeros((n,), jnp.int32)

        def scalar():
            return jnp.zeros((), jnp.int32)

        return RemapState(
            table_key=jnp.asarray(self.table_key),
            ids_hi=zeros_u(S),
            ids_lo=zeros_u(S),
            occupied=jnp.zeros((S,), bool),
            counts=zeros_i(S),
            last_seen=zeros_i(S),
            sorted_hi=zeros_u(S),
            sorted_lo=zeros_u(S),
            sorted_slots=zeros_i(S),
            recent_hi=zeros_u(K),
            recent_lo=zeros_u(K),
            recent_slots=zeros_i(K),
            num_recent=scalar(),
            num_stale=scalar(),
            free_slots=jnp.arange(S - 1, -1, -1, dtype=jnp.int32),  # 0 first
            num_free=jnp.asarray(S, jnp.int32),
            step=scalar(),
            admissions=scalar(),
            evictions=scalar(),
            defaulted=scalar(),
            filter_hi=zeros_u(self.filter_capacity),
            filter_lo=zeros_u(self.filter_capacity),
            filter_counts=zeros_i(self.filter_capacity),
        )

    def check_state(self, state: Any, where: str) -> RemapState:
        """``state`` if it is a state of this table; else a clear error.

        Shapes are checked at trace time; the identity (``table_key``)
        eagerly, or under ``jit`` when the guarded result is used.
        """
        if not isinstance(state, RemapState):
            raise TypeError(
                f"{where}: `state` must be the RemapState of ManagedCollision"
                f"({self.name!r}).init(), got {type(state).__name__}."
            )
        S = self.num_slots
        K = self.recent_capacity
        if (
            state.occupied.shape != (S,)
            or tuple(state.table_key.shape) != (2,)
            or state.recent_slots.shape != (K,)
            or state.filter_counts.shape != (self.filter_capacity,)
        ):
            raise ValueError(
                f"{where}: the state is not one of table {self.name!r}: it has "
                f"{state.occupied.shape[0] if state.occupied.ndim else '?'} slots, "
                f"the table {S} (recent copy: {state.recent_slots.shape}, the "
                f"table ({K},); admission filter: {state.filter_counts.shape}, "
                f"the table ({self.filter_capacity},)). Use the state this "
                "table's init() made."
            )
        mine = self.table_key
        other = jnp.any(jnp.asarray(state.table_key) != jnp.asarray(mine))
        name = self.name

        def error(hi: int, lo: int) -> Exception:
            return ValueError(
                f"{where}: the remap state belongs to another table (identity "
                f"{hi & 0xFFFFFFFF:08x}{lo & 0xFFFFFFFF:08x}), not to "
                f"ManagedCollision({name!r}, num_slots={S}, policy="
                f"{self.policy!r}) (identity {int(mine[0]):08x}{int(mine[1]):08x}). "
                "Pass each table its own state."
            )

        key = jax.lax.bitcast_convert_type(jnp.asarray(state.table_key), jnp.int32)
        # guard the scalars every operation reads (the search bound, the step):
        # two scalars threaded, not the S-sized arrays
        num_free, step = _errors.raise_if(
            other, (state.num_free, state.step), error, key[0], key[1]
        )
        return state._replace(num_free=num_free, step=step)

    # -- the operations -------------------------------------------------------
    def remap(
        self, state: RemapState, ids: Any, mask: Any = None
    ) -> tuple[jax.Array, RemapState, jax.Array]:
        """Map raw ids to slots, admitting new ones; evict first when due.

        Args:
          state: this table's :class:`RemapState`.
          ids: raw ids of any shape (any integer dtype, or
            :class:`~jaxslices.RawIds`: 64-bit ids as two 32-bit words).
          mask: optional booleans of ``ids``' shape; ``False`` entries are
            padding: not looked up, not counted, slot ``S``.

        Returns:
          ``(rows, new_state, evicted)``: ``rows`` ``int32`` of ``ids``' shape
          in ``[0, S]`` (``S``: no row, the default); ``evicted`` ``int32[E]``,
          the slots this call evicted (``E = evict_count``, unused entries
          ``S``), whose rows and optimizer state to reset
          (:func:`jaxslices.reset_rows`) before the table is read.

        Example:
          >>> import jaxslices as js
          >>> mc = js.ManagedCollision("t", num_slots=3)
          >>> rows, state, evicted = mc.remap(mc.init(), [40, 30, 40])
          >>> rows.tolist(), evicted.tolist()
          ([1, 0, 1], [3])
        """
        where = f"ManagedCollision({self.name!r}).remap"
        state = self.check_state(state, where)
        raw = as_raw_ids(ids, where)
        valid = _mask(mask, raw.shape, where)
        # one compiled function per table policy and ids shape, also eagerly
        return _remap(self, state, raw, valid)

    def evict(self, state: RemapState) -> tuple[RemapState, jax.Array]:
        """Evict now (on demand): free slots until ``evict_count`` are free.

        Returns:
          ``(new_state, evicted)``, ``evicted`` ``int32[evict_count]``, unused
          entries ``S``.

        Example:
          >>> import jaxslices as js
          >>> mc = js.ManagedCollision("t", num_slots=2, policy="lru")
          >>> _, state, _ = mc.remap(mc.init(), [4, 6])
          >>> _, state, _ = mc.remap(state, [6])
          >>> state, evicted = mc.evict(state)
          >>> evicted.tolist()  # 4 (slot 0) was least recently used
          [0]
        """
        state = self.check_state(state, f"ManagedCollision({self.name!r}).evict")
        return _evict(self, state)

    def restore(self, saved: Any) -> RemapState:
        """A state of this table from a saved one: its slot table, the search
        structure rebuilt.

        The fields of a :class:`RemapState` are the *slot table* (which raw
        id owns which slot, the counters, the free slots) and a *search
        structure* (sorted copies of the tracked ids) made from it. Only the
        slot table says anything; the search structure is rebuilt here (a
        sort of the slots), so a state saved by a version whose search
        structure differs (more, fewer or other fields) is read by this one:
        give it what the checkpoint holds. Remapping from the restored state
        gives the same rows, admissions and evictions as from the saved one.

        Args:
          saved: a :class:`RemapState`, or a mapping or object with at least
            the slot table's fields (``table_key``, ``ids_hi``, ``ids_lo``,
            ``occupied``, ``counts``, ``last_seen``, ``free_slots``,
            ``num_free``, ``step``, ``admissions``, ``evictions``,
            ``defaulted``), e.g. the dictionary Orbax restores; the admission
            filter's fields too where the checkpoint has them (without
            them, the filter starts empty).

        Raises:
          ValueError: a field is missing or has another shape or dtype than
            this table's (or the state is another table's).

        Example:
          >>> import jaxslices as js
          >>> mc = js.ManagedCollision("t", num_slots=4)
          >>> rows, state, _ = mc.remap(mc.init(), [7, 9])
          >>> saved = {k: v for k, v in state._asdict().items() if "sorted" not in k}
          >>> rows, _, _ = mc.remap(mc.restore(saved), [9, 7, 8])
          >>> rows.tolist()
          [1, 0, 2]
        """
        where = f"ManagedCollision({self.name!r}).restore"
        if not isinstance(saved, Mapping):  # a RemapState, an older layout's
            saved = {f: getattr(saved, f, None) for f in SLOT_TABLE + FILTER}
        fresh = self.init()
        table = {}
        for f in SLOT_TABLE + FILTER:
            want = getattr(fresh, f)
            x = None if saved.get(f) is None else jnp.asarray(saved[f])
            if x is None and f in FILTER:  # saved before the filter: empty
                continue
            if x is None or (x.shape, x.dtype) != (want.shape, want.dtype):
                got = "absent" if x is None else f"{x.dtype}{list(x.shape)}"
                raise ValueError(
                    f"{where}: the saved state's `{f}` is {got}; this table's "
                    f"is {want.dtype}{list(want.shape)} (the slot table needs "
                    f"{', '.join(SLOT_TABLE)}). Restore a state into the table "
                    "that saved it."
                )
            table[f] = x
        state = self.check_state(fresh._replace(**table), where)
        return _rebuild_search(state)


_rebuild_search = jax.jit(rebuild_search)


@functools.partial(jax.jit, static_argnums=0)
def _remap(
    mc: ManagedCollision, state: RemapState, raw: RawIds, valid: jax.Array
) -> tuple[jax.Array, RemapState, jax.Array]:
    S, E = mc.num_slots, mc.evict_count
    step = saturating_add(state.step, 1)
    state = state._replace(step=step)
    if mc.evict_every is None:
        evicted = jnp.full((E,), S, jnp.int32)
    else:
        due = step % mc.evict_every == 0
        state, evicted = jax.lax.cond(
            due,
            functools.partial(_evict, mc),
            lambda s: (s, jnp.full((E,), S, jnp.int32)),
            state,
        )
    rows, state = _ops.admit(
        state,
        raw.hi.reshape(-1),
        raw.lo.reshape(-1),
        valid.reshape(-1),
        label=f"ManagedCollision({mc.name!r}).remap: admission",
        min_count=mc.min_count,
        threshold=mc.admit_threshold,
        half_life=mc.half_life or 0,
    )
    return rows.reshape(raw.shape), state, evicted


@functools.partial(jax.jit, static_argnums=0)
def _evict(mc: ManagedCollision, state: RemapState) -> tuple[RemapState, jax.Array]:
    """Evict now; the native kernel on one CPU device (bitwise equal)."""
    return _ops.evict(
        state,
        policy=mc.policy,
        evict_count=mc.evict_count,
        label=f"ManagedCollision({mc.name!r}): eviction",
        half_life=mc.half_life or 0,
        ttl=mc.ttl or 0,
    )


def _check_positive_or_none(
    where: str, name: str, value: Any, meaning: str, none_means: str
) -> None:
    if value is not None and (not _is_int(value) or value < 1):
        raise ValueError(
            f"{where}: `{name}` must be a positive int ({meaning}) or None "
            f"({none_means}), got {value!r}."
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _mask(mask: Any, shape: tuple[int, ...], where: str) -> jax.Array:
    if mask is None:
        return jnp.ones(shape, bool)
    m = jnp.asarray(mask)
    if m.dtype != jnp.bool_ or tuple(m.shape) != shape:
        raise ValueError(
            f"{where}: `mask` must be booleans of the ids' shape {list(shape)}, got "
            f"{m.dtype}{list(m.shape)}."
        )
    return m
