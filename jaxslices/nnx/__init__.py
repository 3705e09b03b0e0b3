"""Flax NNX: embedding layers with sparse gradients, and NNX gradient entry points.

Stock ``flax.nnx.Embed`` reads its table with ``jnp.take``, so every gradient
transform (``nnx.grad`` and :func:`jaxslices.value_and_grad` alike) gives it a
dense ``(num_embeddings, features)`` gradient. :class:`Embed` is the same layer
(a subclass: same constructor, attributes, parameters, initialisation and
``attend``) whose ``__call__`` reads the table through
:func:`jaxslices.embedding_lookup`, and :func:`value_and_grad` / :func:`grad`
mirror ``nnx.value_and_grad`` / ``nnx.grad`` on top of
:func:`jaxslices.value_and_grad`, so the table's gradient is an
:class:`~jaxslices.IndexedSlices` of the rows the batch touched.

Gradients are an ``nnx.State`` of the same structure and ``Variable`` types as
``nnx.grad``'s (``Param`` leaves, so ``wrt`` filters and ``nnx.Optimizer``
work unchanged); a sparse leaf is a ``Param`` holding an ``IndexedSlices``.
Read it the way NNX reads a non-array variable, with ``get_value()``
(``grads["emb"]["embedding"].get_value()``); ``param[...]`` is for arrays and
raises on it. ``jaxslices.to_dense(grads)`` gives the dense ``State`` that
``nnx.grad`` would have returned.

Differences from ``flax.nnx.Embed``, all documented on :class:`Embed`: an id
``>= num_embeddings`` (or ``< -num_embeddings``) reads zeros and gets no
gradient (stock: NaN); the dtype cast (``promote_dtype``) is applied to the
looked-up rows, not to the whole table.

:class:`ManagedEmbedBag` is a bag layer over a managed-collision table (raw
ids of any value, ``docs/managed.md``), its remap state a :class:`Remap`
variable that ``nnx.Optimizer`` does not train; :func:`reset_rows` starts
evicted rows afresh in the model and its optimizer.

Import it as ``import jaxslices.nnx`` (needs ``pip install "jaxslices[flax]"``);
``import jaxslices`` alone never imports Flax.

The layers by concept: the embedding layers (``_embeddings``), the gradient
entry points (``_gradients``), the collection (``_collection``) and the
managed-collision tables (``_managed``).
"""

from ._collection import EmbeddingCollection as EmbeddingCollection
from ._embeddings import Embed as Embed
from ._embeddings import EmbedBag as EmbedBag
from ._gradients import grad as grad
from ._gradients import value_and_grad as value_and_grad
from ._managed import ManagedEmbedBag as ManagedEmbedBag
from ._managed import Remap as Remap
from ._managed import reset_rows as reset_rows

__all__ = [
    "Embed",
    "EmbedBag",
    "value_and_grad",
    "grad",
    "EmbeddingCollection",
    "ManagedEmbedBag",
    "Remap",
    "reset_rows",
]
