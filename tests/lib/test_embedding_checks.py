"""check_ids errors: the caller's own ids, how many are bad, the function called,
and the exact exception type a user catches eagerly and under jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CHECK_FAILED

import jaxslices as js

TABLE = jnp.ones((5, 2))


def _bag(t, i):
    return js.embedding_bag(t, i, padding_id=9, check_ids=True)


def _lookup(t, i):
    return js.embedding_lookup(t, i, check_ids=True)


def _check(t, i):
    js.check_ids(i, t.shape[0])
    return t


CASES = [
    # (function, the name the message must give, ids, min, max, how many bad)
    (_bag, r"embedding_bag\(check_ids=True\)", [[0, -5, 9], [9, 9, 9]], -5, 0, 1),
    (_bag, r"embedding_bag\(check_ids=True\)", [[7, 9, 6], [1, 9, 2]], 1, 7, 2),
    (_lookup, r"embedding_lookup\(check_ids=True\)", [[4, -1], [7, 0]], -1, 7, 2),
    (_check, r"check_ids", [[3, 11]], 3, 11, 1),
]


def _pattern(name, lo, hi, n):
    what = "1 id is" if n == 1 else f"{n} ids are"
    return (
        rf"^{name}: ids must be in \[0, 5\) for a table with 5 rows; {what} out of "
        rf"range \(the ids checked have min {lo} and max {hi}\)"
    )


@pytest.mark.parametrize("fn, name, ids, lo, hi, n", CASES)
def test_eager_raises_value_error_with_the_callers_ids(fn, name, ids, lo, hi, n):
    for ids_in in (jnp.asarray(ids), np.asarray(ids), ids):
        with pytest.raises(ValueError, match=_pattern(name, lo, hi, n)):
            fn(TABLE, ids_in)


@pytest.mark.parametrize("fn, name, ids, lo, hi, n", CASES)
def test_jit_raises_jax_runtime_error_with_the_callers_ids(fn, name, ids, lo, hi, n):
    f = jax.jit(fn)
    with pytest.raises(CHECK_FAILED, match=_pattern(name, lo, hi, n)[1:]):
        jax.block_until_ready(f(TABLE, jnp.asarray(ids)))
    # Good ids pass (padding included for the bag).
    good = [[0, 4, 9], [9, 9, 9]] if fn is _bag else [[0, 4, 3]]
    jax.block_until_ready(f(TABLE, jnp.asarray(good)))


def test_under_value_and_grad_jit_and_eager():
    ids = jnp.array([[2, 9, 6]])

    def loss(t, i):
        return jnp.sum(_bag(t, i) ** 2)

    with pytest.raises(ValueError, match=r"embedding_bag\(check_ids=True\).*max 6"):
        js.grad(loss)(TABLE, ids)
    with pytest.raises(CHECK_FAILED, match=r"min 2 and max 6"):
        jax.block_until_ready(jax.jit(js.grad(loss))(TABLE, ids))
    g = jax.jit(js.grad(loss))(TABLE, jnp.array([[2, 9, 4]]))
    np.testing.assert_allclose(g.to_dense(), jax.grad(loss)(TABLE, ids.at[0, 2].set(4)))


def test_wide_dtypes_report_the_true_values():
    ids = np.array([1, 2**40], np.int64)  # JAX without x64 would make this 0
    with pytest.raises(ValueError, match="min 1 and max 1099511627776"):
        js.embedding_lookup(TABLE, ids, check_ids=True)
    ids8 = jnp.array([1, -128], jnp.int8)
    with pytest.raises(CHECK_FAILED, match="min -128 and max 1"):
        jax.block_until_ready(jax.jit(_lookup)(TABLE, ids8))
