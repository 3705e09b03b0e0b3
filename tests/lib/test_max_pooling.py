"""Max pooling, ``combiner="max"``: PyTorch's ``EmbeddingBag(mode="max")``.

The reference is a NumPy transcription of PyTorch's CPU kernel
(``embedding_bag_cpu_max_out`` and ``_embedding_bag_dense_backward_cpu_max``
in ``aten/src/ATen/native/EmbeddingBag.cpp``): per bag and element, the first
counted slot starts the running max, a later one replaces it only when
strictly greater (so on ties the first slot wins), and the gradient of the
element goes to that slot's row; a bag with no counted slot gives zeros and
no gradient. Counted slots follow jaxslices' bags rule: padding and
out-of-range ids are left out (PyTorch raises on the latter). Checked under
``jit`` for padded and jagged ids, several dtypes and row shapes (tables of
small integers, so ties are common and every value exact), for the sparse
gradient slot by slot and for plain ``jax.grad``; then the layers, ``vmap``,
the refusals, and a training step through every optimizer of the library.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import registry
from helpers import FLOAT_DTYPES
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxslices as js

nnx = pytest.importorskip("flax.nnx")
jnnx = pytest.importorskip("jaxslices.nnx")
jlinen = pytest.importorskip("jaxslices.linen")
jse = pytest.importorskip("jaxslices.equinox")


def torch_max(table, bags, padding_id=None):
    """PyTorch's CPU max bag: ``(out [B, *row], slot [B, *row])``.

    ``slot``: per element the position in its bag of the row holding the
    max, ``-1`` for a bag with no counted slot (its output is zeros).
    """
    t = np.asarray(table, np.float64)
    out = np.zeros((len(bags), *t.shape[1:]))
    slot = np.full(out.shape, -1)
    for b, bag in enumerate(bags):
        first = True
        for s, i in enumerate(bag):
            if i == padding_id or not 0 <= i < len(t):
                continue  # padding (PyTorch) and out of range (jaxslices' rule)
            if first:
                out[b], slot[b], first = t[i], s, False
            else:
                better = t[i] > out[b]  # strictly greater: ties keep the first
                out[b] = np.where(better, t[i], out[b])
                slot[b] = np.where(better, s, slot[b])
    return out, slot


def torch_max_grad(table, bags, cot, padding_id=None):
    """The gradient of ``sum(out * cot)``: per slot of each bag, and dense."""
    t = np.asarray(table, np.float64)
    _, slot = torch_max(t, bags, padding_id)
    per_slot = [np.zeros((len(bag), *t.shape[1:])) for bag in bags]
    dense = np.zeros(t.shape)
    for b, bag in enumerate(bags):
        for s, i in enumerate(bag):
            held = slot[b] == s
            per_slot[b][s] = np.where(held, cot[b], 0.0)
            if held.any():
                dense[i] += per_slot[b][s]
    return per_slot, dense


def _flat_expected(bags, per_slot, num_rows, padding_id, slots):
    """The expected ``IndexedSlices`` slots: ``slots`` in all, bag after bag."""
    row = per_slot[0].shape[1:] if per_slot else ()
    values = np.zeros((slots, *row))
    indices = np.full(slots, num_rows)
    k = 0
    for bag, g in zip(bags, per_slot, strict=True):
        for s, i in enumerate(bag):
            if i != padding_id and 0 <= i < num_rows:
                indices[k] = i
            values[k] = g[s]
            k += 1
    return values, indices


def _max_bag(**kw):
    return functools.partial(js.embedding_bag, combiner="max", **kw)


def _loss(pool, cot):
    def f(t, ids):
        return jnp.sum(pool(t, ids).astype(jnp.float32) * cot)

    return f


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lead=st.sampled_from([(1,), (4,), (2, 3)]),
    row_shape=st.sampled_from([(), (3,), (2, 2)]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    padding=st.sampled_from([None, -1, 0, 2]),
)
def test_matches_pytorch_padded_and_jagged(seed, lead, row_shape, dtype, padding):
    # Lengths fixed (ids and values drawn; out-of-range and padding ids among
    # them): a case compiles once per drawn structure, not per length.
    num_rows, length = 7, 4
    rng = np.random.default_rng(seed)
    table = rng.integers(-2, 3, (num_rows, *row_shape)).astype(np.float32)
    ids = rng.integers(-3, num_rows + 3, (*lead, length)).astype(np.int32)
    bags = ids.reshape(-1, length).tolist()
    cot = rng.integers(-3, 4, (len(bags), *row_shape)).astype(np.float32)
    out, _ = torch_max(table, bags, padding)
    per_slot, dense = torch_max_grad(table, bags, cot, padding)
    t = jnp.asarray(table, dtype)
    pool = _max_bag(padding_id=padding)

    # padded [..., L]
    got = jax.jit(pool)(t, ids)
    assert got.dtype == dtype and got.shape == (*lead, *row_shape)
    np.testing.assert_array_equal(np.asarray(got, np.float64).reshape(out.shape), out)
    cot_p = jnp.asarray(cot.reshape(*lead, *row_shape))
    g = jax.jit(js.grad(_loss(pool, cot_p)))(t, ids)
    values, indices = _flat_expected(bags, per_slot, num_rows, padding, ids.size)
    np.testing.assert_array_equal(g.indices, indices)
    np.testing.assert_array_equal(np.asarray(g.values, np.float64), values)
    dense_g = jax.jit(jax.grad(_loss(pool, cot_p)))(t, ids)  # plain JAX: dense
    np.testing.assert_array_equal(np.asarray(dense_g, np.float64), dense)

    # jagged: the same bags, with room to spare
    slots = ids.size + 3
    jagged = js.JaggedIds.from_lists(bags, max_total=slots)
    got = jax.jit(pool)(t, jagged)
    np.testing.assert_array_equal(np.asarray(got, np.float64), out)
    g = jax.jit(js.grad(_loss(pool, jnp.asarray(cot))))(t, jagged)
    values, indices = _flat_expected(bags, per_slot, num_rows, padding, slots)
    np.testing.assert_array_equal(g.indices, indices)
    np.testing.assert_array_equal(np.asarray(g.values, np.float64), values)
    dense_g = jax.jit(jax.grad(_loss(pool, jnp.asarray(cot))))(t, jagged)
    np.testing.assert_array_equal(np.asarray(dense_g, np.float64), dense)


def test_ties_go_to_the_first_slot_holding_the_max():
    table = jnp.array([[1.0, 1.0], [1.0, 2.0], [0.0, 2.0]])
    ids = jnp.array([[2, 1, 0], [1, 1, -1]])
    out = js.embedding_bag(table, ids, combiner="max")
    np.testing.assert_array_equal(out, [[1.0, 2.0], [1.0, 2.0]])
    g = js.grad(lambda t: js.embedding_bag(t, ids, combiner="max").sum())(table)
    np.testing.assert_array_equal(g.indices, [2, 1, 0, 1, 1, 3])
    # bag 0: column 0's max 1 first at slot 1 (id 1), column 1's max 2 at slot
    # 0 (id 2); bag 1: the same id twice, the first slot takes it all
    np.testing.assert_array_equal(
        g.values, [[0, 1], [1, 0], [0, 0], [1, 1], [0, 0], [0, 0]]
    )


def test_negative_rows_empty_bags_and_nan():
    table = jnp.array([[-3.0, -1.0], [-2.0, -5.0], [jnp.nan, 0.0]])
    ids = jnp.array([[0, 1, -1], [9, -1, 7], [1, 2, 0]])
    out = js.embedding_bag(table, ids, combiner="max")
    # not the zeros an out-of-range id reads: those are no candidates
    np.testing.assert_array_equal(out[0], [-2.0, -1.0])
    np.testing.assert_array_equal(out[1], [0.0, 0.0])  # empty: zeros
    assert np.isnan(out[2, 0]) and out[2, 1] == 0.0  # a NaN propagates
    g = js.grad(lambda t: js.embedding_bag(t, ids, combiner="max")[:2].sum())(table)
    assert not np.asarray(g.values)[3:6].any()  # the empty bag: no gradient
    bags = js.JaggedIds.from_lists([[0, 1, -1], [], [1, 2, 0]], max_total=8)
    got = js.embedding_bag(table, bags, combiner="max")
    np.testing.assert_array_equal(got[:2], [[-2.0, -1.0], [0.0, 0.0]])
    assert np.isnan(got[2, 0]) and got[2, 1] == 0.0


def test_max_norm_dtype_and_check_ids():
    table = jnp.array([[3.0, 4.0], [0.3, 0.4], [0.0, 2.0]])
    ids = jnp.array([[0, 1, 2]])
    got = js.embedding_bag(table, ids, combiner="max", max_norm=1.0)
    renormed = js.apply_max_norm(table, ids, 1.0)  # PyTorch's in-place renorm
    np.testing.assert_allclose(got, js.embedding_bag(renormed, ids, combiner="max"))
    half = js.embedding_bag(table, ids, combiner="max", dtype=jnp.bfloat16)
    assert half.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="1 id is out of range"):
        js.embedding_bag(table, jnp.array([[0, 3]]), combiner="max", check_ids=True)


def test_per_id_weights_are_refused():
    table = jnp.ones((4, 2))
    ids = jnp.array([[0, 1]])
    match = r"per-id weights are not defined for combiner='max'"
    with pytest.raises(ValueError, match=match):
        js.embedding_bag(table, ids, weights=jnp.ones((1, 2)), combiner="max")
    weighted = js.JaggedIds.from_lists([[0, 1]], max_total=4, weights=[[1.0, 2.0]])
    with pytest.raises(ValueError, match=match):
        js.embedding_bag(table, weighted, combiner="max")
    flat, offsets, w = jnp.array([0, 1, 2]), jnp.array([0, 2]), jnp.ones(3)
    for layer, call in (
        (
            jnnx.EmbedBag(4, 2, combiner="max", rngs=nnx.Rngs(0)),
            lambda m, *a: m(*a),
        ),
        (
            jse.EmbeddingBag(4, 2, combiner="max", key=jax.random.key(0)),
            lambda m, *a: m(*a),
        ),
    ):
        with pytest.raises(ValueError, match=r"EmbedB?a?g?.*combiner='max'"):
            call(layer, flat, offsets, w)
        with pytest.raises(ValueError, match=match):
            call(layer, ids, None, jnp.ones((1, 2)))
    module = jlinen.EmbedBag(4, 2, combiner="max")
    params = module.init(jax.random.key(0), ids)
    with pytest.raises(ValueError, match=r"linen.EmbedBag: per-id weights"):
        module.apply(params, flat, offsets, w)


def test_explain_says_why_max_takes_the_xla_path():
    table, ids = jnp.ones((4, 2)), jnp.array([[0, 1]])
    report = js.kernels.explain(
        lambda t: js.embedding_bag(t, ids, combiner="max").sum(), table
    )
    assert [(d.op, d.native, d.reason) for d in report.decisions] == [
        ("embedding_bag", False, "combiner max (the bag kernel sums)")
    ]
    assert report.native_calls == 0


def test_layers_and_vmap():
    rng = np.random.default_rng(0)
    table = rng.integers(-2, 3, (7, 3)).astype(np.float32)
    ids = np.array([[1, 5, 5, -1], [6, 0, 2, 9]], np.int32)
    cot = rng.integers(-3, 4, (2, 3)).astype(np.float32)
    out, _ = torch_max(table, ids.tolist())
    _, dense = torch_max_grad(table, ids.tolist(), cot)
    t = jnp.asarray(table)

    layer = jnnx.EmbedBag(7, 3, combiner="max", padding_idx=0, rngs=nnx.Rngs(0))
    layer.embedding.set_value(t)
    out0, _ = torch_max(table, ids.tolist(), padding_id=0)
    np.testing.assert_array_equal(layer(ids), out0)

    module = jlinen.EmbedBag(7, 3, combiner="max")
    np.testing.assert_array_equal(module.apply({"params": {"embedding": t}}, ids), out)

    eqx_bag = jse.EmbeddingBag(weight=t, combiner="max")

    def loss(m):  # Equinox's per-example style: one bag per call, vmapped
        return jnp.sum(jax.vmap(m)(jnp.asarray(ids)) * cot)

    g = jax.jit(jse.filter_grad(loss))(eqx_bag).weight
    assert isinstance(g, js.IndexedSlices)
    np.testing.assert_array_equal(g.to_dense(), dense)


# ------------------------------------------------------- training, every optimizer

# Every rule, clip and wrapper (tests/registry.py).
OPTIMIZERS = registry.pick(
    "sgd",
    "sgd_momentum",
    "sgd_nesterov",
    "adagrad",
    "rowwise_adagrad",
    "lazy_adam",
    "lazy_adamw",
    "ftrl",
    "clip_by_global_norm_adagrad",
    "clip_by_row_norm_tight",
    "clip_lazy_adam",
    "add_decayed_weights",
    "multi_steps_k2_mixed",
    "js_apply_if_finite",
)

NUM_ROWS, DIM, PAD = 10, 4, 9


def _model(bag):
    def loss(params, ids, y):
        h = bag(params["emb"], ids)
        return jnp.mean((jnp.tanh(h) @ params["w"] - y) ** 2)

    return loss


def _reference_bag(pick):
    """The max bag from the transcription's choice of slot (``pick``, one-hot
    over the bag per element), through a plain lookup: the reference."""

    def bag(table, ids):
        # out-of-range and padding ids: padding slots (never picked anyway)
        rows = js.embedding_lookup(table, ids, padding_id=PAD)
        return jnp.sum(jnp.where(pick, rows, 0.0), axis=-2)

    return bag


def _pick(table, ids):
    _, slot = torch_max(np.asarray(table), ids.tolist(), padding_id=PAD)
    length = ids.shape[1]
    return slot[:, None, :] == np.arange(length)[None, :, None]  # [B, L, D]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_training_with_max_bags_in_every_optimizer(name):
    """Three steps: the max bag's sparse gradient equals the reference's slot
    for slot (and plain jax.grad densely), and the optimizer's steps equal the
    reference's."""
    rng = np.random.default_rng(3)
    params = {
        "emb": jnp.asarray(rng.normal(size=(NUM_ROWS, DIM)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(DIM,)), jnp.float32),
    }
    tx = OPTIMIZERS[name]()
    max_loss = _model(_max_bag(padding_id=PAD))

    @jax.jit
    def step(params, state, ids, y):
        value, grads = js.value_and_grad(max_loss)(params, ids, y)
        updates, state = tx.update(grads, state, params)
        return js.apply_updates(params, updates), state, value, grads

    @jax.jit
    def reference_step(params, state, ids, y, pick):
        loss = _model(_reference_bag(pick))
        value, grads = js.value_and_grad(loss)(params, ids, y)
        updates, state = tx.update(grads, state, params)
        return js.apply_updates(params, updates), state, value, grads

    ref_params, state, ref_state = params, tx.init(params), tx.init(params)
    for k in range(3):
        ids = rng.integers(-2, NUM_ROWS + 2, (5, 3)).astype(np.int32)
        ids[0, 0] = ids[0, 1] = 4  # a repeated id: ties between equal rows
        y = jnp.asarray(rng.normal(size=(5,)), jnp.float32)
        dense = jax.grad(max_loss)(params, ids, y)["emb"]  # plain JAX
        params, state, value, grads = step(params, state, ids, y)
        pick = _pick(ref_params["emb"], ids)
        ref_params, ref_state, ref_value, ref_grads = reference_step(
            ref_params, ref_state, ids, y, pick
        )
        np.testing.assert_allclose(value, ref_value, rtol=1e-6, err_msg=f"step {k}")
        g, ref_g = grads["emb"], ref_grads["emb"]
        assert isinstance(g, js.IndexedSlices)
        np.testing.assert_array_equal(g.indices, ref_g.indices)
        np.testing.assert_allclose(g.values, ref_g.values, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(g.to_dense(), dense, rtol=1e-5, atol=1e-7)
        for leaf in ("emb", "w"):
            np.testing.assert_allclose(
                params[leaf],
                ref_params[leaf],
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{name} step {k} {leaf}",
            )


def test_collections_have_no_max_pooling():
    with pytest.raises(ValueError, match=r"no max pooling .* combiner='max'"):
        js.TableConfig("t", rows=4, dim=2, combiner="max")
