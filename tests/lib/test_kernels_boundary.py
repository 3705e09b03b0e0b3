"""The FFI boundary of the native kernels: typed, its constants defined once.

The C++ handlers bind typed buffers and named attributes; the Python ops
pass them. What is written on both sides (the rule enum, the attribute
names and types, the exported handler symbols) is read here from the C++
sources and compared with the Python side, and every shape a handler
indexes with is checked by the handler: a wrong one is an error, never a
write out of bounds.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import needs_kernels

from jaxslices.kernels import _build, _ops
from jaxslices.managed import _ops as managed_ops

CSRC = Path(_build.__file__).resolve().parent / "csrc"

pytestmark = needs_kernels


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def test_the_rule_enum_is_the_same_in_python_and_cpp():
    text = (CSRC / "rowwise.cc").read_text()
    body = re.search(r"enum class Rule : int32_t \{(.*?)\};", text, re.S).group(1)
    cpp = {_snake(n): int(v) for n, v in re.findall(r"k(\w+) = (\d+),", body)}
    assert cpp == {r.name.lower(): int(r) for r in _ops.Rule}
    # ... and every rule has its shape (hyperparameters, state, parameters) in
    # the kernel, the shape held in Python (_ops.SHAPES, read by the Pallas
    # kernels and the rule specs).
    pattern = r'case Rule::k(\w+): return \{"(\w+)", (-?\d+), (-?\d+), (true|false)\}'
    shapes = {
        _snake(c): (name, int(hp), int(rows), flag == "true")
        for c, name, hp, rows, flag in re.findall(pattern, text)
    }
    assert shapes == {
        r.name.lower(): (r.name.lower(), *_ops.SHAPES[r]) for r in _ops.Rule
    }


_ATTR_TYPES = {"bool": np.bool_, "int64_t": np.int64, "Rule": np.int32}


@pytest.mark.parametrize(
    "source,op",
    [("bag.cc", _ops._BAG), ("rowwise.cc", _ops._ROWWISE), ("apply.cc", _ops._APPLY)],
)
def test_attribute_names_and_types_match_the_handlers(source, op):
    text = (CSRC / source).read_text()
    cpp = dict(
        (name, _ATTR_TYPES[kind])
        for kind, name in re.findall(r"Attr<(\w+)>\(\"(\w+)\"\)", text)
    )
    assert cpp == op.attrs


def test_the_remap_kernels_bind_their_state_once_and_no_thread_setting():
    """``csrc/remap.cc`` binds the state's arrays in one place, in the order
    ``managed/_ops.py`` passes them; its attributes are the ops' own (the
    remap shares no work between threads, so it takes no thread setting)."""
    text = (CSRC / "remap.cc").read_text()
    cpp = {
        name: _ATTR_TYPES[kind]
        for kind, name in re.findall(r"Attr<(\w+)>\(\"(\w+)\"\)", text)
    }
    assert cpp == {**managed_ops._ADMIT.attrs, **managed_ops._EVICT.attrs}
    assert cpp == {
        "lfu": np.bool_,
        "min_count": np.int64,
        "threshold": np.int64,
        "half_life": np.int64,
        "ttl": np.int64,
    }
    bound = re.findall(r'next\(&st->[\w.]+, ffi::\w+, \w+, "(\w+)"\);', text)
    assert tuple(bound) == (*managed_ops.STATE_FIELDS, "scalars")
    assert text.count("RemainingArgs()") == 2 and "(void)" not in text


def test_every_target_has_its_handler_symbol():
    text = "".join((CSRC / n).read_text() for n in _build.SOURCES)
    symbols = set(re.findall(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*(\w+)", text))
    assert symbols == set(_build.TARGETS.values())
    for op in (_ops._BAG, _ops._ROWWISE, _ops._APPLY):
        for suffix in ("s32", "s64"):
            assert f"{op.target}_{suffix}" in _build.TARGETS


# ------------------------------------------------ shapes checked per handler

V, R, N = 10, 4, 6


def _rss(g, st, p, hp, cfg):
    acc = g * g + st[0]
    return g / jnp.sqrt(acc + hp[0]), (acc,)


def _run_rowwise(kind, *, hp, state=None, params=None):
    spec = _ops.RuleSpec(kind, _rss)
    ids = jnp.array([1, 2, 2, 9, 0, 3], jnp.int32)
    rec = _ops.PooledGradient(jnp.ones((N, R), jnp.float32))
    out = jax.jit(
        lambda s, p: _ops.rowwise(
            rec, ids, num_rows=V, spec=spec, hp=hp, state=s, params=p, capacity=N
        )
    )(state, params)
    return jax.block_until_ready(out)


STATE_10x4 = "needs a state of 10 rows of 4 floats, got"
PARAMS_10x4 = "needs parameters of 10 rows of 4 floats, got"
WRONG_SHAPES = {
    # name: (rule, hyperparameters, state shape, params shape, message)
    "no_hp": ("rss", (), (V, R), None, "takes 1 hyperparameters, got 0"),
    "adam_state_width": (
        "adam",
        (0.9,) * 9,
        (V, R),
        None,
        "needs a state of 10 rows of 8 floats, got 10 rows of 4",
    ),
    "state_rows": ("rss", (1e-7,), (V - 1, R), None, f"{STATE_10x4} 9 rows"),
    "no_state": ("rss", (1e-7,), (0,), None, f"{STATE_10x4} 0 rows"),
    "no_params": ("decay", (0.1,), None, (0,), f"{PARAMS_10x4} 0 rows"),
    "params_width": ("decay", (0.1,), None, (V, R + 1), f"{PARAMS_10x4} 10 rows of 5"),
    "ftrl_hp": ("ftrl", (0.1,) * 5, (V, 2, R), (V, R), "takes 6 hyper"),
}


@pytest.mark.parametrize("case", list(WRONG_SHAPES))
def test_a_wrong_shape_is_an_error_never_a_write_out_of_bounds(case):
    kind, hp, state, params, message = WRONG_SHAPES[case]
    state = None if state is None else jnp.zeros(state, jnp.float32)
    params = None if params is None else jnp.zeros(params, jnp.float32)
    with pytest.raises(Exception, match=f"jaxslices rowwise kernel: rule {kind} "):
        try:
            _run_rowwise(kind, hp=hp, state=state, params=params)
        except Exception as e:
            assert message in str(e), str(e)
            raise


def test_the_right_shapes_run():
    state = jnp.zeros((V, R), jnp.float32)
    new, uids, rows, count, _ = _run_rowwise("rss", hp=(1e-7,), state=state)
    assert int(count) == 5
    np.testing.assert_array_equal(uids, [1, 2, 9, 0, 3, V])
    np.testing.assert_allclose(new[2], 4.0)  # two rows of ones summed, squared


def test_bag_and_weight_sizes_are_checked():
    table = jnp.ones((V, R), jnp.float32)
    ids = jnp.array([1, 2, 3, 4], jnp.int32)
    with pytest.raises(Exception, match="jaxslices bag kernel: the weight array has 3"):
        jax.jit(
            lambda t: _ops.bag_forward(
                t, ids, weight=jnp.ones(3), scale=None, num_bags=2, length=2
            )
        )(table).block_until_ready()
    with pytest.raises(Exception, match="jaxslices bag kernel: the scale array has 1"):
        jax.jit(
            lambda t: _ops.bag_forward(
                t, ids, weight=None, scale=jnp.ones(1), num_bags=2, length=2
            )
        )(table).block_until_ready()
    with pytest.raises(ValueError, match="4 ids for 3 padded bags of 2 slots"):
        _ops.bag_forward(table, ids, weight=None, scale=None, num_bags=3, length=2)
    rec = _ops.PooledGradient(jnp.ones((4, R)), bag=jnp.array([0, 1], jnp.int32))
    with pytest.raises(Exception, match="jaxslices apply kernel: the bag array has 2"):
        jax.jit(lambda t: _ops.apply(t, rec, ids))(table).block_until_ready()


def test_typed_buffers_refuse_a_wrong_dtype_or_rank():
    """The FFI itself checks dtype and rank (typed buffers, no casts)."""
    table = jnp.ones((V, R), jnp.float32)
    call = jax.ffi.ffi_call(
        "jaxslices_apply_s32",
        jax.ShapeDtypeStruct(table.shape, table.dtype),
        input_output_aliases={0: 0},
    )
    attrs = {
        "has_bag": np.bool_(False),
        "has_weight": np.bool_(False),
        "coalesced": np.bool_(False),
        "sum_duplicates": np.bool_(False),
        "stochastic": np.bool_(False),
        "length": np.int64(0),
        "threads": np.int64(0),
        "min_slots": np.int64(0),
    }
    ids = jnp.array([1, 2], jnp.int32)
    none_i, none_f = jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.float32)
    src = jnp.ones((2, R), jnp.float32)
    one, seed = jnp.ones((), jnp.float32), jnp.zeros((), jnp.uint32)
    origin = jnp.zeros((3,), jnp.int32)  # where the rounding noise reads a row
    ok = jax.jit(
        lambda t: call(t, src, ids, none_i, none_f, one, seed, origin, **attrs)
    )(table)
    np.testing.assert_array_equal(ok[1:3], 2.0)
    bad_rank = jnp.ones((2 * R,), jnp.float32)
    with pytest.raises(Exception, match="(?i)rank"):
        jax.jit(
            lambda t: call(t, bad_rank, ids, none_i, none_f, one, seed, origin, **attrs)
        )(table).block_until_ready()
    bad_dtype = ids.astype(jnp.uint32)
    with pytest.raises(Exception, match="(?i)type"):
        jax.jit(
            lambda t: call(
                t, src, bad_dtype, none_i, none_f, one, seed, origin, **attrs
            )
        )(table).block_until_ready()
    with pytest.raises(Exception, match="(?i)attr|type"):
        wrong = {**attrs, "coalesced": np.int64(0)}  # an int where a bool is bound
        jax.jit(
            lambda t: call(t, src, ids, none_i, none_f, one, seed, origin, **wrong)
        )(table).block_until_ready()
    with pytest.raises(Exception, match="a row origin of 2 ids"):
        jax.jit(
            lambda t: call(t, src, ids, none_i, none_f, one, seed, origin[:2], **attrs)
        )(table).block_until_ready()


def test_ids_of_another_integer_dtype_are_refused_in_python():
    table = jnp.ones((V, R), jnp.float32)
    with pytest.raises(TypeError, match="int32 or int64 ids, got int16"):
        _ops.bag_forward(
            table, jnp.zeros(4, jnp.int16), weight=None, scale=None, num_bags=2,
            length=2,
        )  # fmt: skip
