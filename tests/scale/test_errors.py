"""``raise_if``: run-time checks that raise eagerly, under jit, on every device.

Unit checks of :func:`jaxslices._errors.raise_if` (eager, ``jit``, ``vmap``,
``shard_map`` with and without ``check_vma``, plain ``jit`` over a mesh, an
unused result), then the steps a user writes whose check fails on exactly one
of 8 devices (``tests/_failure_cases.py``: ``all_to_all`` capacity in the
lookup and in the update, ``check_ids`` under ``jit`` and inside
``shard_map``, ``MultiSteps`` overflow): each must raise, quickly, with the
error naming the fix, and the process must run a correct step afterwards.
Before ``raise_if`` the one-device failures left the other devices waiting in
a collective until XLA aborted the process (about 60 s, SIGABRT). The same
cases run on 2 processes x 4 devices in ``tests/scale/test_sharding_multihost.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _mesh
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _failure_cases import CASES, EXPECTED
from helpers import CHECK_FAILED
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxslices as js
from jaxslices._errors import raise_if

ROOT = Path(__file__).resolve().parents[2]


def _error(n, hi=0):
    return ValueError(f"{n} bad, max {hi}")


def _check(ids):
    bad = ids >= 10
    return raise_if(bad, ids, _error, jnp.sum(bad), jnp.max(ids))


# --------------------------------------------------------------- raise_if


def test_eager_raises_at_the_call_and_returns_the_guard():
    ids = jnp.array([1, 2])
    assert _check(ids) is ids
    with pytest.raises(ValueError, match="2 bad, max 12"):
        _check(jnp.array([11, 3, 12]))


def test_under_jit_raises_when_the_step_runs():
    f = jax.jit(lambda ids: _check(ids) * 2)
    np.testing.assert_array_equal(f(jnp.arange(4)), [0, 2, 4, 6])
    with pytest.raises(CHECK_FAILED, match="1 bad, max 10"):
        jax.block_until_ready(f(jnp.arange(11)))
    np.testing.assert_array_equal(f(jnp.arange(2)), [0, 2])  # still works


def test_with_always_an_unused_result_is_still_checked():
    def f(ids):
        bad = ids >= 10
        raise_if(bad, ids, _error, jnp.sum(bad), jnp.max(ids), always=True)
        return ids * 2

    with pytest.raises(CHECK_FAILED, match="2 bad"):
        jax.block_until_ready(jax.jit(f)(jnp.arange(12)))
    # check_ids is such a check: a user may call it as a statement.
    g = jax.jit(lambda ids: (js.check_ids(ids, 10), ids * 2)[1])
    with pytest.raises(CHECK_FAILED, match="check_ids"):
        jax.block_until_ready(g(jnp.arange(12)))


def test_a_check_is_no_effect_so_the_step_keeps_the_fast_dispatch_path():
    # An effect (jax.debug.callback) sends every call of the step through
    # JAX's Python dispatch; a pure check does not.
    ids = jnp.arange(4)
    assert not jax.make_jaxpr(lambda i: _check(i) * 2)(ids).effects
    assert jax.make_jaxpr(lambda i: js.check_ids(i, 10) * 2)(ids).effects


def test_every_guarded_leaf_waits_for_the_check():
    def f(ids, x):
        bad = ids >= 10
        g_ids, g_x = raise_if(bad, (ids, x), _error, jnp.sum(bad), jnp.max(ids))
        return g_ids, g_x

    ids, x = jnp.arange(4), jnp.array([-0.0, 1.5, jnp.inf])
    out_ids, out_x = jax.jit(f)(ids, x)
    np.testing.assert_array_equal(out_ids, ids)
    np.testing.assert_array_equal(np.signbit(out_x), np.signbit(x))  # bit for bit
    np.testing.assert_array_equal(out_x, x)
    # Only the float leaf used: still checked.
    with pytest.raises(CHECK_FAILED, match="2 bad"):
        jax.block_until_ready(jax.jit(lambda i, x: f(i, x)[1] * 2)(jnp.arange(12), x))


def test_under_vmap_the_batch_element_that_failed_is_reported():
    f = jax.jit(jax.vmap(_check))
    np.testing.assert_array_equal(f(jnp.ones((3, 2), jnp.int32)), np.ones((3, 2)))
    ids = jnp.array([[1, 2], [3, 40], [5, 6]])
    with pytest.raises(CHECK_FAILED, match="1 bad, max 40"):
        jax.block_until_ready(f(ids))


def test_later_calls_of_a_compiled_step_raise_too():
    # JAX's C++ dispatch path (every call after the first) reports the
    # callback's error as a ValueError, its Python path as JaxRuntimeError.
    f = jax.jit(lambda ids: _check(ids) * 2)
    f(jnp.arange(12) % 10)  # compiled, passes
    for _ in range(3):
        with pytest.raises(CHECK_FAILED, match="2 bad, max 11"):
            jax.block_until_ready(f(jnp.arange(12)))
    np.testing.assert_array_equal(f(jnp.arange(12) % 3)[:4], [0, 2, 4, 0])


@pytest.mark.parametrize("check_vma", [True, False])
def test_inside_shard_map_one_device_fails_every_device_reports_global_values(
    check_vma,
):
    m = _mesh.mesh()

    def per_device(ids):
        bad = ids >= 10
        ids = raise_if(
            bad, ids, _error, jnp.sum(bad), jnp.max(ids), reduce=("sum", "max")
        )
        return jax.lax.psum(ids.sum(), "data")

    f = jax.jit(
        jax.shard_map(
            per_device,
            mesh=m,
            in_specs=P("data"),
            out_specs=P(),
            check_vma=check_vma,
        )
    )
    ids = np.arange(16) % 8
    assert int(f(jnp.asarray(ids))) == ids.sum()
    ids[13] = 99  # device 6 only
    with pytest.raises(CHECK_FAILED, match="1 bad, max 99"):
        jax.block_until_ready(f(jnp.asarray(ids)))


def test_plain_jit_over_a_mesh_runs_the_check_on_every_device():
    m = _mesh.mesh()
    split = NamedSharding(m, P("data"))
    table = jax.device_put(jnp.ones((10, 3)), NamedSharding(m, P()))

    @jax.jit
    def step(table, ids):
        ids = _check(ids)
        rows = table[ids]
        return table.at[ids].add(rows), rows.sum()  # an all-reduce follows

    ids = np.arange(32) % 10
    step(table, jax.device_put(jnp.asarray(ids), split))
    ids[21] = 12
    with pytest.raises(CHECK_FAILED, match="1 bad, max 12"):
        jax.block_until_ready(step(table, jax.device_put(jnp.asarray(ids), split)))
    hlo = step.lower(table, jax.device_put(jnp.asarray(ids), split)).as_text()
    assert "shard_map" in hlo or "manual" in hlo.lower()


# ---------------------------------------- one failing device of 8, as users


_RUNNER = """
import json, os, sys
sys.path.insert(0, {tests!r})
import jax, numpy as np
from jax.sharding import Mesh
import _failure_cases as fc
mesh = Mesh(np.array(jax.devices()[:8]), ("model",))
for case in fc.CASES:
    print(json.dumps({{case: fc.run_case(case, mesh)}}), flush=True)
"""


@pytest.fixture(scope="module")
def one_device_failures():
    """Every case in a child process: a hang would abort it, not this run."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    }
    code = _RUNNER.format(tests=str(ROOT / "tests"))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, timeout=600
    )
    results = {}
    for line in proc.stdout.decode().splitlines():
        if line.startswith("{"):
            results.update(json.loads(line))
    return results, proc


@pytest.mark.parametrize("case", CASES)
def test_a_check_failing_on_one_of_8_devices_raises(one_device_failures, case):
    results, proc = one_device_failures
    assert case in results, (proc.returncode, proc.stderr.decode()[-3000:])
    r = results[case]
    assert r["raised"], r
    assert r["type"] in ("JaxRuntimeError", "ValueError"), r
    assert EXPECTED[case] in r["message"], r
    # Raised at once: the rendezvous timeout that used to end it is 40+ s.
    assert r["seconds"] < 30, r
    assert np.isfinite(r["after"]), r  # the next, correct step ran


def test_the_one_device_data_fails_only_one_device():
    """The cases really are one-device failures (a test that can fail)."""
    from _failure_cases import BAD_DEVICE, spread_ids

    def per_device_needed(ids):
        out = []
        for d in range(8):
            local = np.unique(ids.reshape(8, -1)[d])
            counts = np.bincount(local // 8, minlength=8)
            out.append(int(counts.max()))
        return out

    assert max(per_device_needed(spread_ids(False))) == 1
    bad = per_device_needed(spread_ids(True))
    assert [d for d, n in enumerate(bad) if n > 2] == [BAD_DEVICE]


def test_check_ids_returns_the_ids():
    ids = np.array([0, 4], np.int64)
    assert js.check_ids(ids, 5) is not None
    np.testing.assert_array_equal(js.check_ids(ids, 5), ids)
    f = jax.jit(lambda i: js.embedding_lookup(jnp.eye(5), js.check_ids(i, 5)))
    np.testing.assert_array_equal(f(jnp.array([4])), [[0, 0, 0, 0, 1]])
