"""EmbeddingCollection: equal to separate per-table lookups and to jax.grad of
the dense equivalent (repeated ids, empty bags, shared tables, out-of-range
ids, weights, every combiner, sequence tables, several dtypes)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _mesh import OPTIMIZERS  # every jaxslices optimizer, as the mesh tests
from helpers import CHECK_FAILED, tol
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxslices as js

# ------------------------------------------------------------------ fixtures


def _tables(dtype=jnp.float32, seq=False):
    """Two dims (two buffers), a shared table, every combiner."""
    ts = [
        js.TableConfig("a", rows=5, dim=3, dtype=dtype),
        js.TableConfig("b", rows=2, dim=3, features=("b1", "b2"), combiner="mean",
                       dtype=dtype),
        js.TableConfig("c", rows=4, dim=2, combiner="sqrtn", dtype=dtype),
        js.TableConfig("d", rows=3, dim=3, combiner="sum", dtype=dtype),
    ]  # fmt: skip
    if seq:
        ts.append(
            js.TableConfig("s", rows=6, dim=2, combiner=None, max_sequence_length=3,
                           dtype=dtype)
        )  # fmt: skip
    return ts


def _random_lists(rng, coll, batch, max_len=3, bad=True):
    """{feature: bags}; repeats, empty bags, and ids out of their table's range."""
    out = {}
    for f in coll.features:
        rows = coll.table_config(coll.table_of(f)).rows
        bags = []
        for _ in range(batch):
            n = int(rng.integers(0, max_len + 1))
            ids = rng.integers(0, max(1, rows // 2 + 1), n)  # few rows: repeats
            if bad and n and rng.random() < 0.3:
                ids[0] = rng.choice([-1, rows, rows + 1])  # a neighbour's row
            bags.append(ids.tolist())
        out[f] = bags
    return out


def _weights_for(rng, lists):
    return {f: [rng.uniform(0.5, 2.0, len(b)).tolist() for b in bags]
            for f, bags in lists.items()}  # fmt: skip


L_MAX, B, CAP = 3, 4, 64  # bag length bound, batch, max_total: fixed shapes
PAD = -100  # the padding id of padded inputs (bad ids are -1, rows, rows + 1)


def _padded(coll, lists, weights=None):
    """{feature: (ids [B, L_MAX], present, weights)}: fixed shapes for jit."""
    out = {}
    for f in coll.features:
        bags = lists[f]
        ids = np.zeros((len(bags), L_MAX), np.int32)
        present = np.zeros((len(bags), L_MAX), bool)
        w = np.zeros((len(bags), L_MAX), np.float32)
        for i, b in enumerate(bags):
            ids[i, : len(b)] = b
            present[i, : len(b)] = True
            w[i, : len(b)] = 1.0 if weights is None else weights[f][i]
        out[f] = (ids, present, w)
    return out


def _reference(tables, coll, padded, weighted=False, sparse=False):
    """Per feature, its own table: plain JAX gathers (dense gradients), or
    ``sparse``: jaxslices lookups of the separate tables (sparse gradients)."""
    out = {}
    for f in coll.features:
        t = coll.table_config(coll.table_of(f))
        table = tables[t.name]
        ids, present, w = (jnp.asarray(x) for x in padded[f])
        valid = present & (ids >= 0) & (ids < t.rows)
        safe = jnp.where(valid, ids, t.rows)
        if sparse:
            rows = js.embedding_lookup(table, safe)
        else:
            rows = table.at[safe].get(mode="fill", fill_value=0)
        if t.combiner is None:  # L_MAX == max_sequence_length in these tests
            out[f] = rows
            continue
        # the bags rule: only valid non-padding ids count (in the denominators too)
        wj = jnp.where(valid, w if weighted else 1.0, 0.0).astype(rows.dtype)
        s = jnp.sum(rows * wj[..., None], axis=1)
        if t.combiner == "mean":
            d = jnp.sum(wj, axis=1)
        elif t.combiner == "sqrtn":
            d = jnp.sqrt(jnp.sum(wj * wj, axis=1))
        else:
            d = None
        if d is not None:
            s = s * jnp.where(d == 0, 0, 1 / jnp.where(d == 0, 1, d))[:, None]
        out[f] = s
    return out


def _loss_of(outs, cots):
    return sum(jnp.sum(outs[f].astype(jnp.float32) * cots[f]) for f in sorted(outs))


def _cotangents(rng, outs):
    return {f: jnp.asarray(rng.normal(size=o.shape), jnp.float32)
            for f, o in outs.items()}  # fmt: skip


def _dense_grads(coll, grads):
    """{table: dense gradient} from the collection's per-buffer gradients."""
    dense = {k: (g.to_dense() if isinstance(g, js.IndexedSlices) else g)
             for k, g in grads.items()}  # fmt: skip
    return coll.unstack(dense)


# ------------------------------------------------------------ forward + grads


def _kjt(lists, weights=None):
    return js.KeyedJaggedIds.from_lists(lists, weights=weights, max_total=CAP)


@functools.lru_cache
def _jitted(dtype=jnp.float32, weighted=False):
    """(collection, its value_and_grad, the reference's): compiled once per key."""
    coll = js.EmbeddingCollection(_tables(dtype, seq=True))

    def coll_loss(p, kjt, cots):
        return _loss_of(coll(p, kjt), cots)

    def ref_loss(t, padded, cots):
        return _loss_of(_reference(t, coll, padded, weighted), cots)

    def padded_loss(p, ids, w, cots):
        return _loss_of(coll(p, ids, padding_id=PAD, weights=w), cots)

    return (
        coll,
        jax.jit(coll),
        jax.jit(js.value_and_grad(coll_loss)),
        jax.jit(lambda t, p: _reference(t, coll, p, weighted)),
        jax.jit(jax.value_and_grad(ref_loss)),
        jax.jit(js.value_and_grad(padded_loss)),
    )


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), weighted=st.booleans())
def test_equals_separate_lookups_and_dense_grad(seed, weighted):
    rng = np.random.default_rng(seed)
    coll, fwd, vg, ref_fwd, ref_vg, padded_vg = _jitted(weighted=weighted)
    params = coll.init(jax.random.key(seed % 1000))
    lists = _random_lists(rng, coll, B)
    weights = _weights_for(rng, lists) if weighted else None
    kjt = _kjt(lists, weights)
    padded = _padded(coll, lists, weights)
    out = fwd(params, kjt)
    tables = coll.unstack(params)
    ref = ref_fwd(tables, padded)
    assert list(out) == list(coll.features)
    for f in coll.features:
        np.testing.assert_allclose(out[f], ref[f], rtol=1e-5, atol=1e-6, err_msg=f)
    cots = _cotangents(rng, out)
    value, grads = vg(params, kjt, cots)
    for name in coll.shapes:
        assert isinstance(grads[name], js.IndexedSlices), name  # one per buffer
    want_v, want = ref_vg(tables, padded, cots)
    np.testing.assert_allclose(value, want_v, rtol=1e-5, atol=1e-5)
    got = _dense_grads(coll, grads)
    for name in tables:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    # the same ids padded ({feature: [B, L]}, no segment sum): same numbers
    ids = {f: np.where(p[1], p[0], PAD) for f, p in padded.items()}
    w = {f: p[2] for f, p in padded.items()} if weighted else None
    value2, grads2 = padded_vg(params, ids, w, cots)
    np.testing.assert_allclose(value2, value, rtol=1e-5, atol=1e-5)
    got2 = _dense_grads(coll, grads2)
    for name in tables:
        np.testing.assert_allclose(got2[name], want[name], rtol=1e-5, atol=1e-6)


def test_concat_is_the_pooled_features_side_by_side():
    """Batch-major pooling, jagged and padded, one buffer and several."""
    rng = np.random.default_rng(3)
    for tables in (_tables()[:2], _tables()):  # one dim; two dims
        coll = js.EmbeddingCollection(tables)
        params = coll.init(jax.random.key(3))
        lists = _random_lists(rng, coll, 3)
        kjt = js.KeyedJaggedIds.from_lists(lists)
        want = jnp.concatenate(list(coll(params, kjt).values()), axis=1)
        np.testing.assert_allclose(coll.concat(params, kjt), want, rtol=1e-6)
        padded = _padded(coll, lists)
        ids = {f: np.where(p[1], p[0], PAD) for f, p in padded.items()}
        got = coll.concat(params, ids, padding_id=PAD)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    seq = js.EmbeddingCollection(_tables(seq=True))
    with pytest.raises(ValueError, match=r"sequence tables \['s'\] do not pool"):
        seq.concat(seq.init(jax.random.key(0)), kjt)


def test_dense_jax_grad_through_the_collection_equals_the_sparse_one():
    rng = np.random.default_rng(1)
    coll, fwd, vg, *_ = _jitted()
    params = coll.init(jax.random.key(1))
    kjt = _kjt(_random_lists(rng, coll, B))
    cots = _cotangents(rng, fwd(params, kjt))
    dense = jax.jit(jax.grad(lambda p: _loss_of(coll(p, kjt), cots)))(params)
    _, sparse = vg(params, kjt, cots)
    for k in params:
        assert not isinstance(dense[k], js.IndexedSlices)
        np.testing.assert_allclose(sparse[k].to_dense(), dense[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dtypes(dtype):
    rng = np.random.default_rng(2)
    coll, fwd, vg, ref_fwd, ref_vg, _ = _jitted(dtype)
    params = coll.init(jax.random.key(2))
    assert all(p.dtype == dtype for p in params.values())
    lists = _random_lists(rng, coll, B)
    kjt, padded = _kjt(lists), _padded(coll, lists)
    out = fwd(params, kjt)
    tables = coll.unstack(params)
    ref = ref_fwd(tables, padded)
    for f in coll.features:
        assert out[f].dtype == dtype
        np.testing.assert_allclose(
            np.asarray(out[f], np.float32), np.asarray(ref[f], np.float32), **tol(dtype)
        )
    cots = _cotangents(rng, out)
    _, g = vg(params, kjt, cots)
    _, want = ref_vg(tables, padded, cots)
    got = _dense_grads(coll, g)
    for t in tables:
        assert got[t].dtype == dtype
        np.testing.assert_allclose(
            np.asarray(got[t], np.float32),
            np.asarray(want[t], np.float32),
            **tol(dtype),
        )


@pytest.mark.parametrize("id_dtype", [np.int8, np.uint8, np.int32, np.int64])
def test_id_dtypes_are_range_checked_in_their_own_dtype(id_dtype):
    coll = js.EmbeddingCollection(
        [js.TableConfig("a", 3, 2), js.TableConfig("b", 4, 2)]
    )
    params = {"dim2_float32": jnp.arange(14.0).reshape(7, 2)}
    info = np.iinfo(id_dtype)
    big = min(int(info.max), 300)
    vals = np.array([2, 3, big, 0, 3, 0], id_dtype)  # 3 and big: out of "a"'s range
    kjt = js.KeyedJaggedIds.from_lengths(["a", "b"], vals, [1, 1, 1, 1, 1, 1])
    out = coll(params, kjt)
    np.testing.assert_array_equal(out["a"], [[4, 5], [0, 0], [0, 0]])
    np.testing.assert_array_equal(out["b"][:, 0], [6, 12, 6])  # rows 3+0, 3+3, 3+0


def test_an_out_of_range_id_never_reads_or_trains_a_neighbouring_table():
    coll = js.EmbeddingCollection(
        [js.TableConfig("a", 2, 1), js.TableConfig("b", 2, 1)]
    )
    params = {"dim1_float32": jnp.array([[1.0], [2.0], [3.0], [4.0]])}
    kjt = js.KeyedJaggedIds.from_lists({"a": [[2, -1, 1]], "b": [[0]]})
    out = coll(params, kjt)
    assert out["a"].tolist() == [[2.0]]  # id 2 of "a" would be "b"'s row 0
    g = js.grad(lambda p: coll(p, kjt)["a"].sum())(params)
    np.testing.assert_array_equal(g["dim1_float32"].to_dense().ravel(), [0, 1, 0, 0])


def test_empty_bags_and_an_empty_batch_pool_to_zeros():
    coll = js.EmbeddingCollection([js.TableConfig("a", 3, 2, combiner="mean")])
    params = coll.init(jax.random.key(0))
    kjt = js.KeyedJaggedIds.from_lists({"a": [[], [1], []]}, max_total=4)
    out = coll(params, kjt)["a"]
    np.testing.assert_array_equal(out[0], 0)
    np.testing.assert_array_equal(out[2], 0)
    np.testing.assert_allclose(out[1], params["dim2_float32"][1])
    none = js.KeyedJaggedIds.from_lists({"a": [[], []]}, max_total=2)
    np.testing.assert_array_equal(coll(params, none)["a"], 0)
    g = js.grad(lambda p: coll(p, none)["a"].sum())(params)["dim2_float32"]
    np.testing.assert_array_equal(g.to_dense(), 0)


def test_a_shared_table_sums_both_features_gradients():
    coll = js.EmbeddingCollection([js.TableConfig("t", 4, 2, features=("x", "y"))])
    params = coll.init(jax.random.key(0))
    kjt = js.KeyedJaggedIds.from_lists({"x": [[1, 1]], "y": [[1, 3]]})
    out = coll(params, kjt)
    t = params["dim2_float32"]
    np.testing.assert_allclose(out["x"][0], 2 * t[1])
    np.testing.assert_allclose(out["y"][0], t[1] + t[3])
    g = js.grad(lambda p: sum(v.sum() for v in coll(p, kjt).values()))(params)
    g = g["dim2_float32"]
    assert g.num_slices == 4  # one lookup: the shared table is one buffer's rows
    np.testing.assert_array_equal(g.to_dense()[:, 0], [0, 3, 0, 1])


def test_one_lookup_per_buffer_under_jit():
    """Each buffer's gradient is one lookup of every slot (not one per table)."""
    coll = js.EmbeddingCollection(_tables())  # two dims: two buffers
    params = coll.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    kjt = js.KeyedJaggedIds.from_lists(_random_lists(rng, coll, 4), max_total=64)
    ones = {f: 1.0 for f in coll.features}
    step = jax.jit(js.value_and_grad(lambda p, k: _loss_of(coll(p, k), ones)))
    _, g = step(params, kjt)
    assert {k: v.num_slices for k, v in g.items()} == {
        "dim3_float32": 64,
        "dim2_float32": 64,
    }


def test_unused_keys_are_ignored_and_padding_slots_are_padding():
    coll = js.EmbeddingCollection([js.TableConfig("a", 3, 1)])
    params = {"dim1_float32": jnp.array([[1.0], [2.0], [4.0]])}
    kjt = js.KeyedJaggedIds.from_lists({"other": [[0]], "a": [[2, 2]]}, max_total=5)
    assert coll(params, kjt)["a"].tolist() == [[8.0]]
    g = js.grad(lambda p: coll(p, kjt)["a"].sum())(params)["dim1_float32"]
    assert g.num_slices == 5
    np.testing.assert_array_equal(g.indices, [3, 2, 2, 3, 3])  # 3 = padding


# -------------------------------------------------------------- sequences


def test_sequence_tables_and_their_overflow_error():
    coll = js.EmbeddingCollection(
        [js.TableConfig("s", 4, 2, combiner=None, max_sequence_length=2)]
    )
    params = coll.init(jax.random.key(0))
    t = params["dim2_float32"]
    kjt = js.KeyedJaggedIds.from_lists({"s": [[3, 1], [], [2]]})
    out = coll(params, kjt)["s"]
    assert out.shape == (3, 2, 2)
    np.testing.assert_allclose(out[0], t[jnp.array([3, 1])])
    np.testing.assert_array_equal(out[1], 0)
    np.testing.assert_allclose(out[2], jnp.stack([t[2], jnp.zeros(2)]))
    long = js.KeyedJaggedIds.from_lists({"s": [[3, 1, 0]]})
    with pytest.raises(ValueError, match=r"1 bag is longer than max_sequence_length"):
        coll(params, long)
    with pytest.raises(Exception, match=r"feature 's', L = 2"):
        jax.block_until_ready(jax.jit(coll)(params, long))


def test_padded_sequence_feature_shorter_than_a_pooled_one():
    """A sequence feature's own L counts, not the longest feature's."""
    coll = js.EmbeddingCollection(
        [
            js.TableConfig("s", 5, 2, combiner=None, max_sequence_length=3),
            js.TableConfig("p", 5, 2),
        ]
    )
    params = coll.init(jax.random.key(0))
    t = params["dim2_float32"]
    ids = {"s": jnp.array([[1, 2], [4, 0]]), "p": jnp.array([[0, 1, 2, 3, 4]] * 2)}
    out = coll(params, ids)
    s_rows = t[jnp.array([[1, 2], [4, 0]])]
    want = jnp.concatenate([s_rows, jnp.zeros((2, 1, 2))], axis=1)
    np.testing.assert_allclose(out["s"], want)
    np.testing.assert_allclose(out["p"], jnp.stack([t[5:10].sum(0)] * 2), rtol=1e-6)


# ------------------------------------------------------------------ checks


def test_check_ids_names_the_feature_eagerly_and_under_jit():
    coll = js.EmbeddingCollection(
        [js.TableConfig("a", 3, 1), js.TableConfig("b", 2, 1)]
    )
    params = coll.init(jax.random.key(0))
    good = js.KeyedJaggedIds.from_lists({"a": [[2]], "b": [[1]]})
    coll(params, good, check_ids=True)
    bad = js.KeyedJaggedIds.from_lists({"a": [[2]], "b": [[1, 2, -1]]})
    msg = (
        r"2 ids are out of range .* feature 'b', whose table has 2 rows; .* min -1 "
        "and max 2"
    )
    with pytest.raises(ValueError, match=msg):
        coll(params, bad, check_ids=True)
    f = jax.jit(lambda p, k: coll(p, k, check_ids=True))
    with pytest.raises(CHECK_FAILED, match=msg):
        jax.block_until_ready(f(params, bad))


def test_ids_beyond_jax_integer_width_are_never_a_valid_row():
    """Without x64, int64 2**32 + 1 would wrap to row 1 in jnp.asarray."""
    coll = js.EmbeddingCollection([js.TableConfig("a", 10, 2)])
    params = coll.init(jax.random.key(0))
    big = np.array([[2**32 + 1], [3]], np.int64)
    with pytest.raises(ValueError, match=r"1 id is out of range .* feature 'a'"):
        coll(params, {"a": big}, check_ids=True)
    out = coll(params, {"a": big})  # unchecked: read as padding, zeros
    np.testing.assert_array_equal(out["a"][0], 0)
    kjt = js.KeyedJaggedIds.from_padded({"a": big}, padding_id=-1)
    with pytest.raises(ValueError, match=r"1 id is out of range"):
        coll(params, kjt, check_ids=True)
    assert int(js.JaggedIds.from_padded(big.T, padding_id=-1).values[0]) != 1
    assert int(js.JaggedIds.from_lengths(big[:, 0], np.array([2])).values[0]) != 1


def test_an_empty_batch_pools_nothing_and_checks_nothing():
    coll = js.EmbeddingCollection([js.TableConfig("a", 4, 2)])
    params = coll.init(jax.random.key(0))
    kjt = js.KeyedJaggedIds.from_lists({"a": []})
    assert coll(params, kjt, check_ids=True)["a"].shape == (0, 2)
    g = js.grad(lambda p: coll(p, kjt)["a"].sum())(params)
    np.testing.assert_array_equal(js.to_dense(g["dim2_float32"]), 0)


def test_padded_weights_need_every_feature():
    coll = js.EmbeddingCollection(
        [js.TableConfig("a", 4, 2), js.TableConfig("b", 4, 2)]
    )
    params = coll.init(jax.random.key(0))
    ids = {"a": jnp.array([[1]]), "b": jnp.array([[2]])}
    bad = {"a": jnp.ones((1, 1)), "c": jnp.ones((1, 1))}  # b missing, c extra
    with pytest.raises(ValueError, match=r"`weights` must be a dict with every"):
        coll(params, ids, weights=bad)


def test_keyed_from_padded_refuses_a_filler_its_dtype_cannot_hold():
    ids = {"a": np.array([[1, 2, 3]], np.uint8), "b": np.array([[4]], np.uint8)}
    with pytest.raises(ValueError, match=r"padding_id=-1, which uint8 ids cannot"):
        js.KeyedJaggedIds.from_padded(ids, padding_id=-1)
    kjt = js.KeyedJaggedIds.from_padded(ids, padding_id=255)
    assert kjt.lengths.tolist() == [3, 1]


def test_bad_configs_and_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="`rows` must be a positive int"):
        js.TableConfig("a", rows=0, dim=2)
    with pytest.raises(ValueError, match="needs `max_sequence_length`"):
        js.TableConfig("a", rows=2, dim=2, combiner=None)
    with pytest.raises(ValueError, match="`combiner` must be one of"):
        js.TableConfig("a", rows=2, dim=2, combiner="max")
    with pytest.raises(TypeError, match="float dtype"):
        js.TableConfig("a", rows=2, dim=2, dtype=jnp.int32)
    with pytest.raises(ValueError, match="table names repeat"):
        js.EmbeddingCollection([js.TableConfig("a", 2, 2), js.TableConfig("a", 3, 2)])
    with pytest.raises(ValueError, match="feature 'x' is read by tables 'a' and 'b'"):
        js.EmbeddingCollection(
            [
                js.TableConfig("a", 2, 2, features="x"),
                js.TableConfig("b", 3, 2, features="x"),
            ]
        )
    coll = js.EmbeddingCollection([js.TableConfig("a", 3, 2)])
    params = coll.init(jax.random.key(0))
    with pytest.raises(ValueError, match=r"the input lacks features \['a'\]"):
        coll(params, js.KeyedJaggedIds.from_lists({"z": [[1]]}))
    with pytest.raises(
        ValueError, match=r"buffer 'dim2_float32' must have shape \(3, 2\)"
    ):
        coll(
            {"dim2_float32": jnp.zeros((4, 2))},
            js.KeyedJaggedIds.from_lists({"a": [[1]]}),
        )
    with pytest.raises(TypeError, match="must be a jaxslices.KeyedJaggedIds or a dict"):
        coll(params, [jnp.array([[1]])])
    with pytest.raises(ValueError, match="are for padded inputs"):
        coll(params, js.KeyedJaggedIds.from_lists({"a": [[1]]}), padding_id=-1)
    with pytest.raises(ValueError, match=r"padded ids must be \[B, L\]"):
        coll(params, {"a": jnp.array([1])})


# ------------------------------------------------------------- layout helpers


def test_stack_unstack_table_and_init_are_per_table():
    ts = [
        js.TableConfig("a", 3, 2),
        js.TableConfig("b", 2, 2),
        js.TableConfig("c", 4, 5),
    ]
    coll = js.EmbeddingCollection(ts)
    assert coll.shapes == {"dim2_float32": (5, 2), "dim5_float32": (4, 5)}
    assert coll.placement("b") == ("dim2_float32", 3)
    params = coll.init(jax.random.key(3))
    # a table's values depend on the key and its name only: a collection
    # without "a", the tables in another order, initialises "c" the same
    alone = js.EmbeddingCollection(ts[:0:-1]).init(jax.random.key(3))
    np.testing.assert_array_equal(coll.table(params, "c"), alone["dim5_float32"])
    bound = np.sqrt(1 / 3)
    assert float(jnp.max(jnp.abs(coll.table(params, "a")))) <= bound
    back = coll.stack(coll.unstack(params))
    for k in params:
        np.testing.assert_array_equal(back[k], params[k])
    with pytest.raises(ValueError, match=r"missing \['c'\]"):
        coll.stack({"a": jnp.zeros((3, 2)), "b": jnp.zeros((2, 2))})


# ------------------------------------------------------------- KeyedJaggedIds


def test_keyed_constructors_agree_and_from_padded_runs_under_jit():
    lists = {"a": [[1, 2], [], [0]], "b": [[4], [5, 6], []]}
    k1 = js.KeyedJaggedIds.from_lists(lists)
    k2 = js.KeyedJaggedIds.from_lengths(
        ["a", "b"], np.array([1, 2, 0, 4, 5, 6]), np.array([[2, 0, 1], [1, 2, 0]])
    )
    padded = {"a": jnp.array([[1, 2], [-1, -1], [0, -1]]),
              "b": jnp.array([[4, -1], [5, 6], [-1, -1]])}  # fmt: skip
    k3 = jax.jit(lambda d: js.KeyedJaggedIds.from_padded(d, padding_id=-1))(padded)
    for k in (k2, k3):
        assert k.keys == k1.keys and k.batch_size == 3
        np.testing.assert_array_equal(k.offsets, k1.offsets)
        np.testing.assert_array_equal(k.values[:6], k1.values[:6])
    assert k3.max_total == 12
    leaves, treedef = jax.tree.flatten(k1)
    assert jax.tree.unflatten(treedef, leaves).keys == ("a", "b")
    with pytest.raises(ValueError, match="cannot be split over 2 features"):
        js.KeyedJaggedIds(["a", "b"], k1.ids._replace(offsets=k1.offsets[:4]))
    with pytest.raises(ValueError, match="invalid JaggedIds offsets"):  # by hand
        js.KeyedJaggedIds(
            ["a"], js.JaggedIds(jnp.zeros(2, jnp.int32), jnp.array([0, 3]))
        )
    with pytest.raises(TypeError, match="ids must be integers"):
        js.KeyedJaggedIds.from_lists({"a": [[1.5]]})
    with pytest.raises(ValueError, match="same number of examples"):
        js.KeyedJaggedIds.from_lists({"a": [[1]], "b": [[1], [2]]})


# --------------------------------------------------------------- optimizers


def _train(tx_coll, tx_sep, steps=2, seed=5):
    """Both ways, jitted: the collection vs separate tables with sparse lookups."""
    rng = np.random.default_rng(seed)
    coll, fwd, *_ = _jitted()
    params = coll.init(jax.random.key(seed))
    tables = coll.unstack(params)
    lists = [_random_lists(rng, coll, B) for _ in range(steps)]
    cots = _cotangents(rng, fwd(params, _kjt(lists[0])))

    @jax.jit
    def step_coll(p, s, kjt):
        g = js.grad(lambda p: _loss_of(coll(p, kjt), cots))(p)
        u, s = tx_coll.update(g, s, p)
        return js.apply_updates(p, u), s

    @jax.jit
    def step_sep(t, s, padded):
        g = js.grad(lambda t: _loss_of(_reference(t, coll, padded, sparse=True), cots))(
            t
        )
        u, s = tx_sep.update(g, s, t)
        return js.apply_updates(t, u), s

    s1, s2 = tx_coll.init(params), tx_sep.init(tables)
    for ls in lists:
        params, s1 = step_coll(params, s1, _kjt(ls))
        tables, s2 = step_sep(tables, s2, _padded(coll, ls))
    got = coll.unstack(params)
    for t in tables:
        np.testing.assert_allclose(got[t], tables[t], rtol=2e-5, atol=1e-6, err_msg=t)
    return coll


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_on_the_buffer_equals_it_on_separate_tables(name):
    """Stacking changes nothing: lazy optimizers touch the same rows, row-wise
    state is per row, global norms and step counts are global either way."""
    _train(OPTIMIZERS[name](), OPTIMIZERS[name]())


def test_per_table_learning_rate_and_weight_decay_equal_separate_optimizers():
    """chain(adam, decay by table, lr, scale by table) == one lazy_adamw per table."""
    coll = _jitted()[0]
    names = [t.name for t in coll.tables]
    lr = {"a": 0.1, "b": 0.02, "c": 0.05, "d": optax.linear_schedule(0.1, 0.0, 4)}
    lr["s"] = 0.1
    wd = {"a": 0.0, "b": 0.5, "c": 0.1, "d": 0.2, "s": 0.0}
    factor = {k: (lambda n, v=v: v(n) / 0.1) if callable(v) else v / 0.1
              for k, v in lr.items()}  # fmt: skip
    tx = optax.chain(
        js.scale_by_lazy_adam(),
        coll.add_decayed_weights_by_table(wd),
        js.scale_by_learning_rate(0.1),
        coll.scale_by_table(factor),
    )
    sep = optax.multi_transform(
        {k: js.lazy_adamw(lr[k], weight_decay=wd[k]) for k in names},
        {k: k for k in names},
    )
    _train(tx, sep, steps=3, seed=6)


def test_per_table_transforms_on_dense_leaves_and_their_errors():
    coll = js.EmbeddingCollection(
        [js.TableConfig("a", 2, 1), js.TableConfig("b", 3, 1)]
    )
    p = {"emb": {"dim1_float32": jnp.ones((5, 1))}, "w": jnp.ones(2)}
    g = {"emb": {"dim1_float32": jnp.ones((5, 1))}, "w": jnp.ones(2)}
    tx = optax.chain(coll.add_decayed_weights_by_table({"a": 1.0}),
                     coll.scale_by_table({"b": 0.5}))  # fmt: skip
    u, _ = tx.update(g, tx.init(p), p)
    np.testing.assert_array_equal(
        u["emb"]["dim1_float32"].ravel(), [2, 2, 0.5, 0.5, 0.5]
    )
    np.testing.assert_array_equal(u["w"], g["w"])  # not a buffer: unchanged
    with pytest.raises(ValueError, match=r"no tables \['z'\]"):
        coll.scale_by_table({"z": 1.0})
    tx = coll.scale_by_table({"a": 2.0})
    with pytest.raises(ValueError, match="hold no buffer of this collection"):
        tx.update({"w": jnp.ones(2)}, tx.init(None))
    tx = coll.add_decayed_weights_by_table({"a": 2.0})
    with pytest.raises(ValueError, match="needs the params"):
        tx.update(g, tx.init(p))


def test_jit_train_step_with_donation_keeps_one_compilation():
    coll = js.EmbeddingCollection(_tables())
    params = coll.init(jax.random.key(0))
    tx = optax.chain(js.rowwise_adagrad(0.1), coll.scale_by_table({"b": 0.5}))
    state = tx.init(params)
    traces = []

    def step(p, s, kjt):
        traces.append(1)
        loss, g = js.value_and_grad(lambda p: _loss_of(coll(p, kjt), {
            f: 1.0 for f in coll.features}))(p)  # fmt: skip
        u, s = tx.update(g, s, p)
        return js.apply_updates(p, u), s, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    rng = np.random.default_rng(0)
    for _ in range(3):
        kjt = js.KeyedJaggedIds.from_lists(_random_lists(rng, coll, 4), max_total=64)
        params, state, loss = step(params, state, kjt)
    assert len(traces) == 1 and np.isfinite(loss)
