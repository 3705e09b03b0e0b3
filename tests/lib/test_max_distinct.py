"""The distinct-row bound ``max_distinct``, XLA's index promises, fused clipping.

With a bound at least the distinct rows of every step, every transform gives
the bits it gives without one (only the number of slots changes); one more
distinct row than the bound raises, eagerly and under ``jit`` (on a mesh:
``tests/scale/test_capacity_mesh.py``).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import CHECK_FAILED, assert_same_bits

import jaxslices as js
from jaxslices import IndexedSlices

V, D, N = 12, 3, 10  # table rows, width, lookups per step


def params():
    rng = np.random.default_rng(0)
    return {
        "emb": jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(D,)), jnp.float32),
    }


def grads(steps=3, distinct=4, seed=1):
    """``N`` lookups of ``distinct`` rows per step, a padding and an invalid id."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        rows = rng.choice(V, size=distinct, replace=False)
        idx = np.r_[rows, rng.choice(rows, size=N - distinct - 2), [V, -1]]
        rng.shuffle(idx)
        vals = rng.normal(size=(N, D)).astype(np.float32)
        vals[idx == V] = 0.0
        s = IndexedSlices(jnp.asarray(vals), jnp.asarray(idx, jnp.int32), (V, D))
        out.append({"emb": s, "w": jnp.asarray(rng.normal(size=D), jnp.float32)})
    return out


def with_bound(k, method="auto"):
    kw = {"coalesce_method": method, "max_distinct": k}
    return {
        "sgd_momentum": js.sgd(0.1, 0.9, **kw),
        "clip_sgd": optax.chain(js.clip_by_global_norm(1.0, **kw), js.sgd(0.1)),
        "adagrad": js.adagrad(0.1, **kw),
        "rowwise_adagrad": js.rowwise_adagrad(0.1, **kw),
        "lazy_adam": js.lazy_adam(0.05, **kw),
        "lazy_adamw": js.lazy_adamw(0.05, weight_decay=0.1, **kw),
        "ftrl": js.ftrl(0.1, l1=0.01, **kw),
        "clip": optax.chain(js.clip(0.5, **kw), js.sgd(0.1)),
        "clip_by_row_norm": optax.chain(js.clip_by_row_norm(0.5, **kw), js.sgd(0.1)),
        "add_decayed_weights": optax.chain(
            js.add_decayed_weights(0.1, mask={"emb": True, "w": False}, **kw),
            js.sgd(0.1),
        ),
    }


def run(tx, gs, p=None):
    p = params() if p is None else p
    state = tx.init(p)

    @jax.jit
    def step(p, state, g):
        u, state = tx.update(g, state, p)
        return js.apply_updates(p, u), state, u

    for g in gs:
        p, state, u = step(p, state, g)
    return p, state, u


NAMES = list(with_bound(None))


CASES = [(n, "auto") for n in NAMES] + [
    (n, "sort") for n in ("clip_sgd", "lazy_adam", "rowwise_adagrad")
]


@pytest.mark.parametrize("name, method", CASES)
def test_a_bound_that_holds_gives_the_same_bits(name, method):
    gs = grads()
    p0, s0, u0 = run(with_bound(None, method)[name], gs)
    p1, s1, u1 = run(with_bound(5, method)[name], gs)
    jax.tree.map(assert_same_bits, (p1, s1), (p0, s0))
    assert u0["emb"].num_slices == N and u1["emb"].num_slices == 5
    assert_same_bits(u1["emb"].to_dense(), u0["emb"].to_dense())


def test_a_per_table_bound_and_a_bound_above_the_lookups():
    gs = grads()
    p0, s0, _ = run(js.lazy_adam(0.05), gs)
    p1, s1, u1 = run(js.lazy_adam(0.05, max_distinct={"emb": 4, "w": None}), gs)
    jax.tree.map(assert_same_bits, (p1, s1), (p0, s0))
    assert u1["emb"].num_slices == 4
    _, _, u2 = run(js.lazy_adam(0.05, max_distinct=10**6), gs)
    assert u2["emb"].num_slices == N  # never more slots than lookups


OVER = "touches 5 distinct rows, more than max_distinct=4"


@pytest.mark.parametrize("name", ["lazy_adam", "clip_sgd"])
def test_one_row_over_the_bound_raises_eagerly(name):
    tx = with_bound(4)[name]
    (g,) = grads(1, distinct=5)
    p = params()
    with pytest.raises(ValueError, match=OVER) as e:
        tx.update(g, tx.init(p), p)
    assert "(leaf ['emb'])" in str(e.value) and "Nothing was dropped" in str(e.value)


@pytest.mark.parametrize("name", ["ftrl"])
def test_one_row_over_the_bound_raises_under_jit(name):
    tx = with_bound(4)[name]
    run(tx, grads(1, distinct=4))  # fits
    with pytest.raises(CHECK_FAILED, match=OVER):
        jax.block_until_ready(run(tx, grads(1, distinct=5)))


def test_coalesce_max_distinct():
    s = IndexedSlices(jnp.ones(5), jnp.array([4, 1, 4, 9, 2]), (9,))
    c = js.coalesce(s, max_distinct=3)
    assert c.num_slices == 3 and c.unique_indices and c.indices_sorted
    np.testing.assert_array_equal(c.to_dense(), s.to_dense())
    with pytest.raises(ValueError, match="3 distinct rows, more than max_distinct=2"):
        js.coalesce(s, max_distinct=2)
    # Coalesced already: cut to the bound (after checking what is cut).
    full = js.coalesce(s)
    assert js.coalesce(full, max_distinct=3).num_slices == 3
    with pytest.raises(ValueError, match="max_distinct=2"):
        js.coalesce(full, max_distinct=2)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_a_bad_bound_is_refused_when_the_transform_is_made(bad):
    with pytest.raises(ValueError, match="`max_distinct` must be a positive int"):
        js.lazy_adam(0.1, max_distinct=bad)
    with pytest.raises(ValueError, match="`max_distinct` must be a positive int"):
        js.coalesce(IndexedSlices(jnp.ones(1), jnp.array([0]), (2,)), max_distinct=bad)


def test_a_bound_tree_that_does_not_fit_the_updates_names_the_argument():
    tx = js.adagrad(0.1, max_distinct={"table": 4})
    p = params()
    with pytest.raises(ValueError, match="pytree prefix of the updates"):
        tx.update(grads(1)[0], tx.init(p), p)


# ------------------------ promises and passes, read in the jaxpr and the HLO


def _eqns(jaxpr, prim):
    out = []
    for eqn in jaxpr.eqns:
        for p in eqn.params.values():
            for q in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(q, "jaxpr", q)
                if hasattr(inner, "eqns"):
                    out += _eqns(inner, prim)
        if eqn.primitive.name.startswith(prim):
            out.append(eqn)
    return out


def _step(tx):
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return js.apply_updates(p, u), s

    p = params()
    return step, (p, tx.init(p), grads(1)[0])


def _step_jaxpr(tx):
    step, args = _step(tx)
    return jax.make_jaxpr(step)(*args).jaxpr


def _compiled_sorts(tx) -> int:
    """Sorts in the compiled step (the platform's branch of each coalesce)."""
    step, args = _step(tx)
    hlo = jax.jit(step).lower(*args).compile().as_text()
    return len(re.findall(r" sort\(", hlo))


def _on_table(eqns, width):
    return [e for e in eqns if tuple(e.invars[0].aval.shape) in {(V, D), (V, width)}]


def _hlo(tx) -> str:
    """The step's HLO before XLA's passes: the ops the lowerings emit."""
    step, args = _step(tx)
    return jax.jit(step).lower(*args).compiler_ir("hlo").as_hlo_text()


def _hlo_ops(hlo: str, op: str, shape: str) -> list[str]:
    """The HLO lines of ``op`` whose result has ``shape`` (e.g. ``f32[6,3]``)."""
    return re.findall(rf"= {re.escape(shape)}\S* {op}\([^\n]*", hlo)


@pytest.mark.usefixtures("xla_path")  # XLA's structure; native: test_kernels
@pytest.mark.parametrize("method", ["auto", "sort"])
def test_coalesced_scatters_and_gathers_promise_unique_indices(method):
    tx = optax.chain(
        js.clip_by_global_norm(1.0, coalesce_method=method, max_distinct=6),
        js.adagrad(0.1, coalesce_method=method),
    )
    jaxpr = _step_jaxpr(tx)
    # Adagrad: one row-wise op over the bound, on rows the clip coalesced...
    (rule,) = _eqns(jaxpr, "jaxslices_rowwise")
    assert rule.params["capacity"] == 6 and rule.params["coalesced"], rule
    # ...and the table: one apply op, told its rows are coalesced (and sorted).
    (apply,) = _on_table(_eqns(jaxpr, "jaxslices_apply"), D)
    assert apply.params["coalesced"], apply
    assert apply.params["indices_sorted"] == (method == "sort"), apply
    assert apply.invars[2].aval.shape[0] == 6, apply
    # Their XLA lowerings promise it to XLA: the state's rows read once and
    # written once, the table's scatter-added, over the bound's 6 rows.
    hlo = _hlo(tx)
    gathers = _hlo_ops(hlo, "gather", f"f32[6,{D}]")
    scatters = _hlo_ops(hlo, "scatter", f"f32[{V},{D}]")
    assert len(gathers) == 1 and len(scatters) == 2, (gathers, scatters)
    assert sum("scatter(p__emb__" in e for e in scatters) == 1, scatters
    for e in scatters:  # an HLO gather has no unique_indices
        assert "unique_indices=true" in e, e
    for e in gathers + scatters:
        assert ("indices_are_sorted=true" in e) == (method == "sort"), e


@pytest.mark.usefixtures("xla_path")  # XLA's structure; native: test_kernels
def test_clip_then_optimizer_coalesces_once_and_reads_the_rows_once():
    """Fused clipping: the norm comes from the rows the update uses anyway."""
    tx = optax.chain(
        js.clip_by_global_norm(1.0, coalesce_method="sort", max_distinct=6),
        js.lazy_adam(0.1, coalesce_method="sort"),
    )
    assert _compiled_sorts(tx) == 1  # one coalesce for both transforms
    hlo = _hlo(tx)
    assert "gather(p__emb__" not in hlo  # params not read
    # The moments, packed [V, 2 * D]: one gather, one scatter.
    assert len(_hlo_ops(hlo, "gather", f"f32[6,{2 * D}]")) == 1, hlo
    assert len(_hlo_ops(hlo, "scatter", f"f32[{V},{2 * D}]")) == 1, hlo
    # The test can fail: slices rebuilt by a tree map lose their "coalesced"
    # record, and the optimizer coalesces them again.
    rebuilt = optax.stateless(lambda u, p: jax.tree.map(lambda x: x, u))
    twice = optax.chain(
        js.clip_by_global_norm(1.0, coalesce_method="sort", max_distinct=6),
        rebuilt,
        js.lazy_adam(0.1, coalesce_method="sort"),
    )
    assert _compiled_sorts(twice) == 2
