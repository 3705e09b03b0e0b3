"""Equinox: the module over :class:`jaxslices.EmbeddingCollection`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax

from .. import collection as _collection


class EmbeddingCollection(eqx.Module):
    """A :class:`jaxslices.EmbeddingCollection` as an Equinox module.

    ``buffers`` holds the stacked buffers (``{buffer name: array}``) and
    ``collection`` the static configuration. Calling it pools every feature
    (keyword arguments as :meth:`jaxslices.EmbeddingCollection.__call__`);
    :meth:`concat` returns them side by side. Under
    :func:`jaxslices.equinox.filter_value_and_grad` each buffer's gradient is
    one :class:`~jaxslices.IndexedSlices`; apply updates with
    :func:`jaxslices.equinox.apply_updates`.

    Args:
      tables: the :class:`jaxslices.TableConfig` s.
      key: a JAX PRNG key for the initial values.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices as js, jaxslices.equinox
      >>> layer = jaxslices.equinox.EmbeddingCollection(
      ...     [js.TableConfig("user", 100, 4), js.TableConfig("item", 50, 4)],
      ...     key=jax.random.key(0))
      >>> ids = {"user": jnp.array([[3], [5]]), "item": jnp.array([[1], [1]])}
      >>> g = jaxslices.equinox.filter_grad(lambda m: m.concat(ids).sum())(layer)
      >>> g.buffers["dim4_float32"]
      IndexedSlices(float32[150, 4], rows=4)
    """

    buffers: dict[str, jax.Array]
    collection: _collection.EmbeddingCollection = eqx.field(static=True)

    def __init__(self, tables: Sequence[Any], *, key: jax.Array):
        self.collection = _collection.EmbeddingCollection(tables)
        self.buffers = self.collection.init(key)

    def __call__(self, features: Any, **kwargs: Any) -> dict[str, jax.Array]:
        """``{feature: pooled}``; see :meth:`jaxslices.EmbeddingCollection.__call__`."""
        return self.collection(self.buffers, features, **kwargs)

    def concat(self, features: Any, **kwargs: Any) -> jax.Array:
        """``[B, sum of dims]``; see :meth:`jaxslices.EmbeddingCollection.concat`."""
        return self.collection.concat(self.buffers, features, **kwargs)
