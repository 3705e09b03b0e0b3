"""Matrix factorisation on MovieLens-100K with sparse gradients.

``rating ~ mu + b_user + b_item + <p_user, q_item>``: four embedding tables read
through ``jaxslices.embedding_lookup``, trained with ``jaxslices.value_and_grad``
and ``jaxslices.adagrad`` in one jitted, donated step. The same model is then
trained on the dense path a JAX user writes today (``jax.value_and_grad`` +
``optax.adagrad`` + ``optax.apply_updates``); Adagrad is exact on both paths,
so they reach the same test RMSE with the same loss curve.

MovieLens' tables are small (943 users, 1682 items), so there the dense step
is as cheap as the sparse one. The step-time comparison that matters is run
next: the same model and data with the item tables grown to ``--big-rows``
rows (2^20 by default: a catalogue of a million items, of which MovieLens uses
the first 1682), where a dense step reads and writes every row and a sparse
step only the batch's.

Everything printed is also written to ``<out>/movielens.json`` (with the plot
``<out>/movielens.png``); ``docs/examples.md`` quotes the copy in
``benchmarks/results/2026-11-cpu/`` through ``tools/render_docs.py``.

Data: ``pip install --no-deps recbole==1.2.1`` (see ``examples/data.py``), or
``--data path/to/u.data``.

Run: ``python examples/movielens.py --out out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
    from . import data
except ImportError:  # run as a script
    import data  # type: ignore[no-redef]

import jaxslices as js


def init_params(num_users: int, num_items: int, dim: int, seed: int) -> dict:
    ku, ki = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "user": 0.1 * jax.random.normal(ku, (num_users, dim)),
        "item": 0.1 * jax.random.normal(ki, (num_items, dim)),
        "user_bias": jnp.zeros((num_users, 1)),
        "item_bias": jnp.zeros((num_items, 1)),
    }


def predict(params, users, items, mu, lookup=js.embedding_lookup):
    p = lookup(params["user"], users)
    q = lookup(params["item"], items)
    bu = lookup(params["user_bias"], users)[:, 0]
    bi = lookup(params["item_bias"], items)[:, 0]
    return mu + bu + bi + jnp.sum(p * q, -1), (p, q)


def loss_fn(params, users, items, ratings, mu, reg, lookup=js.embedding_lookup):
    pred, (p, q) = predict(params, users, items, mu, lookup)
    mse = jnp.mean((pred - ratings) ** 2)
    # L2 on the rows the batch touched keeps the gradient sparse.
    penalty = reg * (jnp.sum(p**2) + jnp.sum(q**2)) / users.shape[0]
    return mse + penalty


def _dense_lookup(table, ids):
    return jnp.take(table, ids, axis=0)


def make_step(sparse: bool, lr: float, reg: float, mu: float):
    if sparse:
        opt = js.adagrad(lr)
        grad_fn = js.value_and_grad(loss_fn, strict=True)  # dense tables raise
        apply = js.apply_updates
        lookup = js.embedding_lookup
    else:
        opt = optax.adagrad(lr)
        grad_fn = jax.value_and_grad(loss_fn)
        apply = optax.apply_updates
        lookup = _dense_lookup

    def step(params, state, users, items, ratings):
        loss, grads = grad_fn(params, users, items, ratings, mu, reg, lookup)
        updates, state = opt.update(grads, state, params)
        return apply(params, updates), state, loss

    return jax.jit(step, donate_argnums=(0, 1)), opt


def rmse(params, users, items, ratings, mu) -> float:
    pred, _ = jax.jit(predict, static_argnums=4)(
        params, users, items, mu, _dense_lookup
    )
    return float(jnp.sqrt(jnp.mean((jnp.clip(pred, 1, 5) - ratings) ** 2)))


def train(
    ds,
    sparse,
    *,
    dim,
    epochs,
    batch_size,
    lr,
    reg,
    seed,
    max_steps,
    progress,
    item_rows=None,
    evaluate=True,
):
    """Train one path; ``item_rows`` grows the item tables (same data, more rows)."""
    train_idx, test_idx = data.split(len(ds["rating"]), 0.1, seed)
    mu = float(ds["rating"][train_idx].mean())
    num_items = item_rows or int(ds["num_items"])
    params = init_params(int(ds["num_users"]), num_items, dim, seed)
    step, opt = make_step(sparse, lr, reg, mu)
    state = opt.init(params)
    rng = np.random.default_rng(seed)
    steps_per_epoch = len(train_idx) // batch_size
    total = min(epochs * steps_per_epoch, max_steps or 10**9)
    losses, times = [], []
    bar = _tqdm(total, progress, "jaxslices" if sparse else "dense optax")
    k = 0
    while k < total:
        order = rng.permutation(train_idx)
        for b in range(steps_per_epoch):
            if k >= total:
                break
            idx = order[b * batch_size : (b + 1) * batch_size]
            t0 = time.perf_counter()
            params, state, loss = step(
                params, state, ds["user"][idx], ds["item"][idx], ds["rating"][idx]
            )
            loss = float(loss)  # blocks
            times.append((time.perf_counter() - t0) * 1e3)
            losses.append(loss)
            k += 1
            if bar is not None:
                bar.update(1)
                if k % 100 == 0:
                    bar.set_postfix(loss=f"{loss:.3f}")
    if bar is not None:
        bar.close()
    out = {
        "losses": losses,
        # The first steps include compilation.
        "median_step_ms": float(np.median(times[min(5, len(times) - 1) :])),
        "steps": k,
        "item_rows": num_items,
    }
    if evaluate:
        te = test_idx
        out["test_rmse"] = rmse(
            params, ds["user"][te], ds["item"][te], ds["rating"][te], mu
        )
    return out


def baselines(ds, seed: int) -> dict:
    train_idx, test_idx = data.split(len(ds["rating"]), 0.1, seed)
    r_train, r_test = ds["rating"][train_idx], ds["rating"][test_idx]
    mu = r_train.mean()
    sums = np.bincount(ds["item"][train_idx], r_train, int(ds["num_items"]))
    counts = np.bincount(ds["item"][train_idx], None, int(ds["num_items"]))
    item_mean = np.where(counts > 0, (sums + 5 * mu) / (counts + 5), mu)  # shrunk
    return {
        "global_mean_rmse": float(np.sqrt(np.mean((r_test - mu) ** 2))),
        "item_mean_rmse": float(
            np.sqrt(np.mean((r_test - item_mean[ds["item"][test_idx]]) ** 2))
        ),
    }


def _tqdm(total, enabled, desc):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc)


def _smooth(losses, points=200):
    """Mean over consecutive windows: at most ``points`` values for the plot."""
    losses = np.asarray(losses, np.float64)
    w = max(1, len(losses) // points)
    n = len(losses) // w * w
    return losses[:n].reshape(-1, w).mean(1), w


def save_plot(result: dict, path: Path) -> None:
    # A bare Figure, not pyplot: switching pyplot's backend (to Agg) here would
    # stop a notebook that calls this from showing its own plots.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.8))
    a, b = fig.subplots(1, 2)
    styles = {"sparse": ("jaxslices", "-", 3.0), "dense": ("dense optax", "--", 1.5)}
    for name, (label, ls, lw) in styles.items():
        smooth, w = _smooth(result[name]["losses"])
        a.plot(
            np.arange(len(smooth)) * w,
            smooth,
            ls=ls,
            lw=lw,
            label=f"{label} (test RMSE {result[name]['test_rmse']:.4f})",
        )
    base = result["item_mean_rmse"] ** 2
    a.axhline(base, ls=":", c="gray", label="item-mean baseline (test MSE)")
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.legend()
    a.set_title(f"{result['dataset']}: the two paths' loss curves coincide")
    big = result["large"]
    groups = [
        f"{result['num_items']} item rows\n(MovieLens)",
        f"{big['item_rows']:,} item rows",
    ]
    x = np.arange(2)
    sparse_ms = [result["sparse"]["median_step_ms"], big["sparse"]["median_step_ms"]]
    dense_ms = [result["dense"]["median_step_ms"], big["dense"]["median_step_ms"]]
    b.bar(x - 0.2, sparse_ms, 0.4, label="jaxslices (sparse)", color="tab:blue")
    b.bar(x + 0.2, dense_ms, 0.4, label="dense optax", color="tab:orange")
    b.set_yscale("log")
    b.set_xticks(x, groups)
    b.set_ylabel("median ms / step (log)")
    b.set_title(f"step time: {big['speedup']:.0f}x faster at {big['item_rows']:,} rows")
    for xi, ms in zip(x - 0.2, sparse_ms, strict=True):
        b.annotate(f"{ms:.2f}", (xi, ms), ha="center", va="bottom")
    for xi, ms in zip(x + 0.2, dense_ms, strict=True):
        b.annotate(f"{ms:.2f}", (xi, ms), ha="center", va="bottom")
    b.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def environment() -> dict:
    # The kernels first, before any progress bar: without a C++ compiler
    # their one-time warning then gets a line of its own.
    js.kernels.available()
    return {
        "jax": jax.__version__,
        # The path jaxslices' steps take: native kernels, or XLA and why.
        "kernels": js.kernels.status(),
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        # Timings on a shared machine depend on what else runs: record it.
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


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
    progress: bool = True,
    big_rows: int = 2**20,
    speed_steps: int = 40,
    dataset: str = "MovieLens-100K",
) -> dict:
    """Train sparse and dense; return test RMSEs, baselines and step times.

    ``big_rows`` and ``speed_steps`` set the step-time comparison with grown
    item tables (``speed_steps`` steps per path; at most 10 when ``max_steps``
    is given).
    """
    ds = data.load_movielens(data_path)
    settings = dict(
        dim=dim, epochs=epochs, batch_size=batch_size, lr=lr, reg=reg, seed=seed
    )
    kw = dict(**settings, max_steps=max_steps, progress=progress)
    result = {
        "dataset": dataset,
        "settings": settings,
        "optimizer": f"jaxslices.adagrad({lr}) vs optax.adagrad({lr})",
        "num_users": int(ds["num_users"]),
        "num_items": int(ds["num_items"]),
        "num_ratings": len(ds["rating"]),
        "environment": environment(),
        **baselines(ds, seed),
    }
    t0 = time.perf_counter()
    result["sparse"] = train(ds, True, **kw)
    result["dense"] = train(ds, False, **kw)
    s, d = result["sparse"], result["dense"]
    gap = np.abs(np.asarray(s["losses"]) - np.asarray(d["losses"]))
    result["max_loss_gap"] = float(gap.max())
    print(
        f"{dataset}, {s['steps']} steps of {batch_size} ratings "
        f"(dim {dim}, adagrad lr {lr}, L2 {reg}):"
    )
    print(
        f"  test RMSE: jaxslices {s['test_rmse']:.4f} | dense optax "
        f"{d['test_rmse']:.4f} | item-mean baseline {result['item_mean_rmse']:.4f} "
        f"| global-mean baseline {result['global_mean_rmse']:.4f}"
    )
    print(
        f"  same loss curve: largest difference {result['max_loss_gap']:.1e} "
        f"over {s['steps']} steps"
    )
    print(
        f"  median ms/step: jaxslices {s['median_step_ms']:.2f} | dense optax "
        f"{d['median_step_ms']:.2f} ({result['num_users']} + {result['num_items']}"
        " rows: small tables, dense is cheap here)"
    )

    # A short run (max_steps) is a smoke test: a few timed steps are enough.
    n = speed_steps if max_steps is None else min(speed_steps, max_steps, 10)
    big = {"item_rows": big_rows, "steps": n}
    for name, sparse in (("sparse", True), ("dense", False)):
        r = train(
            ds,
            sparse,
            **{**kw, "epochs": 10**6, "max_steps": n},
            item_rows=big_rows,
            evaluate=False,
        )
        big[name] = {"median_step_ms": r["median_step_ms"], "losses": r["losses"]}
    big["speedup"] = big["dense"]["median_step_ms"] / big["sparse"]["median_step_ms"]
    big["max_loss_gap"] = float(
        np.max(np.abs(np.asarray(big["sparse"]["losses"]) - big["dense"]["losses"]))
    )
    result["large"] = big
    native = result["environment"]["kernels"].startswith("loaded")
    print(
        f"Same model with {big_rows:,}-row item tables ({n} steps each): median "
        f"ms/step jaxslices {big['sparse']['median_step_ms']:.2f} | dense optax "
        f"{big['dense']['median_step_ms']:.2f}: {big['speedup']:.0f}x faster "
        f"(jaxslices on {'its native CPU kernels' if native else 'the XLA path'})"
    )
    result["seconds"] = time.perf_counter() - t0
    if out:
        out_dir = Path(out)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_plot(result, out_dir / "movielens.png")
        record = json.loads(json.dumps(result))
        for r in (record["sparse"], record["dense"]):
            r["losses"] = [round(x, 6) for x in _smooth(r["losses"])[0]]
        for r in (record["large"]["sparse"], record["large"]["dense"]):
            del r["losses"]
        (out_dir / "movielens.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"plot and numbers saved to {out_dir / 'movielens.png'}, .json")
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--steps", type=int, default=None, help="stop after this many")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--reg", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="path to ml-100k.inter or u.data")
    p.add_argument("--out", default="out")
    p.add_argument("--big-rows", type=int, default=2**20)
    p.add_argument("--speed-steps", type=int, default=40)
    a = p.parse_args()
    main(
        a.epochs,
        a.dim,
        a.batch_size,
        a.lr,
        a.reg,
        a.seed,
        a.steps,
        a.data,
        a.out,
        big_rows=a.big_rows,
        speed_steps=a.speed_steps,
    )
