"""The managed layers' argument checks, for the framework layers that hold a
:class:`~jaxslices.ManagedCollision` table (the NNX, Linen and Equinox
``ManagedEmbedBag`` / ``ManagedEmbeddingBag``): one check, one message.
"""

from __future__ import annotations

from typing import Any

from ._table import ManagedCollision

__all__ = ["LAYER_COMBINERS", "check_layer"]


LAYER_COMBINERS = ("mean", "sum", "sqrtn")


def check_layer(where: str, manager: Any, combiner: str) -> None:
    """A managed bag layer's arguments (the NNX, Linen and Equinox layers).

    Example:
      >>> from jaxslices.managed._checks import check_layer
      >>> check_layer("Layer", None, "sum")
      Traceback (most recent call last):
      TypeError: Layer: `manager` must be a jaxslices.ManagedCollision, got NoneType.
    """
    if not isinstance(manager, ManagedCollision):
        raise TypeError(
            f"{where}: `manager` must be a jaxslices.ManagedCollision, got "
            f"{type(manager).__name__}."
        )
    if combiner not in LAYER_COMBINERS:
        raise ValueError(
            f"{where}: `combiner` must be 'mean', 'sum' or 'sqrtn', got {combiner!r}."
        )
