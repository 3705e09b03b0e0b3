"""The lookups of an ``EmbeddingCollection``: one gather per buffer, then pooling.

Two input forms, one rule (:mod:`jaxslices.collection`'s docstring):

* **jagged** (:class:`~jaxslices.KeyedJaggedIds`): every slot's bag comes
  from the offsets (:func:`jaxslices.jagged.segment_ids`), its feature from
  the bag; pooling is a segment sum of the gathered rows into the bags;
* **padded** (``{feature: [B, L] ids}``): the ids are stacked to
  ``[F, B, L]``; pooling is a sum over ``L``, no scatter at all (the fast
  path for fixed-length features such as Criteo's one id per feature).

Which slots count in a bag is the library's one bags rule
(:func:`jaxslices._ids.in_bags`, per table): an id outside ``[0, rows)`` of
its own table, or equal to ``padding_id``, adds no row, weighs nothing in
a ``"mean"`` / ``"sqrtn"`` denominator and gets no gradient, on the XLA
path and the native one alike. Per buffer, every counted id becomes a
buffer row (by its table's :class:`~jaxslices.collection._buffers.Placement`: the
table's first row plus the id on one device; padding ``V`` for every other
slot, and for features of other buffers) and one
:func:`jaxslices.embedding_lookup` reads them all, so under
``value_and_grad`` the buffer's gradient is one ``IndexedSlices``. The row
ids are materialised once (``optimization_barrier``): XLA:CPU would
otherwise fuse the index arithmetic into every ``[N, dim]`` consumer and
redo it per element.

Results per buffer are ``[B, F_b, dim]`` (batch-major) or ``[F_b, B, dim]``
(feature-major), ``F_b`` the buffer's pooled features in the collection's
order; sequence features come out as ``[B, L, dim]``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _errors, _ids, _tape
from ..embedding import combiner_scale, embedding_lookup, pool
from ..jagged import segment_ids
from ..kernels import _path as kernel_path
from ..keyed import KeyedJaggedIds, pad_bags, padded_features
from ._buffers import placed_rows

WHERE = "EmbeddingCollection"


@dataclasses.dataclass(frozen=True)
class Keys:
    """Static facts per input key, plus one sentinel entry for unused slots."""

    keys: tuple[str, ...]
    rows: np.ndarray  # table rows (0: not a feature of the collection)
    buffer: tuple[Any, ...]  # buffer name or None
    start: np.ndarray  # the table's row 0 in its buffer (placement base)
    chunk: np.ndarray  # rows per chunk (row-wise plans; else the table's rows)
    stride: np.ndarray  # rows between chunks / pieces
    combiner: tuple[Any, ...]
    seq_len: np.ndarray  # sequence tables: L, else 0

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(coll: Any, layout: Any, keys: tuple[str, ...]) -> Keys:
        rows, buf, start, chunk, stride, comb, seq = [], [], [], [], [], [], []
        for k in keys:
            if k in coll._table_of_feature:
                t = coll.table_config(coll.table_of(k))
                where = layout.placement(t.name)
                rows.append(t.rows)
                buf.append(where.buffer)
                start.append(where.base)
                chunk.append(where.chunk)
                stride.append(where.stride)
                comb.append(t.combiner)
                seq.append(t.max_sequence_length or 0)
            else:
                rows.append(0)
                buf.append(None)
                start.append(0)
                chunk.append(1)
                stride.append(0)
                comb.append("sum")
                seq.append(0)
        return Keys(
            keys,
            np.array(rows + [0], np.int64),
            tuple(buf) + (None,),
            np.array(start + [0], np.int64),
            np.array(chunk + [1], np.int64),
            np.array(stride + [0], np.int64),
            tuple(comb) + ("sum",),
            np.array(seq + [0], np.int64),
        )

    def pooled_of(self, buffer: str) -> list[int]:
        """Positions of the buffer's pooled features among the keys."""
        return [
            i
            for i, (b, c) in enumerate(
                zip(self.buffer[:-1], self.combiner[:-1], strict=True)
            )
            if b == buffer and c is not None
        ]

    def sequences_of(self, buffer: str) -> list[int]:
        return [
            i
            for i, (b, c) in enumerate(
                zip(self.buffer[:-1], self.combiner[:-1], strict=True)
            )
            if b == buffer and c is None
        ]

    def read_by(self, layout: Any):
        """``(buffer, its pooled features, its sequence features)`` per buffer
        that a key reads (positions among the keys)."""
        for b in layout.buffers:
            pos, seq = self.pooled_of(b.name), self.sequences_of(b.name)
            if pos or seq:
                yield b, pos, seq


def lookup(
    coll: Any,
    layout: Any,
    params: Mapping[str, Any],
    features: Any,
    *,
    padding_id: int | None,
    weights: Any,
    check_ids: bool,
    batch_major: bool,
    gathers: Mapping[str, Any] | None = None,
) -> tuple[dict[str, tuple[list[str], jax.Array]], dict[str, jax.Array]]:
    """``({buffer: (its pooled features, pooled array)}, {feature: sequence})``.

    The pooled features of a buffer are in the collection's order.
    ``gathers``: ``{buffer name: gather(table, rows, batch_dim)}`` for the
    buffers a sharding plan routes (:func:`jaxslices.sharding._routing.gather`);
    the others are read with :func:`jaxslices.embedding_lookup` (or the
    native bag kernel).
    """
    gathers = dict(gathers or {})
    if isinstance(features, KeyedJaggedIds):
        if padding_id is not None or weights is not None:
            raise ValueError(
                f"{WHERE}: `padding_id` and `weights` are for padded inputs (a "
                "dict of [B, L] ids); a KeyedJaggedIds has no padding and carries "
                "its own weights."
            )
        return _jagged(coll, layout, params, features, check_ids, batch_major, gathers)
    if isinstance(features, Mapping):
        return _padded(
            coll,
            layout,
            params,
            features,
            padding_id,
            weights,
            check_ids,
            batch_major,
            gathers,
        )
    raise TypeError(
        f"{WHERE}: `features` must be a jaxslices.KeyedJaggedIds or a dict "
        f"{{feature: [B, L] ids}}, got {type(features).__name__}. Build a "
        "KeyedJaggedIds with KeyedJaggedIds.from_lengths / from_lists."
    )


def per_feature(
    pooled: Mapping[str, tuple[list[str], jax.Array]], batch_major: bool
) -> dict[str, jax.Array]:
    """``{feature: [B, dim]}`` from :func:`lookup`'s pooled buffers.

    One split per buffer, not a slice per feature: the transpose of a split is
    one concatenate, that of ``F`` slices ``F`` padded copies summed.
    """
    axis = 1 if batch_major else 0
    out = {}
    for names, x in pooled.values():
        parts = jax.lax.split(x, (1,) * len(names), axis=axis)
        out.update({n: jnp.squeeze(p, axis) for n, p in zip(names, parts, strict=True)})
    return out


def _missing(coll: Any, keys: Any) -> None:
    missing = [f for f in coll.features if f not in keys]
    if missing:
        raise ValueError(
            f"{WHERE}: the input lacks features {missing} (it has {list(keys)})."
        )


def _as_ids(x: Any, what: str) -> jax.Array:
    return _ids.to_jax(x, f"{WHERE} ({what})")


def _bad_ids_error(n, key, lo, hi, *, keys, rows):
    return ValueError(
        f"{WHERE}(check_ids=True): {n} {'id is' if n == 1 else 'ids are'} out of "
        f"range of its table (the first in feature {keys[key]!r}, whose table has "
        f"{int(rows[key])} rows; the out-of-range ids have min {lo} and max {hi}). "
        f"{_ids.OUT_OF_RANGE_HINT}"
    )


def _check(values, bad, key_of, spec, guard):
    """Raise (also under ``jit``) if any ``bad``; returns ``guard``."""
    if values.size == 0:  # an empty batch: no id to check
        return guard
    F = len(spec.keys)
    info = jnp.iinfo(values.dtype)
    return _errors.raise_if(
        bad,
        guard,
        functools.partial(_bad_ids_error, keys=spec.keys, rows=spec.rows),
        jnp.sum(bad.astype(jnp.int32)),
        jnp.min(jnp.where(bad, key_of, F)),
        jnp.min(jnp.where(bad, values, jnp.array(info.max, values.dtype))),
        jnp.max(jnp.where(bad, values, jnp.array(info.min, values.dtype))),
        reduce=("sum", "min", "min", "max"),
    )


def _row_ids(values, ok, spec, key, b, members):
    """Buffer rows of the ids (``[..., pieces]`` when ``b.pieces > 1``).

    ``key``: each id's key position (broadcast with ``values``); ``members``:
    the key positions in this buffer. The placement of each id's table gives
    ``base + (id // chunk) * stride + id % chunk`` (plus ``j * stride`` for
    piece ``j``); ids that are not ``ok`` go to the padding row.
    """
    idx = np.dtype(_ids.index_dtype(b.rows))
    v = values.astype(idx)
    base = jnp.asarray(spec.start.astype(idx))[key]
    stride = jnp.asarray(spec.stride.astype(idx))[key]
    if np.any(spec.chunk[members] < spec.rows[members]):  # row-wise chunks
        chunk = jnp.asarray(spec.chunk.astype(idx))[key]
        row = placed_rows(v, base, chunk, stride)
    else:
        row = base + v
    if b.pieces > 1:  # column-wise: piece j of a row is `stride` rows further
        row = row[..., None] + stride[..., None] * jnp.arange(b.pieces, dtype=idx)
        ok = ok[..., None]
    return jnp.where(ok, row, jnp.asarray(b.rows, idx))


def _gather_rows(table, gids, b, gather=None, batch_dim=0):
    """The one gather of a buffer; ``[..., width]`` rows.

    ``gather``: a plan's routed gather of the buffer (``batch_dim``: the
    dimension of ``gids`` split over the devices); default
    :func:`jaxslices.embedding_lookup`.
    """
    if gather is None:
        rows = embedding_lookup(table, gids)
    else:
        rows = gather(table, gids, batch_dim)
    if b.pieces > 1:
        rows = rows.reshape(*rows.shape[:-2], b.width)
    return rows


# ------------------------------------------------------------------- padded

_over_bag = functools.partial(jnp.sum, axis=-1)  # a padded bag's slots: the last axis


def _padded(
    coll, lay, params, features, padding_id, weights, check_ids, batch_major, gathers
):
    _missing(coll, features)
    spec = Keys.of(coll, lay, tuple(coll.features))
    arrs, ws, L, dtype = padded_features(features, coll.features, weights, WHERE)
    ids = jnp.stack([pad_bags(a.astype(dtype), L, 0) for a in arrs])  # [F, B, L]
    real = jnp.stack([pad_bags(jnp.ones(a.shape, bool), L, False) for a in arrs])
    F = len(arrs)
    key = np.arange(F).reshape(F, 1, 1)
    if check_ids:  # the caller's non-padding ids
        present = _ids.not_padding(ids, padding_id)
        present = real if present is None else real & present
        bad = present & ~_ids.valid_per_table(ids, spec.rows, key)
        ids = _check(ids, bad, jnp.broadcast_to(jnp.asarray(key), ids.shape), spec, ids)
    # the bags rule: valid non-padding ids count, not the slots added to reach L
    counted = _ids.in_bags(ids, spec.rows, padding_id, table=key) & real
    w = None if ws is None else jnp.stack([pad_bags(x, L, 0) for x in ws])
    fa = 1 if batch_major else 0  # the feature axis of ids, rows and results

    def arrange(x):  # [F_b, B, ...] -> the result's layout
        return jnp.swapaxes(x, 0, 1) if batch_major else x

    pooled, seqs = {}, {}
    for b, pos, seq in spec.read_by(lay):
        sel = np.array(pos + seq)
        key_b = arrange(np.broadcast_to(sel.reshape(-1, 1, 1), (len(sel), 1, 1)))
        gids = _row_ids(arrange(ids[sel]), arrange(counted[sel]), spec, key_b, b, sel)
        gids = jax.lax.optimization_barrier(gids)
        gather = gathers.get(b.name)
        if not seq and gather is None and _native(params[b.name], gids, b):
            wts = None if w is None else arrange(counted[sel] * w[sel])
            c = arrange(counted[sel]).astype(jnp.float32) if w is None else wts
            combs = [spec.combiner[i] for i in pos]
            scale = combiner_scale(combs, c, _over_bag, fa, jnp.float32)
            scale = None if scale is None else scale.reshape(-1)
            n_bags = gids.shape[0] * gids.shape[1]
            out = _pool(params[b.name], gids, wts, scale, n_bags, gids.shape[-1])
            if out is not None:
                out = out.reshape(*gids.shape[:2], b.width)
                pooled[b.name] = ([spec.keys[i] for i in pos], out)
                continue
        # [F_b, B, L, width] or [B, F_b, ...]: the batch is dim 1 or 0
        rows = _gather_rows(params[b.name], gids, b, gather, 0 if batch_major else 1)
        n = len(pos)
        if n:
            mine = jax.lax.slice_in_dim(rows, 0, n, axis=fa) if seq else rows
            wts = counted[sel[:n]].astype(rows.dtype)
            if w is not None:
                wts = wts * w[sel[:n]].astype(rows.dtype)
            wts = arrange(wts)
            total = jnp.sum(mine if w is None else mine * wts[..., None], axis=-2)
            combs = [spec.combiner[i] for i in pos]
            scale = combiner_scale(combs, wts, _over_bag, fa)
            pooled[b.name] = (
                [spec.keys[i] for i in pos],
                total if scale is None else total * scale[..., None],
            )
        for j, i in enumerate(seq, start=n):
            Ls, own = int(spec.seq_len[i]), arrs[i].shape[1]
            if own > Ls:
                raise ValueError(
                    f"{WHERE}: feature {spec.keys[i]!r} has bags of {own} ids, longer "
                    f"than its table's max_sequence_length {Ls}."
                )
            r = jax.lax.index_in_dim(rows, j, axis=fa, keepdims=False)  # [B, L, dim]
            r = r[:, :own]  # its own slots; those beyond were added to reach L
            seqs[spec.keys[i]] = jnp.pad(r, ((0, 0), (0, Ls - own), (0, 0)))
    return pooled, seqs


# ------------------------------------------------------------------- jagged


def _seq_overflow_error(n, key, *, keys, seq_len):
    return ValueError(
        f"{WHERE}: {n} {'bag is' if n == 1 else 'bags are'} longer than "
        f"max_sequence_length (the first in feature {keys[key]!r}, L = "
        f"{int(seq_len[key])}). Raise the table's max_sequence_length or cut "
        "the bags."
    )


def _jagged(coll, lay, params, features, check_ids, batch_major, gathers):
    _missing(coll, features.keys)
    values = _as_ids(features.values, "the ids")
    spec = Keys.of(coll, lay, features.keys)
    F, B, N = len(spec.keys), features.batch_size, features.max_total
    seg = segment_ids(features.offsets, N)  # feature-major bag, F * B: unused
    # the slot's key; F for unused slots (every slot, when the batch is empty)
    kid = seg // B if B else jnp.full_like(seg, F)
    if check_ids:
        member = jnp.asarray(spec.rows > 0)[kid]
        bad = member & ~_ids.valid_per_table(values, spec.rows, kid)
        values = _check(values, bad, kid, spec, values)
    # the bags rule (unused slots and unknown keys: table rows 0, never valid)
    counted = _ids.in_bags(values, spec.rows, table=kid)
    w = None
    if features.weights is not None:
        w = jnp.asarray(features.weights)
    pooled, seqs = {}, {}
    for b, pos, seq in spec.read_by(lay):
        member = np.array([bn == b.name for bn in spec.buffer])
        ok = counted & jnp.asarray(member)[kid]
        gids = _row_ids(values, ok, spec, kid, b, np.array(pos + seq))
        # the pooled features' order: the collection's (not the input's)
        order = [i for f in coll.features for i in pos if spec.keys[i] == f]
        target = np.full(F + 1, -1, np.int64)
        target[order] = np.arange(len(order))
        tgt = jnp.asarray(target.astype(np.int32))[kid]  # -1: not pooled here
        n_out = len(order) * B
        bag = seg - kid * B  # the example
        if batch_major:
            out_id = jnp.where(tgt >= 0, bag * len(order) + tgt, n_out)
        else:
            out_id = jnp.where(tgt >= 0, tgt * B + bag, n_out)
        gids, out_id = jax.lax.optimization_barrier((gids, out_id))
        gather = gathers.get(b.name)
        if not seq and order and gather is None and _native(params[b.name], gids, b):
            scale = _jagged_scale(
                ok, w, out_id, n_out, order, spec, features, batch_major
            )
            bag = out_id.astype(jnp.int32)
            out = _pool(params[b.name], gids, w, scale, n_out, 0, bag)
            if out is not None:
                shape = (B, len(order)) if batch_major else (len(order), B)
                pooled[b.name] = (
                    [spec.keys[i] for i in order],
                    out.reshape(*shape, b.width),
                )
                continue
        rows = _gather_rows(params[b.name], gids, b, gather)
        if order:
            pooled[b.name] = (
                [spec.keys[i] for i in order],
                _pool_jagged(
                    rows, ok, w, out_id, n_out, order, spec, features, batch_major
                ),
            )
        if seq:
            seqs.update(_sequences(rows, b, spec, features, seq, seg, kid))
    return pooled, seqs


def _native(table, gids, b) -> bool:
    """Whether a buffer pools on the native path (one piece per row)."""
    if b.pieces > 1:
        kernel_path.note(f"{WHERE} buffer {b.name!r}", "column-wise pieces")
        return False
    native = kernel_path.route(f"{WHERE} buffer {b.name!r}", gids, tables=(table,))
    expected = _tape.expects_pooled(table)  # this value_and_grad's first path
    return native if expected is None else expected


def _pool(table, gids, w, scale, n_bags, length, bag=None):
    """A buffer's pooled rows ``[n_bags, width]`` from the bag kernel, or ``None``."""
    out = pool(
        table,
        gids.reshape(-1),
        weight=None if w is None else w.reshape(-1).astype(table.dtype),
        scale=scale,
        num_bags=n_bags,
        length=length,
        bag=bag,
    )
    return None if out is _tape.ROWS else out


def _jagged_factor(ok, w, out_id, n_out, combs, shape, feature_axis, dtype):
    """:func:`combiner_scale` of each pooled bag, ``shape``; ``None``: all 1."""

    def per_bag(x):  # a sum over each pooled bag's counted slots (`ok`)
        total = jax.ops.segment_sum(x, out_id, num_segments=n_out + 1)
        return total[:n_out].reshape(shape)

    c = ok.astype(dtype)
    c = c if w is None else c * w.astype(dtype)
    return combiner_scale(combs, c, per_bag, feature_axis, dtype)


def _jagged_scale(ok, w, out_id, n_out, order, spec, features, batch_major):
    """Per pooled bag ``[n_out]``: 1 / its count (mean), 1 / sqrt (sqrtn), 1."""
    combs = [spec.combiner[i] for i in order]
    B = features.batch_size
    shape = (B, len(order)) if batch_major else (len(order), B)
    fa = 1 if batch_major else 0
    scale = _jagged_factor(ok, w, out_id, n_out, combs, shape, fa, jnp.float32)
    return jnp.ones((n_out,), jnp.float32) if scale is None else scale.reshape(-1)


def _pool_jagged(rows, ok, w, out_id, n_out, order, spec, features, batch_major):
    B = features.batch_size
    n_f = len(order)
    contrib = rows if w is None else rows * w.astype(rows.dtype)[:, None]
    sums = jax.ops.segment_sum(contrib, out_id, num_segments=n_out + 1)[:n_out]
    shape = (B, n_f) if batch_major else (n_f, B)
    sums = sums.reshape(*shape, rows.shape[-1])
    combs = [spec.combiner[i] for i in order]
    fa = 1 if batch_major else 0
    scale = _jagged_factor(ok, w, out_id, n_out, combs, shape, fa, rows.dtype)
    return sums if scale is None else sums * scale[..., None]


def _sequences(rows, b, spec, features, seq, seg, kid):
    """``{feature: [B, L, dim]}`` of the sequence features (zeros past a bag)."""
    F, B, N = len(spec.keys), features.batch_size, features.max_total
    L = int(max(spec.seq_len[i] for i in seq))
    is_seq = np.zeros(F + 1, bool)
    is_seq[seq] = True
    offsets = jnp.asarray(features.offsets).astype(jnp.int32)
    slot = jnp.arange(N, dtype=jnp.int32)
    pos = slot - offsets[jnp.minimum(seg, F * B)]
    lim = jnp.asarray(spec.seq_len.astype(np.int32))[kid]
    mine = jnp.asarray(is_seq)[kid]
    over = mine & (pos >= lim) & (slot < offsets[-1])
    pos = _errors.raise_if(
        over,
        pos,
        functools.partial(_seq_overflow_error, keys=spec.keys, seq_len=spec.seq_len),
        jnp.sum(over.astype(jnp.int32)),
        jnp.min(jnp.where(over, kid, F)),
        reduce=("sum", "min"),
    )
    target = jnp.where(mine & (pos < lim), seg * L + pos, F * B * L)
    out = jnp.zeros((F * B * L, b.width), rows.dtype).at[target].add(rows, mode="drop")
    out = out.reshape(F, B, L, b.width)
    return {spec.keys[i]: out[i, :, : spec.seq_len[i]] for i in seq}
