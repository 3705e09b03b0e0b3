"""Which path a step takes on the platform the tests run on, and why.

On a CPU with the kernels built, every jaxslices operation of a step is
native; on a CPU without them (no C++ compiler, ``JAXSLICES_NATIVE=0``),
every one takes the XLA path and says why; on a GPU or TPU (the tests run
there when a machine is lent, with ``JAX_PLATFORMS=cuda,cpu``), the XLA path
runs, unchanged, and ``jaxslices.kernels.explain`` names the platform; the
step's numbers equal the same step's on the CPU's XLA path.
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import registry
from helpers import KERNELS_AVAILABLE, KERNELS_STATUS

import jaxslices as js

OPTIMIZERS = registry.pick(
    "sgd",
    "adagrad",
    "rowwise_adagrad",
    "lazy_adamw",
    "ftrl",
    "clip_by_global_norm_tight",
)


def _loss(p, ids, y):
    h = js.embedding_bag(p["emb"], ids, combiner="mean", padding_id=30)
    return jnp.mean((h @ p["w"] - y) ** 2)


def _setup(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "emb": jnp.asarray(rng.normal(size=(30, 4)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=4), jnp.float32),
    }
    ids = jnp.asarray((rng.zipf(1.3, size=(8, 5)) - 1) % 33, jnp.int32)
    return params, ids, jnp.asarray(rng.normal(size=8), jnp.float32)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_platform_decides_the_path(name):
    params, ids, y = _setup()
    tx = OPTIMIZERS[name]()
    step = harness.jitted_loss_step(tx, _loss)
    report = js.kernels.explain(step, params, tx.init(params), ids, y)
    platform = jax.default_backend()
    if platform == "cpu" and KERNELS_AVAILABLE:
        assert report.native, str(report)
    else:
        assert report.decisions and not any(d.native for d in report.decisions)
        if platform != "cpu":
            why = f"platform is {platform}"
        elif KERNELS_STATUS.startswith("disabled"):
            why = "the native kernels are off"
        else:
            why = "the kernels are unavailable"
        assert all(why in d.reason for d in report.decisions), str(report)
    out = step(params, tx.init(params), ids, y)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), js.kernels.disabled():
        args = jax.device_put((params, tx.init(params), ids, y), cpu)
        ref = step(*args)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
