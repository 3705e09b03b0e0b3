"""Checkpoints: params and every optimizer state jaxslices creates, bit for bit.

For each optimizer (every jaxslices transform, the Optax wrappers around them,
``jaxslices.MultiSteps`` in the middle of an accumulation, so that its buffer
holds ``IndexedSlices`` with repeated ids and padding) a few steps are run,
the ``(params, opt_state)`` pair is saved and restored with Orbax
(``StandardCheckpointer`` into the live state and into an abstract target from
``jax.eval_shape``, ``CheckpointManager`` with ``StandardSave`` /
``StandardRestore``), Flax msgpack and pickle, and checked:

* the same tree structure, every leaf bit for bit (typed indices compared by
  their words);
* training resumed from the restored state equals the uninterrupted run, bit
  for bit.

A fresh Python process restores the Orbax, msgpack and pickle files written
here (nothing registered by hand). Saving through ``np.asarray`` of every leaf
fails at save time with an error naming ``IndexedSlices``.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization

import jaxslices as js
from jaxslices import IndexedSlices, _typed_indices

ROOT = Path(__file__).resolve().parents[2]
V, D = 16, 3


def _sched(step):
    return 0.1 / (1.0 + step)


OPTIMIZERS = {
    "sgd": lambda: js.sgd(0.1),
    "sgd_momentum": lambda: js.sgd(0.1, momentum=0.9),
    "sgd_nesterov_schedule": lambda: js.sgd(_sched, momentum=0.9, nesterov=True),
    "adagrad": lambda: js.adagrad(0.1),
    "rowwise_adagrad": lambda: js.rowwise_adagrad(0.1),
    "lazy_adam": lambda: js.lazy_adam(0.01),
    "lazy_adamw": lambda: js.lazy_adamw(0.01, weight_decay=0.1),
    "ftrl": lambda: js.ftrl(0.1),
    "clip_chain": lambda: optax.chain(
        js.clip_by_global_norm(1.0),
        js.clip(0.5),
        js.clip_by_row_norm(0.7),
        js.add_decayed_weights(0.01),
        js.scale_by_rss(),
        js.scale_by_schedule(_sched),
        js.trace(0.9),
        js.scale(-1.0),
    ),
    "densify_lazy_adam": lambda: optax.chain(
        js.densify(), js.scale_by_lazy_adam(), js.scale_by_learning_rate(0.01)
    ),
    "apply_if_finite": lambda: js.apply_if_finite(js.adagrad(0.1), 3),
    "inject_hyperparams": lambda: optax.inject_hyperparams(js.sgd)(
        learning_rate=0.1, momentum=0.5
    ),
    "multi_transform": lambda: optax.multi_transform(
        {"sparse": js.lazy_adam(0.01), "dense": optax.adam(0.01)},
        {"emb": "sparse", "w": "dense"},
    ),
    "multisteps": lambda: js.MultiSteps(
        js.lazy_adam(0.01), every_k_schedule=3, capacity={"emb": 8, "w": None}
    ),
    "multisteps_coalescing": lambda: js.MultiSteps(
        js.adagrad(0.1), every_k_schedule=3, capacity={"emb": 12, "w": None}
    ),
}


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "emb": jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(D,)), jnp.float32),
    }


def make_batches(steps, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = rng.integers(0, V // 2, size=(4, 2)).astype(np.int32)
        ids[0, 1] = ids[0, 0]  # a repeat
        ids[3, 1] = V + 2  # out of range: a padding slot in the gradient
        out.append((jnp.asarray(ids), jnp.asarray(rng.normal(size=4), jnp.float32)))
    return out


def loss_fn(params, ids, y):
    h = js.embedding_lookup(params["emb"], ids).sum(1)
    return jnp.mean((jnp.tanh(h) @ params["w"] - y) ** 2)


@functools.cache  # one compiled step per transformation (tests reuse it)
def make_step(tx):
    @jax.jit
    def step(params, state, ids, y):
        _, grads = js.value_and_grad(loss_fn)(params, ids, y)
        updates, state = tx.update(grads, state, params)
        return js.apply_updates(params, updates), state

    return step


def train(tx, params, state, batches):
    step = make_step(tx)
    for ids, y in batches:
        params, state = step(params, state, ids, y)
    return params, state


def bits(tree):
    """Every leaf as NumPy bytes (typed indices by their words) and the treedef."""

    def leaf(x):
        if _typed_indices.is_typed(x):
            x = jax.random.key_data(x)
        x = np.asarray(x)
        return (x.dtype.str, x.shape, x.tobytes())

    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [leaf(x) for x in leaves]


def assert_bitwise_equal(a, b):
    ta, la = bits(a)
    tb, lb = bits(b)
    assert ta == tb, f"tree structure differs:\n{ta}\n{tb}"
    assert la == lb


@functools.cache  # the same run for every format's test (arrays are immutable)
def trained_state(name, steps=4):
    tx = OPTIMIZERS[name]()
    params = make_params()
    batches = make_batches(steps + 3)
    # 4 steps: MultiSteps (k=3) is one micro-step into an accumulation.
    params, state = train(tx, params, tx.init(params), batches[:steps])
    return tx, (params, state), batches[steps:]


def has_slices(tree):
    return any(
        isinstance(x, IndexedSlices)
        for x in jax.tree.leaves(tree, is_leaf=js.is_indexed_slices)
    )


def test_multisteps_state_holds_slices_mid_accumulation():
    _, (_, state), _ = trained_state("multisteps")
    assert has_slices(state)
    buf = state.acc_grads["emb"]
    assert int(state.acc_fill["emb"]) == 8  # one micro-batch: 8 slots
    assert int(buf.indices[-1]) == V  # unused slots are padding


def _resumes_equal(tx, saved, restored, rest):
    expect = train(tx, *saved, rest)
    got = train(tx, *restored, rest)
    assert_bitwise_equal(got, expect)


# ------------------------------------------------------------------ Orbax


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_orbax_standard_checkpointer(tmp_path, name):
    tx, saved, rest = trained_state(name)
    ckptr = ocp.StandardCheckpointer()
    path = tmp_path / "ckpt"
    ckptr.save(path, saved)
    ckptr.wait_until_finished()
    live = ckptr.restore(path, saved)
    abstract = ckptr.restore(path, jax.eval_shape(lambda: saved))
    ckptr.close()
    for restored in (live, abstract):
        assert_bitwise_equal(restored, saved)
    _resumes_equal(tx, saved, abstract, rest)


@pytest.mark.parametrize("name", ["multisteps", "lazy_adam", "multi_transform"])
def test_orbax_checkpoint_manager(tmp_path, name):
    tx, saved, rest = trained_state(name)
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(tmp_path / "run", options=options) as mngr:
        mngr.save(4, args=ocp.args.StandardSave(saved))
        mngr.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "run", options=options) as mngr:
        assert mngr.latest_step() == 4
        abstract = jax.eval_shape(lambda: saved)
        restored = mngr.restore(4, args=ocp.args.StandardRestore(abstract))
    assert_bitwise_equal(restored, saved)
    _resumes_equal(tx, saved, restored, rest)


def test_orbax_restore_without_target_gives_the_ids(tmp_path):
    _, saved, _ = trained_state("multisteps")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "c", saved)
    ckptr.wait_until_finished()
    raw = ckptr.restore(tmp_path / "c")  # no target: nested dicts
    ckptr.close()
    buf = saved[1].acc_grads["emb"]
    got = raw[1]["acc_grads"]["emb"]
    assert _typed_indices.is_typed(got["indices"])
    rebuilt = IndexedSlices(got["values"], got["indices"], buf.dense_shape)
    assert_bitwise_equal(rebuilt, buf)


# ------------------------------------------------------- msgpack and pickle


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_flax_msgpack(name):
    tx, saved, rest = trained_state(name)
    data = serialization.to_bytes(saved)
    target = train(tx, make_params(seed=5), tx.init(make_params(seed=5)), rest[:1])
    restored = serialization.from_bytes(target, data)
    assert_bitwise_equal(restored, saved)
    _resumes_equal(tx, saved, restored, rest)


def test_flax_state_dict_of_slices_is_values_and_ids():
    s = IndexedSlices(jnp.ones((3, 2)), jnp.array([4, 1, 4]), (5, 2))
    d = serialization.to_state_dict({"g": s})["g"]
    assert set(d) == {"values", "indices"}
    np.testing.assert_array_equal(d["indices"], [4, 1, 4])
    with pytest.raises(ValueError, match=r"IndexedSlices\(5, 2\)(.|\n)*target"):
        serialization.from_state_dict({"g": s}, {"g": np.zeros(3)})


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_pickle(name):
    tx, saved, rest = trained_state(name)
    restored = pickle.loads(pickle.dumps(saved))
    assert_bitwise_equal(restored, saved)
    _resumes_equal(tx, saved, restored, rest)


def test_pickle_keeps_coalesced_flags_and_negative_ids():
    s = IndexedSlices(jnp.ones(4), jnp.array([3, -2, 3, 9]), (5,))
    for t in (s, js.coalesce(s)):
        for u in (pickle.loads(pickle.dumps(t)), copy.deepcopy(t)):
            assert_bitwise_equal(u, t)
            assert (u.unique_indices, u.indices_sorted) == (
                t.unique_indices,
                t.indices_sorted,
            )


#: Made by the flat layout (commit b939c6b, JAX 0.10.2), whose classes lived in
#: modules that have moved (``jaxslices._transform``, ``jaxslices._alias``,
#: ``jaxslices.accumulate``): ``{name: (params, opt_state)}`` of
#: ``trained_state(name)`` for every optimizer above, written with
#: ``pickle.dump`` by that commit's own ``tests/test_checkpoint.py``:
#:
#:   git archive b939c6b jaxslices tests | tar -x -C /tmp/old
#:   cd /tmp/old && PYTHONPATH=/tmp/old python -c "import pickle, sys; \
#:     sys.path.insert(0, 'tests'); import test_checkpoint as t; \
#:     pickle.dump({n: t.trained_state(n)[1] for n in t.OPTIMIZERS}, \
#:                 open('old_layout_states.pkl', 'wb'))"
OLD_LAYOUT_PICKLE = Path(__file__).parent / "data" / "old_layout_states.pkl"


def test_pickles_of_the_old_layout_load():
    with OLD_LAYOUT_PICKLE.open("rb") as f:
        old = pickle.load(f)
    assert set(old) == set(OPTIMIZERS)
    params = make_params()
    for name, saved in old.items():
        tx = OPTIMIZERS[name]()
        # The same classes as now (a tree structure compares node types) and
        # the same shapes and dtypes.
        now = jax.eval_shape(lambda tx=tx: (params, tx.init(params)))
        got = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), saved)
        assert jax.tree.structure(got) == jax.tree.structure(now), name
        assert jax.tree.leaves(got) == jax.tree.leaves(now), name
    assert type(old["ftrl"][1]) is js.FtrlState
    assert type(old["multisteps"][1]) is js.MultiStepsState
    assert has_slices(old["multisteps"][1])
    # Indistinguishable from a state of this layout (test_pickle resumes those),
    # and saved again under the new module paths, bit for bit.
    assert_bitwise_equal(pickle.loads(pickle.dumps(old)), old)


# --------------------------------------------------------- fresh process


_FRESH = """
import json, pickle, sys
import jax, numpy as np, orbax.checkpoint as ocp
from flax import serialization
sys.path.insert(0, {tests!r})
import test_checkpoint as tc   # defines the model; imports jaxslices

tmp = {tmp!r}
tx, saved, rest = tc.trained_state("multisteps")
out = {{}}
ck = ocp.StandardCheckpointer()
out["orbax"] = ck.restore(tmp + "/orbax", jax.eval_shape(lambda: saved))
ck.close()
with open(tmp + "/state.msgpack", "rb") as f:
    out["msgpack"] = serialization.from_bytes(saved, f.read())
with open(tmp + "/state.pkl", "rb") as f:
    out["pickle"] = pickle.load(f)
ref = np.load(tmp + "/ids.npy")
res = {{}}
for k, v in out.items():
    buf = v[1].acc_grads["emb"]
    res[k] = bool(np.array_equal(np.asarray(buf.indices), ref))
    params = tc.train(tx, *v, rest)[0]
    res[k + "_resume"] = params["emb"].tobytes().hex()
print(json.dumps(res))
"""


def test_restore_in_a_fresh_process(tmp_path):
    tx, saved, rest = trained_state("multisteps")
    ck = ocp.StandardCheckpointer()
    ck.save(tmp_path / "orbax", saved)
    ck.wait_until_finished()
    ck.close()
    (tmp_path / "state.msgpack").write_bytes(serialization.to_bytes(saved))
    (tmp_path / "state.pkl").write_bytes(pickle.dumps(saved))
    np.save(tmp_path / "ids.npy", np.asarray(saved[1].acc_grads["emb"].indices))
    code = _FRESH.format(tests=str(ROOT / "tests" / "lib"), tmp=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    res = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    expect = train(tx, *saved, rest)[0]["emb"].tobytes().hex()
    for k in ("orbax", "msgpack", "pickle"):
        assert res[k], k
        assert res[k + "_resume"] == expect, k


# ------------------------------------------------- unsupported forms


def test_saving_leaves_through_numpy_fails_at_save_time(tmp_path):
    _, saved, _ = trained_state("multisteps")
    with pytest.raises(TypeError, match="IndexedSlices"):
        np.savez(tmp_path / "x.npz", *jax.tree.leaves(saved))


def test_typed_indices_names_are_registered_with_jax():
    assert _typed_indices.NAMES_REGISTERED
    s = IndexedSlices(jnp.ones(2), jnp.array([0, 1]), (2,))
    name = jax.random.key_impl(s._indices)
    assert name == "jaxslices_indices_int32"
    rebuilt = jax.random.wrap_key_data(jax.random.key_data(s._indices), impl=name)
    assert rebuilt.dtype == s._indices.dtype


@pytest.mark.parametrize("flax_first", [False, True])
def test_flax_registration_needs_nothing_and_does_not_import_flax(flax_first):
    code = (
        ("from flax import serialization\n" if flax_first else "")
        + "import sys\nimport jaxslices as js\n"
        + ("" if flax_first else "assert 'flax' not in sys.modules\n")
        + "import jax.numpy as jnp\nfrom flax import serialization\n"
        "s = js.IndexedSlices(jnp.ones((2, 1)), jnp.array([3, 0]), (4, 1))\n"
        "back = serialization.from_bytes(s, serialization.to_bytes(s))\n"
        "assert back.indices.tolist() == [3, 0] and back.dense_shape == (4, 1)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, timeout=300
    )
    assert proc.returncode == 0 and b"ok" in proc.stdout, proc.stderr.decode()[-3000:]
