"""One run-time check that raises eagerly, under ``jit``, and on every device.

:func:`raise_if` is how jaxslices stops a step on a value it cannot see at
trace time (an id out of range, a buffer over capacity). Equinox's
``error_if`` is the model: the check returns the array it guards, and under
``jit`` every use of that result depends on the check, so nothing computed
from it runs before the check has passed.

How, and why this way (measured on 8 CPU devices and on 2 processes x 4
devices; ``tests/scale/test_errors.py``):

* **Eagerly** (concrete values), the error is raised at the call.
* **Under** ``jit`` the check is a ``jax.pure_callback`` inside a
  ``lax.cond`` on the predicate (so the host is called only when the check
  fails). The callback raises the error; JAX reports it, when the result is
  computed, as ``jax.errors.JaxRuntimeError`` on its Python dispatch path (a
  compiled step's first call) and as ``ValueError`` on its C++ fast path
  (later calls; JAX 0.10-0.12), either way with the error's type and text in
  the message: catch both around the jitted call and
  ``jax.block_until_ready`` of its result. A pure callback is no JAX effect,
  so a step with checks keeps JAX's C++ dispatch path (an effect would cost
  0.14-0.25 ms of Python per call on CPU, ``benchmarks/check_dispatch.py``;
  a 1-2 ms CPU optimizer step with a ``max_distinct`` bound gains 5-15%).
  Like Equinox's ``error_if``, the check then runs when something uses its
  result: callers guard what the step goes on to use. ``always=True`` (the public
  :func:`jaxslices.check_ids`, whose result a user may drop) is a
  ``jax.debug.callback`` instead, an effect kept even when the result is
  unused. Either callback needs JAX's CPU backend: with
  ``JAX_PLATFORMS=cuda`` (no ``cpu``) a failing check raises JAX's own
  ``RuntimeError`` ("failed to find a local CPU device", seen on JAX 0.11.2
  on a GPU) instead of the message, though it still stops the step.
* **Over a mesh** a callback that raises on one device only leaves the others
  waiting in the step's next collective: measured, the process aborts after
  the collective's rendezvous timeout (SIGABRT, no Python exception). Under
  plain ``jit`` JAX runs a callback on one device only (device 0), so that was
  what ``jax.debug.callback`` checks did. So the predicate is first made the
  same on every device (it is computed from global values under ``jit``, and
  reduced with a ``psum`` over the manual axes inside ``shard_map``; the
  message's numbers likewise), and the callback runs on *every* device: inside
  ``shard_map`` it does anyway, and under plain ``jit`` over a mesh it is
  wrapped in a ``shard_map`` over that mesh with replicated scalar operands.
  Every device then fails at the same point, before any collective that
  depends on the guarded array, and every process raises. The guarded arrays
  are threaded through the check: integers as ``guard ^ token``, others as
  ``where(token != 0, 0, guard)`` (``token`` is the ``cond``'s result, zero
  when the check passes: XLA cannot fold it away, and it costs one integer
  ``xor`` or one select per element, fused into what uses it).
* **What the user reads.** JAX, not jaxslices, writes the first line of the
  error it raises: jaxlib turns the callback's exception into the text
  ``INTERNAL: CpuCallback error calling callback: Traceback (most recent call
  last):``, then the frames, then ``ValueError: <the message>`` last (on JAX
  0.10.2 and 0.12; the same on every device and process; measured, and
  asserted by ``tests/scale/test_errors.py``). Neither the exception's type
  nor its text nor JAX's traceback filtering changes that first line (the
  frames are formatted in C++, after the exception has left Python; nothing
  of jaxslices runs between the callback and the user's call). Before it
  raises, though, JAX logs the failed callback (logger ``jax._src.callback``,
  ``"jax.pure_callback failed"`` and the whole traceback, at ``ERROR``, once
  per device: 8 tracebacks on 8 devices), and that log is what a script or
  notebook prints first. jaxslices makes that record one line that starts
  with its own message (``jaxslices check failed: <the message>``), written
  once per failure, not per device (the same text within
  :data:`LOG_REPEAT_S` seconds is not repeated): a filter on JAX's callback
  loggers (``_jax_compat`` entry ``callback_logs``) that changes only records
  of exceptions raised by :func:`raise_if`; every other record is left as it
  is. The callback raises the error itself, so the message's traceback holds
  one jaxslices frame.
* The alternatives measured: ``jax.debug.callback`` (runs on device 0 only
  under ``jit``: a hang whenever a collective follows), a callback without
  the global predicate (only the failing device stops: a hang), and
  ``checkify`` (needs the user's function wrapped and its error thrown by the
  caller: not transparent inside a library call).

Callers guard the arrays that feed the step's collectives (for the
``all_to_all`` routing, the slots every exchanged buffer is built from).
Collectives that do not depend on the guarded array and run concurrently with
the check are not ordered by it; jaxslices places its checks before its own
collectives.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from . import _jax_compat

__all__ = ["raise_if"]

_REDUCE = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}


def _is_traced(*xs: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(xs))


def _global(x: jax.Array, how: str, axes: tuple[str, ...]) -> jax.Array:
    """``x`` reduced over the manual ``axes`` (made varying first if needed)."""
    have = _jax_compat.varying_axes(x) or frozenset()
    missing = tuple(a for a in axes if a not in have)
    if missing and _jax_compat.AVAILABLE["pcast_varying"]:
        try:
            x = _jax_compat.pcast_varying(x, missing)
        except (ValueError, TypeError):  # pragma: no cover - no varying types
            pass
    return _REDUCE[how](x, axes)


#: Seconds within which the log line of the same failure is not written
#: again (the callback runs on every device of a mesh: one line, not one per
#: device).
LOG_REPEAT_S = 1.0

#: Set on every exception a failed check raises under ``jit``; the log filter
#: changes the records of these exceptions only.
_MARK = "_jaxslices_check"


def _failure(error: Callable[..., Exception], pred: Any, *payload: Any) -> Any:
    """``error(*payload)`` if any ``pred`` (the first failing element under vmap)."""
    pred = np.asarray(pred)
    if not np.any(pred):
        return None
    values = [np.asarray(v) for v in payload]
    if values and values[0].ndim:  # batched by vmap: report the first failure
        first = int(np.argmax(pred.reshape(-1)))
        values = [v.reshape(-1)[first] for v in values]
    failure = error(*(int(v) for v in values))
    try:
        setattr(failure, _MARK, True)
    except AttributeError:  # pragma: no cover - an exception type with slots
        pass
    return failure


# Raised in the function the callback calls: one jaxslices frame in the
# traceback JAX puts into its error.
def _host_check(error: Callable[..., Exception], pred: Any, *payload: Any) -> None:
    """The effectful check (``always=True``): raise the error itself."""
    failure = _failure(error, pred, *payload)
    if failure is not None:
        raise failure


def _host_token(error: Callable[..., Exception], pred: Any, *payload: Any) -> Any:
    """The pure check (the default): raise, or zeros shaped like ``pred``."""
    failure = _failure(error, pred, *payload)
    if failure is not None:
        raise failure
    return np.zeros(np.shape(pred), np.int32)


class _OneLineLog(logging.Filter):
    """JAX's log of a failed callback, as one line, for jaxslices' checks only.

    JAX logs ``"jax.pure_callback failed"`` (``"jax.debug.callback failed"``)
    with the whole traceback, once per device, before it raises. For an
    exception raised by :func:`raise_if` the record becomes
    ``jaxslices check failed: <message>`` without the traceback (the error
    JAX raises carries it), and the same text within :data:`LOG_REPEAT_S`
    seconds is dropped. Every other record passes unchanged.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._last: tuple[str, float] = ("", float("-inf"))

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if isinstance(record.exc_info, tuple) else None
        if not getattr(exc, _MARK, False):
            return True
        text = f"jaxslices check failed: {exc}"
        now = time.monotonic()
        with self._lock:
            last, when = self._last
            if text == last and now - when < LOG_REPEAT_S:
                return False
            self._last = (text, now)
        record.msg, record.args = text, ()
        record.exc_info, record.exc_text = None, None
        return True


_LOG_FILTER = _OneLineLog()


def _install_log_filter() -> None:
    """Add :data:`_LOG_FILTER` to JAX's callback loggers (once; entry
    ``callback_logs``: without it, JAX's own log stays)."""
    for logger in _jax_compat.callback_loggers():
        if _LOG_FILTER not in logger.filters:
            logger.addFilter(_LOG_FILTER)


def _fire(
    error: Callable[..., Exception], pred: Any, payload: Sequence[Any], always: bool
) -> Any:
    """Zero if ``pred`` is false; otherwise a callback that raises ``error``."""
    _install_log_filter()

    def failed(pred, *payload):
        if always:
            # An effect: kept even when the guarded result is unused, at the
            # price of JAX's C++ dispatch path for the whole step.
            jax.debug.callback(functools.partial(_host_check, error), pred, *payload)
            return pred.astype(jnp.int32)  # 0 where the check passed (under vmap)
        # A pure callback: no effect, so the step keeps JAX's C++ dispatch
        # path (an effect costs 0.14-0.25 ms of Python per call on CPU,
        # benchmarks/check_dispatch.py). Its result is the token every use of
        # the guard depends on: dead code only when nothing uses the guards.
        out = jax.ShapeDtypeStruct(pred.shape, jnp.int32)
        check = functools.partial(_host_token, error)
        token = jax.pure_callback(
            check, out, pred, *payload, vmap_method="broadcast_all"
        )
        # Inside shard_map (check_vma) a callback's result is not varying;
        # the other branch's is, like pred: add a zero that varies like pred.
        return token + jnp.zeros_like(pred, jnp.int32)

    def passed(pred, *payload):
        del payload
        return jnp.zeros_like(pred, jnp.int32)  # varies like pred (shard_map)

    return jax.lax.cond(pred, failed, passed, pred, *payload)


def _thread(leaf: Any, token: jax.Array) -> jax.Array:
    """``leaf`` made to depend on ``token`` (zero when the check passed)."""
    leaf = jnp.asarray(leaf)
    if jnp.issubdtype(leaf.dtype, jnp.integer):
        return leaf ^ token.astype(leaf.dtype)  # one integer xor per element
    # Not foldable by XLA (the token is a run-time value); the other branch is
    # never taken: a failed check raises before anything uses the result.
    return jnp.where(token != 0, jnp.zeros((), leaf.dtype), leaf)


def _mesh_of(arrays: Sequence[Any]) -> Any | None:
    """The mesh of more than one device the arrays are laid out on under
    plain ``jit`` (``None``: none; also inside ``shard_map``, whose mesh is
    all ``Manual``: there each device fires its own callback)."""
    for x in arrays:
        mesh = _jax_compat.abstract_mesh(x)
        if mesh is not None and mesh.size > 1:
            if _jax_compat.axis_kinds(mesh) == frozenset({"Manual"}):
                return None
            return mesh
    return None


def raise_if(
    pred: Any,
    guard: Any,
    error: Callable[..., Exception],
    *payload: Any,
    reduce: Sequence[str] = (),
    like: Sequence[Any] = (),
    always: bool = False,
) -> Any:
    """Raise ``error(*payload)`` if any element of ``pred`` is true; return ``guard``.

    Args:
      pred: booleans; the check fails if any is true (on any device).
      guard: the array (or pytree of arrays) the check guards. It is
        returned unchanged; under ``jit`` every use of the result waits for
        the check, and the check runs when something uses it (as Equinox's
        ``error_if``): guard what the step goes on to use.
      error: builds the exception from the payload as Python ints.
      *payload: integer scalars for the message (counts, extremes).
      reduce: per payload entry, ``"sum"``, ``"max"`` or ``"min"``: how to
        combine it over devices inside ``shard_map``, so that every device
        reports the same numbers. Under plain ``jit`` values computed with
        ``jnp`` reductions are global already.
      like: arrays whose device mesh decides where the check runs under plain
        ``jit`` (default: ``guard``'s).
      always: also check when nothing uses the result (a ``jax.debug.callback``,
        an effect: the whole step then loses JAX's C++ dispatch path). For
        public checks whose result a user may drop (``check_ids``).

    Returns:
      ``guard``.

    Raises:
      The exception ``error`` builds, eagerly; under ``jit``,
      ``jax.errors.JaxRuntimeError`` (``ValueError`` on later calls of a
      compiled step) carrying its message, on every process. Its text is
      JAX's: the first line ``INTERNAL: CpuCallback error calling callback:
      Traceback (most recent call last):``, the last ``<type>: <message>``.
      Before it is raised, the message is logged as one line,
      ``jaxslices check failed: <message>``, at ``ERROR`` on JAX's callback
      logger.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxslices._errors import raise_if
      >>> def check(ids):
      ...     bad = ids >= 4
      ...     return raise_if(bad, ids, lambda n: ValueError(f"{n} ids >= 4"),
      ...                     jnp.sum(bad))
      >>> check(jnp.array([1, 2]))
      Array([1, 2], dtype=int32)
      >>> check(jnp.array([1, 7]))
      Traceback (most recent call last):
      ...
      ValueError: 1 ids >= 4
    """
    if len(reduce) not in (0, len(payload)):
        raise ValueError("raise_if: give one `reduce` entry per payload entry.")
    if not _is_traced(pred, guard, payload):
        if np.any(np.asarray(pred)):
            raise error(*(int(np.asarray(v)) for v in payload))
        return guard
    flag = jnp.any(jnp.asarray(pred))
    payload = tuple(jnp.asarray(v) for v in payload)
    axes = _jax_compat.manual_axes()
    if axes:  # inside shard_map: every device decides on the global values
        flag = _global(flag.astype(jnp.int32), "sum", axes) > 0
        hows = tuple(reduce) or ("max",) * len(payload)
        payload = tuple(_global(v, h, axes) for v, h in zip(payload, hows, strict=True))
        token = _fire(error, flag, payload, always)
    else:
        mesh = _mesh_of([*like, *jax.tree.leaves(guard)])
        if mesh is None:
            token = _fire(error, flag, payload, always)
        else:  # plain jit over a mesh: run the callback on every device
            specs = (P(),) * (1 + len(payload))
            fire = _jax_compat.shard_map(
                lambda f, *p: _fire(error, f, p, always), mesh, specs, P()
            )
            token = fire(flag, *payload)
    return jax.tree.map(lambda leaf: _thread(leaf, token), guard)
