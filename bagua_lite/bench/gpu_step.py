"""Our own cost in a step: every algorithm at P = 1 against the plain loop and DDP, in one run.

    python -m bagua_lite.bench.gpu_step                          # the reference transformer on the GPU
    python -m bagua_lite.bench.gpu_step --device cpu --small     # the harness on the CPU (a small model)

At P = 1 nothing travels, so what a row costs over the plain loop is the wrapper's own work: hooks, copies
into buckets, codecs, selection, the engine's handoff. The reference model is a GPT-style decoder (12 layers x
768, vocabulary 8192, 512 tokens, batch 8: 97.6M parameters), bf16 autocast on a GPU, SGD with momentum (Adam
for qadam). Per row: the median ms of a step (from before forward to the device being idle), the median
ms until the host is back from ``optimizer.step()`` (close to the step's time when the host waits for the
device inside a step), the host synchronisations one step makes as ``torch.cuda.set_sync_debug_mode("warn")``
reports them on the training thread (the engine's own thread is not seen) with the Python lines that made
them, and the peak memory. No
assertion on time.
"""
import argparse
import collections
import gc
import json
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import DistributedModel
from ..algorithms import build
from .zoo import count_parameters, gpt

#: row -> ("plain" | "ddp" | an algorithm's registered name, options)
ROWS = {
    "plain": ("plain", {}),
    "ddp": ("ddp", {}),
    "ddp fp16 hook": ("ddp", {"hook": "fp16"}),
    "ddp powersgd hook r4": ("ddp", {"hook": "powersgd"}),
    "gradient_allreduce": ("gradient_allreduce", {}),
    "gradient_allreduce fp16": ("gradient_allreduce", {"compression": "fp16"}),
    "gradient_allreduce uint8": ("gradient_allreduce", {"compression": "minmax_uint8"}),
    "gradient_allreduce sign": ("gradient_allreduce", {"compression": "sign"}),
    "topk 0.001": ("topk", {"density": 0.001}),
    "gtopk 0.001": ("gtopk", {"density": 0.001}),
    "powersgd r4": ("powersgd", {"rank": 4}),
    "qadam": ("qadam", {"warmup_steps": 2}),
    "local_sgd period 8": ("local_sgd", {"period": 8}),
    "diloco period 8": ("diloco", {"period": 8}),
}


def _ddp(net, hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[0] if next(net.parameters()).is_cuda else None)
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def measure(row, dev, args):
    kind, options = ROWS[row]
    torch.manual_seed(0)
    shape = dict(vocab=256, seq_len=64, d_model=128, layers=2, heads=4) if args.small else \
        dict(vocab=8192, seq_len=512, d_model=768, layers=12, heads=12)
    net = gpt(**shape).to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4) if kind == "qadam" else \
        torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    if kind == "plain":
        model, closing = net, None
    elif kind == "ddp":
        model, closing = _ddp(net, options.get("hook")), None
    else:
        model = DistributedModel(net, opt, build(kind, **options))
        closing = model
    batch = 2 if args.small else 8
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocab"], (batch, shape["seq_len"] + 1), generator=gen).to(dev)
    x, y = tokens[:, :-1], tokens[:, 1:]
    cuda = dev.type == "cuda"

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, shape["vocab"]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    full, host = [], []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        loss = step()
        t1 = time.perf_counter()
        sync()
        full.append((time.perf_counter() - t0) * 1e3)
        host.append((t1 - t0) * 1e3)
    syncs, where = [], collections.Counter()
    if cuda:
        for _ in range(2):  # two steps: a period's local and a sync step can differ; the larger is reported
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            hits = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
            syncs.append(len(hits))
            where.update(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in hits)
        sync()
    out = {"row": row, "ms": statistics.median(full), "host_ms": statistics.median(host),
           "syncs": max(syncs) if syncs else None, "sync_sites": where.most_common(4), "loss": float(loss),
           "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "params": count_parameters(net)}
    if closing is not None:
        closing.close()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="a 2-layer model (the harness on a CPU)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows; known: " + ", ".join(ROWS))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; known: {list(ROWS)}")
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        fd, store = tempfile.mkstemp(prefix="bagua_lite_step_")
        os.close(fd)
        os.unlink(store)
        dist.init_process_group("cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo",
                                store=dist.FileStore(store, 1), rank=0, world_size=1)
    results = []
    for row in rows:
        try:
            results.append(measure(row, dev, args))
        except Exception as e:  # noqa: BLE001 - a row of the table, not the end of the run
            results.append({"row": row, "error": f"{type(e).__name__}: {e}"[:200]})
        gc.collect()  # the row's model and optimizer, before the next row's peak memory is counted
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        r = results[-1]
        print(r, flush=True)
    ref = {r["row"]: r["ms"] for r in results if "ms" in r}
    print("\n| row | ms/step | host ms | x plain | x DDP | syncs/step | peak GiB |\n|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['row']} | {r['error']} | | | | | |")
            continue
        xp = r["ms"] / ref["plain"] if "plain" in ref else float("nan")
        xd = r["ms"] / ref["ddp"] if "ddp" in ref else float("nan")
        peak = f"{r['peak_gb']:.2f}" if r["peak_gb"] is not None else "-"
        print(f"| {r['row']} | {r['ms']:.2f} | {r['host_ms']:.2f} | {xp:.2f} | {xd:.2f} | {r['syncs']} | {peak} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
