"""Training-step time and memory: jaxslices vs the dense Optax path vs a floor.

Workload (issue 5, fixed so results compare across systems): a ``V x 64``
float32 table; batches of 1024 examples x 16 ids, ids ``zipf(1.2) % V`` (fixed
seed, 20 pre-generated batches cycled, so many ids repeat); model: mean of the
16 embeddings -> Linear(64 -> 1) -> mean squared error against fixed random
targets. Optimizers: SGD 0.1; clip_by_global_norm(1.0) + SGD 0.1; Adagrad 0.1;
Adam 1e-3 (lazy Adam on the sparse paths).

Paths, each one jitted step with params and optimizer state donated:

* ``dense``: what a JAX user writes today: ``jax.value_and_grad`` + Optax +
  ``optax.apply_updates``.
* ``jaxslices``: ``jaxslices.value_and_grad`` + ``jaxslices.embedding_lookup``
  + jaxslices transforms + ``jaxslices.apply_updates``.
* ``floor``: a minimal hand-written sparse step: the gradient with respect to
  the gathered rows only, then ``table.at[ids].add(...)``. Clip, Adagrad and
  Adam need per-row sums, for which the floor uses ``jaxslices.coalesce``.

Run: ``python benchmarks/step_bench.py --out benchmarks/results`` (defaults are
the issue's workload). Prints a markdown table with ratios measured pair by pair
in the same run, writes ``step_bench_<backend>.json`` and a log-log plot.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxslices as js

OPTIMIZERS = ("sgd", "clip_sgd", "adagrad", "adam")
PATHS = ("dense", "jaxslices", "floor")


# ------------------------------------------------------------------ workload


def make_batches(num_rows: int, batch: int, bag: int, num_batches: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = [
        jnp.asarray(rng.zipf(1.2, size=(batch, bag)) % num_rows, jnp.int32)
        for _ in range(num_batches)
    ]
    targets = jnp.asarray(rng.normal(size=(batch,)), jnp.float32)
    return ids, targets


def init_params(num_rows: int, dim: int, seed: int) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "emb": 0.01 * jax.random.normal(k1, (num_rows, dim), jnp.float32),
        "w": 0.1 * jax.random.normal(k2, (dim,), jnp.float32),
        "b": jnp.zeros((), jnp.float32),
    }


def _head(h, params, y):
    return jnp.mean((h @ params["w"] + params["b"] - y) ** 2)


def dense_loss(params, ids, y):
    return _head(jnp.take(params["emb"], ids, axis=0).mean(1), params, y)


def sparse_loss(params, ids, y):
    return _head(js.embedding_lookup(params["emb"], ids).mean(1), params, y)


# --------------------------------------------------------------------- steps


def _dense_opt(name: str) -> optax.GradientTransformation:
    return {
        "sgd": lambda: optax.sgd(0.1),
        "clip_sgd": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
        "adagrad": lambda: optax.adagrad(0.1),
        "adam": lambda: optax.adam(1e-3),
    }[name]()


def _sparse_opt(name: str) -> optax.GradientTransformation:
    return {
        "sgd": lambda: js.sgd(0.1),
        "clip_sgd": lambda: optax.chain(js.clip_by_global_norm(1.0), js.sgd(0.1)),
        "adagrad": lambda: js.adagrad(0.1),
        "adam": lambda: js.lazy_adam(1e-3),
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


def _rows_grad(params, ids, y):
    """Floor: gradient with respect to the gathered rows and the dense head."""
    rows = params["emb"].at[ids].get(mode="fill", fill_value=0)

    def loss(rows, w, b):
        return _head(rows.mean(1), {"w": w, "b": b}, y)

    loss_value, (g_rows, g_w, g_b) = jax.value_and_grad(loss, argnums=(0, 1, 2))(
        rows, params["w"], params["b"]
    )
    return loss_value, g_rows.reshape(-1, rows.shape[-1]), g_w, g_b


def make_floor(name: str, params):
    num_rows, dim = params["emb"].shape
    lr = {"sgd": 0.1, "clip_sgd": 0.1, "adagrad": 0.1, "adam": 1e-3}[name]

    def coalesced(ids, g_rows):
        c = js.coalesce(js.IndexedSlices(g_rows, ids.reshape(-1), (num_rows, dim)))
        return c.indices, c.values

    if name == "sgd":
        state = ()

        def step(params, state, ids, y):
            loss, g_rows, g_w, g_b = _rows_grad(params, ids, y)
            emb = params["emb"].at[ids.reshape(-1)].add(-lr * g_rows, mode="drop")
            new = {"emb": emb, "w": params["w"] - lr * g_w, "b": params["b"] - lr * g_b}
            return new, state, loss

    elif name == "clip_sgd":
        state = ()

        def step(params, state, ids, y):
            loss, g_rows, g_w, g_b = _rows_grad(params, ids, y)
            idx, rows = coalesced(ids, g_rows)
            norm = jnp.sqrt(jnp.sum(rows**2) + jnp.sum(g_w**2) + g_b**2)
            scale = lr * jnp.minimum(1.0, 1.0 / jnp.maximum(norm, 1e-12))
            emb = params["emb"].at[idx].add(-scale * rows, mode="drop")
            new = {
                "emb": emb,
                "w": params["w"] - scale * g_w,
                "b": params["b"] - scale * g_b,
            }
            return new, state, loss

    elif name == "adagrad":
        state = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)

        def step(params, acc, ids, y):
            loss, g_rows, g_w, g_b = _rows_grad(params, ids, y)
            idx, rows = coalesced(ids, g_rows)
            a_rows = acc["emb"].at[idx].get(mode="fill", fill_value=0) + rows**2
            a_w, a_b = acc["w"] + g_w**2, acc["b"] + g_b**2
            emb = (
                params["emb"]
                .at[idx]
                .add(-lr * rows * jax.lax.rsqrt(a_rows + 1e-7), mode="drop")
            )
            new_acc = {
                "emb": acc["emb"].at[idx].set(a_rows, mode="drop"),
                "w": a_w,
                "b": a_b,
            }
            new = {
                "emb": emb,
                "w": params["w"] - lr * g_w * jax.lax.rsqrt(a_w + 1e-7),
                "b": params["b"] - lr * g_b * jax.lax.rsqrt(a_b + 1e-7),
            }
            return new, new_acc, loss

    else:  # adam
        zeros = jax.tree.map(jnp.zeros_like, params)
        state = (zeros, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.int32))

        def step(params, state, ids, y):
            m, v, count = state
            count = count + 1
            bc1 = 1 - 0.9 ** count.astype(jnp.float32)
            bc2 = 1 - 0.999 ** count.astype(jnp.float32)
            loss, g_rows, g_w, g_b = _rows_grad(params, ids, y)
            idx, rows = coalesced(ids, g_rows)

            def adam(p, m, v, g):
                m = 0.9 * m + 0.1 * g
                v = 0.999 * v + 0.001 * g**2
                return p - lr * (m / bc1) / (jnp.sqrt(v / bc2) + 1e-8), m, v

            m_rows = m["emb"].at[idx].get(mode="fill", fill_value=0)
            v_rows = v["emb"].at[idx].get(mode="fill", fill_value=0)
            p_rows = params["emb"].at[idx].get(mode="fill", fill_value=0)
            p_rows, m_rows, v_rows = adam(p_rows, m_rows, v_rows, rows)
            w, mw, vw = adam(params["w"], m["w"], v["w"], g_w)
            b, mb, vb = adam(params["b"], m["b"], v["b"], g_b)
            new = {
                "emb": params["emb"].at[idx].set(p_rows, mode="drop"),
                "w": w,
                "b": b,
            }
            new_m = {"emb": m["emb"].at[idx].set(m_rows, mode="drop"), "w": mw, "b": mb}
            new_v = {"emb": v["emb"].at[idx].set(v_rows, mode="drop"), "w": vw, "b": vb}
            return new, (new_m, new_v, count), loss

    return step, state


def make_densify(name: str, params):
    """jaxslices with the opt-in small-table fallback: densify, then transform."""
    opt = optax.chain(js.densify(), _sparse_opt(name))
    return _optax_step(opt, js.value_and_grad, sparse_loss, js.apply_updates, params)


MAKERS: dict[str, Callable[[str, Any], Any]] = {
    "dense": make_dense,
    "jaxslices": make_jaxslices,
    "floor": make_floor,
    "densify": make_densify,  # opt-in, not in the default PATHS
}


# ------------------------------------------------------------------- running


class Runner:
    """One compiled, donated step and its live params/state."""

    def __init__(self, path, opt, num_rows, dim, seed, ids, y):
        params = init_params(num_rows, dim, seed)
        step, state = MAKERS[path](opt, params)
        jitted = jax.jit(step, donate_argnums=(0, 1))
        compiled = jitted.lower(params, state, ids[0], y).compile()
        mem = compiled.memory_analysis()
        self.memory = {
            "temp_bytes": int(getattr(mem, "temp_size_in_bytes", -1)),
            "argument_bytes": int(getattr(mem, "argument_size_in_bytes", -1)),
            "output_bytes": int(getattr(mem, "output_size_in_bytes", -1)),
        }
        self.step, self.params, self.state = compiled, params, state
        self.ids, self.y, self.i = ids, y, 0
        self.times: list[float] = []
        self.run(3, record=False)  # warm up

    def run(self, steps: int, record: bool = True) -> None:
        for _ in range(steps):
            ids = self.ids[self.i % len(self.ids)]
            self.i += 1
            t0 = time.perf_counter()
            self.params, self.state, loss = self.step(
                self.params, self.state, ids, self.y
            )
            jax.block_until_ready((self.params, self.state, loss))
            if record:
                self.times.append((time.perf_counter() - t0) * 1e3)
        self.loss = float(loss)

    def free(self) -> None:
        self.params = self.state = self.step = None


def _progress(total: int):
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="steps", leave=False)
    except ImportError:  # pragma: no cover
        return None


def main(
    num_rows: tuple[int, ...] = (16384, 131072, 1048576),
    dim: int = 64,
    batch: int = 1024,
    bag: int = 16,
    num_batches: int = 20,
    steps: int = 20,
    passes: int = 3,
    optimizers: tuple[str, ...] = OPTIMIZERS,
    paths: tuple[str, ...] = PATHS,
    seed: int = 0,
    out: str | None = None,
    plot: bool = True,
) -> dict:
    """Run the benchmark; returns the report (also printed and saved to ``out``)."""
    rows = []
    bar = _progress(len(num_rows) * len(optimizers) * len(paths) * steps * passes)
    for v in num_rows:
        ids, y = make_batches(v, batch, bag, num_batches, seed)
        for opt in optimizers:
            runners = {p: Runner(p, opt, v, dim, seed, ids, y) for p in paths}
            for _ in range(passes):  # interleave paths against machine noise
                for p in paths:
                    runners[p].run(steps)
                    if bar is not None:
                        bar.update(steps)
            for p, r in runners.items():
                t = np.asarray(r.times)
                rows.append(
                    {
                        "num_rows": v,
                        "optimizer": opt,
                        "path": p,
                        "median_ms": float(np.median(t)),
                        "min_ms": float(t.min()),
                        "max_ms": float(t.max()),
                        "steps_timed": len(t),
                        "final_loss": r.loss,
                        **r.memory,
                    }
                )
                r.free()
    if bar is not None:
        bar.close()
    report = {
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        "workload": {"dim": dim, "batch": batch, "bag": bag, "zipf": 1.2},
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rows": rows,
    }
    report["table"] = markdown_table(rows)
    print(f"{report['device']} ({report['backend']}), jax {report['jax']}")
    print(report["table"])
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        stem = Path(out) / f"step_bench_{report['backend']}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
        if plot:
            save_plot(rows, str(stem) + ".png", report["device"])
    return report


def _get(rows, v, opt, path):
    for r in rows:
        if (r["num_rows"], r["optimizer"], r["path"]) == (v, opt, path):
            return r
    return None


def markdown_table(rows: list[dict]) -> str:
    with_densify = any(r["path"] == "densify" for r in rows)
    lines = [
        "| V | optimizer | dense ms | jaxslices ms | floor ms | dense / jaxslices "
        "| jaxslices / floor | temp MB dense / jaxslices |"
        + (" jaxslices + densify ms |" if with_densify else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if with_densify else ""),
    ]
    for v in sorted({r["num_rows"] for r in rows}):
        for opt in OPTIMIZERS:
            d, s, f = (_get(rows, v, opt, p) for p in PATHS)
            if s is None and d is None:
                continue

            def ms(r):
                return "-" if r is None else f"{r['median_ms']:.2f}"

            def ratio(a, b):
                if a is None or b is None:
                    return "-"
                return f"{a['median_ms'] / b['median_ms']:.1f}x"

            def mb(r):
                return "-" if r is None else f"{r['temp_bytes'] / 2**20:.1f}"

            extra = f" {ms(_get(rows, v, opt, 'densify'))} |" if with_densify else ""
            lines.append(
                f"| {v} | {opt} | {ms(d)} | {ms(s)} | {ms(f)} | {ratio(d, s)} | "
                f"{ratio(s, f)} | {mb(d)} / {mb(s)} |{extra}"
            )
    return "\n".join(lines)


def save_plot(rows: list[dict], path: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(OPTIMIZERS), figsize=(4 * len(OPTIMIZERS), 3.6))
    styles = {"dense": "o-", "jaxslices": "s-", "floor": "^--", "densify": "x:"}
    for ax, opt in zip(axes, OPTIMIZERS, strict=True):
        for p in styles:
            pts = sorted(
                (r["num_rows"], r["median_ms"])
                for r in rows
                if r["optimizer"] == opt and r["path"] == p
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), styles[p], label=p)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(opt)
        ax.set_xlabel("table rows V")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median ms / step")
    axes[0].legend()
    fig.suptitle(f"Training step time vs table size ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-rows", type=int, nargs="+", default=[16384, 131072, 1048576])
    p.add_argument("--steps", type=int, default=20, help="timed steps per pass")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    p.add_argument("--paths", nargs="+", default=list(PATHS))
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    main(
        num_rows=tuple(a.num_rows),
        steps=a.steps,
        passes=a.passes,
        optimizers=tuple(a.optimizers),
        paths=tuple(a.paths),
        batch=a.batch,
        out=a.out,
    )
