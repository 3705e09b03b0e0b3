"""How ``IndexedSlices`` stores its indices: an array arithmetic cannot change.

A gradient tree is a pytree, and generic code maps over every leaf:
``jax.tree.map(jnp.add, g1, g2)``, ``2 * g``, ``lax.psum``, ``optax.global_norm``,
stock Optax transforms. Over plain integer indices each of these silently
changes which rows an update lands on. So the ``indices`` child of an
``IndexedSlices`` is not an integer array but a *typed* one: the integer ids
bit-cast to ``uint32`` words and wrapped (:func:`jax.random.wrap_key_data`) in an
extended dtype registered with :func:`jax.extend.random.define_prng_impl`. JAX
refuses arithmetic, reductions, collectives and casts on extended dtypes, and
its error prints the dtype as ``key<TAG>``: the tag below names
``IndexedSlices`` and the jaxslices way to do it. Indexing, concatenation,
``jnp.where``, ``jit``/``scan``/``vmap``/``device_put``/pickling pass it
through unchanged. ``IndexedSlices.indices`` unwraps it again, which compiles to
nothing (``random_unwrap`` + bit casts; checked in tests on the compiled HLO).

Layout: ids that fit in int32 (every dense shape with fewer than ``2**31 - 1``
rows) are one ``uint32`` word per id (``key_shape=(1,)``); int64 ids, needed
only when ``dense_shape[0]`` does not fit in int32 (``jax_enable_x64``), are two
words (``key_shape=(2,)``). Bit casts keep negative (invalid) ids negative, so
their meaning (treated like padding) is unchanged.

Eagerly, a few array methods that JAX declares abstract on key arrays (``.real``,
``.astype``, ``.conj``, ``.sum``, ... which ``optax.global_norm`` and mixed
precision casts call) raise ``NotImplementedError: Cannot call abstract method``,
which does not name ``IndexedSlices``. :func:`_install_messages` replaces those
methods on JAX's key-array class by ones that raise a ``TypeError`` naming
``IndexedSlices`` and the fix *for jaxslices indices only* and call JAX's own
method for every other key. That class is private to JAX: it is found as
``type(`` of a wrapped array ``)`` and patched through
:mod:`jaxslices._jax_compat` (entry ``key_array_class``), only for JAX versions
known to have that layout (0.5.3 up to the 0.12 line; checked in CI on 0.10.2
and 0.12.0.1), and skipped (JAX's message stays) otherwise. Under ``jit`` no
patch is needed: traced key arrays raise ``TypeError`` with the tag.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import define_prng_impl

from . import _jax_compat
from ._ids import needs_int64  # the index dtype rule (one home)

#: Printed by JAX as ``key<TAG>`` in every dtype error on the indices leaf.
TAG = (
    "IndexedSlices.indices, row ids, not numbers: use jaxslices.tree_add, "
    "jaxslices.tree_scale, jaxslices.tree_psum, jaxslices.global_norm, "
    "jaxslices.scale, jaxslices.sgd or other jaxslices transforms"
)

FIX = (
    "Generic pytree code (jax.tree.map over a gradient tree, lax.psum, "
    "optax.global_norm, stock Optax transforms such as optax.sgd or optax.scale) "
    "maps over the `indices` of an IndexedSlices as if they were numbers, which "
    "would silently change the rows an update lands on. Use the jaxslices "
    "operations instead: jaxslices.tree_add (accumulate), jaxslices.tree_scale, "
    "jaxslices.tree_psum / jaxslices.tree_pmean (cross-device), "
    "jaxslices.global_norm (norm), jaxslices.MultiSteps (gradient accumulation), "
    "jaxslices.tree_map_values (any function of the values), the jaxslices "
    "transforms (jaxslices.sgd, jaxslices.scale, jaxslices.clip_by_global_norm, "
    "jaxslices.adagrad, jaxslices.lazy_adam, ...), or route the sparse leaves "
    "away from stock Optax with optax.multi_transform. `s.indices` gives the "
    "plain integer ids."
)


def _not_a_prng(*args: Any, **kwargs: Any) -> Any:
    del args, kwargs
    raise TypeError(
        "This array holds the indices of a jaxslices.IndexedSlices, not a PRNG key; "
        "it cannot seed, split or draw random bits. " + FIX
    )


def _define(words: int, bits: int) -> Any:
    return define_prng_impl(
        key_shape=(words,),
        seed=_not_a_prng,
        split=_not_a_prng,
        random_bits=_not_a_prng,
        fold_in=_not_a_prng,
        name=f"jaxslices_indices_int{bits}",
        tag=TAG,
    )


IMPL32 = _define(1, 32)
IMPL64 = _define(2, 64)
DTYPE32 = jax.eval_shape(
    lambda: jax.random.wrap_key_data(jnp.zeros((0, 1), jnp.uint32), impl=IMPL32)
).dtype
DTYPE64 = jax.eval_shape(
    lambda: jax.random.wrap_key_data(jnp.zeros((0, 2), jnp.uint32), impl=IMPL64)
).dtype
#: The implementation names a checkpoint stores for typed indices (see
#: ``_jax_compat.register_key_impl_names``).
NAMES = {DTYPE32: "jaxslices_indices_int32", DTYPE64: "jaxslices_indices_int64"}


def is_typed(x: Any) -> bool:
    """``True`` for an array (or ShapeDtypeStruct) holding wrapped indices."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jax.dtypes.extended):
        return False
    return dtype == DTYPE32 or dtype == DTYPE64


def wrap(indices: Any, num_rows: int) -> Any:
    """Integer ids ``[..., N]`` -> typed indices ``[..., N]`` (no copy under jit).

    For ``num_rows`` up to ``2**31 - 1``: ids of at most 32 bits become int32
    (uint32 bit-cast: ids >= 2**31 turn negative, i.e. stay invalid, as they are
    for such a table); 64-bit ids are narrowed to int32 after mapping every id
    outside ``[0, num_rows]`` to -1, so no out-of-range id can wrap into a valid
    row. For more rows (``jax_enable_x64`` required, checked by the caller) ids
    are int64: 64-bit ids bit-cast, narrower ones (uint32 ids >= 2**31
    included) converted by value.
    """
    dtype = jnp.dtype(indices.dtype)
    wide = needs_int64(num_rows)
    if isinstance(indices, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(
            indices.shape, DTYPE64 if wide else DTYPE32, sharding=indices.sharding
        )
    if wide:
        ids = indices
        if dtype.itemsize != 8:
            ids = ids.astype(jnp.int64)  # value-preserving (uint32 included)
        elif dtype != jnp.int64:
            ids = jax.lax.bitcast_convert_type(ids, jnp.int64)
        words = jax.lax.bitcast_convert_type(ids, jnp.uint32)  # [..., N, 2]
        return _with_messages(jax.random.wrap_key_data(words, impl=IMPL64))
    if dtype.itemsize == 8:
        ok = (indices >= 0) & (indices <= num_rows)
        ids = jnp.where(ok, indices, -1).astype(jnp.int32)
    elif dtype == jnp.uint32:
        ids = jax.lax.bitcast_convert_type(indices, jnp.int32)
    elif dtype != jnp.int32:
        ids = indices.astype(jnp.int32)  # narrower ints: value-preserving
    else:
        ids = indices
    words = jax.lax.bitcast_convert_type(ids, jnp.uint32)
    return _with_messages(jax.random.wrap_key_data(words[..., None], impl=IMPL32))


def unwrap(typed: Any) -> Any:
    """Typed indices -> the plain integer ids (int32 or int64). Free under jit."""
    if isinstance(typed, jax.ShapeDtypeStruct) and is_typed(typed):
        int_dtype = jnp.int32 if typed.dtype == DTYPE32 else jnp.int64
        return jax.ShapeDtypeStruct(typed.shape, int_dtype, sharding=typed.sharding)
    if not is_typed(typed):
        raise TypeError(
            "IndexedSlices: the `indices` child of this IndexedSlices is a "
            f"{type(typed).__name__} of dtype {getattr(typed, 'dtype', None)}, not "
            "the typed indices jaxslices stores, so it holds no row ids. It was "
            "rebuilt by jax.tree.map / jax.tree.unflatten from other leaves: "
            "jax.tree.map(f, grads) applies f to the indices too (e.g. "
            "jnp.isnan gives bools). To apply f to the values and keep the ids, "
            "use jaxslices.tree_map_values(f, grads); to build slices, use "
            "IndexedSlices(values, indices, dense_shape) with plain integer ids."
        )
    words = jax.random.key_data(typed)
    if typed.dtype == DTYPE32:
        return jax.lax.bitcast_convert_type(
            jax.lax.squeeze(words, (words.ndim - 1,)), jnp.int32
        )
    return jax.lax.bitcast_convert_type(words, jnp.int64)


# ------------------------------------- checkpoints and array constructors
#
# Two more touch points on JAX internals, through :mod:`jaxslices._jax_compat`
# (its inventory gives the names, the versions checked and the fallbacks):
#
# * ``key_impl_names``: checkpointers store a key array as its ``uint32`` words
#   plus ``str(jax.random.key_impl(x))`` and rebuild it with
#   ``jax.random.wrap_key_data(words, impl=that_string)`` (Orbax does exactly
#   this). JAX resolves such a string only for implementations in its registry
#   of named PRNGs, which ``define_prng_impl`` does not add to: restoring
#   failed with "unrecognized PRNG implementation". The two typed-indices
#   implementations are registered under :data:`NAMES` at import.
# * ``key_full_rule``: ``jnp.zeros_like``, ``ones_like``, ``full_like``,
#   ``lax.full`` (and ``empty_like`` before JAX 0.11) of a key array call the
#   key dtype's fill rule, which broadcasts the number into the key's words: on
#   typed indices every id became 0, 1 or the fill value, silently
#   (``jax.tree.map(jnp.ones_like, grads)``, ``optax.tree.full_like``). The
#   rule is wrapped (:func:`_full_rule`) at trace time (so also under ``jit``),
#   for typed indices only: a non-zero or traced numeric fill raises a
#   ``TypeError`` naming ``IndexedSlices`` and the fix; a zero fill
#   (``zeros_like`` mapped over a whole gradient tree: zero values) gives id
#   -1, invalid, so the result is a zero gradient that touches no row (what
#   ``optax.apply_if_finite`` returns on a rejected step); a fill with typed
#   indices (broadcasting an existing id) and empty results are JAX's. Every
#   other key dtype goes to JAX's rule untouched. (``jnp.empty_like`` on JAX
#   >= 0.11 is uninitialized memory, ids and values alike, as JAX documents.)


def _fill_error(fill_value: Any) -> TypeError:
    return TypeError(
        "jnp.ones_like / full_like (or lax.full) of the indices of a jaxslices "
        f"IndexedSlices would replace every row id by {fill_value!r}: generic "
        "code applied an array constructor to every leaf of a gradient tree, "
        "e.g. jax.tree.map(jnp.ones_like, grads) or optax.tree.full_like(grads, "
        "c). Use jaxslices.tree_map_values(fn, grads), which applies fn to the "
        "values of each IndexedSlices and keeps its indices, or densify first "
        "with jaxslices.to_dense(grads). (A zero fill is allowed: "
        "jax.tree.map(jnp.zeros_like, grads) is a zero gradient that touches no "
        "row.) " + FIX
    )


def _is_zero(fill_value: Any) -> bool:
    """A concrete zero (``zeros_like``, ``empty_like``, ``full_like(x, 0)``)."""
    if isinstance(fill_value, jax.core.Tracer):
        return False
    try:
        return bool(np.all(np.asarray(fill_value) == 0))
    except (TypeError, ValueError):
        return False


def _full_rule(jax_full: Any) -> Any:
    """JAX's key fill rule, refusing numeric fills of typed indices (see above)."""

    def full(shape, fill_value, dtype):
        ours = dtype == DTYPE32 or dtype == DTYPE64
        if (
            ours
            and _jax_compat.AVAILABLE["key_full_rule"]
            and not is_typed(fill_value)
            and int(np.prod(shape)) > 0
        ):
            if not _is_zero(fill_value):
                raise _fill_error(fill_value)
            # A zero gradient touches no row: id -1, every word's bits set.
            fill_value = np.uint32(0xFFFFFFFF)
        return jax_full(shape, fill_value, dtype)

    return full


#: Whether each entry above could be applied on this JAX (tests assert both).
NAMES_REGISTERED = _jax_compat.register_key_impl_names(NAMES, TAG)
FULL_RULE_INSTALLED = _jax_compat.wrap_key_full_rule((DTYPE32, DTYPE64), _full_rule)


# ------------------------------------------------ eager error messages


def _raising(name: str, original: Any) -> Any:
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if is_typed(self) and _jax_compat.AVAILABLE["key_array_class"]:
            raise TypeError(
                f"`.{name}` of the indices of a jaxslices IndexedSlices "
                f"(dtype key<{TAG}>): {FIX}"
            )
        return original(self, *args, **kwargs)

    return method


def _with_messages(typed: Any) -> Any:
    """Install the messages on the class of the first concrete typed array.

    Done lazily, not at import: making a concrete array starts JAX's platform
    runtime, and ``jax.distributed.initialize`` must be able to run after
    ``import jaxslices``. Tracers are skipped (their class is not the eager one).
    """
    global MESSAGES_INSTALLED
    if MESSAGES_INSTALLED is None and not isinstance(typed, jax.core.Tracer):
        MESSAGES_INSTALLED = _install_messages(type(typed))
    return typed


def _install_messages(cls: type) -> bool:
    """Make eager abstract methods on our key arrays name IndexedSlices.

    ``cls`` is the class of a concrete typed-indices array. Returns whether the
    messages were installed (``False`` on an untested JAX version or an
    unknown class layout: JAX's ``NotImplementedError`` then stays). The
    class is private to JAX: :func:`jaxslices._jax_compat.patch_key_array_class`
    does the patching and holds the version gate.
    """
    return _jax_compat.patch_key_array_class(cls, _raising)


#: ``None`` until the first concrete typed array is made, then whether the
#: messages could be installed.
MESSAGES_INSTALLED: bool | None = None
