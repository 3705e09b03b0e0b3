"""The Pallas GPU kernels of the native ops: experimental, opt-in.

Experimental until measured on a GPU (the decision is in docs/design.md,
"The Pallas GPU kernels"): taken only inside
:func:`jaxslices.kernels.gpu_kernels`, never by default, with no speed
claim; a port to Mosaic GPU (JAX's recommended GPU backend on the 0.12
line, where the Triton backend used here is deprecated) or their removal
is decided by that measurement.

Each function here has the signature of its op's XLA reference in
:mod:`jaxslices.kernels._ops` (operands, then the op's parameters) and
returns the same outputs, so :class:`~jaxslices.kernels._primitive.NativeOp`
registers it as the op's lowering for ``cuda`` and ``rocm`` (through
``mlir.lower_fun``) when :func:`jaxslices.kernels.gpu_kernels` is on. Each is
a little XLA glue (a stable sort of the ids into runs) around one
``pallas_call`` on Pallas's Triton backend:

* :func:`bag_forward`: one program per bag; it walks its slots in slot order
  (padded bags: ``b * length ...``; per-slot bags: the slots sorted stably by
  bag), gathers each valid id's row, times its weight, sums, times the
  bag's scale. An id outside ``[0, V)`` reads a row of zeros (times its
  weight: a NaN weight makes its bag NaN, as on the XLA path).
* :func:`rowwise`: the ids sorted stably (invalid ids last), one run per
  distinct valid id; one program per run sums the run's recipe rows in slot
  order (``scale * weight[s] * src[bag[s]]``), then the rule on the summed
  row, reading and writing that id's state row in place
  (``input_output_aliases``). The distinct ids come out sorted (the XLA
  reference's order on a GPU; the CPU kernel's is first appearance).
* :func:`apply`: the same runs; each distinct id's rows summed in slot order
  and added to its table row once, in place: ``sum_duplicates`` always (one
  write per row, no atomics), a rounding away from the XLA path's
  one-add-per-slot.

``interpret=True`` runs the same kernels in Pallas's interpreter on any
platform: the tests run them on a CPU against the XLA references.

Limits, checked by :func:`unsupported` (and by ``kernels._path.route`` on a
GPU, so that ``explain`` says why): float32, a row width (the product of the
trailing dimensions) that is a power of two (Triton's blocks are), at least
one row. The rules are not written here: each program calls its rule
spec's reference (``_ops.RuleSpec``, the rule's one body) on its row, with
the rule's shape from ``_ops.SHAPES`` (the one table, tied to
``csrc/rowwise.cc`` by the boundary test).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat

__all__ = ["apply", "bag_forward", "lower", "rowwise", "unsupported"]

# The names of the kernels in the lowered module (explain counts them).
KERNEL_PREFIX = "jaxslices_gpu_"
_NUM_WARPS = 4


def _width(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[1:], dtype=np.int64))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def unsupported(*arrays: Any) -> str | None:
    """Why these operands cannot take the GPU kernels (``None``: they can).

    The one GPU predicate: :func:`jaxslices.kernels._path.decide` asks it
    when a step is traced (so that ``explain`` says why) and the GPU
    lowering when it is lowered (on every operand). Every floating array of
    rank >= 2 must be float32 with a power-of-two row width.
    """
    if not _jax_compat.AVAILABLE["pallas_gpu"]:
        return "this JAX lacks Pallas's GPU backend (Triton)"
    for a in arrays:
        shape = tuple(getattr(a, "shape", ()))
        if len(shape) < 2 or not jnp.issubdtype(a.dtype, jnp.floating):
            continue
        if a.dtype != jnp.float32:
            return f"a {a.dtype} array (the GPU kernels take float32)"
        if not _power_of_two(_width(shape)):
            return (
                f"rows of {_width(shape)} floats (the Pallas GPU kernels take "
                "a power-of-two row width)"
            )
    return None


def _call(kernel, *, name, grid, out_shape, interpret, aliases=None):
    pl = _jax_compat.pallas
    params = {}
    if not interpret:
        params["compiler_params"] = _jax_compat.pallas_triton.CompilerParams(
            num_warps=_NUM_WARPS
        )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases or {},
        interpret=interpret,
        name=KERNEL_PREFIX + name,
        **params,
    )


def _row(ref: Any, i: Any) -> jax.Array:
    """Row ``i`` of a ``[V]`` or ``[V, W]`` ref as ``[1, W]``."""
    pl = _jax_compat.pallas
    if len(ref.shape) == 1:
        return ref[pl.ds(i, 1)].reshape(1, 1)
    return ref[pl.ds(i, 1), :]


def _set_row(ref: Any, i: Any, value: jax.Array) -> None:
    pl = _jax_compat.pallas
    if len(ref.shape) == 1:
        ref[pl.ds(i, 1)] = value.reshape(1)
    else:
        ref[pl.ds(i, 1), :] = value


def _index(num_rows: int) -> Any:
    """The dtype row indices are computed in: int32 unless rows need int64."""
    return jnp.int64 if num_rows > np.iinfo(np.int32).max else jnp.int32


# ------------------------------------------------------------ forward bag


def bag_forward(
    table, ids, bag, weight, scale, *, has_bag, has_weight, has_scale, length,
    num_bags, interpret=False, **_,
):  # fmt: skip
    """``out[b] = scale[b] * sum_{s in b} weight[s] * table[ids[s]]`` (Pallas).

    The op's reference's signature and output (:func:`_ops.bag_forward`).
    """
    pl = _jax_compat.pallas
    v, n = table.shape[0], ids.shape[0]
    row_shape = table.shape[1:]
    r = max(_width(table.shape), 1)
    if num_bags == 0 or n == 0 or v == 0:
        zeros = jnp.zeros((num_bags, r), table.dtype)
        if has_scale:  # zeros times the scale, as XLA computes it
            zeros = zeros * scale[:, None]
        return [zeros.reshape((num_bags, *row_shape))]
    flat = table.reshape(v, r)
    operands = [ids]
    if has_bag:  # slots sorted stably by bag; unused slots (bag out of range) last
        key = jnp.where((bag >= 0) & (bag < num_bags), bag, num_bags)
        order = jnp.argsort(key, stable=True).astype(jnp.int32)
        sorted_key = key[order]
        bags = jnp.arange(num_bags, dtype=key.dtype)
        starts = jnp.searchsorted(sorted_key, bags, side="left").astype(jnp.int32)
        ends = jnp.searchsorted(sorted_key, bags, side="right").astype(jnp.int32)
        operands += [order, starts, ends]
    if has_weight:
        operands.append(weight)
    if has_scale:
        operands.append(scale)
    idx = _index(v)

    def kernel(*refs):
        ids_ref, *rest = refs[:-2]
        table_ref, out_ref = refs[-2], refs[-1]
        if has_bag:
            order_ref, starts_ref, ends_ref, *rest = rest
        w_ref = rest.pop(0) if has_weight else None
        s_ref = rest.pop(0) if has_scale else None
        b = pl.program_id(0)
        if has_bag:
            start, end = starts_ref[b], ends_ref[b]
        else:
            start, end = b * length, b * length + length

        def slot(q, acc):
            s = order_ref[q] if has_bag else q
            i = ids_ref[s]
            ok = (i >= 0) & (i < v)
            x = table_ref[pl.ds(jnp.where(ok, i, 0).astype(idx), 1), :]
            x = jnp.where(ok, x, 0.0)
            if has_weight:
                x = x * w_ref[s]
            return acc + x

        acc = jax.lax.fori_loop(start, end, slot, jnp.zeros((1, r), jnp.float32))
        if has_scale:
            acc = acc * s_ref[b]
        out_ref[pl.ds(b, 1), :] = acc

    out = _call(
        kernel,
        name="bag_forward",
        grid=(num_bags,),
        out_shape=jax.ShapeDtypeStruct((num_bags, r), table.dtype),
        interpret=interpret,
    )(*operands, flat)
    return [out.reshape((num_bags, *row_shape))]


# ------------------------------------------------------------------ runs


def _runs(ids: jax.Array, num_rows: int, capacity: int) -> dict[str, jax.Array]:
    """The ids sorted stably into runs of one distinct valid id each.

    ``order`` (slots by id, slot order within an id, invalid ids last),
    ``starts`` / ``ends`` (``[capacity]``: run ``j``'s positions in
    ``order``), ``uids`` (the run's id; ``num_rows`` past the count),
    ``count`` (``[1]``: runs to process; 0 when they exceed ``capacity``)
    and ``total`` (the number of distinct valid ids).
    """
    n = ids.shape[0]
    safe = jnp.where((ids >= 0) & (ids < num_rows), ids, num_rows).astype(ids.dtype)
    order = jnp.argsort(safe, stable=True).astype(jnp.int32)
    sorted_ids = safe[order]
    valid = sorted_ids < num_rows
    new = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
    first = new & valid
    total = jnp.sum(first, dtype=jnp.int32)
    n_valid = jnp.sum(valid, dtype=jnp.int32)
    (starts,) = jnp.nonzero(first, size=capacity, fill_value=n)
    starts = jnp.minimum(starts.astype(jnp.int32), n_valid)
    ends = jnp.concatenate([starts[1:], n_valid[None]])
    fits = total <= capacity
    count = jnp.where(fits, total, 0)
    used = jnp.arange(capacity) < count
    uids = jnp.where(used, sorted_ids[jnp.minimum(starts, n - 1)], num_rows)
    return {
        "order": order,
        "starts": starts,
        "ends": ends,
        "uids": uids.astype(ids.dtype),
        "count": count.reshape(1),
        "total": total,
    }


def _recipe_sum(refs, start, end, r, *, has_bag, has_weight, length, num_src):
    """The recipe rows of one run's slots, summed in slot order: ``[1, r]``."""
    pl = _jax_compat.pallas
    order_ref, src_ref, bag_ref, w_ref, scale_ref = refs

    def slot(q, acc):
        s = order_ref[q]
        if has_bag:
            b = bag_ref[s]
        else:
            b = s // length if length > 0 else s
        ok = (b >= 0) & (b < num_src)
        x = src_ref[pl.ds(jnp.where(ok, b, 0), 1), :]
        x = jnp.where(ok, x, 0.0)  # a slot with no source row: a row of zeros
        if has_weight:
            x = x * w_ref[s]
        return acc + x * scale_ref[0]

    return jax.lax.fori_loop(start, end, slot, jnp.zeros((1, r), jnp.float32))


# --------------------------------------------------------------- rowwise


def _state_view(state: jax.Array, parts: int, r: int) -> jax.Array:
    """The state as the kernel indexes it: ``[V]``, ``[V, W]`` or ``[V, 2, r]``.

    The common layouts (``[V]``, ``[V, R]``, ``[V, 2, R]``) pass unchanged (a
    reshape between a donated buffer and an in-place call makes XLA copy it).
    """
    v = state.shape[0]
    if parts == -1:
        return state if state.ndim == 1 else state.reshape(v, 1)
    if parts == 2:
        return state if state.shape == (v, 2, r) else state.reshape(v, 2, r)
    return state if state.ndim == 2 else state.reshape(v, r)


def _check_rule(spec, hp, params, state, num_rows, r) -> None:
    num_hp, parts, uses_params = spec.shape
    where, kind = "jaxslices GPU rowwise kernel", spec.kind
    if hp.shape[0] != num_hp:
        raise ValueError(
            f"{where}: rule {kind} takes {num_hp} hyperparameters, got {hp.shape[0]}"
        )
    width = 1 if parts == -1 else parts * r
    if parts and (state.shape[0] != num_rows or _width(state.shape) != width):
        raise ValueError(
            f"{where}: rule {kind} needs a state of {num_rows} rows of {width} "
            f"floats, got {state.shape}"
        )
    if uses_params and (params.shape[0] != num_rows or _width(params.shape) != r):
        raise ValueError(
            f"{where}: rule {kind} needs parameters of {num_rows} rows of {r} "
            f"floats, got {params.shape}"
        )


def _run_kernel(
    spec: Any, r: int, *, has_bag, has_weight, length, num_src, write_rows,
) -> Callable[..., None]:  # fmt: skip
    """The kernel of one run per program: sum, rule, state row in place.

    ``spec``: the rule (``_ops.RuleSpec``: its reference is the rule's one
    body, called on the run's summed row, ``[1, r]``), or ``None`` for the
    update (the table is the state: row += summed rows).
    """
    pl = _jax_compat.pallas
    num_hp, parts, uses_params = spec.shape if spec is not None else (0, 1, False)

    def kernel(*refs):
        refs = list(refs)
        order_ref, starts_ref, ends_ref, uids_ref, count_ref, src_ref = refs[:6]
        rest = refs[6:]
        bag_ref = rest.pop(0) if has_bag else None
        w_ref = rest.pop(0) if has_weight else None
        scale_ref = rest.pop(0)
        hp_ref = rest.pop(0) if num_hp else None
        p_ref = rest.pop(0) if uses_params else None
        st_in = rest.pop(0) if parts else None
        st_out = rest.pop(0) if parts else None
        rows_ref, sq_ref = (rest.pop(0), rest.pop(0)) if write_rows else (None, None)
        j = pl.program_id(0)
        active = j < count_ref[0]

        @pl.when(active)
        def _():
            uid = uids_ref[j]
            g = _recipe_sum(
                (order_ref, src_ref, bag_ref, w_ref, scale_ref),
                starts_ref[j],
                ends_ref[j],
                r,
                has_bag=has_bag,
                has_weight=has_weight,
                length=length,
                num_src=num_src,
            )
            if write_rows:
                sq_ref[pl.ds(j, 1)] = jnp.sum(g * g).reshape(1)
            if spec is None:  # the update: the table is the state
                _set_row(st_out, uid, _row(st_in, uid) + g)
                return
            if parts == 2:
                state = tuple(st_in[pl.ds(uid, 1), k, :] for k in range(2))
            else:
                state = (_row(st_in, uid),) if parts else ()
            p = _row(p_ref, uid) if uses_params else None
            hp = tuple(hp_ref[k] for k in range(num_hp))
            out, new = spec.reference(g, state, p, hp, spec.cfg)
            if parts == 2:
                for k in range(2):
                    st_out[pl.ds(uid, 1), k, :] = new[k].astype(jnp.float32)
            elif parts:
                _set_row(st_out, uid, new[0].astype(jnp.float32))
            rows_ref[pl.ds(j, 1), :] = out.astype(jnp.float32)

        if write_rows:

            @pl.when(jnp.logical_not(active))
            def _():
                rows_ref[pl.ds(j, 1), :] = jnp.zeros((1, r), jnp.float32)
                sq_ref[pl.ds(j, 1)] = jnp.zeros((1,), jnp.float32)

    return kernel


def _run_operands(runs, src, bag, weight, scale, has_bag, has_weight, length):
    """The runs' and the recipe's operands, and the recipe's kernel options."""
    ops = [runs[k] for k in ("order", "starts", "ends", "uids", "count")]
    ops.append(src)
    if has_bag:
        ops.append(bag)
    if has_weight:
        ops.append(weight)
    ops.append(jnp.asarray(scale, jnp.float32).reshape(1))
    recipe = {
        "has_bag": has_bag,
        "has_weight": has_weight,
        "length": length,
        "num_src": src.shape[0],
    }
    return ops, recipe


def rowwise(
    src, ids, bag, weight, scale, hp, params, state, *, spec, has_bag,
    has_weight, length, num_rows, capacity, interpret=False, **_,
):  # fmt: skip
    """Sum a recipe's rows per distinct id, then the rule per row (Pallas).

    The op's reference's signature and outputs (:func:`_ops.rowwise`):
    ``[state, uids, rows, count, sumsq]``, the distinct ids sorted. The rule
    is ``spec.reference`` on each distinct row (its one body).
    """
    n, r = ids.shape[0], src.shape[1]
    _check_rule(spec, hp, params, state, num_rows, r)
    num_hp, parts, uses_params = spec.shape
    if n == 0 or capacity == 0:  # no slots: nothing summed, the state as it was
        count = jnp.zeros((), jnp.int32)
        if n:  # capacity 0: the count of distinct ids, for the caller's check
            count = _runs(ids, num_rows, 1)["total"]
        uids = jnp.full((capacity,), num_rows, ids.dtype)
        rows = jnp.zeros((capacity, r), jnp.float32)
        return [state, uids, rows, count, jnp.zeros((), jnp.float32)]
    runs = _runs(ids, num_rows, capacity)
    st = _state_view(state, parts, r) if parts else None
    operands, recipe = _run_operands(
        runs, src, bag, weight, scale, has_bag, has_weight, length
    )
    if num_hp:  # no empty operand (Triton has no zero-size blocks)
        operands.append(hp)
    if uses_params:  # read in float32, as the reference reads them
        operands.append(params.reshape(params.shape[0], r).astype(jnp.float32))
    out_shape = []
    if parts:
        operands.append(st)
        out_shape.append(jax.ShapeDtypeStruct(st.shape, st.dtype))
    out_shape += [
        jax.ShapeDtypeStruct((capacity, r), jnp.float32),
        jax.ShapeDtypeStruct((capacity,), jnp.float32),
    ]
    kernel = _run_kernel(spec, r, **recipe, write_rows=True)
    outs = _call(
        kernel,
        name=f"rowwise_{spec.kind}",
        grid=(capacity,),
        out_shape=tuple(out_shape),
        interpret=interpret,
        aliases={len(operands) - 1: 0} if parts else None,
    )(*operands)
    if parts:
        new_state, rows, sq = outs
        new_state = new_state.reshape(state.shape)
    else:
        new_state, (rows, sq) = state, outs
    return [new_state, runs["uids"], rows, runs["total"], jnp.sum(sq)]


# ----------------------------------------------------------------- apply


def apply(
    table, src, ids, bag, weight, scale, _seed=None, _origin=None, *, has_bag,
    has_weight, length, interpret=False, **_,
):  # fmt: skip
    """``table`` plus the recipe's rows at ``ids``, in place (Pallas).

    The op's reference's signature and output (:func:`_ops.apply`); each
    distinct id's rows are summed (in slot order) and added once.
    """
    n, v = ids.shape[0], table.shape[0]
    r = src.shape[1]
    if n == 0 or v == 0:
        return [table]
    runs = _runs(ids, v, n)
    flat = table if table.ndim == 2 else table.reshape(v, r)
    operands, recipe = _run_operands(
        runs, src, bag, weight, scale, has_bag, has_weight, length
    )
    operands.append(flat)
    kernel = _run_kernel(None, r, **recipe, write_rows=False)
    (out,) = _call(
        kernel,
        name="apply",
        grid=(n,),
        out_shape=(jax.ShapeDtypeStruct(flat.shape, flat.dtype),),
        interpret=interpret,
        aliases={len(operands) - 1: 0},
    )(*operands)
    return [out.reshape(table.shape)]


# --------------------------------------------------------------- lowering


def lower(impl: Callable[..., list[jax.Array]]) -> Callable[..., Any]:
    """``impl`` as a lowering rule (Triton's deprecation on JAX 0.12 filtered)."""
    rule = _jax_compat.mlir.lower_fun(impl, multiple_results=True)

    @functools.wraps(impl)
    def lowering(ctx: Any, *operands: Any, **params: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore",
                message=_jax_compat.TRITON_DEPRECATION,
                category=DeprecationWarning,
            )
            return rule(ctx, *operands, **params)

    return lowering
