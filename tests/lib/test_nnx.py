"""jaxslices.nnx: Embed is flax.nnx.Embed with sparse gradients; NNX training works."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tol
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxslices as js

nnx = pytest.importorskip("flax.nnx")
jnnx = pytest.importorskip("jaxslices.nnx")


class Model(nnx.Module):
    """Two tables (one bagged), a counter mutated by every call, a dense head."""

    def __init__(self, embed_cls, rngs, num_users=13, num_items=17, dim=4, **kw):
        self.user = embed_cls(num_users, dim, rngs=rngs, **kw)
        self.item = embed_cls(num_items, dim, rngs=rngs, **kw)
        self.head = nnx.Linear(dim, 1, rngs=rngs)
        self.calls = nnx.Variable(jnp.array(0))

    def __call__(self, users, items):
        self.calls[...] += 1
        u = self.user(users)  # (B, D)
        q = jnp.mean(self.item(items), axis=1)  # (B, L, D) -> (B, D)
        return self.head(u * q)[:, 0].astype(jnp.float32)


def loss_fn(model, users, items, y):
    return jnp.mean((model(users, items) - y) ** 2)


def _batch(seed=0, batch=6, length=3, num_users=13, num_items=17):
    rng = np.random.default_rng(seed)
    users = rng.integers(0, num_users // 3, batch).astype(np.int32)  # repeats
    items = rng.integers(0, num_items, (batch, length)).astype(np.int32)
    items[0, 1] = -2  # counts from the end, as in the stock layer
    y = rng.normal(size=batch).astype(np.float32)
    return jnp.asarray(users), jnp.asarray(items), jnp.asarray(y)


def _pair(**kw):
    return Model(jnnx.Embed, nnx.Rngs(0), **kw), Model(nnx.Embed, nnx.Rngs(0), **kw)


def _assert_state_close(sparse_state, dense_state, **tol):
    dense = js.to_dense(sparse_state)
    assert jax.tree.structure(dense) == jax.tree.structure(dense_state)
    for a, b in zip(jax.tree.leaves(dense), jax.tree.leaves(dense_state), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)


# ------------------------------------------------------------------ the layer


def test_embed_is_the_stock_layer_with_the_same_state_and_outputs():
    mine = jnnx.Embed(11, 3, rngs=nnx.Rngs(5))
    stock = nnx.Embed(11, 3, rngs=nnx.Rngs(5))
    assert isinstance(mine, nnx.Embed)
    assert (mine.num_embeddings, mine.features, mine.dtype, mine.param_dtype) == (
        11,
        3,
        stock.dtype,
        stock.param_dtype,
    )
    _assert_state_close(nnx.state(mine), nnx.state(stock), rtol=0, atol=0)
    ids = jnp.array([[0, 10, -1], [-11, 4, 4]])
    np.testing.assert_array_equal(mine(ids), stock(ids))
    q = jnp.ones((2, 3))
    np.testing.assert_array_equal(mine.attend(q), stock.attend(q))


@pytest.mark.parametrize(
    "dtype,param_dtype",
    [(None, jnp.float32), (jnp.bfloat16, jnp.float32), (None, jnp.bfloat16)],
)
def test_dtypes_follow_the_stock_layer_and_the_gradient_stays_sparse(
    dtype, param_dtype
):
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    mine = jnnx.Embed(9, 4, rngs=nnx.Rngs(0), **kw)
    stock = nnx.Embed(9, 4, rngs=nnx.Rngs(0), **kw)
    ids = jnp.array([[1, 8, 1]])
    assert mine(ids).dtype == stock(ids).dtype
    np.testing.assert_array_equal(mine(ids), stock(ids))

    def loss(m):
        return jnp.sum(m(ids).astype(jnp.float32) ** 2)

    g = jnnx.grad(loss)(mine)["embedding"].get_value()
    assert isinstance(g, js.IndexedSlices) and g.dtype == jnp.dtype(param_dtype)
    want = nnx.grad(loss)(stock)["embedding"][...]
    np.testing.assert_allclose(
        np.asarray(g.to_dense(), np.float32),
        np.asarray(want, np.float32),
        **tol(dtype or param_dtype),
    )


@settings(max_examples=4)  # each example traces both layers eagerly (slow)
@given(
    num=st.integers(2, 9),
    features=st.integers(1, 3),
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_random_ids_give_the_stock_layers_output_and_gradient(
    num, features, shape, seed
):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(-num, num, shape).astype(np.int32))  # repeats
    mine = jnnx.Embed(num, features, rngs=nnx.Rngs(seed))
    stock = nnx.Embed(num, features, rngs=nnx.Rngs(seed))
    np.testing.assert_array_equal(mine(ids), stock(ids))
    w = jnp.asarray(rng.normal(size=(*shape, features)).astype(np.float32))

    def loss(m):
        return jnp.sum(m(ids) * w)

    g = jnnx.grad(loss)(mine)["embedding"].get_value()
    assert isinstance(g, js.IndexedSlices) and g.values.shape[0] == ids.size
    want = nnx.grad(loss)(stock)["embedding"][...]
    np.testing.assert_allclose(g.to_dense(), want, rtol=1e-5, atol=1e-6)


def test_out_of_range_ids_read_zeros_and_get_no_gradient():
    layer = jnnx.Embed(5, 2, rngs=nnx.Rngs(0))
    out = layer(jnp.array([5, 7, -6, 2]))
    np.testing.assert_array_equal(out[:3], 0.0)
    g = jnnx.grad(lambda m: m(jnp.array([5, -6, 2])).sum())(layer)
    s = g["embedding"].get_value()
    np.testing.assert_array_equal(s.indices, [5, 5, 2])  # 5 = padding
    np.testing.assert_array_equal(s.to_dense()[2], [1.0, 1.0])
    assert float(jnp.abs(s.to_dense()).sum()) == 2.0


def test_one_row_table_broadcasts_like_the_stock_layer():
    mine = jnnx.Embed(1, 3, rngs=nnx.Rngs(0))
    stock = nnx.Embed(1, 3, rngs=nnx.Rngs(0))
    ids = jnp.array([[0, 0], [0, 0]])
    np.testing.assert_array_equal(mine(ids), stock(ids))
    g = jnnx.grad(lambda m: m(ids).sum())(mine)["embedding"].get_value()
    np.testing.assert_array_equal(g.to_dense(), [[4.0, 4.0, 4.0]])


def test_out_sharding_under_explicit_sharding_matches_the_stock_layer():
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    n = min(4, len(jax.devices()))
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        mine = jnnx.Embed(16, 4, rngs=nnx.Rngs(0))
        stock = nnx.Embed(16, 4, rngs=nnx.Rngs(0))
        ids = jax.device_put(jnp.arange(2 * n) % 5, P("data"))
        out = mine(ids, out_sharding=P("data"))
        assert out.sharding.spec == stock(ids, out_sharding=P("data")).sharding.spec
        np.testing.assert_array_equal(out, stock(ids, out_sharding=P("data")))

        def loss(m):
            return jnp.sum(m(ids, out_sharding=P("data")) ** 2)

        # Under auto_axes the gradient is the stock layer's dense one.
        g1 = jnnx.grad(loss)(mine)["embedding"][...]
        np.testing.assert_allclose(g1, nnx.grad(loss)(stock)["embedding"][...])


def test_float_ids_raise_a_clear_error():
    layer = jnnx.Embed(5, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"jaxslices.nnx.Embed.*integers.*float32"):
        layer(jnp.array([1.0, 2.0]))


# ------------------------------------------------------------------ gradients


def test_grads_are_sparse_and_equal_to_the_stock_layers_dense_grads():
    mine, stock = _pair()
    users, items, y = _batch()
    v1, g1 = jnnx.value_and_grad(loss_fn)(mine, users, items, y)
    v2, g2 = nnx.value_and_grad(loss_fn)(stock, users, items, y)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    for table, n in (("user", 6), ("item", 18)):
        s = g1[table]["embedding"].get_value()
        assert isinstance(s, js.IndexedSlices) and s.values.shape[0] == n
    assert isinstance(g1.head.kernel[...], jax.Array)  # attribute access, dense
    _assert_state_close(g1, g2, rtol=1e-6, atol=1e-7)


def test_diffstate_filter_tuple_argnums_has_aux_and_plain_pytrees():
    mine, stock = _pair()
    users, items, y = _batch(1)
    only_user = nnx.PathContains("user")

    def loss(model, scale, users, items, y):
        pred = model(users, items) * scale["s"]
        return jnp.mean((pred - y) ** 2), pred

    args = (users, items, y)
    scale = {"s": jnp.float32(1.5)}
    argnums = (nnx.DiffState(0, only_user), 1)
    (v1, aux1), (gm1, gs1) = jnnx.value_and_grad(loss, argnums, has_aux=True)(
        mine, scale, *args
    )
    (v2, aux2), (gm2, gs2) = nnx.value_and_grad(loss, argnums=argnums, has_aux=True)(
        stock, scale, *args
    )
    np.testing.assert_allclose(aux1, aux2, rtol=1e-6)
    assert set(gm1.keys()) == {"user"}
    assert isinstance(gm1["user"]["embedding"].get_value(), js.IndexedSlices)
    _assert_state_close(gm1, gm2, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(gs1["s"], gs2["s"], rtol=1e-5)
    g, aux = jnnx.grad(loss, 1, has_aux=True)(mine, scale, *args)
    assert set(g) == {"s"} and aux.shape == y.shape
    g2, _ = jnnx.grad(loss, np.int64(-4), has_aux=True)(mine, scale, *args)  # = 1
    np.testing.assert_array_equal(g2["s"], g["s"])


def test_keyword_arguments_are_bound_like_positional_ones():
    mine, _ = _pair()
    users, items, y = _batch(2)
    v1, g1 = jnnx.value_and_grad(loss_fn)(mine, users, items=items, y=y)
    v2, g2 = jnnx.value_and_grad(loss_fn)(mine, users, items, y)
    np.testing.assert_allclose(v1, v2)
    _assert_state_close(g1, js.to_dense(g2), rtol=0, atol=0)


def test_state_changes_are_written_back_once_per_call():
    mine, _ = _pair()
    users, items, y = _batch()
    jnnx.value_and_grad(loss_fn)(mine, users, items, y)
    assert int(mine.calls[...]) == 1  # the loss is traced 3 times, applied once
    nnx.jit(lambda m: jnnx.grad(loss_fn)(m, users, items, y))(mine)
    assert int(mine.calls[...]) == 2


def test_tied_weights_through_attend_get_the_dense_gradient():
    class Tied(nnx.Module):
        def __init__(self, embed_cls):
            self.emb = embed_cls(7, 3, rngs=nnx.Rngs(0))

        def __call__(self, ids):
            return jax.nn.log_softmax(self.emb.attend(self.emb(ids)))[:, 0].sum()

    ids = jnp.array([1, 1, 5])
    g1 = jnnx.grad(lambda m: m(ids))(Tied(jnnx.Embed))
    g2 = nnx.grad(lambda m: m(ids))(Tied(nnx.Embed))
    assert isinstance(g1["emb"]["embedding"][...], jax.Array)
    _assert_state_close(g1, g2, rtol=1e-6, atol=1e-7)


def test_reading_a_sparse_gradient():
    mine, _ = _pair()
    grads = jnnx.grad(loss_fn)(mine, *_batch())
    param = grads["user"]["embedding"]
    assert isinstance(param, nnx.Param)  # nnx filters see a Param
    s = param.get_value()
    assert isinstance(s, js.IndexedSlices) and s.dense_shape == (13, 4)
    np.testing.assert_array_equal(s.indices, grads.user.embedding.get_value().indices)
    with pytest.raises(TypeError):
        param[...]  # `[...]` is for array variables; use get_value()
    dense = js.to_dense(grads)["user"]["embedding"][...]
    assert dense.shape == (13, 4)
    filtered = nnx.state(grads, nnx.Param)
    assert isinstance(filtered["user"]["embedding"].get_value(), js.IndexedSlices)


def test_argnums_errors():
    mine, _ = _pair()
    with pytest.raises(ValueError, match="repeated"):
        jnnx.grad(loss_fn, (0, 0))
    with pytest.raises(TypeError, match="nnx.DiffState"):
        jnnx.grad(loss_fn, "model")
    with pytest.raises(ValueError, match="argnum 5 is out of range"):
        jnnx.grad(loss_fn, 5)(mine, *_batch())
    with pytest.raises(ValueError, match="same argument twice"):
        jnnx.grad(loss_fn, (3, -1))(mine, *_batch())


# -------------------------------------------------------------- training loop


@pytest.mark.parametrize("path", ["xla", "native"])
@pytest.mark.parametrize(
    "sparse_tx,dense_tx,exact",
    [
        (js.sgd(0.3), optax.sgd(0.3), False),
        (js.adagrad(0.5), optax.adagrad(0.5), True),
    ],
    ids=["sgd", "adagrad"],
)
def test_jitted_training_equals_the_stock_layer_with_optax(
    sparse_tx, dense_tx, exact, path
):
    """docs/frameworks.md: adagrad bit for bit (XLA path), sgd up to the last bits.

    The native kernels sum a row's duplicate ids in another order: there,
    both agree to float32 rounding.
    """
    exact = exact and path == "xla"
    if path == "xla":
        with js.kernels.disabled():
            _train_pair(sparse_tx, dense_tx, exact)
    else:
        _train_pair(sparse_tx, dense_tx, exact)


def _train_pair(sparse_tx, dense_tx, exact):
    mine, stock = _pair()
    opt_mine = nnx.Optimizer(mine, sparse_tx, wrt=nnx.Param)
    opt_stock = nnx.Optimizer(stock, dense_tx, wrt=nnx.Param)

    @nnx.jit(donate_argnums=(0, 1))  # in place, as docs/frameworks.md advises
    def step_mine(model, opt, users, items, y):
        loss, grads = jnnx.value_and_grad(loss_fn)(model, users, items, y)
        assert isinstance(grads["item"]["embedding"].get_value(), js.IndexedSlices)
        opt.update(model, grads)
        return loss

    @nnx.jit
    def step_stock(model, opt, users, items, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, users, items, y)
        opt.update(model, grads)
        return loss

    for k in range(4):
        batch = _batch(k)
        l1 = step_mine(mine, opt_mine, *batch)
        l2 = step_stock(stock, opt_stock, *batch)
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    _assert_state_close(nnx.state(mine, nnx.Param), nnx.state(stock, nnx.Param), **tol)
    assert int(mine.calls[...]) == int(stock.calls[...]) == 4


def test_lazy_adam_moves_only_the_touched_rows():
    mine, _ = _pair()
    before = np.asarray(mine.item.embedding[...])
    opt = nnx.Optimizer(mine, js.lazy_adam(0.1), wrt=nnx.Param)
    users, items, y = _batch()
    grads = nnx.jit(lambda m: jnnx.grad(loss_fn)(m, users, items, y))(mine)
    opt.update(mine, grads)
    after = np.asarray(mine.item.embedding[...])
    touched = np.unique(np.asarray(items) % 17)
    untouched = np.setdiff1d(np.arange(17), touched)
    np.testing.assert_array_equal(after[untouched], before[untouched])
    assert np.all(np.abs(after[touched] - before[touched]).max(axis=1) > 0)


def test_multisteps_in_nnx_optimizer_equals_optax_multisteps():
    """jaxslices.MultiSteps inside nnx.Optimizer, past its second update.

    nnx.Optimizer writes the state back with nnx.update, which unpacks the
    IndexedSlices buffer into an nnx.State: MultiSteps reads it back (it
    raised "capacity gives this leaf no buffer" on the second update). The
    capacity is a plain dict although the params are an nnx.State.
    """
    mine, stock = _pair()
    capacity = {"user": {"embedding": 12}, "item": {"embedding": 36}, "head": None}
    tx = js.MultiSteps(js.sgd(0.3), every_k_schedule=2, capacity=capacity)
    opt_mine = nnx.Optimizer(mine, tx, wrt=nnx.Param)
    opt_stock = nnx.Optimizer(stock, optax.MultiSteps(optax.sgd(0.3), 2), wrt=nnx.Param)

    @nnx.jit
    def step_mine(model, opt, users, items, y):
        opt.update(model, jnnx.grad(loss_fn)(model, users, items, y))

    @nnx.jit
    def step_stock(model, opt, users, items, y):
        opt.update(model, nnx.grad(loss_fn)(model, users, items, y))

    for k in range(5):
        step_mine(mine, opt_mine, *_batch(k))
        step_stock(stock, opt_stock, *_batch(k))
    buffer = opt_mine.opt_state.acc_grads["item"]["embedding"].get_value()
    assert js.is_indexed_slices(buffer) or "indices" in buffer  # packed or not
    _assert_state_close(
        nnx.state(mine, nnx.Param), nnx.state(stock, nnx.Param), rtol=1e-5, atol=1e-6
    )
    assert int(opt_mine.opt_state.gradient_step.get_value()) == 2


# ------------------------------------------------------------------ packaging


def test_import_jaxslices_imports_no_framework():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    code = (
        "import sys, jaxslices\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('flax', 'equinox'))\n"
        "assert not bad, bad\n"
        "import jaxslices.equinox\n"
        "assert 'flax' not in sys.modules\n"
        "import jaxslices.nnx, jaxslices.linen\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
