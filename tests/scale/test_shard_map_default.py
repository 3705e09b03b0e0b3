"""``jax.shard_map`` with its default settings (``check_vma=True``), as users write it.

In this mode JAX types every value with the mesh axes it varies over, and the
gradient of a replicated parameter is the *sum* over devices of the devices'
gradients (the transpose of the implicit cast of the parameter to "varying").
Every documented path must work here and equal one device's result:

* plain ``jax.grad`` through ``jaxslices.embedding_lookup`` /
  ``embedding_bag`` (the dense fallback), and the framework layers under the
  frameworks' own gradients (``nnx.grad``, ``eqx.filter_grad``, ``jax.grad``
  of a Linen ``apply``): the same as ``table[ids]`` / the stock layers there
  (it raised "Custom VJP bwd rule must produce an output with the same type");
* ``jaxslices.value_and_grad`` and the frameworks' jaxslices gradients: sparse,
  equal to the dense gradient;
* the data-parallel step of ``docs/scale_out.md``: the loss is the ``pmean``
  over devices, and the step equals the single-device step on the global batch;
* ``jaxslices.tree_psum`` / ``tree_pmean`` follow ``jax.lax.psum`` / ``pmean``
  on the dense leaves: slices that vary over the axis are gathered, slices that
  are the same on every device are counted ``n`` times (psum) or once (pmean).
"""

from __future__ import annotations

import _mesh
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxslices as js
import jaxslices.equinox as jse
import jaxslices.linen
import jaxslices.nnx
from tools import hlo as _hlo

V, D, B, L = 64, 4, 16, 3
N = 8  # devices


def _data(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V // 4, size=(B, L)).astype(np.int32)
    ids[0, 1] = ids[0, 0]
    ids[5, 2] = V + 3  # out of range: zeros, no gradient
    return jnp.asarray(ids), jnp.asarray(rng.normal(size=B), jnp.float32)


def _smap(f, in_specs, out_specs):
    return jax.jit(
        jax.shard_map(f, mesh=_mesh.mesh(), in_specs=in_specs, out_specs=out_specs)
    )


def _close(a, b, rtol=2e-5, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _table(seed=1):
    return jax.random.normal(jax.random.key(seed), (V, D))


def _sum_loss(lookup):
    def loss(table, ids):
        return jnp.sum(jnp.tanh(lookup(table, ids)) ** 2)

    return loss


LOOKUPS = {
    "embedding_lookup": js.embedding_lookup,
    "embedding_bag": lambda t, i: js.embedding_bag(t, i, combiner="sum"),
}
PLAIN = {
    "embedding_lookup": lambda t, i: t.at[i].get(mode="fill", fill_value=0),
    "embedding_bag": lambda t, i: t.at[i].get(mode="fill", fill_value=0).sum(-2),
}


@pytest.mark.parametrize("name", list(LOOKUPS))
def test_plain_jax_grad_equals_table_indexing(name):
    ids, _ = _data()
    table = _table()
    got = _smap(jax.grad(_sum_loss(LOOKUPS[name])), (P(), P("data")), P())(table, ids)
    want = _smap(jax.grad(_sum_loss(PLAIN[name])), (P(), P("data")), P())(table, ids)
    one_device = jax.grad(_sum_loss(PLAIN[name]))(table, ids)  # sum over devices
    _close(got, want)
    _close(got, one_device)


@pytest.mark.parametrize("name", list(LOOKUPS))
def test_jaxslices_grad_is_sparse_and_equals_one_device(name):
    ids, _ = _data()
    table = _table()

    def per_device(table, ids):
        g = js.grad(_sum_loss(LOOKUPS[name]))(table, ids)
        assert js.is_indexed_slices(g)
        return js.to_dense(g)

    got = _smap(per_device, (P(), P("data")), P())(table, ids)
    _close(got, jax.grad(_sum_loss(PLAIN[name]))(table, ids))


# ------------------------------------------------------- the documented step


def _doc_loss(params, ids, y):
    h = js.embedding_lookup(params["emb"], ids).mean(1)
    return jnp.mean((jnp.tanh(h) @ params["w"] - y) ** 2)


@pytest.mark.parametrize(
    "name", ["sgd", "clip_by_global_norm_tight", "lazy_adam", "adagrad"]
)
def test_data_parallel_step_of_the_docs(name):
    """docs/scale_out.md: the loss's pmean over devices, default shard_map."""
    m = _mesh.mesh()
    tx = _mesh.OPTIMIZERS[name]()
    params0 = _mesh.init_params(V, D)
    ids, y = _data()
    ref_step = _mesh.reference_step(tx)
    ref = ref_step(params0, tx.init(params0), ids, y)

    def global_loss(params, ids, y):
        return jax.lax.pmean(_doc_loss(params, ids, y), "data")

    def per_device(params, state, ids, y):
        loss, grads = js.value_and_grad(global_loss)(params, ids, y)
        assert js.is_indexed_slices(grads["emb"])
        updates, state = tx.update(grads, state, params)
        return js.apply_updates(params, updates), state, loss

    step = _smap(per_device, (P(), P(), P("data"), P("data")), (P(), P(), P()))
    args = _mesh.data_parallel_args(m, tx, params0, ids, y)
    compiled = step.lower(*args).compile()
    _hlo.assert_no_table_sized(compiled, V, D)
    ref_params, ref_state, _ = ref
    # The reference loss uses the same loss_fn (mean over the global batch).
    ref_loss = _mesh.loss_fn(params0, ids, y)
    out = compiled(*args)
    _close(out[:2], (ref_params, ref_state))
    np.testing.assert_allclose(out[2], ref_loss, rtol=1e-5)


def test_tree_psum_and_pmean_follow_jax_on_the_dense_leaves():
    """Same rule for slices as jax.lax.psum/pmean gives the dense leaf ``w``."""
    ids, y = _data()
    params = _mesh.init_params(V, D)

    def per_device(params, ids, y):
        g = js.grad(_doc_loss)(params, ids, y)  # summed over devices already
        local = js.IndexedSlices(jnp.ones((ids.shape[0], D)), ids[:, 0], (V, D))
        out = {}
        for red, fn in (("psum", js.tree_psum), ("pmean", js.tree_pmean)):
            dense = js.to_dense(fn(g, "data"))
            per_dev = fn({"local": local}, "data")["local"]  # varies: gathered
            out[red] = (dense, js.to_dense(per_dev))
        out["jax"] = {
            "psum": jax.lax.psum(g["w"], "data"),
            "pmean": jax.lax.pmean(g["w"], "data"),
        }
        out["grad"] = js.to_dense(g)
        return out

    out = _smap(per_device, (P(), P("data"), P("data")), P())(params, ids, y)
    one = jax.grad(_doc_loss)(params, ids, y)
    per_device_grads = [
        jax.grad(_doc_loss)(params, ids[i * 2 : (i + 1) * 2], y[i * 2 : (i + 1) * 2])
        for i in range(N)
    ]
    total = jax.tree.map(lambda *g: sum(g), *per_device_grads)
    _close(out["grad"], total)  # JAX's rule in this mode: the sum over devices
    _close(out["jax"]["psum"], N * total["w"])
    _close(out["jax"]["pmean"], total["w"])
    _close(out["psum"][0], jax.tree.map(lambda x: N * x, total))
    _close(out["pmean"][0], total)
    counts = jnp.zeros((V, D)).at[ids[:, 0]].add(1.0, mode="drop")
    _close(out["psum"][1], counts)
    _close(out["pmean"][1], counts / N)
    del one


def test_tree_pmean_with_check_vma_false_still_averages():
    ids, y = _data()
    params = _mesh.init_params(V, D)

    def per_device(params, ids, y):
        return js.to_dense(js.tree_pmean(js.grad(_doc_loss)(params, ids, y), "data"))

    f = jax.jit(
        jax.shard_map(
            per_device,
            mesh=_mesh.mesh(),
            in_specs=(P(), P("data"), P("data")),
            out_specs=P(),
            check_vma=False,
        )
    )
    per_device_grads = [
        jax.grad(_doc_loss)(params, ids[i * 2 : (i + 1) * 2], y[i * 2 : (i + 1) * 2])
        for i in range(N)
    ]
    _close(f(params, ids, y), jax.tree.map(lambda *g: sum(g) / N, *per_device_grads))


# ----------------------------------------------------------- the frameworks


def _in_range(ids, y):
    """The stock layers read NaN (Flax) or clamp (Equinox) out of range."""
    return jnp.minimum(ids, V - 1), y


class _NnxModel(nnx.Module):
    def __init__(self, embed_cls, rngs):
        self.embed = embed_cls(V, D, rngs=rngs)
        self.w = nnx.Param(jnp.linspace(-1.0, 1.0, D))

    def __call__(self, ids):
        return jnp.tanh(self.embed(ids).mean(1)) @ self.w[...]


def _nnx_loss(model, ids, y):
    return jnp.mean((model(ids) - y) ** 2)


@pytest.mark.parametrize("grad", ["nnx.grad", "jaxslices.nnx.grad"])
def test_nnx_inside_shard_map(grad):
    ids, y = _in_range(*_data())
    stock = _NnxModel(nnx.Embed, nnx.Rngs(0))
    ours = _NnxModel(jaxslices.nnx.Embed, nnx.Rngs(0))
    gfn = nnx.grad if grad == "nnx.grad" else jaxslices.nnx.grad

    def run(model, gfn):
        graphdef, state = nnx.split(model)

        def per_device(state, ids, y):
            g = gfn(_nnx_loss)(nnx.merge(graphdef, state), ids, y)
            return js.to_dense(nnx.to_pure_dict(g))

        return _smap(per_device, (P(), P("data"), P("data")), P())(state, ids, y)

    want = js.to_dense(nnx.to_pure_dict(nnx.grad(_nnx_loss)(stock, ids, y)))
    got = run(ours, gfn)
    # Per-device losses are means over the local batch; summed over 8 devices.
    _close(got, jax.tree.map(lambda x: N * x, want))
    if grad == "nnx.grad":
        _close(got, run(stock, nnx.grad))


def test_linen_inside_shard_map():
    ids, y = _in_range(*_data())

    class Tower(nn.Module):
        embed: type

        @nn.compact
        def __call__(self, ids):
            h = self.embed(num_embeddings=V, features=D)(ids)
            return nn.Dense(1)(h.mean(axis=1))[:, 0]

    ours, stock = Tower(jaxslices.linen.Embed), Tower(nn.Embed)
    params = stock.init(jax.random.key(0), ids)["params"]

    def loss(model):
        def f(params, ids, y):
            return jnp.mean((model.apply({"params": params}, ids) - y) ** 2)

        return f

    def per_device(params, ids, y):
        return (
            jax.grad(loss(ours))(params, ids, y),
            js.to_dense(js.grad(loss(ours))(params, ids, y)),
            jax.grad(loss(stock))(params, ids, y),
        )

    got_dense, got_sparse, want = _smap(per_device, (P(), P("data"), P("data")), P())(
        params, ids, y
    )
    _close(got_dense, want)
    _close(got_sparse, want)


class _EqxModel(eqx.Module):
    embedding: eqx.Module
    w: jax.Array

    def __call__(self, ids):
        return jnp.tanh(jnp.mean(jax.vmap(self.embedding)(ids), 0)) @ self.w


def _eqx_loss(model, ids, y):
    return jnp.mean((jax.vmap(model)(ids) - y) ** 2)


def test_equinox_inside_shard_map():
    ids, y = _in_range(*_data())
    key = jax.random.key(0)
    w = jnp.linspace(-1.0, 1.0, D)
    ours = _EqxModel(jse.Embedding(V, D, key=key), w)
    stock = _EqxModel(eqx.nn.Embedding(V, D, key=key), w)
    params, static = eqx.partition(ours, eqx.is_inexact_array)
    s_params, s_static = eqx.partition(stock, eqx.is_inexact_array)

    def per_device(params, s_params, ids, y):
        model, stock_model = (
            eqx.combine(params, static),
            eqx.combine(s_params, s_static),
        )
        return (
            eqx.filter_grad(_eqx_loss)(model, ids, y),
            js.to_dense(jse.filter_grad(_eqx_loss)(model, ids, y)),
            eqx.filter_grad(_eqx_loss)(stock_model, ids, y),
        )

    got_dense, got_sparse, want = _smap(
        per_device, (P(), P(), P("data"), P("data")), P()
    )(params, s_params, ids, y)
    leaves = lambda t: jax.tree.leaves(eqx.filter(t, eqx.is_inexact_array))  # noqa: E731
    _close(leaves(got_dense), leaves(want))
    _close(leaves(got_sparse), leaves(want))
