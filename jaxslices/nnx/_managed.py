"""Flax NNX: a bag layer over a managed-collision table (``docs/managed.md``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .. import embedding as _embedding
from .. import managed
from ..managed._checks import check_layer
from ._embeddings import EMBED_INIT

_MANAGED = "jaxslices.nnx.ManagedEmbedBag"


class Remap(nnx.Variable):
    """The :class:`jaxslices.RemapState` of a managed table, as an NNX variable.

    Not an ``nnx.Param``: ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and
    :func:`jaxslices.nnx.value_and_grad` leave it alone, while
    ``nnx.state(model)`` (and so a checkpoint of it) holds it with the
    table. Select it with ``nnx.state(model, jaxslices.nnx.Remap)``.
    """


class ManagedEmbedBag(nnx.Module):
    """A bag layer over a managed-collision table: raw ids in, pooled rows out.

    Holds the table, the ``embedding`` parameter (``[num_slots, features]``,
    created as :class:`EmbedBag` creates it), and its
    :class:`jaxslices.RemapState` in ``remap_state``, a :class:`Remap`
    variable (not a ``Param``: never trained, saved with the model). A
    training step follows the managed-collision rule (remap, then reset the
    evicted rows, then read the table; ``docs/managed.md``):

    * ``rows, evicted = layer.remap(raw_ids)`` (any integer dtype, or
      :class:`jaxslices.RawIds`) admits and evicts, updating
      ``remap_state`` in place;
    * :func:`jaxslices.nnx.reset_rows` re-initialises the ``evicted`` rows
      of ``embedding`` and of an ``nnx.Optimizer``'s state;
    * ``layer(rows)`` pools the rows (:func:`jaxslices.embedding_bag`; a
      row ``num_slots``, an id given no row, reads nothing and is not
      counted by ``"mean"``), so under :func:`jaxslices.nnx.value_and_grad`
      ``embedding`` gets an :class:`~jaxslices.IndexedSlices` gradient.

    Args:
      manager: the :class:`jaxslices.ManagedCollision` (its ``num_slots`` is
        the table's rows).
      features: the rows' width.
      combiner: ``"mean"``, ``"sum"`` or ``"sqrtn"``.
      dtype: the output's dtype (``None``: the table's).
      param_dtype, embedding_init: as ``nnx.Embed``'s.
      rngs: ``nnx.Rngs``; the table is initialised from ``rngs.params()``.

    Example:
      >>> import jax.numpy as jnp, jaxslices as js, jaxslices.nnx
      >>> from flax import nnx
      >>> mc = js.ManagedCollision("items", num_slots=8)
      >>> layer = jaxslices.nnx.ManagedEmbedBag(mc, 4, rngs=nnx.Rngs(0))
      >>> rows, evicted = layer.remap(jnp.array([[10**9, 7], [7, -1]]))
      >>> rows.tolist()  # -1 is a raw id too (as 2**64 - 1)
      [[1, 0], [0, 2]]
      >>> layer(rows).shape
      (2, 4)
      >>> int(layer.remap_state.get_value().occupancy)
      3
    """

    def __init__(
        self,
        manager: managed.ManagedCollision,
        features: int,
        *,
        combiner: str = "mean",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        embedding_init: Any = EMBED_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        check_layer(_MANAGED, manager, combiner)
        shape = (manager.num_slots, features)
        self.embedding = nnx.Param(embedding_init(rngs.params(), shape, param_dtype))
        self.remap_state = Remap(manager.init())
        self.manager = manager
        self.features = features
        self.combiner = combiner
        self.dtype = dtype

    def remap(self, raw_ids: Any, mask: Any = None) -> tuple[jax.Array, jax.Array]:
        """Raw ids to rows, admitting and evicting: ``(rows, evicted)``.

        Updates ``remap_state`` in place; ``rows`` and ``evicted`` as
        :meth:`jaxslices.ManagedCollision.remap` returns them.
        """
        rows, state, evicted = self.manager.remap(
            self.remap_state.get_value(), raw_ids, mask
        )
        self.remap_state.set_value(state)
        return rows, evicted

    def __call__(self, rows: Any) -> jax.Array:
        """Pool remapped ``rows`` (``[..., L]``, from :meth:`remap`):
        ``[..., features]``."""
        table = self.embedding.get_value()
        out = _embedding.embedding_bag(table, rows, combiner=self.combiner)
        return out if self.dtype is None else out.astype(self.dtype)


def reset_rows(
    model: Any,
    optimizer: nnx.Optimizer | None,
    rows: Any,
    new_rows: Any,
    *,
    where: Callable[[Any], Any],
) -> None:
    """:func:`jaxslices.reset_rows` for an NNX model and its optimizer, in place.

    The table ``where(model)`` picks (a ``Param``, e.g. ``lambda m:
    m.items.embedding``) gets ``new_rows`` in ``rows``, and every state leaf
    of ``optimizer`` (an ``nnx.Optimizer`` of ``model``, or ``None`` for the
    table alone) built from the table gets its optimizer's initial values
    there; both are updated in place (inside ``nnx.jit`` too).

    Example:
      >>> import jax.numpy as jnp, jaxslices as js, jaxslices.nnx
      >>> from flax import nnx
      >>> mc = js.ManagedCollision("t", num_slots=4)
      >>> layer = jaxslices.nnx.ManagedEmbedBag(
      ...     mc, 2, embedding_init=nnx.initializers.ones, rngs=nnx.Rngs(0))
      >>> opt = nnx.Optimizer(layer, js.adagrad(0.1), wrt=nnx.Param)
      >>> jaxslices.nnx.reset_rows(
      ...     layer, opt, jnp.array([2]), 0.0, where=lambda m: m.embedding)
      >>> layer.embedding[:, 0].tolist()
      [1.0, 1.0, 0.0, 1.0]
    """
    name = "jaxslices.nnx.reset_rows"
    target = where(model)
    wrt = nnx.Param if optimizer is None else optimizer.wrt
    variables = nnx.state(model, wrt)
    paths = [path for path, leaf in nnx.to_flat_state(variables) if leaf is target]
    if len(paths) != 1:
        raise ValueError(
            f"{name}: `where(model)` must return one parameter of `model` "
            f"(the table's variable, e.g. where=lambda m: m.items.embedding); it "
            f"returned {type(target).__name__}, found {len(paths)} times among "
            f"the variables nnx.Optimizer trains."
        )
    params = nnx.as_pure(variables)

    def pick(tree: Any) -> Any:
        for key in paths[0]:
            tree = tree[key]
        return tree

    opt_state = None if optimizer is None else nnx.as_pure(optimizer.opt_state)
    params, opt_state = managed.reset_rows(
        params,
        opt_state,
        rows,
        new_rows,
        where=pick,
        optimizer=None if optimizer is None else optimizer.tx,
    )
    nnx.update(model, params)
    if optimizer is not None:
        nnx.update(optimizer.opt_state, nnx.state(opt_state))
