"""The managed-collision remap's native kernels (``csrc/remap.cc``) against
their XLA reference (``jaxslices/managed/_table.py``): bit for bit.

Admission and eviction are native ops: a C++ kernel on one CPU device, the
jax.numpy functions of ``_table.py`` (the contract, tested against a NumPy
model of the policy in ``test_managed_remap.py``) everywhere else. Every
call's rows and evicted slots and the whole state must be equal on both
paths, over streams that take every branch: admissions into the recent copy,
its flush into the main copy, batches larger than the recent copy (straight
into the main copy), masked ids, full tables (the default), LFU and LRU
evictions with ties, and on-demand evictions. Skipped, naming the cause,
where the kernels do not load.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import needs_kernels
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxslices as js

pytestmark = needs_kernels

#: (slots, recent copy, evict_count, batch): a flush every few calls, a batch
#: larger than the recent copy, a full table with a small eviction
CONFIGS = [(12, 8, 4, 6), (12, 4, 6, 6), (40, None, 9, 10)]


def _targets(fn, *args) -> set[str]:
    text = jax.jit(fn).lower(*args).as_text()
    names = ("jaxslices_managed_admit", "jaxslices_managed_evict")
    return {name for name in names if name in text}


def _steps(mc):
    native = jax.jit(mc.remap)
    evict = jax.jit(mc.evict)
    with js.kernels.disabled():
        xla = jax.jit(mc.remap)
        xla_evict = jax.jit(mc.evict)
    return native, xla, evict, xla_evict


_COMPILED: dict = {}


def _compiled(config, policy):
    key = (config, policy)
    if key not in _COMPILED:
        S, K, E, _ = config
        mc = js.ManagedCollision(
            "t", num_slots=S, policy=policy, evict_every=3, evict_count=E, recent_size=K
        )
        _COMPILED[key] = (mc, *_steps(mc))
    return _COMPILED[key]


def _assert_states_equal(a, b, where):
    for field, x, y in zip(a._fields, a, b, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=f"{where}: {field}")


@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize("config", CONFIGS)
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), calls=st.integers(1, 9))
def test_native_remap_equals_the_xla_path_bitwise(policy, config, seed, calls):
    mc, native, xla, evict, xla_evict = _compiled(config, policy)
    S, _, _, N = config
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**63), 2**63 - 1, size=3 * S, dtype=np.int64)
    pool[: S // 2] = pool[0] + (np.arange(S // 2) << 32)  # one low word, many high
    a = b = mc.init()
    for k in range(calls):
        raw = js.RawIds.from_int64(pool[rng.integers(0, pool.size, size=(2, N // 2))])
        mask = jnp.asarray(rng.random((2, N // 2)) < 0.85)
        r1, a, e1 = native(a, raw, mask)
        r2, b, e2 = xla(b, raw, mask)
        np.testing.assert_array_equal(r1, r2, err_msg=f"rows of call {k}")
        np.testing.assert_array_equal(e1, e2, err_msg=f"evicted by call {k}")
        _assert_states_equal(a, b, f"call {k}")
    a, e1 = evict(a)
    b, e2 = xla_evict(b)
    np.testing.assert_array_equal(e1, e2)
    _assert_states_equal(a, b, "on demand")


def test_the_kernels_run_on_one_cpu_device_and_not_when_disabled():
    mc = js.ManagedCollision("t", num_slots=8, evict_every=2)
    state, ids = mc.init(), jnp.arange(4, dtype=jnp.int32)
    assert _targets(mc.remap, state, ids) == {
        "jaxslices_managed_admit",
        "jaxslices_managed_evict",
    }
    with js.kernels.disabled():
        assert _targets(mc.remap, state, ids) == set()


def test_explain_lists_the_remap_ops_and_why_they_take_a_path():
    mc = js.ManagedCollision("x", num_slots=16, evict_every=2)
    step, args = jax.jit(mc.remap), (mc.init(), jnp.array([1, 2, 3]))
    report = js.kernels.explain(step, *args)
    assert [d.op for d in report.decisions] == [
        "ManagedCollision('x'): eviction",
        "ManagedCollision('x').remap: admission",
    ]
    assert report.native and report.native_calls == 2
    assert "threads" not in str(report)  # the remap kernels take no threads
    with js.kernels.disabled():
        report = js.kernels.explain(step, *args)
    assert report.native_calls == 0 and len(report.decisions) == 2
    assert all(not d.native and "off" in d.reason for d in report.decisions)


def test_a_donated_state_is_updated_in_place():
    mc = js.ManagedCollision("t", num_slots=1 << 16, evict_every=2, evict_count=64)
    step = jax.jit(mc.remap, donate_argnums=0)
    ids = jnp.arange(256, dtype=jnp.int32)
    compiled = step.lower(mc.init(), ids).compile()
    assert js.table_copies(compiled, min_bytes=1 << 16) == []
