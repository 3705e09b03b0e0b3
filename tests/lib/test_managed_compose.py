"""Managed-collision tables composed with the rest of jaxslices.

A remapped batch feeds ``embedding_bag`` / ``embedding_lookup`` and an
optimizer step, with evicted rows reset (:func:`jaxslices.reset_rows`):
the sparse training run equals the dense one (``jax.grad`` of the same loss,
stock Optax); ``reset_rows`` gives every optimizer's initial values to the
evicted rows only; the NNX layer, a collection with ``KeyedJaggedIds``
(``remap_keyed``) and an Orbax checkpoint of table + remap state + optimizer
state, resumed bit for bit.
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import registry

import jaxslices as js

S, D, B, L = 12, 3, 4, 3


def _loss(params, rows, y):
    e = js.embedding_bag(params["emb"], rows, combiner="mean")
    return jnp.mean((e @ params["w"] - y) ** 2)


def _dense_loss(params, rows, y):
    """The same loss written with plain JAX: default rows (``S``) weigh nothing."""
    valid = rows < S
    got = jnp.take(params["emb"], jnp.where(valid, rows, 0), axis=0)
    got = jnp.where(valid[..., None], got, 0.0)
    n = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)
    return jnp.mean((got.sum(1) / n @ params["w"] - y) ** 2)


def _stream(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for t in range(steps):
        # drift: the id pool moves; 64-bit ids
        ids = rng.integers(0, 10, size=(B, L)) + 4 * t + 2**40
        yield js.RawIds.from_int64(ids), jnp.asarray(rng.normal(size=(B,)), jnp.float32)


def _make_step(mc, opt, grad_fn, loss):
    def step(params, opt_state, rstate, raw, y, t):
        rows, rstate, evicted = mc.remap(rstate, raw)
        fresh = 0.01 * jax.random.normal(
            jax.random.fold_in(jax.random.key(7), t), (mc.evict_count, D)
        )
        params, opt_state = js.reset_rows(
            params, opt_state, evicted, fresh, where=lambda p: p["emb"], optimizer=opt
        )
        value, grads = grad_fn(loss)(params, rows, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return js.apply_updates(params, updates), opt_state, rstate, value, grads, rows

    return jax.jit(step)


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"emb": jax.random.normal(k1, (S, D)), "w": jax.random.normal(k2, (D,))}


@pytest.mark.parametrize("policy", ["lfu"])  # lru: the model test covers it
def test_training_with_remap_equals_the_dense_run(policy):
    mc = js.ManagedCollision(
        "items", num_slots=S, policy=policy, evict_every=2, evict_count=4
    )
    sparse = _make_step(mc, js.adagrad(0.1), js.value_and_grad, _loss)
    dense = _make_step(
        mc, optax.adagrad(0.1), lambda f: jax.value_and_grad(f), _dense_loss
    )
    p1 = p2 = _params()
    s1, s2 = js.adagrad(0.1).init(p1), optax.adagrad(0.1).init(p2)
    r1 = r2 = mc.init()
    for t, (raw, y) in enumerate(_stream(8)):
        p1, s1, r1, l1, g1, rows1 = sparse(p1, s1, r1, raw, y, t)
        p2, s2, r2, l2, g2, rows2 = dense(p2, s2, r2, raw, y, t)
        np.testing.assert_array_equal(rows1, rows2)
        assert isinstance(g1["emb"], js.IndexedSlices)
        np.testing.assert_allclose(
            js.to_dense(g1)["emb"], g2["emb"], rtol=1e-5, atol=1e-7
        )
        np.testing.assert_allclose(l1, l2, rtol=1e-6)
        np.testing.assert_allclose(p1["emb"], p2["emb"], rtol=1e-5, atol=1e-6)
    stats = {k: int(v) for k, v in r1.stats().items()}
    assert stats["evictions"] > 0 and stats["defaulted"] > 0  # both paths ran


OPTIMIZERS = {
    **registry.pick("sgd_momentum", "adagrad", "rowwise_adagrad", "lazy_adam", "ftrl"),
    # local: a multi_transform with stock Optax, no registry entry
    "optax_adam_multi": lambda: optax.multi_transform(
        {"emb": js.lazy_adam(0.01), "w": optax.adam(0.01)}, {"emb": "emb", "w": "w"}
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_reset_rows_gives_initial_state_to_those_rows_only(name):
    opt = OPTIMIZERS[name]()
    params = _params()
    ids = jnp.array([[0, 1, 2], [3, 4, 5], [6, 7, 1], [2, 3, 9]])
    # two steps: every state away from its initial values
    params, state = harness.fit(opt, _loss, params, [(ids, jnp.ones(B))] * 2)
    rows = jnp.array([1, 9, S])  # S: an unused entry, ignored
    new_params, new_state = jax.jit(
        lambda p, s: js.reset_rows(
            p, s, rows, -1.0, where=lambda p: p["emb"], optimizer=opt
        )
    )(params, state)
    initial = opt.init(params)
    touched = np.isin(np.arange(S), [1, 9])
    np.testing.assert_array_equal(new_params["emb"][touched], -1.0)
    np.testing.assert_array_equal(new_params["emb"][~touched], params["emb"][~touched])
    np.testing.assert_array_equal(new_params["w"], params["w"])
    changed = 0
    for new, old, init in zip(
        jax.tree.leaves(new_state),
        jax.tree.leaves(state),
        jax.tree.leaves(initial),
        strict=True,
    ):
        if new.ndim and new.shape[0] == S and new.shape != params["w"].shape:
            np.testing.assert_array_equal(new[touched], init[touched])
            np.testing.assert_array_equal(new[~touched], old[~touched])
            changed += int(not np.array_equal(new, old))
        else:
            np.testing.assert_array_equal(new, old)  # counts, other params' state
    assert changed  # the state of the table was reset somewhere


def test_reset_rows_bad_input():
    params, opt = _params(), js.adagrad(0.1)
    state = opt.init(params)
    with pytest.raises(
        TypeError, match=r"`rows` must be a 1-D integer array .*float32"
    ):
        js.reset_rows(
            params, state, jnp.ones(2), 0.0, where=lambda p: p["emb"], optimizer=opt
        )
    with pytest.raises(ValueError, match=r"`where\(params\)` must return one leaf"):
        js.reset_rows(
            params,
            state,
            jnp.array([1]),
            0.0,
            where=lambda p: jnp.ones(3),
            optimizer=opt,
        )
    with pytest.raises(
        ValueError, match=r"`opt_state` is not the state of `optimizer`"
    ):
        js.reset_rows(
            params,
            js.lazy_adam(0.1).init(params),
            jnp.array([1]),
            0.0,
            where=lambda p: p["emb"],
            optimizer=opt,
        )


def test_lookup_of_the_default_reads_zeros_and_trains_nothing():
    mc = js.ManagedCollision("t", num_slots=2)
    rows, _, _ = mc.remap(mc.init(), [[5, 6, 7]])  # 7 is not admitted
    table = jnp.ones((2, D))
    np.testing.assert_array_equal(js.embedding_lookup(table, rows)[0, 2], 0.0)
    g = js.grad(lambda t: js.embedding_lookup(t, rows).sum())(table)
    dense = jax.grad(
        lambda t: jnp.take(t, rows, axis=0, mode="fill", fill_value=0).sum()
    )(table)
    np.testing.assert_array_equal(js.to_dense(g), dense)
    np.testing.assert_array_equal(js.to_dense(g)[:, 0], [1.0, 1.0])  # no row 7


def test_nnx_layer_with_remapped_ids():
    nnx = pytest.importorskip("flax.nnx")
    import jaxslices.nnx as jsnnx

    mc = js.ManagedCollision("t", num_slots=4)
    rows, rstate, _ = mc.remap(mc.init(), np.array([[10, 11], [12, 13], [14, 10]]))
    assert int(rows.max()) == 4  # 14 got no row
    model = jsnnx.Embed(4, D, rngs=nnx.Rngs(0))

    def loss(m):
        return jnp.sum(m(rows) ** 2)

    np.testing.assert_array_equal(model(rows)[2, 0], 0.0)
    grads = jsnnx.grad(loss)(model)
    dense = nnx.grad(
        lambda m: jnp.sum(
            jnp.take(m.embedding[...], rows, axis=0, mode="fill", fill_value=0) ** 2
        )
    )(model)
    sparse = grads["embedding"].get_value()
    assert isinstance(sparse, js.IndexedSlices)
    np.testing.assert_allclose(sparse.to_dense(), dense["embedding"][...], rtol=1e-6)


def test_collection_with_keyed_ids():
    tables = [
        js.TableConfig("items", 6, 2, features=("item", "clicked")),
        js.TableConfig("users", 5, 2, features=("user",)),
        js.TableConfig("plain", 3, 2, features=("country",)),
    ]
    coll = js.EmbeddingCollection(tables)
    managers = {
        "items": js.ManagedCollision(
            "items", num_slots=6, evict_every=2, evict_count=2
        ),
        "users": js.ManagedCollision("users", num_slots=5, policy="lru"),
    }
    states = {k: m.init() for k, m in managers.items()}
    kjt = js.KeyedJaggedIds.from_lists(
        {
            "item": [[10**9, 42], [7]],
            "clicked": [[42], [10**9, 8, 9]],
            "user": [[-5], [123456789]],
            "country": [[2], [0]],
        },
        max_total=14,
    )
    out, states, evicted = jax.jit(
        lambda states, kjt: js.remap_keyed(managers, states, kjt, coll)
    )(states, kjt)
    vals = np.asarray(out.values)[: int(kjt.offsets[-1])].tolist()
    # item + clicked share table "items": one raw id, one row, whichever feature
    # (ids admitted in their order: 7 < 8 < 9 < 42 < 10**9)
    assert vals[:3] == [4, 3, 0] and vals[3:7] == [3, 4, 1, 2]
    assert vals[7:9] == [1, 0]  # users: admitted in unsigned order, 2**64 - 5 last
    assert vals[9:] == [2, 0]  # the unmanaged table keeps its ids
    assert set(evicted) == {"items", "users"}
    buffer, base = coll.placement("users")
    assert np.asarray(evicted["users"]).tolist() == [coll.shapes[buffer][0]]
    params = coll.init(jax.random.key(0))

    def loss(p):
        return sum(jnp.sum(v**2) for v in coll(p, out).values())

    g = js.grad(loss)(params)
    dense = jax.grad(loss)(params)
    for name in params:
        np.testing.assert_allclose(js.to_dense(g[name]), dense[name], rtol=1e-6)
    assert {int(states[k].occupancy) for k in states} == {5, 2}
    with pytest.raises(ValueError, match=r"num_slots=4 but table 'items' has rows=6"):
        js.remap_keyed(
            {"items": js.ManagedCollision("items", num_slots=4)},
            {"items": js.ManagedCollision("items", num_slots=4).init()},
            kjt,
            coll,
        )


def test_orbax_checkpoint_resumes_bitwise(tmp_path):
    """The whole state saved, the admission filter's buckets and the decayed
    counts' steps included."""
    mc = js.ManagedCollision(
        "items", num_slots=S, policy="lfu", evict_every=3, evict_count=3,
        min_count=2, half_life=3, ttl=4,
    )  # fmt: skip
    opt = js.lazy_adam(0.05)
    step = _make_step(mc, opt, js.value_and_grad, _loss)
    params = _params()
    run = (params, opt.init(params), mc.init())
    batches = list(_stream(8, seed=3))

    def advance(run, ts):
        for t in ts:
            raw, y = batches[t]
            p, s, r, *_ = step(*run, raw, y, t)
            run = (p, s, r)
        return run

    run = advance(run, range(4))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", run)
    ckptr.wait_until_finished()
    restored = ckptr.restore(tmp_path / "ckpt", jax.eval_shape(lambda: run))
    ckptr.close()
    assert jax.tree.structure(restored) == jax.tree.structure(run)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(run), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert isinstance(restored[2], js.RemapState)
    mc.remap(restored[2], [1])  # the restored state is this table's
    straight = advance(run, range(4, 8))
    resumed = advance(restored, range(4, 8))
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(straight[2].evictions) > 0
    assert int(run[2].filter_counts.sum()) > 0  # the saved filter held counts
