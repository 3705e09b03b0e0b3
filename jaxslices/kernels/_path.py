"""Path choice: does an operation run its native kernel or the XLA path, and why.

Every jaxslices operation with a kernel asks :func:`decide` when it is
traced (the kernels are on and load, the platform is the CPU, or a GPU
inside :func:`gpu_kernels` with rows of a power-of-two width, float32
arrays (a table and its gradient may also be bfloat16 or float16 on the
CPU), not under ``jax.vmap``, not laid out over a mesh by ``jit``): through
:func:`route` where its caller runs the XLA path itself (the row-wise
rules), or by passing the reason to its primitive, bound in every case,
whose lowering picks the kernel or the reference (the forward bag, the
apply, the managed-collision remap's ops). An operation
that takes the XLA path by itself records why with :func:`note`. Each
decision is in the traced jaxpr (a marker primitive that computes nothing,
or the op's own equation), so that :func:`jaxslices.kernels.explain` reads
the decisions of the step as JAX traced it (also of a trace JAX had
cached). A native kernel that reads a
sparse gradient's ``[N, D]`` values instead of its pooled form records that
too (:func:`note_materialised`).

**The switch is part of JAX's cache keys.** :func:`disabled` sets a JAX
*user context* (:func:`jax.make_user_context`: a value that ``jax.jit``'s
tracing, lowering and compilation caches key on), so a function traced with
the kernels on is traced again inside ``disabled()``, and the other way
round: a step called, lowered or explained inside ``disabled()`` takes the
XLA path whether or not JAX traced it before, and outside it the native path.
``JAXSLICES_NATIVE=0`` is read when a step is traced; it is meant for a whole
process (set it before the process starts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat
from . import _build, _pallas

__all__ = [
    "Decision",
    "decide",
    "disabled",
    "dtype_reason",
    "gpu_kernels",
    "note",
    "note_materialised",
    "route",
    "TABLE_DTYPES",
]

# ------------------------------------------------------------ the switch

# Keyed on by jax.jit's caches (trace, lowering, compilation): a new value
# means a new trace. Made once, at import (making one is not thread-safe).
_NATIVE_ON = jax.make_user_context(True)


def _enabled() -> bool:
    return bool(_NATIVE_ON.value) and _build.enabled_by_env()


@contextmanager
def disabled() -> Iterator[None]:
    """Run with the native kernels off (this thread): the XLA path.

    The switch is part of what ``jax.jit`` caches on: a step called (or
    lowered, or passed to :func:`jaxslices.kernels.explain`) inside
    ``disabled()`` is traced on the XLA path, also when JAX traced it with
    the kernels on before, and a step called outside it runs the native path
    again (each path traced and compiled once). ``JAXSLICES_NATIVE=0`` in
    the environment turns the kernels off for a whole process.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices
      >>> bag = jax.jit(jaxslices.embedding_bag)
      >>> table, ids = jnp.ones((4, 2)), jnp.array([[1, 2]])
      >>> native = bag(table, ids)  # the native kernel, where it loads
      >>> with jaxslices.kernels.disabled():
      ...     xla = bag(table, ids)  # traced again: the XLA path
    """
    with _NATIVE_ON(False):
        yield


# The Pallas GPU kernels' opt-in (kernels/_pallas.py): off by default until
# measured on a GPU; keyed on by jit's caches like the switch above.
_GPU_ON = jax.make_user_context(False)


def _gpu_enabled() -> bool:
    """The GPU kernels are opted in (and the native kernels not disabled)."""
    return bool(_GPU_ON.value) and _enabled()


@contextmanager
def gpu_kernels() -> Iterator[None]:
    """Run the Pallas GPU kernels on a GPU (opt-in; this thread).

    On a GPU jaxslices runs XLA's generic ops by default. Inside
    ``gpu_kernels()`` the embedding bag, the optimizers' row-wise rules and
    the update run as Pallas kernels instead (``docs/kernels.md``, "GPU
    kernels"), where the step allows it (float32, rows of a power-of-two
    width, not under ``vmap``, one device or ``shard_map``). They are not
    the default because they have not been measured on a GPU yet. Like
    :func:`disabled`, the switch is part of ``jax.jit``'s cache keys: a step
    traced outside it is traced again inside it. :func:`disabled` wins.
    A step exported for ``cuda`` inside it carries the kernels.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices
      >>> bag = jax.jit(jaxslices.embedding_bag)
      >>> with jaxslices.kernels.gpu_kernels():
      ...     out = bag(jnp.ones((4, 2)), jnp.array([[1, 2]]))  # on a CPU: C++
    """
    with _GPU_ON(True):
        yield


# ---------------------------------------------------- decisions, recorded


@dataclasses.dataclass(frozen=True)
class Decision:
    """Which path one operation of a step takes, decided when it is traced.

    Attributes:
      op: what the user called, with the leaf (``"jaxslices.adagrad (leaf
        ['emb'])"``).
      native: ``True`` when the op's native kernel runs.
      reason: why not native (``""`` when native).
      materialised: for a native kernel that reads a sparse gradient, why it
        reads the gradient's materialised ``[N, D]`` values instead of its
        pooled form (``""`` when it reads the pooled form, or reads none).
    """

    op: str
    native: bool
    reason: str
    materialised: str = ""


def _record(op: str, reason: str, kind: str) -> None:
    if _NOTE is not None:
        # A marker in the traced jaxpr, so that `explain` finds the decision
        # also in a step traced (and cached by jit) before it was asked.
        _NOTE.bind(np.zeros((), np.int8), op=op, reason=reason, kind=kind)


def _make_marker() -> Any:
    """``jaxslices_path_note``: an identity on a constant, holding a decision."""
    if not _jax_compat.AVAILABLE["ffi_primitive"]:  # pragma: no cover
        return None
    p = _jax_compat.Primitive("jaxslices_path_note")
    p.def_impl(lambda x, **_: x)
    p.def_abstract_eval(lambda x, **_: x)
    _jax_compat.mlir.register_lowering(p, lambda ctx, x, **_: [x])
    _jax_compat.primitive_batchers[p] = lambda args, dims, **_: (args[0], dims[0])
    _jax_compat.primitive_jvps[p] = lambda primals, tangents, **_: (
        primals[0],
        tangents[0],
    )
    return p


_NOTE = _make_marker()
MARKER = "jaxslices_path_note"
XLA, MATERIALISED = "xla", "materialised"


VMAP = "inside jax.vmap (the kernels run one problem at a time)"


def note(op: str, reason: str) -> None:
    """Record that ``op`` takes the XLA path because of ``reason``."""
    _record(op, reason, XLA)


def note_materialised(op: str, reason: str) -> None:
    """Record that ``op``'s native kernel reads materialised rows, and why."""
    _record(op, reason, MATERIALISED)


# What the CPU kernels take for a table, the rows of its gradient or update
# and the parameters a rule reads: float32, or bfloat16 / float16 (read in
# float32, written back rounded once; csrc/common.h). Optimizer state and
# everything else: float32.
TABLE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def route(
    op: str,
    *arrays: Any,
    tables: tuple[Any, ...] = (),
    dtypes: tuple[Any, ...] = (jnp.float32,),
) -> bool:
    """Whether ``op`` takes the native path; an XLA path is recorded with why.

    For an operation whose caller runs the XLA path itself when the kernel
    may not run; see :func:`decide` for the conditions. An op bound in every
    case (the forward bag, the apply, the managed-collision remap's) passes
    :func:`decide`'s reason to its primitive instead, which records it.
    """
    reason = decide(*arrays, tables=tables, dtypes=dtypes)
    if reason:
        note(op, reason)
    return not reason


def dtype_reason(
    *arrays: Any,
    tables: tuple[Any, ...] = (),
    dtypes: tuple[Any, ...] = (jnp.float32,),
) -> str:
    """Why the ops do not take these arrays' dtypes (``""``: they do).

    The dtype conditions of :func:`decide` on the CPU (``None`` entries
    skipped): a question about an operation's configuration, not about the
    platform, for a caller whose op expresses only these dtypes.
    """
    for x, allowed, is_table in [(x, dtypes, False) for x in arrays] + [
        (x, TABLE_DTYPES, True) for x in tables
    ]:
        why = "" if x is None else _dtype_reason(x, allowed, is_table)
        if why:
            return why
    return ""


def _dtype_reason(x: Any, allowed: tuple[Any, ...], is_table: bool) -> str:
    dtype = jnp.result_type(x)
    if is_table and not jnp.issubdtype(dtype, jnp.inexact):
        return f"a {jnp.dtype(dtype).name} table (the kernels take float tables)"
    if jnp.issubdtype(dtype, jnp.inexact) and dtype not in allowed:
        names = ", ".join(jnp.dtype(d).name for d in allowed)
        if not is_table and jnp.dtype(dtype) in TABLE_DTYPES:
            return (
                f"a {jnp.dtype(dtype).name} array where the kernels take "
                f"{names} (bfloat16/float16 tables are native, their "
                "optimizer state is float32)"
            )
        return f"a {jnp.dtype(dtype).name} array (the kernels take {names})"
    return ""


def decide(
    *arrays: Any,
    tables: tuple[Any, ...] = (),
    dtypes: tuple[Any, ...] = (jnp.float32,),
    gpu: bool = True,
) -> str:
    """Why an operation on these arrays takes the XLA path (``""``: native).

    Native when: the kernels are enabled and load (built on first use; a
    failure warns once), JAX's default platform is the CPU, or a GPU inside
    :func:`gpu_kernels` for an operation with a GPU kernel (``gpu``) whose
    operands the Pallas kernels take (:func:`_pallas.unsupported`, the one
    GPU predicate, which the GPU lowering applies too); every float array
    among ``arrays`` has a dtype in ``dtypes`` and every one among
    ``tables`` (a table, the rows of its gradient or update, the parameters
    a rule reads) one of :data:`TABLE_DTYPES`; none is batched by
    ``jax.vmap`` or laid out over a mesh by ``jit``.
    """
    if not _enabled():
        return "the native kernels are off (JAXSLICES_NATIVE=0 or kernels.disabled())"
    if not _jax_compat.AVAILABLE["ffi_primitive"]:
        return "this JAX lacks the primitive API the kernels are called through"
    platform = jax.default_backend()
    on_gpu = platform in ("gpu", "cuda", "rocm")
    if on_gpu and not gpu:
        return f"the platform is {platform}: this operation has no GPU kernel"
    if on_gpu and not _GPU_ON.value:
        return (
            f"the platform is {platform}: the Pallas GPU kernels are opt-in "
            "until measured on a GPU (jaxslices.kernels.gpu_kernels())"
        )
    if platform != "cpu" and not on_gpu:
        return f"the platform is {platform}: the native kernels are CPU and GPU only"
    checks = [(x, dtypes, False) for x in arrays]
    checks += [(x, dtypes if on_gpu else TABLE_DTYPES, True) for x in tables]
    for x, allowed, is_table in checks:
        if x is None:
            continue
        why = _dtype_reason(x, allowed, is_table)
        if why:
            return why
        if _jax_compat.is_batched(x):
            return VMAP
        mesh = _jax_compat.abstract_mesh(x)
        if mesh is not None and mesh.size > 1:
            kinds = _jax_compat.axis_kinds(mesh)
            if kinds is None or "Manual" not in kinds:
                return (
                    f"an array laid out over a mesh of {mesh.size} devices by jit "
                    "(the kernels have no partitioning rule; shard_map runs them "
                    "per device)"
                )
    if on_gpu:
        return _pallas.unsupported(*(x for x, _, _ in checks if x is not None)) or ""
    if not _build.load():
        return f"the kernels are unavailable: {_build.reason()}"
    return ""
