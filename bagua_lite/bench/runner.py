"""Compare algorithms side by side, against PyTorch DDP measured in the same run.

    python -m bagua_lite.bench --config configs/benchmark.yaml [--project 16,32,128,1024] [--out bench_out]

On one machine it launches the ranks itself: for every network condition in the YAML (``loopback``, or
an emulated link such as ``1gbit``: each rank in its own network namespace, or ``ranks_per_node`` ranks
in one, a node (``launch``), veth pairs on a bridge, ``tc tbf`` rate limits; needs root) and every world
size, P worker processes (with ``shards`` > 1, on an FSDP2-sharded model: ``cells.wrap_sharded``) train every model with
every algorithm, under every straggler condition. Under ``torchrun`` (RANK/WORLD_SIZE set) it measures on
the real cluster instead.

Per cell: samples/s, speed-up over DDP, time split (compute floor, compression, communication, hidden
share), bytes sent per step per rank, final training loss, and the alpha-beta cost model's prediction.
Outputs: a table, ``results.json``, ``results.csv`` and ``throughput.png`` in ``--out``.

``mode: convergence`` in the YAML measures time to accuracy instead (``bench/convergence.py``): every
algorithm trains the model's task to a held-out target; rows get ``steps_to_target``,
``time_to_target_s``, ``final_metric`` and ``step_s``; plots ``convergence_<model>.png``. With
``project_time: true`` every cell trains once on loopback and is then timed on each throttled network
(``--phase timing`` workers), and those networks' rows are projected: steps to target x s/step
(``report.project_records``; the tables say PROJECTED). The configuration keys are described in
``bench/config.py``. While it runs, stderr shows the cell in progress (i/N, label, network, P) and an
estimate of the time left (``Progress``).

The matrix (YAML), besides world sizes, networks, models and step counts:

``algorithms``   entries ``name`` or ``{name: ..., <the algorithm's options>, label: ..., optimizer: ...}``.
                 ``optimizer`` (taken by the benchmark, never passed to the algorithm) is one of
                 ``sgd`` (default: SGD, lr 0.01, momentum 0.9), ``adam`` (Adam, lr 1e-3) or ``adamw``
                 (AdamW, lr 1e-3, weight decay 0.01); the DDP baselines take it too, so an algorithm that
                 needs Adam (qadam) is compared with ``{name: ddp, optimizer: adam}``. The compute floor
                 always uses SGD. A row's ``optimizer`` is printed (an ``optim`` column) when any row is
                 not SGD, and a default label ends in ``[adam]``/``[adamw]``.
``stragglers``   a matrix axis, default ``[none]``. ``half``: rank 0 runs at half speed. Rule: after each
                 of its steps (warm-up ones too) rank 0 sleeps (``time.sleep``, no CPU burnt) for as long
                 as that step's own forward + backward + communication + optimizer step took. The sleep
                 is taken at the start of its next step, after the benchmark's per-step barrier and
                 inside the timed step, so that the other ranks of a synchronous algorithm wait for it
                 in that step's collectives, as in training, and not in the (untimed) barrier. The last
                 step's sleep is dropped. The cost model knows no stragglers: such rows have no
                 prediction, and no "exposed" communication (the step includes the sleep).

How a cell is timed: a synchronous algorithm (and every DDP baseline) starts each step with a barrier;
after it the ranks exchange their step times (one allreduce of P numbers), so all agree on when the
cell has measured enough (``steps``, ``min_cell_s``, ``max_steps``, whole cycles). An asynchronous
algorithm (``Algorithm.asynchronous``) would be synchronised by that, hiding what it buys: its ranks
start together (one barrier), then each runs exactly ``max_steps`` measured steps (rounded to whole
cycles) with no per-step collective, recording its own step times; one allreduce of a P x steps tensor
after the last step exchanges them, and every rank then closes the model (the algorithm's close ends its
background work collectively).

Row fields (``results.json``/``.csv``), among others: ``step_s`` the s/step of the slowest rank (per step
for synchronous algorithms; for asynchronous ones the rank with the largest median), ``rank_s_per_step``
each rank's own median (over whole cycles) step time, ``fast_s_per_step`` the median of those over the
ranks other than the straggler (all ranks with no straggler), ``straggler``, ``optimizer``,
``asynchronous``, ``samples_per_s`` (P x batch / step_s; an asynchronous algorithm: the sum of every
rank's own rate, batch / rank_s_per_step, since no rank waits for the others) and ``speedup_vs_ddp``
(samples/s over that of the DDP row, named in ``ddp_baseline``, of the same network, P, model and
straggler condition, with the same optimizer if the matrix has such a DDP row, else plain DDP),
``floor_s`` the compute floor this cell is compared with (the median of its repeats' floors, each
measured in the middle of its repeat's cells: ``rotation``), ``vs_floor`` = step_s / floor_s and
``below_floor`` (vs_floor < 1: only a change of the machine's speed makes a row beat its floor; the table
marks it ``!``). ``results.json`` also has ``floor_spread`` (``report.floor_spread``): per model and P, how
far apart its floors were; beyond 1.25x the table and the plot say the machine's speed moved during the
run. ``throughput.png`` (``report.throughput_figure``): measured samples/s per algorithm, and the
``--project`` projections in a panel of their own, titled PROJECTED.
"""
import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from .. import cost_model, runtime
from ..bucket import plan_model_buckets
from . import convergence, gpu_step, netem
from .config import load_benchmark_config, make_optimizer
from .data import loss_fn, make_batches
from .report import (auto_convergence_report, auto_report, combine_seeds, convergence_figures, floor_spread,
                     print_convergence_table, print_table, projection_report, summarize, summarize_convergence,
                     write_convergence_outputs, write_outputs)
from .timing import time_cell
from .zoo import fresh_model


# ---- one rank -----------------------------------------------------------------------------------------------
def _compute_floor(model_name, batches, cfg):
    """Per-step time with no communication at all (every rank computing at once, as in training)."""
    import torch
    import torch.distributed as dist

    net, _ = fresh_model(model_name)
    opt = make_optimizer("sgd", net.parameters())  # the floor keeps SGD whatever the cells use
    times = []
    # Timed like a cell (the slowest rank per step, then the median), over at least 8 steps: it is cheap,
    # and every prediction and "exposed" figure of the model is measured against it.
    for step in range(cfg["warmup_steps"] + max(8, cfg["steps"])):
        x, y = batches[step % len(batches)]
        dist.barrier()
        t0 = time.perf_counter()
        loss_fn(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step >= cfg["warmup_steps"]:
            times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


FLOOR = "floor"  # the compute floor's place in a repeat's rotation (``rotation``)


def rotation(cfg):
    """What one repeat measures for a (network, P, model), in order: every straggler condition's cells
    (``(straggler, cell)``) with one compute floor (``FLOOR``) among them, in the middle.

    The floor divides the rows (``x floor``), so it is measured inside each repeat, next in time to the
    cells it divides: a machine whose speed drifts over minutes moves a repeat's floor and its rows alike,
    and each row's floor is the median of its own repeats' floors. In the middle, no cell of the repeat
    is more than half a rotation away from it (first, the last cell would be a whole rotation away), at
    the same cost. One floor per repeat, not one per cell: a floor is ``warmup_steps`` + max(8, ``steps``) steps
    without communication, about a cheap cell's time, so it adds about 1/N to a repeat of N cells, where
    a floor before every cell (``floor_each_cell: true``, then the only floors) adds about as much as the
    cells themselves. ``repeats`` >= 2 gives each row several floors and the run several to compare, so
    a drift shows (``report.floor_spread``)."""
    cells = [(s, c) for s in cfg["stragglers"] for c in cfg["algorithms"]]
    if cfg["floor_each_cell"]:
        return cells
    mid = len(cells) // 2
    return cells[:mid] + [FLOOR] + cells[mid:]


def worker_main(cfg, network, result_path, phase="run"):
    """Runs on every rank (spawned by the launcher or under torchrun); rank 0 appends JSON lines.

    Joins the default process group from the environment, unless one exists already (then it is left
    as it was found: the tests run the matrix on their own gloo group).
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("BAGUA_LITE_BENCH_THREADS", "1")))
    # Before anything is measured: the floor, the DDP baselines and our algorithms share one allocator.
    tuned = runtime.tune_cpu_allocator()
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["timeout_s"]))
    rank, world = dist.get_rank(), dist.get_world_size()

    def emit(record):
        if rank == 0:
            with open(result_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    if cfg["mode"] == "convergence":
        if phase == "timing":  # project_time: s/step on this network; the steps come from loopback
            convergence.timing_worker(cfg, network, rank, world, emit)
        else:
            convergence.worker(cfg, network, rank, world, emit)
        if owned:
            dist.destroy_process_group()
        return
    net = cost_model.probe_network()
    machine = cost_model.calibrate_machine()

    emit({"kind": "network", "network": network, "world_size": world, "alpha": net.alpha, "beta": net.beta,
          "host_local": net.host_local,
          "machine": machine.__dict__, "malloc_tuned": tuned})
    for model_name in cfg["models"]:
        model0, spec = fresh_model(model_name)
        numel = sum(p.numel() for p in model0.parameters())
        batches = make_batches(spec, cfg["batch_size"], cfg["warmup_steps"] + cfg["max_steps"], rank)
        # the buckets DistributedModel will make
        bucket_numels = [sum(p.numel() for p in b) for b in plan_model_buckets(model0, cfg["bucket_size_mb"])]

        def measure_floor(repeat, before=None):
            step_s = _compute_floor(model_name, batches, cfg)
            emit({"kind": "floor", "network": network, "world_size": world, "model": model_name, "numel": numel,
                  "step_s": step_s, "bucket_numels": bucket_numels, "repeat": repeat,
                  **({"before": before} if before else {})})
            return step_s

        for repeat in range(cfg["repeats"]):
            for item in rotation(cfg):
                if item is FLOOR:
                    measure_floor(repeat)
                    continue
                straggler, cell = item
                # floor_each_cell: this cell's own floor, measured right before it; otherwise the report
                # gives the cell its repeat's floor (measured mid-rotation, maybe after this cell)
                before = cell["label"] + (f" [straggler {straggler}]" if straggler != "none" else "")
                own = measure_floor(repeat, before) if cfg["floor_each_cell"] else None
                res = time_cell(cell, cfg, model_name, batches, rank, world, straggler)
                emit({"kind": "cell", "network": network, "world_size": world, "model": model_name,
                      "algorithm": cell["name"], "label": cell["label"], "options": cell["options"],
                      "optimizer": cell.get("optimizer", "sgd"), "straggler": straggler, "floor_s": own,
                      "repeat": repeat, "numel": numel, "batch_size": cfg["batch_size"], **res})
    if owned:
        dist.destroy_process_group()


# ---- launcher --------------------------------------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def format_eta(seconds):
    """A duration for the progress line: '42 s', '4 min 05 s', '1 h 02 min'."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def plan_cells(cfg, networks):
    """Every cell of the run in the order the workers write them: (kind, network, P, model, label, seed);
    kind ``train`` (convergence), ``timing`` (project_time's s/step runs) or ``cell`` (throughput)."""
    plan = []
    if cfg["mode"] == "convergence":
        for phase, nets in launches(cfg, networks):
            kind = "timing" if phase == "timing" else "train"
            for network in nets:
                for P in cfg["world_sizes"]:
                    for seed in (cfg["seeds"] if kind == "train" else [None]):
                        for model in cfg["models"]:
                            plan += [(kind, network, P, model, c["label"], seed) for _ in
                                     range(1 if kind == "train" else cfg.get("timing_repeats", 1))
                                     for c in cfg["algorithms"]]
        return plan
    for network in networks:
        for P in cfg["world_sizes"]:
            for model in cfg["models"]:
                plan += [("cell", network, P, model, c["label"] + (f" [straggler {s}]" if s != "none" else ""), None)
                         for _ in range(cfg["repeats"]) for s in cfg["stragglers"] for c in cfg["algorithms"]]
    return plan


def launches(cfg, networks):
    """[(phase, networks)]: what runs where. project_time: every cell trains on loopback, then timing runs
    on each throttled network; otherwise every cell runs on every network."""
    if cfg["mode"] == "convergence" and cfg.get("project_time"):
        throttled = [n for n in networks if netem.NETWORKS[n] is not None]
        return [("run", ["loopback"])] + ([("timing", throttled)] if throttled else [])
    return [("run", list(networks))]


class Progress:
    """Which cell is running (i/N, its label, network, P) and an estimate of the time left: each remaining
    cell is expected to take as long as the finished ones of its kind on its network took on average (of
    its kind, else of all, when none has finished yet). On a terminal one line redrawn; otherwise a line
    per cell, and again every ``every_s`` seconds (logs)."""

    def __init__(self, plan, out=None, every_s=120.0, clock=time.monotonic):
        self.plan, self.out, self.every_s, self.clock = plan, out, every_s, clock
        self.t0 = clock()
        self.done_at = []
        self._shown, self._shown_at = None, None

    def _durations(self):
        prev, out = self.t0, []
        for t in self.done_at:
            out.append(t - prev)
            prev = t
        return out

    def eta(self, done, now=None):
        """Seconds left, or None before the first cell finished."""
        now = self.clock() if now is None else now
        took = self._durations()
        if not took:
            return None
        def mean(sel):
            v = [d for d, c in zip(took, self.plan) if sel(c)]
            return sum(v) / len(v) if v else None
        left = 0.0
        for i, c in enumerate(self.plan[done:], start=done):
            est = mean(lambda d: d[:2] == c[:2]) or mean(lambda d: d[0] == c[0]) or mean(lambda d: True)
            if i == done:  # the running cell has been at it since the last one finished
                est = max(0.0, est - (now - (self.done_at[-1] if self.done_at else self.t0)))
            left += est
        return left

    def line(self, done, now=None, width=24):
        now = self.clock() if now is None else now
        total = len(self.plan)
        filled = int(width * done / max(1, total))
        bar = f"[{'#' * filled}{'.' * (width - filled)}]"
        if done >= total:
            return f"{bar} {total}/{total} cells done in {format_eta(now - self.t0)}"
        kind, network, P, model, label, seed = self.plan[done]
        what = {"train": "training", "timing": "timing (s/step)", "cell": "throughput"}[kind]
        eta = self.eta(done, now)
        return (f"{bar} cell {done + 1}/{total}: {label} on {network} P={P} {model}"
                + (f" seed {seed}" if seed is not None and kind == "train" else "") + f" [{what}] | "
                + f"{format_eta(now - self.t0)} elapsed, "
                + ("time left: estimated after the first cell" if eta is None else f"about {format_eta(eta)} left"))

    def update(self, done):
        now = self.clock()
        while len(self.done_at) < min(done, len(self.plan)):
            self.done_at.append(now)
        out = self.out or sys.stderr
        tty = out.isatty() if hasattr(out, "isatty") else False
        if not tty and self._shown == done and now - self._shown_at < self.every_s:
            return
        self._shown, self._shown_at = done, now
        text = self.line(done, now)
        out.write(f"\r{text:<140}" if tty else text + "\n")
        out.flush()


def node_of(rank, ranks_per_node):
    """(node, local rank) of ``rank``: consecutive ranks share a node (``ranks_per_node`` of them)."""
    return divmod(rank, ranks_per_node)


def launch(cfg, config_path, network, world_size, result_path, progress, phase="run"):
    """Start ``world_size`` workers for one network condition; wait, showing progress.

    On an emulated link the ranks sit in nodes of ``ranks_per_node`` consecutive ranks: one network
    namespace per node (``EmulatedNetwork`` over the nodes), every rank of a node launched in it with the
    node's interface as ``GLOO_SOCKET_IFNAME`` and address. Two ranks of a node reach each other at that
    address, which is local to the namespace, so the kernel carries their traffic over the namespace's
    loopback, not the rate-limited veth; traffic to another node crosses both nodes' veths. MASTER_ADDR is
    node 0's. With nodes (``ranks_per_node`` > 1) LOCAL_RANK and LOCAL_WORLD_SIZE are the node's, as
    torchrun sets them on a real node (hierarchical gradient_allreduce reads them); with one rank per node
    LOCAL_WORLD_SIZE stays the number of ranks on this machine, as before nodes existed: the cost model's
    calibration (``cost_network.cores_per_rank``) divides this machine's cores by it.
    ``BAGUA_LITE_BENCH_RANKS_PER_NODE`` tells ``cells.tx_bytes`` how many ranks share the node's counter."""
    threads = os.environ.get("BAGUA_LITE_BENCH_THREADS", "1")
    per_node = cfg.get("ranks_per_node", 1)
    env_base = dict(os.environ, WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(per_node if per_node > 1 else world_size),
                    BAGUA_LITE_BENCH_NETWORK=network, OMP_NUM_THREADS=threads,
                    BAGUA_LITE_BENCH_THREADS=threads, BAGUA_LITE_BENCH_RANKS_PER_NODE=str(per_node))
    env_base.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at INFO
    port = _free_port()
    emu = None
    try:
        rate = netem.NETWORKS[network]
        if rate is not None:
            emu = netem.EmulatedNetwork(world_size // per_node, rate).__enter__()
            master = emu.address(0)
        else:
            master = "127.0.0.1"
        procs = []
        for r in range(world_size):
            node, local = node_of(r, per_node)
            env = dict(env_base, RANK=str(r), LOCAL_RANK=str(local if per_node > 1 else r), MASTER_ADDR=master,
                       MASTER_PORT=str(port),
                       BAGUA_LITE_BENCH_ADDR=emu.address(node) if emu is not None else "127.0.0.1")
            argv = [sys.executable, "-m", "bagua_lite.bench", "--config", config_path, "--worker",
                    "--network", network, "--result-file", result_path, "--phase", phase]
            if emu is not None:
                env["GLOO_SOCKET_IFNAME"] = emu.interface(node)
                argv = emu.command(node, argv)
            procs.append(subprocess.Popen(argv, env=env))
        deadline = time.monotonic() + cfg["timeout_s"] * 2
        while any(p.poll() is None for p in procs):
            progress.update(_count_cells(result_path))  # the file holds every launch's cells
            failed = [p.returncode for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"benchmark: workers for network={network} P={world_size} failed "
                                   f"(exit codes {failed}) or timed out; see their output above")
            time.sleep(0.5)
        bad = [p.returncode for p in procs if p.returncode != 0]
        if bad:
            raise RuntimeError(f"benchmark: workers for network={network} P={world_size} exited with {bad}")
    finally:
        if emu is not None:
            emu.__exit__(None, None, None)


def _count_cells(path):
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if '"kind": "cell"' in line or '"kind": "convergence"' in line
                   or '"kind": "timing"' in line)


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="benchmark", help="a benchmark YAML file, or a shipped one by name "
                    "(benchmark, benchmark_lm, benchmark_hooks, ...; default: benchmark)")
    ap.add_argument("--project", default="", help="comma-separated world sizes to project to, e.g. 16,32,128,1024")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--network", default="loopback", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="run", choices=("run", "timing"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cfg = load_benchmark_config(args.config)
    if cfg["mode"] == "step":  # one process, nothing launched: our own cost in a step (gpu_step)
        if args.project:
            ap.error("--project projects step times of mode throughput; this config is mode step")
        gpu_step.run_config(cfg, args.out)
        return
    if not args.worker and os.environ.get("RANK", "0") == "0":  # the launcher, or rank 0 under torchrun
        for note in cfg["skipped"]:
            print(f"benchmark: {note}", file=sys.stderr)
    project = [int(p) for p in args.project.split(",") if p.strip()] or list(cfg["project"])
    if project and cfg["mode"] == "convergence":
        ap.error("--project projects step times: it needs mode throughput, the config says mode convergence")

    if args.worker or ("RANK" in os.environ and "WORLD_SIZE" in os.environ and args.result_file is None):
        # Under torchrun on a real cluster: measure here; rank 0 writes the results.
        path = args.result_file or os.path.join(args.out, "records.jsonl")
        if not args.worker:
            os.makedirs(args.out, exist_ok=True)
        worker_main(cfg, os.environ.get("BAGUA_LITE_BENCH_NETWORK", args.network), path, args.phase)
        if args.worker:
            # Results are on disk and the group is destroyed. Skip interpreter teardown: destructors of
            # leftover DDP/gloo objects at exit can abort a process whose work is already done.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if int(os.environ["RANK"]) != 0:
            return
        records = _read(path)
    else:
        networks = list(cfg["networks"])
        if any(netem.NETWORKS[n] is not None for n in networks):
            ok, why = netem.available()
            if not ok:
                print(f"benchmark: emulated networks unavailable ({why}); running loopback only", file=sys.stderr)
                networks = [n for n in networks if netem.NETWORKS[n] is None] or ["loopback"]
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "records.jsonl")
        if os.path.exists(path):
            os.unlink(path)
        progress = Progress(plan_cells(cfg, networks))
        for phase, nets in launches(cfg, networks):
            for network in nets:
                for P in cfg["world_sizes"]:
                    launch(cfg, args.config, network, P, path, progress, phase)
        progress.update(len(progress.plan))
        sys.stderr.write("\n")
        records = _read(path)
    if cfg["mode"] == "convergence":
        rows = summarize_convergence(records)
        combined = combine_seeds(rows)
        print_convergence_table(combined)
        convergence_figures(combined)
        auto_convergence_report(combined)
        written = write_convergence_outputs(rows, args.out, combined)
        print(f"wrote {args.out}/results.json, results.csv" + "".join(f", {w}" for w in written))
        return
    rows = summarize(records)
    spread = floor_spread(records)
    print_table(rows, spread=spread)
    tuned = {r.get("malloc_tuned") for r in records if r["kind"] == "network"}
    print("allocator: " + ("malloc keeps freed blocks for reuse (bagua_lite.tune_cpu_allocator) in every worker, "
                           "so the floor, DDP and our algorithms share it" if tuned == {True} else
                           "glibc defaults (BAGUA_LITE_TUNE_MALLOC=0 or no mallopt)"))
    auto_report(rows)
    measured_err = [r["prediction_error"] for r in rows if r["prediction_error"] is not None]
    if measured_err:
        by_p = {}
        for r in rows:
            if r["prediction_error"] is not None:
                by_p.setdefault(r["world_size"], []).append(r["prediction_error"])
        print("cost model error vs measured (median |pred-meas|/meas): "
              + ", ".join(f"P={p}: {statistics.median(e):.0%}" for p, e in sorted(by_p.items())))
    projections = projection_report(records, project) if project else []
    write_outputs(rows, projections, args.out, spread)
    print(f"wrote {args.out}/results.json, results.csv, throughput.png")


if __name__ == "__main__":
    main()
