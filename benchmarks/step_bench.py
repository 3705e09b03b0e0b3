"""Training-step time and memory: jaxslices vs the dense Optax path vs a floor.

Workload (issue 5, fixed so results compare across systems): a ``V x 64``
float32 table; batches of 1024 examples x 16 ids, ids ``zipf(1.2) % V`` (fixed
seed, 20 pre-generated batches cycled, so many ids repeat); model: mean of the
16 embeddings -> Linear(64 -> 1) -> mean squared error against fixed random
targets. Optimizers: SGD 0.1; clip_by_global_norm(1.0) + SGD 0.1; Adagrad 0.1;
Adam 1e-3 (lazy Adam on the sparse paths); row-wise Adagrad 0.1 and FTRL 0.1
(``l1=1e-4``; jaxslices only: Optax has neither, so their ``dense`` path is the
jaxslices transform on ``jax.value_and_grad``'s dense gradient).

Paths, each one jitted step with params and optimizer state donated:

* ``dense``: what a JAX user writes today: ``jax.value_and_grad`` + Optax +
  ``optax.apply_updates``.
* ``jaxslices``: ``jaxslices.value_and_grad`` + ``jaxslices.embedding_lookup``
  + jaxslices transforms + ``jaxslices.apply_updates``.
* ``floor``: a minimal hand-written sparse step: the gradient with respect to
  the gathered rows only, then ``table.at[ids].add(...)``. Clip, Adagrad and
  Adam need per-row sums; the floor gets them with a hand-written hash dedup
  (``_common.hash_dedup``), independent of jaxslices. (No floor for row-wise
  Adagrad and FTRL.)
* ``densify``: ``jaxslices`` with ``jaxslices.densify()`` first in the chain
  (the opt-in dense fallback for small tables; run for ``V <= --densify-max-v``).
* ``js_sort``: ``jaxslices`` with ``coalesce_method="sort"`` on every
  transform (the default is ``"auto"``: the hash dedup on CPU), to measure the
  coalescing choice through the public argument.
* ``native``: the experimental native backend (``jaxslices.native``): the
  table marked inside the step (capacity = ids per batch), plain
  ``jax.value_and_grad``, ``native.to_indexed_slices``, then the same
  jaxslices transforms and ``apply_updates`` as ``jaxslices``.
* ``js_nodonate`` and ``dense_nodonate`` (opt-in, ``--paths``): the
  ``jaxslices`` and ``dense`` steps jitted *without* donation, what a step
  costs when the table and its optimizer state must be copied first. Every
  row records ``copied_bytes``: the table-sized arrays (at least half a
  table) that :func:`jaxslices.table_copies` finds the compiled step copying
  whole each step.

Run: ``python benchmarks/step_bench.py --out
benchmarks/results/<yyyy-mm>-<backend>`` (defaults are
the issue's workload). Prints a markdown table with ratios measured pair by pair
in the same run and the issue's targets, writes ``step_bench_<backend>.json``
and a log-log plot of ms/step against V.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import (
    environment,
    fmt_ratio,
    hash_dedup,
    interleave,
    progress,
    rss_mb,
    save_json,
    summary,
)

import jaxslices as js

OPTIMIZERS = ("sgd", "clip_sgd", "adagrad", "adam", "rowwise_adagrad", "ftrl")
PATHS = ("dense", "jaxslices", "floor", "densify", "js_sort", "native")
NOT_DONATED = ("js_nodonate", "dense_nodonate")  # opt-in: --paths
NEEDS_API = {"jaxslices", "densify", "js_sort", "js_nodonate"}  # value_and_grad
LR = {
    "sgd": 0.1,
    "clip_sgd": 0.1,
    "adagrad": 0.1,
    "adam": 1e-3,
    "rowwise_adagrad": 0.1,
    "ftrl": 0.1,
}
NO_FLOOR = {"rowwise_adagrad", "ftrl"}


# ------------------------------------------------------------------ workload


def make_batches(num_rows: int, batch: int, bag: int, num_batches: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = [
        jnp.asarray(rng.zipf(1.2, size=(batch, bag)) % num_rows, jnp.int32)
        for _ in range(num_batches)
    ]
    targets = jnp.asarray(rng.normal(size=(batch,)), jnp.float32)
    return ids, targets


def init_params(num_rows: int, dim: int, seed: int) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "emb": 0.01 * jax.random.normal(k1, (num_rows, dim), jnp.float32),
        "w": 0.1 * jax.random.normal(k2, (dim,), jnp.float32),
        "b": jnp.zeros((), jnp.float32),
    }


def _head(h: jax.Array, params: dict[str, jax.Array], y: jax.Array) -> jax.Array:
    return jnp.mean((h @ params["w"] + params["b"] - y) ** 2)


def dense_loss(params, ids, y):
    return _head(jnp.take(params["emb"], ids, axis=0).mean(1), params, y)


def sparse_loss(params, ids, y):
    return _head(js.embedding_lookup(params["emb"], ids).mean(1), params, y)


# --------------------------------------------------------------------- steps

Step = Callable[..., tuple[Any, Any, jax.Array]]


def _dense_opt(name: str) -> optax.GradientTransformation:
    lr = LR[name]
    return {
        "sgd": lambda: optax.sgd(lr),
        "clip_sgd": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(lr)),
        "adagrad": lambda: optax.adagrad(lr),
        "adam": lambda: optax.adam(lr),
        # Not in Optax: the jaxslices transform on the dense gradient.
        "rowwise_adagrad": lambda: js.rowwise_adagrad(lr),
        "ftrl": lambda: js.ftrl(lr, l1=1e-4),
    }[name]()


def _sparse_opt(name: str, method: str = "auto") -> optax.GradientTransformation:
    lr, m = LR[name], {"coalesce_method": method}
    return {
        "sgd": lambda: js.sgd(lr, **m),
        "clip_sgd": lambda: optax.chain(
            js.clip_by_global_norm(1.0, **m), js.sgd(lr, **m)
        ),
        "adagrad": lambda: js.adagrad(lr, **m),
        "adam": lambda: js.lazy_adam(lr, **m),
        "rowwise_adagrad": lambda: js.rowwise_adagrad(lr, **m),
        "ftrl": lambda: js.ftrl(lr, l1=1e-4, **m),
    }[name]()


def _optax_step(opt, value_and_grad, loss_fn, apply_updates, params):
    """One training step in Optax's shape; returns (step, initial state)."""

    def step(params, state, ids, y):
        loss, grads = value_and_grad(loss_fn)(params, ids, y)
        updates, state = opt.update(grads, state, params)
        return apply_updates(params, updates), state, loss

    return step, opt.init(params)


def make_dense(name: str, params):
    opt = _dense_opt(name)
    return _optax_step(opt, jax.value_and_grad, dense_loss, optax.apply_updates, params)


def make_jaxslices(name: str, params):
    opt = _sparse_opt(name)
    return _optax_step(opt, js.value_and_grad, sparse_loss, js.apply_updates, params)


def make_js_sort(name: str, params):
    opt = _sparse_opt(name, method="sort")
    return _optax_step(opt, js.value_and_grad, sparse_loss, js.apply_updates, params)


def make_densify(name: str, params):
    opt = optax.chain(js.densify(), _sparse_opt(name))
    return _optax_step(opt, js.value_and_grad, sparse_loss, js.apply_updates, params)


# --- native backend path (jaxslices.native; owner: native backend) ---------


def make_native(name: str, params):
    from jaxslices import native

    opt = _sparse_opt(name)

    def step(params, state, ids, y):
        marked = {**params, "emb": native.mark(params["emb"], capacity=ids.size)}
        loss, grads = jax.value_and_grad(sparse_loss)(marked, ids, y)
        grads = native.to_indexed_slices(grads)
        updates, state = opt.update(grads, state, params)
        return js.apply_updates(params, updates), state, loss

    return step, opt.init(params)


# --- end of the native backend path ------------------------------------------


def _rows_grad(params, ids, y):
    """Floor: gradient with respect to the gathered rows and the dense head."""
    rows = params["emb"].at[ids].get(mode="fill", fill_value=0)

    def loss(rows, w, b):
        return _head(rows.mean(1), {"w": w, "b": b}, y)

    loss_value, (g_rows, g_w, g_b) = jax.value_and_grad(loss, argnums=(0, 1, 2))(
        rows, params["w"], params["b"]
    )
    return loss_value, g_rows.reshape(-1, rows.shape[-1]), g_w, g_b


def _floor_coalesce(ids: jax.Array, g_rows: jax.Array, num_rows: int):
    """Unique ids (padding ``num_rows``) and summed rows: hash dedup, O(N) temp."""
    return hash_dedup(ids.reshape(-1), g_rows, num_rows)


def make_floor(name: str, params):
    """Hand-written sparse steps; state is a plain tuple/dict of arrays."""
    num_rows = params["emb"].shape[0]
    lr = LR[name]

    def get(x, idx):
        return x.at[idx].get(mode="fill", fill_value=0)

    def put(x, idx, rows):
        return x.at[idx].set(rows, mode="drop")

    if name == "sgd":

        def step(params, state, ids, y):
            loss, g_rows, g_w, g_b = _rows_grad(params, ids, y)
            emb = params["emb"].at[ids.reshape(-1)].add(-lr * g_rows, mode="drop")
            new = {"emb": emb, "w": params["w"] - lr * g_w, "b": params["b"] - lr * g_b}
            return new, state, loss

        return step, ()

    if name == "clip_sgd":

        def step(params, state, ids, y):
            loss, g_rows, g_w, g_b = _rows_grad(params, ids, y)
            idx, rows = _floor_coalesce(ids, g_rows, num_rows)
            norm = jnp.sqrt(jnp.sum(rows**2) + jnp.sum(g_w**2) + g_b**2)
            scale = lr * jnp.minimum(1.0, 1.0 / jnp.maximum(norm, 1e-12))
            new = {
                "emb": params["emb"].at[idx].add(-scale * rows, mode="drop"),
                "w": params["w"] - scale * g_w,
                "b": params["b"] - scale * g_b,
            }
            return new, state, loss

        return step, ()

    if name == "adagrad":

        def step(params, acc, ids, y):
            loss, g_rows, g_w, g_b = _rows_grad(params, ids, y)
            idx, rows = _floor_coalesce(ids, g_rows, num_rows)
            a_rows = get(acc["emb"], idx) + rows**2
            a_w, a_b = acc["w"] + g_w**2, acc["b"] + g_b**2
            d_rows = -lr * rows * jax.lax.rsqrt(a_rows + 1e-7)
            new = {
                "emb": params["emb"].at[idx].add(d_rows, mode="drop"),
                "w": params["w"] - lr * g_w * jax.lax.rsqrt(a_w + 1e-7),
                "b": params["b"] - lr * g_b * jax.lax.rsqrt(a_b + 1e-7),
            }
            return new, {"emb": put(acc["emb"], idx, a_rows), "w": a_w, "b": a_b}, loss

        return step, jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)

    def step(params, state, ids, y):  # adam
        m, v, count = state
        count = count + 1
        bc1 = 1 - 0.9 ** count.astype(jnp.float32)
        bc2 = 1 - 0.999 ** count.astype(jnp.float32)
        loss, g_rows, g_w, g_b = _rows_grad(params, ids, y)
        idx, rows = _floor_coalesce(ids, g_rows, num_rows)

        def adam(p, m, v, g):
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g**2
            return p - lr * (m / bc1) / (jnp.sqrt(v / bc2) + 1e-8), m, v

        p_rows, m_rows, v_rows = adam(
            get(params["emb"], idx), get(m["emb"], idx), get(v["emb"], idx), rows
        )
        w, mw, vw = adam(params["w"], m["w"], v["w"], g_w)
        b, mb, vb = adam(params["b"], m["b"], v["b"], g_b)
        new = {"emb": put(params["emb"], idx, p_rows), "w": w, "b": b}
        new_m = {"emb": put(m["emb"], idx, m_rows), "w": mw, "b": mb}
        new_v = {"emb": put(v["emb"], idx, v_rows), "w": vw, "b": vb}
        return new, (new_m, new_v, count), loss

    zeros = jax.tree.map(jnp.zeros_like, params)
    return step, (zeros, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.int32))


MAKERS: dict[str, Callable[[str, Any], tuple[Step, Any]]] = {
    "dense": make_dense,
    "jaxslices": make_jaxslices,
    "floor": make_floor,
    "densify": make_densify,
    "js_sort": make_js_sort,
    "native": make_native,
    "js_nodonate": make_jaxslices,
    "dense_nodonate": make_dense,
}


def runs(path: str, opt: str) -> bool:
    return not (path == "floor" and opt in NO_FLOOR)


# ------------------------------------------------------------------- running


class Runner:
    """One compiled step (donated unless ``*_nodonate``) and its live params/state."""

    def __init__(self, path: str, opt: str, num_rows: int, dim: int, seed: int, ids, y):
        rss_before = rss_mb()["rss_mb"]
        params = init_params(num_rows, dim, seed)
        step, state = MAKERS[path](opt, params)
        donate = () if path in NOT_DONATED else (0, 1)
        jitted = jax.jit(step, donate_argnums=donate)
        t0 = time.perf_counter()
        compiled = jitted.lower(params, state, ids[0], y).compile()
        compile_s = time.perf_counter() - t0  # trace + lower + compile
        mem = compiled.memory_analysis()
        self.memory = {
            f"{k}_bytes": int(getattr(mem, f"{k}_size_in_bytes", -1))
            for k in ("temp", "argument", "output", "alias")
        }
        self.memory["state_bytes"] = sum(
            x.size * x.dtype.itemsize for x in jax.tree.leaves(state)
        )
        table_bytes = num_rows * dim * 4
        copies = js.table_copies(compiled, min_bytes=table_bytes // 2)
        self.memory["copied_bytes"] = sum(c.nbytes for c in copies)
        self.step, self.params, self.state = compiled, params, state
        self.ids, self.y, self.i = ids, y, 0
        self.loss = float("nan")
        for _ in range(3):  # warm up
            self()
        self.memory.update(rss_mb())
        self.memory["compile_s"] = compile_s
        # This runner's footprint (params, state, executable, temporaries once
        # allocated); approximate, as freed memory may be reused.
        self.memory["rss_delta_mb"] = self.memory["rss_mb"] - rss_before

    def __call__(self) -> None:
        ids = self.ids[self.i % len(self.ids)]
        self.i += 1
        self.params, self.state, loss = self.step(self.params, self.state, ids, self.y)
        jax.block_until_ready((self.params, self.state, loss))
        self.loss = loss

    def free(self) -> None:
        self.params = self.state = self.step = None


def main(
    num_rows: tuple[int, ...] = (16384, 131072, 1048576),
    dim: int = 64,
    batch: int = 1024,
    bag: int = 16,
    num_batches: int = 20,
    steps: int = 10,
    passes: int = 6,
    optimizers: tuple[str, ...] = OPTIMIZERS,
    paths: tuple[str, ...] = PATHS,
    densify_max_v: int = 131072,
    seed: int = 0,
    out: str | None = None,
    plot: bool = True,
) -> dict[str, Any]:
    """Run the benchmark; returns the report (also printed and saved to ``out``).

    Each configuration runs ``passes`` x ``steps`` timed steps; the paths of one
    (V, optimizer) run interleaved, so their ratios are measured side by side.
    """
    if not hasattr(js, "value_and_grad"):
        print(
            "step_bench: jaxslices.value_and_grad does not exist yet; skipping the "
            f"paths that need it: {sorted(NEEDS_API & set(paths))}."
        )
        paths = tuple(p for p in paths if p not in NEEDS_API)
    configs = [
        (
            v,
            opt,
            [
                p
                for p in paths
                if (p != "densify" or v <= densify_max_v) and runs(p, opt)
            ],
        )
        for v in num_rows
        for opt in optimizers
    ]
    bar = progress(sum(len(ps) for *_, ps in configs) * steps * passes, "step_bench")
    rows = []
    for v, opt, ps in configs:
        ids, y = make_batches(v, batch, bag, num_batches, seed)
        runners = {p: Runner(p, opt, v, dim, seed, ids, y) for p in ps}
        times = interleave(runners, steps, passes, bar)
        for p, r in runners.items():
            rows.append(
                {
                    "num_rows": v,
                    "optimizer": opt,
                    "path": p,
                    **summary(times[p]),
                    "final_loss": float(r.loss),
                    **r.memory,
                }
            )
            r.free()
    if bar is not None:
        bar.close()
    report = {
        **environment(),
        "workload": {"dim": dim, "batch": batch, "bag": bag, "zipf": 1.2},
        "steps_per_pass": steps,
        "passes": passes,
        "peak_rss_mb": rss_mb()["peak_rss_mb"],
        "rows": rows,
        "temp_grows_with_v": temp_growth(rows),
        "targets": targets(rows),
    }
    report["table"] = markdown_table(rows)
    report["targets_table"] = targets_table(report["targets"])
    print(
        f"{report['cpu']} x{report['nproc']} ({report['backend']}), jax {report['jax']}"
    )
    print(report["table"])
    print("\nTemp bytes grow with V:", report["temp_grows_with_v"] or "none")
    print(report["targets_table"])
    save_json(report, out, f"step_bench_{report['backend']}.json")
    if out and plot:
        save_plot(rows, str(Path(out) / f"step_bench_{report['backend']}.png"), report)
    return report


# ------------------------------------------------------------------- output


def _get(rows: list[dict], v: int, opt: str, path: str) -> dict | None:
    for r in rows:
        if (r["num_rows"], r["optimizer"], r["path"]) == (v, opt, path):
            return r
    return None


def _ms(rows: list[dict], v: int, opt: str, path: str) -> float | None:
    r = _get(rows, v, opt, path)
    return None if r is None else r["median_ms"]


def temp_growth(rows: list[dict]) -> list[str]:
    """``"path/optimizer"`` for each config whose compiled temp bytes grow with V.

    Growth counts when, from the smallest to the largest V, temp bytes grow by
    more than 5% of what argument bytes grow by (the table and its optimizer
    state): a table-sized temporary, not a few KB of changed buffer layout.
    """
    vs = sorted({r["num_rows"] for r in rows})
    flagged = []
    for path in dict.fromkeys(r["path"] for r in rows):
        for opt in OPTIMIZERS:
            lo, hi = _get(rows, vs[0], opt, path), _get(rows, vs[-1], opt, path)
            if lo is None or hi is None or lo is hi:
                continue
            d_temp = hi["temp_bytes"] - lo["temp_bytes"]
            d_args = hi["argument_bytes"] - lo["argument_bytes"]
            if d_temp > 0.05 * max(d_args, 0):
                flagged.append(f"{path}/{opt}")
    return flagged


def markdown_table(rows: list[dict]) -> str:
    present = [p for p in MAKERS if any(r["path"] == p for r in rows)]
    ratios = [
        ("dense", "jaxslices"),
        ("jaxslices", "floor"),
        ("js_sort", "jaxslices"),
        ("densify", "jaxslices"),
        ("native", "jaxslices"),
        ("js_nodonate", "jaxslices"),
        ("js_nodonate", "dense"),
        ("dense_nodonate", "dense"),
    ]
    ratios = [(a, b) for a, b in ratios if a in present and b in present]
    head = (
        ["V", "optimizer"]
        + [f"{p} ms (min-max)" for p in present]
        + [f"{a} / {b}" for a, b in ratios]
        + ["temp MB " + " / ".join(present), "opt. state MB (jaxslices)"]
        + ["copied MB " + " / ".join(present)]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in sorted({r["num_rows"] for r in rows}):
        for opt in OPTIMIZERS:
            if not any(_get(rows, v, opt, p) for p in present):
                continue
            cells = [str(v), opt]
            for p in present:
                r = _get(rows, v, opt, p)
                cells.append(
                    "-"
                    if r is None
                    else f"{r['median_ms']:.2f} ({r['min_ms']:.2f}-{r['max_ms']:.2f})"
                )
            cells += [
                fmt_ratio(_ms(rows, v, opt, a), _ms(rows, v, opt, b)) for a, b in ratios
            ]
            temps = [_get(rows, v, opt, p) for p in present]
            cells.append(
                " / ".join(
                    "-" if t is None else f"{t['temp_bytes'] / 2**20:.1f}"
                    for t in temps
                )
            )
            js_row = _get(rows, v, opt, "jaxslices")
            state_mb = None if js_row is None else js_row["state_bytes"] / 2**20
            cells.append("-" if state_mb is None else f"{state_mb:.1f}")
            cells.append(
                " / ".join(
                    "-" if t is None else f"{t['copied_bytes'] / 2**20:.1f}"
                    for t in temps
                )
            )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[dict[str, Any]]:
    """The issue's targets, evaluated on this run's smallest and largest V.

    The issue states them for V = 16384 (``lo``) and V = 1048576 (``hi``).
    """
    vs = sorted({r["num_rows"] for r in rows})
    lo, hi = vs[0], vs[-1]
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, ok: Callable[[float], bool], fmt: str):
        if value is not None:
            out.append(
                {"target": name, "value": value, "met": bool(ok(value)), "fmt": fmt}
            )

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    sparse = "jaxslices"
    floor_sgd = {v: _ms(rows, v, "sgd", "floor") for v in (lo, hi)}
    add(
        f"V={hi} SGD: dense / jaxslices >= 50",
        ratio(_ms(rows, hi, "sgd", "dense"), _ms(rows, hi, "sgd", sparse)),
        lambda x: x >= 50,
        "{:.1f}x",
    )
    add(
        f"V={hi} SGD: jaxslices / floor <= 1.25",
        ratio(_ms(rows, hi, "sgd", sparse), floor_sgd[hi]),
        lambda x: x <= 1.25,
        "{:.2f}x",
    )
    # Issue 12's targets.
    add(
        f"V={hi} clip+SGD jaxslices / floor SGD <= 1.5",
        ratio(_ms(rows, hi, "clip_sgd", sparse), floor_sgd[hi]),
        lambda x: x <= 1.5,
        "{:.2f}x",
    )
    add(
        f"V={hi} lazy Adam jaxslices / floor SGD <= 2",
        ratio(_ms(rows, hi, "adam", sparse), floor_sgd[hi]),
        lambda x: x <= 2,
        "{:.2f}x",
    )
    for v in sorted({lo, hi}):
        add(
            f"V={v} rowwise_adagrad / adagrad (jaxslices) <= 1",
            ratio(
                _ms(rows, v, "rowwise_adagrad", sparse),
                _ms(rows, v, "adagrad", sparse),
            ),
            lambda x: x <= 1.0,
            "{:.2f}x",
        )
    for opt in OPTIMIZERS:
        # Documented advice for small tables: densify() ahead of clip/Adagrad/
        # Adam/FTRL, plain jaxslices for SGD; the best of the two vs dense.
        best = [_ms(rows, lo, opt, p) for p in (sparse, "densify")]
        best = [b for b in best if b is not None]
        add(
            f"V={lo} {opt}: best of jaxslices / densify vs dense <= 1",
            ratio(min(best), _ms(rows, lo, opt, "dense")) if best else None,
            lambda x: x <= 1.0,
            "{:.2f}x",
        )
    add(
        f"V={hi} Adam: dense / jaxslices >= 20",
        ratio(_ms(rows, hi, "adam", "dense"), _ms(rows, hi, "adam", sparse)),
        lambda x: x >= 20,
        "{:.1f}x",
    )
    for opt in OPTIMIZERS if hi > lo else ():
        add(
            f"jaxslices {opt}: time(V={hi}) / time(V={lo}) <= 1.5",
            ratio(_ms(rows, hi, opt, sparse), _ms(rows, lo, opt, sparse)),
            lambda x: x <= 1.5,
            "{:.2f}x",
        )
    return out


def targets_table(items: list[dict[str, Any]]) -> str:
    lines = ["| target | measured | verdict |", "|---|---|---|"]
    for t in items:
        verdict = "met" if t["met"] else "missed"
        lines.append(f"| {t['target']} | {t['fmt'].format(t['value'])} | {verdict} |")
    return "\n".join(lines)


def save_plot(rows: list[dict], path: str, env: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opts = [o for o in OPTIMIZERS if any(r["optimizer"] == o for r in rows)]
    fig, axes = plt.subplots(1, len(opts), figsize=(4 * len(opts), 3.6), squeeze=False)
    axes = axes[0]
    styles = {
        "dense": "o-",
        "jaxslices": "s-",
        "floor": "^--",
        "densify": "x:",
        "js_sort": "d-.",
        "native": "v-",
        "js_nodonate": "s:",
        "dense_nodonate": "o:",
    }
    for ax, opt in zip(axes, opts, strict=True):
        for p, style in styles.items():
            pts = sorted(
                (r["num_rows"], r["median_ms"])
                for r in rows
                if r["optimizer"] == opt and r["path"] == p
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=p)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(opt)
        ax.set_xlabel("table rows V")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median ms / step")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"Training step time vs table size ({env['cpu']} x{env['nproc']}, "
        f"{env['backend']}, jax {env['jax']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-rows", type=int, nargs="+", default=[16384, 131072, 1048576])
    p.add_argument("--steps", type=int, default=10, help="timed steps per turn")
    p.add_argument(
        "--passes", type=int, default=6, help="round-robin turns (steps x passes timed)"
    )
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    p.add_argument(
        "--paths", nargs="+", default=list(PATHS), choices=[*PATHS, *NOT_DONATED]
    )
    p.add_argument("--densify-max-v", type=int, default=131072)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    main(
        num_rows=tuple(a.num_rows),
        steps=a.steps,
        passes=a.passes,
        optimizers=tuple(a.optimizers),
        paths=tuple(a.paths),
        densify_max_v=a.densify_max_v,
        batch=a.batch,
        out=a.out,
    )
