"""Host time of our gradient hook per parameter (issue 37: per-parameter Python work in the hot path).

    python scripts/hook_cost.py gradient_allreduce topk gtopk local_sgd

One process (gloo, P = 1) trains 300 Linear(8, 8) layers (600 parameters, so the hook, not the arithmetic,
is what is timed) with each algorithm for 12 x 10 steps; every call of the scheduler's gradient hook is timed,
and the median and minimum over the 12 rounds of the mean time per call are printed. The timer wraps the hook
the same way for every algorithm, so the figures compare algorithms and versions, not absolute cost.
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import bagua_lite
from bagua_lite import scheduler


def main(kinds):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    cls = next(c for c in vars(scheduler).values() if isinstance(c, type) and "_on_grad_ready" in vars(c))
    hook, acc = cls._on_grad_ready, [0.0, 0]

    def timed(self, p):
        t = time.perf_counter()
        hook(self, p)
        acc[0] += time.perf_counter() - t
        acc[1] += 1

    cls._on_grad_ready = timed  # before the models are made: they register the bound method
    x = torch.randn(4, 8)
    for kind in kinds:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(300)])
        opt = torch.optim.SGD(net.parameters(), lr=0.0, momentum=0.9)  # lr 0: 600 layers would diverge
        model = bagua_lite.DistributedModel(net, opt, algorithm=kind)
        per = []
        for _ in range(12):
            acc[:] = [0.0, 0]
            for _ in range(10):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            per.append(acc[0] / acc[1])
        model.close()
        print(f"{kind:20s} hook: median {statistics.median(per) * 1e6:.2f} us, min {min(per) * 1e6:.2f} us per parameter")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:] or ["gradient_allreduce", "topk", "gtopk", "local_sgd"])
