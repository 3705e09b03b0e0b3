"""Equinox embedding layers with sparse gradients: ``Embedding``, ``EmbeddingBag``."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import _frameworks

_EMBED = "jaxslices.equinox.Embedding"
_BAG = "jaxslices.equinox.EmbeddingBag"


class Embedding(eqx.nn.Embedding):
    """``equinox.nn.Embedding`` whose table gets a sparse gradient.

    Same fields (``num_embeddings``, ``embedding_size``, ``weight``) and
    constructor (``num_embeddings=..., embedding_size=..., key=...`` or
    ``weight=...``, ``dtype``) as ``eqx.nn.Embedding``; calling it with one
    scalar id returns that row, read through :func:`jaxslices.embedding_lookup`.
    Under :func:`filter_value_and_grad` (or :func:`jaxslices.value_and_grad`)
    ``weight`` then gets an :class:`~jaxslices.IndexedSlices` gradient; under
    ``eqx.filter_grad``, the stock dense one.

    PyTorch's options (``torch.nn.Embedding``), keyword-only, off by default:
    ``padding_idx`` (that row, negative counted from the end, is zeroed when
    the weight is initialised from ``key`` (a given ``weight`` is kept as it
    is, as PyTorch's ``from_pretrained``), read as it is and never gets a
    gradient) and ``max_norm`` / ``norm_type`` (rows read whose norm exceeds
    ``max_norm`` are returned renormalised; PyTorch's in-place rescaling of
    the table is :meth:`apply_max_norm`, a row-sparse scatter into ``weight``).
    ``strict=True``: raise :class:`jaxslices.DenseGradientError` at trace time
    if the table would get a dense gradient (``eqx.filter_grad`` instead of
    :func:`filter_grad`, a cast of the model before the call, ...).

    Ids: negative ids count from the end, as in the stock layer; an id
    ``>= num_embeddings`` or ``< -num_embeddings`` reads zeros and gets no
    gradient (the stock layer clamps it to the first or last row).

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices.equinox as jse
      >>> emb = jse.Embedding(100, 4, key=jax.random.key(0))
      >>> emb(jnp.array(7)).shape
      (4,)
      >>> loss = lambda m, ids: jnp.sum(jax.vmap(m)(ids) ** 2)
      >>> jse.filter_grad(loss)(emb, jnp.array([6, 1, 1])).weight
      IndexedSlices(float32[100, 4], rows=3)
    """

    padding_idx: int | None = eqx.field(static=True)
    max_norm: float | None = eqx.field(static=True)
    norm_type: float = eqx.field(static=True)
    strict: bool = eqx.field(static=True)

    def __init__(
        self,
        num_embeddings: int | None = None,
        embedding_size: int | None = None,
        weight: Any = None,
        dtype: Any = None,
        *,
        key: Any = None,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        strict: bool = False,
    ) -> None:
        super().__init__(num_embeddings, embedding_size, weight, dtype, key=key)
        pad = _frameworks.keep_options(
            self, _EMBED, self.num_embeddings, padding_idx, max_norm, norm_type, strict
        )
        if weight is None:  # initialised here: the padding row starts at zero
            self.weight = _frameworks.zero_padding_row(self.weight, pad)

    def __call__(self, x: Any, *, key: Any = None) -> jax.Array:
        """Row ``x`` of the table (``x`` a scalar integer); ``key`` is ignored."""
        if not (eqx.is_array_like(x) and jnp.shape(x) == ()):
            raise ValueError(
                "jaxslices.equinox.Embedding()(x) should be called with a scalar "
                f"index `x`, got shape {jnp.shape(x)}. Use `jax.vmap` to look up "
                "several ids, e.g. `jax.vmap(embedding)(ids)`: it stays sparse."
            )
        return _frameworks.lookup(self, self.weight, x, _EMBED)

    def apply_max_norm(self, ids: Any) -> Embedding:
        """This layer with the rows ``ids`` read renormalised in ``weight``.

        PyTorch's in-place ``max_norm`` step (:func:`jaxslices.apply_max_norm`),
        for ids of any shape: a row-sparse scatter. Apply it first in the
        training step, before the forward pass, e.g. ``model =
        eqx.tree_at(lambda m: m.emb, model, model.emb.apply_max_norm(ids))``.
        """
        return _with_weight(self, _EMBED, ids, None)


def _with_weight(layer: Any, where: str, ids: Any, offsets: Any) -> Any:
    weight = _frameworks.renormed(layer, layer.weight, ids, offsets, where)
    return eqx.tree_at(lambda m: m.weight, layer, weight)


class EmbeddingBag(eqx.Module):
    """``torch.nn.EmbeddingBag`` for Equinox, with a sparse gradient.

    A ``weight`` of shape ``(num_embeddings, embedding_size)`` (standard
    normal from ``key``, as ``eqx.nn.Embedding``; or given); bags of ids are
    looked up and combined (``combiner``: ``"mean"``, ``"sum"``,
    ``"sqrtn"`` or ``"max"``, PyTorch's ``mode``) through
    :func:`jaxslices.embedding_bag`, so under
    :func:`filter_value_and_grad` ``weight`` gets an
    :class:`~jaxslices.IndexedSlices` gradient.

    Call it on one bag (``[L]`` ids, giving ``[embedding_size]``: ``jax.vmap``
    it over a batch, it stays sparse), on a padded ``[..., L]`` batch, on a
    :class:`~jaxslices.JaggedIds`, or with PyTorch's flat ``[N]`` ids and
    ``offsets`` (``[B]`` starts, ``[B + 1]`` with
    ``include_last_offset=True``); ``per_sample_weights`` shaped like the ids
    (not with ``"max"``, as in PyTorch). Ids outside ``[0, num_embeddings)``
    (e.g. ``-1`` padding) are left out of their bag (not counted by
    ``"mean"``); ``padding_idx`` (PyTorch's meaning) is zeroed at initialisation,
    excluded from every bag and never gets a gradient; ``max_norm`` and
    ``strict`` as in :class:`Embedding`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices.equinox as jse
      >>> bag = jse.EmbeddingBag(100, 4, combiner="sum", key=jax.random.key(0))
      >>> bag(jnp.array([3, 7, -1])).shape
      (4,)
      >>> loss = lambda m, ids: jnp.sum(jax.vmap(m)(ids) ** 2)
      >>> jse.filter_grad(loss)(bag, jnp.array([[3, 7], [1, 1]])).weight
      IndexedSlices(float32[100, 4], rows=4)
    """

    weight: jax.Array
    num_embeddings: int = eqx.field(static=True)
    embedding_size: int = eqx.field(static=True)
    combiner: str = eqx.field(static=True)
    padding_idx: int | None = eqx.field(static=True)
    max_norm: float | None = eqx.field(static=True)
    norm_type: float = eqx.field(static=True)
    include_last_offset: bool = eqx.field(static=True)
    strict: bool = eqx.field(static=True)

    def __init__(
        self,
        num_embeddings: int | None = None,
        embedding_size: int | None = None,
        weight: Any = None,
        dtype: Any = None,
        *,
        combiner: str = "mean",
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        include_last_offset: bool = False,
        strict: bool = False,
        key: Any = None,
    ) -> None:
        table = eqx.nn.Embedding(num_embeddings, embedding_size, weight, dtype, key=key)
        n = table.num_embeddings
        pad = _frameworks.keep_options(
            self, _BAG, n, padding_idx, max_norm, norm_type, strict, combiner
        )
        self.include_last_offset = include_last_offset
        self.weight = (
            table.weight
            if weight is not None
            else _frameworks.zero_padding_row(table.weight, pad)
        )
        self.num_embeddings = n
        self.embedding_size = table.embedding_size

    def __call__(
        self,
        ids: Any,
        offsets: Any = None,
        per_sample_weights: Any = None,
        *,
        key: Any = None,
    ) -> jax.Array:
        """One combined row per bag; ``key`` is ignored."""
        weights = per_sample_weights
        return _frameworks.bag(self, self.weight, ids, offsets, weights, _BAG)

    def apply_max_norm(self, ids: Any, offsets: Any = None) -> EmbeddingBag:
        """This layer with the rows the bags read renormalised in ``weight``."""
        return _with_weight(self, _BAG, ids, offsets)
