"""What a collection and a sharding plan show alike: lookups, per-table transforms.

:class:`jaxslices.EmbeddingCollection` (its own stacked layout) and
:class:`jaxslices.sharding.ShardingPlan` (a plan's layout over a mesh, some
buffers reached by a routed gather) look up the same way: one gather per
buffer, pooled as on one device (:mod:`._pooling`). This mixin holds that
face once; a subclass says where its tables live (:meth:`_lookup_source`),
its name in messages and who makes its params (:attr:`_WHERE`,
:attr:`_PARAMS_FROM`), and what
the per-table transforms read (:meth:`_per_table_view`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ..keyed import KeyedJaggedIds
from ..transforms import _per_table
from . import _pooling

__all__ = ["CollectionFace"]

Params = Mapping[str, Any]  # {buffer or feature name: array}
Features = KeyedJaggedIds | Mapping[str, Any]  # keyed jagged, or padded [B, L]


class CollectionFace:
    """The lookups and per-table transforms of a collection or a plan."""

    #: the name in messages, and where the params come from
    _WHERE = "EmbeddingCollection"
    _PARAMS_FROM = "`EmbeddingCollection.init` (or `stack`)"
    buffers: tuple[Any, ...]

    def _lookup_source(self) -> tuple[Any, Any, Mapping[str, Any]]:
        """``(collection, layout, {buffer: routed gather})`` of the lookups."""
        raise NotImplementedError

    def _per_table_view(self) -> Any:
        """What the per-table transforms read: tables, buffers, shapes."""
        return self

    def _check_params(self, params: Any, where: str) -> None:
        if not isinstance(params, Mapping):
            raise TypeError(
                f"{where}: `params` must be the dict of buffers that "
                f"{self._PARAMS_FROM} made ({[b.name for b in self.buffers]}), "
                f"got {type(params).__name__}."
            )
        for b in self.buffers:
            x = params.get(b.name)
            shape = getattr(x, "shape", None)
            if shape is None or tuple(shape) != b.shape:
                got = "missing" if x is None else f"shape {shape}"
                raise ValueError(
                    f"{where}: buffer {b.name!r} must have shape {b.shape}, got "
                    f"{got}. Pass the params {self._PARAMS_FROM} made."
                )

    def _lookup(self, params, features, padding_id, weights, check_ids, batch_major):
        coll, layout, gathers = self._lookup_source()
        return _pooling.lookup(
            coll,
            layout,
            params,
            features,
            padding_id=padding_id,
            weights=weights,
            check_ids=check_ids,
            batch_major=batch_major,
            gathers=gathers,
        )

    def __call__(
        self, params: Params, features: Features, *, padding_id: int | None = None,
        weights: Params | None = None, check_ids: bool = False,
    ) -> dict[str, jax.Array]:  # fmt: skip
        """Pooled (or sequence) embeddings of every feature of the collection.

        A plan looks up as its collection does, on the plan's params (its
        sharded buffers' gathers routed, as ``plan.routing`` says).

        Args:
          params: ``{buffer name: buffer}``
            (:meth:`jaxslices.EmbeddingCollection.init`, or
            :meth:`jaxslices.sharding.ShardingPlan.shard` for a plan).
          features: a :class:`~jaxslices.KeyedJaggedIds` holding at least every
            feature of the collection (other keys are ignored), or padded ids
            ``{feature: [B, L] ids}`` (the fast path for fixed-length
            features: no scatter; ``L`` may differ between features).
          padding_id: padded input only: the id of an empty slot (it counts
            in no bag); ``None``: every slot is an id.
          weights: padded input only: ``{feature: [B, L]}`` per-id weights
            (a ``KeyedJaggedIds`` carries its own).
          check_ids: raise an error (also under ``jit``) if an id is outside
            ``[0, rows)`` of its feature's table.

        Returns:
          ``{feature: [B, dim]}`` for pooled tables, ``{feature: [B, L, dim]}``
          for sequence tables, in the collection's feature order.
        """
        self._check_params(params, self._WHERE)
        pooled, seqs = self._lookup(
            params, features, padding_id, weights, check_ids, False
        )
        out = {**seqs, **_pooling.per_feature(pooled, batch_major=False)}
        return {f: out[f] for f in self._lookup_source()[0].features}

    def concat(
        self, params: Params, features: Features, *, padding_id: int | None = None,
        weights: Params | None = None, check_ids: bool = False,
    ) -> jax.Array:  # fmt: skip
        """The pooled embeddings side by side: ``[B, sum of the features' dims]``.

        TorchRec's ``KeyedTensor.values()``: feature ``i`` (in the
        collection's order) in columns ``sum(dims[:i]) : sum(dims[:i + 1])``.
        With one buffer it is the pooling's own result (batch-major), no copy:
        ``concat(...).reshape(B, F, dim)`` is what a DLRM interacts. Arguments
        as for :meth:`__call__`; every table must pool (no sequence tables).

        Example:
          >>> import jax, jax.numpy as jnp, jaxslices as js
          >>> coll = js.EmbeddingCollection(
          ...     [js.TableConfig("a", 4, 2), js.TableConfig("b", 3, 2)])
          >>> params = {"dim2_float32": jnp.arange(14.0).reshape(7, 2)}
          >>> coll.concat(params, {"a": jnp.array([[1]]), "b": jnp.array([[0]])})
          Array([[2., 3., 8., 9.]], dtype=float32)
        """
        where = f"{self._WHERE}.concat"
        coll = self._lookup_source()[0]
        seq = [t.name for t in coll.tables if t.combiner is None]
        if seq:
            raise ValueError(
                f"{where}: sequence tables {seq} do not pool; use the "
                "collection's call, which returns them as [B, L, dim]."
            )
        self._check_params(params, where)
        pooled, _ = self._lookup(params, features, padding_id, weights, check_ids, True)
        if len(pooled) == 1:
            ((_, x),) = pooled.values()
            return x.reshape(x.shape[0], math.prod(x.shape[1:]))  # a batch may be 0
        cols = _pooling.per_feature(pooled, batch_major=True)
        return jnp.concatenate([cols[f] for f in coll.features], axis=1)

    # -- per-table hyperparameters -------------------------------------------
    def scale_by_table(self, factors: Mapping[str, Any], *, default: Any = 1.0) -> Any:
        """See :func:`jaxslices.transforms.scale_by_table` (a plan: its layout)."""
        view = self._per_table_view()
        return _per_table.scale_by_table(view, factors, default=default)

    def add_decayed_weights_by_table(
        self, rates: Mapping[str, Any], *, default: Any = 0.0
    ) -> Any:
        """See :func:`jaxslices.transforms.add_decayed_weights_by_table` (a plan:
        its layout)."""
        view = self._per_table_view()
        return _per_table.add_decayed_weights_by_table(view, rates, default=default)
