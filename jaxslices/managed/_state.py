"""``RemapState``: the state of a managed-collision table, a pytree of arrays.

Its fields are two kinds of data: the *slot table* (each slot's raw id,
whether it is occupied, its counters, the free-slot stack and the scalar
counters), which says which raw id owns which row, and the *search
structure* (the main and recent sorted copies, ``num_recent``,
``num_stale``), which finds a raw id's slot fast and is a function of the
slot table: :func:`jaxslices.managed._reference.rebuild_search` makes it
again from the slot table alone (``docs/managed.md``, "The search structure
is derived").
"""

from __future__ import annotations

from typing import NamedTuple

import jax

__all__ = ["FILTER", "SLOT_TABLE", "RemapState"]

#: The fields a saved state must keep to be restored (the slot table and the
#: counters); the other fields are the search structure, rebuilt from them.
SLOT_TABLE = (
    "table_key", "ids_hi", "ids_lo", "occupied", "counts", "last_seen",
    "free_slots", "num_free", "step", "admissions", "evictions", "defaulted",
)  # fmt: skip
#: The admission filter's fields: saved with the slot table; a state saved
#: before the filter existed restores with an empty one.
FILTER = ("filter_hi", "filter_lo", "filter_counts")


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
      filter_hi, filter_lo, filter_counts: ``[W]`` (``W`` the table's
        ``filter_size``; 1, unused, without ``min_count``), the admission filter: a
        bucket per hash of an untracked id, holding one id and how often it
        has been seen (count 0: empty).
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
    filter_hi: jax.Array
    filter_lo: jax.Array
    filter_counts: jax.Array

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
