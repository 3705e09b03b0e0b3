"""Internal: id handling shared by the framework layers (nnx, linen, equinox).

The stock Flax and Equinox layers index with ``jnp.take`` / ``table[ids]``,
where negative ids count from the end; the drop-in layers keep that, and
:func:`jaxslices.embedding_lookup` then reads zeros (no gradient) for what is
still out of range.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def wrap_negative(ids: jax.Array, num_rows: int) -> jax.Array:
    """Negative ids count from the end, as in the stock layers."""
    return jnp.where(ids < 0, ids + num_rows, ids)


def integer_ids(inputs: Any, where: str) -> jax.Array:
    """``inputs`` as an array, or a ``ValueError`` naming ``where`` if not integer."""
    inputs = jnp.asarray(inputs)
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
        raise ValueError(
            f"{where}: input ids must be integers, got {inputs.dtype.name}"
            f"{list(inputs.shape)}. Cast them, e.g. `ids.astype(jnp.int32)`."
        )
    return inputs
