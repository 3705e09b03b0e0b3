"""Internal: the private JAX names jaxslices uses, in one place.

Only the tape mechanism uses them, to see whether a lookup below the loss's top
level is separated from it by ``jax.vmap`` alone (then it can stay sparse). On
a JAX whose internals differ (checked at import: the names and attributes
below), :data:`AVAILABLE` is ``False`` and such lookups fall back to JAX's
dense gradient, which is always correct.

Names used (JAX >= 0.4.36, stackless tracing; checked on 0.10.2 and the 0.11
sources): ``jax._src.core.trace_ctx.trace`` (the current trace, thread-local),
``jax._src.interpreters.batching.BatchTrace`` (``parent_trace``, ``tag``) and
``BatchTracer`` (``_trace``).
"""

from __future__ import annotations

from typing import Any

try:
    from jax._src import core as _core
    from jax._src.interpreters import batching as _batching

    _BatchTrace = _batching.BatchTrace
    _BatchTracer = _batching.BatchTracer
    AVAILABLE = hasattr(_core, "trace_ctx") and hasattr(_BatchTracer, "_trace")
except Exception:  # pragma: no cover - a JAX without these internals
    AVAILABLE = False


def current_trace() -> Any:
    """The current trace object (``None`` if the internals are unavailable)."""
    return _core.trace_ctx.trace if AVAILABLE else None


def vmap_route(top: Any, ids: Any) -> bool | None:
    """How the current trace reaches ``top``.

    Returns ``None`` unless every trace between the current one and ``top`` is
    a ``jax.vmap`` (``BatchTrace``); otherwise whether ``ids`` is batched by
    one of those ``vmap``s (``False``: the ids are the same for every batch
    element, so operations on them run at ``top`` itself).
    """
    if not AVAILABLE or top is None:
        return None
    tags = []
    trace = _core.trace_ctx.trace
    while trace is not top:
        if not isinstance(trace, _BatchTrace) or not hasattr(trace, "parent_trace"):
            return None
        tags.append(trace.tag)
        trace = trace.parent_trace
    return isinstance(ids, _BatchTracer) and any(ids._trace.tag is t for t in tags)
