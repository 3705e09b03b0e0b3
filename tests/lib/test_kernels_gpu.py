"""The Pallas GPU kernels (kernels/_pallas.py) in interpret mode, against XLA.

No GPU is needed: Pallas's interpreter runs the same kernels on the CPU. The
fixture ``interpreted`` lowers the three native ops on the CPU to their
Pallas kernels with ``interpret=True`` (instead of the C++ kernels), so that
whole training steps (every optimizer and chain, padded and jagged bags,
weights, combiners, heavy Zipf duplicates, padding and out-of-range ids,
empty bags and batches, int32 and int64 ids) run on the GPU kernels and are
compared with the same steps on the XLA path (``kernels.disabled()``). The
kernels sum rows in another order than XLA (slot order within an id, then
one add per distinct row), so they agree to float32 rounding: ``TOL``, the
tolerance docs/kernels.md ("GPU kernels") states, the same as the CPU
kernels'. The exports check that a step exported for ``cuda`` inside
``kernels.gpu_kernels()`` carries the kernels and that ``tpu`` is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import registry

import jaxslices as js
from jaxslices import _jax_compat
from jaxslices.kernels import _build, _explain, _ops, _pallas, _path

TOL = {"rtol": 2e-5, "atol": 2e-6}
OPS = (_ops._BAG, _ops._ROWWISE, _ops._APPLY)
# Adagrad's rule, as the kernels are given it (its reference is the one body).
RSS = js.transforms._transform._RSS_SPEC

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="interpret mode on the CPU host"
)


@pytest.fixture
def interpreted(monkeypatch):
    """The native ops lower to their Pallas kernels in interpret mode on the CPU.

    ``_build.load`` answers ``True`` so that the path choice takes the
    native path without the C++ kernels (which are then never called). No
    compiled step outlives the swap: every step here is a new function (a
    new entry of jit's caches), and the ops' own eager caches are dropped on
    the way in and out.
    """
    mlir = _jax_compat.mlir
    monkeypatch.setattr(_build, "load", lambda *a, **k: True)
    for op in OPS:
        op.__dict__.pop("_jitted", None)
        impl = functools.partial(op.gpu, interpret=True)
        mlir.register_lowering(op.prim, _pallas.lower(impl), platform="cpu")
    yield
    for op in OPS:
        mlir.register_lowering(op.prim, op._cpu_lowering, platform="cpu")
        op.__dict__.pop("_jitted", None)


def _assert_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL)


def _zipf(rng, shape, num_rows):
    return ((rng.zipf(1.2, size=shape) - 1) % num_rows).astype(np.int32)


# ----------------------------------------------------- the forward bag


def _bag_case(rng, *, v=24, r=8, b=5, length=4, has_bag, dtype=np.int32):
    n = b * length
    ids = _zipf(rng, n, v + 4) - 2  # -2, -1 and >= v: out of range
    bag = rng.integers(-1, b + 1, size=n) if has_bag else None  # some unused
    return (
        jnp.asarray(rng.normal(size=(v, r)), jnp.float32),
        jnp.asarray(ids.astype(dtype)),
        None if bag is None else jnp.asarray(bag, jnp.int32),
    )


@pytest.mark.parametrize("has_bag", [False, True], ids=["padded", "per_slot"])
@pytest.mark.parametrize("has_weight", [False, True])
@pytest.mark.parametrize("has_scale", [False, True])
def test_bag_forward_equals_reference(has_bag, has_weight, has_scale):
    rng = np.random.default_rng(0)
    b, length = 5, 4
    table, ids, bag = _bag_case(rng, b=b, length=length, has_bag=has_bag)
    weight = jnp.asarray(rng.normal(size=ids.shape), jnp.float32)
    scale = jnp.asarray(rng.normal(size=b), jnp.float32)
    args = (
        table,
        ids,
        _ops._NONE_I32 if bag is None else bag,
        weight if has_weight else _ops._NONE_F32,
        scale if has_scale else _ops._NONE_F32,
    )
    kw = dict(
        has_bag=has_bag,
        has_weight=has_weight,
        has_scale=has_scale,
        length=0 if has_bag else length,
        num_bags=b,
    )
    (ref,) = _ops._bag_reference(*args, **kw)
    (got,) = _pallas.bag_forward(*args, interpret=True, **kw)
    np.testing.assert_allclose(got, ref, **TOL)
    assert np.abs(np.asarray(ref)).max() > 0  # the case pools something


@pytest.mark.parametrize(
    "num_bags, length", [(0, 3), (4, 0), (0, 0)], ids=["no_bags", "no_slots", "none"]
)
def test_bag_forward_empty_bags_and_batches(num_bags, length):
    table = jnp.ones((6, 4))
    ids = jnp.zeros((num_bags * length,), jnp.int32)
    scale = jnp.full((num_bags,), 2.0)
    kw = dict(has_bag=False, has_weight=False, has_scale=True, length=length)
    args = (table, ids, _ops._NONE_I32, _ops._NONE_F32, scale)
    (got,) = _pallas.bag_forward(*args, num_bags=num_bags, interpret=True, **kw)
    (ref,) = _ops._bag_reference(*args, num_bags=num_bags, **kw)
    assert got.shape == ref.shape == (num_bags, 4)
    np.testing.assert_array_equal(got, ref)


def test_bag_forward_nan_weight_on_an_out_of_range_id_is_nan_as_xla():
    table = jnp.ones((4, 2))
    ids = jnp.array([0, 9, 1, 2], jnp.int32)
    weight = jnp.array([1.0, jnp.nan, 1.0, 1.0])
    args = (table, ids, _ops._NONE_I32, weight, _ops._NONE_F32)
    kw = dict(has_bag=False, has_weight=True, has_scale=False, length=2, num_bags=2)
    (got,) = _pallas.bag_forward(*args, interpret=True, **kw)
    (ref,) = _ops._bag_reference(*args, **kw)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert np.isnan(got[0]).all() and np.isfinite(got[1]).all()


# ------------------------------------------------ the apply (SGD's update)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_apply_sums_heavy_duplicates_in_place(dtype):
    rng = np.random.default_rng(1)
    v, r, n = 16, 4, 40
    table = jnp.asarray(rng.normal(size=(v, r)), jnp.float32)
    ids = _zipf(rng, n, v + 3).astype(dtype)
    ids[:3] = [-1, v, v + 2]
    src = jnp.asarray(rng.normal(size=(n, r)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=n), jnp.float32)
    with jax.enable_x64(dtype == np.int64):
        ids = jnp.asarray(ids)
        assert ids.dtype == dtype
        args = (table, src, ids, _ops._NONE_I32, weight, jnp.float32(0.5),
                jnp.uint32(0))  # fmt: skip
        kw = dict(
            has_bag=False, has_weight=True, coalesced=False, length=0, stochastic=False
        )
        (ref,) = _ops._apply_reference(*args, **kw)
        (got,) = jax.jit(
            functools.partial(_pallas.apply, interpret=True, **kw), donate_argnums=0
        )(jnp.copy(table), *args[1:])
    np.testing.assert_allclose(got, ref, **TOL)
    assert int(np.bincount(np.clip(ids, 0, v), minlength=v + 1)[:v].max()) > 5


# ------------------------------------- every optimizer and chain, end to end

#: Every rule and clip of the kernels (tests/registry.py); each is two
#: compiles (GPU kernels, XLA), slow in interpret mode.
OPTIMIZERS = registry.pick(
    "sgd",
    "trace",
    "sgd_nesterov",
    "clip_by_global_norm_adagrad",
    "clip_by_row_norm_tight",
    "clip_lazy_adam",
    "max_distinct_tight",
    "lazy_adam_nesterov",
    "lazy_adamw",
    "ftrl",
    "ftrl_power",
)

# Every rule of the row-wise kernel is run by some optimizer above (decay by
# lazy_adamw, coalesce by clip_by_global_norm, both Nesterov variants of trace
# and adam, both FTRL powers); max_norm by test_apply_max_norm below.
RULES_RUN = {
    "coalesce", "clip", "row_norm", "rss", "rowwise_rss", "adam", "trace",
    "decay", "ftrl",
}  # fmt: skip


def test_every_rule_is_covered():
    assert (
        RULES_RUN | {"max_norm"}
        == {r.name.lower() for r in _ops.SHAPES}
        == {r.name.lower() for r in _ops.Rule}
    )


def _batches(rng, *, v=32, b=6, length=5, steps=2, dtype=np.int32):
    out = []
    for _ in range(steps):
        ids = _zipf(rng, (b, length), v)
        ids[0, 1] = v + 3  # out of range
        ids[1, :] = v  # an empty bag (all padding)
        ids[2, 2] = -2  # negative
        y = jnp.asarray(rng.normal(size=b), jnp.float32)
        out.append((jnp.asarray(ids.astype(dtype)), y))
    return out


def _loss(combiner, weights=None):
    def loss(p, ids, y):
        h = js.embedding_bag(
            p["emb"], ids, combiner=combiner, padding_id=32, weights=weights
        )
        return jnp.mean((h @ p["w"] - y) ** 2)

    return loss


def _train(tx, loss, params, batches, *, xla):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, ids, y):
        updates, s = tx.update(js.grad(loss)(p, ids, y), s, p)
        return js.apply_updates(p, updates), s

    p = jax.tree.map(jnp.copy, params)
    s = tx.init(p)
    for ids, y in batches:
        if xla:
            with js.kernels.disabled():
                p, s = step(p, s, ids, y)
        else:
            p, s = step(p, s, ids, y)
    return p, s


def _params(rng, v=32, r=8):
    return {
        "emb": jnp.asarray(rng.normal(size=(v, r)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=r), jnp.float32),
    }


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_gpu_kernels_equal_xla(name, interpreted):
    rng = np.random.default_rng(2)
    params, batches = _params(rng), _batches(rng)
    tx, loss = OPTIMIZERS[name](), _loss("mean")
    gpu = _train(tx, loss, params, batches, xla=False)
    xla = _train(tx, loss, params, batches, xla=True)
    _assert_close(gpu, xla)
    assert not np.allclose(gpu[0]["emb"], params["emb"])  # the table moved

    # The step ran the kernels: the bag, the rule (unless plain SGD) and the update.
    ids, y = batches[0]
    ops = _native_ops(tx, loss, params, ids, y)
    assert ops[:1] == ["jaxslices_bag_forward"] and ops[-1] == "jaxslices_apply"
    assert name == "sgd" or len(ops) >= 3, ops


def _native_ops(tx, loss, params, *batch):
    def step(p, s, *batch):
        u, s = tx.update(js.grad(loss)(p, *batch), s, p)
        return js.apply_updates(p, u), s

    jaxpr = jax.make_jaxpr(step)(params, tx.init(params), *batch)
    names = [e.primitive.name for e in _explain._walk(jaxpr.jaxpr)]
    return [n for n in names if n in {op.name for op in OPS}]


def test_weights_sqrtn_and_int64_ids(interpreted):
    rng = np.random.default_rng(3)
    params = _params(rng)
    weights = jnp.asarray(rng.uniform(0.1, 2.0, size=(6, 5)), jnp.float32)
    tx, loss = js.lazy_adam(0.01), _loss("sqrtn", weights)
    with jax.enable_x64(True):
        batches = _batches(rng, dtype=np.int64)
        gpu = _train(tx, loss, params, batches, xla=False)
        xla = _train(tx, loss, params, batches, xla=True)
    _assert_close(gpu, xla)


@pytest.mark.parametrize("name", ["clip_by_global_norm_adagrad", "ftrl"])
def test_nan_and_inf_where_xla_puts_them(name, interpreted):
    """NaN, +inf, -inf and 0 * inf in the weights: the same places on both."""
    rng = np.random.default_rng(9)
    params, batches = _params(rng), _batches(rng, steps=1)
    weights = np.ones((6, 5), np.float32)
    weights[3, 0], weights[4, 1], weights[5, 2] = np.nan, np.inf, -np.inf
    weights[0, 1] = np.inf  # on an out-of-range id: 0 * inf
    tx, loss = OPTIMIZERS[name](), _loss("sum", jnp.asarray(weights))
    gpu = _train(tx, loss, params, batches, xla=False)
    xla = _train(tx, loss, params, batches, xla=True)
    emb = np.asarray(gpu[0]["emb"])
    assert np.isnan(emb).any() and np.isfinite(emb).any()
    _assert_close(gpu, xla)  # NaN and inf at the same places (same signs)


def test_jagged_bags(interpreted):
    rng = np.random.default_rng(4)
    params = _params(rng)
    lists = [[1, 1, 7], [], [3], [31, 1, 1, 1], [45]]  # 45: out of range

    def loss(p, bags, y):
        h = js.embedding_bag(p["emb"], bags, combiner="sqrtn")
        return jnp.mean((h @ p["w"] - y) ** 2)

    tx = js.adagrad(0.1)
    bags = js.JaggedIds.from_lists(lists, max_total=12)
    batches = [(bags, jnp.arange(5.0))] * 2
    gpu = _train(tx, loss, params, batches, xla=False)
    xla = _train(tx, loss, params, batches, xla=True)
    _assert_close(gpu, xla)


def test_empty_batches_change_nothing():
    """No slots (``N = 0``): no row summed, the state and the table as they were."""
    table, state = jnp.ones((8, 4)), jnp.full((8, 4), 2.0)
    ids, src = jnp.zeros((0,), jnp.int32), jnp.ones((3, 4))
    recipe = (_ops._NONE_I32, _ops._NONE_F32, jnp.float32(1.0))
    new_state, uids, rows, count, sumsq = _pallas.rowwise(
        src, ids, *recipe, jnp.array([1e-7]), _ops._NONE_F32, state,
        spec=RSS, has_bag=False, has_weight=False, length=0,
        num_rows=8, capacity=0, interpret=True,
    )  # fmt: skip
    assert new_state is state and uids.shape == (0,) and rows.shape == (0, 4)
    assert int(count) == 0 and float(sumsq) == 0.0
    (out,) = _pallas.apply(
        table, src, ids, *recipe, has_bag=False, has_weight=False, length=0,
        interpret=True,
    )  # fmt: skip
    assert out is table


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
def test_apply_max_norm(norm_type, interpreted):
    rng = np.random.default_rng(5)
    table = jnp.asarray(rng.normal(size=(30, 4)) * 2, jnp.float32)
    ids = jnp.asarray([[1, 1, 5], [7, 33, -1], [5, 0, 0]])
    step = jax.jit(
        functools.partial(js.apply_max_norm, max_norm=1.5, norm_type=norm_type)
    )
    gpu = step(table, ids)
    with js.kernels.disabled():
        xla = step(table, ids)
    np.testing.assert_allclose(gpu, xla, **TOL)
    assert not np.allclose(gpu, table)


def test_over_capacity_changes_nothing_and_counts():
    """More distinct ids than ``capacity``: the count says so, no state moves."""
    state = jnp.ones((8, 4))
    ids = jnp.array([1, 2, 3, 3], jnp.int32)
    src = jnp.ones((4, 4))
    out = _pallas.rowwise(
        src, ids, _ops._NONE_I32, _ops._NONE_F32, jnp.float32(1.0),
        jnp.array([1e-7]), _ops._NONE_F32, state, spec=RSS,
        has_bag=False, has_weight=False, length=0, num_rows=8, capacity=2,
        interpret=True,
    )  # fmt: skip
    new_state, uids, rows, count, sumsq = out
    assert int(count) == 3
    np.testing.assert_array_equal(new_state, state)
    np.testing.assert_array_equal(uids, [8, 8])
    assert float(sumsq) == 0.0 and not np.asarray(rows).any()


def test_a_wrong_state_is_refused_with_what_was_given():
    with pytest.raises(ValueError, match=r"rule rss needs a state of 8 rows of 4"):
        _pallas.rowwise(
            jnp.ones((2, 4)), jnp.array([1, 2]), _ops._NONE_I32, _ops._NONE_F32,
            jnp.float32(1.0), jnp.array([1e-7]), _ops._NONE_F32, jnp.ones((8, 2)),
            spec=RSS, has_bag=False, has_weight=False, length=0,
            num_rows=8, capacity=2, interpret=True,
        )  # fmt: skip


def test_tolerance_is_needed_and_met():
    """Other sums than XLA's: the bits differ, never past ``TOL``.

    The update adds each id's summed rows once; XLA's scatter-add adds each
    slot's row in turn.
    """
    rng = np.random.default_rng(6)
    v, r, n = 4, 16, 100
    table = jnp.asarray(rng.normal(size=(v, r)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, size=n), jnp.int32)
    src = jnp.asarray(rng.normal(size=(n, r)), jnp.float32)
    args = (table, src, ids, _ops._NONE_I32, _ops._NONE_F32, jnp.float32(1.0),
            jnp.uint32(0))  # fmt: skip
    kw = dict(
        has_bag=False, has_weight=False, coalesced=False, length=0, stochastic=False
    )
    (ref,) = _ops._apply_reference(*args, **kw)
    (got,) = _pallas.apply(*args, interpret=True, **kw)
    np.testing.assert_allclose(got, ref, **TOL)
    assert (np.asarray(got) != np.asarray(ref)).any()


# ------------------------------------------------------- path and explain


def test_the_gpu_path_is_opt_in(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    table = jnp.ones((8, 4))
    assert "opt-in" in _path.decide(table)
    with js.kernels.gpu_kernels():
        assert _path.decide(table) == ""
        why = _path.decide(jnp.ones((8, 3)))
        assert "power-of-two" in why
        assert "no GPU kernel" in _path.decide(table, gpu=False)  # the remap
        with js.kernels.disabled():
            assert "off" in _path.decide(table)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with js.kernels.gpu_kernels():
        assert "tpu" in _path.decide(table)


# ---------------------------------------------------------------- exports


def _export(step, args, platform, monkeypatch):
    monkeypatch.setattr(_build, "load", lambda *a, **k: True)
    check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with _jax_compat.gpu_target():
        exported = jax.export.export(
            jax.jit(step), platforms=(platform,), disabled_checks=[check]
        )(*args)
    return exported.mlir_module()


def _step_and_args(tx=None, loss=None, seed=7):
    tx = js.lazy_adam(0.01) if tx is None else tx
    loss = _loss("mean") if loss is None else loss
    rng = np.random.default_rng(seed)
    params = _params(rng)
    ids, y = _batches(rng, steps=1)[0]

    def step(p, s, ids, y):
        u, s = tx.update(js.grad(loss)(p, ids, y), s, p)
        return js.apply_updates(p, u), s

    return step, (params, tx.init(params), ids, y)


TRITON = re.compile(r'__gpu\$xla\.gpu\.triton.*?name = "(jaxslices_gpu_\w+)"')


def test_cuda_export_carries_the_gpu_kernels_when_opted_in(monkeypatch):
    step, args = _step_and_args()
    with js.kernels.gpu_kernels():
        text = _export(step, args, "cuda", monkeypatch)
    names = set(TRITON.findall(text))
    assert names == {
        "jaxslices_gpu_bag_forward",
        "jaxslices_gpu_rowwise_adam",
        "jaxslices_gpu_apply",
    }, names
    assert len(_explain._GPU_CALL.findall(text)) == 3  # what explain counts
    # By default (not opted in), no kernel: the XLA path.
    assert "xla.gpu.triton" not in _export(step, args, "cuda", monkeypatch)


def test_every_kernel_lowers_to_triton(monkeypatch):
    """Every rule's kernel, the bag and the update lower for ``cuda``.

    (Lowering is what a host without a GPU can check of the GPU code: an
    operation Triton lacks would fail here.) One chain of every rule, with
    weighted bags and a row-wise state; ``max_norm`` apart.
    """
    tx = optax.chain(
        js.clip_by_global_norm(1.0),
        js.clip_by_row_norm(1.0),
        js.clip(1.0),
        js.trace(0.5),
        js.trace(0.5, nesterov=True),
        js.scale_by_rss(),
        js.scale_by_rowwise_rss(),
        js.scale_by_lazy_adam(nesterov=True),
        js.add_decayed_weights(0.1),
        js.ftrl(0.1),
        js.ftrl(0.1, learning_rate_power=-0.3),
    )
    step, args = _step_and_args(tx, _loss("sqrtn", jnp.ones((6, 5))), seed=8)
    renorm = functools.partial(js.apply_max_norm, max_norm=1.0, norm_type=3.0)
    with js.kernels.gpu_kernels():
        text = _export(step, args, "cuda", monkeypatch)
        text += _export(renorm, (args[0]["emb"], args[2]), "cuda", monkeypatch)
    rules = {f"jaxslices_gpu_rowwise_{r.name.lower()}" for r in _ops.Rule}
    assert set(TRITON.findall(text)) == {
        "jaxslices_gpu_bag_forward",
        "jaxslices_gpu_apply",
        *rules,
    }


def test_tpu_export_is_unchanged(monkeypatch):
    step, args = _step_and_args()
    default = _export(step, args, "tpu", monkeypatch)
    with js.kernels.gpu_kernels():
        opted = _export(step, args, "tpu", monkeypatch)
    for text in (default, opted):
        assert "triton" not in text and "@jaxslices_" not in text
        assert "custom_call @tpu_custom_call" not in text
    ops = functools.partial(re.findall, r"\b(?:stablehlo|func|chlo|sdy)\.\w+")
    assert ops(default) == ops(opted) and len(ops(default)) > 50


def test_without_pallas_the_ops_lower_to_xla_and_route_says_why(monkeypatch):
    """The ``pallas_gpu`` entry of ``_jax_compat`` taken away: its fallback."""
    step, args = _step_and_args()
    monkeypatch.setitem(_jax_compat.AVAILABLE, "pallas_gpu", False)
    with js.kernels.gpu_kernels():
        text = _export(step, args, "cuda", monkeypatch)
        assert "@jaxslices_" not in text and "triton" not in text
        assert "jaxslices_rowwise" in text  # the ops, lowered as their references
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        why = _path.decide(jnp.ones((8, 4)))
    assert "lacks Pallas's GPU backend" in why
    assert isinstance(_jax_compat.gpu_target(), contextlib.nullcontext)
