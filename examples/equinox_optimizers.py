"""Equinox: one optimizer for the embedding tables, another for the rest.

A common recipe for recommendation models: a sparse, row-wise optimizer for
the tables (here ``jaxslices.adagrad``, which touches the batch's rows only)
and Adam for the dense layers. In Equinox the parameter groups come from a
label tree shaped like the model, but such a tree is itself an ``eqx.Module``,
which is callable, and ``optax.multi_transform`` *calls* a callable label
tree. ``jaxslices.equinox.param_labels(model)`` builds the labels as a
function (the jaxslices tables ``"tables"``, every other array ``"rest"``), and
``jaxslices.equinox.multi_transform`` refuses a module-shaped tree with an
error that says so.

The model: a bag of a user's item ids (``jaxslices.equinox.EmbeddingBag``)
and the item's own embedding (``jaxslices.equinox.Embedding``), an MLP on top.
The step runs with strict mode (a table with a dense gradient would raise)
and donated params and state. As a check, the same model is trained with
dense gradients (``eqx.filter_grad``) and ``optax.multi_transform`` of
``optax.adagrad`` and ``optax.adam``: Adagrad on sparse gradients equals dense
Adagrad, so both runs must end with the same parameters.

Run: ``python examples/equinox_optimizers.py``. Needs jaxslices[equinox].
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxslices as js
import jaxslices.equinox as jse


class Recommender(eqx.Module):
    history: jse.EmbeddingBag
    item: jse.Embedding
    mlp: eqx.nn.MLP

    def __init__(self, num_items: int, dim: int, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.history = jse.EmbeddingBag(num_items, dim, combiner="mean", key=k1)
        self.item = jse.Embedding(num_items, dim, key=k2)
        self.mlp = eqx.nn.MLP(2 * dim, "scalar", 16, 1, key=k3)

    def __call__(self, history: jax.Array, item: jax.Array) -> jax.Array:
        """One example: a ``-1``-padded bag of item ids, and the item to score."""
        return self.mlp(jnp.concatenate([self.history(history), self.item(item)]))


def loss_fn(model, history, items, ratings):
    pred = jax.vmap(model)(history, items)
    return jnp.mean((pred - ratings) ** 2)


def make_tx(model, lr_tables: float, lr_rest: float):
    """Adagrad for the tables (sparse), Adam for the MLP."""
    return jse.multi_transform(
        {"tables": js.adagrad(lr_tables), "rest": optax.adam(lr_rest)},
        jse.param_labels(model),
    )


def batches(steps, batch, bag, num_items, seed):
    """Synthetic ratings: an item's hidden score plus noise."""
    rng = np.random.default_rng(seed)
    score = rng.normal(size=num_items)
    for _ in range(steps):
        history = rng.integers(0, num_items, (batch, bag))
        lengths = rng.integers(1, bag + 1, batch)
        history[np.arange(bag)[None, :] >= lengths[:, None]] = -1  # padding
        items = rng.integers(0, num_items // 10, batch)  # popular items
        ratings = score[items] + 0.1 * rng.normal(size=batch)
        yield (
            jnp.asarray(history, jnp.int32),
            jnp.asarray(items, jnp.int32),
            jnp.asarray(ratings, jnp.float32),
        )


def train_sparse(model, tx, data):
    state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit(donate="all-except-first")
    def step(batch, model, state):
        loss, grads = jse.filter_value_and_grad(loss_fn, strict=True)(model, *batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = tx.update(grads, state, params)
        return jse.apply_updates(model, updates), state, loss

    losses = []
    for batch in data:
        model, state, loss = step(batch, model, state)
        losses.append(float(loss))
    return model, losses


def train_dense(model, lr_tables, lr_rest, data):
    """The reference: dense gradients, stock Optax on every group."""
    labels = jse.param_labels(model)
    tx = optax.multi_transform(
        {"tables": optax.adagrad(lr_tables), "rest": optax.adam(lr_rest)}, labels
    )
    state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(batch, model, state):
        grads = eqx.filter_grad(loss_fn)(model, *batch)
        updates, state = tx.update(
            grads, state, eqx.filter(model, eqx.is_inexact_array)
        )
        return eqx.apply_updates(model, updates), state

    for batch in data:
        model, state = step(batch, model, state)
    return model


def main(
    steps: int = 30,
    batch: int = 32,
    bag: int = 6,
    num_items: int = 5000,
    dim: int = 16,
    lr_tables: float = 0.1,
    lr_rest: float = 1e-2,
    seed: int = 0,
) -> dict:
    model = Recommender(num_items, dim, jax.random.key(seed))
    data = list(batches(steps, batch, bag, num_items, seed))
    # The sparse step donates its model: train a copy.
    fresh = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, model)
    sparse, losses = train_sparse(fresh, make_tx(model, lr_tables, lr_rest), data)
    dense = train_dense(model, lr_tables, lr_rest, data)
    diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(eqx.filter(sparse, eqx.is_inexact_array)),
            jax.tree.leaves(eqx.filter(dense, eqx.is_inexact_array)),
            strict=True,
        )
    )
    untouched = np.setdiff1d(
        np.arange(num_items),
        np.concatenate(
            [np.ravel(h) for h, *_ in data] + [np.ravel(i) for _, i, _ in data]
        ),
    )
    same_rows = bool(
        jnp.array_equal(sparse.item.weight[untouched], model.item.weight[untouched])
    )
    out = {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        # the first batch again, at the end: what training learnt
        "first_batch_loss_after": float(loss_fn(sparse, *data[0])),
        "sparse_vs_dense_max_diff": diff,
        "untouched_rows_unchanged": same_rows,
    }
    print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {steps} steps; sparse vs "
        f"dense parameters: max |diff| = {diff:.2e}; rows no batch touched "
        f"unchanged: {same_rows}"
    )
    return out


if __name__ == "__main__":
    main()
