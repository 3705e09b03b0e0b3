"""Jagged ids: bags of different lengths as flat ids plus offsets.

Data pipelines deliver variable-length features as flat ids plus offsets or
lengths (PyTorch ``EmbeddingBag(input, offsets)``, TorchRec's
``JaggedTensor``, TF's ``RaggedTensor``). :class:`JaggedIds` holds them in a
form ``jax.jit`` accepts: a flat id array of a **static** length
``max_total`` (the most ids a batch may hold) and ``num_bags + 1`` offsets.
Bag ``b`` is ``values[offsets[b]:offsets[b + 1]]``; slots from
``offsets[-1]`` on are unused (they read nothing and get no gradient), so
batches of any total length up to ``max_total`` share one compilation.

:func:`jaxslices.embedding_bag` takes a :class:`JaggedIds` where it takes a
padded ``[..., L]`` id array, with the same combiners and the same sparse
gradient (one slot per id, unused slots as padding).

Build them with :meth:`JaggedIds.from_lists` (a list of lists),
:meth:`JaggedIds.from_lengths` (flat values and per-bag lengths, as
TorchRec's ``lengths``) or :meth:`JaggedIds.from_padded` (a padded
``[num_bags, L]`` array and its padding id), as
:class:`~jaxslices.KeyedJaggedIds` is built; the free functions
``jagged_from_lists`` / ``_lengths`` / ``_padded`` are their earlier names.
Data that does not fit ``max_total`` raises: eagerly in the constructors
for concrete data, and under ``jit`` through
:func:`jaxslices._errors.raise_if` (``jax.errors.JaxRuntimeError``, or
``ValueError`` on later calls of a compiled step, when the step runs, on every
device of a mesh). :func:`check_jagged` checks offsets
built by hand the same way (``embedding_bag`` calls it).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from . import _errors, _ids

__all__ = [
    "JaggedIds",
    "check_jagged",
    "jagged_from_lengths",
    "jagged_from_lists",
    "jagged_from_padded",
    "segment_ids",
    "weights_like",
]


class JaggedIds(NamedTuple):
    """Bags of ids of different lengths: flat ``values`` plus ``offsets``.

    A pytree (a ``NamedTuple``): it passes through ``jax.jit`` and
    ``jax.tree`` functions as its arrays.

    Attributes:
      values: ``[max_total]`` integer ids, bag after bag; slots from
        ``offsets[-1]`` on are unused.
      offsets: int32 ``[num_bags + 1]``: ``offsets[0] == 0``, nondecreasing,
        ``offsets[-1] <= max_total``. Bag ``b`` is
        ``values[offsets[b]:offsets[b + 1]]``.
      weights: optional ``[max_total]`` per-id weights (PyTorch's
        ``per_sample_weights``).

    Example:
      >>> import jaxslices
      >>> j = jaxslices.JaggedIds.from_lists([[3, 1], [], [2]], max_total=5)
      >>> j.values, j.offsets
      (Array([3, 1, 2, 0, 0], dtype=int32), Array([0, 2, 2, 3], dtype=int32))
      >>> j.num_bags, j.max_total, j.lengths
      (3, 5, Array([2, 0, 1], dtype=int32))
    """

    values: jax.Array
    offsets: jax.Array
    weights: jax.Array | None = None

    @property
    def num_bags(self) -> int:
        """The number of bags (static): ``offsets.shape[0] - 1``."""
        return int(self.offsets.shape[0]) - 1

    @property
    def max_total(self) -> int:
        """The number of id slots (static): ``values.shape[0]``."""
        return int(self.values.shape[0])

    @property
    def lengths(self) -> jax.Array:
        """``[num_bags]`` bag lengths: ``offsets[1:] - offsets[:-1]``."""
        offsets = jnp.asarray(self.offsets)
        return offsets[1:] - offsets[:-1]

    # -- constructors (TorchRec's KeyedJaggedTensor.from_*, KeyedJaggedIds') --
    @classmethod
    def from_lists(
        cls,
        lists: Sequence[Sequence[int]],
        *,
        max_total: int | None = None,
        weights: Sequence[Sequence[float]] | None = None,
        dtype: Any = jnp.int32,
    ) -> JaggedIds:
        """:class:`JaggedIds` from a list of bags (each a list of ids), eagerly.

        Args:
          lists: one sequence of ids per bag (empty bags allowed).
          max_total: the static number of id slots (default: the ids' total).
            Keep it fixed across batches so a jitted step compiles once.
          weights: optional per-id weights, one sequence per bag, shaped like
            ``lists``.
          dtype: the ids' integer dtype.

        Raises:
          ValueError: the ids do not fit ``max_total``, or ``weights`` is not
            shaped like ``lists``.

        Example:
          >>> import jaxslices
          >>> j = jaxslices.JaggedIds.from_lists([[4], [1, 1]], weights=[[0.5], [1, 2]])
          >>> j.weights
          Array([0.5, 1. , 2. ], dtype=float32)
        """
        return _from_lists(
            lists,
            max_total=max_total,
            weights=weights,
            dtype=dtype,
            where="JaggedIds.from_lists",
        )

    @classmethod
    def from_lengths(
        cls,
        values: ArrayLike,
        lengths: ArrayLike,
        *,
        max_total: int | None = None,
        weights: ArrayLike | None = None,
    ) -> JaggedIds:
        """:class:`JaggedIds` from flat ids and per-bag lengths (TorchRec's layout).

        Bag ``b`` holds the next ``lengths[b]`` ids of ``values``. Works under
        ``jit`` (``lengths`` may be traced; ``max_total`` is static).

        Args:
          values: ``[n]`` integer ids, bag after bag (ids past ``sum(lengths)``
            are ignored).
          lengths: ``[num_bags]`` non-negative integers.
          max_total: the static number of id slots (default ``n``); ``values``
            is cut or zero-padded to it.
          weights: optional ``[n]`` per-id weights.

        Raises:
          ValueError: a negative length, or ``sum(lengths)`` more than
            ``max_total`` or than the ``n`` ids given (eagerly; under ``jit``
            ``jax.errors.JaxRuntimeError``, or ``ValueError`` on later calls, with
            this message when the step runs).

        Example:
          >>> import jax.numpy as jnp, jaxslices
          >>> values, lengths = jnp.array([7, 8, 9]), jnp.array([1, 0, 2])
          >>> j = jaxslices.JaggedIds.from_lengths(values, lengths)
          >>> j.offsets
          Array([0, 1, 1, 3], dtype=int32)
        """
        return _from_lengths(
            values,
            lengths,
            max_total=max_total,
            weights=weights,
            where="JaggedIds.from_lengths",
        )

    @classmethod
    def from_padded(
        cls,
        ids: ArrayLike,
        *,
        padding_id: int,
        max_total: int | None = None,
        weights: ArrayLike | None = None,
    ) -> JaggedIds:
        """:class:`JaggedIds` from a padded ``[num_bags, L]`` id array.

        Bag ``b`` holds the ids of row ``b`` that are not ``padding_id``, in
        order (padding may be anywhere in the row). Works under ``jit``.

        Args:
          ids: ``[num_bags, L]`` integer ids.
          padding_id: the id that marks an empty slot.
          max_total: the static number of id slots (default ``num_bags * L``,
            which always fits).
          weights: optional ``[num_bags, L]`` per-id weights (those of padding
            slots are dropped).

        Raises:
          ValueError: more non-padding ids than ``max_total`` (eagerly; under
            ``jit`` ``jax.errors.JaxRuntimeError``, or ``ValueError`` on later
            calls, when the step runs).

        Example:
          >>> import jax.numpy as jnp, jaxslices
          >>> ids = jnp.array([[5, -1], [-1, -1], [2, 3]])
          >>> j = jaxslices.JaggedIds.from_padded(ids, padding_id=-1)
          >>> j.values, j.offsets
          (Array([5, 2, 3, 0, 0, 0], dtype=int32), Array([0, 1, 1, 3], dtype=int32))
        """
        return _from_padded(
            ids,
            padding_id=padding_id,
            max_total=max_total,
            weights=weights,
            where="JaggedIds.from_padded",
        )


def _overflow(total: int, *, max_total: int, where: str, hint: str) -> ValueError:
    return ValueError(
        f"{where}: the bags hold {total} ids in all, more than max_total="
        f"{max_total} slots. Pass a larger static `max_total` (the most ids one "
        f"batch may hold){hint}."
    )


def _check_max_total(max_total: Any, where: str) -> int:
    if isinstance(max_total, jax.core.Tracer) or not isinstance(
        max_total, int | np.integer
    ):
        raise TypeError(
            f"{where}: `max_total` must be a Python int (a static size under "
            f"jit), got {max_total!r}."
        )
    if max_total < 0:
        raise ValueError(f"{where}: `max_total` must be >= 0, got {max_total}.")
    return int(max_total)


def _pad_to(x: jax.Array, size: int) -> jax.Array:
    """``x`` (1-D) cut or zero-padded to ``size`` entries."""
    if x.shape[0] >= size:
        return x[:size]
    return jnp.concatenate([x, jnp.zeros((size - x.shape[0],), x.dtype)])


def _integer(x: Any, name: str, where: str) -> Any:
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise TypeError(
            f"{where}: `{name}` must be integers, got {jnp.result_type(x).name}"
            f"{list(jnp.shape(x))}. Cast them, e.g. `{name}.astype(jnp.int32)`."
        )
    return x


def weights_like(weights: Any, shape: tuple, name: str, where: str) -> Any:
    """``weights`` as an array of ``shape`` (that of the ids ``name``), or raise."""
    if weights is None:
        return None
    weights = jnp.asarray(weights)
    if weights.shape != tuple(shape):
        raise ValueError(
            f"{where}: `weights` must have the shape of `{name}` {tuple(shape)}, "
            f"got {tuple(weights.shape)}."
        )
    return weights


def _from_lists(
    lists: Sequence[Sequence[int]],
    *,
    max_total: int | None = None,
    weights: Sequence[Sequence[float]] | None = None,
    dtype: Any = jnp.int32,
    where: str,
) -> JaggedIds:
    lists = [list(b) for b in lists]
    lengths = [len(b) for b in lists]
    total = sum(lengths)
    max_total = total if max_total is None else _check_max_total(max_total, where)
    if total > max_total:
        raise _overflow(total, max_total=max_total, where=where, hint="")
    flat = np.zeros(max_total, dtype)
    flat[:total] = np.asarray([i for b in lists for i in b], dtype).reshape(-1)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    w = None
    if weights is not None:
        weights = [list(b) for b in weights]
        if [len(b) for b in weights] != lengths:
            raise ValueError(
                f"{where}: `weights` must hold one weight per id, shaped like "
                f"`lists` (bag lengths {lengths}), got bag lengths "
                f"{[len(b) for b in weights]}."
            )
        w = np.zeros(max_total, np.float32)
        w[:total] = np.asarray([x for b in weights for x in b], np.float32)
        w = jnp.asarray(w)
    return JaggedIds(jnp.asarray(flat), jnp.asarray(offsets), w)


def _from_lengths(
    values: ArrayLike,
    lengths: ArrayLike,
    *,
    max_total: int | None = None,
    weights: ArrayLike | None = None,
    where: str,
) -> JaggedIds:
    values = _ids.to_jax(_integer(values, "values", where), where)
    lengths = jnp.asarray(_integer(lengths, "lengths", where))
    if values.ndim != 1 or lengths.ndim != 1:
        raise ValueError(
            f"{where}: `values` and `lengths` must be 1-D, got shapes "
            f"{tuple(values.shape)} and {tuple(lengths.shape)}."
        )
    n = int(values.shape[0])
    max_total = n if max_total is None else _check_max_total(max_total, where)
    weights = weights_like(weights, values.shape, "values", where)
    if weights is not None:
        weights = _pad_to(weights, max_total)
    lengths = lengths.astype(jnp.int32)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths)])
    limit = min(n, max_total)
    hint = (
        ""
        if limit == max_total
        else f"; only {n} ids were given, so sum(lengths) must be <= {n}"
    )
    error = functools.partial(_overflow, max_total=max_total, where=where, hint=hint)
    if not _ids.has_tracer(lengths):  # checked in NumPy: no op is traced here
        given = np.asarray(lengths)
        if np.any(given < 0):
            raise ValueError(f"{where}: `lengths` must be >= 0, got {given}.")
        if int(given.sum()) > limit:
            raise error(int(given.sum()))
    else:
        offsets = _errors.raise_if(
            jnp.any(lengths < 0),
            offsets,
            lambda n_neg: ValueError(
                f"{where}: {n_neg} of `lengths` are negative; every bag's "
                "length must be >= 0."
            ),
            jnp.sum(lengths < 0),
        )
        offsets = _errors.raise_if(offsets[-1] > limit, offsets, error, offsets[-1])
    return JaggedIds(_pad_to(values, max_total), offsets, weights)


def _from_padded(
    ids: ArrayLike,
    *,
    padding_id: int,
    max_total: int | None = None,
    weights: ArrayLike | None = None,
    where: str,
) -> JaggedIds:
    ids = _ids.to_jax(_integer(ids, "ids", where), where)
    if ids.ndim != 2:
        raise ValueError(
            f"{where}: `ids` must be a padded [num_bags, L] array, got shape "
            f"{tuple(ids.shape)}."
        )
    size = int(ids.size)
    max_total = size if max_total is None else _check_max_total(max_total, where)
    info = np.iinfo(ids.dtype)
    padded = info.min <= padding_id <= info.max
    if padded:
        present = ids != padding_id
    else:
        present = jnp.ones(ids.shape, bool)
    counts = jnp.sum(present, axis=1, dtype=jnp.int32)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts)])
    error = functools.partial(_overflow, max_total=max_total, where=where, hint="")
    if not _ids.has_tracer(ids):  # checked in NumPy: no op is traced here
        given = np.asarray(ids)
        total = int(np.sum(given != padding_id)) if padded else size
        if total > max_total:
            raise error(total)
    else:
        offsets = _errors.raise_if(offsets[-1] > max_total, offsets, error, offsets[-1])
    flat_present = present.reshape(-1)
    # Slot of each present id; absent ones (and overflow) are dropped.
    slot = jnp.cumsum(flat_present, dtype=jnp.int32) - 1
    slot = jnp.where(flat_present, slot, max_total)

    def compact(x):  # absent ids all go to slot max_total: out of bounds, dropped
        return jnp.zeros((max_total,), x.dtype).at[slot].set(x.reshape(-1), mode="drop")

    weights = weights_like(weights, ids.shape, "ids", where)
    if weights is not None:
        weights = compact(weights)
    return JaggedIds(compact(ids), offsets, weights)


def _bad_offsets(first: int, n_down: int, last: int, *, max_total: int, where: str):
    return ValueError(
        f"{where}: invalid JaggedIds offsets: they must start at 0, never "
        f"decrease and end at most at max_total={max_total} (values.shape[0]); "
        f"got offsets[0]={first}, {n_down} decreasing step(s), offsets[-1]={last}. "
        "Build them with jaxslices.JaggedIds.from_lists / from_lengths / "
        "from_padded, or pass a larger `values` array."
    )


def check_jagged(jagged: JaggedIds, where: str = "jaxslices.check_jagged") -> JaggedIds:
    """Check a :class:`JaggedIds`: shapes at trace time, offsets at run time.

    Static checks (``TypeError``/``ValueError`` at once): ``values`` 1-D
    integers, ``offsets`` 1-D integers with at least one entry, ``weights``
    (if any) shaped like ``values``. Offsets must start at 0, never decrease
    and end at most at ``max_total``: checked eagerly for concrete offsets,
    and under ``jit`` by :func:`jaxslices._errors.raise_if`. Returns the
    jagged ids (offsets as int32); under ``jit`` what is computed from the
    result's offsets waits for the check.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> bad = jaxslices.JaggedIds(jnp.zeros(2, int), jnp.array([0, 3]))
      >>> jaxslices.check_jagged(bad)
      Traceback (most recent call last):
      ...
      ValueError: jaxslices.check_jagged: invalid JaggedIds offsets: ...
    """
    if not isinstance(jagged, JaggedIds):
        raise TypeError(f"{where}: expected a jaxslices.JaggedIds, got {jagged!r}.")
    values, offsets, weights = jagged
    values = _integer(values, "values", where)
    offsets = jnp.asarray(_integer(offsets, "offsets", where))
    if jnp.ndim(values) != 1 or offsets.ndim != 1 or offsets.shape[0] < 1:
        raise ValueError(
            f"{where}: JaggedIds needs 1-D `values` and 1-D `offsets` with "
            f"num_bags + 1 >= 1 entries, got shapes {tuple(jnp.shape(values))} "
            f"and {tuple(offsets.shape)}."
        )
    weights = weights_like(weights, jnp.shape(values), "values", where)
    max_total = int(jnp.shape(values)[0])
    error = functools.partial(_bad_offsets, max_total=max_total, where=where)
    if not _ids.has_tracer(offsets):  # checked in NumPy: no op is traced here
        given = np.asarray(offsets)
        down = int(np.sum(given[1:] < given[:-1]))
        if given[0] != 0 or down or given[-1] > max_total:
            raise error(int(given[0]), down, int(given[-1]))
    else:
        down = offsets[1:] < offsets[:-1]
        bad = (offsets[0] != 0) | jnp.any(down) | (offsets[-1] > max_total)
        payload = (offsets[0], jnp.sum(down, dtype=jnp.int32), offsets[-1])
        offsets = _errors.raise_if(bad, offsets.astype(jnp.int32), error, *payload)
    return JaggedIds(values, offsets.astype(jnp.int32), weights)


def segment_ids(offsets: jax.Array, max_total: int) -> jax.Array:
    """Each slot's bag: ``[max_total]`` int32, ``num_bags`` for unused slots.

    Nondecreasing (so scatters by it may say ``indices_are_sorted``). O(max_total
    + num_bags): a scatter of ones at the bag ends, then a cumulative sum.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxslices.jagged import segment_ids
      >>> segment_ids(jnp.array([0, 2, 2, 3]), 5)
      Array([0, 0, 2, 3, 3], dtype=int32)
    """
    ends = jnp.zeros((max_total + 1,), jnp.int32).at[offsets[1:]].add(1, mode="drop")
    return jnp.cumsum(ends, dtype=jnp.int32)[:max_total]


# ---------------------------------------------- the constructors' old names


def jagged_from_lists(
    lists: Sequence[Sequence[int]],
    *,
    max_total: int | None = None,
    weights: Sequence[Sequence[float]] | None = None,
    dtype: Any = jnp.int32,
) -> JaggedIds:
    """:meth:`JaggedIds.from_lists` (its earlier name; errors name this one)."""
    return _from_lists(
        lists,
        max_total=max_total,
        weights=weights,
        dtype=dtype,
        where="jaxslices.jagged_from_lists",
    )


def jagged_from_lengths(
    values: ArrayLike,
    lengths: ArrayLike,
    *,
    max_total: int | None = None,
    weights: ArrayLike | None = None,
) -> JaggedIds:
    """:meth:`JaggedIds.from_lengths` (its earlier name; errors name this one)."""
    return _from_lengths(
        values,
        lengths,
        max_total=max_total,
        weights=weights,
        where="jaxslices.jagged_from_lengths",
    )


def jagged_from_padded(
    ids: ArrayLike,
    *,
    padding_id: int,
    max_total: int | None = None,
    weights: ArrayLike | None = None,
) -> JaggedIds:
    """:meth:`JaggedIds.from_padded` (its earlier name; errors name this one)."""
    return _from_padded(
        ids,
        padding_id=padding_id,
        max_total=max_total,
        weights=weights,
        where="jaxslices.jagged_from_padded",
    )
