"""Embedding collections: many named tables, stacked in buffers, one lookup each.

One unit, four modules:

* :mod:`._collection`: :class:`TableConfig` and :class:`EmbeddingCollection`
  (the configs, the params);
* :mod:`._face`: what a collection and a sharding plan show alike (the
  calls, ``concat``, the per-table transforms);
* :mod:`._buffers`: where the tables live (:class:`Buffer`, a
  :class:`~jaxslices.collection._buffers.Placement` per table, the
  :class:`~jaxslices.collection._buffers.Layout` of them all), for the
  collection's own stacked layout and a sharding plan's;
* :mod:`._pooling`: the lookups, one gather per buffer, then pooling of
  padded or keyed jagged ids.

The per-table hyperparameters are transforms
(:func:`jaxslices.transforms.scale_by_table`); the placement of the buffers
over a mesh is :mod:`jaxslices.sharding`'s.
"""

from ._buffers import Buffer as Buffer
from ._collection import EmbeddingCollection as EmbeddingCollection
from ._collection import TableConfig as TableConfig
from ._collection import uniform_initializer as uniform_initializer

__all__ = ["Buffer", "EmbeddingCollection", "TableConfig"]
