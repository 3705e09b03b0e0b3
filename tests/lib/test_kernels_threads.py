"""The native kernels on several threads: the same results, bit for bit.

Each kernel call splits its work into units that the calling thread and
XLA's pool threads claim (``csrc/parallel.h``); every table row is owned by
one unit and summed in slot order, so a step's table, optimizer state and
outputs must not depend on the thread count at all. The tests force 1, 2
and 4 threads with ``min_slots=0`` (so that even these small batches are
split) and compare bitwise: every optimizer, every bag form, the row-wise
op's own outputs (distinct ids in order, rows, count, sum of squares), a
collection, and a step inside ``shard_map`` on 8 devices. Then the edges:
the threshold (a call below ``min_slots`` stays on one thread; the setting
reaches the kernel), a pool of one thread asked for 4 (``PJRT_NPROC=1``),
a kernel called from a pool worker (many independent branches: the case
that deadlocks a kernel waiting for unclaimed work), and bad settings.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import needs_kernels

import jaxslices as js
from jaxslices._recipe import PooledGradient
from jaxslices.kernels import _ops, _threads
from jaxslices.transforms import _transform

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU-only kernels"),
    needs_kernels,  # the fallbacks: tests/lib/test_kernels_build.py
]

THREADS = (1, 2, 4)

OPTIMIZERS = {
    "sgd": lambda: js.sgd(0.1),
    "sgd_momentum": lambda: js.sgd(0.1, 0.9, nesterov=True),
    "adagrad": lambda: js.adagrad(0.1),
    "rowwise_adagrad": lambda: js.rowwise_adagrad(0.1),
    "lazy_adam": lambda: js.lazy_adam(0.01),
    "lazy_adamw": lambda: js.lazy_adamw(0.01, weight_decay=0.1),
    "ftrl": lambda: js.ftrl(0.1, l1=0.01, l2=0.01, l2_shrinkage=0.01, beta=0.1),
    "clip_by_global_norm": lambda: optax.chain(
        js.clip_by_global_norm(0.05), js.adagrad(0.1)
    ),
    "clip_by_row_norm": lambda: optax.chain(js.clip_by_row_norm(0.01), js.sgd(0.1)),
    "clip": lambda: optax.chain(js.clip(0.001), js.lazy_adam(0.01)),
    "max_distinct": lambda: js.rowwise_adagrad(0.1, max_distinct=400),
}


def _ids(rng, shape, num_rows):
    """Zipf ids (heavy duplicates) with padding and out-of-range ids."""
    ids = (rng.zipf(1.2, size=shape) - 1) % num_rows
    flat = ids.reshape(-1)
    flat[::17] = num_rows  # padding / out of range
    flat[5::23] = -3  # negative: out of range
    return jnp.asarray(ids, jnp.int32)


def _assert_bitwise(a, b, what):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, what
        # Bit patterns: NaN == NaN, and -0.0 != 0.0.
        assert x.tobytes() == y.tobytes(), f"{what}: not bitwise equal"


def _on_each_thread_count(fn, *args):
    """``jax.jit(fn)(*args)`` with 1, 2 and 4 forced threads."""
    out = []
    for t in THREADS:
        with js.kernels.threads(t, min_slots=0):
            out.append(jax.jit(fn)(*args))
    return out


def _assert_all_bitwise(runs, what):
    for t, r in zip(THREADS[1:], runs[1:], strict=True):
        _assert_bitwise(runs[0], r, f"{what}: 1 thread vs {t}")


def _train(tx_fn, loss, params, batches, threads):
    tx = tx_fn()

    @jax.jit
    def step(p, s, *batch):
        g = js.grad(loss)(p, *batch)
        u, s = tx.update(g, s, p)
        return js.apply_updates(p, u), s

    p, s = params, tx.init(params)
    with js.kernels.threads(threads, min_slots=0):
        for batch in batches:
            p, s = step(p, s, *batch)
    return p, s


def _bag_setup(rng, num_rows=300, dim=8, bags=64, length=8, steps=2):
    params = {
        "emb": jnp.asarray(rng.normal(size=(num_rows, dim)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(dim,)), jnp.float32),
    }
    batches = [
        (_ids(rng, (bags, length), num_rows), jnp.asarray(rng.normal(size=bags)))
        for _ in range(steps)
    ]

    def loss(p, ids, y):
        h = js.embedding_bag(p["emb"], ids, combiner="mean", padding_id=num_rows)
        return jnp.mean((h @ p["w"] - y) ** 2)

    return params, batches, loss


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_is_bitwise_the_same_on_1_2_and_4_threads(name):
    params, batches, loss = _bag_setup(np.random.default_rng(0))
    runs = [_train(OPTIMIZERS[name], loss, params, batches, t) for t in THREADS]
    _assert_all_bitwise(runs, f"{name}")
    # ... and right: the XLA path, to float rounding.
    with js.kernels.disabled():
        xla = _train(OPTIMIZERS[name], loss, params, batches, 1)
    for x, y in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(xla), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("form", ["sum_weights", "sqrtn", "jagged"])
def test_every_bag_form_and_its_gradient_is_bitwise_the_same(form):
    rng = np.random.default_rng(1)
    num_rows, dim, bags, length = 200, 16, 48, 6
    table = jnp.asarray(rng.normal(size=(num_rows, dim)), jnp.float32)
    ids = _ids(rng, (bags, length), num_rows)
    weights = jnp.asarray(rng.normal(size=(bags, length)), jnp.float32)
    lengths = rng.integers(0, 9, size=bags)
    jagged = js.JaggedIds.from_lengths(
        rng.integers(-1, num_rows + 1, size=int(lengths.sum())), lengths
    )

    def f(tab):
        if form == "jagged":
            h = js.embedding_bag(tab, jagged, combiner="mean")
        elif form == "sqrtn":
            h = js.embedding_bag(tab, ids, combiner="sqrtn")
        else:
            h = js.embedding_bag(tab, ids, combiner="sum", weights=weights)
        return (h * h).sum(), h

    def run(t):
        with js.kernels.threads(t, min_slots=0):
            (_, h), g = jax.jit(js.value_and_grad(f, has_aux=True))(table)
            u, _ = js.sgd(1.0).update(g, js.sgd(1.0).init(table), table)
            return h, jax.jit(js.apply_updates)(table, u)

    runs = [run(t) for t in THREADS]
    _assert_all_bitwise(runs, f"{form}")


@pytest.mark.parametrize("order", ["sorted", "unsorted"])
def test_bags_given_per_slot_sorted_or_not(order):
    """The forward op, a bag per slot: split by bags when sorted, else one thread."""
    rng = np.random.default_rng(4)
    num_rows, dim, bags, n = 100, 8, 30, 400
    table = jnp.asarray(rng.normal(size=(num_rows, dim)), jnp.float32)
    ids = jnp.asarray(rng.integers(-2, num_rows + 2, size=n), jnp.int32)
    bag = np.sort(rng.integers(-1, bags + 1, size=n)).astype(np.int32)
    if order == "unsorted":
        bag = rng.permutation(bag)
    weight = jnp.asarray(rng.normal(size=n), jnp.float32)

    def forward(tab):
        return _ops.bag_forward(
            tab, ids, weight=weight, scale=None, num_bags=bags, bag=jnp.asarray(bag)
        )

    runs = _on_each_thread_count(forward, table)
    _assert_all_bitwise(runs, f"{order} bags")
    with js.kernels.disabled():
        xla = jax.jit(forward)(table)
    np.testing.assert_allclose(runs[0], xla, rtol=2e-5, atol=2e-6)


def test_rowwise_op_outputs_are_bitwise_the_same():
    """Distinct ids in order of first appearance, rows, count, sum of squares."""
    rng = np.random.default_rng(2)
    num_rows, dim, bags, length = 500, 8, 128, 8
    src = jnp.asarray(rng.normal(size=(bags, dim)), jnp.float32)
    ids = _ids(rng, (bags * length,), num_rows)
    state = jnp.asarray(rng.uniform(size=(num_rows, dim)), jnp.float32)
    recipe = PooledGradient(src, None, length, None, jnp.float32(0.5))

    def rowwise(st):
        return _ops.rowwise(
            recipe, ids, num_rows=num_rows, spec=_transform._RSS_SPEC, hp=(1e-7,),
            state=st, capacity=ids.size, want_sumsq=True,
        )  # fmt: skip

    def defined(out):  # rows past the count are unspecified
        new_state, uids, rows, count, sumsq = out
        return new_state, uids, rows[: int(count)], count, sumsq

    runs = [defined(out) for out in _on_each_thread_count(rowwise, state)]
    _assert_all_bitwise(runs, "rowwise")
    new_state, uids, rows, count, sumsq = runs[0]
    flat = np.asarray(ids)
    valid = flat[(flat >= 0) & (flat < num_rows)]
    first = list(dict.fromkeys(valid.tolist()))  # order of first appearance
    assert int(count) == len(first)
    assert np.asarray(uids)[: len(first)].tolist() == first
    assert (np.asarray(uids)[len(first) :] == num_rows).all()


def test_a_collection_step_is_bitwise_the_same():
    rng = np.random.default_rng(3)
    coll = js.EmbeddingCollection(
        [
            js.TableConfig("user", rows=120, dim=8, combiner="mean"),
            js.TableConfig("item", rows=90, dim=8, features=("item", "seen")),
        ]
    )
    params = coll.init(jax.random.key(0))
    rows, B = {"user": 120, "item": 90, "seen": 90}, range(40)
    kjt = js.KeyedJaggedIds.from_lists(
        {
            f: [rng.integers(-1, n + 1, size=rng.integers(0, 7)).tolist() for _ in B]
            for f, n in rows.items()
        }
    )
    tx = js.adagrad(0.1)

    @jax.jit
    def step(p, s, kjt):
        def loss(p):
            return sum(jnp.sum(jnp.tanh(v)) for v in coll(p, kjt).values())

        g = js.grad(loss)(p)
        u, s = tx.update(g, s, p)
        return js.apply_updates(p, u), s

    runs = []
    for t in THREADS:
        with js.kernels.threads(t, min_slots=0):
            runs.append(step(params, tx.init(params), kjt))
    _assert_all_bitwise(runs, "collection")


def test_per_device_kernels_inside_shard_map_are_bitwise_the_same():
    import _mesh
    from jax.sharding import PartitionSpec as P

    m = _mesh.mesh()
    params, batches, loss = _bag_setup(np.random.default_rng(5), bags=128)
    tx = js.lazy_adam(0.01)

    def per_device(p, s, ids, y):
        g = js.grad(lambda p: jax.lax.pmean(loss(p, ids, y), "data"))(p)
        u, s = tx.update(g, s, p)
        return js.apply_updates(p, u), s

    step = jax.jit(
        jax.shard_map(
            per_device,
            mesh=m,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=(P(), P()),
        )  # fmt: skip
    )
    runs = []
    for t in THREADS:
        with js.kernels.threads(t, min_slots=0):
            runs.append(step(params, tx.init(params), *batches[0]))
            assert js.kernels.explain(step, params, tx.init(params), *batches[0]).native
    _assert_all_bitwise(runs, "shard_map")


def test_threshold_and_setting_reach_the_kernels():
    table = jnp.ones((64, 4))
    ids = jnp.zeros((8, 4), jnp.int32)
    f = jax.jit(lambda t, i: js.embedding_bag(t, i))
    with js.kernels.threads(3, min_slots=17):
        text = f.lower(table, ids).as_text()
        assert _threads.thread_setting() == (3, 17)
    assert "threads = 3" in text and "min_slots = 17" in text
    n, min_slots = _threads.thread_setting()
    assert (n, min_slots) == (0, _threads.MIN_SLOTS)
    default = f.lower(table, ids).as_text()
    assert f"min_slots = {_threads.MIN_SLOTS}" in default and "threads = 0" in default
    # A call below min_slots (32 ids < 1000) and one above (32 >= 0) agree.
    with js.kernels.threads(4, min_slots=1000):
        below = f(table, ids)
    with js.kernels.threads(4, min_slots=0):
        above = f(table, ids)
    _assert_bitwise(below, above, "below vs above the threshold")
    report = js.kernels.explain(f, table, ids)
    assert "threads:" in str(report)


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: js.kernels.threads(0), "n must be >= 1"),
        (lambda: js.kernels.threads(2.5), "n must be an int"),
        (lambda: js.kernels.threads(True), "n must be an int"),
        (lambda: js.kernels.threads(2, min_slots=-1), "min_slots must be >= 0"),
    ],
)
def test_bad_settings_raise_saying_what_was_given(call, error):
    with pytest.raises((TypeError, ValueError), match=error):
        with call():
            pass


def _subprocess(code: str, env: dict[str, str], timeout: float = 240) -> str:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_one_thread_pool_asked_for_4_and_called_from_pool_workers():
    """PJRT_NPROC=1: the pool has one thread; 4 forced threads queue on it.

    Twelve independent bags and updates in one step make XLA's executor run
    thunks on pool workers (the handler then runs on the pool's only
    thread): a kernel that waited for tasks nobody claimed would hang here;
    the subprocess's timeout turns a hang into a failure.
    """
    code = """
        import jax, jax.numpy as jnp, numpy as np, jaxslices as js
        assert js.kernels.default_threads() == 1, js.kernels.default_threads()
        rng = np.random.default_rng(0)
        tables = [jnp.asarray(rng.normal(size=(256, 16)), jnp.float32)] * 12
        ids = [jnp.asarray(rng.integers(0, 256, size=(64, 8)), jnp.int32)
               for _ in range(12)]
        tx = js.adagrad(0.1)

        @jax.jit
        def step(ps, s, ids):
            g = js.grad(lambda ps: sum(js.embedding_bag(t, i).sum()
                                       for t, i in zip(ps, ids)))(ps)
            u, s = tx.update(g, s, ps)
            return js.apply_updates(ps, u), s

        outs = []
        for t in (1, 4):
            with js.kernels.threads(t, min_slots=0):
                p, s = tables, tx.init(tables)
                for _ in range(5):
                    p, s = step(p, s, ids)
                outs.append(np.concatenate([np.asarray(x).ravel() for x in p]))
        assert outs[0].tobytes() == outs[1].tobytes()
        print("ok")
    """
    # Without the 8 forced devices (XLA's pool has a thread per device).
    assert "ok" in _subprocess(code, {"PJRT_NPROC": "1", "XLA_FLAGS": ""})


def test_environment_variable_sets_the_default_and_rejects_nonsense():
    code = """
        import jaxslices as js
        from jaxslices.kernels import _threads
        try:
            print(_threads.thread_setting()[0])
        except ValueError as e:
            print("ValueError:", e)
    """
    assert _subprocess(code, {"JAXSLICES_THREADS": "3"}).strip() == "3"
    out = _subprocess(code, {"JAXSLICES_THREADS": "many"})
    assert "ValueError: JAXSLICES_THREADS='many'" in out
