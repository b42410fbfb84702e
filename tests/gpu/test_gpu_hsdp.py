"""ShardedModel on the device against its own CPU run: an FSDP2 model on a CUDA mesh, the relaxation across
its replicas. NCCL at P = 1 (one replica of one shard: the hooks, the engine and the step on the device),
and several processes on one GPU over gloo with CUDA tensors: P = 2 as 2 replicas of 1 shard (the
cross-replica exchange on device tensors) and P = 4 as 2 x 2 (FSDP2's reduce-scatter over gloo too, where
gloo carries it for CUDA tensors: the table says if not).

Per algorithm and (backend, P): the device run's final full weights against the CPU run's on the same
mesh shape, data and seeds, as the largest difference relative to the largest weight; replicas bit for bit
equal where the algorithm keeps them so. Tolerances as tests/gpu/test_gpu_algorithms.py's.
"""
import traceback

import pytest
import torch

from gpu_device import DEVICE, join_group, spawn_ranks

ALGORITHMS = {
    "hsdp_identity": ("gradient_allreduce", {}),
    "hsdp_fp16": ("gradient_allreduce", {"compression": "fp16"}),
    "hsdp_gtopk": ("gtopk", {"density": 0.1, "momentum_correction": 0}),
    "hsdp_powersgd": ("powersgd", {"rank": 2}),
    "hsdp_diloco": ("diloco", {"period": 3}),
    "hsdp_streaming_diloco": ("diloco", {"period": 4, "fragments": 2, "overlap": 1, "compression": "absmax4"}),
}
DISCONTINUOUS = {"hsdp_gtopk", "hsdp_streaming_diloco"}  # a rounding can flip a selection or a 4-bit code
IDENTICAL_REPLICAS = {"hsdp_identity", "hsdp_fp16", "hsdp_gtopk", "hsdp_powersgd"}
SMOOTH, DISCONTINUOUS_TOL = 1e-3, 5e-2
STEPS = 7
SHAPES = [("nccl", 1, 1), ("cpu:gloo,cuda:nccl", 1, 1), ("gloo", 2, 1), ("gloo", 2, 2)] if DEVICE == "cuda" else \
    [("gloo", 1, 1), ("gloo", 2, 1), ("gloo", 2, 2)]


def _train(rank, device, R, S, name, options):
    import bagua_lite
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (R, S), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 33), torch.nn.Tanh(),
                              torch.nn.Linear(33, 4)).to(device)
    for i in (0, 2, 4):
        fully_shard(net[i], mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    relaxed = bagua_lite.ShardedModel(net, opt, algorithm=bagua_lite.algorithm.build(name, **options), mesh=mesh)
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    relaxed.close()
    return torch.cat([p.detach().full_tensor().reshape(-1).cpu() for p in net.parameters()])


def _worker(rank, P, backend, device, R, S, store_path, results):
    try:
        import torch.distributed as dist
        dev = join_group(rank, P, backend, device, store_path)
        out = {}
        for key, (name, options) in ALGORITHMS.items():
            try:
                out[key] = {"weights": _train(rank, dev, R, S, name, options).numpy()}
            except Exception:  # noqa: BLE001 - a row of the table, not the end of the run
                out[key] = {"error": traceback.format_exc(limit=3)}
        dist.destroy_process_group()
        results.put((rank, out))
    except BaseException:  # noqa: BLE001
        results.put((rank, {"__fatal__": traceback.format_exc()}))


def _run(backend, device, R, S, timeout=240):
    return spawn_ranks(_worker, R * S, (backend, device, R, S), timeout)


@pytest.mark.parametrize("backend,R,S", SHAPES, ids=[f"{b}-{r}x{s}" for b, r, s in SHAPES])
def test_sharded_model_against_its_cpu_run(dev, record, backend, R, S):
    P = R * S
    ref, _ = _run("gloo", "cpu", R, S)
    got, codes = _run(backend, DEVICE, R, S)
    failures = []
    for key in ALGORITHMS:
        rows = [got.get(r, {}) for r in range(P)]
        fatal = next((row["__fatal__"] for row in rows if "__fatal__" in row), None)
        errors = [row.get(key, {}).get("error") for row in rows if row.get(key, {}).get("error")]
        if len(got) < P or fatal or errors or any(key not in row for row in rows):
            note = (fatal or (errors[0] if errors else f"no result from every rank, exit codes {codes}")).strip()
            record(key, backend, P, False, float("nan"), note=f"{R}x{S}: " + note.splitlines()[-1][:150])
            failures.append(key)
            continue
        finals = [torch.from_numpy(row[key]["weights"]) for row in rows]
        refs = [torch.from_numpy(ref[r][key]["weights"]) for r in range(P)]
        diff = max(float((w - c).abs().max()) / float(c.abs().max()) for w, c in zip(finals, refs))
        finite = all(bool(torch.isfinite(w).all()) for w in finals)
        replicas = all(torch.equal(finals[0], w) for w in finals) if key in IDENTICAL_REPLICAS else True
        ok = finite and replicas and diff <= (DISCONTINUOUS_TOL if key in DISCONTINUOUS else SMOOTH)
        record(key, backend, P, ok, diff, note=f"{R}x{S}" + ("" if replicas else ", replicas differ"))
        if not ok:
            failures.append(key)
    assert not failures, f"{backend} at {R}x{S}: {failures}"
