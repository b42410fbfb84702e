"""Convergence mode: which relaxation reaches the target first, in wall-clock training time.

Every cell (network, P, model, algorithm, DDP baselines included) starts from the same seeded weights and
trains the model's task (``bench.data.make_task``: the same data stream per rank for every algorithm) with
the cell's optimizer, evaluating every ``eval_every`` steps, until the held-out metric reaches the
target (``stop_at_target``) or the budget (``max_steps``, ``time_budget_s``) runs out.

Timing: ranks start each stretch of ``eval_every`` steps together (a barrier); a stretch's time is the
slowest rank's (one allreduce MAX after it), so the sum over stretches is the wall-clock training time
with every evaluation left out. ``time_to_target_s`` is that sum at the first evaluation that reached the
target, ``steps_to_target`` its step; ``step_s`` is the training time over the steps run.

What is evaluated: the *average of the replicas* (parameters and buffers, summed onto rank 0 and divided
by P), by rank 0, on the held-out set; the metric is broadcast so every rank stops at the same
evaluation. For synchronous algorithms the replicas are identical and the average is rank 0's model; for
decentralized, local SGD and asynchronous averaging it is the model their averaging tends to, the one a
user would keep. The averaging and the evaluation are not timed. With ``shards`` > 1 (HSDP) every rank
takes part in the averaging, which first makes each FSDP2-sharded parameter whole (``whole_state``).
"""
import copy
import gc
import time

import torch
import torch.distributed as dist

from .. import comm
from .cells import tx_bytes, wrap
from .config import BASELINES, cell_lr
from .data import evaluate, loss_fn, make_batches, make_task
from .timing import time_cell
from .zoo import fresh_model


def whole_state(net):
    """``net``'s state dict with every DTensor (an FSDP2-sharded model's parameters) made whole:
    ``full_tensor()`` gathers it over its mesh, collectively, so every rank calls this, and in the same
    order (the state dict's, the same on every rank). Plain tensors are returned as they are."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in net.state_dict().items()}


def average_replicas(net, into):
    """Rank 0's ``into`` (a plain, unsharded copy of the model) becomes the average of every rank's ``net``
    (floating-point parameters and buffers; integer buffers such as BatchNorm's step count are rank 0's).
    Collective: every rank calls. A sharded ``net`` (``shards`` > 1) is first made whole on every rank
    (``whole_state``), so the ranks of a replica hold the same whole weights and the average over all
    ranks is the average over the replicas."""
    world = dist.get_world_size()
    state = whole_state(net)
    src = [t for t in state.values() if t.is_floating_point()]
    flat = torch.cat([t.detach().reshape(-1).double() for t in src]) if src else torch.zeros(0, dtype=torch.float64)
    dist.reduce(flat, dst=0)
    if dist.get_rank() != 0:
        return
    into.load_state_dict(state)
    flat /= world
    offset = 0
    with torch.no_grad():
        for t in (t for t in into.state_dict().values() if t.is_floating_point()):
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def reached(metric, value, target):
    return value >= target if metric == "accuracy" else value <= target


def run_cell(cell, cfg, model_name, task, rank, world):
    """Train one cell to its target or budget; returns the record's measured fields (same on every rank)."""

    gc.collect()
    net, _ = fresh_model(model_name, cfg["seed"])
    eval_net = copy.deepcopy(net)
    model, wrapper, opt, handle = wrap(cell, cfg, net)
    metric, target = cfg["metric"], cfg["target"]
    task.reset()

    def evaluation():
        average_replicas(net, eval_net)
        out = torch.tensor(evaluate(eval_net, task) if rank == 0 else (0.0, 0.0), dtype=torch.float64)
        dist.broadcast(out, 0)
        acc, loss = out.tolist()
        return acc if metric == "accuracy" else loss, loss

    t_eval = time.perf_counter()
    value, heldout = evaluation()
    eval_s = time.perf_counter() - t_eval
    curve = [[0, 0.0, value, heldout]]  # [step, training seconds, metric, held-out loss]
    train_s, step, hit = 0.0, 0, None
    train_losses = []
    wire = 0  # bytes this rank's link sent in training stretches (evaluations cross it too, so per stretch)
    budget = cfg.get("time_budget_s")
    # bagua_lite's own counter counts training traffic only, so it runs over the whole cell and is read once
    # the wrapper is closed: a background sync launched by a stretch's last step (streaming DiLoCo's, whose
    # fragments can start exactly at an evaluation) still sends during the evaluation and belongs to training
    comm.reset_traffic()
    while step < cfg["max_steps"]:
        n = min(cfg["eval_every"], cfg["max_steps"] - step)
        dist.barrier()
        tx0 = tx_bytes()
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = task.batch(step)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            step += 1
        stretch = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        wire = None if tx0 is None or wire is None else wire + tx_bytes() - tx0
        train_losses.append(float(loss.detach()))
        dist.all_reduce(stretch, op=dist.ReduceOp.MAX)
        train_s += float(stretch)
        t_eval = time.perf_counter()
        value, heldout = evaluation()
        eval_s += time.perf_counter() - t_eval
        curve.append([step, train_s, value, heldout])
        if hit is None and reached(metric, value, target):
            hit = (step, train_s)
            if cfg["stop_at_target"]:
                break
        if budget is not None and train_s >= budget:
            break
    picked = decision = None
    if wrapper is not None:
        # auto: probed the network and calibrated when wrapped (not timed), trained its probe steps as local
        # SGD (timed: they are training steps), then handed the model its pick
        picked = getattr(wrapper.configured_algorithm, "picked_label", None)
        decision = (getattr(wrapper.configured_algorithm, "decision", None) or {}).get("line")
        wrapper.close()
    if handle is not None:
        handle.close()
    counted = comm.bytes_sent()
    return {"metric": metric, "target": target, "curve": curve,
            "steps_to_target": hit[0] if hit else None, "time_to_target_s": hit[1] if hit else None,
            "final_metric": value, "final_loss": heldout, "train_loss": train_losses[-1] if train_losses else None,
            "steps_run": step, "train_s": train_s, "eval_s": eval_s,
            "step_s": train_s / step if step else None, "picked": picked, "decision": decision,
            # per step per rank, over the training stretches (rank 0's); our own collectives only for the first
            "bytes_per_step_counted": counted / step if step and wrapper is not None else None,
            "bytes_per_step_wire": wire / step if step and wire is not None else None}


def worker(cfg, network, rank, world, emit):
    """Every convergence cell of this launch (one network, one P), in config order, once per seed."""
    for seed in cfg["seeds"]:
        scfg = {**cfg, "seed": seed}
        for model_name in cfg["models"]:
            net0, spec = fresh_model(model_name, seed)
            numel = sum(p.numel() for p in net0.parameters())
            task = make_task(spec, rank, world, cfg["batch_size"], cfg["eval_samples"], seed)
            for cell in cfg["algorithms"]:
                res = run_cell(cell, scfg, model_name, task, rank, world)
                emit({"kind": "convergence", "network": network, "world_size": world, "model": model_name,
                      "algorithm": cell["name"], "label": cell["label"], "options": cell["options"],
                      "optimizer": cell.get("optimizer", "sgd"), "numel": numel, "batch_size": cfg["batch_size"],
                      "lr": cell_lr(cell, cfg), "seed": seed, **layout_fields(cfg), **res})


def layout_fields(cfg):
    """The layout a record carries: ranks per replica and per node, and (sharded) how FSDP2 wrapped it."""
    out = {"shards": cfg.get("shards", 1), "ranks_per_node": cfg.get("ranks_per_node", 1)}
    if out["shards"] > 1:
        out.update(fsdp_units=cfg.get("fsdp_units", "blocks"),
                   reshard_after_forward=cfg.get("reshard_after_forward", True))
    return out


def timing_worker(cfg, network, rank, world, emit):
    """``project_time``: the seconds per step of every cell on this (throttled) network, measured as the
    throughput mode measures them (``timing.time_cell``: a barrier per step, the slowest rank's time, whole
    cycles of a periodic algorithm, at least two), over ``timing_steps`` steps after
    ``timing_warmup_steps``. An algorithm with a ``warmup_steps`` option > 0 is timed in both of its phases
    (the record's ``phases``: ``warmup`` and ``after``). Synthetic batches of the model's shape: what the batches hold does not change
    a step's time. The steps to target come from the loopback run (``report.project_rows``). With
    ``timing_repeats`` R the whole list runs R times in a row (A B C A B C), each record marked ``repeat``."""
    tcfg = {**cfg, "steps": cfg["timing_steps"], "warmup_steps": cfg["timing_warmup_steps"],
            "max_steps": cfg["timing_steps"], "min_cell_s": 0.0}
    for model_name in cfg["models"]:
        net0, spec = fresh_model(model_name)
        numel = sum(p.numel() for p in net0.parameters())
        batches = make_batches(spec, cfg["batch_size"], 8, rank)
        for repeat, cell in [(r, c) for r in range(cfg.get("timing_repeats", 1)) for c in cfg["algorithms"]]:
            warm = cell["options"].get("warmup_steps", 0) if cell["name"] not in BASELINES else 0
            phases = {}
            if warm:
                # two phases, each timed on its own: the warm-up (dense: the same algorithm with a warm-up
                # that outlasts the timing run) and what follows it (the same algorithm without warm-up)
                for phase, w in (("warmup", 10 ** 9), ("after", 0)):
                    res = time_cell({**cell, "options": {**cell["options"], "warmup_steps": w}}, tcfg, model_name,
                                    batches, rank, world)
                    phases[phase] = {k: res[k] for k in ("times", "cycle", "bytes", "tx_bytes")}
            else:
                res = time_cell(cell, tcfg, model_name, batches, rank, world)
            emit({"kind": "timing", "network": network, "world_size": world, "model": model_name,
                  "algorithm": cell["name"], "label": cell["label"], "options": cell["options"],
                  "optimizer": cell.get("optimizer", "sgd"), "numel": numel, "batch_size": cfg["batch_size"],
                  "times": res["times"], "cycle": res["cycle"], "bytes": res["bytes"], "tx_bytes": res["tx_bytes"],
                  "loss": res["loss"], "warmup_steps": warm, "phases": phases or None, "repeat": repeat,
                  **layout_fields(cfg)})
