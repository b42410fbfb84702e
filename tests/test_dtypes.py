"""Models whose parameters are bf16 (``model.to(torch.bfloat16)``, common on GPUs) under every algorithm.

Each algorithm trains a bf16 copy of the same network on the same data as its fp32 run, and must end
near it: within ``TOLERANCE`` of the largest fp32 weight. bf16 keeps 8 significant bits, so each step's
update is rounded to about 2^-8 of the weight it lands on (measured: 0.9-1.7% after 6 steps for the
algorithms whose update is continuous in the gradient). Where it is not - a sign, a top-k selection, Adam's
normalised step (qadam) - a gradient rounded across a threshold flips an entry's update (measured 4.6-11.5%),
so those get ``TOLERANCE_DISCONTINUOUS``. Either is well below how far training moved the weights
(12-60%), which an update dropped or applied at the wrong scale would show. Centralized replicas stay equal.
"""
import torch
import torch.nn.functional as F

import bagua_lite
from bagua_lite.algorithms import build

ALGORITHMS = {
    "dense": ("gradient_allreduce", {}),
    "fp16": ("gradient_allreduce", {"compression": "fp16"}),
    "uint8": ("gradient_allreduce", {"compression": "minmax_uint8"}),
    "sign": ("gradient_allreduce", {"compression": "sign"}),
    "topk": ("topk", {"density": 0.25}),
    "gtopk": ("gtopk", {"density": 0.25}),
    "powersgd": ("powersgd", {"rank": 2}),
    "qadam": ("qadam", {"warmup_steps": 2}),
    "decentralized": ("decentralized", {}),
    "low_precision_decentralized": ("low_precision_decentralized", {}),
    "local_sgd": ("local_sgd", {"period": 2}),
    "diloco": ("diloco", {"period": 2}),
    "streaming_diloco": ("diloco", {"period": 4, "fragments": 2, "overlap": 1, "alpha": 0.5, "compression": "absmax4"}),
}
CENTRALIZED = ("dense", "fp16", "uint8", "sign", "topk", "gtopk", "powersgd", "qadam")
DISCONTINUOUS = ("sign", "topk", "gtopk", "qadam")
STEPS = 6
TOLERANCE = 0.03
TOLERANCE_DISCONTINUOUS = 0.15


def _run(rank, name, options, dtype):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4)).to(dtype)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2) if name == "qadam" else \
        torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.001)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(rank * 1000 + step)
        x = torch.randn(8, 10, generator=g)
        F.cross_entropy(model(x.to(dtype)).float(), x[:, :4].argmax(1)).backward()
        opt.step()
        opt.zero_grad()
    model.close()
    assert all(p.dtype == dtype for p in net.parameters())
    return torch.cat([p.detach().float().reshape(-1) for p in net.parameters()])


def _r_bf16(rank, P):
    out = {}
    for key, (name, options) in ALGORITHMS.items():
        start = torch.cat([p.detach().reshape(-1) for p in
                           (torch.manual_seed(0), torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.ReLU(),
                                                                      torch.nn.Linear(24, 4)))[1].parameters()])
        fp32 = _run(rank, name, options, torch.float32)
        bf16 = _run(rank, name, options, torch.bfloat16)
        out[key] = {"bf16": bf16, "error": float((bf16 - fp32).abs().max() / fp32.abs().max()),
                    "moved": float((fp32 - start).abs().max() / fp32.abs().max())}
    return out


def test_bf16_parameters_train_under_every_algorithm(clusters):
    P = 3
    res = clusters.get(P).run(_r_bf16, timeout=300)
    for key in ALGORITHMS:
        for r in range(P):
            o = res[r][key]
            assert torch.isfinite(o["bf16"]).all(), (key, r)
            tolerance = TOLERANCE_DISCONTINUOUS if key in DISCONTINUOUS else TOLERANCE
            assert o["moved"] > 0.1, (key, r, o)  # training moved the weights
            assert o["error"] <= tolerance, f"{key}, rank {r}: bf16 ended {o['error']:.3g} from fp32 (relative)"
        if key in CENTRALIZED:
            assert all(torch.equal(res[0][key]["bf16"], res[r][key]["bf16"]) for r in range(P)), key
