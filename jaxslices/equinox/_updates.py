"""Equinox updates: ``apply_updates`` (sparse), optimizers per parameter group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import optax

from .. import _leaves, updates
from ..slices import IndexedSlices
from ._embeddings import Embedding, EmbeddingBag
from ._managed import ManagedEmbeddingBag


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
