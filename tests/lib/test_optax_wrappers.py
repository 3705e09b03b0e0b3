"""Optax wrappers around every jaxslices transform and chain.

Each case wraps a jaxslices optimizer in ``optax.chain``, ``optax.masked``
(tree and callable masks), ``optax.multi_transform``,
``optax.inject_hyperparams``, ``optax.apply_if_finite`` or
``jaxslices.apply_if_finite``, alone and nested, runs a few jitted steps on
gradient trees holding ``IndexedSlices`` (repeated ids, padding) and compares
the parameters with a reference computed without the wrapper: the unwrapped
optimizer on the leaves the wrapper routes to it, the wrapper's documented
behaviour (identity, Optax Adam) elsewhere. The unwrapped optimizers are
checked against Optax and NumPy in ``test_transforms.py``; exact ones are
also checked here against the dense Optax reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxslices as js
from jaxslices import IndexedSlices

V, D = 8, 2


def make_params(rng):
    return {
        "emb": jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    }


def make_grads(rng, steps=3):
    out = []
    for _ in range(steps):
        idx = rng.integers(0, V // 2, size=6).astype(np.int32)
        idx[1], idx[4] = idx[0], V  # a duplicate, a padding slot
        vals = rng.normal(size=(6, D)).astype(np.float32)
        vals[4] = 0.0
        out.append(
            {
                "emb": IndexedSlices(jnp.asarray(vals), jnp.asarray(idx), (V, D)),
                "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
            }
        )
    return out


def with_nan(g):
    bad = dict(g)
    s = g["emb"]
    bad["emb"] = IndexedSlices(s.values.at[0, 0].set(jnp.nan), s.indices, s.dense_shape)
    return bad


def run(tx, params, grads):
    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return js.apply_updates(p, u), s

    state = tx.init(params)
    for g in grads:
        params, state = step(params, state, g)
    return params, state


def sub(tree, keys):
    return {k: tree[k] for k in keys}


def clip_sgd(max_norm, learning_rate):
    return optax.chain(js.clip_by_global_norm(max_norm), js.sgd(learning_rate))


def clip_value_sgd(max_delta, learning_rate):
    return optax.chain(js.clip(max_delta), js.sgd(learning_rate))


def row_norm_sgd(max_norm, learning_rate):
    return optax.chain(js.clip_by_row_norm(max_norm), js.sgd(learning_rate))


def decay_sgd(weight_decay, learning_rate):
    return optax.chain(js.add_decayed_weights(weight_decay), js.sgd(learning_rate))


def densify_adam(learning_rate):
    return optax.chain(js.densify(), js.lazy_adam(learning_rate))


def clip_adam(max_norm, learning_rate):
    return optax.chain(js.clip_by_global_norm(max_norm), js.lazy_adam(learning_rate))


# name -> (factory, hyperparameters, Optax factory with the same dense maths
# on dense gradients, or None where sparse is lazy)
OPTIMIZERS = {
    "sgd": (js.sgd, dict(learning_rate=0.1), optax.sgd),
    "sgd_momentum": (js.sgd, dict(learning_rate=0.1, momentum=0.9), None),
    "scale": (js.scale, dict(step_size=-0.1), optax.scale),
    "clip_by_global_norm+sgd": (
        clip_sgd,
        dict(max_norm=0.5, learning_rate=0.1),
        lambda max_norm, learning_rate: optax.chain(
            optax.clip_by_global_norm(max_norm), optax.sgd(learning_rate)
        ),
    ),
    "clip+sgd": (
        clip_value_sgd,
        dict(max_delta=0.3, learning_rate=0.1),
        lambda max_delta, learning_rate: optax.chain(
            optax.clip(max_delta), optax.sgd(learning_rate)
        ),
    ),
    "clip_by_row_norm+sgd": (row_norm_sgd, dict(max_norm=0.5, learning_rate=0.1), None),
    "add_decayed_weights+sgd": (
        decay_sgd,
        dict(weight_decay=0.1, learning_rate=0.1),
        None,
    ),
    "adagrad": (js.adagrad, dict(learning_rate=0.1), optax.adagrad),
    "rowwise_adagrad": (js.rowwise_adagrad, dict(learning_rate=0.1), None),
    "lazy_adam": (js.lazy_adam, dict(learning_rate=0.05), None),
    "lazy_adamw": (js.lazy_adamw, dict(learning_rate=0.05, weight_decay=0.1), None),
    "ftrl": (js.ftrl, dict(learning_rate=0.1, l1=0.01), None),
    "clip_by_global_norm+lazy_adam": (
        clip_adam,
        dict(max_norm=0.5, learning_rate=0.05),
        None,
    ),
    "densify+lazy_adam": (
        densify_adam,
        dict(learning_rate=0.05),
        lambda learning_rate: optax.adam(learning_rate),
    ),
}

TABLE_KEYS, DENSE_KEYS = ("emb",), ("b",)


def is_table(tree):
    """A callable mask: must treat IndexedSlices as one leaf (docs/optax.md)."""
    return jax.tree.map(lambda x: x.ndim == 2, tree, is_leaf=js.is_indexed_slices)


def _wrapped(kind, factory, hp):
    """(wrapped optimizer, reference kind, whether a NaN step is skipped)."""
    tx = factory(**hp)
    mask = {"emb": True, "b": False}
    labels = {"emb": "sparse", "b": "dense"}
    if kind == "chain":
        return optax.chain(optax.identity(), tx, optax.identity()), "plain"
    if kind == "masked":
        return optax.masked(tx, mask), "masked"
    if kind == "masked_callable":
        return optax.masked(tx, is_table), "masked"
    if kind == "multi_transform":
        return optax.multi_transform(
            {"sparse": tx, "dense": optax.adam(0.1)}, labels
        ), "multi"
    if kind == "inject_hyperparams":
        return optax.inject_hyperparams(factory)(**hp), "plain"
    if kind == "optax.apply_if_finite":
        return optax.apply_if_finite(tx, 2), "finite"
    if kind == "jaxslices.apply_if_finite":
        return js.apply_if_finite(tx, 2), "finite"
    if kind == "apply_if_finite(masked(inject_hyperparams))":
        inner = optax.masked(optax.inject_hyperparams(factory)(**hp), mask)
        return js.apply_if_finite(inner, 2), "finite_masked"
    if kind == "multi_transform(apply_if_finite)":
        return optax.multi_transform(
            {"sparse": optax.apply_if_finite(tx, 2), "dense": optax.adam(0.1)},
            labels,
        ), "multi"
    if kind == "masked(apply_if_finite)":
        return optax.masked(js.apply_if_finite(tx, 2), mask), "masked"
    raise AssertionError(kind)


WRAPPERS = [
    "chain",
    "masked",
    "masked_callable",
    "multi_transform",
    "inject_hyperparams",
    "optax.apply_if_finite",
    "jaxslices.apply_if_finite",
    "apply_if_finite(masked(inject_hyperparams))",
    "multi_transform(apply_if_finite)",
    "masked(apply_if_finite)",
]

# Optax's apply_if_finite returns zeros shaped like its *input* on a rejected
# step; a chain that turns slices into dense arrays (densify) makes the two
# lax.cond branches differ. jaxslices.apply_if_finite is the documented fix.
UNSUPPORTED = {
    ("densify+lazy_adam", "optax.apply_if_finite"),
    ("densify+lazy_adam", "multi_transform(apply_if_finite)"),
}


@functools.cache
def data(nan: bool):
    """Params and 3 steps of gradients; with ``nan``, step 2 holds a NaN."""
    rng = np.random.default_rng(0)
    params = make_params(rng)
    grads = make_grads(rng, 3)
    if nan:
        grads = [grads[0], with_nan(grads[1]), grads[2]]
    return params, grads


@functools.cache
def cached_reference(name, ref, nan):
    factory, hp, _ = OPTIMIZERS[name]
    return reference(ref, factory, hp, *data(nan))


def reference(ref, factory, hp, params, grads):
    """Expected params: the unwrapped optimizer where the wrapper routes to it."""
    if ref == "plain":
        return run(factory(**hp), params, grads)[0]
    if ref in ("finite", "finite_masked"):
        finite = [g for g in grads if not _has_nan(g)]
        if ref == "finite":
            return run(factory(**hp), params, finite)[0]
        return reference("masked", factory, hp, params, finite)
    got = run(
        factory(**hp), sub(params, TABLE_KEYS), [sub(g, TABLE_KEYS) for g in grads]
    )[0]
    if ref == "masked":  # unmasked leaves: the raw gradient is the update
        rest = sub(params, DENSE_KEYS)
        for g in grads:
            rest = js.apply_updates(rest, sub(g, DENSE_KEYS))
    else:  # multi_transform: Optax Adam on the dense leaves
        dense_grads = [sub(g, DENSE_KEYS) for g in grads]
        rest = run(optax.adam(0.1), sub(params, DENSE_KEYS), dense_grads)[0]
    return {**got, **rest}


def _has_nan(g):
    return not all(
        bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(js.to_dense(g))
    )


def assert_close(got, want):
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_wrapper_matches_unwrapped(name, wrapper):
    factory, hp, _ = OPTIMIZERS[name]
    tx, ref = _wrapped(wrapper, factory, hp)
    nan = ref.startswith("finite")
    params, grads = data(nan)
    if (name, wrapper) in UNSUPPORTED:
        with pytest.raises(TypeError, match="cond branch outputs must have the same"):
            run(tx, params, grads)
        fixed = js.apply_if_finite(factory(**hp), 2)
        want = cached_reference(name, "finite", nan)
        assert_close(run(fixed, params, grads)[0], want)
        return
    got, state = run(tx, params, grads)
    assert_close(got, cached_reference(name, ref, nan))
    if wrapper == "inject_hyperparams":
        assert set(hp) <= set(state.hyperparams)


@pytest.mark.parametrize(
    "name", [k for k, (_, _, dense) in OPTIMIZERS.items() if dense is not None]
)
def test_wrapped_exact_optimizers_match_dense_optax(name):
    """Exact optimizers: wrapped jaxslices on slices == wrapped Optax on dense."""
    factory, hp, dense_factory = OPTIMIZERS[name]
    params, grads = data(nan=True)
    ours = js.apply_if_finite(optax.inject_hyperparams(factory)(**hp), 2)
    theirs = optax.apply_if_finite(optax.inject_hyperparams(dense_factory)(**hp), 2)
    got, _ = run(ours, params, grads)
    want, _ = run(theirs, params, [js.to_dense(g) for g in grads])
    assert_close(got, want)


def test_rejected_step_touches_no_row_in_a_following_lazy_transform():
    """jaxslices.apply_if_finite rejects with padding slices, not row 0."""
    params = {"emb": jnp.ones((4, 2))}
    bad = {"emb": IndexedSlices(jnp.full((2, 2), jnp.nan), jnp.array([1, 1]), (4, 2))}
    tx = optax.chain(
        js.apply_if_finite(js.clip(1.0), 3), js.lazy_adamw(0.1, weight_decay=0.5)
    )
    got, state = run(tx, params, [bad])
    np.testing.assert_array_equal(got["emb"], params["emb"])  # row 0 did not decay
