"""Skip-gram with negative sampling on the Lee news corpus, with sparse gradients.

Two tables (input and output word vectors) are read only through
``jaxslices.embedding_lookup``, so each step's gradient is an
``IndexedSlices`` of the few hundred words in the batch, trained with
``jaxslices.adagrad`` in one jitted, donated step. Reports the Spearman
correlation with WordSim-353 human judgements (pairs in the vocabulary) against
random vectors, and nearest neighbours of a few words.

Data: ``pip install --no-deps gensim==4.4.0`` (see ``examples/data.py``), or
``--corpus path/to/lee_background.cor --wordsim path/to/wordsim353.tsv``.

Run: ``python examples/word2vec.py --epochs 10 --out out``.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

try:
    from . import data
except ImportError:  # run as a script
    import data  # type: ignore[no-redef]

import jaxslices as js


def build_vocab(corpus: list[list[str]], min_count: int):
    counts = Counter(w for doc in corpus for w in doc)
    words = sorted(
        (w for w, c in counts.items() if c >= min_count), key=lambda w: -counts[w]
    )
    return (
        words,
        {w: i for i, w in enumerate(words)},
        np.array([counts[w] for w in words]),
    )


def skipgram_pairs(corpus, index, counts, window: int, sample: float, rng):
    """(center, context) pairs; frequent words are subsampled as in word2vec."""
    freq = counts / counts.sum()
    keep = (
        np.ones(len(counts)) if sample <= 0 else np.sqrt(sample / freq) + sample / freq
    )
    pairs = []
    for doc in corpus:
        ids = [index[w] for w in doc if w in index]
        ids = [i for i in ids if rng.random() < keep[i]]
        for i, center in enumerate(ids):
            span = rng.integers(1, window + 1)  # dynamic window, as word2vec
            for j in range(max(0, i - span), min(len(ids), i + span + 1)):
                if j != i:
                    pairs.append((center, ids[j]))
    return np.asarray(pairs, np.int32)


def loss_fn(params, centers, contexts, negatives):
    u = js.embedding_lookup(params["in"], centers)  # (B, D)
    v = js.embedding_lookup(params["out"], contexts)  # (B, D)
    n = js.embedding_lookup(params["out"], negatives)  # (B, K, D)
    pos = jax.nn.log_sigmoid(jnp.sum(u * v, -1))
    neg = jnp.sum(jax.nn.log_sigmoid(-jnp.einsum("bd,bkd->bk", u, n)), -1)
    return -jnp.mean(pos + neg)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(x):
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for value in np.unique(x):  # average ranks of ties
            tie = x == value
            r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(np.asarray(a)), ranks(np.asarray(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def _unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / (np.linalg.norm(vectors, axis=1, keepdims=True) + 1e-8)


def similarity_score(vectors: np.ndarray, index: dict, pairs) -> tuple[float, int]:
    unit = _unit(vectors)
    found = [(index[a], index[b], s) for a, b, s in pairs if a in index and b in index]
    if len(found) < 3:
        return float("nan"), len(found)
    cos = [float(unit[i] @ unit[j]) for i, j, _ in found]
    return spearman(np.array(cos), np.array([s for *_, s in found])), len(found)


def neighbours(vectors, words, index, query: str, k: int = 5) -> list[str]:
    unit = _unit(vectors)
    sims = unit @ unit[index[query]]
    return [words[i] for i in np.argsort(-sims)[1 : k + 1]]


def main(
    epochs: int = 5,
    dim: int = 64,
    window: int = 4,
    negatives: int = 5,
    min_count: int = 3,
    sample: float = 0.0,
    batch_size: int = 1024,
    lr: float = 0.2,
    seed: int = 0,
    max_steps: int | None = None,
    corpus_path: str | None = None,
    wordsim_path: str | None = None,
    out: str | None = "out",
    progress: bool = True,
) -> dict:
    """Train skip-gram; return the similarity scores and a few neighbours."""
    corpus = data.load_lee_corpus(corpus_path)
    words, index, counts = build_vocab(corpus, min_count)
    rng = np.random.default_rng(seed)
    pairs = skipgram_pairs(corpus, index, counts, window, sample, rng)
    noise = counts**0.75 / np.sum(counts**0.75)  # word2vec's unigram^0.75
    vocab = len(words)
    k_in, _ = jax.random.split(jax.random.PRNGKey(seed))
    params = {
        "in": (jax.random.uniform(k_in, (vocab, dim)) - 0.5) / dim,
        "out": jnp.zeros((vocab, dim)),
    }
    random_vectors = np.asarray(
        jax.random.normal(jax.random.PRNGKey(seed + 1), (vocab, dim))
    )
    opt = js.adagrad(lr)
    state = opt.init(params)

    def _step(params, state, c, x, n):
        loss, grads = js.value_and_grad(loss_fn, strict=True)(params, c, x, n)
        updates, state = opt.update(grads, state, params)
        return js.apply_updates(params, updates), state, loss

    step = jax.jit(_step, donate_argnums=(0, 1))
    steps_per_epoch = max(1, len(pairs) // batch_size)
    total = min(epochs * steps_per_epoch, max_steps or 10**9)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="skip-gram")
    losses, times, k = [], [], 0
    while k < total:
        order = rng.permutation(len(pairs))
        for b in range(steps_per_epoch):
            if k >= total:
                break
            batch = pairs[order[b * batch_size : (b + 1) * batch_size]]
            neg = rng.choice(vocab, size=(len(batch), negatives), p=noise).astype(
                np.int32
            )
            t0 = time.perf_counter()
            params, state, loss = step(params, state, batch[:, 0], batch[:, 1], neg)
            losses.append(float(loss))
            times.append((time.perf_counter() - t0) * 1e3)
            k += 1
            if bar is not None:
                bar.update(1)
                if k % 50 == 0:
                    bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if bar is not None:
        bar.close()
    vectors = np.asarray(params["in"])
    pairs353 = data.load_wordsim353(wordsim_path)
    score, n_pairs = similarity_score(vectors, index, pairs353)
    random_score, _ = similarity_score(random_vectors, index, pairs353)
    queries = [
        w for w in ("government", "police", "president", "australia") if w in index
    ]
    near = {q: neighbours(vectors, words, index, q) for q in queries}
    result = {
        "vocab": vocab,
        "pairs": len(pairs),
        "steps": k,
        "wordsim_spearman": score,
        "random_spearman": random_score,
        "wordsim_pairs": n_pairs,
        "losses": losses,
        "median_step_ms": float(np.median(times[min(5, len(times) - 1) :])),
        "neighbours": near,
    }
    print(
        f"vocabulary {vocab} words, {len(pairs)} skip-gram pairs, {k} steps, "
        f"median {result['median_step_ms']:.2f} ms/step"
    )
    print(
        f"WordSim-353 Spearman ({n_pairs} pairs in vocabulary): {score:.3f} "
        f"(random vectors: {random_score:.3f})"
    )
    for q, ns in near.items():
        print(f"  nearest to {q!r}: {', '.join(ns)}")
    if out:
        save_plot(losses, Path(out) / "word2vec.png")
    return result


def save_plot(losses, path: Path) -> None:
    # A bare Figure, not pyplot: switching pyplot's backend (to Agg) here would
    # stop a notebook that calls this from showing its own plots.
    from matplotlib.figure import Figure

    path.parent.mkdir(parents=True, exist_ok=True)
    w = max(1, len(losses) // 50)
    smooth = np.convolve(losses, np.ones(w) / w, mode="valid")
    fig = Figure(figsize=(5, 3.4))
    ax = fig.subplots()
    ax.plot(smooth)
    ax.set_xlabel("step")
    ax.set_ylabel("negative-sampling loss")
    ax.set_title("Skip-gram on the Lee corpus (jaxslices)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", default=None)
    p.add_argument("--wordsim", default=None)
    p.add_argument("--out", default="out")
    a = p.parse_args()
    main(
        epochs=a.epochs,
        dim=a.dim,
        lr=a.lr,
        seed=a.seed,
        max_steps=a.steps,
        corpus_path=a.corpus,
        wordsim_path=a.wordsim,
        out=a.out,
    )
