"""The one home of the transforms' private helpers, and the row-wise rule helper.

A jaxslices optimizer is written once, as a *rule* on aligned arrays::

    rule(g, states, p) -> (update, new_states)

``g`` is a gradient (a whole dense leaf, or the coalesced rows of a sparse
one), ``states`` a tuple of the matching state arrays (rows), ``p`` the
matching parameter (rows) or ``None``. :func:`rowwise_update` maps a rule over
an updates tree:

* a dense leaf gets ``rule(g, states, p)`` on the whole arrays, so dense
  leaves compute exactly what Optax computes;
* an :class:`~jaxslices.IndexedSlices` leaf is coalesced (duplicates summed),
  the touched rows of every state array (and of the parameter) are gathered,
  the rule is applied to those rows, the new state rows are scattered back,
  and the update rows come out as slices on the coalesced indices, with
  padding slots zeroed. No ``(V, ...)`` temporary is made; under donation the
  state is updated in place. Untouched rows' state does not change: that is
  what makes a stateful sparse update *lazy* (or exact, when a zero gradient
  leaves state and parameter unchanged in the dense rule too).

State arrays have the parameter's leading axis ``V``; their other axes are
the rule's business (``rowwise_adagrad`` keeps one float per row).

**Row-major state.** A rule with several state arrays of one shape (lazy
Adam's two moments, FTRL's accumulator and linear term) keeps them *packed*:
one array of shape ``(V, k, *row)`` (:func:`packed_shape`) per parameter,
the ``k`` states of a row side by side, so that one gather and one scatter
serve all of a row's state (FBGEMM's fused kernels keep a row's weights and
state together for the same reason). The rule still sees ``k`` separate
arrays (:func:`unpack`), and returns ``k`` (:func:`pack`).

**Distinct-row bound.** ``max_distinct`` (a static ``int`` per leaf, see
:func:`jaxslices.coalesce`) coalesces a sparse leaf into that many slots
instead of one per lookup, so every gather, scatter and state update runs
over the bound; more distinct rows raise. Coalesced slices carry XLA's
``unique_indices`` (and, when sorted, ``indices_are_sorted``) promises into
every gather and scatter here and in :func:`jaxslices.apply_updates`: the
valid indices are distinct, and padding slots (index ``V``) are out of
bounds, so they are dropped by scatters and filled by gathers.

**Which body runs.** A sparse leaf of a rule with a kernel (a
:class:`~jaxslices.kernels._ops.RuleSpec`, given as :class:`Native`), at
most one state tree, a float32 state, a float32, bfloat16 or float16
gradient and parameters, and no refusal by the rule (``Native.refuse``:
``mu_dtype``, ``accumulator_dtype``) binds the row-wise op
(:func:`jaxslices.kernels._ops.rowwise`, :func:`native_leaf`) whatever the
path: its lowering runs the kernel where
:func:`jaxslices.kernels._path.decide` says native, and otherwise its XLA
reference, which is that leaf's XLA path (the rule's ``RuleSpec`` body on
the coalesced rows, constants as Optax computes them). The body here
(coalesce, gather, rule, scatter) serves what the op does not express:
dense leaves (the rule on whole arrays: Optax's numbers), several state
trees, low-precision states (read in float32, written rounded,
stochastically), float64 and complex leaves, rules without a kernel.
"""

from __future__ import annotations

import contextvars
import functools
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .. import _coalesce, _errors, _leaves, _rounding, _spmd, slices
from .._recipe import PooledGradient
from ..kernels import _ops as kernel_ops
from ..kernels import _path as kernel_path
from ..slices import IndexedSlices, _replace_values, check_slices
from ..tree import _map_values

ScalarOrSchedule = ArrayLike | Callable[[ArrayLike], ArrayLike]
Rule = Callable[[jax.Array, tuple[jax.Array, ...], Any], tuple[Any, tuple[Any, ...]]]


def coalesce_for_update(
    s: IndexedSlices,
    method: str = "auto",
    max_distinct: int | None = None,
    where: str = "jaxslices.coalesce",
) -> IndexedSlices:
    """Where every transform coalesces: unique valid indices, padding elsewhere.

    Free for slices that are coalesced already (``s.unique_indices``) and
    have at most ``max_distinct`` slots; ``where`` names the transform and
    leaf in the overflow error.
    """
    return slices.coalesce_bounded(s, method, max_distinct, where)


def check_max_distinct(max_distinct: Any, name: str) -> Any:
    """Construction-time check of a transform's ``max_distinct`` argument.

    An ``int`` (every sparse leaf), ``None`` (one slot per lookup), or a
    pytree prefix of the updates with one of those per leaf (checked when
    the updates are seen).
    """
    if max_distinct is None or np.isscalar(max_distinct):
        slices.check_max_distinct(max_distinct, f"jaxslices.{name}")
    return max_distinct


def leaf_bounds(name: str, max_distinct: Any, updates: Any) -> Any:
    """``max_distinct`` broadcast to one ``int | None`` per leaf of ``updates``."""

    def broadcast(c, sub):
        c = slices.check_max_distinct(c, f"jaxslices.{name}")
        return jax.tree.map(lambda _: c, sub, is_leaf=is_leaf)

    try:
        return jax.tree.map(
            broadcast,
            max_distinct,
            updates,
            is_leaf=lambda x: x is None or np.isscalar(x),
        )
    except ValueError as e:
        if "max_distinct" in str(e):
            raise
        raise ValueError(
            f"jaxslices.{name}: `max_distinct` must be an int, None, or a pytree "
            "prefix of the updates with one of those per table, e.g. "
            f"{{'emb': 4608, 'w': None}}; got {max_distinct!r}. ({e})"
        ) from e


is_leaf = _leaves.is_leaf


class Out:
    """Several per-leaf results; a plain object, so a tree map keeps it whole."""

    __slots__ = ("items",)

    def __init__(self, *items: Any):
        self.items = items


def unzip(tree: Any, n: int) -> tuple[Any, ...]:
    """Split a tree of ``Out`` leaves into ``n`` trees."""

    def item(i):
        return jax.tree.map(
            lambda o: o.items[i], tree, is_leaf=lambda x: isinstance(x, Out)
        )

    return tuple(item(i) for i in range(n))


def where(name: str, path: Any) -> str:
    return _leaves.label(f"jaxslices.{name}", path)


def check_leaf(
    name: str, path: Any, g: Any, x: Any, x_name: str, shape: Any = None
) -> None:
    """``x`` (state or params) must have ``shape`` (default: ``g``'s dense shape)."""
    if isinstance(g, IndexedSlices):
        check_slices(g, where(name, path))
    if x is None:
        return
    want = tuple(g.shape) if shape is None else tuple(shape)
    if not hasattr(x, "shape") or tuple(x.shape) != want:
        got = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
        expect = "" if shape is None else f" (so `{x_name}` should have {want})"
        raise ValueError(
            f"{where(name, path)}: the update has dense shape {tuple(g.shape)}"
            f"{expect} but `{x_name}` has {got} there. Updates, params and "
            "optimizer state must describe the same parameters; was `init` called "
            "on these params?"
        )


def tree_map(name: str, fn: Callable[..., Any], updates: Any, *others: Any) -> Any:
    """``fn(path, g, *others_leaves)`` over the leaves of ``updates``.

    ``None`` and ``IndexedSlices`` are leaves of ``updates``; ``others``
    (``(name, tree)`` pairs: state, params) must have the same leaf paths.
    """
    for other_name, other in others:
        _leaves.check_structure(
            f"jaxslices.{name}", updates, "updates", other, other_name
        )
    return jax.tree_util.tree_map_with_path(
        fn, updates, *(tree for _, tree in others), is_leaf=is_leaf
    )


def check_all(name: str, updates: Any) -> None:
    """The integer-indices guard on every slices leaf of ``updates``."""

    def leaf(path, g):
        if isinstance(g, IndexedSlices):
            check_slices(g, where(name, path))

    jax.tree_util.tree_map_with_path(leaf, updates, is_leaf=is_leaf)


def map_values(
    name: str,
    fn: Callable[[jax.Array], jax.Array],
    updates: Any,
    factor: Any = None,
):
    """Apply ``fn`` to each dense leaf and to the values of each slices leaf.

    For value-wise maths (scaling) that needs neither state nor distinct rows:
    slices keep their indices and are not coalesced (:func:`jaxslices.tree_map_values`,
    its errors naming ``jaxslices.<name>``). ``factor``: the scalar ``fn``
    multiplies by, if it does, so that slices keep their native recipe.
    """
    return _map_values(name, lambda x: fn(jnp.asarray(x)), updates, factor)


def promises(c: IndexedSlices) -> dict[str, bool]:
    """XLA's ``unique_indices`` / ``indices_are_sorted`` where ``c``'s flags say so.

    Padding slots repeat the index ``V``, which is out of bounds: scatters
    drop it and gathers fill it, so only the valid indices must be distinct.
    """
    return {"unique_indices": c.unique_indices, "indices_are_sorted": c.indices_sorted}


def rows(x: Any, c: IndexedSlices) -> jax.Array:
    """Gather the rows of state/params ``x`` at ``c``'s indices (padding: 0)."""
    idx = slices.safe_indices(c)
    return jnp.asarray(x).at[idx].get(mode="fill", fill_value=0, **promises(c))


def set_rows(
    x: Any, c: IndexedSlices, new_rows: jax.Array, seed: Any = None, origin: Any = None
) -> jax.Array:
    """Write ``new_rows`` into ``x`` at ``c``'s (unique) indices; padding dropped.

    With a ``seed``, rows of a bfloat16/float16 ``x`` are rounded
    stochastically (:mod:`jaxslices._rounding`; the noise reads each row
    where ``origin`` puts it, :func:`jaxslices.kernels._ops.noise_rows`),
    else to nearest.
    """
    x = jnp.asarray(x)
    flags = promises(c)  # a layout constraint rebuilds c without its flags
    idx, new_rows = _spmd.replicate_rows(x, (slices.safe_indices(c), new_rows))
    if seed is not None and _rounding.is_low_precision(x.dtype):
        at = idx if origin is None else kernel_ops.noise_rows(origin, idx)
        new_rows = _rounding.round_to(
            new_rows, x.dtype, stochastic=True, seed=seed, rows=at
        )
    return x.at[idx].set(new_rows.astype(x.dtype), mode="drop", **flags)


#: True while a rule runs on float32 copies of low-precision states that are
#: rounded stochastically when written: rules then leave their states wide.
_ROUNDED_LATER: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jaxslices_rounded_later", default=False
)


#: The dtype of the gradient a rule's float32 rows were widened from (a
#: low-precision table's): a state Optax keeps in the gradient's dtype
#: (:func:`grad_dtype`) keeps it.
_GRAD_DTYPE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "jaxslices_grad_dtype", default=None
)


def grad_dtype(g: Any) -> Any:
    """The dtype of the gradient ``g`` stands for (``g`` may be its float32
    rows, widened from a bfloat16/float16 gradient)."""
    given = _GRAD_DTYPE.get()
    return jnp.result_type(g) if given is None else given


def state_as(x: Any, dtype: Any) -> Any:
    """A rule's new state in ``dtype``, or left in float32 when it is rounded
    stochastically on the way into its low-precision storage."""
    return x if _ROUNDED_LATER.get() else x.astype(dtype)


def _round_state(x: Any, dtype: Any, seed: jax.Array) -> jax.Array:
    return _rounding.round_to(x, dtype, stochastic=True, seed=seed)


def state_seed(name: str, i: int) -> jax.Array:
    """The rounding seed of a transform's ``i``-th state tree (fixed per state,
    so two states' draws differ; the hash also reads each entry's row, column
    and value)."""
    return _rounding.mix32(jnp.asarray(zlib.crc32(f"{name}/{i}".encode()), jnp.uint32))


def check_stochastic_rounding(value: Any, where: str) -> None:
    """``stochastic_rounding`` must be ``None``, ``True`` or ``False``."""
    if not (value is None or isinstance(value, bool)):
        raise TypeError(
            f"jaxslices.{where}: `stochastic_rounding` must be None, True or "
            f"False (a Python value: it chooses the program); got {value!r}."
        )


# ------------------------------------------------------------ packed state


def packed_shape(shape: tuple[int, ...], k: int) -> tuple[int, ...]:
    """``(V, k, *row)``: ``k`` states of shape ``(V, *row)`` side by side per row.

    A scalar's ``k`` states are a ``(k,)`` vector.
    """
    return tuple(shape[:1]) + (k,) + tuple(shape[1:])


def pack(parts: Sequence[Any], like: Any) -> jax.Array:
    """Stack ``parts`` (states of one parameter, or their rows) like ``like``.

    ``like`` is the packed array (or its rows); the result has its dtype.
    """
    axis = min(jnp.ndim(like) - 1, 1)
    dtype = jnp.result_type(like)
    return jnp.stack([_store_as(jnp.asarray(x), dtype) for x in parts], axis=axis)


def _store_as(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` in the packed array's (wider) ``dtype``, rounded to its own dtype.

    A bfloat16 moment kept in a float32 array must hold bfloat16 values: XLA
    may drop a ``convert`` pair (excess precision), never ``reduce_precision``.
    """
    narrow = jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(
        dtype, jnp.floating
    )
    if not narrow or jnp.finfo(x.dtype).bits >= jnp.finfo(dtype).bits:
        return x.astype(dtype)
    fi = jnp.finfo(x.dtype)
    return jax.lax.reduce_precision(
        x.astype(dtype), exponent_bits=fi.nexp, mantissa_bits=fi.nmant
    )


def unpack(x: jax.Array, k: int) -> tuple[jax.Array, ...]:
    """The ``k`` states held side by side in the packed ``x`` (:func:`packed_shape`)."""
    axis = min(x.ndim - 1, 1)
    return tuple(jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(k))


def unpacked(field: str, i: int, doc: str) -> property:
    """A state's property: state ``i`` of the two packed in its ``field``.

    One array per parameter (a copy), as the separate layout had it.
    """
    return property(
        lambda self: jax.tree.map(lambda x: unpack(x, 2)[i], getattr(self, field)),
        doc=f"{doc} One array per parameter (a copy).",
    )


def packed_pair(state: str, fields: str, packed: Any, old: tuple[Any, ...]) -> Any:
    """The packed field of a ``(count, packed)`` state, also from an old pickle.

    Pickles of the separate layout (``(count, mu, nu)``, say) arrive with one
    more field, ``old``: the two states are packed here.
    """
    if len(old) == 1:
        return pack_states(packed, old[0])
    if old:
        raise TypeError(f"{state} takes {fields}, got {2 + len(old)} fields.")
    return packed


def pack_states(*trees: Any) -> Any:
    """Trees of per-parameter states (one tree per state) packed row-major.

    Converts the separate layout (``mu`` and ``nu`` trees, say) into the
    packed one; the packed array has the widest of the states' dtypes.
    """

    def leaf(*xs):
        xs = [jnp.asarray(x) for x in xs]
        dtype = jnp.result_type(*xs)
        return jnp.stack([x.astype(dtype) for x in xs], axis=min(xs[0].ndim, 1))

    return jax.tree.map(leaf, *trees)


def packed_zeros(params: Any, fills: Sequence[Any], dtype: Any = None) -> Any:
    """Per leaf of ``params``, ``len(fills)`` packed states, each filled."""

    def leaf(p):
        if not (hasattr(p, "shape") and hasattr(p, "dtype")):
            p = jnp.asarray(p)  # lists, Python scalars
        d = p.dtype if dtype is None else dtype
        shape = packed_shape(tuple(p.shape), len(fills))
        fill = jnp.asarray(fills, d).reshape((len(fills),) + (1,) * (len(shape) - 2))
        if len(shape) == 1:  # a scalar's states: a (k,) vector
            return jnp.asarray(fills, d)
        return jnp.broadcast_to(fill, shape).astype(d)

    return jax.tree.map(leaf, params)


def mask_padding(c: IndexedSlices, new_rows: jax.Array) -> jax.Array:
    """Zero the rows of padding slots (keeps the padding convention exact)."""
    valid = _coalesce.rows_where(slices.valid_mask(c), new_rows.ndim)
    return jnp.where(valid, new_rows, jnp.zeros((), new_rows.dtype))


def abs_sq(x: jax.Array) -> jax.Array:
    return (x.conj() * x).real


def zeros_like(tree: Any, dtype: Any = None) -> Any:
    return jax.tree.map(lambda p: jnp.zeros_like(p, dtype=dtype), tree)


def coalesce_all(
    name: str, updates: Any, method: str = "auto", max_distinct: Any = None
) -> tuple[Any, list[jax.Array | None]]:
    """Every slices leaf of ``updates`` coalesced (free where it is already).

    Returns ``(updates, measured)``: ``measured`` holds, per leaf of the
    result (``jax.tree.leaves`` with ``None`` and slices as leaves), the
    squared norm the native coalescing kernel measured, or ``None``
    (:func:`jaxslices.slices.norm_of_leaves` reads it).
    """
    bounds = leaf_bounds(name, max_distinct, updates)
    measured: dict[Any, jax.Array] = {}

    def leaf(path, x, bound):
        if not isinstance(x, IndexedSlices):
            return x
        if not (x.unique_indices and bound is None) and kernel_path.route(
            where(name, path), tables=(x.values,)
        ):  # the coalescing kernel; its XLA path is jaxslices.coalesce's
            done = native_leaf(
                name, path, x, Native(_COALESCE_SPEC), bound, want_sumsq=True
            )
            if done is not None:
                out, _, measured[path] = done
                return out
        return coalesce_for_update(x, method, bound, where(name, path))

    out = jax.tree_util.tree_map_with_path(leaf, updates, bounds, is_leaf=is_leaf)
    paths = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_leaf)[0]
    return out, [measured.get(path) for path, _ in paths]


StateEntry = tuple[str, Any] | tuple[str, Any, int]


def _coalesce_native(g, st, p, hp, cfg):
    return g, ()


_COALESCE_SPEC = kernel_ops.RuleSpec("coalesce", _coalesce_native)


class Native(NamedTuple):
    """A rule's native kernel (:mod:`jaxslices.kernels`): its spec and hyperparameters.

    ``hp``: the scalars the kernel and the spec's XLA reference read (traced
    values welcome, e.g. a schedule's learning rate).
    """

    spec: kernel_ops.RuleSpec
    hp: tuple[Any, ...] = ()
    refuse: str | None = None  # why this configuration takes the XLA path


def native_leaf(
    name: str,
    path: Any,
    g: IndexedSlices,
    native: Native,
    bound: int | None,
    state: Any = None,
    k: int = 0,
    p: Any = None,
    *,
    method: str = "auto",
    want_sumsq: bool = False,
) -> tuple[IndexedSlices, Any, Any] | None:
    """One sparse leaf through the row-wise op, or ``None`` (the general path).

    ``None`` where the op does not express the configuration
    (:func:`unexpressed`; recorded for ``explain``). Otherwise
    :func:`kernel_ops.rowwise` is bound whatever the path, with
    :func:`kernel_path.decide`'s reason: natively the kernel sums the
    gradient's rows per distinct id (reading a bag's pooled gradient
    directly, see :func:`jaxslices.slices.with_recipe`), applies the rule to
    each distinct row and its ``state`` row in place; on the XLA path the
    op's reference does the same on the gradient's rows (float32 rows for a
    low-precision gradient, as the general path reads them), coalescing by
    ``method``. Returns ``(update, new_state, sumsq)``, the update coalesced
    (and holding the op's float32 rows as its recipe). ``state`` is packed
    ``(V, k, *row)`` when ``k``.
    """
    label = where(name, path)
    why = unexpressed(native, g, state, p)
    if why:
        kernel_path.note(label, why)
        return None
    reason = kernel_path.decide(state, tables=(g.values, p))
    if not reason:
        recipe = slices.kernel_input(g, label)
    else:  # the rows the general path reads, laid out for the scatter into the state
        low = _rounding.is_low_precision(g.dtype)
        values = (slices.float32_rows(g) if low else g).values
        target = p if state is None else state
        if target is not None:
            values = _spmd.replicate_rows(target, values)
        recipe = PooledGradient.of_rows(values)
    n = g.num_slices
    capacity = n if bound is None else min(bound, n)
    new_state, uids, rows, count, sumsq = kernel_ops.rowwise(
        recipe,
        g.indices,
        num_rows=g.dense_shape[0],
        spec=native.spec,
        hp=native.hp,
        params=p,
        state=state,
        capacity=capacity,
        coalesced=g.unique_indices,
        indices_sorted=g.indices_sorted,
        method=method,
        want_sumsq=want_sumsq,
        reason=reason,
        label=label,
    )
    if capacity < n:  # the distinct-row bound: more rows raise, none is dropped
        rows, uids = _errors.raise_if(
            count > capacity,
            (rows, uids),
            functools.partial(slices._too_many_rows, size=capacity, where=label),
            count,
            # The op's outputs carry no mesh: the inputs say where to check.
            like=[x for x in (g.indices, g.values, p, state) if x is not None],
        )
    valid = (uids < g.dense_shape[0])[:, None]
    values = jnp.where(valid, rows, jnp.zeros((), rows.dtype))
    values = values.reshape((capacity, *g.row_shape)).astype(g.dtype)
    # The kernel's ids come in order of first appearance; the reference's as
    # jaxslices.coalesce orders them (`method`), which the flags then say.
    kept = g.unique_indices and (g.indices_sorted or method in _coalesce.UNSORTED_OK)
    sorted_ = bool(reason) and (
        g.indices_sorted if kept else method not in _coalesce.UNSORTED_OK
    )
    out = slices._with_flags(
        IndexedSlices(values, uids, g.dense_shape),
        unique_indices=True,
        indices_sorted=sorted_,
    )
    out = slices.with_recipe(out, PooledGradient(rows))
    return out, new_state, sumsq


def unexpressed(native: Native, g: IndexedSlices, state: Any, p: Any) -> str:
    """Why the row-wise op does not express this sparse leaf's configuration
    (``""``: it does): the rule's own refusal (``Native.refuse``), or dtypes
    it does not take (a float32, bfloat16 or float16 gradient and
    parameters, a float32 state). Never a question of the platform."""
    if native.refuse is not None:
        return native.refuse
    return kernel_path.dtype_reason(state, tables=(g.values, p))


def rowwise_update(
    name: str,
    rule: Rule,
    updates: Any,
    states: Sequence[StateEntry] = (),
    params: Any = None,
    *,
    state_shape: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None,
    method: str = "auto",
    max_distinct: Any = None,
    native: Native | None = None,
    stochastic_rounding: bool | None = None,
) -> tuple[Any, tuple[Any, ...]]:
    """Apply ``rule`` to every leaf of ``updates``: dense whole, sparse by rows.

    Args:
      name: the public transform's name, for error messages.
      rule: ``rule(g, states, p) -> (update, new_states)`` (module docstring).
      updates: the updates tree (dense arrays, slices, ``None``).
      states: ``(name, tree)`` pairs, each tree with the leaf paths of
        ``updates``, or ``(name, tree, k)`` triples for packed trees whose
        leaves hold ``k`` states side by side (:func:`packed_shape`). The rule
        receives the states in this order, a packed tree's ``k`` one by one.
      params: the params tree, or ``None`` when the rule does not read them
        (the rule then gets ``p=None``).
      state_shape: ``dense_shape -> shape`` of each state (of each of a packed
        leaf's states); default: the same shape as the parameter.
      method: the coalescing method (:func:`jaxslices.coalesce`); slices that
        arrive coalesced (``unique_indices``) are not coalesced again.
      max_distinct: the distinct-row bound of sparse leaves (an ``int``, or a
        pytree prefix of ``updates`` with an ``int | None`` per leaf); ``None``:
        one slot per lookup.
      native: the rule's native kernel, taken for a sparse leaf when
        :func:`jaxslices.kernels` allow it (:func:`native_leaf`); at most one
        state tree.
      stochastic_rounding: how bfloat16/float16 states are written: ``None``
        stochastically for sparse leaves and to nearest for dense ones
        (Optax's numbers); ``True`` stochastically for both; ``False`` to
        nearest. Rounded stochastically, a state is read and updated in
        float32 and rounded once when written.

    Returns:
      ``(new_updates, new_state_trees)``; a ``None`` update keeps its state.
    """
    entries = [(e[0], e[1], e[2] if len(e) == 3 else 0) for e in states]
    others = [(n, t) for n, t, _ in entries]
    others += [("params", params)] if params is not None else []
    n_trees = len(entries)
    bounds = leaf_bounds(name, max_distinct, updates)

    def leaf(path, g, bound, *xs):
        st, p = xs[:n_trees], (xs[n_trees] if params is not None else None)
        if g is None:
            return Out(None, *st)
        # NumPy arrays, Python scalars: what JAX accepts, made arrays once here.
        g = g if isinstance(g, IndexedSlices) else jnp.asarray(g)
        st = tuple(jnp.asarray(x) for x in st)
        p = None if p is None else jnp.asarray(p)
        shape = None if state_shape is None else state_shape(tuple(g.shape))
        for x, (x_name, _, k) in zip(st, entries, strict=True):
            want = packed_shape(shape or tuple(g.shape), k) if k else shape
            check_leaf(name, path, g, x, x_name, want)
        check_leaf(name, path, g, p, "params")

        def run(g_rows, st_rows, p_rows, split, join, wide=False, g_dtype=None):
            parts = []
            for x, (_, _, k) in zip(st_rows, entries, strict=True):
                parts += list(split(x, k)) if k else [x]
            token = _ROUNDED_LATER.set(wide)
            dtype_token = _GRAD_DTYPE.set(g_dtype)
            try:
                upd, new = rule(g_rows, tuple(parts), p_rows)
            finally:
                _ROUNDED_LATER.reset(token)
                _GRAD_DTYPE.reset(dtype_token)
            if any(k for *_, k in entries):
                # The new states as buffers of their own, before they are
                # packed. Else XLA fuses the rule into the packing and again
                # into the update: the rule computed twice (measured 2-5x
                # slower on 16384 rows), and on dense leaves other roundings
                # than Optax's (with these buffers: the same bits).
                new = jax.lax.optimization_barrier(tuple(new))
            packed, i = [], 0
            for x, (_, _, k) in zip(st_rows, entries, strict=True):
                packed.append(join(new[i : i + k], x) if k else new[i])
                i += k or 1
            return upd, packed

        low = [_rounding.is_low_precision(x.dtype) for x in st]
        sr = stochastic_rounding
        if not isinstance(g, IndexedSlices):
            if not (sr and any(low)):
                upd, new = run(g, st, p, unpack, pack)
                return Out(upd, *new)
            wide = tuple(
                x.astype(jnp.float32) if lo else x
                for x, lo in zip(st, low, strict=True)
            )
            upd, new = run(g, wide, p, unpack, pack, wide=True)
            new = tuple(
                _round_state(n, x.dtype, state_seed(name, i)) if lo else n
                for i, (n, x, lo) in enumerate(zip(new, st, low, strict=True))
            )
            return Out(upd, *new)
        sr = sr is not False and any(low)
        if native is not None and n_trees <= 1:
            k = entries[0][2] if entries else 0
            st0 = st[0] if st else None
            done = native_leaf(name, path, g, native, bound, st0, k, p, method=method)
            if done is not None:
                return Out(done[0], *([done[1]] if st else []))
        # A low-precision table's gradient or state: one float32 result per
        # entry, as the kernels compute it. The gradient's float32 rows
        # (summed in float32), the state read in float32, the rule in
        # float32, each state written rounded once into its dtype
        # (stochastically when `sr`; a low-precision state on its write, a
        # state Optax keeps in the gradient's dtype by the rule:
        # `grad_dtype`), the update kept in float32 (the apply rounds it once).
        g_dtype = g.dtype
        wide = any(low) or _rounding.is_low_precision(g_dtype)
        if wide:
            g = slices.float32_rows(g)
        c = coalesce_for_update(g, method, bound, where(name, path))
        p_rows = None if p is None else rows(p, c)
        # A packed (V, k, *row) leaf is gathered and scattered as (V, k * R)
        # rows (R the size of a row, a free reshape), its states side by side
        # in each: XLA:CPU gathers and scatters such rows several times
        # faster than (1, k, *row) slices (measured: docs/design.md).
        flat = tuple(
            x.reshape(x.shape[0], math.prod(x.shape[1:])) if k else x
            for x, (*_, k) in zip(st, entries, strict=True)
        )
        row_shape = tuple(shape or g.shape)[1:]  # of each packed state

        def split(x, k):
            r = x.shape[1] // k
            return tuple(
                x[:, i * r : (i + 1) * r].reshape(x.shape[:1] + row_shape)
                for i in range(k)
            )

        def join(parts, x):
            dtype = jnp.result_type(x)
            # Explicit sizes: a zero-row gradient has no -1 to infer.
            rows_ = [
                jnp.asarray(q).reshape(q.shape[0], math.prod(q.shape[1:]))
                for q in parts
            ]
            return jnp.concatenate([_store_as(q, dtype) for q in rows_], axis=1)

        st_rows = tuple(rows(f, c) for f in flat)
        if wide:
            st_rows = tuple(r.astype(jnp.float32) for r in st_rows)
            if p_rows is not None:
                p_rows = p_rows.astype(jnp.promote_types(p_rows.dtype, jnp.float32))
        upd, new = run(
            c.values, st_rows, p_rows, split, join, wide=any(low), g_dtype=g_dtype
        )
        origin = _spmd.noise_origin(path, g.dense_shape[0]) if sr else None
        new_st = tuple(
            set_rows(f, c, r, state_seed(name, i) if sr else None, origin).reshape(
                x.shape
            )
            for i, (f, x, r) in enumerate(zip(flat, st, new, strict=True))
        )
        upd = mask_padding(c, jnp.asarray(upd))
        if not wide:
            return Out(_replace_values(c, upd), *new_st)
        # The update in the gradient's dtype, its float32 rows as its recipe
        # (what the apply reads, on both paths).
        out = _replace_values(c, upd.astype(g_dtype))
        flat_upd = upd.reshape(upd.shape[0], math.prod(upd.shape[1:]))
        out = slices.with_recipe(out, PooledGradient(flat_upd.astype(jnp.float32)))
        return Out(out, *new_st)

    check_stochastic_rounding(stochastic_rounding, name)
    for other_name, other in others:
        _leaves.check_structure(
            f"jaxslices.{name}", updates, "updates", other, other_name
        )
    out = jax.tree_util.tree_map_with_path(
        leaf, updates, bounds, *(tree for _, tree in others), is_leaf=is_leaf
    )
    new_updates, *new_states = unzip(out, 1 + n_trees)
    return new_updates, tuple(new_states)
