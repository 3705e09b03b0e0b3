"""The pooled gradient (``IndexedSlices.recipe``) through jaxslices' tree functions.

A gradient of ``embedding_bag`` carries its pooled form, which the native
kernels read instead of the ``[N, D]`` values. Every operation here is
checked three ways: its dense result against the dense reference, the
recipe (when kept) against the values it stands for, and, end to end, the
source the row-wise kernel reads in the step's jaxpr (``[B, D]`` pooled rows
or the ``[N, D]`` values) and what ``explain`` says about it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import KERNELS_AVAILABLE, KERNELS_STATUS, bag_problem

import jaxslices as js
from jaxslices import slices
from jaxslices._recipe import PooledGradient, concatenate

TOL = {"rtol": 2e-5, "atol": 2e-6}
V, D, B, L = 12, 3, 4, 3
N = B * L


def _pooled(seed: int, *, scale=None) -> js.IndexedSlices:
    """Slices made from a recipe (padded bags, weights), ids with padding."""
    rng = np.random.default_rng(seed)
    recipe = PooledGradient(
        jnp.asarray(rng.normal(size=(B, D)), jnp.float32),
        length=L,
        weight=jnp.asarray(rng.normal(size=N), jnp.float32),
        scale=scale,
    )
    ids = rng.integers(0, V, size=N)
    ids[[2, 7]] = V  # padding slots
    values = recipe.values(N)
    values = jnp.where(jnp.asarray(ids < V)[:, None], values, 0.0)
    return slices.with_recipe(js.IndexedSlices(values, ids, (V, D)), recipe)


def _plain(seed: int) -> js.IndexedSlices:
    rng = np.random.default_rng(seed)
    values = jnp.asarray(rng.normal(size=(5, D)), jnp.float32)
    return js.IndexedSlices(values, rng.integers(0, V, size=5), (V, D))


def _recipe_rows_and_values(s: js.IndexedSlices) -> tuple[jax.Array, jax.Array]:
    """What the recipe stands for and the values, both zero at padding slots."""
    assert s.recipe is not None  # at trace time, also under jit
    valid = (s.indices < V)[:, None]
    rows = s.recipe.values(s.num_slices)
    return jnp.where(valid, rows, 0.0), jnp.where(valid, s.values, 0.0)


# ------------------------------------------------------------- the type


def test_recipe_forms_and_out_of_range_sources():
    src = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(PooledGradient(src).values(2), src)
    np.testing.assert_array_equal(
        PooledGradient(src, length=2).values(4), jnp.repeat(src, 2, axis=0)
    )
    bag = jnp.array([1, -1, 0, 2], jnp.int32)  # -1 and 2: no source row
    weight = jnp.array([2.0, 5.0, 1.0, 5.0])
    got = PooledGradient(src, bag=bag, weight=weight, scale=jnp.float32(0.5)).values(4)
    np.testing.assert_array_equal(got, [[3.0, 4.0], [0, 0], [0.5, 1.0], [0, 0]])


def test_concatenate_folds_each_parts_scale_into_its_weights():
    a, b = _pooled(0, scale=jnp.float32(2.0)), _pooled(1)
    c = PooledGradient.of_rows(_plain(2).values)
    got = concatenate([(a.recipe, N), (b.recipe, N), (c, 5)]).values(2 * N + 5)
    want = jnp.concatenate([a.recipe.values(N), b.recipe.values(N), c.values(5)])
    np.testing.assert_allclose(got, want, **TOL)


def test_the_recipe_is_typed_and_has_no_field_nothing_reads():
    s = _pooled(0)
    assert isinstance(s.recipe, PooledGradient)
    fields = {f.name for f in dataclasses.fields(PooledGradient)}
    assert fields == {"src", "bag", "length", "weight", "scale"}
    assert js.PooledGradient is PooledGradient and "PooledGradient" in js.__all__
    with pytest.raises(TypeError, match="expected a jaxslices.PooledGradient"):
        slices.with_recipe(s, object())
    assert "PooledGradient(float32[4, 3], padded bags of 3, weight)" == repr(s.recipe)


def test_the_recipe_is_not_a_pytree_child():
    s = _pooled(0)
    leaves, treedef = jax.tree.flatten(s)
    assert len(leaves) == 2 and leaves[0] is s.values
    assert jax.tree.structure(s) == jax.tree.structure(
        js.IndexedSlices(s.values, s.indices, s.dense_shape)
    )


# -------------------------------------------- jaxslices' operations keep it


KEEP = {
    "tree_scale": (lambda s, t: js.tree_scale(0.5, {"e": s})["e"],
                   lambda a, b: 0.5 * a),
    "tree_add pooled": (lambda s, t: js.tree_add(s, t), lambda a, b: a + b),
    "tree_add with rows": (lambda s, t: js.tree_add(s, _plain(9)),
                           lambda a, b: a + _plain(9).to_dense()),
    "neg": (lambda s, t: -s, lambda a, b: -a),
    "mul": (lambda s, t: s * 3.0, lambda a, b: 3.0 * a),
    "rmul": (lambda s, t: 3.0 * s, lambda a, b: 3.0 * a),
    "div": (lambda s, t: s / 4.0, lambda a, b: a / 4.0),
    "sub": (lambda s, t: s - t, lambda a, b: a - b),
    "astype same": (lambda s, t: s.astype(jnp.float32), lambda a, b: a),
    "scale transform": (
        lambda s, t: js.scale(-0.1).update({"e": s}, js.scale(-0.1).init({}))[0]["e"],
        lambda a, b: -0.1 * a,
    ),
}  # fmt: skip


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("name", list(KEEP))
def test_jaxslices_operations_keep_the_pooled_form(name, use_jit):
    op, dense = KEEP[name]

    def run():  # the slices made inside: a jit boundary would drop the recipe
        s, t = _pooled(0, scale=jnp.float32(1.5)), _pooled(1)
        out = op(s, t)
        return (out.to_dense(), dense(s.to_dense(), t.to_dense()),
                *_recipe_rows_and_values(out))  # fmt: skip

    got, want, rows, values = (jax.jit(run) if use_jit else run)()
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(rows, values, **TOL)


REBUILT = {
    "identity tree map": lambda s: jax.tree.map(lambda x: x, s),
    "identity tree map of a tree": (
        lambda s: jax.tree.map(lambda x: x, {"e": s, "w": jnp.ones(2)})["e"]
    ),
    "generic tree map": lambda s: jax.tree.map(
        lambda x: 0.5 * x if jnp.issubdtype(x.dtype, jnp.floating) else x, s
    ),
    "unflatten": lambda s: jax.tree.unflatten(*reversed(jax.tree.flatten(s))),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REBUILT))
def test_a_rebuild_from_leaves_knows_only_the_leaves(name):
    """Flattening and unflattening are pure: no pooled form, no index flags,
    no note (a kernel then says it reads values that carry none)."""
    c = js.coalesce(_pooled(0))
    c = slices.with_recipe(c, PooledGradient.of_rows(c.values))
    out = REBUILT[name](c)
    assert out.recipe is None and out._lost_by is None
    assert not (out.unique_indices or out.indices_sorted)
    scale = 0.5 if name == "generic tree map" else 1.0
    np.testing.assert_allclose(out.to_dense(), scale * c.to_dense(), **TOL)


LOSE = {
    "tree_map_values": (
        lambda s: js.tree_map_values(lambda v: 0.5 * v, s),
        "jaxslices.tree_map_values",
    ),
    "row-vector product": (lambda s: s * jnp.full((D,), 0.5), "IndexedSlices *"),
    "astype": (lambda s: 0.5 * s.astype(jnp.float16), "astype"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LOSE))
def test_other_operations_drop_it_and_say_which(name):
    op, culprit = LOSE[name]
    s = _pooled(0)
    out = op(s)
    assert out.recipe is None
    assert culprit in out._lost_by
    tol = {"rtol": 2e-3, "atol": 2e-3} if out.dtype == jnp.float16 else TOL
    np.testing.assert_allclose(out.to_dense(), 0.5 * s.to_dense(), **tol)
    # and so does every operation after it (a later kernel names the culprit)
    assert culprit in (-js.tree_scale(2.0, out))._lost_by


def test_tree_pmean_gathers_rows_and_says_so():
    seen = {}

    def per_device(x):
        out = js.tree_pmean(_pooled(0), "i")
        seen["recipe"], seen["lost"] = out.recipe, out._lost_by
        return out.to_dense() + x

    dense = jax.vmap(per_device, axis_name="i")(jnp.zeros(2))
    np.testing.assert_allclose(dense[1], _pooled(0).to_dense(), **TOL)
    assert seen["recipe"] is None and "jaxslices.tree_psum" in seen["lost"]


def test_a_rebuild_from_other_leaves_has_no_recipe_and_no_culprit():
    out = jax.jit(lambda s: s)(_pooled(0))  # new arrays: nothing is known
    assert out.recipe is None and out._lost_by is None


# ------------------------------------------- end to end: the native kernels

needs_kernels = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not KERNELS_AVAILABLE,
    reason=f"needs the native CPU kernels here: {KERNELS_STATUS}",
)

TX = js.rowwise_adagrad(0.1)


def _loss(p, ids, y):
    h = js.embedding_bag(p["emb"], ids, combiner="mean")
    return jnp.mean((h @ p["w"] - y) ** 2)


BAGS, LENGTH = 7, 5
# what runs between value_and_grad and tx.update: (fn, its factor on the
# gradient, what explain says of the values read or None, the rows the kernel
# reads)
BETWEEN = {
    "plain": (lambda g: g, 1.0, None, BAGS),
    "tree_scale": (lambda g: js.tree_scale(0.5, g), 0.5, None, BAGS),
    "identity tree map": (
        lambda g: jax.tree.map(lambda x: x, g),
        1.0,
        "no pooled",
        BAGS * LENGTH,
    ),
    "tree_add": (lambda g: js.tree_add(g, g), 2.0, None, 2 * BAGS),
    "tree_map_values": (
        lambda g: js.tree_map_values(lambda v: 0.5 * v, g),
        0.5,
        "jaxslices.tree_map_values",
        BAGS * LENGTH,
    ),
    "generic tree map": (
        lambda g: jax.tree.map(
            lambda x: 0.5 * x if jnp.issubdtype(x.dtype, jnp.floating) else x, g
        ),
        0.5,
        "no pooled",
        BAGS * LENGTH,
    ),
}


def _rowwise_sources(jaxpr) -> list[tuple[int, ...]]:
    """The shape of the rows each row-wise kernel of a jaxpr reads."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "jaxslices_rowwise":
            out.append(tuple(eqn.invars[0].aval.shape))
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                out += _rowwise_sources(inner)
    return out


@needs_kernels
@pytest.mark.parametrize("name", list(BETWEEN))
def test_what_the_kernel_reads_after_a_tree_operation(name):
    between, factor, culprit, read = BETWEEN[name]
    bags, length = BAGS, LENGTH
    params, ids, y = bag_problem(0, rows=50, dim=D, bags=bags, length=length)

    def step(p, s, ids, y):
        g = between(js.grad(_loss)(p, ids, y))
        u, s = TX.update(g, s, p)
        return js.apply_updates(p, u), s

    state = TX.init(params)
    jitted = jax.jit(step)
    got = jitted(params, state, ids, y)
    with js.kernels.disabled():
        want = jax.jit(step)(params, state, ids, y)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)

    # the gradient scaled as said: against the dense gradient
    g = between(js.grad(_loss)(params, ids, y))["emb"]
    dense = jax.grad(_loss)(params, ids, y)["emb"]
    np.testing.assert_allclose(g.to_dense(), factor * dense, rtol=1e-5, atol=1e-6)

    sources = _rowwise_sources(jax.make_jaxpr(step)(params, state, ids, y).jaxpr)
    report = js.kernels.explain(jitted, params, state, ids, y)
    assert report.native, str(report)
    assert sources == [(read, D)], sources
    if culprit is None:  # the pooled gradient ([B, D], or two side by side)
        assert report.materialised == (), str(report)
    else:  # the [N, D] values
        (d,) = report.materialised
        assert "rowwise_rss" in d.op and culprit in d.materialised, str(report)
        assert f" [{bags * length}, {D}] " in str(report)
