"""Row-sharded tables (model parallel): masked and all-to-all routing.

The table and its optimizer state are sharded by rows over a mesh axis; a step
must never gather, all-reduce or replicate a table (or a table shard), its
outputs keep the table's sharding, and its results equal one device's.
"""

import functools

import _mesh
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxslices as js
from tools import hlo as _hlo

# V is chosen so that a shard (V / 8 rows) is larger than the hash coalesce's
# 4N-cell workspace (N = B * L ids), which masked routing may all-reduce: that is
# O(batch), not table-sized, but a shard of the same size would be flagged.
V, D, B, L = 8192, 8, 32, 4


def _sharded_step(tx, routing, axis, capacity=None):
    lookup = functools.partial(
        js.sharding.sharded_lookup, axis=axis, routing=routing, capacity=capacity
    )

    def step(params, state, ids, y):
        loss, grads = js.value_and_grad(_mesh.loss_fn)(params, ids, y, lookup)
        params, state = js.sharding.sharded_update(
            tx, grads, state, params, axis=axis, routing=routing, capacity=capacity
        )
        return params, state, loss

    return step


def _run(
    tx_name,
    routing,
    *,
    num_rows=V,
    shape=(8,),
    names=("model",),
    axis="model",
    capacity=None,
    steps=2,
    compile_only=False,
):
    m = _mesh.mesh(shape, names)
    tx = _mesh.OPTIMIZERS[tx_name]()
    params0 = _mesh.init_params(num_rows, D)
    batches = [_mesh.batch(num_rows, B, L, seed=s) for s in range(steps)]

    p1 = s1 = loss1 = None
    if not compile_only:
        p1, s1 = params0, tx.init(params0)
        single = _mesh.reference_step(tx)
        for ids, y in batches:
            p1, s1, loss1 = single(p1, s1, ids, y)

    params = {
        "emb": js.sharding.shard_rows(params0["emb"], m, axis),
        "w": jax.device_put(params0["w"], NamedSharding(m, P())),
    }
    state = js.sharding.sharded_init(tx, params)
    bat = NamedSharding(m, P(tuple(names)))
    placed = [(jax.device_put(i, bat), jax.device_put(y, bat)) for i, y in batches]
    step = jax.jit(_sharded_step(tx, routing, axis, capacity), donate_argnums=(0, 1))
    compiled = step.lower(params, state, *placed[0]).compile()
    if compile_only:
        return compiled
    for ids, y in placed:
        params, state, loss = compiled(params, state, ids, y)
    return compiled, (p1, s1, loss1), (params, state, loss), m


def _unpad(tree, num_rows):
    return jax.tree.map(
        lambda x: x[:num_rows] if x.ndim and x.shape[0] > num_rows else x, tree
    )


def _check(compiled, ref, out, m, num_rows=V, axis="model"):
    shard = -(-num_rows // m.shape[axis])
    _hlo.assert_no_table_sized(compiled, shard, D)
    params, state, loss = out
    _mesh.assert_trees_close(_unpad((params, state), num_rows), ref[:2])
    np.testing.assert_allclose(loss, ref[2], rtol=1e-5)
    row_sharded = NamedSharding(m, P(axis))
    padded = shard * m.shape[axis]
    for leaf in jax.tree.leaves((params, state)):
        if leaf.ndim and leaf.shape[0] == padded:  # table, state: still by rows
            assert leaf.sharding.is_equivalent_to(row_sharded, 2), leaf.sharding
    # Nothing table-sized is held whole by a device (growth with V: below).
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < num_rows * D * 4 / 2, temp


@pytest.mark.parametrize("name", list(_mesh.OPTIMIZERS))
def test_masked(name):
    _check(*_run(name, "masked"))


@pytest.mark.parametrize("name", list(_mesh.OPTIMIZERS))
def test_all_to_all(name):
    compiled, *rest = _run(name, "all_to_all")
    _check(compiled, *rest)
    assert any(c.kind == "all-to-all" for c in _hlo.collectives(compiled))


def test_all_to_all_global_norm_clipping_sums_over_shards():
    """clip_by_global_norm: the norm of all rows (every shard's), as one device.

    It used to fail with JAX's shard_map message about a function 'local'. The
    batch's gradient norm is far above the clip (0.05), so clipping is active;
    on a 2-D mesh the table is replicated over "data", whose replicas must not
    count their rows twice.
    """
    params0 = _mesh.init_params(V, D)
    ids, y = _mesh.batch(V, B, L, seed=0)
    grads = js.grad(_mesh.loss_fn)(params0, ids, y)
    assert float(js.global_norm(grads)) > 0.5
    for shape, names in (((8,), ("model",)), ((2, 4), ("data", "model"))):
        compiled, *rest = _run(
            "clip_by_global_norm_tight", "all_to_all", shape=shape, names=names
        )
        _check(compiled, *rest)


def test_all_to_all_apply_if_finite_skips_on_every_shard():
    """A NaN in one shard's rows skips the whole step, on every shard."""
    m = _mesh.mesh((8,), ("model",))
    tx = js.apply_if_finite(js.sgd(0.5), 3)
    params0 = _mesh.init_params(V, D)
    params = {
        "emb": js.sharding.shard_rows(params0["emb"], m, "model"),
        "w": jax.device_put(params0["w"], NamedSharding(m, P())),
    }
    state = js.sharding.sharded_init(tx, params)
    bat = NamedSharding(m, P("model"))

    @jax.jit
    def step(params, state, ids, y, poison):
        def loss(params, ids, y):
            rows = js.sharding.sharded_lookup(
                params["emb"], ids, axis="model", routing="all_to_all"
            )
            rows = rows.at[0, 0, 0].multiply(poison)  # NaN on one row of shard 0
            h = rows.mean(1)
            return jnp.mean((jnp.tanh(h) @ params["w"] - y) ** 2)

        _, g = js.value_and_grad(loss)(params, ids, y)
        return js.sharding.sharded_update(
            tx, g, state, params, axis="model", routing="all_to_all"
        )

    ids, y = jax.device_put(_mesh.batch(V, B, L, seed=2), bat)
    ids = ids.at[0, 0].set(3)  # a row of shard 0
    skipped, s1 = step(params, state, ids, y, jnp.float32(jnp.nan))
    np.testing.assert_array_equal(skipped["emb"], params["emb"])
    np.testing.assert_array_equal(skipped["w"], params["w"])
    assert int(s1.notfinite_count) == 1
    applied, s2 = step(params, state, ids, y, jnp.float32(1.0))
    assert int(s2.notfinite_count) == 0
    assert not np.array_equal(applied["emb"], params["emb"])


def test_all_to_all_capacity_cuts_bytes_and_overflow_raises():
    full = _run("sgd", "all_to_all", steps=1, compile_only=True)
    # 32 x 4 ids over 8 devices: 16 per device; the test batch's hot rows give
    # at most 8 distinct ids per (device, shard) pair.
    small, *rest = _run("sgd", "all_to_all", capacity=8, steps=1)
    _check(small, *rest)
    assert _hlo.total_bytes(small) < _hlo.total_bytes(full)
    with pytest.raises(Exception, match="capacity=1 slots"):
        out = _run("sgd", "all_to_all", capacity=1, steps=1)
        jax.block_until_ready(out)


@pytest.mark.parametrize("routing", ["masked", "all_to_all"])
def test_temporaries_do_not_grow_with_the_table(routing):
    temps = [
        _run("lazy_adamw", routing, num_rows=v, steps=1, compile_only=True)
        .memory_analysis()
        .temp_size_in_bytes
        for v in (V, 4 * V)
    ]
    assert temps[1] - temps[0] < 0.01 * 3 * V * D * 4, temps


@pytest.mark.parametrize("routing", ["masked", "all_to_all"])
def test_rows_not_divisible_by_devices(routing):
    num_rows = 8189  # not divisible by 8; shards of 1024 rows
    _check(*_run("adagrad", routing, num_rows=num_rows), num_rows=num_rows)


@pytest.mark.parametrize("routing", ["masked", "all_to_all"])
def test_2d_mesh(routing):
    compiled, *rest = _run(
        "lazy_adam", routing, shape=(2, 4), names=("data", "model"), axis="model"
    )
    _check(compiled, *rest)


def test_sharded_lookup_alone_matches_take():
    m = _mesh.mesh((8,), ("model",))
    table = jnp.arange(V * 2, dtype=jnp.float32).reshape(V, 2)
    ids, _ = _mesh.batch(V, 16, 3)
    placed = js.sharding.shard_rows(table, m, "model")
    bat = jax.device_put(ids, NamedSharding(m, P("model")))
    for routing in ("masked", "all_to_all"):
        f = jax.jit(
            lambda t, i, r=routing: js.sharding.sharded_lookup(
                t, i, axis="model", routing=r
            )
        )
        out = f(placed, bat)
        expect = jnp.where((ids < V)[..., None], table[jnp.clip(ids, 0, V - 1)], 0)
        np.testing.assert_array_equal(out, expect)
        # plain jax.grad through the routed lookup is the dense gradient
        g = jax.jit(
            jax.grad(
                lambda t, i, r=routing: js.sharding.sharded_lookup(
                    t, i, axis="model", routing=r
                ).sum()
            )
        )(placed, bat)
        dense = jnp.zeros((V, 2)).at[ids].add(1.0, mode="drop")
        np.testing.assert_allclose(g, dense)


def test_bad_arguments():
    m = _mesh.mesh((8,), ("model",))
    table = js.sharding.shard_rows(jnp.ones((64, 2)), m, "model")
    with pytest.raises(ValueError, match="routing"):
        js.sharding.sharded_lookup(
            table, jnp.zeros((8,), jnp.int32), axis="model", routing="x"
        )
    with pytest.raises(ValueError, match="capacity"):
        js.sharding.sharded_lookup(
            table, jnp.zeros((8,), jnp.int32), axis="model", capacity=0
        )
    with pytest.raises(ValueError, match="axis"):
        js.sharding.shard_rows(jnp.ones((8, 2)), m, "nope")
    with pytest.raises(ValueError, match="divisible"):
        jax.jit(
            lambda t, i: js.sharding.sharded_lookup(
                t, i, axis="model", routing="all_to_all"
            )
        )(table, jnp.zeros((3, 2), jnp.int32))


def test_all_to_all_several_tables_of_different_sizes():
    """Each table routes with its own rows per shard (1001 and 333 rows)."""
    m = _mesh.mesh((8,), ("model",))
    tx = js.sgd(0.5, momentum=0.9)
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    params0 = {
        "a": jax.random.normal(k1, (1001, D)),
        "b": jax.random.normal(k2, (333, D)),
    }
    rng = np.random.default_rng(3)
    ia = jnp.asarray(rng.integers(0, 1001, (16, 2)), jnp.int32)
    ib = jnp.asarray(rng.integers(0, 333, (16, 2)), jnp.int32)

    def loss(params, ia, ib, lookup):
        return jnp.sum(jnp.tanh(lookup(params["a"], ia) * lookup(params["b"], ib)))

    def single(params, state):
        _, g = js.value_and_grad(loss)(params, ia, ib, js.embedding_lookup)
        u, state = tx.update(g, state, params)
        return js.apply_updates(params, u), state

    lookup = functools.partial(
        js.sharding.sharded_lookup, axis="model", routing="all_to_all"
    )

    @jax.jit
    def sharded(params, state, ia, ib):
        _, g = js.value_and_grad(loss)(params, ia, ib, lookup)
        return js.sharding.sharded_update(
            tx, g, state, params, axis="model", routing="all_to_all"
        )

    ref = jax.jit(single)(params0, tx.init(params0))
    params = {k: js.sharding.shard_rows(v, m, "model") for k, v in params0.items()}
    bat = NamedSharding(m, P("model"))
    out = sharded(
        params, js.sharding.sharded_init(tx, params), *jax.device_put((ia, ib), bat)
    )
    _mesh.assert_trees_close(jax.tree.map(lambda x, r: x[: r.shape[0]], out, ref), ref)
