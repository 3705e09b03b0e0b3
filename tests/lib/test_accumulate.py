"""jaxslices.MultiSteps: k micro-steps equal one step on the averaged gradient."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import registry
from helpers import random_slices

import jaxslices as js
from jaxslices import IndexedSlices

V, D, N, K = 12, 3, 6, 3


def make_params(rng):
    return {
        "emb": jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(D,)), jnp.float32),
    }


def make_grads(rng, steps, n=N):
    """Micro-batch gradients: repeated ids, padding slots, one dense leaf."""
    return [
        {
            "emb": random_slices(rng, num_rows=V, n=n, row_shape=(D,), padding=1),
            "w": jnp.asarray(rng.normal(size=(D,)), jnp.float32),
        }
        for _ in range(steps)
    ]


def mean_gradient(micro):
    """The reference: concatenated slices / k, dense mean."""
    return js.tree_scale(1.0 / len(micro), js.tree_add(*micro))


def step_fn(tx):
    def step(params, state, g):
        u, state = tx.update(g, state, params)
        return js.apply_updates(params, u), state

    return jax.jit(step, donate_argnums=(0, 1))


def assert_params_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


OPTS = registry.pick(
    "sgd", "sgd_momentum", "adagrad", "lazy_adam", "clip_by_global_norm"
)


@pytest.mark.parametrize("name", list(OPTS))
@pytest.mark.parametrize("capacity", ["k_times_n", "coalescing"])
def test_k_micro_steps_equal_one_step_on_the_mean(name, capacity):
    rng = np.random.default_rng(0)
    params = make_params(rng)
    micro = make_grads(rng, 2 * K)
    # k * N slots: plain concatenation. N + 2 slots (< k * N): coalesces when
    # full; the micro-batches draw from V // 2 rows, so the distinct rows fit.
    slots = K * N if capacity == "k_times_n" else N + 2
    ms = js.MultiSteps(OPTS[name](), K, capacity={"emb": slots, "w": None})
    ref_tx = OPTS[name]()

    step = step_fn(ms)
    ref_step = harness.jitted_step(ref_tx, donate=True)
    p, s = jax.tree.map(jnp.copy, params), ms.init(params)
    rp, rs = jax.tree.map(jnp.copy, params), ref_tx.init(params)
    for i, g in enumerate(micro):
        before = jax.tree.map(jnp.copy, p)
        shapes = [(x.shape, x.dtype) for x in jax.tree.leaves(s)]
        p, s = step(p, s, g)
        # The state keeps its shapes (jit and donation friendly).
        assert [(x.shape, x.dtype) for x in jax.tree.leaves(s)] == shapes
        if (i + 1) % K:
            assert not bool(ms.has_updated(s))
            assert_params_close(p, before, rtol=0, atol=0)  # zero updates
        else:
            assert bool(ms.has_updated(s))
            mean = mean_gradient(micro[i + 1 - K : i + 1])
            if name == "clip_by_global_norm":  # above its threshold (1.0): clips
                assert float(js.global_norm(mean)) > 1.0
            rp, rs = ref_step(rp, rs, mean)
            assert_params_close(p, rp)
    assert int(s.gradient_step) == 2


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_matches_stock_optax_multisteps_on_dense_gradients(name):
    """Exact optimizers: same params as optax.MultiSteps on to_dense(grads)."""
    rng = np.random.default_rng(1)
    params = make_params(rng)
    micro = make_grads(rng, 2 * K)
    ours = js.MultiSteps(OPTS[name](), K, capacity={"emb": K * N, "w": None})
    theirs = optax.MultiSteps(registry.optax_twin(name), K)
    p, s = params, ours.init(params)
    q, t = params, theirs.init(params)
    for g in micro:
        u, s = jax.jit(ours.update)(g, s, p)
        p = js.apply_updates(p, u)
        v, t = jax.jit(theirs.update)(js.to_dense(g), t, q)
        q = optax.apply_updates(q, v)
        assert_params_close(p, q)
    assert bool(theirs.has_updated(t)) and bool(ours.has_updated(s))


def test_sum_schedule_and_gradient_transformation():
    rng = np.random.default_rng(2)
    params = make_params(rng)
    micro = make_grads(rng, 5)
    # Schedule: first update after 2 micro-steps, then every 3.
    ms = js.MultiSteps(
        js.sgd(1.0),
        lambda step: jnp.where(step == 0, 2, 3),
        use_grad_mean=False,
        capacity={"emb": 3 * N, "w": None},
    )
    tx = ms.gradient_transformation()
    p, s = params, tx.init(params)
    for g in micro:
        u, s = jax.jit(tx.update)(g, s, p)
        p = js.apply_updates(p, u)
    total = js.tree_add(*micro)  # sums, not means
    expected = js.apply_updates(params, js.tree_scale(-1.0, total))
    assert_params_close(p, expected)


def test_overflow_raises_instead_of_dropping():
    # Every micro-batch touches 4 new rows; 5 slots cannot hold 8 distinct rows.
    ms = js.MultiSteps(js.sgd(0.1), 2, capacity=5)
    params = jnp.zeros((V, D))
    state = ms.init(params)
    step = jax.jit(ms.update)
    g1 = IndexedSlices(jnp.ones((4, D)), jnp.array([0, 1, 2, 3]), (V, D))
    g2 = IndexedSlices(jnp.ones((4, D)), jnp.array([4, 5, 6, 7]), (V, D))
    _, state = step(g1, state, params)
    with pytest.raises(Exception, match=r"8 distinct rows.*capacity=5"):
        jax.block_until_ready(step(g2, state, params))


def test_coalescing_keeps_duplicates_exact():
    # 4 + 4 slots over 3 distinct rows fit in 4 slots after coalescing.
    ms = js.MultiSteps(js.sgd(1.0), 2, use_grad_mean=False, capacity=4)
    params = jnp.zeros((V, D))
    g1 = IndexedSlices(jnp.ones((4, D)), jnp.array([0, 1, 1, V]), (V, D))
    g2 = IndexedSlices(2 * jnp.ones((4, D)), jnp.array([2, 0, 0, 1]), (V, D))
    state = ms.init(params)
    u, state = jax.jit(ms.update)(g1, state, params)
    u, state = jax.jit(ms.update)(g2, state, params)
    expected = -(g1.to_dense() + g2.to_dense())
    np.testing.assert_allclose(js.apply_updates(params, u), expected)


def test_errors_name_the_leaf_and_the_fix():
    rng = np.random.default_rng(3)
    params = make_params(rng)
    g = make_grads(rng, 1)[0]
    ms = js.MultiSteps(js.sgd(0.1), K)  # no capacity: every leaf dense
    with pytest.raises(TypeError, match=r"\['emb'\].*capacity=\{"):
        ms.update(g, ms.init(params), params)
    small = js.MultiSteps(js.sgd(0.1), K, capacity={"emb": N - 1, "w": None})
    with pytest.raises(ValueError, match=f"has {N} slots but `capacity` is {N - 1}"):
        small.update(g, small.init(params), params)
    with pytest.raises(ValueError, match="positive ints"):
        js.MultiSteps(js.sgd(0.1), K, capacity={"emb": 0, "w": None}).init(params)
    with pytest.raises(ValueError, match="pytree prefix"):
        js.MultiSteps(js.sgd(0.1), K, capacity={"emb": 4}).init(params)
    dense_where_sparse = js.MultiSteps(js.sgd(0.1), K, capacity=8)
    with pytest.raises(TypeError, match=r"\['w'\].*capacity to None"):
        dense_where_sparse.update(g, dense_where_sparse.init(params), params)


def test_should_skip_update_fn_leaves_state_unchanged():
    rng = np.random.default_rng(4)
    params = make_params(rng)
    micro = make_grads(rng, 2)
    ms = js.MultiSteps(
        js.sgd(0.1),
        2,
        should_skip_update_fn=lambda u, step, p: (jnp.asarray(True), ()),
        capacity={"emb": 2 * N, "w": None},
    )
    s = ms.init(params)
    for g in micro:
        u, s = jax.jit(ms.update)(g, s, params)
        assert int(s.mini_step) == 0 and int(s.gradient_step) == 0
        assert not bool(jnp.any(u["emb"].values)) and not bool(jnp.any(u["w"]))


def test_stock_optax_multisteps_raises_naming_indexed_slices():
    rng = np.random.default_rng(5)
    params = make_params(rng)
    g = make_grads(rng, 1)[0]
    tx = optax.MultiSteps(js.sgd(0.1), K)
    with pytest.raises(ValueError, match=r"IndexedSlices(.|\n)*jaxslices\.MultiSteps"):
        tx.update(g, tx.init(params), params)


def test_capacity_from_eval_shape_of_the_gradient_function():
    """The recipe of docs/optax.md: k * N slots per table, found abstractly."""
    rng = np.random.default_rng(6)
    params = make_params(rng)
    ids = jnp.asarray(rng.integers(0, V, size=(4, 2)))

    def loss(p, ids):
        return jnp.sum(js.embedding_lookup(p["emb"], ids) @ p["w"])

    shapes = jax.eval_shape(js.grad(loss), params, ids)
    capacity = jax.tree.map(
        lambda g: K * g.num_slices if js.is_indexed_slices(g) else None,
        shapes,
        is_leaf=js.is_indexed_slices,
    )
    assert capacity == {"emb": K * 8, "w": None}
    ms = js.MultiSteps(js.sgd(0.1), K, capacity=capacity)
    state = ms.init(params)
    p = params
    for _ in range(K):
        u, state = jax.jit(ms.update)(js.grad(loss)(p, ids), state, p)
        p = js.apply_updates(p, u)
    sgd = js.sgd(0.1)
    g = js.grad(loss)(params, ids)
    ref = js.apply_updates(params, sgd.update(g, sgd.init(params))[0])
    assert_params_close(p, ref)
