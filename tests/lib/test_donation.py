"""``table_copies``: a compiled step copies its tables unless they are donated.

Checked both ways on whole training steps: donated, nothing is copied; not
donated, the table and its table-sized optimizer state are reported (with
their names, sizes and ``donated=False``); donated but returned twice, the
copy XLA still makes is reported with ``donated=True``. For ``jax.jit``,
``nnx.jit`` and ``eqx.filter_jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxslices as js

V, D = 65_536, 8  # 2 MiB tables: above table_copies' default 1 MiB
TABLE_BYTES = V * D * 4


def _loss(params, ids, y):
    h = js.embedding_lookup(params["emb"], ids).mean(1)
    return jnp.mean((h @ params["w"] - y) ** 2)


def _step_and_args():
    tx = js.adagrad(0.1)  # a table-sized accumulator: copied too

    def step(params, state, ids, y):
        _, grads = js.value_and_grad(_loss, strict=True)(params, ids, y)
        updates, state = tx.update(grads, state, params)
        return js.apply_updates(params, updates), state

    params = {"emb": jnp.zeros((V, D)), "w": jnp.ones(D)}
    ids, y = jnp.array([[3, 7], [7, 9]]), jnp.ones(2)
    return step, (params, tx.init(params), ids, y)


def test_a_donated_step_copies_nothing_and_an_undonated_one_its_tables():
    step, args = _step_and_args()
    donated = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
    assert js.table_copies(donated) == []
    copied = js.table_copies(jax.jit(step).lower(*args))  # a Lowered is compiled
    assert len(copied) == 2, copied
    names = sorted(c.argument for c in copied)
    assert names == ["params['emb']", "state[0].sum_of_squares['emb']"], names
    for c in copied:
        assert c == js.TableCopy(c.argument, (V, D), "f32", TABLE_BYTES, False)
    assert js.table_copies(jax.jit(step).lower(*args), min_bytes=TABLE_BYTES + 1) == []


def test_a_donated_table_still_copied_is_reported():
    def step(table, ids):
        new = js.scatter_add(table, js.IndexedSlices(jnp.ones((2, D)), ids, (V, D)))
        return new, table  # the old table is an output too: XLA must copy

    lowered = jax.jit(step, donate_argnums=0).lower(
        jnp.zeros((V, D)), jnp.array([1, 2])
    )
    (copy,) = js.table_copies(lowered.compile())
    assert copy.argument == "table" and copy.donated and copy.nbytes == TABLE_BYTES


def test_nnx_jit_and_eqx_filter_jit():
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    jnnx = pytest.importorskip("jaxslices.nnx")
    model = jnnx.Embed(V, D, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, js.sgd(0.1), wrt=nnx.Param)

    def step(model, opt, ids):
        _, g = jnnx.value_and_grad(lambda m: m(ids).sum(), strict=True)(model)
        opt.update(model, g)

    ids = jnp.array([1, 2])
    donated = nnx.jit(step, donate_argnums=(0, 1)).lower(model, opt, ids).compile()
    assert js.table_copies(donated) == []
    (copy,) = js.table_copies(nnx.jit(step).lower(model, opt, ids).compile())
    assert copy.shape == (V, D) and not copy.donated

    def eqx_step(ids, table):
        return js.scatter_add(table, js.IndexedSlices(jnp.ones((2, D)), ids, (V, D)))

    table = jnp.zeros((V, D))
    jitted = eqx.filter_jit(eqx_step, donate="all-except-first")
    assert js.table_copies(jitted.lower(ids, table).compile()) == []
    (copy,) = js.table_copies(eqx.filter_jit(eqx_step).lower(ids, table).compile())
    assert copy.nbytes == TABLE_BYTES and not copy.donated


@pytest.mark.parametrize("renorm_first", [True, False])
def test_apply_max_norm_first_or_after_the_lookups(renorm_first):
    """docs/embeddings.md: first in the step, as PyTorch; after the lookups, the
    old table must be kept for them, and XLA copies it (donated or not)."""

    def loss(params, ids):
        return jnp.sum(js.embedding_lookup(params["emb"], ids, max_norm=1.0) ** 2)

    def step(params, ids):
        if renorm_first:
            params = {"emb": js.apply_max_norm(params["emb"], ids, 1.0)}
        _, grads = js.value_and_grad(loss, strict=True)(params, ids)
        if not renorm_first:
            params = {"emb": js.apply_max_norm(params["emb"], ids, 1.0)}
        return js.apply_updates(params, js.tree_scale(-0.1, grads))

    args = ({"emb": jnp.ones((V, D))}, jnp.array([3, 7, 7]))
    copies = js.table_copies(jax.jit(step, donate_argnums=0).lower(*args).compile())
    if renorm_first:
        assert copies == []
    else:
        assert [(c.argument, c.donated) for c in copies] == [("params['emb']", True)]


def test_anything_else_is_refused():
    with pytest.raises(TypeError, match="expected a compiled step"):
        js.table_copies(jax.jit(lambda x: x))


def test_an_unused_argument_does_not_shift_the_donated_flags():
    """jit drops unused arguments from the HLO (keep_unused=False): the copied
    state is still reported as not donated, though the leaf at its position
    (the table) was."""

    def step(unused, table, acc, ids):
        return table.at[ids].add(1.0), acc.at[ids].add(1.0)

    table, acc = jnp.zeros((V, D)), jnp.zeros((V, D))
    args = (jnp.zeros(3), table, acc, jnp.array([1, 2]))
    compiled = jax.jit(step, donate_argnums=1).lower(*args).compile()
    (copy,) = js.table_copies(compiled)
    assert copy.argument == "acc" and copy.donated is False


def test_bytes_per_element_follow_the_hlo_type_width():
    from jaxslices.donation import _itemsize

    widths = {"f32": 4, "bf16": 2, "f8e4m3fn": 1, "s4": 0.5, "pred": 1, "c128": 16}
    assert {t: _itemsize(t) for t in widths} == widths
