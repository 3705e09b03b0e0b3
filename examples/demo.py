"""The README's demo: MovieLens-100K when its data package is installed.

Without ``recbole`` (the wheel that carries MovieLens-100K), it says so and
trains the same model on a small synthetic rating matrix instead.

Run: ``python examples/demo.py`` (``--epochs`` to change the length).
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


def main(epochs: int = 10, out: str | None = "out", progress: bool = True) -> dict:
    try:
        data.movielens_path()
    except data.DataNotFound as e:
        print(f"MovieLens-100K not found ({e})")
        print("Running the same model on synthetic ratings instead.")
        original = data.load_movielens
        data.load_movielens = lambda path=None: synthetic_ratings()
        try:
            return movielens.main(epochs=epochs, out=out, progress=progress)
        finally:
            data.load_movielens = original
    return movielens.main(epochs=epochs, out=out, progress=progress)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--out", default="out")
    a = p.parse_args()
    main(a.epochs, a.out)
