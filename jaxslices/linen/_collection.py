"""Flax Linen: the module over :class:`jaxslices.EmbeddingCollection`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flax import linen as nn

from .. import collection as _collection


class EmbeddingCollection(nn.Module):
    """A :class:`jaxslices.EmbeddingCollection` as a Linen module.

    One parameter per stacked buffer, named like the buffer
    (``"dim64_float32"``), each initialised table by table as
    :meth:`jaxslices.EmbeddingCollection.init` does (from the parameter's own
    key). Calling it pools every feature (keyword arguments as
    :meth:`jaxslices.EmbeddingCollection.__call__`); ``concat=True`` returns
    them side by side, ``[B, sum of dims]``. Differentiate a ``model.apply``
    loss with :func:`jaxslices.value_and_grad`: each buffer's gradient is one
    :class:`~jaxslices.IndexedSlices`.

    Attributes:
      tables: the :class:`jaxslices.TableConfig` s.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices as js, jaxslices.linen
      >>> model = jaxslices.linen.EmbeddingCollection(
      ...     (js.TableConfig("user", 100, 4), js.TableConfig("item", 50, 4)))
      >>> ids = {"user": jnp.array([[3], [5]]), "item": jnp.array([[1], [1]])}
      >>> params = model.init(jax.random.key(0), ids)["params"]
      >>> loss = lambda p: model.apply({"params": p}, ids, concat=True).sum()
      >>> js.grad(loss)(params)["dim4_float32"]
      IndexedSlices(float32[150, 4], rows=4)
    """

    tables: Sequence[Any]

    @property
    def collection(self) -> _collection.EmbeddingCollection:
        return _collection.EmbeddingCollection(tuple(self.tables))

    @nn.compact
    def __call__(self, features: Any, *, concat: bool = False, **kwargs: Any) -> Any:
        coll = self.collection
        params = {
            b.name: self.param(b.name, lambda key, b=b: coll.init_buffer(key, b.name))
            for b in coll.buffers
        }
        if concat:
            return coll.concat(params, features, **kwargs)
        return coll(params, features, **kwargs)
