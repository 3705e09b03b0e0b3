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
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import _mesh
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _failure_cases import CASES, EXPECTED
from helpers import CHECK_FAILED, JAX_FIRST_LINE, LOGGED
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxslices as js
from jaxslices import _errors, _jax_compat
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


# ------------------------------------------------- what a user reads first


def _lookup_check_ids():
    step = jax.jit(lambda t, i: js.embedding_lookup(t, i, check_ids=True).sum())
    table = jnp.ones((5, 2))
    return step, (table, jnp.array([0, 1])), (table, jnp.array([0, 7]))


def _public_check_ids():  # always=True: an effect, JAX's Python path each call
    step = jax.jit(lambda i: js.check_ids(i, 5) * 2)
    return step, (jnp.array([0, 4]),), (jnp.array([-1, 4]),)


def _max_distinct():
    def step(values, ids):
        s = js.IndexedSlices(values, ids, (10,))
        return js.coalesce(s, max_distinct=3).values

    values = jnp.ones(5)
    return (
        jax.jit(step),
        (values, jnp.array([4, 1, 4, 1, 2])),
        (
            values,
            jnp.array([4, 1, 4, 9, 2]),
        ),
    )


def _jagged_max_total():
    step = jax.jit(lambda v, n: js.JaggedIds.from_lengths(v, n, max_total=3).offsets)
    values = jnp.arange(5)
    return step, (values, jnp.array([1, 2])), (values, jnp.array([2, 2]))


def _multisteps_capacity():
    ms = js.MultiSteps(optax.identity(), every_k_schedule=2, capacity={"emb": 4})
    params = {"emb": jnp.zeros((16, 2))}

    def step(state, ids):
        grads = {"emb": js.IndexedSlices(jnp.ones((4, 2)), ids, (16, 2))}
        return ms.update(grads, state, params)[1]

    seen = jnp.array([0, 1, 2, 3])
    state = step(ms.init(params), seen)  # 4 rows in 4 slots (eagerly)
    return jax.jit(step), (state, seen), (state, jnp.array([4, 5, 6, 7]))


#: Each kind of check: a fresh jitted step, arguments that pass and that fail,
#: and how jaxslices' message starts.
KINDS = {
    "embedding_lookup(check_ids=True)": (
        _lookup_check_ids,
        "embedding_lookup(check_ids=True): ids must be in [0, 5) for a table "
        "with 5 rows; 1 id is out of range (the ids checked have min 0 and max 7)",
    ),
    "check_ids": (
        _public_check_ids,
        "check_ids: ids must be in [0, 5) for a table with 5 rows; 1 id is out "
        "of range (the ids checked have min -1 and max 4)",
    ),
    "max_distinct": (
        _max_distinct,
        "jaxslices.coalesce: this step's gradient touches 4 distinct rows, more than "
        "max_distinct=3. Nothing was dropped: the step stops here. Pass "
        "max_distinct >= 4",
    ),
    "max_total": (
        _jagged_max_total,
        "JaggedIds.from_lengths: the bags hold 4 ids in all, more than "
        "max_total=3 slots. Pass a larger static `max_total`",
    ),
    "MultiSteps capacity": (
        _multisteps_capacity,
        "jaxslices.MultiSteps (leaf ['emb']): the accumulated gradient touches "
        "8 distinct rows but the buffer has capacity=4 slots.",
    ),
}


def _raised(step, args) -> BaseException:
    with pytest.raises(CHECK_FAILED) as info:
        jax.block_until_ready(step(*args))
    return info.value


@pytest.mark.parametrize("kind", KINDS)
def test_what_a_user_reads_when_a_check_fails_under_jit(kind, caplog, monkeypatch):
    """First the log: one line, jaxslices' message. Then JAX's error: its first
    line is JAX's (jaxlib's), its last line the message (JAX 0.10.2, 0.12)."""
    monkeypatch.setattr(_errors, "LOG_REPEAT_S", 0.0)  # a line per failure here
    make, message = KINDS[kind]
    caplog.set_level(logging.ERROR)
    step, _, bad = make()
    first = _raised(step, bad)  # a step's first call: JAX's Python dispatch path
    step, good, bad = make()
    step(*good)  # a step whose first call passed: later calls take the C++ path
    later = _raised(step, bad)
    assert type(first) is jax.errors.JaxRuntimeError
    if kind == "check_ids":  # an effect: every call takes the Python path
        assert type(later) is jax.errors.JaxRuntimeError
    else:
        assert type(later) is ValueError
    full = None
    for e in (first, later):
        lines = str(e).splitlines()
        assert lines[0] == JAX_FIRST_LINE, lines[0]
        assert lines[-1].startswith(f"ValueError: {message}"), lines[-1]
        full = full or lines[-1].removeprefix("ValueError: ")
        assert lines[-1] == f"ValueError: {full}"
        # One frame of jaxslices' check, the one that raised.
        assert sum(_errors.__file__ in ln for ln in lines[1:-1]) == 1, lines
    logged = [r for r in caplog.records if r.name.startswith("jax")]
    assert [r.getMessage() for r in logged] == [LOGGED + full] * 2
    assert all(r.exc_info is None and r.levelno == logging.ERROR for r in logged)


def test_one_log_line_per_failure_and_other_records_untouched():
    mine = ValueError("jaxslices' message")
    setattr(mine, _errors._MARK, True)

    def record(exc, msg="jax.pure_callback failed"):
        return logging.LogRecord(
            "jax", logging.ERROR, __file__, 1, msg, (), (type(exc), exc, None)
        )

    f = _errors._OneLineLog()
    r = record(mine)
    assert f.filter(r) and r.getMessage() == LOGGED + "jaxslices' message"
    assert r.exc_info is None
    assert not f.filter(record(mine))  # the same failure on another device
    other = ValueError("someone else's")
    r = record(other)
    assert f.filter(r) and r.getMessage() == "jax.pure_callback failed"
    assert r.exc_info[1] is other
    plain = logging.LogRecord("jax", logging.ERROR, __file__, 1, "x", (), None)
    assert f.filter(plain) and plain.getMessage() == "x"


def test_a_user_callback_keeps_jax_log(caplog):
    def boom(x):
        raise RuntimeError("a user's callback failed")

    out = jax.ShapeDtypeStruct((), jnp.float32)
    f = jax.jit(lambda x: jax.pure_callback(boom, out, x))
    jax.jit(_check)(jnp.arange(3))  # a check staged: the filter is installed
    caplog.set_level(logging.ERROR)
    with pytest.raises(CHECK_FAILED, match="a user's callback failed"):
        jax.block_until_ready(f(1.0))
    (r,) = [r for r in caplog.records if r.name.startswith("jax")]
    assert r.getMessage() == "jax.pure_callback failed"
    assert isinstance(r.exc_info[1], RuntimeError)


def test_without_the_callback_logs_entry_jax_log_stays(caplog, monkeypatch):
    for logger in _jax_compat.callback_loggers():
        kept = [f for f in logger.filters if f is not _errors._LOG_FILTER]
        monkeypatch.setattr(logger, "filters", kept)
    monkeypatch.setitem(_jax_compat.AVAILABLE, "callback_logs", False)
    assert _jax_compat.callback_loggers() == ()
    caplog.set_level(logging.ERROR)
    with pytest.raises(CHECK_FAILED, match="1 bad, max 10") as info:
        jax.block_until_ready(jax.jit(_check)(jnp.arange(11)))
    assert str(info.value).splitlines()[0] == JAX_FIRST_LINE
    (r,) = [r for r in caplog.records if r.name.startswith("jax")]
    assert r.getMessage() == "jax.pure_callback failed"
    assert str(r.exc_info[1]) == "1 bad, max 10"


_SEEN = "### What you see when a check fails under `jit`"
_OUTPUTS = {(0, 12): 0, (0, 10): 1}  # which text block of the docs, per JAX line
_FRAME_LINE = re.compile(r'^(  File "[^"]*", line )\d+', re.M)


def _shown(text: str, script: str) -> str:
    """``text`` with the line numbers of every frame but the script's masked."""
    return "\n".join(
        ln if script in ln else _FRAME_LINE.sub(r"\1N", ln)
        for ln in text.strip().splitlines()
    )


def test_the_docs_show_what_a_user_sees(tmp_path):
    """docs/sparse_gradients.md's script, run: its output is the page's, but
    for the line numbers of JAX's and jaxslices' own frames."""
    line = _jax_compat.JAX_VERSION[:2]
    if line not in _OUTPUTS:
        pytest.skip(f"the page shows JAX 0.10.2 and 0.12.0.1, not {jax.__version__}")
    section = (ROOT / "docs" / "sparse_gradients.md").read_text().split(_SEEN)[1]
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", section, re.S | re.M)
    script = next(body for lang, body in blocks if lang == "py")
    want = [body for lang, body in blocks if lang == "text"][_OUTPUTS[line]]
    (tmp_path / "step.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "step.py"], cwd=tmp_path, env=env, capture_output=True
    )
    assert proc.returncode == 1
    got = proc.stderr.decode()
    for path in (tmp_path, ROOT):
        got = got.replace(str(path) + os.sep, ".../")
    got = re.sub(r'"[^"]*site-packages/', '".../site-packages/', got)
    assert _shown(got, "step.py") == _shown(want, "step.py")


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
    assert r["first"] == JAX_FIRST_LINE, r
    assert EXPECTED[case] in r["message"], r
    # Logged first, as one line, once for the 8 devices.
    stderr = proc.stderr.decode()
    assert stderr.count(LOGGED + EXPECTED[case]) == 1, stderr[-3000:]
    assert "callback failed" not in stderr, stderr[-3000:]
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
