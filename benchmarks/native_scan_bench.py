"""A sequence model's training step: lookups inside ``lax.scan``, three backends.

Where the native backend (``jaxslices.native``) differs most from the default
wrapper: the wrapper cannot see lookups inside ``lax.scan`` and falls back to
JAX's dense gradient; the native backend keeps them sparse.

Workload: a ``V x 64`` float32 table, ``T`` scan steps over ``B = 128`` ids
each (uniform random ids, fixed seed), an RNN cell ``h = tanh(h @ W + e_t)``,
loss the sum of the hidden states; SGD 0.1, one jitted step with the params
donated. Paths:

* ``dense``: ``jax.value_and_grad`` with ``jnp.take`` + ``jaxslices.sgd``.
* ``jaxslices``: ``jaxslices.value_and_grad`` + ``embedding_lookup`` (dense
  fallback inside ``scan``) + ``jaxslices.sgd``.
* ``native``: table marked with ``capacity = T * B``, plain
  ``jax.value_and_grad``, ``native.to_indexed_slices`` + ``jaxslices.sgd``.

Run: ``python benchmarks/native_scan_bench.py --num-rows 65536 1048576
--seq-len 32 128 --out benchmarks/results/<yyyy-mm>-<backend>``. Prints a
markdown table (median ms per step, interleaved, compile seconds, compiled
temp MB) and writes
``native_scan_bench_<backend>.json``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
from _common import environment, fmt_ratio, interleave, progress, save_json, summary

import jaxslices as js

PATHS = ("dense", "jaxslices", "native")


def rnn_loss(lookup):
    def loss(params, ids):
        def body(h, i):
            h = jnp.tanh(h @ params["w"] + lookup(params["emb"], i))
            return h, jnp.sum(h)

        h0 = jnp.zeros((ids.shape[1], params["w"].shape[0]), jnp.float32)
        _, ys = jax.lax.scan(body, h0, ids)
        return jnp.sum(ys)

    return loss


def make_step(path: str):
    tx = js.sgd(0.1)

    def step(params, ids):
        if path == "native":
            from jaxslices import native

            marked = {**params, "emb": native.mark(params["emb"], capacity=ids.size)}
            loss, g = jax.value_and_grad(rnn_loss(js.embedding_lookup))(marked, ids)
            g = native.to_indexed_slices(g)
        elif path == "jaxslices":
            loss, g = js.value_and_grad(rnn_loss(js.embedding_lookup))(params, ids)
        else:
            take = lambda t, i: jnp.take(t, i, axis=0)  # noqa: E731
            loss, g = jax.value_and_grad(rnn_loss(take))(params, ids)
        updates, _ = tx.update(g, tx.init(params), params)
        return js.apply_updates(params, updates), loss

    return step


class Runner:
    def __init__(self, path: str, num_rows: int, dim: int, ids: jax.Array):
        self.params = {
            "emb": 0.01 * jax.random.normal(jax.random.key(0), (num_rows, dim)),
            "w": 0.5 * jnp.eye(dim),
        }
        t0 = time.perf_counter()
        jitted = jax.jit(make_step(path), donate_argnums=0)
        self.step = jitted.lower(self.params, ids).compile()
        self.compile_s = time.perf_counter() - t0
        self.temp_bytes = int(self.step.memory_analysis().temp_size_in_bytes)
        self.ids = ids

    def __call__(self) -> None:
        self.params, loss = self.step(self.params, self.ids)
        jax.block_until_ready((self.params, loss))


def main(
    num_rows: tuple[int, ...] = (65536, 1048576),
    seq_lens: tuple[int, ...] = (32, 128),
    batch: int = 128,
    dim: int = 64,
    steps: int = 5,
    passes: int = 4,
    paths: tuple[str, ...] = PATHS,
    out: str | None = None,
) -> dict[str, Any]:
    rows = []
    configs = [(v, t) for v in num_rows for t in seq_lens]
    bar = progress(len(configs) * len(paths) * steps * passes, "native_scan_bench")
    for v, t in configs:
        ids = jax.random.randint(jax.random.key(1), (t, batch), 0, v)
        runners = {p: Runner(p, v, dim, ids) for p in paths}
        times = interleave(runners, steps, passes, bar)
        for p, r in runners.items():
            rows.append(
                {
                    "num_rows": v,
                    "seq_len": t,
                    "batch": batch,
                    "path": p,
                    **summary(times[p]),
                    "compile_s": r.compile_s,
                    "temp_bytes": r.temp_bytes,
                }
            )
    if bar is not None:
        bar.close()
    report = {**environment(), "rows": rows, "table": markdown_table(rows)}
    print(report["table"])
    save_json(report, out, f"native_scan_bench_{report['backend']}.json")
    return report


def markdown_table(rows: list[dict]) -> str:
    head = [
        "V",
        "T x B",
        "path",
        "ms (min-max)",
        "dense / path",
        "compile s",
        "temp MB",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        dense = next(
            (
                d["median_ms"]
                for d in rows
                if d["path"] == "dense"
                and (d["num_rows"], d["seq_len"]) == (r["num_rows"], r["seq_len"])
            ),
            None,
        )
        lines.append(
            f"| {r['num_rows']} | {r['seq_len']} x {r['batch']} | {r['path']} | "
            f"{r['median_ms']:.2f} ({r['min_ms']:.2f}-{r['max_ms']:.2f}) | "
            f"{fmt_ratio(dense, r['median_ms'])} | {r['compile_s']:.2f} | "
            f"{r['temp_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-rows", type=int, nargs="+", default=[65536, 1048576])
    p.add_argument("--seq-len", type=int, nargs="+", default=[32, 128])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--paths", nargs="+", default=list(PATHS))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    main(
        num_rows=tuple(a.num_rows),
        seq_lens=tuple(a.seq_len),
        batch=a.batch,
        steps=a.steps,
        passes=a.passes,
        paths=tuple(a.paths),
        out=a.out,
    )
