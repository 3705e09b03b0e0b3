"""Flax Linen: embedding layers whose tables get sparse gradients.

Stock ``flax.linen.Embed`` reads its table with ``jnp.take``, so the gradient
of a ``model.apply`` loss holds a dense ``(num_embeddings, features)`` array
for it, whichever gradient function is used. :class:`Embed` is the same module
(a subclass: same fields, parameter name ``"embedding"``, initialisation and
``attend``) whose ``__call__`` reads the table through
:func:`jaxslices.embedding_lookup`. Differentiate the usual Linen loss with
:func:`jaxslices.value_and_grad` and the ``"embedding"`` leaf of the params
gradient is an :class:`~jaxslices.IndexedSlices`::

    def loss(params, ids, y):
        return jnp.mean((model.apply({"params": params}, ids) - y) ** 2)

    value, grads = jaxslices.value_and_grad(loss)(params, ids, y)

The lookup must see the params leaf itself: pass ``{"params": params}`` (or
the variables dict) straight to ``apply``, without transforming the table
first (a table cast or scaled before ``apply`` gets its exact dense gradient).

Import it as ``import jaxslices.linen`` (needs ``pip install "jaxslices[flax]"``);
``import jaxslices`` alone never imports Flax.

The layers by concept: the embedding layers (``_embeddings``), the collection
(``_collection``) and the managed-collision tables (``_managed``); Linen's
gradients are plain :func:`jaxslices.value_and_grad` of a ``model.apply``
loss.
"""

from ._collection import EmbeddingCollection as EmbeddingCollection
from ._embeddings import Embed as Embed
from ._embeddings import EmbedBag as EmbedBag
from ._managed import ManagedEmbedBag as ManagedEmbedBag

__all__ = ["Embed", "EmbedBag", "EmbeddingCollection", "ManagedEmbedBag"]
