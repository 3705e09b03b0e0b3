"""64-bit mode (``JAX_ENABLE_X64=1``): every optimizer on both paths.

Under x64, ``jnp.sum`` of int32 returns int64, so a reduction that counts in
one branch of a ``lax.switch`` and not in the other used to break tracing
(``switch branches must have equal output types``: the coalescing methods).
x64 is a process-wide switch read when JAX starts, so the cases run in a
subprocess; the parent compares what it prints with its own (32-bit) run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

CASES = textwrap.dedent(
    """
    import contextlib, json, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    import jaxslices as js

    OPTIMIZERS = {
        "sgd": lambda: js.sgd(0.1),
        "sgd_momentum": lambda: js.sgd(0.1, 0.9),
        "adagrad": lambda: js.adagrad(0.1),
        "rowwise_adagrad": lambda: js.rowwise_adagrad(0.1),
        "lazy_adam": lambda: js.lazy_adam(0.01),
        "lazy_adamw": lambda: js.lazy_adamw(0.01, weight_decay=0.1),
        "ftrl": lambda: js.ftrl(0.1, l1=0.01, l2=0.01),
        "clip_adagrad": lambda: optax.chain(
            js.clip_by_global_norm(0.05), js.adagrad(0.1)),
        "clip_lazy_adam": lambda: optax.chain(js.clip(0.001), js.lazy_adam(0.01)),
        "row_norm_sgd": lambda: optax.chain(js.clip_by_row_norm(0.01), js.sgd(0.1)),
        "decay_sgd": lambda: optax.chain(js.add_decayed_weights(0.1), js.sgd(0.1)),
        "max_distinct": lambda: js.rowwise_adagrad(0.1, max_distinct=24),
    }
    ID_DTYPES = sys.argv[1].split(",")
    PATHS = [p == "native" for p in sys.argv[2].split(",")]
    rng = np.random.default_rng(0)
    V = 30
    raw = ((rng.zipf(1.3, size=(3, 6, 4)) - 1) % V).astype(np.int64)
    raw[:, 1, :] = V  # an empty bag
    y = rng.normal(size=(3, 6)).astype(np.float32)
    table = rng.normal(size=(V, 4)).astype(np.float32)
    w = rng.normal(size=(4,)).astype(np.float32)

    def loss(p, ids, y):
        h = js.embedding_bag(p["emb"], ids, combiner="mean")
        r = js.embedding_lookup(p["emb"], ids[:, 0])
        return jnp.mean((h @ p["w"] - y) ** 2) + jnp.mean(r ** 2)

    def train(name, id_dtype, native):
        tx = OPTIMIZERS[name]()
        p = {"emb": jnp.asarray(table), "w": jnp.asarray(w)}
        s = tx.init(p)

        @jax.jit
        def step(p, s, ids, y):
            g = js.grad(loss)(p, ids, y)
            u, s = tx.update(g, s, p)
            return js.apply_updates(p, u), s

        with contextlib.nullcontext() if native else js.kernels.disabled():
            for k in range(3):
                p, s = step(p, s, jnp.asarray(raw[k].astype(id_dtype)), y[k])
        return np.asarray(p["emb"]).tolist()

    out = {"x64": bool(jax.config.jax_enable_x64), "runs": {}}
    for name in OPTIMIZERS:
        # Every optimizer with the widest ids; every id dtype through one.
        dtypes = ID_DTYPES if name == "adagrad" else ID_DTYPES[-1:]
        for id_dtype in dtypes:
            for native in PATHS:
                key = f"{name}/{id_dtype}/{'native' if native else 'xla'}"
                out["runs"][key] = train(name, id_dtype, native)

    s = js.IndexedSlices(
        jnp.ones((6, 2)), jnp.array([3, 1, 3, V, 0, 1], ID_DTYPES[-1]), (V, 2)
    )
    for method in ("hash", "sort", "auto"):
        c = jax.jit(lambda s: js.coalesce(s, method=method))(s)
        out["runs"][f"coalesce/{method}"] = np.asarray(c.to_dense()).tolist()
    print("RESULT " + json.dumps(out))
    """
)


def _run(x64: bool, id_dtypes: str, paths: str) -> dict:
    env = {"JAX_ENABLE_X64": "1" if x64 else "0", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", CASES, id_dtypes, paths],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **env, "XLA_FLAGS": ""},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="runs JAX on the CPU")
def test_every_optimizer_and_coalesce_method_under_x64_equals_32_bit_mode():
    """Under x64 every optimizer traces on both paths, with int8..int64 ids.

    The results on both paths equal the same steps in 32-bit mode on the XLA
    path (ids are int32 indices below 2**31 rows in both modes; the float
    maths is float32 in both). In 32-bit mode the native path equals the XLA
    path for every optimizer in tests/lib/test_kernels.py, so the 32-bit run
    here takes the XLA path only.
    """
    wide = _run(True, "int8,int16,uint8,int32,int64", "native,xla")
    narrow = _run(False, "int32", "xla")
    assert wide["x64"] and not narrow["x64"]
    tol = {"rtol": 2e-5, "atol": 2e-6}
    for key, ref in narrow["runs"].items():
        if key.startswith("coalesce/"):
            np.testing.assert_array_equal(wide["runs"][key], ref, err_msg=key)
            continue
        name = key.split("/")[0]
        widths = ("int8", "int16", "uint8", "int32", "int64")
        for id_dtype in widths if name == "adagrad" else ("int64",):
            for path in ("native", "xla"):
                got = wide["runs"][f"{name}/{id_dtype}/{path}"]
                where = f"{key} {id_dtype} {path}"
                np.testing.assert_allclose(got, ref, err_msg=where, **tol)
