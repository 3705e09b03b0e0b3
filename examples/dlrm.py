"""A DLRM on synthetic Criteo-shaped data, its 26 tables in one EmbeddingCollection.

The model is TorchRec's ``DLRM``: a dense arch (MLP 13 -> 512 -> 256 -> D) on
the 13 dense features, the 26 sparse features pooled by a
:class:`jaxslices.EmbeddingCollection` (26 tables of Criteo's skewed sizes,
stacked in one ``[sum of rows, D]`` buffer: one gather, one sparse gradient,
one coalesce and scatter per step), the pairwise dot products of the 27
vectors, and an over arch (MLP -> 512 -> 256 -> 1) giving the click logit.

Data (``examples/criteo_synth.py``): generated on the fly, Criteo Kaggle's
cardinalities scaled by ``--scale`` (the default 1/8 gives 4.2M rows, 1.1 GB
at D = 64), Zipf ids, labels from a hidden teacher. The step is one
``jax.jit`` with the params and optimizer state donated (the buffer is
updated in place): row-wise Adagrad (FBGEMM's, exact) on the embeddings,
SGD on the MLPs, as TorchRec's DLRM example trains.

Prints the loss on held-out batches against the label entropy (what
predicting the click rate alone achieves), saves ``<out>/dlrm.png`` (the
loss curve) and ``<out>/dlrm.json``.

Run: ``python examples/dlrm.py`` (300 steps of 1024 examples; a few
minutes on 2 shared CPU cores; ``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
    from . import criteo_synth as synth
except ImportError:  # run as a script
    import criteo_synth as synth  # type: ignore[no-redef]

import jaxslices as js


def feature_names(num: int) -> list[str]:
    return [f"C{f + 1}" for f in range(num)]


def make_collection(sizes, dim: int, dtype=jnp.float32) -> js.EmbeddingCollection:
    """One table per Criteo feature, sum pooling (TorchRec's default)."""
    return js.EmbeddingCollection(
        [
            js.TableConfig(f"t_{name}", rows=v, dim=dim, features=(name,), dtype=dtype)
            for name, v in zip(feature_names(len(sizes)), sizes, strict=True)
        ]
    )


def init_params(coll: js.EmbeddingCollection, init: dict) -> dict:
    """JAX params from :func:`criteo_synth.init_dlrm`'s NumPy values."""
    tables = {
        t.name: jnp.asarray(x, t.dtype)
        for t, x in zip(coll.tables, init["tables"], strict=True)
    }
    return {
        "emb": coll.stack(tables),
        "bottom": [(jnp.asarray(w), jnp.asarray(b)) for w, b in init["bottom"]],
        "top": [(jnp.asarray(w), jnp.asarray(b)) for w, b in init["top"]],
    }


def mlp(layers, x, final_relu: bool):
    for i, (w, b) in enumerate(layers):
        x = x @ w + b
        if final_relu or i < len(layers) - 1:
            x = jax.nn.relu(x)
    return x


def interact(dense_out, emb):
    """TorchRec's ``InteractionArch``: ``[B, D]`` and ``[B, F, D]`` -> ``[B, D + P]``.

    ``P = (F + 1) F / 2``: the dot products of every pair of the ``F + 1``
    vectors (the dense arch's output and the ``F`` pooled embeddings).
    """
    z = jnp.concatenate([dense_out[:, None], emb], axis=1)  # [B, F + 1, D]
    gram = jnp.einsum("bfd,bgd->bfg", z, z)
    iu, ju = np.triu_indices(z.shape[1], k=1)
    return jnp.concatenate([dense_out, gram[:, iu, ju]], axis=1)


def head_loss(params, dense, emb, labels):
    """Mean log loss of the over arch on the interactions of ``emb [B, F, D]``."""
    x = mlp(params["bottom"], dense, final_relu=True)
    logits = mlp(params["top"], interact(x, emb), final_relu=False)[:, 0]
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, labels))


def make_loss(coll: js.EmbeddingCollection):
    def loss_fn(params, dense, kjt, labels):
        emb = coll.concat(params["emb"], kjt)  # [B, F * D], pooled side by side
        # float32 from here (a no-op for float32 tables; bf16 ones pool in
        # float32 and are returned in bf16)
        emb = emb.reshape(emb.shape[0], len(coll.features), -1).astype(jnp.float32)
        return head_loss(params, dense, emb, labels)

    return loss_fn


def make_optimizer(lr: float, dense_lr: float) -> optax.GradientTransformation:
    """Row-wise Adagrad on the buffer, SGD on the MLPs (TorchRec's DLRM recipe)."""
    return optax.multi_transform(
        {"emb": js.rowwise_adagrad(lr), "mlp": js.sgd(dense_lr)},
        lambda p: {"emb": "emb", "bottom": "mlp", "top": "mlp"},
    )


def make_step(
    coll: js.EmbeddingCollection,
    tx: optax.GradientTransformation,
    stochastic_rounding: bool | None = None,
):
    """The jitted training step; params and optimizer state are donated.

    ``stochastic_rounding``: how a bf16/f16 buffer is written
    (:func:`jaxslices.apply_updates`; the step number seeds it).
    """
    grad_fn = js.value_and_grad(make_loss(coll))

    def step(params, state, dense, kjt, labels, k):
        loss, grads = grad_fn(params, dense, kjt, labels)
        updates, state = tx.update(grads, state, params)
        params = js.apply_updates(
            params, updates, stochastic_rounding=stochastic_rounding, key=k
        )
        return params, state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def inputs(batch: synth.Batch, keys, max_total: int):
    """``(dense, KeyedJaggedIds, labels)`` of a synthetic batch."""
    kjt = js.KeyedJaggedIds.from_lengths(
        keys, batch.ids.astype(np.int32), batch.lengths, max_total=max_total
    )
    return jnp.asarray(batch.dense), kjt, jnp.asarray(batch.labels)


def label_entropy(labels: np.ndarray) -> float:
    p = float(np.clip(labels.mean(), 1e-6, 1 - 1e-6))
    return -(p * np.log(p) + (1 - p) * np.log(1 - p))


def main(
    steps: int = 300,
    batch: int = 1024,
    dim: int = 64,
    scale: float = 1 / 8,
    max_len: int = 1,
    lr: float = 0.05,
    dense_lr: float = 0.1,
    eval_every: int = 50,
    eval_batches: int = 4,
    seed: int = 0,
    out: str | None = "out",
    progress: bool = True,
    table_dtype: str = "float32",
    stochastic_rounding: bool | None = None,
) -> dict:
    """Train, evaluating every ``eval_every`` steps; return the curves.

    ``table_dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``): the
    tables'; ``stochastic_rounding``: how a low-precision buffer is written.
    """
    sizes = synth.table_sizes(scale)
    coll = make_collection(sizes, dim, jnp.dtype(table_dtype))
    data = synth.CriteoSynth(tuple(sizes), batch, max_len, seed=seed)
    params = init_params(coll, synth.init_dlrm(sizes, dim, seed=seed))
    tx = make_optimizer(lr, dense_lr)
    state = tx.init(params)
    step = make_step(coll, tx, stochastic_rounding)
    loss_fn = jax.jit(make_loss(coll))
    max_total = len(sizes) * batch * max_len
    held_out = [inputs(data.batch_at(2**40 + i), coll.features, max_total)
                for i in range(eval_batches)]  # fmt: skip
    entropy = float(np.mean([label_entropy(np.asarray(b[2])) for b in held_out]))

    def evaluate(params):
        return float(np.mean([loss_fn(params, *b) for b in held_out]))

    train_losses, evals, times = [], [(0, evaluate(params))], []
    t_start = time.perf_counter()
    for i in range(steps):
        batch_in = inputs(data.batch_at(i), coll.features, max_total)
        t0 = time.perf_counter()
        params, state, loss = step(params, state, *batch_in, i)
        train_losses.append(float(loss))  # blocks: the step's time
        times.append(time.perf_counter() - t0)
        if (i + 1) % eval_every == 0 or i + 1 == steps:
            evals.append((i + 1, evaluate(params)))
            if progress:
                print(
                    f"step {i + 1}: held-out loss {evals[-1][1]:.4f} "
                    f"(label entropy {entropy:.4f})",
                    flush=True,
                )
    result = {
        "settings": dict(
            steps=steps,
            batch=batch,
            dim=dim,
            scale=scale,
            max_len=max_len,
            lr=lr,
            dense_lr=dense_lr,
            seed=seed,
            table_dtype=table_dtype,
            stochastic_rounding=stochastic_rounding,
        ),  # fmt: skip
        "tables": len(sizes),
        "rows": int(sum(sizes)),
        "buffers": {k: list(v) for k, v in coll.shapes.items()},
        "table_bytes": int(sum(x.nbytes for x in jax.tree.leaves(params["emb"]))),
        "label_entropy": entropy,
        "eval": evals,
        "train_losses": train_losses,
        "median_step_ms": 1e3 * float(np.median(times[1:] or times)),
        "first_step_s": times[0],
        "seconds": time.perf_counter() - t_start,
        "environment": {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "python": platform.python_version(),
        },
    }
    print(
        f"DLRM, {len(sizes)} tables ({sum(sizes):,} rows x {dim} in "
        f"{len(coll.buffers)} buffer), {steps} steps of {batch}: held-out loss "
        f"{evals[0][1]:.4f} -> {evals[-1][1]:.4f} (label entropy {entropy:.4f}); "
        f"{result['median_step_ms']:.1f} ms/step"
    )
    if out:
        out_dir = Path(out)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_plot(result, out_dir / "dlrm.png")
        (out_dir / "dlrm.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"plot and numbers saved to {out_dir / 'dlrm.png'}, .json")
    return result


def save_plot(result: dict, path: Path) -> None:
    # A bare Figure, not pyplot: switching pyplot's backend (to Agg) here would
    # stop a notebook that calls this from showing its own plots.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    tr = np.asarray(result["train_losses"])
    k = max(1, len(tr) // 30)
    smooth = np.convolve(tr, np.ones(k) / k, mode="valid")
    ax.plot(np.arange(len(smooth)) + k, smooth, label=f"train (mean of {k})")
    ev = np.asarray(result["eval"])
    ax.plot(ev[:, 0], ev[:, 1], "o-", label="held out")
    ax.axhline(result["label_entropy"], ls="--", c="gray", label="label entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("log loss")
    ax.set_title(f"DLRM on synthetic Criteo ({result['rows']:,} rows)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--scale", type=float, default=1 / 8)
    p.add_argument("--max-len", type=int, default=1, help="ids per bag: 1 to this")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dense-lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out")
    p.add_argument(
        "--table-dtype", default="float32", choices=["float32", "bfloat16", "float16"]
    )
    p.add_argument(
        "--rounding", default="stochastic", choices=["stochastic", "nearest"],
        help="how a bfloat16/float16 buffer is written",
    )  # fmt: skip
    a = p.parse_args()
    main(
        steps=a.steps, batch=a.batch, dim=a.dim, scale=a.scale, max_len=a.max_len,
        lr=a.lr, dense_lr=a.dense_lr, seed=a.seed, out=a.out,
        table_dtype=a.table_dtype,
        stochastic_rounding=a.rounding == "stochastic",
    )  # fmt: skip
