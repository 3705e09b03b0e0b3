"""Optax gradient transformations that understand ``IndexedSlices``.

Every transform is an :class:`optax.GradientTransformationExtraArgs` usable in
:func:`optax.chain`. Update trees may mix dense arrays and
:class:`~jaxslices.IndexedSlices`; slices stay slices, and on dense leaves each
transform computes the same numbers as the Optax transform of the same name.

This package is the transforms' namespace (``jaxslices.transforms.sgd`` and
``jaxslices.sgd`` are one function). The code is split as Optax splits
``optax/_src`` and ``optax/transforms``: building blocks in ``_transform.py``,
clipping in ``_clipping.py``, optimizer aliases in ``_alias.py``, gradient
accumulation (:class:`MultiSteps`) in ``_accumulation.py``, conditional
application (:func:`apply_if_finite`) in ``_conditionality.py``, per-table
hyperparameters of a collection's stacked buffers (:func:`scale_by_table`,
:func:`add_decayed_weights_by_table`) in ``_per_table.py``, and the one
row-wise rule helper every stateful transform is written with in
``_rowwise.py``; :func:`upgrade_state` (``_upgrade.py``) reads checkpoints of
the optimizer states saved before the row-major layout.

Conventions (see ``docs/optax.md``):

* **Sparse leaves touch only their rows.** State for a table has the table's
  leading axis ``V``, but a sparse update gathers the touched rows, updates
  them and scatters them back: no ``(V, D)`` temporary is made, and under
  ``jax.jit(..., donate_argnums=...)`` the state is updated in place.
  Stateful sparse updates are therefore *lazy* unless a zero gradient leaves
  state and parameters unchanged in the dense rule too (Adagrad, row-wise
  Adagrad): an untouched row's state and parameters do not move.
* **Coalescing.** Transforms that need one value per row (clipping, Adagrad,
  lazy Adam, weight decay, momentum, FTRL) sum duplicate indices first; their
  sparse outputs are coalesced (unique indices, padding at the end), so a
  following transform does not coalesce again. How is their keyword-only
  ``coalesce_method``, the ``method`` of :func:`jaxslices.coalesce`; the
  default ``"auto"`` is the fastest measured per platform.
* **Optax's signatures.** Positional arguments are those of the Optax
  namesake, in its order, with its names and defaults; what jaxslices adds is
  keyword-only (``tests/lib/test_optax_parity.py``).
* **Docstrings** follow Optax's aliases: an alias (:func:`sgd`,
  :func:`adagrad`, :func:`lazy_adam`, ...) has the maths, what is lazy or
  exact for sparse leaves, an example and the references; its building block
  (:func:`trace`, :func:`scale_by_rss`, :func:`scale_by_lazy_adam`, ...)
  points there instead of repeating them.
* **Guard.** Every entry point checks at trace time that the indices of every
  slices leaf are integers; float indices mean a stock leaf-wise Optax
  transform (``optax.scale``, ``optax.sgd``, ...) mapped over them earlier in
  the chain, and the error says so.
* **Row-major state.** Where a transform keeps several state arrays per
  parameter (:func:`lazy_adam`'s two moments, :func:`ftrl`'s ``n`` and
  ``z``), they are one packed array ``(V, k, *row)`` per parameter, so a
  sparse step reads and writes all of a row's state with one gather and
  one scatter (``docs/optax.md``, "Row-major state").
* **Distinct-row bound.** Every transform that coalesces takes a
  keyword-only ``max_distinct``: the slots a sparse leaf is coalesced into
  (default: one per lookup); more distinct rows raise
  (``docs/optax.md``, "Distinct-row bound").
* ``None`` updates are passed through, as in Optax.
"""

from __future__ import annotations

from . import (
    _accumulation,
    _alias,
    _clipping,
    _conditionality,
    _per_table,
    _transform,
    _upgrade,
)
from ._accumulation import MultiSteps as MultiSteps
from ._accumulation import MultiStepsState as MultiStepsState
from ._alias import FtrlState as FtrlState
from ._alias import adagrad as adagrad
from ._alias import ftrl as ftrl
from ._alias import lazy_adam as lazy_adam
from ._alias import lazy_adamw as lazy_adamw
from ._alias import rowwise_adagrad as rowwise_adagrad
from ._alias import sgd as sgd
from ._clipping import clip as clip
from ._clipping import clip_by_global_norm as clip_by_global_norm
from ._clipping import clip_by_row_norm as clip_by_row_norm
from ._conditionality import apply_if_finite as apply_if_finite
from ._per_table import PerTableState as PerTableState
from ._per_table import add_decayed_weights_by_table as add_decayed_weights_by_table
from ._per_table import scale_by_table as scale_by_table
from ._transform import AddDecayedWeightsState as AddDecayedWeightsState
from ._transform import ScaleByLazyAdamState as ScaleByLazyAdamState
from ._transform import ScaleByRowwiseRssState as ScaleByRowwiseRssState
from ._transform import ScaleByRssState as ScaleByRssState
from ._transform import ScaleByScheduleState as ScaleByScheduleState
from ._transform import TraceState as TraceState
from ._transform import add_decayed_weights as add_decayed_weights
from ._transform import densify as densify
from ._transform import scale as scale
from ._transform import scale_by_lazy_adam as scale_by_lazy_adam
from ._transform import scale_by_learning_rate as scale_by_learning_rate
from ._transform import scale_by_rowwise_rss as scale_by_rowwise_rss
from ._transform import scale_by_rss as scale_by_rss
from ._transform import scale_by_schedule as scale_by_schedule
from ._transform import trace as trace
from ._upgrade import upgrade_state as upgrade_state

# The namespace exports what each module exports (the form type checkers read).
__all__: list[str] = []
__all__ += _accumulation.__all__
__all__ += _alias.__all__
__all__ += _clipping.__all__
__all__ += _conditionality.__all__
__all__ += _per_table.__all__
__all__ += _transform.__all__
__all__ += _upgrade.__all__
