"""Internal: the native backend's version gate, its errors, and every
experimental or private JAX name it uses.

:mod:`jaxslices.native` is built on JAX's experimental "hijax" types
(``jax.experimental.hijax``), whose API changes between JAX releases. This
module is the one place that imports those names, checks the JAX version
(with :data:`jaxslices._jax_compat.JAX_VERSION`, the package's one version
parse) and papers over the differences we know of:

* JAX 0.10.2: ``HiType``, ``VJPHiPrimitive``, ``register_hitype``,
  ``aval_method``, ``ShapedArray``, ``Zero`` are in ``jax.experimental.hijax``;
  the gradient accumulator class (``GradAccum``) is private
  (``jax._src.interpreters.ad``).
* JAX 0.11.x: the same names, plus the accumulators re-exported from
  ``jax.experimental.hijax``; the remat hook of ``VJPHiPrimitive`` takes a
  trace instead of a policy as its first argument (we take it positionally,
  so one signature serves both).
* JAX 0.12.x: ``VJPHiPrimitive`` is gone; its successor ``HiPrim`` has the same
  interface for every method ``jaxslices.native`` defines or calls
  (``in_avals``/``out_aval``/``params`` set in ``__init__``, ``expand``,
  ``vjp_fwd``, ``vjp_bwd`` with accumulators, ``vjp_bwd_retval``, ``batch``,
  ``jvp``, ``remat(trace, ...)``), so the port is the name. Every name comes
  from the public ``jax.experimental.hijax``: nothing private on 0.12.
* All: ``lax.cond`` reads a ``mat`` (manual-axis type) attribute from every
  branch output type; hi types have none, so ours return the one of an
  unsharded ``ShapedArray`` (JAX's empty one), read from a public
  constructor rather than imported from ``jax._src.core``.
* ``jax.checkpoint`` differentiates through ``jvp`` by default (our
  forward-mode error); under ``jax_remat3`` it calls the remat hook, which
  raises the same kind of error (JAX's own full remat of these types fails).

``tests/lib/test_native.py`` passes on JAX 0.10.2 (Python 3.11) and JAX 0.12.0.1
(Python 3.12), both in CI; it passed on 0.11.0 when that was current.

:data:`SUPPORTED_RANGE` is 0.10.2 up to (not including) 0.13
(:data:`jaxslices._jax_compat.UNTESTED_FROM`, the line after the newest tested
one): every 0.12.x release is accepted, as the 0.12 line is tested. On any
other JAX (older, or a newer line not yet tested: hijax is experimental and
changed in every line so far), :func:`require` raises
:class:`UnsupportedJaxError` naming the versions that are known to work and
the default path (:func:`jaxslices.value_and_grad`), which needs none of this.
The default path itself has no upper bound: on a newer line it runs, with a
warning that the line is untested (``docs/design.md``, "JAX compatibility");
the native backend refuses instead, because an experimental API that changed
in every line would more likely fail in ways a warning does not cover.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .. import _jax_compat

__all__ = [
    "DEFAULT_PATH",
    "SUPPORTED_RANGE",
    "NativeBackendError",
    "UnsupportedJaxError",
    "require",
    "typeof",
]

#: Inclusive lower bound, exclusive upper bound, compared with
#: ``_jax_compat.JAX_VERSION`` (major, minor, patch).
SUPPORTED_RANGE = ((0, 10, 2), _jax_compat.UNTESTED_FROM)


class UnsupportedJaxError(ImportError):
    """The installed JAX lacks the hijax API ``jaxslices.native`` is built on."""


class NativeBackendError(TypeError):
    """An operation the native backend does not support (see the message)."""


#: The way out every error of the native backend names.
DEFAULT_PATH = (
    "Use the default backend instead: jaxslices.value_and_grad with "
    "jaxslices.embedding_lookup on the plain array."
)


def typeof(x: Any) -> Any:
    """``jax.typeof(x)``, or ``None`` for what JAX cannot type."""
    try:
        return jax.typeof(x)
    except TypeError:
        return None


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


_IMPORT_ERROR: BaseException | None = None

try:
    from jax.experimental import hijax as _hx

    HiType: Any = _hx.HiType
    # The primitive base class: VJPHiPrimitive on JAX 0.10-0.11, HiPrim on 0.12.
    HiPrimitive: Any = getattr(_hx, "VJPHiPrimitive", None) or _hx.HiPrim
    register_hitype: Any = _hx.register_hitype
    aval_method: Any = _hx.aval_method
    ShapedArray: Any = _hx.ShapedArray
    Zero: Any = _hx.Zero
    if hasattr(_hx, "GradAccum"):  # JAX >= 0.11: public
        GradAccum: Any = _hx.GradAccum
    else:  # JAX 0.10.2: private
        from jax._src.interpreters.ad import GradAccum
    # The empty manual-axis type: the default of every unsharded array type.
    EMPTY_MAT: Any = ShapedArray((), np.float32).mat
except (ImportError, AttributeError) as e:  # pragma: no cover - other JAX versions
    _IMPORT_ERROR = e


def require() -> None:
    """Raise :class:`UnsupportedJaxError` unless this JAX is known to work."""
    lo, hi = SUPPORTED_RANGE
    problem = None
    if _IMPORT_ERROR is not None:
        problem = f"its hijax API could not be imported ({_IMPORT_ERROR!r})"
    elif not _jax_compat.version_in(lo, hi):
        problem = "this version has not been tested with it"
    if problem is not None:
        raise UnsupportedJaxError(
            f"jaxslices.native needs JAX >= {_fmt(lo)} and < {_fmt(hi)} (it is "
            f"built on the experimental jax.experimental.hijax API, tested on "
            f"{_jax_compat.OLDEST_TESTED} and {_jax_compat.NEWEST_TESTED}); JAX "
            f"{jax.__version__} is installed and {problem}. Use the default "
            "backend instead: jaxslices.value_and_grad / jaxslices.grad with "
            "jaxslices.embedding_lookup need no experimental JAX API and run on "
            f"every JAX >= {_jax_compat.OLDEST_TESTED} (on a line newer than "
            f"the newest tested, {_jax_compat.NEWEST_TESTED}, with a warning "
            "that it is untested)."
        )


def is_grad_accum(x: Any) -> bool:
    return isinstance(x, GradAccum)


def remat_error_hook(error: type[Exception], message: str) -> Any:
    """A primitive's ``remat`` method that raises ``error(message)``.

    Its first argument is a checkpoint policy (JAX 0.10.2) or a trace (0.11,
    0.12); both are taken positionally and ignored.
    """

    def remat(self: Any, _policy_or_trace: Any, *args: Any) -> Any:
        raise error(message)

    return remat
