"""Typed indices: generic pytree code cannot silently change which rows update.

Each corruption measured on the first version (issue 9, item 2) now raises a
``TypeError`` whose message names ``IndexedSlices`` and the jaxslices way; and
the typed indices still pass through every JAX transformation unchanged.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import dense_reference, random_slices

import jaxslices as js
from jaxslices import IndexedSlices, _typed_indices

ROOT = Path(__file__).resolve().parents[2]


def grads(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "emb": random_slices(rng, num_rows=9, n=8, row_shape=(3,)),
        "w": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    }


def params():
    return {"emb": jnp.zeros((9, 3)), "w": jnp.zeros(3)}


def raises_naming(fix: str, error=TypeError):
    """``error`` naming IndexedSlices and the jaxslices alternative ``fix``."""
    return pytest.raises(error, match=rf"IndexedSlices(.|\n)*{fix}")


JIT = [False, True]


def maybe_jit(f, use_jit):
    return jax.jit(f) if use_jit else f


# ------------------------------------------------------------- corruptions


@pytest.mark.parametrize("use_jit", JIT)
def test_tree_map_add_raises(use_jit):
    g1, g2 = grads(1), grads(2)
    with raises_naming(r"jaxslices\.tree_add"):
        maybe_jit(lambda a, b: jax.tree.map(jnp.add, a, b), use_jit)(g1, g2)
    with raises_naming(r"jaxslices\.tree_add"):
        maybe_jit(lambda a, b: jax.tree.map(lambda x, y: x + y, a, b), use_jit)(g1, g2)


@pytest.mark.parametrize("use_jit", JIT)
def test_tree_map_scale_raises(use_jit):
    with raises_naming(r"jaxslices\.tree_scale"):
        maybe_jit(lambda g: jax.tree.map(lambda x: 2 * x, g), use_jit)(grads())
    with raises_naming(r"jaxslices\.tree_scale"):
        maybe_jit(lambda g: jax.tree.map(lambda x: x / 4, g), use_jit)(grads())


@pytest.mark.parametrize("reduce", [jax.lax.psum, jax.lax.pmean])
def test_psum_raises(reduce):
    g = jax.tree.map(lambda *x: jnp.stack(x), grads(1), grads(2))
    with raises_naming(r"jaxslices\.tree_psum"):
        jax.vmap(lambda t: reduce(t, "batch"), axis_name="batch")(g)


@pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated")
@pytest.mark.parametrize("use_jit", JIT)
def test_optax_global_norm_raises(use_jit):
    # Before: optax.global_norm counted the indices (49.7 instead of 0.84).
    # Under jit JAX 0.5.3 raises ValueError ("Cannot interpret key<...> as a
    # data type"), later versions TypeError; both name the tag.
    error = (TypeError, ValueError) if use_jit else TypeError
    for norm in (optax.global_norm, optax.tree.norm):
        with raises_naming(r"jaxslices\.global_norm", error):
            maybe_jit(norm, use_jit)(grads())


@pytest.mark.parametrize("use_jit", JIT)
def test_stock_sgd_with_schedule_raises(use_jit):
    # Before: optax.sgd(schedule) multiplied the indices by int(-0.1) == 0, so
    # every update landed on row 0.
    tx = optax.sgd(optax.constant_schedule(0.1))
    with raises_naming(r"jaxslices\.sgd"):
        maybe_jit(tx.update, use_jit)(grads(), tx.init(params()))


@pytest.mark.parametrize("use_jit", JIT)
def test_stock_scale_minus_one_raises(use_jit):
    # Before: optax.scale(-1) made every index negative, so every update was
    # dropped.
    tx = optax.scale(-1.0)
    with raises_naming(r"jaxslices\.scale"):
        maybe_jit(tx.update, use_jit)(grads(), tx.init(params()))


@pytest.mark.parametrize("use_jit", JIT)
def test_other_generic_ops_raise(use_jit):
    # Mixed-precision casts and reductions over the whole tree.
    for f in (
        lambda g: jax.tree.map(lambda x: x.astype(jnp.bfloat16), g),
        lambda g: jax.tree.map(jnp.mean, g),
        lambda g: jax.tree.map(lambda x: -x, g),
        lambda g: optax.tree.add(g, g),
        lambda g: optax.tree.scale(0.5, g),
    ):
        # (a cast under jit raises ValueError: convert_element_type from key<...>);
        # eagerly every one is a TypeError naming the jaxslices way.
        if use_jit:
            with pytest.raises((TypeError, ValueError), match="IndexedSlices"):
                jax.jit(f)(grads())
        else:
            with raises_naming(r"jaxslices\.tree_scale"):
                f(grads())


def test_np_asarray_of_indices_child_names_the_fix():
    child = jax.tree.leaves(grads()["emb"])[1]
    with pytest.raises(TypeError, match=r"IndexedSlices(.|\n)*s\.indices"):
        np.asarray(child)


# -------------------------------------------------------------- the type


def test_indices_property_is_plain_int32_and_constructor_takes_ints():
    for dtype in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32):
        s = IndexedSlices(jnp.ones((3, 1)), np.array([0, 2, 5], dtype), (5, 1))
        assert s.indices.dtype == jnp.int32
        np.testing.assert_array_equal(s.indices, [0, 2, 5])
    # Lists and NumPy int64 (x64 off) are accepted too.
    s = IndexedSlices(np.ones((2, 1)), [1, 1], (3, 1))
    np.testing.assert_array_equal(s.to_dense().ravel(), [0, 2, 0])


def test_negative_and_out_of_range_ids_keep_their_meaning():
    s = IndexedSlices(jnp.ones(3), jnp.array([-1, 3, 1]), (3,))
    np.testing.assert_array_equal(s.indices, [-1, 3, 1])
    np.testing.assert_array_equal(s.to_dense(), [0, 1, 0])
    # uint32 ids >= 2**31 become negative int32: still invalid, never a row.
    big = IndexedSlices(jnp.ones(2), np.array([2**32 - 1, 2], np.uint32), (3,))
    assert int(big.indices[0]) < 0
    np.testing.assert_array_equal(big.to_dense(), [0, 0, 1])


def test_int64_indices_under_x64():
    code = f"""
import sys; sys.path.insert(0, {str(ROOT)!r})
import jax; jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np, jaxslices as js
# Small table: int64 ids are range-checked, then narrowed to int32.
s = js.IndexedSlices(jnp.ones(3), np.array([2**32 + 1, 1, -5], np.int64), (4,))
assert s.indices.dtype == jnp.int32, s.indices.dtype
assert s.to_dense().tolist() == [0, 1, 0, 0], s.to_dense()
# A table with more than 2**31 - 1 rows keeps int64 ids (two uint32 words).
v = 2**31 + 10
ids = np.array([v - 1, 5, -1, v], np.int64)
b = js.IndexedSlices(jnp.ones((4, 2)), ids, (v, 2))
assert b.indices.dtype == jnp.int64 and b.indices.tolist() == ids.tolist()
out = jax.jit(lambda t: t)(b)
assert out.indices.tolist() == ids.tolist()
assert js.coalesce(b).indices.tolist() == [5, v - 1, v, v]
with __import__("pytest").raises(TypeError, match="IndexedSlices"):
    jax.tree.map(lambda x: 2 * x, b)
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_pass_through_jit_donation_scan_device_put_vmap_tree_map():
    s = random_slices(np.random.default_rng(3), num_rows=7, n=6)
    ref = dense_reference(s)

    out = jax.jit(lambda t: t)(s)  # argument and result
    np.testing.assert_array_equal(out.indices, s.indices)
    donated = jax.jit(lambda t: t * 2.0, donate_argnums=0)(jax.tree.map(jnp.copy, s))
    np.testing.assert_allclose(donated.to_dense(), 2 * ref, rtol=1e-6, atol=1e-6)

    carry, _ = jax.lax.scan(lambda c, _: (c * 1.0, None), s, None, length=3)
    np.testing.assert_array_equal(carry.indices, s.indices)

    put = jax.device_put(s)
    np.testing.assert_array_equal(put.indices, s.indices)
    got = jax.device_get(s)
    np.testing.assert_array_equal(np.asarray(got.values), np.asarray(s.values))
    np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(s.indices))

    stacked = jax.tree.map(lambda *x: jnp.stack(x), s, s)
    dense = jax.vmap(lambda t: t.to_dense())(stacked)
    np.testing.assert_allclose(dense[1], ref, rtol=1e-6, atol=1e-6)

    halved = jax.tree.map(
        lambda x: x * 0.5,
        {"emb": s, "w": jnp.ones(2)},
        is_leaf=js.is_indexed_slices,
    )
    np.testing.assert_array_equal(halved["emb"].indices, s.indices)


def test_pickle_in_process_and_in_a_fresh_process():
    s = random_slices(np.random.default_rng(4))
    back = pickle.loads(pickle.dumps(s))
    np.testing.assert_array_equal(back.indices, s.indices)
    np.testing.assert_array_equal(back.to_dense(), s.to_dense())
    code = (
        "import pickle, sys; import jaxslices; "
        "s = pickle.loads(sys.stdin.buffer.read()); print(s.indices.tolist())"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(s),
        env=env,
        capture_output=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.decode().strip() == str(np.asarray(s.indices).tolist())


def test_eval_shape_and_shape_dtype_structs():
    s = random_slices(np.random.default_rng(5), n=5)
    shapes = jax.eval_shape(lambda t: t, s)
    assert isinstance(shapes, IndexedSlices) and shapes.num_slices == 5
    assert shapes.indices == jax.ShapeDtypeStruct((5,), jnp.int32)
    abstract = IndexedSlices(
        jax.ShapeDtypeStruct((5, 3), jnp.float32),
        jax.ShapeDtypeStruct((5,), jnp.int32),
        (7, 3),
    )
    lowered = jax.jit(lambda t: t.to_dense()).lower(abstract)
    assert "7x3" in lowered.as_text()


@pytest.mark.usefixtures("xla_path")  # XLA's structure; native: test_kernels
def test_unwrap_compiles_to_nothing():
    """The compiled step is the same whether indices arrive typed or plain."""
    table = jnp.zeros((7, 3))
    s = random_slices(np.random.default_rng(6))

    def typed(t, s):
        return js.scatter_add(t, s)

    def plain(t, values, indices):
        return js.scatter_add(t, IndexedSlices(values, indices, (7, 3)))

    def kernels(hlo: str) -> list[str]:
        # The opcodes of the entry computation: what runs, fusions included.
        entry = hlo[hlo.index("ENTRY") :]
        return re.findall(r"= \S+ ([a-z][a-z\-]*)\(", entry)

    a = jax.jit(typed).lower(table, s).compile().as_text()
    b = jax.jit(plain).lower(table, s.values, s.indices).compile().as_text()
    # Same kernels: the unwrapping bit cast is fused into the index masking
    # (typed indices arrive as their uint32 words).
    assert kernels(a) == kernels(b)
    assert "fusion" in kernels(a) and "bitcast-convert" not in kernels(a)


def test_unflatten_with_plain_leaves_is_refused_by_consumers():
    s = IndexedSlices(jnp.ones((2, 1)), jnp.array([0, 1]), (3, 1))
    rebuilt = jax.tree.unflatten(jax.tree.structure(s), [s.values, s.indices])
    with pytest.raises(TypeError, match=r"IndexedSlices\(values, indices"):
        rebuilt.indices  # noqa: B018
    with pytest.raises(TypeError, match="IndexedSlices"):
        js.apply_updates(jnp.zeros((3, 1)), rebuilt)


def test_typed_indices_accepted_by_the_constructor():
    s = IndexedSlices(jnp.ones((2, 1)), jnp.array([0, 2]), (3, 1))
    child = jax.tree.leaves(s)[1]
    t = IndexedSlices(jnp.zeros((2, 1)), child, (3, 1))
    assert t._indices is child
    with pytest.raises(ValueError, match="int32 cannot hold the padding index"):
        IndexedSlices(jnp.zeros((2, 1)), child, (2**31 + 10, 1))


def test_eager_messages_installed_on_this_jax():
    IndexedSlices(jnp.ones((1, 1)), jnp.array([0]), (2, 1))  # installs lazily
    assert _typed_indices.MESSAGES_INSTALLED
    # Other keys keep JAX's own behaviour.
    key = jax.random.key(0)
    with pytest.raises(NotImplementedError, match="abstract method"):
        key.real  # noqa: B018
    assert jax.random.randint(key, (), 0, 5).shape == ()


# ------------------------------- tree constructors and elementwise functions
# Issue 18, item 2: jnp.ones_like / full_like (and optax.tree.ones_like /
# full_like) over a gradient tree silently turned every id into the fill value.


@pytest.mark.parametrize("use_jit", JIT)
@pytest.mark.parametrize(
    "make",
    [
        lambda g: jax.tree.map(jnp.ones_like, g),
        lambda g: optax.tree.ones_like(g),
        lambda g: optax.tree.full_like(g, 0.5),
        lambda g: jax.tree.map(lambda x: jnp.full_like(x, 3), g),
        lambda g: jax.tree.map(lambda x: jax.lax.full_like(x, 2), g),
        lambda g: jax.tree.map(lambda x: jnp.full(x.shape, 7, x.dtype), g),
    ],
    ids=["ones_like", "optax.ones_like", "optax.full_like", "full_like", "lax", "full"],
)
def test_nonzero_constructors_raise_naming_the_fix(make, use_jit):
    with raises_naming(r"jaxslices\.tree_map_values"):
        maybe_jit(make, use_jit)(grads())


@pytest.mark.parametrize("use_jit", JIT)
@pytest.mark.parametrize(
    "make",
    [
        lambda g: jax.tree.map(jnp.zeros_like, g),
        lambda g: optax.tree.zeros_like(g),
        lambda g: jax.tree.map(lambda x: jnp.full_like(x, 0), g),
        lambda g: optax.tree.full_like(g, 0.0),
    ],
    ids=["zeros_like", "optax.zeros_like", "full_like_0", "optax.full_like_0"],
)
def test_zero_constructors_give_a_zero_gradient_touching_no_row(make, use_jit):
    g = grads()
    z = maybe_jit(make, use_jit)(g)
    s = z["emb"]
    assert isinstance(s, IndexedSlices) and s.num_slices == g["emb"].num_slices
    assert (np.asarray(s.indices) == -1).all()  # invalid: no row
    np.testing.assert_array_equal(js.to_dense(z)["emb"], np.zeros((9, 3)))
    # A lazy optimizer leaves every row's state alone, as for no gradient.
    tx = js.lazy_adam(0.1)
    state = tx.init(params())
    _, new = tx.update(z, state, params())
    np.testing.assert_array_equal(new[0].mu["emb"], state[0].mu["emb"])


@pytest.mark.parametrize("use_jit", JIT)
def test_where_with_zeros_like_masks_rows(use_jit):
    g = grads()
    keep = g["emb"].indices % 2 == 0

    def masked(g):
        s = g["emb"]
        return jax.tree.map(
            lambda x: jnp.where(
                keep.reshape(keep.shape + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x)
            ),
            s,
        )

    out = maybe_jit(masked, use_jit)(g)
    want = dense_reference(
        IndexedSlices(
            jnp.where(keep[:, None], g["emb"].values, 0.0), g["emb"].indices, (9, 3)
        )
    )
    np.testing.assert_allclose(out.to_dense(), want, rtol=1e-6)


@pytest.mark.parametrize("use_jit", JIT)
def test_predicates_over_a_tree_print_and_refuse_use_as_slices(use_jit):
    g = grads()
    g["emb"] = IndexedSlices(
        g["emb"].values.at[1, 0].set(jnp.nan), g["emb"].indices, (9, 3)
    )
    for f in (jnp.isnan, jnp.isfinite, lambda x: jnp.isnan(x).any()):
        out = maybe_jit(lambda t, f=f: jax.tree.map(f, t), use_jit)(g)
        text = str(out)  # used to raise IndexError: tuple index out of range
        assert "IndexedSlices(values=bool" in text and "indices=bool" in text
        leaves = jax.tree.leaves(out)
        # The leaves are the elementwise answer: the NaN is found, ids are not.
        assert bool(jnp.any(leaves[0])) == (f is not jnp.isfinite) or f is jnp.isfinite
        with raises_naming(r"jaxslices\.tree_map_values"):
            out["emb"].indices  # noqa: B018
        with raises_naming(r"jaxslices\.tree_map_values"):
            js.to_dense(out)
    nan_found = jax.tree.map(lambda x: jnp.isnan(x).any(), g)
    assert any(bool(x) for x in jax.tree.leaves(nan_found))


_UNARY = {
    name: getattr(jnp, name)
    for name in (
        "abs absolute negative positive sign square sqrt cbrt exp exp2 expm1 log "
        "log1p log2 log10 sin cos tan tanh arcsinh floor ceil round rint trunc "
        "reciprocal isnan isfinite isinf isneginf isposinf signbit logical_not "
        "invert real imag conj conjugate angle nan_to_num copy asarray array "
        "ravel zeros_like ones_like empty_like deg2rad sinc i0 spacing"
    ).split()
}
_UNARY.update(
    {
        "clip": lambda x: jnp.clip(x, -1, 1),
        "astype_f32": lambda x: x.astype(jnp.float32),
        "astype_bf16": lambda x: jnp.astype(x, jnp.bfloat16),
        "astype_i32": lambda x: jnp.asarray(x, jnp.int32),
        "full_like_3": lambda x: jnp.full_like(x, 3),
        "where_self": lambda x: jnp.where(True, x, x),
        "reshape": lambda x: x.reshape(x.shape),
        "stop_gradient": jax.lax.stop_gradient,
        "sum": jnp.sum,
        "mean": jnp.mean,
        "max": jnp.max,
        "cumsum": jnp.cumsum,
        "sort": jnp.sort,
    }
)
_BINARY = {
    name: getattr(jnp, name)
    for name in (
        "add subtract multiply divide true_divide floor_divide power maximum "
        "minimum fmax fmin hypot arctan2 equal not_equal less greater "
        "logical_and logical_or bitwise_and bitwise_or mod remainder copysign "
        "nextafter logaddexp isclose"
    ).split()
}


def _elementwise_cases():
    for name, f in _UNARY.items():
        yield name, lambda t, f=f: jax.tree.map(f, t)
    for name, f in _BINARY.items():
        yield name, lambda t, f=f: jax.tree.map(lambda x, f=f: f(x, x), t)


@pytest.mark.parametrize("use_jit", JIT)
@pytest.mark.parametrize("name,fn", list(_elementwise_cases()))
def test_any_elementwise_function_over_a_tree_is_right_or_raises(name, fn, use_jit):
    """jax.tree.map(f, grads) for every elementwise f: never different row ids.

    Either it raises an error naming IndexedSlices (and the jaxslices way), or
    the ids come back unchanged (the right answer for a function of the values
    only), or all invalid with zero values (a zero fill: touches no row), or
    not ids at all (a predicate's booleans), which prints and which every
    jaxslices entry point refuses, naming tree_map_values.
    """
    g = grads()
    ids = np.asarray(g["emb"].indices)
    try:  # functions that refuse float gradients anyway (bitwise ops) are skipped
        maybe_jit(fn, use_jit)(js.to_dense(g))
    except TypeError:
        with pytest.raises(TypeError):
            maybe_jit(fn, use_jit)(g)
        return
    try:
        out = maybe_jit(fn, use_jit)(g)
    except (TypeError, ValueError, NotImplementedError) as e:
        assert re.search(r"IndexedSlices", str(e)), f"{name}: {e}"
        return
    s = out["emb"]
    repr(s)
    if _typed_indices.is_typed(s._indices):
        got = np.asarray(s.indices)
        if name in ("empty_like",):  # uninitialized, as JAX's values (JAX >= 0.11)
            return
        if (got == -1).all():
            np.testing.assert_array_equal(np.asarray(s.values), 0)
        else:
            np.testing.assert_array_equal(got, ids, err_msg=name)
    else:
        with raises_naming(r"jaxslices\.tree_map_values"):
            s.indices  # noqa: B018
        with pytest.raises(TypeError, match="IndexedSlices"):
            js.apply_updates(params(), out)


def test_tree_map_values_refuses_a_function_that_changes_the_row_shape():
    g = grads()
    with pytest.raises(ValueError, match=r"tree_map_values \(leaf \['emb'\]\).*row"):
        js.tree_map_values(lambda v: v.sum(-1), g)
    with pytest.raises(ValueError, match=r"\(8, 3\)"):
        jax.jit(lambda t: js.tree_map_values(lambda v: v[:4], t))(g)
    # Casting and scaling keep the shape: fine, ids kept.
    out = js.tree_map_values(lambda v: (2 * v).astype(jnp.bfloat16), g)
    np.testing.assert_array_equal(out["emb"].indices, g["emb"].indices)
    np.testing.assert_allclose(
        js.to_dense(out)["emb"].astype(np.float32),
        2 * dense_reference(g["emb"]),
        rtol=1e-2,
        atol=1e-2,
    )


def test_ids_at_the_int32_edge_under_x64():
    """Issue 18, item 8: uint32 ids >= 2**31 of a table of more rows, messages."""
    code = f"""
import sys; sys.path.insert(0, {str(ROOT)!r})
import jax; jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np, pytest, jaxslices as js
v = 2**31 + 10
ids = np.array([2**31 + 5, 3, 2**32 - 1, v], np.uint32)  # 2**32 - 1 >= v: invalid
s = js.IndexedSlices(jnp.ones((4, 1)), ids, (v, 1))
assert s.indices.dtype == jnp.int64, s.indices.dtype
assert s.indices.tolist() == [2**31 + 5, 3, 2**32 - 1, v], s.indices
assert js.coalesce(s).indices.tolist() == [3, 2**31 + 5, v, v]
assert jax.jit(lambda t: t)(s).indices.tolist() == s.indices.tolist()
with pytest.raises(ValueError, match="int32 cannot hold the padding index.*int64"):
    js.IndexedSlices(jnp.ones(1), np.array([1], np.int32), (v,))
with pytest.raises(ValueError, match="int8 cannot hold.*use int32 indices"):
    js.IndexedSlices(jnp.ones(1), np.array([1], np.int8), (300,))
print("ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_huge_tables_without_x64_say_how_to_enable_it():
    with pytest.raises(ValueError, match=r"jax_enable_x64"):
        IndexedSlices(jnp.ones((1, 1)), np.array([5], np.uint32), (2**31 + 10, 1))
