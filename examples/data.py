"""Data for the examples, found inside installed PyPI wheels (nothing is downloaded).

* MovieLens-100K ratings ship in the ``recbole==1.2.1`` wheel
  (``recbole/dataset_example/ml-100k/ml-100k.inter``).
* The Lee news corpus and word-similarity sets ship in the ``gensim==4.4.0``
  wheel (``gensim/test/test_data/``).

Install them without their (heavy, unneeded) dependencies::

    pip install --no-deps recbole==1.2.1 gensim==4.4.0

The packages are located through ``importlib.metadata`` and never imported.
Every loader also takes a path to the original files. The MovieLens licence
forbids redistribution, so no data is copied into this repository.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import numpy as np

INSTALL_HINT = "pip install --no-deps recbole==1.2.1 gensim==4.4.0"


class DataNotFound(FileNotFoundError):
    """The data package is not installed and no path was given."""


def packaged_file(package: str, relative: str) -> Path:
    """Path of a file shipped inside an installed wheel, without importing it."""
    try:
        dist = distribution(package)
    except PackageNotFoundError as e:
        raise DataNotFound(
            f"The example data lives in the PyPI package {package!r}, which is not "
            f"installed. Install it with `{INSTALL_HINT}`, or pass the path to the "
            f"original file ({relative.rsplit('/', 1)[-1]}) explicitly."
        ) from e
    path = Path(str(dist.locate_file(relative)))
    if not path.exists():
        raise DataNotFound(
            f"{package} is installed but {relative} is missing at {path}."
        )
    return path


def movielens_path(path: str | Path | None = None) -> Path:
    if path is not None:
        return Path(path)
    return packaged_file("recbole", "recbole/dataset_example/ml-100k/ml-100k.inter")


def load_movielens(path: str | Path | None = None) -> dict[str, np.ndarray]:
    """MovieLens-100K as contiguous int32 user/item ids and float32 ratings.

    Reads RecBole's ``.inter`` (tab separated, one header line) or the original
    ``u.data`` (user, item, rating, timestamp; no header).
    """
    p = movielens_path(path)
    with open(p) as f:
        first = f.readline()
    skip = 1 if ":" in first else 0
    raw = np.loadtxt(p, delimiter="\t", skiprows=skip, dtype=np.float64)
    users, user_idx = np.unique(raw[:, 0].astype(np.int64), return_inverse=True)
    items, item_idx = np.unique(raw[:, 1].astype(np.int64), return_inverse=True)
    return {
        "user": user_idx.astype(np.int32),
        "item": item_idx.astype(np.int32),
        "rating": raw[:, 2].astype(np.float32),
        "num_users": np.int32(len(users)),
        "num_items": np.int32(len(items)),
    }


def split(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic random train/test split of ``range(n)``."""
    perm = np.random.default_rng(seed).permutation(n)
    cut = int(n * (1 - test_fraction))
    return perm[:cut], perm[cut:]


def lee_corpus_path(path: str | Path | None = None) -> Path:
    if path is not None:
        return Path(path)
    return packaged_file("gensim", "gensim/test/test_data/lee_background.cor")


def load_lee_corpus(path: str | Path | None = None) -> list[list[str]]:
    """The Lee news corpus (300 articles) as lists of lowercase tokens."""
    text = lee_corpus_path(path).read_text(encoding="utf-8", errors="replace")
    return [re.findall(r"[a-z]+", line.lower()) for line in text.splitlines() if line]


def load_wordsim353(path: str | Path | None = None) -> list[tuple[str, str, float]]:
    """WordSim-353 pairs with their human similarity scores."""
    p = (
        Path(path)
        if path
        else packaged_file("gensim", "gensim/test/test_data/wordsim353.tsv")
    )
    pairs = []
    for line in p.read_text(encoding="utf-8").splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split("\t")
        try:
            pairs.append((parts[0].lower(), parts[1].lower(), float(parts[2])))
        except (IndexError, ValueError):
            continue  # header
    return pairs
