"""Native CPU kernels: the embedding bag and its optimizer step, in C++.

XLA's generic gather, sort and scatter ops cost more than the row work of an
embedding step on a CPU. jaxslices therefore runs the hot parts of a training
step as C++ kernels called through JAX's foreign function interface
(``jax.ffi``): the forward bag (gather and pooling), the optimizers'
coalescing and row-wise rules (duplicate ids summed in a hash table, each
distinct row and its optimizer state updated once, in place), and the
in-place update of the table. The API does not change: the same
``jaxslices.value_and_grad``, layers, transforms, ``optax.chain`` and
``apply_updates`` take this path by themselves when it is available and the
step allows it, and the XLA path otherwise (``docs/kernels.md``).

This module is the user's handle on it:

* :func:`status` / :func:`available`: are the kernels built and loaded?
  (They are compiled on first use against the installed jaxlib's headers;
  without a C++ compiler jaxslices says so once and runs on XLA.)
* :func:`explain`: which path each operation of a step takes, and why, and
  where a kernel reads a gradient's materialised rows instead of its pooled
  form (:attr:`jaxslices.IndexedSlices.recipe`).
* :func:`disabled`: run on the XLA path; part of ``jax.jit``'s cache keys,
  so a step traced before is traced again (``JAXSLICES_NATIVE=0`` turns the
  kernels off for a whole process).
* :func:`threads` / :func:`default_threads`: the threads of XLA's CPU pool a
  kernel call uses (results are the same whatever the count).
* :func:`gpu_kernels`: on a GPU, run the embedding bag, the optimizers'
  rules and the update as Pallas kernels instead of XLA's generic ops
  (opt-in: not measured on a GPU yet; part of ``jax.jit``'s cache keys);
  :func:`gpu_target`: the GPU to lower them for on a host without one
  (``jax.export`` for ``cuda``).
* ``python -m jaxslices.kernels``: build them now (the first build takes
  about a minute, once) and print :func:`status`, the compiler, the flags,
  the threads and the cache (``--help``).

Inside: ``_path`` (path choice: the switch, ``route``, the notes
``explain`` reads), ``_ops`` (the ops as primitives, their XLA references),
``_pallas`` (their Pallas GPU kernels),
``_build`` (compile, cache, load), ``_threads`` (the thread setting),
``_explain``.
"""

from __future__ import annotations

from .._jax_compat import gpu_target
from ._build import KernelsUnavailableWarning, library_path
from ._build import load as _load
from ._build import status as _status
from ._explain import Report, explain
from ._path import Decision, disabled, gpu_kernels
from ._threads import default_threads, threads

__all__ = [
    "Decision",
    "KernelsUnavailableWarning",
    "Report",
    "available",
    "default_threads",
    "disabled",
    "explain",
    "gpu_kernels",
    "gpu_target",
    "library_path",
    "status",
    "threads",
]


def available() -> bool:
    """Build (once, cached) and load the kernels; ``True`` if they run here.

    Example:
      >>> import jaxslices
      >>> isinstance(jaxslices.kernels.available(), bool)
      True
    """
    return _load()


def status() -> str:
    """One line: the kernels are loaded (and from where), or why not.

    Builds and loads them first if no step has yet (as :func:`available`),
    but does not warn: the line it returns is the message.

    Example:
      >>> import jaxslices
      >>> jaxslices.kernels.status().split(":")[0] in ("loaded", "unavailable",
      ...     "disabled by JAXSLICES_NATIVE=0")
      True
      >>> jaxslices.kernels.status().startswith("loaded: ") == (
      ...     jaxslices.kernels.available())
      True
    """
    _load(warn=False)
    return _status()
