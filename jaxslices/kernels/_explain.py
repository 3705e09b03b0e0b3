"""``explain``: which path (native kernel or XLA) each operation of a step takes.

It reads the decisions from the step's jaxpr (the path notes of
:mod:`jaxslices.kernels._path` and the native ops' own equations, with the
reason their caller passed), so it
reports the trace that calling the step runs: the kernels' switch is part of
``jax.jit``'s cache keys, and ``explain`` traces in the caller's context.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax

from . import _build, _pallas, _threads
from ._path import MARKER, MATERIALISED, Decision
from ._primitive import OPS

__all__ = ["Report", "explain"]


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`explain` found in a step.

    Attributes:
      decisions: one per jaxslices operation of the step, in trace order:
        ``op`` (what was called, with the leaf), ``native`` and ``reason``.
      native_calls: native kernel calls in the lowered step (C++ or Pallas).
      status: :func:`jaxslices.kernels.status` at the time.
      threads: the threads a native kernel call of the step uses
        (:func:`jaxslices.kernels.threads`), in words.
      gpu_calls: of ``native_calls``, the Pallas GPU kernels' calls
        (``jaxslices_gpu_*``, on a GPU inside
        :func:`jaxslices.kernels.gpu_kernels`).
    """

    decisions: tuple[Decision, ...]
    native_calls: int
    status: str
    threads: str = ""
    gpu_calls: int = 0

    @property
    def native(self) -> bool:
        """``True`` if every jaxslices operation of the step runs natively."""
        return bool(self.decisions) and all(d.native for d in self.decisions)

    @property
    def materialised(self) -> tuple[Decision, ...]:
        """The native operations that read a gradient's ``[N, D]`` values."""
        return tuple(d for d in self.decisions if d.native and d.materialised)

    def __str__(self) -> str:
        lines = [f"native kernels: {self.status}"]
        if not self.decisions:
            lines.append("no jaxslices operation with a native kernel in this step")
        for d in self.decisions:
            path = "native" if d.native else f"XLA ({d.reason})"
            if d.native and d.materialised:
                path = f"native, {d.materialised}"
            lines.append(f"  {d.op}: {path}")
        calls = f"native kernel calls in the compiled step: {self.native_calls}"
        if self.gpu_calls:
            calls += f" (Pallas GPU kernels: {self.gpu_calls})"
        lines.append(calls)
        if self.native_calls and self.threads:
            lines.append(f"threads: {self.threads}")
        return "\n".join(lines)


def _subjaxprs(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _subjaxprs(v)
        return
    jaxpr = getattr(value, "jaxpr", None)  # ClosedJaxpr
    if jaxpr is not None and hasattr(jaxpr, "eqns"):
        yield jaxpr
    elif hasattr(value, "eqns"):
        yield value


def _walk(jaxpr: Any) -> Iterator[Any]:
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                yield from _walk(sub)


def _decisions(jaxpr: Any, per_device: bool) -> list[Decision]:
    out = []
    reads = collections.defaultdict(list)  # op -> why it reads the values
    for eqn in _walk(jaxpr):
        name = eqn.primitive.name
        if name == MARKER and eqn.params["kind"] == MATERIALISED:
            reads[eqn.params["op"]].append(eqn.params["reason"])
        elif name == MARKER:
            out.append(Decision(eqn.params["op"], False, eqn.params["reason"]))
        elif name in OPS:
            label = eqn.params.get("label") or name
            if eqn.params["reason"]:  # bound in every case: its reference runs
                out.append(Decision(label, False, eqn.params["reason"]))
            elif per_device:
                why = reads[label].pop(0) if reads[label] else ""
                out.append(Decision(label, True, "", why))
            else:
                out.append(
                    Decision(
                        label,
                        False,
                        "the step is compiled for several devices or another "
                        "platform: the kernel's XLA reference runs",
                    )
                )
    return out


def _traced_jaxpr(jitted: Any, fun: Any, args: Any, kwargs: Any) -> Any:
    """The step's jaxpr: ``jax.jit``'s ``trace``, also through Flax's wrapper."""
    traced = jitted.trace(*args, **kwargs) if hasattr(jitted, "trace") else None
    for _ in range(4):
        if traced is None:
            break
        if hasattr(traced, "jaxpr"):
            return traced.jaxpr
        # nnx.jit's Traced holds JAX's as `traced`
        traced = getattr(traced, "traced", None) or getattr(traced, "_inner_obj", None)
    return jax.make_jaxpr(fun)(*args, **kwargs)


def explain(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """Which path each jaxslices operation of ``fun(*args, **kwargs)`` takes.

    ``fun`` is a training step (jitted or not; ``jax.jit``, ``nnx.jit`` and
    ``eqx.filter_jit`` steps work) and ``args`` what it is called with; it is
    traced and lowered, not run. Each embedding bag, optimizer transform and
    update of a table is reported as ``native`` or ``XLA`` with the reason
    (the kernels are off or unavailable, a GPU without
    :func:`jaxslices.kernels.gpu_kernels`, a TPU, a dtype the kernels do not
    take, ``jax.vmap``, a step partitioned over several devices). A
    native kernel that reads a gradient's materialised ``[N, D]`` values
    instead of its pooled form (:attr:`jaxslices.IndexedSlices.recipe`) says
    so, and why (e.g. the tree operation that lost the pooled form).

    The report is what calling ``fun(*args, **kwargs)`` here runs: inside
    :func:`jaxslices.kernels.disabled` the XLA path, outside it the native
    one, whichever JAX traced and cached before (the switch is part of
    ``jax.jit``'s cache keys).

    Example:
      >>> import functools, jax, jax.numpy as jnp, jaxslices as js
      >>> def loss(p, ids):
      ...     return js.embedding_bag(p["emb"], ids).sum()
      >>> tx = js.adagrad(0.1)
      >>> @functools.partial(jax.jit, donate_argnums=(0, 1))
      ... def step(p, s, ids):
      ...     g = js.grad(loss)(p, ids)
      ...     u, s = tx.update(g, s, p)
      ...     return js.apply_updates(p, u), s
      >>> p = {"emb": jnp.ones((8, 4))}
      >>> report = js.kernels.explain(step, p, tx.init(p), jnp.array([[1, 2]]))
      >>> report.native == js.kernels.available()
      True
    """
    _build.load()
    jitted = fun if hasattr(fun, "lower") else jax.jit(fun)
    jaxpr = _traced_jaxpr(jitted, fun, args, kwargs)
    lowered = jitted.lower(*args, **kwargs)
    text = getattr(lowered, "lowered", lowered).as_text()
    cpu_calls = len(
        re.findall(r"custom_call @jaxslices_|call_target_name = \"jaxslices_", text)
    )
    gpu_calls = len(re.findall(_GPU_CALL, text))
    calls = cpu_calls + gpu_calls
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    decisions = _decisions(jaxpr, per_device=calls > 0)
    # the thread setting, where a kernel that shares work between threads runs
    threaded = {n for n, op in OPS.items() if "threads" in op.attrs}
    threaded_calls = re.findall(
        r"(?:custom_call @|call_target_name = \")(" + "|".join(threaded) + ")", text
    )
    threads = _threads.describe() if threaded_calls else ""
    return Report(tuple(decisions), calls, _build.status(), threads, gpu_calls)


# A Pallas GPU kernel of jaxslices in a lowered step: Triton's custom call,
# named after the kernel (kernels/_pallas.py, KERNEL_PREFIX).
_GPU_CALL = re.compile(r'xla\.gpu\.triton[^\n]*?name = "' + _pallas.KERNEL_PREFIX)
