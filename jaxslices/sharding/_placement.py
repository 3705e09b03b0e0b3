"""Placing tables and their optimizer state on a mesh: rows over one axis.

:func:`shard_rows` places one ``[V, ...]`` array with its rows split over a
mesh axis (padding the rows to a multiple of the shards);
:func:`sharded_init` lays an optimizer's state out like its parameters. A
:class:`~jaxslices.sharding.ShardingPlan` places a collection's buffers
itself (:meth:`~jaxslices.sharding.ShardingPlan.shard`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["check_axis", "shard_rows", "sharded_init", "state_specs"]


def check_axis(mesh: Any, axis: str, where: str) -> int:
    """The size of ``mesh``'s axis ``axis``; a clear error if it has none."""
    if axis not in mesh.axis_names:
        raise ValueError(
            f"{where}: `axis` must name an axis of the mesh {dict(mesh.shape)}, "
            f"got {axis!r}."
        )
    return int(mesh.shape[axis])


def shard_rows(x: Any, mesh: Any, axis: str) -> jax.Array:
    """Place ``x`` on ``mesh`` sharded by rows over ``axis``, padding rows if needed.

    JAX shards evenly only, so a table of ``V`` rows on ``n`` shards gets
    ``-V % n`` zero rows appended (``ceil(V / n) * n`` rows in all). The extra
    rows are never read by valid ids (``< V``) and never receive a gradient;
    ids in ``[V, padded V)`` would read them (zeros), so check ids against
    ``V`` (:func:`jaxslices.check_ids`) if they may be out of range.

    Args:
      x: a ``[V, ...]`` array (a table, or an optimizer state leaf).
      mesh: a :class:`jax.sharding.Mesh`.
      axis: the mesh axis to shard the rows over.

    Returns:
      The (padded) array with sharding ``NamedSharding(mesh, P(axis))``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxslices
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
      >>> jaxslices.sharding.shard_rows(jnp.ones((5, 2)), mesh, "model").shape
      (5, 2)
    """
    n = check_axis(mesh, axis, "shard_rows")
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"shard_rows: `x` must have rows, got shape {x.shape}.")
    pad = -x.shape[0] % n
    if pad:
        x = jnp.concatenate([x, jnp.zeros((pad, *x.shape[1:]), x.dtype)])
    return jax.device_put(x, NamedSharding(mesh, P(axis)))


def state_specs(tx: Any, state: Any, param_specs: Any, other: Any) -> Any:
    """Each params-like state leaf gets its param's spec, every other leaf ``other``.

    ``param_specs``: a tree like the params of their ``PartitionSpec`` s or
    ``NamedSharding`` s. A spec standing for a whole state subtree is
    expanded to its leaves; a parameter an ``optax.masked`` /
    ``optax.multi_transform`` branch leaves out (``optax.MaskedNode``) keeps
    its empty subtree.
    """
    masked = optax.MaskedNode

    def spec_of(x, s):
        return x if isinstance(x, masked) else s

    specs = optax.tree_utils.tree_map_params(
        tx,
        spec_of,
        state,
        param_specs,
        transform_non_params=lambda _: other,
        is_leaf=lambda x: isinstance(x, P | NamedSharding | masked),
    )

    def expand(spec, sub):
        return jax.tree.map(lambda _: spec, sub)

    return jax.tree.map(
        expand,
        specs,
        state,
        is_leaf=lambda x: isinstance(x, P | NamedSharding) or x is None,
    )


def sharded_init(tx: optax.GradientTransformation, params: Any) -> Any:
    """``tx.init(params)``, each state leaf laid out like its parameter.

    ``jax.jit(tx.init)`` would replicate the moments of a row-sharded table
    (zeros carry no sharding); this places every params-shaped state leaf (a
    momentum trace, Adagrad's accumulator, Adam's moments) with its parameter's
    sharding and everything else (step counts) replicated on the same mesh.

    Args:
      tx: an Optax transformation.
      params: the parameters, already placed (e.g. with :func:`shard_rows`).

    Returns:
      The optimizer state.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxslices
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
      >>> emb = jaxslices.sharding.shard_rows(jnp.ones((4, 2)), mesh, "model")
      >>> params = {"emb": emb}
      >>> state = jaxslices.sharding.sharded_init(jaxslices.adagrad(0.1), params)
      >>> spec = state[0].sum_of_squares["emb"].sharding.spec
      >>> spec == jax.sharding.PartitionSpec("model")
      True
    """
    shardings = jax.tree.map(lambda p: p.sharding, params)
    meshes = {
        s.mesh for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding)
    }
    if len(meshes) != 1:
        raise ValueError(
            "sharded_init: every parameter must be placed with a NamedSharding on "
            "one mesh (jax.device_put or jaxslices.sharding.shard_rows); found "
            f"{len(meshes)} meshes."
        )
    (mesh,) = meshes
    shapes = jax.eval_shape(tx.init, params)
    out = state_specs(tx, shapes, shardings, NamedSharding(mesh, P()))
    return jax.jit(tx.init, out_shardings=out)(params)
