"""A DLRM training step four ways: one EmbeddingCollection, 26 separate tables,
dense Optax, and TorchRec/FBGEMM on CPU, on the same synthetic Criteo batches.

The model and data are ``examples/dlrm.py``'s (26 tables of Criteo Kaggle's
skewed sizes times ``--scale``, Zipf ids, ``--batch`` examples of one id per
feature, or 1 to ``--max-len``); every path starts from the same initial
values (``examples/criteo_synth.py``) and trains the embeddings with the same
optimizer (``--opt``: FBGEMM's exact row-wise Adagrad, or SGD), the MLPs with
SGD:

* ``collection``: :class:`jaxslices.EmbeddingCollection`, one stacked buffer,
  a ``KeyedJaggedIds`` input: one gather, one sparse gradient, one coalesce
  and scatter per step;
* ``separate``: 26 tables, one ``jaxslices.embedding_bag`` each (26 sparse
  gradients, 26 coalesces and scatters);
* ``dense``: 26 tables, ``jax.value_and_grad`` and the same optimizer on dense
  gradients (``optax.sgd``; for row-wise Adagrad, which Optax lacks,
  ``jaxslices.rowwise_adagrad``'s rule on the dense gradient): every step
  reads and writes every row;
* ``torchrec`` (with ``--torchrec-python``): ``benchmarks/dlrm_torchrec.py``
  in a worker process of that interpreter: TorchRec's ``DLRM`` over a
  ``FusedEmbeddingBagCollection`` (FBGEMM, optimizer fused into backward);
  ``--torch-threads 0 1`` runs one worker with torch's default threads and
  one with 1 thread (``torchrec_1thread``): on a shared machine torch's
  OpenMP threads suffer when a core is taken.

``--head linear`` swaps the MLPs and interactions for one linear layer on the
pooled embeddings: the sparse part alone, where the paths differ.

How it measures: each JAX path is one ``jax.jit`` step with params and
optimizer state donated, compiled ahead of time (``memory_analysis()`` gives
its temporary bytes). First every path (and the worker) runs
``--check-steps`` steps on batches 0, 1, ...: their losses must agree (the
same model computed four ways), the largest difference is recorded. Then
``--passes`` turns in a shuffled order, each turn one untimed and
``--steps`` timed steps of every path in turn (the worker idles on a pipe
while JAX runs, and JAX idles while the worker runs), on a pool of
``--pool`` batches. Medians and their ratios come from this one run, with
the CPU time (user + system, all threads) per step of each process.

``--keep-freed-memory`` restarts the script with glibc's malloc set to keep
freed memory (:data:`MALLOC_ENV`: one arena, no trimming, no mmap below
1 GB; the workers inherit it): glibc serves large blocks with fresh pages and
returns them on free, so a step whose XLA:CPU temporaries are large pays a
page fault per page touched, every step.

Run: ``python benchmarks/dlrm_bench.py --out benchmarks/results/<yyyy-mm>-cpu
--torchrec-python /path/to/venv-torchrec/bin/python``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import MALLOC_ENV, environment, rss_mb, save_json, summary, time_call
from _repo import load

import jaxslices as js

synth = load("examples.criteo_synth")
dlrm = load("examples.dlrm")

PATHS = ("collection", "collection_padded", "separate", "dense")


def linear_head_loss(params, dense, emb, labels):
    del dense
    x = emb.reshape(emb.shape[0], -1)  # [B, F * D]
    logits = (x @ params["out"][0] + params["out"][1])[:, 0]
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, labels))


class JaxPath:
    """Params, optimizer state and the jitted, donated step of one path."""

    def __init__(self, path, sizes, a, init):
        self.path = path
        head = dlrm.head_loss if a.head == "dlrm" else linear_head_loss
        if a.head == "dlrm":
            mlp = {"bottom": init["bottom"], "top": init["top"]}
        else:
            mlp = {"out": linear_init(len(sizes) * a.dim, a.seed)}
        mlp = jax.tree.map(jnp.asarray, mlp)
        keys = dlrm.feature_names(len(sizes))
        if path.startswith("collection"):
            coll = dlrm.make_collection(sizes, a.dim)
            tables = {
                t.name: x for t, x in zip(coll.tables, init["tables"], strict=True)
            }
            emb = coll.stack(tables)

            def pooled(emb, sparse):
                pad = None if path == "collection" else -1
                x = coll.concat(emb, sparse, padding_id=pad)  # [B, F * D]
                return x.reshape(x.shape[0], len(keys), -1)

            if path == "collection":
                cap = len(sizes) * a.batch * a.max_len
                self.inputs = lambda b: dlrm.inputs(b, keys, cap)
            else:

                def inputs(b):  # {feature: [B, L] ids, -1 in empty slots}
                    ids = dict(zip(keys, jnp.asarray(b.padded(a.max_len)), strict=True))
                    return jnp.asarray(b.dense), ids, jnp.asarray(b.labels)

                self.inputs = inputs
        else:
            emb = [jnp.asarray(t) for t in init["tables"]]
            if path == "separate":

                def pooled(emb, ids):
                    outs = [
                        js.embedding_bag(t, ids[f], combiner="sum", padding_id=-1)
                        for f, t in enumerate(emb)
                    ]
                    return jnp.stack(outs, axis=1)
            else:

                def pooled(emb, ids):
                    outs = []
                    for f, t in enumerate(emb):
                        rows = t.at[ids[f]].get(mode="fill", fill_value=0)
                        outs.append(jnp.sum(rows, axis=1))  # -1 reads zeros
                    return jnp.stack(outs, axis=1)

            def inputs(b):
                return (
                    jnp.asarray(b.dense),
                    jnp.asarray(b.padded(a.max_len)),
                    jnp.asarray(b.labels),
                )

            self.inputs = inputs
        self.params = {"emb": emb, **mlp}
        if a.opt == "sgd":
            tx_emb = optax.sgd(a.lr) if path == "dense" else js.sgd(a.lr)
        else:
            tx_emb = js.rowwise_adagrad(a.lr)  # dense gradients: its dense rule
        tx = optax.multi_transform(
            {"emb": tx_emb, "mlp": optax.sgd(a.dense_lr)},
            lambda p: {k: ("emb" if k == "emb" else "mlp") for k in p},
        )
        self.state = jax.jit(tx.init)(self.params)

        def loss_fn(params, dense, sparse, labels):
            return head(params, dense, pooled(params["emb"], sparse), labels)

        grad = jax.value_and_grad if path == "dense" else js.value_and_grad
        vg = grad(loss_fn)

        def step(params, state, dense, sparse, labels):
            loss, g = vg(params, dense, sparse, labels)
            u, state = tx.update(g, state, params)
            return js.apply_updates(params, u), state, loss

        self.step = jax.jit(step, donate_argnums=(0, 1))

    def compile(self, inp) -> dict:
        t0 = time.perf_counter()
        compiled = self.step.lower(self.params, self.state, *inp).compile()
        self.step = compiled  # run what was compiled (jit would compile again)
        m = compiled.memory_analysis()
        return {
            "compile_s": round(time.perf_counter() - t0, 2),
            "temp_mb": round(m.temp_size_in_bytes / 2**20, 1),
            "argument_mb": round(m.argument_size_in_bytes / 2**20, 1),
            "alias_mb": round(m.alias_size_in_bytes / 2**20, 1),
        }

    def run(self, inp) -> float:
        self.params, self.state, loss = self.step(self.params, self.state, *inp)
        return float(loss)  # blocks


def _check_malloc_env() -> None:
    """``--keep-freed-memory`` needs :data:`MALLOC_ENV` from the process start."""
    wrong = {k: v for k, v in MALLOC_ENV.items() if os.environ.get(k) != v}
    if wrong:
        raise RuntimeError(
            "keep_freed_memory=True: start Python with these environment "
            f"variables (glibc reads them at start-up): {wrong}. The command line "
            "option restarts the script with them."
        )


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process, every thread."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def linear_init(n_in: int, seed: int):
    """The linear head's initial values (``dlrm_torchrec.linear_init``'s)."""
    rng = np.random.default_rng((seed, 1))
    bound = 1.0 / np.sqrt(n_in)
    w = rng.uniform(-bound, bound, (n_in, 1)).astype(np.float32)
    return w, np.zeros(1, np.float32)


class TorchWorker:
    """``dlrm_torchrec.py --serve`` in another interpreter, driven over pipes."""

    def __init__(self, python: str, a, threads: int):
        script = Path(__file__).with_name("dlrm_torchrec.py")
        args = [
            f"--batch={a.batch}", f"--dim={a.dim}", f"--scale={a.scale}",
            f"--max-len={a.max_len}", f"--opt={a.opt}", f"--lr={a.lr}",
            f"--dense-lr={a.dense_lr}", f"--head={a.head}", f"--seed={a.seed}",
            f"--pool={a.pool}", f"--check-steps={a.check_steps}",
            f"--tables={a.tables}",
        ]  # fmt: skip
        if threads:
            args.append(f"--threads={threads}")
        self.cmd = [python, str(script), "--serve", *args]
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            raise RuntimeError(f"the TorchRec worker failed: {self.proc.wait()}")
        self.info = json.loads(line)

    def run(self, n: int) -> tuple[list[float], float]:
        """K step times (ms) and the CPU ms per step of the last K - 1."""
        self.proc.stdin.write(f"run {n}\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        return [1e3 * t for t in out["times"]], out["cpu_ms"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def main(
    batch: int = 2048,
    dim: int = 64,
    scale: float = 1 / 8,
    max_len: int = 1,
    opt: str = "rowwise_adagrad",
    lr: float = 0.05,
    dense_lr: float = 0.1,
    head: str = "dlrm",
    paths: tuple[str, ...] = PATHS,
    tables: int = 26,
    torchrec_python: str | None = None,
    torch_threads: tuple[int, ...] = (0,),
    check_steps: int = 3,
    steps: int = 5,
    passes: int = 8,
    pool: int = 4,
    seed: int = 0,
    out: str | None = None,
    tag: str = "",
    keep_freed_memory: bool = False,
) -> dict:
    a = argparse.Namespace(**locals())
    if keep_freed_memory:
        _check_malloc_env()  # the TorchRec workers inherit the environment
    sizes = synth.table_sizes(scale)[:tables]
    data = synth.CriteoSynth(tuple(sizes), batch, max_len, seed=seed)
    load = [os.getloadavg()[0]]
    init = synth.init_dlrm(sizes, dim, seed=seed)
    runners, compiled, rss_growth = {}, {}, {}
    for p in paths:
        before = rss_mb()["rss_mb"]
        r = JaxPath(p, sizes, a, init)
        compiled[p] = r.compile(r.inputs(data.batch_at(0)))
        runners[p] = r
        rss_growth[p] = round(rss_mb()["rss_mb"] - before, 1)
    del init
    check = {p: [r.run(r.inputs(data.batch_at(i))) for i in range(check_steps)]
             for p, r in runners.items()}  # fmt: skip
    workers = {}  # one TorchRec worker per thread count (0: torch's default)
    for n in torch_threads if torchrec_python else ():
        name = "torchrec" if n == 0 else f"torchrec_{n}thread"
        workers[name] = TorchWorker(torchrec_python, a, n)
        check[name] = workers[name].info["check_losses"]
    ref = np.asarray(check[paths[0]])
    check_gap = {
        p: float(np.max(np.abs(np.asarray(v) - ref))) for p, v in check.items()
    }
    inputs = {p: [r.inputs(data.batch_at(i)) for i in range(pool)]
              for p, r in runners.items()}  # fmt: skip
    times: dict[str, list[float]] = {p: [] for p in [*runners, *workers]}
    counter = {p: 0 for p in runners}

    cpu_ms: dict[str, list[float]] = {p: [] for p in times}

    def jax_turn(p):
        r = runners[p]
        c0 = None
        for k in range(steps + 1):
            if k == 1:
                c0 = _cpu_s()
            inp = inputs[p][counter[p] % pool]
            counter[p] += 1
            t = time_call(lambda r=r, inp=inp: r.run(inp))
            if k:
                times[p].append(t)
        cpu_ms[p].append(1e3 * (_cpu_s() - c0) / steps)

    rng = np.random.default_rng(0)
    names = list(times)
    for _ in range(passes):
        for i in rng.permutation(len(names)):
            name = names[i]
            if name in workers:
                t, c = workers[name].run(steps + 1)
                times[name] += t[1:]
                cpu_ms[name].append(c)
            else:
                jax_turn(name)
        load.append(os.getloadavg()[0])
    for w in workers.values():
        w.close()
    med = {
        p: {**summary(t), "cpu_ms": float(np.median(cpu_ms[p]))}
        for p, t in times.items()
    }
    base = med[paths[0]]["median_ms"]
    report = {
        "benchmark": "dlrm_bench",
        "settings": {k: v for k, v in vars(a).items() if k != "torchrec_python"},
        "tables": len(sizes),
        "rows": int(sum(sizes)),
        "table_mb": round(sum(sizes) * dim * 4 / 2**20, 1),
        "backend": jax.default_backend(),
        "environment": environment(),
        "load_avg_1m": {"start": load[0], "min": min(load), "max": max(load)},
        "check_losses": check,
        "check_max_abs_diff": check_gap,
        "paths": {
            p: {**med[p], **compiled.get(p, {}), "rss_growth_mb": rss_growth.get(p)}
            for p in med
        },
        f"time_over_{paths[0]}": {
            p: round(m["median_ms"] / base, 3) for p, m in med.items()
        },
        "peak_rss_mb": rss_mb()["peak_rss_mb"],
    }
    for name, w in workers.items():
        report[name] = {k: v for k, v in w.info.items() if k != "check_losses"}
        report[name]["command"] = " ".join(w.cmd[1:])
    name = "_".join(
        ["dlrm_bench", report["backend"]]
        + ([] if head == "dlrm" else [head])
        + ([] if batch == 2048 else [f"b{batch}"])
        + ([tag] if tag else [])
    )
    name += ".json"
    save_json(report, out, name)
    print(f"DLRM step ({head} head, batch {batch}, {len(sizes)} tables, "
          f"{sum(sizes):,} rows x {dim}, {opt}); load {load[0]:.1f}:")  # fmt: skip
    for p, m in med.items():
        extra = compiled.get(p, {})
        print(
            f"  {p:17s} {m['median_ms']:8.2f} ms  x{m['median_ms'] / base:6.2f}  "
            f"cpu {m['cpu_ms']:7.1f} ms  "
            f"temp {extra.get('temp_mb', '-')} MB  loss gap {check_gap[p]:.1e}"
        )
    return report


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--scale", type=float, default=1 / 8)
    p.add_argument("--max-len", type=int, default=1)
    p.add_argument(
        "--opt", default="rowwise_adagrad", choices=("sgd", "rowwise_adagrad")
    )
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dense-lr", type=float, default=0.1)
    p.add_argument("--head", default="dlrm", choices=("dlrm", "linear"))
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--tables", type=int, default=26, help="the first N of Criteo's")
    p.add_argument("--torchrec-python", default=None)
    p.add_argument(
        "--torch-threads",
        type=int,
        nargs="+",
        default=[0],
        help="one TorchRec worker per value (0: torch's default)",
    )
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--passes", type=int, default=8)
    p.add_argument("--pool", type=int, default=4)
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="", help="appended to the JSON's name")
    p.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="restart with MALLOC_ENV: glibc keeps freed memory (both sides)",
    )
    args = vars(p.parse_args())
    if args["keep_freed_memory"] and any(
        os.environ.get(k) != v for k, v in MALLOC_ENV.items()
    ):  # glibc reads them at start-up: run again with them
        os.execve(
            sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV}
        )
    main(**{k.replace("-", "_"): v for k, v in args.items()})
