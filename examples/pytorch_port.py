"""A PyTorch ``EmbeddingBag`` model, ported to Flax NNX with jaxslices.

The PyTorch original, a text classifier over variable-length bags of token
ids::

    class Classifier(torch.nn.Module):
        def __init__(self, vocab, dim, classes):
            super().__init__()
            self.bag = torch.nn.EmbeddingBag(
                vocab, dim, mode="mean", padding_idx=0, max_norm=1.0, sparse=True
            )
            self.out = torch.nn.Linear(dim, classes)

        def forward(self, tokens, offsets):
            return self.out(self.bag(tokens, offsets))

    # SparseAdam for the table, Adam for the rest; batches of (tokens, offsets)

and the port, written from ``docs/embeddings.md`` and ``docs/frameworks.md``:
``jaxslices.nnx.EmbedBag`` with the same arguments (``combiner`` for ``mode``,
``strict=True`` so any dense gradient of the table raises), the batches as
``JaggedIds`` of a fixed ``max_total`` (one compilation), ``lazy_adam`` (Adam
on the touched rows, as SparseAdam, and Adam on the dense layer) through
``nnx.Optimizer``,
``apply_max_norm`` for PyTorch's in-place renormalisation, a donated step
checked with ``jaxslices.table_copies``, and an Orbax checkpoint in the middle
of training, restored into fresh objects and resumed.

The data is synthetic: each class has its own few "keyword" tokens, mixed
with common ones; token 0 is padding. Run: ``python examples/pytorch_port.py``.
Needs jaxslices[flax] and orbax-checkpoint.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import jaxslices as js
import jaxslices.nnx


class Classifier(nnx.Module):
    def __init__(self, vocab: int, dim: int, classes: int, rngs: nnx.Rngs):
        self.bag = jaxslices.nnx.EmbedBag(
            vocab,
            dim,
            combiner="mean",
            padding_idx=0,
            max_norm=1.0,
            strict=True,  # a dense gradient of the table raises at trace time
            rngs=rngs,
        )
        self.out = nnx.Linear(dim, classes, rngs=rngs)

    def __call__(self, tokens: js.JaggedIds) -> jax.Array:
        return self.out(self.bag(tokens))


def loss_fn(model, tokens, labels):
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@nnx.jit(donate_argnums=(0, 1))
def train_step(model, optimizer, tokens, labels):
    # PyTorch's in-place max_norm, row-sparse, first (as PyTorch does it): the
    # lookups then read the renormalised table, and nothing needs the old one.
    model.bag.apply_max_norm(tokens)
    loss, grads = jaxslices.nnx.value_and_grad(loss_fn, strict=True)(
        model, tokens, labels
    )
    optimizer.update(model, grads)
    return loss


@nnx.jit
def accuracy(model, tokens, labels):
    return jnp.mean(jnp.argmax(model(tokens), -1) == labels)


def make_data(num, vocab, classes, max_len, seed):
    """Bags of token ids (lists of different lengths) and their classes."""
    rng = np.random.default_rng(seed)
    keywords = rng.choice(np.arange(1, vocab), (classes, 4), replace=False)
    bags, labels = [], rng.integers(0, classes, num)
    for c in labels:
        n = int(rng.integers(2, max_len + 1))
        bag = rng.integers(1, vocab, n)  # common tokens
        bag[: max(1, n // 3)] = rng.choice(keywords[c], max(1, n // 3))
        bag[rng.random(n) < 0.1] = 0  # padding tokens inside a bag
        bags.append(bag.tolist())
    return bags, labels


def batches(bags, labels, batch, max_total):
    for i in range(0, len(bags) - batch + 1, batch):
        tokens = js.JaggedIds.from_lists(bags[i : i + batch], max_total=max_total)
        yield tokens, jnp.asarray(labels[i : i + batch], jnp.int32)


def fresh(vocab, dim, classes, seed):
    model = Classifier(vocab, dim, classes, nnx.Rngs(seed))
    # SparseAdam for the table, Adam for the rest: lazy_adam is both (on dense
    # leaves it gives optax.adam's numbers).
    return model, nnx.Optimizer(model, js.lazy_adam(1e-2), wrt=nnx.Param)


def main(
    steps: int = 60,
    batch: int = 32,
    vocab: int = 20_000,
    dim: int = 16,
    classes: int = 4,
    max_len: int = 12,
    seed: int = 0,
    directory: str | None = None,
) -> dict:
    bags, labels = make_data(batch * (steps + 4), vocab, classes, max_len, seed)
    max_total = batch * max_len
    data = list(batches(bags, labels, batch, max_total))
    train, test = data[:steps], data[steps:]

    model, optimizer = fresh(vocab, dim, classes, seed)
    copies = js.table_copies(
        train_step.lower(model, optimizer, *train[0]).compile(), min_bytes=1 << 16
    )
    losses = [float(train_step(model, optimizer, *b)) for b in train[: steps // 2]]

    # Checkpoint in the middle of training, restore into fresh objects, resume.
    root = Path(directory or tempfile.mkdtemp(prefix="jaxslices_port_"))
    with ocp.CheckpointManager(root) as mngr:
        mngr.save(steps // 2, args=ocp.args.StandardSave(nnx.state((model, optimizer))))
        mngr.wait_until_finished()
    losses += [float(train_step(model, optimizer, *b)) for b in train[steps // 2 :]]

    model2, optimizer2 = fresh(vocab, dim, classes, seed + 1)  # other weights
    target = jax.tree.map(
        ocp.utils.to_shape_dtype_struct, nnx.state((model2, optimizer2))
    )
    with ocp.CheckpointManager(root) as mngr:
        step = mngr.latest_step()
        restored = mngr.restore(step, args=ocp.args.StandardRestore(target))
    nnx.update((model2, optimizer2), restored)
    for b in train[steps // 2 :]:
        train_step(model2, optimizer2, *b)

    leaves = lambda objs: jax.tree.leaves(nnx.state(objs))  # noqa: E731
    resumed_diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            leaves((model, optimizer)), leaves((model2, optimizer2)), strict=True
        )
        if jnp.issubdtype(a.dtype, jnp.floating)
    )
    table = model.bag.embedding[...]
    last = train[-1][0]  # the rows the last step read: renormalised, then trained
    read = np.unique(np.asarray(last.values)[: int(last.offsets[-1])])
    out = {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "test_accuracy": float(np.mean([accuracy(model, *b) for b in test])),
        "table_copies": copies,
        "resumed_vs_uninterrupted": resumed_diff,
        "padding_row_max_abs": float(jnp.max(jnp.abs(table[0]))),
        "last_rows_max_norm": float(jnp.max(jnp.linalg.norm(table[read], axis=1))),
    }
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps, test accuracy "
        f"{out['test_accuracy']:.2f} ({classes} classes); table copies per step: "
        f"{copies}; resumed vs uninterrupted: {resumed_diff}; padding row "
        f"{out['padding_row_max_abs']}; largest norm of the rows the last step read "
        f"{out['last_rows_max_norm']:.3f} (max_norm 1, then one Adam step)"
    )
    return out


if __name__ == "__main__":
    main()
