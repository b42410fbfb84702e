"""Models whose parameters are bf16 (``model.to(torch.bfloat16)``, common on GPUs) under every algorithm.

Each algorithm trains a bf16 copy of the same network on the same data as its fp32 run, and must end
near it: within ``TOLERANCE`` of the largest fp32 weight. bf16 keeps 8 significant bits, so each step's
update is rounded to about 2^-8 of the weight it lands on (measured: 0.9-1.7% after 6 steps for the
algorithms whose update is continuous in the gradient). Where it is not - a sign, a top-k selection, Adam's
normalised step (qadam), a low-bit code - a gradient rounded across a threshold flips an entry's update
(measured up to 11.5%), so those get ``TOLERANCE_DISCONTINUOUS``. Either is well below how far training
moved the weights (12-60%), which an update dropped or applied at the wrong scale would show. Centralized replicas stay equal.
"""
import torch

from algo_matrix import DISCONTINUOUS, CENTRALIZED, build_model, pick, train, weights

ALGORITHMS = {**pick("dense", "fp16", "uint8", "sign", "powersgd", "qadam", "decentralized",
                     "low_precision_decentralized", "local_sgd", "diloco", "streaming_diloco"),
              # denser than the matrix: at density 0.1 gtopk ended 12% from fp32, too near the tolerance
              "topk": ("topk", {"density": 0.25}), "gtopk": ("gtopk", {"density": 0.25})}
TOLERANCE = 0.03
TOLERANCE_DISCONTINUOUS = 0.15


def _r_bf16(rank, P):
    out = {}
    for key, (name, options) in ALGORITHMS.items():
        net, _, model = build_model(name, options)  # the start both runs take
        start = weights(net)
        model.close()
        fp32 = train(rank, name, options)
        bf16 = train(rank, name, options, dtype=torch.bfloat16)
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
