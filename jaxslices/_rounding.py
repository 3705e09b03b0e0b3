"""Rounding float32 results into bfloat16 and float16: to nearest or stochastically.

A low-precision table (``bfloat16``, ``float16``) is updated in float32 (the
row plus the sum of its updates) and written back rounded. Round to nearest
loses an update smaller than half a unit in the last place (ulp) of the
weight; **stochastic rounding** rounds ``x`` up to the next representable
value ``hi`` with probability ``(x - lo) / (hi - lo)`` and down to ``lo``
otherwise, so the expected result is ``x`` and small updates survive on
average (FBGEMM writes fp16 and bf16 tables this way by default).

The randomness is a hash, not a PRNG stream, so that the XLA path and the
native kernels (``kernels/csrc/common.h``) draw the same bits without
sharing state. The 32 random bits of the entry in column ``c`` of row ``r``
(the row in the array being written, its entries flattened: ``c`` in ``[0,
R)``) whose float32 result has bit pattern ``b`` are::

    row = mix(mix(mix(seed) ^ lo32(r)) ^ hi32(r))
    h   = mix(row ^ (c * 0x9E3779B9) ^ b)

``mix`` being the 32-bit finaliser of MurmurHash3 (Austin Appleby, public
domain: xor-shift 16, multiply ``0x85EBCA6B``, xor-shift 13, multiply
``0xC2B2AE35``, xor-shift 16) and the products taken modulo ``2**32``. So
the draws are independent **per entry** (equal entries given equal updates
round apart, so that on average they move as float32 does) and **per
step**: the ``seed`` mixes :func:`jaxslices.apply_updates`' ``key`` with
the step the optimizer counts (:func:`step_seed`; the jaxslices
optimizers count their steps for a low-precision table, so no ``key`` is
needed). The row is the one of the array written: a table alone and its
rows stacked in a collection's buffer draw differently (alike in
distribution), the XLA path and the kernels bitwise alike; a sharding
plan's buffers read the rows of the collection's buffer they hold
(``collection._buffers.noise_origin``), so a plan rounds as one device.

How each format rounds:

* ``bfloat16`` is the top half of a float32, so the 16 low bits of ``x``
  are exactly the fraction of an ulp: the result is the top half of ``|x| +
  (h & 0xFFFF)`` (integer addition), which rounds up with probability
  ``low16 / 2**16``, exactly ``(x - lo) / (hi - lo)``.
* ``float16`` (other exponent range): ``lo`` is ``x`` rounded toward zero,
  ``hi`` the next value away from zero, and the result is ``hi`` when ``u *
  (hi - lo) < |x| - |lo|`` with ``u = (h >> 8) / 2**24``: every term is
  exact in float32 (``hi - lo`` is a power of two, ``|x| - |lo|`` by
  Sterbenz's lemma), so both paths compare the same numbers.

Finite values never round to infinity (a value beyond the largest finite
one rounds down to it); infinities stay infinities and NaN stays NaN.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "LOW_PRECISION",
    "is_low_precision",
    "mix32",
    "noise",
    "round_to",
    "seed_from",
    "step_seed",
]

LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_low_precision(dtype: Any) -> bool:
    """Whether ``dtype`` is one the update path rounds into (bfloat16, float16)."""
    try:
        return jnp.dtype(dtype) in LOW_PRECISION
    except TypeError:
        return False


def _u32(x: Any) -> jax.Array:
    return jnp.asarray(x).astype(jnp.uint32)


def mix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser (public domain), on ``uint32`` arrays."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def seed_from(key: Any) -> jax.Array:
    """``key`` as the ``uint32`` seed of the noise: ``None`` (0), an integer
    (a step, say), or a ``jax.random`` key (its data folded to 32 bits)."""
    if key is None:
        return jnp.zeros((), jnp.uint32)
    key = jnp.asarray(key) if not hasattr(key, "dtype") else key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    if not jnp.issubdtype(key.dtype, jnp.integer):
        raise TypeError(
            "jaxslices.apply_updates: `key` must be an integer (a step counter, "
            "say) or a jax.random key, the seed of stochastic rounding; got "
            f"an array of dtype {key.dtype}."
        )
    words = jnp.ravel(key)
    if words.dtype.itemsize == 8:
        words = jnp.concatenate([_u32(words), _u32(words >> 32)])
    h = jnp.zeros((), jnp.uint32)
    for i in range(words.shape[0]):  # a key has 2 words, a step 1
        h = mix32(h ^ _u32(words[i]))
    return h


def step_seed(seed: jax.Array, step: Any) -> jax.Array:
    """``seed`` (:func:`seed_from`) mixed with an optimizer's step count
    (``None``: ``seed`` as it is), so every step draws anew."""
    if step is None:
        return seed
    step = jnp.asarray(step)
    return mix32(_u32(seed) ^ mix32(_u32(step) + np.uint32(0x9E3779B9)))


def _row_words(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    rows = jnp.asarray(rows)
    lo = _u32(rows)
    hi = _u32(rows >> 32) if rows.dtype.itemsize == 8 else jnp.zeros_like(lo)
    return lo, hi


def noise(seed: jax.Array, x: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """The 32 random bits of each entry of the float32 rows ``x`` ``[K, R]``.

    ``rows`` ``[K]``: the row of the array written that each of ``x``'s rows
    is (default ``0 .. K-1``); columns are ``0 .. R-1``.
    """
    if rows is None:
        rows = jnp.arange(x.shape[0], dtype=jnp.int32)
    lo, hi = _row_words(rows)
    row = mix32(mix32(mix32(_u32(seed)) ^ lo) ^ hi)
    cols = jnp.arange(x.shape[1], dtype=jnp.uint32) * np.uint32(0x9E3779B9)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return mix32(row[:, None] ^ cols[None, :] ^ bits)


def _round_bf16(x: jax.Array, h: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits & np.uint32(0x80000000)
    mag = bits & np.uint32(0x7FFFFFFF)
    up = (mag + (h & np.uint32(0xFFFF))) >> 16
    # A finite value never rounds to infinity: the largest finite bf16 instead.
    up = jnp.minimum(up, np.uint32(0x7F7F))
    out = ((sign >> 16) | up).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(out, jnp.bfloat16)


def _round_f16(x: jax.Array, h: jax.Array) -> jax.Array:
    nearest = x.astype(jnp.float16)
    nb = jax.lax.bitcast_convert_type(nearest, jnp.uint16)
    sign = nb & np.uint16(0x8000)
    mag = nb & np.uint16(0x7FFF)
    away = jnp.abs(nearest.astype(jnp.float32)) > jnp.abs(x)
    lo_mag = jnp.where(away, mag - np.uint16(1), mag)  # toward zero; 0 stays 0
    lo_mag = jnp.where(away & (mag == 0), mag, lo_mag)
    hi_mag = lo_mag + np.uint16(1)
    lo = jax.lax.bitcast_convert_type(lo_mag, jnp.float16).astype(jnp.float32)
    hi = jax.lax.bitcast_convert_type(hi_mag, jnp.float16).astype(jnp.float32)
    u = (h >> 8).astype(jnp.float32) * np.float32(2.0**-24)
    take_hi = (u * (hi - lo) < jnp.abs(x) - lo) & (hi_mag < np.uint16(0x7C00))
    out = sign | jnp.where(take_hi, hi_mag, lo_mag)
    return jax.lax.bitcast_convert_type(out, jnp.float16)


def round_to(
    x: jax.Array,
    dtype: Any,
    *,
    stochastic: bool,
    seed: jax.Array | None = None,
    rows: jax.Array | None = None,
) -> jax.Array:
    """``x`` (computed in float32) rounded into ``dtype``, entry by entry.

    Round to nearest unless ``stochastic`` and ``dtype`` is bfloat16 or
    float16; a wider ``dtype`` is a plain cast. ``x`` is ``[K, *row]``
    (rows of the array written, ``rows`` ``[K]`` their indices there;
    default ``0 .. K-1``: ``x`` is the whole array); a scalar is one row.
    """
    dtype = jnp.dtype(dtype)
    if not stochastic or dtype not in LOW_PRECISION:
        return x.astype(dtype)
    x = jnp.asarray(x).astype(jnp.float32)
    shape = x.shape
    rows_of = (1, 1) if x.ndim == 0 else (shape[0], math.prod(shape[1:]))
    flat = x.reshape(rows_of)
    seed = jnp.zeros((), jnp.uint32) if seed is None else seed
    h = noise(seed, flat, rows)
    out = _round_bf16(flat, h) if dtype == jnp.bfloat16 else _round_f16(flat, h)
    special = ~jnp.isfinite(flat)
    return jnp.where(special, flat.astype(dtype), out).reshape(shape)
