"""The suite's one registry of optimizers and chains.

Every test that trains with "every optimizer" (or a selection) takes its
transformations from here, by name, so that a rule is written once for the
suite and each (optimizer, step) program is compiled once per test session
(``tests/harness.py`` caches the jitted steps by these names). A test file
selects names (:func:`pick`); it does not define its own optimizers, except
a transformation that only it is about (a wrapper under test, a bad
argument).

Hyperparameters are chosen so that every property the suite checks is
active: clipping thresholds clip the test gradients, decays decay, learning
rates move the tables visibly in a few steps without overflowing bfloat16.

Example:
  >>> import registry
  >>> tx = registry.optimizer("lazy_adam")
  >>> tx is registry.optimizer("lazy_adam")  # one instance per session
  True
  >>> sorted(registry.pick("sgd", "adagrad"))
  ['adagrad', 'sgd']
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import jaxslices as js

#: A schedule, for the transforms whose state counts steps.
SCHEDULE = optax.linear_schedule(0.1, 0.01, 5)


def _row_ndim_mask(params):
    return jax.tree.map(lambda x: x.ndim == 2, params)


#: name -> a function making the transformation (called once per session by
#: :func:`optimizer`). Grouped: the rules, then chains, then wrappers.
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    # ---- the row-wise rules (each a native kernel rule)
    "sgd": lambda: js.sgd(0.1),
    "sgd_schedule": lambda: js.sgd(SCHEDULE),
    "sgd_momentum": lambda: js.sgd(0.1, 0.9),
    "sgd_nesterov": lambda: js.sgd(0.1, 0.9, nesterov=True),
    "sgd_nesterov_schedule": lambda: js.sgd(SCHEDULE, 0.9, nesterov=True),
    "adagrad": lambda: js.adagrad(0.1),
    "adagrad_schedule": lambda: js.adagrad(SCHEDULE, 0.5, 1e-6),
    "rowwise_adagrad": lambda: js.rowwise_adagrad(0.1),
    "lazy_adam": lambda: js.lazy_adam(0.05),
    "lazy_adam_schedule": lambda: js.lazy_adam(SCHEDULE),
    "lazy_adam_nesterov": lambda: js.lazy_adam(
        0.1, eps_root=1e-8, mu_dtype=jnp.float32, nesterov=True
    ),
    "lazy_adamw": lambda: js.lazy_adamw(0.05, weight_decay=0.3),
    "lazy_adamw_mask": lambda: js.lazy_adamw(
        0.1, weight_decay=SCHEDULE, mask={"emb": True, "w": True, "b": False}
    ),
    "lazy_adamw_callable_mask": lambda: js.lazy_adamw(0.1, mask=_row_ndim_mask),
    "ftrl": lambda: js.ftrl(0.1, l1=0.01, l2=0.01, l2_shrinkage=0.01, beta=0.1),
    "ftrl_power": lambda: js.ftrl(0.1, learning_rate_power=-0.3, l1=0.001),
    "max_distinct": lambda: js.rowwise_adagrad(0.1, max_distinct=48),
    # a bound below a [6, 5] batch's 30 slots, so it binds there
    "max_distinct_tight": lambda: js.rowwise_adagrad(0.1, max_distinct=24),
    # ---- transforms other than a rule, and chains
    "scale": lambda: js.scale(-0.3),
    "scale_by_schedule": lambda: js.scale_by_schedule(SCHEDULE),
    "scale_by_learning_rate": lambda: js.scale_by_learning_rate(SCHEDULE),
    "trace": lambda: optax.chain(js.trace(0.5), js.scale(-0.1)),
    "add_decayed_weights": lambda: optax.chain(
        js.add_decayed_weights(0.3), js.sgd(0.1)
    ),
    "add_decayed_weights_schedule": lambda: optax.chain(
        js.add_decayed_weights(SCHEDULE), js.sgd(0.1)
    ),
    "decay_adagrad": lambda: optax.chain(js.add_decayed_weights(0.1), js.adagrad(0.1)),
    "clip_by_global_norm": lambda: optax.chain(
        js.clip_by_global_norm(1.0), js.sgd(0.1)
    ),
    "clip_by_global_norm_adagrad": lambda: optax.chain(
        js.clip_by_global_norm(0.05), js.adagrad(0.1)
    ),
    "clip_by_global_norm_tight": lambda: optax.chain(
        js.clip_by_global_norm(0.05), js.sgd(0.1)
    ),
    "clip": lambda: optax.chain(js.clip(0.5), js.sgd(0.1)),
    "clip_lazy_adam": lambda: optax.chain(js.clip(0.001), js.lazy_adam(0.01)),
    "clip_by_row_norm": lambda: optax.chain(js.clip_by_row_norm(0.7), js.sgd(0.1)),
    "clip_by_row_norm_tight": lambda: optax.chain(
        js.clip_by_row_norm(0.01), js.sgd(0.1)
    ),
    "clip_chain": lambda: optax.chain(
        js.clip_by_global_norm(1.0),
        js.clip(1.0),
        js.clip_by_row_norm(1.0),
        js.sgd(0.1, 0.9),
    ),
    "lazy_adam_max_distinct": lambda: js.lazy_adam(0.1, max_distinct=2),
    # ---- wrappers
    "apply_if_finite": lambda: optax.apply_if_finite(js.lazy_adam(0.1), 3),
    "js_apply_if_finite": lambda: js.apply_if_finite(js.lazy_adam(0.1), 2),
    "multi_steps": lambda: js.MultiSteps(
        js.lazy_adam(0.1), every_k_schedule=1, capacity=16
    ),
    "multi_steps_k2": lambda: js.MultiSteps(
        js.ftrl(0.1), every_k_schedule=2, capacity=16
    ),
    # a sparse "emb" and a dense "w" (an int capacity buffers every leaf)
    "multi_steps_k2_mixed": lambda: js.MultiSteps(
        js.lazy_adam(0.05), every_k_schedule=2, capacity={"emb": 64, "w": None}
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(js.lazy_adam)(0.1),
}

#: name -> the Optax transformation a registry entry equals on dense leaves
#: (bit for bit where the test says so).
OPTAX_TWINS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_schedule": lambda: optax.sgd(SCHEDULE),
    "sgd_momentum": lambda: optax.sgd(0.1, 0.9),
    "sgd_nesterov_schedule": lambda: optax.sgd(SCHEDULE, 0.9, True),
    "scale": lambda: optax.scale(-0.3),
    "scale_by_schedule": lambda: optax.scale_by_schedule(SCHEDULE),
    "scale_by_learning_rate": lambda: optax.scale_by_learning_rate(SCHEDULE),
    "clip_by_global_norm": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.sgd(0.1)
    ),
    "clip": lambda: optax.chain(optax.clip(0.5), optax.sgd(0.1)),
    "add_decayed_weights_schedule": lambda: optax.chain(
        optax.add_decayed_weights(SCHEDULE), optax.sgd(0.1)
    ),
    "adagrad": lambda: optax.adagrad(0.1),
    "adagrad_schedule": lambda: optax.adagrad(SCHEDULE, 0.5, 1e-6),
    "lazy_adam_schedule": lambda: optax.adam(SCHEDULE),
    "lazy_adam_nesterov": lambda: optax.adam(
        0.1, eps_root=1e-8, mu_dtype=jnp.float32, nesterov=True
    ),
    "lazy_adamw": lambda: optax.adamw(0.05, weight_decay=0.3),
    "lazy_adamw_mask": lambda: optax.adamw(
        0.1, weight_decay=SCHEDULE, mask={"emb": True, "w": True, "b": False}
    ),
}


@functools.cache
def optimizer(name: str) -> optax.GradientTransformation:
    """The registry's transformation ``name``: one instance per test session,
    so the jitted steps built on it are cached (``tests/harness.py``)."""
    return OPTIMIZERS[name]()


@functools.cache
def optax_twin(name: str) -> optax.GradientTransformation:
    """The Optax transformation that ``name`` equals on dense leaves."""
    return OPTAX_TWINS[name]()


def pick(*names: str) -> dict[str, Callable[[], optax.GradientTransformation]]:
    """A selection of the registry, in the order given: ``name -> factory``,
    each factory returning the session's one instance."""
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown:
        raise KeyError(f"not in tests/registry.py: {unknown}")
    return {n: functools.partial(optimizer, n) for n in names}
