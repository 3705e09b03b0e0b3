"""Synthetic Criteo-shaped data and DLRM initial values, in NumPy only.

NumPy only so that the JAX example (``examples/dlrm.py``), its benchmark
(``benchmarks/dlrm_bench.py``) and the TorchRec side of the benchmark
(``benchmarks/dlrm_torchrec.py``, another environment) read the same batches
and start from the same numbers.

* 26 categorical features with the Criteo Kaggle (Display Advertising
  Challenge) per-feature cardinalities, as published with the DLRM and
  TorchRec Criteo examples, scaled so the big tables fit the machine
  (:func:`table_sizes`); 13 dense features.
* Ids are Zipf-distributed per feature (a few hot rows, a long tail), the hot
  ranks spread over the table by a fixed hash.
* Labels come from a hidden logistic teacher (a per-row effect of every
  feature plus a linear function of the dense features), so a model's loss
  can fall below the label entropy.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Criteo Kaggle cardinalities, C1..C26 (33,762,577 rows in all).
KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
NUM_DENSE = 13
# TorchRec's DLRM naming: dense arch 13 -> 512 -> 256 -> D, over arch -> 512 ->
# 256 -> 1 (ReLU between, none after the last layer).
BOTTOM = (512, 256)
TOP = (512, 256, 1)


def table_sizes(scale: float = 1 / 8, keep: int = 10_000) -> list[int]:
    """Kaggle cardinalities times ``scale``; tables up to ``keep`` rows kept whole.

    ``max(ceil(c * scale), min(c, keep))`` is monotone in ``c``: the order and
    skew of the big tables stay Criteo's while the small ones keep their size.
    """
    return [max(int(np.ceil(c * scale)), min(c, keep)) for c in KAGGLE_CARDINALITIES]


def _zipf_ranks(rng, n: int, size: int, alpha: float) -> np.ndarray:
    """Ranks in ``[0, n)``, ``P(k) ~ (k + 1) ** -alpha`` (continuous inverse CDF)."""
    if n == 1:
        return np.zeros(size, np.int64)
    u = rng.random(size)
    a1 = 1.0 - alpha
    x = ((n + 1.0) ** a1 - 1.0) * u + 1.0
    return np.minimum(np.floor(x ** (1.0 / a1)) - 1, n - 1).astype(np.int64)


def _mix(x: np.ndarray, salt: int) -> np.ndarray:
    """A fixed 64-bit hash of ``(x, salt)`` (the splitmix64 finaliser)."""
    golden = np.array([0x9E3779B97F4A7C15], np.uint64)  # arrays wrap silently
    z = x.astype(np.uint64) + np.array([salt], np.uint64) * golden
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@dataclasses.dataclass(frozen=True)
class Batch:
    dense: np.ndarray  # [B, 13] float32
    ids: np.ndarray  # flat ids, feature-major (like a KeyedJaggedTensor), int64
    lengths: np.ndarray  # [F, B] int32: ids per bag
    labels: np.ndarray  # [B] float32

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths.reshape(-1))])

    def padded(self, max_len: int) -> np.ndarray:
        """``[F, B, max_len]`` ids, ``-1`` in empty slots."""
        F, B = self.lengths.shape
        out = np.full((F * B, max_len), -1, np.int32)
        lens = self.lengths.reshape(-1)
        pos = np.arange(self.ids.size) - np.repeat(self.offsets[:-1], lens)
        out[np.repeat(np.arange(F * B), lens), pos] = self.ids
        return out.reshape(F, B, max_len)


@dataclasses.dataclass(frozen=True)
class CriteoSynth:
    """Batch ``step`` of the synthetic data; ``max_len=1`` is Criteo's one id per bag.

    With ``max_len > 1`` each bag holds 1 to ``max_len`` ids (uniformly).
    """

    sizes: tuple[int, ...]
    batch: int = 2048
    max_len: int = 1
    alpha: float = 1.05
    seed: int = 0

    def batch_at(self, step: int) -> Batch:
        rng = np.random.default_rng((self.seed, step))
        B, F = self.batch, len(self.sizes)
        dense = np.log1p(rng.exponential(3.0, (B, NUM_DENSE))).astype(np.float32)
        if self.max_len == 1:
            lengths = np.ones((F, B), np.int32)
        else:
            lengths = rng.integers(1, self.max_len + 1, (F, B)).astype(np.int32)
        teacher = np.random.default_rng(12345).normal(0, 0.15, NUM_DENSE)
        logit = dense @ teacher - 1.1
        vals = []
        for f, n in enumerate(self.sizes):
            cnt = int(lengths[f].sum())
            row = (_zipf_ranks(rng, n, cnt, self.alpha) * 2654435761 + 97 * f) % n
            vals.append(row)
            effect = (_mix(row, f + 1) >> np.uint64(11)).astype(np.float64) / 2.0**53
            bag = np.repeat(np.arange(B), lengths[f])
            logit += np.bincount(bag, (effect - 0.5) * 2.0, B) / lengths[f] * 0.6
        labels = (rng.random(B) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return Batch(dense, np.concatenate(vals), lengths, labels)


def _linear(rng, n_in: int, n_out: int):
    bound = 1.0 / np.sqrt(n_in)  # PyTorch's nn.Linear default
    w = rng.uniform(-bound, bound, (n_in, n_out)).astype(np.float32)
    b = rng.uniform(-bound, bound, (n_out,)).astype(np.float32)
    return w, b


def interaction_width(num_features: int, dim: int) -> int:
    """The over arch's input: ``D`` plus the pairs of ``F + 1`` vectors."""
    n = num_features + 1
    return dim + n * (n - 1) // 2


def init_dlrm(sizes, dim: int, seed: int = 0) -> dict:
    """``{"tables": [V_f x D], "bottom": [(W, b)], "top": [(W, b)]}`` in NumPy.

    Tables ``U(-sqrt(1 / V), sqrt(1 / V))`` (TorchRec's default), linear
    layers PyTorch's default; ``W`` is ``[in, out]``.
    """
    rng = np.random.default_rng(seed)
    tables = []
    for v in sizes:
        bound = np.sqrt(1.0 / v)
        t = rng.random((v, dim), dtype=np.float32)
        t *= 2 * bound
        t -= bound
        tables.append(t)
    widths = (NUM_DENSE, *BOTTOM, dim)
    bottom = [_linear(rng, a, b) for a, b in zip(widths[:-1], widths[1:], strict=True)]
    widths = (interaction_width(len(sizes), dim), *TOP)
    top = [_linear(rng, a, b) for a, b in zip(widths[:-1], widths[1:], strict=True)]
    return {"tables": tables, "bottom": bottom, "top": top}
