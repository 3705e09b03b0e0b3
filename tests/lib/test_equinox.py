"""jaxslices.equinox: Embedding, filtered gradients and updates, against Equinox."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tol

import jaxslices as js

eqx = pytest.importorskip("equinox")
jse = pytest.importorskip("jaxslices.equinox")

NUM_USERS, NUM_ITEMS, DIM = 13, 17, 4


class PerExample(eqx.Module):
    """One example per call: a user id and a sequence of item ids."""

    user: eqx.nn.Embedding
    item: eqx.nn.Embedding
    head: eqx.nn.Linear
    act: object  # a non-array leaf: its gradient is None

    def __init__(self, embedding_cls, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.user = embedding_cls(NUM_USERS, DIM, key=k1)
        self.item = embedding_cls(NUM_ITEMS, DIM, key=k2)
        self.head = eqx.nn.Linear(DIM, "scalar", key=k3)
        self.act = jax.nn.tanh

    def __call__(self, user, items):
        u = self.user(user)
        q = jnp.mean(jax.vmap(self.item)(items), axis=0)
        return self.head(self.act(u * q))


def nested_loss(model, users, items, y):
    """The Equinox idiom: vmap the model; the model vmaps the item table."""
    return jnp.mean((jax.vmap(model)(users, items) - y) ** 2)


def flat_loss(model, users, items, y):
    """One vmap level: the model's tables looked up per example at the top."""
    u = jax.vmap(model.user)(users)
    q = jax.vmap(model.item)(items.reshape(-1)).reshape(*items.shape, -1)
    q = jnp.mean(q, axis=1)
    pred = jax.vmap(model.head)(model.act(u * q))
    return jnp.mean((pred - y) ** 2)


def _batch(seed=0, batch=6, length=3):
    rng = np.random.default_rng(seed)
    users = rng.integers(0, NUM_USERS // 3, batch).astype(np.int32)  # repeats
    items = rng.integers(0, NUM_ITEMS, (batch, length)).astype(np.int32)
    items[0, 1] = -2  # counts from the end, as in the stock layer
    y = rng.normal(size=batch).astype(np.float32)
    return jnp.asarray(users), jnp.asarray(items), jnp.asarray(y)


def _pair():
    key = jax.random.key(0)
    return PerExample(jse.Embedding, key), PerExample(eqx.nn.Embedding, key)


def _assert_trees_close(sparse, dense, **tol):
    got = jax.tree_util.tree_leaves_with_path(js.to_dense(sparse))
    want = jax.tree_util.tree_leaves_with_path(dense)
    # Same paths (the classes differ: jaxslices' layer subclasses the stock one).
    assert [p for p, _ in got] == [p for p, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)


# ------------------------------------------------------------------ the layer


def test_embedding_is_the_stock_layer_with_the_same_fields_and_rows():
    key = jax.random.key(3)
    mine, stock = jse.Embedding(9, 5, key=key), eqx.nn.Embedding(9, 5, key=key)
    assert isinstance(mine, eqx.nn.Embedding)
    assert (mine.num_embeddings, mine.embedding_size) == (9, 5)
    np.testing.assert_array_equal(mine.weight, stock.weight)
    for i in (0, 8, -1, -9):
        np.testing.assert_array_equal(mine(jnp.array(i)), stock(jnp.array(i)))
    w = jnp.arange(6.0).reshape(3, 2)
    from_weight = jse.Embedding(weight=w)
    assert (from_weight.num_embeddings, from_weight.embedding_size) == (3, 2)
    bf16 = jse.Embedding(4, 2, dtype=jnp.bfloat16, key=key)
    assert bf16.weight.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="num_embeddings"):
        jse.Embedding(4, 2)  # no key, no weight: Equinox's own error


def test_bad_ids_raise_clear_errors():
    emb = jse.Embedding(5, 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"scalar index.*jax.vmap"):
        emb(jnp.array([1, 2]))
    with pytest.raises(ValueError, match=r"integers.*float32"):
        emb(jnp.array(1.0))


def test_out_of_range_ids_read_zeros_and_are_padding():
    emb = jse.Embedding(5, 2, key=jax.random.key(0))
    np.testing.assert_array_equal(emb(jnp.array(5)), 0.0)
    ids = jnp.array([5, 2, -6])
    g = jse.filter_grad(lambda m: jnp.sum(jax.vmap(m)(ids)))(emb).weight
    np.testing.assert_array_equal(g.indices, [5, 2, 5])
    assert float(g.to_dense().sum()) == 2.0


# ------------------------------------------------------------------ gradients


@pytest.mark.parametrize("loss", [flat_loss, nested_loss], ids=["flat", "nested"])
def test_grads_equal_the_stock_layers_dense_grads(loss):
    mine, stock = _pair()
    batch = _batch(1)
    v1, g1 = jse.filter_value_and_grad(loss)(mine, *batch)
    v2, g2 = eqx.filter_value_and_grad(loss)(stock, *batch)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    assert g1.act is None and g2.act is None
    _assert_trees_close(g1, g2, rtol=1e-5, atol=1e-7)


def test_per_example_lookups_at_one_vmap_level_are_sparse():
    mine, _ = _pair()
    g = jse.filter_grad(flat_loss)(mine, *_batch())
    assert isinstance(g.user.weight, js.IndexedSlices)
    assert isinstance(g.item.weight, js.IndexedSlices)
    assert g.item.weight.values.shape == (18, DIM)
    assert isinstance(g.head.weight, jax.Array)


def test_nested_vmap_per_example_model_is_sparse():
    # jax.vmap(model) whose __call__ runs jax.vmap(self.item): nested vmap.
    mine, _ = _pair()
    g = jse.filter_grad(nested_loss)(mine, *_batch())
    assert isinstance(g.user.weight, js.IndexedSlices)
    assert isinstance(g.item.weight, js.IndexedSlices)
    assert g.item.weight.values.shape == (18, DIM)  # 6 examples x 3 items


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes_keep_the_gradient_sparse_in_the_tables_dtype(dtype):
    key = jax.random.key(1)
    mine = jse.Embedding(7, 3, dtype=dtype, key=key)
    stock = eqx.nn.Embedding(7, 3, dtype=dtype, key=key)
    ids = jnp.array([6, 1, 1, -1, 0])
    w = jnp.arange(15.0).reshape(5, 3).astype(dtype)

    def loss(m):
        return jnp.sum((jax.vmap(m)(ids) * w).astype(jnp.float32))

    g = jse.filter_grad(loss)(mine).weight
    assert isinstance(g, js.IndexedSlices) and g.dtype == dtype
    want = eqx.filter_grad(loss)(stock).weight
    np.testing.assert_allclose(
        np.asarray(g.to_dense(), np.float32), np.asarray(want, np.float32), **tol(dtype)
    )


def test_has_aux_and_extra_arguments():
    mine, stock = _pair()

    def loss(model, users, items, y, *, scale):
        pred = jax.vmap(model)(users, items) * scale
        return jnp.mean((pred - y) ** 2), pred

    batch = _batch(2)
    (v1, a1), g1 = jse.filter_value_and_grad(loss, has_aux=True)(
        mine, *batch, scale=2.0
    )
    (v2, a2), g2 = eqx.filter_value_and_grad(loss, has_aux=True)(
        stock, *batch, scale=2.0
    )
    np.testing.assert_allclose(a1, a2, rtol=1e-6)
    _assert_trees_close(g1, g2, rtol=1e-5, atol=1e-7)
    g, aux = jse.filter_grad(loss, has_aux=True)(mine, *batch, scale=2.0)
    assert aux.shape == (6,)


# ------------------------------------------------------------------ updates


def test_apply_updates_takes_a_prefix_and_scatters_slices():
    emb = jse.Embedding(weight=jnp.zeros((4, 2)))
    model = {"emb": emb, "b": jnp.ones(2), "frozen": jnp.ones(3)}
    upd = {
        "emb": jse.Embedding(
            weight=js.IndexedSlices(jnp.ones((3, 2)), jnp.array([1, 1, 4]), (4, 2))
        ),
        "b": jnp.ones(2),
        "frozen": None,
    }
    new = jse.apply_updates(model, upd)
    np.testing.assert_array_equal(new["emb"].weight[1], [2.0, 2.0])  # duplicates sum
    assert float(jnp.abs(new["emb"].weight).sum()) == 4.0  # padding (4) dropped
    np.testing.assert_array_equal(new["b"], [2.0, 2.0])
    assert new["frozen"] is model["frozen"]
    assert jse.apply_updates(model, None) is model


def test_apply_updates_checks_the_shape():
    emb = jse.Embedding(weight=jnp.zeros((4, 2)))
    bad = js.IndexedSlices(jnp.ones((1, 2)), jnp.array([0]), (5, 2))
    with pytest.raises(ValueError, match=r"shape \(4, 2\).*\(5, 2\)"):
        jse.apply_updates(emb, eqx.tree_at(lambda m: m.weight, emb, bad))


@pytest.mark.parametrize(
    "sparse_tx,dense_tx",
    [(js.sgd(0.3), optax.sgd(0.3)), (js.adagrad(0.5), optax.adagrad(0.5))],
    ids=["sgd", "adagrad"],
)
def test_jitted_training_equals_the_stock_layer_with_optax(sparse_tx, dense_tx):
    mine, stock = _pair()
    s1 = sparse_tx.init(eqx.filter(mine, eqx.is_inexact_array))
    s2 = dense_tx.init(eqx.filter(stock, eqx.is_inexact_array))

    @eqx.filter_jit(donate="all-except-first")
    def step_mine(batch, model, state):
        loss, grads = jse.filter_value_and_grad(flat_loss)(model, *batch)
        assert isinstance(grads.item.weight, js.IndexedSlices)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = sparse_tx.update(grads, state, params)
        return jse.apply_updates(model, updates), state, loss

    @eqx.filter_jit
    def step_stock(model, state, *batch):
        loss, grads = eqx.filter_value_and_grad(flat_loss)(model, *batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = dense_tx.update(grads, state, params)
        return eqx.apply_updates(model, updates), state, loss

    for k in range(4):
        mine, s1, l1 = step_mine(_batch(k), mine, s1)
        stock, s2, l2 = step_stock(stock, s2, *_batch(k))
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
    _assert_trees_close(
        eqx.filter(mine, eqx.is_inexact_array),
        eqx.filter(stock, eqx.is_inexact_array),
        rtol=1e-5,
        atol=1e-6,
    )


# ------------------------------------------------- optimizers per parameter group


def test_multi_transform_refuses_a_module_shaped_label_tree():
    class Model(eqx.Module):
        emb: jse.Embedding
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.emb = jse.Embedding(20, 3, key=k1)
            self.out = eqx.nn.Linear(3, 1, key=k2)

        def __call__(self, ids):
            return self.out(jax.vmap(self.emb)(ids).mean(0))

    model = Model(jax.random.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    wrong = jax.tree.map(lambda _: "rest", params)  # a Model again: callable
    assert isinstance(wrong, eqx.Module) and callable(wrong)
    txs = {"tables": js.adagrad(0.1), "rest": optax.adam(1e-3)}
    with pytest.raises(
        TypeError, match=r"`param_labels` is an Equinox module \(Model\)"
    ):
        jse.multi_transform(txs, wrong)
    # What stock Optax does with it: calls it, i.e. runs Model.__call__ on params.
    with pytest.raises(Exception) as stock:
        optax.multi_transform(txs, wrong).init(params)
    assert "param_labels" not in str(stock.value)  # an error from inside the model
    with pytest.raises(TypeError, match="labels that `param_labels` returned hold"):
        jse.multi_transform(txs, lambda p: jax.tree.map(lambda _: print, p)).init(
            params
        )

    labels = jse.param_labels(model)
    tree = labels(params)
    assert tree.emb.weight == "tables" and tree.out.weight == tree.out.bias == "rest"
    custom = jse.param_labels(model, lambda x: "tables" if x is model.emb else "head")
    assert custom(params).out.weight == "head"
    tx = jse.multi_transform(txs, labels)
    state = tx.init(params)
    ids = jnp.array([[1, 1, 4]])
    grads = jse.filter_grad(lambda m: jnp.sum(jax.vmap(m)(ids) ** 2), strict=True)(
        model
    )
    updates, _ = tx.update(grads, state, params)
    assert isinstance(updates.emb.weight, js.IndexedSlices)  # adagrad: still sparse
    assert isinstance(updates.out.weight, jax.Array)
