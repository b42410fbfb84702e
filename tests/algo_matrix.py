"""One matrix of algorithm configurations and one small training loop, for the tests that run every
algorithm under some condition (control traffic on its own group, a GradScaler, bf16 parameters, a GPU)."""
import torch
import torch.nn.functional as F

ALGORITHMS = {
    "dense": ("gradient_allreduce", {}),
    "fp16": ("gradient_allreduce", {"compression": "fp16"}),
    "uint8": ("gradient_allreduce", {"compression": "minmax_uint8"}),
    "sign": ("gradient_allreduce", {"compression": "sign"}),
    "hierarchical": ("gradient_allreduce", {"hierarchical": True, "ranks_per_node": 2}),
    "topk": ("topk", {"density": 0.1}),
    "gtopk": ("gtopk", {"density": 0.1}),
    "gtopk_no_correction": ("gtopk", {"density": 0.1, "momentum_correction": 0}),
    "gtopk_4bit": ("gtopk", {"density": 0.3, "value_bits": 4}),
    "gtopk_4bit_union": ("gtopk", {"density": 0.3, "value_bits": 4, "final_union": True}),
    "powersgd": ("powersgd", {"rank": 2}),
    "qadam": ("qadam", {"warmup_steps": 2}),
    "decentralized": ("decentralized", {}),
    "decentralized_all": ("decentralized", {"peer_selection": "all"}),
    "low_precision_decentralized": ("low_precision_decentralized", {}),
    "local_sgd": ("local_sgd", {"period": 2}),
    "diloco": ("diloco", {"period": 2}),
    "streaming_diloco": ("diloco", {"period": 4, "fragments": 2, "overlap": 1, "alpha": 0.5, "compression": "absmax4"}),
    "async_model_average": ("async_model_average", {"sync_interval_ms": 10}),
    # every figure given, so the pick never depends on a timing (it probes, and picks, all the same)
    "auto": ("auto", {"probe_steps": 2, "network": {"alpha": 1e-3, "beta": 1e-8}, "compute_s": 0.002,
                      "machine": {"topk_s_per_elem": 1e-9, "quantize_s_per_elem": 1e-9, "fp16_s_per_elem": 1e-9,
                                  "add_s_per_elem": 1e-9}}),
}
#: replicas bit for bit equal after every step
CENTRALIZED = {"dense", "fp16", "uint8", "sign", "hierarchical", "topk", "gtopk", "gtopk_no_correction", "gtopk_4bit",
               "gtopk_4bit_union", "powersgd", "qadam"}
#: a rounding of the gradient can flip an entry's update (a sign, a top-k selection, Adam's normalised step)
DISCONTINUOUS = {"sign", "topk", "gtopk", "gtopk_no_correction", "gtopk_4bit", "gtopk_4bit_union", "qadam",
                 "low_precision_decentralized", "streaming_diloco"}


def pick(*keys):
    return {key: ALGORITHMS[key] for key in keys}


def mlp(sizes):
    """Linear layers of ``sizes`` with ReLUs between them, from seed 0 (the same start on every rank)."""
    torch.manual_seed(0)
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def build_model(name, options, dtype=torch.float32, device="cpu", grad_scaler=None, sizes=(10, 24, 4),
                weight_decay=0.0, fused=False):
    """(net, optimizer, DistributedModel): the same start on every rank; Adam for qadam, else SGD momentum
    (``fused``: torch's fused kernels)."""
    import bagua_lite
    from bagua_lite.algorithms import build
    net = mlp(sizes).to(device=device, dtype=dtype)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, fused=fused) if name == "qadam" else \
        torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=weight_decay, fused=fused)
    model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.001,
                                        grad_scaler=grad_scaler)
    return net, opt, model


def loss_of(model, rank, step, sizes=(10, 24, 4), dtype=torch.float32, device="cpu"):
    """This rank's loss on its own batch of ``step`` (a toy task: the largest of the first inputs)."""
    x = torch.randn(8, sizes[0], generator=torch.Generator().manual_seed(rank * 1000 + step))
    return F.cross_entropy(model(x.to(device=device, dtype=dtype)).float(), x[:, :sizes[-1]].argmax(1).to(device))


def weights(net):
    return torch.cat([p.detach().float().reshape(-1) for p in net.parameters()]).cpu()


def train(rank, name, options, steps=6, **kwargs):
    """Plain loop (backward, step, zero_grad) for ``steps`` steps; the final weights (fp32, on the CPU)."""
    net, opt, model = build_model(name, options, **kwargs)
    for step in range(steps):
        loss_of(model, rank, step, kwargs.get("sizes", (10, 24, 4)), kwargs.get("dtype", torch.float32),
                kwargs.get("device", "cpu")).backward()
        opt.step()
        opt.zero_grad()
    model.close()
    return weights(net)
