"""Path choice (jaxslices.kernels._path): the switch is part of JAX's caches.

``js.kernels.disabled()`` is a JAX user context, so ``jax.jit`` keys its
trace, lowering and compilation caches on it: a function traced before with
the kernels on is traced again inside ``disabled()`` (and the other way
round), and ``explain`` reports what calling the step runs in the caller's
context. What actually runs is read from the compiled step (its custom
calls), not from what jaxslices says about it.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import KERNELS_AVAILABLE, KERNELS_STATUS, bag_problem

import jaxslices as js

ROOT = Path(__file__).resolve().parents[2]
TOL = {"rtol": 2e-5, "atol": 2e-6}

needs_kernels = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not KERNELS_AVAILABLE,
    reason=f"needs the native CPU kernels here: {KERNELS_STATUS}",
)


def _problem(seed=0):
    return bag_problem(seed, rows=50, dim=4, bags=6, length=5)


TX = js.rowwise_adagrad(0.1)


def _loss(p, ids, y):
    h = js.embedding_bag(p["emb"], ids, combiner="mean")
    return jnp.mean((h @ p["w"] - y) ** 2)


def _step(p, s, ids, y):  # one module-level function, traced by several jits
    u, s = TX.update(js.grad(_loss)(p, ids, y), s, p)
    return js.apply_updates(p, u), s


def _custom_calls(jitted, *args) -> int:
    """The native kernel calls of the step as it compiles here and now."""
    text = jitted.lower(*args).compile().as_text()
    return len(re.findall(r'custom_call_target="jaxslices_', text))


needs = needs_kernels


@needs
def test_disabled_around_a_new_jit_of_a_function_traced_before():
    """The issue's case: JAX had cached the trace of `_step` (native); a new
    `jax.jit(_step)` called first inside `disabled()` must take the XLA path."""
    params, ids, y = _problem()
    state = TX.init(params)
    native_step = jax.jit(_step)
    want_native = native_step(params, state, ids, y)
    assert _custom_calls(native_step, params, state, ids, y) > 0

    with js.kernels.disabled():
        fresh = jax.jit(_step)
        got_xla = fresh(params, state, ids, y)
        assert _custom_calls(fresh, params, state, ids, y) == 0
        report = js.kernels.explain(fresh, params, state, ids, y)
    assert report.decisions and not any(d.native for d in report.decisions)
    assert all("are off" in d.reason for d in report.decisions), str(report)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got_xla,
                 want_native)  # fmt: skip


@needs
def test_a_compiled_step_called_inside_disabled_runs_the_xla_path_then_native():
    params, ids, y = _problem(1)
    state = TX.init(params)
    step = jax.jit(_step)
    step(params, state, ids, y)
    with js.kernels.disabled():
        assert _custom_calls(step, params, state, ids, y) == 0
        xla = step(params, state, ids, y)
    assert _custom_calls(step, params, state, ids, y) > 0
    native = step(params, state, ids, y)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), xla, native)


@needs
def test_explain_of_an_unjitted_function_reports_what_calling_it_runs():
    params, ids, y = _problem(2)
    state = TX.init(params)

    def step(p, s, ids, y):  # un-jitted: explain jits it
        return _step(p, s, ids, y)

    assert js.kernels.explain(step, params, state, ids, y).native
    with js.kernels.disabled():
        report = js.kernels.explain(step, params, state, ids, y)
        assert _custom_calls(jax.jit(step), params, state, ids, y) == 0
    assert not any(d.native for d in report.decisions), str(report)
    assert js.kernels.explain(step, params, state, ids, y).native
    assert _custom_calls(jax.jit(step), params, state, ids, y) > 0


@needs
def test_eager_ops_follow_the_switch():
    """Un-jitted calls: each op decides (and compiles) in the caller's context."""
    table = jnp.arange(12.0).reshape(6, 2)
    ids = jnp.array([[1, 2, 2], [5, 0, 6]])
    with js.kernels.disabled():
        report = js.kernels.explain(js.embedding_bag, table, ids)
        xla = js.embedding_bag(table, ids)
    assert not report.native
    assert js.kernels.explain(js.embedding_bag, table, ids).native
    np.testing.assert_allclose(js.embedding_bag(table, ids), xla, **TOL)


@needs
def test_the_switch_is_per_thread():
    params, ids, y = _problem(3)
    state = TX.init(params)
    step = jax.jit(_step)
    seen = {}
    inside, done = threading.Event(), threading.Event()

    def other_thread():
        inside.wait()
        seen["calls"] = _custom_calls(step, params, state, ids, y)
        done.set()

    t = threading.Thread(target=other_thread)
    t.start()
    with js.kernels.disabled():
        inside.set()
        assert done.wait(120)
        assert _custom_calls(step, params, state, ids, y) == 0
    t.join()
    assert seen["calls"] > 0


@needs
def test_nested_disabled_restores_the_outer_state():
    table, ids = jnp.ones((4, 2)), jnp.array([[1, 2]])
    with js.kernels.disabled():
        with js.kernels.disabled():
            pass
        assert not js.kernels.explain(js.embedding_bag, table, ids).native
    assert js.kernels.explain(js.embedding_bag, table, ids).native


def test_the_package_cites_only_docs_that_exist():
    """help(jaxslices.kernels) once cited a docs page that did not exist."""
    cited = set()
    for path in [
        *ROOT.joinpath("jaxslices").rglob("*.py"),
        *ROOT.glob("tests/**/*.py"),
    ]:
        cited |= set(re.findall(r"\bdocs/[A-Za-z0-9_]+\.md\b", path.read_text()))
    missing = sorted(c for c in cited if not (ROOT / c).exists())
    assert cited and not missing, missing


# ------------------------------------------- one body per op, on either path

OPS = ("jaxslices_bag_forward", "jaxslices_rowwise", "jaxslices_apply")


def _bound(fn, *args):
    """``{op: [reason bound with it]}`` of the native ops in ``fn``'s jaxpr."""
    from jaxslices.kernels import _explain

    out = {}
    for e in _explain._walk(jax.make_jaxpr(fn)(*args).jaxpr):
        if e.primitive.name in OPS:
            out.setdefault(e.primitive.name, []).append(e.params["reason"])
    return out


def test_an_xla_path_step_binds_each_op_with_its_reason():
    """The bag, the row-wise rule and the apply are each one op: on the XLA
    path their primitives are in the step's jaxpr, bound with the reason, and
    explain lists each decision from them (what runs is their reference)."""
    params, ids, y = _problem(4)
    tx = js.adagrad(0.1)

    def step(p, s, ids, y):
        u, s = tx.update(js.grad(_loss)(p, ids, y), s, p)
        return js.apply_updates(p, u), s

    args = (params, tx.init(params), ids, y)
    with js.kernels.disabled():
        bound = _bound(step, *args)
        report = js.kernels.explain(step, *args)
        xla = jax.jit(step)(*args)
    assert sorted(bound) == sorted(OPS), bound
    assert all("are off" in r for rs in bound.values() for r in rs), bound
    ops = [d.op for d in report.decisions]
    assert ops == [
        "embedding_bag",
        "jaxslices.scale_by_rss (leaf ['emb'])",
        "jaxslices.apply_updates (leaf ['emb'])",
    ], str(report)
    assert not any(d.native for d in report.decisions), str(report)
    assert all("are off" in d.reason for d in report.decisions), str(report)
    if KERNELS_AVAILABLE and jax.default_backend() == "cpu":  # the same ops, native
        native_ops = _bound(step, *args)
        assert sorted(native_ops) == sorted(OPS), native_ops
        assert all(r == "" for rs in native_ops.values() for r in rs), native_ops
        native = jax.jit(step)(*args)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), xla, native)


def test_what_the_bag_op_does_not_express_pools_rows_and_says_why():
    """max_norm: no bag op bound, a note; the rows pooled as the op pools."""
    params, ids, y = _problem(5)

    def loss(p, ids, y):
        h = js.embedding_bag(p["emb"], ids, combiner="sum", max_norm=100.0)
        return jnp.mean((h @ p["w"] - y) ** 2)

    assert "jaxslices_bag_forward" not in _bound(js.grad(loss), params, ids, y)
    (bag,) = js.kernels.explain(js.grad(loss), params, ids, y).decisions[:1]
    assert bag.op == "embedding_bag" and "max_norm" in bag.reason, bag
    table = params["emb"]  # no row over the norm: the same numbers as the op
    with js.kernels.disabled():
        op = js.embedding_bag(table, ids, combiner="sum")
        rows = js.embedding_bag(table, ids, combiner="sum", max_norm=100.0)
    np.testing.assert_array_equal(op, rows)


def test_a_bfloat16_bag_on_the_xla_path_pools_in_float32_and_rounds_once():
    """As the kernel does: the float32 pooling of the bfloat16 rows, rounded."""
    rng = np.random.default_rng(6)
    table = jnp.asarray(rng.normal(size=(30, 8)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, 30, size=(5, 7)))
    with js.kernels.disabled():
        low = js.embedding_bag(table, ids, combiner="sum")
        wide = js.embedding_bag(table.astype(jnp.float32), ids, combiner="sum")
    assert low.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(low, np.float32), np.asarray(wide.astype(jnp.bfloat16), np.float32)
    )


def test_the_rule_ops_reference_coalesces_by_its_method():
    """The row-wise op's XLA reference honours the coalescing method and keeps
    coalesced ids as they are, as jaxslices.coalesce does."""
    from jaxslices._recipe import PooledGradient
    from jaxslices.kernels import _ops

    spec = _ops.RuleSpec("coalesce", lambda g, st, p, hp, cfg: (g, ()))
    values, ids = jnp.arange(6.0).reshape(6, 1), jnp.array([5, 1, 5, 3, 9, 1])

    def op(ids, **kw):
        args = {"num_rows": 10, "spec": spec, "capacity": 6, "reason": "a test"}
        return _ops.rowwise(PooledGradient(values), ids, **args, **kw)[1:3]

    want = js.coalesce(js.IndexedSlices(values, ids, (10, 1)), method="sort")
    uids, rows = op(ids, method="sort")
    np.testing.assert_array_equal(uids, want.indices)
    np.testing.assert_array_equal(rows, want.values)
    kept = jnp.array([7, 2, 10, 10, 10, 10])  # distinct ids, padding after
    uids, rows = op(kept, coalesced=True, method="hash")
    np.testing.assert_array_equal(uids, kept)
    np.testing.assert_array_equal(rows[:2], values[:2])


def test_jax_jvp_goes_through_an_xla_path_bag():
    """The bag op's own JVP rule serves both paths (the XLA lookup's
    custom_vjp refused forward mode): a mean bag is linear in the table."""
    rng = np.random.default_rng(7)
    table, tangent = (jnp.asarray(rng.normal(size=(12, 3)), jnp.float32) for _ in "ab")
    ids = jnp.asarray(rng.integers(-1, 13, size=(4, 5)))

    def bag(t):
        return js.embedding_bag(t, ids, combiner="mean")

    with js.kernels.disabled():
        out, t_out = jax.jvp(bag, (table,), (tangent,))
        np.testing.assert_array_equal(out, bag(table))
        np.testing.assert_allclose(t_out, bag(tangent), rtol=1e-6, atol=1e-7)
