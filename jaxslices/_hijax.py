"""Internal: every experimental or private JAX name the native backend uses.

:mod:`jaxslices.native` is built on JAX's experimental "hijax" types
(``jax.experimental.hijax``), whose API changes between JAX releases. This
module is the one place that imports those names, checks the JAX version and
papers over the differences we know of:

* JAX 0.10.2: ``HiType``, ``VJPHiPrimitive``, ``register_hitype``,
  ``aval_method``/``aval_property`` are in ``jax.experimental.hijax``; the
  gradient accumulators (``GradAccum``, ``NullAccum``) are private
  (``jax._src.interpreters.ad``).
* JAX 0.11.x: the same names, plus the accumulators re-exported from
  ``jax.experimental.hijax``; the remat hook of ``VJPHiPrimitive`` takes a
  trace instead of a policy as its first argument (we take it positionally,
  so one signature serves both).
* Both: ``lax.cond`` reads a ``mat`` (manual-axis type) attribute from every
  branch output type; hi types have none, so we provide JAX's empty one
  (``jax._src.core.empty_mat``).
* ``jax.checkpoint`` differentiates through ``jvp`` by default on both (our
  forward-mode error); under ``jax_remat3`` (0.11) it calls the remat hook,
  which raises the same kind of error (JAX's own remat of these types fails).

``tests/test_native.py`` passes on JAX 0.10.2 (Python 3.11) and on JAX 0.11.0
(Python 3.12, CPU, with flax 0.12.8 and equinox 0.13.8).

On any other JAX, :func:`require` raises :class:`UnsupportedJaxError` naming
the versions that are known to work and the default path
(:func:`jaxslices.value_and_grad`), which needs none of this.
"""

from __future__ import annotations

import re
from typing import Any

import jax

__all__ = [
    "JAX_VERSION",
    "SUPPORTED_RANGE",
    "UnsupportedJaxError",
    "require",
]

# Inclusive lower bound, exclusive upper bound.
SUPPORTED_RANGE = ((0, 10, 2), (0, 12, 0))


def _parse_version(text: str) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    if m is None:
        return (0, 0, 0)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3)))


JAX_VERSION = _parse_version(jax.__version__)


class UnsupportedJaxError(ImportError):
    """The installed JAX lacks the hijax API ``jaxslices.native`` is built on."""


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


_IMPORT_ERROR: BaseException | None = None

try:
    from jax.experimental import hijax as _hx

    HiType: Any = _hx.HiType
    VJPHiPrimitive: Any = _hx.VJPHiPrimitive
    register_hitype: Any = _hx.register_hitype
    aval_method: Any = _hx.aval_method
    aval_property: Any = _hx.aval_property
    ShapedArray: Any = _hx.ShapedArray
    Zero: Any = _hx.Zero
    if hasattr(_hx, "GradAccum"):  # JAX >= 0.11: public
        GradAccum: Any = _hx.GradAccum
    else:  # JAX 0.10.2: private
        from jax._src.interpreters.ad import GradAccum
    from jax._src import core as _core

    EMPTY_MAT: Any = getattr(_core, "empty_mat", None)
except (ImportError, AttributeError) as e:  # pragma: no cover - other JAX versions
    _IMPORT_ERROR = e


def require() -> None:
    """Raise :class:`UnsupportedJaxError` unless this JAX is known to work."""
    lo, hi = SUPPORTED_RANGE
    problem = None
    if _IMPORT_ERROR is not None:
        problem = f"its hijax API could not be imported ({_IMPORT_ERROR!r})"
    elif not lo <= JAX_VERSION < hi:
        problem = "this version has not been tested with it"
    if problem is not None:
        raise UnsupportedJaxError(
            f"jaxslices.native needs JAX >= {_fmt(lo)} and < {_fmt(hi)} (it is "
            f"built on the experimental jax.experimental.hijax API); JAX "
            f"{jax.__version__} is installed and {problem}. Use the default "
            "backend instead: jaxslices.value_and_grad / jaxslices.grad with "
            "jaxslices.embedding_lookup work on every supported JAX."
        )


def is_grad_accum(x: Any) -> bool:
    return isinstance(x, GradAccum)


def remat_error_hook(error: type[Exception], message: str) -> Any:
    """A ``VJPHiPrimitive.remat`` method that raises ``error(message)``.

    Its first argument is a checkpoint policy (JAX 0.10.2) or a trace (0.11);
    both are taken positionally and ignored.
    """

    def remat(self: Any, _policy_or_trace: Any, *args: Any) -> Any:
        raise error(message)

    return remat
