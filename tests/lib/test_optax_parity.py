"""Every jaxslices namesake of an Optax function takes Optax's arguments.

A user of Optax who swaps ``optax.sgd(0.1, 0.9, False, jnp.bfloat16)`` for
``jaxslices.sgd`` must get the same meaning: the positional parameters are
Optax's, in Optax's order, with Optax's names and defaults; Optax's
keyword-only parameters are keyword-only here too; what jaxslices adds
(``coalesce_method``, ``capacity``) is keyword-only, after a bare ``*``. Where
a jaxslices function differs on purpose, :data:`DIFFERENCES` says why. Reads
``inspect.signature`` only (fast).
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import optax
import pytest

import jaxslices as js

POSITIONAL = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
)
KW_ONLY = inspect.Parameter.KEYWORD_ONLY

#: jaxslices name -> its Optax namesake, where the names differ.
NAMESAKES: dict[str, Any] = {
    "lazy_adam": optax.adam,  # Adam's formula on the touched rows
    "lazy_adamw": optax.adamw,
    "scale_by_lazy_adam": optax.scale_by_adam,
    "tree_add": optax.tree.add,
    "tree_scale": optax.tree.scale,
}

#: Public jaxslices transforms and tree functions that Optax does not have.
NO_NAMESAKE = {
    "clip_by_row_norm": "row-wise clipping; Optax clips globally or per entry",
    "densify": "turns slices into dense arrays; Optax has no slices",
    "ftrl": "FTRL-proximal (Keras 3); not in Optax 0.2.8",
    "rowwise_adagrad": "FBGEMM's exact row-wise Adagrad; not in Optax",
    "scale_by_table": "per-table factors of a collection's stacked buffers",
    "add_decayed_weights_by_table": "per-table decay of a collection's buffers",
    "scale_by_rowwise_rss": "its building block",
    "tree_map_values": "maps the values of slices; Optax's trees have none",
    "tree_pmean": "cross-device reduction of trees with slices (jax.lax.pmean)",
    "tree_psum": "cross-device reduction of trees with slices (jax.lax.psum)",
    "upgrade_state": "reads checkpoints of jaxslices' own earlier state layout",
}

#: Namesakes whose signature differs on purpose, and why.
DIFFERENCES = {
    "tree_add": (
        "any number of trees, one included, as `*trees` (its errors name "
        "`trees[i]`); optax.tree.add(tree_x, tree_y, *other_trees) needs two. "
        "Positional calls with two or more trees mean the same."
    ),
}

#: Fields a jaxslices state adds to its Optax namesake's, and why.
STATE_EXTRAS = {
    "MultiStepsState": {
        "acc_fill": "the used slots of each sparse leaf's buffer, beside acc_grads",
    },
    # optax.AddDecayedWeightsState is EmptyState; with a scheduled weight decay
    # Optax keeps the same count in another state class (WeightDecaySchedule).
    "AddDecayedWeightsState": {"count": "the step count a scheduled decay reads"},
}

TREE_FUNCTIONS = ["tree_add", "tree_scale", "tree_map_values", "tree_psum"]
FUNCTIONS = sorted(
    {n for n in js.transforms.__all__ if not n.endswith("State")}
    | {"apply_updates", "global_norm", "tree_pmean", *TREE_FUNCTIONS}
)
STATES = sorted(n for n in js.transforms.__all__ if n.endswith("State"))


def namesake(name: str) -> Any:
    return NAMESAKES.get(name, getattr(optax, name, None))


def params(f: Any) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """``([(name, default)] positional, {name: default} keyword-only)``."""
    sig = inspect.signature(f)
    pos = [(p.name, p.default) for p in sig.parameters.values() if p.kind in POSITIONAL]
    kw = {p.name: p.default for p in sig.parameters.values() if p.kind == KW_ONLY}
    return pos, kw


def parity_problems(ours: Any, theirs: Any) -> list[str]:
    """What differs between the two signatures (empty: parity)."""
    (pos, kw), (opos, okw) = params(ours), params(theirs)
    problems = []
    if [n for n, _ in pos] != [n for n, _ in opos]:
        problems.append(
            f"positional {[n for n, _ in pos]} != Optax's {[n for n, _ in opos]}"
        )
    else:
        for (n, d), (_, od) in zip(pos, opos, strict=True):
            if d is not od and d != od:
                problems.append(f"default of {n}: {d!r} != Optax's {od!r}")
    for n, od in okw.items():
        if n not in kw:
            problems.append(f"Optax's keyword-only {n} is not keyword-only here")
        elif kw[n] is not od and kw[n] != od:
            problems.append(f"default of {n}: {kw[n]!r} != Optax's {od!r}")
    return problems


@pytest.mark.parametrize("name", FUNCTIONS)
def test_signature_matches_the_optax_namesake(name):
    ours = getattr(js, name)
    theirs = namesake(name)
    if theirs is None:
        assert name in NO_NAMESAKE, (
            f"jaxslices.{name} has no Optax namesake: say why in NO_NAMESAKE"
        )
        return
    assert name not in NO_NAMESAKE, f"optax has {name} now: compare the two"
    problems = parity_problems(ours, theirs)
    if name in DIFFERENCES:
        assert problems, f"{name} matches Optax now: drop it from DIFFERENCES"
        return
    assert not problems, f"jaxslices.{name} vs Optax: {problems}"


def state_problems(ours: Any, theirs: Any, extras: Any = ()) -> list[str]:
    """Optax's fields, in Optax's order; any other field must be in ``extras``."""
    problems = []
    shared = [f for f in ours._fields if f in theirs._fields]
    if shared != list(theirs._fields):
        problems.append(f"fields {ours._fields} vs Optax's {theirs._fields}")
    added = [f for f in ours._fields if f not in theirs._fields]
    problems += [f"field {f} is not Optax's" for f in added if f not in extras]
    return problems


@pytest.mark.parametrize("name", STATES)
def test_state_fields_are_the_optax_namesake_fields(name):
    theirs = getattr(optax, name, None)
    if theirs is None or not hasattr(theirs, "_fields"):
        return  # no Optax state of that name (FtrlState, ...)
    extras = STATE_EXTRAS.get(name, {})
    assert not state_problems(getattr(js, name), theirs, extras)


def test_the_parity_check_finds_differences():
    # The checks above must be able to fail.
    def sgd_keyword_only(learning_rate, momentum=None, nesterov=False, *, acc=None):
        del learning_rate, momentum, nesterov, acc

    def trace_reordered(decay, accumulator_dtype=None, nesterov=False):
        del decay, accumulator_dtype, nesterov

    def lr_without_default(learning_rate, *, flip_sign=True):
        del learning_rate, flip_sign

    def flip_sign_positional(learning_rate=None, flip_sign=True):
        del learning_rate, flip_sign

    assert parity_problems(sgd_keyword_only, optax.sgd)
    assert parity_problems(trace_reordered, optax.trace)
    assert parity_problems(lr_without_default, optax.scale_by_learning_rate)
    assert parity_problems(flip_sign_positional, optax.scale_by_learning_rate)
    assert not parity_problems(js.sgd, optax.sgd)

    class Reordered(NamedTuple):
        inner_opt_state: Any
        mini_step: Any

    compared = [n for n in STATES if hasattr(getattr(optax, n, None), "_fields")]
    assert {"TraceState", "ScaleByRssState", "MultiStepsState"} <= set(compared)
    assert state_problems(Reordered, optax.MultiStepsState)
    assert state_problems(js.MultiStepsState, optax.MultiStepsState)  # no extras


def test_optax_positional_calls_mean_the_same():
    """The orders that used to differ: positional Optax calls work here."""
    import jax.numpy as jnp

    tx = js.sgd(0.1, 0.9, True, jnp.bfloat16)
    state = tx.init({"w": jnp.zeros(2)})
    assert state[0].trace["w"].dtype == jnp.bfloat16
    t = js.trace(0.5, False, jnp.bfloat16)
    assert t.init(jnp.zeros(2)).trace.dtype == jnp.bfloat16
    assert js.scale_by_learning_rate().init(jnp.zeros(2)) == optax.EmptyState()
