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
* **Default**: an id not admitted (no free slot left) is served by **no row**:
  its slot is ``S``, out of the table's range, which every jaxslices lookup
  reads as zeros and which gets no gradient and touches no optimizer state
  (the padding rule of :func:`jaxslices.embedding_lookup`,
  :func:`jaxslices.embedding_bag` and collections). It trains nothing wrong:
  the other rows of its bag train as if it were absent, and ``"mean"`` /
  ``"sqrtn"`` bags do not count it.
* **Eviction** (:meth:`ManagedCollision.evict`, on demand, and every
  ``evict_every`` calls of ``remap``, before that call's admissions): when
  fewer than ``evict_count`` slots are free, the tracked ids with the lowest
  score lose their slots until ``evict_count`` are free. LFU scores by the
  number of lookups of the id since it was admitted (ties: least recently
  seen first), LRU by the step it was last seen (ties: fewest lookups
  first); remaining ties go to the lower slot. An id is never evicted while
  ``evict_count`` slots are free. The evicted slots are returned, and
  become free, in increasing order.
* **Re-initialisation**: ``remap`` returns the slots it evicted (``[E]``, the
  unused entries ``S``); :func:`jaxslices.reset_rows` gives those rows of the
  table fresh values and their optimizer state its initial values, before
  the step reads the table.

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

The state's counters (``admissions``, ``evictions``, ``defaulted``, per-slot
``counts``, ``step``) are ``int32`` and saturate at ``2**31 - 1``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _errors
from .._jax_compat import native_out_aval
from ..kernels._primitive import NativeOp
from ._raw import RawIds, as_raw_ids

__all__ = ["ManagedCollision", "RemapState"]

Policy = Literal["lfu", "lru"]
_POLICIES = ("lfu", "lru")
_INT32_MAX = np.iinfo(np.int32).max


class RemapState(NamedTuple):
    """The remap state of a :class:`ManagedCollision` table (a pytree of arrays).

    ``S`` is the number of slots (rows of the table). A slot ``s`` is free when
    ``occupied[s]`` is false; its other per-slot fields are then zero.

    Attributes:
      table_key: ``uint32[2]``, the identity of the table the state belongs to
        (a hash of its name, slots and policy); a state of another table is
        refused.
      ids_hi, ids_lo: ``uint32[S]``, the raw id tracked in each slot.
      occupied: ``bool[S]``.
      counts: ``int32[S]``, lookups of the slot's id since its admission.
      last_seen: ``int32[S]``, the ``step`` of its last lookup.
      sorted_hi, sorted_lo, sorted_slots: ``[S]``, the *main* sorted copy:
        tracked ids sorted by low word, then high word, and their slots, in
        the first ``occupancy - num_recent + num_stale`` entries (zeros after
        them). ``num_stale`` of them are *stale*: ids evicted since the
        last merge into this copy, kept in place (so the copy stays sorted
        and an eviction does not move ``O(S)`` entries) with slot ``S``; a
        lookup that finds one reads it as absent, and the next merge into
        the main copy drops them.
      recent_hi, recent_lo, recent_slots: ``[K]`` (``K`` the table's
        ``recent_size``), the ids admitted since the last flush, sorted the
        same way, in the first ``num_recent`` entries (zeros after them).
        A lookup searches both copies; admissions go into this small one
        (``O(K)``), which is merged into the main copy (``O(S)``) only when
        a batch might not fit in it.
      num_recent: ``int32``, the entries of the recent copy.
      num_stale: ``int32``, the stale entries of the main copy.
      free_slots: ``int32[S]``, a stack: the free slots are
        ``free_slots[:num_free]``, the next one admitted is the last.
      num_free: ``int32``, free slots.
      step: ``int32``, calls of ``remap`` so far.
      admissions, evictions: ``int32``, ids admitted and evicted so far.
      defaulted: ``int32``, looked-up ids served by the default (no row) so
        far, every occurrence counted.
    """

    table_key: jax.Array
    ids_hi: jax.Array
    ids_lo: jax.Array
    occupied: jax.Array
    counts: jax.Array
    last_seen: jax.Array
    sorted_hi: jax.Array
    sorted_lo: jax.Array
    sorted_slots: jax.Array
    recent_hi: jax.Array
    recent_lo: jax.Array
    recent_slots: jax.Array
    num_recent: jax.Array
    num_stale: jax.Array
    free_slots: jax.Array
    num_free: jax.Array
    step: jax.Array
    admissions: jax.Array
    evictions: jax.Array
    defaulted: jax.Array

    @property
    def num_slots(self) -> int:
        """``S`` (static)."""
        return int(self.occupied.shape[0])

    @property
    def occupancy(self) -> jax.Array:
        """Tracked ids (occupied slots)."""
        return self.num_slots - self.num_free

    def stats(self) -> dict[str, jax.Array]:
        """``{occupancy, admissions, evictions, defaulted, step}`` as scalars.

        Example:
          >>> import jaxslices as js
          >>> mc = js.ManagedCollision("items", num_slots=4)
          >>> rows, state, _ = mc.remap(mc.init(), [7, 7, 9])
          >>> {k: int(v) for k, v in state.stats().items()}
          {'occupancy': 2, 'admissions': 2, 'evictions': 0, 'defaulted': 0, 'step': 1}
        """
        return {
            "occupancy": self.occupancy,
            "admissions": self.admissions,
            "evictions": self.evictions,
            "defaulted": self.defaulted,
            "step": self.step,
        }


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

    def __post_init__(self):
        where = f"ManagedCollision({self.name!r})"
        if not isinstance(self.name, str):
            raise TypeError(f"{where}: `name` must be a str, got {self.name!r}.")
        if not _is_int(self.num_slots) or not 1 <= self.num_slots <= _INT32_MAX - 1:
            raise ValueError(
                f"{where}: `num_slots` must be an int in [1, {_INT32_MAX - 1}], "
                f"got {self.num_slots!r}."
            )
        if self.policy not in _POLICIES:
            raise ValueError(
                f"{where}: `policy` must be one of {_POLICIES}, got {self.policy!r}."
            )
        if self.evict_every is not None and (
            not _is_int(self.evict_every) or self.evict_every < 1
        ):
            raise ValueError(
                f"{where}: `evict_every` must be a positive int (calls of remap "
                f"between evictions) or None (on demand only), got "
                f"{self.evict_every!r}."
            )
        if not _is_int(self.evict_count) or not 1 <= self.evict_count <= self.num_slots:
            raise ValueError(
                f"{where}: the table is too small for its eviction policy: "
                f"evict_count={self.evict_count!r} free slots per eviction, but "
                f"num_slots={self.num_slots}. Give 1 <= evict_count <= num_slots "
                "(evict_count is how many slots an eviction frees for new ids)."
            )
        if self.recent_size is not None and (
            not _is_int(self.recent_size) or self.recent_size < 1
        ):
            raise ValueError(
                f"{where}: `recent_size` must be a positive int (entries of the "
                f"small sorted copy of recent admissions) or None (the default), "
                f"got {self.recent_size!r}."
            )

    @property
    def recent_capacity(self) -> int:
        """``K``: the entries of the recent sorted copy (static)."""
        if self.recent_size is not None:
            return min(self.num_slots, int(self.recent_size))
        return min(self.num_slots, 64 * math.isqrt(self.num_slots))

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
        ):
            raise ValueError(
                f"{where}: the state is not one of table {self.name!r}: it has "
                f"{state.occupied.shape[0] if state.occupied.ndim else '?'} slots, "
                f"the table {S} (recent copy: {state.recent_slots.shape}, the "
                f"table ({K},)). Use the state this table's init() made."
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


LAYER_COMBINERS = ("mean", "sum", "sqrtn")


def check_layer(where: str, manager: Any, combiner: str) -> None:
    """A managed bag layer's arguments (the NNX, Linen and Equinox layers).

    Example:
      >>> import jaxslices as js
      >>> from jaxslices.managed._table import check_layer
      >>> check_layer("Layer", js.ManagedCollision("t", num_slots=4), "sum")
    """
    if not isinstance(manager, ManagedCollision):
        raise TypeError(
            f"{where}: `manager` must be a jaxslices.ManagedCollision, got "
            f"{type(manager).__name__}."
        )
    if combiner not in LAYER_COMBINERS:
        raise ValueError(
            f"{where}: `combiner` must be 'mean', 'sum' or 'sqrtn', got {combiner!r}."
        )


@functools.partial(jax.jit, static_argnums=0)
def _remap(
    mc: ManagedCollision, state: RemapState, raw: RawIds, valid: jax.Array
) -> tuple[jax.Array, RemapState, jax.Array]:
    S, E = mc.num_slots, mc.evict_count
    step = _saturating_add(state.step, 1)
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
    rows, state = _lookup_and_admit(
        state, raw.hi.reshape(-1), raw.lo.reshape(-1), valid.reshape(-1)
    )
    return rows.reshape(raw.shape), state, evicted


@functools.partial(jax.jit, static_argnums=0)
def _evict(mc: ManagedCollision, state: RemapState) -> tuple[RemapState, jax.Array]:
    """Evict now; the native kernel on one CPU device (bitwise equal)."""
    outs = _EVICT_OP.bind(
        *(getattr(state, f) for f in _EVICT_FIELDS),
        _scalars(state),
        lfu=mc.policy == "lfu",
        evict_count=mc.evict_count,
        fallback=None,
    )
    evicted, *arrays, scalars = outs
    return _with_scalars(
        state._replace(**dict(zip(_EVICT_FIELDS, arrays, strict=True))), scalars
    ), evicted


def _evict_xla(
    state: RemapState, policy: str, evict_count: int
) -> tuple[RemapState, jax.Array]:
    S, E = state.num_slots, evict_count
    need = jnp.maximum(E - state.num_free, 0)
    if policy == "lfu":
        first, then = state.counts, state.last_seen
    else:
        first, then = state.last_seen, state.counts
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
        evictions=_saturating_add(state.evictions, need),
    )
    return jax.lax.cond(need > 0, _drop_evicted, lambda *a: a[0], state, *gone), evicted


def _kth_smallest(x: jax.Array, k: jax.Array, candidate: jax.Array) -> jax.Array:
    """The ``k``-th smallest of the candidates of ``x`` (``1 <= k <=`` their
    number; non-negative ``int32``).

    A binary search on the value between the candidates' least and greatest:
    ``log2(range) + 2`` passes of a count over ``x``, ``O(S)`` each, no sort
    (a sort of ``2**20`` slots costs about 1 s on XLA's CPU).
    """
    low = jnp.min(jnp.where(candidate, x, _INT32_MAX))
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


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _saturating_add(a: jax.Array, b: Any) -> jax.Array:
    b = jnp.asarray(b, jnp.int32)
    return jnp.where(a > _INT32_MAX - b, _INT32_MAX, a + b)


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


def _lookup_and_admit_xla(
    state: RemapState, hi: jax.Array, lo: jax.Array, valid: jax.Array
) -> tuple[jax.Array, RemapState]:
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
    group, mixed = _groups_by_low_word(hi, lo, valid)
    rows, hi_s, lo_s, assigned, place, rank = jax.lax.cond(
        mixed,
        _admit_exact,
        _admit_fast,
        group, hi, lo, valid, found, place, state.num_free, state.free_slots,
    )  # fmt: skip
    admitted = assigned < S

    n_admitted = jnp.sum(admitted, dtype=jnp.int32)
    target = jnp.where(admitted, assigned, S)  # admitted ids' slots, else dropped
    counts = state.counts.at[target].set(0, mode="drop")
    before = counts.at[rows].get(mode="fill", fill_value=0)
    counts = counts.at[rows].add(1, mode="drop")
    wrapped = counts.at[rows].get(mode="fill", fill_value=0) < before
    counts = counts.at[jnp.where(wrapped, rows, S)].set(_INT32_MAX, mode="drop")
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
        admissions=_saturating_add(state.admissions, n_admitted),
        defaulted=_saturating_add(
            state.defaulted, jnp.sum(valid & (rows == S), dtype=jnp.int32)
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


# ------------------------------------------------- the native CPU kernels
#
# Admission and eviction are two native ops (jaxslices.kernels: a C++ kernel
# on one CPU device, csrc/remap.cc, the functions above everywhere else, as
# their reference): the same state bit for bit, updated in place.

_SCALARS = (
    "num_free", "num_recent", "step", "admissions", "defaulted", "evictions",
    "num_stale",
)  # fmt: skip
_ADMIT_FIELDS = (
    "ids_hi", "ids_lo", "occupied", "counts", "last_seen",
    "sorted_hi", "sorted_lo", "sorted_slots", "recent_hi", "recent_lo", "recent_slots",
)  # fmt: skip
_EVICT_FIELDS = (*_ADMIT_FIELDS, "free_slots")


def _scalars(state: RemapState) -> jax.Array:
    return jnp.stack([jnp.asarray(getattr(state, f), jnp.int32) for f in _SCALARS])


def _with_scalars(state: RemapState, scalars: jax.Array) -> RemapState:
    return state._replace(**{f: scalars[i] for i, f in enumerate(_SCALARS)})


def _as_state(arrays: dict[str, jax.Array], scalars: jax.Array) -> RemapState:
    fields = dict.fromkeys(RemapState._fields)
    fields.update(arrays, table_key=jnp.zeros((2,), jnp.uint32))
    return _with_scalars(RemapState(**fields), scalars)


def _admit_reference(hi, lo, valid, *arrays, **_):
    *per_slot, free_slots, scalars = arrays
    state = _as_state(
        {**dict(zip(_ADMIT_FIELDS, per_slot, strict=True)), "free_slots": free_slots},
        scalars,
    )
    rows, state = _lookup_and_admit_xla(state, hi, lo, valid)
    return [rows, *(getattr(state, f) for f in _ADMIT_FIELDS), _scalars(state)]


def _evict_reference(*arrays, lfu, evict_count, **_):
    *per_slot, scalars = arrays
    state = _as_state(dict(zip(_EVICT_FIELDS, per_slot, strict=True)), scalars)
    state, evicted = _evict_xla(state, "lfu" if lfu else "lru", evict_count)
    return [evicted, *(getattr(state, f) for f in _EVICT_FIELDS), _scalars(state)]


def _admit_abstract(hi, lo, valid, *arrays, **_):
    avals = (hi, lo, valid, *arrays)
    per_slot = arrays[: len(_ADMIT_FIELDS)]
    return [
        native_out_aval(hi.shape, jnp.int32, avals),
        *(native_out_aval(a.shape, a.dtype, avals) for a in per_slot),
        native_out_aval(arrays[-1].shape, jnp.int32, avals),
    ]


def _evict_abstract(*arrays, evict_count, **_):
    return [
        native_out_aval((evict_count,), jnp.int32, arrays),
        *(native_out_aval(a.shape, a.dtype, arrays) for a in arrays),
    ]


_ADMIT_OP = NativeOp(
    "jaxslices_managed_admit",
    _admit_reference,
    _admit_abstract,
    # operand i -> output i - 2: the per-slot arrays and the scalars in place
    aliases={i: i - 2 for i in range(3, 3 + len(_ADMIT_FIELDS))} | {15: 12},
    attrs={},
    ids_operand=10,  # sorted_slots, int32: the kernel's one registration
)
_EVICT_OP = NativeOp(
    "jaxslices_managed_evict",
    _evict_reference,
    _evict_abstract,
    aliases={i: i + 1 for i in range(len(_EVICT_FIELDS) + 1)},
    attrs={"lfu": np.bool_},
    ids_operand=7,
)


def _lookup_and_admit(
    state: RemapState, hi: jax.Array, lo: jax.Array, valid: jax.Array
) -> tuple[jax.Array, RemapState]:
    """Look up and admit; the native kernel on one CPU device (bitwise equal)."""
    if hi.shape[0] == 0:
        return jnp.zeros((0,), jnp.int32), state
    rows, *arrays, scalars = _ADMIT_OP.bind(
        hi,
        lo,
        valid,
        *(getattr(state, f) for f in _ADMIT_FIELDS),
        state.free_slots,
        _scalars(state),
        fallback=None,
    )
    state = state._replace(**dict(zip(_ADMIT_FIELDS, arrays, strict=True)))
    return rows, _with_scalars(state, scalars)
