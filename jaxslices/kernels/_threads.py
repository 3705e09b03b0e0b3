"""Threads: how many of XLA's CPU pool threads a native kernel call uses.

The kernels run on XLA's intra-op thread pool, the one XLA's own CPU ops
use (its size: the CPUs the process may use when JAX starts, or
``PJRT_NPROC``, and at least one per CPU device), at most one thread per CPU
the process may use (:func:`default_threads`). Each call splits its work into units
claimed by the calling thread and pool tasks (csrc/parallel.h), so that a
busy core never holds the others back. :func:`threads` caps or forces the
number of threads per call and the batch size below which a call stays on
one thread; it is a JAX user context (as :func:`~jaxslices.kernels.disabled`),
read when a step is lowered, so part of ``jax.jit``'s cache keys.
``JAXSLICES_THREADS=n`` sets the default for a whole process.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
import numpy as np

from . import _build

__all__ = ["MIN_SLOTS", "default_threads", "thread_setting", "threads"]

# Below this many ids (slots) a kernel call runs on one thread: waking the
# pool's parked threads costs tens of microseconds, more than a small
# batch's work. Measured: docs/kernels.md ("Threads").
MIN_SLOTS = 4096

# (threads, min_slots) as given to threads(); None: the default.
_THREADS = jax.make_user_context((None, None))


def _check_count(name: str, value: Any, least: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"threads(): {name} must be an int or None, got {value!r}")
    if value < least:
        raise ValueError(f"threads(): {name} must be >= {least} or None, got {value}")
    return int(value)


def thread_setting() -> tuple[int, int]:
    """``(threads, min_slots)`` for kernels lowered here (0 threads: the default)."""
    n, min_slots = _THREADS.value
    if n is None:
        env = os.environ.get("JAXSLICES_THREADS", "").strip()
        if env and not (env.isdigit() and int(env) >= 1):
            raise ValueError(
                f"JAXSLICES_THREADS={env!r}: expected a number of threads >= 1 "
                "(or unset: XLA's CPU pool as it is)"
            )
        n = int(env) if env else 0
    return n, MIN_SLOTS if min_slots is None else min_slots


@contextmanager
def threads(n: int | None = None, *, min_slots: int | None = None) -> Iterator[None]:
    """Run the native kernels on ``n`` threads per call (this thread's steps).

    ``n=None`` (the default) uses XLA's CPU thread pool, at most one thread
    per CPU the process may use (:func:`jaxslices.kernels.default_threads`);
    ``n=1`` runs each kernel on the calling thread only; a larger ``n``
    splits each call into units that up to ``n`` threads claim (also more
    than the pool has: the extra tasks queue). Calls with fewer than
    ``min_slots`` ids stay on one thread (default :data:`MIN_SLOTS`).
    Results never depend on the thread count: each table row is owned by one
    thread and its sums run in slot order, so they are the same bit for bit.
    Like :func:`disabled`, the setting is part of ``jax.jit``'s cache keys (a
    step is lowered again under a new one).

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices
      >>> bag = jax.jit(jaxslices.embedding_bag)
      >>> table, ids = jnp.ones((4, 2)), jnp.array([[1, 2]])
      >>> with jaxslices.kernels.threads(1):
      ...     one = bag(table, ids)
      >>> bool((one == bag(table, ids)).all())
      True
    """
    setting = (_check_count("n", n, 1), _check_count("min_slots", min_slots, 0))
    with _THREADS(setting):
        yield


@functools.cache
def _default_threads() -> int:
    call = jax.ffi.ffi_call(
        "jaxslices_pool_threads", jax.ShapeDtypeStruct((), np.int32)
    )
    with jax.default_device(jax.devices("cpu")[0]):
        return int(jax.jit(call)())


def default_threads() -> int | None:
    """The threads a kernel call uses unless :func:`threads` says otherwise.

    XLA's CPU thread pool, at most one thread per CPU this process may use
    (its affinity: ``taskset -c 0`` gives 1); ``None`` without the kernels.

    Example:
      >>> import jaxslices
      >>> n = jaxslices.kernels.default_threads()
      >>> n is None or n >= 1
      True
    """
    if not _build.load(warn=False):
        return None
    return _default_threads()


def describe() -> str:
    """One line for :func:`jaxslices.kernels.explain`: the threads a call uses."""
    n, min_slots = thread_setting()
    default = default_threads()
    if n:
        what = f"{n} per kernel call (forced by kernels.threads or JAXSLICES_THREADS)"
    elif default:
        what = f"up to {default} per kernel call (XLA's CPU pool, one per CPU)"
    else:
        what = "none (the kernels are unavailable)"
    below = f"one below {min_slots} ids" if min_slots else "every batch split"
    return f"{what}, {below}"
