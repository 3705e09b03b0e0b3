"""Equinox: an ``Embedding`` with sparse gradients, filtered gradients, updates.

Stock ``equinox.nn.Embedding`` reads its table with ``self.weight[x]``, so
every gradient transform gives it a dense ``(num_embeddings, embedding_size)``
gradient. This module gives an Equinox user the same idioms, sparse:

* :class:`Embedding`: ``eqx.nn.Embedding`` (a subclass: same fields
  ``num_embeddings``, ``embedding_size``, ``weight``, same constructor and
  call on one scalar id) whose lookup is :func:`jaxslices.embedding_lookup`.
* :func:`filter_value_and_grad` / :func:`filter_grad`: ``eqx.filter_value_and_grad``
  / ``eqx.filter_grad`` (differentiate the first argument's inexact arrays,
  ``None`` elsewhere) on top of :func:`jaxslices.value_and_grad`, so the
  table's gradient is an :class:`~jaxslices.IndexedSlices`.
* :class:`EmbeddingBag`: PyTorch's ``nn.EmbeddingBag`` (bags of ids,
  padded, jagged or with offsets), sparse like :class:`Embedding`.
* :func:`multi_transform` / :func:`param_labels`: one optimizer for the
  tables, another for the rest, without Optax calling a module-shaped label
  tree.
* :func:`apply_updates`: ``eqx.apply_updates`` for update trees that hold
  ``IndexedSlices`` (a row scatter-add for those leaves). ``eqx.apply_updates``
  itself maps over the updates tree, so it sees an ``IndexedSlices`` as two
  leaves and fails with a tree-structure error: use this one.

Per-example models work as in Equinox and stay sparse:
``jax.vmap(self.embedding)(ids)`` inside a loss, ``jax.vmap(model)(batch)``
whose ``__call__`` looks up one id per example, and both at once
(``jax.vmap(model)`` with an inner ``jax.vmap(self.embedding)``: nested
``vmap``).

Import it as ``import jaxslices.equinox`` (needs ``pip install
"jaxslices[equinox]"``); ``import jaxslices`` alone never imports Equinox.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from . import _frameworks, _leaves, autodiff, updates
from .slices import IndexedSlices

__all__ = [
    "Embedding",
    "EmbeddingBag",
    "filter_value_and_grad",
    "filter_grad",
    "apply_updates",
    "multi_transform",
    "param_labels",
]


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
        pad = _frameworks.check_options(
            _EMBED, self.num_embeddings, padding_idx, max_norm, norm_type
        )
        if weight is None:  # initialised here: the padding row starts at zero
            self.weight = _frameworks.zero_padding_row(self.weight, pad)
        self.padding_idx = pad
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.strict = strict

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


_EMBED = "jaxslices.equinox.Embedding"
_BAG = "jaxslices.equinox.EmbeddingBag"


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
        pad = _frameworks.check_options(
            _BAG, table.num_embeddings, padding_idx, max_norm, norm_type, combiner
        )
        self.weight = (
            table.weight
            if weight is not None
            else _frameworks.zero_padding_row(table.weight, pad)
        )
        self.num_embeddings = table.num_embeddings
        self.embedding_size = table.embedding_size
        self.combiner = combiner
        self.padding_idx = pad
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.include_last_offset = include_last_offset
        self.strict = strict

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


_VG = "jaxslices.equinox.filter_value_and_grad"


def _label(i: int, path: str) -> str:
    return f"model{path}"


def filter_value_and_grad(
    fun: Callable[..., Any], *, has_aux: bool = False, strict: bool = False
) -> Callable[..., Any]:
    """``eqx.filter_value_and_grad`` with sparse gradients for embedding tables.

    Differentiates ``fun`` with respect to the inexact arrays of its first
    argument (other leaves get ``None``), as Equinox does; a table read only
    through :func:`jaxslices.embedding_lookup` (e.g. by :class:`Embedding`)
    gets an :class:`~jaxslices.IndexedSlices` gradient, every other leaf
    exactly what ``eqx.filter_value_and_grad`` gives. The loss is traced three
    times (see :func:`jaxslices.value_and_grad`). Apply the updates with
    :func:`apply_updates`. ``strict=True``: a table that would get a dense
    gradient (a stock ``eqx.nn.Embedding``, ``weight[ids]``, a cast) raises
    :class:`jaxslices.DenseGradientError` at trace time.

    Args:
      fun: ``fun(model, *args, **kwargs)``, returning a scalar, or
        ``(scalar, aux)`` with ``has_aux``.
      has_aux: as in ``eqx.filter_value_and_grad``.
      strict: raise instead of giving a table a dense gradient.

    Returns:
      A function returning ``(value, grads)`` or ``((value, aux), grads)``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices.equinox as jse
      >>> emb = jse.Embedding(10, 2, key=jax.random.key(0))
      >>> loss = lambda m, ids: jnp.sum(jax.vmap(m)(ids))
      >>> value, grads = jse.filter_value_and_grad(loss)(emb, jnp.array([3, 3]))
      >>> grads.weight.to_dense()[3]
      Array([2., 2.], dtype=float32)
    """

    @functools.wraps(fun)
    def wrapper(x: Any, /, *args: Any, **kwargs: Any) -> Any:
        diff, static = eqx.partition(x, eqx.is_inexact_array)

        def call(diff: Any, static: Any, *args: Any, **kwargs: Any) -> Any:
            return fun(eqx.combine(diff, static), *args, **kwargs)

        vg = autodiff.differentiate(call, 0, has_aux, strict, _VG, _label)
        return vg(diff, static, *args, **kwargs)

    return wrapper


def filter_grad(
    fun: Callable[..., Any], *, has_aux: bool = False, strict: bool = False
) -> Callable:
    """``eqx.filter_grad`` with sparse gradients; see :func:`filter_value_and_grad`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices.equinox as jse
      >>> emb = jse.Embedding(10, 2, key=jax.random.key(0))
      >>> jse.filter_grad(lambda m: m(jnp.array(4)).sum())(emb).weight.indices
      Array([4], dtype=int32)
    """
    vg = filter_value_and_grad(fun, has_aux=has_aux, strict=strict)
    return autodiff.grad_from_value_and_grad(vg, fun, has_aux)


def _apply_one(u: Any, p: Any) -> Any:
    if u is None:
        return p
    if isinstance(u, IndexedSlices):
        return updates.apply_updates(p, u)
    return p + u


def apply_updates(model: Any, updates: Any) -> Any:
    """``eqx.apply_updates`` for update trees holding ``IndexedSlices``.

    As in Equinox, ``updates`` is a prefix of ``model``: a ``None`` update
    leaves its part of the model unchanged and a dense update is added
    (``model + update``). An :class:`~jaxslices.IndexedSlices` update is
    scatter-added into its table in the table's dtype, as
    :func:`jaxslices.apply_updates` does (in place under ``jax.jit`` /
    ``eqx.filter_jit`` with the model donated).

    Args:
      model: an Equinox module or any pytree.
      updates: a prefix of ``model``: arrays, ``IndexedSlices`` or ``None``.

    Returns:
      The updated model.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices, jaxslices.equinox as jse
      >>> emb = jse.Embedding(weight=jnp.zeros((3, 2)))
      >>> g = jse.filter_grad(lambda m: m(jnp.array(1)).sum())(emb)
      >>> jse.apply_updates(emb, jax.tree.map(
      ...     lambda s: -s, g, is_leaf=jaxslices.is_indexed_slices)).weight
      Array([[ 0.,  0.],
             [-1., -1.],
             [ 0.,  0.]], dtype=float32)
    """
    return jax.tree.map(_apply_one, updates, model, is_leaf=_leaves.is_leaf)


# -- embedding collection (issue 22) -------------------------------------------
# A separate block: the Equinox module over jaxslices.EmbeddingCollection.

from collections.abc import Sequence  # noqa: E402

from . import collection as _collection  # noqa: E402


class EmbeddingCollection(eqx.Module):
    """A :class:`jaxslices.EmbeddingCollection` as an Equinox module.

    ``buffers`` holds the stacked buffers (``{buffer name: array}``) and
    ``collection`` the static configuration. Calling it pools every feature
    (keyword arguments as :meth:`jaxslices.EmbeddingCollection.__call__`);
    :meth:`concat` returns them side by side. Under
    :func:`jaxslices.equinox.filter_value_and_grad` each buffer's gradient is
    one :class:`~jaxslices.IndexedSlices`; apply updates with
    :func:`jaxslices.equinox.apply_updates`.

    Args:
      tables: the :class:`jaxslices.TableConfig` s.
      key: a JAX PRNG key for the initial values.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices as js, jaxslices.equinox
      >>> layer = jaxslices.equinox.EmbeddingCollection(
      ...     [js.TableConfig("user", 100, 4), js.TableConfig("item", 50, 4)],
      ...     key=jax.random.key(0))
      >>> ids = {"user": jnp.array([[3], [5]]), "item": jnp.array([[1], [1]])}
      >>> g = jaxslices.equinox.filter_grad(lambda m: m.concat(ids).sum())(layer)
      >>> g.buffers["dim4_float32"]
      IndexedSlices(float32[150, 4], rows=4)
    """

    buffers: dict[str, jax.Array]
    collection: _collection.EmbeddingCollection = eqx.field(static=True)

    def __init__(self, tables: Sequence[Any], *, key: jax.Array):
        self.collection = _collection.EmbeddingCollection(tables)
        self.buffers = self.collection.init(key)

    def __call__(self, features: Any, **kwargs: Any) -> dict[str, jax.Array]:
        """``{feature: pooled}``; see :meth:`jaxslices.EmbeddingCollection.__call__`."""
        return self.collection(self.buffers, features, **kwargs)

    def concat(self, features: Any, **kwargs: Any) -> jax.Array:
        """``[B, sum of dims]``; see :meth:`jaxslices.EmbeddingCollection.concat`."""
        return self.collection.concat(self.buffers, features, **kwargs)


__all__ += ["EmbeddingCollection"]
# -- mixing optimizers per parameter group --------------------------------------

_MT = "jaxslices.equinox.multi_transform"


def param_labels(
    model: Any,
    label: Callable[[Any], Any] | None = None,
    *,
    tables: str = "tables",
    rest: str = "rest",
) -> Callable[[Any], Any]:
    """``param_labels`` for ``optax.multi_transform`` on an Equinox model.

    A label tree shaped like an Equinox model is itself an ``eqx.Module``,
    and a module is callable: ``optax.multi_transform(transforms, labels)``
    would call it as a label *function* (running the model's ``__call__`` on
    the params), not read it as a tree. This returns a plain function instead,
    which Optax calls with the params (or updates) to get the labels.

    By default the ``weight`` of every :class:`Embedding`,
    :class:`EmbeddingBag` and :class:`ManagedEmbeddingBag` is labelled
    ``tables`` and every other inexact array ``rest``, so jaxslices
    transforms can take the tables and stock Optax the rest.
    ``label(module_or_leaf)`` overrides: it gets each of those layers and
    each other leaf and returns a label (a jaxslices layer's label goes to
    its ``weight``).

    Args:
      model: the Equinox model (its structure, not its values, is used).
      label: optional ``layer_or_leaf -> label``.
      tables: the tables' label (default).
      rest: every other array's label (default).

    Returns:
      ``params -> label tree`` (``None`` where the model holds no array).

    Example:
      >>> import jax, optax, equinox as eqx, jaxslices, jaxslices.equinox as jse
      >>> emb = jse.Embedding(100, 4, key=jax.random.key(0))
      >>> labels = jse.param_labels(emb)
      >>> labels(eqx.filter(emb, eqx.is_inexact_array)).weight
      'tables'
      >>> tx = optax.multi_transform(
      ...     {"tables": jaxslices.adagrad(0.1), "rest": optax.adam(1e-3)}, labels)
    """
    layers = (Embedding, EmbeddingBag, ManagedEmbeddingBag)

    def label_of(x: Any) -> Any:
        if isinstance(x, layers):
            name = tables if label is None else label(x)
            return eqx.tree_at(
                lambda m: m.weight,
                jax.tree.map(lambda _: None, x),
                name,
                is_leaf=lambda v: v is None,  # a managed layer's state: None too
            )
        if eqx.is_inexact_array(x):
            return rest if label is None else label(x)
        return None

    is_layer = lambda x: isinstance(x, layers)  # noqa: E731
    tree = jax.tree.map(label_of, model, is_leaf=is_layer)

    def labels(params: Any) -> Any:
        del params  # the structure is the model's
        return tree

    return labels


def multi_transform(
    transforms: Any, param_labels: Any, **kwargs: Any
) -> optax.GradientTransformationExtraArgs:
    """``optax.multi_transform`` that refuses an Equinox module as a label tree.

    ``optax.multi_transform`` calls ``param_labels`` when it is callable, and
    every ``eqx.Module`` is (it defines ``__call__``): a label tree made by
    mapping over a model (``jax.tree.map(lambda _: "rest", model)``) would be
    *called* on the params, running the model's ``__call__`` on them, and fail
    somewhere inside the model with an error about shapes or ``vmap`` sizes,
    or worse. This raises a ``TypeError`` saying so, with the fix, and
    otherwise is ``optax.multi_transform`` (same arguments).

    Example:
      >>> import jax, optax, jaxslices, jaxslices.equinox as jse
      >>> emb = jse.Embedding(100, 4, key=jax.random.key(0))
      >>> wrong = jax.tree.map(lambda _: "tables", emb)  # an Embedding again
      >>> jse.multi_transform({"tables": jaxslices.adagrad(0.1)}, wrong)
      Traceback (most recent call last):
      ...
      TypeError: jaxslices.equinox.multi_transform: `param_labels` is an Equinox ...
    """
    if isinstance(param_labels, eqx.Module):
        raise TypeError(
            f"{_MT}: `param_labels` is an Equinox module "
            f"({type(param_labels).__name__}), a label tree shaped like the model. "
            "Every eqx.Module is callable, so optax.multi_transform would call it "
            "as a label function, running the model's __call__ on the params, "
            "instead of reading its labels. Pass a function instead: "
            "`param_labels=lambda params: labels`, or build it with "
            "jaxslices.equinox.param_labels(model), which labels the jaxslices "
            "tables 'tables' and the other arrays 'rest'."
        )
    if callable(param_labels):
        given = param_labels

        def param_labels(params: Any) -> Any:
            labels = given(params)
            leaves = jax.tree.leaves(labels)
            if any(callable(x) for x in leaves):
                raise TypeError(
                    f"{_MT}: the labels that `param_labels` returned hold callables "
                    f"({[x for x in leaves if callable(x)][:3]}); labels must be "
                    "hashable names such as strings, one per parameter array."
                )
            return labels

    return optax.multi_transform(transforms, param_labels, **kwargs)


# -- managed-collision tables (issue 37) ---------------------------------------
# A separate block: a bag layer over a ManagedCollision table (docs/managed.md).

from . import embedding as _embedding  # noqa: E402
from . import managed as _managed  # noqa: E402
from .managed._checks import check_layer  # noqa: E402

_MANAGED = "jaxslices.equinox.ManagedEmbeddingBag"


class ManagedEmbeddingBag(eqx.Module):
    """A bag layer over a managed-collision table: raw ids in, pooled rows out.

    ``weight`` is the table (``[num_slots, embedding_size]``, standard normal
    from ``key`` as ``eqx.nn.Embedding``'s, or given) and ``remap_state`` its
    :class:`jaxslices.RemapState` (integer and boolean arrays: not inexact,
    so ``eqx.filter(model, eqx.is_inexact_array)`` and
    :func:`filter_value_and_grad` leave it out of training; it is saved with
    the model, e.g. by ``eqx.tree_serialise_leaves``). A training step
    follows the managed-collision rule (remap, then reset the evicted rows,
    then read the table; ``docs/managed.md``):

    * ``layer, rows, evicted = layer.remap(raw_ids)`` (any integer dtype, or
      :class:`jaxslices.RawIds`): a layer with the new remap state;
    * :func:`reset_rows` re-initialises the ``evicted`` rows of ``weight``
      and of the optimizer state;
    * ``layer(rows)`` pools the rows (:func:`jaxslices.embedding_bag`; a
      row ``num_slots``, an id given no row, reads nothing and is not
      counted by ``"mean"``); under :func:`filter_value_and_grad`
      ``weight`` gets an :class:`~jaxslices.IndexedSlices` gradient.

    Args:
      manager: the :class:`jaxslices.ManagedCollision` (its ``num_slots``
        is the table's rows).
      embedding_size: the rows' width.
      weight: optional initial table, ``[num_slots, embedding_size]``.
      dtype: the table's dtype (as ``eqx.nn.Embedding``'s).
      combiner: ``"mean"``, ``"sum"`` or ``"sqrtn"``.
      key: a PRNG key (without ``weight``).

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices as js, jaxslices.equinox as jse
      >>> mc = js.ManagedCollision("items", num_slots=8)
      >>> layer = jse.ManagedEmbeddingBag(mc, 4, key=jax.random.key(0))
      >>> layer, rows, evicted = layer.remap(jnp.array([[10**9, 7], [7, 5]]))
      >>> rows.tolist()
      [[2, 1], [1, 0]]
      >>> layer(rows).shape
      (2, 4)
    """

    weight: jax.Array
    remap_state: _managed.RemapState
    manager: _managed.ManagedCollision = eqx.field(static=True)
    combiner: str = eqx.field(static=True)

    def __init__(
        self,
        manager: _managed.ManagedCollision,
        embedding_size: int | None = None,
        weight: Any = None,
        dtype: Any = None,
        *,
        combiner: str = "mean",
        key: Any = None,
    ) -> None:
        check_layer(_MANAGED, manager, combiner)
        table = eqx.nn.Embedding(
            None if weight is not None else manager.num_slots,
            embedding_size,
            weight,
            dtype,
            key=key,
        )
        if table.num_embeddings != manager.num_slots:
            raise ValueError(
                f"{_MANAGED}: `weight` must have num_slots={manager.num_slots} "
                f"rows (ManagedCollision({manager.name!r})), got "
                f"{table.num_embeddings}."
            )
        self.weight = table.weight
        self.remap_state = manager.init()
        self.manager = manager
        self.combiner = combiner

    def remap(
        self, raw_ids: Any, mask: Any = None
    ) -> tuple[ManagedEmbeddingBag, jax.Array, jax.Array]:
        """Raw ids to rows, admitting and evicting: ``(layer, rows, evicted)``.

        ``layer`` holds the new remap state; ``rows`` and ``evicted`` as
        :meth:`jaxslices.ManagedCollision.remap` returns them.
        """
        rows, state, evicted = self.manager.remap(self.remap_state, raw_ids, mask)
        return eqx.tree_at(lambda m: m.remap_state, self, state), rows, evicted

    def __call__(self, rows: Any, *, key: Any = None) -> jax.Array:
        """Pool remapped ``rows`` (``[..., L]``, from :meth:`remap`);
        ``key`` is ignored."""
        return _embedding.embedding_bag(self.weight, rows, combiner=self.combiner)


def reset_rows(
    model: Any,
    opt_state: Any,
    rows: Any,
    new_rows: Any,
    *,
    where: Callable[[Any], Any],
    optimizer: Any = None,
) -> tuple[Any, Any]:
    """:func:`jaxslices.reset_rows` for an Equinox model.

    The optimizer state is that of ``eqx.filter(model, eqx.is_inexact_array)``
    (the Equinox idiom); the table ``where(model)`` picks (e.g.
    ``lambda m: m.items.weight``) gets ``new_rows`` in ``rows`` and its
    optimizer state the optimizer's initial values there.

    Returns:
      ``(model, opt_state)``.

    Example:
      >>> import jax, jax.numpy as jnp, equinox as eqx, jaxslices as js
      >>> import jaxslices.equinox as jse
      >>> layer = jse.ManagedEmbeddingBag(
      ...     js.ManagedCollision("t", num_slots=4), weight=jnp.ones((4, 2)))
      >>> tx = js.adagrad(0.1)
      >>> state = tx.init(eqx.filter(layer, eqx.is_inexact_array))
      >>> layer, state = jse.reset_rows(layer, state, jnp.array([2]), 0.0,
      ...     where=lambda m: m.weight, optimizer=tx)
      >>> layer.weight[:, 0].tolist()
      [1.0, 1.0, 0.0, 1.0]
    """
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params, opt_state = _managed.reset_rows(
        params, opt_state, rows, new_rows, where=where, optimizer=optimizer
    )
    return eqx.combine(params, static), opt_state


__all__ += ["ManagedEmbeddingBag", "reset_rows"]
