"""Lookups under (nested) jax.vmap stay sparse and equal jax.grad densified.

The Equinox per-example idiom is ``jax.vmap(model)(batch)`` with
``jax.vmap(self.embedding)(tokens)`` inside: a lookup of one scalar id under two
``vmap``s. Positional embeddings add a lookup whose ids are not batched by the
outer ``vmap``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslices as js

V, D, B, L = 11, 3, 4, 5


def _params(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {
        "tok": jax.random.normal(k1, (V, D)),
        "pos": jax.random.normal(k2, (L, D)),
        "w": jax.random.normal(k3, (D,)),
    }


def _tokens(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V // 2, size=(B, L)).astype(np.int32)  # repeats
    ids[0, -1] = V  # out of range: padding
    ids[1, 0] = -1
    return jnp.asarray(ids)


def _check(loss, params, sparse, *args):
    want_value, want = jax.value_and_grad(loss)(params, *args)
    for vg in (js.value_and_grad(loss), jax.jit(js.value_and_grad(loss))):
        value, got = vg(params, *args)
        np.testing.assert_allclose(value, want_value, rtol=1e-5)
        for name in params:
            g = got[name]
            assert isinstance(g, js.IndexedSlices) == (name in sparse), name
            g = g.to_dense() if isinstance(g, js.IndexedSlices) else g
            np.testing.assert_allclose(g, want[name], rtol=1e-5, atol=1e-6)
    return got


def _valid(ids):
    ids = np.asarray(ids)
    return np.where((ids >= 0) & (ids < V), ids, V)


def test_equinox_idiom_nested_vmap_of_scalar_lookup():
    params, tokens = _params(), _tokens()

    def embed(p, token):  # like eqx.nn.Embedding.__call__: one scalar id
        return js.embedding_lookup(p["tok"], token)

    def model(p, seq):  # written for one example
        h = jax.vmap(embed, in_axes=(None, 0))(p, seq)  # (L, D)
        return jnp.tanh(h @ p["w"]).sum()

    def loss(p, tokens):
        return jnp.mean(jax.vmap(model, in_axes=(None, 0))(p, tokens) ** 2)

    got = _check(loss, params, {"tok"}, tokens)
    np.testing.assert_array_equal(got["tok"].indices, _valid(tokens).reshape(-1))


def test_unbatched_ids_inside_vmap_positional_embedding():
    """Positions are the same for every example: ids not batched by the vmap."""
    params, tokens = _params(1), _tokens(1)

    def model(p, seq):
        tok = jax.vmap(lambda t: js.embedding_lookup(p["tok"], t))(seq)
        pos = js.embedding_lookup(p["pos"], jnp.arange(L))  # unbatched ids
        return jnp.sum(jnp.sin((tok + pos) @ p["w"]))

    def loss(p, tokens):
        return jnp.sum(jax.vmap(model, in_axes=(None, 0))(p, tokens) ** 2)

    got = _check(loss, params, {"tok", "pos"}, tokens)
    # One lookup of L positions at the top level, its rows' gradient summed
    # over the batch (the ids are the same for every example).
    np.testing.assert_array_equal(got["pos"].indices, np.arange(L))


def test_unbatched_ids_inside_nested_vmap():
    params = _params(2)

    def loss(p, scales):
        def inner(s, r):
            return s * r * js.embedding_lookup(p["pos"], jnp.array([0, 2, 2])).sum()

        out = jax.vmap(jax.vmap(inner, (None, 0)), (0, None))(scales, scales[:3])
        return jnp.sum(out**2)

    _check(loss, params, {"pos"}, jnp.arange(1.0, 5.0))


@pytest.mark.parametrize("outer_axis", [0, 1])
@pytest.mark.parametrize("inner_axis", [0, 1])
def test_vmap_inside_vmap_with_different_in_axes(outer_axis, inner_axis):
    params = _params(3)
    rng = np.random.default_rng(3)
    ids3 = jnp.asarray(rng.integers(-1, V + 1, size=(2, 3, 4)).astype(np.int32))

    def one(p, i):  # i: a vector of ids
        return jnp.sum(js.embedding_lookup(p["tok"], i) @ p["w"]) ** 2

    def loss(p, ids3):
        inner = jax.vmap(one, in_axes=(None, inner_axis))
        return jnp.sum(jax.vmap(inner, in_axes=(None, outer_axis))(p, ids3))

    got = _check(loss, params, {"tok"}, ids3)
    assert got["tok"].num_slices == ids3.size


def test_three_levels_and_vmap_of_whole_model_with_other_batched_args():
    params, tokens = _params(4), _tokens(4)
    ys = jnp.arange(float(B))

    def loss(p, tokens, ys):
        def example(seq, y):
            def slot(t):
                return jax.vmap(lambda u: js.embedding_lookup(p["tok"], u))(
                    jnp.stack([t, t])
                ).sum(0)

            h = jax.vmap(slot)(seq)  # three vmaps deep
            return (jnp.sum(h @ p["w"]) - y) ** 2

        return jnp.mean(jax.vmap(example)(tokens, ys))

    got = _check(loss, params, {"tok"}, tokens, ys)
    assert got["tok"].num_slices == 2 * tokens.size


def test_vmap_inside_scan_is_still_dense():
    params, tokens = _params(5), _tokens(5)

    def loss(p, tokens):
        def body(c, seq):
            h = jax.vmap(lambda t: js.embedding_lookup(p["tok"], t))(seq)
            return c + jnp.sum(h @ p["w"]) ** 2, None

        return jax.lax.scan(body, 0.0, tokens)[0]

    _check(loss, params, set(), tokens)


def test_equinox_module_per_example():
    eqx = pytest.importorskip("equinox")

    class Embedding(eqx.Module):
        weight: jax.Array

        def __call__(self, token):
            return js.embedding_lookup(self.weight, token)

    class Model(eqx.Module):
        emb: Embedding
        w: jax.Array

        def __call__(self, seq):
            return jnp.sum(jnp.tanh(jax.vmap(self.emb)(seq) @ self.w))

    p = _params(6)
    model = Model(Embedding(p["tok"]), p["w"])
    tokens = _tokens(6)

    def loss(m, tokens):
        return jnp.mean(jax.vmap(m)(tokens) ** 2)

    value, grads = js.value_and_grad(loss)(model, tokens)
    want_value, want = jax.value_and_grad(loss)(model, tokens)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    assert isinstance(grads.emb.weight, js.IndexedSlices)
    np.testing.assert_allclose(
        grads.emb.weight.to_dense(), want.emb.weight, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(grads.w, want.w, rtol=1e-5, atol=1e-6)


# ------------------------------------ per-example gradients: vmap(value_and_grad)
# Bags and collections pool on the native path where the kernels run; under
# an outer vmap, discovery sees unbatched ids and the differentiating pass
# batched ones, so the path must be decided once per value_and_grad.


def _per_example(loss, params, *batched):
    """``vmap(js.value_and_grad)`` densified, and ``vmap(jax.value_and_grad)``."""
    in_axes = (None,) + (0,) * len(batched)
    vals, grads = jax.vmap(js.value_and_grad(loss), in_axes=in_axes)(params, *batched)
    rvals, rgrads = jax.vmap(jax.value_and_grad(loss), in_axes=in_axes)(
        params, *batched
    )
    np.testing.assert_allclose(vals, rvals, rtol=1e-5, atol=1e-6)
    sparse = []
    for (path, g), r in zip(
        jax.tree_util.tree_leaves_with_path(grads, is_leaf=js.is_indexed_slices),
        jax.tree.leaves(rgrads),
        strict=True,
    ):
        if isinstance(g, js.IndexedSlices):
            sparse.append(jax.tree_util.keystr(path))
            g = jax.vmap(lambda s: s.to_dense())(g)
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    return sparse


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("combiner", ["mean", "sum", "sqrtn"])
def test_per_example_gradients_of_a_bag(native, combiner):
    """``jax.vmap(js.value_and_grad(loss), in_axes=(None, 0))`` with a bag."""
    import contextlib

    rng = np.random.default_rng(3)
    params = _params()
    ids = jnp.asarray(rng.integers(-1, V + 1, size=(3, B, L)), jnp.int32)
    y = jnp.asarray(rng.normal(size=(3, B)), jnp.float32)

    def loss(p, ids, y):
        h = js.embedding_bag(p["tok"], ids, combiner=combiner)
        return jnp.mean((h @ p["w"] - y) ** 2)

    with contextlib.nullcontext() if native else js.kernels.disabled():
        assert _per_example(loss, params, ids, y) == ["['tok']"]
        jitted = jax.jit(jax.vmap(js.grad(loss), in_axes=(None, 0, 0)))
        g = jitted(params, ids, y)["tok"]
    want = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, ids, y)["tok"]
    np.testing.assert_allclose(
        jax.vmap(lambda s: s.to_dense())(g), want, rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("native", [True, False])
def test_per_example_gradients_of_a_collection(native):
    import contextlib

    coll = js.EmbeddingCollection(
        [
            js.TableConfig("user", rows=13, dim=4),
            js.TableConfig("item", rows=9, dim=4, features=("item", "clicked")),
        ]
    )
    params = {**coll.init(jax.random.key(0)), "w": jnp.ones((12,))}
    rng = np.random.default_rng(4)
    batch = {
        "user": jnp.asarray(rng.integers(0, 13, size=(3, B, 1)), jnp.int32),
        "item": jnp.asarray(rng.integers(0, 9, size=(3, B, 2)), jnp.int32),
        "clicked": jnp.asarray(rng.integers(-1, 10, size=(3, B, L)), jnp.int32),
    }

    def loss(p, batch):
        h = coll.concat({k: v for k, v in p.items() if k != "w"}, batch)
        return jnp.mean(jnp.tanh(h @ p["w"]))

    with contextlib.nullcontext() if native else js.kernels.disabled():
        assert _per_example(loss, params, batch) == ["['dim4_float32']"]


def test_a_bag_inside_vmap_inside_value_and_grad_stays_sparse():
    """The other direction: vmap inside the loss (the rows path below the top)."""
    rng = np.random.default_rng(5)
    params = _params()
    ids = jnp.asarray(rng.integers(0, V, size=(B, L)), jnp.int32)

    def loss(p, ids):
        h = jax.vmap(lambda i: js.embedding_bag(p["tok"], i[None])[0])(ids)
        return jnp.sum(jnp.sin(h @ p["w"]))

    g = js.grad(loss)(params, ids)
    assert isinstance(g["tok"], js.IndexedSlices)
    np.testing.assert_allclose(
        g["tok"].to_dense(), jax.grad(loss)(params, ids)["tok"], rtol=1e-5, atol=1e-6
    )
