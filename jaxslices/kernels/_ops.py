"""The native ops: JAX primitives whose CPU lowering is a C++ kernel.

Each op is one primitive with an XLA *reference* implementation written in
jax.numpy. The reference is the op's contract and its fallback: it is what
the primitive lowers to on every platform but the CPU, on the CPU when the
kernels are not loaded or the step is partitioned over several devices by
``jit`` (a custom call has no partitioning rule: XLA would gather the whole
table onto every device), under ``jax.vmap`` (the batching rule vmaps the
reference) and under differentiation (the JVP rule differentiates the
reference; the forward bag writes its own). On one CPU device, and inside
``shard_map`` (every mesh axis manual: the kernel runs on each device's own
shard), it lowers to the FFI custom call; on a GPU, inside
:func:`jaxslices.kernels.gpu_kernels` (opt-in), to its Pallas kernel
(``_pallas.py``). A TPU kernel would be one more lowering rule: the seam.

Three ops here (``csrc/`` holds their kernels; the managed-collision
remap's two are in :mod:`jaxslices.managed._ops`):

* :func:`bag_forward`: pooled rows of bags of ids (``embedding_bag``'s
  forward);
* :func:`rowwise`: a sparse gradient, given as a :class:`PooledGradient`, summed per
  distinct id, then an optimizer rule on each distinct row and its state,
  in place;
* :func:`apply`: a sparse update, as a recipe, added to a table in place.

A :class:`~jaxslices.PooledGradient` (:attr:`jaxslices.IndexedSlices.recipe`)
describes the rows of a sparse gradient without making them: slot ``s``
holds ``scale * weight[s] * src[bag[s]]``, so the pooled gradient of a bag
(``[B, R]``) stands for its ``[N, R]`` per-id rows. Whether an op runs its
kernel at all is decided by :mod:`jaxslices.kernels._path`.

A row-wise rule is a :class:`RuleSpec`: its XLA reference is the rule's one
body (the op's reference and the Pallas kernel call it; the C++ kernel is
tested against it), and its shape (:data:`SHAPES`) is held here once.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _coalesce, _jax_compat, _rounding, _strict
from .._recipe import PooledGradient, flat_rows
from . import _pallas
from ._primitive import NativeOp, check_ids_dtype

# ---------------------------------------------------- the primitive seam


class Rule(enum.IntEnum):
    """The row-wise kernel's rules: its ``rule`` attribute (an enum in C++).

    The same names and numbers as ``enum class Rule`` in ``csrc/rowwise.cc``
    (``tests/lib/test_kernels_boundary.py`` reads it); the kernels check each
    rule's hyperparameter count and state width (:data:`SHAPES`).
    """

    COALESCE = 0
    CLIP = 1
    ROW_NORM = 2
    RSS = 3
    ROWWISE_RSS = 4
    ADAM = 5
    TRACE = 6
    DECAY = 7
    FTRL = 8
    MAX_NORM = 9


class RuleShape(NamedTuple):
    """What a rule reads besides the gradient rows ``[K, R]``.

    ``num_hp`` hyperparameters; ``state_rows``: its state per row (0: none,
    -1: one float, ``k``: ``k`` parts of ``R`` floats); ``uses_params``: it
    reads the parameter rows.
    """

    num_hp: int
    state_rows: int
    uses_params: bool


# Each rule's shape, held here once: the Pallas kernels read it, the C++
# kernel's ``ShapeOf`` (csrc/rowwise.cc) is compared with it by
# tests/lib/test_kernels_boundary.py.
SHAPES = {
    Rule.COALESCE: RuleShape(0, 0, False),
    Rule.CLIP: RuleShape(1, 0, False),
    Rule.ROW_NORM: RuleShape(1, 0, False),
    Rule.RSS: RuleShape(1, 1, False),
    Rule.ROWWISE_RSS: RuleShape(1, -1, False),
    Rule.ADAM: RuleShape(9, 2, False),
    Rule.TRACE: RuleShape(1, 1, False),
    Rule.DECAY: RuleShape(1, 0, True),
    Rule.FTRL: RuleShape(6, 2, True),
    Rule.MAX_NORM: RuleShape(3, 1, False),
}


def _f32(x: Any) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


# An absent optional operand (no bag, no weights, no hyperparameters, no
# state): an empty array, with the has_* attribute saying it is absent.
_NONE_I32 = np.zeros((0,), np.int32)
_NONE_F32 = np.zeros((0,), np.float32)


# ------------------------------------------------------------ forward bag


def pool_rows(
    rows: jax.Array,
    weight: jax.Array | None,
    scale: jax.Array | None,
    *,
    num_bags: int,
    length: int = 0,
    bag: jax.Array | None = None,
    bags_sorted: bool = False,
) -> jax.Array:
    """``out[b] = scale[b] * sum_{s in b} weight[s] * rows[s]``: the bag's pooling.

    ``rows`` ``[N, R]`` (the result ``[num_bags, R]`` has their dtype);
    ``weight`` ``[N]`` and ``scale`` ``[num_bags]`` or ``None`` (1); bags
    padded (``length`` slots each) or given per slot (``bag``; a slot outside
    ``[0, num_bags)`` is unused; ``bags_sorted``: XLA's promise that ``bag``
    is sorted). The one pooling of :func:`embedding_bag
    <jaxslices.embedding_bag>`: this op's XLA reference pools with it, and so
    do the lookups the op does not express (max_norm, a dtype cast, a table
    of a lookup handler).
    """
    if weight is not None:
        rows = rows * weight[:, None]
    if bag is not None:
        out = jnp.zeros((num_bags, rows.shape[1]), rows.dtype)
        # A bag outside [0, B) is an unused slot (JAX would wrap a negative one).
        bag = jnp.where((bag >= 0) & (bag < num_bags), bag, num_bags)
        total = out.at[bag].add(rows, mode="drop", indices_are_sorted=bags_sorted)
    else:  # padded bags (length 0: no slots, every bag empty)
        total = jnp.sum(rows.reshape(num_bags, length, rows.shape[1]), axis=1)
    if scale is not None:
        total = total * scale[:, None]
    return total


def _bag_reference(
    table, ids, bag, weight, scale, *, has_bag, has_weight, has_scale, length,
    num_bags, **_,
):  # fmt: skip
    row_shape = table.shape[1:]
    # An id outside [0, V) adds nothing; JAX would wrap a negative one.
    safe = jnp.where((ids >= 0) & (ids < table.shape[0]), ids, table.shape[0])
    rows = flat_rows(table.at[safe].get(mode="fill", fill_value=0))
    # Pooled in (at least) float32, rounded once into the table's dtype.
    rows = rows.astype(jnp.promote_types(table.dtype, jnp.float32))
    total = pool_rows(
        rows,
        weight if has_weight else None,
        scale if has_scale else None,
        num_bags=num_bags,
        length=length,
        bag=bag if has_bag else None,
    )
    return [total.astype(table.dtype).reshape((num_bags, *row_shape))]


def _bag_abstract(table, ids, bag, weight, scale, *, num_bags, **_):
    avals = (table, ids, bag, weight, scale)
    shape = (num_bags, *table.shape[1:])
    return [_jax_compat.native_out_aval(shape, table.dtype, avals)]


def _bag_jvp(primals, tangents, **params):
    table, ids, bag, weight, scale = primals
    t_table, _, _, t_weight, t_scale = tangents
    (out,) = _BAG.bind(*primals, **params)
    ref = functools.partial(_bag_reference, **params)
    zero = _jax_compat.is_symbolic_zero
    terms = []
    if not zero(t_table):  # read densely: JAX's dense gradient of the table
        if params["dense_check"]:
            _strict.on_dense_lookup(table.shape, params["strict"])
        terms.append(ref(t_table, ids, bag, weight, scale)[0])
    if not zero(t_weight):
        terms.append(ref(table, ids, bag, t_weight, scale)[0])
    if not zero(t_scale):
        terms.append(ref(table, ids, bag, weight, t_scale)[0])
    if not terms:
        return [out], [jnp.zeros_like(out)]
    return [out], [functools.reduce(jnp.add, terms)]


_BAG = NativeOp(
    "jaxslices_bag_forward",
    _bag_reference,
    _bag_abstract,
    aliases={},
    attrs={
        "has_bag": np.bool_,
        "has_weight": np.bool_,
        "has_scale": np.bool_,
        "length": np.int64,
    },
    ids_operand=1,
    jvp=_bag_jvp,
    gpu=_pallas.bag_forward,
)


def bag_forward(
    table: jax.Array,
    ids: jax.Array,
    *,
    weight: jax.Array | None,
    scale: jax.Array | None,
    num_bags: int,
    length: int = 0,
    bag: jax.Array | None = None,
    label: str = "embedding_bag",
    strict: bool = False,
    dense_check: bool = True,
    reason: str = "",
) -> jax.Array:
    """``out[b] = scale[b] * sum_{s in b} weight[s] * table[ids[s]]``.

    ``table`` ``[V, *row]`` float32, bfloat16 or float16 (out: ``[B, *row]``
    of its dtype; a low-precision table is read and pooled in float32, the
    output rounded once to nearest); ``ids`` ``[N]``
    int32 or int64 (an id outside ``[0, V)`` reads a row of zeros); bags
    padded (``length`` slots each, ``N = B * length``; ``length`` 0: no
    slots, every bag empty, zeros) or given per slot (``bag``; ``num_bags``
    marks an unused slot). Differentiable in ``table`` (densely, as JAX's
    gather), ``weight`` and ``scale``.

    ``dense_check``: a dense gradient of the table asks strict mode first
    (``strict``: the lookup's own switch), as the XLA lookups do; the tape's
    own lookups (whose table an outer transformation may differentiate)
    pass ``False``.

    The one body of the bags this op expresses (``embedding_bag``'s sum,
    mean and sqrtn of a float32, bfloat16 or float16 table, a collection's
    buffers): bound whatever the path, with :func:`_path.decide`'s
    ``reason`` (``""``: native); its lowering runs the kernel or this op's
    XLA reference (:func:`pool_rows` on the rows read in float32), which is
    the XLA path.
    """
    check_ids_dtype(ids, label)
    if bag is None and ids.shape[0] != num_bags * length:
        raise ValueError(
            f"{label}: {ids.shape[0]} ids for {num_bags} padded bags of "
            f"{length} slots (expected {num_bags * length})."
        )
    out = _BAG.bind(
        table,
        ids,
        _NONE_I32 if bag is None else bag,
        _NONE_F32 if weight is None else _f32(weight),
        _NONE_F32 if scale is None else _f32(scale),
        has_bag=bag is not None,
        has_weight=weight is not None,
        has_scale=scale is not None,
        length=int(length),
        num_bags=int(num_bags),
        label=label,
        strict=bool(strict),
        dense_check=bool(dense_check),
        reason=str(reason),
    )
    return out[0]


# -------------------------------------------------------- row-wise rules


@dataclasses.dataclass(frozen=True)
class RuleSpec:
    """One optimizer rule: its XLA reference, which every kernel follows.

    ``reference(g, state, p_rows, hp, cfg) -> (out, new_state)`` on ``[K, R]``
    rows: ``state`` and ``new_state`` tuples of the state's parts (each
    ``[K, R]``, or ``[K, 1]`` for one float per row; ``()`` for a rule
    without state), ``p_rows`` ``[K, R]`` or ``None``; ``hp`` the
    hyperparameters, a sequence of float32 scalars (traced values welcome:
    schedules); ``cfg`` static. It is the rule's one body: the op's XLA
    reference calls it on all the distinct rows, the Pallas kernel on one
    row at a time (``[1, R]``), and the C++ kernel is tested against it.
    ``kind`` names the kernel's rule (:class:`Rule`, lower case), whose
    shape (:data:`SHAPES`) says what it reads; ``nesterov`` (``trace``,
    ``adam``) and ``sqrt_power`` (``ftrl``: the power is 0.5) are the rules'
    two options.
    """

    kind: str
    reference: Callable[..., Any]
    cfg: Any = None
    nesterov: bool = False
    sqrt_power: bool = False

    @property
    def rule(self) -> Rule:
        return Rule[self.kind.upper()]

    @property
    def shape(self) -> RuleShape:
        return SHAPES[self.rule]

    @property
    def uses_state(self) -> bool:
        return self.shape.state_rows != 0

    @property
    def uses_params(self) -> bool:
        return self.shape.uses_params


def state_parts(rows: jax.Array, shape: RuleShape) -> tuple[jax.Array, ...]:
    """A rule's state rows ``[K, S]`` as its parts (:class:`RuleSpec`)."""
    if shape.state_rows == 0:
        return ()
    if shape.state_rows <= 1:
        return (rows,)
    r = rows.shape[1] // shape.state_rows
    return tuple(rows[:, k * r : (k + 1) * r] for k in range(shape.state_rows))


def _join_parts(parts: tuple[jax.Array, ...]) -> jax.Array:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _recipe_args(recipe: PooledGradient) -> tuple[list[Any], dict[str, bool]]:
    """The recipe as operands ``[src, bag, weight, scale]`` and its has_* flags."""
    bag = _NONE_I32 if recipe.bag is None else recipe.bag
    weight = _NONE_F32 if recipe.weight is None else _f32(recipe.weight)
    scale = jnp.ones((), jnp.float32) if recipe.scale is None else _f32(recipe.scale)
    present = {
        "has_bag": recipe.bag is not None,
        "has_weight": recipe.weight is not None,
        # The reference multiplies by no scale of 1 (the kernels' operand).
        "has_scale": recipe.scale is not None,
    }
    # The kernels sum in float32: a bfloat16/float16 gradient (a low-precision
    # table's) is widened here ([M, R], exact), so the reference sums in
    # float32 too (a wider one, on the XLA path only, stays as it is).
    src = jnp.asarray(recipe.src)
    if jnp.issubdtype(src.dtype, jnp.inexact):
        src = src.astype(jnp.promote_types(src.dtype, jnp.float32))
    return [src, bag, weight, scale], present


# The attributes of a kernel that reads a recipe and its ids (the row-wise
# rules, the apply): the recipe's operands present and its padded bags'
# length, the ids distinct.
_RECIPE_ATTRS = {
    "has_bag": np.bool_,
    "has_weight": np.bool_,
    "length": np.int64,
    "coalesced": np.bool_,
}


def _materialize(
    src, ids, bag, weight, scale, has_bag, has_weight, length, has_scale=True
):
    n = ids.shape[0]
    if n == 0:  # no slots (ids [B, 0] of a recipe whose src is [B, R])
        return jnp.zeros((0, src.shape[1]), src.dtype)
    exact = not jnp.issubdtype(src.dtype, jnp.inexact)  # an integer table's rows
    return PooledGradient(
        src,
        bag if has_bag else None,
        length,
        weight if has_weight else None,
        None if exact or not has_scale else scale,
    ).values(n)


def _rowwise_reference(
    src, ids, bag, weight, scale, hp, params, state, *, has_bag, has_weight,
    length, num_rows, capacity, spec, coalesced=False, method="auto",
    indices_sorted=False, **_,
):  # fmt: skip
    values = _materialize(src, ids, bag, weight, scale, has_bag, has_weight, length)
    safe = jnp.where((ids >= 0) & (ids < num_rows), ids, num_rows).astype(ids.dtype)
    kept = coalesced and (indices_sorted or method in _coalesce.UNSORTED_OK)
    if kept or ids.shape[0] == 0:  # (no slots: nothing to coalesce)
        # Distinct valid ids first, padding after, in an order `method`
        # accepts: kept as they are, cut to the capacity (the caller raises
        # past it), as jaxslices.coalesce keeps them.
        uids, summed = safe[:capacity], values[:capacity]
        count = jnp.sum(safe < num_rows, dtype=jnp.int32)
        summed = jnp.where((uids < num_rows)[:, None], summed, 0).astype(summed.dtype)
    else:
        summed, uids, count = _coalesce.coalesce_rows(
            values, safe, num_rows, method, capacity
        )
    # XLA's promises, as the transforms make them: distinct ids, sorted
    # where they came sorted or `method` sorts them.
    sorted_ = indices_sorted if kept else method not in _coalesce.UNSORTED_OK
    promises = {"unique_indices": True, "indices_are_sorted": bool(sorted_)}
    sumsq = jnp.sum(summed * summed)
    p_rows = state_rows = None
    gather = {"mode": "fill", "fill_value": 0, **promises}
    # Rows as [V, S] (the kernels' layout): one gather and one scatter each.
    if spec.uses_params:  # a bfloat16/float16 table's rows, read in float32
        p_rows = flat_rows(params).at[uids].get(**gather)
        p_rows = p_rows.astype(jnp.promote_types(params.dtype, jnp.float32))
    if spec.uses_state:
        state_rows = flat_rows(state).at[uids].get(**gather)
    parts = () if state_rows is None else state_parts(state_rows, spec.shape)
    out, new_parts = spec.reference(summed, parts, p_rows, hp, spec.cfg)
    valid = (uids < num_rows)[:, None]
    out = jnp.where(valid, out, jnp.zeros((), out.dtype))
    if spec.uses_state:
        if len(new_parts) > 1:  # XLA would otherwise scatter each part apart
            new_parts = jax.lax.optimization_barrier(tuple(new_parts))
        new_rows = _join_parts(tuple(new_parts)).astype(state.dtype)
        flat = flat_rows(state).at[uids].set(new_rows, mode="drop", **promises)
        state = flat.reshape(state.shape)
    return [state, uids, out.astype(jnp.float32), count, sumsq.astype(jnp.float32)]


def _rowwise_abstract(
    src, ids, bag, weight, scale, hp, params, state, *, capacity, **_
):
    avals = (src, ids, bag, weight, scale, hp, params, state)

    def sa(shape, dtype):
        return _jax_compat.native_out_aval(shape, dtype, avals)

    return [
        sa(state.shape, state.dtype),
        sa((capacity,), ids.dtype),
        sa((capacity, src.shape[1]), jnp.float32),
        sa((), jnp.int32),
        sa((), jnp.float32),
    ]


_ROWWISE = NativeOp(
    "jaxslices_rowwise",
    _rowwise_reference,
    _rowwise_abstract,
    aliases={7: 0},
    attrs={
        "rule": np.int32,
        **_RECIPE_ATTRS,
        "want_sumsq": np.bool_,
        "nesterov": np.bool_,
        "sqrt_power": np.bool_,
        "num_rows": np.int64,
    },
    ids_operand=1,
    gpu=_pallas.rowwise,
)


def rowwise(
    recipe: PooledGradient,
    ids: jax.Array,
    *,
    num_rows: int,
    spec: RuleSpec,
    hp: Any = (),
    params: jax.Array | None = None,
    state: jax.Array | None = None,
    capacity: int,
    coalesced: bool = False,
    indices_sorted: bool = False,
    method: str = "auto",
    want_sumsq: bool = False,
    reason: str = "",
    label: str = "",
) -> tuple[jax.Array | None, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Sum a recipe's rows per distinct id, then ``spec``'s rule per row.

    ``state`` ``[V, *srow]`` (float32) and ``params`` ``[V, *row]``
    (float32, bfloat16 or float16, read in float32; the
    kernel and the rule see their rows flattened, ``[V, S]`` and ``[V, R]``,
    as the reference does) as the rule needs them; ``capacity`` output slots
    (``<= N``). The state is passed whole, never reshaped: a reshape between
    a donated buffer and the kernel that writes it in place makes XLA copy it.

    Returns ``(new_state, uids [K], rows [K, R], count, sumsq)``: the
    distinct valid ids in order of first appearance then ``num_rows``; the
    rule's output rows (rows past the count unspecified); the number of
    distinct ids (may exceed ``capacity``: the caller raises, and then the
    state is unchanged); the squared norm of the summed rows (``want_sumsq``).
    No ids (``N = 0``): nothing summed, the state as it was.

    The one body of the row-wise rules it expresses
    (``transforms._rowwise.rowwise_update``): bound whatever the path, with
    :func:`_path.decide`'s ``reason`` (``""``: native); its lowering runs
    the kernel or this op's XLA reference, which is the XLA path. The
    reference sums duplicates by the coalescing ``method``
    (:func:`jaxslices.coalesce`; the kernel hashes, whatever the method) and
    keeps ids that are ``coalesced`` already (distinct valid ids first,
    padding after; ``indices_sorted``, or a method that takes any order) as
    they are, as :func:`jaxslices.coalesce` does.
    """
    check_ids_dtype(ids, label or "rowwise")
    args, present = _recipe_args(recipe)
    hp_arr = jnp.stack([_f32(h) for h in hp]) if len(hp) else _NONE_F32
    p_arr = params if spec.uses_params else _NONE_F32
    s_arr = state if spec.uses_state else _NONE_F32
    st, uids, rows, count, sumsq = _ROWWISE.bind(
        *args[:1],
        ids,
        *args[1:],
        hp_arr,
        p_arr,
        s_arr,
        rule=spec.rule,
        **present,
        coalesced=bool(coalesced),
        indices_sorted=bool(indices_sorted),
        method=str(method),
        want_sumsq=bool(want_sumsq),
        nesterov=bool(spec.nesterov),
        sqrt_power=bool(spec.sqrt_power),
        length=int(recipe.length),
        num_rows=int(num_rows),
        capacity=int(capacity),
        spec=spec,
        reason=str(reason),
        label=label,
    )
    return (st if spec.uses_state else None), uids, rows, count, sumsq


# ----------------------------------------------------------------- apply


def _apply_reference(
    table, src, ids, bag, weight, scale, seed, origin=None, *, has_bag, has_weight,
    coalesced, length, stochastic, indices_sorted=False, has_scale=True, **_,
):  # fmt: skip
    values = _materialize(
        src, ids, bag, weight, scale, has_bag, has_weight, length, has_scale
    )
    num_rows = table.shape[0]
    safe = jnp.where((ids >= 0) & (ids < num_rows), ids, num_rows)
    if _rounding.is_low_precision(table.dtype):
        if origin is None:
            origin = jnp.asarray(identity_origin(ids.dtype))
        rounded = _apply_rounded(
            table, values, safe, seed, origin, coalesced, stochastic
        )
        return [rounded]
    values = values.reshape((-1, *table.shape[1:]))
    out = table.at[safe].add(
        values.astype(table.dtype),
        mode="drop",
        unique_indices=coalesced,
        indices_are_sorted=coalesced and indices_sorted,
    )
    return [out]


def noise_rows(origin: jax.Array, ids: jax.Array) -> jax.Array:
    """Where the rounding noise reads each of the rows ``ids``: ``origin`` is
    ``[base, first_0, coord_0, first_1, coord_1, ...]`` (``csrc/apply.cc``'s
    ``Origin``), row ``i`` reads ``g - first_k + coord_k``, ``g = i + base``."""
    first, coord = origin[1::2], origin[2::2]
    g = ids + origin[0]
    k = jnp.clip(jnp.searchsorted(first, g, side="right") - 1, 0, first.shape[0] - 1)
    return g - first[k] + coord[k]


def identity_origin(dtype: Any) -> np.ndarray:
    """The origin of rows read where they are (``[0, 0, 0]``)."""
    return np.zeros((3,), dtype)


def _apply_rounded(table, values, safe, seed, origin, coalesced, stochastic):
    """A bfloat16/float16 table plus float32 rows ``[N, R]``, rounded once per row.

    Duplicates summed in float32 (slot order), each touched row read and
    added in float32, written back rounded (:func:`_rounding.round_to`, the
    noise of each entry's row and column).
    """
    num_rows = table.shape[0]
    if values.shape[0] == 0:
        return table
    if coalesced:  # distinct valid ids already (the rest out of range)
        summed, uids = values, safe
    else:
        summed, uids, _ = _coalesce.coalesce_rows(values, safe, num_rows, "auto")
    gather = {"mode": "fill", "fill_value": 0, "unique_indices": True}
    old = flat_rows(table.at[uids].get(**gather)).astype(jnp.float32)
    total = old + summed
    rows = noise_rows(origin, uids)
    new = _rounding.round_to(
        total, table.dtype, stochastic=stochastic, seed=seed, rows=rows
    )
    new = new.reshape((-1, *table.shape[1:]))
    return table.at[uids].set(new, mode="drop", unique_indices=True)


def _apply_abstract(table, *avals, **_):
    return [_jax_compat.native_out_aval(table.shape, table.dtype, (table, *avals))]


_APPLY = NativeOp(
    "jaxslices_apply",
    _apply_reference,
    _apply_abstract,
    aliases={0: 0},
    attrs={
        **_RECIPE_ATTRS,
        "sum_duplicates": np.bool_,
        "stochastic": np.bool_,
    },
    ids_operand=2,
    gpu=_pallas.apply,
)


def apply(
    table: jax.Array,
    recipe: PooledGradient,
    ids: jax.Array,
    *,
    coalesced: bool = False,
    indices_sorted: bool = False,
    sum_duplicates: bool = False,
    stochastic: bool = False,
    seed: Any = None,
    origin: Any = None,
    reason: str = "",
    label: str = "",
) -> jax.Array:
    """``table`` ``[V, *row]`` plus the recipe's rows at ``ids``, in place.

    The one body of the update of a table (``jaxslices.apply_updates``,
    ``scatter_add``, ``IndexedSlices + array``): the primitive is bound
    whatever the path, with :func:`_path.decide`'s ``reason`` (``""``:
    native); its lowering runs the kernel or this op's XLA reference, which
    is the XLA path. ``coalesced``
    (distinct valid ids) and ``indices_sorted`` are XLA's scatter promises.
    ``origin`` (ids' dtype, :func:`noise_rows`): where the stochastic
    rounding's noise reads each row (``None``: the row itself).

    A bfloat16 or float16 ``table``: the rows of each id are summed in
    float32 (in slot order), added to the row in float32 and the row
    written back rounded once: stochastically when ``stochastic`` (the
    noise of :mod:`jaxslices._rounding` with ``seed``, a ``uint32`` scalar:
    :func:`jaxslices._rounding.seed_from`), else to nearest; the same bits
    as :func:`jaxslices.apply_updates` on the XLA path when the float32
    sums agree.

    Each slot's row is added in turn, as the XLA path's scatter-add does
    (plain SGD's update on both paths). With ``sum_duplicates`` the rows of
    one id are summed first and each distinct row is written once: more
    accurate under heavy duplicates, slower (the hash pass over the ids);
    both measured in docs/kernels.md ("Plain SGD adds each id's row to the
    table in turn"). No ids: the table as it was.
    """
    check_ids_dtype(ids, label or "apply")
    args, present = _recipe_args(recipe)
    seed = jnp.zeros((), jnp.uint32) if seed is None else jnp.asarray(seed, jnp.uint32)
    if origin is None:
        origin = identity_origin(ids.dtype)
    (out,) = _APPLY.bind(
        table,
        args[0],
        ids,
        *args[1:],
        seed,
        jnp.asarray(origin, ids.dtype),
        **present,
        coalesced=bool(coalesced),
        indices_sorted=bool(indices_sorted),
        sum_duplicates=bool(sum_duplicates),
        stochastic=bool(stochastic),
        length=int(recipe.length),
        reason=str(reason),
        label=label,
    )
    return out
