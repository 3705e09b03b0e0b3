"""The README's demo: MovieLens-100K when its data package is installed.

Trains the same matrix-factorisation model twice, with jaxslices (sparse
gradients, ``jaxslices.adagrad``) and with the dense Optax path, prints both
test RMSEs beside the baselines, then times a step of both paths with the item
tables grown to a million rows, where sparse gradients matter (see
``examples/movielens.py``). Takes well under a minute on 2 CPU cores.

Without ``recbole`` (the wheel that carries MovieLens-100K), it says so and
trains the same model on a synthetic rating matrix instead.

Run: ``python examples/demo.py`` (``--out`` for the plot and JSON directory).
"""

from __future__ import annotations

import argparse

import numpy as np

try:
    from . import data, movielens
except ImportError:  # run as a script
    import data  # type: ignore[no-redef]
    import movielens  # type: ignore[no-redef]


def synthetic_ratings(num_users=600, num_items=900, n=60000, rank=4, seed=0) -> dict:
    """Ratings 1-5 from a random low-rank model plus noise."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(num_users, rank))
    v = rng.normal(size=(num_items, rank))
    users = rng.integers(0, num_users, n).astype(np.int32)
    items = (rng.zipf(1.3, n) % num_items).astype(np.int32)
    score = np.sum(u[users] * v[items], -1) / np.sqrt(rank) + rng.normal(0, 0.5, n)
    ratings = np.clip(np.round(3 + score), 1, 5).astype(np.float32)
    return {
        "user": users,
        "item": items,
        "rating": ratings,
        "num_users": np.int32(num_users),
        "num_items": np.int32(num_items),
    }


def main(out: str | None = "out", progress: bool = True, **kwargs) -> dict:
    """Run ``movielens.main(out=out, progress=progress, **kwargs)``, or synthetic."""
    try:
        data.movielens_path()
    except data.DataNotFound as e:
        print(f"MovieLens-100K not found ({e})")
        print("Running the same model on synthetic ratings instead.")
        original = data.load_movielens
        data.load_movielens = lambda path=None: synthetic_ratings()
        try:
            return movielens.main(
                out=out, progress=progress, dataset="synthetic ratings", **kwargs
            )
        finally:
            data.load_movielens = original
    return movielens.main(out=out, progress=progress, **kwargs)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out", help="directory for the plot and JSON")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args()
    main(a.out, not a.no_progress, epochs=a.epochs)
