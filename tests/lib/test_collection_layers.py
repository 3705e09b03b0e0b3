"""The collection's NNX, Linen and Equinox modules: the functional collection's
numbers, one IndexedSlices per buffer, and a training step of each framework's
own idiom equal to the functional step (per-table learning rates included)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxslices as js
import jaxslices.equinox
import jaxslices.linen
import jaxslices.nnx

TABLES = (
    js.TableConfig("user", rows=7, dim=3),
    js.TableConfig("item", rows=5, dim=3, features=("item", "seen"), combiner="mean"),
    js.TableConfig("tag", rows=4, dim=2),
)
COLL = js.EmbeddingCollection(TABLES)
KJT = js.KeyedJaggedIds.from_lists(
    {
        "user": [[1], [6]],
        "item": [[2], [0]],
        "seen": [[2, 2, 4], []],
        "tag": [[3], [1, 0]],
    }
)


def _tx():
    return optax.chain(js.rowwise_adagrad(0.3), COLL.scale_by_table({"item": 0.5}))


def _loss(params, kjt=KJT):
    return jnp.sum(jnp.tanh(COLL.concat(params, kjt)) ** 2)


def _functional_step(params):
    tx = _tx()
    g = js.grad(_loss)(params)
    u, _ = tx.update(g, tx.init(params), params)
    return js.apply_updates(params, u)


def _check(params, new_params):
    want = _functional_step(params)
    for k in want:
        np.testing.assert_allclose(new_params[k], want[k], rtol=1e-6, atol=1e-7)
        assert not np.allclose(new_params[k], params[k])  # the step moved it


def test_nnx_module_trains_with_nnx_optimizer():
    layer = jaxslices.nnx.EmbeddingCollection(TABLES, rngs=nnx.Rngs(0))
    before = layer.params()
    np.testing.assert_array_equal(layer.concat(KJT), COLL.concat(before, KJT))
    out = layer(KJT)
    assert list(out) == list(COLL.features)
    opt = nnx.Optimizer(layer, _tx(), wrt=nnx.Param)

    @nnx.jit
    def step(layer, opt, kjt):
        loss_fn = lambda m: jnp.sum(jnp.tanh(m.concat(kjt)) ** 2)  # noqa: E731
        loss, grads = jaxslices.nnx.value_and_grad(loss_fn)(layer)
        assert isinstance(
            grads["buffers"]["dim3_float32"].get_value(), js.IndexedSlices
        )
        opt.update(layer, grads)
        return loss

    step(layer, opt, KJT)
    _check(before, layer.params())


def test_linen_module_trains_with_value_and_grad():
    model = jaxslices.linen.EmbeddingCollection(TABLES)
    params = model.init(jax.random.key(0), KJT)["params"]
    assert {k: v.shape for k, v in params.items()} == COLL.shapes
    out = model.apply({"params": params}, KJT)
    np.testing.assert_array_equal(out["seen"], COLL(params, KJT)["seen"])
    tx = _tx()

    @jax.jit
    def step(params):
        loss_fn = lambda p: jnp.sum(  # noqa: E731
            jnp.tanh(model.apply({"params": p}, KJT, concat=True)) ** 2
        )
        g = js.grad(loss_fn)(params)
        assert all(isinstance(x, js.IndexedSlices) for x in g.values())
        u, _ = tx.update(g, tx.init(params), params)
        return js.apply_updates(params, u)

    _check(params, step(params))


def test_equinox_module_trains_with_filter_grad():
    layer = jaxslices.equinox.EmbeddingCollection(TABLES, key=jax.random.key(0))
    np.testing.assert_array_equal(layer(KJT)["tag"], COLL(layer.buffers, KJT)["tag"])
    tx = _tx()

    @eqx.filter_jit
    def step(layer):
        loss_fn = lambda m: jnp.sum(jnp.tanh(m.concat(KJT)) ** 2)  # noqa: E731
        g = jaxslices.equinox.filter_grad(loss_fn)(layer)
        assert isinstance(g.buffers["dim2_float32"], js.IndexedSlices)
        u, _ = tx.update(g, tx.init(eqx.filter(layer, eqx.is_array)), layer)
        return jaxslices.equinox.apply_updates(layer, u)

    _check(layer.buffers, step(layer).buffers)
