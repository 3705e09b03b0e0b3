"""Shared pieces of the sharding tests: a small model, optimizers, references.

The optimizers are ``tests/registry.py``'s, and the single-device reference
step is ``tests/harness.py``'s: compiled once per session for each optimizer
and shared by every file that compares a mesh step with it.

The tests need 8 devices: ``tests/conftest.py`` sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX starts, so
plain ``python -m pytest`` (also with ``-n 2``: every worker imports the
conftest) has 8 CPU devices.
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import registry
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxslices as js

NEED = 8


def devices(n: int = NEED):
    got = jax.devices()
    assert len(got) >= n, (
        f"the sharding tests need {n} devices, JAX has {len(got)}: run pytest from "
        "the repository root (tests/conftest.py sets XLA_FLAGS="
        "--xla_force_host_platform_device_count=8), or set it before JAX starts."
    )
    return got[:n]


def mesh(shape=(8,), names=("data",)) -> Mesh:
    n = int(np.prod(shape))
    return Mesh(np.array(devices(n)).reshape(shape), names)


#: The optimizers every mesh test runs (``tests/registry.py`` names).
OPTIMIZERS = registry.pick(
    "sgd",
    "sgd_momentum",
    "clip_by_global_norm_tight",
    "adagrad",
    "lazy_adam",
    "lazy_adamw",
    "rowwise_adagrad",
    "ftrl",
)


def init_params(num_rows: int, dim: int, seed: int = 0) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "emb": jax.random.normal(k1, (num_rows, dim), jnp.float32),
        "w": jax.random.normal(k2, (dim,), jnp.float32),
    }


def batch(num_rows: int, b: int, bag: int, seed: int = 0, hot: int | None = None):
    """Ids with many repeats (drawn from ``hot`` rows) and one invalid id."""
    rng = np.random.default_rng(seed)
    hot = hot or max(2, num_rows // 16)
    ids = rng.integers(0, num_rows, size=hot)[rng.integers(0, hot, size=(b, bag))]
    ids[0, 0] = num_rows + 3  # out of range: reads zeros, no gradient
    y = rng.normal(size=(b,)).astype(np.float32)
    return jnp.asarray(ids, jnp.int32), jnp.asarray(y)


def loss_fn(params, ids, y, lookup=js.embedding_lookup):
    h = lookup(params["emb"], ids).mean(1)
    return jnp.mean((jnp.tanh(h) @ params["w"] - y) ** 2)


def make_step(tx, lookup=js.embedding_lookup):
    """``step(params, state, ids, y) -> (params, state, loss)`` on
    :func:`loss_fn`, to jit for a mesh."""

    def step(params, state, ids, y):
        loss, grads = js.value_and_grad(loss_fn)(params, ids, y, lookup)
        updates, state = tx.update(grads, state, params)
        return js.apply_updates(params, updates), state, loss

    return step


def reference_step(tx):
    """The single-device step a mesh step must equal: the session's one jitted
    step of ``tx`` on :func:`loss_fn` (``tests/harness.py``)."""
    return harness.jitted_loss_step(tx, loss_fn)


def replicated(m: Mesh) -> NamedSharding:
    return NamedSharding(m, P())


def data_parallel_args(m: Mesh, tx, params, ids, y, axis: str = "data"):
    """``(params, state, ids, y)`` placed for a data-parallel step on ``m``."""
    rep, bat = replicated(m), NamedSharding(m, P(axis))
    return (
        jax.device_put(params, rep),
        jax.device_put(tx.init(params), rep),
        jax.device_put(ids, bat),
        jax.device_put(y, bat),
    )


def assert_trees_close(a, b, rtol=2e-5, atol=2e-6):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
