"""No allocation proportional to the model in a steady step, for every algorithm (the quality bar; issue 37).

Every rank trains the same MLP (weights of 128 KB, 1 MB and 32 KB, in three buckets) with the plain loop and
with each algorithm of the matrix, and records every CPU allocation of 16 KB or more during steps 7-14 (after
the warm-ups, whole periods of the periodic algorithms) through a watch on torch's CPU allocator
(``_C._alloc_watch_*``), which sees every thread: the trainer's, autograd's, the engine's, gloo's. A step of
an algorithm may make the allocations the plain loop's step makes (autograd's new gradients, after
``zero_grad()`` set them to None) and two kinds that are not ours, told apart here:
- inside torch's ``ProcessGroupGloo`` (its CPU allgather gathers into a flat tensor of its own, then copies
  into ours; NCCL writes into the caller's output on a GPU);
- a DiLoCo outer optimizer's own step (torch's SGD with Nesterov momentum adds out of place): the watch is
  paused around it, as it is around the plain loop's ``optimizer.step()`` for the same reason.
Anything else fails the test, with its size and C++ backtrace.
"""
import collections

import pytest
import torch
import torch.nn.functional as F

from algo_matrix import ALGORITHMS, mlp

SIZES = (64, 512, 512, 16)
MIN_BYTES = 16 * 1024
WARMUP, WATCHED = 6, 8


def _paused_around(optimizer):
    from bagua_lite import _C
    optimizer.register_step_pre_hook(lambda *_: _C._alloc_watch_pause(True))
    optimizer.register_step_post_hook(lambda *_: _C._alloc_watch_pause(False))


def _r_steady_allocations(rank, world_size, names):
    """Per name (and "plain"): per watched step, the (size, backtrace) of each allocation >= MIN_BYTES."""
    import bagua_lite
    from bagua_lite import _C
    from bagua_lite.algorithms import build
    out = {}
    for name in ("plain",) + tuple(names):
        net = mlp(SIZES)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3) if name == "qadam" else \
            torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        _paused_around(opt)
        model = net
        if name != "plain":
            algorithm, options = ALGORITHMS[name]
            model = bagua_lite.DistributedModel(net, opt, build(algorithm, **options), bucket_size_mb=0.6)
        steps, outers = [], set()
        for step in range(WARMUP + WATCHED):
            for outer in getattr(model, "algorithm", None) and getattr(model.algorithm, "outers", []) or []:
                if id(outer) not in outers:  # made at the first sync: watched from then on
                    outers.add(id(outer))
                    _paused_around(outer)
            x = torch.randn(4, SIZES[0], generator=torch.Generator().manual_seed(rank * 1000 + step))
            if step >= WARMUP:
                _C._alloc_watch_start(MIN_BYTES, True)
            F.cross_entropy(model(x), x[:, :SIZES[-1]].argmax(1)).backward()
            opt.step()
            opt.zero_grad()
            if step >= WARMUP:
                sizes, where = _C._alloc_watch_stop()
                steps.append(list(zip(sizes, where)))
        if name != "plain":
            model.close()
        out[name] = steps
    return out


def _ours(step, plain_step):
    """The allocations of one step that are neither gloo's nor the plain loop's (as a multiset of sizes)."""
    left = collections.Counter(size for size, _ in plain_step)
    mine = []
    for size, where in step:
        if "ProcessGroupGloo" in where:
            continue
        if left[size] > 0:
            left[size] -= 1
            continue
        mine.append((size, where))
    return mine


def _frames(where, keep=("bagua_lite", "at::_ops", "at::native")):
    lines = [line.split(": ", 1)[-1].split(" (0x")[0] for line in where.splitlines()]
    return "\n      ".join(line for line in lines if any(k in line for k in keep))[:1500]


@pytest.mark.parametrize("P", (2, 3), ids=lambda p: f"P{p}")
def test_a_steady_step_allocates_nothing_proportional_to_the_model(clusters, P):
    names = tuple(ALGORITHMS)
    results = clusters.get(P).run(_r_steady_allocations, names, timeout=400)
    problems, per_name = [], collections.Counter()
    for rank, res in enumerate(results):
        plain = res["plain"]
        assert all(len(s) >= 3 for s in plain), f"the watch missed the plain loop's gradients: {plain}"
        for name in names:
            for i, (step, plain_step) in enumerate(zip(res[name], plain)):
                for size, where in _ours(step, plain_step):
                    problems.append(f"{name}, rank {rank}, watched step {i}: {size} bytes at\n      {_frames(where)}")
                    per_name[name] += 1
    assert not problems, f"{len(problems)} allocation(s) of >= {MIN_BYTES} bytes in steady steps " \
        f"({dict(per_name)}):\n" + "\n".join(problems[:8])


def test_the_watch_sees_other_threads_and_pauses():
    """The watch itself: an allocation on another thread is recorded, one made while paused is not, and
    sizes under the threshold are left out."""
    import threading

    from bagua_lite import _C
    _C._alloc_watch_start(1 << 20)
    t = threading.Thread(target=lambda: torch.empty(300_000))  # 1.2 MB on another thread
    t.start()
    t.join()
    torch.empty(1000)  # 4 KB: under the threshold
    _C._alloc_watch_pause(True)
    torch.empty(400_000)
    _C._alloc_watch_pause(False)
    torch.empty(500_000)
    sizes, where = _C._alloc_watch_stop()
    assert sizes == [1_200_000, 2_000_000] and where == []
    with pytest.raises(ValueError, match="min_bytes must be >= 0, got -1"):
        _C._alloc_watch_start(-1)
