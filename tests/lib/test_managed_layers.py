"""The managed-collision layers of NNX, Linen and Equinox.

Each trains a few steps (remap, evicted rows reset, sparse gradient, jaxslices
Adagrad) to the numbers of the same loop written densely (``nnx.value_and_grad``
/ ``jax.grad`` / ``eqx.filter_grad`` and stock ``optax.adagrad``), with the
remap state kept in the framework's own way (an NNX ``Remap`` variable, a Linen
variable collection, an Equinox field); the NNX model and optimizer are saved
mid-run with Orbax (their ``nnx.state``) and the Equinox model with
``eqx.tree_serialise_leaves``, and both resume bit for bit. ``import jaxslices``
imports neither framework (``tests/lib/test_nnx.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxslices as js

S, D, B, L, STEPS = 10, 3, 4, 3, 5


def _manager():
    return js.ManagedCollision(
        "items", num_slots=S, policy="lru", evict_every=2, evict_count=4
    )


def _stream(steps=STEPS, seed=0):
    """64-bit raw ids, a pool drifting by 4 ids a step (evictions, defaults)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        ids = rng.integers(0, 12, size=(B, L)) + 4 * t + 2**40
        y = jnp.asarray(rng.normal(size=(B,)), jnp.float32)
        out.append((js.RawIds.from_int64(ids), y))
    return out


def _fresh(t):
    return 0.1 * jax.random.normal(jax.random.fold_in(jax.random.key(3), t), (4, D))


def _check_remapped(states):
    stats = {k: int(v) for k, v in states.stats().items()}
    assert stats["evictions"] > 0 and stats["defaulted"] > 0, stats


# ------------------------------------------------------------------ Linen


def test_linen_layer_trains_like_the_dense_loop():
    nn = pytest.importorskip("flax.linen")
    import jaxslices.linen as jsl

    class Model(nn.Module):
        @nn.compact
        def __call__(self, rows):
            return nn.Dense(1)(jsl.ManagedEmbedBag(_manager(), D, name="items")(rows))

    model = Model()
    raw0 = _stream()[0][0]
    rows0 = jnp.zeros((B, L), jnp.int32)
    variables = model.init(jax.random.key(0), rows0)
    remap_vars = jsl.ManagedEmbedBag(_manager(), D).init(
        jax.random.key(0), raw0, method="remap"
    )["remap"]

    def make_step(tx, grad_fn):
        def remap(remap_vars, raw):
            layer = jsl.ManagedEmbedBag(_manager(), D)
            table = jnp.zeros((S, D))  # remap reads the state only
            variables = {"params": {"embedding": table}, "remap": remap_vars}
            (rows, evicted), new = layer.apply(
                variables, raw, method="remap", mutable=["remap"]
            )
            return rows, evicted, new["remap"]

        def loss(params, rows, y):
            out = model.apply({"params": params}, rows)[:, 0]
            return jnp.mean((out - y) ** 2)

        @jax.jit
        def step(params, opt_state, remap_vars, raw, y, t):
            rows, evicted, remap_vars = remap(remap_vars, raw)
            params, opt_state = js.reset_rows(
                params, opt_state, evicted, _fresh(t),
                where=lambda p: p["items"]["embedding"], optimizer=tx,
            )  # fmt: skip
            value, grads = grad_fn(loss)(params, rows, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return js.apply_updates(params, updates), opt_state, remap_vars, value

        return step

    sparse = make_step(js.adagrad(0.2), js.value_and_grad)
    dense = make_step(optax.adagrad(0.2), jax.value_and_grad)
    p1 = p2 = variables["params"]
    s1, s2 = js.adagrad(0.2).init(p1), optax.adagrad(0.2).init(p2)
    r1 = r2 = remap_vars
    for t, (raw, y) in enumerate(_stream()):
        p1, s1, r1, l1 = sparse(p1, s1, r1, raw, y, t)
        p2, s2, r2, l2 = dense(p2, s2, r2, raw, y, t)
        np.testing.assert_allclose(l1, l2, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(r1), jax.tree.leaves(r2), strict=True):
        np.testing.assert_array_equal(a, b)
    _check_remapped(r1["state"])
    # the sparse gradient: one IndexedSlices for the table
    g = js.grad(lambda p: jnp.sum(model.apply({"params": p}, rows0)))(p1)
    assert isinstance(g["items"]["embedding"], js.IndexedSlices)


def test_linen_layer_bad_input():
    pytest.importorskip("flax.linen")
    import jaxslices.linen as jsl

    layer = jsl.ManagedEmbedBag(_manager(), D)
    raw = jnp.array([[1, 2]])
    variables = layer.init(jax.random.key(0), raw, method="remap")
    assert int(variables["remap"]["state"].step) == 0  # init does not remap
    with pytest.raises(ValueError, match=r"mutable=\['remap'\]"):
        layer.apply(variables, raw, method="remap")
    with pytest.raises(ValueError, match=r"needs the remap state"):
        layer.apply({"params": variables["params"]}, raw, method="remap")
    with pytest.raises(TypeError, match=r"must be a jaxslices.ManagedCollision"):
        jsl.ManagedEmbedBag("items", D).init(jax.random.key(0), raw)
    with pytest.raises(ValueError, match=r"`combiner` must be"):
        jsl.ManagedEmbedBag(_manager(), D, combiner="max").init(jax.random.key(0), raw)


# ---------------------------------------------------------------- Equinox


@functools.lru_cache
def _eqx_model_class():
    """One model class (a resumed model's state must be of the same class)."""
    import equinox as eqx

    import jaxslices.equinox as jse

    class Model(eqx.Module):
        items: jse.ManagedEmbeddingBag
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.items = jse.ManagedEmbeddingBag(_manager(), D, key=k1)
            self.head = eqx.nn.Linear(D, "scalar", key=k2)

        def __call__(self, rows):
            return jax.vmap(self.head)(self.items(rows))

    return Model


def _eqx_model(eqx, jse):
    return _eqx_model_class()(jax.random.key(0))


def _eqx_step(eqx, jse, tx, value_and_grad, apply_updates):
    def loss(model, rows, y):
        return jnp.mean((model(rows) - y) ** 2)

    @eqx.filter_jit
    def step(model, opt_state, raw, y, t):
        items, rows, evicted = model.items.remap(raw)
        model = eqx.tree_at(lambda m: m.items, model, items)
        model, opt_state = jse.reset_rows(
            model, opt_state, evicted, _fresh(t),
            where=lambda m: m.items.weight, optimizer=tx,
        )  # fmt: skip
        value, grads = value_and_grad(loss)(model, rows, y)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = tx.update(grads, opt_state, params)
        return apply_updates(model, updates), opt_state, value

    return step


def test_equinox_layer_trains_like_the_dense_loop_and_resumes(tmp_path):
    eqx = pytest.importorskip("equinox")
    import jaxslices.equinox as jse

    sparse_tx, dense_tx = js.adagrad(0.2), optax.adagrad(0.2)
    sparse = _eqx_step(eqx, jse, sparse_tx, jse.filter_value_and_grad,
                       jse.apply_updates)  # fmt: skip
    dense = _eqx_step(eqx, jse, dense_tx, eqx.filter_value_and_grad,
                      eqx.apply_updates)  # fmt: skip
    m1 = m2 = _eqx_model(eqx, jse)
    s1 = sparse_tx.init(eqx.filter(m1, eqx.is_inexact_array))
    s2 = dense_tx.init(eqx.filter(m2, eqx.is_inexact_array))
    batches = _stream()
    saved = None
    for t, (raw, y) in enumerate(batches):
        if t == 2:
            saved = tmp_path / "model.eqx"
            eqx.tree_serialise_leaves(saved, (m1, s1))
        m1, s1, l1 = sparse(m1, s1, raw, y, t)
        m2, s2, l2 = dense(m2, s2, raw, y, t)
        np.testing.assert_allclose(l1, l2, rtol=1e-6)
        np.testing.assert_allclose(m1.items.weight, m2.items.weight, rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
        np.testing.assert_allclose(m1.head.weight, m2.head.weight, rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
    for a, b in zip(
        jax.tree.leaves(m1.items.remap_state),
        jax.tree.leaves(m2.items.remap_state),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    _check_remapped(m1.items.remap_state)
    # resume from step 2: bit for bit the uninterrupted run
    fresh = _eqx_model(eqx, jse)
    like = (fresh, sparse_tx.init(eqx.filter(fresh, eqx.is_inexact_array)))
    m, s = eqx.tree_deserialise_leaves(saved, like)
    assert int(m.items.remap_state.step) == 2
    for t in range(2, STEPS):
        m, s, _ = sparse(m, s, *batches[t], t)
    for a, b in zip(jax.tree.leaves((m, s)), jax.tree.leaves((m1, s1)), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_equinox_layer_bad_input_and_labels():
    eqx = pytest.importorskip("equinox")
    import jaxslices.equinox as jse

    with pytest.raises(TypeError, match=r"must be a jaxslices.ManagedCollision"):
        jse.ManagedEmbeddingBag("items", D, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"`weight` must have num_slots=10 rows"):
        jse.ManagedEmbeddingBag(_manager(), weight=jnp.zeros((4, D)))
    with pytest.raises(ValueError, match=r"`combiner` must be"):
        jse.ManagedEmbeddingBag(_manager(), D, combiner="max", key=jax.random.key(0))
    layer = jse.ManagedEmbeddingBag(_manager(), D, key=jax.random.key(0))
    # the remap state is not trained: only the table is an inexact array
    params = eqx.filter(layer, eqx.is_inexact_array)
    assert [x.shape for x in jax.tree.leaves(params)] == [(S, D)]
    assert jse.param_labels(layer)(params).weight == "tables"


# -------------------------------------------------------------------- NNX


def _nnx_model(nnx, jsnnx):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.items = jsnnx.ManagedEmbedBag(_manager(), D, rngs=rngs)
            self.head = nnx.Linear(D, 1, rngs=rngs)

        def __call__(self, rows):
            return self.head(self.items(rows))[:, 0]

    return Model(nnx.Rngs(0))


def _nnx_step(nnx, jsnnx, value_and_grad):
    def loss(model, rows, y):
        return jnp.mean((model(rows) - y) ** 2)

    @nnx.jit
    def step(model, optimizer, raw, y, t):
        rows, evicted = model.items.remap(raw)
        jsnnx.reset_rows(
            model, optimizer, evicted, _fresh(t), where=lambda m: m.items.embedding
        )
        value, grads = value_and_grad(loss)(model, rows, y)
        optimizer.update(model, grads)
        return value

    return step


def test_nnx_layer_trains_like_the_dense_loop_and_resumes(tmp_path):
    nnx = pytest.importorskip("flax.nnx")
    ocp = pytest.importorskip("orbax.checkpoint")
    import jaxslices.nnx as jsnnx

    sparse = _nnx_step(nnx, jsnnx, jsnnx.value_and_grad)
    dense = _nnx_step(nnx, jsnnx, nnx.value_and_grad)
    m1, m2 = _nnx_model(nnx, jsnnx), _nnx_model(nnx, jsnnx)
    o1 = nnx.Optimizer(m1, js.adagrad(0.2), wrt=nnx.Param)
    o2 = nnx.Optimizer(m2, optax.adagrad(0.2), wrt=nnx.Param)
    # the remap state is not trained: the optimizer holds the params' state only
    assert jsnnx.Remap not in {
        type(v)
        for v in jax.tree.leaves(
            nnx.state(m1, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
    }
    batches = _stream()
    ckptr = ocp.StandardCheckpointer()
    for t, (raw, y) in enumerate(batches):
        if t == 2:
            ckptr.save(tmp_path / "ckpt", (nnx.state(m1), nnx.state(o1)))
            ckptr.wait_until_finished()
        l1, l2 = sparse(m1, o1, raw, y, t), dense(m2, o2, raw, y, t)
        np.testing.assert_allclose(l1, l2, rtol=1e-6)
        for a, b in zip(
            jax.tree.leaves(nnx.state(m1, nnx.Param)),
            jax.tree.leaves(nnx.state(m2, nnx.Param)),
            strict=True,
        ):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    r1, r2 = m1.items.remap_state.get_value(), m2.items.remap_state.get_value()
    for a, b in zip(jax.tree.leaves(r1), jax.tree.leaves(r2), strict=True):
        np.testing.assert_array_equal(a, b)
    _check_remapped(r1)
    # the table's gradient is sparse, in a Param of the NNX gradient state
    g = jsnnx.grad(lambda m: jnp.sum(m(jnp.zeros((B, L), jnp.int32))))(m1)
    assert isinstance(g["items"]["embedding"].get_value(), js.IndexedSlices)
    # resume from step 2 (Orbax, the nnx.state of model and optimizer): bit for bit
    m = _nnx_model(nnx, jsnnx)
    o = nnx.Optimizer(m, js.adagrad(0.2), wrt=nnx.Param)
    model_state, opt_state = ckptr.restore(
        tmp_path / "ckpt", jax.eval_shape(lambda: (nnx.state(m), nnx.state(o)))
    )
    ckptr.close()
    nnx.update(m, model_state)
    nnx.update(o, opt_state)
    assert int(m.items.remap_state.get_value().step) == 2
    for t in range(2, STEPS):
        sparse(m, o, *batches[t], t)
    for a, b in zip(
        jax.tree.leaves((nnx.state(m), nnx.state(o))),
        jax.tree.leaves((nnx.state(m1), nnx.state(o1))),
        strict=True,
    ):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_nnx_layer_bad_input():
    nnx = pytest.importorskip("flax.nnx")
    import jaxslices.nnx as jsnnx

    rngs = nnx.Rngs(0)
    with pytest.raises(TypeError, match=r"must be a jaxslices.ManagedCollision"):
        jsnnx.ManagedEmbedBag("items", D, rngs=rngs)
    with pytest.raises(ValueError, match=r"`combiner` must be"):
        jsnnx.ManagedEmbedBag(_manager(), D, combiner="max", rngs=rngs)
    layer = jsnnx.ManagedEmbedBag(_manager(), D, rngs=rngs)
    with pytest.raises(ValueError, match=r"must return one parameter of `model`"):
        jsnnx.reset_rows(layer, None, jnp.array([1]), 0.0,
                         where=lambda m: m.embedding[...])  # fmt: skip
    with pytest.raises(ValueError, match=r"must return one parameter of `model`"):
        jsnnx.reset_rows(layer, None, jnp.array([1]), 0.0,
                         where=lambda m: m.remap_state)  # fmt: skip
    # a state of another table is refused by the remap
    layer.remap_state.set_value(js.ManagedCollision("other", num_slots=S).init())
    with pytest.raises(ValueError, match=r"other"):
        layer.remap(jnp.array([[1, 2]]))
