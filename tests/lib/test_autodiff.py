"""value_and_grad and grad: sparse where provably right, always equal to jax.grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tol

import jaxslices as js
from jaxslices import IndexedSlices


def _params(key=0, num_rows=10, dim=4, dtype=jnp.float32, out=20):
    k1, k2 = jax.random.split(jax.random.PRNGKey(key))
    return {
        "emb": jax.random.normal(k1, (num_rows, dim)).astype(dtype),
        "w": jax.random.normal(k2, (out,)).astype(dtype),
    }


def _ids(rng, batch=3, length=5, num_rows=10, pad=True):
    ids = rng.integers(0, num_rows // 2, size=(batch, length)).astype(np.int32)
    if pad:
        ids[0, -1] = num_rows  # out of range: reads zeros, padding in the grad
    return jnp.asarray(ids)


def flatten_loss(params, ids):
    rows = js.embedding_lookup(params["emb"], ids)
    x = rows.reshape(rows.shape[0], -1)
    return jnp.mean((x @ params["w"][: x.shape[1]] - 1.0) ** 2)


def assert_grads_match(sparse, dense, kinds, dtype=jnp.float32):
    """Leaves named in ``kinds`` must be IndexedSlices; all must equal jax.grad."""
    flat_s = jax.tree.leaves(sparse, is_leaf=js.is_indexed_slices)
    flat_d = jax.tree.leaves(dense)
    names = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(dense)
    ]
    assert len(flat_s) == len(flat_d)
    for name, s, d in zip(names, flat_s, flat_d, strict=True):
        want_sparse = any(k in name for k in kinds)
        assert isinstance(s, IndexedSlices) == want_sparse, (name, type(s))
        got = s.to_dense() if isinstance(s, IndexedSlices) else s
        assert got.shape == d.shape and got.dtype == d.dtype, name
        np.testing.assert_allclose(
            np.asarray(got, np.float32),
            np.asarray(d, np.float32),
            err_msg=name,
            **tol(dtype),
        )


# ----------------------------------------------------------- the TF example


def test_tf_classic_example_embedding_flatten_dense():
    """Embedding(10, 4) -> Flatten -> Dense(1), input [[6, 1, 1, 4, 8]]."""
    params = {
        "emb": jax.random.uniform(
            jax.random.PRNGKey(0), (10, 4), minval=-0.05, maxval=0.05
        ),
        "dense": {"kernel": jnp.full((20, 1), 0.1), "bias": jnp.zeros((1,))},
    }
    ids = jnp.array([[6, 1, 1, 4, 8]])

    def model(params, ids):
        x = js.embedding_lookup(params["emb"], ids).reshape(ids.shape[0], -1)
        return x @ params["dense"]["kernel"] + params["dense"]["bias"]

    def loss(params, ids):
        return jnp.sum(model(params, ids))

    value, grads = js.value_and_grad(loss)(params, ids)
    g = grads["emb"]
    assert isinstance(g, IndexedSlices)
    np.testing.assert_array_equal(g.indices, [6, 1, 1, 4, 8])
    assert g.values.shape == (5, 4) and g.dense_shape == (10, 4)
    ref_value, ref = jax.value_and_grad(loss)(params, ids)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    np.testing.assert_allclose(g.to_dense(), ref["emb"], rtol=1e-6)
    np.testing.assert_allclose(grads["dense"]["kernel"], ref["dense"]["kernel"])


# ---------------------------------------------------------------- basics


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("use_jit", [False, True])
def test_sparse_matches_jax_grad(dtype, use_jit):
    rng = np.random.default_rng(0)
    params = _params(dtype=dtype)
    ids = _ids(rng)
    vg = js.value_and_grad(flatten_loss)
    if use_jit:
        vg = jax.jit(vg)
    value, grads = vg(params, ids)
    ref_value, ref = jax.value_and_grad(flatten_loss)(params, ids)
    np.testing.assert_allclose(np.float32(value), np.float32(ref_value), **tol(dtype))
    assert_grads_match(grads, ref, kinds=["emb"], dtype=dtype)
    g = grads["emb"]
    assert g.dtype == dtype
    idx = np.asarray(ids).reshape(-1)
    np.testing.assert_array_equal(g.indices, np.where(idx < 10, idx, 10))
    np.testing.assert_array_equal(np.asarray(g.values[4], np.float32), 0.0)  # padding


def test_jit_inside_the_loss_wrapper_and_around():
    rng = np.random.default_rng(1)
    params, ids = _params(), _ids(rng)
    step = jax.jit(lambda p, i: js.grad(flatten_loss)(p, i))
    assert_grads_match(step(params, ids), jax.grad(flatten_loss)(params, ids), ["emb"])
    inner = js.grad(jax.jit(flatten_loss))  # lookup inside an inner jit: dense
    assert_grads_match(inner(params, ids), jax.grad(flatten_loss)(params, ids), [])


def test_has_aux_and_argnums():
    rng = np.random.default_rng(2)
    params, ids = _params(), _ids(rng)

    def loss(scale, params, ids):
        value = flatten_loss(params, ids) * scale
        return value, {"ids_sum": jnp.sum(ids)}

    (value, aux), (g_scale, g_params) = js.value_and_grad(
        loss, argnums=(0, 1), has_aux=True
    )(2.0, params, ids)
    (rv, raux), (rs, rp) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        2.0, params, ids
    )
    np.testing.assert_allclose(value, rv, rtol=1e-6)
    assert int(aux["ids_sum"]) == int(raux["ids_sum"])
    np.testing.assert_allclose(g_scale, rs, rtol=1e-5)
    assert_grads_match(g_params, rp, ["emb"])
    g, aux2 = js.grad(loss, argnums=1, has_aux=True)(2.0, params, ids)
    assert_grads_match(g, rp, ["emb"])
    assert int(aux2["ids_sum"]) == int(raux["ids_sum"])
    with pytest.raises(ValueError, match="argnums 5 out of range"):
        js.grad(loss, argnums=5)(2.0, params, ids)


def test_several_lookups_concatenate_and_several_tables():
    rng = np.random.default_rng(3)
    params = {"user": _params(1)["emb"], "item": _params(2)["emb"], "b": jnp.ones(())}
    u, i1, i2 = _ids(rng, 4, 1), _ids(rng, 4, 2), _ids(rng, 4, 3)

    def loss(p):
        eu = js.embedding_lookup(p["user"], u)[:, 0]
        ei = js.embedding_lookup(p["item"], i1).sum(1) - js.embedding_lookup(
            p["item"], i2
        ).mean(1)
        return jnp.mean(jnp.sum(eu * ei, -1) + p["b"]) ** 2

    grads = js.grad(loss)(params)
    assert_grads_match(grads, jax.grad(loss)(params), ["user", "item"])
    assert grads["item"].num_slices == 4 * 2 + 4 * 3
    np.testing.assert_array_equal(
        grads["item"].indices,
        np.where(
            np.concatenate([np.ravel(i1), np.ravel(i2)]) < 10,
            np.concatenate([np.ravel(i1), np.ravel(i2)]),
            10,
        ),
    )


def test_lookup_dtype_cast_keeps_sparse_gradient_in_table_dtype():
    rng = np.random.default_rng(4)
    params, ids = _params(), _ids(rng)

    def loss(p):
        rows = js.embedding_lookup(p["emb"], ids, dtype=jnp.bfloat16)
        return jnp.sum(rows.astype(jnp.float32) ** 2)

    grads = js.grad(loss)(params)
    assert isinstance(grads["emb"], IndexedSlices) and grads["emb"].dtype == jnp.float32
    assert_grads_match(grads, jax.grad(loss)(params), ["emb"], dtype=jnp.bfloat16)


def test_non_float_and_unused_leaves():
    rng = np.random.default_rng(5)
    ids = _ids(rng)
    params = {"emb": _params()["emb"], "unused": jnp.ones(3), "w": jnp.ones(20)}

    def loss(p):
        return flatten_loss(p, ids)

    assert_grads_match(js.grad(loss)(params), jax.grad(loss)(params), ["emb"])
    # No lookups at all: exactly jax.grad.
    g = js.grad(lambda p: jnp.sum(p["w"] ** 2))(params)
    assert not any(isinstance(x, IndexedSlices) for x in jax.tree.leaves(g))


# -------------------------------------------------------- dense fallbacks


def test_tied_input_output_embeddings_fall_back_to_dense():
    rng = np.random.default_rng(6)
    params, ids = _params(), _ids(rng)

    def loss(p):
        h = js.embedding_lookup(p["emb"], ids).mean(1)  # (B, D)
        logits = h @ p["emb"].T  # tied output layer
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    assert_grads_match(js.grad(loss)(params), jax.grad(loss)(params), [])


def test_transformed_table_falls_back_to_dense():
    rng = np.random.default_rng(7)
    params, ids = _params(), _ids(rng)

    def loss(p):
        return jnp.sum(js.embedding_lookup(p["emb"] * 2.0, ids) ** 2)

    assert_grads_match(js.grad(loss)(params), jax.grad(loss)(params), [])


def test_stop_gradient_use_keeps_sparse():
    rng = np.random.default_rng(8)
    params, ids = _params(), _ids(rng)

    def loss(p):
        norm = jnp.sum(jax.lax.stop_gradient(p["emb"]) ** 2)
        return jnp.sum(js.embedding_lookup(p["emb"], ids) ** 2) / norm

    assert_grads_match(js.grad(loss)(params), jax.grad(loss)(params), ["emb"])


@pytest.mark.parametrize(
    "construct", ["scan", "cond", "checkpoint", "inner_jit", "fori"]
)
def test_nested_scopes_fall_back_to_dense(construct):
    rng = np.random.default_rng(9)
    params, ids = _params(), _ids(rng)

    def lookup_sq(table, i):
        return jnp.sum(js.embedding_lookup(table, i) ** 2)

    def loss(p):
        t = p["emb"]
        if construct == "scan":
            return jax.lax.scan(lambda c, i: (c + lookup_sq(t, i), None), 0.0, ids)[0]
        if construct == "fori":
            return jax.lax.fori_loop(0, 3, lambda k, c: c + lookup_sq(t, ids[k]), 0.0)
        if construct == "cond":
            return jax.lax.cond(ids[0, 0] >= 0, lambda: lookup_sq(t, ids), lambda: 0.0)
        if construct == "checkpoint":
            return jax.checkpoint(lambda: lookup_sq(t, ids))()
        return jax.jit(lambda: lookup_sq(t, ids))()

    ref = jax.grad(loss)(params)
    got = js.grad(loss)(params)
    assert_grads_match(got, ref, [])
    assert_grads_match(jax.jit(js.grad(loss))(params), ref, [])


def test_scan_plus_top_level_lookup_of_one_table_is_dense():
    rng = np.random.default_rng(10)
    params, ids = _params(), _ids(rng)

    def loss(p):
        top = jnp.sum(js.embedding_lookup(p["emb"], ids[0]) ** 2)
        body = lambda c, i: (c + jnp.sum(js.embedding_lookup(p["emb"], i)), None)  # noqa: E731
        return top + jax.lax.scan(body, 0.0, ids)[0]

    assert_grads_match(js.grad(loss)(params), jax.grad(loss)(params), [])


@pytest.mark.parametrize("in_axes", [0, 1])
@pytest.mark.parametrize("use_jit", [False, True])
def test_lookup_inside_vmap_stays_sparse(in_axes, use_jit):
    """Equinox-style per-example model code under vmap keeps the sparse gradient."""
    rng = np.random.default_rng(11)
    params, ids = _params(), _ids(rng)

    def model(p, row_ids):  # written for one example
        return jnp.sum(js.embedding_lookup(p["emb"], row_ids) @ p["w"][:4])

    def loss(p):
        return jnp.mean(jax.vmap(model, in_axes=(None, in_axes))(p, ids) ** 2)

    ref = jax.grad(loss)(params)
    got = (jax.jit(js.grad(loss)) if use_jit else js.grad(loss))(params)
    assert_grads_match(got, ref, ["emb"])
    expected = np.asarray(ids) if in_axes == 0 else np.asarray(ids).T
    expected = np.where(expected < 10, expected, 10).reshape(-1)
    np.testing.assert_array_equal(got["emb"].indices, expected)


@pytest.mark.parametrize("private_jax", [True, False])
def test_lookup_inside_nested_vmap_or_vmap_in_scan(private_jax, monkeypatch):
    """Nested vmaps stay sparse (tests/lib/test_autodiff_vmap.py has more); vmap
    inside scan is dense; without the private JAX names all are dense."""
    from jaxslices import _jax_compat

    if not private_jax:
        monkeypatch.setitem(_jax_compat.AVAILABLE, "vmap_internals", False)
    rng = np.random.default_rng(14)
    params, ids = _params(), _ids(rng)
    ids3 = jnp.stack([ids, ids[::-1]])

    def one(p, i):
        return jnp.sum(js.embedding_lookup(p["emb"], i) ** 2)

    def nested(p):
        return jnp.sum(jax.vmap(jax.vmap(one, (None, 0)), (None, 0))(p, ids3))

    def in_scan(p):
        body = lambda c, i: (c + jnp.sum(jax.vmap(one, (None, 0))(p, i)), None)  # noqa: E731
        return jax.lax.scan(body, 0.0, ids3)[0]

    def closed_over_ids(p):  # ids not batched by the vmap
        return jnp.sum(jax.vmap(lambda s: s * one(p, ids))(jnp.arange(3.0)))

    for loss, sparse in ((nested, True), (in_scan, False), (closed_over_ids, True)):
        kinds = ["emb"] if sparse and private_jax else []
        assert_grads_match(js.grad(loss)(params), jax.grad(loss)(params), kinds)


def test_per_example_gradients_with_vmap_over_value_and_grad():
    rng = np.random.default_rng(12)
    params, ids = _params(), _ids(rng)

    def loss(p, row_ids):
        return flatten_loss(p, row_ids[None])

    vals, grads = jax.vmap(js.value_and_grad(loss), in_axes=(None, 0))(params, ids)
    rvals, rgrads = jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0))(params, ids)
    np.testing.assert_allclose(vals, rvals, rtol=1e-5)
    g = grads["emb"]
    assert isinstance(g, IndexedSlices) and g.values.shape == (3, 5, 4)
    dense = jax.vmap(lambda s: s.to_dense())(g)
    np.testing.assert_allclose(dense, rgrads["emb"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads["w"], rgrads["w"], rtol=1e-5, atol=1e-6)


def test_plain_jax_grad_through_lookup_is_dense_and_correct():
    table = jnp.arange(12.0).reshape(6, 2)
    ids = jnp.array([5, 0, 5, -1, 6])

    def loss(t):
        return jnp.sum(js.embedding_lookup(t, ids) * jnp.arange(1.0, 3.0))

    g = jax.grad(loss)(table)
    expected = np.zeros((6, 2))
    expected[5] = 2 * np.array([1.0, 2.0])
    expected[0] = [1.0, 2.0]
    np.testing.assert_array_equal(g, expected)  # ids -1 and 6: no gradient


# ----------------------------------------------------------------- lookups


def test_embedding_lookup_forward_and_ids_policy():
    table = jnp.arange(12.0).reshape(6, 2)
    ids = jnp.array([[5, -1], [6, 0]])
    out = js.embedding_lookup(table, ids)
    assert out.shape == (2, 2, 2)
    np.testing.assert_array_equal(out, [[[10, 11], [0, 0]], [[0, 0], [0, 1]]])
    assert js.embedding_lookup(table, ids, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    rows3 = js.embedding_lookup(jnp.ones((4, 2, 3)), jnp.array([1]))
    assert rows3.shape == (1, 2, 3)


def test_embedding_lookup_bad_input():
    with pytest.raises(TypeError, match=r"`ids` must be integers, got float32\[2\]"):
        js.embedding_lookup(jnp.ones((3, 2)), jnp.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="at least one dimension"):
        js.embedding_lookup(jnp.float32(1.0), jnp.array([0]))


def test_checked_mode_raises_under_jit():
    table = jnp.ones((5, 2))
    f = jax.jit(lambda t, i: js.embedding_lookup(t, i, check_ids=True).sum())
    assert float(f(table, jnp.array([0, 4]))) == 4.0
    with pytest.raises(Exception, match=r"ids must be in \[0, 5\).*min -1 and max 7"):
        jax.block_until_ready(f(table, jnp.array([-1, 7])))
    g = jax.jit(js.grad(lambda t, i: js.embedding_lookup(t, i, check_ids=True).sum()))
    with pytest.raises(Exception, match=r"ids must be in \[0, 5\)"):
        jax.block_until_ready(g(table, jnp.array([9])))


# ------------------------------------------------------------ embedding_bag


def _bag_reference(table, ids, weights, combiner, padding_id):
    table = np.asarray(table, np.float64)
    out = np.zeros(ids.shape[:-1] + table.shape[1:])
    for pos in np.ndindex(*ids.shape[:-1]):
        acc, wsum, w2 = 0.0, 0.0, 0.0
        for j, i in enumerate(ids[pos]):
            if padding_id is not None and i == padding_id:
                continue
            w = 1.0 if weights is None else float(weights[pos][j])
            row = table[i] if 0 <= i < table.shape[0] else 0.0
            acc = acc + w * row
            wsum += w
            w2 += w * w
        if combiner == "mean":
            acc = acc / wsum if wsum else acc * 0
        elif combiner == "sqrtn":
            acc = acc / np.sqrt(w2) if w2 else acc * 0
        out[pos] = acc
    return out


@pytest.mark.parametrize("combiner", ["mean", "sum", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_embedding_bag_forward_and_sparse_grad(combiner, weighted):
    rng = np.random.default_rng(13)
    table = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)
    ids = rng.integers(0, 4, size=(2, 3, 4)).astype(np.int32)
    ids[0, 0, :] = 7  # an empty bag (all padding)
    ids[1, 2, 1] = 7
    weights = (
        rng.uniform(0.5, 2.0, size=ids.shape).astype(np.float32) if weighted else None
    )
    w = None if weights is None else jnp.asarray(weights)
    kw = dict(weights=w, combiner=combiner, padding_id=7)
    out = js.embedding_bag(table, jnp.asarray(ids), **kw)
    assert out.shape == (2, 3, 3)
    np.testing.assert_allclose(
        out, _bag_reference(table, ids, weights, combiner, 7), 1e-5
    )
    np.testing.assert_array_equal(out[0, 0], 0.0)  # empty bag: zeros, not NaN

    def loss(t):
        return jnp.sum(js.embedding_bag(t, jnp.asarray(ids), **kw) ** 2)

    g = js.grad(loss)(table)
    assert isinstance(g, IndexedSlices)
    ref = jax.grad(loss)(table)
    assert np.all(np.isfinite(ref))
    np.testing.assert_allclose(g.to_dense(), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ref[7], 0.0)  # the padding row gets nothing
    assert np.all(np.asarray(g.indices)[ids.reshape(-1) == 7] == 8)


def test_embedding_bag_errors():
    t = jnp.ones((4, 2))
    with pytest.raises(ValueError, match="`combiner` must be one of"):
        js.embedding_bag(t, jnp.array([[0]]), combiner="min")
    with pytest.raises(
        ValueError, match=r"`weights` must have the shape of `ids` \(1, 2\)"
    ):
        js.embedding_bag(t, jnp.array([[0, 1]]), weights=jnp.ones(2))


# -------------------------------------------------- no (V, D) on sparse path


def _sgd_step(loss, lr=0.1):
    def step(params, ids, y):
        grads = js.grad(loss)(params, ids, y)
        emb = js.scatter_add(params["emb"], -lr * grads["emb"])
        return {"emb": emb, "w": params["w"] - lr * grads["w"]}

    return step


def _bag_mse(params, ids, y):
    h = js.embedding_bag(params["emb"], ids, combiner="mean")
    return jnp.mean((h @ params["w"] - y) ** 2)


def _temp_bytes(step, num_rows, batch=64, dim=16):
    params = {
        "emb": jax.ShapeDtypeStruct((num_rows, dim), jnp.float32),
        "w": jax.ShapeDtypeStruct((dim,), jnp.float32),
    }
    ids = jax.ShapeDtypeStruct((batch, 4), jnp.int32)
    y = jax.ShapeDtypeStruct((batch,), jnp.float32)
    compiled = jax.jit(step, donate_argnums=0).lower(params, ids, y).compile()
    mem = compiled.memory_analysis()
    return mem.temp_size_in_bytes, compiled.as_text()


def test_no_table_sized_temporary_on_the_sparse_path():
    small, _ = _temp_bytes(_sgd_step(_bag_mse), 2**12)
    large, hlo = _temp_bytes(_sgd_step(_bag_mse), 2**18)
    assert large == small, (small, large)
    assert large < 2**18 * 16 * 4 // 10
    dense_small, _ = _temp_bytes(_dense_step, 2**12)
    dense_large, _ = _temp_bytes(_dense_step, 2**18)
    assert dense_large > dense_small + 2**18 * 16 * 4 // 2  # the check can fail


def _dense_step(params, ids, y):
    grads = jax.grad(_bag_mse)(params, ids, y)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_no_table_sized_intermediate_in_the_jaxpr():
    num_rows, dim = 4099, 16
    params = {"emb": jnp.zeros((num_rows, dim)), "w": jnp.zeros(dim)}
    ids, y = jnp.zeros((8, 4), jnp.int32), jnp.zeros(8)
    jaxpr = jax.make_jaxpr(_sgd_step(_bag_mse))(params, ids, y)
    shapes = _all_intermediate_shapes(jaxpr.jaxpr)
    table_like = [(p, s) for p, s in shapes if s and s[0] == num_rows]
    # Only the update's output (the updated table: XLA's scatter, or the native
    # kernel that writes the rows in place) may have the table's shape;
    # stop_gradient is an identity that XLA removes (no buffer).
    update = "jaxslices_apply" if js.kernels.available() else "scatter-add"
    assert [p for p, _ in table_like if p != "stop_gradient"] == [update], table_like
    dense = _all_intermediate_shapes(jax.make_jaxpr(_dense_step)(params, ids, y).jaxpr)
    assert len([s for _, s in dense if s and s[0] == num_rows]) > 2


def _all_intermediate_shapes(jaxpr):
    shapes = []
    for eqn in jaxpr.eqns:
        shapes += [
            (eqn.primitive.name, tuple(v.aval.shape))
            for v in eqn.outvars
            if hasattr(v.aval, "shape")
        ]
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                shapes += _all_intermediate_shapes(inner)
    return shapes


@pytest.mark.parametrize("use_jit", [False, True])
def test_value_and_dense_leaves_are_bit_for_bit_jax(use_jit):
    """README / docs/sparse_gradients.md: dense leaves are exactly jax.grad's."""

    def loss(params, ids, y):
        h = js.embedding_bag(params["emb"], ids, combiner="mean")
        return jnp.mean((jnp.tanh(h) @ params["w"] - y) ** 2)

    for seed in range(3):
        rng = np.random.default_rng(seed)
        params = {
            "emb": jnp.asarray(rng.normal(size=(50, 8)), jnp.float32),
            "w": jnp.asarray(rng.normal(size=8), jnp.float32),
        }
        ids = jnp.asarray(rng.integers(0, 10, (6, 4)))  # repeats
        y = jnp.asarray(rng.normal(size=6), jnp.float32)
        ours, theirs = js.value_and_grad(loss), jax.value_and_grad(loss)
        if use_jit:
            ours, theirs = jax.jit(ours), jax.jit(theirs)
        (v1, g1), (v2, g2) = ours(params, ids, y), theirs(params, ids, y)
        np.testing.assert_array_equal(v1, v2)
        np.testing.assert_array_equal(g1["w"], g2["w"])
        np.testing.assert_allclose(js.to_dense(g1)["emb"], g2["emb"], rtol=1e-6)
