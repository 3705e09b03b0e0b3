"""Equinox: an ``Embedding`` with sparse gradients, filtered gradients, updates.

Stock ``equinox.nn.Embedding`` reads its table with ``self.weight[x]``, so
every gradient transform gives it a dense ``(num_embeddings, embedding_size)``
gradient. This module gives an Equinox user the same idioms, sparse:

* :class:`Embedding`: ``eqx.nn.Embedding`` (a subclass: same fields
  ``num_embeddings``, ``embedding_size``, ``weight``, same constructor and
  call on one scalar id) whose lookup is :func:`jaxslices.embedding_lookup`.
* :func:`filter_value_and_grad` / :func:`filter_grad`: ``eqx.filter_value_and_grad``
  / ``eqx.filter_grad`` (differentiate the first argument's inexact arrays,
  ``None`` elsewhere) on top of :func:`jaxslices.value_and_grad`, so the
  table's gradient is an :class:`~jaxslices.IndexedSlices`.
* :class:`EmbeddingBag`: PyTorch's ``nn.EmbeddingBag`` (bags of ids,
  padded, jagged or with offsets), sparse like :class:`Embedding`.
* :func:`multi_transform` / :func:`param_labels`: one optimizer for the
  tables, another for the rest, without Optax calling a module-shaped label
  tree.
* :func:`apply_updates`: ``eqx.apply_updates`` for update trees that hold
  ``IndexedSlices`` (a row scatter-add for those leaves). ``eqx.apply_updates``
  itself maps over the updates tree, so it sees an ``IndexedSlices`` as two
  leaves and fails with a tree-structure error: use this one.
* :class:`EmbeddingCollection`: a :class:`jaxslices.EmbeddingCollection` as
  a module.
* :class:`ManagedEmbeddingBag` / :func:`reset_rows`: a bag layer over a
  managed-collision table (raw ids of any value, ``docs/managed.md``).

Per-example models work as in Equinox and stay sparse:
``jax.vmap(self.embedding)(ids)`` inside a loss, ``jax.vmap(model)(batch)``
whose ``__call__`` looks up one id per example, and both at once
(``jax.vmap(model)`` with an inner ``jax.vmap(self.embedding)``: nested
``vmap``).

Import it as ``import jaxslices.equinox`` (needs ``pip install
"jaxslices[equinox]"``); ``import jaxslices`` alone never imports Equinox.

The layers by concept: the embedding layers (``_embeddings``), the gradient
entry points (``_gradients``), updates and optimizers per parameter group
(``_updates``), the collection (``_collection``) and the managed-collision
tables (``_managed``).
"""

from ._collection import EmbeddingCollection as EmbeddingCollection
from ._embeddings import Embedding as Embedding
from ._embeddings import EmbeddingBag as EmbeddingBag
from ._gradients import filter_grad as filter_grad
from ._gradients import filter_value_and_grad as filter_value_and_grad
from ._managed import ManagedEmbeddingBag as ManagedEmbeddingBag
from ._managed import reset_rows as reset_rows
from ._updates import apply_updates as apply_updates
from ._updates import multi_transform as multi_transform
from ._updates import param_labels as param_labels

__all__ = [
    "Embedding",
    "EmbeddingBag",
    "filter_value_and_grad",
    "filter_grad",
    "apply_updates",
    "multi_transform",
    "param_labels",
    "EmbeddingCollection",
    "ManagedEmbeddingBag",
    "reset_rows",
]
