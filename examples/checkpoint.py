"""Checkpoint a jaxslices training run with Orbax, restore it, resume it.

Two models as users write them (docs/frameworks.md, docs/checkpointing.md):

* a Flax NNX two-tower recommender (``jaxslices.nnx.Embed`` towers,
  ``nnx.Optimizer`` with ``jaxslices.lazy_adam``), checkpointed as
  ``nnx.state((model, optimizer))`` and restored into freshly built objects;
* an Equinox bag-of-ids model trained with gradient accumulation
  (``jaxslices.MultiSteps`` over clipping + Adagrad), checkpointed in the
  middle of an accumulation, when its buffer holds ``IndexedSlices``.

Each run is interrupted after ``steps`` steps, saved with Orbax
(``CheckpointManager``, ``StandardSave`` / ``StandardRestore`` into an abstract
target), restored into new objects as a fresh process would, resumed for
``steps`` more, and compared with the uninterrupted run: they must be equal
bit for bit. Run: ``python examples/checkpoint.py``. Needs jaxslices[flax,
equinox] and orbax-checkpoint.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import jaxslices as js
import jaxslices.equinox as jse
import jaxslices.nnx

# ----------------------------------------------------------- Flax NNX


class TwoTower(nnx.Module):
    def __init__(self, num_users: int, num_items: int, dim: int, rngs: nnx.Rngs):
        self.user = jaxslices.nnx.Embed(num_users, dim, rngs=rngs)
        self.item = jaxslices.nnx.Embed(num_items, dim, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, users, items):
        u = self.proj(self.user(users))
        v = self.item(items).mean(axis=1)  # a bag of recent items per example
        return jnp.sum(u * v, axis=-1)


def nnx_loss(model, users, items, labels):
    return optax.sigmoid_binary_cross_entropy(model(users, items), labels).mean()


@nnx.jit(donate_argnums=(0, 1))
def nnx_step(model, optimizer, users, items, labels):
    loss, grads = jaxslices.nnx.value_and_grad(nnx_loss, strict=True)(
        model, users, items, labels
    )
    optimizer.update(model, grads)
    return loss


def nnx_objects(num_users, num_items, dim, seed):
    model = TwoTower(num_users, num_items, dim, nnx.Rngs(seed))
    return model, nnx.Optimizer(model, js.lazy_adam(1e-2), wrt=nnx.Param)


def nnx_batches(steps, batch, num_users, num_items, seed):
    rng = np.random.default_rng(seed)
    return [
        (
            jnp.asarray(rng.integers(0, num_users // 4, batch), jnp.int32),  # repeats
            jnp.asarray(rng.integers(0, num_items, (batch, 3)), jnp.int32),
            jnp.asarray(rng.integers(0, 2, batch), jnp.float32),
        )
        for _ in range(steps)
    ]


def run_nnx(directory: Path, steps, batch, num_users, num_items, dim, seed) -> dict:
    batches = nnx_batches(2 * steps, batch, num_users, num_items, seed)
    options = ocp.CheckpointManagerOptions(max_to_keep=1)

    model, optimizer = nnx_objects(num_users, num_items, dim, seed)
    for b in batches[:steps]:
        nnx_step(model, optimizer, *b)
    with ocp.CheckpointManager(directory, options=options) as mngr:
        mngr.save(steps, args=ocp.args.StandardSave(nnx.state((model, optimizer))))
        mngr.wait_until_finished()
    at_save = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    for b in batches[steps:]:  # the uninterrupted run
        nnx_step(model, optimizer, *b)

    # As a new process would: build the objects, restore into their shapes.
    abstract = nnx.eval_shape(lambda: nnx_objects(num_users, num_items, dim, seed))
    with ocp.CheckpointManager(directory, options=options) as mngr:
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(abstract))
        restored = mngr.restore(
            mngr.latest_step(), args=ocp.args.StandardRestore(target)
        )
    model2, optimizer2 = nnx_objects(num_users, num_items, dim, seed + 1)
    nnx.update((model2, optimizer2), restored)
    for b in batches[steps:]:
        nnx_step(model2, optimizer2, *b)
    return {
        "resumed_vs_uninterrupted": _max_diff(
            nnx.state((model, optimizer)), nnx.state((model2, optimizer2))
        ),
        "moved_after_save": _max_diff(at_save, nnx.state(model, nnx.Param)),
    }


# ------------------------------------------------------------- Equinox


class Bag(eqx.Module):
    embedding: jse.Embedding
    linear: eqx.nn.Linear

    def __init__(self, num_ids: int, dim: int, key):
        k1, k2 = jax.random.split(key)
        self.embedding = jse.Embedding(num_ids, dim, key=k1)
        self.linear = eqx.nn.Linear(dim, "scalar", key=k2)

    def __call__(self, ids):  # one example: a bag of ids
        return self.linear(jnp.mean(jax.vmap(self.embedding)(ids), axis=0))


def eqx_loss(model, ids, y):
    return jnp.mean((jax.vmap(model)(ids) - y) ** 2)


def make_accumulator(k: int, slots: int, num_ids: int) -> js.MultiSteps:
    # Gradient accumulation over k micro-batches of `slots` ids each, with
    # clipping; a buffer of k * slots never needs to coalesce. The table is the
    # leaf with num_ids rows; every other leaf is dense (None).
    inner = optax.chain(js.clip_by_global_norm(1.0), js.adagrad(0.1))
    return js.MultiSteps(
        inner,
        every_k_schedule=k,
        capacity=lambda params: jax.tree.map(
            lambda p: k * slots if p.shape[:1] == (num_ids,) else None, params
        ),
    )


def run_eqx(directory: Path, steps, batch, num_ids, dim, seed) -> dict:
    k, bag = 3, 4
    tx = make_accumulator(k, batch * bag, num_ids)
    rng = np.random.default_rng(seed)
    batches = [
        (
            jnp.asarray(rng.integers(0, num_ids // 4, (batch, bag)), jnp.int32),
            jnp.asarray(rng.normal(size=batch), jnp.float32),
        )
        for _ in range(2 * steps)
    ]

    @eqx.filter_jit
    def step(model, state, ids, y):
        _, grads = jse.filter_value_and_grad(eqx_loss, strict=True)(model, ids, y)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = tx.update(grads, state, params)
        return jse.apply_updates(model, updates), state

    def fresh(key_seed):
        model = Bag(num_ids, dim, jax.random.key(key_seed))
        return model, tx.init(eqx.filter(model, eqx.is_inexact_array))

    model, state = fresh(seed)
    for b in batches[:steps]:
        model, state = step(model, state, *b)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    with ocp.CheckpointManager(directory) as mngr:
        mngr.save(steps, args=ocp.args.StandardSave((params, state)))
        mngr.wait_until_finished()
    buffer = state.acc_grads.embedding.weight  # IndexedSlices, mid-accumulation
    filled = int(state.acc_fill.embedding.weight)
    for b in batches[steps:]:
        model, state = step(model, state, *b)

    model2, state2 = fresh(seed + 1)  # other numbers, same shapes
    params2, static2 = eqx.partition(model2, eqx.is_inexact_array)
    abstract = jax.eval_shape(lambda: (params2, state2))
    with ocp.CheckpointManager(directory) as mngr:
        params2, state2 = mngr.restore(
            mngr.latest_step(), args=ocp.args.StandardRestore(abstract)
        )
    model2 = eqx.combine(params2, static2)
    for b in batches[steps:]:
        model2, state2 = step(model2, state2, *b)
    return {
        "resumed_vs_uninterrupted": _max_diff(
            (state, eqx.filter(model, eqx.is_inexact_array)),
            (state2, eqx.filter(model2, eqx.is_inexact_array)),
        ),
        "moved_after_save": _max_diff(params, eqx.filter(model, eqx.is_inexact_array)),
        "buffer_slots_filled_at_save": filled,
        "buffer_is_slices": isinstance(buffer, js.IndexedSlices),
    }


def _max_diff(a, b) -> float:
    """Largest difference between two trees (slices: their values and ids)."""

    def plain(tree):
        return jax.tree.map(
            lambda x: (x.values, x.indices) if isinstance(x, js.IndexedSlices) else x,
            tree,
            is_leaf=js.is_indexed_slices,
        )

    la, lb = jax.tree.leaves(plain(a)), jax.tree.leaves(plain(b))
    assert len(la) == len(lb)
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(la, lb, strict=True)
    )


def main(
    steps: int = 4,
    batch: int = 8,
    num_users: int = 200,
    num_items: int = 1000,
    dim: int = 8,
    seed: int = 0,
    directory: str | None = None,
) -> dict:
    root = Path(directory or tempfile.mkdtemp(prefix="jaxslices_ckpt_"))
    out = {
        "nnx": run_nnx(root / "nnx", steps, batch, num_users, num_items, dim, seed),
        # steps + 1 micro-steps, k = 3: saved in the middle of an accumulation.
        "equinox_multisteps": run_eqx(
            root / "eqx", steps + 1, batch, num_items, dim, seed
        ),
    }
    for name, r in out.items():
        print(
            f"{name}: resumed minus uninterrupted run, max |diff| = "
            f"{r['resumed_vs_uninterrupted']} (parameters moved by "
            f"{r['moved_after_save']:.3g} after the save)"
        )
    return out


if __name__ == "__main__":
    main()
