"""Synchronous rounds whose non-finite verdict stays on the device (bagua_lite.verdict: dense averaging's in its
result, the codecs', PowerSGD's, topk's, gtopk's and qadam's in their agreed flags, their state put back there), and local steps (local
SGD, DiLoCo) whose checks stay there: with a fused optimizer, with or without a GradScaler, a step makes no
host synchronisation on any thread (counted with ``torch.cuda.set_sync_debug_mode("warn")``, as
``bench.gpu_step`` counts them), and a non-finite gradient on one rank is still skipped (dense: on every rank;
local: on that rank alone): the weights across the bad step are bit for bit those before it, the scaler's
scale falls, and without a scaler the error comes at the next forward. NCCL at P = 1 (held to no
synchronisation, topk with momentum correction too: its check of .grad joins the fused SGD's found_inf), gloo with CUDA tensors at P = 2 (counted only: gloo copies CUDA tensors through the host).
With the CPU standing in, the same run with BAGUA_LITE_DEFER_CHECKS=1 (no count).
"""
import os

import pytest
import torch
import torch.nn.functional as F

from gpu_device import DEVICE, serve_rows, spawn_ranks

BAD_STEP, STEPS = 5, 8  # steps 2 and 3 are counted, 4 on recorded
ALGORITHMS = {"dense": ("gradient_allreduce", {}), "fp16": ("gradient_allreduce", {"compression": "fp16"}),
              "uint8": ("gradient_allreduce", {"compression": "minmax_uint8"}),
              "sign": ("gradient_allreduce", {"compression": "sign"}),
              "powersgd": ("powersgd", {"rank": 2, "min_compression_rate": 1.0}),
              # double-buffered residuals, a discarded round's working copies put back on the device
              "topk": ("topk", {"density": 0.01, "momentum_correction": 0}),
              "gtopk": ("gtopk", {"density": 0.01, "momentum_correction": 0}),
              # momentum correction (refuses a loss scaler): its own update skips with the fused SGD's
              "topk_mc": ("topk", {"density": 0.01}),
              # after its freeze (step 1): the frozen Adam update on the device, skipped with the fused Adam's
              "qadam": ("qadam", {"warmup_steps": 1}),
              "local_sgd": ("local_sgd", {"period": 1000}), "diloco": ("diloco", {"period": 1000}),
              # two micro-batches a step accumulated without no_sync(), the bad one first: the second's forward
              # finds .grad as the first backward left it, and leaves the checks to the step (no read)
              "diloco_x2": ("diloco", {"period": 1000})}
LOCAL = ("local_sgd", "diloco", "diloco_x2")  # gradients stay local: only the bad rank skips (no average here)
MICRO_BATCHES = {"diloco_x2": 2}
# host synchronisations a step makes under NCCL, where not 0 (P = 1: topk's exchange is its own pairs, gtopk's
# rounds are tensor ops, momentum correction's refuse_changed leaves its answer in the fused SGD's found_inf)
# (qadam under a GradScaler: refuse_changed's answer is read, as the scaler's found_inf cannot take it: the
# scaler's update would read a refusal as an overflow)
HELD = {"qadam fused+scaler": 1}
CASES = {f"{a} {driver}": (a, driver) for a in ALGORITHMS for driver in ("fused", "fused+scaler")
         if not (a == "topk_mc" and driver == "fused+scaler")}
BACKENDS = [("nccl", 1), ("gloo", 2)] if DEVICE == "cuda" else [("gloo", 1), ("gloo", 2)]


def _case(dev, name):
    import bagua_lite
    import torch.distributed as dist
    from bagua_lite.algorithms import build
    from bagua_lite.bench.gpu_step import count_syncs
    codec, driver = CASES[name]
    rank, P = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 10)).to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=True) if codec == "qadam" else \
        torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, fused=True)
    scaler = torch.amp.GradScaler(dev.type, init_scale=2.0 ** 8) if driver == "fused+scaler" else None
    algorithm, options = ALGORITHMS[codec]
    model = bagua_lite.DistributedModel(net, opt, build(algorithm, **options), bucket_size_mb=0.1,
                                        grad_scaler=scaler)
    state = {"s": 0, "errors": [], "weights": {}, "scales": {}}

    def step(bad=False, keep=True):
        micro_batches = MICRO_BATCHES.get(codec, 1)
        for m in range(micro_batches):
            g = torch.Generator().manual_seed(rank * 7919 + (state["s"] * micro_batches + m) * 31 + 5)
            x = torch.randn(32, 64, generator=g).to(dev)
            try:
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), x[:, :10].argmax(1))
            except FloatingPointError as e:
                state["errors"].append(("forward", state["s"], str(e)[:80]))
                return
            if bad and m == 0:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        state["s"] += 1
        if keep:  # host reads of our own: not in a counted step
            state["weights"][state["s"] - 1] = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).cpu()
            state["scales"][state["s"] - 1] = float(scaler.get_scale()) if scaler else None

    for _ in range(2):
        step(keep=False)
    syncs = count_syncs(lambda: step(keep=False), steps=2) if dev.type == "cuda" else None
    if syncs is None:
        step(keep=False), step(keep=False)
    while state["s"] < STEPS:
        step(bad=state["s"] == BAD_STEP and rank == P - 1)
    on_device = model._verdict_round
    model.close()
    return {"syncs": syncs, "errors": state["errors"], "weights": {k: w.numpy() for k, w in state["weights"].items()},
            "scales": state["scales"], "on_device": on_device}


def _worker(rank, P, backend, device, store_path, results):
    if device == "cpu":
        os.environ["BAGUA_LITE_DEFER_CHECKS"] = "1"
    serve_rows(rank, P, backend, device, store_path, results, list(CASES), _case)


@pytest.mark.parametrize("backend,P", BACKENDS, ids=[f"{b}-P{p}" for b, p in BACKENDS])
def test_verdict_on_the_device_makes_no_host_synchronisation(dev, record, backend, P):
    got, codes = spawn_ranks(_worker, P, (backend, DEVICE), timeout=240)
    assert len(got) == P and not any("__fatal__" in o for o in got.values()), (got, codes)
    ok_all = True
    for name in CASES:
        outs = [got[r][name] for r in range(P)]
        if any(isinstance(o, str) for o in outs):
            record(f"verdict on the device: {name}", backend, P, False, float("nan"),
                   note=next(o for o in outs if isinstance(o, str)).strip().splitlines()[-1][:200])
            ok_all = False
            continue
        local = CASES[name][0] in LOCAL
        o = outs[P - 1]  # the bad rank
        w, i = o["weights"], BAD_STEP  # w[k]: after step k
        skipped = (w[i] == w[i - 1]).all() and not (w[STEPS - 1] == w[i]).all()
        replicas = local or all((x["weights"][STEPS - 1] == w[STEPS - 1]).all() for x in outs)
        if CASES[name][1] == "fused":
            reported = [e[:2] for e in o["errors"]] == [("forward", BAD_STEP + 1)]
        else:
            reported = o["errors"] == [] and o["scales"][i] < o["scales"][i - 1]
        if local:  # the others trained on, untouched
            reported &= all(x["errors"] == [] and not (x["weights"][i] == x["weights"][i - 1]).all()
                            for x in outs[:-1])
        syncs = [x["syncs"] for x in outs]
        # held to none under NCCL; gloo carries CUDA tensors through host copies of its own (counted, not held)
        none = backend != "nccl" or all(s is None or s["all"] == HELD.get(name, 0) for s in syncs)
        ok = bool((o["on_device"] or local) and skipped and replicas and reported and none)
        ok_all &= ok
        note = "syncs/step: " + ("n/a (CPU)" if syncs[0] is None else
                                 ", ".join(f"{s['all']} {s['sites']}" for s in syncs))
        record(f"verdict on the device: {name}", backend, P, ok, 0.0, repeat="",
               note=f"{note}; bad step skipped: {bool(skipped)}; reported: {reported}; errors: {o['errors']}"[:300])
    assert ok_all
