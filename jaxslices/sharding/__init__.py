"""Scale-out: embedding tables over a device mesh, data-parallel or sharded.

JAX's own SPMD is the engine (``jax.jit`` with ``NamedSharding``,
``shard_map``, ``jax.distributed``); this package keeps sparse gradients
sparse across it. Per step, communication is O(rows in the batch x D),
never O(V x D). See ``docs/scale_out.md`` and ``docs/collections.md``.

One unit, TorchRec's ``torchrec/distributed`` split in modules:

* :mod:`._placement`: arrays on the mesh (:func:`shard_rows`,
  :func:`sharded_init`);
* :mod:`._routing`: the routing of lookups and gradients to the devices
  that own their rows (``"masked"`` and ``"all_to_all"``), and the sharded
  optimizer step; :func:`sharded_lookup` and :func:`sharded_update` for one
  table;
* :mod:`._plan`: :class:`ShardingPlan` (a placement of every table of a
  collection, as buffers over one mesh axis: data and a thin step) and
  :class:`TablePlan`;
* :mod:`._layout`: the kinds and the buffers they make;
* :mod:`._replay`: the host replay of a step on sample batches (capacities,
  ids per step);
* :mod:`._cost`: the cost model (memory and bytes per device) and the
  choice of each buffer's routing;
* :mod:`._planner`: :func:`plan_collection`, the planner.

:func:`replicate_rows` (from :mod:`jaxslices._spmd`) is the hook every
jaxslices scatter calls so that a data-parallel step never all-reduces a
table.
"""

from .._spmd import replicate_rows as replicate_rows
from ._layout import KINDS as KINDS
from ._placement import shard_rows as shard_rows
from ._placement import sharded_init as sharded_init
from ._plan import ShardingPlan as ShardingPlan
from ._plan import TablePlan as TablePlan
from ._planner import plan_collection as plan_collection
from ._routing import Routing as Routing
from ._routing import sharded_lookup as sharded_lookup
from ._routing import sharded_update as sharded_update

__all__ = [
    "KINDS",
    "Routing",
    "ShardingPlan",
    "TablePlan",
    "plan_collection",
    "replicate_rows",
    "shard_rows",
    "sharded_init",
    "sharded_lookup",
    "sharded_update",
]


def __getattr__(name: str):
    # ``jaxslices.plans.plan`` (served as this module, jaxslices._moved) is
    # the planner's old name.
    if name == "plan":
        return plan_collection
    raise AttributeError(f"module 'jaxslices.sharding' has no attribute {name!r}")
