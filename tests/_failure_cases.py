"""Steps that fail on exactly one device of an 8-device mesh, as a user writes them.

Used by ``tests/scale/test_errors.py`` (one process, 8 CPU devices, each case
in a child process so that a hang cannot take the test run with it) and by
``tests/_multihost_worker.py`` (2 processes x 4 devices,
``tests/scale/test_sharding_multihost.py``). Every case builds
its data with :func:`global_array`, so it runs the same in both settings, and
returns ``{"raised": bool, "first": str, "message": str, "seconds": float,
"after": ...}``: whether the failing step raised in this process, the error's
first line (JAX's) and last line (jaxslices' message), how long it took, and
the result of a correct step run afterwards (the process and its devices must
still work).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxslices as js

V, D = 64, 4  # 8 rows per shard on 8 devices
B, L = 16, 4  # 2 x 4 ids per device
BAD_DEVICE = 5  # the one device whose data fails the check
CASES = (
    "lookup_overflow",
    "update_overflow",
    "check_ids_jit",
    "check_ids_shard_map",
    "multisteps_overflow",
)

#: What every process must raise for each case (part of the message).
EXPECTED = {
    "lookup_overflow": "sharded_lookup(routing='all_to_all'): a device has 3 "
    "distinct ids for one shard, more than capacity=2 slots. Nothing was "
    "dropped: the step stops here, on every device. Pass capacity >= 3",
    "update_overflow": "sharded_update(routing='all_to_all'): a device has 3 "
    "distinct ids for one shard, more than capacity=2 slots",
    "check_ids_jit": "embedding_lookup(check_ids=True): ids must be in [0, 64) "
    "for a table with 64 rows; 1 id is out of range (the ids checked have min "
    "0 and max 65)",
    "check_ids_shard_map": "check_ids: ids must be in [0, 64) for a table with "
    "64 rows; 1 id is out of range (the ids checked have min -1 and max 63)",
    "multisteps_overflow": "jaxslices.MultiSteps (leaf ['emb']): the "
    "accumulated gradient touches 128 distinct rows but the buffer has "
    "capacity=64 slots",
}


def global_array(x: np.ndarray, sharding: Any) -> jax.Array:
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def spread_ids(overflow: bool) -> np.ndarray:
    """Each device's 8 ids hit 8 shards once; ``BAD_DEVICE``'s hit shard 0 thrice.

    With ``capacity=2`` only ``BAD_DEVICE`` overflows (it needs 3 slots for
    shard 0); every other device needs 1 slot per shard.
    """
    per_device = B * L // 8
    ids = np.zeros((8, per_device), np.int32)
    for d in range(8):
        ids[d] = [s * (V // 8) + d % (V // 8) for s in range(per_device)]
    if overflow:
        ids[BAD_DEVICE, 1:3] = [6, 7]  # shard 0 now gets rows 5, 6, 7
    return ids.reshape(B, L)


def _loss(params, ids, y, lookup):
    h = lookup(params["emb"], ids).mean(1)
    return jnp.mean((jnp.tanh(h) @ params["w"] - y) ** 2)


def _params(mesh, axis_sharded: bool):
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(V, D)).astype(np.float32)
    w = rng.normal(size=(D,)).astype(np.float32)
    rows = NamedSharding(mesh, P("model" if axis_sharded else None))
    return {
        "emb": global_array(emb, rows),
        "w": global_array(w, NamedSharding(mesh, P())),
    }


def _attempt(fn, *args) -> dict:
    t0 = time.time()
    try:
        jax.block_until_ready(fn(*args))
        return {"raised": False, "message": "", "seconds": time.time() - t0}
    except Exception as e:  # noqa: BLE001 - reported to the test
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        return {
            "raised": True,
            "type": type(e).__name__,
            "first": lines[0] if lines else "",
            "message": lines[-1] if lines else "",
            "seconds": time.time() - t0,
        }


def _all_to_all(mesh, lookup_capacity, update_capacity) -> dict:
    tx = js.adagrad(0.1)
    params = _params(mesh, True)
    state = js.sharding.sharded_init(tx, params)
    lookup = functools.partial(
        js.sharding.sharded_lookup,
        axis="model",
        routing="all_to_all",
        capacity=lookup_capacity,
    )

    @jax.jit
    def step(params, state, ids, y):
        loss, grads = js.value_and_grad(_loss)(params, ids, y, lookup)
        return js.sharding.sharded_update(
            tx,
            grads,
            state,
            params,
            axis="model",
            routing="all_to_all",
            capacity=update_capacity,
        )

    split = NamedSharding(mesh, P("model"))
    y = global_array(np.ones(B, np.float32), split)
    bad = global_array(spread_ids(True), split)
    good = global_array(spread_ids(False), split)
    out = _attempt(step, params, state, bad, y)
    after, _ = step(params, state, good, y)
    out["after"] = float(np.asarray(after["w"].addressable_data(0)).sum())
    return out


def _check_ids_jit(mesh) -> dict:
    """Data parallel under plain jit: the lookup checks ids, sharded over 8."""
    tx = js.sgd(0.1)
    params = _params(mesh, False)

    def loss(params, ids, y):
        rows = js.embedding_lookup(params["emb"], ids, check_ids=True)
        return jnp.mean((rows.mean(1) @ params["w"] - y) ** 2)

    @jax.jit
    def step(params, ids, y):
        _, grads = js.value_and_grad(loss)(params, ids, y)
        updates, _ = tx.update(grads, tx.init(params), params)
        return js.apply_updates(params, updates)

    split = NamedSharding(mesh, P("model"))
    ids = spread_ids(False)
    bad_ids = ids.copy()
    bad_ids[2 * BAD_DEVICE, 3] = V + 1  # one id out of range, on one device
    y = global_array(np.ones(B, np.float32), split)
    out = _attempt(step, params, global_array(bad_ids, split), y)
    after = step(params, global_array(ids, split), y)
    out["after"] = float(np.asarray(after["w"].addressable_data(0)).sum())
    return out


def _check_ids_shard_map(mesh) -> dict:
    """Inside shard_map (default check_vma): check_ids on each device's ids."""

    def per_device(table, ids):
        ids = js.check_ids(ids, V)
        rows = js.embedding_lookup(table, ids)
        return jax.lax.psum(rows.sum(), "model")

    step = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("model")), out_specs=P())
    )
    table = _params(mesh, False)["emb"]
    split = NamedSharding(mesh, P("model"))
    ids = spread_ids(False)
    bad_ids = ids.copy()
    bad_ids[2 * BAD_DEVICE, 0] = -1
    out = _attempt(step, table, global_array(bad_ids, split))
    out["after"] = float(np.asarray(step(table, global_array(ids, split))))
    return out


def _multisteps_overflow(mesh) -> dict:
    """Data-parallel gradient accumulation whose buffer overflows."""
    big = 4 * V
    ms = js.MultiSteps(optax.identity(), every_k_schedule=2, capacity={"emb": B * L})
    rep = NamedSharding(mesh, P())
    params = {"emb": global_array(np.zeros((big, D), np.float32), rep)}

    def loss(params, ids):
        return js.embedding_lookup(params["emb"], ids).sum()

    @jax.jit
    def step(params, state, ids):
        _, grads = js.value_and_grad(loss)(params, ids)
        updates, state = ms.update(grads, state, params)
        return js.apply_updates(params, updates), state

    split = NamedSharding(mesh, P("model"))
    state = jax.jit(ms.init, out_shardings=rep)(params)
    first = np.arange(B * L, dtype=np.int32).reshape(B, L)  # 64 distinct rows
    p1, s1 = step(params, state, global_array(first, split))
    # 64 other rows: 128 distinct in a buffer of 64 slots.
    out = _attempt(step, p1, s1, global_array(first + B * L, split))
    p2, _ = step(p1, s1, global_array(first, split))  # the same rows: fits
    out["after"] = float(np.asarray(p2["emb"].addressable_data(0)).sum())
    return out


def run_case(name: str, mesh: Mesh) -> dict:
    if name == "lookup_overflow":
        return _all_to_all(mesh, 2, None)
    if name == "update_overflow":
        return _all_to_all(mesh, None, 2)
    if name == "check_ids_jit":
        return _check_ids_jit(mesh)
    if name == "check_ids_shard_map":
        return _check_ids_shard_map(mesh)
    if name == "multisteps_overflow":
        return _multisteps_overflow(mesh)
    raise ValueError(f"unknown case {name!r}")
