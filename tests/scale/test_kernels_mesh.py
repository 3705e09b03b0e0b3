"""The native CPU kernels over a mesh of 8 CPU devices.

* Inside ``jax.shard_map`` (every mesh axis manual) each kernel runs on its
  own device's data: a data-parallel step (table replicated, batch sharded,
  default ``check_vma=True``) takes the native path on every device and
  equals one device's XLA step on the global batch.
* Under a ``jit`` partitioned over the mesh (``NamedSharding`` arguments),
  a custom call has no partitioning rule, so jaxslices takes the XLA path
  there (and says why); the results equal one device's.
* A step partitioned over the mesh never holds a replicated table because
  of the kernels: the compiled HLO has no native call and no all-gather of
  the table.
"""

from __future__ import annotations

import _mesh
import harness
import jax
import jax.numpy as jnp
import pytest
import registry
from helpers import needs_kernels
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxslices as js

V, D, B, L = 64, 4, 16, 3

pytestmark = needs_kernels


def _bag_loss(params, ids, y):
    h = js.embedding_bag(params["emb"], ids, combiner="mean")
    return jnp.mean((jnp.tanh(h) @ params["w"] - y) ** 2)


def _reference(tx, params, ids, y):
    """One device's XLA-path step (``tests/harness.py``'s, compiled once)."""
    with js.kernels.disabled():
        step = harness.jitted_loss_step(tx, _bag_loss)
        return step(params, tx.init(params), ids, y)


@pytest.mark.parametrize("name", list(_mesh.OPTIMIZERS))
def test_inside_shard_map_every_device_runs_the_kernels(name):
    m = _mesh.mesh()
    tx = _mesh.OPTIMIZERS[name]()
    params = _mesh.init_params(V, D)
    ids, y = _mesh.batch(V, B, L)

    def global_loss(p, ids, y):
        return jax.lax.pmean(_bag_loss(p, ids, y), "data")

    def per_device(p, s, ids, y):
        loss, g = js.value_and_grad(global_loss)(p, ids, y)
        u, s = tx.update(g, s, p)
        return js.apply_updates(p, u), s, loss

    step = jax.jit(
        jax.shard_map(
            per_device,
            mesh=m,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=(P(), P(), P()),
        )
    )
    args = _mesh.data_parallel_args(m, tx, params, ids, y)
    report = js.kernels.explain(step, *args)
    assert report.native and report.native_calls >= 2, str(report)
    out = step(*args)
    ref = _reference(tx, params, ids, y)
    _mesh.assert_trees_close(out[:2], ref[:2])


@pytest.mark.parametrize("name", ["sgd", "adagrad", "lazy_adam", "ftrl"])
def test_a_jit_partitioned_step_takes_the_xla_path_and_is_right(name):
    m = _mesh.mesh()
    tx = _mesh.OPTIMIZERS[name]()
    params = _mesh.init_params(V, D)
    ids, y = _mesh.batch(V, B, L)

    def step(p, s, ids, y):
        loss, g = js.value_and_grad(_bag_loss)(p, ids, y)
        u, s = tx.update(g, s, p)
        return js.apply_updates(p, u), s, loss

    jitted = jax.jit(step)
    args = _mesh.data_parallel_args(m, tx, params, ids, y)
    report = js.kernels.explain(jitted, *args)
    assert not any(d.native for d in report.decisions), str(report)
    assert any("mesh of 8 devices" in d.reason for d in report.decisions), str(report)
    text = jitted.lower(*args).compile().as_text()
    assert "jaxslices_" not in "".join(
        ln for ln in text.splitlines() if "custom-call" in ln
    )
    out = jitted(*args)
    ref = _reference(tx, params, ids, y)
    _mesh.assert_trees_close(out[:2], ref[:2])


def test_row_sharded_table_partitioned_by_jit_stays_sharded():
    """A row-sharded table under jit: XLA path, no all-gather of the table."""
    m = _mesh.mesh()
    tx = registry.optimizer("adagrad")
    params = _mesh.init_params(V, D)
    ids, y = _mesh.batch(V, B, L)
    rows = NamedSharding(m, P("data"))
    rep = NamedSharding(m, P())
    p = {
        "emb": jax.device_put(params["emb"], rows),
        "w": jax.device_put(params["w"], rep),
    }
    s = jax.device_put(tx.init(params), rep)
    s = jax.tree.map(
        lambda x: jax.device_put(x, rows) if x.ndim and x.shape[0] == V else x, s
    )

    def step(p, s, ids, y):
        loss, g = js.value_and_grad(_bag_loss)(p, ids, y)
        u, s = tx.update(g, s, p)
        return js.apply_updates(p, u), s, loss

    jitted = jax.jit(
        step, out_shardings=(jax.tree.map(lambda x: x.sharding, p), None, None)
    )
    out = jitted(p, s, jax.device_put(ids, rep), jax.device_put(y, rep))
    assert out[0]["emb"].sharding.spec == P("data")
    ref = _reference(tx, params, ids, y)
    _mesh.assert_trees_close(out[0], ref[0])
