"""Ids without a vocabulary: modulo hashing vs a managed-collision table.

A synthetic stream with a long tail and new ids over time: each example
carries one raw 64-bit id drawn with Zipf popularity from ``4 * slots``
distinct ids, and the popular ids drift (the head of the distribution moves
through the id space, so new ids keep arriving and old ones fade). Each id
has a hidden click probability; the model learns one embedding row per row
of its table (``logit = <row, w> + b``), trained online with Adagrad, and is
scored by its *progressive* log loss (each batch scored before the step that
learns from it), the usual metric of a stream.

Six ways on the same table size ``S = slots`` (the unbounded one excepted):

* ``modulo``: ``row = hash(id) % S``, unrelated ids share rows;
* ``managed_lfu`` / ``managed_lru``: :class:`jaxslices.ManagedCollision`
  (admission into free slots; every ``evict_every`` steps, eviction down to
  ``batch`` free slots, room for a batch's new ids; evicted
  rows and their Adagrad state reset with :func:`jaxslices.reset_rows`; ids
  not admitted read no row);
* ``managed_lfu_hl5``: a decayed LFU (the counts halve every 5 steps, so
  the ids popular long ago give way to those popular now);
* ``managed_lru_min3``: LRU with an admission filter (``min_count=3``: an id
  takes a slot on its third sighting, so the long tail's rare ids never
  evict anyone). Other ways by name: ``policies=("lfu_hl20_min2", ...)``
  (``hl``: ``half_life``, ``min``: ``min_count``, ``ttl``: ``ttl``);
* ``unbounded``: one row per distinct id (``4 * S`` rows), the reference.

``collision_rate``: the share of lookups whose id has no row of its own:
modulo, a row already used by another id of the stream; managed, an id
served by the default (no row). The result reports how much of the loss gap
between ``modulo`` and ``unbounded`` each managed table closes (the issue's
goal: at least half).

Run: ``python examples/managed_ids.py --out out`` (writes ``managed_ids.json``
and the plot ``managed_ids.png``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxslices as js

DIM = 8


def make_stream(
    steps: int, batch: int, distinct: int, seed: int, zipf: float, drift: float
):
    """``(raw ids uint64 [steps, batch], index [steps, batch], labels)``.

    Id ``k`` of the stream (``0 <= k < distinct``) has the random 64-bit raw
    id ``raw[k]`` and click probability ``sigmoid(z[k])``. At step ``t`` a
    popularity rank ``r`` (Zipf) names id ``(r + t * drift) % distinct``.
    """
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 2**63, size=distinct, dtype=np.int64).astype(np.uint64)
    raw = raw * np.uint64(2) + rng.integers(0, 2, size=distinct).astype(np.uint64)
    z = rng.normal(0.0, 2.0, size=distinct)
    weights = 1.0 / np.arange(1, distinct + 1) ** zipf
    ranks = rng.choice(distinct, size=(steps, batch), p=weights / weights.sum())
    shift = (np.arange(steps)[:, None] * drift).astype(np.int64)
    index = (ranks + shift) % distinct
    labels = (rng.random((steps, batch)) < 1 / (1 + np.exp(-z[index]))).astype(
        np.float32
    )
    return raw[index], index, labels


def _loss(params, rows, y):
    e = js.embedding_lookup(params["emb"], rows)
    logits = e @ params["w"] + params["b"]
    return jnp.mean(jnp.logaddexp(0.0, logits) - y * logits)


def _train(rows_of, table_rows, steps_data, lr, managed=None, evicted_of=None):
    opt = js.adagrad(lr)
    params = {
        "emb": jnp.zeros((table_rows, DIM)),
        "w": jnp.full((DIM,), 0.5),
        "b": jnp.zeros(()),
    }
    state = opt.init(params)

    @jax.jit
    def step(params, state, extra, raw, y):
        rows, extra, evicted = rows_of(extra, raw)
        if evicted is not None:
            params, state = js.reset_rows(
                params, state, evicted, 0.0, where=lambda p: p["emb"], optimizer=opt
            )
        value, grads = js.value_and_grad(_loss)(params, rows, y)
        updates, state = opt.update(grads, state, params)
        return js.apply_updates(params, updates), state, extra, value, rows

    losses, rows_seen = [], []
    extra = managed
    for raw, y in steps_data:
        params, state, extra, value, rows = step(params, state, extra, raw, y)
        losses.append(float(value))
        rows_seen.append(np.asarray(rows))
    return np.array(losses), rows_seen, extra


def main(
    steps: int = 3000,
    batch: int = 256,
    slots: int = 2000,
    evict_every: int = 1,
    seed: int = 0,
    zipf: float = 1.2,
    drift: float | None = None,
    lr: float = 0.5,
    policies: tuple[str, ...] = ("lfu", "lfu_hl5", "lru", "lru_min3"),
    out: str | None = None,
) -> dict:
    distinct = 4 * slots
    if drift is None:  # the head moves through half of the id space
        drift = distinct / (2 * steps)
    raw, index, labels = make_stream(steps, batch, distinct, seed, zipf, drift)
    raw_ids = [js.RawIds.from_int64(r) for r in raw]
    data = [(r, jnp.asarray(y)) for r, y in zip(raw_ids, labels, strict=True)]
    idx_data = [
        (jnp.asarray(i, jnp.int32), jnp.asarray(y))
        for i, y in zip(index, labels, strict=True)
    ]
    result: dict = {
        "steps": steps,
        "batch": batch,
        "slots": slots,
        "distinct_ids": distinct,
        "curves": {},
    }

    # unbounded: one row per id (the stream's index is a perfect vocabulary)
    loss, _, _ = _train(lambda e, i: (i, e, None), distinct, idx_data, lr)
    result["curves"]["unbounded"] = (loss, np.zeros(steps))

    # modulo hashing of the raw 64-bit id
    mod_rows = (raw % np.uint64(slots)).astype(np.int32)
    mod_data = [
        (jnp.asarray(m), jnp.asarray(y)) for m, y in zip(mod_rows, labels, strict=True)
    ]
    loss, rows_seen, _ = _train(lambda e, i: (i, e, None), slots, mod_data, lr)
    owner: dict[int, int] = {}
    shared = np.zeros(steps)
    for t in range(steps):
        for r, k in zip(mod_rows[t].tolist(), index[t].tolist(), strict=True):
            owner.setdefault(r, k)
        shared[t] = np.mean(
            [owner[r] != k for r, k in zip(mod_rows[t], index[t], strict=True)]
        )
    result["curves"]["modulo"] = (loss, shared)

    for policy in policies:  # "lru", "lru_min2": min_count=2, "lfu_hl50": half_life=50
        rule, *options = policy.split("_")
        knobs = {"min": "min_count", "hl": "half_life", "ttl": "ttl"}
        extra = {
            knobs[o.rstrip("0123456789")]: int(o.lstrip("abcdefghijklmnopqrstuvwxyz"))
            for o in options
        }
        mc = js.ManagedCollision(
            f"ids_{policy}",
            num_slots=slots,
            policy=rule,
            evict_every=evict_every,
            evict_count=min(slots, batch),  # room for a batch's new ids
            **extra,
        )
        loss, rows_seen, final = _train(mc.remap, slots, data, lr, managed=mc.init())
        defaulted = np.array([np.mean(r == slots) for r in rows_seen])
        result["curves"][f"managed_{policy}"] = (loss, defaulted)
        result[f"managed_{policy}_stats"] = {
            k: int(v) for k, v in final.stats().items()
        }

    half = steps // 2  # the second half: past the warm-up of every table
    summary = {
        name: {
            "log_loss_second_half": float(np.mean(curve[0][half:])),
            "log_loss_all": float(np.mean(curve[0])),
            "collision_rate_second_half": float(np.mean(curve[1][half:])),
        }
        for name, curve in result["curves"].items()
    }
    gap = (
        summary["modulo"]["log_loss_second_half"]
        - summary["unbounded"]["log_loss_second_half"]
    )
    for policy in policies:
        closed = (
            summary["modulo"]["log_loss_second_half"]
            - summary[f"managed_{policy}"]["log_loss_second_half"]
        )
        summary[f"managed_{policy}"]["gap_closed"] = float(closed / gap) if gap else 0.0
    result["summary"] = summary
    for name, row in summary.items():
        print(name, {k: round(v, 4) for k, v in row.items()})
    if out is not None:
        out_dir = Path(out)
        out_dir.mkdir(parents=True, exist_ok=True)
        saved = {k: v for k, v in result.items() if k != "curves"}
        saved.update(
            jax=jax.__version__,
            device=str(jax.devices()[0].device_kind),
            nproc=os.cpu_count(),
            load_average=list(os.getloadavg()),
            settings={
                "zipf": zipf,
                "drift": drift,
                "lr": lr,
                "seed": seed,
                "evict_every": evict_every,
            },
        )
        (out_dir / "managed_ids.json").write_text(json.dumps(saved, indent=1))
        save_plot(result, out_dir / "managed_ids.png")
    return result


def _smooth(x: np.ndarray, points: int = 200) -> np.ndarray:
    w = max(1, len(x) // points)
    n = len(x) // w * w
    return x[:n].reshape(-1, w).mean(1) if n else x


def save_plot(result: dict, path: Path) -> None:
    # A bare Figure, not pyplot (a notebook's own plots keep their backend).
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    a, b = fig.subplots(1, 2)
    for name, (loss, rate) in result["curves"].items():
        w = max(1, len(loss) // 200)
        x = np.arange(len(_smooth(loss))) * w
        a.plot(x, _smooth(loss), label=name)
        b.plot(x, _smooth(rate), label=name)
    a.set_title(
        f"progressive log loss (S={result['slots']}, "
        f"{result['distinct_ids']} distinct ids)"
    )
    a.set_xlabel("step")
    b.set_title("lookups without a row of their own")
    b.set_xlabel("step")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--slots", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    main(
        steps=args.steps,
        batch=args.batch,
        slots=args.slots,
        seed=args.seed,
        out=args.out,
    )
