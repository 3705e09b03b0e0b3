"""jaxslices.linen: Embed is flax.linen.Embed with a sparse gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tol

import jaxslices as js

nn = pytest.importorskip("flax.linen")
jlinen = pytest.importorskip("jaxslices.linen")


class Model(nn.Module):
    embed_cls: type = nn.Embed
    dtype: object = None

    @nn.compact
    def __call__(self, users, items):
        u = self.embed_cls(13, 4, dtype=self.dtype, name="user")(users)
        q = jnp.mean(self.embed_cls(17, 4, dtype=self.dtype, name="item")(items), 1)
        return nn.Dense(1)(u * q)[:, 0].astype(jnp.float32)


def _batch(seed=0, batch=6, length=3):
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 4, batch).astype(np.int32)  # repeats
    items = rng.integers(0, 17, (batch, length)).astype(np.int32)
    items[0, 1] = -3  # counts from the end, as in the stock layer
    y = rng.normal(size=batch).astype(np.float32)
    return jnp.asarray(users), jnp.asarray(items), jnp.asarray(y)


def _models(dtype=None):
    mine, stock = Model(jlinen.Embed, dtype), Model(nn.Embed, dtype)
    users, items, _ = _batch()
    p1 = mine.init(jax.random.key(0), users, items)["params"]
    p2 = stock.init(jax.random.key(0), users, items)["params"]
    return mine, stock, p1, p2


def _loss(model):
    def loss(params, users, items, y):
        return jnp.mean((model.apply({"params": params}, users, items) - y) ** 2)

    return loss


def _assert_trees_close(sparse, dense, **tol):
    got = js.to_dense(sparse)
    assert jax.tree.structure(got) == jax.tree.structure(dense)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(dense), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), **tol
        )


def test_same_params_outputs_and_attend_as_the_stock_layer():
    mine, stock, p1, p2 = _models()
    _assert_trees_close(p1, p2, rtol=0, atol=0)
    users, items, _ = _batch()
    np.testing.assert_array_equal(
        mine.apply({"params": p1}, users, items),
        stock.apply({"params": p2}, users, items),
    )
    layer, ref = jlinen.Embed(7, 3), nn.Embed(7, 3)
    ids = jnp.array([0, 6, -1, -7])
    v = ref.init(jax.random.key(1), ids)
    np.testing.assert_array_equal(layer.apply(v, ids), ref.apply(v, ids))
    q = jnp.ones((2, 3))
    np.testing.assert_array_equal(
        layer.apply(v, q, method="attend"), ref.apply(v, q, method="attend")
    )


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_grads_are_sparse_and_equal_to_the_stock_layers(dtype):
    mine, stock, p1, p2 = _models(dtype)
    batch = _batch(1)
    v1, g1 = js.value_and_grad(_loss(mine))(p1, *batch)
    v2, g2 = jax.value_and_grad(_loss(stock))(p2, *batch)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    for name, rows in (("user", 6), ("item", 18)):
        s = g1[name]["embedding"]
        assert isinstance(s, js.IndexedSlices) and s.values.shape[0] == rows
        assert s.dtype == jnp.float32  # the parameter's dtype
    assert isinstance(g1["Dense_0"]["kernel"], jax.Array)
    # bf16: the stock layer sums duplicate rows in bf16, the sparse path in f32.
    _assert_trees_close(g1, g2, **(tol(dtype) if dtype else dict(rtol=1e-6, atol=1e-7)))


def test_plain_jax_grad_of_the_layer_is_the_stock_dense_gradient():
    mine, stock, p1, p2 = _models()
    batch = _batch(2)
    _assert_trees_close(
        jax.grad(_loss(mine))(p1, *batch), jax.grad(_loss(stock))(p2, *batch), rtol=1e-6
    )


def test_out_of_range_ids_read_zeros_and_are_padding():
    layer = jlinen.Embed(5, 2)
    ids = jnp.array([5, 2, -6])
    p = layer.init(jax.random.key(0), ids)["params"]
    out = layer.apply({"params": p}, ids)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(out[2], 0.0)
    g = js.grad(lambda p: layer.apply({"params": p}, ids).sum())(p)["embedding"]
    np.testing.assert_array_equal(g.indices, [5, 2, 5])
    np.testing.assert_array_equal(g.to_dense().sum(), 2.0)


def test_tied_weights_through_attend_get_the_dense_gradient():
    class Tied(nn.Module):
        embed_cls: type

        @nn.compact
        def __call__(self, ids):
            emb = self.embed_cls(7, 3, name="emb")
            return jax.nn.log_softmax(emb.attend(emb(ids)))[:, 0].sum()

    ids = jnp.array([1, 1, 5])
    mine, stock = Tied(jlinen.Embed), Tied(nn.Embed)
    p = stock.init(jax.random.key(0), ids)["params"]
    g1 = js.grad(lambda p: mine.apply({"params": p}, ids))(p)
    g2 = jax.grad(lambda p: stock.apply({"params": p}, ids))(p)
    assert isinstance(g1["emb"]["embedding"], jax.Array)
    _assert_trees_close(g1, g2, rtol=1e-6, atol=1e-7)


def test_float_ids_raise_a_clear_error():
    layer = jlinen.Embed(5, 2)
    with pytest.raises(ValueError, match=r"jaxslices.linen.Embed.*integers"):
        layer.init(jax.random.key(0), jnp.array([1.0]))


@pytest.mark.parametrize(
    "sparse_tx,dense_tx",
    [(js.sgd(0.3), optax.sgd(0.3)), (js.adagrad(0.5), optax.adagrad(0.5))],
    ids=["sgd", "adagrad"],
)
def test_jitted_training_equals_the_stock_layer_with_optax(sparse_tx, dense_tx):
    mine, stock, p1, p2 = _models()
    s1, s2 = sparse_tx.init(p1), dense_tx.init(p2)

    @jax.jit
    def step_mine(params, state, *batch):
        loss, grads = js.value_and_grad(_loss(mine))(params, *batch)
        assert isinstance(grads["item"]["embedding"], js.IndexedSlices)
        updates, state = sparse_tx.update(grads, state, params)
        return js.apply_updates(params, updates), state, loss

    @jax.jit
    def step_stock(params, state, *batch):
        loss, grads = jax.value_and_grad(_loss(stock))(params, *batch)
        updates, state = dense_tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    for k in range(4):
        p1, s1, l1 = step_mine(p1, s1, *_batch(k))
        p2, s2, l2 = step_stock(p2, s2, *_batch(k))
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
    _assert_trees_close(p1, p2, rtol=1e-5, atol=1e-6)
