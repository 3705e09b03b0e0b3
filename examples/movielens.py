"""Matrix factorisation on MovieLens-100K with sparse gradients.

``rating ~ mu + b_user + b_item + <p_user, q_item>``: four embedding tables read
through ``jaxslices.embedding_lookup``, trained with ``jaxslices.value_and_grad``
and ``jaxslices.adagrad`` in one jitted, donated step. The same model is then
trained on the dense path a JAX user writes today (``jax.value_and_grad`` +
``optax.adagrad`` + ``optax.apply_updates``); Adagrad is exact on both paths,
so they reach the same test RMSE, and the step times are compared.

Data: ``pip install --no-deps recbole==1.2.1`` (see ``examples/data.py``), or
``--data path/to/u.data``.

Run: ``python examples/movielens.py --epochs 20 --out out``.
"""

from __future__ import annotations

import argparse
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
        grad_fn = js.value_and_grad(loss_fn)
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


def train(ds, sparse, *, dim, epochs, batch_size, lr, reg, seed, max_steps, progress):
    train_idx, test_idx = data.split(len(ds["rating"]), 0.1, seed)
    mu = float(ds["rating"][train_idx].mean())
    params = init_params(int(ds["num_users"]), int(ds["num_items"]), dim, seed)
    step, opt = make_step(sparse, lr, reg, mu)
    state = opt.init(params)
    rng = np.random.default_rng(seed)
    steps_per_epoch = len(train_idx) // batch_size
    total = min(epochs * steps_per_epoch, max_steps or 10**9)
    losses, times = [], []
    bar = _tqdm(total, progress, "sparse" if sparse else "dense")
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
    te = test_idx
    test_rmse = rmse(params, ds["user"][te], ds["item"][te], ds["rating"][te], mu)
    return {
        "test_rmse": test_rmse,
        "losses": losses,
        "median_step_ms": float(np.median(times[min(5, len(times) - 1) :])),
        "steps": k,
    }


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


def save_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name in ("sparse", "dense"):
        losses = np.asarray(result[name]["losses"])
        w = max(1, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(w) / w, mode="valid")
        a.plot(smooth, label=f"{name} (test RMSE {result[name]['test_rmse']:.3f})")
    a.axhline(result["item_mean_rmse"] ** 2, ls="--", c="gray", label="item-mean MSE")
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.legend()
    a.set_title("MovieLens-100K matrix factorisation")
    names = ["jaxslices (sparse)", "optax (dense)"]
    ms = [result["sparse"]["median_step_ms"], result["dense"]["median_step_ms"]]
    b.bar(names, ms, color=["tab:blue", "tab:orange"])
    b.set_ylabel("median ms / step")
    b.set_title("step time")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(
    epochs: int = 20,
    dim: int = 32,
    batch_size: int = 1024,
    lr: float = 0.1,
    reg: float = 0.05,
    seed: int = 0,
    max_steps: int | None = None,
    data_path: str | None = None,
    out: str | None = "out",
    progress: bool = True,
) -> dict:
    """Train sparse and dense; return test RMSEs, baselines and step times."""
    ds = data.load_movielens(data_path)
    kw = dict(
        dim=dim,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        reg=reg,
        seed=seed,
        max_steps=max_steps,
        progress=progress,
    )
    result = {**baselines(ds, seed)}
    result["sparse"] = train(ds, True, **kw)
    result["dense"] = train(ds, False, **kw)
    s, d = result["sparse"], result["dense"]
    print(
        f"test RMSE: jaxslices {s['test_rmse']:.4f} | dense optax {d['test_rmse']:.4f} "
        f"| item-mean baseline {result['item_mean_rmse']:.4f} "
        f"| global-mean baseline {result['global_mean_rmse']:.4f}"
    )
    print(
        f"median ms/step: jaxslices {s['median_step_ms']:.2f} | dense "
        f"{d['median_step_ms']:.2f} (tables {int(ds['num_users'])} + "
        f"{int(ds['num_items'])} rows: small, so dense is competitive here)"
    )
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        save_plot(result, Path(out) / "movielens.png")
        print(f"plot saved to {Path(out) / 'movielens.png'}")
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--steps", type=int, default=None, help="stop after this many")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--reg", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="path to ml-100k.inter or u.data")
    p.add_argument("--out", default="out")
    a = p.parse_args()
    main(a.epochs, a.dim, a.batch_size, a.lr, a.reg, a.seed, a.steps, a.data, a.out)
