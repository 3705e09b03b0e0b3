"""The backend interfaces: lookup handlers (jaxslices._lookup_handlers) and the tap
backend's four functions (discover, probe, run, pack) that value_and_grad uses."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslices as js
from jaxslices import _lookup_handlers, _tape


@dataclasses.dataclass
class _Owned:
    """A table type no JAX function knows: only its handler can read it."""

    data: jax.Array


def _owned_lookup(table, ids):
    assert ids.dtype == jnp.int32  # ids arrive in the index dtype, padding = V
    assert int(jnp.max(ids)) <= table.data.shape[0]
    return 2.0 * table.data.at[ids].get(mode="fill", fill_value=0)


HANDLER = _lookup_handlers.LookupHandler(
    name="test-owned",
    claims=lambda t: isinstance(t, _Owned),
    num_rows=lambda t: t.data.shape[0],
    lookup=_owned_lookup,
)


@pytest.fixture
def handler():
    _lookup_handlers.register_lookup_handler(HANDLER)
    _lookup_handlers.register_lookup_handler(HANDLER)  # idempotent
    yield HANDLER
    _lookup_handlers.unregister_lookup_handler(HANDLER)


def test_a_registered_handler_gets_claimed_tables_after_the_ids_policy(handler):
    data = jnp.arange(12.0).reshape(6, 2)
    owned = _Owned(data)
    ids = np.array([[5, -1, 2**40 + 1], [6, 0, 3]], np.int64)  # wide, bad, padding
    got = js.embedding_lookup(owned, ids, dtype=jnp.bfloat16)
    want = js.embedding_lookup(data, ids) * 2
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    bag = js.embedding_bag(owned, jnp.array([[1, 3, 9]]), padding_id=9)
    np.testing.assert_allclose(bag, 2 * (data[1] + data[3])[None] / 2)
    with pytest.raises(ValueError, match=r"embedding_lookup\(check_ids=True\)"):
        js.embedding_lookup(owned, jnp.array([7]), check_ids=True)
    # Plain arrays still take the default path.
    np.testing.assert_array_equal(js.embedding_lookup(data, jnp.array([1])), data[1:2])


def test_without_the_handler_the_table_is_not_claimed():
    assert _lookup_handlers.handler_for(_Owned(jnp.ones((2, 2)))) is None
    with pytest.raises(TypeError):  # not an array: jnp.asarray refuses it
        js.embedding_lookup(_Owned(jnp.ones((2, 2))), jnp.array([0]))


def test_the_four_functions_compose_into_value_and_grad():
    rng = np.random.default_rng(0)
    leaves = [jnp.asarray(rng.normal(size=(8, 3)), jnp.float32), jnp.ones(3)]
    ids = jnp.array([[1, 7], [1, 8]])  # 8: padding

    def call(values):
        rows = js.embedding_lookup(values[0], ids)
        return jnp.sum(jnp.sin(rows @ values[1]))

    plan = _tape.discover(call, leaves)
    assert plan.sparse == (0,) and len(plan.records) == 1
    assert plan.records[0].ids_shape == (2, 2)
    plan = _tape.probe(call, leaves, plan, has_aux=False)
    assert plan.sparse == (0,)
    (value, aux), g_dense, tapped = _tape.run(call, leaves, plan, has_aux=False)
    slices = _tape.pack(plan, tapped, leaves)
    want_value, want = jax.value_and_grad(call)(leaves)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    assert aux is None and set(g_dense) == {1}
    np.testing.assert_allclose(g_dense[1], want[1], rtol=1e-5)
    np.testing.assert_array_equal(slices[0].indices, [1, 7, 1, 8])
    np.testing.assert_allclose(slices[0].to_dense(), want[0], rtol=1e-5, atol=1e-6)

    def tied(values):  # also read densely: the probe drops it
        return call(values) + jnp.sum(values[0])

    assert _tape.probe(tied, leaves, _tape.discover(tied, leaves), False).sparse == ()
