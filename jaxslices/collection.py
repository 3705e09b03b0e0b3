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
  naming the feature. A bag's mean or sqrtn counts every id in it (an
  out-of-range id reads zeros but counts), as in ``embedding_bag``; an empty
  bag pools to zeros.
* **Per-table hyperparameters**: :meth:`EmbeddingCollection.scale_by_table`
  (a per-table learning-rate factor) and
  :meth:`EmbeddingCollection.add_decayed_weights_by_table` (per-table weight
  decay) are Optax transforms that find each gradient row's table from the
  static row offsets (:mod:`jaxslices.per_table`).

Cost of one call per buffer: a gather of ``max_total`` rows, a sorted
segment-sum into ``F * B`` bags (``F``: the input's features) and, backward,
the gather of the bags' cotangents; with several buffers each one covers
every slot of the input (slots of other buffers' features are padding).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from . import _errors, _ids
from .embedding import embedding_lookup
from .keyed import KeyedJaggedIds

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
            raise ValueError(
                f"{where}: `combiner` must be one of {_COMBINERS}, got "
                f"{self.combiner!r}."
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


@dataclasses.dataclass(frozen=True)
class Buffer:
    """Where tables live: one ``[rows, dim]`` buffer of stacked tables.

    ``tables[i]`` occupies rows ``starts[i] : starts[i] + sizes[i]``.
    """

    name: str
    dim: int
    dtype: Any
    tables: tuple[str, ...]
    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.starts[-1] + self.sizes[-1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.dim)


class EmbeddingCollection:
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
        groups: dict[tuple[int, Any], list[TableConfig]] = {}
        for t in tables:
            groups.setdefault((t.dim, t.dtype), []).append(t)
        buffers = []
        for (dim, dtype), ts in groups.items():
            sizes = tuple(t.rows for t in ts)
            starts = tuple(int(s) for s in np.cumsum((0,) + sizes[:-1]))
            buffers.append(
                Buffer(
                    f"dim{dim}_{dtype.name}",
                    dim,
                    dtype,
                    tuple(t.name for t in ts),
                    starts,
                    sizes,
                )
            )
        self.buffers = tuple(buffers)
        self._buffer_of = {n: b for b in buffers for n in b.tables}
        self._start = {
            n: s for b in buffers for n, s in zip(b.tables, b.starts, strict=True)
        }
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
        return self._buffer_of[table].name, self._start[table]

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """``{buffer name: (rows, dim)}``."""
        return {b.name: b.shape for b in self.buffers}

    # -- params ---------------------------------------------------------------
    def _build(self, key: jax.Array) -> dict[str, jax.Array]:
        out = {}
        for b in self.buffers:
            parts = []
            for name in b.tables:
                t = self._by_name[name]
                init = t.initializer or uniform_initializer
                k = jax.random.fold_in(key, _seed_of(name))
                parts.append(jnp.asarray(init(k, (t.rows, t.dim), t.dtype), t.dtype))
            out[b.name] = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
        return out

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        """The params ``{buffer name: [rows, dim]}``, each table by its initializer.

        A table's values depend on ``key`` and its name only
        (``jax.random.fold_in(key, crc32(name))``), not on the other tables
        or their order. Compiled once per collection (no per-table copies).
        """
        return self._init(key)

    def stack(self, tables: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Params from ``{table name: [rows, dim] array}`` (every table once)."""
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

    def _check_params(self, params: Any, where: str) -> None:
        if not isinstance(params, Mapping):
            raise TypeError(
                f"{where}: `params` must be the dict of buffers that `init` returns "
                f"({list(self.shapes)}), got {type(params).__name__}."
            )
        for b in self.buffers:
            x = params.get(b.name)
            shape = getattr(x, "shape", None)
            if shape is None or tuple(shape) != b.shape:
                got = "missing" if x is None else f"shape {shape}"
                raise ValueError(
                    f"{where}: buffer {b.name!r} must have shape {b.shape}, got "
                    f"{got}. Pass the params `EmbeddingCollection.init` (or "
                    "`stack`) made for this collection."
                )

    # -- lookup ---------------------------------------------------------------
    def __call__(
        self,
        params: Mapping[str, Any],
        features: KeyedJaggedIds,
        *,
        check_ids: bool = False,
    ) -> dict[str, jax.Array]:
        """Pooled (or sequence) embeddings of every feature of the collection.

        Args:
          params: ``{buffer name: buffer}`` (:meth:`init`).
          features: :class:`~jaxslices.KeyedJaggedIds` holding at least every
            feature of the collection (other keys are ignored).
          check_ids: raise an error (also under ``jit``) if an id is outside
            ``[0, rows)`` of its feature's table.

        Returns:
          ``{feature: [B, dim]}`` for pooled tables, ``{feature: [B, L, dim]}``
          for sequence tables, in the collection's feature order.
        """
        where = "EmbeddingCollection"
        self._check_params(params, where)
        if not isinstance(features, KeyedJaggedIds):
            raise TypeError(
                f"{where}: `features` must be a jaxslices.KeyedJaggedIds, got "
                f"{type(features).__name__}. Build one with "
                "KeyedJaggedIds.from_lengths / from_lists / from_padded."
            )
        missing = [f for f in self.features if f not in features.keys]
        if missing:
            raise ValueError(
                f"{where}: the input lacks features {missing} (it has "
                f"{list(features.keys)})."
            )
        values = jnp.asarray(features.values)
        if not jnp.issubdtype(values.dtype, jnp.integer):
            raise TypeError(
                f"{where}: ids must be integers, got {values.dtype}. Cast them, "
                "e.g. `values.astype(jnp.int32)`."
            )
        layout = _Layout.of(self, features.keys)
        seg = _bag_of_slot(features.offsets, features.max_total)
        kid = seg // features.batch_size  # == F for unused slots
        valid = _valid(values, layout.rows, kid)
        if check_ids:
            values = _check(values, valid, layout, kid, features, where)
        weights = features.weights
        out: dict[str, jax.Array] = {}
        for b in self.buffers:
            out.update(
                _lookup_buffer(
                    params[b.name],
                    b,
                    layout,
                    features,
                    values,
                    valid,
                    seg,
                    kid,
                    weights,
                )
            )
        return {f: out[f] for f in self.features}

    # -- per-table hyperparameters -------------------------------------------
    def scale_by_table(self, factors: Mapping[str, Any], *, default: Any = 1.0):
        """See :func:`jaxslices.per_table.scale_by_table`."""
        from .per_table import scale_by_table

        return scale_by_table(self, factors, default=default)

    def add_decayed_weights_by_table(
        self, rates: Mapping[str, Any], *, default: Any = 0.0
    ):
        """See :func:`jaxslices.per_table.add_decayed_weights_by_table`."""
        from .per_table import add_decayed_weights_by_table

        return add_decayed_weights_by_table(self, rates, default=default)


# ------------------------------------------------------------------ internals


def _seed_of(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Per input key (and one sentinel for unused slots): static facts.

    Arrays have ``F + 1`` entries (``F`` = the input's keys): the last is for
    slots past ``offsets[-1]``.
    """

    keys: tuple[str, ...]
    rows: np.ndarray  # table rows (0: not a feature of the collection)
    buffer: tuple[str | None, ...]
    start: np.ndarray  # first row of the key's table in its buffer
    combiner: tuple[Any, ...]
    seq_len: np.ndarray  # sequence tables: L, else 0

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(coll: EmbeddingCollection, keys: tuple[str, ...]) -> _Layout:
        rows, buf, start, comb, seq = [], [], [], [], []
        for k in keys:
            if k in coll._table_of_feature:
                t = coll._by_name[coll._table_of_feature[k]]
                rows.append(t.rows)
                buf.append(coll._buffer_of[t.name].name)
                start.append(coll._start[t.name])
                comb.append(t.combiner)
                seq.append(t.max_sequence_length or 0)
            else:
                rows.append(0)
                buf.append(None)
                start.append(0)
                comb.append("sum")
                seq.append(0)
        return _Layout(
            keys,
            np.array(rows + [0], np.int64),
            tuple(buf) + (None,),
            np.array(start + [0], np.int64),
            tuple(comb) + ("sum",),
            np.array(seq + [0], np.int64),
        )


def _bag_of_slot(offsets: Any, max_total: int) -> jax.Array:
    """The bag of each slot ``[max_total]``; ``num_bags`` for unused slots.

    ``#{b : offsets[b + 1] <= slot}``: ends are counted into a histogram
    (scatter-add) whose running sum is the bag index; ``O(max_total + bags)``.
    """
    offsets = jnp.asarray(offsets).astype(jnp.int32)
    marks = jnp.zeros(max_total + 1, jnp.int32).at[offsets[1:]].add(1, mode="drop")
    return jnp.cumsum(marks[:max_total]).astype(jnp.int32)


def _valid(values: jax.Array, rows: np.ndarray, kid: jax.Array) -> jax.Array:
    """``0 <= id < rows of its key's table``, in the ids' own dtype."""
    info = np.iinfo(values.dtype)
    big = rows > info.max  # every non-negative id of this dtype is valid
    lim = jnp.asarray(np.where(big, info.max, rows).astype(values.dtype))[kid]
    ok = values < lim
    if big.any():
        ok = ok | jnp.asarray(big)[kid]
    if info.min < 0:
        ok = ok & (values >= 0)
    return ok & jnp.asarray(rows > 0)[kid]


def _bad_ids_error(n, key, lo, hi, *, keys, rows, where):
    k = keys[key]
    return ValueError(
        f"{where}(check_ids=True): {n} {'id is' if n == 1 else 'ids are'} out of "
        f"range of its table (the first in feature {k!r}, whose table has "
        f"{int(rows[key])} rows; the out-of-range ids have min {lo} and max {hi}). "
        "Out-of-range ids would read zeros and get no gradient; fix the ids, or "
        "pass check_ids=False to treat them as padding."
    )


def _check(values, valid, layout, kid, features, where):
    member = jnp.asarray(layout.rows > 0)[kid]
    bad = member & ~valid
    F = len(layout.keys)
    info = jnp.iinfo(values.dtype)
    return _errors.raise_if(
        bad,
        values,
        functools.partial(
            _bad_ids_error, keys=layout.keys, rows=layout.rows, where=where
        ),
        jnp.sum(bad.astype(jnp.int32)),
        jnp.min(jnp.where(bad, kid, F)),
        jnp.min(jnp.where(bad, values, jnp.array(info.max, values.dtype))),
        jnp.max(jnp.where(bad, values, jnp.array(info.min, values.dtype))),
        reduce=("sum", "min", "min", "max"),
    )


def _seq_overflow_error(n, key, *, keys, seq_len, where):
    return ValueError(
        f"{where}: {n} {'bag is' if n == 1 else 'bags are'} longer than "
        f"max_sequence_length (the first in feature {keys[key]!r}, L = "
        f"{int(seq_len[key])}). Raise the table's max_sequence_length or cut "
        "the bags."
    )


def _lookup_buffer(table, b, layout, features, values, valid, seg, kid, weights):
    """``{feature: output}`` for the features of buffer ``b``: one lookup."""
    member = np.array([bn == b.name for bn in layout.buffer])
    feats = [k for k, m in zip(layout.keys, member[:-1], strict=True) if m]
    if not feats:
        return {}
    F, B = len(layout.keys), features.batch_size
    idx = _ids.index_dtype(b.rows)
    ok = valid & jnp.asarray(member)[kid]
    start = jnp.asarray(layout.start.astype(np.dtype(idx)))[kid]
    gids = jnp.where(ok, values.astype(idx) + start, jnp.asarray(b.rows, idx))
    rows = embedding_lookup(table, gids)  # the one gather (and sparse gradient)
    out = {}
    pooled = [k for k in feats if layout.combiner[layout.keys.index(k)] is not None]
    seq = [k for k in feats if layout.combiner[layout.keys.index(k)] is None]
    w = None if weights is None else jnp.asarray(weights).astype(rows.dtype)
    if pooled:
        contrib = rows if w is None else rows * w[:, None]
        sums = jax.ops.segment_sum(
            contrib, seg, num_segments=F * B + 1, indices_are_sorted=True
        )[: F * B]
        combs = {layout.combiner[layout.keys.index(k)] for k in pooled}
        if combs != {"sum"}:
            sums = sums * _bag_scale(layout, features, w, seg, F * B, rows.dtype)
        sums = sums.reshape(F, B, b.dim)
        for k in pooled:
            out[k] = sums[layout.keys.index(k)]
    if seq:
        out.update(_sequences(rows, b, layout, features, seq, seg, kid))
    return out


def _bag_scale(layout, features, w, seg, n_bags, dtype):
    """``[F * B, 1]``: 1 for sum, ``1 / sum(w)`` for mean, ``1 / sqrt(sum w^2)``."""
    B = features.batch_size
    if w is None:
        n = features.lengths.astype(dtype)
        mean_d, sqrtn_d = n, jnp.sqrt(n)
    else:
        mean_d = jax.ops.segment_sum(w, seg, n_bags + 1, indices_are_sorted=True)
        sq = jax.ops.segment_sum(w * w, seg, n_bags + 1, indices_are_sorted=True)
        mean_d, sqrtn_d = mean_d[:n_bags], jnp.sqrt(sq[:n_bags])
    code = np.array(
        [{"mean": 1, "sqrtn": 2}.get(c, 0) for c in layout.combiner[:-1]], np.int32
    )
    code = jnp.asarray(np.repeat(code, B))
    denom = jnp.where(code == 1, mean_d, jnp.where(code == 2, sqrtn_d, 1))
    denom = denom.astype(dtype)
    safe = jnp.where(denom == 0, jnp.ones((), dtype), denom)
    scale = jnp.where(denom == 0, jnp.zeros((), dtype), 1 / safe)
    return scale[:, None]


def _sequences(rows, b, layout, features, seq, seg, kid):
    """``{feature: [B, L, dim]}`` of the sequence features (zeros past a bag)."""
    F, B, N = len(layout.keys), features.batch_size, features.max_total
    L = int(max(layout.seq_len[layout.keys.index(k)] for k in seq))
    is_seq = np.array([k in seq for k in layout.keys] + [False])
    offsets = jnp.asarray(features.offsets).astype(jnp.int32)
    slot = jnp.arange(N, dtype=jnp.int32)
    pos = slot - offsets[jnp.minimum(seg, F * B)]
    lim = jnp.asarray(layout.seq_len.astype(np.int32))[kid]
    mine = jnp.asarray(is_seq)[kid]
    over = mine & (pos >= lim)
    total = offsets[-1]
    over = over & (slot < total)
    pos = _errors.raise_if(
        over,
        pos,
        functools.partial(
            _seq_overflow_error,
            keys=layout.keys,
            seq_len=layout.seq_len,
            where="EmbeddingCollection",
        ),
        jnp.sum(over.astype(jnp.int32)),
        jnp.min(jnp.where(over, kid, F)),
        reduce=("sum", "min"),
    )
    target = jnp.where(mine & (pos < lim), seg * L + pos, F * B * L)
    out = jnp.zeros((F * B * L, b.dim), rows.dtype).at[target].add(rows, mode="drop")
    out = out.reshape(F, B, L, b.dim)
    return {
        k: out[layout.keys.index(k), :, : layout.seq_len[layout.keys.index(k)]]
        for k in seq
    }
