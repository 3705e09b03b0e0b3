"""Shared test helpers: random slices with repeats and padding, tolerances,
whether the native kernels run here."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslices
from jaxslices import IndexedSlices, _jax_compat


def _native_kernels() -> tuple[bool, str]:
    """Whether the native CPU kernels run in this process, and their status line.

    Asked once per process (tests/conftest.py imports this module before any
    test), with the one-time ``KernelsUnavailableWarning`` caught: under
    pyproject's ``filterwarnings = ["error"]`` it would otherwise fail
    whichever collection or test first met the kernels. Its cause is the
    status line, which the skips below give as their reason and the pytest
    header prints. The warning itself is tested in subprocesses
    (tests/lib/test_kernels_build.py).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxslices.kernels.KernelsUnavailableWarning)
        available = jaxslices.kernels.available()
    return available, jaxslices.kernels.status()


KERNELS_AVAILABLE, KERNELS_STATUS = _native_kernels()

#: For a test (``@needs_kernels``) or module (``pytestmark``) that asserts the
#: native path: skipped, with the kernels' status as the reason, where they do
#: not run (no C++ compiler, a failed build, ``JAXSLICES_NATIVE=0``).
needs_kernels = pytest.mark.skipif(
    not KERNELS_AVAILABLE, reason=f"needs the native kernels: {KERNELS_STATUS}"
)

FLOAT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
ROW_SHAPES = [(), (3,), (2, 3)]

#: What a failed run-time check raises under ``jit``: JAX reports a callback's
#: error as ``JaxRuntimeError`` on its Python dispatch path (a step's first
#: call) and as ``ValueError`` on its C++ fast path (later calls, once a call
#: has passed), JAX 0.10-0.12.
CHECK_FAILED = (jax.errors.JaxRuntimeError, ValueError)
#: The first line of the error JAX raises for a failed check under ``jit``
#: (jaxlib's text; jaxslices' message is the last line): JAX 0.10.2 and 0.12.
JAX_FIRST_LINE = (
    "INTERNAL: CpuCallback error calling callback: Traceback (most recent call last):"
)
#: How jaxslices logs a failed check under ``jit`` (one line, before the error).
LOGGED = "jaxslices check failed: "


def tol(dtype) -> dict:
    """assert_allclose tolerances suited to ``dtype``."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16:
        return dict(rtol=2e-2, atol=2e-2)
    if dtype == jnp.float16:
        return dict(rtol=5e-3, atol=5e-3)
    return dict(rtol=1e-5, atol=1e-5)


# JAX 0.10.2's XLA:CPU contracts multiply-adds (FMA) differently from one
# compiled program to another (other fusions, other slot counts), so two
# programs computing the same rule can differ in the last bit of float32
# results; JAX 0.12's gives the same bits, and there equality is exact.
LAST_BIT_EXACT = _jax_compat.JAX_VERSION >= (0, 11, 0)


def assert_same_bits(x, y) -> None:
    """Equal bit for bit; on JAX < 0.11, float32 within two units in the last place."""
    x, y = np.asarray(x), np.asarray(y)
    if LAST_BIT_EXACT or x.dtype != np.float32:
        np.testing.assert_array_equal(x, y)
    else:
        np.testing.assert_array_max_ulp(x, y, maxulp=2)


def random_slices(
    rng: np.random.Generator,
    num_rows: int = 7,
    n: int = 12,
    row_shape: tuple[int, ...] = (3,),
    dtype=jnp.float32,
    padding: int = 2,
    index_dtype=np.int32,
) -> IndexedSlices:
    """Slices with repeated ids (drawn from a few rows) and ``padding`` pad slots."""
    few = max(1, num_rows // 2)
    idx = rng.integers(0, few, size=n).astype(index_dtype)
    if padding:
        pad_at = rng.choice(n, size=min(padding, n), replace=False)
        idx[pad_at] = num_rows
    values = rng.normal(size=(n, *row_shape)).astype(np.float32)
    if padding:
        values[idx == num_rows] = 0.0
    return IndexedSlices(
        jnp.asarray(values, dtype), jnp.asarray(idx), (num_rows, *row_shape)
    )


def dense_reference(s: IndexedSlices) -> np.ndarray:
    """NumPy float64 dense equivalent: valid rows summed, everything else dropped."""
    out = np.zeros(s.dense_shape, np.float64)
    idx = np.asarray(s.indices)
    vals = np.asarray(s.values.astype(jnp.float32), np.float64)
    for i, v in zip(idx, vals, strict=True):
        if 0 <= i < s.dense_shape[0]:
            out[i] += v
    return out


def bag_reference(table, bags, weights, combiner, padding_id=None) -> np.ndarray:
    """NumPy float64: one combined row per bag, straight from the definition.

    ``bags``: lists of ids (out-of-range ids and ``padding_id`` are left out);
    ``weights``: lists of per-id weights like ``bags``. Empty bags give zeros.
    """
    t = np.asarray(table, np.float64)
    out = np.zeros((len(bags), *t.shape[1:]))
    for b, (ids, ws) in enumerate(zip(bags, weights, strict=True)):
        keep = [
            (i, w)
            for i, w in zip(ids, ws, strict=True)
            if i != padding_id and 0 <= i < len(t)
        ]
        if not keep:
            continue
        s = sum(w * t[i] for i, w in keep)
        den = {
            "sum": 1.0,
            "mean": sum(w for _, w in keep),
            "sqrtn": np.sqrt(sum(w * w for _, w in keep)),
        }[combiner]
        out[b] = s / den if den else 0
    return out


def dense_bag(table, ids, weights, combiner, padding_id=None):
    """A padded ``[B, L]`` bag written with plain ``table[ids]``: ``jax.grad`` of
    it is JAX's own dense gradient, the reference for sparse ones."""
    num_rows = table.shape[0]
    mask = (ids >= 0) & (ids < num_rows)
    if padding_id is not None:
        mask = mask & (ids != padding_id)
    rows = table[jnp.clip(ids, 0, num_rows - 1)]
    w = jnp.where(mask, weights, 0.0)
    total = jnp.sum(rows * w[..., None], axis=-2)
    if combiner == "sum":
        return total
    den = jnp.sum(w, -1) if combiner == "mean" else jnp.sqrt(jnp.sum(w * w, -1))
    return total / jnp.where(den == 0, 1.0, den)[..., None]


def bag_problem(seed: int, *, rows: int, dim: int, bags: int, length: int):
    """A bag model's ``(params, ids, y)``: a ``[rows, dim]`` table ``emb``, a
    head ``w``, ``[bags, length]`` Zipf ids (many repeats), float32 targets."""
    rng = np.random.default_rng(seed)
    params = {
        "emb": jnp.asarray(rng.normal(size=(rows, dim)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=dim), jnp.float32),
    }
    ids = jnp.asarray((rng.zipf(1.3, size=(bags, length)) - 1) % rows, jnp.int32)
    return params, ids, jnp.asarray(rng.normal(size=bags), jnp.float32)
