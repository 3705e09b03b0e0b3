"""Equinox: a bag layer over a managed-collision table (``docs/managed.md``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from .. import embedding as _embedding
from .. import managed
from ..managed._checks import check_layer

_MANAGED = "jaxslices.equinox.ManagedEmbeddingBag"


class ManagedEmbeddingBag(eqx.Module):
    """A bag layer over a managed-collision table: raw ids in, pooled rows out.

    ``weight`` is the table (``[num_slots, embedding_size]``, standard normal
    from ``key`` as ``eqx.nn.Embedding``'s, or given) and ``remap_state`` its
    :class:`jaxslices.RemapState` (integer and boolean arrays: not inexact,
    so ``eqx.filter(model, eqx.is_inexact_array)`` and
    :func:`filter_value_and_grad` leave it out of training; it is saved with
    the model, e.g. by ``eqx.tree_serialise_leaves``). A training step
    follows the managed-collision rule (remap, then reset the evicted rows,
    then read the table; ``docs/managed.md``):

    * ``layer, rows, evicted = layer.remap(raw_ids)`` (any integer dtype, or
      :class:`jaxslices.RawIds`): a layer with the new remap state;
    * :func:`reset_rows` re-initialises the ``evicted`` rows of ``weight``
      and of the optimizer state;
    * ``layer(rows)`` pools the rows (:func:`jaxslices.embedding_bag`; a
      row ``num_slots``, an id given no row, reads nothing and is not
      counted by ``"mean"``); under :func:`filter_value_and_grad`
      ``weight`` gets an :class:`~jaxslices.IndexedSlices` gradient.

    Args:
      manager: the :class:`jaxslices.ManagedCollision` (its ``num_slots``
        is the table's rows).
      embedding_size: the rows' width.
      weight: optional initial table, ``[num_slots, embedding_size]``.
      dtype: the table's dtype (as ``eqx.nn.Embedding``'s).
      combiner: ``"mean"``, ``"sum"`` or ``"sqrtn"``.
      key: a PRNG key (without ``weight``).

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices as js, jaxslices.equinox as jse
      >>> mc = js.ManagedCollision("items", num_slots=8)
      >>> layer = jse.ManagedEmbeddingBag(mc, 4, key=jax.random.key(0))
      >>> layer, rows, evicted = layer.remap(jnp.array([[10**9, 7], [7, 5]]))
      >>> rows.tolist()
      [[2, 1], [1, 0]]
      >>> layer(rows).shape
      (2, 4)
    """

    weight: jax.Array
    remap_state: managed.RemapState
    manager: managed.ManagedCollision = eqx.field(static=True)
    combiner: str = eqx.field(static=True)

    def __init__(
        self,
        manager: managed.ManagedCollision,
        embedding_size: int | None = None,
        weight: Any = None,
        dtype: Any = None,
        *,
        combiner: str = "mean",
        key: Any = None,
    ) -> None:
        check_layer(_MANAGED, manager, combiner)
        table = eqx.nn.Embedding(
            None if weight is not None else manager.num_slots,
            embedding_size,
            weight,
            dtype,
            key=key,
        )
        if table.num_embeddings != manager.num_slots:
            raise ValueError(
                f"{_MANAGED}: `weight` must have num_slots={manager.num_slots} "
                f"rows (ManagedCollision({manager.name!r})), got "
                f"{table.num_embeddings}."
            )
        self.weight = table.weight
        self.remap_state = manager.init()
        self.manager = manager
        self.combiner = combiner

    def remap(
        self, raw_ids: Any, mask: Any = None
    ) -> tuple[ManagedEmbeddingBag, jax.Array, jax.Array]:
        """Raw ids to rows, admitting and evicting: ``(layer, rows, evicted)``.

        ``layer`` holds the new remap state; ``rows`` and ``evicted`` as
        :meth:`jaxslices.ManagedCollision.remap` returns them.
        """
        rows, state, evicted = self.manager.remap(self.remap_state, raw_ids, mask)
        return eqx.tree_at(lambda m: m.remap_state, self, state), rows, evicted

    def __call__(self, rows: Any, *, key: Any = None) -> jax.Array:
        """Pool remapped ``rows`` (``[..., L]``, from :meth:`remap`);
        ``key`` is ignored."""
        return _embedding.embedding_bag(self.weight, rows, combiner=self.combiner)


def reset_rows(
    model: Any,
    opt_state: Any,
    rows: Any,
    new_rows: Any,
    *,
    where: Callable[[Any], Any],
    optimizer: Any = None,
) -> tuple[Any, Any]:
    """:func:`jaxslices.reset_rows` for an Equinox model.

    The optimizer state is that of ``eqx.filter(model, eqx.is_inexact_array)``
    (the Equinox idiom); the table ``where(model)`` picks (e.g.
    ``lambda m: m.items.weight``) gets ``new_rows`` in ``rows`` and its
    optimizer state the optimizer's initial values there.

    Returns:
      ``(model, opt_state)``.

    Example:
      >>> import jax, jax.numpy as jnp, equinox as eqx, jaxslices as js
      >>> import jaxslices.equinox as jse
      >>> layer = jse.ManagedEmbeddingBag(
      ...     js.ManagedCollision("t", num_slots=4), weight=jnp.ones((4, 2)))
      >>> tx = js.adagrad(0.1)
      >>> state = tx.init(eqx.filter(layer, eqx.is_inexact_array))
      >>> layer, state = jse.reset_rows(layer, state, jnp.array([2]), 0.0,
      ...     where=lambda m: m.weight, optimizer=tx)
      >>> layer.weight[:, 0].tolist()
      [1.0, 1.0, 0.0, 1.0]
    """
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params, opt_state = managed.reset_rows(
        params, opt_state, rows, new_rows, where=where, optimizer=optimizer
    )
    return eqx.combine(params, static), opt_state
