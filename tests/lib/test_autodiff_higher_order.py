"""Higher-order AD on top of js.value_and_grad / js.grad equals it on top of JAX's.

Every case is the same expression twice: once with ``js.value_and_grad`` /
``js.grad`` (sparse gradients densified with ``to_dense``), once with
``jax.value_and_grad`` / ``jax.grad``. The outer transformation is plain JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslices as js

NUM_ROWS, DIM = 7, 3


def _inputs(seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    table = jax.random.normal(k1, (NUM_ROWS, DIM))
    w = jax.random.normal(k2, (DIM,))
    # Repeated ids, an out-of-range id (padding) and a negative one.
    ids = jnp.array([[1, 4, 4], [6, NUM_ROWS, 1], [-1, 0, 4]])
    return table, w, ids


def _loss(table, w, ids):
    rows = js.embedding_lookup(table, ids)  # (B, L, D)
    return jnp.sum(jnp.tanh(rows @ w) ** 2) + 0.1 * jnp.sum(rows**3)


def _dense(g):
    return g.to_dense() if isinstance(g, js.IndexedSlices) else g


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def _vg(sparse):
    return js.value_and_grad if sparse else jax.value_and_grad


def _g(sparse):
    return js.grad if sparse else jax.grad


def _assert_nonzero(x):
    assert float(jnp.max(jnp.abs(x))) > 1e-3  # the bug gave exact zeros


@pytest.mark.parametrize("use_jit", [False, True])
def test_grad_of_value_equals_grad(use_jit):
    table, w, ids = _inputs()

    def outer(sparse):
        f = lambda t: _vg(sparse)(_loss)(t, w, ids)[0]  # noqa: E731
        return jax.grad(f)

    got, want = outer(True), outer(False)
    if use_jit:
        got, want = jax.jit(got), jax.jit(want)
    _assert_nonzero(want(table))
    _close(got(table), want(table))


@pytest.mark.parametrize("use_jit", [False, True])
def test_gradient_penalty(use_jit):
    """loss + ||grad||^2, differentiated w.r.t. the table and the dense weights."""
    table, w, ids = _inputs(1)

    def penalised(sparse):
        def f(t, w):
            g_t, g_w = _g(sparse)(_loss, argnums=(0, 1))(t, w, ids)
            return _loss(t, w, ids) + jnp.sum(_dense(g_t) ** 2) + jnp.sum(g_w**2)

        return f

    for outer in (jax.grad, js.grad):
        got = outer(penalised(True), argnums=(0, 1))
        want = jax.grad(penalised(False), argnums=(0, 1))
        if use_jit:
            got, want = jax.jit(got), jax.jit(want)
        (gt, gw), (wt, ww) = got(table, w), want(table, w)
        _assert_nonzero(wt)
        _close(_dense(gt), wt)
        _close(gw, ww)


def test_jvp_through_value_and_grad():
    table, w, ids = _inputs(2)
    tangent = jax.random.normal(jax.random.PRNGKey(9), table.shape)

    def run(sparse):
        def f(t):
            value, g = _vg(sparse)(_loss)(t, w, ids)
            return value, _dense(g)

        return jax.jvp(f, (table,), (tangent,))

    (v, g), (dv, dg) = run(True)
    (rv, rg), (rdv, rdg) = run(False)
    _assert_nonzero(rdv)
    _close(v, rv)
    _close(g, rg)
    _close(dv, rdv)
    _close(dg, rdg)


def test_hessian_style_nesting():
    table, w, ids = _inputs(3)

    def hess(sparse):
        return jax.jacfwd(lambda t: _dense(_g(sparse)(_loss)(t, w, ids)))(table)

    want = hess(False)
    _assert_nonzero(want)
    _close(hess(True), want)
    # jax.hessian of the value returned by value_and_grad.
    h = jax.hessian(lambda t: js.value_and_grad(_loss)(t, w, ids)[0])(table)
    _close(h, jax.hessian(_loss)(table, w, ids))


def test_maml_inner_step():
    table, w, ids = _inputs(4)
    _, _, query = _inputs(5)
    query = query[::-1]

    def maml(sparse, lr=0.5):
        def outer_loss(t, w):
            g_t, g_w = _g(sparse)(_loss, argnums=(0, 1))(t, w, ids)
            if sparse:
                t2 = js.scatter_add(t, -lr * g_t)
            else:
                t2 = t - lr * g_t
            return _loss(t2, w - lr * g_w, query)

        return outer_loss

    got = jax.value_and_grad(maml(True), argnums=(0, 1))(table, w)
    want = jax.value_and_grad(maml(False), argnums=(0, 1))(table, w)
    _assert_nonzero(want[1][0])
    _close(got[0], want[0])
    _close(got[1][0], want[1][0])
    _close(got[1][1], want[1][1])


def test_outer_grad_through_vmapped_lookup_and_aux():
    """The per-example (vmap) path and has_aux under an outer jax.grad."""
    table, w, ids = _inputs(6)

    def model(t, w, row):  # one example
        return jnp.sum(jnp.sin(js.embedding_lookup(t, row) @ w))

    def loss(t, w):
        out = jax.vmap(model, in_axes=(None, None, 0))(t, w, ids)
        return jnp.sum(out**2), out

    def outer(sparse):
        def f(t):
            (value, aux), g = _vg(sparse)(loss, has_aux=True)(t, w)
            return value + jnp.sum(aux) + jnp.sum(_dense(g) ** 2)

        return jax.grad(f)

    assert isinstance(js.grad(loss, has_aux=True)(table, w)[0], js.IndexedSlices)
    want = outer(False)(table)
    _assert_nonzero(want)
    _close(outer(True)(table), want)
