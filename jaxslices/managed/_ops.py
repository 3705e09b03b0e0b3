"""The managed-collision remap in the kernels' seam: admission and eviction as ops.

Each is a native op (:class:`jaxslices.kernels._primitive.NativeOp`), bound
in every case with the reason :func:`jaxslices.kernels._path.decide` gives
when it is traced: its lowering runs the C++ kernel (``csrc/remap.cc``) on
one CPU device and the XLA reference (:mod:`jaxslices.managed._reference`)
everywhere else, the same state bit for bit, updated in place; and
:func:`jaxslices.kernels.explain` lists both, with the reason where the
reference runs. They have no GPU kernel, take no ids dtype (raw ids are
pairs of ``uint32`` words) and share no work between threads.

The state reaches the kernels as the fifteen arrays of :data:`STATE_FIELDS`
and one vector of the scalar counters (:data:`SCALARS`), in this order on
both sides (``csrc/remap.cc`` binds them once, ``BindState``), each output
aliasing its input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._jax_compat import native_out_aval
from ..kernels import _path
from ..kernels._primitive import NativeOp
from . import _reference
from ._state import RemapState

__all__ = ["SCALARS", "STATE_FIELDS", "admit", "evict"]

#: The state's arrays, as the kernels bind them.
STATE_FIELDS = (
    "ids_hi", "ids_lo", "occupied", "counts", "last_seen",
    "sorted_hi", "sorted_lo", "sorted_slots", "recent_hi", "recent_lo", "recent_slots",
    "free_slots", "filter_hi", "filter_lo", "filter_counts",
)  # fmt: skip
#: The state's scalar counters, in the kernels' order (``enum Scalar``).
SCALARS = (
    "num_free", "num_recent", "step", "admissions", "defaulted", "evictions",
    "num_stale",
)  # fmt: skip


def _operands(state: RemapState) -> list[jax.Array]:
    scalars = jnp.stack([jnp.asarray(getattr(state, f), jnp.int32) for f in SCALARS])
    return [*(getattr(state, f) for f in STATE_FIELDS), scalars]


def _with(state: RemapState, outs: list[jax.Array]) -> RemapState:
    *arrays, scalars = outs
    fields = dict(zip(STATE_FIELDS, arrays, strict=True))
    fields.update({f: scalars[i] for i, f in enumerate(SCALARS)})
    return state._replace(**fields)


def _state(operands: tuple[jax.Array, ...]) -> RemapState:
    empty = RemapState(*([None] * len(RemapState._fields)))
    return _with(empty._replace(table_key=jnp.zeros((2,), jnp.uint32)), operands)


def _admit_reference(hi, lo, valid, *state, min_count, threshold, half_life, **_):
    rows, new = _reference.lookup_and_admit(
        _state(state), hi, lo, valid, int(min_count), int(threshold), int(half_life)
    )
    return [rows, *_operands(new)]


def _evict_reference(*state, lfu, evict_count, half_life, ttl, **_):
    policy = "lfu" if lfu else "lru"
    new, evicted = _reference.evict(
        _state(state), policy, evict_count, int(half_life), int(ttl)
    )
    return [evicted, *_operands(new)]


def _state_avals(state, avals):
    return [native_out_aval(a.shape, a.dtype, avals) for a in state]


def _admit_abstract(hi, lo, valid, *state, **_):
    avals = (hi, lo, valid, *state)
    rows = native_out_aval(hi.shape, jnp.int32, avals)
    return [rows, *_state_avals(state, avals)]


def _evict_abstract(*state, evict_count, **_):
    evicted = native_out_aval((evict_count,), jnp.int32, state)
    return [evicted, *_state_avals(state, state)]


_NUM_STATE = len(STATE_FIELDS) + 1  # the arrays and the scalars
_ADMIT = NativeOp(
    "jaxslices_managed_admit",
    _admit_reference,
    _admit_abstract,
    # operands (hi, lo, valid, *state) -> outputs (rows, *state), in place
    aliases={3 + i: 1 + i for i in range(_NUM_STATE)},
    attrs={"min_count": np.int64, "threshold": np.int64, "half_life": np.int64},
    ids_operand=None,
    threads=False,
)
_EVICT = NativeOp(
    "jaxslices_managed_evict",
    _evict_reference,
    _evict_abstract,
    # operands (*state) -> outputs (evicted, *state), in place
    aliases={i: 1 + i for i in range(_NUM_STATE)},
    attrs={"lfu": np.bool_, "half_life": np.int64, "ttl": np.int64},
    ids_operand=None,
    threads=False,
)


def _reason(state: RemapState, *arrays: jax.Array) -> str:
    return _path.decide(*arrays, state.occupied, gpu=False)


def admit(
    state: RemapState,
    hi: jax.Array,
    lo: jax.Array,
    valid: jax.Array,
    *,
    label: str,
    min_count: int = 1,
    threshold: int = -1,
    half_life: int = 0,
) -> tuple[jax.Array, RemapState]:
    """:func:`_reference.lookup_and_admit` as its op (``label``: for ``explain``;
    ``min_count``, ``threshold``: the admission filter's, ``half_life``: the
    counts' decay, static)."""
    if hi.shape[0] == 0:
        return jnp.zeros((0,), jnp.int32), state
    rows, *outs = _ADMIT.bind(
        hi,
        lo,
        valid,
        *_operands(state),
        reason=_reason(state, hi),
        label=label,
        min_count=int(min_count),
        threshold=int(threshold),
        half_life=int(half_life),
    )
    return rows, _with(state, outs)


def evict(
    state: RemapState,
    *,
    policy: str,
    evict_count: int,
    label: str,
    half_life: int = 0,
    ttl: int = 0,
) -> tuple[RemapState, jax.Array]:
    """:func:`_reference.evict` as its op (``label``: for ``explain``)."""
    evicted, *outs = _EVICT.bind(
        *_operands(state),
        reason=_reason(state),
        lfu=policy == "lfu",
        evict_count=int(evict_count),
        label=label,
        half_life=int(half_life),
        ttl=int(ttl),
    )
    return _with(state, outs), evicted
