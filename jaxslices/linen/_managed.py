"""Flax Linen: a bag layer over a managed-collision table (``docs/managed.md``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from .. import embedding as _embedding
from .. import managed
from ..managed._checks import check_layer

_MANAGED = "jaxslices.linen.ManagedEmbedBag"


class ManagedEmbedBag(nn.Module):
    """A bag layer over a managed-collision table: raw ids in, pooled rows out.

    Holds the table, the ``"embedding"`` parameter (``[num_slots,
    features]``), and its :class:`jaxslices.RemapState`, the variable
    ``"state"`` of the ``"remap"`` collection (an ordinary pytree of arrays:
    checkpointed with the variables, never differentiated). A training step
    calls it twice, as the managed-collision rule orders (remap, then reset
    the evicted rows, then read the table; ``docs/managed.md``):

    * ``model.apply(variables, raw_ids, method="remap", mutable=["remap"])``
      remaps the raw ids (any integer dtype, or :class:`jaxslices.RawIds`):
      ``((rows, evicted), {"remap": new state})``;
    * :func:`jaxslices.reset_rows` re-initialises the ``evicted`` rows of
      ``params["embedding"]`` and of the optimizer state;
    * ``model.apply({"params": params}, rows)`` pools the rows
      (:func:`jaxslices.embedding_bag`; a row ``num_slots``, an id given no
      row, reads nothing and is not counted by ``"mean"``), so under
      :func:`jaxslices.value_and_grad` the table's gradient is an
      :class:`~jaxslices.IndexedSlices`.

    Attributes:
      manager: the :class:`jaxslices.ManagedCollision` (its ``num_slots`` is
        the table's rows).
      features: the rows' width.
      combiner: ``"mean"``, ``"sum"`` or ``"sqrtn"``.
      embedding_init, param_dtype: as ``flax.linen.Embed``'s.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices as js, jaxslices.linen
      >>> mc = js.ManagedCollision("items", num_slots=8)
      >>> model = jaxslices.linen.ManagedEmbedBag(mc, features=4)
      >>> raw = jnp.array([[10**9, 7], [7, -1]])
      >>> variables = model.init(jax.random.key(0), raw, method="remap")
      >>> (rows, evicted), remap = model.apply(
      ...     variables, raw, method="remap", mutable=["remap"])
      >>> rows.tolist()  # -1 is a raw id too (as 2**64 - 1)
      [[1, 0], [0, 2]]
      >>> model.apply({"params": variables["params"]}, rows).shape
      (2, 4)
    """

    manager: managed.ManagedCollision
    features: int
    combiner: str = "mean"
    embedding_init: Callable[..., Any] = nn.linear.default_embed_init
    param_dtype: Any = jnp.float32

    def setup(self) -> None:
        check_layer(_MANAGED, self.manager, self.combiner)
        self.embedding = self.param(
            "embedding",
            self.embedding_init,
            (self.manager.num_slots, self.features),
            self.param_dtype,
        )
        # the lookup alone (``{"params": ...}``) needs no remap state
        if self.is_initializing() or self.has_variable("remap", "state"):
            self.state = self.variable("remap", "state", self.manager.init)
        else:
            self.state = None

    def remap(self, raw_ids: Any, mask: Any = None) -> tuple[jax.Array, jax.Array]:
        """Raw ids to rows, admitting and evicting: ``(rows, evicted)``.

        Updates the ``"remap"`` collection, which must be mutable
        (``mutable=["remap"]``); ``rows`` and ``evicted`` as
        :meth:`jaxslices.ManagedCollision.remap` returns them.
        """
        if self.state is None:
            raise ValueError(
                f"{_MANAGED}.remap needs the remap state: pass the variables "
                "with their 'remap' collection (model.init makes it)."
            )
        rows, new_state, evicted = self.manager.remap(self.state.value, raw_ids, mask)
        if not self.is_initializing():
            if not self.is_mutable_collection("remap"):
                raise ValueError(
                    f"{_MANAGED}.remap changes the remap state: call it with "
                    "model.apply(variables, raw_ids, method='remap', "
                    "mutable=['remap'])."
                )
            self.state.value = new_state
        return rows, evicted

    def __call__(self, rows: Any) -> jax.Array:
        """Pool remapped ``rows`` (``[..., L]``, from :meth:`remap`):
        ``[..., features]``."""
        return _embedding.embedding_bag(self.embedding, rows, combiner=self.combiner)
