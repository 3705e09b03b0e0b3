"""Flax NNX embedding layers: ``Embed`` and ``EmbedBag`` with sparse gradients."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .. import _frameworks

_EMBED = "jaxslices.nnx.Embed"
_BAG = "jaxslices.nnx.EmbedBag"


class Embed(nnx.Embed):
    """``flax.nnx.Embed`` whose table gets a sparse gradient.

    A subclass of ``flax.nnx.Embed`` with the same constructor arguments,
    attributes (``embedding``, ``num_embeddings``, ``features``, ``dtype``,
    ``param_dtype``, ``promote_dtype``), parameter state and ``attend``; only
    ``__call__`` differs: it reads the table through
    :func:`jaxslices.embedding_lookup`. Under :func:`jaxslices.nnx.value_and_grad`
    (or :func:`jaxslices.value_and_grad` of a function of the model's state) the
    ``embedding`` parameter then gets an :class:`~jaxslices.IndexedSlices`
    gradient; under ``nnx.grad`` it gets the same dense gradient as the stock
    layer. A table also read another way (``attend`` for tied input and output
    embeddings) gets the correct dense gradient.

    PyTorch's options (``torch.nn.Embedding``), keyword-only, off by default:

    * ``padding_idx``: that row (negative: counted from the end) is zeroed at
      initialisation, read as it is, and never gets a gradient (its slots are
      padding in the sparse gradient, so no optimizer touches it).
    * ``max_norm`` / ``norm_type``: rows read whose norm exceeds ``max_norm``
      are returned renormalised (PyTorch's gradient). PyTorch also rescales
      them in the table, in place: call :meth:`apply_max_norm` with the ids of
      the step (a row-sparse update) first in the step, as PyTorch does.

    ``strict=True``: raise :class:`jaxslices.DenseGradientError` at trace time
    if the table would get a dense gradient (differentiated by ``nnx.grad``
    instead of :func:`jaxslices.nnx.grad`, cast before the lookup, ...).

    Ids: negative ids count from the end, as in the stock layer; an id
    ``>= num_embeddings`` or ``< -num_embeddings`` reads zeros and gets no
    gradient (the stock layer reads NaN). With ``num_embeddings == 1`` every id
    reads row 0, as in the stock layer. ``promote_dtype`` is applied to the
    looked-up rows rather than to the table, so a bf16 ``dtype`` keeps the
    gradient sparse (in the parameter's dtype). With ``out_sharding`` (JAX's
    explicit sharding mode) the lookup runs under ``jax.sharding.auto_axes``,
    as in the stock layer, and the gradient is dense (correct, not sparse).

    Example:
      >>> import jax.numpy as jnp, jaxslices.nnx
      >>> from flax import nnx
      >>> layer = jaxslices.nnx.Embed(10, 4, rngs=nnx.Rngs(0))
      >>> layer(jnp.array([[6, 1, 1]])).shape
      (1, 3, 4)
      >>> loss = lambda m, ids: jnp.sum(m(ids) ** 2)
      >>> grads = jaxslices.nnx.grad(loss)(layer, jnp.array([6, 1, 1]))
      >>> grads["embedding"].get_value()
      IndexedSlices(float32[10, 4], rows=3)
      >>> padded = jaxslices.nnx.Embed(10, 4, padding_idx=0, rngs=nnx.Rngs(0))
      >>> padded(jnp.array([0]))
      Array([[0., 0., 0., 0.]], dtype=float32)
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        strict: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(num_embeddings, features, **kwargs)
        pad = _frameworks.keep_options(
            self, _EMBED, num_embeddings, padding_idx, max_norm, norm_type, strict
        )
        if pad is not None:
            table = self.embedding.get_value()
            self.embedding.set_value(_frameworks.zero_padding_row(table, pad))

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        """Embed integer ids; output shape ``inputs.shape + (features,)``."""
        lookup = functools.partial(_frameworks.lookup, self, where=_EMBED)
        table = self.embedding.get_value()
        if out_sharding is None:
            rows = lookup(table, inputs)
        else:
            # Explicit sharding: the gather needs its output sharding, which
            # `auto_axes` provides (as in the stock layer). The sparse mechanism
            # does not see through `auto_axes`: this path's gradient is dense.
            rows = jax.sharding.auto_axes(lookup, out_sharding=out_sharding)(
                table, inputs
            )
        (rows,) = self.promote_dtype((rows,), dtype=self.dtype, inexact=False)
        return rows

    def apply_max_norm(self, inputs: jax.Array) -> None:
        """Renormalise in the table the rows ``inputs`` read (PyTorch's in-place step).

        Rows whose norm exceeds ``max_norm`` are scaled to it
        (:func:`jaxslices.apply_max_norm`); only those rows are written (in
        place under ``nnx.jit`` with the model donated). Call it once per step
        with the step's ids, first (before the forward pass, as PyTorch does:
        later it is still exact, but the lookups then need the old table and
        XLA copies it, see :func:`jaxslices.table_copies`).
        """
        self.embedding.set_value(
            _frameworks.renormed(self, self.embedding.get_value(), inputs, None, _EMBED)
        )


EMBED_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
"""``nnx.Embed``'s default initializer (Flax's ``default_embed_init``)."""


class EmbedBag(nnx.Module):
    """``torch.nn.EmbeddingBag`` for Flax NNX, with a sparse gradient.

    Looks up bags of ids and combines each bag's rows (``combiner``:
    ``"mean"``, ``"sum"``, ``"sqrtn"``, optionally weighted, or ``"max"``,
    PyTorch's ``mode``) through
    :func:`jaxslices.embedding_bag`, so under
    :func:`jaxslices.nnx.value_and_grad` the ``embedding`` parameter gets an
    :class:`~jaxslices.IndexedSlices` gradient (under ``nnx.grad``, the dense
    one). The parameter is created as ``nnx.Embed`` creates it
    (``embedding_init``, ``param_dtype``, ``rngs``).

    Call it with:

    * a padded ``[..., L]`` id array: one bag per row of the last axis
      (output ``[..., features]``);
    * a :class:`~jaxslices.JaggedIds` (output ``[num_bags, features]``);
    * PyTorch's flat ``[N]`` ids and ``offsets`` (the ``[B]`` start of each
      bag, or ``[B + 1]`` offsets with ``include_last_offset=True``).

    ``per_sample_weights`` (shaped like the ids) weight each id, for every
    combiner but ``"max"`` (an error, as in PyTorch). Ids outside
    ``[0, num_embeddings)`` (e.g. ``-1`` padding) are left out of their bag
    (not counted by ``"mean"``). ``padding_idx``: that row is zeroed at
    initialisation, excluded from every bag and never gets a gradient
    (PyTorch's meaning). ``max_norm`` and ``strict``: as in :class:`Embed`
    (:meth:`apply_max_norm` renormalises the table's rows).

    Example:
      >>> import jax.numpy as jnp, jaxslices, jaxslices.nnx
      >>> from flax import nnx
      >>> bag = jaxslices.nnx.EmbedBag(100, 4, combiner="sum", rngs=nnx.Rngs(0))
      >>> bag(jnp.array([[3, 7, -1], [5, -1, -1]])).shape
      (2, 4)
      >>> bag(jnp.array([3, 7, 5]), offsets=jnp.array([0, 2])).shape
      (2, 4)
      >>> loss = lambda m, ids: jnp.sum(m(ids) ** 2)
      >>> jaxslices.nnx.grad(loss)(bag, jnp.array([[3, 7]]))["embedding"].get_value()
      IndexedSlices(float32[100, 4], rows=2)
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        combiner: str = "mean",
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        include_last_offset: bool = False,
        strict: bool = False,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        embedding_init: Any = EMBED_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        options = (padding_idx, max_norm, norm_type, strict, combiner)
        pad = _frameworks.keep_options(self, _BAG, num_embeddings, *options)
        self.include_last_offset = include_last_offset
        table = embedding_init(rngs.params(), (num_embeddings, features), param_dtype)
        self.embedding = nnx.Param(_frameworks.zero_padding_row(table, pad))
        self.num_embeddings = num_embeddings
        self.features = features
        self.dtype = dtype
        self.param_dtype = param_dtype

    def __call__(
        self,
        inputs: Any,
        offsets: Any = None,
        per_sample_weights: Any = None,
    ) -> jax.Array:
        """One combined row per bag: ``[..., features]`` or ``[num_bags, features]``."""
        table = self.embedding.get_value()
        out = _frameworks.bag(self, table, inputs, offsets, per_sample_weights, _BAG)
        return out if self.dtype is None else out.astype(self.dtype)

    def apply_max_norm(self, inputs: Any, offsets: Any = None) -> None:
        """Renormalise in the table the rows the bags read (see :class:`Embed`)."""
        self.embedding.set_value(
            _frameworks.renormed(
                self, self.embedding.get_value(), inputs, offsets, _BAG
            )
        )
