"""Concurrent js.value_and_grad traces in several threads (tapes are per thread)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslices as js

N_THREADS = 3


def _case(k):
    rng = np.random.default_rng(k)
    num_rows, dim = 8 + k, 2 + k  # different shapes per thread
    params = {
        "emb": jnp.asarray(rng.normal(size=(num_rows, dim)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(dim,)), jnp.float32),
    }
    ids = jnp.asarray(rng.integers(0, num_rows, size=(4, 3)), jnp.int32)
    return params, ids


@pytest.mark.parametrize("mode", ["eager", "own_jit", "shared_jit"])
def test_concurrent_traces_each_get_their_own_sparse_gradients(mode):
    """``shared_jit``: one jitted function; the threads' shapes differ, so JAX
    traces it once per thread, concurrently."""
    barrier = threading.Barrier(N_THREADS, timeout=30)
    results, errors = {}, {}

    def make_loss(k):
        def loss(p, ids):
            # Every thread reaches this point in each of its traces before any
            # goes on: the traces (and their tapes) overlap. A thread that
            # fell back to dense would trace fewer times and break the barrier.
            barrier.wait()
            return _loss(k if mode != "shared_jit" else 0)(p, ids)

        return loss

    shared = jax.jit(js.value_and_grad(make_loss(0)))

    def work(k):
        try:
            params, ids = _case(k)
            if mode == "shared_jit":
                vg = shared
            else:
                vg = js.value_and_grad(make_loss(k))
                vg = jax.jit(vg) if mode == "own_jit" else vg
            results[k] = vg(params, ids)
        except Exception as e:  # reported below
            errors[k] = e
            barrier.abort()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(N_THREADS):
        params, ids = _case(k)
        want_value, want = jax.value_and_grad(_loss(k if mode != "shared_jit" else 0))(
            params, ids
        )
        value, grads = results[k]
        np.testing.assert_allclose(value, want_value, rtol=1e-5)
        assert isinstance(grads["emb"], js.IndexedSlices), k
        np.testing.assert_array_equal(grads["emb"].indices, np.ravel(ids))
        np.testing.assert_allclose(
            grads["emb"].to_dense(), want["emb"], rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(grads["w"], want["w"], rtol=1e-5, atol=1e-6)


def _loss(k):
    def loss(p, ids):
        rows = js.embedding_lookup(p["emb"], ids)
        return jnp.sum(jnp.tanh(rows @ p["w"]) ** 2) * (k + 1)

    return loss
