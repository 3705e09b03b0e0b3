"""The TorchRec / FBGEMM side of ``dlrm_bench.py``: the same DLRM step on CPU.

Runs in an environment with ``torch``, ``torchrec`` and ``fbgemm-gpu-cpu``
(not jaxslices'), on the same synthetic batches and from the same initial
values as the JAX side (``examples/criteo_synth.py``, NumPy only):
``torchrec.models.dlrm.DLRM`` over a ``FusedEmbeddingBagCollection`` (FBGEMM's
table-batched embedding bags, all 26 tables in one kernel, the embedding
optimizer fused into ``loss.backward()``), the MLPs trained by
``torch.optim.SGD``. ``--head linear`` replaces the dense, interaction and
over arches by one linear layer on the concatenated pooled embeddings.

``dlrm_bench.py --torchrec-python PATH`` starts this script as a worker
(``--serve``): it builds and warms up, prints one JSON line (its first
losses, build time, threads, memory), then answers each ``run K`` line on
stdin with the K step times (seconds) and the CPU milliseconds per step
of the last K - 1, as one JSON line. Alone it prints its
median step time.

The install that works on CPU (torch 2.13.0, torchrec 1.8.0, the CPU build
fbgemm-gpu-cpu 1.8.0 in place of the CUDA fbgemm-gpu torchrec pulls) is in
``docs/collections.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import numpy as np
import torch
from _repo import load
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: F401 (checks FBGEMM)
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad

synth = load("examples.criteo_synth")


class LinearHead(torch.nn.Module):
    """The sparse part alone: pooled embeddings -> one linear layer."""

    def __init__(self, ebc, num: int, dim: int):
        super().__init__()
        self.sparse_arch = ebc
        self.out = torch.nn.Linear(num * dim, 1)

    def forward(self, dense_features, sparse_features):
        del dense_features
        return self.out(self.sparse_arch(sparse_features).values())


class Runner:
    def __init__(self, a):
        sizes = synth.table_sizes(a.scale)[: a.tables]
        init = synth.init_dlrm(sizes, a.dim, seed=a.seed)
        self.keys = [f"C{f + 1}" for f in range(len(sizes))]
        tables = [
            EmbeddingBagConfig(
                name=f"t_{k}",
                embedding_dim=a.dim,
                num_embeddings=v,
                feature_names=[k],
                pooling=PoolingType.SUM,
            )
            for k, v in zip(self.keys, sizes, strict=True)
        ]
        if a.opt == "sgd":
            otype, kw = torch.optim.SGD, {"lr": a.lr}
        else:
            otype, kw = RowWiseAdagrad, {"lr": a.lr, "eps": 1e-8}
        ebc = FusedEmbeddingBagCollection(
            tables=tables, optimizer_type=otype, optimizer_kwargs=kw
        )
        if a.head == "dlrm":
            self.model = DLRM(
                embedding_bag_collection=ebc,
                dense_in_features=synth.NUM_DENSE,
                dense_arch_layer_sizes=[*synth.BOTTOM, a.dim],
                over_arch_layer_sizes=list(synth.TOP),
            )
        else:
            self.model = LinearHead(ebc, len(sizes), a.dim)
        with torch.no_grad():
            for k, t in zip(self.keys, init["tables"], strict=True):
                ebc.embedding_bags[f"t_{k}"].weight.copy_(torch.from_numpy(t))
            if a.head == "dlrm":
                linears = [
                    m
                    for arch in (self.model.dense_arch, self.model.over_arch)
                    for m in arch.modules()
                    if isinstance(m, torch.nn.Linear)
                ]
                layers = init["bottom"] + init["top"]
            else:
                linears = [self.model.out]
                layers = [linear_init(len(sizes) * a.dim, a.seed)]
            for lin, (w, b) in zip(linears, layers, strict=True):
                lin.weight.copy_(torch.from_numpy(w.T))
                lin.bias.copy_(torch.from_numpy(b))
        dense = [p for n, p in self.model.named_parameters() if "embedding" not in n]
        self.opt = torch.optim.SGD(dense, lr=a.dense_lr)
        self.loss_fn = torch.nn.BCEWithLogitsLoss()

    def inputs(self, b):
        lengths = torch.from_numpy(b.lengths.reshape(-1).astype(np.int64))
        kjt = KeyedJaggedTensor(
            keys=self.keys, values=torch.from_numpy(b.ids), lengths=lengths
        )
        return torch.from_numpy(b.dense), kjt, torch.from_numpy(b.labels)

    def run(self, inp):
        dense, kjt, labels = inp
        self.opt.zero_grad()
        logits = self.model(dense_features=dense, sparse_features=kjt)
        loss = self.loss_fn(logits.squeeze(-1), labels)
        loss.backward()  # the fused embedding optimizer updates the tables here
        self.opt.step()
        return float(loss.detach())


def _rss_mb() -> float:
    """Resident memory now (Linux; ru_maxrss would include the parent's)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def linear_init(n_in: int, seed: int):
    """The linear head's initial values, as ``dlrm_bench.py`` makes them."""
    rng = np.random.default_rng((seed, 1))
    bound = 1.0 / np.sqrt(n_in)
    w = rng.uniform(-bound, bound, (n_in, 1)).astype(np.float32)
    return w, np.zeros(1, np.float32)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--scale", type=float, default=1 / 8)
    p.add_argument("--max-len", type=int, default=1)
    p.add_argument(
        "--opt", default="rowwise_adagrad", choices=("sgd", "rowwise_adagrad")
    )
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dense-lr", type=float, default=0.1)
    p.add_argument("--head", default="dlrm", choices=("dlrm", "linear"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--pool", type=int, default=4)
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="0: torch's default")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--serve", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    sizes = synth.table_sizes(a.scale)[: a.tables]
    data = synth.CriteoSynth(tuple(sizes), a.batch, a.max_len, seed=a.seed)
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    r = Runner(a)
    build_s = time.perf_counter() - t0
    check = [r.run(r.inputs(data.batch_at(i))) for i in range(a.check_steps)]
    pool = [r.inputs(data.batch_at(i)) for i in range(a.pool)]
    for i in range(2):
        r.run(pool[i % a.pool])
    info = {
        "ready": True,
        "check_losses": check,
        "build_s": round(build_s, 2),
        "threads": torch.get_num_threads(),
        "rss_growth_mb": round(_rss_mb() - rss0, 1),  # model, state, warm-up
        "torch": torch.__version__,
    }
    if a.serve:
        print(json.dumps(info), flush=True)
        k = 0
        for line in sys.stdin:
            times, c0 = [], None
            n = int(line.split()[1])
            for i in range(n):
                if i == 1:
                    c0 = _cpu_s()
                t = time.perf_counter()
                r.run(pool[k % a.pool])
                times.append(time.perf_counter() - t)
                k += 1
            cpu = 1e3 * (_cpu_s() - c0) / (n - 1)
            print(json.dumps({"times": times, "cpu_ms": cpu}), flush=True)
        return
    times = []
    for i in range(a.steps):
        t = time.perf_counter()
        r.run(pool[i % a.pool])
        times.append(time.perf_counter() - t)
    print(json.dumps({**info, "median_ms": 1e3 * float(np.median(times))}))


if __name__ == "__main__":
    main()
