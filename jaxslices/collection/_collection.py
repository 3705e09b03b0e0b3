"""``EmbeddingCollection``: many named tables, stacked, looked up in one call.

Recommendation models read tens of sparse features, each through its own
table (a Criteo DLRM has 26, from 3 rows to millions). TorchRec serves them
with an ``EmbeddingBagCollection`` over a ``KeyedJaggedTensor`` and FBGEMM's
table-batched kernel; this module is the JAX counterpart:

* **Configs.** Each :class:`TableConfig` names a table (rows, dim, dtype,
  combiner, initializer) and the features that read it; several features may
  share one table.
* **Stacked buffers.** Tables of the same ``(dim, dtype)`` live in one
  ``[sum of rows, dim]`` buffer, each at a static row offset; the params are
  ``{buffer name: buffer}`` (e.g. ``{"dim64_float32": ...}``). One call
  (:meth:`EmbeddingCollection.__call__`) maps every feature's ids to buffer
  rows (id + its table's offset) and makes **one** lookup per buffer, so under
  :func:`jaxslices.value_and_grad` the gradient is **one**
  :class:`~jaxslices.IndexedSlices` per buffer, and an optimizer coalesces
  and scatters once per buffer, not once per table.
* **Input.** A :class:`~jaxslices.KeyedJaggedIds` (feature names, flat ids,
  offsets, optional weights; feature-major like TorchRec's
  ``KeyedJaggedTensor``). Output: ``{feature: [B, dim]}`` pooled by the
  table's combiner (``"sum"``, ``"mean"``, ``"sqrtn"``; weighted when the
  input has weights), or ``{feature: [B, L, dim]}`` for a sequence table
  (``combiner=None``, ``L = max_sequence_length``).
* **Ids policy** (as :func:`jaxslices.embedding_lookup`): an id outside
  ``[0, rows)`` of *its own table* reads zeros and gets no gradient (it can
  never reach a neighbouring table's rows); ``check_ids=True`` raises instead,
  naming the feature. In a bag such an id is padding, as in
  :func:`jaxslices.embedding_bag` and the bag layers (one rule,
  :func:`jaxslices._ids.in_bags`): it is not counted by ``"mean"`` or
  ``"sqrtn"``. An empty bag pools to zeros.
* **No max pooling.** TorchRec's ``PoolingType`` has ``SUM``, ``MEAN`` and
  ``NONE`` (FBGEMM's table-batched kernel pools the same ways), so no
  TorchRec model needs one; a collection pools every table of a buffer with
  one segment sum (and the native bag kernel) that a max would split in two.
  ``TableConfig(combiner="max")`` raises and points to
  :func:`jaxslices.embedding_bag` / the bag layers, which have it.
* **Per-table hyperparameters**: :meth:`EmbeddingCollection.scale_by_table`
  (a per-table learning-rate factor) and
  :meth:`EmbeddingCollection.add_decayed_weights_by_table` (per-table weight
  decay) are Optax transforms that find each gradient row's table from the
  static row offsets (:func:`jaxslices.transforms.scale_by_table`).

Cost of one call per buffer: a gather of ``max_total`` rows, a sorted
segment-sum into ``F * B`` bags (``F``: the input's features) and, backward,
the gather of the bags' cotangents; with several buffers each one covers
every slot of the input (slots of other buffers' features are padding).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from . import _buffers
from ._buffers import Buffer
from ._face import CollectionFace

__all__ = ["TableConfig", "EmbeddingCollection", "Buffer"]

Combiner = Literal["sum", "mean", "sqrtn"]
_COMBINERS = ("sum", "mean", "sqrtn", None)
Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


def uniform_initializer(key: jax.Array, shape: tuple[int, ...], dtype: Any):
    """TorchRec's default: ``U(-sqrt(1 / rows), sqrt(1 / rows))``."""
    bound = math.sqrt(1.0 / shape[0])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One table of an :class:`EmbeddingCollection`.

    Args:
      name: the table's name (unique in the collection).
      rows: number of rows ``V``.
      dim: embedding width ``D``.
      features: the feature names that read this table (default: ``(name,)``).
        Several features may share a table; a feature reads one table.
      combiner: how a feature's bag is pooled: ``"sum"`` (TorchRec's default),
        ``"mean"``, ``"sqrtn"``; ``None`` for a sequence table (no pooling).
      initializer: ``(key, shape, dtype) -> array`` (a ``jax.nn.initializers``
        function works); default ``U(-sqrt(1/V), sqrt(1/V))`` as TorchRec.
      dtype: the table's dtype; tables stack by ``(dim, dtype)``.
      max_sequence_length: ``L`` of a sequence table's ``[B, L, dim]`` output
        (required with ``combiner=None``). A longer bag raises an error.

    Example:
      >>> import jaxslices as js
      >>> js.TableConfig("user", rows=1000, dim=16).features
      ('user',)
    """

    name: str
    rows: int
    dim: int
    features: tuple[str, ...] = ()
    combiner: Combiner | None = "sum"
    initializer: Initializer | None = None
    dtype: Any = jnp.float32
    max_sequence_length: int | None = None

    def __post_init__(self):
        where = f"TableConfig({self.name!r})"
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(
                f"TableConfig: `name` must be a non-empty str, got {self.name!r}."
            )
        for field in ("rows", "dim"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(
                    f"{where}: `{field}` must be a positive int, got {v!r}."
                )
            object.__setattr__(self, field, int(v))
        feats = (self.name,) if not self.features else self.features
        if isinstance(feats, str):
            feats = (feats,)
        feats = tuple(feats)
        if not all(isinstance(f, str) and f for f in feats):
            raise TypeError(f"{where}: `features` must be names (str), got {feats!r}.")
        if len(set(feats)) != len(feats):
            raise ValueError(f"{where}: `features` repeat a name: {feats!r}.")
        object.__setattr__(self, "features", feats)
        if self.combiner not in _COMBINERS:
            hint = (
                " A collection has no max pooling (TorchRec's PoolingType is SUM, "
                "MEAN or NONE); pool that feature with jaxslices.embedding_bag("
                "..., combiner='max') or a bag layer (combiner='max') instead."
                if self.combiner == "max"
                else ""
            )
            raise ValueError(
                f"{where}: `combiner` must be one of {_COMBINERS}, got "
                f"{self.combiner!r}.{hint}"
            )
        dtype = jnp.dtype(self.dtype)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(f"{where}: `dtype` must be a float dtype, got {dtype}.")
        object.__setattr__(self, "dtype", dtype)
        L = self.max_sequence_length
        if self.combiner is None:
            if isinstance(L, bool) or not isinstance(L, (int, np.integer)) or L < 1:
                raise ValueError(
                    f"{where}: a sequence table (combiner=None) needs "
                    f"`max_sequence_length`, a positive int, got {L!r}."
                )
            object.__setattr__(self, "max_sequence_length", int(L))
        elif L is not None:
            raise ValueError(
                f"{where}: `max_sequence_length` is for sequence tables "
                f"(combiner=None); this table pools with {self.combiner!r}."
            )


class EmbeddingCollection(CollectionFace):
    """Named tables stacked by ``(dim, dtype)``; one lookup per buffer.

    See the module docstring. The collection is static (hashable, no arrays):
    its params are the dict :meth:`init` returns, ``{buffer name: [rows,
    dim]}``, to be trained with any jaxslices optimizer.

    Args:
      tables: the :class:`TableConfig` s.

    Example:
      >>> import jax, jax.numpy as jnp, jaxslices as js
      >>> coll = js.EmbeddingCollection([
      ...     js.TableConfig("user", rows=100, dim=4),
      ...     js.TableConfig("item", rows=50, dim=4, features=("item", "clicked"),
      ...                    combiner="mean"),
      ... ])
      >>> params = coll.init(jax.random.key(0))
      >>> {k: v.shape for k, v in params.items()}
      {'dim4_float32': (150, 4)}
      >>> kjt = js.KeyedJaggedIds.from_lists(
      ...     {"user": [[7], [3]], "item": [[1], [2]], "clicked": [[1, 4], []]})
      >>> out = coll(params, kjt)
      >>> out["clicked"].shape, bool(jnp.all(out["clicked"][1] == 0))
      ((2, 4), True)
      >>> loss = lambda p: sum(jnp.sum(v ** 2) for v in coll(p, kjt).values())
      >>> js.grad(loss)(params)["dim4_float32"]
      IndexedSlices(float32[150, 4], rows=6)
    """

    def __init__(self, tables: Sequence[TableConfig]):
        tables = tuple(tables)
        if not tables or not all(isinstance(t, TableConfig) for t in tables):
            raise TypeError(
                "EmbeddingCollection: `tables` must be a non-empty sequence of "
                f"TableConfig, got {[type(t).__name__ for t in tables]}."
            )
        names = [t.name for t in tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"EmbeddingCollection: table names repeat: {dup}.")
        owner: dict[str, str] = {}
        for t in tables:
            for f in t.features:
                if f in owner:
                    raise ValueError(
                        f"EmbeddingCollection: feature {f!r} is read by tables "
                        f"{owner[f]!r} and {t.name!r}; a feature reads one table "
                        "(to share a table, list both features on it)."
                    )
                owner[f] = t.name
        self.tables = tables
        self._by_name = {t.name: t for t in tables}
        self.layout = _buffers.stacked(tables)
        self.buffers = self.layout.buffers
        self.features = tuple(owner)
        self._table_of_feature = owner
        self._init = jax.jit(self._build)

    # -- identity -------------------------------------------------------------
    def __eq__(self, other: Any) -> bool:
        return isinstance(other, EmbeddingCollection) and other.tables == self.tables

    def __hash__(self) -> int:
        return hash(self.tables)

    def __repr__(self) -> str:
        bufs = ", ".join(f"{b.name}[{b.rows}, {b.dim}]" for b in self.buffers)
        return f"EmbeddingCollection({len(self.tables)} tables in {bufs})"

    # -- layout ---------------------------------------------------------------
    def table_config(self, table: str) -> TableConfig:
        """The config of ``table``."""
        if table not in self._by_name:
            raise KeyError(
                f"EmbeddingCollection: no table {table!r}; tables: "
                f"{list(self._by_name)}."
            )
        return self._by_name[table]

    def table_of(self, feature: str) -> str:
        """The name of the table ``feature`` reads."""
        if feature not in self._table_of_feature:
            raise KeyError(
                f"EmbeddingCollection: no feature {feature!r}; features: "
                f"{list(self.features)}."
            )
        return self._table_of_feature[feature]

    def placement(self, table: str) -> tuple[str, int]:
        """``(buffer name, first row)`` of ``table`` in the params."""
        self.table_config(table)
        where = self.layout.placement(table)
        return where.buffer, where.base

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """``{buffer name: (rows, dim)}``."""
        return {b.name: b.shape for b in self.buffers}

    # -- params ---------------------------------------------------------------
    def _build(self, key: jax.Array, only: str | None = None) -> dict[str, jax.Array]:
        out = {}
        for b in self.buffers:
            if only is not None and b.name != only:
                continue
            parts = [self._init_table(key, name) for name in b.tables]
            out[b.name] = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
        return out

    def _init_table(self, key: jax.Array, name: str) -> jax.Array:
        t = self._by_name[name]
        init = t.initializer or uniform_initializer
        k = jax.random.fold_in(key, _seed_of(name))
        return jnp.asarray(init(k, (t.rows, t.dim), t.dtype), t.dtype)

    def init_buffer(self, key: jax.Array, name: str) -> jax.Array:
        """One buffer of :meth:`init` (``init(key)[name]``), built alone."""
        if name not in self.shapes:
            raise KeyError(
                f"EmbeddingCollection: no buffer {name!r}; buffers: "
                f"{list(self.shapes)}."
            )
        return self._build(key, name)[name]

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        """The params ``{buffer name: [rows, dim]}``, each table by its initializer.

        A table's values depend on ``key`` and its name only
        (``jax.random.fold_in(key, crc32(name))``), not on the other tables
        or their order. Compiled once per collection (no per-table copies).

        Example:
          >>> import jax, jaxslices as js
          >>> coll = js.EmbeddingCollection([js.TableConfig("a", 5, 4)])
          >>> {k: v.shape for k, v in coll.init(jax.random.key(0)).items()}
          {'dim4_float32': (5, 4)}
        """
        return self._init(key)

    def stack(self, tables: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Params from ``{table name: [rows, dim] array}`` (every table once).

        :meth:`unstack` and :meth:`table` read them back.

        Example:
          >>> import jax.numpy as jnp, jaxslices as js
          >>> coll = js.EmbeddingCollection(
          ...     [js.TableConfig("a", 2, 3), js.TableConfig("b", 1, 3)])
          >>> params = coll.stack({"a": jnp.zeros((2, 3)), "b": jnp.ones((1, 3))})
          >>> params["dim3_float32"].shape
          (3, 3)
          >>> coll.table(params, "b").tolist()
          [[1.0, 1.0, 1.0]]
          >>> sorted(coll.unstack(params))
          ['a', 'b']
        """
        missing = [n for n in self._by_name if n not in tables]
        extra = [n for n in tables if n not in self._by_name]
        if missing or extra:
            raise ValueError(
                f"EmbeddingCollection.stack: need exactly the tables "
                f"{list(self._by_name)}; missing {missing}, unknown {extra}."
            )
        out = {}
        for b in self.buffers:
            parts = []
            for name in b.tables:
                t, x = self._by_name[name], jnp.asarray(tables[name])
                if x.shape != (t.rows, t.dim):
                    raise ValueError(
                        f"EmbeddingCollection.stack: table {name!r} must have shape "
                        f"{(t.rows, t.dim)}, got {tuple(x.shape)}."
                    )
                parts.append(x.astype(t.dtype))
            out[b.name] = jnp.concatenate(parts)
        return out

    def unstack(self, params: Mapping[str, Any]) -> dict[str, jax.Array]:
        """``{table name: [rows, dim]}`` views of the params (static slices)."""
        return {t.name: self.table(params, t.name) for t in self.tables}

    def table(self, params: Mapping[str, Any], table: str) -> jax.Array:
        """The rows of one table in the params."""
        buf, start = self.placement(table)
        self._check_params(params, "EmbeddingCollection.table")
        return params[buf][start : start + self._by_name[table].rows]

    # -- lookups and per-table transforms: CollectionFace ----------------------
    def _lookup_source(self) -> tuple[Any, Any, Mapping[str, Any]]:
        return self, self.layout, {}


# ------------------------------------------------------------------ internals


def _seed_of(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF
