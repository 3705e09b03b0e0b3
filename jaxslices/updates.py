"""``apply_updates``: add an updates tree with ``IndexedSlices`` leaves to params.

The ``scatter_*`` family lives in :mod:`jaxslices.slices`; this module applies a
whole updates tree, as :func:`optax.apply_updates` does, with a row scatter for
every sparse leaf so that, under ``jax.jit(..., donate_argnums=...)``, a table
is updated in place and a step costs what the batch touches.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import _indexed, _leaves, _rounding, slices
from ._indexed import IndexedSlices, check_slices

__all__ = ["apply_updates"]

_WHERE = "jaxslices.apply_updates"


def _apply_leaf(
    path: Any,
    p: Any,
    u: Any,
    stochastic: bool | None = None,
    seed: Any = None,
    origin: Any = None,
) -> Any:
    where = _leaves.label(_WHERE, path)
    if p is None:
        return None
    if u is None:
        return p
    if isinstance(u, IndexedSlices):
        check_slices(u, where)
    p = jnp.asarray(p)
    u_shape = u.shape if isinstance(u, IndexedSlices) else jnp.shape(u)
    if tuple(p.shape) != tuple(u_shape):
        kind = "update has shape"
        if isinstance(u, IndexedSlices):
            kind = "IndexedSlices update has dense shape"
        raise ValueError(
            f"{where}: the parameter has shape {tuple(p.shape)} but the {kind} "
            f"{tuple(u_shape)}. Updates must have their parameter's shape (for "
            "slices: dense_shape == param.shape); were the updates computed for "
            "these params?"
        )
    low = _rounding.is_low_precision(p.dtype)
    if isinstance(u, IndexedSlices):
        if low:
            sr = True if stochastic is None else stochastic
            seed = _rounding.step_seed(seed, _indexed.step_of(u))
            return slices._scatter_rounded(
                p, u, where, stochastic=sr, seed=seed, origin=origin
            )
        return slices._scatter_add(p, u, where)  # lays the rows out on a mesh first
    if low and stochastic:  # dense leaves round stochastically when asked
        total = p.astype(jnp.float32) + jnp.asarray(u).astype(jnp.float32)
        return _rounding.round_to(total, p.dtype, stochastic=True, seed=seed)
    return (p + u).astype(p.dtype)


def apply_updates(
    params: Any,
    updates: Any,
    *,
    stochastic_rounding: bool | None = None,
    key: Any = None,
) -> Any:
    """Add ``updates`` to ``params``, leaf by leaf; sparse leaves by scatter-add.

    For an :class:`~jaxslices.IndexedSlices` update this is
    ``param.at[indices].add(values)`` (duplicates summed, padding and invalid
    slots dropped, values cast to the parameter's dtype first): under
    ``jax.jit(step, donate_argnums=...)`` with the params donated, the table
    is updated in place and only the touched rows are read and written. A
    dense update is added as :func:`optax.apply_updates` does, ``(p +
    u).astype(p.dtype)``. A ``None`` parameter stays ``None``; a ``None``
    update leaves its parameter unchanged.

    **Low-precision tables** (``bfloat16``, ``float16``): a sparse update is
    summed per row in float32 (duplicates first), added to the row in
    float32 and written back with one rounding per row and step;
    stochastically by default (as FBGEMM), so that an update smaller than
    half an ulp of the weight survives on average (docs/optax.md,
    "Low-precision tables"). ``stochastic_rounding=False`` rounds to
    nearest. Dense low-precision leaves round to nearest, as Optax, unless
    ``stochastic_rounding=True``. The rounding noise is a hash of the seed,
    the entry's row and column and its float32 value
    (:mod:`jaxslices._rounding`), bitwise the same on the XLA path and the
    native kernels: independent per entry, and per step, the seed mixing
    ``key`` with the step count a jaxslices optimizer gives its sparse
    updates of a low-precision table (no ``key`` needed; ``key`` makes
    another reproducible draw, e.g. per run).

    :func:`optax.apply_updates` also works with slices updates (it computes
    ``p + u``, which ``IndexedSlices`` turns into a scatter-add); this function
    adds the integer-indices guard and error messages that name the leaf.

    Args:
      params: a tree of arrays.
      updates: a tree of the same structure whose leaves are arrays of the
        parameter's shape, ``IndexedSlices`` whose ``dense_shape`` is the
        parameter's shape, or ``None``.
      stochastic_rounding: how results are rounded into bfloat16/float16
        params: ``None`` (default) stochastically for sparse updates and to
        nearest for dense ones; ``True`` stochastically for both; ``False``
        to nearest. Float32 and wider params are unaffected.
      key: the seed of stochastic rounding: ``None`` (0), an integer, or a
        ``jax.random`` key; mixed with the optimizer's step count where the
        updates carry one (the jaxslices optimizers' on a low-precision
        table).

    Returns:
      The updated params, each leaf in its original dtype.

    Raises:
      ValueError: the trees differ (the message names the first leaf that is in
        one but not the other), or an update's (dense) shape is not its
        parameter's shape.
      TypeError: a slices leaf has non-integer indices (a stock leaf-wise Optax
        transform mapped over them).

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> params = {"emb": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
      >>> upd = jaxslices.IndexedSlices(jnp.ones((2, 2)), jnp.array([1, 3]), (3, 2))
      >>> new = jaxslices.apply_updates(params, {"emb": upd, "b": jnp.ones(2)})
      >>> new["emb"]
      Array([[0., 0.],
             [1., 1.],
             [0., 0.]], dtype=float32)
    """
    return apply_leaves(params, updates, stochastic_rounding, key)


def apply_leaves(
    params: Any,
    updates: Any,
    stochastic_rounding: bool | None,
    key: Any,
    origins: Any = None,
) -> Any:
    """:func:`apply_updates`, with ``origins``: a function ``leaf index ->``
    where the rounding noise reads the rows of that leaf of
    ``jax.tree.leaves(params)`` (:func:`jaxslices.kernels._ops.noise_rows`;
    ``None``: the rows themselves). A sharding plan's step gives its buffers'
    rows the rows of the collection's buffers, so it rounds as one device."""
    _leaves.check_structure(_WHERE, params, "params", updates, "updates")
    if not (stochastic_rounding is None or isinstance(stochastic_rounding, bool)):
        raise TypeError(
            f"{_WHERE}: `stochastic_rounding` must be None, True or False (a "
            f"Python value: it chooses the program); got {stochastic_rounding!r}."
        )
    seed = _rounding.seed_from(key)
    if origins is None:
        return jax.tree_util.tree_map_with_path(
            lambda path, p, u: _apply_leaf(path, p, u, stochastic_rounding, seed),
            params,
            updates,
            is_leaf=_leaves.is_leaf,
        )
    index = iter(range(len(jax.tree.leaves(params))))

    def leaf(path, p, u):
        origin = None if p is None else origins(next(index))
        return _apply_leaf(path, p, u, stochastic_rounding, seed, origin)

    return jax.tree_util.tree_map_with_path(
        leaf, params, updates, is_leaf=_leaves.is_leaf
    )
