"""No allocation proportional to the model in a steady step, on the device (tests/test_allocations.py holds
the CPU to it allocation by allocation at P = 2 and 3).

At P = 1 ("nccl" on a GPU; gloo when the CPU stands in), every algorithm of the matrix trains the MLP of
tests/test_allocations.py on the device; over 8 steps after 6 warm-up steps, the bytes the device's
allocator hands out (``torch.cuda.memory_stats()["allocated_bytes.all.allocated"]``; on the CPU the C++
allocation watch) are summed, leaving out the optimizers' own steps (the user's and a DiLoCo outer
optimizer's, measured around them). The excess over the plain loop's steps must stay under 1/8 of the
model's bytes a step: flags, step counters and scalars pass; a copy of a bucket does not.
"""
import functools

import torch
import torch.nn.functional as F

from algo_matrix import ALGORITHMS, mlp
from gpu_device import DEVICE, serve_rows, spawn_ranks
from test_allocations import SIZES, WARMUP, WATCHED  # the CPU test's MLP and window


class _Meter:
    """Bytes allocated on the device since start(), the optimizers' steps left out."""

    def __init__(self, dev):
        self.cuda = dev.type == "cuda"
        self.left_out, self._t0, self._pause, self.active = 0, 0, None, False

    def _now(self):
        if self.cuda:
            return torch.cuda.memory_stats()["allocated_bytes.all.allocated"]
        from bagua_lite import _C
        sizes, _ = _C._alloc_watch_stop()  # the CPU watch counts from its start: restart it, keep the sum
        self._cpu = getattr(self, "_cpu", 0) + sum(sizes)
        _C._alloc_watch_start(0)
        return self._cpu

    def start(self):
        if not self.cuda:
            from bagua_lite import _C
            _C._alloc_watch_start(0)
            self._cpu = 0
        self.left_out, self._t0, self.active = 0, self._now(), True

    def stop(self):
        total = self._now() - self._t0 - self.left_out
        self.active = False
        if not self.cuda:
            from bagua_lite import _C
            _C._alloc_watch_stop()
        return total

    def leave_out(self, optimizer):
        def pre(*_):
            if self.active:
                self._pause = self._now()

        def post(*_):
            if self.active:
                self.left_out += self._now() - self._pause
        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)


def _steady_bytes(rank, dev, name):
    import bagua_lite
    from bagua_lite.algorithms import build
    net = mlp(SIZES).to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3) if name == "qadam" else \
        torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    meter = _Meter(dev)
    meter.leave_out(opt)
    model = net
    if name != "plain":
        algorithm, options = ALGORITHMS[name]
        model = bagua_lite.DistributedModel(net, opt, build(algorithm, **options), bucket_size_mb=0.6)
    seen = set()
    for step in range(WARMUP + WATCHED):
        for outer in getattr(getattr(model, "algorithm", None), "outers", None) or []:
            if id(outer) not in seen:
                seen.add(id(outer))
                meter.leave_out(outer)
        x = torch.randn(4, SIZES[0], generator=torch.Generator().manual_seed(rank * 1000 + step)).to(dev)
        if step == WARMUP:
            meter.start()
        F.cross_entropy(model(x), x[:, :SIZES[-1]].argmax(1)).backward()
        opt.step()
        opt.zero_grad()
    total = meter.stop()
    if name != "plain":
        model.close()
    return total / WATCHED, sum(p.numel() * p.element_size() for p in net.parameters())


def _worker(rank, P, backend, device, store_path, results):
    serve_rows(rank, P, backend, device, store_path, results, ("plain",) + tuple(ALGORITHMS),
               functools.partial(_steady_bytes, rank))


def test_a_steady_step_allocates_nothing_proportional_to_the_model_on_the_device(dev, record):
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    got, codes = spawn_ranks(_worker, 1, (backend, DEVICE), timeout=300)
    assert 0 in got and "__fatal__" not in got[0], (got, codes)
    res = got[0]
    assert not isinstance(res["plain"], str), res["plain"]
    plain, model_bytes = res["plain"]
    bad = []
    for name in ALGORITHMS:
        if isinstance(res[name], str):
            record(f"steady-step allocations: {name}", backend, 1, False, float("nan"), note=res[name][-200:])
            bad.append(name)
            continue
        per_step = res[name][0] - plain
        ok = per_step < model_bytes / 8
        record(f"steady-step allocations: {name}", backend, 1, ok, float(per_step),
               note=f"bytes a step over the plain loop's ({plain:.0f}); model {model_bytes} bytes")
        if not ok:
            bad.append(f"{name}: {per_step:.0f} bytes a step")
    assert not bad, f"allocations proportional to the model ({model_bytes} bytes) in steady steps: {bad}"
