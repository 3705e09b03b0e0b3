"""Experimental: sparse gradients from plain ``jax.grad`` (JAX hijax types).

:func:`jaxslices.value_and_grad` (the default backend) rewrites the loss to get
row-sparse gradients. This module takes another route: it gives the *table* a
new JAX type whose cotangent type is row-sparse, so that JAX's own
``jax.grad``, ``jax.value_and_grad``, ``jax.vjp`` (and framework wrappers built
on them) return a row-sparse gradient for it, also for lookups inside
``lax.scan`` and ``vmap``, from one trace of the loss.

Usage::

    @jax.jit
    def step(params, opt_state, ids, y):
        marked = {**params, "emb": native.mark(params["emb"], capacity=ids.size)}
        loss, g = jax.value_and_grad(loss_fn)(marked, ids, y)
        g = native.to_indexed_slices(g)  # RowSparse leaves -> IndexedSlices
        updates, opt_state = tx.update(g, opt_state, params)
        return jaxslices.apply_updates(params, updates), opt_state, loss

* :func:`mark` wraps a ``(V, ...)`` array into a :class:`SparseTable` with a
  static row ``capacity``. The loss reads it only through :func:`lookup` (or
  :func:`jaxslices.embedding_lookup` / :func:`jaxslices.embedding_bag`, which
  dispatch to :func:`lookup` for a marked table).
* The gradient of a :class:`SparseTable` is a :class:`RowSparse`: ``capacity``
  slots of ``(row, index)``, one slot per looked-up id (duplicates kept, ids
  outside ``[0, V)`` and unused slots are padding with index ``V``, as in
  :class:`~jaxslices.IndexedSlices`). :func:`to_indexed_slices` turns every
  ``RowSparse`` in a tree into an :class:`~jaxslices.IndexedSlices`, which the
  jaxslices transforms and :func:`~jaxslices.apply_updates` take.

Capacity (never silently wrong): every id looked up from a table in one
gradient computation takes one slot, whether the lookups are at top level,
under ``vmap`` (the whole batch) or inside ``lax.scan`` (every step). If they
need more slots than ``capacity``, you get an error, never a truncated
gradient: at trace time where the shapes decide it (one lookup, or several
lookups added in one backward pass), otherwise (``scan``) when the gradient is
read by :func:`to_indexed_slices` / :meth:`RowSparse.to_dense` (under
``jit`` through :func:`jaxslices._errors.raise_if`, like
:func:`jaxslices.check_ids`).

Not supported, each raising a :class:`NativeBackendError` that names the
limit and the default backend: reading a marked table other than through
:func:`lookup` (e.g. ``table @ x``, tied output embeddings), ``jax.checkpoint``
around a lookup, forward-mode AD (``jax.jvp``), ``vmap`` over a batch of
tables. Shardings are not modelled on the types (no ``shard_map``/explicit
sharding support; JAX raises its own error). This module needs JAX >= 0.10.2
and < 0.13 (tested on 0.10.2 and 0.12.0.1; see ``jaxslices/native/_hijax.py``);
importing it on another JAX raises ``UnsupportedJaxError`` (an
``ImportError``) naming the default backend, which runs on newer JAX too
(with a warning that the line is untested).
"""

from __future__ import annotations

from typing import Any

import jax

from .. import _lookup_handlers
from . import _hijax

_hijax.require()  # before the modules built on the hijax names

from ._hijax import NativeBackendError  # noqa: E402
from ._row_sparse import (  # noqa: E402
    RowSparse,
    RowSparseType,
    is_row_sparse,
    to_indexed_slices,
)
from ._table import (  # noqa: E402
    SparseTable,
    SparseTableType,
    _lookup,
    is_marked,
    lookup,
    mark,
)

__all__ = [
    "NativeBackendError",
    "RowSparse",
    "RowSparseType",
    "SparseTable",
    "SparseTableType",
    "is_marked",
    "is_row_sparse",
    "lookup",
    "mark",
    "to_indexed_slices",
]


# jaxslices.embedding_lookup / embedding_bag hand marked tables to this backend
# (after their own ids checks; the ids arrive in [0, V], V being padding).
def _claims(table: Any) -> bool:
    try:
        return is_marked(table)
    except Exception:  # never raise for a table that is not ours
        return False


_lookup_handlers.register_lookup_handler(
    _lookup_handlers.LookupHandler(
        name="jaxslices.native",
        claims=_claims,
        num_rows=lambda table: jax.typeof(table).dense_shape[0],
        lookup=_lookup,
    )
)
