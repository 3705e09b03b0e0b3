"""MovieLens-100K matrix factorisation on a device mesh, tables sharded by rows.

The model of ``examples/movielens.py`` (four embedding tables: user and item
factors and biases, Adagrad) trained twice: on one device, and on a
``data x model`` mesh (default 2 x 4 = 8 devices) with every table and its
Adagrad accumulator sharded by rows over ``model`` (``jaxslices.sharding.shard_rows``,
``jaxslices.sharding.sharded_init``) and the batch split over all devices. Lookups and
updates route ids to their owner shard (``routing="all_to_all"``; pass
``--routing masked`` for the other scheme). Adagrad is exact, so both reach
the same test RMSE.

Without 8 accelerators, CPU devices stand in:
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set here when unset).

Run: ``python examples/sharded.py --epochs 5``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

try:
    from . import data, movielens
except ImportError:  # run as a script
    import data  # type: ignore[no-redef]
    import movielens  # type: ignore[no-redef]

import jaxslices as js  # noqa: E402


def make_sharded_step(tx, mu, reg, routing, capacity):
    lookup = functools.partial(
        js.sharding.sharded_lookup, axis="model", routing=routing, capacity=capacity
    )

    def step(params, state, users, items, ratings):
        loss, grads = js.value_and_grad(movielens.loss_fn, strict=True)(
            params, users, items, ratings, mu, reg, lookup
        )
        params, state = js.sharding.sharded_update(
            tx, grads, state, params, axis="model", routing=routing, capacity=capacity
        )
        return params, state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def train(ds, mesh_shape, *, dim, epochs, batch_size, lr, reg, seed, max_steps, **kw):
    """Train on one device (``mesh_shape=None``) or on a (data, model) mesh."""
    routing, capacity = kw["routing"], kw["capacity"]
    train_idx, test_idx = data.split(len(ds["rating"]), 0.1, seed)
    mu = float(ds["rating"][train_idx].mean())
    num_users, num_items = int(ds["num_users"]), int(ds["num_items"])
    params = movielens.init_params(num_users, num_items, dim, seed)
    tx = js.adagrad(lr)
    if mesh_shape is None:
        step, _ = movielens.make_step(True, lr, reg, mu)
        state = tx.init(params)
        split = None
    else:
        n = int(np.prod(mesh_shape))
        mesh = Mesh(np.array(jax.devices()[:n]).reshape(mesh_shape), ("data", "model"))
        params = {
            k: js.sharding.shard_rows(v, mesh, "model") for k, v in params.items()
        }
        state = js.sharding.sharded_init(tx, params)
        step = make_sharded_step(tx, mu, reg, routing, capacity)
        split = NamedSharding(mesh, P(("data", "model")))
    rng = np.random.default_rng(seed)
    steps_per_epoch = len(train_idx) // batch_size
    total = min(epochs * steps_per_epoch, max_steps or 10**9)
    losses, k = [], 0
    while k < total:
        order = rng.permutation(train_idx)
        for b in range(min(steps_per_epoch, total - k)):
            idx = order[b * batch_size : (b + 1) * batch_size]
            batch = (ds["user"][idx], ds["item"][idx], ds["rating"][idx])
            if split is not None:
                batch = jax.device_put(batch, split)
            params, state, loss = step(params, state, *batch)
            losses.append(float(loss))
            k += 1
    sharding = list(params["user"].sharding.spec) if split is not None else None
    params = {  # drop the padding rows shard_rows added
        "user": params["user"][:num_users],
        "item": params["item"][:num_items],
        "user_bias": params["user_bias"][:num_users],
        "item_bias": params["item_bias"][:num_items],
    }
    te = test_idx
    rmse = movielens.rmse(params, ds["user"][te], ds["item"][te], ds["rating"][te], mu)
    return {"test_rmse": rmse, "losses": losses, "steps": k, "table_spec": sharding}


def main(
    epochs: int = 5,
    dim: int = 32,
    batch_size: int = 1024,
    lr: float = 0.1,
    reg: float = 0.05,
    seed: int = 0,
    max_steps: int | None = None,
    mesh: tuple[int, int] = (2, 4),
    routing: str = "all_to_all",
    capacity: int | None = None,
    data_path: str | None = None,
    out: str | None = None,
) -> dict:
    """Train on one device and on the mesh; return both test RMSEs."""
    ds = data.load_movielens(data_path)
    kw = dict(
        dim=dim,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        reg=reg,
        seed=seed,
        max_steps=max_steps,
        routing=routing,
        capacity=capacity,
    )
    result = {"devices": int(np.prod(mesh)), "mesh": list(mesh), "routing": routing}
    result["single"] = train(ds, None, **kw)
    result["sharded"] = train(ds, tuple(mesh), **kw)
    result.update(movielens.baselines(ds, seed))
    s, m = result["single"], result["sharded"]
    print(
        f"test RMSE: one device {s['test_rmse']:.4f} | {result['devices']} devices "
        f"(mesh data x model = {mesh[0]} x {mesh[1]}, routing={routing}, tables "
        f"sharded {m['table_spec']}) {m['test_rmse']:.4f} | item-mean baseline "
        f"{result['item_mean_rmse']:.4f}"
    )
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "sharded.json").write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--steps", type=int, default=None, help="stop after this many")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--mesh", type=int, nargs=2, default=[2, 4], help="data model")
    p.add_argument("--routing", default="all_to_all", choices=["masked", "all_to_all"])
    p.add_argument("--capacity", type=int, default=None)
    p.add_argument("--data", default=None, help="path to ml-100k.inter or u.data")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    main(
        epochs=a.epochs,
        dim=a.dim,
        batch_size=a.batch_size,
        max_steps=a.steps,
        mesh=tuple(a.mesh),
        routing=a.routing,
        capacity=a.capacity,
        data_path=a.data,
        out=a.out,
    )
