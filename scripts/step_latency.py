"""Host cost of a latency-bound step at P > 1: where the model is tiny, a step is its collectives' latency.

    python scripts/step_latency.py [P] [steps] [buckets] [fused]     # defaults: 3 200 1

P processes on this machine (gloo over loopback) train test_long_run's 964-parameter MLP with the plain loop
(no communication: the floor), torch DDP, and bagua_lite's algorithms, one after another in the same
processes. Printed per row: the median ms/step over ``steps`` steps (after 20 warm-up steps) on rank 0, the
ratio to DDP measured in the same run, and for bagua_lite the median time a step waits for the engine and for
the round's agreement (DistributedModel.timings). ``buckets``: 1 puts the model in one bucket, more splits it.
``fused``: every row's SGD with ``fused=True`` (with BAGUA_LITE_DEFER_CHECKS=1, the rounds whose verdict then
stays on the device: bagua_lite/verdict.py).
"""
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROWS = [("plain", None, {}), ("ddp", None, {}),
        ("gradient_allreduce", "gradient_allreduce", {}),
        ("fp16", "gradient_allreduce", {"compression": "fp16"}),
        ("uint8", "gradient_allreduce", {"compression": "minmax_uint8"}),
        ("topk 0.05", "topk", {"density": 0.05}),
        ("gtopk 0.05", "gtopk", {"density": 0.05}),
        ("powersgd 2", "powersgd", {"rank": 2})]
WARMUP = 20


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.ReLU(), torch.nn.Linear(24, 24), torch.nn.ReLU(),
                               torch.nn.Linear(24, 4))


def _worker(rank, P, steps, buckets, fused, path, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=P)
    import bagua_lite
    from bagua_lite.algorithms import build
    results = {}
    bucket_mb = 964 * 4 / 1e6 / buckets * 1.01
    for label, name, options in ROWS:
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9, fused=fused)
        model = net
        if label == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=bucket_mb)
        elif name is not None:
            model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=bucket_mb)
        g = torch.Generator().manual_seed(1000 + rank)
        times, waits, agrees = [], [], []
        for step in range(WARMUP + steps):
            dist.barrier()
            x = torch.randn(8, 10, generator=g)
            t0 = time.perf_counter()
            before = dict(getattr(model, "timings", {}))
            loss = F.cross_entropy(model(x), (x[:, :4] * 2).argmax(1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step >= WARMUP:
                times.append(time.perf_counter() - t0)
                t = getattr(model, "timings", None)
                if t:
                    waits.append(t["backward_wait_s"] - before.get("backward_wait_s", 0))
                    agrees.append(t["agree_s"] - before.get("agree_s", 0))
        if hasattr(model, "close"):
            model.close()
        med = lambda v: statistics.median(v) * 1e3 if v else float("nan")  # noqa: E731
        results[label] = (med(times), med(waits), med(agrees), len(getattr(model, "buckets", [])))
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main():
    P = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    buckets = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    fused = len(sys.argv) > 4 and sys.argv[4] == "fused"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bagua_lite_lat_") as d:
        procs = [ctx.Process(target=_worker, args=(r, P, steps, buckets, fused, os.path.join(d, "store"), out))
                 for r in range(P)]
        for p in procs:
            p.start()
        res = out.get(timeout=1800)
        for p in procs:
            p.join()
    ddp = res["ddp"][0]
    print(f"P = {P}, {steps} steps (median, rank 0), requested buckets {buckets}{', fused SGD' if fused else ''}")
    print(f"{'row':20s} {'ms/step':>8s} {'x DDP':>6s} {'wait ms':>8s} {'agree ms':>8s} {'buckets':>7s}")
    for label, (ms, wait, agree, nb) in res.items():
        print(f"{label:20s} {ms:8.2f} {ms / ddp:6.2f} {wait:8.2f} {agree:8.2f} {nb:7d}")


if __name__ == "__main__":
    main()
