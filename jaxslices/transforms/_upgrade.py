"""Optimizer states saved before the row-major layout, read into the new one.

Until the row-major state, :func:`jaxslices.lazy_adam` (and
:func:`~jaxslices.lazy_adamw`, :func:`~jaxslices.scale_by_lazy_adam`) kept
two trees ``mu`` and ``nu``, and :func:`jaxslices.ftrl` two trees
``accumulator`` and ``linear``; they are now one packed tree each
(``mu_nu``, ``n_z``: a row's states side by side). A pickle of the old
layout loads as the new one by itself (the state classes accept the old
fields). A Flax msgpack or Orbax checkpoint is restored *without a target*
(``flax.serialization.msgpack_restore(data)``, ``ckptr.restore(path)``),
and :func:`upgrade_state` turns what comes back into the structure of the
new ``tx.init(params)``.

Since the low-precision step count, a constant learning rate's state is a
step counter (a :class:`~jaxslices.ScaleByScheduleState`) where the params
hold a bfloat16 or float16 leaf, and was empty before: a checkpoint saved
without it upgrades with the count at 0 (the rounding's per-step seeds
start again; every value is the checkpoint's).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._rowwise import pack_states
from ._transform import ScaleByScheduleState

__all__ = ["upgrade_state"]

# The packed field of each row-major state, and the old fields it replaces.
PACKED_FIELDS = {"mu_nu": ("mu", "nu"), "n_z": ("accumulator", "linear")}


def _key(k: Any) -> str:
    """A path entry as a string: ``['emb']``, ``.mu``, ``[1]`` all as names."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _flat(tree: Any) -> dict[tuple[str, ...], Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(_key(k) for k in path): x for path, x in leaves}


def upgrade_state(restored: Any, target: Any) -> Any:
    """A state restored from a checkpoint of the old layout, as ``target``'s tree.

    Matches leaves by their path, whatever the containers became on the way
    (a restore without a target gives dicts for named tuples and lists or
    ``{"0": ...}`` dicts for tuples), and packs the old separate moments
    (``mu`` and ``nu``; FTRL's ``accumulator`` and ``linear``) into the new
    packed field. Leaves saved in the new layout already are taken as they
    are, so upgrading a new checkpoint returns it unchanged. A step counter
    (:class:`~jaxslices.ScaleByScheduleState`) the checkpoint holds nothing
    of starts at 0: a low-precision table's optimizer counts its steps since
    the per-step rounding seed, and its state was empty before.

    Args:
      restored: the restored tree: ``flax.serialization.msgpack_restore(data)``
        or Orbax's ``ckptr.restore(path)`` without a target.
      target: the state of the new layout, e.g. ``tx.init(params)`` or
        ``jax.eval_shape(tx.init, params)`` (only its structure, shapes and
        dtypes are used).

    Returns:
      ``target``'s tree holding the restored values.

    Raises:
      ValueError: a leaf of ``target`` is not in ``restored`` (in either
        layout) or has another shape there; the message names the leaf.

    Example:
      >>> import jax.numpy as jnp, jaxslices
      >>> tx = jaxslices.lazy_adam(0.1)
      >>> old = {"0": {"count": 3, "mu": jnp.ones((2, 1)), "nu": jnp.zeros((2, 1))},
      ...        "1": {}}  # what msgpack_restore gives for the old layout
      >>> state = jaxslices.upgrade_state(old, tx.init(jnp.zeros((2, 1))))
      >>> state[0].mu_nu[:, :, 0], int(state[0].count)
      (Array([[1., 0.],
             [1., 0.]], dtype=float32), 3)
    """
    old = _flat(restored)
    counters = _new_step_counters(target, old)

    def leaf(path, t):
        keys = tuple(_key(k) for k in path)
        if keys in old:
            x = old[keys]
        elif keys in counters:
            x = jnp.zeros_like(t)
        else:
            x = _packed_from_old(keys, old)
        x = jnp.asarray(x)
        want = tuple(np.shape(t))
        if tuple(x.shape) != want:
            raise ValueError(
                f"jaxslices.upgrade_state: leaf {jax.tree_util.keystr(path)} has "
                f"shape {tuple(x.shape)} in the checkpoint but {want} in `target`; "
                "was the checkpoint saved for other params?"
            )
        return x.astype(jnp.result_type(t))

    return jax.tree_util.tree_map_with_path(leaf, target)


def _new_step_counters(target: Any, old: dict) -> set[tuple[str, ...]]:
    """The ``count`` paths of ``target``'s step counters that the checkpoint
    holds nothing of (saved when that state was empty)."""

    def is_counter(x):
        return isinstance(x, ScaleByScheduleState)

    out = set()
    for path, x in jax.tree_util.tree_flatten_with_path(target, is_leaf=is_counter)[0]:
        if not is_counter(x):
            continue
        here = tuple(_key(k) for k in path)
        if not any(k[: len(here)] == here for k in old):
            out.add((*here, "count"))
    return out


def _packed_from_old(keys: tuple[str, ...], old: dict) -> Any:
    for i, k in enumerate(keys):
        if k in PACKED_FIELDS:
            names = [keys[:i] + (f,) + keys[i + 1 :] for f in PACKED_FIELDS[k]]
            if all(n in old for n in names):
                shapes = [tuple(np.shape(old[n])) for n in names]
                if len(set(shapes)) > 1:
                    raise ValueError(
                        f"jaxslices.upgrade_state: the old fields "
                        f"{', '.join('/'.join(n) for n in names)} have shapes "
                        f"{' and '.join(map(str, shapes))} in the checkpoint; they "
                        "must be equal (was it saved for other params?)."
                    )
                return pack_states(*(old[n] for n in names))
    raise ValueError(
        f"jaxslices.upgrade_state: the checkpoint has no leaf at "
        f"{'/'.join(keys)} (nor the old separate fields it replaces). Restore "
        "the checkpoint without a target and pass what comes back; `target` "
        "must be the state of the same optimizer (tx.init(params))."
    )
