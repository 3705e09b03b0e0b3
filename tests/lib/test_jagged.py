"""Jagged ids: constructors, overflow errors, and embedding_bag on them.

Every forward result is checked against a NumPy float64 reference written bag
by bag, every sparse gradient against ``jax.grad`` of a dense lookup written
with plain indexing (and against the padded form's sparse gradient).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CHECK_FAILED, bag_reference
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxslices as js

V, D = 9, 3


def _table(seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(V, D)), jnp.float32)


def _dense_bag_loss(bags, weights, combiner, padding_id=None):
    """A loss written with plain ``table[ids]``: JAX's dense gradient is the truth."""

    def loss(table):
        outs = []
        for ids, ws in zip(bags, weights, strict=True):
            keep = [(i, w) for i, w in zip(ids, ws, strict=True) if i != padding_id]
            if not keep:
                outs.append(jnp.zeros(D))
                continue
            rows = table[jnp.array([i for i, _ in keep])]
            w = jnp.array([w for _, w in keep], jnp.float32)
            s = jnp.sum(rows * w[:, None], 0)
            den = {"sum": 1.0, "mean": jnp.sum(w), "sqrtn": jnp.sqrt(jnp.sum(w * w))}
            outs.append(s / den[combiner])  # weights > 0: den > 0
        return jnp.sum(jnp.stack(outs) ** 2)

    return loss


# ------------------------------------------------------------ constructors


def test_the_three_constructors_agree():
    bags = [[3, 1], [], [2, 2, 8]]
    a = js.JaggedIds.from_lists(bags, max_total=7, weights=[[1, 2], [], [3, 4, 5]])
    b = js.JaggedIds.from_lengths(
        jnp.array([3, 1, 2, 2, 8]),
        jnp.array([2, 0, 3]),
        max_total=7,
        weights=jnp.arange(1.0, 6.0),
    )
    padded = jnp.array([[3, -1, 1], [-1, -1, -1], [2, 2, 8]])
    c = js.JaggedIds.from_padded(
        padded,
        padding_id=-1,
        max_total=7,
        weights=jnp.array([[1.0, 9, 2], [9, 9, 9], [3, 4, 5]]),
    )
    for j in (a, b, c):
        assert isinstance(j, js.JaggedIds)
        assert (j.num_bags, j.max_total) == (3, 7)
        np.testing.assert_array_equal(j.offsets, [0, 2, 2, 5])
        np.testing.assert_array_equal(j.lengths, [2, 0, 3])
        np.testing.assert_array_equal(j.values[:5], [3, 1, 2, 2, 8])
        np.testing.assert_array_equal(j.weights[:5], [1, 2, 3, 4, 5])
        assert j.offsets.dtype == jnp.int32


def test_defaults_and_a_pytree():
    j = js.JaggedIds.from_lists([[1], [2, 3]])
    assert j.max_total == 3 and j.weights is None
    leaves = jax.tree.leaves(j)
    assert len(leaves) == 2  # weights None: no leaf
    j2 = jax.jit(lambda j: j)(j)
    assert isinstance(j2, js.JaggedIds)
    np.testing.assert_array_equal(j2.values, j.values)
    # values longer than max_total are cut (the unused tail), shorter padded
    k = js.JaggedIds.from_lengths(
        jnp.array([4, 5, 6, 7]), jnp.array([1, 1]), max_total=2
    )
    np.testing.assert_array_equal(k.values, [4, 5])
    k = js.JaggedIds.from_lengths(jnp.array([4]), jnp.array([1]), max_total=3)
    np.testing.assert_array_equal(k.values, [4, 0, 0])


def test_overflow_raises_eagerly():
    with pytest.raises(ValueError, match=r"hold 3 ids in all, more than max_total=2"):
        js.JaggedIds.from_lists([[1, 2], [3]], max_total=2)
    with pytest.raises(ValueError, match=r"hold 3 ids in all, more than max_total=2"):
        js.JaggedIds.from_lengths(jnp.array([1, 2, 3]), jnp.array([2, 1]), max_total=2)
    with pytest.raises(ValueError, match=r"only 2 ids were given"):
        js.JaggedIds.from_lengths(jnp.array([1, 2]), jnp.array([2, 1]), max_total=5)
    with pytest.raises(ValueError, match=r"`lengths` must be >= 0"):
        js.JaggedIds.from_lengths(jnp.array([1, 2]), jnp.array([2, -1]))
    with pytest.raises(ValueError, match=r"hold 4 ids in all, more than max_total=3"):
        js.JaggedIds.from_padded(
            jnp.array([[1, 0], [2, 3], [4, 0]]), padding_id=0, max_total=3
        )
    with pytest.raises(TypeError, match="`max_total` must be a Python int"):
        js.JaggedIds.from_lists([[1]], max_total=2.0)
    with pytest.raises(ValueError, match="one weight per id"):
        js.JaggedIds.from_lists([[1, 2]], weights=[[1.0]])
    with pytest.raises(TypeError, match="`values` must be integers"):
        js.JaggedIds.from_lengths(jnp.array([1.0]), jnp.array([1]))
    with pytest.raises(ValueError, match=r"padded \[num_bags, L\]"):
        js.JaggedIds.from_padded(jnp.array([1, 2]), padding_id=0)


def test_overflow_raises_under_jit():
    @jax.jit
    def from_lengths(values, lengths):
        return js.JaggedIds.from_lengths(values, lengths, max_total=3).offsets

    values = jnp.arange(5)
    np.testing.assert_array_equal(from_lengths(values, jnp.array([1, 2])), [0, 1, 3])
    with pytest.raises(CHECK_FAILED, match="hold 4 ids in all"):
        jax.block_until_ready(from_lengths(values, jnp.array([2, 2])))
    with pytest.raises(CHECK_FAILED, match="of `lengths` are negative"):
        jax.block_until_ready(from_lengths(values, jnp.array([2, -1])))

    @jax.jit
    def from_padded(ids):
        j = js.JaggedIds.from_padded(ids, padding_id=0, max_total=2)
        return j.values, j.offsets

    vals, offs = from_padded(jnp.array([[0, 7], [8, 0]]))
    np.testing.assert_array_equal(vals, [7, 8])
    np.testing.assert_array_equal(offs, [0, 1, 2])
    with pytest.raises(CHECK_FAILED, match="hold 3 ids in all"):
        jax.block_until_ready(from_padded(jnp.array([[5, 7], [8, 0]])))


def test_check_jagged_refuses_bad_offsets_and_shapes():
    bad = [
        ([1, 3], "offsets\\[0\\]=1"),
        ([0, 3, 2], "1 decreasing step"),
        ([0, 5], "offsets\\[-1\\]=5"),
    ]
    for offsets, msg in bad:
        j = js.JaggedIds(jnp.zeros(4, jnp.int32), jnp.array(offsets))
        with pytest.raises(ValueError, match=msg):
            js.check_jagged(j)
        with pytest.raises(ValueError, match=msg):  # embedding_bag checks too
            js.embedding_bag(_table(), j)
        with pytest.raises(CHECK_FAILED, match=msg):
            jax.block_until_ready(jax.jit(js.embedding_bag)(_table(), j))
    with pytest.raises(ValueError, match="1-D `values`"):
        js.check_jagged(js.JaggedIds(jnp.zeros((2, 2), jnp.int32), jnp.array([0, 1])))
    with pytest.raises(ValueError, match="`weights` must have the shape"):
        js.check_jagged(
            js.JaggedIds(jnp.zeros(2, jnp.int32), jnp.array([0]), jnp.ones(3))
        )
    with pytest.raises(TypeError, match="`offsets` must be integers"):
        js.check_jagged(js.JaggedIds(jnp.zeros(2, jnp.int32), jnp.array([0.0])))
    j = js.JaggedIds.from_lists([[1]], weights=[[2.0]])
    with pytest.raises(ValueError, match="weights given twice"):
        js.embedding_bag(_table(), j, weights=jnp.ones(1))


# ------------------------------------------------------------ embedding_bag


def _random_bags(rng, num_bags, max_len, padding_id=None):
    bags = [
        list(rng.integers(0, V // 2 + 1, rng.integers(0, max_len + 1)))
        for _ in range(num_bags)
    ]  # few distinct ids: repeats
    if padding_id is not None:
        for bag in bags:
            if bag:
                bag[rng.integers(len(bag))] = padding_id
    weights = [list(rng.uniform(0.5, 2.0, len(b)).astype(np.float32)) for b in bags]
    return bags, weights


def _reference_grad(bags, weights, combiner, padding_id, scale):
    """NumPy: d/dtable of sum(bag rows · scale), written out per id."""
    g = np.zeros((V, D))
    for ids, ws in zip(bags, weights, strict=True):
        keep = [(i, w) for i, w in zip(ids, ws, strict=True) if i != padding_id]
        den = {
            "sum": 1.0,
            "mean": sum(w for _, w in keep),
            "sqrtn": np.sqrt(sum(w * w for _, w in keep)),
        }[combiner]
        for i, w in keep:
            g[i] += w / den * scale
    return g


_SCALE = jnp.arange(1.0, D + 1)


@functools.lru_cache
def _step(combiner):
    def loss(t, j):
        return jnp.sum(js.embedding_bag(t, j, combiner=combiner, padding_id=7) * _SCALE)

    return jax.jit(js.value_and_grad(loss))


@settings(max_examples=8)
@given(
    seed=st.integers(0, 2**16),
    combiner=st.sampled_from(["sum", "mean", "sqrtn"]),
    weighted=st.booleans(),
    padded=st.booleans(),
)
def test_forward_and_sparse_gradient_equal_the_references(
    seed, combiner, weighted, padded
):
    rng = np.random.default_rng(seed)
    padding_id = 7  # ids are drawn below it: only `padded` puts it in bags
    bags, weights = _random_bags(rng, 4, 3, padding_id=7 if padded else None)
    if not weighted:
        weights = [[1.0] * len(b) for b in bags]
    total = sum(map(len, bags))
    jagged = js.JaggedIds.from_lists(bags, max_total=14, weights=weights)
    table = _table(seed)

    out = js.embedding_bag(table, jagged, combiner=combiner, padding_id=padding_id)
    assert out.shape == (4, D)
    ref = bag_reference(table, bags, weights, combiner, padding_id)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)

    value, g = _step(combiner)(table, jagged)
    assert isinstance(g, js.IndexedSlices) and g.values.shape[0] == 14
    ref_g = _reference_grad(bags, weights, combiner, padding_id, np.asarray(_SCALE))
    np.testing.assert_allclose(g.to_dense(), ref_g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(value, np.sum(ref * np.asarray(_SCALE)), rtol=1e-5)
    # unused slots and padding ids are padding slots of the gradient
    idx = np.asarray(g.indices)
    assert np.all(idx[total:] == V)
    flat = np.asarray(jagged.values[:total])
    assert np.all(idx[:total][flat == padding_id] == V)
    assert np.all(idx[:total][flat != padding_id] == flat[flat != padding_id])


def test_jagged_equals_the_padded_form_values_and_gradients():
    rng = np.random.default_rng(3)
    bags, weights = _random_bags(rng, num_bags=5, max_len=4)
    L = max(map(len, bags))
    padded = np.full((5, L), -1, np.int32)
    pw = np.zeros((5, L), np.float32)
    for b, (ids, ws) in enumerate(zip(bags, weights, strict=True)):
        padded[b, : len(ids)] = ids
        pw[b, : len(ws)] = ws
    jagged = js.JaggedIds.from_padded(
        jnp.asarray(padded), padding_id=-1, weights=jnp.asarray(pw)
    )
    table = _table(1)

    def loss(t, ids, w=None):
        kw = {} if w is None else dict(weights=w, padding_id=-1)
        return jnp.sum(js.embedding_bag(t, ids, combiner="sqrtn", **kw) ** 2)

    def jagged_loss(t, w):
        return loss(t, jagged._replace(weights=w))

    vg = jax.jit(js.value_and_grad(jagged_loss, argnums=(0, 1)))
    vj, (gj, gw) = vg(table, jagged.weights)
    vp, gp = jax.jit(js.value_and_grad(loss))(
        table, jnp.asarray(padded), jnp.asarray(pw)
    )
    np.testing.assert_allclose(vj, vp, rtol=1e-6)
    np.testing.assert_allclose(gj.to_dense(), gp.to_dense(), rtol=1e-5, atol=1e-6)
    # jax.grad of a dense lookup written with plain indexing: the truth
    dense = jax.jit(jax.grad(_dense_bag_loss(bags, weights, "sqrtn")))(table)
    np.testing.assert_allclose(gj.to_dense(), dense, rtol=1e-5, atol=1e-6)
    # the weights' gradient (through the JaggedIds) is the padded one's, compacted
    gpw = jax.grad(lambda w: loss(table, jnp.asarray(padded), w))(jnp.asarray(pw))
    present = padded != -1
    np.testing.assert_allclose(
        gw[: present.sum()], np.asarray(gpw)[present], rtol=1e-5, atol=1e-6
    )


def test_one_compilation_for_every_total_and_check_ids():
    traces = []

    @jax.jit
    def f(table, jagged):
        traces.append(1)
        return js.embedding_bag(table, jagged, combiner="sum")

    table = _table()
    for bags in (
        [[1, 2], [3]],
        [[4], []],
        [
            [],
            [],
        ],
        [[8, 8, 8, 8]],
    ):
        bags = bags + [[]] * (2 - len(bags)) if len(bags) < 2 else bags[:2]
        out = f(table, js.JaggedIds.from_lists(bags, max_total=4))
        np.testing.assert_allclose(
            out,
            bag_reference(table, bags, [[1.0] * len(b) for b in bags], "sum"),
            rtol=1e-6,
        )
    assert len(traces) == 1
    bad = js.JaggedIds.from_lists([[1, 12]])
    out = js.embedding_bag(table, bad, combiner="sum")  # policy: out of range reads 0
    np.testing.assert_allclose(out[0], table[1], rtol=1e-6)
    with pytest.raises(ValueError, match=r"1 id is out of range"):
        js.embedding_bag(table, bad, check_ids=True)


def test_empty_bags_and_an_all_unused_batch():
    table = _table()
    j = js.JaggedIds.from_lists([[], []], max_total=3)
    for combiner in ("sum", "mean", "sqrtn"):
        out = js.embedding_bag(table, j, combiner=combiner)
        np.testing.assert_array_equal(out, np.zeros((2, D)))
    g = js.grad(lambda t: js.embedding_bag(t, j).sum())(table)
    assert np.all(np.asarray(g.indices) == V) and not np.any(g.values)
