"""Empty and all-padding gradients touch nothing, for every optimizer and wrapper.

A batch in which a table gets no ids gives it an ``IndexedSlices`` with zero
rows (a feature absent from the batch) or with only padding slots (every id
out of range or marked as padding). Such a step must change neither the table
nor the optimizer state of any table row, eagerly and under ``jit``: the
matrix below runs every optimizer of the library on both kinds, in several
row shapes and dtypes (hypothesis draws them), so a change of the state
layout cannot break them again (the packed row-major state once did:
``reshape(0, -1)`` raised).
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import registry
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxslices as js

V = 6

OPTIMIZERS = registry.pick(
    "sgd",
    "sgd_momentum",
    "sgd_nesterov",
    "adagrad",
    "rowwise_adagrad",
    "lazy_adam",
    "lazy_adamw",
    "ftrl",
    "clip_by_global_norm_adagrad",
    "clip_by_row_norm",
    "clip_lazy_adam",
    "add_decayed_weights",
    "lazy_adam_max_distinct",
    "multi_steps",
    "multi_steps_k2",
    "js_apply_if_finite",
    "inject_hyperparams",
)


def _empty_grad(kind, row_shape, dtype, n):
    shape = (V, *row_shape)
    if kind == "empty":
        return js.IndexedSlices(
            jnp.zeros((0, *row_shape), dtype), jnp.zeros((0,), jnp.int32), shape
        )
    ids = np.full((n,), V, np.int32)  # padding
    ids[::2] = -1  # and invalid ids: also nothing
    return js.IndexedSlices(jnp.zeros((n, *row_shape), dtype), jnp.asarray(ids), shape)


def _leaves(tree):
    out = []
    for x in jax.tree.leaves(tree, is_leaf=js.is_indexed_slices):
        if isinstance(x, js.IndexedSlices):  # MultiSteps' buffers
            out += [np.asarray(x.values), np.asarray(x.indices)]
        else:
            out.append(np.asarray(x))
    return out


def _check_untouched(name, kind, row_shape, dtype, n, jit):
    tx = OPTIMIZERS[name]()
    rng = np.random.default_rng(0)
    params = {"emb": jnp.asarray(rng.normal(size=(V, *row_shape)), dtype)}
    state = tx.init(params)
    step = harness.jitted_step(tx) if jit else harness.step_function(tx)
    g = _empty_grad(kind, row_shape, dtype, n)
    new_params, new_state = step(params, state, {"emb": g})
    np.testing.assert_array_equal(new_params["emb"], params["emb"])
    # Every state array with the table's rows keeps them bit for bit (step
    # counters move, as they do for a dense zero gradient).
    for old, new in zip(_leaves(state), _leaves(new_state), strict=True):
        if old.ndim >= 1 and old.shape[0] == V:
            np.testing.assert_array_equal(new, old)


# Every optimizer under jit; op by op, one smoke case per kind.
@pytest.mark.parametrize(
    "name, kind, jit",
    [
        *((n, k, True) for n in OPTIMIZERS for k in ("empty", "padding")),
        ("multi_steps_k2", "empty", False),
        ("clip_by_global_norm_adagrad", "padding", False),
    ],
)
def test_empty_and_all_padding_gradients_touch_nothing(name, kind, jit):
    _check_untouched(name, kind, (3,), jnp.float32, 4, jit)


@settings(max_examples=15, deadline=None)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    kind=st.sampled_from(["empty", "padding"]),
    row_shape=st.sampled_from([(), (1,), (3,), (2, 3)]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
)
def test_property_empty_batches_in_every_optimizer(name, kind, row_shape, dtype):
    # Four slots (lengths not drawn): each program is the harness's, compiled once.
    _check_untouched(name, kind, row_shape, dtype, 4, jit=True)


def test_an_empty_gradient_from_value_and_grad_trains_nothing():
    """The whole path: a batch whose bags are all padding, then every optimizer."""

    def loss(params, ids):
        h = js.embedding_bag(params["emb"], ids, padding_id=V)
        return jnp.sum(h**2)

    params = {"emb": jnp.ones((V, 3))}
    for shape in [(2, 3), (0, 3)]:  # all padding; no bag at all
        ids = jnp.full(shape, V, jnp.int32)
        for name in OPTIMIZERS:
            tx = OPTIMIZERS[name]()

            @jax.jit
            def step(params, state, ids, tx=tx):
                grads = js.grad(loss)(params, ids)
                updates, state = tx.update(grads, state, params)
                return js.apply_updates(params, updates), state

            new, _ = step(params, tx.init(params), ids)
            np.testing.assert_array_equal(new["emb"], params["emb"], err_msg=name)


def test_a_collection_step_with_an_absent_feature_trains_nothing_there():
    coll = js.EmbeddingCollection(
        [js.TableConfig("a", V, 2), js.TableConfig("b", V, 2)]
    )
    params = coll.init(jax.random.key(0))
    batch = js.KeyedJaggedIds.from_lists({"a": [[1, 2]], "b": [[]]}, max_total=4)

    def loss(params):
        out = coll(params, batch)
        return jnp.sum(out["a"] ** 2) + jnp.sum(out["b"] ** 2)

    for name in OPTIMIZERS:
        tx = OPTIMIZERS[name]()

        @jax.jit
        def step(params, state, tx=tx):
            updates, state = tx.update(js.grad(loss)(params), state, params)
            return js.apply_updates(params, updates), state

        new, _ = step(params, tx.init(params))
        key, base = coll.placement("b")
        before, after = np.asarray(params[key]), np.asarray(new[key])
        # Table b got no ids: none of its rows moves; nor does a's untouched row 0.
        np.testing.assert_array_equal(
            after[base : base + V], before[base : base + V], err_msg=name
        )
        a_key, a_base = coll.placement("a")
        np.testing.assert_array_equal(
            np.asarray(new[a_key])[a_base], np.asarray(params[a_key])[a_base]
        )
