"""Flax NNX gradient entry points: ``value_and_grad`` and ``grad``, sparse."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import filterlib, graphlib

from .. import autodiff

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
