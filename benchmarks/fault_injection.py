"""Fault injection for ``DistributedModel(..., fault_tolerant=True)``: workers SIGKILLed or SIGSTOPped
while training, replacements started at once (as a process manager would), and what it costs.

    python benchmarks/fault_injection.py matrix            # every algorithm x P = 4, 5 x faults at random steps
    python benchmarks/fault_injection.py digits --every 30 # accuracy with a worker killed and replaced every 30 steps,
                                                           # then one kill recovered by torchrun --max-restarts
    python benchmarks/fault_injection.py restart           # that torchrun restart alone

Workers are real processes, each started on its own with the variables torchrun would set and
``bagua_lite.init_process_group()``, all clients of a TCPStore served by this script (the store must
outlive every worker). A replacement is started with the same code and environment: it finds the job
running and joins it. Every run must end within its deadline (a hang is reported, never waited out).
"""
import argparse
import datetime
import hashlib
import json
import math
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

ALGORITHMS = {  # the algorithms fault tolerance supports, with the options the matrix runs them with
    "gradient_allreduce": {},
    "gradient_allreduce+sign": {"compression": "sign"},
    "gradient_allreduce+hierarchical": {"hierarchical": True, "ranks_per_node": 2},
    "topk": {"density": 0.1},
    "gtopk": {"density": 0.1},
    "powersgd": {"rank": 2, "warmup_steps": 2},
    "local_sgd": {"period": 4},
    "diloco": {"period": 4},
    "diloco+minmax_uint8": {"period": 4, "compression": "minmax_uint8"},
    "diloco+streaming": {"period": 4, "overlap": 1, "fragments": 2},
    "decentralized": {"peer_selection": "ring"},
    "low_precision_decentralized": {},
    "async_model_average": {"sync_interval_ms": 100},
    # a network of 1 MB/s given, so that it picks gtopk at once (no probe steps)
    "auto": {"probe_steps": 0, "compute_s": 0.01, "network": {"alpha": 1e-4, "beta": 1e-6},
             "machine": {"topk_s_per_elem": 0.0, "quantize_s_per_elem": 0.0, "fp16_s_per_elem": 0.0,
                         "add_s_per_elem": 0.0},
             "candidates": ["gradient_allreduce", {"name": "gtopk", "options": {"density": 0.1}}],
             "efficiency": {"gtopk(density=0.1)": 1.0}},
}
# replicas differ by design (streaming diloco: between a fragment's merges): the end-of-run check is that every
# member finished
DIFFERING = {"decentralized", "low_precision_decentralized", "async_model_average", "diloco+streaming"}
# its ranks do not wait for each other, so its loops are short: long enough that a SIGSTOPped worker's
# heartbeat times out, and its replacement is admitted, while the others still train
STEPS_OF = {"async_model_average": 200}
HEARTBEAT_TIMEOUT_S = 10.0  # DistributedModel's default: a SIGSTOPped worker is left out after it


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))


def _tiny_batch(member, step):
    g = torch.Generator().manual_seed(member * 7919 + step * 31 + 5)
    x = torch.randn(16, 12, generator=g)
    return x, (x[:, :5] * 3).argmax(1)


class Digits:
    """The digits task (scikit-learn's, 80/20 split) with a global batch of 64 per step, split among the
    current members by rank: the same samples are trained on at every world size."""

    def __init__(self, steps, lr=0.05):
        from bagua_lite.bench.data import digits_shards
        self.x, self.y, self.x_test, self.y_test = digits_shards(0, 1)
        self.steps, self.lr = steps, lr

    def batch(self, step, rank, world):
        epoch_len = len(self.x) // 64
        perm = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(step // epoch_len))
        idx = perm[(step % epoch_len) * 64:(step % epoch_len + 1) * 64].tensor_split(world)[rank]
        return self.x[idx], self.y[idx]

    def lr_at(self, step):
        return self.lr * 0.5 * (1 + math.cos(math.pi * step / self.steps))


def _worker(name, port, P, out, task, algo, steps, faults, window, timeout_s, replacement, spawned):
    """One worker (``name``: generation-0 rank, or "r<k>" for a replacement). ``faults``: {step: [(rank,
    signal name)]}: the worker at that rank of the current generation sends itself the signal at the top of
    that step (once per step, whoever holds the rank then)."""
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(name if isinstance(name, int) else 0), WORLD_SIZE=str(P),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    import bagua_lite
    from bagua_lite.algorithms import build
    from bagua_lite.bench.zoo import make_mlp

    t_start = time.time()
    bagua_lite.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    digits = Digits(steps) if task == "digits" else None
    net = make_mlp(0) if digits else _tiny()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model = bagua_lite.DistributedModel(net, opt, build(algo.split("+")[0], **ALGORITHMS.get(algo, {})),
                                        bucket_size_mb=0.01, fault_tolerant=True, rejoin_window_s=window)
    me = model._elastic.membership.me
    log = {"name": name, "me": me, "started": t_start, "spawned": spawned, "admitted_step": model.algorithm.step if replacement else 0,
           "admitted": time.time(), "first_step": None, "discarded": [], "steps_done": {}}
    while model.algorithm.step < steps:
        s = model.algorithm.step
        for rank, sig in faults.get(s, ()):
            if dist.get_rank() == rank and store.add(f"fault/{s}/{rank}", 1) == 1:
                store.set(f"faulted/{s}/{rank}", json.dumps([repr(name), time.time(), sig]))
                os.kill(os.getpid(), getattr(signal, sig))
        if digits:
            for g in opt.param_groups:
                g["lr"] = digits.lr_at(s)
            x, y = digits.batch(s, dist.get_rank(), dist.get_world_size())
        else:
            x, y = _tiny_batch(me, s)
        try:
            F.cross_entropy(model(x), y).backward()
            opt.step()
        except bagua_lite.MembershipChanged:
            log["discarded"].append((s, time.time()))
        else:
            log["steps_done"][s] = time.time()
            if log["first_step"] is None:
                log["first_step"] = time.time()
                store.set(f"first_step/{name}", repr(log["first_step"]))  # a replacement may be killed later
        opt.zero_grad()
        time.sleep(0.1)  # a step of a real model's length, so that replacements start while the others train
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    log.update(digest=hashlib.sha256(flat.numpy().tobytes()).hexdigest(), world=model.world_size, rank=dist.get_rank())
    if digits is not None:
        with torch.no_grad():
            log["accuracy"] = (net(digits.x_test).argmax(1) == digits.y_test).float().mean().item()
    model.close()
    with open(os.path.join(out, f"log_{name}.json"), "w") as f:
        json.dump(log, f)


def run(P, algo, faults, task="tiny", steps=40, window=1.0, timeout_s=1800, deadline_s=240, replace=True):
    """One job: P workers, ``faults`` injected, a replacement started for every faulted worker (a SIGSTOPped
    one is SIGKILLed once its replacement runs). Returns (logs by worker, hung names, store)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    out = tempfile.mkdtemp(prefix="bagua_lite_faults_")
    ctx = mp.get_context("spawn")
    args = (store.port, P, out, task, algo, steps, faults, window, timeout_s)
    procs = {r: ctx.Process(target=_worker, args=(r,) + args + (False, time.time()), daemon=True) for r in range(P)}
    for p in procs.values():
        p.start()
    end = time.monotonic() + deadline_s
    seen, k = set(), 0
    expected = sum(len(v) for v in faults.values())
    while time.monotonic() < end and not all(not p.is_alive() for p in procs.values()):
        for s, victims in faults.items():
            for rank, sig in victims:
                key = f"faulted/{s}/{rank}"
                if key not in seen and store.check([key]):
                    seen.add(key)
                    victim = json.loads(store.get(key))[0]
                    if replace:
                        store.set(f"spawned/r{k}", repr(time.time()))
                        procs[f"r{k}"] = ctx.Process(target=_worker, args=(f"r{k}",) + args + (True, time.time()),
                                                    daemon=True)
                        procs[f"r{k}"].start()
                        k += 1
                    if sig == "SIGSTOP":  # a process manager ends a stopped worker it replaced
                        stopped = procs[eval(victim)]  # noqa: S307 - our own repr of an int or a str
                        threading_kill_later(stopped, HEARTBEAT_TIMEOUT_S + window + 2)
        time.sleep(0.05)
    hung = [n for n, p in procs.items() if p.is_alive()]
    for n in hung:
        procs[n].kill()
    for p in procs.values():
        p.join(5)
    # every worker ends well (0) or was SIGKILLed (a victim, or a SIGSTOPped one ended by us): anything else
    # (an abort at exit, an exception) is a failure, even if the logs look fine
    bad_exits = {n: p.exitcode for n, p in procs.items() if n not in hung and p.exitcode not in (0, -signal.SIGKILL)}
    logs = {}
    for n in procs:
        path = os.path.join(out, f"log_{n}.json")
        if os.path.exists(path):
            with open(path) as f:
                logs[n] = json.load(f)
    assert len(seen) == expected or hung, (seen, faults)
    return logs, hung, store, bad_exits


def threading_kill_later(proc, after_s):
    import threading
    threading.Timer(after_s, lambda: proc.is_alive() and proc.kill()).start()


def plans(P, steps, rng):
    """The four faults of a matrix cell, at steps drawn by ``rng``: each leaves room for the replacement to
    join before the end (a SIGSTOPped worker is found a heartbeat timeout later)."""
    late = steps - max(30, steps // 3)  # an asynchronous run's survivors keep stepping while a worker joins
    first = rng.randint(3, late // 2)
    return (("kill -9, 1 worker", {rng.randint(3, late): [(rng.randrange(P), "SIGKILL")]}),
            ("kill -9, 2 workers", {rng.randint(3, late): [(2, "SIGKILL"), (0, "SIGKILL")]}),  # rank 0 among them
            ("kill -9, 1 then 1", {first: [(P - 1, "SIGKILL")], rng.randint(first + 10, late): [(0, "SIGKILL")]}),
            # early: an asynchronous run goes on stepping for the heartbeat timeout before it is found
            ("SIGSTOP, 1 worker", {rng.randint(3, 15): [(rng.randrange(P), "SIGSTOP")]}))


def matrix(args):
    import random

    rows, hangs = [], 0
    print(f"fault steps drawn with seed {args.seed}", flush=True)
    for P in (4, 5):
        for algo in args.only or ALGORITHMS:
            steps = max(args.steps, STEPS_OF.get(algo, 0))
            for fault, plan in plans(P, steps, random.Random(f"{args.seed}/{P}/{algo}")):
                t0 = time.monotonic()
                logs, hung, store, bad_exits = run(P, algo, plan, steps=steps)
                hangs += len(hung)
                finished = [lg for lg in logs.values() if len(lg["steps_done"]) and lg["world"] == P]
                digests = {lg["digest"] for lg in finished}
                kills = []
                for s, victims in plan.items():
                    for rank, _ in victims:
                        _, at, _ = json.loads(store.get(f"faulted/{s}/{rank}"))
                        kills.append(at)
                resumed = []
                for at in kills:  # the survivors' first completed step after the step the fault discarded
                    nxt = []  # (an asynchronous survivor goes on with local steps until it learns of the loss)
                    for lg in logs.values():
                        if lg["started"] < at:
                            seen = min([t for _, t in lg["discarded"] if t >= at] or [at])
                            nxt.append(min([t for t in lg["steps_done"].values() if t > seen] or [math.inf]))
                    resumed.append(max(nxt) - at)
                joins = [lg["first_step"] - lg["spawned"] for n, lg in logs.items() if str(n).startswith("r")]
                lost = max((len(lg["discarded"]) for lg in logs.values()), default=0)
                ok = not hung and not bad_exits and len(finished) == P and (len(digests) == 1 or algo in DIFFERING)
                rows.append((P, algo, fault, ok, len(hung), lost, resumed, joins, time.monotonic() - t0))
                at = "; ".join(f"step {k}: {', '.join(f'rank {r}' for r, _ in v)}" for k, v in sorted(plan.items()))
                print(f"P={P} {algo:24s} {fault:20s} ({at}) {'ok' if ok else 'FAILED'}: hung {len(hung)}, "
                      f"{'exit codes ' + repr(bad_exits) + ', ' if bad_exits else ''}members at the "
                      f"end {len(finished)} of {P} with {len(digests)} distinct weights, MembershipChanged per "
                      f"survivor {lost}, fault -> survivors' next step {', '.join(f'{r:.2f}' for r in resumed)} s, "
                      f"replacement start -> first step {', '.join(f'{j:.2f}' for j in joins)} s", flush=True)
                if not ok:  # what each worker's log says, to find out why
                    for n, lg in sorted(logs.items(), key=str):
                        print(f"    {n}: world {lg['world']}, steps done {len(lg['steps_done'])}, discarded at "
                              f"{[d[0] for d in lg['discarded']]}, admitted at step {lg['admitted_step']}", flush=True)
                    print(f"    without a log: {sorted(set(map(str, range(P))) - set(map(str, logs)))}", flush=True)
    print(f"\n{sum(r[3] for r in rows)} of {len(rows)} runs ok, {hangs} hung processes")
    resumed = [x for r in rows if "SIGSTOP" not in r[2] for x in r[6]]
    joins = [x for r in rows for x in r[7]]
    print(f"kill -9 -> survivors' next completed step: median {statistics.median(resumed):.2f} s, max "
          f"{max(resumed):.2f} s (rejoin window 1 s); replacement start -> its first step: median "
          f"{statistics.median(joins):.2f} s, max {max(joins):.2f} s")
    return 0 if all(r[3] for r in rows) else 1


def digits(args):
    steps = args.steps
    plan = {s: [((s // args.every) % 4, "SIGKILL")] for s in range(args.every, steps, args.every)}
    print(f"digits, P = 4, {args.algorithm}, {steps} steps of 64 samples, cosine lr from 0.05; a worker SIGKILLed "
          f"every {args.every} steps ({len(plan)} kills, rank 0 among them) and a replacement started at once")
    base, hung0, _, _ = run(4, args.algorithm, {}, task="digits", steps=steps, deadline_s=600)
    faulted, hung1, store, _ = run(4, args.algorithm, plan, task="digits", steps=steps, deadline_s=900)
    acc0 = {lg["accuracy"] for lg in base.values()}
    end = [lg for lg in faulted.values() if lg["world"] == 4]
    acc1 = {lg["accuracy"] for lg in end}
    back, spawn = [], []
    for k, (s, ((rank, _),)) in enumerate(sorted(plan.items())):  # replacement r<k> answers the k-th kill
        _, at, _ = json.loads(store.get(f"faulted/{s}/{rank}"))
        first = float(store.get(f"first_step/r{k}")) if store.check([f"first_step/r{k}"]) else math.nan
        back.append(first - at)
        spawn.append(float(store.get(f"spawned/r{k}")) - at)
    print(f"uninterrupted: held-out accuracy {sorted(acc0)} (hung {len(hung0)})")
    print(f"killed and replaced: held-out accuracy {sorted(acc1)} on the {len(end)} final members, "
          f"{len(acc1)} distinct (hung {len(hung1)})")
    print(f"difference: {100 * (max(acc1) - max(acc0)):+.2f} points")
    joins = [b - sp for b, sp in zip(back, spawn)]
    print(f"replacement start -> its first step: median {statistics.median(joins):.2f} s; kill -> the replacement's "
          f"first step (the group whole again): median {statistics.median(back):.2f} s, max {max(back):.2f} s "
          f"(of which kill -> replacement started by this script: median {statistics.median(spawn):.2f} s)")
    print("the same kill recovered the default way, in this run:")
    return restart(argparse.Namespace(steps=60, kill_at=25, ckpt_every=10, algorithm=args.algorithm))


RESTART_WORKER = r'''
import os, sys, time, json, signal, datetime
import torch, torch.distributed as dist, torch.nn.functional as F
sys.path.insert(0, os.environ["BENCH_DIR"])
import bagua_lite
from fault_injection import Digits
from bagua_lite.bench.zoo import make_mlp
steps, every, kill_at, ckpt = (int(os.environ[k]) for k in ("STEPS", "EVERY", "KILL_AT", "CKPT_EVERY"))
t0 = time.time()
bagua_lite.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
d = Digits(steps)
net = make_mlp(0)
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
model = bagua_lite.DistributedModel(net, opt, os.environ["ALGO"], bucket_size_mb=0.01)
path = os.path.join(os.environ["OUT"], "ckpt")
if os.path.isdir(path):
    bagua_lite.load_checkpoint(path, model, opt)
first = None
while model.algorithm.step < steps:
    s = model.algorithm.step
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 and s == kill_at and rank == 1:
        with open(os.path.join(os.environ["OUT"], "killed"), "w") as f: f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    for g in opt.param_groups: g["lr"] = d.lr_at(s)
    x, y = d.batch(s, rank, world)
    F.cross_entropy(model(x), y).backward(); opt.step(); opt.zero_grad()
    time.sleep(0.1)  # the same step length as the fault-tolerant runs
    if first is None:
        first = time.time()
        if attempt > 0 and rank == 0:
            with open(os.path.join(os.environ["OUT"], "restarted"), "w") as f: f.write(json.dumps([t0, first, s]))
    if (s + 1) % ckpt == 0:
        bagua_lite.save_checkpoint(path, model, opt)
model.close()
'''


def restart(args):
    """The default path for comparison: fail fast, torchrun restarts every worker, all resume from the last
    checkpoint (every ``--ckpt-every`` steps) and retrain the steps since."""
    out = tempfile.mkdtemp(prefix="bagua_lite_restart_")
    script = os.path.join(out, "worker.py")
    with open(script, "w") as f:
        f.write(RESTART_WORKER)
    env = dict(os.environ, BENCH_DIR=os.path.dirname(os.path.abspath(__file__)), STEPS=str(args.steps),
               EVERY="0", KILL_AT=str(args.kill_at), CKPT_EVERY=str(args.ckpt_every), OUT=out,
               ALGO=args.algorithm.split("+")[0], OMP_NUM_THREADS="1")
    t = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--max-restarts",
                           "1", "--monitor-interval", "0.1", script], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        return 1
    killed = float(open(os.path.join(out, "killed")).read())
    t0, first, s = json.loads(open(os.path.join(out, "restarted")).read())
    print(f"torchrun --max-restarts 1, checkpoint every {args.ckpt_every} steps, rank 1 SIGKILLed at step "
          f"{args.kill_at}: {first - killed:.2f} s from the kill to the restarted group's first step (every worker "
          f"stopped and restarted: {t0 - killed:.2f} s until the new processes had imported torch and bagua_lite, "
          f"{first - t0:.2f} s to form the group, load the checkpoint and take a step); it resumed at step {s}, so {args.kill_at - s} step(s) are trained again; "
          f"whole run {time.time() - t:.1f} s")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("matrix", "digits", "restart"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--every", type=int, default=30)
    ap.add_argument("--algorithm", default="gradient_allreduce", choices=sorted(ALGORITHMS))
    ap.add_argument("--only", nargs="+", choices=sorted(ALGORITHMS), help="matrix: these algorithms only")
    ap.add_argument("--seed", type=int, default=0, help="matrix: the seed the fault steps and ranks are drawn with")
    ap.add_argument("--kill-at", type=int, default=25)
    ap.add_argument("--ckpt-every", type=int, default=10)
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = {"matrix": 60, "digits": 300, "restart": 60}[args.what]
    return {"matrix": matrix, "digits": digits, "restart": restart}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
