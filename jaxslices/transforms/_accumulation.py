"""Gradient accumulation over micro-batches with ``IndexedSlices`` gradients.

:class:`MultiSteps` has :class:`optax.MultiSteps`' interface and semantics
(``init``, ``update``, ``has_updated``, ``gradient_transformation``; the inner
optimizer runs once every ``k`` micro-steps on the mean, or sum, of the ``k``
gradients; in between the updates are zero). Stock ``optax.MultiSteps`` keeps a
dense ``(V, D)`` accumulator per table and fails on a tree holding slices
(pytree structure error); here a sparse leaf is accumulated in a fixed-size
buffer of slices instead, so a micro-step costs what its batch touches.

**Capacity.** JAX needs static shapes, and ``init`` sees only the params, so the
number of slots of each table's buffer is given up front: ``capacity`` is a
pytree prefix of the params with an ``int`` (slots) for every leaf whose
gradients arrive as :class:`~jaxslices.IndexedSlices` and ``None`` for dense
leaves (a single ``int``: every leaf is sparse). With a constant
``every_k_schedule=k`` and ``capacity >= k * N`` (``N`` slots per micro-batch
gradient, known when ``update`` is traced) the micro-gradients are simply
concatenated: nothing can overflow. A smaller capacity (or a schedule) is
allowed: when the next micro-gradient does not fit, the buffer and it are
coalesced (duplicate rows summed, :func:`jaxslices.coalesce`) and the distinct
rows kept; if even the distinct rows do not fit, the step raises (also under
``jit``, on every device of a mesh, like :func:`jaxslices.check_ids`): a
gradient is never dropped silently.
:func:`jaxslices.capacity.estimate_multisteps_capacity` estimates a capacity
from sample micro-batches (the most distinct rows of ``k`` consecutive ones,
with a margin).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from .. import _errors, _leaves, _typed_indices, slices
from .._indexed import IndexedSlices, _replace_values, valid_mask

__all__ = ["MultiSteps", "MultiStepsState"]

_NAME = "jaxslices.MultiSteps"


class MultiStepsState(NamedTuple):
    """State of :class:`MultiSteps` (:class:`optax.MultiStepsState` plus fills).

    Attributes:
      mini_step: micro-steps accumulated since the last inner update.
      gradient_step: inner updates so far.
      inner_opt_state: the wrapped optimizer's state.
      acc_grads: per leaf, a dense running mean/sum (as Optax) or, for sparse
        leaves, an ``IndexedSlices`` buffer of ``capacity`` slots holding the
        sum of the micro-gradients (unused slots are padding).
      acc_fill: per sparse leaf, the number of used buffer slots (``None`` for
        dense leaves).
      skip_state: what ``should_skip_update_fn`` returned last.
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    inner_opt_state: Any
    acc_grads: Any
    acc_fill: Any
    skip_state: Any = ()


_is_leaf = _leaves.is_leaf


def _where(path: Any) -> str:
    return _leaves.label(_NAME, path)


def _no_skip(updates: Any, gradient_step: Any, params: Any):
    del updates, gradient_step, params
    return jnp.array(False, dtype=jnp.bool_), ()


def _overflow_error(distinct: int, *, capacity: int, where: str) -> ValueError:
    return ValueError(
        f"{where}: the accumulated gradient touches {distinct} distinct rows but "
        f"the buffer has capacity={capacity} slots. Increase `capacity` (with a "
        "constant every_k_schedule=k, capacity >= k * slots per micro-batch never "
        "overflows) or accumulate fewer steps."
    )


class MultiSteps:
    """:class:`optax.MultiSteps` for gradient trees with ``IndexedSlices`` leaves.

    Accumulates ``k = every_k_schedule(gradient_step)`` micro-batch gradients
    and calls the wrapped optimizer once on their mean (``use_grad_mean=True``,
    as Optax) or sum; the updates of the other micro-steps are zero (slices
    with only padding slots for sparse leaves). Dense leaves are accumulated
    exactly as :class:`optax.MultiSteps` does (running mean in
    ``accumulator_dtype``). Sparse leaves are summed into a buffer of
    ``capacity`` slots and divided by the number of micro-steps when the inner
    optimizer runs, so it sees one ``IndexedSlices`` of ``capacity`` slots: the
    concatenation of the micro-gradients (or their coalesced sum, see below).

    See the module docstring for ``capacity``: with a constant ``k`` and
    ``capacity >= k * N`` accumulation is a concatenation; smaller buffers
    coalesce when full and raise rather than drop a row.

    The inner optimizer runs under :func:`jax.lax.cond`, only on the micro-step
    that completes an accumulation (Optax runs it every micro-step and selects).

    Args:
      opt: the wrapped optimizer (jaxslices transforms, or stock Optax ones on
        dense leaves).
      every_k_schedule: an ``int`` or a function ``gradient_step -> k``.
      use_grad_mean: average (``True``) or sum the micro-gradients.
      should_skip_update_fn: as in :class:`optax.MultiSteps`: ``(updates,
        gradient_step, params) -> (bool scalar, skip_state)``; a skipped
        micro-step leaves the state unchanged (``skip_state`` apart).
      accumulator_dtype: dtype of the accumulators (float32 as in Optax).
      capacity: slots of the accumulation buffer of each sparse leaf: a pytree
        prefix of the params of ``int`` (sparse leaf) or ``None`` (dense leaf),
        a single ``int`` for every leaf, or a callable ``params -> such a
        tree``. ``None`` (default): every leaf dense.
        :func:`jaxslices.capacity.estimate_multisteps_capacity` estimates it
        from sample micro-batches.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> params = {"emb": jnp.zeros((4, 1))}
      >>> ms = jaxslices.MultiSteps(jaxslices.sgd(1.0), every_k_schedule=2,
      ...                           capacity={"emb": 2})
      >>> state = ms.init(params)
      >>> for row in (1, 3):
      ...     g = {"emb": jaxslices.IndexedSlices(jnp.ones((1, 1)), jnp.array([row]),
      ...                                         (4, 1))}
      ...     updates, state = ms.update(g, state, params)
      ...     params = jaxslices.apply_updates(params, updates)
      >>> params["emb"].ravel(), bool(ms.has_updated(state))
      (Array([ 0. , -0.5,  0. , -0.5], dtype=float32), True)
    """

    def __init__(
        self,
        opt: optax.GradientTransformation,
        every_k_schedule: int | Callable[[ArrayLike], ArrayLike],
        use_grad_mean: bool = True,
        should_skip_update_fn: Callable[..., Any] | None = None,
        accumulator_dtype: Any = jnp.float32,
        *,
        capacity: Any = None,
    ):
        self._opt = optax.with_extra_args_support(opt)
        if isinstance(every_k_schedule, (int, np.integer)):
            if every_k_schedule < 1:
                raise ValueError(
                    f"{_NAME}: every_k_schedule must be >= 1, got {every_k_schedule}."
                )
            k = int(every_k_schedule)
            self._static_k: int | None = k
            self._every_k_schedule = lambda step: k
        else:
            self._static_k = None
            self._every_k_schedule = every_k_schedule
        self._use_grad_mean = use_grad_mean
        self._should_skip_update_fn = should_skip_update_fn or _no_skip
        self._accumulator_dtype = jnp.dtype(accumulator_dtype)
        self._capacity = capacity

    # ---------------------------------------------------------------- init
    def _capacities(self, params: Any) -> Any:
        """``capacity`` broadcast to one entry (int or None) per params leaf."""
        cap = self._capacity
        if callable(cap):
            cap = cap(params)
        other_mapping = isinstance(params, Mapping) and type(params) is not dict
        if type(cap) is dict and other_mapping:
            # A dict for params of another mapping type (Flax NNX's nnx.State,
            # which nnx.Optimizer passes): the same keys, in that type.
            cap = type(params)(cap)

        def check(c):
            if c is None:
                return None
            if not isinstance(c, (int, np.integer)) or isinstance(c, bool) or c < 1:
                raise ValueError(
                    f"{_NAME}: `capacity` entries must be positive ints (slots) or "
                    f"None (dense leaf), got {c!r}."
                )
            return int(c)

        def broadcast(c, sub):
            c = check(c)
            return jax.tree.map(lambda _: c, sub)

        try:
            return jax.tree.map(
                broadcast, cap, params, is_leaf=lambda x: x is None or np.isscalar(x)
            )
        except ValueError as e:
            raise ValueError(
                f"{_NAME}: `capacity` must be a pytree prefix of the params (an int "
                "or None per table), e.g. {'emb': 4096, 'w': None}; got "
                f"{cap!r}. ({e})"
            ) from e

    def init(self, params: Any) -> MultiStepsState:
        """The initial state: empty accumulators, the wrapped optimizer's state."""
        caps = self._capacities(params)
        dtype = self._accumulator_dtype

        def acc(c, p):
            if c is None:
                return jnp.zeros(jnp.shape(p), dtype)
            if jnp.ndim(p) < 1:
                raise ValueError(
                    f"{_NAME}: a capacity was given for a scalar parameter; only "
                    "tables (arrays with rows) can receive IndexedSlices."
                )
            return _leaves.padding_slices(c, tuple(jnp.shape(p)), dtype)

        is_none = lambda x: x is None  # noqa: E731 - None marks a dense leaf
        acc_grads = jax.tree.map(acc, caps, params, is_leaf=is_none)
        acc_fill = jax.tree.map(
            lambda c: None if c is None else jnp.zeros([], jnp.int32),
            caps,
            is_leaf=is_none,
        )
        gradient_step = jnp.zeros([], jnp.int32)
        zeros = jax.tree.map(jnp.zeros_like, params)
        _, skip_state = self._should_skip_update_fn(zeros, gradient_step, params)
        return MultiStepsState(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_step=gradient_step,
            inner_opt_state=self._opt.init(params),
            acc_grads=acc_grads,
            acc_fill=acc_fill,
            skip_state=skip_state,
        )

    # -------------------------------------------------------------- update
    def _append(self, path, buf: IndexedSlices, fill, g: IndexedSlices):
        """Add ``g``'s slots to the buffer: concatenate, or coalesce when full."""
        where = _where(path)
        if g.dense_shape != buf.dense_shape:
            raise ValueError(
                f"{where}: the gradient has dense shape {g.dense_shape} but the "
                f"parameter has shape {buf.dense_shape}."
            )
        cap, n = buf.num_slices, g.num_slices
        if n > cap:
            raise ValueError(
                f"{where}: a micro-batch gradient has {n} slots but `capacity` is "
                f"{cap}; give this leaf at least {n} slots (k * {n} to never "
                "coalesce)."
            )
        g_values = g.values.astype(buf.dtype)
        g_idx = g.indices.astype(buf.indices.dtype)

        def append(buf, fill):
            zero = (0,) * (buf.values.ndim - 1)
            values = jax.lax.dynamic_update_slice(buf.values, g_values, (fill, *zero))
            idx = jax.lax.dynamic_update_slice(buf.indices, g_idx, (fill,))
            return IndexedSlices(values, idx, buf.dense_shape), fill + n

        if self._static_k is not None and cap >= self._static_k * n:
            return append(buf, fill)  # at most k appends between resets

        def merge(buf, fill):
            both = IndexedSlices(
                jnp.concatenate([buf.values, g_values]),
                jnp.concatenate([buf.indices, g_idx]),
                buf.dense_shape,
            )
            c = slices.coalesce(both)  # distinct valid rows first, then padding
            distinct = jnp.sum(valid_mask(c), dtype=jnp.int32)
            # The kept slots are read from a start that the check guards, so
            # nothing downstream runs before it (0 unless it raises).
            start = _errors.raise_if(
                distinct > cap,
                jnp.zeros((), jnp.int32),
                functools.partial(_overflow_error, capacity=cap, where=where),
                distinct,
                like=(buf.values,),
            )
            kept = IndexedSlices(
                jax.lax.dynamic_slice_in_dim(c.values, start, cap),
                jax.lax.dynamic_slice_in_dim(c.indices, start, cap),
                buf.dense_shape,
            )
            return kept, jnp.minimum(distinct, cap).astype(fill.dtype)

        return jax.lax.cond(fill + n <= cap, append, merge, buf, fill)

    def update(
        self,
        updates: Any,
        state: MultiStepsState,
        params: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, MultiStepsState]:
        """Accumulate ``updates``; every ``k``-th call run the wrapped optimizer.

        The steps, each a method below: decide whether to skip
        (:meth:`_should_skip`), add the micro-gradient to the accumulators
        (:meth:`_accumulate`), read them as one gradient (:meth:`_gradient`),
        run the wrapped optimizer on the ``k``-th micro-step only
        (:meth:`_emit`), count the micro-step and empty the accumulators after
        an inner step (:func:`_advance`), and keep the old state on a skipped
        micro-step.
        """
        state = state._replace(acc_grads=_slices_back(state.acc_grads, updates))
        should_skip, skip_state = self._should_skip(updates, state, params)
        _leaves.check_structure(
            _NAME, updates, "updates", state.acc_fill, "the params given to init"
        )
        k_steps = self._every_k_schedule(state.gradient_step)
        acc_grads, acc_fill = self._accumulate(updates, state)
        grads = self._gradient(acc_grads, updates, state.mini_step)
        emit = state.mini_step >= k_steps - 1
        new_updates, new_inner, zero = self._emit(
            emit, grads, state.inner_opt_state, params, extra_args
        )
        done = _advance(state, emit, new_inner, acc_grads, acc_fill, skip_state)
        skipped = state._replace(skip_state=skip_state)
        return jax.lax.cond(
            should_skip,
            lambda _: (zero, skipped),
            lambda _: (new_updates, done),
            None,
        )

    def _should_skip(self, updates: Any, state: MultiStepsState, params: Any):
        """``should_skip_update_fn``'s answer, checked: ``(bool scalar, state)``."""
        should_skip, skip_state = self._should_skip_update_fn(
            updates, state.gradient_step, params
        )
        if (jnp.dtype(should_skip.dtype), jnp.shape(should_skip)) != (
            jnp.dtype(jnp.bool_),
            (),
        ):
            raise ValueError(
                f"{_NAME}: should_skip_update_fn must return a boolean scalar, got "
                f"dtype {should_skip.dtype} and shape {jnp.shape(should_skip)}."
            )
        return should_skip, skip_state

    def _accumulate(self, updates: Any, state: MultiStepsState):
        """``(acc_grads, acc_fill)`` with this micro-gradient added.

        Dense leaves: Optax's running mean (or sum) in ``accumulator_dtype``;
        sparse leaves: their slots appended to the buffer (:meth:`_append`).
        """
        n_acc = state.mini_step

        def leaf(path, g, acc, fill):
            if g is None:
                return _Pair(acc, fill)
            sparse_acc = isinstance(acc, IndexedSlices)
            if isinstance(g, IndexedSlices) and not sparse_acc:
                raise TypeError(
                    f"{_where(path)}: the gradient is an IndexedSlices but "
                    "`capacity` gives this leaf no buffer, so it would be "
                    "accumulated in a dense (V, ...) array. Pass capacity={..., "
                    f"leaf: slots}} to {_NAME}, e.g. k * (slots per micro-batch) "
                    f"= {self._static_k or 'k'} * {g.num_slices}."
                )
            if sparse_acc and not isinstance(g, IndexedSlices):
                raise TypeError(
                    f"{_where(path)}: `capacity` gives this leaf a buffer of "
                    "IndexedSlices but the gradient is a dense array; set its "
                    "capacity to None."
                )
            if sparse_acc:
                return _Pair(*self._append(path, acc, fill, g))
            if self._use_grad_mean:  # Welford mean, as optax.MultiSteps
                new = acc + (g - acc) / (n_acc + 1)
            else:
                new = acc + g
            return _Pair(new.astype(self._accumulator_dtype), fill)

        pairs = jax.tree_util.tree_map_with_path(
            leaf, updates, state.acc_grads, state.acc_fill, is_leaf=_is_leaf
        )
        is_pair = lambda x: isinstance(x, _Pair)  # noqa: E731
        acc_grads = jax.tree.map(lambda x: x.acc, pairs, is_leaf=is_pair)
        acc_fill = jax.tree.map(lambda x: x.fill, pairs, is_leaf=is_pair)
        return acc_grads, acc_fill

    def _gradient(self, acc_grads: Any, updates: Any, n_acc: Any) -> Any:
        """The accumulated gradient, in each micro-gradient's dtype.

        Sparse buffers hold the sum: divided by the number of micro-steps for
        the mean (dense leaves hold the mean already).
        """

        def leaf(acc, g):
            if g is None:
                return None
            if isinstance(acc, IndexedSlices):
                values = acc.values
                if self._use_grad_mean:
                    values = values / (n_acc + 1).astype(values.dtype)
                return _replace_values(acc, values.astype(g.dtype))
            return acc.astype(jnp.asarray(g).dtype)

        return jax.tree.map(leaf, acc_grads, updates, is_leaf=_is_leaf)

    def _emit(self, emit: Any, grads: Any, inner_state: Any, params, extra_args):
        """The wrapped optimizer's ``(updates, state)`` where ``emit``, else zeros.

        Returns ``(updates, inner_state, zero updates)``; the optimizer runs
        under :func:`jax.lax.cond`, on the emitting micro-step only.
        """

        def run_inner(inner_state):
            return self._opt.update(grads, inner_state, params, **extra_args)

        shapes = jax.eval_shape(run_inner, inner_state)
        zero = _leaves.zero_updates(shapes[0])
        new_updates, new_inner = jax.lax.cond(
            emit,
            run_inner,
            lambda inner_state: (_leaves.zero_updates(shapes[0]), inner_state),
            inner_state,
        )
        return new_updates, new_inner, zero

    def has_updated(self, state: MultiStepsState) -> jax.Array:
        """``True`` right after a micro-step that ran the wrapped optimizer."""
        return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """This wrapper as an :class:`optax.GradientTransformationExtraArgs`."""
        return optax.GradientTransformationExtraArgs(self.init, self.update)


def _is_unpacked_slices(x: Any) -> bool:
    """A mapping of an ``IndexedSlices``' children (``values``, typed ``indices``)."""
    return (
        isinstance(x, Mapping)
        and set(x.keys()) == {"values", "indices"}
        and _typed_indices.is_typed(x["indices"])
    )


def _slices_back(acc_grads: Any, updates: Any) -> Any:
    """Accumulation buffers as ``IndexedSlices`` again, where a framework unpacked them.

    Flax NNX's ``nnx.Optimizer`` writes the new optimizer state back with
    ``nnx.update(opt_state, nnx.state(new_state))``, and ``nnx.state`` turns
    every pytree node, an ``IndexedSlices`` included, into an ``nnx.State`` of
    its children: from the second update on the buffer arrives as a mapping
    ``{"values", "indices"}``. Its typed indices (an extended dtype no other
    array has) identify it; the dense shape is the gradient's.
    """
    is_acc_leaf = lambda x: _is_leaf(x) or _is_unpacked_slices(x)  # noqa: E731
    accs, treedef = jax.tree.flatten(acc_grads, is_leaf=is_acc_leaf)
    if not any(_is_unpacked_slices(a) for a in accs):
        return acc_grads
    grads = jax.tree.leaves(updates, is_leaf=_is_leaf)
    if len(grads) != len(accs):
        return acc_grads  # check_structure explains the mismatch

    def back(a, g):
        if _is_unpacked_slices(a) and isinstance(g, IndexedSlices):
            return IndexedSlices(a["values"], a["indices"], g.dense_shape)
        return a

    return treedef.unflatten([back(a, g) for a, g in zip(accs, grads, strict=True)])


class _Pair:
    """Accumulator and fill of one leaf; a plain object so tree maps keep it."""

    __slots__ = ("acc", "fill")

    def __init__(self, acc: Any, fill: Any):
        self.acc, self.fill = acc, fill


def _advance(
    state: MultiStepsState,
    emit: Any,
    inner_opt_state: Any,
    acc_grads: Any,
    acc_fill: Any,
    skip_state: Any,
) -> MultiStepsState:
    """The state after a micro-step that was not skipped.

    Where ``emit`` (the wrapped optimizer ran), the micro-step count restarts,
    the inner step count grows and the accumulators are emptied
    (:func:`_reset`); otherwise the micro-step count grows.
    """
    reset_acc, reset_fill = _reset(acc_grads, acc_fill)
    acc_grads, acc_fill = jax.lax.cond(
        emit,
        lambda _: (reset_acc, reset_fill),
        lambda _: (acc_grads, acc_fill),
        None,
    )
    mini_step = jnp.where(emit, 0, optax.safe_increment(state.mini_step))
    gradient_step = jnp.where(
        emit, optax.safe_increment(state.gradient_step), state.gradient_step
    )
    return MultiStepsState(
        mini_step=mini_step.astype(jnp.int32),
        gradient_step=gradient_step.astype(jnp.int32),
        inner_opt_state=inner_opt_state,
        acc_grads=acc_grads,
        acc_fill=acc_fill,
        skip_state=skip_state,
    )


def _reset(acc_grads: Any, acc_fill: Any) -> tuple[Any, Any]:
    """Empty accumulators of the same shapes (dense zeros, padding buffers)."""
    acc = jax.tree.map(
        lambda a: (
            _leaves.padding_slices(a.num_slices, a.dense_shape, a.dtype)
            if isinstance(a, IndexedSlices)
            else jnp.zeros_like(a)
        ),
        acc_grads,
        is_leaf=_is_leaf,
    )
    fill = jax.tree.map(jnp.zeros_like, acc_fill)
    return acc, fill
