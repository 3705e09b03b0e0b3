"""Flax Linen: an ``Embed`` layer whose table gets a sparse gradient.

Stock ``flax.linen.Embed`` reads its table with ``jnp.take``, so the gradient
of a ``model.apply`` loss holds a dense ``(num_embeddings, features)`` array
for it, whichever gradient function is used. :class:`Embed` is the same module
(a subclass: same fields, parameter name ``"embedding"``, initialisation and
``attend``) whose ``__call__`` reads the table through
:func:`jaxslices.embedding_lookup`. Differentiate the usual Linen loss with
:func:`jaxslices.value_and_grad` and the ``"embedding"`` leaf of the params
gradient is an :class:`~jaxslices.IndexedSlices`::

    def loss(params, ids, y):
        return jnp.mean((model.apply({"params": params}, ids) - y) ** 2)

    value, grads = jaxslices.value_and_grad(loss)(params, ids, y)

The lookup must see the params leaf itself: pass ``{"params": params}`` (or
the variables dict) straight to ``apply``, without transforming the table
first (a table cast or scaled before ``apply`` gets its exact dense gradient).

Import it as ``import jaxslices.linen`` (needs ``pip install "jaxslices[flax]"``);
``import jaxslices`` alone never imports Flax.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from . import _frameworks

__all__ = ["Embed", "EmbedBag"]


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


_EMBED = "jaxslices.linen.Embed"
_BAG = "jaxslices.linen.EmbedBag"


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

    Call it with a padded ``[..., L]`` id array (one bag per row of the last
    axis), a :class:`~jaxslices.JaggedIds`, or PyTorch's flat ``[N]`` ids and
    ``offsets`` (``[B]`` starts, or ``[B + 1]`` with
    ``include_last_offset=True``); ``per_sample_weights`` shaped like the ids
    (not with ``"max"``, as in PyTorch). Ids outside ``[0, num_embeddings)``
    (e.g. ``-1`` padding) are left out of their bag (not counted by
    ``"mean"``); ``padding_idx`` (PyTorch's meaning) is zeroed at initialisation,
    excluded from every bag and never gets a gradient; ``max_norm`` and
    ``strict`` as in :class:`Embed`.

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


# -- embedding collection (issue 22) -------------------------------------------
# A separate block: the Linen module over jaxslices.EmbeddingCollection.

from collections.abc import Sequence  # noqa: E402

from . import collection as _collection  # noqa: E402


class EmbeddingCollection(nn.Module):
    """A :class:`jaxslices.EmbeddingCollection` as a Linen module.

    One parameter per stacked buffer, named like the buffer
    (``"dim64_float32"``), each initialised table by table as
    :meth:`jaxslices.EmbeddingCollection.init` does (from the parameter's own
    key). Calling it pools every feature (keyword arguments as
    :meth:`jaxslices.EmbeddingCollection.__call__`); ``concat=True`` returns
    them side by side, ``[B, sum of dims]``. Differentiate a ``model.apply``
    loss with :func:`jaxslices.value_and_grad`: each buffer's gradient is one
    :class:`~jaxslices.IndexedSlices`.

    Attributes:
      tables: the :class:`jaxslices.TableConfig` s.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices as js, jaxslices.linen
      >>> model = jaxslices.linen.EmbeddingCollection(
      ...     (js.TableConfig("user", 100, 4), js.TableConfig("item", 50, 4)))
      >>> ids = {"user": jnp.array([[3], [5]]), "item": jnp.array([[1], [1]])}
      >>> params = model.init(jax.random.key(0), ids)["params"]
      >>> loss = lambda p: model.apply({"params": p}, ids, concat=True).sum()
      >>> js.grad(loss)(params)["dim4_float32"]
      IndexedSlices(float32[150, 4], rows=4)
    """

    tables: Sequence[Any]

    @property
    def collection(self) -> _collection.EmbeddingCollection:
        return _collection.EmbeddingCollection(tuple(self.tables))

    @nn.compact
    def __call__(self, features: Any, *, concat: bool = False, **kwargs: Any) -> Any:
        coll = self.collection
        params = {
            b.name: self.param(b.name, lambda key, b=b: coll.init_buffer(key, b.name))
            for b in coll.buffers
        }
        if concat:
            return coll.concat(params, features, **kwargs)
        return coll(params, features, **kwargs)


__all__ += ["EmbeddingCollection"]


# -- managed-collision tables (issue 37) ---------------------------------------
# A separate block: a bag layer over a ManagedCollision table (docs/managed.md).

from . import embedding as _embedding  # noqa: E402
from . import managed as _managed  # noqa: E402
from .managed._checks import check_layer  # noqa: E402


class ManagedEmbedBag(nn.Module):
    """A bag layer over a managed-collision table: raw ids in, pooled rows out.

    Holds the table, the ``"embedding"`` parameter (``[num_slots,
    features]``), and its :class:`jaxslices.RemapState`, the variable
    ``"state"`` of the ``"remap"`` collection (an ordinary pytree of arrays:
    checkpointed with the variables, never differentiated). A training step
    calls it twice, as the managed-collision rule orders (remap, then reset
    the evicted rows, then read the table; ``docs/managed.md``):

    * ``model.apply(variables, raw_ids, method="remap", mutable=["remap"])``
      remaps the raw ids (any integer dtype, or :class:`jaxslices.RawIds`):
      ``((rows, evicted), {"remap": new state})``;
    * :func:`jaxslices.reset_rows` re-initialises the ``evicted`` rows of
      ``params["embedding"]`` and of the optimizer state;
    * ``model.apply({"params": params}, rows)`` pools the rows
      (:func:`jaxslices.embedding_bag`; a row ``num_slots``, an id given no
      row, reads nothing and is not counted by ``"mean"``), so under
      :func:`jaxslices.value_and_grad` the table's gradient is an
      :class:`~jaxslices.IndexedSlices`.

    Attributes:
      manager: the :class:`jaxslices.ManagedCollision` (its ``num_slots`` is
        the table's rows).
      features: the rows' width.
      combiner: ``"mean"``, ``"sum"`` or ``"sqrtn"``.
      embedding_init, param_dtype: as ``flax.linen.Embed``'s.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices as js, jaxslices.linen
      >>> mc = js.ManagedCollision("items", num_slots=8)
      >>> model = jaxslices.linen.ManagedEmbedBag(mc, features=4)
      >>> raw = jnp.array([[10**9, 7], [7, -1]])
      >>> variables = model.init(jax.random.key(0), raw, method="remap")
      >>> (rows, evicted), remap = model.apply(
      ...     variables, raw, method="remap", mutable=["remap"])
      >>> rows.tolist()  # -1 is a raw id too (as 2**64 - 1)
      [[1, 0], [0, 2]]
      >>> model.apply({"params": variables["params"]}, rows).shape
      (2, 4)
    """

    manager: _managed.ManagedCollision
    features: int
    combiner: str = "mean"
    embedding_init: Callable[..., Any] = nn.linear.default_embed_init
    param_dtype: Any = jnp.float32

    def setup(self) -> None:
        check_layer(_MANAGED, self.manager, self.combiner)
        self.embedding = self.param(
            "embedding",
            self.embedding_init,
            (self.manager.num_slots, self.features),
            self.param_dtype,
        )
        # the lookup alone (``{"params": ...}``) needs no remap state
        if self.is_initializing() or self.has_variable("remap", "state"):
            self.state = self.variable("remap", "state", self.manager.init)
        else:
            self.state = None

    def remap(self, raw_ids: Any, mask: Any = None) -> tuple[jax.Array, jax.Array]:
        """Raw ids to rows, admitting and evicting: ``(rows, evicted)``.

        Updates the ``"remap"`` collection, which must be mutable
        (``mutable=["remap"]``); ``rows`` and ``evicted`` as
        :meth:`jaxslices.ManagedCollision.remap` returns them.
        """
        if self.state is None:
            raise ValueError(
                f"{_MANAGED}.remap needs the remap state: pass the variables "
                "with their 'remap' collection (model.init makes it)."
            )
        rows, new_state, evicted = self.manager.remap(self.state.value, raw_ids, mask)
        if not self.is_initializing():
            if not self.is_mutable_collection("remap"):
                raise ValueError(
                    f"{_MANAGED}.remap changes the remap state: call it with "
                    "model.apply(variables, raw_ids, method='remap', "
                    "mutable=['remap'])."
                )
            self.state.value = new_state
        return rows, evicted

    def __call__(self, rows: Any) -> jax.Array:
        """Pool remapped ``rows`` (``[..., L]``, from :meth:`remap`):
        ``[..., features]``."""
        return _embedding.embedding_bag(self.embedding, rows, combiner=self.combiner)


_MANAGED = "jaxslices.linen.ManagedEmbedBag"

__all__ += ["ManagedEmbedBag"]
