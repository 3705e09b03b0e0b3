"""Every input JAX accepts: NumPy arrays and lists, NumPy argnums, aliased
leaves, ids of every integer dtype (range-checked before any narrowing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslices as js

V, D = 10, 3


def _x64():
    """A context that enables 64-bit types (``jax.enable_x64`` or the old name)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # pragma: no cover - older JAX

    return enable_x64()


def _table(seed=0):
    return np.random.default_rng(seed).normal(size=(V, D)).astype(np.float32)


def _dense(g):
    return np.asarray(g.to_dense() if isinstance(g, js.IndexedSlices) else g)


def _loss(p, ids):
    rows = js.embedding_lookup(p["emb"], ids)
    return jnp.sum(jnp.tanh(rows @ p["w"]) ** 2)


def _ref_lookup(table, ids):
    """NumPy reference: rows of valid ids, zeros for the rest."""
    ids = np.asarray(ids)
    valid = (ids >= 0) & (ids < table.shape[0])
    out = np.asarray(table)[np.where(valid, ids, 0)]
    return np.where(valid[..., None], out, 0.0)


# ----------------------------------------------------- NumPy arrays and lists


@pytest.mark.parametrize("kind", ["numpy", "list"])
@pytest.mark.parametrize("use_jit", [False, True])
def test_numpy_and_list_tables_and_ids_for_lookups(kind, use_jit):
    table = _table()
    ids = [[1, 4, 4], [V, 0, -1]]
    t = table if kind == "numpy" else table.tolist()
    i = np.asarray(ids) if kind == "numpy" else ids
    lookup = lambda t, i: js.embedding_lookup(t, i)  # noqa: E731
    bag = lambda t, i: js.embedding_bag(t, i, padding_id=0, combiner="sum")  # noqa: E731
    if use_jit:  # jit turns lists into lists of tracers, NumPy into arrays
        lookup, bag = jax.jit(lookup), jax.jit(bag)
    np.testing.assert_allclose(lookup(t, i), _ref_lookup(table, ids), rtol=1e-6)
    want_bag = _ref_lookup(table, ids) * (np.asarray(ids) != 0)[..., None]
    np.testing.assert_allclose(bag(t, i), want_bag.sum(1), rtol=1e-6)


@pytest.mark.parametrize("use_jit", [False, True])
def test_numpy_params_and_list_ids_for_value_and_grad(use_jit):
    params = {"emb": _table(1), "w": np.arange(1.0, D + 1, dtype=np.float32)}
    ids = [3, 3, 7, V]
    vg = js.value_and_grad(_loss)
    if use_jit:
        vg = jax.jit(vg)
    value, grads = vg(params, ids)
    want_value, want = jax.value_and_grad(_loss)(
        jax.tree.map(jnp.asarray, params), jnp.asarray(ids)
    )
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    assert isinstance(grads["emb"], js.IndexedSlices)
    np.testing.assert_allclose(_dense(grads["emb"]), want["emb"], rtol=1e-5)
    np.testing.assert_allclose(grads["w"], want["w"], rtol=1e-5)


def test_python_list_table_in_params_is_a_tree_of_scalars_as_in_jax():
    """A list table is a pytree of Python floats: dense, exactly as jax.grad."""
    table = _table(7).tolist()

    def loss(p, ids):
        return jnp.sum(js.embedding_lookup(p["emb"], ids) ** 2)

    for grad in (js.grad(loss), jax.jit(js.grad(loss))):
        got = grad({"emb": table}, [1, 1, 5])
        want = jax.grad(loss)({"emb": table}, [1, 1, 5])
        assert jax.tree.structure(got) == jax.tree.structure(want)
        np.testing.assert_allclose(jax.tree.leaves(got), jax.tree.leaves(want))


@pytest.mark.parametrize("argnums", [np.int64(0), np.int32(-3), (np.int64(0), 1)])
def test_numpy_integer_argnums(argnums):
    params = {"emb": jnp.asarray(_table(2)), "w": jnp.ones(D)}
    ids = jnp.array([1, 2, 2])

    def loss(p, scale, ids):
        return _loss(p, ids) * scale

    got = js.grad(loss, argnums=argnums)(params, 2.0, ids)
    want = jax.grad(loss, argnums=argnums)(params, 2.0, ids)
    if isinstance(argnums, tuple):
        got, want = got[0], want[0]
    assert isinstance(got["emb"], js.IndexedSlices)
    np.testing.assert_allclose(_dense(got["emb"]), want["emb"], rtol=1e-5)


# --------------------------------------------- one array bound to several leaves


@pytest.mark.parametrize("use_jit", [False, True])
def test_one_array_bound_to_several_leaves(use_jit):
    z = jnp.asarray(_table(3))
    u, i = jnp.array([1, 5, 5, V]), jnp.array([[2, 5], [0, 0]])

    def loss(p):
        a = js.embedding_lookup(p["user"], u)
        b = js.embedding_lookup(p["item"], i).sum(1)
        c = js.embedding_lookup(p["user"], i[0])
        return jnp.sum(jnp.sin(a[:2] * b)) + 3.0 * jnp.sum(c**2) + jnp.sum(p["w"])

    def run(grad_fn):
        f = lambda z: grad_fn(loss)({"user": z, "item": z, "w": z})  # noqa: E731
        return jax.jit(f)(z) if use_jit else f(z)

    got, want = run(js.grad), run(jax.grad)
    for name in ("user", "item"):
        assert isinstance(got[name], js.IndexedSlices), name
        np.testing.assert_allclose(_dense(got[name]), want[name], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["w"], want["w"])
    assert not np.allclose(want["user"], want["item"])  # different gradients


def test_one_array_as_differentiated_leaf_and_non_differentiated_argument():
    z = jnp.asarray(_table(8))
    ids = jnp.array([1, 1, 4])

    def loss(p, frozen):
        return jnp.sum(js.embedding_lookup(p, ids) ** 2) + jnp.sum(
            js.embedding_lookup(frozen, ids[:2]) * 3.0
        )

    for grad in (js.grad(loss), jax.jit(js.grad(loss))):
        got = grad(z, z)  # one object in both roles: dense, and right
        np.testing.assert_allclose(_dense(got), jax.grad(loss)(z, z), rtol=1e-6)
    got = js.grad(loss)(z, z + 0)  # distinct objects: sparse
    assert isinstance(got, js.IndexedSlices)
    np.testing.assert_allclose(_dense(got), jax.grad(loss)(z, z), rtol=1e-6)


# --------------------------------------------------------- integer id dtypes

SMALL = [np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32]


@pytest.mark.parametrize("dtype", SMALL)
@pytest.mark.parametrize("numpy_ids", [False, True])
def test_every_integer_dtype(dtype, numpy_ids):
    table = jnp.asarray(_table(4))
    info = np.iinfo(dtype)
    raw = [1, 4, 4, V, info.max] + ([-1, info.min] if info.min < 0 else [])
    ids = np.array(raw, dtype)
    if dtype == np.uint32:  # 2**31 + 1 wraps to a negative int32
        ids = np.append(ids, np.uint32(2**31 + 1))
    ids_in = ids if numpy_ids else jnp.asarray(ids)
    rows = js.embedding_lookup(table, ids_in)
    np.testing.assert_allclose(rows, _ref_lookup(table, ids.astype(np.int64)))

    def loss(t):
        return jnp.sum(js.embedding_lookup(t, ids_in) ** 2)

    g = js.grad(loss)(table)
    valid = (ids.astype(np.int64) >= 0) & (ids.astype(np.int64) < V)
    np.testing.assert_array_equal(g.indices, np.where(valid, ids, V))
    np.testing.assert_allclose(_dense(g), jax.grad(loss)(table), rtol=1e-6)


def test_wide_ids_are_range_checked_before_narrowing_with_x64():
    """int64 2**32 + 1 must not wrap into row 1 (it did: ids were cast first)."""
    with _x64():
        table = jnp.asarray(_table(5))
        for dtype in (np.int64, np.uint64):
            ids = np.array([1, 2**32 + 1, 2**33 + 2, 2**63 - 1], dtype)
            for ids_in in (ids, jnp.asarray(ids)):
                assert js.embedding_lookup(table, ids_in).dtype == table.dtype
                rows = np.asarray(js.embedding_lookup(table, ids_in))
                np.testing.assert_array_equal(rows[1:], 0.0)
                np.testing.assert_allclose(rows[0], table[1])

                def loss(t, ids_in=ids_in):
                    return jnp.sum(js.embedding_lookup(t, ids_in) ** 2)

                g = js.grad(loss)(table)
                np.testing.assert_array_equal(g.indices, [1, V, V, V])
                dense = np.asarray(jax.grad(loss)(table))
                np.testing.assert_allclose(dense[1], 2 * table[1])  # only once
                np.testing.assert_allclose(_dense(g), dense)
                bag = js.embedding_bag(table, ids_in, combiner="sum")
                np.testing.assert_allclose(bag, table[1])
            with pytest.raises(ValueError, match="max 9223372036854775807"):
                js.check_ids(jnp.asarray(ids), V)


def test_numpy_int64_ids_without_x64_checked_before_jax_narrows_them():
    table = jnp.asarray(_table(6))
    ids = np.array([1, 2**32 + 1], np.int64)  # jnp.asarray would make this [1, 1]
    rows = np.asarray(js.embedding_lookup(table, ids))
    np.testing.assert_array_equal(rows[1], 0.0)
    with pytest.raises(ValueError, match="min 1 and max 4294967297"):
        js.embedding_lookup(table, ids, check_ids=True)
