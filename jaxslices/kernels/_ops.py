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
shard), it lowers to the FFI custom call. A Pallas kernel for GPU or TPU
would be one more lowering rule here: this is the seam.

Three ops (``csrc/`` holds their kernels):

* :func:`bag_forward`: pooled rows of bags of ids (``embedding_bag``'s
  forward);
* :func:`rowwise`: a sparse gradient, given as a :class:`Recipe`, summed per
  distinct id, then an optimizer rule on each distinct row and its state,
  in place;
* :func:`apply`: a sparse update, as a recipe, added to a table in place.

A :class:`~jaxslices._recipe.Recipe` (:attr:`jaxslices.IndexedSlices.recipe`)
describes the rows of a sparse gradient without making them: slot ``s``
holds ``scale * weight[s] * src[bag[s]]``, so the pooled gradient of a bag
(``[B, R]``) stands for its ``[N, R]`` per-id rows. Whether an op runs its
kernel at all is decided by :mod:`jaxslices.kernels._path`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _coalesce, _jax_compat, _strict
from .._recipe import Recipe, flat_rows
from . import _build

# Flags of the kernels' "flags" attribute (csrc/common.h).
HAS_BAG = 1
HAS_WEIGHT = 2
COALESCED = 4
WANT_SUMSQ = 8
NESTEROV = 16
SQRT_POWER = 32
SUM_DUPLICATES = 64
HAS_SCALE = 128

# Rules of the row-wise kernel (csrc/rowwise.cc).
RULES = {
    "coalesce": 0,
    "clip": 1,
    "row_norm": 2,
    "rss": 3,
    "rowwise_rss": 4,
    "adam": 5,
    "trace": 6,
    "decay": 7,
    "ftrl": 8,
    "max_norm": 9,
}

# ---------------------------------------------------- the primitive seam


def _f32(x: Any) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


_DUMMY_I32 = np.zeros((1,), np.int32)
_DUMMY_F32 = np.zeros((1,), np.float32)


class NativeOp:
    """A primitive: a C++ kernel on CPU, its XLA reference everywhere else."""

    def __init__(
        self,
        name: str,
        target: str,
        reference: Callable[..., list[jax.Array]],
        abstract: Callable[..., list[Any]],
        aliases: dict[int, int],
        attrs: tuple[str, ...],
        jvp: Callable[..., Any] | None = None,
    ):
        self.name, self.target = name, target
        self.reference, self.aliases, self.attrs = reference, aliases, attrs
        if not _jax_compat.AVAILABLE["ffi_primitive"]:  # pragma: no cover
            self.prim = None
            return
        p = _jax_compat.Primitive(name)
        p.multiple_results = True
        p.def_abstract_eval(lambda *avals, **params: abstract(*avals, **params))
        p.def_impl(self._impl)
        mlir = _jax_compat.mlir
        mlir.register_lowering(
            p, mlir.lower_fun(self._reference, multiple_results=True)
        )
        mlir.register_lowering(p, self._cpu_lowering, platform="cpu")
        _jax_compat.primitive_batchers[p] = self._batch
        _jax_compat.primitive_jvps[p] = jvp or self._jvp
        self.prim = p

    def bind(self, *args: Any, **params: Any) -> list[jax.Array]:
        return self.prim.bind(*args, **params)

    def _reference(self, *args: Any, **params: Any) -> list[jax.Array]:
        return self.reference(*args, **params)

    @functools.cached_property
    def _jitted(self) -> Callable[..., Any]:
        @functools.lru_cache(maxsize=256)
        def compiled(items):
            params = dict(items)
            return jax.jit(lambda *a: self.prim.bind(*a, **params))

        return compiled

    def _impl(self, *args: Any, **params: Any) -> list[jax.Array]:
        # Eager use: compile the primitive alone (lowered like any other).
        return self._jitted(tuple(sorted(params.items())))(*args)

    def _cpu_lowering(self, ctx: Any, *operands: Any, **params: Any) -> Any:
        per_device = _jax_compat.lowering_is_per_device(ctx)
        if params["fallback"] is None and per_device and _build.load():
            attrs = {k: np.int64(params[k]) for k in self.attrs}
            rule = jax.ffi.ffi_lowering(
                self.target, operand_output_aliases=dict(self.aliases)
            )
            return rule(ctx, *operands, **attrs)
        ref = _jax_compat.mlir.lower_fun(self._reference, multiple_results=True)
        return ref(ctx, *operands, **params)

    def _batch(self, args: Any, dims: Any, **params: Any) -> Any:
        fun = functools.partial(self.reference, **params)
        out = jax.vmap(lambda *a: tuple(fun(*a)), in_axes=tuple(dims))(*args)
        return list(out), [0] * len(out)

    def _jvp(self, primals: Any, tangents: Any, **params: Any) -> Any:
        tangents = [_jax_compat.instantiate_zeros(t) for t in tangents]
        fun = functools.partial(self.reference, **params)
        out, t_out = jax.jvp(lambda *a: tuple(fun(*a)), tuple(primals), tuple(tangents))
        return list(out), list(t_out)


# ------------------------------------------------------------ forward bag


def _bag_reference(table, ids, bag, weight, scale, *, flags, length, num_bags, **_):
    row_shape = table.shape[1:]
    rows = flat_rows(table.at[ids].get(mode="fill", fill_value=0))
    if flags & HAS_WEIGHT:
        rows = rows * weight[:, None]
    if length > 0:
        total = jnp.sum(rows.reshape(num_bags, length, rows.shape[1]), axis=1)
    else:
        out = jnp.zeros((num_bags, rows.shape[1]), rows.dtype)
        total = out.at[bag].add(rows, mode="drop")
    if flags & HAS_SCALE:
        total = total * scale[:, None]
    return [total.reshape((num_bags, *row_shape))]


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
    "jaxslices_bag_forward",
    _bag_reference,
    _bag_abstract,
    aliases={},
    attrs=("flags", "length"),
    jvp=_bag_jvp,
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
) -> jax.Array:
    """``out[b] = scale[b] * sum_{s in b} weight[s] * table[ids[s]]``.

    ``table`` ``[V, *row]`` float32 (out: ``[B, *row]``); ``ids`` ``[N]``
    (an id outside ``[0, V)`` adds nothing); bags padded (``length`` slots
    each, ``N = B * length``) or given per slot (``bag``; ``num_bags`` marks
    an unused slot). Differentiable in ``table``
    (densely, as JAX's gather), ``weight`` and ``scale``.

    ``dense_check``: a dense gradient of the table asks strict mode first
    (``strict``: the lookup's own switch), as the XLA lookups do; the tape's
    own lookups (whose table an outer transformation may differentiate)
    pass ``False``.
    """
    flags = (HAS_WEIGHT if weight is not None else 0) | (
        HAS_SCALE if scale is not None else 0
    )
    if bag is not None:
        flags |= HAS_BAG
    out = _BAG.bind(
        table,
        ids,
        _DUMMY_I32 if bag is None else bag,
        _DUMMY_F32 if weight is None else weight,
        _DUMMY_F32 if scale is None else scale,
        flags=flags,
        length=int(length),
        num_bags=int(num_bags),
        fallback=None,
        label=label,
        strict=bool(strict),
        dense_check=bool(dense_check),
    )
    return out[0]


# -------------------------------------------------------- row-wise rules


@dataclasses.dataclass(frozen=True)
class RuleSpec:
    """One optimizer rule, for the kernel and its XLA reference.

    ``reference(g, state_rows, p_rows, hp, cfg) -> (out, new_state_rows)`` on
    ``[K, R]`` rows (``state_rows``/``new_state_rows`` ``[K, S]`` or ``None``,
    ``p_rows`` ``[K, R]`` or ``None``); ``hp`` the hyperparameters as a
    float32 vector (traced values welcome: schedules); ``cfg`` static.
    """

    kind: str
    reference: Callable[..., Any]
    cfg: Any = None
    uses_state: bool = False
    uses_params: bool = False
    flags: int = 0


def _recipe_args(recipe: Recipe) -> tuple[list[Any], int]:
    flags = 0
    bag = _DUMMY_I32
    if recipe.bag is not None:
        bag, flags = recipe.bag, flags | HAS_BAG
    weight = _DUMMY_F32
    if recipe.weight is not None:
        weight, flags = recipe.weight, flags | HAS_WEIGHT
    scale = jnp.ones((), jnp.float32) if recipe.scale is None else _f32(recipe.scale)
    return [recipe.src, bag, weight, scale], flags


def _materialize(src, ids, bag, weight, scale, flags, length):
    n = ids.shape[0]
    return Recipe(
        src,
        bag if flags & HAS_BAG else None,
        length,
        weight if flags & HAS_WEIGHT else None,
        scale,
    ).values(n)


def _rowwise_reference(
    src, ids, bag, weight, scale, hp, params, state, *, flags, length, num_rows,
    capacity, spec, **_,
):  # fmt: skip
    values = _materialize(src, ids, bag, weight, scale, flags, length)
    safe = jnp.where((ids >= 0) & (ids < num_rows), ids, num_rows).astype(ids.dtype)
    summed, uids, count = _coalesce.coalesce_rows(
        values, safe, num_rows, "auto", capacity
    )
    sumsq = jnp.sum(summed * summed)
    p_rows = state_rows = None
    gather = {"mode": "fill", "fill_value": 0, "unique_indices": True}
    if spec.uses_params:
        p_rows = params.at[uids].get(**gather)
    if spec.uses_state:
        state_rows = state.at[uids].get(**gather)
    if p_rows is not None:
        p_rows = flat_rows(p_rows)
    if state_rows is not None:
        state_rows = flat_rows(state_rows)
    out, new_rows = spec.reference(summed, state_rows, p_rows, hp, spec.cfg)
    valid = (uids < num_rows)[:, None]
    out = jnp.where(valid, out, jnp.zeros((), out.dtype))
    if spec.uses_state:
        new_rows = new_rows.astype(state.dtype).reshape((-1, *state.shape[1:]))
        state = state.at[uids].set(new_rows, mode="drop", unique_indices=True)
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
    "jaxslices_rowwise",
    _rowwise_reference,
    _rowwise_abstract,
    aliases={7: 0},
    attrs=("rule", "flags", "length", "num_rows", "uses_state", "uses_params"),
)


def rowwise(
    recipe: Recipe,
    ids: jax.Array,
    *,
    num_rows: int,
    spec: RuleSpec,
    hp: Any = (),
    params: jax.Array | None = None,
    state: jax.Array | None = None,
    capacity: int,
    coalesced: bool = False,
    want_sumsq: bool = False,
    label: str = "",
) -> tuple[jax.Array | None, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Sum a recipe's rows per distinct id, then ``spec``'s rule per row.

    ``state`` ``[V, *srow]`` and ``params`` ``[V, *row]`` (float32; the
    kernel and the rule see their rows flattened, ``[V, S]`` and ``[V, R]``,
    as the reference does) as the rule needs them; ``capacity`` output slots
    (``<= N``). The state is passed whole, never reshaped: a reshape between
    a donated buffer and the kernel that writes it in place makes XLA copy it.

    Returns ``(new_state, uids [K], rows [K, R], count, sumsq)``: the
    distinct valid ids in order of first appearance then ``num_rows``; the
    rule's output rows (rows past the count unspecified); the number of
    distinct ids (may exceed ``capacity``: the caller raises, and then the
    state is unchanged); the squared norm of the summed rows (``want_sumsq``).
    """
    args, flags = _recipe_args(recipe)
    flags |= spec.flags
    if coalesced:
        flags |= COALESCED
    if want_sumsq:
        flags |= WANT_SUMSQ
    hp_arr = jnp.stack([_f32(h) for h in hp]) if len(hp) else _DUMMY_F32
    p_arr = params if spec.uses_params else np.zeros((1,), np.float32)
    s_arr = state if spec.uses_state else np.zeros((1,), np.float32)
    st, uids, rows, count, sumsq = _ROWWISE.bind(
        *args[:1],
        ids,
        *args[1:],
        hp_arr,
        p_arr,
        s_arr,
        rule=RULES[spec.kind],
        flags=flags,
        length=int(recipe.length),
        num_rows=int(num_rows),
        capacity=int(capacity),
        uses_state=int(spec.uses_state),
        uses_params=int(spec.uses_params),
        spec=spec,
        fallback=None,
        label=label,
    )
    return (st if spec.uses_state else None), uids, rows, count, sumsq


# ----------------------------------------------------------------- apply

NATIVE_OPS = frozenset(
    {"jaxslices_bag_forward", "jaxslices_rowwise", "jaxslices_apply"}
)


def _apply_reference(table, src, ids, bag, weight, scale, *, flags, length, **_):
    values = _materialize(src, ids, bag, weight, scale, flags, length)
    values = values.reshape((-1, *table.shape[1:]))
    num_rows = table.shape[0]
    safe = jnp.where((ids >= 0) & (ids < num_rows), ids, num_rows)
    unique = bool(flags & COALESCED)
    out = table.at[safe].add(
        values.astype(table.dtype), mode="drop", unique_indices=unique
    )
    return [out]


def _apply_abstract(table, *avals, **_):
    return [_jax_compat.native_out_aval(table.shape, table.dtype, (table, *avals))]


_APPLY = NativeOp(
    "jaxslices_apply",
    "jaxslices_apply",
    _apply_reference,
    _apply_abstract,
    aliases={0: 0},
    attrs=("flags", "length"),
)


def apply(
    table: jax.Array,
    recipe: Recipe,
    ids: jax.Array,
    *,
    coalesced: bool = False,
    sum_duplicates: bool = False,
    label: str = "",
) -> jax.Array:
    """``table`` ``[V, *row]`` plus the recipe's rows at ``ids``, in place.

    With ``sum_duplicates`` the rows of one id are summed before the row is
    written (each distinct row read and written once). Off by default: for
    an uncoalesced update (plain SGD's) adding each id's row in turn was
    measured faster (0.16 vs 0.34 ms for 16,384 Zipf ids at V = 1M: the hash
    costs more than the repeated writes to hot, cached rows save), and it is
    what the XLA path computes (a scatter-add).
    """
    args, flags = _recipe_args(recipe)
    if coalesced:
        flags |= COALESCED
    if sum_duplicates:
        flags |= SUM_DUPLICATES
    (out,) = _APPLY.bind(
        table,
        args[0],
        ids,
        *args[1:],
        flags=flags,
        length=int(recipe.length),
        fallback=None,
        label=label,
    )
    return out
