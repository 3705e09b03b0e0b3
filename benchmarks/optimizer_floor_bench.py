"""Optimizer steps at the floor: every optimizer vs the floor's SGD step.

Workload (``step_bench.py``'s): a ``V x 64`` float32 table; 1024 examples x
16 ids ``zipf(1.2) % V`` per step (fixed seed, 20 batches cycled: about 4,300
distinct rows of 16,384 lookups at V = 1M); mean of the 16 rows ->
Linear(64 -> 1) -> mean squared error. Optimizers: SGD 0.1, clip (global
norm 1) + SGD 0.1, Adagrad 0.1, lazy Adam 1e-3, row-wise Adagrad 0.1, FTRL
0.1 (``l1=1e-4``). Every step is one ``jax.jit`` with params and state
donated; the paths of one (V, optimizer) run interleaved (``_common.interleave``),
so their ratios are measured side by side.

Paths:

* ``floor_sgd``: the floor: the gradient with respect to the gathered rows,
  then ``table.at[ids].add(-lr * rows)``. The reference of every ratio.
* ``hand``: the same algorithm written by hand, as a user would without
  jaxslices: per-row sums by a hand-written hash dedup into one slot per
  lookup (``_common.hash_dedup``), one state array per quantity, gathers and
  scatters of those rows (SGD: the floor itself).
* ``jaxslices``: ``jaxslices.value_and_grad`` + the jaxslices optimizer with
  its defaults + ``jaxslices.apply_updates``.
* ``bounded``: the same with ``max_distinct`` from
  ``jaxslices.capacity.estimate_max_distinct`` over the workload's batches
  (margin 1.25, a multiple of 128). Only for a jaxslices that has it.
* ``xla``: ``jaxslices``, traced with the native CPU kernels off
  (``jaxslices.kernels.disabled()``): the XLA path of the same code, in the
  same process. Only for a jaxslices that has kernels (then ``jaxslices``
  and ``bounded`` are its native path wherever the kernels run).

``--lookup bag`` reads the table with ``jaxslices.embedding_bag(...,
combiner="mean")`` (the native path's forward kernel) instead of
``embedding_lookup(...).mean(1)``; the floor and the hand-written paths are
the same either way.

Each tree given to ``--trees`` (a directory holding a ``jaxslices`` package)
is measured in its own child process, the trees taking turns ``--repeats``
times: ``--trees . /tmp/old --labels new today`` compares this code with an
older one (``git archive <commit> jaxslices | tar -x -C /tmp/old``) on the
same machine, each ratio measured within one process. The report has the
median over repeats of each ratio, every repeat's value, and the machine's
load average before and after each child.

Run: ``python benchmarks/optimizer_floor_bench.py --trees . /tmp/old --labels
new today --repeats 2 --out benchmarks/results/<yyyy-mm>-cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

OPTIMIZERS = ("sgd", "clip_sgd", "adagrad", "adam", "rowwise_adagrad", "ftrl")
PATHS = ("floor_sgd", "hand", "jaxslices", "bounded", "xla")
LR = {
    "sgd": 0.1,
    "clip_sgd": 0.1,
    "adagrad": 0.1,
    "adam": 1e-3,
    "rowwise_adagrad": 0.1,
    "ftrl": 0.1,
}
FTRL_L1 = 1e-4
# Issue 21's goals at V = 1M (CPU), as ratios of the bounded path to floor_sgd.
GOALS = {"clip_sgd": 1.3, "rowwise_adagrad": 1.5, "adagrad": 2.0, "adam": 2.0}
GOALS["ftrl"] = 2.0
HERE = Path(__file__).resolve().parent


# ===================================================== child: one code tree


def child(
    num_rows: tuple[int, ...],
    optimizers: tuple[str, ...],
    dim: int,
    batch: int,
    bag: int,
    num_batches: int,
    steps: int,
    passes: int,
    seed: int,
    lookup: str = "rows",
) -> dict[str, Any]:
    """Measure every path in this process (jaxslices from ``sys.path``)."""
    import jax
    import jax.numpy as jnp
    import optax
    from _common import environment, hash_dedup, interleave, summary

    import jaxslices as js

    has_bound = hasattr(js, "capacity")
    has_kernels = hasattr(js, "kernels")

    def make_batches(v):
        rng = np.random.default_rng(seed)
        ids = [
            jnp.asarray(rng.zipf(1.2, size=(batch, bag)) % v, jnp.int32)
            for _ in range(num_batches)
        ]
        return ids, jnp.asarray(rng.normal(size=(batch,)), jnp.float32)

    def init_params(v):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        return {
            "emb": 0.01 * jax.random.normal(k1, (v, dim), jnp.float32),
            "w": 0.1 * jax.random.normal(k2, (dim,), jnp.float32),
            "b": jnp.zeros((), jnp.float32),
        }

    def head(h, p, y):
        return jnp.mean((h @ p["w"] + p["b"] - y) ** 2)

    def rows_grad(p, ids, y):
        rows = p["emb"].at[ids].get(mode="fill", fill_value=0)
        loss, (g_rows, g_w, g_b) = jax.value_and_grad(
            lambda r, w, b: head(r.mean(1), {"w": w, "b": b}, y), argnums=(0, 1, 2)
        )(rows, p["w"], p["b"])
        return loss, g_rows.reshape(-1, dim), g_w, g_b

    # ------------------------------------------------- the library's paths
    def library(name, bound):
        lr, kw = LR[name], {}
        if bound is not None:
            kw = {"max_distinct": bound}
        opt = {
            "sgd": lambda: js.sgd(lr),
            "clip_sgd": lambda: optax.chain(
                js.clip_by_global_norm(1.0, **kw), js.sgd(lr)
            ),
            "adagrad": lambda: js.adagrad(lr, **kw),
            "adam": lambda: js.lazy_adam(lr, **kw),
            "rowwise_adagrad": lambda: js.rowwise_adagrad(lr, **kw),
            "ftrl": lambda: js.ftrl(lr, l1=FTRL_L1, **kw),
        }[name]()

        def loss_fn(p, ids, y):
            if lookup == "bag":
                return head(js.embedding_bag(p["emb"], ids, combiner="mean"), p, y)
            return head(js.embedding_lookup(p["emb"], ids).mean(1), p, y)

        def make(p):
            def step(p, state, ids, y):
                loss, grads = js.value_and_grad(loss_fn)(p, ids, y)
                updates, state = opt.update(grads, state, p)
                return js.apply_updates(p, updates), state, loss

            return step, opt.init(p)

        return make

    # -------------------------------------------------- hand-written paths
    def get(x, idx):
        return x.at[idx].get(mode="fill", fill_value=0)

    def put(x, idx, r):
        return x.at[idx].set(r, mode="drop")

    def dense_leaves(p, g_w, g_b, fn, st):
        w, sw = fn(p["w"], g_w, st["w"])
        b, sb = fn(p["b"], g_b, st["b"])
        return w, b, sw, sb

    def hand(name, v):
        lr = LR["sgd" if name == "floor_sgd" else name]

        def floor_sgd(p, state, ids, y):
            loss, g_rows, g_w, g_b = rows_grad(p, ids, y)
            emb = p["emb"].at[ids.reshape(-1)].add(-lr * g_rows, mode="drop")
            new = {"emb": emb, "w": p["w"] - lr * g_w, "b": p["b"] - lr * g_b}
            return new, state, loss

        def clip_sgd(p, state, ids, y):
            loss, g_rows, g_w, g_b = rows_grad(p, ids, y)
            idx, rows = hash_dedup(ids.reshape(-1), g_rows, v)
            norm = jnp.sqrt(jnp.sum(rows**2) + jnp.sum(g_w**2) + g_b**2)
            s = lr * jnp.minimum(1.0, 1.0 / jnp.maximum(norm, 1e-12))
            new = {
                "emb": p["emb"].at[idx].add(-s * rows, mode="drop"),
                "w": p["w"] - s * g_w,
                "b": p["b"] - s * g_b,
            }
            return new, state, loss

        def adagrad(p, acc, ids, y):
            loss, g_rows, g_w, g_b = rows_grad(p, ids, y)
            idx, rows = hash_dedup(ids.reshape(-1), g_rows, v)
            a = get(acc["emb"], idx) + rows**2

            def rule(x, g, a):
                a = a + g**2
                return x - lr * g * jax.lax.rsqrt(a + 1e-7), a

            w, b, aw, ab = dense_leaves(p, g_w, g_b, rule, acc)
            d = -lr * rows * jax.lax.rsqrt(a + 1e-7)
            emb = p["emb"].at[idx].add(d, mode="drop")
            new_acc = {"emb": put(acc["emb"], idx, a), "w": aw, "b": ab}
            return {"emb": emb, "w": w, "b": b}, new_acc, loss

        def rowwise(p, acc, ids, y):
            loss, g_rows, g_w, g_b = rows_grad(p, ids, y)
            idx, rows = hash_dedup(ids.reshape(-1), g_rows, v)
            a = get(acc["emb"], idx) + jnp.mean(rows**2, axis=1)
            d = -lr * rows / jnp.where(a > 0, jnp.sqrt(a) + 1e-8, 1.0)[:, None]

            def rule(x, g, a):
                a = a + g**2
                return x - lr * g / jnp.where(a > 0, jnp.sqrt(a) + 1e-8, 1.0), a

            w, b, aw, ab = dense_leaves(p, g_w, g_b, rule, acc)
            emb = p["emb"].at[idx].add(d, mode="drop")
            new_acc = {"emb": put(acc["emb"], idx, a), "w": aw, "b": ab}
            return {"emb": emb, "w": w, "b": b}, new_acc, loss

        def adam(p, state, ids, y):
            m, s, count = state
            count = count + 1
            bc1 = 1 - 0.9 ** count.astype(jnp.float32)
            bc2 = 1 - 0.999 ** count.astype(jnp.float32)
            loss, g_rows, g_w, g_b = rows_grad(p, ids, y)
            idx, rows = hash_dedup(ids.reshape(-1), g_rows, v)

            def rule(x, g, ms):
                mu = 0.9 * ms[0] + 0.1 * g
                nu = 0.999 * ms[1] + 0.001 * g**2
                return x - lr * (mu / bc1) / (jnp.sqrt(nu / bc2) + 1e-8), (mu, nu)

            u, (mu, nu) = rule(0.0, rows, (get(m["emb"], idx), get(s["emb"], idx)))
            w, b, mw, mb = dense_leaves(
                p, g_w, g_b, rule, {k: (m[k], s[k]) for k in "wb"}
            )
            new_m = {"emb": put(m["emb"], idx, mu), "w": mw[0], "b": mb[0]}
            new_s = {"emb": put(s["emb"], idx, nu), "w": mw[1], "b": mb[1]}
            emb = p["emb"].at[idx].add(u, mode="drop")
            return {"emb": emb, "w": w, "b": b}, (new_m, new_s, count), loss

        def ftrl(p, state, ids, y):
            n, z = state
            loss, g_rows, g_w, g_b = rows_grad(p, ids, y)
            idx, rows = hash_dedup(ids.reshape(-1), g_rows, v)

            def rule(x, g, nz):
                n_new = nz[0] + g**2
                sq_new = jnp.sqrt(n_new)
                z_new = nz[1] + g - (sq_new - jnp.sqrt(nz[0])) / lr * x
                x_new = (jnp.clip(z_new, -FTRL_L1, FTRL_L1) - z_new) / (sq_new / lr)
                return x_new, (n_new, z_new)

            x_new, (nr, zr) = rule(
                get(p["emb"], idx), rows, (get(n["emb"], idx), get(z["emb"], idx))
            )
            w, b, nzw, nzb = dense_leaves(
                p, g_w, g_b, rule, {k: (n[k], z[k]) for k in "wb"}
            )
            emb = put(p["emb"], idx, x_new)
            new_n = {"emb": put(n["emb"], idx, nr), "w": nzw[0], "b": nzb[0]}
            new_z = {"emb": put(z["emb"], idx, zr), "w": nzw[1], "b": nzb[1]}
            return {"emb": emb, "w": w, "b": b}, (new_n, new_z), loss

        def init(p):
            zeros = lambda: jax.tree.map(jnp.zeros_like, p)  # noqa: E731
            full = lambda c: jax.tree.map(lambda x: jnp.full_like(x, c), p)  # noqa: E731
            return {
                "floor_sgd": (),
                "sgd": (),
                "clip_sgd": (),
                "adagrad": full(0.1),
                "rowwise_adagrad": {
                    "emb": jnp.zeros((v,), jnp.float32),
                    "w": jnp.zeros_like(p["w"]),
                    "b": jnp.zeros_like(p["b"]),
                },
                "adam": (zeros(), zeros(), jnp.zeros((), jnp.int32)),
                "ftrl": (full(0.1), zeros()),
            }[name]

        fns = {
            "floor_sgd": floor_sgd,
            "sgd": floor_sgd,
            "clip_sgd": clip_sgd,
            "adagrad": adagrad,
            "adam": adam,
            "rowwise_adagrad": rowwise,
            "ftrl": ftrl,
        }
        return lambda p: (fns[name], init(p))

    class Runner:
        """One compiled, donated step and its live params and state."""

        def __init__(self, make, v, ids, y, xla=False):
            import contextlib

            p = init_params(v)
            step, state = make(p)
            jitted = jax.jit(step, donate_argnums=(0, 1))
            off = js.kernels.disabled() if xla else contextlib.nullcontext()
            with off:  # the path is chosen when the step is traced
                self.step = jitted.lower(p, state, ids[0], y).compile()
            self.p, self.state, self.ids, self.y, self.i = p, state, ids, y, 0
            for _ in range(3):
                self()

        def __call__(self):
            ids = self.ids[self.i % len(self.ids)]
            self.i += 1
            self.p, self.state, self.loss = self.step(self.p, self.state, ids, self.y)
            jax.block_until_ready((self.p, self.state, self.loss))

    rows, bounds = [], {}
    for v in num_rows:
        ids, y = make_batches(v)
        if has_bound:
            flat = [np.asarray(i).reshape(-1) for i in ids]
            bounds[v] = int(js.capacity.estimate_max_distinct(flat, num_rows=v))
        for name in optimizers:
            makers = {"floor_sgd": hand("floor_sgd", v)}
            if name != "sgd":
                makers["hand"] = hand(name, v)
            makers["jaxslices"] = library(name, None)
            if has_bound and name != "sgd":
                makers["bounded"] = library(name, bounds[v])
            if has_kernels:
                makers["xla"] = library(name, None)
            runners = {
                k: Runner(m, v, ids, y, xla=k == "xla") for k, m in makers.items()
            }
            times = interleave(runners, steps, passes)
            ref = float(np.median(times["floor_sgd"]))
            for k, r in runners.items():
                s = summary(times[k])
                rows.append(
                    {
                        "num_rows": v,
                        "optimizer": name,
                        "path": k,
                        **s,
                        "ratio_to_floor_sgd": s["median_ms"] / ref,
                        "final_loss": float(r.loss),
                    }
                )
            del runners
    counts = {
        v: [int(np.unique(np.asarray(i)).size) for i in make_batches(v)[0]]
        for v in num_rows
    }
    return {
        **environment(),
        "jaxslices_file": js.__file__,
        "kernels": js.kernels.status() if has_kernels else None,
        "lookup": lookup,
        "max_distinct": bounds,
        "max_distinct_seen": {v: max(c) for v, c in counts.items()},
        "min_distinct_seen": {v: min(c) for v, c in counts.items()},
        "rows": rows,
    }


# ================================================= parent: trees, repeats


def _run_child(tree: str, args: dict[str, Any]) -> dict[str, Any]:
    tree = str(Path(tree).resolve())
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([tree, str(HERE)]),
        # this process's platform choice (unset: JAX's default, a GPU if any)
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", ""),
    }
    code = (
        "import json, optimizer_floor_bench as b\n"
        f"print('RESULT ' + json.dumps(b.child(**json.loads({json.dumps(args)!r}))))"
    )
    load = os.getloadavg()[0]
    proc = subprocess.run(  # cwd: `python -c` imports jaxslices from it first
        [sys.executable, "-c", code],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"child for {tree} failed:\n{proc.stderr[-4000:]}")
    out = json.loads(lines[-1][len("RESULT ") :])
    out["tree"] = tree
    out["load_avg_1m_before"], out["load_avg_1m_after"] = load, os.getloadavg()[0]
    return out


def _run_here(tree: str, args: dict[str, Any]) -> dict[str, Any]:
    import jaxslices

    here = Path(jaxslices.__file__).resolve().parents[1]
    if here != Path(tree).resolve():
        raise ValueError(f"in_process: jaxslices is imported from {here}, not {tree}")
    load = os.getloadavg()[0]
    out = json.loads(json.dumps(child(**args)))  # the keys a child's JSON has
    out["tree"] = str(here)
    out["load_avg_1m_before"], out["load_avg_1m_after"] = load, os.getloadavg()[0]
    return out


def _ratio(run: dict, v: int, opt: str, path: str) -> float | None:
    for r in run["rows"]:
        if (r["num_rows"], r["optimizer"], r["path"]) == (v, opt, path):
            return r["ratio_to_floor_sgd"]
    return None


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


def summarize(runs: dict[str, list[dict]], labels: list[str]) -> dict[str, Any]:
    """Median (over repeats) of each ratio to floor_sgd, per label and path."""
    first = runs[labels[0]][0]
    vs = sorted({r["num_rows"] for r in first["rows"]})
    opts = [o for o in OPTIMIZERS if any(r["optimizer"] == o for r in first["rows"])]
    table = []
    for v in vs:
        for opt in opts:
            row: dict[str, Any] = {"num_rows": v, "optimizer": opt}
            for label in labels:
                for path in PATHS:
                    each = [_ratio(run, v, opt, path) for run in runs[label]]
                    if any(x is not None for x in each):
                        row[f"{label}/{path}"] = _median(each)
                        row[f"{label}/{path}/each"] = each
            table.append(row)
    return {"vs": vs, "optimizers": opts, "rows": table}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def markdown(summary: dict[str, Any], labels: list[str]) -> str:
    """The ratios to the floor's SGD step, one line per (V, optimizer)."""
    new, old = labels[0], labels[-1]
    cols = [(f"{new}/bounded", f"{new}: `max_distinct`")]
    cols += [(f"{new}/jaxslices", f"{new}: defaults")]
    for mid in labels[1:-1]:  # trees between the newest and the oldest
        cols += [(f"{mid}/bounded", f"{mid}: `max_distinct`")]
    if old != new:
        cols += [(f"{old}/jaxslices", f"{old}: defaults")]
    cols += [(f"{new}/hand", "by hand")]
    head = ["V", "optimizer"] + [c[1] for c in cols] + ["goal (V = 1M)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["rows"]:
        goal = GOALS.get(row["optimizer"]) if row["num_rows"] >= 2**20 else None
        cells = [f"{row['num_rows']:,}", row["optimizer"]]
        cells += [_fmt(row.get(k)) for k, _ in cols]
        cells.append("-" if goal is None else f"<= {goal}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals(summary: dict[str, Any], labels: list[str]) -> list[dict[str, Any]]:
    """Issue 21's goals: bounded/floor at V = 1M; none slower than ``old`` at 16K."""
    new, old = labels[0], labels[-1]
    out = []
    for row in summary["rows"]:
        v, opt = row["num_rows"], row["optimizer"]
        best = min(
            x
            for x in (row.get(f"{new}/bounded"), row.get(f"{new}/jaxslices"))
            if x is not None
        )
        if v >= 2**20 and opt in GOALS:
            out.append(
                {
                    "goal": f"V={v} {opt}: jaxslices / floor SGD <= {GOALS[opt]}",
                    "value": best,
                    "met": best <= GOALS[opt],
                }
            )
        if v == min(summary["vs"]) and old != new:
            before = row.get(f"{old}/jaxslices")
            if before is not None:
                out.append(
                    {
                        "goal": f"V={v} {opt}: not slower than {old}",
                        "value": best / before,
                        "met": best <= before * 1.05,
                    }
                )
    return out


def native_markdown(summary: dict[str, Any], labels: list[str]) -> str:
    """The native path: its ratio to the floor, to its own SGD, to the XLA path."""
    new = labels[0]
    if not any(f"{new}/xla" in row for row in summary["rows"]):
        return ""
    head = [
        "V",
        "optimizer",
        "native / floor SGD",
        "native / native SGD",
        "XLA path / floor SGD",
        "native / XLA path",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    sgd = {
        row["num_rows"]: row.get(f"{new}/jaxslices")
        for row in summary["rows"]
        if row["optimizer"] == "sgd"
    }
    for row in summary["rows"]:
        nat, xla = row.get(f"{new}/jaxslices"), row.get(f"{new}/xla")
        base = sgd.get(row["num_rows"])
        cells = [
            f"{row['num_rows']:,}",
            row["optimizer"],
            _fmt(nat),
            _fmt(None if nat is None or not base else nat / base),
            _fmt(xla),
            _fmt(None if nat is None or not xla else nat / xla),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Issue 31's goals for the native path (CPU).
NATIVE_OVER_SGD = 1.5


def native_goals(summary: dict[str, Any], labels: list[str]) -> list[dict[str, Any]]:
    """Every optimizer <= 1.5x the native SGD step; none slower than XLA at 16K."""
    new = labels[0]
    out = []
    sgd = {
        row["num_rows"]: row.get(f"{new}/jaxslices")
        for row in summary["rows"]
        if row["optimizer"] == "sgd"
    }
    for row in summary["rows"]:
        v, opt = row["num_rows"], row["optimizer"]
        nat, xla = row.get(f"{new}/jaxslices"), row.get(f"{new}/xla")
        if nat is None or xla is None:
            continue
        if opt != "sgd" and sgd.get(v):
            value = nat / sgd[v]
            out.append(
                {
                    "goal": f"V={v} {opt}: native / native SGD <= {NATIVE_OVER_SGD}",
                    "value": value,
                    "met": value <= NATIVE_OVER_SGD,
                }
            )
        if v == min(summary["vs"]):
            out.append(
                {
                    "goal": f"V={v} {opt}: native not slower than the XLA path",
                    "value": nat / xla,
                    "met": nat <= xla * 1.05,
                }
            )
    return out


def main(
    trees: tuple[str, ...] = (".",),
    labels: tuple[str, ...] | None = None,
    repeats: int = 1,
    num_rows: tuple[int, ...] = (16384, 1048576),
    optimizers: tuple[str, ...] = OPTIMIZERS,
    dim: int = 64,
    batch: int = 1024,
    bag: int = 16,
    num_batches: int = 20,
    steps: int = 10,
    passes: int = 6,
    seed: int = 0,
    out: str | None = None,
    command: str | None = None,
    in_process: bool = False,
    lookup: str = "rows",
    tag: str = "",
) -> dict[str, Any]:
    """Measure every tree ``repeats`` times (taking turns); print and save.

    ``in_process``: run in this process instead of child processes (for the
    smoke test; every tree must then be the one ``jaxslices`` is imported
    from).
    """
    labels = list(labels or [Path(t).resolve().name for t in trees])
    args = {
        "num_rows": list(num_rows),
        "optimizers": list(optimizers),
        "dim": dim,
        "batch": batch,
        "bag": bag,
        "num_batches": num_batches,
        "steps": steps,
        "passes": passes,
        "seed": seed,
        "lookup": lookup,
    }
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    t0 = time.time()
    for _ in range(repeats):
        for tree, label in zip(trees, labels, strict=True):
            run = _run_here if in_process else _run_child
            runs[label].append(run(tree, args))
    summary = summarize(runs, labels)
    first = runs[labels[0]][0]
    report = {
        "command": command,
        "workload": {**args, "zipf": 1.2},
        "labels": labels,
        "trees": list(trees),
        "repeats": repeats,
        "seconds": time.time() - t0,
        "environment": {k: v for k, v in first.items() if k not in ("rows", "tree")},
        "loads": {
            label: [(r["load_avg_1m_before"], r["load_avg_1m_after"]) for r in rs]
            for label, rs in runs.items()
        },
        "runs": runs,
        "summary": summary,
        "goals": goals(summary, labels) + native_goals(summary, labels),
        "table": markdown(summary, labels),
        "native_table": native_markdown(summary, labels),
    }
    env = report["environment"]
    print(f"{env['cpu']} x{env['nproc']} ({env['backend']}), jax {env['jax']}")
    print(f"max_distinct per V (estimated): {first.get('max_distinct')}")
    print(report["table"])
    if report["native_table"]:
        print(report["native_table"])
    for g in report["goals"]:
        print(f"{g['goal']}: {g['value']:.2f} {'met' if g['met'] else 'missed'}")
    print("load average (1 min) before/after each child:", report["loads"])
    if out:
        suffix = f"_{tag}" if tag else ""
        path = Path(out) / f"optimizer_floor_bench_{env['backend']}{suffix}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs="+", default=["."])
    p.add_argument("--labels", nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--num-rows", type=int, nargs="+", default=[16384, 1048576])
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--passes", type=int, default=6)
    p.add_argument("--out", default=None)
    p.add_argument("--lookup", choices=("rows", "bag"), default="rows")
    p.add_argument("--tag", default="", help="suffix of the result file's name")
    a = p.parse_args()
    main(
        trees=tuple(a.trees),
        labels=tuple(a.labels) if a.labels else None,
        repeats=a.repeats,
        num_rows=tuple(a.num_rows),
        optimizers=tuple(a.optimizers),
        steps=a.steps,
        passes=a.passes,
        out=a.out,
        command="python " + " ".join(sys.argv),
        lookup=a.lookup,
        tag=a.tag,
    )
