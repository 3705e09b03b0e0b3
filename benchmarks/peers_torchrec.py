"""The FBGEMM side of ``peers_bench.py``: the peers step with FBGEMM's CPU kernels.

Runs in an environment with ``torch`` and ``fbgemm-gpu-cpu`` (TorchRec's
kernels; not jaxslices' environment), on the batches and initial values
``peers_bench.py`` saved (``--data``, an ``.npz`` of ``table``, ``w``, ``ids``,
``y``). The table is FBGEMM's table-batched embedding bag
(``SplitTableBatchedEmbeddingBagsCodegen``, one table on
``EmbeddingLocation.HOST`` / ``ComputeDevice.CPU``, float32, mean pooling)
with its optimizer fused into ``loss.backward()``: ``EXACT_SGD``,
``EXACT_ROWWISE_ADAGRAD`` or ``EXACT_ADAGRAD`` (optimizer state starts at 0).
The head ``w`` is updated by plain SGD by hand (``w -= lr * w.grad``). The
bounds check of the ids stays at FBGEMM's default (``WARNING``).

``peers_bench.py --torchrec-python PATH`` starts this script as a worker
(``--serve``) with ``--threads`` 1 or 2 (``torch.set_num_threads``): it builds,
runs ``--check-steps`` steps on batches 0, 1, ... (their losses are compared
with jaxslices'), warms up, prints one JSON line, then answers each
``run K`` line on stdin with one JSON line: the K step times (seconds) after
one untimed step, the CPU milliseconds per step (user + system, every
thread) and the page faults per step of those K. Alone it prints its median step time.

The install that works on CPU is in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

OPTIM = {
    "sgd": EmbOptimType.EXACT_SGD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
}


class Runner:
    """FBGEMM's embedding bag, the head ``w`` and the inputs of every batch."""

    def __init__(self, data, optimizer: str, lr: float, eps: float):
        table = torch.from_numpy(np.ascontiguousarray(data["table"]))
        v, d = table.shape
        self.emb = SplitTableBatchedEmbeddingBagsCodegen(
            [(v, d, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=OPTIM[optimizer],
            learning_rate=lr,
            eps=eps,
            pooling_mode=PoolingMode.MEAN,
            weights_precision=SparseType.FP32,
            output_dtype=SparseType.FP32,
        )
        with torch.no_grad():
            self.emb.split_embedding_weights()[0].copy_(table)
            for states in self.emb.split_optimizer_states():
                for s in states:  # FBGEMM's default, made explicit
                    s.zero_()
        self.w = torch.from_numpy(data["w"].copy()).requires_grad_(True)
        self.lr = lr
        ids, y = data["ids"], data["y"]
        nb, b, bag = ids.shape
        offsets = torch.arange(0, b * bag + 1, bag, dtype=torch.int64)
        self.batches = [
            (torch.from_numpy(ids[i].reshape(-1).astype(np.int64)), offsets,
             torch.from_numpy(y[i]))
            for i in range(nb)
        ]  # fmt: skip
        self.i = 0
        self.state_bytes = sum(
            s.numel() * s.element_size()
            for states in self.emb.split_optimizer_states()
            for s in states
        )

    def step(self) -> float:
        ids, offsets, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        pooled = self.emb(ids, offsets)  # [B, D]
        loss = torch.mean((pooled @ self.w - y) ** 2)
        loss.backward()  # FBGEMM updates its table (and state) here
        with torch.no_grad():
            self.w -= self.lr * self.w.grad
        self.w.grad = None
        return float(loss.detach())


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _faults() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt + r.ru_majflt


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help=".npz from peers_bench.py")
    p.add_argument("--optimizer", default="rowwise_adagrad", choices=sorted(OPTIM))
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--eps", type=float, default=1e-8, help="FBGEMM's eps")
    p.add_argument("--threads", type=int, default=0, help="0: torch's default")
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=50, help="without --serve")
    p.add_argument("--serve", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    data = dict(np.load(a.data))
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    r = Runner(data, a.optimizer, a.lr, a.eps)
    del data
    build_s = time.perf_counter() - t0
    check = [r.step() for _ in range(a.check_steps)]
    for _ in range(a.warmup):
        r.step()
    import fbgemm_gpu

    info = {
        "ready": True,
        "check_losses": check,
        "build_s": round(build_s, 2),
        "threads": torch.get_num_threads(),
        "rss_mb": round(_rss_mb(), 1),
        "rss_growth_mb": round(_rss_mb() - rss0, 1),
        "state_bytes": r.state_bytes,
        "torch": torch.__version__,
        "fbgemm_gpu": fbgemm_gpu.__version__,
        "kernel": "SplitTableBatchedEmbeddingBagsCodegen",
        "optim_type": OPTIM[a.optimizer].name,
        "eps": a.eps,
        "lr": a.lr,
    }
    if a.serve:
        print(json.dumps(info), flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] != "run":
                break
            n = int(words[1])
            r.step()  # untimed: the first step after another process ran
            times, c0, f0 = [], _cpu_s(), _faults()
            for _ in range(n):
                t = time.perf_counter()
                r.step()
                times.append(time.perf_counter() - t)
            out = {
                "times": times,
                "cpu_ms": 1e3 * (_cpu_s() - c0) / n,
                "faults": (_faults() - f0) / n,
                "rss_mb": _rss_mb(),
            }
            print(json.dumps(out), flush=True)
        return
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        r.step()
        times.append(time.perf_counter() - t)
    print(json.dumps({**info, "median_ms": 1e3 * float(np.median(times))}))


if __name__ == "__main__":
    main()
