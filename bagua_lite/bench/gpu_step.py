"""Our own cost in a step: every algorithm at P = 1 against the plain loop and DDP, in one run.

    python -m bagua_lite.bench.gpu_step                          # the reference transformer on the GPU
    python -m bagua_lite.bench.gpu_step --device cpu --small     # the harness on the CPU (a small model)
    python -m bagua_lite.bench --config benchmark_gpu --out bench_gpu   # the main job on a GPU: both models,
                                                                 # every row; table, CSV, JSON and a plot

At P = 1 nothing travels, so what a row costs over the plain loop is the wrapper's own work: hooks, copies
into buckets, codecs, selection, the engine's handoff. The reference model is a GPT-style decoder (12 layers x
768, vocabulary 8192, 512 tokens, batch 8: 91.7M parameters), bf16 autocast on a GPU, SGD with momentum (Adam
for qadam; the rows named "... fused" with ``fused=True``, where the synchronous rows' non-finite verdict and
the local steps' checks stay on the device); ``--models gpt,resnet18`` adds the zoo's ResNet-18 (CIFAR size, batch 128). ``--small``: a 2-layer
GPT and ResNet-18 at batch 4, for the CPU. Per row: the median ms of a step (from before forward to the device
being idle), the median ms until the host is back from ``optimizer.step()`` (close to the step's time when the
host waits for the device inside a step), the host synchronisations one step makes as
``torch.cuda.set_sync_debug_mode("warn")`` reports them (``count_syncs``): in all and on the training thread (a
sync that Python code on the engine's thread makes, such as the read of the deferred checks' flags, is counted
in all; one inside the C++ core's own calls is printed by torch, not counted), with the Python lines that made
them, the peak memory, and the bytes bagua_lite's counter says a step sends (0 at P = 1, where nothing
travels; none for the plain loop and DDP, which it does not see). No assertion on time.

A config of ``mode: step`` (``configs/benchmark_gpu.yaml``) runs this through ``python -m bagua_lite.bench``;
its keys are ``STEP_KEYS``, each the option of the same name.
"""
import argparse
import collections
import csv
import gc
import json
import os
import statistics
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import DistributedModel, comm
from ..algorithms import build
from .plot import pyplot
from .zoo import count_parameters, gpt, resnet18

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
#: the same rows with a fused optimizer (``fused=True``: it skips a step on the device when told to), where a
#: synchronous row's non-finite verdict and a local step's check stay on the device (bagua_lite.verdict): row ->
#: the row it repeats
FUSED = {f"{row} fused": row for row in ("plain", "ddp", "gradient_allreduce", "gradient_allreduce fp16",
                                         "gradient_allreduce uint8", "gradient_allreduce sign", "topk 0.001",
                                         "gtopk 0.001", "powersgd r4", "qadam", "local_sgd period 8",
                                         "diloco period 8")}
ROWS.update({row: ROWS[base] for row, base in FUSED.items()})


MODELS = ("gpt", "resnet18")
DDP_POWERSGD_RANK = 4  # torch's PowerSGD hook in the "ddp powersgd hook r4" row
#: a ``mode: step`` config's keys and their defaults (the command line's options of the same names)
STEP_KEYS = {"mode": "step", "device": "auto", "models": ["gpt"], "rows": list(ROWS), "steps": 12, "warmup": 3,
             "small": False}


def check_step_config(cfg):
    """A ``mode: step`` benchmark config with its defaults filled in; a bad key or value is named."""
    for key in cfg:
        if key not in STEP_KEYS:
            raise ValueError(f"benchmark config: unknown key {key!r} for mode step (allowed: {', '.join(STEP_KEYS)})")
    out = {**STEP_KEYS, **cfg}
    if out["device"] not in ("auto", "cpu", "cuda"):
        raise ValueError(f"benchmark config: device must be auto, cpu or cuda, got {out['device']!r}")
    for key, known in (("models", MODELS), ("rows", tuple(ROWS))):
        if not isinstance(out[key], list) or not out[key]:
            raise ValueError(f"benchmark config: {key} must be a non-empty list, got {out[key]!r}")
        unknown = [v for v in out[key] if v not in known]
        if unknown:
            raise ValueError(f"benchmark config: unknown {key} {unknown}; known: {', '.join(known)}")
    for key, low in (("steps", 1), ("warmup", 0)):
        if not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] < low:
            raise ValueError(f"benchmark config: {key} must be an int >= {low}, got {out[key]!r}")
    if not isinstance(out["small"], bool):
        raise ValueError(f"benchmark config: small must be true or false, got {out['small']!r}")
    return out


def _ddp(net, hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[0] if next(net.parameters()).is_cuda else None)
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=DDP_POWERSGD_RANK,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def _gpt_shape(small):
    return dict(vocab=256, seq_len=64, d_model=128, layers=2, heads=4) if small else \
        dict(vocab=8192, seq_len=512, d_model=768, layers=12, heads=12)


def build_model(model, small):
    """The untrained ``model`` (gpt or resnet18) at its reference size, or its small one."""
    return resnet18(num_classes=10, cifar=True) if model == "resnet18" else gpt(**_gpt_shape(small))


def _workload(model, dev, small):
    """(net on ``dev``, inputs, targets, classes) of a model, the same for every row."""
    gen = torch.Generator().manual_seed(1)
    net = build_model(model, small).to(dev)
    if model == "resnet18":
        batch = 4 if small else 128
        x = torch.randn(batch, 3, 32, 32, generator=gen)
        y = torch.randint(0, 10, (batch,), generator=gen)
        return net, x.to(dev), y.to(dev), 10
    shape = _gpt_shape(small)
    tokens = torch.randint(0, shape["vocab"], (2 if small else 8, shape["seq_len"] + 1), generator=gen).to(dev)
    return net, tokens[:, :-1], tokens[:, 1:], shape["vocab"]


def measure(row, dev, args, model_name="gpt"):
    kind, options = ROWS[row]
    torch.manual_seed(0)
    net, x, y, classes = _workload(model_name, dev, args.small)
    fused = row in FUSED
    opt = torch.optim.Adam(net.parameters(), lr=1e-4, fused=fused) if kind == "qadam" else \
        torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9, fused=fused)
    if kind == "plain":
        model, closing = net, None
    elif kind == "ddp":
        model, closing = _ddp(net, options.get("hook")), None
    else:
        model = DistributedModel(net, opt, build(kind, **options))
        closing = model
    cuda = dev.type == "cuda"

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, classes), y.reshape(-1))
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
    comm.reset_traffic()
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        loss = step()
        t1 = time.perf_counter()
        sync()
        full.append((time.perf_counter() - t0) * 1e3)
        host.append((t1 - t0) * 1e3)
    sent = comm.bytes_sent() / args.steps if closing is not None else None
    syncs = count_syncs(step) if cuda else None
    if cuda:
        sync()
    out = {"model": model_name, "row": row, "ms": statistics.median(full), "host_ms": statistics.median(host),
           "mb_per_step": None if sent is None else sent / 1e6,
           "syncs": syncs and syncs["all"], "syncs_training_thread": syncs and syncs["training thread"],
           "sync_sites": syncs and syncs["sites"], "loss": float(loss.detach()),
           "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "params": count_parameters(net)}
    if closing is not None:
        closing.close()
    return out


SYNC_WARNING = "called a synchronizing CUDA operation"


def count_syncs(step, steps=2, debug_mode=None):
    """Run ``step`` ``steps`` times under ``torch.cuda.set_sync_debug_mode("warn")`` (``debug_mode``: the
    setter, for a test) and count the host synchronisations torch warns about: the most any one step made,
    in all (every thread: the engine's reads the deferred checks' flags) and on the calling thread (the one
    that waits in the training loop), and the four most frequent sites. Two steps by default: a period's
    local and sync steps can differ."""
    debug_mode = torch.cuda.set_sync_debug_mode if debug_mode is None else debug_mode
    me, alls, mine, where = threading.get_ident(), [], [], collections.Counter()
    for _ in range(steps):
        hits = []

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                hits.append((threading.get_ident(), f"{os.path.relpath(filename)}:{lineno}"))
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            debug_mode("warn")
            try:
                step()
            finally:
                debug_mode("default")
        alls.append(len(hits))
        mine.append(sum(t == me for t, _ in hits))
        where.update(site for _, site in hits)
    return {"all": max(alls), "training thread": max(mine), "sites": where.most_common(4)}


def table(results):
    """The markdown table of one model's rows, with each row's ratios to the plain loop and DDP of the run."""
    ref = {r["row"]: r["ms"] for r in results if "ms" in r}
    lines = ["| row | ms/step | host ms | x plain | x DDP | syncs/step (training thread) | MB/step | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['error']} | | | | | | |")
            continue
        xp = r["ms"] / ref["plain"] if "plain" in ref else float("nan")
        xd = r["ms"] / ref["ddp"] if "ddp" in ref else float("nan")
        peak = f"{r['peak_gb']:.2f}" if r["peak_gb"] is not None else "-"
        mb = f"{r['mb_per_step']:.2f}" if r.get("mb_per_step") is not None else "-"
        syncs = "-" if r["syncs"] is None else f"{r['syncs']} ({r.get('syncs_training_thread')})"
        lines.append(f"| {r['row']} | {r['ms']:.2f} | {r['host_ms']:.2f} | {xp:.2f} | {xd:.2f} | {syncs} | {mb} "
                     f"| {peak} |")
    return "\n".join(lines)


def write_outputs(results, out_dir, dev):
    """results.json, results.csv, table.md and (with matplotlib) step.png: x DDP per row, one panel a model."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    fields = ["model", "row", "ms", "host_ms", "syncs", "syncs_training_thread", "mb_per_step", "peak_gb", "params",
              "loss", "error"]
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(results)
    models = list(dict.fromkeys(r["model"] for r in results))
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        for m in models:
            f.write(f"## {m} on {dev}\n\n{table([r for r in results if r['model'] == m])}\n\n")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(len(models), 1, figsize=(9, 3.2 * len(models)), squeeze=False)
    for ax, m in zip(axes[:, 0], models):
        rows = [r for r in results if r["model"] == m and "ms" in r]
        ddp = next((r["ms"] for r in rows if r["row"] == "ddp"), None)
        vals = [r["ms"] / ddp if ddp else r["ms"] for r in rows]
        ax.barh([r["row"] for r in rows], vals, color=["0.6" if r["row"] in ("plain", "ddp") or
                                                       r["row"].startswith("ddp ") else "C0" for r in rows])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("step time, x DDP" if ddp else "ms per step")
        ax.set_title(f"{m} on {dev}: one step at P = 1 (grey: torch)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "step.png"), dpi=110)
    plt.close(fig)


def run(models, rows, dev, args):
    """Every row of every model, in this process (P = 1); the rows as they are measured are printed."""
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        fd, store = tempfile.mkstemp(prefix="bagua_lite_step_")
        os.close(fd)
        os.unlink(store)
        dist.init_process_group("cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo",
                                store=dist.FileStore(store, 1), rank=0, world_size=1)
    results = []
    for model in models:
        for row in rows:
            try:
                results.append(measure(row, dev, args, model))
            except Exception as e:  # noqa: BLE001 - a row of the table, not the end of the run
                results.append({"model": model, "row": row, "error": f"{type(e).__name__}: {e}"[:200]})
            gc.collect()  # the row's model and optimizer, before the next row's peak memory is counted
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            print(results[-1], flush=True)
    for model in models:
        print(f"\n{model} on {dev}:\n{table([r for r in results if r['model'] == model])}")
    dist.destroy_process_group()
    return results


def _device(name):
    name = ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name
    return torch.device(name, 0) if name == "cuda" else torch.device("cpu")


def run_config(cfg, out_dir):
    """A ``mode: step`` config (``check_step_config``'s) end to end: the tables printed and written to ``out_dir``."""
    args = argparse.Namespace(small=cfg["small"], steps=cfg["steps"], warmup=cfg["warmup"])
    dev = _device(cfg["device"])
    results = run(cfg["models"], cfg["rows"], dev, args)
    write_outputs(results, out_dir, dev)
    print(f"wrote {out_dir}/results.json, results.csv, table.md, step.png")
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--small", action="store_true", help="small models (the harness on a CPU)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--models", default="gpt", help="comma-separated; known: " + ", ".join(MODELS))
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows; known: " + ", ".join(ROWS))
    p.add_argument("--json", default=None, help="the results as JSON to this file")
    p.add_argument("--out", default=None, help="a folder for results.json, results.csv, table.md and step.png")
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; known: {list(ROWS)}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; known: {list(MODELS)}")
    dev = _device(args.device)
    results = run(models, rows, dev, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.out:
        write_outputs(results, args.out, dev)


if __name__ == "__main__":
    main()
