"""Where arrays live on a device mesh: the low-level helpers every scatter uses.

Kept apart from :mod:`jaxslices.sharding` (placement, routing, the sharded
step) so that :mod:`jaxslices.slices` can call :func:`replicate_rows` from its
scatters without importing the modules built on top of it.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _jax_compat


def replicate_rows(target: Any, tree: Any) -> Any:
    """Lay out ``tree`` (slices, their rows, their indices) whole on every device.

    The one hook every jaxslices scatter into a ``target`` table or optimizer
    state calls. Under ``jax.jit`` over a device mesh it constrains each array
    in ``tree`` to be replicated, so the partitioner all-gathers the batch's
    rows (``N x D``) and each device scatters into its own copy (replicated
    table) or its own rows (row-sharded table), instead of scattering into a
    zero table and all-reducing ``V x D``. A sharding constraint never changes
    values; outside a mesh (one device, inside ``shard_map``) it is a no-op.

    Args:
      target: the array about to be scattered into.
      tree: a pytree of arrays (an :class:`~jaxslices.IndexedSlices`, rows).

    Returns:
      ``tree``, with sharding constraints where a mesh is in use.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> s = jaxslices.IndexedSlices(jnp.ones((2, 1)), jnp.array([0, 1]), (3, 1))
      >>> jaxslices.sharding.replicate_rows(jnp.zeros((3, 1)), s) is s
      True
    """
    mesh = _jax_compat.abstract_mesh(target)
    if mesh is None or mesh.size == 1:
        return tree
    kinds = _jax_compat.axis_kinds(mesh)
    if kinds is None or kinds & {"Manual", "Explicit"}:
        # Inside shard_map every array is local already; meshes with Explicit
        # axes are not supported by jaxslices' lookups yet (docs/scale_out.md);
        # unknown axis kinds: the layout is left to XLA (correct, slower).
        return tree
    _warn_if_routed(target)
    replicated = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), tree)


# ------------------------------------------------- rows owned by each shard

_SHARDED = threading.local()


@contextmanager
def rows_sharded_over(
    axis: str, shards: int | None = None, origins: dict[str, Any] | None = None
) -> Iterator[None]:
    """While tracing a per-shard optimizer step: slices hold this shard's rows.

    :func:`jaxslices.sharding.sharded_update` and
    :meth:`jaxslices.sharding.ShardingPlan.update` with all-to-all routing
    run the optimizer inside ``shard_map`` on the rows each shard owns
    (``shards`` of them over ``axis``, shard ``k`` holding rows ``[k * R,
    (k + 1) * R)``); a quantity summed over all rows (the global norm of
    ``clip_by_global_norm``, the non-finite count of ``apply_if_finite``)
    must then be summed over the shards too (:func:`sum_over_shards`), and a
    transform that needs a row's place in the whole table (the per-table
    ones) finds it with :func:`shard_rows`. ``origins``: per leaf path
    (``jax.tree_util.keystr``), ``(static origin, sharded)``: where the
    stochastic rounding of a state row reads its row (:func:`noise_origin`).
    """
    previous = (
        getattr(_SHARDED, "axis", None),
        getattr(_SHARDED, "shards", None),
        getattr(_SHARDED, "origins", None),
    )
    _SHARDED.axis, _SHARDED.shards, _SHARDED.origins = axis, shards, origins
    try:
        yield
    finally:
        _SHARDED.axis, _SHARDED.shards, _SHARDED.origins = previous


def noise_origin(path: Any, num_rows: int) -> Any:
    """Inside :func:`rows_sharded_over` with ``origins``: the row origin
    (``kernels._ops.noise_rows``) of the leaf at ``path`` with ``num_rows``
    local rows, a sharded leaf's base its shard's first row; else ``None``
    (the rows themselves)."""
    origins = getattr(_SHARDED, "origins", None) or {}
    static, sharded = origins.get(jax.tree_util.keystr(tuple(path)), (None, False))
    if static is None:
        return None
    static = jax.numpy.asarray(static)
    base = jax.lax.axis_index(_SHARDED.axis) * num_rows if sharded else 0
    return jax.numpy.concatenate([jax.numpy.asarray(base, static.dtype)[None], static])


def shard_rows(num_rows: int) -> tuple[int, Any] | None:
    """Inside :func:`rows_sharded_over`: ``(R, first)`` of a table of ``num_rows``.

    ``R = num_rows / shards``, the rows each shard holds, and ``first``, the
    table row of this shard's row 0 (traced: ``axis_index * R``). ``None``
    elsewhere, or when ``num_rows`` does not split over the shards.
    """
    axis, shards = getattr(_SHARDED, "axis", None), getattr(_SHARDED, "shards", None)
    if axis is None or not shards or num_rows % shards:
        return None
    rows = num_rows // shards
    return rows, jax.lax.axis_index(axis) * rows


def sum_over_shards(x: Any) -> Any:
    """``x``, computed from slices' rows, summed over the shards that own rows.

    Inside :func:`rows_sharded_over` a ``psum`` over its axis when ``x``
    varies over it (each shard holds different rows; replicas over the mesh's
    other axes hold the same ones); a value that is the same on every shard
    (computed from a replicated table's slices, which every device holds
    whole) is counted once. Elsewhere ``x`` itself.
    """
    axis = getattr(_SHARDED, "axis", None)
    if axis is None:
        return x
    axes = _jax_compat.varying_axes(x)
    if axes is not None and axis not in axes:
        return x
    return jax.lax.psum(x, axis)


# ------------------------------------ a routed lookup's gradient, unrouted

_ROUTED = threading.local()


def expect_routed_step(table: Any, message: str) -> None:
    """While tracing: a routed lookup of ``table`` was differentiated.

    Until a routed step takes the table's gradient (:func:`routed_step_taken`),
    the first scatter into this very array (the same tracer, under ``jit``)
    under the partitioner (:func:`replicate_rows`) warns ``message``: the
    step was written as on one device. Held weakly: a finished trace's
    tracers are gone, and with them what was expected of them.
    """
    _ROUTED.pending = [*_pending(), (weakref.ref(table), message)]


def routed_step_taken(tables: Iterable[Any]) -> None:
    """A routed step takes these tables' gradients: nothing to warn about."""
    done = [id(t) for t in tables]
    _ROUTED.pending = [(r, m) for r, m in _pending() if id(r()) not in done]


def _pending() -> list:
    """The live entries of :func:`expect_routed_step`."""
    return [(r, m) for r, m in getattr(_ROUTED, "pending", ()) if r() is not None]


def _warn_if_routed(target: Any) -> None:
    if not getattr(_ROUTED, "pending", None):
        return
    message = next((m for r, m in _pending() if r() is target), None)
    if message is not None:
        routed_step_taken([target])  # once per traced step
        warnings.warn(message, UserWarning, stacklevel=5)
