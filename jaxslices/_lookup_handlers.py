"""Internal: lookup handlers, where another gradient backend plugs into lookups.

:func:`jaxslices.embedding_lookup` and :func:`jaxslices.embedding_bag` consult
this registry first (one marked place, ``_prepare`` in ``embedding.py``). A
backend whose tables are not plain arrays (the opt-in native backend's hijax
table type, for example) registers a :class:`LookupHandler` that claims its
tables; the lookup then runs the handler's ``lookup`` on ids that already went
through the common ids policy (:mod:`jaxslices._ids`: validated, ``check_ids``
applied on the caller's ids, range-checked in their own dtype and mapped to
the index dtype with every invalid id set to ``V``, the padding index). The
dtype cast (``dtype=``) and ``embedding_bag``'s reduction are applied to the
rows it returns.

Tables no handler claims take the default path: the tap backend
(``_tape.lookup`` under :func:`jaxslices.value_and_grad`) or a plain lookup
with JAX's dense gradient.

Handlers are registered at import of the backend's module (not while
tracing), so a module-level list is enough; registering is idempotent.

(Named for what it holds: "backend" in jaxslices means a way of getting sparse
gradients, the tap backend or the native one; this registry is not one.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["LookupHandler", "register_lookup_handler", "unregister_lookup_handler"]


@dataclasses.dataclass(frozen=True)
class LookupHandler:
    """How a backend looks up rows of the tables it owns.

    Attributes:
      name: for error messages and debugging.
      claims: ``claims(table) -> bool``: is ``table`` (a value or a tracer)
        one of this backend's tables? Called on every lookup: keep it cheap,
        and never raise for a table that is not yours.
      num_rows: ``num_rows(table) -> int``: ``V``, static.
      lookup: ``lookup(table, ids) -> rows`` with ``ids`` integer, in
        ``[0, V]`` (``V``: padding, must read zeros and get no gradient);
        returns ``ids.shape + row_shape`` rows.
    """

    name: str
    claims: Callable[[Any], bool]
    num_rows: Callable[[Any], int]
    lookup: Callable[[Any, jax.Array], jax.Array]


_HANDLERS: list[LookupHandler] = []


def register_lookup_handler(handler: LookupHandler) -> None:
    """Add ``handler`` (once); later registrations are consulted first."""
    if handler not in _HANDLERS:
        _HANDLERS.insert(0, handler)


def unregister_lookup_handler(handler: LookupHandler) -> None:
    """Remove ``handler`` if registered."""
    if handler in _HANDLERS:
        _HANDLERS.remove(handler)


def handler_for(table: Any) -> LookupHandler | None:
    """The handler that claims ``table``, or ``None`` for the default path."""
    for handler in _HANDLERS:
        if handler.claims(table):
            return handler
    return None
