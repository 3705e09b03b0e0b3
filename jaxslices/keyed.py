"""``KeyedJaggedIds``: the ids of several sparse features, one flat array.

The input of an :class:`~jaxslices.EmbeddingCollection`, as TorchRec's
``KeyedJaggedTensor`` is the input of its ``EmbeddingBagCollection``: the
bags of ``F`` features for a batch of ``B`` examples are ``F * B`` bags of
:class:`~jaxslices.jagged.JaggedIds`, **feature-major** (bag ``f * B + b``
holds the ids of feature ``keys[f]`` in example ``b``), and the feature
names are static (pytree aux data), so a batch passes through ``jax.jit``
with one compilation per ``(keys, B, max_total)``.

Constructors: :meth:`KeyedJaggedIds.from_lengths` (flat ids and per-bag
lengths, TorchRec's layout), :meth:`KeyedJaggedIds.from_lists` (Python
lists per feature) and :meth:`KeyedJaggedIds.from_padded` (``[B, L]`` id
arrays per feature with a padding id; works on traced arrays, under
``jit``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _ids
from .jagged import JaggedIds, _from_lengths, _from_lists, _from_padded, check_jagged

__all__ = ["KeyedJaggedIds"]


def _check_keys(keys: Any, where: str) -> tuple[str, ...]:
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise TypeError(
            f"{where}: `keys` must be a sequence of feature names (str), got "
            f"{type(keys).__name__}."
        )
    keys = tuple(keys)
    bad = [k for k in keys if not isinstance(k, str)]
    if bad or not keys:
        raise TypeError(
            f"{where}: `keys` must be a non-empty sequence of str, got {keys!r}."
        )
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"{where}: feature names must be unique; repeated: {dup}.")
    return keys


def padded_features(
    ids: Mapping[str, Any], keys: Sequence[str], weights: Any, where: str
) -> tuple[list[jax.Array], list[jax.Array] | None, int, Any]:
    """Padded ids ``{feature: [B, L] ids}`` of ``keys``, checked, and their weights.

    Every feature's ids an integer ``[B, L]`` array of one batch size ``B``
    (``L`` may differ); ``weights``, if given, a dict with at least every
    key, each of its ids' shape. Returns ``(ids, float32 weights or None,
    the longest L, the ids' common dtype)``; :func:`pad_bags` pads a
    feature to that ``L``. What :meth:`KeyedJaggedIds.from_padded` and a
    collection's padded lookups read.

    Example:
      >>> import numpy as np
      >>> arrs, ws, L, dtype = padded_features(
      ...     {"a": np.zeros((2, 3), np.int32), "b": np.zeros((2, 1), np.int32)},
      ...     ["a", "b"], None, "here")
      >>> [a.shape for a in arrs], ws, L, dtype.name
      ([(2, 3), (2, 1)], None, 3, 'int32')
    """
    arrs = [_ids.to_jax(ids[k], f"{where} (the ids of feature {k!r})") for k in keys]
    for k, a in zip(keys, arrs, strict=True):
        if a.ndim != 2 or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(
                f"{where}: padded ids must be [B, L] per feature, of an integer "
                f"dtype; feature {k!r} has {a.dtype}{list(a.shape)}."
            )
    if len({a.shape[0] for a in arrs}) != 1:
        raise ValueError(
            f"{where}: every feature needs the same batch size, got "
            f"{ {k: a.shape[0] for k, a in zip(keys, arrs, strict=True)} }."
        )
    ws = None
    if weights is not None:
        if not isinstance(weights, Mapping) or not set(keys) <= set(weights):
            raise ValueError(
                f"{where}: `weights` must be a dict with every feature "
                f"{list(keys)}, like the ids."
            )
        ws = [jnp.asarray(weights[k], jnp.float32) for k in keys]
        for k, a, w in zip(keys, arrs, ws, strict=True):
            if w.shape != a.shape:
                raise ValueError(
                    f"{where}: the weights of {k!r} must have the shape of its ids "
                    f"{tuple(a.shape)}, got {tuple(w.shape)}."
                )
    return arrs, ws, max(a.shape[1] for a in arrs), jnp.result_type(*arrs)


def pad_bags(x: jax.Array, length: int, value: Any) -> jax.Array:
    """``[B, L]`` to ``[B, length]``, the new slots ``value``."""
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1])), constant_values=value)


@jax.tree_util.register_pytree_with_keys_class
class KeyedJaggedIds:
    """Jagged ids of named features, feature-major (TorchRec's ``KeyedJaggedTensor``).

    Args:
      keys: the feature names, static.
      ids: :class:`~jaxslices.jagged.JaggedIds` with ``len(keys) * B`` bags;
        bag ``f * B + b`` holds feature ``keys[f]`` of example ``b``.

    Raises:
      ValueError: the number of bags is not a multiple of ``len(keys)``.

    Example:
      >>> import jaxslices as js
      >>> kjt = js.KeyedJaggedIds.from_lists(
      ...     {"user": [[3], [1]], "tags": [[0, 2], []]})
      >>> kjt.keys, kjt.batch_size, kjt.lengths.tolist()
      (('user', 'tags'), 2, [1, 1, 2, 0])
    """

    __slots__ = ("keys", "ids")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, keys: Sequence[str], ids: JaggedIds):
        keys = _check_keys(keys, "KeyedJaggedIds")
        if not isinstance(ids, JaggedIds):
            raise TypeError(
                "KeyedJaggedIds: `ids` must be a jaxslices JaggedIds, got "
                f"{type(ids).__name__}. Build one with KeyedJaggedIds.from_lengths "
                "or from_lists."
            )
        if ids.num_bags % len(keys):
            raise ValueError(
                f"KeyedJaggedIds: {ids.num_bags} bags cannot be split over "
                f"{len(keys)} features {keys}: the bags are feature-major, "
                "len(keys) * batch_size of them."
            )
        self.keys = keys
        # offsets made by hand are checked (eagerly, or under jit when used)
        self.ids = check_jagged(ids, "KeyedJaggedIds")

    @classmethod
    def _made(cls, keys: tuple[str, ...], ids: JaggedIds) -> KeyedJaggedIds:
        """From jaxslices' own constructors, whose offsets are valid."""
        if ids.num_bags % len(keys):
            raise ValueError(
                f"KeyedJaggedIds: {ids.num_bags} bags cannot be split over "
                f"{len(keys)} features {keys}: the bags are feature-major, "
                "len(keys) * batch_size of them."
            )
        out = object.__new__(cls)
        out.keys, out.ids = keys, ids
        return out

    # -- pytree ---------------------------------------------------------------
    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("ids"), self.ids),), self.keys

    def tree_flatten(self):
        return (self.ids,), self.keys

    @classmethod
    def tree_unflatten(cls, keys, children):
        out = object.__new__(cls)  # no validation on placeholder leaves
        out.keys = keys
        (out.ids,) = children
        return out

    # -- properties -----------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """``B``: bags per feature (static)."""
        return self.ids.num_bags // len(self.keys)

    @property
    def values(self) -> jax.Array:
        return self.ids.values

    @property
    def offsets(self) -> jax.Array:
        return self.ids.offsets

    @property
    def weights(self) -> jax.Array | None:
        return self.ids.weights

    @property
    def lengths(self) -> jax.Array:
        """Ids per bag, ``[len(keys) * B]``, feature-major."""
        return self.ids.lengths

    @property
    def max_total(self) -> int:
        return self.ids.max_total

    def __repr__(self) -> str:
        return (
            f"KeyedJaggedIds(keys={list(self.keys)}, batch_size={self.batch_size}, "
            f"max_total={self.max_total}, weighted={self.weights is not None})"
        )

    # -- constructors ---------------------------------------------------------
    @classmethod
    def from_lengths(
        cls,
        keys: Sequence[str],
        values: Any,
        lengths: Any,
        *,
        weights: Any = None,
        max_total: int | None = None,
    ) -> KeyedJaggedIds:
        """From flat ids and lengths, as TorchRec's ``KeyedJaggedTensor``.

        Args:
          keys: ``F`` feature names.
          values: the flat ids, feature-major.
          lengths: ids per bag, ``[F * B]`` or ``[F, B]``.
          weights: optional per-id weights, like ``values``.
          max_total: the static capacity (default: ``len(values)``); unused
            slots are padding.

        Example:
          >>> import numpy as np, jaxslices as js
          >>> kjt = js.KeyedJaggedIds.from_lengths(
          ...     ["a", "b"], np.array([5, 1, 2]), np.array([[1, 0], [2, 0]]))
          >>> kjt.batch_size, kjt.offsets.tolist()
          (2, [0, 1, 1, 3, 3])
        """
        keys = _check_keys(keys, "KeyedJaggedIds.from_lengths")
        lengths = jnp.asarray(lengths)
        if lengths.ndim == 2 and lengths.shape[0] != len(keys):
            raise ValueError(
                f"KeyedJaggedIds.from_lengths: `lengths` of shape {lengths.shape} "
                f"must be [F, B] with F = {len(keys)} features, or flat [F * B]."
            )
        ids = _from_lengths(
            values,
            lengths.reshape(-1),
            max_total=max_total,
            weights=weights,
            where="KeyedJaggedIds.from_lengths",
        )
        return cls._made(keys, ids)

    @classmethod
    def from_lists(
        cls,
        lists: Mapping[str, Sequence[Sequence[int]]],
        *,
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
        max_total: int | None = None,
    ) -> KeyedJaggedIds:
        """From ``{feature: [ids of example 0, ids of example 1, ...]}``.

        Every feature must have the same number of examples.

        Example:
          >>> import jaxslices as js
          >>> kjt = js.KeyedJaggedIds.from_lists({"a": [[1, 2], [3]]}, max_total=4)
          >>> kjt.values.tolist(), kjt.offsets.tolist()
          ([1, 2, 3, 0], [0, 2, 3])
        """
        where = "KeyedJaggedIds.from_lists"
        keys = _check_keys(list(lists), where)
        sizes = {k: len(lists[k]) for k in keys}
        if len(set(sizes.values())) != 1:
            raise ValueError(
                f"{where}: every feature needs the same number of examples, got "
                f"{sizes}."
            )
        if weights is not None and set(weights) != set(keys):
            raise ValueError(
                f"{where}: `weights` must have the keys of `lists` {list(keys)}, "
                f"got {list(weights)}."
            )
        bags = [bag for k in keys for bag in lists[k]]
        flat = np.asarray([i for b in bags for i in b])
        if flat.size and not np.issubdtype(flat.dtype, np.integer):
            raise TypeError(f"{where}: ids must be integers, got {flat.dtype}.")
        w = None if weights is None else [bag for k in keys for bag in weights[k]]
        ids = _from_lists(bags, max_total=max_total, weights=w, where=where)
        return cls._made(keys, ids)

    @classmethod
    def from_padded(
        cls,
        ids: Mapping[str, Any],
        *,
        padding_id: int,
        weights: Mapping[str, Any] | None = None,
    ) -> KeyedJaggedIds:
        """From ``{feature: [B, L] ids}``; slots equal to ``padding_id`` are dropped.

        Works on traced arrays (under ``jit``): ``max_total`` is ``F * B * L``
        (``L``: the longest bag axis; features may differ in ``L``), and the
        ids of each bag keep their order (:meth:`jaxslices.JaggedIds.from_padded`).

        Example:
          >>> import jax.numpy as jnp, jaxslices as js
          >>> kjt = js.KeyedJaggedIds.from_padded(
          ...     {"a": jnp.array([[4, -1], [-1, -1]])}, padding_id=-1)
          >>> kjt.lengths.tolist(), kjt.values[:1].tolist()
          ([1, 0], [4])
        """
        where = "KeyedJaggedIds.from_padded"
        keys = _check_keys(list(ids), where)
        if weights is not None and set(weights) != set(keys):
            raise ValueError(
                f"{where}: `weights` must have the keys of `ids` {list(keys)}."
            )
        arrs, ws, L, dtype = padded_features(ids, keys, weights, where)
        info = np.iinfo(dtype)
        if any(a.shape[1] < L for a in arrs) and not (
            info.min <= padding_id <= info.max
        ):
            raise ValueError(
                f"{where}: the features have bags of different lengths "
                f"{ {k: a.shape[1] for k, a in zip(keys, arrs, strict=True)} }, and "
                f"the slots added to reach {L} are filled with padding_id="
                f"{padding_id}, which {jnp.dtype(dtype).name} ids cannot hold. Pass "
                "a padding_id in the ids' range, or pad every feature to one length."
            )
        ids = jnp.concatenate([pad_bags(a.astype(dtype), L, padding_id) for a in arrs])
        w = None
        if ws is not None:
            w = jnp.concatenate([pad_bags(x, L, 0) for x in ws])
        jagged = _from_padded(
            ids, padding_id=padding_id, weights=w, where="KeyedJaggedIds.from_padded"
        )
        return cls._made(keys, jagged)
