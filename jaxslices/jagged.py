"""PLACEHOLDER (branch h-collection only): the agreed shape of jagged ids.

The issue 20 helper owns ``jaxslices/jagged.py`` and commits it as one
standalone "jagged:" commit; this placeholder is reverted and that commit
cherry-picked as soon as it exists. It holds only what the collection needs,
with the agreed names: ``JaggedIds(values, offsets, weights)`` and
``jagged_from_lengths``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["JaggedIds", "jagged_from_lengths"]


class JaggedIds(NamedTuple):
    """Bags of ids, flat: bag ``b`` holds ``values[offsets[b]:offsets[b + 1]]``."""

    values: Any
    offsets: Any
    weights: Any = None

    @property
    def num_bags(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def max_total(self) -> int:
        return int(self.values.shape[0])

    @property
    def lengths(self) -> jax.Array:
        return jnp.diff(self.offsets)


def jagged_from_lengths(
    values: Any, lengths: Any, *, max_total: int | None = None, weights: Any = None
) -> JaggedIds:
    """Jagged ids from flat ``values`` and per-bag ``lengths`` (NumPy inputs)."""
    values, lengths = np.asarray(values), np.asarray(lengths).reshape(-1)
    total = int(lengths.sum())
    max_total = total if max_total is None else max_total
    if total > max_total:
        raise ValueError(f"jagged_from_lengths: {total} ids > max_total {max_total}")
    vals = np.zeros(max_total, values.dtype)
    vals[:total] = values[:total]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    if weights is not None:
        w = np.zeros(max_total, np.asarray(weights).dtype)
        w[:total] = np.asarray(weights)[:total]
        weights = jnp.asarray(w)
    return JaggedIds(jnp.asarray(vals), jnp.asarray(offsets), weights)
