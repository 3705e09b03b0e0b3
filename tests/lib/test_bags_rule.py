"""One bags rule (``jaxslices._ids.in_bags``) at every entry point.

An id outside ``[0, V)`` in a bag is padding: it adds no row, weighs nothing
in the ``"mean"`` / ``"sqrtn"`` denominators, is no ``"max"`` candidate and
gets no gradient. The same batch of bags full of out-of-range ids (``-1``,
``V``, far above, far below, a bag of nothing else) goes through every entry
point, on the native path and on the XLA path, and gives the same pooled
values and table gradients, those of a NumPy reference written from the
rule: ``embedding_bag`` on padded and on jagged ids, ``embedding_lookup``,
the bag layers of NNX, Linen and Equinox (padded, and PyTorch's ``(input,
offsets)``), an ``EmbeddingCollection`` on padded ids and on a
``KeyedJaggedIds``, and a ``ShardingPlan`` over 8 CPU devices placing one
table each way. ``check_ids=True`` raises on the same batch everywhere.
"""

from __future__ import annotations

import contextlib

import _mesh
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslices as js

nnx = pytest.importorskip("flax.nnx")
jnnx = pytest.importorskip("jaxslices.nnx")
jlinen = pytest.importorskip("jaxslices.linen")
jse = pytest.importorskip("jaxslices.equinox")

V, D = 6, 8
# Bags of 4 ids: -1 (a fill), V, 100, -7 and V + 1 are out of range; bag 2 has
# nothing else (it pools to zeros), bag 4 has repeats.
BAGS = [
    [1, -1, 3, V],
    [2, 2, 100, 5],
    [-1, -1, -1, -1],
    [0, 4, -7, 4],
    [V + 1, 3, 3, 3],
]
IDS = np.array(BAGS, np.int32)
POOLED = ("sum", "mean", "sqrtn")  # a collection's combiners
COMBINERS = (*POOLED, "max")
PATHS = ("native", "xla")


def _path(path):
    """The native kernels on (when they load here) or off, for a first trace."""
    return contextlib.nullcontext() if path == "native" else js.kernels.disabled()


def _table(seed=0):
    return np.random.default_rng(seed).normal(size=(V, D)).astype(np.float32)


def _cot(seed=1):
    return np.random.default_rng(seed).normal(size=(len(BAGS), D)).astype(np.float32)


def reference(table, combiner, cot):
    """NumPy, from the rule: pooled ``[B, D]`` and the dense gradient of
    ``sum(pooled * cot)``. Max: PyTorch's CPU rule (the first counted slot
    holding the max wins)."""
    out = np.zeros((len(BAGS), D))
    grad = np.zeros((V, D))
    for b, bag in enumerate(BAGS):
        kept = [i for i in bag if 0 <= i < V]
        if not kept:
            continue
        if combiner == "max":
            for d in range(D):
                best = kept[0]
                for i in kept[1:]:
                    if table[i, d] > table[best, d]:
                        best = i
                out[b, d] = table[best, d]
                grad[best, d] += cot[b, d]
            continue
        scale = {"sum": 1.0, "mean": 1 / len(kept), "sqrtn": len(kept) ** -0.5}
        for i in kept:
            out[b] += table[i] * scale[combiner]
            grad[i] += cot[b] * scale[combiner]
    return out, grad


def _dense(g):
    return np.asarray(g.to_dense() if isinstance(g, js.IndexedSlices) else g)


def _check(got_out, got_grad, table, combiner, cot, what):
    out, grad = reference(table, combiner, cot)
    np.testing.assert_allclose(got_out, out, rtol=1e-5, atol=1e-6, err_msg=what)
    np.testing.assert_allclose(
        _dense(got_grad), grad, rtol=1e-5, atol=1e-6, err_msg=what
    )


def _value_and_grad(fn, *args):
    """``(fn(*args), sparse grad)`` of ``sum(fn * cot)``, jitted (traced anew)."""

    def loss(t, cot):
        out = fn(t, *args)
        return jnp.sum(out * cot), out

    return jax.jit(js.value_and_grad(loss, has_aux=True))


# ------------------------------------------------------------------ functional


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("combiner", COMBINERS)
def test_functional_bags_padded_and_jagged(combiner, path):
    table, cot = _table(), _cot()
    jagged = js.JaggedIds.from_lists(BAGS, max_total=24)
    for what, ids in (("padded", jnp.asarray(IDS)), ("jagged", jagged)):
        with _path(path):
            step = _value_and_grad(
                lambda t, ids: js.embedding_bag(t, ids, combiner=combiner), ids
            )
            (_, out), g = step(jnp.asarray(table), cot)
        _check(out, g, table, combiner, cot, f"embedding_bag {what} {path}")
        # every out-of-range slot is a padding slot of the sparse gradient
        flat = np.asarray(IDS if what == "padded" else jagged.values).reshape(-1)
        real = np.arange(flat.size) < (flat.size if what == "padded" else IDS.size)
        bad = real & ((flat < 0) | (flat >= V))
        assert g.shape == (V, D)
        assert np.all(np.asarray(g.indices)[bad] == V), what
        assert not np.asarray(g.values)[bad].any(), what


def test_the_native_path_is_taken_for_sum_mean_sqrtn():
    if not js.kernels.available():
        pytest.skip(f"no native kernels here: {js.kernels.status()}")
    for combiner in POOLED:

        def f(t, c=combiner):
            return js.embedding_bag(t, jnp.asarray(IDS), combiner=c)

        assert js.kernels.explain(f, jnp.asarray(_table())).native, combiner


@pytest.mark.parametrize("path", PATHS)
def test_embedding_lookup_reads_zeros_and_gives_padding_slots(path):
    table, cot = _table(), _cot()
    with _path(path):
        step = _value_and_grad(lambda t: js.embedding_lookup(t, IDS).sum(axis=1))
        (_, out), g = step(jnp.asarray(table), cot)
    _check(out, g, table, "sum", cot, f"embedding_lookup {path}")
    bad = (IDS < 0) | (IDS >= V)
    assert np.all(np.asarray(g.indices)[bad.reshape(-1)] == V)


# ------------------------------------------------------------------ layers


def _nnx(table, combiner, cot, *args):
    layer = jnnx.EmbedBag(V, D, combiner=combiner, rngs=nnx.Rngs(0))
    layer.embedding.set_value(jnp.asarray(table))
    out = layer(*args)
    g = jnnx.grad(lambda m: jnp.sum(m(*args) * cot))(layer)
    return out, g["embedding"].get_value()


def _linen(table, combiner, cot, *args):
    module = jlinen.EmbedBag(V, D, combiner=combiner)
    params = {"embedding": jnp.asarray(table)}
    f = jax.jit(lambda p: module.apply({"params": p}, *args))
    g = jax.jit(js.grad(lambda p: jnp.sum(module.apply({"params": p}, *args) * cot)))
    return f(params), g(params)["embedding"]


def _equinox(table, combiner, cot, *args):
    layer = jse.EmbeddingBag(weight=jnp.asarray(table), combiner=combiner)
    g = jse.filter_grad(lambda m: jnp.sum(m(*args) * cot))(layer)
    return layer(*args), g.weight


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("layer", [_nnx, _linen, _equinox], ids=lambda f: f.__name__)
def test_bag_layers(layer, combiner, path):
    table, cot = _table(), _cot()
    flat = jnp.asarray(IDS.reshape(-1))
    offsets = jnp.arange(0, IDS.size, IDS.shape[1])
    for what, args in (("padded", (jnp.asarray(IDS),)), ("offsets", (flat, offsets))):
        with _path(path):
            out, g = layer(table, combiner, cot, *args)
        assert isinstance(g, js.IndexedSlices)
        _check(out, g, table, combiner, cot, f"{layer.__name__} {what} {path}")


# ------------------------------------------------------- collections and plans


def _collection():
    return js.EmbeddingCollection(
        [js.TableConfig(c, rows=V, dim=D, combiner=c) for c in POOLED]
        + [js.TableConfig("sum_dp", rows=V, dim=D, combiner="sum")]
    )


def _features(coll):
    return {f: jnp.asarray(IDS) for f in coll.features}


def _kjt(coll):
    return js.KeyedJaggedIds.from_lists({f: BAGS for f in coll.features}, max_total=96)


def _check_collection(coll, tables, outs, dense_params, cots, what):
    grads = coll.unstack(dense_params)
    for f in coll.features:
        t = coll.table_of(f)
        combiner = coll.table_config(t).combiner
        _check(outs[f], grads[t], tables[t], combiner, cots[f], f"{what} {f}")


@pytest.mark.parametrize("path", PATHS)
def test_collection_padded_and_keyed_jagged(path):
    coll = _collection()
    tables = {t.name: _table(k) for k, t in enumerate(coll.tables)}
    cots = {f: _cot(10 + k) for k, f in enumerate(coll.features)}
    params = coll.stack(tables)

    def loss(p, x):
        outs = coll(p, x)
        return sum(jnp.sum(outs[f] * cots[f]) for f in coll.features), outs

    for what, x in (("padded", _features(coll)), ("keyed jagged", _kjt(coll))):
        with _path(path):
            step = jax.jit(js.value_and_grad(loss, has_aux=True))
            (_, outs), g = step(params, x)
        dense = {k: _dense(v) for k, v in g.items()}
        _check_collection(coll, tables, outs, dense, cots, f"collection {what} {path}")


@pytest.mark.parametrize("path", PATHS)
def test_sharding_plan_on_8_devices(path):
    coll = _collection()
    mesh = _mesh.mesh((8,), ("model",))
    plan = js.sharding.ShardingPlan(
        coll,
        mesh,
        "model",
        {
            "sum": "row_wise",
            "mean": "table_wise",
            "sqrtn": "column_wise",
            "sum_dp": "data_parallel",
        },
    )
    tables = {t.name: _table(k) for k, t in enumerate(coll.tables)}
    cots = {f: _cot(10 + k) for k, f in enumerate(coll.features)}
    params = plan.shard(coll.stack(tables))

    def loss(p, x):
        outs = plan(p, x)
        return sum(jnp.sum(outs[f] * cots[f]) for f in coll.features), outs

    for what, x in (("padded", _features(coll)), ("keyed jagged", _kjt(coll))):
        with _path(path):
            step = jax.jit(js.value_and_grad(loss, has_aux=True))
            (_, outs), g = step(params, x)
        dense = plan.unshard({k: _dense(v) for k, v in g.items()})
        _check_collection(coll, tables, outs, dense, cots, f"plan {what} {path}")


# ------------------------------------------------------------------ checked


def test_check_ids_raises_on_the_batch_at_every_entry_point():
    table = jnp.asarray(_table())
    coll = _collection()
    params = coll.stack({t.name: _table() for t in coll.tables})
    calls = {
        "embedding_bag": lambda: js.embedding_bag(table, IDS, check_ids=True),
        "embedding_bag jagged": lambda: js.embedding_bag(
            table, js.JaggedIds.from_lists(BAGS, max_total=24), check_ids=True
        ),
        "embedding_lookup": lambda: js.embedding_lookup(table, IDS, check_ids=True),
        "collection padded": lambda: coll(params, _features(coll), check_ids=True),
        "collection keyed": lambda: coll(params, _kjt(coll), check_ids=True),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match="out of range"):
            call()
