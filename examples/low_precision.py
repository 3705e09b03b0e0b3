"""Tables in half the memory: MovieLens with float32, bfloat16 round-to-nearest
and bfloat16 stochastic-rounding tables.

The model and data of ``examples/movielens.py`` (matrix factorisation,
``jaxslices.adagrad``), trained several ways on the same batches:

* ``float32``: float32 tables and Adagrad accumulators (the reference);
* ``bf16_nearest``: bfloat16 tables and accumulators, every write rounded to
  nearest (``stochastic_rounding=False`` on the optimizer and on
  ``apply_updates``): what jaxslices did before;
* ``bf16_stochastic``: bfloat16 tables and accumulators, every write rounded
  stochastically (the default for bfloat16 tables);
* ``bf16_stochastic_f32_state``: bfloat16 tables rounded stochastically,
  float32 accumulators (the state decision, docs/optax.md).

Then the DLRM of ``examples/dlrm.py`` (26 Criteo-shaped tables in one
buffer, row-wise Adagrad, whose state is float32 always) with float32,
bfloat16 round-to-nearest and bfloat16 stochastic-rounding tables: the
held-out log loss over training (``--dlrm-steps 0`` skips it).

The forward pass computes in float32 (``dtype=jnp.float32`` on the lookup:
the rows are cast after the gather, the gradient stays sparse). Printed and
written to ``<out>/low_precision.json`` (with ``low_precision.png``): the
test RMSE after every epoch, the final test RMSE's distance to float32, and
the bytes of each table and its optimizer state.

Run: ``python examples/low_precision.py --out out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

try:
    from . import data, dlrm, movielens
except ImportError:  # run as a script
    import data  # type: ignore[no-redef]
    import dlrm  # type: ignore[no-redef]
    import movielens  # type: ignore[no-redef]

import jaxslices as js

#: DLRM variants: name -> (table dtype, stochastic rounding)
DLRM_VARIANTS = {
    "float32": ("float32", None),
    "bf16_nearest": ("bfloat16", False),
    "bf16_stochastic": ("bfloat16", True),
}

#: name -> (table dtype, state dtype, stochastic rounding)
VARIANTS = {
    "float32": (jnp.float32, jnp.float32, False),
    "bf16_nearest": (jnp.bfloat16, jnp.bfloat16, False),
    "bf16_stochastic": (jnp.bfloat16, jnp.bfloat16, True),
    "bf16_stochastic_f32_state": (jnp.bfloat16, jnp.float32, True),
}


def _lookup(table, ids):
    return js.embedding_lookup(table, ids, dtype=jnp.float32)


def make_step(lr: float, reg: float, mu: float, sr: bool):
    opt = js.adagrad(lr, stochastic_rounding=sr)
    grad_fn = js.value_and_grad(movielens.loss_fn, strict=True)

    def step(params, state, users, items, ratings, k):
        loss, grads = grad_fn(params, users, items, ratings, mu, reg, _lookup)
        updates, state = opt.update(grads, state, params)
        params = js.apply_updates(params, updates, stochastic_rounding=sr, key=k)
        return params, state, loss

    return jax.jit(step, donate_argnums=(0, 1)), opt


def _rmse(params, ds, idx, mu) -> float:
    wide = jax.tree.map(lambda t: t.astype(jnp.float32), params)
    return movielens.rmse(wide, ds["user"][idx], ds["item"][idx], ds["rating"][idx], mu)


def train_variant(ds, name, *, dim, epochs, batch_size, lr, reg, seed, max_steps):
    table_dtype, state_dtype, sr = VARIANTS[name]
    train_idx, test_idx = data.split(len(ds["rating"]), 0.1, seed)
    mu = float(ds["rating"][train_idx].mean())
    params = movielens.init_params(
        int(ds["num_users"]), int(ds["num_items"]), dim, seed
    )
    params = jax.tree.map(lambda t: t.astype(table_dtype), params)
    step, opt = make_step(lr, reg, mu, sr)
    # The accumulators take the dtype of what init sees (Optax's rule).
    state = opt.init(jax.tree.map(lambda t: t.astype(state_dtype), params))
    rng = np.random.default_rng(seed)  # the same batches for every variant
    per_epoch = len(train_idx) // batch_size
    curve, losses, k = [], [], 0
    for _ in range(epochs):
        order = rng.permutation(train_idx)
        for b in range(per_epoch):
            if max_steps is not None and k >= max_steps:
                break
            i = order[b * batch_size : (b + 1) * batch_size]
            params, state, loss = step(
                params, state, ds["user"][i], ds["item"][i], ds["rating"][i], k
            )
            losses.append(float(loss))
            k += 1
        curve.append(_rmse(params, ds, test_idx, mu))
    table_bytes = {n: int(t.nbytes) for n, t in params.items()}
    # The accumulators (a bfloat16 table's optimizer also counts its steps:
    # a scalar, the stochastic rounding's per-step seed, left out).
    state_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(state) if x.ndim)
    return {
        "table_dtype": jnp.dtype(table_dtype).name,
        "state_dtype": jnp.dtype(state_dtype).name,
        "stochastic_rounding": sr,
        "test_rmse_per_epoch": curve,
        "test_rmse": curve[-1],
        "losses": losses,
        "steps": k,
        "table_bytes": table_bytes,
        "optimizer_state_bytes": state_bytes,
    }


def save_plot(result: dict, path: Path) -> None:
    # A bare Figure, not pyplot: switching pyplot's backend (to Agg) here would
    # stop a notebook that calls this from showing its own plots.
    from matplotlib.figure import Figure

    runs = result.get("dlrm", {})
    fig = Figure(figsize=(12 if runs else 6.5, 4))
    axes = fig.subplots(1, 2) if runs else [fig.subplots()]
    ax = axes[0]
    for name, r in result["variants"].items():
        ep = np.arange(1, len(r["test_rmse_per_epoch"]) + 1)
        ax.plot(ep, r["test_rmse_per_epoch"], label=f"{name} ({r['test_rmse']:.4f})")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test RMSE")
    ax.set_title("MovieLens-100K, jaxslices.adagrad: table precision")
    ax.legend()
    if runs:
        ax = axes[1]
        for name, r in runs.items():
            steps, losses = zip(*r["eval"], strict=True)
            ax.plot(steps, losses, marker="o", label=f"{name} ({losses[-1]:.4f})")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out log loss")
        ax.set_title("DLRM (synthetic Criteo), row-wise Adagrad")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(
    epochs: int = 30,
    dim: int = 32,
    batch_size: int = 512,
    lr: float = 0.3,
    reg: float = 0.15,
    seed: int = 0,
    max_steps: int | None = None,
    data_path: str | None = None,
    out: str | None = "out",
    variants: tuple[str, ...] = tuple(VARIANTS),
    progress: bool = True,
    dlrm_steps: int = 300,
    dlrm_scale: float = 1 / 8,
    dlrm_batch: int = 1024,
    dlrm_dim: int = 64,
) -> dict:
    """Train each variant on the same batches; return their curves and bytes."""
    ds = data.load_movielens(data_path)
    settings = dict(
        dim=dim, epochs=epochs, batch_size=batch_size, lr=lr, reg=reg, seed=seed
    )
    result = {"dataset": "MovieLens-100K", "settings": settings, "variants": {}}
    names = list(variants)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(names, desc="variants")
    for name in names:
        result["variants"][name] = train_variant(
            ds, name, **settings, max_steps=max_steps
        )
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    ref = result["variants"].get("float32")
    for name, r in result["variants"].items():
        line = f"{name:28s} test RMSE {r['test_rmse']:.4f}"
        if ref is not None:
            r["rmse_minus_float32"] = r["test_rmse"] - ref["test_rmse"]
            line += f" ({r['rmse_minus_float32']:+.4f} vs float32)"
        tables = sum(r["table_bytes"].values())
        state = r["optimizer_state_bytes"]
        line += f", tables {tables / 1e3:.0f} kB, state {state / 1e3:.0f} kB"
        print(line)
    if dlrm_steps:
        result["dlrm"] = {}
        for name, (dtype, sr) in DLRM_VARIANTS.items():
            r = dlrm.main(
                steps=dlrm_steps,
                batch=dlrm_batch,
                dim=dlrm_dim,
                scale=dlrm_scale,
                out=None,
                progress=False,
                table_dtype=dtype,
                stochastic_rounding=sr,
            )
            keep = ("settings", "eval", "label_entropy", "table_bytes", "rows")
            result["dlrm"][name] = {k: r[k] for k in keep} | {
                "final_eval": r["eval"][-1][1],
                "median_step_ms": r["median_step_ms"],
            }
        ref = result["dlrm"]["float32"]["final_eval"]
        for name, r in result["dlrm"].items():
            print(
                f"DLRM {name:16s} held-out log loss {r['final_eval']:.4f} "
                f"({r['final_eval'] - ref:+.4f} vs float32), tables "
                f"{r['table_bytes'] / 1e6:.0f} MB"
            )
    if out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "low_precision.json").write_text(json.dumps(result, indent=1))
        save_plot(result, path / "low_precision.png")
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--reg", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="stop after this many")
    p.add_argument("--data", default=None, help="path to ml-100k.inter or u.data")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--dlrm-steps", type=int, default=300, help="0: no DLRM")
    p.add_argument("--dlrm-scale", type=float, default=1 / 8)
    p.add_argument("--out", default="out")
    a = p.parse_args()
    main(
        epochs=a.epochs,
        dim=a.dim,
        batch_size=a.batch_size,
        lr=a.lr,
        reg=a.reg,
        seed=a.seed,
        max_steps=a.steps,
        data_path=a.data,
        out=a.out,
        variants=tuple(a.variants),
        dlrm_steps=a.dlrm_steps,
        dlrm_scale=a.dlrm_scale,
    )
