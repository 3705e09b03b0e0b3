"""Flax Linen embedding layers: ``Embed`` and ``EmbedBag`` with sparse gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from .. import _frameworks

_EMBED = "jaxslices.linen.Embed"
_BAG = "jaxslices.linen.EmbedBag"


class Embed(nn.Embed):
    """``flax.linen.Embed`` whose table gets a sparse gradient.

    Same fields as ``flax.linen.Embed`` (``num_embeddings``, ``features``,
    ``dtype``, ``param_dtype``, ``embedding_init``, ``promote_dtype``), same
    ``"embedding"`` parameter and ``attend``; ``__call__`` reads the table
    through :func:`jaxslices.embedding_lookup`, so under
    :func:`jaxslices.value_and_grad` of a ``model.apply`` loss the table's
    gradient is an :class:`~jaxslices.IndexedSlices` (under ``jax.grad``: the
    stock layer's dense gradient). A table also read another way (``attend``
    for tied embeddings) gets the exact dense gradient.

    PyTorch's options (``torch.nn.Embedding``), off by default:
    ``padding_idx`` (that row, negative counted from the end, is zeroed at
    initialisation, read as it is and never gets a gradient) and ``max_norm``
    / ``norm_type`` (rows read whose norm exceeds ``max_norm`` are returned
    renormalised; PyTorch's in-place rescaling of the table is
    :func:`jaxslices.apply_max_norm` of the ``"embedding"`` leaf, a row-sparse
    scatter in the training step). ``strict=True``: raise
    :class:`jaxslices.DenseGradientError` at trace time if the table would get
    a dense gradient (``jax.grad`` of the loss, params cast before ``apply``).

    Ids: negative ids count from the end, as in the stock layer; an id
    ``>= num_embeddings`` or ``< -num_embeddings`` reads zeros and gets no
    gradient (the stock layer reads NaN). With ``num_embeddings == 1`` every id
    reads row 0, as in the stock layer. ``promote_dtype`` is applied to the
    looked-up rows rather than to the table.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices, jaxslices.linen
      >>> model = jaxslices.linen.Embed(num_embeddings=100, features=4)
      >>> ids = jnp.array([[6, 1, 1]])
      >>> params = model.init(jax.random.key(0), ids)["params"]
      >>> loss = lambda p, ids: jnp.sum(model.apply({"params": p}, ids) ** 2)
      >>> jaxslices.grad(loss)(params, ids)["embedding"]
      IndexedSlices(float32[100, 4], rows=3)
    """

    padding_idx: int | None = None
    max_norm: float | None = None
    norm_type: float = 2.0
    strict: bool = False

    def setup(self) -> None:
        pad = _frameworks.check_options(
            _EMBED,
            self.num_embeddings,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
        )
        self.embedding = self.param(
            "embedding",
            _zeroed(self.embedding_init, pad),
            (self.num_embeddings, self.features),
            self.param_dtype,
        )

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Embed integer ids; output shape ``inputs.shape + (features,)``."""
        rows = _frameworks.lookup(self, self.embedding, inputs, _EMBED)
        (rows,) = self.promote_dtype(rows, dtype=self.dtype, inexact=False)
        return rows


def _zeroed(init: Callable[..., Any], pad: int | None) -> Callable[..., Any]:
    """``init`` with the padding row zeroed (PyTorch's initialisation)."""
    if pad is None:
        return init
    return lambda key, shape, dtype: _frameworks.zero_padding_row(
        init(key, shape, dtype), pad
    )


class EmbedBag(nn.Module):
    """``torch.nn.EmbeddingBag`` for Flax Linen, with a sparse gradient.

    One ``"embedding"`` parameter of shape ``(num_embeddings, features)``
    (initialised as ``nn.Embed``'s); bags of ids are looked up and combined
    (``combiner``: ``"mean"``, ``"sum"``, ``"sqrtn"`` or ``"max"``,
    PyTorch's ``mode``) through :func:`jaxslices.embedding_bag`, so under
    :func:`jaxslices.value_and_grad` of a ``model.apply`` loss the table's
    gradient is an :class:`~jaxslices.IndexedSlices`.

    It takes what every jaxslices bag layer takes (``docs/frameworks.md``,
    "Bag layers"): a padded ``[..., L]`` id array (a bag per row of the last
    axis), a :class:`~jaxslices.JaggedIds`, or PyTorch's flat ids with
    ``offsets`` (``include_last_offset`` as in PyTorch), and optional
    ``per_sample_weights`` (any combiner but ``"max"``). The bags rule
    leaves ids outside ``[0, num_embeddings)`` (``-1`` fill) out of their
    bag, and ``padding_idx`` too, which also starts at zero and never gets a
    gradient; ``max_norm`` and ``strict`` as in :class:`Embed`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices, jaxslices.linen
      >>> model = jaxslices.linen.EmbedBag(num_embeddings=100, features=4)
      >>> ids = jnp.array([[6, 1, -1], [2, -1, -1]])
      >>> params = model.init(jax.random.key(0), ids)["params"]
      >>> model.apply({"params": params}, ids).shape
      (2, 4)
      >>> loss = lambda p, ids: jnp.sum(model.apply({"params": p}, ids) ** 2)
      >>> jaxslices.grad(loss)(params, ids)["embedding"]
      IndexedSlices(float32[100, 4], rows=6)
    """

    num_embeddings: int
    features: int
    combiner: str = "mean"
    padding_idx: int | None = None
    max_norm: float | None = None
    norm_type: float = 2.0
    include_last_offset: bool = False
    strict: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    embedding_init: Callable[..., Any] = nn.linear.default_embed_init

    def setup(self) -> None:
        pad = _frameworks.check_options(
            _BAG,
            self.num_embeddings,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.combiner,
        )
        self.embedding = self.param(
            "embedding",
            _zeroed(self.embedding_init, pad),
            (self.num_embeddings, self.features),
            self.param_dtype,
        )

    def __call__(
        self, inputs: Any, offsets: Any = None, per_sample_weights: Any = None
    ) -> jax.Array:
        """One combined row per bag: ``[..., features]`` or ``[num_bags, features]``."""
        out = _frameworks.bag(
            self, self.embedding, inputs, offsets, per_sample_weights, _BAG
        )
        return out if self.dtype is None else out.astype(self.dtype)
