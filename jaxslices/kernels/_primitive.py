"""The primitive machinery of the native ops: one JAX primitive per kernel.

A :class:`NativeOp` is a JAX primitive with an XLA *reference*
implementation written in jax.numpy: its contract and its fallback. It
lowers to the reference on every platform but the CPU, on the CPU when the
kernels are not loaded or the step is partitioned over several devices by
``jit`` (a custom call has no partitioning rule: XLA would gather the whole
table onto every device), under ``jax.vmap`` (the batching rule vmaps the
reference) and under differentiation (the JVP rule differentiates the
reference, unless the op brings its own). On one CPU device, and inside
``shard_map`` (every mesh axis manual: the kernel runs on each device's own
shard), it lowers to the FFI custom call. On ``cuda`` and ``rocm``, with
the GPU kernels opted in (:func:`jaxslices.kernels.gpu_kernels`), it lowers
to the op's Pallas kernel (``_pallas.py``) under the same conditions (one
device or ``shard_map``; float32 rows of a power-of-two width), and to the
reference otherwise. A TPU (Mosaic) kernel would be one more lowering rule
here: this is the seam.

Every op is bound with the ``reason`` its caller got from
:func:`jaxslices.kernels._path.decide` when it was traced (``""``: the
kernel may run): a reason sends the lowering to the reference on every
platform, and :func:`jaxslices.kernels.explain` reads it from the op's
equation. :data:`OPS` holds every op by name (``explain`` finds them there).

The FFI boundary is typed (``csrc/common.h``): a kernel that takes ids is
registered once per ids dtype (``<target>_s32``, ``<target>_s64``; one that
takes none, once: ``<target>``), and its attributes are passed with the
types the handler binds (``np.bool_`` for ``bool``, ``np.int32`` for the
rule enum, ``np.int64`` for sizes), so the FFI rejects a mismatch instead of
reinterpreting it. Only the kernels that share work between threads take
the thread setting (``THREAD_ATTRS``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .. import _jax_compat
from . import _build, _pallas, _path, _threads

# The attributes of a kernel that shares its work between threads: the
# threads it may use and the batch size below which it uses one
# (kernels._threads).
THREAD_ATTRS = {"threads": np.int64, "min_slots": np.int64}

# The ids dtypes the kernels are registered for, and their target suffixes.
ID_SUFFIXES = {np.dtype(np.int32): "s32", np.dtype(np.int64): "s64"}


def target_name(target: str, ids_dtype: Any = None) -> str:
    """The FFI target of kernel ``target`` for ids of ``ids_dtype`` (``None``:
    a kernel that takes no ids, registered once)."""
    if ids_dtype is None:
        return target
    return f"{target}_{ID_SUFFIXES[np.dtype(ids_dtype)]}"


def check_ids_dtype(ids: Any, where: str) -> None:
    """Raise unless ``ids`` are int32 or int64 (the kernels' two registrations)."""
    dtype = np.dtype(ids.dtype)
    if dtype not in ID_SUFFIXES:
        raise TypeError(
            f"{where}: the native kernels take int32 or int64 ids, got "
            f"{dtype.name} (jaxslices._ids.index_dtype gives the ids' dtype)."
        )


# Every native op, by primitive name (kernels/_ops.py, managed/_ops.py).
OPS: dict[str, NativeOp] = {}


class NativeOp:
    """A primitive: a C++ kernel on CPU, its XLA reference everywhere else.

    Args:
      name: the primitive's name (also the stem of its FFI targets).
      reference: ``(*operands, **params) -> list of outputs``, in jax.numpy.
      abstract: ``(*avals, **params) -> list of output avals``.
      aliases: operand index -> output index written in place.
      attrs: the kernel's FFI attributes: param name -> numpy scalar type.
      ids_operand: the index of the ids operand (its dtype picks the
        target), or ``None`` for a kernel that takes no ids.
      threads: the kernel shares its work between threads (it takes
        ``THREAD_ATTRS``).
      jvp: a JVP rule of the primitive (default: the reference's).
      gpu: the op's Pallas GPU kernel, with the reference's signature
        (``_pallas.py``; ``None``: the reference on GPUs too).
    """

    def __init__(
        self,
        name: str,
        reference: Callable[..., list[jax.Array]],
        abstract: Callable[..., list[Any]],
        *,
        aliases: dict[int, int],
        attrs: dict[str, type],
        ids_operand: int | None,
        threads: bool = True,
        jvp: Callable[..., Any] | None = None,
        gpu: Callable[..., list[jax.Array]] | None = None,
    ):
        self.name, self.target = name, name
        self.reference, self.aliases = reference, aliases
        # The thread setting is read when a step is lowered.
        self.attrs = {**attrs, **(THREAD_ATTRS if threads else {})}
        self.ids_operand, self.gpu = ids_operand, gpu
        OPS[name] = self
        if not _jax_compat.AVAILABLE["ffi_primitive"]:  # pragma: no cover
            self.prim = None
            return
        p = _jax_compat.Primitive(name)
        p.multiple_results = True
        p.def_abstract_eval(lambda *avals, **params: abstract(*avals, **params))
        p.def_impl(self._impl)
        mlir = _jax_compat.mlir
        mlir.register_lowering(
            p, mlir.lower_fun(self._reference, multiple_results=True)
        )
        mlir.register_lowering(p, self._cpu_lowering, platform="cpu")
        if gpu is not None:
            for platform in ("cuda", "rocm"):
                mlir.register_lowering(p, self._gpu_lowering, platform=platform)
        _jax_compat.primitive_batchers[p] = self._batch
        _jax_compat.primitive_jvps[p] = jvp or self._jvp
        self.prim = p

    def bind(self, *args: Any, reason: str = "", **params: Any) -> list[jax.Array]:
        """The op on ``args``; ``reason`` (from ``_path.decide``): why its
        reference runs (``""``: the kernel may run)."""
        return self.prim.bind(*args, reason=reason, **params)

    def _reference(self, *args: Any, **params: Any) -> list[jax.Array]:
        return self.reference(*args, **params)

    @functools.cached_property
    def _jitted(self) -> Callable[..., Any]:
        @functools.lru_cache(maxsize=256)
        def compiled(items):
            params = dict(items)
            return jax.jit(lambda *a: self.prim.bind(*a, **params))

        return compiled

    def _impl(self, *args: Any, **params: Any) -> list[jax.Array]:
        # Eager use: compile the primitive alone (lowered like any other).
        return self._jitted(tuple(sorted(params.items())))(*args)

    def _cpu_lowering(self, ctx: Any, *operands: Any, **params: Any) -> Any:
        # The caller's decision; the switch (part of jit's cache keys, so a
        # direct op call inside ``disabled()`` lowers to its reference too);
        # one device or inside shard_map; the kernels loaded.
        per_device = _jax_compat.lowering_is_per_device(ctx)
        native = not params["reason"] and _path._enabled() and per_device
        if native and _build.load():
            values = dict(params)
            if "threads" in self.attrs:
                values["threads"], values["min_slots"] = _threads.thread_setting()
            attrs = {k: kind(values[k]) for k, kind in self.attrs.items()}
            ids = None if self.ids_operand is None else ctx.avals_in[self.ids_operand]
            rule = jax.ffi.ffi_lowering(
                target_name(self.target, None if ids is None else ids.dtype),
                operand_output_aliases=dict(self.aliases),
            )
            return rule(ctx, *operands, **attrs)
        return self._reference_lowering(ctx, *operands, **params)

    def _gpu_lowering(self, ctx: Any, *operands: Any, **params: Any) -> Any:
        # The caller's decision (opted in: a user context, part of jit's cache
        # keys), on one device or inside shard_map, operands the kernels take.
        pallas = (
            not params["reason"]
            and _path._gpu_enabled()
            and _jax_compat.lowering_is_per_device(ctx)
            and _pallas.unsupported(*ctx.avals_in) is None
        )
        if pallas:
            return _pallas.lower(self.gpu)(ctx, *operands, **params)
        return self._reference_lowering(ctx, *operands, **params)

    def _reference_lowering(self, ctx: Any, *operands: Any, **params: Any) -> Any:
        ref = _jax_compat.mlir.lower_fun(self._reference, multiple_results=True)
        return ref(ctx, *operands, **params)

    def _batch(self, args: Any, dims: Any, **params: Any) -> Any:
        # vmap replaces the op by its vmapped reference: its decision is
        # noted for `explain` instead of the equation it would have read.
        _path.note(params.get("label") or self.name, params["reason"] or _path.VMAP)
        fun = functools.partial(self.reference, **params)
        out = jax.vmap(lambda *a: tuple(fun(*a)), in_axes=tuple(dims))(*args)
        return list(out), [0] * len(out)

    def _jvp(self, primals: Any, tangents: Any, **params: Any) -> Any:
        tangents = [_jax_compat.instantiate_zeros(t) for t in tangents]
        fun = functools.partial(self.reference, **params)
        out, t_out = jax.jvp(lambda *a: tuple(fun(*a)), tuple(primals), tuple(tangents))
        return list(out), list(t_out)
