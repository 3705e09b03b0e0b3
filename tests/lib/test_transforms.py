"""Optax transforms with IndexedSlices: sparse vs dense/NumPy references."""

from __future__ import annotations

import functools

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import registry
from helpers import assert_same_bits, dense_reference, random_slices, tol
from hypothesis import given
from hypothesis import strategies as st

import jaxslices as js
from jaxslices import IndexedSlices
from jaxslices import slices as slices_mod
from jaxslices.transforms import _rowwise

V, D, H = 10, 3, 2  # table rows, embedding dim, hidden
SCHED = optax.linear_schedule(0.1, 0.01, 5)


# ------------------------------------------------------------------ helpers


def make_params(rng, dtype=jnp.float32, num_rows=V):
    return {
        "emb": jnp.asarray(rng.normal(size=(num_rows, D)), dtype),
        "w": jnp.asarray(rng.normal(size=(D, H)), dtype),
        "b": jnp.asarray(rng.normal(size=(H,)), dtype),
    }


def make_slices(rng, dtype=jnp.float32, num_rows=V, n=8, invalid=False):
    """Slices with a repeated id, two padding slots, optionally a negative id."""
    idx = rng.integers(0, num_rows, size=n).astype(np.int32)
    idx[1] = idx[0]  # a duplicate
    idx[[2, 5]] = num_rows  # padding
    if invalid:
        idx[6] = -1
    vals = rng.normal(size=(n, D)).astype(np.float32)
    vals[idx == num_rows] = 0.0
    return IndexedSlices(jnp.asarray(vals, dtype), jnp.asarray(idx), (num_rows, D))


def make_grads(rng, steps=4, dtype=jnp.float32, num_rows=V, invalid=False):
    return [
        {
            "emb": make_slices(rng, dtype, num_rows, invalid=invalid),
            "w": jnp.asarray(rng.normal(size=(D, H)), dtype),
            "b": jnp.asarray(rng.normal(size=(H,)), dtype),
        }
        for _ in range(steps)
    ]


make_step = harness.step_function
# Jitted steps come from the harness: one per transform instance for the
# session, so the tests stepping one registry optimizer on these shapes share
# one executable.
run = harness.train


def _plain_leaves(tree):
    """Leaves with each IndexedSlices as its values and plain integer indices."""
    out = []
    for x in jax.tree.leaves(tree, is_leaf=js.is_indexed_slices):
        out.extend([x.values, x.indices] if js.is_indexed_slices(x) else [x])
    return out


def assert_trees_close(a, b, dtype=jnp.float32, exact=False):
    la, lb = _plain_leaves(a), _plain_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        if exact:
            assert_same_bits(x, y)
        else:
            np.testing.assert_allclose(
                np.asarray(x, np.float32), np.asarray(y, np.float32), **tol(dtype)
            )


def float_index_slices(num_rows=V):
    """Slices rebuilt from float leaves (a leaf-wise transform on plain indices).

    Typed indices make ``jax.tree.map(lambda x: x * 0.5, s)`` raise; the guard
    in every consumer still refuses slices rebuilt from such leaves by hand.
    """
    s = make_slices(np.random.default_rng(0), num_rows=num_rows)
    leaves = [s.values * 0.5, s.indices * 0.5]  # what optax.scale(0.5) did
    return jax.tree.unflatten(jax.tree.structure(s), leaves)


# The registry's transforms with an Optax twin (tests/registry.py): name ->
# (the jaxslices transform, the Optax transform of the same rule).
PAIRS = {
    name: (lambda name=name: (registry.optimizer(name), registry.optax_twin(name)))
    for name in registry.OPTAX_TWINS
}

# Transforms whose sparse result equals the Optax transform on the dense gradient.
EXACT_ON_DENSE_GRAD = [
    "sgd",
    "sgd_schedule",
    "scale",
    "scale_by_schedule",
    "scale_by_learning_rate",
    "clip_by_global_norm",
    "clip",
    "adagrad",
    "adagrad_schedule",
]
ALL = registry.pick(*PAIRS, "clip_by_row_norm", "rowwise_adagrad", "ftrl")


# ------------------------------------------------- dense leaves: same as Optax


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", list(PAIRS))
def test_dense_trees_bitwise_equal_optax(name, dtype):
    rng = np.random.default_rng(0)
    params = make_params(rng, dtype)
    grads = [js.to_dense(g) for g in make_grads(rng, dtype=dtype)]
    ours, theirs = PAIRS[name]()
    got, _ = run(ours, params, grads)
    want, _ = run(theirs, params, grads, apply=optax.apply_updates)
    # The global norm is summed in float32 (Optax: in the leaf dtype), so on
    # bfloat16 leaves it may differ in the last bit (seen on GPU).
    exact = not (name == "clip_by_global_norm" and dtype == jnp.bfloat16)
    assert_trees_close(got, want, dtype, exact=exact)


# ----------------------------------------- sparse == Optax on the dense gradient


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", EXACT_ON_DENSE_GRAD)
def test_sparse_equals_optax_on_dense_gradient(name, dtype):
    rng = np.random.default_rng(1)
    params = make_params(rng, dtype)
    grads = make_grads(rng, steps=4, dtype=dtype, invalid=True)
    ours, theirs = PAIRS[name]()
    got, _ = run(ours, params, grads)
    want, _ = run(
        theirs, params, [js.to_dense(g) for g in grads], apply=optax.apply_updates
    )
    assert_trees_close(got, want, dtype)


@pytest.mark.parametrize("name", list(ALL))
def test_slices_stay_slices_and_stay_small(name):
    rng = np.random.default_rng(2)
    params = make_params(rng)
    tx = ALL[name]()
    updates, _ = tx.update(make_grads(rng, 1)[0], tx.init(params), params)
    assert isinstance(updates["emb"], IndexedSlices)
    assert updates["emb"].dense_shape == (V, D)
    assert updates["emb"].num_slices == 8
    assert jnp.issubdtype(updates["emb"].indices.dtype, jnp.integer)
    assert not isinstance(updates["w"], IndexedSlices)


# ------------------------------------------------- lazy rules vs NumPy references


def numpy_lazy(params, grads, rule, state_names, mu_dtype=None):
    """Apply ``rule`` to touched rows of ``emb`` and to all of the dense leaves.

    ``rule(g, state_dict, p, step) -> (update, new_state_dict)`` on float64 rows.
    """
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    state = {k: {n: np.zeros_like(v) for n in state_names} for k, v in p.items()}
    touched = set()
    for step, g in enumerate(grads, start=1):
        for k in p:
            if isinstance(g[k], IndexedSlices):
                dense = dense_reference(g[k])
                idx = np.asarray(g[k].indices)
                rows = sorted({int(i) for i in idx if 0 <= i < V})
                touched.update(rows)
            else:
                dense = np.asarray(g[k], np.float64)
                rows = slice(None)
            s_rows = {n: state[k][n][rows] for n in state_names}
            upd, new = rule(dense[rows], s_rows, p[k][rows], step)
            for n in state_names:
                state[k][n][rows] = new[n]
            p[k][rows] += upd
    return p, state, touched


def momentum_rule(lr, mom, nesterov):
    def rule(g, s, p, step):
        t = g + mom * s["t"]
        u = g + mom * t if nesterov else t
        return -lr * u, {"t": t}

    return rule


def adam_rule(lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
    def rule(g, s, p, step):
        mu = (1 - b1) * g + b1 * s["mu"]
        nu = (1 - b2) * g**2 + b2 * s["nu"]
        u = (mu / (1 - b1**step)) / (np.sqrt(nu / (1 - b2**step)) + eps)
        return -lr * (u + wd * p), {"mu": mu, "nu": nu}

    return rule


def decay_rule(lr, wd):
    def rule(g, s, p, step):
        return -lr * (g + wd * p), {}

    return rule


# Registry names (tests/registry.py) -> (the NumPy rule of its
# hyperparameters, the names of its per-row state).
LAZY = {
    "sgd_momentum": (momentum_rule(0.1, 0.9, False), ["t"]),
    "sgd_nesterov": (momentum_rule(0.1, 0.9, True), ["t"]),
    "lazy_adam": (adam_rule(0.05), ["mu", "nu"]),
    "lazy_adamw": (adam_rule(0.05, wd=0.3), ["mu", "nu"]),
    "add_decayed_weights": (decay_rule(0.1, 0.3), []),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", list(LAZY))
def test_lazy_rules_match_numpy(name, dtype):
    rule, state_names = LAZY[name]
    make_tx = functools.partial(registry.optimizer, name)
    rng = np.random.default_rng(3)
    params = make_params(rng, dtype)
    grads = make_grads(rng, steps=5, dtype=dtype, invalid=True)
    got, state = run(make_tx(), params, grads)
    want, _, touched = numpy_lazy(params, grads, rule, state_names)
    for k in params:
        np.testing.assert_allclose(
            np.asarray(got[k], np.float32), want[k], err_msg=k, **tol(dtype)
        )
    # Untouched rows: parameters bit-for-bit unchanged, state still zero.
    untouched = np.array(sorted(set(range(V)) - touched), int)
    assert untouched.size > 0
    np.testing.assert_array_equal(got["emb"][untouched], params["emb"][untouched])
    for leaf in jax.tree.leaves(state):
        if getattr(leaf, "shape", None) == (V, D):
            assert not np.any(np.asarray(leaf[untouched], np.float32))


def test_lazy_adam_bias_correction_uses_global_count():
    # Row 1 is first touched at step 3: its first update is corrected by 1-b1^3.
    b1, b2, lr = 0.9, 0.999, 1.0
    tx = js.lazy_adam(lr, b1, b2, eps=0.0)
    params = jnp.zeros((3,))
    state = tx.init(params)
    step = jax.jit(make_step(tx))
    g0 = IndexedSlices(jnp.array([1.0]), jnp.array([0]), (3,))
    g1 = IndexedSlices(jnp.array([1.0]), jnp.array([1]), (3,))
    for g in (g0, g0, g1):
        params, state = step(params, state, g)
    mu, nu = (1 - b1), (1 - b2)
    want = -(mu / (1 - b1**3)) / np.sqrt(nu / (1 - b2**3))
    np.testing.assert_allclose(params[1], want, rtol=1e-5)
    assert int(state[0].count) == 3


def test_lazy_momentum_does_not_coast_untouched_rows():
    tx = js.sgd(1.0, momentum=0.9)
    params = jnp.zeros((2, 1))
    state = tx.init(params)
    step = jax.jit(make_step(tx))
    params, state = step(
        params, state, IndexedSlices(jnp.ones((1, 1)), jnp.array([0]), (2, 1))
    )
    params, state = step(
        params, state, IndexedSlices(jnp.ones((1, 1)), jnp.array([1]), (2, 1))
    )
    # Dense momentum would have moved row 0 by 0.9 in step 2; lazy does not.
    np.testing.assert_allclose(params.ravel(), [-1.0, -1.0])
    np.testing.assert_allclose(state[0].trace.ravel(), [1.0, 1.0])


def test_bf16_table_with_float32_state():
    rng = np.random.default_rng(4)
    params = make_params(rng, jnp.bfloat16)
    grads = make_grads(rng, steps=3, dtype=jnp.bfloat16)
    for tx, field in [
        (js.sgd(0.1, 0.9, accumulator_dtype=jnp.float32), "trace"),
        (js.lazy_adam(0.01, mu_dtype=jnp.float32), "mu"),
    ]:
        p, state = run(tx, params, grads)
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p))
        assert getattr(state[0], field)["emb"].dtype == jnp.float32


# ------------------------------------------------------------------ clipping


def test_clip_clips_the_per_row_sum():
    s = IndexedSlices(jnp.array([0.4, 0.4, -0.3]), jnp.array([1, 1, 0]), (3,))
    u, _ = js.clip(0.5).update(s, optax.EmptyState())
    np.testing.assert_allclose(u.to_dense(), [-0.3, 0.5, 0.0])
    # coalesced: unique ids (first appearance on CPU, sorted elsewhere), padding
    np.testing.assert_array_equal(np.sort(u.indices[:2]), [0, 1])
    assert int(u.indices[2]) == 3 and u.unique_indices


def test_clip_by_global_norm_is_exact_with_duplicates():
    # Two slots of 3 on one row: the dense gradient is 6, its norm 6 (TF says 4.24).
    s = IndexedSlices(jnp.array([[3.0], [3.0]]), jnp.array([0, 0]), (2, 1))
    u, _ = js.clip_by_global_norm(1.0).update({"e": s}, optax.EmptyState())
    np.testing.assert_allclose(u["e"].to_dense(), [[1.0], [0.0]], rtol=1e-6)
    # Coalesced (the norm needed it) and passed on as such: row 0 once.
    np.testing.assert_array_equal(u["e"].indices, [0, 2])
    assert u["e"].unique_indices


def test_clip_by_global_norm_below_threshold_is_identity():
    rng = np.random.default_rng(5)
    g = make_grads(rng, 1)[0]
    u, _ = js.clip_by_global_norm(1e6).update(g, optax.EmptyState())
    # Slices come out coalesced (the norm needed it): same dense equivalent.
    assert u["emb"].unique_indices
    assert_trees_close(js.to_dense(u), js.to_dense(g))
    assert_trees_close({k: u[k] for k in "wb"}, {k: g[k] for k in "wb"}, exact=True)


def test_one_global_norm_of_raw_and_coalesced_slices():
    """The one global norm (the public one, whose body clip_by_global_norm uses)
    gives the same number for raw slices and for the coalesced ones the
    transforms hand it (on the native path, with the kernel's squared norm)."""
    rng = np.random.default_rng(6)
    g = make_grads(rng, 1, invalid=True)[0]
    c, measured = _rowwise.coalesce_all("clip_by_global_norm", g, "auto", None)
    leaves = jax.tree.leaves(c, is_leaf=_rowwise.is_leaf)
    assert len(measured) == len(leaves)
    want = js.global_norm(g)
    np.testing.assert_allclose(js.global_norm(c), want, rtol=1e-6)
    got = slices_mod.norm_of_leaves(leaves, measured)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(js.global_norm({})) == 0.0


def numpy_row_clip(x, max_norm):
    x = np.asarray(x, np.float64)
    rows = x.reshape(x.shape[0], -1) if x.ndim else x.reshape(1, 1)
    norm = np.linalg.norm(rows, axis=1)
    factor = np.where(norm > max_norm, max_norm / np.maximum(norm, 1e-30), 1.0)
    return (rows * factor[:, None]).reshape(x.shape)


@pytest.mark.parametrize("row_shape", [(), (3,), (2, 3)])
def test_clip_by_row_norm_sparse_matches_dense_rule(row_shape):
    rng = np.random.default_rng(7)
    idx = jnp.array([0, 0, 2, 5, 5, -1], jnp.int32)
    vals = jnp.asarray(rng.normal(size=(6, *row_shape)), jnp.float32)
    s = IndexedSlices(vals, idx, (5, *row_shape))
    tx = js.clip_by_row_norm(0.8)
    u, _ = jax.jit(tx.update)(s, tx.init(None))
    assert isinstance(u, IndexedSlices)
    want = numpy_row_clip(dense_reference(s), 0.8)
    np.testing.assert_allclose(u.to_dense(), want, rtol=1e-6, atol=1e-6)
    dense_u, _ = tx.update(s.to_dense(), tx.init(None))
    np.testing.assert_allclose(dense_u, want, rtol=1e-6, atol=1e-6)


def test_clip_by_row_norm_dense_rows_are_the_leading_axis():
    tx = js.clip_by_row_norm(1.0)
    tree = {
        "m": jnp.array([[3.0, 4.0], [0.3, 0.4]]),
        "v": jnp.array([2.0, -0.5]),
        "s": jnp.array(-3.0),
    }
    u, _ = tx.update(tree, tx.init(None))
    np.testing.assert_allclose(u["m"], [[0.6, 0.8], [0.3, 0.4]], rtol=1e-6)
    np.testing.assert_allclose(u["v"], [1.0, -0.5])  # 1-D: rows of one entry
    np.testing.assert_allclose(u["s"], -1.0)  # scalar: one row
    np.testing.assert_array_equal(u["m"][1], tree["m"][1])  # under the norm: untouched


def test_clip_by_row_norm_zero_max_norm_has_no_nan():
    s = IndexedSlices(jnp.array([[0.0, 0.0], [1.0, 0.0]]), jnp.array([0, 1]), (2, 2))
    u, _ = js.clip_by_row_norm(0.0).update(s, optax.EmptyState())
    np.testing.assert_array_equal(u.to_dense(), np.zeros((2, 2)))


# -------------------------------------------------------------- weight decay


def test_add_decayed_weights_touched_rows_once():
    params = jnp.array([1.0, 2.0, 3.0, 4.0])
    g = IndexedSlices(jnp.array([0.5, 0.5, 0.0]), jnp.array([1, 1, 4]), (4,))
    tx = js.add_decayed_weights(0.1)
    u, _ = tx.update(g, tx.init(params), params)
    np.testing.assert_allclose(u.to_dense(), [0.0, 1.2, 0.0, 0.0], rtol=1e-6)


def test_add_decayed_weights_zero_is_identity():
    g = make_slices(np.random.default_rng(8))
    tx = js.add_decayed_weights(0.0)
    u, _ = tx.update(g, tx.init(jnp.zeros((V, D))), jnp.zeros((V, D)))
    assert u is g


def test_add_decayed_weights_masks():
    rng = np.random.default_rng(9)
    params = make_params(rng)
    g = make_grads(rng, 1)[0]
    seen = []

    def mask_fn(p):
        seen.append(p)
        return {"emb": True, "w": False, "b": False}

    for mask in [{"emb": True, "w": False, "b": False}, mask_fn]:
        tx = js.add_decayed_weights(0.5, mask=mask)
        u, _ = tx.update(g, tx.init(params), params)
        np.testing.assert_array_equal(u["w"], g["w"])
        np.testing.assert_array_equal(u["b"], g["b"])
        touched = np.unique(np.asarray(g["emb"].indices))
        touched = touched[touched < V]
        want = dense_reference(g["emb"])
        want[touched] += 0.5 * np.asarray(params["emb"])[touched]
        np.testing.assert_allclose(u["emb"].to_dense(), want, rtol=1e-6, atol=1e-6)
    # A callable mask sees the params (dense arrays), never the slices.
    assert not any(
        isinstance(x, IndexedSlices)
        for x in jax.tree.leaves(seen, is_leaf=js.is_indexed_slices)
    )
    # A prefix mask (one bool for a whole subtree) works too.
    tx = js.add_decayed_weights(0.5, mask={"emb": False, "w": True, "b": True})
    u, _ = tx.update(g, tx.init(params), params)
    assert u["emb"] is g["emb"]


def test_add_decayed_weights_needs_params():
    tx = js.add_decayed_weights(0.1)
    with pytest.raises(
        ValueError, match=r"jaxslices\.add_decayed_weights needs the params"
    ):
        tx.update({"e": jnp.ones(2)}, tx.init({"e": jnp.ones(2)}))


# ----------------------------------------------------------- scaling helpers


def test_scale_by_learning_rate_variants():
    g = IndexedSlices(jnp.array([2.0]), jnp.array([0]), (2,))
    tx = js.scale_by_learning_rate(0.5, flip_sign=False)
    np.testing.assert_allclose(tx.update(g, tx.init(None))[0].values, [1.0])
    tx = js.scale_by_learning_rate(None)
    assert tx.update(g, tx.init(None))[0] is g


def test_scale_keeps_low_precision_values():
    g = IndexedSlices(jnp.ones(2, jnp.bfloat16), jnp.array([0, 1]), (2,))
    for tx in [js.scale(0.5), js.scale_by_schedule(lambda c: 0.5), js.sgd(0.1)]:
        u, _ = tx.update(g, tx.init(jnp.zeros(2, jnp.bfloat16)))
        assert u.values.dtype == jnp.bfloat16


@pytest.mark.parametrize("name", list(ALL))
def test_none_updates_pass_through(name):
    rng = np.random.default_rng(25)
    params = make_params(rng)
    grads = make_grads(rng, 2)
    for g in grads:
        g["w"] = None
    got, _ = run(ALL[name](), params, grads)
    np.testing.assert_array_equal(got["w"], params["w"])
    assert not np.array_equal(got["b"], params["b"])


# --------------------------------------------------- init, retracing, donation


@pytest.mark.parametrize("name", list(ALL))
def test_init_on_shape_dtype_struct(name):
    rng = np.random.default_rng(10)
    params = make_params(rng, jnp.bfloat16)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    tx = ALL[name]()
    concrete = tx.init(params)
    for got in [tx.init(abstract), jax.eval_shape(tx.init, abstract)]:
        assert jax.tree.structure(got) == jax.tree.structure(concrete)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(concrete), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("name", list(ALL))
def test_no_retracing_across_steps(name):
    rng = np.random.default_rng(11)
    params = make_params(rng)
    tx = ALL[name]()
    traces = []
    inner = make_step(tx)

    def step(p, s, g):
        traces.append(1)
        return inner(p, s, g)

    step = jax.jit(step, donate_argnums=(0, 1))
    state = tx.init(params)
    for g in make_grads(rng, steps=4):
        params, state = step(params, state, g)
    assert len(traces) == 1


def _temp_bytes(tx, num_rows):
    params = {
        "emb": jax.ShapeDtypeStruct((num_rows, 16), jnp.float32),
        "w": jax.ShapeDtypeStruct((16,), jnp.float32),
    }
    state = jax.eval_shape(tx.init, params)
    grads = {
        "emb": IndexedSlices(
            jax.ShapeDtypeStruct((64, 16), jnp.float32),
            jax.ShapeDtypeStruct((64,), jnp.int32),
            (num_rows, 16),
        ),
        "w": params["w"],
    }
    step = jax.jit(make_step(tx), donate_argnums=(0, 1))
    compiled = step.lower(params, state, grads).compile()
    return compiled.memory_analysis().temp_size_in_bytes


MEMORY = registry.pick(
    *(k for k in ALL if k != "lazy_adamw_mask"),
    "lazy_adamw_callable_mask",
    "apply_if_finite",
    "clip_chain",
)


@pytest.mark.parametrize("name", list(MEMORY))
def test_no_table_sized_temporaries(name):
    tx = MEMORY[name]()
    small, large = _temp_bytes(tx, 1_000), _temp_bytes(tx, 16_000)
    # A (V, 16) float32 temporary would add 960 kB between the two.
    assert large <= small + 1024, (small, large)


@pytest.mark.parametrize("name", ["sgd_momentum", "adagrad", "lazy_adamw"])
def test_donated_step_updates_in_place_and_matches(name):
    rng = np.random.default_rng(12)
    params = make_params(rng)
    grads = make_grads(rng, steps=3)
    tx = ALL[name]()
    want, _ = run(tx, params, grads)
    step = jax.jit(make_step(tx), donate_argnums=(0, 1))
    p = jax.tree.map(jnp.copy, params)
    state = tx.init(p)
    for g in grads:
        old = p["emb"]
        p, state = step(p, state, g)
        assert old.is_deleted()  # the table's buffer was donated
    assert_trees_close(p, want, exact=True)


# ------------------------------------------------------------------- guard


def test_guard_names_stock_optax_scale_in_a_chain():
    params = {"emb": jnp.zeros((V, D))}
    grads = {"emb": make_slices(np.random.default_rng(13))}
    tx = optax.chain(optax.scale(0.5), js.sgd(0.1))
    # Typed indices: stock optax.scale itself raises, naming the jaxslices way.
    with pytest.raises(TypeError, match=r"IndexedSlices.*jaxslices\.scale"):
        jax.jit(tx.update)(grads, tx.init(params), params)


@pytest.mark.parametrize("name", list(ALL))
def test_every_transform_guards_indices(name):
    params = {"emb": jnp.zeros((V, D))}
    tx = ALL[name]()
    with pytest.raises(
        TypeError, match=r"\(leaf \['emb'\]\): `indices` must have an integer"
    ):
        tx.update({"emb": float_index_slices()}, tx.init(params), params)


# --------------------------------------------------------------- bad input


def test_state_of_other_shape_names_the_leaf():
    tx = js.sgd(0.1, momentum=0.9)
    state = tx.init({"emb": jnp.zeros((V + 1, D))})
    with pytest.raises(
        ValueError,
        match=r"jaxslices\.trace \(leaf \['emb'\]\): the update has dense shape "
        r"\(10, 3\) but `state\.trace` has \(11, 3\)",
    ):
        tx.update({"emb": make_slices(np.random.default_rng(14))}, state)


def test_params_of_other_shape_names_the_leaf():
    tx = js.lazy_adamw(0.1)
    params = {"emb": jnp.zeros((V, D))}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"`params` has \(10, 4\) there"):
        tx.update(
            {"emb": make_slices(np.random.default_rng(15))},
            state,
            {"emb": jnp.zeros((V, 4))},
        )


def test_mismatched_trees_name_the_leaf():
    rng = np.random.default_rng(16)
    params = make_params(rng)
    grads = make_grads(rng, 1)[0]
    del grads["b"]
    tx = js.lazy_adam(0.1)
    with pytest.raises(
        ValueError,
        match=r"jaxslices\.scale_by_lazy_adam: `updates` and `state\.mu_nu` must have "
        r"the same tree structure; leaf \['b'\] is in `state\.mu_nu` but not in "
        r"`updates`",
    ):
        tx.update(grads, tx.init(params), params)


# ---------------------------------------------- stock Optax: the pitfalls


def test_stock_optax_pitfalls_with_slices():
    """The behaviour docs/optax.md warns about (optax 0.2.8)."""
    params = {"emb": jnp.zeros((V, D))}
    grads = {"emb": make_slices(np.random.default_rng(17))}
    # Typed indices: stock optax.sgd raises instead of scaling the indices.
    with pytest.raises(TypeError, match=r"IndexedSlices\.indices.*jaxslices\.sgd"):
        optax.sgd(0.1).update(grads, optax.sgd(0.1).init(params))
    with pytest.raises(ValueError, match="pytree structure"):
        optax.adam(0.1).update(grads, optax.adam(0.1).init(params))
    with pytest.raises(
        TypeError, match=r"IndexedSlices.*jaxslices\.clip_by_global_norm"
    ):
        optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())


# ------------------------------------------------ combining with stock Optax


def test_chain_clip_by_global_norm_sgd_matches_dense_optax():
    rng = np.random.default_rng(18)
    params = make_params(rng)
    grads = make_grads(rng, steps=5)
    ours = optax.chain(js.clip_by_global_norm(1.0), js.sgd(0.1))
    theirs = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    p_ours, s_ours = jax.tree.map(jnp.copy, params), ours.init(params)
    p_theirs, s_theirs = params, theirs.init(params)
    step_ours = jax.jit(make_step(ours), donate_argnums=(0, 1))
    step_theirs = jax.jit(make_step(theirs, optax.apply_updates))
    for g in grads:
        p_ours, s_ours = step_ours(p_ours, s_ours, g)
        p_theirs, s_theirs = step_theirs(p_theirs, s_theirs, js.to_dense(g))
        assert_trees_close(p_ours, p_theirs)


def test_multi_transform_routes_tables_to_jaxslices():
    rng = np.random.default_rng(19)
    params = make_params(rng)
    grads = make_grads(rng, steps=3)
    labels = {"emb": "sparse", "w": "dense", "b": "dense"}
    tx = optax.multi_transform(
        {"sparse": js.lazy_adam(0.1), "dense": optax.adam(0.1)}, labels
    )
    got, _ = run(tx, params, grads)
    emb_only, _ = run(
        js.lazy_adam(0.1), {"emb": params["emb"]}, [{"emb": g["emb"]} for g in grads]
    )
    dense = {k: params[k] for k in ("w", "b")}
    dense_only, _ = run(
        optax.adam(0.1),
        dense,
        [{k: g[k] for k in ("w", "b")} for g in grads],
        apply=optax.apply_updates,
    )
    np.testing.assert_array_equal(got["emb"], emb_only["emb"])
    assert_trees_close({k: got[k] for k in ("w", "b")}, dense_only, exact=True)


@pytest.mark.parametrize("callable_mask", [False, True])
def test_masked_routes_tables_to_jaxslices(callable_mask):
    rng = np.random.default_rng(20)
    params = make_params(rng)
    grads = make_grads(rng, steps=3)
    if callable_mask:
        # A callable mask sees the updates too: treat IndexedSlices as one leaf.
        def sparse(t):
            return jax.tree.map(
                lambda x: x.ndim == 2 and x.shape[0] == V,
                t,
                is_leaf=js.is_indexed_slices,
            )

        def dense(t):
            return jax.tree.map(lambda m: not m, sparse(t))
    else:
        sparse = {"emb": True, "w": False, "b": False}
        dense = {"emb": False, "w": True, "b": True}
    tx = optax.chain(
        optax.masked(js.sgd(0.1, momentum=0.9), sparse),
        optax.masked(optax.sgd(0.1, momentum=0.9), dense),
    )
    got, _ = run(tx, params, grads)
    want, _, _ = numpy_lazy(params, grads, momentum_rule(0.1, 0.9, False), ["t"])
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_apply_if_finite_skips_non_finite_sparse_steps():
    rng = np.random.default_rng(21)
    params = make_params(rng)
    grads = make_grads(rng, steps=3)
    bad = dict(grads[1])
    bad["emb"] = slices_mod._replace_values(
        bad["emb"], bad["emb"].values.at[0, 0].set(jnp.nan, mode="promise_in_bounds")
    )
    tx = optax.apply_if_finite(js.lazy_adam(0.1), max_consecutive_errors=2)
    step = jax.jit(make_step(tx), donate_argnums=(0, 1))
    p, state = jax.tree.map(jnp.copy, params), tx.init(params)
    p, state = step(p, state, grads[0])
    before = jax.tree.map(jnp.copy, (p, state.inner_state))
    p, state = step(p, state, bad)
    assert int(state.notfinite_count) == 1 and not bool(state.last_finite)
    assert_trees_close((p, state.inner_state), before, exact=True)  # nothing moved
    p, state = step(p, state, grads[2])
    assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 1
    want, _ = run(js.lazy_adam(0.1), params, [grads[0], grads[2]])
    assert_trees_close(p, want)  # lax.cond compiles differently: not bitwise


# ------------------------------------------------------------- coalescing


def count_coalesces(tx, grads, params):
    """Coalesces in the lowered ``tx.update``: the default method is one while
    loop on CPU (hash) and one sort on GPU (pair sort); see test_coalesce.py."""
    text = jax.jit(tx.update).lower(grads, tx.init(params), params).as_text()
    return text.count("stablehlo.sort") + text.count("stablehlo.while")


@pytest.mark.usefixtures("xla_path")  # XLA's structure; native: test_kernels
@pytest.mark.parametrize(
    "name, coalesces",
    [("sgd", 0), ("scale", 0), ("lazy_adam", 1), ("lazy_adamw", 1), ("adagrad", 1)],
)
def test_coalesces_at_most_once_per_table(name, coalesces):
    rng = np.random.default_rng(23)
    params = make_params(rng)
    tx = registry.optimizer(name)
    assert count_coalesces(tx, make_grads(rng, 1)[0], params) == coalesces


# ------------------------------------------------------------------ property


@given(
    ids=st.lists(st.integers(-2, 6), min_size=10, max_size=10),  # one shape
    seed=st.integers(0, 2**16),
    max_norm=st.floats(0.05, 5.0),
)
def test_property_clipping_and_adagrad_match_dense(ids, seed, max_norm):
    rng = np.random.default_rng(seed)
    num_rows = 6  # ids 6 are padding, negative ids invalid
    idx = np.asarray(ids, np.int32)
    vals = rng.normal(size=(len(ids), 2)).astype(np.float32)
    vals[idx == num_rows] = 0.0
    s = IndexedSlices(jnp.asarray(vals), jnp.asarray(idx), (num_rows, 2))
    dense = jnp.asarray(dense_reference(s), jnp.float32)
    for ours, theirs in [
        (js.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)),
        (js.clip(max_norm), optax.clip(max_norm)),
        (js.clip_by_row_norm(max_norm), js.clip_by_row_norm(max_norm)),
        (js.adagrad(max_norm), optax.adagrad(max_norm)),
    ]:
        params = jnp.ones((num_rows, 2))
        u, _ = ours.update(s, ours.init(params), params)
        want, _ = theirs.update(dense, theirs.init(params), params)
        assert isinstance(u, IndexedSlices)
        np.testing.assert_allclose(u.to_dense(), want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ end to end


def _model_loss(params, ids, y):
    rows = js.embedding_lookup(params["emb"], ids)  # (B, L, D)
    pred = jnp.mean(rows, axis=1) @ params["w"] + params["b"]
    return jnp.mean((pred - y) ** 2)


@pytest.mark.skipif(
    not hasattr(js, "value_and_grad"), reason="needs jaxslices.value_and_grad"
)
def test_end_to_end_training_matches_dense_optax():
    rng = np.random.default_rng(24)
    num_rows = 50
    params = make_params(rng, num_rows=num_rows)
    batches = [
        (
            jnp.asarray(rng.integers(0, 8, size=(4, 3)), jnp.int32),  # repeated ids
            jnp.asarray(rng.normal(size=(4, H)), jnp.float32),
        )
        for _ in range(5)
    ]
    ours = optax.chain(js.clip_by_global_norm(1.0), js.sgd(0.1))
    theirs = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))

    @jax.jit
    def dense_step(p, s, ids, y):
        loss, g = jax.value_and_grad(_model_loss)(p, ids, y)
        u, s = theirs.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    def sparse_step(p, s, ids, y):
        loss, g = js.value_and_grad(_model_loss)(p, ids, y)
        assert isinstance(g["emb"], IndexedSlices)
        u, s = ours.update(g, s, p)
        return js.apply_updates(p, u), s, loss

    sparse_step = jax.jit(sparse_step, donate_argnums=(0, 1))
    p_s, s_s = jax.tree.map(jnp.copy, params), ours.init(params)
    p_d, s_d = params, theirs.init(params)
    for ids, y in batches:
        p_s, s_s, loss_s = sparse_step(p_s, s_s, ids, y)
        p_d, s_d, loss_d = dense_step(p_d, s_d, ids, y)
        np.testing.assert_allclose(loss_s, loss_d, rtol=1e-6)
        assert_trees_close(p_s, p_d)


def test_densify_small_tables_matches_dense_optax():
    """Opt-in dense fallback: small tables densified, large ones stay sparse."""
    rng = np.random.default_rng(99)
    small = js.IndexedSlices(
        jnp.asarray(rng.normal(size=(6, 2)), jnp.float32),
        jnp.array([1, 1, 3, 4, 0, 4]),
        (4, 2),
    )
    big = js.IndexedSlices(jnp.ones((2, 2)), jnp.array([7, 7]), (50, 2))
    params = {"small": jnp.ones((4, 2)), "big": jnp.zeros((50, 2))}
    tx = optax.chain(js.densify(max_rows=10), js.lazy_adam(0.1))
    ref = optax.adam(0.1)
    updates, _ = jax.jit(tx.update)(
        {"small": small, "big": big}, tx.init(params), params
    )
    assert isinstance(updates["big"], js.IndexedSlices)
    assert not isinstance(updates["small"], js.IndexedSlices)
    want, _ = ref.update(
        {"small": small.to_dense()}, ref.init({"small": params["small"]})
    )
    np.testing.assert_allclose(updates["small"], want["small"], rtol=1e-6)
    every, _ = js.densify().update({"big": big}, ())
    np.testing.assert_array_equal(every["big"], big.to_dense())


# ------------------------------------------ row-wise Adagrad and FTRL (NumPy)


def numpy_rows(g, num_rows):
    """(dense float64 gradient, the rows a step updates: touched ids or all)."""
    if isinstance(g, IndexedSlices):
        idx = np.asarray(g.indices)
        return dense_reference(g), np.array(
            sorted({int(i) for i in idx if 0 <= i < num_rows}), int
        )
    g = np.asarray(g, np.float64)
    return g, np.arange(g.shape[0]) if g.ndim else ()


def numpy_rowwise_adagrad(params, grads, lr, init=0.0, eps=1e-8):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD in float64 on the rows each step touches."""
    p = {k: np.array(v, np.float64) for k, v in params.items()}
    acc = {k: np.full(v.shape[:1] if v.ndim >= 2 else v.shape, init)
           for k, v in p.items()}  # fmt: skip
    for g in grads:
        for k in p:
            dense, rows = numpy_rows(g[k], p[k].shape[0] if p[k].ndim else 0)
            gr = dense[rows]
            if p[k].ndim >= 2:
                acc[k][rows] += np.mean(gr**2, axis=tuple(range(1, gr.ndim)))
                denom = np.sqrt(acc[k][rows]).reshape((-1,) + (1,) * (gr.ndim - 1))
            else:
                acc[k][rows] += gr**2
                denom = np.sqrt(acc[k][rows])
            p[k][rows] += -lr * gr / (denom + eps)
    return p, acc


FTRL_ARGS = dict(
    learning_rate=0.2,
    learning_rate_power=-0.5,
    initial_accumulator_value=0.1,
    l1=0.05,
    l2=0.1,
    l2_shrinkage=0.02,
    beta=0.3,
)


def numpy_ftrl(params, grads, learning_rate, learning_rate_power,
               initial_accumulator_value, l1, l2, l2_shrinkage, beta):  # fmt: skip
    """Keras 3's Ftrl formula in float64 on the rows each step touches."""
    p = {k: np.array(v, np.float64) for k, v in params.items()}
    n = {k: np.full(v.shape, initial_accumulator_value) for k, v in p.items()}
    z = {k: np.zeros(v.shape) for k, v in p.items()}
    lr, k_pow = learning_rate, -learning_rate_power
    for g in grads:
        for k in p:
            dense, rows = numpy_rows(g[k], p[k].shape[0])
            gr, pr, nr, zr = dense[rows], p[k][rows], n[k][rows], z[k][rows]
            n_new = nr + gr**2
            zr = zr + gr + 2 * l2_shrinkage * pr - (n_new**k_pow - nr**k_pow) / lr * pr
            q = n_new**k_pow / lr + 2 * (l2 + beta / (2 * lr))
            p[k][rows] = (np.clip(zr, -l1, l1) - zr) / q
            n[k][rows], z[k][rows] = n_new, zr
    return p, n, z


def _untouched(grads):
    touched = set()
    for g in grads:
        touched.update(int(i) for i in np.asarray(g["emb"].indices) if 0 <= i < V)
    return np.array(sorted(set(range(V)) - touched), int)


@pytest.mark.parametrize("use_jit", [True, False])
@pytest.mark.parametrize("init", [0.0, 0.5])
def test_rowwise_adagrad_matches_numpy(init, use_jit):
    rng = np.random.default_rng(30)
    params = make_params(rng)
    grads = make_grads(rng, steps=4, invalid=True)
    tx = js.rowwise_adagrad(0.3, initial_accumulator_value=init, eps=1e-6)
    got, state = run(tx, params, grads, jit=use_jit)
    want, acc = numpy_rowwise_adagrad(params, grads, 0.3, init, 1e-6)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
        np.testing.assert_allclose(state[0].sum_of_squares[k], acc[k], rtol=1e-5)
    # One float per table row; rank-1 leaves one per element.
    assert state[0].sum_of_squares["emb"].shape == (V,)
    assert state[0].sum_of_squares["b"].shape == (H,)
    untouched = _untouched(grads)
    assert untouched.size
    np.testing.assert_array_equal(got["emb"][untouched], params["emb"][untouched])
    np.testing.assert_array_equal(state[0].sum_of_squares["emb"][untouched], init)


def test_rowwise_adagrad_sparse_equals_dense_and_rank3_rows():
    rng = np.random.default_rng(31)
    s = random_slices(rng, num_rows=V, n=9, row_shape=(2, 3))
    params = {"t": jnp.asarray(rng.normal(size=(V, 2, 3)), jnp.float32)}
    grads = [{"t": s}, {"t": s * 0.5}]
    tx = optax.chain(js.clip_by_global_norm(1e6), js.rowwise_adagrad(0.1))
    sparse, s_state = run(tx, params, grads)
    dense, d_state = run(tx, params, [js.to_dense(g) for g in grads])
    want, acc = numpy_rowwise_adagrad(params, grads, 0.1)
    np.testing.assert_allclose(sparse["t"], dense["t"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(sparse["t"], want["t"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s_state[1][0].sum_of_squares["t"], acc["t"], rtol=1e-5)


def test_rowwise_adagrad_state_is_one_float_per_row():
    params = {"emb": jax.ShapeDtypeStruct((1000, 64), jnp.bfloat16)}
    ada = jax.eval_shape(js.adagrad(0.1).init, params)
    row = jax.eval_shape(js.rowwise_adagrad(0.1).init, params)
    nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))  # noqa: E731
    assert row[0].sum_of_squares["emb"].dtype == jnp.float32  # bf16 table: f32 state
    # the per-row state, and a bf16 table's step count (the rounding's seed)
    assert nbytes(row[0]) == 1000 * 4 and nbytes(row[1]) == 4
    assert nbytes(ada[0]) == 1000 * 64 * 2


@pytest.mark.parametrize("use_jit", [True, False])
def test_ftrl_matches_numpy_on_touched_rows(use_jit):
    rng = np.random.default_rng(32)
    params = make_params(rng)
    grads = make_grads(rng, steps=4, invalid=True)
    got, state = run(js.ftrl(**FTRL_ARGS), params, grads, jit=use_jit)
    want, n, z = numpy_ftrl(params, grads, **FTRL_ARGS)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)
        np.testing.assert_allclose(state.accumulator[k], n[k], rtol=1e-5)
        np.testing.assert_allclose(state.linear[k], z[k], rtol=1e-4, atol=1e-6)
    untouched = _untouched(grads)
    assert untouched.size
    np.testing.assert_array_equal(got["emb"][untouched], params["emb"][untouched])
    np.testing.assert_array_equal(state.linear["emb"][untouched], 0.0)
    np.testing.assert_allclose(state.accumulator["emb"][untouched], 0.1)
    assert int(state.count) == 4


def test_ftrl_dense_leaves_are_the_dense_formula_and_differ_from_sparse():
    """Dense FTRL moves never-touched rows (to 0); sparse FTRL leaves them."""
    rng = np.random.default_rng(33)
    params = make_params(rng)
    grads = make_grads(rng, steps=3)
    dense_grads = [js.to_dense(g) for g in grads]
    args = dict(FTRL_ARGS, l2_shrinkage=0.0)
    got, _ = run(js.ftrl(**args), params, dense_grads)
    want, _, _ = numpy_ftrl(params, dense_grads, **args)
    np.testing.assert_allclose(got["emb"], want["emb"], rtol=1e-4, atol=1e-6)
    untouched = _untouched(grads)
    np.testing.assert_array_equal(got["emb"][untouched], 0.0)
    sparse, _ = run(js.ftrl(**args), params, grads)
    np.testing.assert_array_equal(sparse["emb"][untouched], params["emb"][untouched])


def test_ftrl_in_chain_with_schedule_and_duplicates_only():
    """Schedule as learning rate; every id of the step is one duplicated row."""
    params = {"emb": jnp.ones((4, 2))}
    s = IndexedSlices(jnp.array([[1.0, 2.0], [3.0, -1.0], [0.0, 0.0]]),
                      jnp.array([2, 2, 4]), (4, 2))  # fmt: skip
    sched = optax.linear_schedule(0.5, 0.1, 3)
    tx = optax.chain(js.clip_by_global_norm(1e6), js.ftrl(sched, l1=0.1))
    got, _ = run(tx, params, [{"emb": s}] * 3)
    p = np.ones((4, 2))
    n, z = np.full((4, 2), 0.1), np.zeros((4, 2))
    for step in range(3):
        lr, g = float(sched(step)), np.array([4.0, 1.0])
        n_new = n[2] + g**2
        z[2] = z[2] + g - (np.sqrt(n_new) - np.sqrt(n[2])) / lr * p[2]
        p[2] = (np.clip(z[2], -0.1, 0.1) - z[2]) / (np.sqrt(n_new) / lr)
        n[2] = n_new
    np.testing.assert_allclose(got["emb"], p, rtol=1e-5, atol=1e-6)


def test_ftrl_bad_arguments_and_missing_params():
    with pytest.raises(ValueError, match="learning_rate_power` must be <= 0"):
        js.ftrl(0.1, learning_rate_power=0.5)
    with pytest.raises(ValueError, match="`l1` must be >= 0, got -1"):
        js.ftrl(0.1, l1=-1.0)
    with pytest.raises(ValueError, match="`learning_rate` must be > 0"):
        js.ftrl(0.0)
    tx = js.ftrl(0.1)
    params = {"emb": jnp.zeros((V, D))}
    with pytest.raises(ValueError, match="ftrl needs the params"):
        tx.update({"emb": make_slices(np.random.default_rng(0))}, tx.init(params))


# ------------------------------------- NumPy arrays and Python lists as input


def _as_numpy_inputs(params, grads):
    """Dense leaves as NumPy arrays, the bias as a Python list of floats."""
    p = {k: np.asarray(v) for k, v in params.items()}
    p["b"] = [float(x) for x in p["b"]]
    gs = []
    for g in grads:
        g = {k: v if js.is_indexed_slices(v) else np.asarray(v) for k, v in g.items()}
        g["b"] = [float(x) for x in g["b"]]
        gs.append(g)
    return p, gs


# Every transform under jit; op by op, one smoke case per row-wise rule.
EAGER_SMOKE = ["sgd_momentum", "adagrad", "rowwise_adagrad", "lazy_adamw", "ftrl"]


@pytest.mark.parametrize(
    "name, use_jit",
    [*((n, True) for n in ALL), *((n, False) for n in EAGER_SMOKE)],
)
def test_numpy_and_list_params_state_and_grads(name, use_jit):
    rng = np.random.default_rng(40)
    params = make_params(rng)
    grads = make_grads(rng, steps=2)
    tx = ALL[name]()
    want, want_state = run(tx, params, grads, jit=use_jit)
    np_params, np_grads = _as_numpy_inputs(params, grads)
    state = jax.tree.map(np.asarray, tx.init(np_params))  # NumPy state too
    update = jax.jit(tx.update) if use_jit else tx.update
    p = np_params
    for g in np_grads:
        updates, state = update(g, state, p)
        p = js.apply_updates(p, updates)
    got = dict(p, b=jnp.stack(p["b"]))
    assert_trees_close(got, want)

    # The list parameter's state is a list of scalars: compare flattened.
    def flat(t):
        return np.concatenate([np.zeros(0)] + [np.ravel(x) for x in jax.tree.leaves(t)])

    np.testing.assert_allclose(flat(state), flat(want_state), rtol=1e-5, atol=1e-6)
