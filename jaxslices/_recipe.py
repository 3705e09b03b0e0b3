"""``PooledGradient``: the pooled form of a sparse gradient (its recipe).

The gradient of an embedding bag is, per looked-up id, its bag's pooled
gradient times the id's weight: ``values[s] = scale * weight[s] * G[bag[s]]``
with ``G`` the pooled gradient ``[B, D]``. The ``[N, D]`` values are an XLA
expression of ``G``; a native kernel (:mod:`jaxslices.kernels`) reads ``G``,
the weights and the bag of each slot instead, and XLA then never computes
the values. A :class:`PooledGradient` is that description, and
:attr:`jaxslices.IndexedSlices.recipe` is where a gradient carries it.

The recipe is a typed, static part of an ``IndexedSlices``, not a pytree
child: the pytree of a slices leaf stays ``(values, indices)`` with aux data
``dense_shape`` (the contract every JAX transformation relies on), and its
flattening and unflattening are pure. Whatever rebuilds slices from their
leaves (a ``jit`` boundary, a checkpoint, any ``jax.tree.map``, the identity
included) gets the values without the recipe; jaxslices' own operations keep
it where the result can be described (see ``docs/sparse_gradients.md``, "The
pooled gradient"), and :func:`jaxslices.kernels.explain` says where a kernel
reads the materialised rows instead.

The same layout is what the kernels take (``kernels/csrc/common.h``): a slot
whose source row is out of ``[0, M)`` holds zeros.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["PooledGradient", "concatenate", "flat_rows"]


def flat_rows(x: jax.Array) -> jax.Array:
    """``[V, *row]`` as ``[V, R]`` (a free reshape; ``R = prod(row)``)."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


@dataclasses.dataclass(frozen=True)
class PooledGradient:
    """The pooled form of a sparse gradient: how its ``N`` rows are made.

    What :attr:`jaxslices.IndexedSlices.recipe` holds for the gradient of
    an :func:`jaxslices.embedding_bag` (float32): the bags' pooled gradient
    and each slot's bag and weight, which the native kernels read instead of
    the ``[N, D]`` values. Read it to see what a kernel will read; the
    values it stands for are ``values(N)``.

    Slot ``s`` holds ``scale * weight[s] * src[b(s)]``, with ``b(s)`` =
    ``bag[s]`` (bags given per slot), ``s // length`` (padded bags of
    ``length`` slots), or ``s`` (the rows themselves); a source row outside
    ``[0, M)`` gives zeros. Rows of slots whose index is padding may hold
    anything: every reader skips them.

    Attributes:
      src: ``[M, R]`` float32 source rows (a bag's pooled gradient, or the
        rows a native kernel returned).
      bag: ``[N]`` int32 source row of each slot, or ``None``.
      length: ``> 0``: padded bags of this many slots (``bag`` is ``None``).
      weight: ``[N]`` float32 per-slot factor, or ``None`` (1).
      scale: a float32 scalar factor of every slot, or ``None`` (1).

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices as js
      >>> table = jnp.ones((10, 2))
      >>> ids = jnp.array([[1, 2], [3, 3]])  # 2 bags of 2 ids
      >>> g = js.grad(lambda t: js.embedding_bag(t, ids, combiner="sum").sum())(table)
      >>> g.recipe  # the pooled gradient [2, 2], padded bags of 2 slots
      PooledGradient(float32[2, 2], padded bags of 2, weight)
      >>> bool((g.recipe.values(4) == g.values).all())
      True
      >>> r = js.PooledGradient(jnp.array([[1.0], [2.0]]), length=2)
      >>> r.scaled(0.5).values(4).ravel()
      Array([0.5, 0.5, 1. , 1. ], dtype=float32)
    """

    src: jax.Array
    bag: jax.Array | None = None
    length: int = 0
    weight: jax.Array | None = None
    scale: jax.Array | None = None

    @classmethod
    def of_rows(cls, values: jax.Array) -> PooledGradient:
        """The recipe of materialised ``[N, *row]`` values: the rows themselves."""
        return cls(flat_rows(values))

    @property
    def pooled(self) -> bool:
        """``True`` when several slots share a source row (a bag's gradient)."""
        return self.bag is not None or self.length > 0

    def scaled(self, factor: Any) -> PooledGradient:
        """The recipe times a scalar."""
        factor = jnp.asarray(factor, jnp.float32)
        scale = factor if self.scale is None else self.scale * factor
        return dataclasses.replace(self, scale=scale)

    def source_rows(self, num_slots: int) -> jax.Array:
        """``b(s)`` of every slot, ``[num_slots]`` int32 (may be out of range)."""
        if self.bag is not None:
            return jnp.asarray(self.bag, jnp.int32)
        slots = jnp.arange(num_slots, dtype=jnp.int32)
        return slots // self.length if self.length > 0 else slots

    def factors(self, num_slots: int) -> jax.Array | None:
        """``scale * weight[s]`` of every slot, ``[num_slots]``, or ``None`` (1)."""
        if self.weight is None and self.scale is None:
            return None
        w = jnp.ones((num_slots,), jnp.float32) if self.weight is None else self.weight
        return w if self.scale is None else w * self.scale

    def values(self, num_slots: int) -> jax.Array:
        """The ``[num_slots, R]`` rows (XLA), padding slots as they are."""
        if self.bag is not None:
            m = self.src.shape[0]
            inside = (self.bag >= 0) & (self.bag < m)
            rows = self.src.at[jnp.where(inside, self.bag, m)].get(
                mode="fill", fill_value=0
            )
        elif self.length > 0:
            rows = jnp.repeat(
                self.src, self.length, axis=0, total_repeat_length=num_slots
            )
        else:
            rows = self.src
        # One product per entry, by the slot's factor (as the kernels compute
        # it: the same float32 rows on both paths).
        f = self.factors(num_slots)
        return rows if f is None else rows * f[:, None]

    def __repr__(self) -> str:
        m, r = self.src.shape
        how = (
            "per-slot bags"
            if self.bag is not None
            else f"padded bags of {self.length}"
            if self.length > 0
            else "rows"
        )
        extras = [x for x in ("weight", "scale") if getattr(self, x) is not None]
        tail = "".join(f", {x}" for x in extras)
        return f"PooledGradient(float32[{m}, {r}], {how}{tail})"


def concatenate(parts: Sequence[tuple[PooledGradient, int]]) -> PooledGradient:
    """The recipe of concatenated slices: ``(recipe, slots)`` of each part.

    Every part becomes per-slot bags into the concatenated sources (a part's
    scale folded into its weights), so concatenating pooled gradients keeps
    them pooled (several lookups of one table, ``tree_add`` of two steps'
    gradients).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxslices._recipe import PooledGradient, concatenate
      >>> a = PooledGradient(jnp.array([[1.0]]), length=2)
      >>> b = PooledGradient(jnp.array([[3.0]]), length=1).scaled(2.0)
      >>> concatenate([(a, 2), (b, 1)]).values(3).ravel()
      Array([1., 1., 6.], dtype=float32)
    """
    if len(parts) == 1:
        return parts[0][0]
    srcs, bags, weights, offset = [], [], [], 0
    weighted = any(r.factors(n) is not None for r, n in parts)
    for recipe, n in parts:
        m = recipe.src.shape[0]
        bag = recipe.source_rows(n)
        bags.append(jnp.where((bag >= 0) & (bag < m), bag + offset, -1))
        srcs.append(recipe.src)
        if weighted:
            w = recipe.factors(n)
            weights.append(jnp.ones((n,), jnp.float32) if w is None else w)
        offset += m
    return PooledGradient(
        jnp.concatenate(srcs),
        bag=jnp.concatenate(bags).astype(jnp.int32),
        weight=jnp.concatenate(weights) if weighted else None,
    )
