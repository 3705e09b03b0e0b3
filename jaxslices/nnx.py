"""Flax NNX: an ``Embed`` layer with sparse gradients, and NNX gradient entry points.

Stock ``flax.nnx.Embed`` reads its table with ``jnp.take``, so every gradient
transform (``nnx.grad`` and :func:`jaxslices.value_and_grad` alike) gives it a
dense ``(num_embeddings, features)`` gradient. :class:`Embed` is the same layer
(a subclass: same constructor, attributes, parameters, initialisation and
``attend``) whose ``__call__`` reads the table through
:func:`jaxslices.embedding_lookup`, and :func:`value_and_grad` / :func:`grad`
mirror ``nnx.value_and_grad`` / ``nnx.grad`` on top of
:func:`jaxslices.value_and_grad`, so the table's gradient is an
:class:`~jaxslices.IndexedSlices` of the rows the batch touched.

Gradients are an ``nnx.State`` of the same structure and ``Variable`` types as
``nnx.grad``'s (``Param`` leaves, so ``wrt`` filters and ``nnx.Optimizer``
work unchanged); a sparse leaf is a ``Param`` holding an ``IndexedSlices``.
Read it the way NNX reads a non-array variable, with ``get_value()``
(``grads["emb"]["embedding"].get_value()``); ``param[...]`` is for arrays and
raises on it. ``jaxslices.to_dense(grads)`` gives the dense ``State`` that
``nnx.grad`` would have returned.

Differences from ``flax.nnx.Embed``, all documented on :class:`Embed`: an id
``>= num_embeddings`` (or ``< -num_embeddings``) reads zeros and gets no
gradient (stock: NaN); the dtype cast (``promote_dtype``) is applied to the
looked-up rows, not to the whole table.

:class:`ManagedEmbedBag` is a bag layer over a managed-collision table (raw
ids of any value, ``docs/managed.md``), its remap state a :class:`Remap`
variable that ``nnx.Optimizer`` does not train; :func:`reset_rows` starts
evicted rows afresh in the model and its optimizer.

Import it as ``import jaxslices.nnx`` (needs ``pip install "jaxslices[flax]"``);
``import jaxslices`` alone never imports Flax.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import filterlib, graphlib

from . import _frameworks, autodiff

__all__ = ["Embed", "EmbedBag", "value_and_grad", "grad"]


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
        where = _EMBED
        pad = _frameworks.check_options(
            where, num_embeddings, padding_idx, max_norm, norm_type
        )
        super().__init__(num_embeddings, features, **kwargs)
        if pad is not None:
            table = self.embedding.get_value()
            self.embedding.set_value(_frameworks.zero_padding_row(table, pad))
        self.padding_idx = pad
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.strict = strict

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


_EMBED_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
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
        embedding_init: Any = _EMBED_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        where = _BAG
        pad = _frameworks.check_options(
            where, num_embeddings, padding_idx, max_norm, norm_type, combiner
        )
        table = embedding_init(rngs.params(), (num_embeddings, features), param_dtype)
        self.embedding = nnx.Param(_frameworks.zero_padding_row(table, pad))
        self.num_embeddings = num_embeddings
        self.features = features
        self.combiner = combiner
        self.padding_idx = pad
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.include_last_offset = include_last_offset
        self.strict = strict
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


# -- gradients ---------------------------------------------------------------

_WHERE = "jaxslices.nnx.value_and_grad"


def _diff_specs(
    argnums: int | nnx.DiffState | Sequence[int | nnx.DiffState],
) -> list[tuple[int, Any]]:
    """``[(argnum, filter)]`` in the order the gradients are returned."""
    items = (
        [argnums]
        if isinstance(argnums, int | np.integer | nnx.DiffState)
        else list(argnums)
        if isinstance(argnums, Sequence)
        else None
    )
    if not items:
        raise TypeError(
            f"{_WHERE}: `argnums` must be an int, an nnx.DiffState or a non-empty "
            f"sequence of them, got {argnums!r}."
        )
    specs: list[tuple[int, Any]] = []
    for item in items:
        if isinstance(item, nnx.DiffState):
            spec = (item.argnum, item.filter)
        elif isinstance(item, int | np.integer) and not isinstance(item, bool):
            spec = (int(item), nnx.Param)
        else:
            raise TypeError(
                f"{_WHERE}: each entry of `argnums` must be an int or an "
                f"nnx.DiffState(argnum, filter), got {item!r}."
            )
        if any(spec[0] == s[0] for s in specs):
            raise ValueError(f"{_WHERE}: argnum {spec[0]} is repeated in {argnums!r}.")
        specs.append(spec)
    return specs


def _label(i: int, path: str) -> str:
    """A differentiated leaf in strict mode's messages: ``argument 0['emb']...``.

    ``path`` is the leaf's path in the diff state or the plain arguments,
    both keyed by argnum first (``[0]['emb']['embedding'].value``).
    """
    argnum, _, rest = path.removeprefix("[").partition("]")
    return f"argument {argnum}{rest.removesuffix('.value')}"


def _bind_kwargs(f: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
    """Move keyword arguments that could be positional into ``args``."""
    if not kwargs:
        return args, kwargs
    try:
        bound = inspect.signature(f).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    return tuple(bound.args), dict(bound.kwargs)


def value_and_grad(
    f: Callable[..., Any],
    argnums: int | nnx.DiffState | Sequence[int | nnx.DiffState] = 0,
    *,
    has_aux: bool = False,
    strict: bool = False,
) -> Callable[..., Any]:
    """``nnx.value_and_grad`` with sparse gradients for embedding tables.

    Same call and results as ``flax.nnx.value_and_grad(f, argnums, has_aux)``:
    for an NNX object argument the gradient is an ``nnx.State`` of its
    variables that pass the filter (``nnx.Param`` for a plain ``int`` argnum,
    ``nnx.DiffState(argnum, filter)`` to choose), a plain pytree argument gets
    JAX's gradient tree, and changes ``f`` makes to the objects' other
    variables (counters, batch statistics, RNG state) are written back to the
    objects. In addition, a parameter read only through
    :func:`jaxslices.embedding_lookup` / :func:`jaxslices.embedding_bag` (e.g.
    by :class:`Embed`) gets an :class:`~jaxslices.IndexedSlices` gradient,
    held in its ``Param``: read it with ``.get_value()``. Everything else is
    as :func:`jaxslices.value_and_grad` describes (the loss is traced three
    times; a table also read another way gets its exact dense gradient).

    Works inside ``nnx.jit`` and with ``nnx.Optimizer(model, tx,
    wrt=nnx.Param)`` for a jaxslices transform ``tx`` (e.g.
    ``jaxslices.lazy_adam``); ``optimizer.update(model, grads)`` then writes
    only the touched rows. Keyword-only arguments of ``f`` are passed through,
    never differentiated. Not supported (unlike ``nnx.value_and_grad``):
    ``holomorphic``, ``allow_int``, ``reduce_axes`` and the ``graph`` options.

    ``strict=True``: a table that would get a dense gradient (read by a stock
    ``nnx.Embed`` or by indexing, cast, tied, looked up inside ``scan``)
    raises :class:`jaxslices.DenseGradientError` at trace time, naming it (its
    path in the model), the reason and the fix.

    Args:
      f: the loss; returns a scalar, or ``(scalar, aux)`` with ``has_aux``.
      argnums: an int, an ``nnx.DiffState`` or a sequence of them.
      has_aux: as in ``nnx.value_and_grad``.
      strict: raise instead of giving a table a dense gradient.

    Returns:
      A function returning ``(value, grads)`` or ``((value, aux), grads)``;
      ``grads`` is a tuple when ``argnums`` is a sequence.

    Example:
      >>> import jax.numpy as jnp, jaxslices.nnx
      >>> from flax import nnx
      >>> class Model(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.emb = jaxslices.nnx.Embed(1000, 8, rngs=rngs)
      ...         self.out = nnx.Linear(8, 1, rngs=rngs)
      ...     def __call__(self, ids):
      ...         return self.out(self.emb(ids))[..., 0]
      >>> model = Model(nnx.Rngs(0))
      >>> loss = lambda m, ids, y: jnp.mean((m(ids) - y) ** 2)
      >>> vg = jaxslices.nnx.value_and_grad(loss)
      >>> value, grads = vg(model, jnp.array([3, 7, 3]), jnp.ones(3))
      >>> grads["emb"]["embedding"].get_value()
      IndexedSlices(float32[1000, 8], rows=3)
      >>> grads["out"]["kernel"][...].shape  # dense, as nnx.grad gives
      (8, 1)
    """
    given_specs = _diff_specs(argnums)
    single = isinstance(argnums, int | np.integer | nnx.DiffState)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _bind_kwargs(f, args, kwargs)
        for i, _ in given_specs:
            if not -len(args) <= i < len(args):
                raise ValueError(
                    f"{_WHERE}: argnum {i} is out of range for a call with "
                    f"{len(args)} positional arguments."
                )
        specs = [(i % len(args), flt) for i, flt in given_specs]
        if len({i for i, _ in specs}) != len(specs):
            raise ValueError(
                f"{_WHERE}: argnums {argnums!r} name the same argument twice for a "
                f"call with {len(args)} positional arguments."
            )
        filters = {i: filterlib.to_predicate(flt) for i, flt in specs}
        nodes = {i: a for i, a in enumerate(args) if graphlib.is_graph_node(a)}
        plain = {i: args[i] for i, _ in specs if i not in nodes}

        def is_diff(path: tuple, x: Any) -> bool:
            return path[0] in filters and filters[path[0]](path[1:], x)

        if nodes:
            graphdef, diff_state, rest = nnx.split(nodes, is_diff, ...)
        else:
            graphdef, diff_state, rest = None, nnx.State({}), nnx.State({})

        def pure(diff_state, plain, rest):
            # Fresh Variables belong to the current trace, so `f` may mutate them.
            rest = jax.tree.map(lambda x: x, rest)
            merged = nnx.merge(graphdef, diff_state, rest) if nodes else {}
            call_args = [
                merged[i] if i in nodes else plain.get(i, a) for i, a in enumerate(args)
            ]
            out = f(*call_args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            new_rest = nnx.split(merged, is_diff, ...)[2] if nodes else rest
            return loss, (aux, new_rest)

        (loss, (aux, new_rest)), (g_state, g_plain) = autodiff.differentiate(
            pure, (0, 1), True, strict, _WHERE, _label
        )(diff_state, plain, rest)
        if nodes:
            nnx.update(nodes, new_rest)
        grads = tuple(
            (g_state[i] if i in g_state else nnx.State({}))
            if i in nodes
            else g_plain[i]
            for i, _ in specs
        )
        g = grads[0] if single else grads
        return ((loss, aux) if has_aux else loss), g

    return wrapper


def grad(
    f: Callable[..., Any],
    argnums: int | nnx.DiffState | Sequence[int | nnx.DiffState] = 0,
    *,
    has_aux: bool = False,
    strict: bool = False,
) -> Callable[..., Any]:
    """``nnx.grad`` with sparse gradients for embedding tables.

    See :func:`value_and_grad` (``strict`` included); returns ``grads`` or
    ``(grads, aux)``.

    Example:
      >>> import jax.numpy as jnp, jaxslices.nnx
      >>> from flax import nnx
      >>> layer = jaxslices.nnx.Embed(5, 2, rngs=nnx.Rngs(0))
      >>> g = jaxslices.nnx.grad(lambda m: m(jnp.array([4, 4])).sum())(layer)
      >>> g["embedding"].get_value().to_dense()[4]
      Array([2., 2.], dtype=float32)
    """
    vg = value_and_grad(f, argnums, has_aux=has_aux, strict=strict)
    return autodiff.grad_from_value_and_grad(vg, f, has_aux)


# -- embedding collection (issue 22) -------------------------------------------
# A separate block: the NNX module over jaxslices.EmbeddingCollection.

from . import collection as _collection  # noqa: E402


class EmbeddingCollection(nnx.Module):
    """A :class:`jaxslices.EmbeddingCollection` as an NNX module.

    Its stacked buffers are ``nnx.Param`` s in ``self.buffers`` (``{buffer
    name: Param}``); calling it pools every feature (see
    :meth:`jaxslices.EmbeddingCollection.__call__`; :meth:`concat` gives them
    side by side). Under :func:`jaxslices.nnx.value_and_grad` each buffer's
    gradient is one :class:`~jaxslices.IndexedSlices`, and ``nnx.Optimizer``
    with a jaxslices transform updates only the touched rows. Per-table
    hyperparameters: :meth:`jaxslices.EmbeddingCollection.scale_by_table` and
    ``add_decayed_weights_by_table`` of ``self.collection``, chained after the
    optimizer.

    Args:
      tables: the :class:`jaxslices.TableConfig` s.
      rngs: ``nnx.Rngs``; the buffers are initialised from ``rngs.params()``.

    Example:
      >>> import jax.numpy as jnp, jaxslices as js, jaxslices.nnx
      >>> from flax import nnx
      >>> layer = jaxslices.nnx.EmbeddingCollection(
      ...     [js.TableConfig("user", 100, 4), js.TableConfig("item", 50, 4)],
      ...     rngs=nnx.Rngs(0))
      >>> ids = {"user": jnp.array([[3], [5]]), "item": jnp.array([[1], [1]])}
      >>> layer.concat(ids).shape
      (2, 8)
      >>> g = jaxslices.nnx.grad(lambda m: m.concat(ids).sum())(layer)
      >>> g["buffers"]["dim4_float32"].get_value()
      IndexedSlices(float32[150, 4], rows=4)
    """

    def __init__(self, tables: Sequence[Any], *, rngs: nnx.Rngs):
        self.collection = _collection.EmbeddingCollection(tables)
        init = self.collection.init(rngs.params())
        self.buffers = nnx.data({k: nnx.Param(v) for k, v in init.items()})

    def params(self) -> dict[str, jax.Array]:
        """``{buffer name: array}``: the functional collection's params."""
        return {k: v.get_value() for k, v in self.buffers.items()}

    def __call__(self, features: Any, **kwargs: Any) -> dict[str, jax.Array]:
        """``{feature: pooled}``; see :meth:`jaxslices.EmbeddingCollection.__call__`."""
        return self.collection(self.params(), features, **kwargs)

    def concat(self, features: Any, **kwargs: Any) -> jax.Array:
        """``[B, sum of dims]``; see :meth:`jaxslices.EmbeddingCollection.concat`."""
        return self.collection.concat(self.params(), features, **kwargs)


__all__ += ["EmbeddingCollection"]


# -- managed-collision tables (issue 37) ---------------------------------------
# A separate block: a bag layer over a ManagedCollision table (docs/managed.md).

from . import embedding as _embedding  # noqa: E402
from . import managed as _managed  # noqa: E402
from .managed._checks import check_layer  # noqa: E402

_MANAGED = "jaxslices.nnx.ManagedEmbedBag"


class Remap(nnx.Variable):
    """The :class:`jaxslices.RemapState` of a managed table, as an NNX variable.

    Not an ``nnx.Param``: ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and
    :func:`jaxslices.nnx.value_and_grad` leave it alone, while
    ``nnx.state(model)`` (and so a checkpoint of it) holds it with the
    table. Select it with ``nnx.state(model, jaxslices.nnx.Remap)``.
    """


class ManagedEmbedBag(nnx.Module):
    """A bag layer over a managed-collision table: raw ids in, pooled rows out.

    Holds the table, the ``embedding`` parameter (``[num_slots, features]``,
    created as :class:`EmbedBag` creates it), and its
    :class:`jaxslices.RemapState` in ``remap_state``, a :class:`Remap`
    variable (not a ``Param``: never trained, saved with the model). A
    training step follows the managed-collision rule (remap, then reset the
    evicted rows, then read the table; ``docs/managed.md``):

    * ``rows, evicted = layer.remap(raw_ids)`` (any integer dtype, or
      :class:`jaxslices.RawIds`) admits and evicts, updating
      ``remap_state`` in place;
    * :func:`jaxslices.nnx.reset_rows` re-initialises the ``evicted`` rows
      of ``embedding`` and of an ``nnx.Optimizer``'s state;
    * ``layer(rows)`` pools the rows (:func:`jaxslices.embedding_bag`; a
      row ``num_slots``, an id given no row, reads nothing and is not
      counted by ``"mean"``), so under :func:`jaxslices.nnx.value_and_grad`
      ``embedding`` gets an :class:`~jaxslices.IndexedSlices` gradient.

    Args:
      manager: the :class:`jaxslices.ManagedCollision` (its ``num_slots`` is
        the table's rows).
      features: the rows' width.
      combiner: ``"mean"``, ``"sum"`` or ``"sqrtn"``.
      dtype: the output's dtype (``None``: the table's).
      param_dtype, embedding_init: as ``nnx.Embed``'s.
      rngs: ``nnx.Rngs``; the table is initialised from ``rngs.params()``.

    Example:
      >>> import jax.numpy as jnp, jaxslices as js, jaxslices.nnx
      >>> from flax import nnx
      >>> mc = js.ManagedCollision("items", num_slots=8)
      >>> layer = jaxslices.nnx.ManagedEmbedBag(mc, 4, rngs=nnx.Rngs(0))
      >>> rows, evicted = layer.remap(jnp.array([[10**9, 7], [7, -1]]))
      >>> rows.tolist()  # -1 is a raw id too (as 2**64 - 1)
      [[1, 0], [0, 2]]
      >>> layer(rows).shape
      (2, 4)
      >>> int(layer.remap_state.get_value().occupancy)
      3
    """

    def __init__(
        self,
        manager: _managed.ManagedCollision,
        features: int,
        *,
        combiner: str = "mean",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        embedding_init: Any = _EMBED_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        check_layer(_MANAGED, manager, combiner)
        shape = (manager.num_slots, features)
        self.embedding = nnx.Param(embedding_init(rngs.params(), shape, param_dtype))
        self.remap_state = Remap(manager.init())
        self.manager = manager
        self.features = features
        self.combiner = combiner
        self.dtype = dtype

    def remap(self, raw_ids: Any, mask: Any = None) -> tuple[jax.Array, jax.Array]:
        """Raw ids to rows, admitting and evicting: ``(rows, evicted)``.

        Updates ``remap_state`` in place; ``rows`` and ``evicted`` as
        :meth:`jaxslices.ManagedCollision.remap` returns them.
        """
        rows, state, evicted = self.manager.remap(
            self.remap_state.get_value(), raw_ids, mask
        )
        self.remap_state.set_value(state)
        return rows, evicted

    def __call__(self, rows: Any) -> jax.Array:
        """Pool remapped ``rows`` (``[..., L]``, from :meth:`remap`):
        ``[..., features]``."""
        table = self.embedding.get_value()
        out = _embedding.embedding_bag(table, rows, combiner=self.combiner)
        return out if self.dtype is None else out.astype(self.dtype)


def reset_rows(
    model: Any,
    optimizer: nnx.Optimizer | None,
    rows: Any,
    new_rows: Any,
    *,
    where: Callable[[Any], Any],
) -> None:
    """:func:`jaxslices.reset_rows` for an NNX model and its optimizer, in place.

    The table ``where(model)`` picks (a ``Param``, e.g. ``lambda m:
    m.items.embedding``) gets ``new_rows`` in ``rows``, and every state leaf
    of ``optimizer`` (an ``nnx.Optimizer`` of ``model``, or ``None`` for the
    table alone) built from the table gets its optimizer's initial values
    there; both are updated in place (inside ``nnx.jit`` too).

    Example:
      >>> import jax.numpy as jnp, jaxslices as js, jaxslices.nnx
      >>> from flax import nnx
      >>> mc = js.ManagedCollision("t", num_slots=4)
      >>> layer = jaxslices.nnx.ManagedEmbedBag(
      ...     mc, 2, embedding_init=nnx.initializers.ones, rngs=nnx.Rngs(0))
      >>> opt = nnx.Optimizer(layer, js.adagrad(0.1), wrt=nnx.Param)
      >>> jaxslices.nnx.reset_rows(
      ...     layer, opt, jnp.array([2]), 0.0, where=lambda m: m.embedding)
      >>> layer.embedding[:, 0].tolist()
      [1.0, 1.0, 0.0, 1.0]
    """
    name = "jaxslices.nnx.reset_rows"
    target = where(model)
    wrt = nnx.Param if optimizer is None else optimizer.wrt
    variables = nnx.state(model, wrt)
    paths = [path for path, leaf in nnx.to_flat_state(variables) if leaf is target]
    if len(paths) != 1:
        raise ValueError(
            f"{name}: `where(model)` must return one parameter of `model` "
            f"(the table's variable, e.g. where=lambda m: m.items.embedding); it "
            f"returned {type(target).__name__}, found {len(paths)} times among "
            f"the variables nnx.Optimizer trains."
        )
    params = nnx.as_pure(variables)

    def pick(tree: Any) -> Any:
        for key in paths[0]:
            tree = tree[key]
        return tree

    opt_state = None if optimizer is None else nnx.as_pure(optimizer.opt_state)
    params, opt_state = _managed.reset_rows(
        params,
        opt_state,
        rows,
        new_rows,
        where=pick,
        optimizer=None if optimizer is None else optimizer.tx,
    )
    nnx.update(model, params)
    if optimizer is not None:
        nnx.update(optimizer.opt_state, nnx.state(opt_state))


__all__ += ["ManagedEmbedBag", "Remap", "reset_rows"]
