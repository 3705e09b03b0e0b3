"""NaN and inf on the native path: the same positions and values as the XLA path.

Every rule and the clip / norm kernels see gradients with NaN, +inf, -inf and
an inf times a zero weight (``0 * inf``: NaN on both paths), over three
steps; the two paths must put NaN and inf in the same places (same sign) and
agree on every finite value to the tolerance of docs/kernels.md. Where Optax
is the reference (Adagrad on the dense equivalent), native equals it too.
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import registry
from helpers import needs_kernels

import jaxslices as js

TOL = {"rtol": 2e-5, "atol": 2e-6}

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

CASES = ["nan", "inf", "-inf", "inf_times_zero_weight", "inf_in_table"]
V, D, B, L = 16, 4, 5, 3


def _case(name):
    """``(params, ids, weights, c)``: the loss is ``sum(bag(ids, weights) * c)``."""
    rng = np.random.default_rng(7)
    emb = rng.normal(size=(V, D)).astype(np.float32)
    ids = rng.integers(0, 8, size=(B, L)).astype(np.int32)
    ids[0, 1] = ids[0, 0]  # a duplicate inside a bag
    ids[4, :] = [2, 2, V]  # a duplicate with the row of a bad entry; padding
    weights = rng.uniform(0.5, 1.5, size=(B, L)).astype(np.float32)
    c = rng.normal(size=(B, D)).astype(np.float32)
    if name == "nan":
        c[1, 2] = np.nan
    elif name == "inf":
        c[1, 2] = np.inf
        c[3, 0] = np.inf
    elif name == "-inf":
        c[1, 2] = -np.inf
        c[2, 1] = np.inf  # rows summed across bags: inf + -inf is NaN
    elif name == "inf_times_zero_weight":
        c[1, 2] = np.inf
        weights[1, 0] = 0.0  # this slot's gradient row: 0 * inf = NaN
    elif name == "inf_in_table":
        emb[ids[2, 0], 1] = np.inf  # the weight decay reads it: wd * inf
    params = {
        "emb": jnp.asarray(emb),
        "w": jnp.asarray(rng.normal(size=D), jnp.float32),
    }
    return params, jnp.asarray(ids), jnp.asarray(weights), jnp.asarray(c)


def _loss(p, ids, weights, c):
    h = js.embedding_bag(p["emb"], ids, weights=weights, combiner="sum", padding_id=V)
    return jnp.sum(h * c) + jnp.sum(p["w"] ** 2)


def _both_paths(run):
    """``run()`` on the native path (as it comes) and on the XLA path; the
    harness's steps are cached per path (the switch is in jit's cache keys)."""
    native = run()
    with js.kernels.disabled():
        xla = run()
    return native, xla


def _fit(tx, params, data, steps=3):
    """``steps`` steps of ``_loss`` on ``data`` (``harness.fit``: one compiled
    step per transformation and path for all the cases, same shapes)."""
    return harness.fit(tx, _loss, params, [data] * steps)


def _assert_same_nonfinite(a, b):
    """Same NaN and inf positions (inf of the same sign), finite values close."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_array_equal(np.isnan(x), np.isnan(y))
        np.testing.assert_array_equal(np.isposinf(x), np.isposinf(y))
        np.testing.assert_array_equal(np.isneginf(x), np.isneginf(y))
        np.testing.assert_allclose(x, y, **TOL)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_rule_with_nan_and_inf_native_equals_xla(name, case):
    params, *data = _case(case)
    tx = OPTIMIZERS[name]()
    native, xla = _both_paths(lambda: _fit(tx, params, data))
    _assert_same_nonfinite(native, xla)
    grad = js.to_dense(js.grad(_loss)(params, *data)["emb"])
    assert not np.isfinite(np.asarray(grad)).all() or case == "inf_in_table"
    step = harness.jitted_loss_step(tx, _loss)
    report = js.kernels.explain(step, params, tx.init(params), *data)
    assert report.native, str(report)


@pytest.mark.parametrize("case", ["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    "name", ["adagrad", "rowwise_adagrad", "lazy_adam", "clip_lazy_adam"]
)
def test_plain_slices_with_nan_and_inf(name, case):
    """Slices that carry their values (no pooled recipe): the same agreement."""
    bad = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[case]
    values = np.ones((6, D), np.float32)
    values[1, 2] = bad
    g = js.IndexedSlices(
        jnp.asarray(values), jnp.array([3, 3, 5, V, 0, 5], jnp.int32), (V, D)
    )
    params = jnp.ones((V, D), jnp.float32)
    tx = OPTIMIZERS[name]()
    _assert_same_nonfinite(*_both_paths(lambda: harness.train(tx, params, [g] * 3)))


@pytest.mark.parametrize("case", ["nan", "inf"])
def test_native_adagrad_with_nan_and_inf_equals_optax(case):
    """Adagrad is exact: the sparse native step equals optax.adagrad densely."""
    params, *data = _case(case)
    tx = registry.optimizer("adagrad")
    native, _ = _fit(tx, params, data)
    dense = registry.optax_twin("adagrad")
    p, s = params, dense.init(params)
    for _ in range(3):
        g = jax.grad(lambda p: _loss(p, *data))(p)  # dense: JAX's own gradient
        u, s = dense.update(g, s, p)
        p = optax.apply_updates(p, u)
    _assert_same_nonfinite(native, p)
    assert np.isnan(np.asarray(native["emb"])).any()


@pytest.mark.parametrize("jagged", [False, True])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_forward_bag_with_nan_and_inf_in_table_and_weights(jagged, combiner):
    """A NaN or inf weight on a padding slot or on a zero row: as XLA computes."""
    table = np.random.default_rng(3).normal(size=(V, D)).astype(np.float32)
    table[1, 0] = np.nan
    table[2, 3] = np.inf
    table[4, 1] = -np.inf
    ids = np.array(
        [[1, 0, V], [2, 4, 5], [V, V, V], [5, V, 6], [2, 2, 3], [7, -1, 8]], np.int32
    )
    weights = np.ones(ids.shape, np.float32)
    weights[3, 1] = np.nan  # a padding slot with a NaN weight
    weights[5, 1] = np.inf  # an invalid id with an inf weight
    weights[4, 0] = 0.0  # 0 * inf
    weights[2, :] = [np.nan, 1.0, 1.0]  # an all-padding bag
    tbl, w = jnp.asarray(table), jnp.asarray(weights)
    if jagged:
        bags = js.JaggedIds.from_lists(
            [list(r) for r in ids], max_total=24, weights=weights.tolist()
        )

        def bag(t):
            return js.embedding_bag(t, bags, combiner=combiner, padding_id=V)
    else:

        def bag(t):
            return js.embedding_bag(t, ids, weights=w, combiner=combiner, padding_id=V)

    native = jax.jit(lambda t: bag(t))(tbl)
    with js.kernels.disabled():
        xla = jax.jit(lambda t: bag(t))(tbl)
    _assert_same_nonfinite(native, xla)
    assert js.kernels.explain(bag, tbl).native


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
def test_max_norm_renormalisation_of_rows_with_nan_and_inf(norm_type):
    """A row with a NaN keeps its NaN norm (never scaled); an inf norm scales."""
    table = np.random.default_rng(5).normal(size=(V, D)).astype(np.float32) * 3
    table[1, 0] = np.nan  # the other entries of row 1 exceed max_norm
    table[2, 3] = np.inf
    table[3, :] = [np.nan, 0.1, 0.1, 0.1]
    ids = jnp.array([[1, 2, 3], [4, 1, 0]], jnp.int32)
    tbl = jnp.asarray(table)

    def renorm(t):
        return js.apply_max_norm(t, ids, 1.5, norm_type=norm_type)

    native = jax.jit(renorm)(tbl)
    with js.kernels.disabled():
        xla = jax.jit(lambda t: renorm(t))(tbl)
    _assert_same_nonfinite(native, xla)
    np.testing.assert_array_equal(native[1], table[1])  # NaN norm: unchanged
    assert js.kernels.explain(renorm, tbl).native
