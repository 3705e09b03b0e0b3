"""Flax NNX: the module over :class:`jaxslices.EmbeddingCollection`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from .. import collection as _collection


class EmbeddingCollection(nnx.Module):
    """A :class:`jaxslices.EmbeddingCollection` as an NNX module.

    Its stacked buffers are ``nnx.Param`` s in ``self.buffers`` (``{buffer
    name: Param}``); calling it pools every feature (see
    :meth:`jaxslices.EmbeddingCollection.__call__`; :meth:`concat` gives them
    side by side). Under :func:`jaxslices.nnx.value_and_grad` each buffer's
    gradient is one :class:`~jaxslices.IndexedSlices`, and ``nnx.Optimizer``
    with a jaxslices transform updates only the touched rows. Per-table
    hyperparameters: :meth:`jaxslices.EmbeddingCollection.scale_by_table` and
    ``add_decayed_weights_by_table`` of ``self.collection``, chained after the
    optimizer.

    Args:
      tables: the :class:`jaxslices.TableConfig` s.
      rngs: ``nnx.Rngs``; the buffers are initialised from ``rngs.params()``.

    Example:
      >>> import jax.numpy as jnp, jaxslices as js, jaxslices.nnx
      >>> from flax import nnx
      >>> layer = jaxslices.nnx.EmbeddingCollection(
      ...     [js.TableConfig("user", 100, 4), js.TableConfig("item", 50, 4)],
      ...     rngs=nnx.Rngs(0))
      >>> ids = {"user": jnp.array([[3], [5]]), "item": jnp.array([[1], [1]])}
      >>> layer.concat(ids).shape
      (2, 8)
      >>> g = jaxslices.nnx.grad(lambda m: m.concat(ids).sum())(layer)
      >>> g["buffers"]["dim4_float32"].get_value()
      IndexedSlices(float32[150, 4], rows=4)
    """

    def __init__(self, tables: Sequence[Any], *, rngs: nnx.Rngs):
        self.collection = _collection.EmbeddingCollection(tables)
        init = self.collection.init(rngs.params())
        self.buffers = nnx.data({k: nnx.Param(v) for k, v in init.items()})

    def params(self) -> dict[str, jax.Array]:
        """``{buffer name: array}``: the functional collection's params."""
        return {k: v.get_value() for k, v in self.buffers.items()}

    def __call__(self, features: Any, **kwargs: Any) -> dict[str, jax.Array]:
        """``{feature: pooled}``; see :meth:`jaxslices.EmbeddingCollection.__call__`."""
        return self.collection(self.params(), features, **kwargs)

    def concat(self, features: Any, **kwargs: Any) -> jax.Array:
        """``[B, sum of dims]``; see :meth:`jaxslices.EmbeddingCollection.concat`."""
        return self.collection.concat(self.params(), features, **kwargs)
