"""Internal: what the framework layers share (NNX, Linen, Equinox).

The three framework modules hold only their framework's plumbing (parameter
creation, fields, gradient entry points); the lookups, their options and the
options' checks live here, written once:

* ``strict`` (:mod:`jaxslices._strict`): the lookups raise if JAX would
  differentiate the table densely.
* PyTorch's options: ``padding_idx`` (:func:`padding_row`: negative counts
  from the end, as in ``torch.nn.Embedding``; the row is zeroed at
  initialisation, read as it is, never given a gradient), ``max_norm`` and
  ``norm_type`` (:mod:`jaxslices.max_norm`).
* ``Embed`` lookups (:func:`lookup`): integer ids, negative ids counting from
  the end as in the stock layers, a one-row table read by every id.
* bag lookups (:func:`bag`): padded ``[..., L]`` ids, :class:`JaggedIds`, or
  PyTorch's ``(input, offsets)`` pair (:func:`bag_ids`), pooled by
  :func:`jaxslices.embedding_bag` (``combiner``: ``"mean"``, ``"sum"``,
  ``"sqrtn"``, ``"max"``), whose bags rule (:func:`jaxslices._ids.in_bags`)
  leaves ids outside ``[0, V)`` (e.g. ``-1`` padding) and ``padding_idx``
  out of the bags.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._ids import integer_ids, wrap_negative
from .embedding import MAX_WEIGHTS, embedding_bag, embedding_lookup
from .jagged import JaggedIds, check_jagged
from .max_norm import apply_max_norm, check_max_norm

__all__ = [
    "bag",
    "bag_ids",
    "check_options",
    "keep_options",
    "lookup",
    "renormed",
    "padding_row",
    "zero_padding_row",
]

COMBINERS = ("mean", "sum", "sqrtn", "max")


def padding_row(padding_idx: Any, num_embeddings: int, where: str) -> int | None:
    """PyTorch's ``padding_idx`` as a row in ``[0, V)`` (negative: from the end).

    Example:
      >>> from jaxslices._frameworks import padding_row
      >>> padding_row(-1, 10, "Embed"), padding_row(None, 10, "Embed")
      (9, None)
    """
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int | np.integer):
        raise TypeError(
            f"{where}: `padding_idx` must be an int (or None), got {padding_idx!r}."
        )
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(
            f"{where}: `padding_idx` must be within num_embeddings: in "
            f"[-{num_embeddings}, {num_embeddings}), got {padding_idx}."
        )
    return int(padding_idx) % num_embeddings


def check_options(
    where: str,
    num_embeddings: int,
    padding_idx: Any,
    max_norm: Any,
    norm_type: Any,
    combiner: str | None = None,
) -> int | None:
    """Check a layer's options at construction; returns the padding row."""
    check_max_norm(max_norm, norm_type, where)
    if combiner is not None and combiner not in COMBINERS:
        raise ValueError(
            f"{where}: `combiner` must be one of {COMBINERS}, got {combiner!r} "
            "(PyTorch's `mode`)."
        )
    return padding_row(padding_idx, num_embeddings, where)


def keep_options(
    layer: Any,
    where: str,
    num_embeddings: int,
    padding_idx: Any,
    max_norm: Any,
    norm_type: Any,
    strict: bool,
    combiner: str | None = None,
) -> int | None:
    """Check a layer's options (:func:`check_options`) and set them on it.

    Sets ``padding_idx`` (as its row in ``[0, V)``), ``max_norm``,
    ``norm_type``, ``strict`` and a bag layer's ``combiner`` as attributes
    of ``layer``, in its constructor (an NNX or Equinox module); returns the
    padding row.
    """
    pad = check_options(
        where, num_embeddings, padding_idx, max_norm, norm_type, combiner
    )
    layer.padding_idx, layer.max_norm, layer.norm_type = pad, max_norm, norm_type
    layer.strict = strict
    if combiner is not None:
        layer.combiner = combiner
    return pad


def zero_padding_row(table: jax.Array, padding_idx: int | None) -> jax.Array:
    """The freshly initialised table with its padding row zeroed (PyTorch)."""
    return table if padding_idx is None else table.at[padding_idx].set(0)


def lookup(layer: Any, table: jax.Array, inputs: Any, where: str) -> jax.Array:
    """An ``Embed`` layer's lookup: ``inputs.shape + table.shape[1:]``.

    ``layer`` gives the options (``padding_idx``, ``max_norm``,
    ``norm_type``), read from its attributes as the user set them.
    """
    num_rows = table.shape[0]
    inputs = integer_ids(inputs, where)
    if num_rows == 1:  # as in the stock layers: every id reads row 0
        inputs = jnp.zeros(inputs.shape, jnp.int32)
    return embedding_lookup(
        table,
        wrap_negative(inputs, num_rows),
        padding_id=padding_row(layer.padding_idx, num_rows, where),
        max_norm=layer.max_norm,
        norm_type=layer.norm_type,
        strict=layer.strict,
    )


def bag_ids(
    inputs: Any,
    offsets: Any,
    per_sample_weights: Any,
    *,
    include_last_offset: bool,
    where: str,
) -> tuple[Any, Any]:
    """The ids ``embedding_bag`` takes, and its weights, from a layer's call.

    ``inputs`` is a padded ``[..., L]`` array (``offsets`` ``None``), a
    :class:`JaggedIds`, or PyTorch's flat ``[N]`` ids with ``offsets``: the
    ``[B]`` start of each bag (the last bag ends at ``N``), or, with
    ``include_last_offset``, ``[B + 1]`` offsets whose last entry is the end.
    """
    if isinstance(inputs, JaggedIds):
        if offsets is not None:
            raise ValueError(
                f"{where}: `offsets` given with a JaggedIds, which holds its own."
            )
        return check_jagged(inputs, where), per_sample_weights
    inputs = integer_ids(inputs, where)
    if offsets is None:
        if inputs.ndim < 1:
            raise ValueError(
                f"{where}: bag ids must have at least one axis (the bag), got a scalar."
            )
        return inputs, per_sample_weights
    offsets = integer_ids(offsets, where)
    if inputs.ndim != 1 or offsets.ndim != 1:
        raise ValueError(
            f"{where}: with `offsets`, `input` must be the flat [N] ids and "
            f"`offsets` 1-D (as torch.nn.EmbeddingBag), got shapes "
            f"{tuple(inputs.shape)} and {tuple(offsets.shape)}."
        )
    offsets = offsets.astype(jnp.int32)
    if not include_last_offset:
        end = jnp.full((1,), inputs.shape[0], jnp.int32)
        offsets = jnp.concatenate([offsets, end])
    jagged = JaggedIds(inputs, offsets, per_sample_weights)
    return check_jagged(jagged, where), None


def bag(
    layer: Any,
    table: jax.Array,
    inputs: Any,
    offsets: Any,
    per_sample_weights: Any,
    where: str,
) -> jax.Array:
    """A bag layer's lookup: one combined row per bag (options from ``layer``)."""
    ids, weights = bag_ids(
        inputs,
        offsets,
        per_sample_weights,
        include_last_offset=layer.include_last_offset,
        where=where,
    )
    held = ids.weights if isinstance(ids, JaggedIds) else None
    if layer.combiner == "max" and (weights is not None or held is not None):
        raise ValueError(MAX_WEIGHTS.format(where=where))
    # Out-of-range ids and the padding row are left out of the bags by
    # embedding_bag's bags rule (jaxslices._ids.in_bags).
    return embedding_bag(
        table,
        ids,
        weights=weights,
        combiner=layer.combiner,
        padding_id=padding_row(layer.padding_idx, table.shape[0], where),
        max_norm=layer.max_norm,
        norm_type=layer.norm_type,
        strict=layer.strict,
    )


def renormed(
    layer: Any, table: jax.Array, inputs: Any, offsets: Any, where: str
) -> jax.Array:
    """A layer's :func:`jaxslices.apply_max_norm` for the ids of one call.

    A bag layer (one with a ``combiner``) reads its ids as :func:`bag` does;
    an ``Embed`` layer lets negative ids count from the end.
    """
    if layer.max_norm is None:
        raise ValueError(
            f"{where}.apply_max_norm: this layer has no `max_norm` (None): there "
            "is nothing to renormalise."
        )
    if hasattr(layer, "combiner"):
        ids, _ = bag_ids(
            inputs,
            offsets,
            None,
            include_last_offset=layer.include_last_offset,
            where=where,
        )
    else:
        ids = integer_ids(inputs, where)
        if table.shape[0] == 1:  # every id reads row 0
            ids = jnp.zeros(ids.shape, jnp.int32)
        ids = wrap_negative(ids, table.shape[0])
    return apply_max_norm(table, ids, layer.max_norm, norm_type=layer.norm_type)
