"""jaxslices.native: plain ``jax.grad`` gives row-sparse gradients (experimental).

Self-contained (no helpers from other test modules), tiny sizes. Every sparse
gradient is compared with ``jax.grad`` of the same loss written on the plain
array with the same ids policy (invalid ids read zeros, get no gradient).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxslices as js
from jaxslices import _jax_compat, native
from jaxslices.native import _hijax, _table

ROOT = Path(__file__).resolve().parents[2]


def plain_lookup(table, ids):
    """The reference: ``table[ids]`` with jaxslices' ids policy, dense gradient."""
    num_rows = table.shape[0]
    safe = jnp.where((ids >= 0) & (ids < num_rows), ids, num_rows)
    return table.at[safe].get(mode="fill", fill_value=0)


def random_case(seed, num_rows=11, row=(3,), ids_shape=(2, 5), dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(seed))
    table = jax.random.normal(k1, (num_rows, *row), dtype)
    # Repeated ids, out of range (>= V) and negative ones.
    ids = jax.random.randint(k2, ids_shape, -3, num_rows + 3)
    ids = ids.at[(0,) * len(ids_shape)].set(num_rows)  # a padding slot for sure
    ids = ids.reshape(-1).at[-1].set(ids.reshape(-1)[0]).reshape(ids_shape)
    return table, ids


def assert_close(a, b, dtype=jnp.float32):
    tol = 2e-2 if jnp.dtype(dtype).itemsize < 4 else 1e-5
    np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol
    )


def sq_loss(lookup):
    def loss(table, ids):
        rows = lookup(table, ids).astype(jnp.float32)
        return jnp.sum(jnp.sin(rows) * rows)

    return loss


# --------------------------------------------------------------------------
# Gradients equal the dense ones
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "row,ids_shape,dtype",
    [
        ((3,), (7,), jnp.float32),
        ((3,), (2, 5), jnp.float32),
        ((2, 2), (4,), jnp.float32),
        ((), (6,), jnp.float32),
        ((4,), (3, 2), jnp.bfloat16),
        ((4,), (5,), jnp.float16),
    ],
)
def test_grad_equals_dense(row, ids_shape, dtype):
    table, ids = random_case(len(ids_shape), row=row, ids_shape=ids_shape, dtype=dtype)
    cap = int(np.prod(ids_shape)) + 2
    dense = jax.grad(sq_loss(plain_lookup))(table, ids)
    mark = jax.jit(native.mark, static_argnums=1)
    g = jax.jit(jax.grad(sq_loss(native.lookup)))(mark(table, cap), ids)
    assert native.is_row_sparse(g)
    assert g.shape == table.shape and g.dtype == table.dtype
    assert_close(g.to_dense(), dense, dtype)
    s = native.to_indexed_slices(g)
    assert isinstance(s, js.IndexedSlices)
    assert s.values.shape == (cap, *row) and s.dense_shape == table.shape
    assert_close(s.to_dense(), dense, dtype)
    # Invalid ids and unused slots are padding with zero values.
    flat = np.asarray(ids).reshape(-1)
    idx = np.asarray(s.indices)
    n = flat.size
    valid = (flat >= 0) & (flat < table.shape[0])
    np.testing.assert_array_equal(idx[:n][valid], flat[valid])
    assert np.all(idx[:n][~valid] == table.shape[0])
    assert np.all(idx[n:] == table.shape[0])
    assert np.all(np.asarray(s.values, np.float32)[n:] == 0)


def test_forward_value_and_ids_policy():
    table, ids = random_case(0)
    out = native.lookup(native.mark(table, ids.size), ids)
    np.testing.assert_array_equal(out, plain_lookup(table, ids))


def test_value_and_grad_vjp_argnums_has_aux_under_jit():
    table, ids = random_case(2)
    w = jnp.arange(3.0)

    def loss(params, ids):
        rows = native.lookup(params["emb"], ids)
        return jnp.sum(jnp.tanh(rows @ params["w"])), rows.shape

    def ref(params, ids):
        return jnp.sum(jnp.tanh(plain_lookup(params["emb"], ids) @ params["w"]))

    @jax.jit
    def step(table, w, ids):
        params = {"emb": native.mark(table, ids.size), "w": w}
        (v, _), g = jax.value_and_grad(loss, has_aux=True)(params, ids)
        return v, native.to_indexed_slices(g)

    v, g = step(table, w, ids)
    rv, rg = jax.value_and_grad(ref)({"emb": table, "w": w}, ids)
    assert_close(v, rv)
    assert isinstance(g["emb"], js.IndexedSlices)
    assert_close(g["emb"].to_dense(), rg["emb"])
    assert_close(g["w"], rg["w"])

    # argnums and jax.vjp
    t = native.mark(table, ids.size)
    g_ids = jax.grad(lambda i, t: loss({"emb": t, "w": w}, i)[0], argnums=1)(ids, t)
    assert_close(g_ids.to_dense(), rg["emb"])
    out, vjp = jax.vjp(lambda t: native.lookup(t, ids), t)
    ct = jax.random.normal(jax.random.key(9), out.shape)
    (g_vjp,) = vjp(ct)
    _, ref_vjp = jax.vjp(lambda t: plain_lookup(t, ids), table)
    assert_close(g_vjp.to_dense(), ref_vjp(ct)[0])


def test_two_lookups_of_one_table_and_inner_jit():
    table, ids = random_case(3, ids_shape=(6,))

    def loss(lookup):
        inner = jax.jit(lambda t, i: jnp.sum(lookup(t, i) ** 2))
        return lambda t, i: inner(t, i) + jnp.sum(jnp.cos(lookup(t, i[::-1][:4])))

    dense = jax.grad(loss(plain_lookup))(table, ids)
    g = jax.jit(jax.grad(loss(native.lookup)))(native.mark(table, 10), ids)
    assert_close(g.to_dense(), dense)


def test_embedding_lookup_and_bag_dispatch_to_native():
    table, ids = random_case(4, ids_shape=(3, 4))

    def loss(t):
        bag = js.embedding_bag(t, ids, combiner="sqrtn", padding_id=2)
        rows = js.embedding_lookup(t, ids[0], dtype=jnp.bfloat16)
        return jnp.sum(bag**2) + jnp.sum(rows.astype(jnp.float32))

    dense = jax.jit(jax.grad(loss))(table)  # plain arrays: the custom_vjp lookups
    g = jax.jit(lambda x: jax.grad(loss)(native.mark(x, 16)))(table)
    assert native.is_row_sparse(g)
    assert g.dtype == table.dtype
    assert_close(g.to_dense(), dense, jnp.bfloat16)


def test_lax_cond_under_jit():
    table, ids = random_case(5, ids_shape=(4,))

    def loss(lookup):
        def f(t, pred):
            return jax.lax.cond(
                pred,
                lambda: jnp.sum(lookup(t, ids) ** 2),
                lambda: jnp.sum(lookup(t, ids[:2]) * 3.0),
            )

        return f

    for pred in (True, False):
        dense = jax.grad(loss(plain_lookup))(table, pred)
        g = jax.jit(lambda x, p: jax.grad(loss(native.lookup))(native.mark(x, 4), p))
        assert_close(g(table, pred).to_dense(), dense)


def test_marking_inside_the_loss_gives_the_dense_gradient():
    table, ids = random_case(6)
    dense = jax.grad(sq_loss(plain_lookup))(table, ids)
    g = jax.grad(lambda x: sq_loss(native.lookup)(native.mark(x, ids.size), ids))(table)
    assert isinstance(g, jax.Array) and g.shape == table.shape
    assert_close(g, dense)


# --------------------------------------------------------------------------
# Where it beats the wrapper: scan, vmap, one trace
# --------------------------------------------------------------------------


def rnn_loss(lookup):
    def loss(table, ids):  # ids: [T, B]
        def body(h, i):
            h = jnp.tanh(h + lookup(table, i))
            return h, jnp.sum(h * h)

        h0 = jnp.zeros((ids.shape[1], table.shape[1]), table.dtype)
        h, ys = jax.lax.scan(body, h0, ids)
        return jnp.sum(ys) + jnp.sum(h)

    return loss


@pytest.mark.parametrize("jit", [False, True])
def test_scan_sequence_model_stays_sparse(jit):
    table, ids = random_case(7, ids_shape=(5, 3))
    dense = jax.grad(rnn_loss(plain_lookup))(table, ids)

    def native_grad(x, i):
        return native.to_indexed_slices(
            jax.grad(rnn_loss(native.lookup))(native.mark(x, i.size), i)
        )

    g = (jax.jit(native_grad) if jit else native_grad)(table, ids)
    assert isinstance(g, js.IndexedSlices) and g.values.shape == (ids.size, 3)
    assert_close(g.to_dense(), dense)
    # The default backend falls back to a dense gradient for lookups in scan.
    wrapped = js.grad(rnn_loss(js.embedding_lookup))(table, ids)
    assert not isinstance(wrapped, js.IndexedSlices)
    assert_close(wrapped, dense)


def test_vmap_inside_the_loss():
    table, ids = random_case(8, ids_shape=(4, 3))

    def loss(lookup):
        return lambda t, i: jnp.sum(jax.vmap(lambda r: lookup(t, r) ** 3)(i))

    dense = jax.grad(loss(plain_lookup))(table, ids)
    g = jax.jit(jax.grad(loss(native.lookup)))(native.mark(table, ids.size), ids)
    assert_close(g.to_dense(), dense)


@pytest.mark.parametrize("jit", [False, True])
def test_per_example_vmap_of_grad(jit):
    table, ids = random_case(9, ids_shape=(4, 3))
    loss = sq_loss(native.lookup)
    dense = jax.vmap(jax.grad(sq_loss(plain_lookup)), in_axes=(None, 0))(table, ids)

    def per_example(x, i):
        g = jax.vmap(jax.grad(loss), in_axes=(None, 0))(native.mark(x, 3), i)
        return native.to_indexed_slices(g)

    g = (jax.jit(per_example) if jit else per_example)(table, ids)
    assert g.values.shape == (4, 3, 3) and g.indices.shape == (4, 3)
    assert_close(jax.vmap(lambda s: s.to_dense())(g), dense)


def test_one_trace_of_the_loss_instead_of_three():
    table, ids = random_case(10)
    traces = {"native": 0, "wrapper": 0}

    def counted(key):
        def loss(t, i):
            traces[key] += 1
            return jnp.sum(js.embedding_lookup(t, i) ** 2)

        return loss

    jax.jit(lambda x, i: jax.grad(counted("native"))(native.mark(x, i.size), i))(
        table, ids
    )
    jax.jit(js.grad(counted("wrapper")))(table, ids)
    assert traces == {"native": 1, "wrapper": 3}


# --------------------------------------------------------------------------
# Optimizers and memory
# --------------------------------------------------------------------------


def _native_step(tx):
    def loss(params, ids, y):
        h = js.embedding_bag(params["emb"], ids, combiner="mean")
        return jnp.mean((h @ params["w"] - y) ** 2)

    def step(params, opt_state, ids, y):
        marked = {**params, "emb": native.mark(params["emb"], ids.size)}
        value, g = jax.value_and_grad(loss)(marked, ids, y)
        g = native.to_indexed_slices(g)
        updates, opt_state = tx.update(g, opt_state, params)
        return js.apply_updates(params, updates), opt_state, value

    return step, loss


@pytest.mark.parametrize("make_tx", [lambda: js.sgd(0.1), lambda: js.lazy_adam(0.01)])
def test_training_step_matches_the_default_backend(make_tx):
    tx = make_tx()
    step, loss = _native_step(tx)
    table, ids = random_case(11, num_rows=20, row=(4,), ids_shape=(5, 3))
    params = {"emb": table, "w": jnp.linspace(-1.0, 1.0, 4)}
    y = jnp.arange(5.0)
    p1, s1 = params, tx.init(params)
    p2, s2 = params, tx.init(params)
    for _ in range(3):
        p1, s1, v1 = jax.jit(step)(p1, s1, ids, y)
        v2, g2 = js.value_and_grad(loss)(p2, ids, y)
        u2, s2 = tx.update(g2, s2, p2)
        p2 = js.apply_updates(p2, u2)
        assert_close(v1, v2)
    assert_close(p1["emb"], p2["emb"])
    assert_close(p1["w"], p2["w"])


def test_sgd_step_has_no_table_sized_temporary():
    step, _ = _native_step(js.sgd(0.1))

    def temp_bytes(num_rows):
        params = {
            "emb": jax.ShapeDtypeStruct((num_rows, 16), jnp.float32),
            "w": jax.ShapeDtypeStruct((16,), jnp.float32),
        }
        state = jax.eval_shape(js.sgd(0.1).init, params)
        ids = jax.ShapeDtypeStruct((8, 4), jnp.int32)
        y = jax.ShapeDtypeStruct((8,), jnp.float32)
        compiled = jax.jit(step, donate_argnums=0).lower(params, state, ids, y)
        return compiled.compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(2**12), temp_bytes(2**18)
    assert small == large, (small, large)
    assert large < 2**18 * 16 * 4 // 10


# --------------------------------------------------------------------------
# Never silently wrong: capacity
# --------------------------------------------------------------------------


def test_capacity_of_one_lookup_is_checked_at_trace_time():
    table, ids = random_case(12, ids_shape=(6,))
    with pytest.raises(ValueError, match=r"capacity 5 needs 6 row slots"):
        jax.jit(jax.grad(sq_loss(native.lookup)))(native.mark(table, 5), ids)


def test_capacity_of_lookups_added_together_is_checked_at_trace_time():
    table, ids = random_case(13, ids_shape=(6,))

    def loss(t):
        return jnp.sum(native.lookup(t, ids)) + jnp.sum(native.lookup(t, ids[:2]))

    with pytest.raises(ValueError, match=r"needs 8 row slots \(all lookups"):
        jax.grad(loss)(native.mark(table, 7))
    g = jax.grad(loss)(native.mark(table, 8))  # exactly enough
    ref = jax.grad(
        lambda t: jnp.sum(plain_lookup(t, ids)) + jnp.sum(plain_lookup(t, ids[:2]))
    )
    assert_close(g.to_dense(), ref(table))


def test_capacity_under_vmap_counts_the_whole_batch():
    table, ids = random_case(14, ids_shape=(4, 3))

    def loss(t):
        return jnp.sum(jax.vmap(lambda r: native.lookup(t, r))(ids))

    with pytest.raises(ValueError, match=r"needs 12 row slots"):
        jax.grad(loss)(native.mark(table, 11))


@pytest.mark.parametrize("use_jit", [False, True])
def test_capacity_is_fixed_by_jax_accumulator_type(monkeypatch, use_jit):
    """Why ``capacity`` is static (docs/sparse_gradients.md), kept as a check.

    Through plain ``jax.grad`` JAX accumulates a table's cotangents in an
    accumulator typed before any lookup is transposed and refuses any other
    type. A lookup whose backward rule sized its slots by its own ids (3, for
    a table marked with 8) is refused. If a JAX ever accepts it, the capacity
    could be derived from the traced lookups: this test then fails and says so.
    """
    import dataclasses

    sized = _table._slots_from_rows

    def by_own_ids(g, ids, ty):
        return sized(g, ids, dataclasses.replace(ty, capacity=ids.size))

    monkeypatch.setattr(_table, "_slots_from_rows", by_own_ids)
    ids = jnp.array([1, 2, 3])
    grad = jax.grad(lambda t: native.lookup(t, ids).sum())
    grad = jax.jit(grad) if use_jit else grad
    expected = r"Expected cotangent type RowSparse\[float32\[10,2\], cap=8\]"
    with pytest.raises(ValueError, match=expected + r" but got .*cap=3"):
        grad(native.mark(jnp.ones((10, 2)), capacity=8))


def test_scan_overflow_raises_when_read_eagerly():
    table, ids = random_case(15, ids_shape=(5, 2))
    g = jax.grad(rnn_loss(native.lookup))(native.mark(table, 9), ids)
    with pytest.raises(ValueError, match=r"needed 10 row slots but its capacity is 9"):
        native.to_indexed_slices(g)
    with pytest.raises(ValueError, match=r"needed 10 row slots"):
        g.to_dense()


def test_scan_overflow_raises_under_jit():
    table, ids = random_case(16, ids_shape=(5, 2))

    @jax.jit
    def grads(x, i):
        g = jax.grad(rnn_loss(native.lookup))(native.mark(x, 9), i)
        return native.to_indexed_slices(g)

    with pytest.raises(Exception, match=r"needed 10 row slots but its capacity is 9"):
        jax.block_until_ready(grads(table, ids))


def test_check_ids_with_a_marked_table():
    table, ids = random_case(17, ids_shape=(4,))
    f = jax.jit(lambda x, i: native.lookup(native.mark(x, 4), i, check_ids=True))
    with pytest.raises(Exception, match=r"ids must be in \[0, 11\)"):
        jax.block_until_ready(f(table, ids))


# --------------------------------------------------------------------------
# Unsupported contexts and bad input raise clear errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t[0],
        lambda t: t @ jnp.ones(3),
        lambda t: t * 2.0,
        lambda t: jnp.sum(t),
    ],
    ids=["getitem", "matmul", "mul", "jnp.sum"],
)
def test_dense_read_of_a_marked_table_raises(read):
    table, _ = random_case(18)
    t = native.mark(table, 4)
    with pytest.raises(native.NativeBackendError, match="can only be read through"):
        jax.grad(lambda t: jnp.sum(read(t)))(t)
    with pytest.raises(native.NativeBackendError, match="default backend"):
        read(t)


def test_checkpoint_and_forward_mode_raise():
    table, ids = random_case(19)
    t = native.mark(table, ids.size)
    loss = sq_loss(native.lookup)
    with pytest.raises(native.NativeBackendError, match="jax.checkpoint"):
        jax.grad(jax.checkpoint(loss))(t, ids)
    with pytest.raises(native.NativeBackendError, match="forward-mode"):
        jax.jvp(lambda t: native.lookup(t, ids), (t,), (jax.grad(loss)(t, ids),))


def test_vmap_over_a_batch_of_tables_raises():
    table, ids = random_case(20)
    with pytest.raises(native.NativeBackendError, match="vmap over a batch"):
        jax.vmap(lambda x: native.lookup(native.mark(x, ids.size), ids))(
            jnp.stack([table, table])
        )


def test_bad_arguments():
    table, ids = random_case(21)
    with pytest.raises(TypeError, match="capacity.*Python int"):
        native.mark(table, capacity=jnp.array(3))
    with pytest.raises(ValueError, match="capacity.*>= 1"):
        native.mark(table, capacity=0)
    with pytest.raises(TypeError, match="floating-point"):
        native.mark(ids, capacity=3)
    with pytest.raises(native.NativeBackendError, match="already marked"):
        native.mark(native.mark(table, 3), capacity=3)
    with pytest.raises(TypeError, match="must be marked"):
        native.lookup(table, ids)
    with pytest.raises(TypeError, match="must be integers"):
        native.lookup(native.mark(table, 3), ids.astype(jnp.float32))
    with pytest.raises(TypeError, match="expected a RowSparse"):
        native.RowSparse.to_dense(table)


# --------------------------------------------------------------------------
# Frameworks: gradients without jaxslices' entry points
# --------------------------------------------------------------------------


def test_flax_nnx_value_and_grad():
    nnx = pytest.importorskip("flax.nnx")
    table, ids = random_case(22, ids_shape=(5,))

    class Model(nnx.Module):
        def __init__(self, emb):
            self.emb = nnx.Param(emb)
            self.w = nnx.Param(jnp.linspace(0.5, 1.5, 3))

        def __call__(self, ids):
            # get_value(): a marked table is not an array, so no `[...]`.
            return js.embedding_lookup(self.emb.get_value(), ids) @ self.w[...]

    def loss(model, ids):
        return jnp.sum(jnp.tanh(model(ids)))

    model = Model(native.mark(table, ids.size))
    _, g = nnx.jit(nnx.value_and_grad(loss))(model, ids)
    ref = jax.grad(lambda t: jnp.sum(jnp.tanh(plain_lookup(t, ids) @ model.w[...])))
    sparse = g["emb"].get_value()
    assert native.is_row_sparse(sparse)
    assert_close(sparse.to_dense(), ref(table))


def test_equinox_with_jax_grad_and_filter_grad():
    eqx = pytest.importorskip("equinox")
    table, ids = random_case(23, ids_shape=(5,))

    class Model(eqx.Module):
        emb: object
        w: jax.Array

        def __call__(self, ids):
            return js.embedding_lookup(self.emb, ids) @ self.w

    def loss(model, ids):
        return jnp.sum(jnp.tanh(model(ids)))

    model = Model(native.mark(table, ids.size), jnp.linspace(0.5, 1.5, 3))
    ref = jax.grad(lambda t: jnp.sum(jnp.tanh(plain_lookup(t, ids) @ model.w)))(table)
    g = jax.jit(jax.grad(loss))(model, ids)  # jax.grad on the module: sparse
    assert_close(g.emb.to_dense(), ref)
    # eqx.filter_jit returns non-array leaves as static Python objects: convert
    # the gradient to IndexedSlices (arrays) inside it.
    step = eqx.filter_jit(lambda m, i: native.to_indexed_slices(jax.grad(loss)(m, i)))
    assert_close(step(model, ids).emb.to_dense(), ref)
    # eqx.filter_grad differentiates `eqx.is_inexact_array` leaves only: a
    # marked table is not one, so it gets no gradient (documented limitation).
    assert eqx.filter_grad(loss)(model, ids).emb is None


# --------------------------------------------------------------------------
# Versions and imports
# --------------------------------------------------------------------------


def test_unsupported_jax_version_raises_a_clear_error(monkeypatch):
    # The gate reads the package's one version parse (jaxslices._jax_compat),
    # and the message names the way out.
    way_out = r"needs JAX >= 0\.10\.2 and < 0\.13(.|\n)*jaxslices\.value_and_grad"
    for untested in [(0, 9, 0), (0, 10, 1), (0, 13, 0), (1, 0, 0)]:
        monkeypatch.setattr(_jax_compat, "JAX_VERSION", untested)
        with pytest.raises(_hijax.UnsupportedJaxError, match=way_out):
            _hijax.require()
    for tested in [(0, 10, 2), (0, 11, 0), (0, 12, 0), (0, 12, 5)]:
        monkeypatch.setattr(_jax_compat, "JAX_VERSION", tested)
        _hijax.require()  # the whole 0.12 line is accepted


def test_import_jaxslices_does_not_import_native():
    code = (
        "import sys, jaxslices; assert 'jaxslices.native' not in sys.modules; "
        "assert 'jaxslices.native._hijax' not in sys.modules; "
        "assert jaxslices.native.mark is not None"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


def test_optax_chain_with_native_gradients():
    # A stateful jaxslices transform inside optax.chain takes the converted tree.
    table, ids = random_case(24, ids_shape=(4,))
    tx = optax.chain(js.clip_by_global_norm(1.0), js.adagrad(0.1))
    params = {"emb": table}
    state = tx.init(params)
    loss = lambda p: sq_loss(js.embedding_lookup)(p["emb"], ids)  # noqa: E731
    g_native = native.to_indexed_slices(
        jax.grad(loss)({"emb": native.mark(table, ids.size)})
    )
    g_wrapper = js.grad(loss)(params)
    u1, _ = tx.update(g_native, state, params)
    u2, _ = tx.update(g_wrapper, state, params)
    assert_close(js.to_dense(u1)["emb"], js.to_dense(u2)["emb"])


def test_run_time_capacity_check_only_where_shapes_do_not_decide():
    table, ids = random_case(25, ids_shape=(4, 2))

    def grads(loss):
        def f(x, i):
            return native.to_indexed_slices(jax.grad(loss)(native.mark(x, i.size), i))

        return str(jax.make_jaxpr(f)(table, ids))

    assert "callback" not in grads(sq_loss(native.lookup))  # checked when traced
    assert "callback" in grads(rnn_loss(native.lookup))  # scan: checked when run


def test_lookups_inside_and_outside_scan_together():
    # Slots from scan steps (added at run time) and from top-level lookups
    # (counted at trace time) in one gradient; capacity exactly enough.
    table, ids = random_case(26, ids_shape=(3, 2))
    extra = jnp.array([0, 5, 5, -1])

    def loss(lookup):
        def f(t, i):
            return rnn_loss(lookup)(t, i) + jnp.sum(lookup(t, extra) ** 2)

        return f

    dense = jax.grad(loss(plain_lookup))(table, ids)
    grads = jax.jit(
        lambda x, i: native.to_indexed_slices(
            jax.grad(loss(native.lookup))(native.mark(x, ids.size + 4), i)
        )
    )
    assert_close(grads(table, ids).to_dense(), dense)
    too_small = jax.jit(
        lambda x, i: native.to_indexed_slices(
            jax.grad(loss(native.lookup))(native.mark(x, ids.size + 3), i)
        )
    )
    with pytest.raises(Exception, match=r"needed 10 row slots but its capacity is 9"):
        jax.block_until_ready(too_small(table, ids))


def test_unused_marked_table_gets_an_empty_gradient():
    table, ids = random_case(27)
    g = jax.grad(lambda t, w: jnp.sum(w**2), argnums=(0, 1))(
        native.mark(table, 3), jnp.ones(2)
    )[0]
    s = native.to_indexed_slices(g)
    assert np.all(np.asarray(s.indices) == table.shape[0])
    assert np.all(np.asarray(s.to_dense()) == 0)


@hypothesis.settings(max_examples=5, deadline=None)
@hypothesis.given(
    num_rows=st.integers(1, 9),
    ids_len=st.integers(1, 7),
    spare=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_random_ids_and_capacities(num_rows, ids_len, spare, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    table = jax.random.normal(k1, (num_rows, 2))
    ids = jax.random.randint(k2, (ids_len,), -2, num_rows + 2)
    dense = jax.grad(sq_loss(plain_lookup))(table, ids)

    @jax.jit
    def grads(x, i):
        g = jax.grad(sq_loss(native.lookup))(native.mark(x, ids_len + spare), i)
        return native.to_indexed_slices(g)

    assert_close(grads(table, ids).to_dense(), dense)


def test_native_scan_bench_smoke(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("native_scan_bench", None)
    import native_scan_bench

    report = native_scan_bench.main(
        num_rows=(64,), seq_lens=(3,), batch=4, dim=8, steps=1, passes=1, out=None
    )
    assert [r["path"] for r in report["rows"]] == list(native_scan_bench.PATHS)
    temp = {r["path"]: r["temp_bytes"] for r in report["rows"]}
    assert temp["native"] <= temp["dense"]


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int8, jnp.int16, jnp.uint32])
def test_ids_of_every_integer_dtype(dtype):
    table = jax.random.normal(jax.random.key(28), (300, 2))
    top = min(255, int(jnp.iinfo(dtype).max))  # an id near the dtype's limit
    ids = jnp.array([0, 7, 7, top, 100], dtype)
    if jnp.issubdtype(dtype, jnp.signedinteger):
        ids = ids.at[1].set(-1)
    dense = jax.grad(sq_loss(plain_lookup))(table, ids.astype(jnp.int32))
    g = jax.grad(sq_loss(native.lookup))(native.mark(table, 5), ids)
    assert_close(g.to_dense(), dense)


def test_large_int64_ids_are_range_checked_before_narrowing():
    # 2**32 + 1 would wrap to row 1 if narrowed to int32 before the check.
    code = (
        "import jax, jax.numpy as jnp; from jaxslices import native\n"
        "t = native.mark(jnp.ones((10, 2)), capacity=2)\n"
        "ids = jnp.array([2**32 + 1, 3], jnp.int64)\n"
        "assert ids.dtype == jnp.int64\n"
        "assert float(native.lookup(t, ids)[0].sum()) == 0.0\n"
        "g = jax.grad(lambda t: native.lookup(t, ids).sum())(t).to_indexed_slices()\n"
        "assert g.indices.tolist() == [10, 3], g.indices\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "JAX_ENABLE_X64": "1",
    }
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


def test_wrapper_on_a_marked_table_leaves_it_to_jax():
    # jaxslices.value_and_grad sees no tapped lookup (the marked table dispatches
    # to the native lookup) and defers to jax.value_and_grad: a RowSparse.
    table, ids = random_case(29, ids_shape=(4,))
    loss = lambda p: sq_loss(js.embedding_lookup)(p["e"], ids) + jnp.sum(p["w"])  # noqa: E731
    _, g = js.value_and_grad(loss)({"e": native.mark(table, 4), "w": jnp.ones(2)})
    assert native.is_row_sparse(g["e"])
    assert_close(g["e"].to_dense(), jax.grad(sq_loss(plain_lookup))(table, ids))
    assert_close(g["w"], jnp.ones(2))
