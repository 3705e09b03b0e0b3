"""Coalescing study: ways to sum the rows of duplicate ids, and whether SGD should.

Input: ``N = 16384`` ids ``zipf(1.2) % V`` (about a quarter distinct, one id
thousands of times) with ``N x 64`` float32 rows, for ``V`` in {16384, 1048576}.
Every method returns ``(indices, values)`` of static size ``N`` whose valid
indices are unique and whose other slots are padding (index ``V``, values
zero): what an optimizer needs before it reads and writes per-row state
(what ``jaxslices.coalesce`` promises). Only the sort-based methods also sort
the ids; ``library*`` are ``jaxslices.coalesce`` with its public ``method``.

Methods:

* ``unique``: ``jnp.unique(ids, size=N, fill_value=V, return_inverse=True)`` +
  ``segment_sum``.
* ``pair_sort``: stable ``lax.sort((ids, iota))`` + permute rows +
  ``segment_sum(indices_are_sorted=True)`` (jaxslices' first version).
* ``library_pair_sort``, ``library_hash``: ``jaxslices.coalesce(s,
  method="pair_sort" | "hash")`` (the hash with a scatter-min winner, so it is
  order independent).
* ``library``: ``jaxslices.coalesce`` (``method="sort"``; on CPU: sort the ids alone +
  ``searchsorted`` + unsorted ``segment_sum``).
* ``packed_sort``: the permutation from single-operand sorts of packed
  ``uint32`` keys ``id << b | slot`` (two LSD passes when ``V * N > 2**32``).
* ``workspace``: a persistent ``V``-sized int32 buffer (donated state): scatter
  each slot's position to its id, gather back a representative slot per id,
  ``segment_sum`` into the representatives. No reset is needed: every id of
  the batch is written before it is read, so stale entries are never seen.
* ``workspace_reset``: the same, resetting the touched entries afterwards.
* ``hash``: the workspace idea without ``V``-sized state: an ``M = 4N``-slot
  int32 buffer addressed by a multiplicative hash of the id; ids whose cell
  another id won retry with a new hash (``while_loop``, a few rounds). Temp
  memory O(N), independent of V.

SGD: ``table.at[ids].add(-lr * rows)`` straight (raw), against coalescing first
with the fastest methods, the table donated.

Run: ``python benchmarks/coalesce_bench.py --out
benchmarks/results/<yyyy-mm>-<backend>``.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import (
    environment,
    fmt_ratio,
    from_representatives,
    interleave,
    progress,
    save_json,
    summary,
)
from _common import hash_dedup as _common_hash_dedup

import jaxslices as js

Coalesced = tuple[jax.Array, jax.Array]
# A method: (workspace or None, ids [N], rows [N, D], V) -> ((indices, rows), ws).
Method = Callable[[Any, jax.Array, jax.Array, int], tuple[Coalesced, Any]]


# ------------------------------------------------------------------ helpers


def _safe(ids: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """Ids with invalid ones mapped to the padding index V, and the valid mask."""
    valid = (ids >= 0) & (ids < num_rows)
    return jnp.where(valid, ids, num_rows), valid


def _from_sorted(
    sorted_ids: jax.Array, sorted_rows: jax.Array, num_rows: int
) -> Coalesced:
    """Sum runs of equal ids in sorted order; padding segments at the end."""
    n = sorted_ids.shape[0]
    is_new = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
    seg = jnp.cumsum(is_new.astype(jnp.int32)) - 1
    summed = jax.ops.segment_sum(sorted_rows, seg, n, indices_are_sorted=True)
    idx = jnp.full((n,), num_rows, sorted_ids.dtype).at[seg].set(sorted_ids)
    return idx, jnp.where((idx < num_rows)[:, None], summed, 0)


# ------------------------------------------------------------------ methods


def unique(ws: Any, ids: jax.Array, rows: jax.Array, num_rows: int):
    n = ids.shape[0]
    safe, valid = _safe(ids, num_rows)
    uniq, inv = jnp.unique(safe, size=n, fill_value=num_rows, return_inverse=True)
    summed = jax.ops.segment_sum(jnp.where(valid[:, None], rows, 0), inv.ravel(), n)
    return (uniq, jnp.where((uniq < num_rows)[:, None], summed, 0)), ws


def pair_sort(ws: Any, ids: jax.Array, rows: jax.Array, num_rows: int):
    safe, _ = _safe(ids, num_rows)
    iota = jnp.arange(ids.shape[0], dtype=jnp.int32)
    sorted_ids, perm = jax.lax.sort((safe, iota), num_keys=1, is_stable=True)
    return _from_sorted(sorted_ids, rows[perm], num_rows), ws


def library(ws: Any, ids: jax.Array, rows: jax.Array, num_rows: int):
    c = js.coalesce(js.IndexedSlices(rows, ids, (num_rows, rows.shape[1])))
    return (c.indices, c.values), ws


def packed_permutation(safe: jax.Array, num_rows: int) -> jax.Array:
    """Stable sorting permutation of ``safe`` from single-operand uint32 sorts."""
    n = safe.shape[0]
    slot_bits = max(1, (n - 1).bit_length())
    id_bits = int(num_rows).bit_length()  # the padding index V must fit too
    key_bits = 32 - slot_bits
    if id_bits > 2 * key_bits:
        raise ValueError(f"packed_sort: ids of {id_bits} bits do not fit")
    iota = jnp.arange(n, dtype=jnp.uint32)
    mask = jnp.uint32((1 << slot_bits) - 1)
    u = safe.astype(jnp.uint32)

    def sort_pass(key: jax.Array) -> jax.Array:
        return jnp.sort((key << slot_bits) | iota) & mask

    if id_bits <= key_bits:
        return sort_pass(u).astype(jnp.int32)
    low = sort_pass(u & jnp.uint32((1 << key_bits) - 1))  # LSD radix: low bits
    high = sort_pass((u >> key_bits)[low])  # then high bits, stable
    return low[high].astype(jnp.int32)


def packed_sort(ws: Any, ids: jax.Array, rows: jax.Array, num_rows: int):
    safe, _ = _safe(ids, num_rows)
    perm = packed_permutation(safe, num_rows)
    return _from_sorted(safe[perm], rows[perm], num_rows), ws


def _workspace_reps(ws: jax.Array, safe: jax.Array, valid: jax.Array):
    n = safe.shape[0]
    iota = jnp.arange(n, dtype=jnp.int32)
    ws = ws.at[safe].set(iota, mode="drop")  # V (padding) is out of bounds: dropped
    rep = ws.at[safe].get(mode="fill", fill_value=0)
    return jnp.where(valid, rep, iota), ws


def workspace(ws: jax.Array, ids: jax.Array, rows: jax.Array, num_rows: int):
    safe, valid = _safe(ids, num_rows)
    rep, ws = _workspace_reps(ws, safe, valid)
    return from_representatives(rep, safe, valid, rows, num_rows), ws


def workspace_reset(ws: jax.Array, ids: jax.Array, rows: jax.Array, num_rows: int):
    safe, valid = _safe(ids, num_rows)
    rep, ws = _workspace_reps(ws, safe, valid)
    ws = ws.at[safe].set(-1, mode="drop")
    return from_representatives(rep, safe, valid, rows, num_rows), ws


def hash_dedup(ws: Any, ids: jax.Array, rows: jax.Array, num_rows: int, load: int = 4):
    """Hand-written hash dedup (``_common.hash_dedup``; the step floor's)."""
    return _common_hash_dedup(ids, rows, num_rows, load), ws


def library_method(method: str) -> Method:
    """``jaxslices.coalesce(s, method=method)``."""

    def run(ws: Any, ids: jax.Array, rows: jax.Array, num_rows: int):
        s = js.IndexedSlices(rows, ids, (num_rows, rows.shape[1]))
        c = js.coalesce(s, method=method)
        return (c.indices, c.values), ws

    return run


METHODS: dict[str, Method] = {
    "unique": unique,
    "pair_sort": pair_sort,
    "library": library,
    "library_pair_sort": library_method("pair_sort"),
    "library_hash": library_method("hash"),
    "packed_sort": packed_sort,
    "workspace": workspace,
    "workspace_reset": workspace_reset,
    "hash": hash_dedup,
    "hash_load2": functools.partial(hash_dedup, load=2),
}
STATEFUL = {"workspace", "workspace_reset"}
SGD_METHODS = ("library", "library_hash", "hash")


def init_workspace(method: str, num_rows: int) -> jax.Array | None:
    return jnp.zeros((num_rows,), jnp.int32) if method in STATEFUL else None


# ------------------------------------------------------------------ checks


def check(method: str, ids: np.ndarray, rows: np.ndarray, num_rows: int) -> None:
    """Assert a method's result has the dense meaning of the input.

    Three slots get invalid ids (-1, V, V + 3), which must count as padding.
    """
    ids = ids.copy()
    ids[:3] = [-1, num_rows, num_rows + 3]
    fn = jax.jit(METHODS[method], static_argnums=3)
    (idx, vals), _ = fn(init_workspace(method, num_rows), ids, rows, num_rows)
    idx, vals = np.asarray(idx), np.asarray(vals)
    valid = idx < num_rows
    assert valid[: valid.sum()].all(), f"{method}: padding is not at the end"
    assert len(np.unique(idx[valid])) == valid.sum(), f"{method}: duplicate indices"
    assert not vals[~valid].any(), f"{method}: nonzero padding values"
    ids, rows = ids[3:], rows[3:]
    want_ids, inv = np.unique(ids, return_inverse=True)
    want = np.zeros((len(want_ids), rows.shape[1]), np.float64)
    np.add.at(want, inv, rows)
    order = np.argsort(idx[valid])
    np.testing.assert_array_equal(idx[valid][order], want_ids, err_msg=method)
    np.testing.assert_allclose(vals[valid][order], want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ running


class Stepper:
    """A jitted function whose first argument (state) is donated and carried."""

    def __init__(self, fn: Callable, state: Any, batches: list[tuple[Any, ...]]):
        self.fn = jax.jit(fn, donate_argnums=0)
        self.state, self.batches, self.i = state, batches, 0
        self()  # compile and warm up
        self()

    def __call__(self) -> None:
        args = self.batches[self.i % len(self.batches)]
        self.i += 1
        out, self.state = self.fn(self.state, *args)
        jax.block_until_ready((out, self.state))


def coalesce_stepper(method: str, num_rows: int, batches) -> Stepper:
    fn = functools.partial(_call_method, method, num_rows=num_rows)
    return Stepper(fn, init_workspace(method, num_rows), batches)


def _call_method(method: str, ws: Any, ids: jax.Array, rows: jax.Array, *, num_rows):
    return METHODS[method](ws, ids, rows, num_rows)


def sgd_stepper(method: str | None, num_rows: int, dim: int, batches) -> Stepper:
    """``table <- table - 0.1 * dense(rows at ids)``; ``method=None``: raw scatter."""

    def step(state, ids, rows):
        table, ws = state
        if method is not None:
            (ids, rows), ws = METHODS[method](ws, ids, rows, num_rows)
        table = table.at[ids].add(-0.1 * rows, mode="drop")
        return (), (table, ws)

    table = jnp.zeros((num_rows, dim), jnp.float32)
    ws = init_workspace(method, num_rows) if method else None
    return Stepper(step, (table, ws), batches)


def main(
    num_rows: tuple[int, ...] = (16384, 1048576),
    n: int = 16384,
    dim: int = 64,
    num_batches: int = 20,
    steps: int = 30,
    passes: int = 3,
    methods: tuple[str, ...] = tuple(METHODS),
    sgd_methods: tuple[str, ...] = SGD_METHODS,
    seed: int = 0,
    out: str | None = None,
    check_results: bool = True,
) -> dict[str, Any]:
    """Run the study; returns the report (printed, and saved to ``out``).

    With ``check_results`` every method is first checked against NumPy on one
    batch of each V (see :func:`check`).
    """
    rng = np.random.default_rng(seed)
    rows_np = rng.normal(size=(num_batches, n, dim)).astype(np.float32)
    n_sgd = 1 + len(sgd_methods)
    bar = progress(len(num_rows) * (len(methods) + n_sgd) * steps * passes, "coalesce")
    results = []
    for v in num_rows:
        ids_np = (rng.zipf(1.2, size=(num_batches, n)) % v).astype(np.int32)
        for m in methods if check_results else ():
            check(m, ids_np[0], rows_np[0], v)
        batches = [
            (jnp.asarray(i), jnp.asarray(r))
            for i, r in zip(ids_np, rows_np, strict=True)
        ]
        fns: dict[str, Callable[[], None]] = {
            m: coalesce_stepper(m, v, batches) for m in methods
        }
        fns["sgd:raw"] = sgd_stepper(None, v, dim, batches)
        for m in sgd_methods:
            fns[f"sgd:{m}"] = sgd_stepper(m, v, dim, batches)
        times = interleave(fns, steps, passes, bar)
        distinct = [len(np.unique(i)) for i in ids_np]
        results.append(
            {
                "num_rows": v,
                "n": n,
                "dim": dim,
                "distinct_ids_mean": float(np.mean(distinct)),
                "max_repeats": int(max(np.bincount(i).max() for i in ids_np)),
                "timings": {k: summary(t) for k, t in times.items()},
            }
        )
        for s in fns.values():
            s.state = None
    if bar is not None:
        bar.close()
    report = {**environment(), "results": results}
    report["table"] = markdown_table(results)
    print(
        f"{report['cpu']} x{report['nproc']} ({report['backend']}), jax {report['jax']}"
    )
    print(report["table"])
    save_json(report, out, f"coalesce_bench_{report['backend']}.json")
    return report


def markdown_table(results: list[dict[str, Any]]) -> str:
    """One row per method and V: median (min-max) ms, and ratio to ``library``."""
    lines = [
        "| V | distinct ids | method | median ms | min-max ms | / library | "
        "/ raw SGD |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        med = {k: s["median_ms"] for k, s in r["timings"].items()}
        for k, s in r["timings"].items():
            sgd = k.startswith("sgd:")
            ref = "sgd:library" if sgd else "library"
            lines.append(
                f"| {r['num_rows']} | {r['distinct_ids_mean']:.0f} | {k} | "
                f"{s['median_ms']:.3f} | {s['min_ms']:.2f}-{s['max_ms']:.2f} | "
                f"{fmt_ratio(med[k], med.get(ref))} | "
                f"{fmt_ratio(med[k], med.get('sgd:raw')) if sgd else ''} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-rows", type=int, nargs="+", default=[16384, 1048576])
    p.add_argument("--n", type=int, default=16384, help="ids per batch")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=30, help="timed calls per pass")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--sgd-methods", nargs="+", default=list(SGD_METHODS))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    main(
        num_rows=tuple(a.num_rows),
        n=a.n,
        dim=a.dim,
        steps=a.steps,
        passes=a.passes,
        methods=tuple(a.methods),
        sgd_methods=tuple(a.sgd_methods),
        out=a.out,
    )
