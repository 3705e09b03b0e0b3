"""Raw ids: how ids of any value (64-bit integers, strings) reach the device.

A managed-collision table (:class:`~jaxslices.ManagedCollision`) tracks *raw*
ids, the ids of the data (a user id, an item hash, a query token), which have
no vocabulary and may use all 64 bits. Under JAX's default 32-bit mode
(``jax_enable_x64`` off) no ``int64`` array exists on a device: ``jnp.asarray``
of NumPy ``int64`` ids would narrow them to ``int32``. So a raw id travels as
**two 32-bit words**, :class:`RawIds` ``(hi, lo)`` (two ``uint32`` arrays of
one shape), and every comparison on the device is on the pair. Nothing is
lost and no hash is needed for integer ids.

Accepted as raw ids (:func:`as_raw_ids`), the value of the integer is the id:

* :class:`RawIds` (from :meth:`RawIds.from_int64` on the host, or
  :meth:`RawIds.from_strings`);
* NumPy ``int64`` / ``uint64`` arrays (split on the host, exactly);
* JAX ``int64`` / ``uint64`` arrays (with ``jax_enable_x64``; split on the
  device);
* any narrower integer array (``int8`` ... ``int32``, ``uint8`` ...
  ``uint32``), NumPy or JAX, traced or not: sign-extended to 64 bits, so
  ``int32 -1`` and ``int64 -1`` are one id (``uint32 0xFFFFFFFF`` is another).

Floats and booleans are refused (``TypeError`` naming the dtype).

**Strings** are hashed on the host to 64 bits (:meth:`RawIds.from_strings`,
the first 8 bytes of BLAKE2b of the UTF-8 text: stable across processes and
platforms, unlike Python's ``hash``). Two of ``n`` distinct strings share a
hash with probability about ``n**2 / 2**65``: below ``3e-6`` for ``n = 10``
million. Those two strings are then one id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RawIds", "as_raw_ids"]

_MASK32 = np.uint64(0xFFFFFFFF)


@jax.tree_util.register_pytree_node_class
class RawIds:
    """Raw ids of any 64-bit value as two ``uint32`` words, ``(hi, lo)``.

    ``id = hi * 2**32 + lo`` (as an unsigned 64-bit value; a negative
    ``int64`` id is its two's complement). A pytree (children ``hi``, ``lo``),
    so it passes through ``jax.jit``.

    Args:
      hi: the high 32 bits, ``uint32``.
      lo: the low 32 bits, ``uint32``, the shape of ``hi``.

    Raises:
      TypeError: a word is not ``uint32``.
      ValueError: the words' shapes differ.

    Example:
      >>> import numpy as np, jaxslices as js
      >>> ids = js.RawIds.from_int64(np.array([2**40 + 7, -1], np.int64))
      >>> ids.hi.tolist(), ids.lo.tolist()
      ([256, 4294967295], [7, 4294967295])
    """

    __slots__ = ("hi", "lo")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, hi: Any, lo: Any):
        hi, lo = jnp.asarray(hi), jnp.asarray(lo)
        for name, word in (("hi", hi), ("lo", lo)):
            if word.dtype != jnp.uint32:
                raise TypeError(
                    f"RawIds: `{name}` must be uint32 (one 32-bit word of each "
                    f"id), got {word.dtype}. Build RawIds with RawIds.from_int64 "
                    "or RawIds.from_strings."
                )
        if hi.shape != lo.shape:
            raise ValueError(
                f"RawIds: `hi` {hi.shape} and `lo` {lo.shape} must have one shape."
            )
        self.hi, self.lo = hi, lo

    def tree_flatten(self):
        return (self.hi, self.lo), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        out = object.__new__(cls)  # no validation on placeholder leaves
        out.hi, out.lo = children
        return out

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.hi.shape)

    def reshape(self, *shape: Any) -> RawIds:
        return RawIds.tree_unflatten(
            None, (self.hi.reshape(*shape), self.lo.reshape(*shape))
        )

    def __repr__(self) -> str:
        return f"RawIds(shape={list(self.shape)})"

    @classmethod
    def from_int64(cls, ids: Any) -> RawIds:
        """From 64-bit integer ids on the host (NumPy ``int64`` or ``uint64``).

        Exact: every value keeps its 64 bits. Narrower integer dtypes are
        accepted too (sign-extended).

        Example:
          >>> import numpy as np, jaxslices as js
          >>> js.RawIds.from_int64(np.array([5, 2**33], np.int64)).hi.tolist()
          [0, 2]
        """
        a = np.asarray(ids)
        _check_integer(a.dtype, "RawIds.from_int64")
        u = a.astype(np.int64).view(np.uint64) if a.dtype != np.uint64 else a
        hi = (u >> np.uint64(32)).astype(np.uint32)
        lo = (u & _MASK32).astype(np.uint32)
        return cls(jnp.asarray(hi), jnp.asarray(lo))

    @classmethod
    def from_strings(cls, strings: Iterable[str]) -> RawIds:
        """Strings hashed on the host to 64-bit ids (BLAKE2b, 8 bytes).

        Stable across processes, platforms and Python versions. Two of ``n``
        distinct strings collide with probability about ``n**2 / 2**65``.

        Example:
          >>> import jaxslices as js
          >>> ids = js.RawIds.from_strings(["cat", "dog", "cat"])
          >>> ids.shape, bool(ids.lo[0] == ids.lo[2]), bool(ids.lo[0] == ids.lo[1])
          ((3,), True, False)
        """
        words = [
            int.from_bytes(hashlib.blake2b(_text(s).encode(), digest_size=8).digest())
            for s in strings
        ]
        return cls.from_int64(np.asarray(words, np.uint64).reshape(-1))


def _text(s: Any) -> str:
    if not isinstance(s, str):
        raise TypeError(
            f"RawIds.from_strings: every item must be a str, got {type(s).__name__} "
            f"{s!r}. Hash integer ids with RawIds.from_int64 instead."
        )
    return s


def _check_integer(dtype: Any, where: str) -> None:
    if not np.issubdtype(dtype, np.integer) or dtype == np.bool_:
        raise TypeError(
            f"{where}: raw ids must be integers (any width, signed or unsigned), "
            f"RawIds, or strings through RawIds.from_strings; got dtype {dtype}."
        )


def as_raw_ids(ids: Any, where: str) -> RawIds:
    """``ids`` as :class:`RawIds`, by the rules of this module's docstring.

    Example:
      >>> import jax.numpy as jnp
      >>> r = as_raw_ids(jnp.array([-1, 3], jnp.int32), "here")
      >>> r.hi.tolist(), r.lo.tolist()
      ([4294967295, 0], [4294967295, 3])
    """
    if isinstance(ids, RawIds):
        return ids
    if isinstance(ids, (list, tuple)) or np.isscalar(ids):
        ids = np.asarray(ids)  # Python ints: int64 on the host, split exactly
    dtype = np.dtype(ids.dtype)
    _check_integer(dtype, where)
    if isinstance(ids, np.ndarray) and dtype.itemsize == 8:
        return RawIds.from_int64(ids)  # exact on the host, in any mode
    x = jnp.asarray(ids)
    if x.dtype.itemsize == 8:  # x64 mode: split on the device
        u = x if x.dtype == jnp.uint64 else jax.lax.bitcast_convert_type(x, jnp.uint64)
        hi = (u >> jnp.uint64(32)).astype(jnp.uint32)
        lo = (u & jnp.uint64(0xFFFFFFFF)).astype(jnp.uint32)
        return RawIds.tree_unflatten(None, (hi, lo))
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
        wide = x.astype(jnp.int32)
        hi = jnp.where(wide < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0))
        return RawIds.tree_unflatten(
            None, (hi, jax.lax.bitcast_convert_type(wide, jnp.uint32))
        )
    lo = x.astype(jnp.uint32)
    return RawIds.tree_unflatten(None, (jnp.zeros_like(lo), lo))
