"""One cell's seconds per step on this rank, as the throughput mode measures them (``runner``) and as
``project_time``'s timing runs do (``convergence.timing_worker``): a barrier per step, the slowest rank's
time, whole cycles of a periodic algorithm."""
import gc
import time

import torch
import torch.distributed as dist

from .. import comm
from .cells import tx_bytes, wrap
from .config import STRAGGLER_RANK
from .data import loss_fn
from .report import cycle_median
from .zoo import fresh_model


def time_cell(cell, cfg, model_name, batches, rank, world, straggler="none"):
    """Train ``model_name`` with one algorithm; returns per-step times (every rank's) and counters.

    ``straggler="half"``: rank ``STRAGGLER_RANK`` sleeps, at the start of each step, for as long as its
    previous step's own work took (see ``runner``'s module docstring). An asynchronous algorithm runs a fixed
    number of steps with no per-step collective and exchanges the step times once, at the end.
    """
    gc.collect()  # the previous cell's model, buffers and DDP reducer are gone before this one is timed
    net, _ = fresh_model(model_name)
    name = cell["name"]
    model, wrapper, opt, handle = wrap(cell, cfg, net)
    ours = wrapper is not None
    # a DistributedModel's engine overlaps backward: how long backward waited for it and how busy it was.
    # A ShardedModel (shards > 1) runs each unit's exchange inside FSDP2's hook, which waits for it: there
    # is no overlap to measure, and it keeps no such counters (its rows get no waits/busy).
    profiled = ours and hasattr(wrapper, "engine_stats")
    asynchronous = ours and bool(getattr(wrapper.algorithm, "asynchronous", False))
    slow = straggler == "half" and rank == STRAGGLER_RANK
    times, losses, waits, busy, sent, tx = [], [], [], [], [], []
    rank_times = [[] for _ in range(world)]  # rank_times[r]: rank r's own measured step times
    own = []  # this rank's (asynchronous: exchanged after the last step)
    warm = cfg["warmup_steps"]
    if ours and name == "auto":
        # timed from the second step of its pick: the probe steps and the switch are set-up, as
        # start_powerSGD_iter is for the PowerSGD baseline
        warm = max(warm, int(wrapper.configured_algorithm.probe_steps) + 1)
    cycle, measure, most = 1, cfg["steps"], cfg["max_steps"]
    step = 0
    pending_sleep = 0.0  # the straggler's sleep for its previous step, taken at the start of the next
    if asynchronous:
        dist.barrier()  # the ranks start the cell together; no collective of ours after this until the end
    while step < warm + measure:
        if step == warm and (ours or handle is not None):
            # A periodic relaxation (local SGD, decentralized with an interval, torchft's DiLoCo) is timed
            # over whole cycles, at least two; the summary averages within a cycle and takes the median across.
            cycle = max(1, int(wrapper.algorithm.cycle if ours else handle.cycle))
            measure = max(measure, 2 * cycle)
            measure = -(-measure // cycle) * cycle
            most = max(measure, most // cycle * cycle)
            if asynchronous:
                # no rank can tell when the others have measured enough: a fixed count, the same on all
                measure = most
        x, y = batches[step % len(batches)]
        if not asynchronous:
            dist.barrier()
        comm.reset_traffic()
        tx0 = tx_bytes()
        wait0 = wrapper.timings["backward_wait_s"] if profiled else 0.0
        if profiled:
            wrapper.engine_stats(reset=True)
        t0 = time.perf_counter()
        if pending_sleep:
            time.sleep(pending_sleep)
        t_work = time.perf_counter()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t1 = time.perf_counter()
        dt = t1 - t0
        if slow:
            pending_sleep = t1 - t_work  # this step's own compute + communication, without the sleep
        if step >= warm:
            if asynchronous:
                own.append(dt)
            else:
                # Every rank's time of this step, known to every rank, so that all of them agree on
                # when the cell has measured enough (the slowest rank's time decides).
                per = torch.zeros(world, dtype=torch.float64)
                per[rank] = dt
                dist.all_reduce(per)
                for r, t in enumerate(per.tolist()):
                    rank_times[r].append(t)
                times.append(max(per.tolist()))
            losses.append(float(loss.detach()))
            if profiled:
                waits.append(wrapper.timings["backward_wait_s"] - wait0)
                busy.append(wrapper.engine_stats()["busy_seconds"])
            sent.append(comm.bytes_sent())
            tx1 = tx_bytes()
            tx.append(None if tx0 is None else tx1 - tx0)
        step += 1
        # Cheap cells measure more steps (at least min_cell_s of measured time, whole cycles, at most
        # max_steps), so that their medians are as steady as those of the slow cells.
        if (not asynchronous and step == warm + measure and measure + cycle <= most
                and sum(times) < cfg["min_cell_s"]):
            measure += cycle
    if asynchronous:
        # One exchange after the cell (every rank measured the same number of steps): rank r's row.
        per = torch.zeros(world, len(own), dtype=torch.float64)
        per[rank] = torch.tensor(own, dtype=torch.float64)
        dist.all_reduce(per)
        rank_times = per.tolist()
        # The cell's step time is the slowest rank's (the one with the largest median); ranks' steps are
        # not aligned, so a per-step maximum would mean nothing.
        times = max(rank_times, key=lambda ts: cycle_median(ts, cycle))
    picked = None
    if ours:
        picked = getattr(wrapper.configured_algorithm, "picked", None)
        picked = repr(picked) if picked is not None else None
        wrapper.close()  # on every rank: an asynchronous algorithm ends its background work collectively
    if handle is not None:
        handle.close()
    return {"times": times, "rank_times": rank_times, "loss": losses[-1] if losses else float("nan"),
            "waits": waits, "busy": busy, "bytes": sent, "tx_bytes": tx, "picked": picked, "cycle": cycle,
            "asynchronous": asynchronous}
