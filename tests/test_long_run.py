"""Long runs: the centralized algorithms keep every replica bit-identical all along.

Odd and non-power-of-two P matter (gTop-k's tree, recursive doubling, ring chunking); several buckets
per model. Hashes of every replica are compared every 50 steps. The test command runs 500 steps at P = 3
and fewer at larger P (8 ranks on 2 cores take ~90 ms a step: 500 steps of every algorithm at P = 8 is
six minutes); ``BAGUA_LITE_LONG_STEPS=500`` runs 500 at every P (measured: see the README).
"""
import hashlib
import os

import pytest
import torch
import torch.nn.functional as F

import bagua_lite
from bagua_lite.algorithms import build

CENTRALIZED = {
    "gradient_allreduce": ("gradient_allreduce", {}, "sgd"),
    "fp16": ("gradient_allreduce", {"compression": "fp16"}, "sgd"),
    "bytegrad": ("gradient_allreduce", {"compression": "minmax_uint8"}, "sgd"),
    "sign": ("gradient_allreduce", {"compression": "sign"}, "sgd"),
    "topk": ("topk", {"density": 0.05}, "sgd"),
    "gtopk": ("gtopk", {"density": 0.05}, "sgd"),
    "powersgd": ("powersgd", {"rank": 2}, "sgd"),
    "qadam": ("qadam", {}, "adam"),  # warm-up: a fifth of the run
}
EVERY = 50


def _steps(P):
    return int(os.environ.get("BAGUA_LITE_LONG_STEPS", 0)) or {3: 500, 4: 100, 5: 100}.get(P, 50)


def _r_long(rank, P, STEPS):
    out = {}
    for label, (name, options, kind) in CENTRALIZED.items():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.ReLU(), torch.nn.Linear(24, 24), torch.nn.ReLU(),
                                  torch.nn.Linear(24, 4))
        opt = (torch.optim.Adam(net.parameters(), lr=1e-3) if kind == "adam"
               else torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9))
        if name == "qadam":
            options = dict(options, warmup_steps=max(2, STEPS // 5))
        model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.001)
        g = torch.Generator().manual_seed(1000 + rank)
        hashes, losses = [], []
        for step in range(STEPS):
            x = torch.randn(8, 10, generator=g)
            loss = F.cross_entropy(model(x), (x[:, :4] * 2).argmax(1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
            if (step + 1) % EVERY == 0:
                flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
                hashes.append(hashlib.sha1(flat.numpy().tobytes()).hexdigest())
        model.close()
        w = min(50, STEPS // 5)
        out[label] = (hashes, sum(losses[:w]) / w, sum(losses[-w:]) / w, len(model.buckets))
    return out


@pytest.mark.parametrize("P", (3, 4, 5, 8), ids=lambda p: f"P{p}")
def test_long_run_replicas_bit_identical(clusters, P):
    STEPS = _steps(P)
    res = clusters.get(P).run(_r_long, STEPS, timeout=1200)
    for label in CENTRALIZED:
        per_rank = [r[label] for r in res]
        assert per_rank[0][3] >= 3, f"{label}: expected several buckets"
        for i in range(STEPS // EVERY):
            hs = {pr[0][i] for pr in per_rank}
            assert len(hs) == 1, f"{label}: replicas differ after step {(i + 1) * EVERY} at P={P}"
        first, last = per_rank[0][1], per_rank[0][2]
        assert last < first, f"{label}: loss did not fall over {STEPS} steps ({first:.3f} -> {last:.3f})"
