"""jaxslices: row-sparse ``IndexedSlices`` gradients and Optax optimizers for JAX.

A training step that reads an embedding table through
:func:`jaxslices.embedding_lookup` gets, from :func:`jaxslices.value_and_grad`,
an :class:`IndexedSlices` gradient of the rows the batch touched; jaxslices'
Optax transforms keep it sparse and :func:`jaxslices.apply_updates` writes it
in place, so a step costs what the batch touches, not what the table holds.

Framework layers (optional extras, imported only when used; ``import
jaxslices`` imports neither Flax nor Equinox):

* :mod:`jaxslices.nnx` (``jaxslices[flax]``): ``Embed``, a drop-in for
  ``flax.nnx.Embed``, and ``value_and_grad`` / ``grad`` like ``nnx``'s.
* :mod:`jaxslices.linen` (``jaxslices[flax]``): ``Embed``, a drop-in for
  ``flax.linen.Embed``.
* :mod:`jaxslices.equinox` (``jaxslices[equinox]``): ``Embedding``, a drop-in
  for ``equinox.nn.Embedding``, ``filter_value_and_grad`` / ``filter_grad``
  and ``apply_updates``.

What this module exports, and what lives in a namespace instead
(:mod:`jaxslices.sharding`, :mod:`jaxslices.capacity`,
:mod:`jaxslices.kernels`, :mod:`jaxslices.native`), follows one rule,
written in ``jaxslices/README.md`` ("What the top level exports").
"""

from importlib.metadata import PackageNotFoundError, version

from . import _checkpoint, _moved, transforms
from . import capacity as capacity
from . import kernels as kernels
from . import sharding as sharding
from ._recipe import PooledGradient as PooledGradient
from ._strict import DenseGradientError as DenseGradientError
from .autodiff import grad as grad
from .autodiff import value_and_grad as value_and_grad
from .collection import Buffer as Buffer
from .collection import EmbeddingCollection as EmbeddingCollection
from .collection import TableConfig as TableConfig
from .donation import TableCopy as TableCopy
from .donation import table_copies as table_copies
from .embedding import check_ids as check_ids
from .embedding import embedding_bag as embedding_bag
from .embedding import embedding_lookup as embedding_lookup
from .jagged import JaggedIds as JaggedIds
from .jagged import check_jagged as check_jagged
from .keyed import KeyedJaggedIds as KeyedJaggedIds
from .managed import ManagedCollision as ManagedCollision
from .managed import RawIds as RawIds
from .managed import RemapState as RemapState
from .managed import remap_keyed as remap_keyed
from .managed import reset_rows as reset_rows
from .max_norm import apply_max_norm as apply_max_norm
from .slices import IndexedSlices as IndexedSlices
from .slices import coalesce as coalesce
from .slices import concatenate as concatenate
from .slices import from_dense as from_dense
from .slices import global_norm as global_norm
from .slices import is_indexed_slices as is_indexed_slices
from .slices import scatter_add as scatter_add
from .slices import scatter_sub as scatter_sub
from .slices import scatter_update as scatter_update
from .slices import sparse_mask as sparse_mask
from .slices import to_dense as to_dense
from .transforms import AddDecayedWeightsState as AddDecayedWeightsState
from .transforms import FtrlState as FtrlState
from .transforms import MultiSteps as MultiSteps
from .transforms import MultiStepsState as MultiStepsState
from .transforms import PerTableState as PerTableState
from .transforms import ScaleByLazyAdamState as ScaleByLazyAdamState
from .transforms import ScaleByRowwiseRssState as ScaleByRowwiseRssState
from .transforms import ScaleByRssState as ScaleByRssState
from .transforms import ScaleByScheduleState as ScaleByScheduleState
from .transforms import TraceState as TraceState
from .transforms import adagrad as adagrad
from .transforms import add_decayed_weights as add_decayed_weights
from .transforms import (
    add_decayed_weights_by_table as add_decayed_weights_by_table,
)
from .transforms import apply_if_finite as apply_if_finite
from .transforms import clip as clip
from .transforms import clip_by_global_norm as clip_by_global_norm
from .transforms import clip_by_row_norm as clip_by_row_norm
from .transforms import densify as densify
from .transforms import ftrl as ftrl
from .transforms import lazy_adam as lazy_adam
from .transforms import lazy_adamw as lazy_adamw
from .transforms import rowwise_adagrad as rowwise_adagrad
from .transforms import scale as scale
from .transforms import scale_by_lazy_adam as scale_by_lazy_adam
from .transforms import scale_by_learning_rate as scale_by_learning_rate
from .transforms import scale_by_rowwise_rss as scale_by_rowwise_rss
from .transforms import scale_by_rss as scale_by_rss
from .transforms import scale_by_schedule as scale_by_schedule
from .transforms import scale_by_table as scale_by_table
from .transforms import sgd as sgd
from .transforms import trace as trace
from .transforms import upgrade_state as upgrade_state
from .tree import tree_add as tree_add
from .tree import tree_map_values as tree_map_values
from .tree import tree_pmean as tree_pmean
from .tree import tree_psum as tree_psum
from .tree import tree_scale as tree_scale
from .updates import apply_updates as apply_updates

_checkpoint.install_flax_serialization()  # Flax msgpack saves IndexedSlices
_moved.install()  # old module paths (pickles of earlier layouts) keep loading


def __getattr__(name: str):
    # ``jaxslices.native`` (experimental, built on JAX's hijax API) is imported
    # only when used, so ``import jaxslices`` never touches private JAX names.
    if name == "native":
        import importlib

        return importlib.import_module(".native", __name__)
    # Names this module exported before the rule of jaxslices/README.md ("What
    # the top level exports") moved them: still importable, not in __all__.
    return _moved.old_name(name)


try:
    __version__ = version("jaxslices")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    # the type and its operations
    "IndexedSlices",
    "PooledGradient",
    "coalesce",
    "concatenate",
    "from_dense",
    "global_norm",
    "is_indexed_slices",
    "scatter_add",
    "scatter_sub",
    "scatter_update",
    "sparse_mask",
    "to_dense",
    # lookups and their ids
    "JaggedIds",
    "KeyedJaggedIds",
    "apply_max_norm",
    "check_ids",
    "check_jagged",
    "embedding_bag",
    "embedding_lookup",
    # gradients
    "DenseGradientError",
    "grad",
    "value_and_grad",
    # updates and trees
    "TableCopy",
    "apply_updates",
    "table_copies",
    "tree_add",
    "tree_map_values",
    "tree_pmean",
    "tree_psum",
    "tree_scale",
    # collections
    "Buffer",
    "EmbeddingCollection",
    "TableConfig",
    # managed-collision tables (raw ids without a vocabulary)
    "ManagedCollision",
    "RawIds",
    "RemapState",
    "remap_keyed",
    "reset_rows",
    # namespaces
    "capacity",
    "kernels",
    "sharding",
]
__all__ += transforms.__all__  # every transform, re-exported above
