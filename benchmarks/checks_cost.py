"""What the run-time checks and checkpoint support cost a step, code tree vs tree.

Compares two versions of jaxslices (e.g. ``main`` and a branch), each imported
in its own child process from the directory given to ``--trees``:

* the compiled HLO of whole training steps, with source locations stripped
  (``value_and_grad`` of an embedding model, V = 2**20, D = 64, 1024 x 16
  ids, params and state donated): SGD, clip + SGD, lazy Adam, ``MultiSteps``
  (concatenating and coalescing buffers), and the row-sharded step on 8 CPU
  devices with ``masked`` and ``all_to_all`` routing. Equal hashes mean the
  step did not change at all; the collectives and conditionals are counted;
* the median time of the row-sharded steps and of the coalescing
  ``MultiSteps`` step (V = 2**16, D = 32, 512 x 8 ids), on 8 CPU devices.

Run: ``python benchmarks/checks_cost.py --trees /path/to/main . --labels main
branch --repeats 3 --out benchmarks/results/<yyyy-mm>-cpu/checks_cost_cpu.json``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HLO_STEPS = (
    "sgd",
    "clip_sgd",
    "lazy_adam",
    "multisteps_concat",
    "multisteps_coalesce",
    "sharded_masked",
    "sharded_all_to_all",
)
TIMED_STEPS = ("sharded_masked", "sharded_all_to_all", "multisteps_coalesce")


def strip_locations(text: str) -> str:
    """Compiled HLO text without source locations (file tables, frame ids)."""
    out, skip = [], False
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            skip = True
            continue
        if skip:
            skip = line.strip() != ""
            continue
        line = re.sub(r",? ?stack_frame_id=\d+", "", line)
        line = re.sub(r",? ?metadata=\{[^}]*\}", "", line)
        out.append(line)
    return "\n".join(out)


def _count(text: str, op: str) -> int:
    return len(re.findall(rf"\s{re.escape(op)}(?:-start)?\(", text))


HLO_SIZES = (2**20, 64, 1024, 16)  # rows, dim, batch, bag of the compiled steps


def child(
    num_rows: int,
    dim: int,
    batch: int,
    bag: int,
    steps: int,
    hlo_sizes: tuple[int, int, int, int] = HLO_SIZES,
) -> dict:
    """Runs in the child process (jaxslices from PYTHONPATH): HLO facts, times."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxslices as js

    def loss_fn(params, ids, y, lookup=js.embedding_lookup):
        h = lookup(params["emb"], ids).mean(1)
        return jnp.mean((jnp.tanh(h) @ params["w"] - y) ** 2)

    def plain_step(tx):
        def step(params, state, ids, y):
            _, g = js.value_and_grad(loss_fn)(params, ids, y)
            u, state = tx.update(g, state, params)
            return js.apply_updates(params, u), state

        return step

    def sharded_step(tx, routing):
        lookup = functools.partial(
            js.sharding.sharded_lookup, axis="model", routing=routing
        )

        def step(params, state, ids, y):
            _, g = js.value_and_grad(loss_fn)(params, ids, y, lookup)
            return js.sharding.sharded_update(
                tx, g, state, params, axis="model", routing=routing
            )

        return step

    def optimizers(n):
        return {
            "sgd": js.sgd(0.1),
            "clip_sgd": optax.chain(js.clip_by_global_norm(1.0), js.sgd(0.1)),
            "lazy_adam": js.lazy_adam(1e-3),
            "multisteps_concat": js.MultiSteps(
                js.sgd(0.1), 4, capacity={"emb": 4 * n, "w": None}
            ),
            "multisteps_coalesce": js.MultiSteps(
                js.sgd(0.1), 4, capacity={"emb": 2 * n, "w": None}
            ),
        }

    mesh = Mesh(np.array(jax.devices()[:8]), ("model",))
    rows, rep = NamedSharding(mesh, P("model")), NamedSharding(mesh, P())

    def shapes(v, d, b, bag_, sharded):
        emb_s, batch_s = (rows, rows) if sharded else (None, None)
        params = {
            "emb": jax.ShapeDtypeStruct((v, d), jnp.float32, sharding=emb_s),
            "w": jax.ShapeDtypeStruct(
                (d,), jnp.float32, sharding=rep if sharded else None
            ),
        }
        ids = jax.ShapeDtypeStruct((b, bag_), jnp.int32, sharding=batch_s)
        y = jax.ShapeDtypeStruct((b,), jnp.float32, sharding=batch_s)
        return params, ids, y

    hlo = {}
    v, d, b, n = hlo_sizes
    for name, tx in optimizers(b * n).items():
        params, ids, y = shapes(v, d, b, n, False)
        state = jax.eval_shape(tx.init, params)
        text = jax.jit(plain_step(tx), donate_argnums=(0, 1))
        hlo[name] = text.lower(params, state, ids, y).compile().as_text()
    tx = js.adagrad(0.1)
    for routing in ("masked", "all_to_all"):
        params, ids, y = shapes(v, d, b, n, True)
        state = jax.eval_shape(tx.init, params)
        state = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(
                s.shape, s.dtype, sharding=rows if s.shape[:1] == (v,) else rep
            ),
            state,
        )
        step = jax.jit(sharded_step(tx, routing), donate_argnums=(0, 1))
        hlo["sharded_" + routing] = (
            step.lower(params, state, ids, y).compile().as_text()
        )
    facts = {}
    for name, text in hlo.items():
        s = strip_locations(text)
        facts[name] = {
            "sha256": hashlib.sha256(s.encode()).hexdigest()[:16],
            **{
                op: _count(s, op)
                for op in (
                    "all-reduce",
                    "all-gather",
                    "all-to-all",
                    "conditional",
                    "custom-call",
                )
            },
        }

    def timed(step, args):
        out = step(*args)
        jax.block_until_ready(out)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            out = step(*out[:2], *args[2:])
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t)
        return float(np.median(times)) * 1e3

    rng = np.random.default_rng(0)
    ms = {}
    for routing in ("masked", "all_to_all"):
        params = {
            "emb": js.sharding.shard_rows(
                jnp.asarray(rng.normal(size=(num_rows, dim)), jnp.float32),
                mesh,
                "model",
            ),
            "w": jax.device_put(jnp.ones(dim), rep),
        }
        ids = jax.device_put(
            jnp.asarray(rng.integers(0, num_rows, (batch, bag)), jnp.int32), rows
        )
        y = jax.device_put(jnp.ones(batch), rows)
        step = jax.jit(sharded_step(tx, routing), donate_argnums=(0, 1))
        ms["sharded_" + routing] = timed(
            step, (params, js.sharding.sharded_init(tx, params), ids, y)
        )
    acc = optimizers(batch * bag)["multisteps_coalesce"]
    params = {
        "emb": jnp.asarray(rng.normal(size=(num_rows, dim)), jnp.float32),
        "w": jnp.ones(dim),
    }
    ids = jnp.asarray(rng.integers(0, num_rows // 8, (batch, bag)), jnp.int32)
    step = jax.jit(plain_step(acc), donate_argnums=(0, 1))
    ms["multisteps_coalesce"] = timed(
        step, (params, acc.init(params), ids, jnp.ones(batch))
    )
    return {
        "jax": jax.__version__,
        "jaxslices": js.__file__,
        "hlo": facts,
        "median_ms": ms,
    }


def main(
    trees: tuple[str, ...] = (".",),
    repeats: int = 1,
    labels: tuple[str, ...] | None = None,
    num_rows: int = 2**16,
    dim: int = 32,
    batch: int = 512,
    bag: int = 8,
    steps: int = 30,
    out: str | None = None,
    hlo_sizes: tuple[int, int, int, int] = HLO_SIZES,
) -> dict:
    runs = []
    labels = labels or trees
    for r in range(repeats):
        for tree, label in zip(trees, labels, strict=True):
            here = str(Path(__file__).parent)
            env = {
                **os.environ,
                # the tree's jaxslices, and this script for the child
                "PYTHONPATH": os.pathsep.join([str(Path(tree).resolve()), here]),
                "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                "JAX_PLATFORMS": "cpu",
            }
            sizes = f"{num_rows}, {dim}, {batch}, {bag}, {steps}, {hlo_sizes}"
            code = f"import json, checks_cost as c; print(json.dumps(c.child({sizes})))"
            proc = subprocess.run(  # cwd: `python -c` imports from it first
                [sys.executable, "-c", code],
                env=env,
                cwd=str(Path(tree).resolve()),
                capture_output=True,
                check=True,
            )
            res = json.loads(proc.stdout.decode().strip().splitlines()[-1])
            runs.append({"run": r + 1, "code": label, **res})
            print(r + 1, label, res["median_ms"], flush=True)
    report = {
        "what": __doc__.split("\n\n")[0],
        "command": "python benchmarks/checks_cost.py --trees "
        + " ".join(trees)
        + " --labels "
        + " ".join(labels)
        + f" --repeats {repeats}",
        "backend": "cpu (8 host devices)",
        "nproc": os.cpu_count(),
        "sizes": {"num_rows": num_rows, "dim": dim, "batch": batch, "bag": bag},
        "runs": runs,
    }
    if out:
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs="+", default=["."])
    p.add_argument("--labels", nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    labels = tuple(a.labels) if a.labels else None
    main(tuple(a.trees), a.repeats, labels, steps=a.steps, out=a.out)
