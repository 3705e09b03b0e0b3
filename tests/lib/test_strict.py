"""Strict mode: every silent dense gradient of a table raises at trace time.

Each reason the issue names (stock gradient, cast of the params, direct read
or indexing) and the others the mechanism knows (tied weights, a lookup
inside ``scan``) raises ``jaxslices.DenseGradientError`` naming the table and
the fix, from the gradient functions (``strict=True``) and from the layers
(``strict=True``). What is not a table (a dense kernel, a cast weight in a
matmul, a table nobody differentiates) never raises, and strict mode changes
no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslices as js

nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")
eqx = pytest.importorskip("equinox")
jnnx = pytest.importorskip("jaxslices.nnx")
jlinen = pytest.importorskip("jaxslices.linen")
jse = pytest.importorskip("jaxslices.equinox")

V, D = 10, 4
IDS = jnp.array([6, 1, 1])
Error = js.DenseGradientError


def _params():
    return {"emb": jnp.ones((V, D)), "w": jnp.arange(1.0, D + 1)}


LOSSES = {
    "indexing": (
        lambda p, ids: jnp.sum(p["emb"][ids] @ p["w"]),
        r"argument 0\['emb'\] \(shape \(10, 4\)\): it is read by indexing \(`gather`",
    ),
    "take": (
        lambda p, ids: jnp.sum(jnp.take(p["emb"], ids, axis=0) @ p["w"]),
        r"read by indexing .*Fix: read it only through jaxslices.embedding_lookup",
    ),
    "cast": (
        lambda p, ids: jnp.sum(
            js.embedding_lookup(p["emb"].astype(jnp.bfloat16), ids) @ p["w"]
        ),
        r"\['emb'\].*it is cast \(`convert_element_type`.*Fix: pass the parameter "
        r"itself and ask the lookup or layer for the compute dtype",
    ),
    "tied": (
        lambda p, ids: jnp.sum(js.embedding_lookup(p["emb"], ids) @ p["emb"].T),
        r"\['emb'\].*besides its jaxslices lookups it is also used by `transpose`",
    ),
    "scan": (
        lambda p, ids: jax.lax.scan(
            lambda c, i: (c + js.embedding_lookup(p["emb"], i) @ p["w"], None),
            0.0,
            ids,
        )[0],
        r"\['emb'\].*looked up inside a nested transformation .*Fix: look the ids "
        r"up at the loss's top level",
    ),
}


@pytest.mark.parametrize("case", sorted(LOSSES))
def test_value_and_grad_strict_names_the_table_and_the_reason(case):
    loss, message = LOSSES[case]
    with pytest.raises(
        Error, match=r"jaxslices.value_and_grad\(strict=True\): 1 table"
    ):
        js.value_and_grad(loss, strict=True)(_params(), IDS)
    with pytest.raises(Error, match=message):
        jax.jit(js.grad(loss, strict=True))(_params(), IDS)  # at trace time
    # Without strict: JAX's exact dense gradient, as before.
    g = js.grad(loss)(_params(), IDS)
    np.testing.assert_allclose(g["emb"], jax.grad(loss)(_params(), IDS)["emb"])


def test_strict_changes_no_gradient_and_passes_dense_parameters():
    def loss(p, ids):  # a cast weight in a matmul and a bias: not tables
        rows = js.embedding_lookup(p["emb"], ids, dtype=jnp.bfloat16)
        h = rows @ p["w"].astype(jnp.bfloat16)
        return jnp.sum(h.astype(jnp.float32) + p["b"][0])

    params = {**_params(), "b": jnp.zeros(3)}
    v1, g1 = jax.jit(js.value_and_grad(loss, strict=True))(params, IDS)
    v2, g2 = jax.jit(js.value_and_grad(loss))(params, IDS)
    assert isinstance(g1["emb"], js.IndexedSlices)
    np.testing.assert_array_equal(g1["emb"].indices, g2["emb"].indices)
    for a, b in zip(
        jax.tree.leaves(js.to_dense(g1)), jax.tree.leaves(js.to_dense(g2)), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(v1, v2)


def test_the_lookups_strict_switch_catches_stock_gradients():
    def loss(t):
        return jnp.sum(js.embedding_lookup(t, IDS, strict=True) ** 2)

    stock = r"JAX's own gradient is differentiating this table .*\(10, 4\).*Fix: use"
    for grad in (jax.grad, jax.value_and_grad):
        with pytest.raises(Error, match=stock):
            grad(loss)(jnp.ones((V, D)))
    bag = lambda t: js.embedding_bag(t, IDS[None], strict=True).sum()  # noqa: E731
    with pytest.raises(Error, match=stock):
        jax.jit(jax.grad(bag))(jnp.ones((V, D)))
    assert isinstance(js.grad(loss)(jnp.ones((V, D))), js.IndexedSlices)
    # A table nobody differentiates: no dense gradient, no error.
    w_only = lambda w, t: jnp.sum(js.embedding_lookup(t, IDS, strict=True) * w)  # noqa: E731
    jax.grad(w_only)(1.0, jnp.ones((V, D)))
    # Inside a jaxslices gradient function that falls back to dense (a cast).
    cast = lambda t: js.embedding_lookup(t * 2.0, IDS, strict=True).sum()  # noqa: E731
    with pytest.raises(Error, match=r"under jaxslices.value_and_grad: .*a cast such"):
        js.grad(cast)(jnp.ones((V, D)))


# ------------------------------------------------------------ the frameworks


class _Tower(nnx.Module):
    def __init__(self, embed, **kw):
        self.emb = embed(V, D, rngs=nnx.Rngs(0), **kw)
        self.out = nnx.Linear(D, 1, rngs=nnx.Rngs(1))

    def __call__(self, ids):
        return self.out(self.emb(ids))[:, 0]


def _nnx_loss(m):
    return jnp.sum(m(IDS) ** 2)


def test_nnx():
    with pytest.raises(Error, match=r"argument 0\['emb'\]\['embedding'\] .*stock `nnx"):
        jnnx.value_and_grad(_nnx_loss, strict=True)(_Tower(nnx.Embed))
    g = jnnx.grad(_nnx_loss, strict=True)(_Tower(jnnx.Embed))
    assert isinstance(g["emb"]["embedding"].get_value(), js.IndexedSlices)
    strict_model = _Tower(jnnx.Embed, strict=True)
    with pytest.raises(Error, match="JAX's own gradient"):
        nnx.grad(_nnx_loss)(strict_model)  # the stock gradient function
    with pytest.raises(Error, match="JAX's own gradient"):
        nnx.jit(nnx.grad(_nnx_loss))(strict_model)
    bag = _Tower(jnnx.EmbedBag, strict=True)
    with pytest.raises(Error, match="JAX's own gradient"):
        nnx.grad(lambda m: jnp.sum(m(IDS[None]) ** 2))(bag)
    # Only the Linear differentiated: the strict table is not, no error.
    only_out = nnx.DiffState(0, nnx.PathContains("out"))
    g = nnx.grad(_nnx_loss, argnums=only_out)(strict_model)
    assert list(g.keys()) == ["out"]


def test_linen_cast_params_before_apply():
    model = jlinen.Embed(num_embeddings=V, features=D)
    params = model.init(jax.random.key(0), IDS)["params"]

    def loss(p):
        p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
        return jnp.sum(model.apply({"params": p16}, IDS).astype(jnp.float32))

    with pytest.raises(Error, match=r"argument 0\['embedding'\].*it is cast"):
        js.grad(loss, strict=True)(params)
    fixed = jlinen.Embed(num_embeddings=V, features=D, dtype=jnp.bfloat16)

    def loss_fixed(p):  # the fix the message gives: the layer's dtype
        return jnp.sum(fixed.apply({"params": p}, IDS).astype(jnp.float32))

    assert isinstance(
        js.grad(loss_fixed, strict=True)(params)["embedding"], js.IndexedSlices
    )
    strict_layer = jlinen.Embed(num_embeddings=V, features=D, strict=True)

    def loss_strict(p):
        return jnp.sum(strict_layer.apply({"params": p}, IDS))

    with pytest.raises(Error, match="JAX's own gradient"):
        jax.grad(loss_strict)(params)


def test_equinox():
    stock = eqx.nn.Embedding(V, D, key=jax.random.key(0))

    def loss(m):
        return jnp.sum(jax.vmap(m)(IDS) ** 2)

    with pytest.raises(Error, match=r"model.weight \(shape \(10, 4\)\): it is read by"):
        jse.filter_grad(loss, strict=True)(stock)
    mine = jse.Embedding(V, D, key=jax.random.key(0), strict=True)
    assert isinstance(jse.filter_grad(loss, strict=True)(mine).weight, js.IndexedSlices)
    with pytest.raises(Error, match="JAX's own gradient"):
        eqx.filter_grad(loss)(mine)
    bag = jse.EmbeddingBag(V, D, key=jax.random.key(0), strict=True)
    with pytest.raises(Error, match="JAX's own gradient"):
        eqx.filter_value_and_grad(lambda m: jnp.sum(m(IDS) ** 2))(bag)
