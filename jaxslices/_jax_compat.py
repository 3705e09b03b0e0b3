"""Internal: every private or version-dependent JAX name jaxslices uses.

jaxslices supports JAX 0.10.2 and newer; it is tested on 0.10.2 (the oldest,
on Python 3.11) and on the 0.12 line (the newest tested, 0.12.1 on Python
3.12): CI runs the whole suite on both. :data:`NEWEST_TESTED` is the one
place that says which JAX is the newest tested (``.ci/run`` reads it; JAX has
no upper bound in ``pyproject.toml``, so that installing jaxslices never
downgrades a newer JAX). Everything else in the default path (the tape backend of
:func:`jaxslices.value_and_grad`, the typed indices, the sharding helpers) uses
public JAX only. The names that are private to JAX (``jax._src``, attributes of
JAX's internal objects) or that moved between releases are reached through
this module alone, one *entry* each. An entry is

* resolved once, at import, without starting JAX's platform runtime (so
  that ``jax.distributed.initialize`` can still run after ``import jaxslices``);
  ``pallas_gpu`` at its first read instead (``AVAILABLE["pallas_gpu"]``,
  ``pallas``, ``pallas_triton``: Pallas and its Triton backend are imported
  when a GPU lowering needs them, never by ``import jaxslices``);
* switched by its flag in :data:`AVAILABLE` (``False`` where the names are
  missing), which every function below reads at call time. That flag is the
  one switch tests use to take an entry away
  (``monkeypatch.setitem(_jax_compat.AVAILABLE, "vmap_internals", False)``);
* served by functions whose fallback is correct, if slower. A question an
  entry cannot answer is never answered by a guess: an unknown varying-axes
  type or mesh layout sends the table to JAX's own dense gradient, or leaves
  the layout to XLA, never "no axes".

The one version parse of the package is :data:`JAX_VERSION`
(:func:`parse_version`); the version gates below and the opt-in native backend's
gate (``jaxslices/native/_hijax.py``, which keeps its experimental hijax names there,
as the separate opt-in unit) read it. On a JAX newer than the newest tested
line (from :data:`UNTESTED_FROM`), ``import jaxslices`` warns once
(:class:`UntestedJaxWarning`, naming the tested range), the default path keeps
working on the entries' structural checks, and the two version-gated pieces
take their conservative side (the key-array messages are not installed,
``jaxslices.native`` refuses to import with an error naming the default
backend). Raising :data:`NEWEST_TESTED` moves all three.

Public JAX names the package uses directly, because they are stable over the
supported range, are not entries: ``jax.typeof`` (JAX >= 0.6),
``jax.extend.random.define_prng_impl``, ``jax.random.wrap_key_data``,
``jax.custom_batching.custom_vmap``, ``jax.core.Tracer``,
``jax.make_user_context`` (the native kernels' switch, ``kernels/_path.py``).

The inventory below (:data:`ENTRIES`, rendered by :func:`inventory_table`) is
copied into docs/design.md ("JAX compatibility"); a test checks they agree.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "AVAILABLE",
    "ENTRIES",
    "JAX_VERSION",
    "KEY_ARRAY_CLASS_VERSIONS",
    "NEWEST_TESTED",
    "OLDEST_TESTED",
    "UNTESTED_FROM",
    "UntestedJaxWarning",
    "abstract_mesh",
    "all_gather_invariant",
    "axis_kinds",
    "callback_loggers",
    "current_trace",
    "inventory_table",
    "manual_axes",
    "parse_version",
    "patch_key_array_class",
    "pcast_varying",
    "register_key_impl_names",
    "shard_map",
    "trace_state",
    "varying_axes",
    "version_in",
    "warn_if_untested",
    "vmap_route",
    "wrap_key_full_rule",
    "Primitive",
    "mlir",
    "primitive_batchers",
    "primitive_jvps",
    "is_batched",
    "instantiate_zeros",
    "is_symbolic_zero",
    "lowering_is_per_device",
    "operands_varying",
    "native_out_aval",
    "pallas",  # noqa: F822 - served by __getattr__, imported on first use
    "pallas_triton",  # noqa: F822
    "gpu_target",
    "TRITON_DEPRECATION",
]

# ------------------------------------------------------------------ versions

OLDEST_TESTED = "0.10.2"  # Python 3.11, CI leg 1 (pyproject's lower bound)
# The newest JAX the suite passed on (CI leg 2, whose check reads this line):
# its whole line (0.12.x) counts as tested.
NEWEST_TESTED = "0.12.1"  # Python 3.12, CI leg 2 (0.12.0.1 before it)


def parse_version(text: str) -> tuple[int, int, int]:
    """The first three numbers of a version string (missing ones are 0).

    A string that does not start with a number gives ``(0, 0, 0)``, which is
    outside every version gate (the conservative side).

    Example:
      >>> parse_version("0.12.0.1"), parse_version("0.13.0.dev20260101")
      ((0, 12, 0), (0, 13, 0))
      >>> parse_version("0.13"), parse_version("unknown")
      ((0, 13, 0), (0, 0, 0))
    """
    m = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text.strip())
    if m is None:
        return (0, 0, 0)
    return (int(m[1]), int(m[2] or 0), int(m[3] or 0))


#: The installed JAX, as ``(major, minor, patch)``: the package's one parse.
JAX_VERSION: tuple[int, int, int] = parse_version(jax.__version__)


#: The first JAX line not tested: the minor release after :data:`NEWEST_TESTED`.
UNTESTED_FROM: tuple[int, int, int] = (
    parse_version(NEWEST_TESTED)[0],
    parse_version(NEWEST_TESTED)[1] + 1,
    0,
)


class UntestedJaxWarning(UserWarning):
    """The installed JAX is newer than the newest line jaxslices was tested on."""


_warned_untested = False


def warn_if_untested() -> bool:
    """Warn once per process if JAX is at or past :data:`UNTESTED_FROM`.

    Called when jaxslices is imported. Returns whether it warned now.
    """
    global _warned_untested
    if _warned_untested or JAX_VERSION < UNTESTED_FROM:
        return False
    _warned_untested = True
    below = ".".join(map(str, UNTESTED_FROM[:2]))
    newest = ".".join(map(str, parse_version(NEWEST_TESTED)[:2]))
    warnings.warn(
        f"jaxslices is tested with JAX {OLDEST_TESTED} to {newest}.x (newest "
        f"tested: {NEWEST_TESTED}); JAX {jax.__version__} is installed, a newer "
        "line that has not been tested. The default path should work (it "
        "reaches JAX's private names through checked entries whose fallbacks "
        'stay correct: docs/design.md, "JAX compatibility"); jaxslices.native '
        "will not import. If something fails, install a tested JAX "
        f'(pip install "jax<{below}", with your platform\'s extra) and report '
        "it. This warning is shown once.",
        UntestedJaxWarning,
        stacklevel=2,
    )
    return True


def version_in(lo: tuple[int, ...], hi: tuple[int, ...]) -> bool:
    """``lo <= JAX_VERSION < hi`` (read at call time).

    Example:
      >>> version_in((0, 0, 0), (99, 0, 0))
      True
    """
    return tuple(lo) <= JAX_VERSION < tuple(hi)


# ----------------------------------------------------------------- inventory


class Entry(NamedTuple):
    """One row of the inventory."""

    name: str  # the key in AVAILABLE
    jax_names: str
    why: str
    versions: str
    fallback: str
    breaks: str


ENTRIES: tuple[Entry, ...] = (
    Entry(
        "trace_state",
        "`jax.extend.core.get_opaque_trace_state` (else "
        "`jax._src.core.get_opaque_trace_state`)",
        "the tape tells a lookup at the loss's top level from one in a nested "
        "trace (`scan`, `cond`, inner `jit`, `vmap`)",
        "0.10.2, 0.12.0.1",
        "a token that never matches: every lookup asks `vmap_internals` whether "
        "it is at the top (zero traces in between); without both, dense",
        "nothing while `vmap_internals` is there; with neither, every table "
        "gets JAX's dense gradient",
    ),
    Entry(
        "vmap_internals",
        "`jax._src.core.trace_ctx.trace`, `jax._src.interpreters.batching."
        "BatchTrace` (`parent_trace`, `tag`), `BatchTracer._trace`",
        "a lookup below the top level stays sparse when only `jax.vmap`s lie "
        "in between (Equinox-style per-example code, nested `vmap`s)",
        "0.10.2, 0.12.0.1",
        "such lookups take JAX's dense gradient",
        "sparse gradients under `vmap` (they are dense, correct)",
    ),
    Entry(
        "varying_axes",
        "`jax.typeof(x).mat.varying` (JAX >= 0.10, also `.manual_axis_type`; "
        "`.vma` on 0.7 to 0.9)",
        "inside `shard_map(check_vma=True)` a tap must vary over the mesh axes "
        "its ids vary over and its table does not, or JAX sums row gradients "
        "of different ids over devices",
        "0.10.2, 0.12.0.1",
        "unknown type layout: that table takes JAX's dense gradient (summed "
        'over devices by JAX), never "no axes"',
        "sparse gradients of all tables (dense, correct)",
    ),
    Entry(
        "pcast_varying",
        '`jax.lax.pcast(x, axes, to="varying")` (JAX >= 0.8; `jax.lax.pvary` before)',
        "makes a tap varying over those axes",
        "0.10.2, 0.12.0.1",
        "tables whose ids vary over mesh axes take JAX's dense gradient",
        "sparse gradients inside `shard_map` with sharded ids (dense, correct)",
    ),
    Entry(
        "all_gather_invariant",
        '`jax.lax.all_gather(..., to="invarying")`',
        "gathers slices over devices into a value `shard_map` knows is the "
        "same on every device (the tape's cross-device gradient, the "
        "`all_to_all` update's table replicas)",
        "0.10.2, 0.12.0.1",
        "the same gather as a `psum` of each device's block in a zero buffer "
        "(invariant by construction, exact; an all-reduce of devices x N rows "
        "instead of an all-gather)",
        "nothing (slower communication)",
    ),
    Entry(
        "abstract_mesh",
        "`jax.typeof(x).sharding.mesh` (the abstract mesh under `jit`)",
        "`replicate_rows` asks for the slices' rows on every device before a "
        "scatter; `all_to_all` routing finds the mesh when `mesh=` is not given",
        "0.10.2, 0.12.0.1",
        "no mesh: no sharding constraint (XLA then all-reduces the V x D table "
        "of an SGD step: slower, correct); `all_to_all` without `mesh=` asks "
        "for `mesh=`",
        "O(batch) communication under data-parallel `jit`",
    ),
    Entry(
        "axis_types",
        "`mesh.axis_types` (`jax.sharding.AxisType`: Auto, Explicit, Manual)",
        "no sharding constraint inside `shard_map` (Manual axes) or on Explicit axes",
        "0.10.2, 0.12.0.1",
        "unknown kinds: no constraint (as `abstract_mesh`)",
        "O(batch) communication under data-parallel `jit`",
    ),
    Entry(
        "shard_map",
        "`jax.shard_map` (JAX >= 0.7)",
        "`all_to_all` routing (`sharded_lookup`, `sharded_update`)",
        "0.10.2, 0.12.0.1",
        "`jax.experimental.shard_map.shard_map` (deprecated since 0.8, its "
        "warning silenced); with neither, a `RuntimeError` naming "
        '`routing="masked"`',
        "with neither: `all_to_all` routing (`masked` works)",
    ),
    Entry(
        "key_array_class",
        "the class of an eager typed-indices array (JAX's private "
        "`PRNGKeyArray`): its abstract methods and `__array__`, patched",
        "eager misuse of `IndexedSlices` indices (`.real`, `.astype`, `.sum`, "
        "`np.asarray`, ...) raises a `TypeError` naming the jaxslices fix",
        "0.10.2, 0.12.0.1 (0.5.3 to 0.11 when written); patched for "
        "0.5.3 <= JAX < 0.13 only",
        "JAX's own `NotImplementedError`/`TypeError` (still an error, never a "
        "number; under `jit` JAX's error names the fix anyway)",
        "the jaxslices wording of eager errors",
    ),
    Entry(
        "key_impl_names",
        "JAX's registry of named PRNG implementations (`prngs` in the module "
        "of a key dtype's implementation, `jax._src.random.prng` today) and "
        "`dtype._impl`",
        "checkpointers (Orbax) save a key array as its words plus "
        "`str(jax.random.key_impl(x))` and rebuild it with "
        "`jax.random.wrap_key_data(words, impl=that_name)`: the typed indices' "
        "two implementations are added under their names, so that restoring "
        "an `IndexedSlices` works",
        "0.10.2, 0.12.0.1",
        "none that restores: Orbax saves typed indices and cannot restore "
        "them (`tests/lib/test_checkpoint.py` fails); Flax msgpack and pickle do "
        "not use it",
        "Orbax checkpoints of trees holding `IndexedSlices` (`MultiSteps` states)",
    ),
    Entry(
        "key_full_rule",
        "a key dtype's fill rule `dtype._rules.full(shape, fill_value, dtype)` "
        "(JAX's `KeyTyRules.full`, a staticmethod), wrapped",
        "`jnp.ones_like`, `full_like`, `zeros_like` and `lax.full` of typed "
        "indices broadcast the fill value into the ids: the wrapper raises for "
        "a non-zero fill and gives id -1 (no row) for a zero fill, typed "
        "indices only",
        "0.10.2, 0.12.0.1",
        "none: such fills give wrong ids silently, as before (the tests fail "
        "on such a JAX)",
        "the error for `jax.tree.map(jnp.ones_like, grads)`; `zeros_like` "
        "touching no row",
    ),
    Entry(
        "manual_axes",
        "`jax.sharding.get_abstract_mesh()` and its `axis_types` and `shape`",
        "a run-time check (`_errors.raise_if`) inside `shard_map` makes its "
        "predicate the same on every device with a `psum` over the manual "
        "axes, so that every device raises, none waits in a collective",
        "0.10.2, 0.12.0.1",
        "no manual axes known: each device decides on its own values (a check "
        "failing on one device only can leave the others waiting, as before)",
        "raising on every device inside `shard_map` (a hang instead of an "
        "error when one device fails)",
    ),
    Entry(
        "ffi_primitive",
        "`jax.extend.core.Primitive`, `jax.interpreters.mlir` (`register_lowering`, "
        "`lower_fun`), `jax.interpreters.batching.primitive_batchers`, "
        "`jax.interpreters.ad` (`primitive_jvps`, `instantiate_zeros`, `Zero`), "
        "`jax.ffi.ffi_lowering`",
        "the native CPU kernels are primitives: a custom call on one CPU device, "
        "their XLA reference elsewhere, under `vmap` and under differentiation",
        "0.10.2, 0.12.0.1",
        "no native path: every step runs on XLA (correct, slower on CPU)",
        "the native CPU kernels",
    ),
    Entry(
        "lowering_context",
        "`ctx.module_context.axis_context` of a lowering rule and "
        "`jax._src.sharding_impls` (`ShardingContext.num_devices`, "
        "`SPMDAxisContext.manual_axes`)",
        "a native kernel runs where each device computes on its own data: one "
        "device, or inside `shard_map` with every mesh axis manual; a step "
        "partitioned by `jit` over several devices lowers the XLA reference",
        "0.10.2, 0.12.0.1",
        "the XLA reference everywhere (never a kernel on a partitioned step)",
        "the native CPU kernels",
    ),
    Entry(
        "manual_axis_avals",
        "`jax._src.core` (`ShapedArray(..., sharding=, manual_axis_type=)`, "
        "`ManualAxisType`, `get_cur_mesh_sharding`), an aval's `.mat.varying`",
        "inside `shard_map(check_vma=True)` the outputs of a native op vary "
        "over the mesh axes its operands vary over",
        "0.10.2, 0.12.0.1",
        "operands that vary over mesh axes: the XLA path (decided at trace time)",
        "native kernels inside `shard_map` with device-varying operands",
    ),
    Entry(
        "callback_logs",
        "the `logger` of `jax._src.callback` and of `jax._src.debugging` (their "
        '`"jax.pure_callback failed"` / `"jax.debug.callback failed"` records)',
        "a failed run-time check (`_errors.raise_if`) is logged by JAX with its "
        "whole traceback, once per device, before JAX raises: a filter makes "
        "the records of jaxslices' checks one line that starts with the "
        "message, once per failure",
        "0.10.2, 0.12.0.1",
        "no filter: JAX's own log stays (a traceback per device, the message "
        "at its end); the error raised is the same",
        "the one-line log of a failed check",
    ),
    Entry(
        "pallas_gpu",
        "`jax.experimental.pallas` (`pallas_call`, `program_id`, `when`, `ds`), "
        "`jax.experimental.pallas.triton.CompilerParams` (the Triton backend, "
        "deprecated on the 0.12 line: its `DeprecationWarning` is filtered while "
        "a kernel lowers); `jax.sharding.AbstractDevice` and `use_abstract_mesh` "
        "(JAX >= 0.12: a GPU to lower for on a host without one)",
        "the opt-in Pallas GPU kernels (`kernels/_pallas.py`): the lowering of "
        "the native ops for `cuda` and `rocm`",
        "0.10.2, 0.12.0.1",
        "no GPU kernels: the ops lower to their XLA reference on a GPU, and "
        "`kernels.gpu_kernels()` steps say so in `explain`",
        "the opt-in GPU path (the XLA path is the default on a GPU)",
    ),
)

_HEADER = ("entry", "JAX names", "why", "versions checked", "fallback", "breaks")


def inventory_table() -> str:
    """The inventory as a Markdown table (also in docs/design.md).

    Example:
      >>> inventory_table().splitlines()[0]
      '| entry | JAX names | why | versions checked | fallback | breaks |'
    """
    lines = ["| " + " | ".join(_HEADER) + " |", "|" + " --- |" * len(_HEADER)]
    for e in ENTRIES:
        lines.append(f"| `{e.name}` | " + " | ".join(e[1:]) + " |")
    return "\n".join(lines) + "\n"


__doc__ = (__doc__ or "") + "\nInventory:\n\n" + inventory_table()

# ---------------------------------------------------- resolution, at import

try:  # public in jax.extend since JAX 0.4.36 (stackless tracing)
    from jax.extend.core import get_opaque_trace_state as _opaque_trace_state
except ImportError:  # pragma: no cover - other layouts
    try:
        from jax._src.core import get_opaque_trace_state as _opaque_trace_state
    except ImportError:
        _opaque_trace_state = None

try:
    from jax._src import core as _core
    from jax._src.interpreters import batching as _batching

    _BatchTrace = _batching.BatchTrace
    _BatchTracer = _batching.BatchTracer
    _VMAP_OK = hasattr(_core, "trace_ctx") and hasattr(_BatchTracer, "_trace")
except Exception:  # pragma: no cover - a JAX without these internals
    _VMAP_OK = False


def _has_to_argument(f: Any) -> bool:
    try:
        return "to" in inspect.signature(f).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def _experimental_shard_map() -> Any | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.shard_map import shard_map as f
    except (ImportError, AttributeError):  # pragma: no cover - removed
        return None
    return f


try:  # the native kernels' primitives (semi-public JAX: jax.interpreters)
    from jax.extend.core import Primitive
    from jax.interpreters import ad as _ad
    from jax.interpreters import mlir
    from jax.interpreters.batching import primitive_batchers

    primitive_jvps = _ad.primitive_jvps
    _FFI_OK = all(
        hasattr(m, n)
        for m, n in [
            (mlir, "register_lowering"),
            (mlir, "lower_fun"),
            (_ad, "instantiate_zeros"),
            (_ad, "Zero"),
            (jax.ffi, "ffi_lowering"),
        ]
    )
except Exception:  # pragma: no cover - a JAX without these
    Primitive = mlir = primitive_batchers = primitive_jvps = None
    _FFI_OK = False

try:
    from jax._src import sharding_impls as _sharding_impls

    _CTX_OK = hasattr(_sharding_impls, "ShardingContext") and hasattr(
        _sharding_impls, "SPMDAxisContext"
    )
except Exception:  # pragma: no cover
    _CTX_OK = False

_MAT_OK = (
    all(
        hasattr(_core, n)
        for n in ("ManualAxisType", "get_cur_mesh_sharding", "ShapedArray")
    )
    if _VMAP_OK
    else False
)


# The opt-in Pallas GPU kernels (kernels/_pallas.py). Pallas and its Triton
# backend are about 120 modules: imported when a GPU lowering first reads
# them (`pallas`, `pallas_triton`, `AVAILABLE["pallas_gpu"]`), never by
# `import jaxslices`. At import, only whether the package is there.
_PALLAS_FOUND = importlib.util.find_spec("jax.experimental.pallas") is not None
_PALLAS: dict[str, Any] = {}


def _import_pallas() -> bool:
    """Import Pallas and its Triton backend (once); ``True`` if the entry's
    names are there."""
    if not _PALLAS:
        try:
            from jax.experimental import pallas
            from jax.experimental.pallas import triton as pallas_triton

            ok = all(
                hasattr(pallas, n) for n in ("pallas_call", "program_id", "when", "ds")
            ) and hasattr(pallas_triton, "CompilerParams")
        except Exception:  # pragma: no cover - a JAX without Pallas
            pallas = pallas_triton = None
            ok = False
        _PALLAS.update(pallas=pallas, pallas_triton=pallas_triton, ok=ok)
    return _PALLAS["ok"]


def __getattr__(name: str) -> Any:
    """``pallas`` and ``pallas_triton``, imported on first use (or ``None``)."""
    if name in ("pallas", "pallas_triton"):
        _import_pallas()
        return _PALLAS[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The Triton backend's deprecation (JAX 0.12), filtered while a kernel lowers.
TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"


def _module_logger(module: str) -> logging.Logger | None:
    logger = getattr(sys.modules.get(module), "logger", None)
    return logger if isinstance(logger, logging.Logger) else None


# The modules are imported by `import jax`; each logs its callbacks' failures.
_CALLBACK_LOGGERS = tuple(
    _module_logger(m) for m in ("jax._src.callback", "jax._src.debugging")
)


class _Flags(dict):
    """:data:`AVAILABLE`: a dict whose lazy entries are checked when first read.

    A lazy entry (``pallas_gpu``: its check imports Pallas) holds whether its
    package is installed until it is read (``flags[name]``); the first read
    runs its check, and a write (``monkeypatch.setitem``) replaces both.
    """

    def __init__(self, flags: dict[str, bool], lazy: dict[str, Callable[[], bool]]):
        super().__init__(flags)
        self._lazy = dict(lazy)

    def __getitem__(self, name: str) -> bool:
        check = self._lazy.pop(name, None)
        if check is not None:
            dict.__setitem__(self, name, dict.__getitem__(self, name) and check())
        return dict.__getitem__(self, name)

    def __setitem__(self, name: str, value: bool) -> None:
        self._lazy.pop(name, None)
        dict.__setitem__(self, name, value)


#: Whether each entry's JAX names are there. Read at call time; tests switch
#: an entry off with ``monkeypatch.setitem(AVAILABLE, name, False)``.
AVAILABLE: dict[str, bool] = _Flags(
    {
        "trace_state": _opaque_trace_state is not None,
        "vmap_internals": _VMAP_OK,
        "varying_axes": hasattr(jax, "typeof"),
        "pcast_varying": hasattr(jax.lax, "pcast") or hasattr(jax.lax, "pvary"),
        "all_gather_invariant": _has_to_argument(jax.lax.all_gather),
        "abstract_mesh": hasattr(jax, "typeof"),
        "axis_types": hasattr(jax.sharding, "AxisType"),
        "shard_map": hasattr(jax, "shard_map"),
        "key_array_class": True,  # structural checks in patch_key_array_class
        "key_impl_names": True,  # structural checks in register_key_impl_names
        "key_full_rule": True,  # structural checks in wrap_key_full_rule
        "manual_axes": hasattr(jax.sharding, "get_abstract_mesh"),
        "ffi_primitive": _FFI_OK,
        "lowering_context": _CTX_OK,
        "manual_axis_avals": _MAT_OK,
        "callback_logs": all(logger is not None for logger in _CALLBACK_LOGGERS),
        "pallas_gpu": _PALLAS_FOUND,
    },
    lazy={"pallas_gpu": _import_pallas},
)

assert set(AVAILABLE) == {e.name for e in ENTRIES}

# ---------------------------------------------------------------- tracing


class _NoTraceState:
    """Stands for an unknown trace state: equal to nothing, itself included."""

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]


def trace_state() -> Any:
    """An opaque token for the current trace, comparable with ``==``.

    Entry ``trace_state``. Unavailable: a token equal to nothing, so no
    lookup is taken to be at the top level on its word alone (the tape then
    asks :func:`vmap_route`, which needs no token).
    """
    if AVAILABLE["trace_state"]:
        return _opaque_trace_state(convention="jaxslices")
    return _NoTraceState()


def current_trace() -> Any:
    """The current trace object (entry ``vmap_internals``; else ``None``)."""
    return _core.trace_ctx.trace if AVAILABLE["vmap_internals"] else None


def vmap_route(top: Any, ids: Any) -> bool | None:
    """How the current trace reaches ``top`` (entry ``vmap_internals``).

    Returns ``None`` unless every trace between the current one and ``top`` is
    a ``jax.vmap`` (``BatchTrace``), or if the internals are unavailable;
    otherwise whether ``ids`` is batched by one of those ``vmap``\\ s
    (``False``: the ids are the same for every batch element, so operations
    on them run at ``top`` itself; also ``False`` at ``top``, with no trace in
    between).
    """
    if not AVAILABLE["vmap_internals"] or top is None:
        return None
    tags = []
    trace = _core.trace_ctx.trace
    while trace is not top:
        if not isinstance(trace, _BatchTrace) or not hasattr(trace, "parent_trace"):
            return None
        tags.append(trace.tag)
        trace = trace.parent_trace
    return isinstance(ids, _BatchTracer) and any(ids._trace.tag is t for t in tags)


# ------------------------------------------------------- manual mesh axes


def varying_axes(x: Any) -> frozenset | None:
    """The mesh axes ``x`` varies over inside ``shard_map`` (``None``: unknown).

    Entry ``varying_axes``. ``frozenset()`` outside ``shard_map`` and with
    ``check_vma=False``. ``None`` when the entry is unavailable or the type's
    layout is not one this module knows: callers must then not assume "no
    axes" (the tape gives that table JAX's dense gradient).

    Example:
      >>> import jax.numpy as jnp
      >>> varying_axes(jnp.zeros(2))
      frozenset()
    """
    if not AVAILABLE["varying_axes"]:
        return None
    try:
        aval = jax.typeof(x)
    except TypeError:
        return None
    # JAX >= 0.10: `mat` (what JAX's own messages tell users to read), also
    # stored as `manual_axis_type`.
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    if mat is not None:
        varying = getattr(mat, "varying", None)
        return None if varying is None else frozenset(varying)
    vma = getattr(aval, "vma", None)  # JAX 0.7 - 0.9
    return None if vma is None else frozenset(vma)


def pcast_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x`` typed as varying over ``axes`` (entry ``pcast_varying``).

    Only called when :data:`AVAILABLE` says so (the tape checks first).
    """
    if not AVAILABLE["pcast_varying"]:
        raise RuntimeError(  # pragma: no cover - callers check first
            "jaxslices internal error: pcast_varying used while unavailable."
        )
    if hasattr(jax.lax, "pcast"):  # JAX >= 0.8
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # pragma: no cover - JAX 0.6 - 0.7


def all_gather_invariant(x: Any, axes: tuple[str, ...]) -> Any:
    """Tiled all-gather (pytree) whose result ``shard_map`` knows is invariant.

    Entry ``all_gather_invariant``. Unavailable: each device writes its block
    at its position in a zero buffer and the buffers are ``psum``-ed: the same
    values exactly (one non-zero term per element), invariant by the type of
    ``psum``, with more communication.
    """
    if AVAILABLE["all_gather_invariant"]:
        return jax.tree.map(lambda a: _gather_invariant(a, axes), x)
    return jax.tree.map(lambda a: _gather_by_psum(a, axes), x)


def _gather_invariant(a: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    # JAX 0.12.1 gathers only what varies over the axes: an invariant leaf
    # (e.g. values made by jnp.ones beside varying ids) is cast first.
    varying = varying_axes(a)
    missing = () if varying is None else tuple(n for n in axes if n not in varying)
    if missing and AVAILABLE["pcast_varying"]:
        a = pcast_varying(a, missing)
    return jax.lax.all_gather(a, axes, axis=0, tiled=True, to="invarying")


def _gather_by_psum(a: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    size = 1
    for name in axes:
        size *= jax.lax.axis_size(name)
    n = a.shape[0]
    buf = jnp.zeros((size * n,) + a.shape[1:], a.dtype)
    start = jax.lax.axis_index(axes) * n
    return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(buf, a, start, 0), axes)


# ------------------------------------------------------------- device mesh


def abstract_mesh(x: Any) -> Any | None:
    """The mesh ``x`` is laid out on inside ``jit`` (``None``: unknown or none).

    Entry ``abstract_mesh``: ``jax.typeof(x).sharding.mesh``, the abstract
    mesh of the inputs' shardings, also for ``Auto`` axes whose specs it does
    not report.

    Example:
      >>> import jax.numpy as jnp
      >>> abstract_mesh(jnp.zeros(2)) is None  # not on a mesh
      True
    """
    if not AVAILABLE["abstract_mesh"]:
        return None
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        # A concrete array: its own sharding is the truth. (JAX 0.12 can give
        # an eager op's result the abstract mesh of an earlier call of the same
        # op on a mesh, e.g. ``a.at[0, 0].set(v)``, though it is on one device.)
        mesh = getattr(x.sharding, "mesh", None)  # NamedSharding only
        if mesh is None or mesh.size == 1:
            return None
        return getattr(mesh, "abstract_mesh", mesh)
    try:
        mesh = jax.typeof(x).sharding.mesh
    except (AttributeError, TypeError):
        return None
    if mesh is None or getattr(mesh, "empty", True):
        return None
    return mesh


def axis_kinds(mesh: Any) -> frozenset[str] | None:
    """Names of the mesh's axis types (``"Auto"``, ``"Explicit"``, ``"Manual"``).

    Entry ``axis_types``; ``None`` when unknown (callers then leave the
    layout to XLA).
    """
    if not AVAILABLE["axis_types"]:
        return None
    types = getattr(mesh, "axis_types", None)
    if types is None:
        return None
    return frozenset(str(t).rsplit(".", 1)[-1] for t in types)


def manual_axes() -> tuple[str, ...]:
    """The manual axes of more than one device here (inside ``shard_map``).

    Entry ``manual_axes``, in mesh order. ``()`` outside ``shard_map``, and
    when unavailable or the mesh's layout is unknown.

    Example:
      >>> manual_axes()
      ()
    """
    if not AVAILABLE["manual_axes"]:
        return ()
    try:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh is None or getattr(mesh, "empty", True):
            return ()
        kinds = getattr(mesh, "axis_types", None) or ()
        sizes = dict(mesh.shape)
        return tuple(
            name
            for name, kind in zip(mesh.axis_names, kinds, strict=False)
            if str(kind).rsplit(".", 1)[-1] == "Manual" and sizes.get(name, 1) > 1
        )
    except (AttributeError, TypeError):  # pragma: no cover - unknown layout
        return ()


def shard_map(f: Callable, mesh: Any, in_specs: Any, out_specs: Any) -> Callable:
    """``jax.shard_map`` (entry ``shard_map``), else its experimental ancestor."""
    if AVAILABLE["shard_map"]:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    legacy = _experimental_shard_map()
    if legacy is None:  # pragma: no cover - a JAX without either
        raise RuntimeError(
            f"jaxslices: routing='all_to_all' needs jax.shard_map, which JAX "
            f"{jax.__version__} does not have. Use routing='masked' (no "
            "shard_map needed), or a JAX between "
            f"{OLDEST_TESTED} and {NEWEST_TESTED}."
        )
    return legacy(f, mesh, in_specs=in_specs, out_specs=out_specs)


# ---------------------------------------------------------- callback logs


def callback_loggers() -> tuple[logging.Logger, ...]:
    """The loggers JAX writes a failed callback to (entry ``callback_logs``).

    ``()`` when the entry is unavailable: then nothing is filtered.
    """
    if not AVAILABLE["callback_logs"]:
        return ()
    return tuple(logger for logger in _CALLBACK_LOGGERS if logger is not None)


# -------------------------------------------------------- key-array class

#: JAX versions whose key-array class layout was checked (lo inclusive, hi
#: exclusive): the ``key_array_class`` patch is applied only there.
KEY_ARRAY_CLASS_VERSIONS = ((0, 5, 3), UNTESTED_FROM)


def patch_key_array_class(cls: type, wrap: Callable[[str, Any], Any]) -> bool:
    """Replace the eager abstract methods of JAX's key-array class ``cls``.

    Entry ``key_array_class``. ``cls`` is the class of a concrete (eager)
    key array; every method or property JAX declares abstract on it, and
    ``__array__``, is replaced by ``wrap(name, original)`` (a property's
    getter for a property). ``wrap`` must call ``original`` for every array
    that is not its business. Applied once per class; only for
    :data:`KEY_ARRAY_CLASS_VERSIONS`. Returns whether ``cls`` is patched
    (``False``: unavailable, untested JAX, or an unknown class layout; then
    JAX's own errors stay).
    """
    if not AVAILABLE["key_array_class"] or not version_in(*KEY_ARRAY_CLASS_VERSIONS):
        return False
    if getattr(cls, "_jaxslices_patched", False):
        return True
    try:
        names = []
        for name in dir(cls):
            attr = inspect.getattr_static(cls, name)
            fn = attr.fget if isinstance(attr, property) else attr
            if getattr(fn, "__isabstractmethod__", False):
                names.append(name)
        if not names or inspect.getattr_static(cls, "__array__", None) is None:
            return False  # not the layout this was written for
        for name in ["__array__", *names]:
            attr = inspect.getattr_static(cls, name)
            if isinstance(attr, property):
                setattr(cls, name, property(wrap(name, attr.fget)))
            elif callable(attr):
                setattr(cls, name, wrap(name, attr))
        cls._jaxslices_patched = True
        return True
    except Exception:  # noqa: BLE001 - never break jaxslices over a message
        return False


# ------------------------------------------------- key dtypes: names, fills


def register_key_impl_names(names: dict[Any, str], tag: str) -> bool:
    """Add key implementations to JAX's registry of named PRNGs.

    Entry ``key_impl_names``. ``names`` maps key dtypes to their
    implementation's name; ``tag`` is the implementations' tag, which marks a
    registry entry as one of ours (replaced after a module reload). Returns
    whether ``jax.random.wrap_key_data(..., impl=name)`` now gives each dtype
    back (``False``: unavailable, or an unknown layout).
    """
    import sys

    if not AVAILABLE["key_impl_names"]:
        return False
    try:
        for dtype, name in names.items():
            impl = getattr(dtype, "_impl", None)
            registry = getattr(sys.modules.get(type(impl).__module__), "prngs", None)
            if impl is None or impl.name != name or not isinstance(registry, dict):
                return False
            known = registry.get(name)
            if known is not None and getattr(known, "tag", None) != tag:
                return False  # the name is taken by something else
            registry[name] = impl
            words = impl.key_shape[0]
            probe = jax.eval_shape(
                lambda n=name, w=words: jax.random.wrap_key_data(
                    jnp.zeros((0, w), jnp.uint32), impl=n
                )
            )
            if probe.dtype != dtype:
                return False
        return True
    except Exception:  # noqa: BLE001 - never break `import jaxslices`
        return False


def wrap_key_full_rule(dtypes: tuple[Any, ...], wrap: Callable) -> bool:
    """Wrap the fill rule that ``lax.full`` / ``full_like`` use for key dtypes.

    Entry ``key_full_rule``. ``dtypes`` share one rules class;
    ``wrap(jax_full)`` returns the new ``full(shape, fill_value, dtype)``, which
    must call ``jax_full`` for every dtype not in ``dtypes`` and whenever
    ``AVAILABLE["key_full_rule"]`` is false (read at call time). Applied once.
    Returns whether the rule is wrapped.
    """
    if not AVAILABLE["key_full_rule"]:
        return False
    try:
        rules = dtypes[0]._rules
        if any(d._rules is not rules for d in dtypes):
            return False
        original = inspect.getattr_static(rules, "full", None)
        if getattr(getattr(original, "__func__", None), "_jaxslices", False):
            return True
        if not isinstance(original, staticmethod):
            return False
        params = list(inspect.signature(original.__func__).parameters)
        if params != ["shape", "fill_value", "dtype"]:
            return False
        full = wrap(original.__func__)
        full._jaxslices = True
        rules.full = staticmethod(full)
        return True
    except Exception:  # noqa: BLE001 - never break `import jaxslices`
        return False


# ------------------------------------------------------ native primitives


def is_batched(x: Any) -> bool:
    """Whether ``x`` is being batched by ``jax.vmap`` (entry ``vmap_internals``).

    Unknown (entry unavailable): ``False``; a batched operand of a native op
    then reaches its batching rule, which runs the XLA reference (correct).
    """
    return AVAILABLE["vmap_internals"] and isinstance(x, _BatchTracer)


def instantiate_zeros(t: Any) -> Any:
    """A JVP tangent with symbolic zeros made arrays (entry ``ffi_primitive``)."""
    return _ad.instantiate_zeros(t)


def is_symbolic_zero(t: Any) -> bool:
    """Whether a JVP tangent is a symbolic zero (entry ``ffi_primitive``)."""
    return isinstance(t, _ad.Zero)


def lowering_is_per_device(ctx: Any) -> bool:
    """Whether a lowering rule emits code that runs on one device's own data.

    Entry ``lowering_context``: ``True`` for a computation on one device and
    inside ``shard_map`` with every mesh axis manual; ``False`` for a ``jit``
    partitioned over several devices (XLA's partitioner would treat a custom
    call as replicated and gather its operands whole), for partly manual
    meshes, and whenever the context is unknown.
    """
    if not AVAILABLE["lowering_context"]:
        return False
    ac = getattr(getattr(ctx, "module_context", None), "axis_context", None)
    if isinstance(ac, _sharding_impls.ShardingContext):
        return ac.num_devices == 1
    if isinstance(ac, _sharding_impls.SPMDAxisContext):
        names = frozenset(getattr(ac.mesh, "axis_names", ()))
        return bool(names) and frozenset(ac.manual_axes) == names
    return False


def operands_varying(avals: Any) -> frozenset | None:
    """The mesh axes any of ``avals`` varies over (``None``: unknown)."""
    out: frozenset = frozenset()
    for a in avals:
        mat = getattr(a, "mat", None) or getattr(a, "manual_axis_type", None)
        if mat is None:
            continue
        varying = getattr(mat, "varying", None)
        if varying is None:
            return None
        out |= frozenset(varying)
    return out


def native_out_aval(shape: tuple[int, ...], dtype: Any, avals_in: Any) -> Any:
    """An output aval of a native op: varying where its operands vary.

    Entry ``manual_axis_avals``. Outside ``shard_map`` (or with
    ``check_vma=False``): a plain ``ShapedArray``.
    """
    varying = operands_varying(avals_in)
    if not varying:
        return jax.core.ShapedArray(shape, dtype)
    if not AVAILABLE["manual_axis_avals"]:
        raise TypeError(
            "jaxslices: a native op inside shard_map with device-varying "
            "operands needs JAX's manual-axis types, which this JAX lacks."
        )
    from jax.sharding import PartitionSpec

    sharding = _core.get_cur_mesh_sharding(PartitionSpec(*([None] * len(shape))))
    mat = _core.ManualAxisType(varying=varying)
    return _core.ShapedArray(shape, dtype, sharding=sharding, manual_axis_type=mat)


# ------------------------------------------------------------ Pallas GPU


def gpu_target(device_kind: str = "NVIDIA H200") -> Any:
    """A context in which the Pallas GPU kernels lower on a host without a GPU.

    Entry ``pallas_gpu``. On JAX 0.12, Pallas asks the GPU it lowers a
    kernel for (its compute capability); on a host without one (a CPU
    machine exporting a step for ``cuda`` with :func:`jax.export.export`
    inside :func:`jaxslices.kernels.gpu_kernels`) this names it: an
    abstract device of ``device_kind`` (``jax.sharding.AbstractDevice`` on a
    one-device ``AbstractMesh``, set by ``jax.sharding.use_abstract_mesh``).
    JAX 0.10's Pallas lowers without one (for compute capability 9.0) and
    does not read it; without Pallas it does nothing. Served as
    ``jaxslices.kernels.gpu_target``.

    Args:
      device_kind: the GPU, as JAX names its device kind (``"NVIDIA H100"``).

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices
      >>> with jaxslices.kernels.gpu_target("NVIDIA H100"):
      ...     y = jax.jit(lambda x: x + 1)(jnp.ones(2))
    """
    import contextlib

    sharding = jax.sharding
    if not AVAILABLE["pallas_gpu"] or not all(
        hasattr(sharding, n) for n in ("AbstractDevice", "use_abstract_mesh")
    ):
        return contextlib.nullcontext()
    device = sharding.AbstractDevice(
        device_kind=device_kind, num_cores=None, platform="gpu"
    )
    mesh = sharding.AbstractMesh(
        (1,), ("_gpu",), (sharding.AxisType.Auto,), abstract_device=device
    )
    return sharding.use_abstract_mesh(mesh)


# ------------------------------------------------------------------- import

warn_if_untested()
