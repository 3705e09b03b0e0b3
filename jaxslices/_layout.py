"""Where arrays live on a device mesh: the low-level helpers every scatter uses.

Kept apart from :mod:`jaxslices.sharding` (placement, routing, the sharded
step) so that :mod:`jaxslices.slices` can call :func:`replicate_rows` from its
scatters without importing the modules built on top of it.
"""

from __future__ import annotations

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
    replicated = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), tree)
