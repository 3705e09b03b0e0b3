"""The suite's conformance harness: each step program compiled once per session.

A test that trains a registry optimizer (``tests/registry.py``) takes its
jitted step from here. :func:`jitted_step` is cached on the transformation
instance (the registry gives one per name and session), the apply function
and donation, so every test of a session that steps the same optimizer on
the same shapes and dtypes reuses one trace and one executable, whatever
its data: the properties (parity with Optax and NumPy, untouched rows, the
shapes of the updates, NumPy inputs) are checked on those outputs. The
kernels' path switch is part of jit's cache keys, so the native and the XLA
path each get their own executable (so do :func:`jaxslices.kernels.threads`
settings).

A test that differentiates a loss inside its step takes
:func:`jitted_loss_step` (cached on the transformation, the loss function,
the apply function and donation) and :func:`fit`. The loss must be one
function object for the session (a module-level function, or one made by a
``functools.cache``'d factory), or every test compiles its own step again.

Example:
  >>> import jax.numpy as jnp, harness, registry
  >>> tx = registry.optimizer("sgd")
  >>> harness.jitted_step(tx) is harness.jitted_step(tx)
  True
  >>> p = {"w": jnp.ones(2)}
  >>> [round(float(x), 4) for x in harness.train(tx, p, [{"w": jnp.ones(2)}])[0]["w"]]
  [0.9, 0.9]
  >>> def loss(p, x):
  ...     return jnp.sum(p["w"] * x)
  >>> [round(float(x), 4) for x in harness.fit(tx, loss, p, [(jnp.ones(2),)])[0]["w"]]
  [0.9, 0.9]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax

import jaxslices as js


def step_function(tx, apply: Callable = js.apply_updates) -> Callable:
    """``step(params, state, grads) -> (params, state)`` of ``tx``."""

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return apply(params, updates), state

    return step


@functools.cache
def jitted_step(tx, apply: Callable = js.apply_updates, donate: bool = False):
    """The session's one jitted :func:`step_function` of ``tx`` (donating the
    parameters and the state when ``donate``)."""
    return jax.jit(step_function(tx, apply), donate_argnums=(0, 1) if donate else ())


def train(
    tx,
    params,
    grads: Sequence,
    *,
    apply: Callable = js.apply_updates,
    jit: bool = True,
    donate: bool = False,
):
    """``(params, state)`` after one step per entry of ``grads`` from
    ``tx.init(params)``: jitted through :func:`jitted_step` (cached), or op
    by op when ``jit`` is false."""
    step = jitted_step(tx, apply, donate) if jit else step_function(tx, apply)
    state = tx.init(params)
    for g in grads:
        params, state = step(params, state, g)
    return params, state


def loss_step_function(tx, loss: Callable, apply: Callable = js.apply_updates):
    """``step(params, state, *batch) -> (params, state, loss value)``: one step
    of ``tx`` on the gradient of ``loss(params, *batch)`` (from
    :func:`jaxslices.value_and_grad`, so lookups give ``IndexedSlices``)."""

    def step(params, state, *batch):
        value, grads = js.value_and_grad(loss)(params, *batch)
        updates, state = tx.update(grads, state, params)
        return apply(params, updates), state, value

    return step


@functools.cache
def jitted_loss_step(
    tx, loss: Callable, apply: Callable = js.apply_updates, donate: bool = False
):
    """The session's one jitted :func:`loss_step_function` of ``(tx, loss)``
    (donating the parameters and the state when ``donate``)."""
    return jax.jit(
        loss_step_function(tx, loss, apply), donate_argnums=(0, 1) if donate else ()
    )


def fit(
    tx,
    loss: Callable,
    params,
    batches: Sequence[tuple],
    *,
    state=None,
    jit: bool = True,
    donate: bool = False,
):
    """``(params, state)`` after one step of ``loss`` per batch (a tuple of the
    loss's arguments after the parameters), from ``state`` (default
    ``tx.init(params)``): jitted through :func:`jitted_loss_step` (cached),
    or op by op when ``jit`` is false. With ``donate``, copies of ``params``
    and ``state`` are donated, never the caller's arrays."""
    if jit:
        step = jitted_loss_step(tx, loss, donate=donate)
    else:
        step = loss_step_function(tx, loss)
    if donate:
        params = jax.tree.map(jax.numpy.copy, params)
        state = None if state is None else jax.tree.map(jax.numpy.copy, state)
    state = tx.init(params) if state is None else state
    for batch in batches:
        params, state, _ = step(params, state, *batch)
    return params, state
