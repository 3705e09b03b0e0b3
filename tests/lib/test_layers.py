"""PyTorch's options and bag layers on the NNX, Linen and Equinox layers.

Each framework's layers are driven through one small adapter (build, call,
gradient of the table, table) so every check runs on all three:

* ``padding_idx``: the row is zeroed at initialisation (negative counts from
  the end), read as it is, its slots are padding in the sparse gradient, and
  training never moves it (even set to non-zero, even with weight decay);
* ``max_norm``: outputs equal the functional lookup's, ``apply_max_norm``
  equals :func:`jaxslices.apply_max_norm`;
* bag layers: outputs equal a NumPy reference for padded, jagged and
  ``(input, offsets)`` inputs, weighted or not, and the sparse gradient equals
  ``jax.grad`` of a dense lookup (``helpers.dense_bag``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import bag_reference, dense_bag

import jaxslices as js

nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")
eqx = pytest.importorskip("equinox")
jnnx = pytest.importorskip("jaxslices.nnx")
jlinen = pytest.importorskip("jaxslices.linen")
jse = pytest.importorskip("jaxslices.equinox")

V, D = 11, 3


class NNX:
    name = "nnx"

    @staticmethod
    def embed(**kw):
        return jnnx.Embed(V, D, rngs=nnx.Rngs(0), **kw)

    @staticmethod
    def bag(**kw):
        return jnnx.EmbedBag(V, D, rngs=nnx.Rngs(0), **kw)

    @staticmethod
    def table(layer):
        return layer.embedding.get_value()

    @staticmethod
    def set_table(layer, table):
        layer.embedding.set_value(table)
        return layer

    @staticmethod
    def call(layer, *args, **kw):
        return layer(*args, **kw)

    @staticmethod
    def grad(layer, loss, *args):
        g = jnnx.grad(lambda m: loss(m(*args)))(layer)
        return g["embedding"].get_value()

    @staticmethod
    def renorm(layer, *args):
        layer.apply_max_norm(*args)
        return layer


class Linen:
    name = "linen"

    class _Layer:
        def __init__(self, module, ids):
            self.module = module
            self.params = module.init(jax.random.key(0), ids)["params"]

    @classmethod
    def embed(cls, **kw):
        return cls._Layer(jlinen.Embed(V, D, **kw), jnp.zeros((1,), jnp.int32))

    @classmethod
    def bag(cls, **kw):
        return cls._Layer(jlinen.EmbedBag(V, D, **kw), jnp.zeros((1, 1), jnp.int32))

    @staticmethod
    def table(layer):
        return layer.params["embedding"]

    @staticmethod
    def set_table(layer, table):
        layer.params = {"embedding": table}
        return layer

    @staticmethod
    def call(layer, *args, **kw):
        return layer.module.apply({"params": layer.params}, *args, **kw)

    @staticmethod
    def grad(layer, loss, *args):
        def f(p):
            return loss(layer.module.apply({"params": p}, *args))

        return js.grad(f)(layer.params)["embedding"]

    @staticmethod
    def renorm(layer, *args):
        m, ids = layer.module, args[0]  # bags: the flat ids, every one read
        if isinstance(m, jlinen.Embed):  # negative ids count from the end
            ids = jnp.where(ids < 0, ids + V, ids)
        table = js.apply_max_norm(
            layer.params["embedding"], ids, m.max_norm, norm_type=m.norm_type
        )
        return Linen.set_table(layer, table)


class Equinox:
    name = "equinox"

    @staticmethod
    def embed(**kw):
        return jse.Embedding(V, D, key=jax.random.key(0), **kw)

    @staticmethod
    def bag(**kw):
        return jse.EmbeddingBag(V, D, key=jax.random.key(0), **kw)

    @staticmethod
    def table(layer):
        return layer.weight

    @staticmethod
    def set_table(layer, table):
        return eqx.tree_at(lambda m: m.weight, layer, table)

    @staticmethod
    def call(layer, *args, **kw):
        if isinstance(layer, jse.Embedding):  # one id per call: vmap
            (ids,) = args
            return (
                jax.vmap(jax.vmap(layer))(ids)
                if ids.ndim == 2
                else jax.vmap(layer)(ids)
            )
        return layer(*args, **kw)

    @staticmethod
    def grad(layer, loss, *args):
        return jse.filter_grad(lambda m: loss(Equinox.call(m, *args)))(layer).weight

    @staticmethod
    def renorm(layer, *args):
        return layer.apply_max_norm(*args)


FRAMEWORKS = [NNX, Linen, Equinox]
ids_fw = [f.name for f in FRAMEWORKS]


def _square_loss(out):
    return jnp.sum(out**2 * jnp.arange(1.0, D + 1))


# ------------------------------------------------------------ Embed layers


@pytest.mark.parametrize("fw", FRAMEWORKS, ids=ids_fw)
def test_embed_padding_idx_and_max_norm(fw):
    layer = fw.embed(padding_idx=-2, max_norm=0.8)
    table = fw.table(layer)
    np.testing.assert_array_equal(table[V - 2], 0)  # zeroed at initialisation
    assert np.all(np.asarray(table[: V - 2]) != 0)
    table = table.at[V - 2].set(jnp.array([3.0, 0.0, 4.0]))  # a user-set pad row
    layer = fw.set_table(layer, table)
    ids = jnp.array([[V - 2, 1, 1], [4, -1, 0]])  # -1: the last row
    out = fw.call(layer, ids)
    wrapped = jnp.where(ids < 0, ids + V, ids)
    ref = js.embedding_lookup(table, wrapped, padding_id=V - 2, max_norm=0.8)
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    norms = np.linalg.norm(np.asarray(out), axis=-1)
    assert norms.max() <= 0.8 + 1e-6 and norms[0, 0] > 0.79  # the pad row too

    g = fw.grad(layer, _square_loss, ids)
    assert isinstance(g, js.IndexedSlices)
    idx = np.asarray(g.indices)
    assert idx[0] == V and list(idx[1:]) == [1, 1, 4, V - 1, 0]
    dense = jax.grad(
        lambda t: _square_loss(
            js.embedding_lookup(t, wrapped, padding_id=V - 2, max_norm=0.8)
        )
    )(table)
    np.testing.assert_allclose(g.to_dense(), dense, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(dense[V - 2], 0)

    renormed = fw.table(fw.renorm(layer, ids))
    expect = js.apply_max_norm(table, wrapped, 0.8)
    np.testing.assert_allclose(renormed, expect, rtol=1e-6)
    np.testing.assert_array_equal(renormed[5], table[5])  # not read: untouched


@pytest.mark.parametrize("fw", FRAMEWORKS, ids=ids_fw)
def test_bad_options_raise_at_construction(fw):
    with pytest.raises(
        ValueError, match=r"`padding_idx` must be within num_embeddings"
    ):
        fw.call(fw.embed(padding_idx=V), jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="`max_norm` must be a positive"):
        fw.call(fw.embed(max_norm=0.0), jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="`norm_type` must be a positive"):
        fw.call(fw.embed(max_norm=1.0, norm_type=0), jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"`combiner` must be one of .* got 'min'"):
        fw.call(fw.bag(combiner="min"), jnp.zeros((1, 1), jnp.int32))
    with pytest.raises(ValueError, match="has no `max_norm`|`max_norm` must be"):
        fw.renorm(fw.embed(), jnp.zeros((1,), jnp.int32))


def test_the_padding_row_never_moves_in_nnx_training():
    """lazy_adamw decays the rows it touches: the padding row is never touched."""

    class Model(nnx.Module):
        def __init__(self):
            self.emb = jnnx.Embed(V, D, padding_idx=0, rngs=nnx.Rngs(0))
            self.bag = jnnx.EmbedBag(V, D, padding_idx=0, rngs=nnx.Rngs(1))

        def __call__(self, ids):
            return jnp.sum(self.emb(ids), 1) + self.bag(ids)

    model = Model()
    pad = jnp.array([1.0, -2.0, 0.5])
    model.emb.embedding[...] = model.emb.embedding[...].at[0].set(pad)
    optimizer = nnx.Optimizer(
        model, js.lazy_adamw(0.1, weight_decay=0.5), wrt=nnx.Param
    )

    @nnx.jit
    def step(model, optimizer, ids):
        loss = lambda m: jnp.sum(m(ids) ** 2)  # noqa: E731
        _, grads = jnnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)

    before = np.asarray(model.emb.embedding[...])
    for _ in range(3):
        step(model, optimizer, jnp.array([[0, 3, 0], [5, 0, 3]]))
    after = np.asarray(model.emb.embedding[...])
    np.testing.assert_array_equal(after[0], pad)
    np.testing.assert_array_equal(model.bag.embedding[...][0], 0)
    assert not np.allclose(after[3], before[3])  # trained


# ------------------------------------------------------------ bag layers

BAGS = [[1, 4, 4], [], [2, 0, 9, 2], [7]]
WEIGHTS = [[0.5, 1.0, 2.0], [], [1.0, 3.0, 0.25, 1.0], [2.0]]


def _padded(bags, fill):
    out = np.full((len(bags), max(map(len, bags))), fill)
    for b, ids in enumerate(bags):
        out[b, : len(ids)] = ids
    return out


@pytest.mark.parametrize("fw", FRAMEWORKS, ids=ids_fw)
@pytest.mark.parametrize("combiner", ["mean", "sum", "sqrtn"])
def test_bag_layers_equal_the_references(fw, combiner):
    layer = fw.bag(combiner=combiner, padding_idx=2)
    table = fw.table(layer)
    np.testing.assert_array_equal(table[2], 0)
    table = table.at[2].set(5.0)  # excluded from every bag anyway
    layer = fw.set_table(layer, table)
    ref = bag_reference(table, BAGS, WEIGHTS, combiner, padding_id=2)
    padded = jnp.asarray(_padded(BAGS, -1), jnp.int32)
    pw = jnp.asarray(_padded(WEIGHTS, 0.0), jnp.float32)
    flat = jnp.array([i for b in BAGS for i in b], jnp.int32)
    starts = jnp.array(np.cumsum([0] + [len(b) for b in BAGS[:-1]]), jnp.int32)
    jagged = js.JaggedIds.from_lists(BAGS, max_total=12, weights=WEIGHTS)
    flat_w = jnp.array([w for b in WEIGHTS for w in b], jnp.float32)
    for args in ((padded, None, pw), (jagged,), (flat, starts, flat_w)):
        np.testing.assert_allclose(fw.call(layer, *args), ref, rtol=1e-5, atol=1e-6)
    ones = [[1.0] * len(b) for b in BAGS]
    ref1 = bag_reference(table, BAGS, ones, combiner, padding_id=2)
    np.testing.assert_allclose(fw.call(layer, padded), ref1, rtol=1e-5, atol=1e-6)

    g = fw.grad(layer, _square_loss, jagged)
    assert isinstance(g, js.IndexedSlices) and g.values.shape[0] == 12
    dense = jax.grad(
        lambda t: _square_loss(dense_bag(t, padded, pw, combiner, padding_id=2))
    )(table)
    np.testing.assert_allclose(g.to_dense(), dense, rtol=1e-5, atol=1e-6)
    g = fw.grad(layer, _square_loss, flat, starts, flat_w)
    np.testing.assert_allclose(g.to_dense(), dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fw", FRAMEWORKS, ids=ids_fw)
def test_bag_include_last_offset_max_norm_and_bad_offsets(fw):
    layer = fw.bag(combiner="sum", include_last_offset=True, max_norm=0.5)
    table = fw.table(layer)
    flat = jnp.array([3, 3, 6, 1], jnp.int32)
    offsets = jnp.array([0, 2, 2, 4], jnp.int32)  # three bags, one empty
    out = fw.call(layer, flat, offsets)
    renormed = js.apply_max_norm(table, flat, 0.5)
    ref = bag_reference(renormed, [[3, 3], [], [6, 1]], [[1, 1], [], [1, 1]], "sum")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        fw.table(fw.renorm(layer, flat, offsets)), renormed, rtol=1e-6
    )
    with pytest.raises(ValueError, match="invalid JaggedIds offsets"):
        fw.call(layer, flat, jnp.array([0, 3, 2, 4], jnp.int32))
    with pytest.raises(ValueError, match=r"`input` must be the flat \[N\] ids"):
        fw.call(layer, flat[None], offsets)


def test_equinox_bag_per_example_under_vmap_stays_sparse():
    bag = jse.EmbeddingBag(V, D, combiner="sqrtn", key=jax.random.key(1))
    ids = jnp.asarray(_padded(BAGS, -1), jnp.int32)
    g = jse.filter_grad(lambda m: _square_loss(jax.vmap(m)(ids)))(bag).weight
    assert isinstance(g, js.IndexedSlices)
    ones = jnp.where(ids >= 0, 1.0, 0.0)
    dense = jax.grad(lambda t: _square_loss(dense_bag(t, ids, ones, "sqrtn")))(
        bag.weight
    )
    np.testing.assert_allclose(g.to_dense(), dense, rtol=1e-5, atol=1e-6)
