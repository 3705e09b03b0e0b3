"""Empty bags on the native path: ids of shape ``[B, 0]`` and ``(0,)``.

A feature with no slots in a batch pools to zeros and its zero-row gradient
changes neither the table nor the optimizer state, as on the XLA path: through
``embedding_bag`` (eager and under ``jit``), every optimizer's training step,
the Flax NNX and Equinox bag layers, and an ``EmbeddingCollection`` with a
feature that has no ids. ``explain`` reports the native path for each.
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import registry
from helpers import needs_kernels

import jaxslices as js

pytestmark = needs_kernels

#: Every rule of the native kernels, and each clipping or decay kernel before
#: the rule it feeds (tests/registry.py).
OPTIMIZERS = registry.pick(
    "sgd",
    "sgd_momentum",
    "sgd_nesterov",
    "adagrad",
    "decay_adagrad",
    "rowwise_adagrad",
    "lazy_adam",
    "lazy_adam_nesterov",
    "lazy_adamw",
    "ftrl",
    "ftrl_power",
    "add_decayed_weights",
    "clip_by_global_norm_tight",
    "clip_by_global_norm_adagrad",
    "clip_by_row_norm_tight",
    "clip_lazy_adam",
)

TABLE = jnp.asarray(np.random.default_rng(0).normal(size=(12, 4)), jnp.float32)


def _both_paths(fn, *args):
    """``fn(*args)`` traced natively and on the XLA path (fresh traces each)."""
    native = jax.jit(lambda *a: fn(*a))(*args)
    with js.kernels.disabled():
        xla = jax.jit(lambda *a: fn(*a))(*args)
    return native, xla


@pytest.mark.parametrize("shape", [(3, 0), (0,), (2, 3, 0)])
@pytest.mark.parametrize("combiner", ["mean", "sum", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_empty_bags_pool_to_zeros_eager_and_jit(shape, combiner, weighted):
    ids = jnp.zeros(shape, jnp.int32)
    weights = jnp.ones(shape, jnp.float32) if weighted else None

    def bag(t, i):
        return js.embedding_bag(t, i, combiner=combiner, weights=weights)

    want = np.zeros(shape[:-1] + (4,), np.float32)
    np.testing.assert_array_equal(bag(TABLE, ids), want)  # eager
    native, xla = _both_paths(bag, TABLE, ids)
    np.testing.assert_array_equal(native, want)
    np.testing.assert_array_equal(xla, want)
    report = js.kernels.explain(bag, TABLE, ids)
    assert report.native, str(report)


def _loss(p, full, empty):
    h = js.embedding_bag(p["emb"], full, combiner="mean")
    h = h + js.embedding_bag(p["emb"], empty, combiner="sum")  # no slots
    return jnp.mean((h @ p["w"] - 1.0) ** 2)


def _fit_both_paths(tx, loss, params, *data, steps=3):
    """``steps`` steps of ``loss`` (``harness.fit``, its steps cached per path)
    natively (as it comes) and on the XLA path: ``(native, xla)``."""
    native = harness.fit(tx, loss, params, [data] * steps)
    with js.kernels.disabled():
        xla = harness.fit(tx, loss, params, [data] * steps)
    return native, xla


def _assert_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("full_shape", [(4, 3), (4, 0)])
def test_a_step_with_a_feature_without_slots(name, full_shape):
    """Every optimizer: native equals XLA; only ids' rows move (none if empty)."""
    rng = np.random.default_rng(1)
    params = {"emb": TABLE, "w": jnp.ones(4)}
    full = jnp.asarray(rng.integers(0, 6, size=full_shape), jnp.int32)
    empty = jnp.zeros((4, 0), jnp.int32)
    tx = OPTIMIZERS[name]()
    native, xla = _fit_both_paths(tx, _loss, params, full, empty)
    _assert_close(native, xla)
    untouched = np.setdiff1d(np.arange(12), np.asarray(full).ravel())
    np.testing.assert_array_equal(native[0]["emb"][untouched], TABLE[untouched])
    init = jax.tree.leaves(tx.init(params))
    if full.size == 0:  # nothing looked up: table and state as they were
        np.testing.assert_array_equal(native[0]["emb"], TABLE)
        for new, old in zip(jax.tree.leaves(native[1]), init, strict=True):
            if np.ndim(new) >= 1 and np.shape(new)[0] == 12:
                np.testing.assert_array_equal(new, old)

    step = harness.jitted_loss_step(tx, _loss)
    report = js.kernels.explain(step, params, tx.init(params), full, empty)
    assert report.native, str(report)


def test_flax_nnx_and_equinox_bags_without_slots():
    import equinox as eqx
    from flax import nnx

    import jaxslices.equinox as jse
    import jaxslices.nnx as jnnx

    ids = jnp.zeros((3, 0), jnp.int32)
    layer = jnnx.EmbedBag(20, 4, combiner="mean", rngs=nnx.Rngs(0))
    before = jnp.copy(layer.embedding[...])
    np.testing.assert_array_equal(layer(ids), np.zeros((3, 4)))
    opt = nnx.Optimizer(layer, js.lazy_adam(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(m, opt, ids):
        loss, g = jnnx.value_and_grad(lambda m, i: jnp.sum(m(i) ** 2))(m, ids)
        opt.update(m, g)
        return loss

    assert js.kernels.explain(step, layer, opt, ids).native
    step(layer, opt, ids)
    np.testing.assert_array_equal(layer.embedding[...], before)

    emb = jse.EmbeddingBag(20, 4, key=jax.random.key(0))
    tx = js.ftrl(0.1)

    def eqx_update(m, st, ids):  # the layer's own gradient entry and update
        u, st = tx.update(jse.filter_grad(lambda m, i: m(i).sum())(m, ids), st, m)
        return jse.apply_updates(m, u), st

    state = tx.init(eqx.filter(emb, eqx.is_array))
    assert js.kernels.explain(eqx.filter_jit(eqx_update), emb, state, ids).native
    new, new_state = eqx.filter_jit(eqx_update)(emb, state, ids)
    np.testing.assert_array_equal(new.weight, emb.weight)
    np.testing.assert_array_equal(new_state.n_z.weight, state.n_z.weight)
    assert int(new_state.count) == 1  # the step counted; no row changed


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "clip_lazy_adam"])
def test_a_collection_with_a_feature_without_ids(name):
    coll = js.EmbeddingCollection(
        [
            js.TableConfig("a", rows=10, dim=4, combiner="mean"),
            js.TableConfig("b", rows=6, dim=4, combiner="sum"),
        ]
    )
    params = {"emb": coll.init(jax.random.key(0)), "w": jnp.ones(8)}
    padded = {
        "a": jnp.array([[1, 2], [3, 3]], jnp.int32),
        "b": jnp.zeros((2, 0), jnp.int32),
    }
    jagged = js.KeyedJaggedIds.from_lists(
        {"a": [[1, 2], [3]], "b": [[], []]}, max_total=4
    )
    tx = OPTIMIZERS[name]()

    def loss(p, feats):
        return jnp.mean((coll.concat(p["emb"], feats) @ p["w"] - 1.0) ** 2)

    for feats in (padded, jagged):
        out = coll(params["emb"], feats)
        np.testing.assert_array_equal(out["b"], np.zeros((2, 4)))
        _assert_close(*_fit_both_paths(tx, loss, params, feats))
        step = harness.jitted_loss_step(tx, loss)
        assert js.kernels.explain(step, params, tx.init(params), feats).native


def test_the_ops_with_no_ids_in_the_kernels_and_their_references():
    """``N = 0`` through each op: the kernel (jit) and the reference (vmap)."""
    from jaxslices.kernels import _ops

    ids = jnp.zeros((0,), jnp.int32)
    recipe = _ops.PooledGradient(jnp.ones((3, 4)), length=0)  # pooled [3, 4], no slots
    spec = _ops.RuleSpec("rss", lambda g, s, p, hp, c: (g, (g * g + s[0],)))
    state = jnp.full((12, 4), 0.5)

    def ops(table, state):
        new_state, uids, rows, count, sumsq = _ops.rowwise(
            recipe, ids, num_rows=12, spec=spec, hp=(1e-7,), state=state, capacity=0
        )
        fwd = _ops.bag_forward(
            table, ids, weight=None, scale=jnp.full(3, 2.0), num_bags=3, length=0
        )
        return _ops.apply(table, recipe, ids), new_state, uids, rows, count, fwd

    kernel = jax.jit(ops)(TABLE, state)
    reference = jax.vmap(ops)(TABLE[None], state[None])
    for got in (kernel, jax.tree.map(lambda x: x[0], reference)):
        table, new_state, uids, rows, count, fwd = got
        np.testing.assert_array_equal(table, TABLE)
        np.testing.assert_array_equal(new_state, state)
        assert uids.shape == (0,) and rows.shape == (0, 4) and int(count) == 0
        np.testing.assert_array_equal(fwd, np.zeros((3, 4)))
