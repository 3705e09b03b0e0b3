"""Data parallel: tables replicated, batch sharded; sparse communication only.

Every step is compiled for 8 CPU devices and its HLO collectives are read
(``tools/hlo.py``): none may move a table-sized array, and the result must
equal the same step on one device.
"""

import _mesh
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import registry
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxslices as js
from tools import hlo as _hlo

V, D, B, L = 2048, 8, 32, 4


def test_eight_devices():
    assert len(_mesh.devices()) == 8


# ------------------------------------------------------------- HLO helper


def _take(table, ids):
    return jnp.take(table, ids, axis=0)


def test_hlo_helper_finds_the_dense_all_reduce():
    """The helper sees what the issue measured: dense Optax all-reduces V x D."""
    m = _mesh.mesh()
    rep, bat = _mesh.replicated(m), NamedSharding(m, P("data"))
    params = jax.device_put(_mesh.init_params(V, D), rep)
    ids, y = _mesh.batch(V, B, L)
    tx = optax.sgd(0.5)

    def step(params, state, ids, y):
        loss, g = jax.value_and_grad(_mesh.loss_fn)(params, ids, y, _take)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state, loss

    state = jax.device_put(tx.init(params), rep)
    compiled = (
        jax.jit(step)
        .lower(params, state, jax.device_put(ids, bat), jax.device_put(y, bat))
        .compile()
    )
    found = _hlo.collectives(compiled)
    assert any(c.kind == "all-reduce" for c in found)
    bad = _hlo.table_sized(compiled, V, D)
    assert bad and any(("f32", (V, D)) in c.arrays for c in bad), found
    with pytest.raises(AssertionError, match="table-sized collectives"):
        _hlo.assert_no_table_sized(compiled, V, D)
    assert _hlo.total_bytes(compiled) >= V * D * 4


def test_hlo_parser_on_text():
    text = """
  %p = f32[16,4]{1,0} parameter(0)
  %i = s32[16]{0} parameter(1)
  %ag = f32[128,4]{1,0} all-gather(%p), channel_id=1, dimensions={0}
  %ar = (f32[16,4]{1,0}, s32[16]{0}) all-reduce(%p, %i), channel_id=2
  %a2a-start = ((f32[16,4]{1,0}), f32[16,4]{1,0}) all-to-all-start(%p)
  %a2a-done = f32[16,4]{1,0} all-to-all-done(%a2a-start)
  ROOT %cp = f32[16,4]{1,0} collective-permute(%p), source_target_pairs={{0,1}}
"""
    found = _hlo.collectives(text)
    assert [c.kind for c in found] == [
        "all-gather",
        "all-reduce",
        "all-to-all",
        "collective-permute",
    ]
    ag = found[0]
    assert ag.operands == (("f32", (16, 4)),) and ag.results == (("f32", (128, 4)),)
    assert ag.bytes == 128 * 4 * 4
    assert found[1].bytes == 16 * 4 * 4 + 16 * 4
    assert [c.name for c in _hlo.table_sized(text, 100)] == ["ag"]
    assert _hlo.table_sized(text, 200, 4) == []


# ----------------------------------------------------------- data parallel


def _dp_compiled_and_run(tx, steps=2):
    m = _mesh.mesh()
    rep, bat = _mesh.replicated(m), NamedSharding(m, P("data"))
    params0 = _mesh.init_params(V, D)
    step = _mesh.make_step(tx)
    batches = [_mesh.batch(V, B, L, seed=s) for s in range(steps)]

    # single device reference
    p1, s1 = params0, tx.init(params0)
    single = _mesh.reference_step(tx)
    for ids, y in batches:
        p1, s1, _ = single(p1, s1, ids, y)

    params = jax.device_put(params0, rep)
    state = jax.device_put(tx.init(params0), rep)
    placed = [(jax.device_put(i, bat), jax.device_put(y, bat)) for i, y in batches]
    sharded = jax.jit(step, donate_argnums=(0, 1))
    compiled = sharded.lower(params, state, *placed[0]).compile()
    for ids, y in placed:
        params, state, _ = compiled(params, state, ids, y)
    return compiled, (p1, s1), (params, state), rep


@pytest.mark.parametrize("name", list(_mesh.OPTIMIZERS))
def test_data_parallel_no_table_sized_collective(name):
    tx = _mesh.OPTIMIZERS[name]()
    compiled, ref, out, rep = _dp_compiled_and_run(tx)
    _hlo.assert_no_table_sized(compiled, V, D)
    # The batch's rows do travel: an all-gather of the slices.
    assert any(c.kind == "all-gather" for c in _hlo.collectives(compiled))
    _mesh.assert_trees_close(out, ref)
    assert out[0]["emb"].sharding.is_equivalent_to(rep, 2)


@pytest.mark.parametrize("apply", ["optax.apply_updates", "params + updates"])
def test_data_parallel_with_optax_apply_updates(apply):
    """``optax.apply_updates`` (``p + s``) goes through the same scatter hook."""
    m = _mesh.mesh()
    rep, bat = _mesh.replicated(m), NamedSharding(m, P("data"))
    tx = registry.optimizer("sgd")
    params0 = _mesh.init_params(V, D)
    ids, y = _mesh.batch(V, B, L)

    def step(params, state, ids, y):
        loss, grads = js.value_and_grad(_mesh.loss_fn)(params, ids, y)
        updates, state = tx.update(grads, state, params)
        if apply == "optax.apply_updates":
            new = optax.apply_updates(params, updates)
        else:
            new = {k: params[k] + updates[k] for k in params}
        return new, state, loss

    ref = _mesh.reference_step(tx)(params0, tx.init(params0), ids, y)
    args = (
        jax.device_put(params0, rep),
        jax.device_put(tx.init(params0), rep),
        jax.device_put(ids, bat),
        jax.device_put(y, bat),
    )
    compiled = jax.jit(step).lower(*args).compile()
    _hlo.assert_no_table_sized(compiled, V, D)
    _mesh.assert_trees_close(compiled(*args), ref)


def test_data_parallel_bytes_do_not_grow_with_the_table():
    small = _dp_bytes(V)
    big = _dp_bytes(4 * V)
    assert small == big, (small, big)


def _dp_bytes(num_rows):
    m = _mesh.mesh()
    rep, bat = _mesh.replicated(m), NamedSharding(m, P("data"))
    tx = registry.optimizer("lazy_adam")
    params = jax.device_put(_mesh.init_params(num_rows, D), rep)
    state = jax.device_put(tx.init(params), rep)
    ids, y = _mesh.batch(num_rows, B, L)
    compiled = (
        jax.jit(_mesh.make_step(tx))
        .lower(params, state, jax.device_put(ids, bat), jax.device_put(y, bat))
        .compile()
    )
    return _hlo.total_bytes(compiled)


def test_data_parallel_2d_mesh_with_column_sharded_dense():
    """A 2-D mesh: batch over both axes, a dense leaf sharded over one."""
    m = _mesh.mesh((2, 4), ("data", "model"))
    tx = registry.optimizer("adagrad")
    params0 = _mesh.init_params(V, D)
    ids, y = _mesh.batch(V, B, L)
    step = _mesh.make_step(tx)
    ref = _mesh.reference_step(tx)(params0, tx.init(params0), ids, y)
    rep = NamedSharding(m, P())
    bat = NamedSharding(m, P(("data", "model")))
    params = {
        "emb": jax.device_put(params0["emb"], NamedSharding(m, P(None, "model"))),
        "w": jax.device_put(params0["w"], rep),
    }
    state = jax.device_put(tx.init(params0), rep)
    compiled = (
        jax.jit(step)
        .lower(params, state, jax.device_put(ids, bat), jax.device_put(y, bat))
        .compile()
    )
    _hlo.assert_no_table_sized(compiled, V, D // 4)
    out = compiled(params, state, jax.device_put(ids, bat), jax.device_put(y, bat))
    _mesh.assert_trees_close(out[:2], ref[:2])


def test_replicate_rows_is_a_no_op_without_a_mesh():
    s = js.IndexedSlices(jnp.ones((2, 3)), jnp.array([0, 1]), (4, 3))
    out = jax.jit(lambda x, s: js.sharding.replicate_rows(x, s))(jnp.zeros((4, 3)), s)
    np.testing.assert_array_equal(out.values, s.values)
    np.testing.assert_array_equal(out.indices, s.indices)


# ------------------------------------------------------ inside shard_map


def _shard_map(f, m, in_specs, out_specs):
    """Per-device semantics: gradients stay local until reduced explicitly.

    With ``check_vma=True`` (the default of ``jax.shard_map``) JAX sums the
    gradient of a replicated parameter over devices by itself (tested in
    ``test_value_and_grad_inside_shard_map_check_vma``).
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(
            f, mesh=m, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
    from jax.experimental.shard_map import shard_map

    return shard_map(f, m, in_specs=in_specs, out_specs=out_specs, check_rep=False)


@pytest.mark.parametrize("name", ["sgd", "clip_by_global_norm_tight", "lazy_adam"])
def test_data_parallel_inside_shard_map_with_tree_pmean(name):
    """Per-device gradients reduced with jaxslices.tree_pmean (slices gathered)."""
    m = _mesh.mesh()
    tx = _mesh.OPTIMIZERS[name]()
    params0 = _mesh.init_params(V, D)
    ids, y = _mesh.batch(V, B, L)
    ref = _mesh.reference_step(tx)(params0, tx.init(params0), ids, y)

    def per_device(params, state, ids, y):
        loss, grads = js.value_and_grad(_mesh.loss_fn)(params, ids, y)
        grads = js.tree_pmean(grads, "data")  # the mean loss over the global batch
        updates, state = tx.update(grads, state, params)
        return js.apply_updates(params, updates), state, jax.lax.pmean(loss, "data")

    step = jax.jit(
        _shard_map(per_device, m, (P(), P(), P("data"), P("data")), (P(), P(), P()))
    )
    args = _mesh.data_parallel_args(m, tx, params0, ids, y)
    compiled = step.lower(*args).compile()
    _hlo.assert_no_table_sized(compiled, V, D)
    out = compiled(*args)
    _mesh.assert_trees_close(out, ref)


def test_value_and_grad_inside_shard_map_check_vma():
    if not hasattr(jax, "shard_map"):
        pytest.skip("jax.shard_map with check_vma: JAX >= 0.7")
    m = _mesh.mesh()
    params0 = _mesh.init_params(V, D)
    ids, y = _mesh.batch(V, B, L)

    def per_device(params, ids, y):
        _, g = js.value_and_grad(_mesh.loss_fn)(params, ids, y)
        return js.to_dense(g)["emb"][None]

    got = jax.jit(
        jax.shard_map(
            per_device,
            mesh=m,
            in_specs=(P(), P("data"), P("data")),
            out_specs=P("data"),
        )
    )(params0, ids, y)
    # JAX's semantics in this mode: the gradient of a replicated parameter is
    # the sum of the devices' gradients (what it gives the dense leaf "w").
    local = jax.grad(_mesh.loss_fn)
    expect = sum(
        local(params0, ids[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4])["emb"]
        for i in range(8)
    )
    for device_result in got:
        np.testing.assert_allclose(device_result, expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "clip_by_global_norm_tight", "lazy_adam"])
def test_training_step_inside_shard_map_check_vma(name):
    """The default shard_map mode: JAX sums gradients of replicated parameters.

    Sparse gradients follow the same rule (all-gathered slices: their sum), so
    with the loss divided by the number of devices a per-device step equals
    the single-device step on the global batch, with no table-sized collective.
    """
    if not hasattr(jax, "shard_map"):
        pytest.skip("jax.shard_map with check_vma: JAX >= 0.7")
    m = _mesh.mesh()
    n = m.devices.size
    tx = _mesh.OPTIMIZERS[name]()
    params0 = _mesh.init_params(V, D)
    ids, y = _mesh.batch(V, B, L)
    ref = _mesh.reference_step(tx)(params0, tx.init(params0), ids, y)

    def per_device(params, state, ids, y):
        def loss(p, i, t):
            return _mesh.loss_fn(p, i, t) / n

        loss_value, grads = js.value_and_grad(loss)(params, ids, y)
        assert js.is_indexed_slices(grads["emb"])
        updates, state = tx.update(grads, state, params)
        return (
            js.apply_updates(params, updates),
            state,
            jax.lax.psum(loss_value, "data"),
        )

    step = jax.jit(
        jax.shard_map(
            per_device,
            mesh=m,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=(P(), P(), P()),
        )
    )
    args = _mesh.data_parallel_args(m, tx, params0, ids, y)
    compiled = step.lower(*args).compile()
    _hlo.assert_no_table_sized(compiled, V, D)
    _mesh.assert_trees_close(compiled(*args), ref)


def test_eager_update_on_one_device_after_the_same_eager_op_on_a_mesh():
    # JAX 0.12: an eager ``a.at[0, 0].set(v)`` on one device, run after the
    # same op on a mesh, returns an array whose abstract type names that mesh
    # although it lives on one device. An eager jaxslices update of such
    # arrays must still run on their one device, as an update of clean ones.
    m = _mesh.mesh((8,), ("model",))
    for dtype in (jnp.int32, jnp.float32):
        on_mesh = jax.device_put(
            jnp.zeros((32, 4), dtype), NamedSharding(m, P("model"))
        )
        on_mesh.at[0, 0].set(3)
    table = jnp.zeros((20, 4), jnp.float32).at[0, 0].set(1.0)
    ids = jnp.array([[1, 2, 3], [3, 19, 0]], jnp.int32).at[0, 0].set(5)
    assert len(table.sharding.device_set) == 1
    g = js.grad(lambda t: js.embedding_bag(t, ids, combiner="sum").sum())(table)
    new = js.apply_updates({"emb": table}, {"emb": g})["emb"]
    want = np.zeros((20, 4), np.float32)
    want[0, 0] = 1.0
    np.add.at(want, np.array([5, 2, 3, 3, 19, 0]), 1.0)
    np.testing.assert_array_equal(new, want)
