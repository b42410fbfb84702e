"""Compare algorithms side by side, against PyTorch DDP measured in the same run.

    python -m bagua_lite.bench --config configs/benchmark.yaml [--project 16,32,128,1024] [--out bench_out]

On one machine it launches the ranks itself: for every network condition in the YAML (``loopback``, or
an emulated link such as ``1gbit``: each rank in its own network namespace, veth pairs on a bridge,
``tc tbf`` rate limits; needs root) and every world size, P worker processes train every model with
every algorithm, under every straggler condition. Under ``torchrun`` (RANK/WORLD_SIZE set) it measures on
the real cluster instead.

Per cell: samples/s, speed-up over DDP, time split (compute floor, compression, communication, hidden
share), bytes sent per step per rank, final training loss, and the alpha-beta cost model's prediction.
Outputs: a table, ``results.json``, ``results.csv`` and ``throughput.png`` in ``--out``.

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
straggler condition, with the same optimizer if the matrix has such a DDP row, else plain DDP).
"""
import argparse
import csv
import datetime
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import yaml

BASELINES = ("ddp", "ddp_fp16", "ddp_powersgd")
MODELS = ("mlp25m", "cnn", "mlp_small", "resnet18", "vgg16")
OPTIMIZERS = ("sgd", "adam", "adamw")  # per algorithm entry; see make_optimizer
STRAGGLERS = ("none", "half")  # the ``stragglers`` axis; see the module docstring
STRAGGLER_RANK = 0  # the rank that runs slow under ``half``
CONFIG_KEYS = ("world_sizes", "networks", "models", "algorithms", "steps", "warmup_steps", "batch_size",
               "bucket_size_mb", "project", "timeout_s", "min_cell_s", "max_steps", "stragglers")


# ---- configuration -----------------------------------------------------------------------------------------
def load_benchmark_config(path):
    import difflib

    with open(path) as f:
        cfg = yaml.safe_load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"benchmark config {path}: expected a mapping")
    for key in cfg:
        if key not in CONFIG_KEYS:
            near = difflib.get_close_matches(key, CONFIG_KEYS, n=1)
            raise ValueError(f"benchmark config: unknown key {key!r}" + (f"; did you mean {near[0]!r}?" if near else "")
                             + f" (allowed: {', '.join(CONFIG_KEYS)})")
    out = {"world_sizes": [4], "networks": ["loopback"], "models": ["mlp25m"], "steps": 5, "warmup_steps": 2,
           "batch_size": 32, "bucket_size_mb": 25.0, "project": [], "timeout_s": 900, "min_cell_s": 0.0,
           "max_steps": None, "stragglers": ["none"]}
    out.update(cfg)
    for key, lowest in (("steps", 1), ("warmup_steps", 0)):
        v = out[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < lowest:
            raise ValueError(f"benchmark config: {key} must be an int >= {lowest}, got {v!r}")
    if out["max_steps"] is None:
        out["max_steps"] = out["steps"]
    if not isinstance(out["max_steps"], int) or isinstance(out["max_steps"], bool) or out["max_steps"] < out["steps"]:
        raise ValueError(f"benchmark config: max_steps must be an int >= steps ({out['steps']}), "
                         f"got {out['max_steps']!r}")
    m = out["min_cell_s"]
    if not isinstance(m, (int, float)) or isinstance(m, bool) or m < 0:
        raise ValueError(f"benchmark config: min_cell_s must be a number of seconds >= 0, got {m!r}")
    stragglers = out["stragglers"]
    if not isinstance(stragglers, list) or not stragglers:
        raise ValueError(f"benchmark config: stragglers must be a non-empty list of {', '.join(STRAGGLERS)}, "
                         f"got {stragglers!r}")
    for s in stragglers:
        if not isinstance(s, str) or s not in STRAGGLERS:
            raise ValueError(f"benchmark config: unknown straggler condition {s!r} in stragglers; "
                             f"allowed: {', '.join(STRAGGLERS)}")
    if len(set(stragglers)) != len(stragglers):
        raise ValueError(f"benchmark config: stragglers lists a condition twice: {stragglers!r}")
    for p in out["world_sizes"]:
        if not isinstance(p, int) or p < 1:
            raise ValueError(f"benchmark config: world_sizes must be ints >= 1, got {p!r}")
    for m in out["models"]:
        if m not in MODELS:
            raise ValueError(f"benchmark config: unknown model {m!r}; known: {', '.join(MODELS)}")
    from . import netem

    for n in out["networks"]:
        if n not in netem.NETWORKS:
            raise ValueError(f"benchmark config: unknown network {n!r}; known: {', '.join(netem.NETWORKS)}")
    algs = []
    from .. import algorithms  # noqa: F401  (registers built-ins)
    from ..algorithm import build

    for entry in out.get("algorithms") or []:
        entry = {"name": entry} if isinstance(entry, str) else dict(entry)
        label = entry.pop("label", None)
        name = entry.pop("name")
        # the benchmark's own key, never an option of the algorithm
        optimizer = entry.pop("optimizer", "sgd")
        if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
            raise ValueError(f"benchmark config: algorithm {name!r}: unknown optimizer {optimizer!r}; "
                             f"allowed: {', '.join(OPTIMIZERS)}")
        if name == "ddp_powersgd":
            entry.setdefault("rank", 4)
        elif name not in BASELINES:
            build(name, **entry)  # validate now, before any process starts
        algs.append({"name": name, "options": entry, "optimizer": optimizer,
                     "label": label or _label(name, entry, optimizer)})
    if not algs:
        raise ValueError("benchmark config: 'algorithms' must list at least one algorithm")
    out["algorithms"] = algs
    return out


def _label(name, options, optimizer="sgd"):
    suffix = "" if optimizer == "sgd" else f"[{optimizer}]"
    if not options:
        return name + suffix
    short = ",".join(f"{k}={v}" for k, v in sorted(options.items()) if k not in ("warmup_densities",))
    return f"{name}({short}){suffix}"


def make_optimizer(kind, params):
    """The optimizer of a cell: ``sgd`` (lr 0.01, momentum 0.9), ``adam`` (lr 1e-3), ``adamw`` (lr 1e-3,
    torch's default weight decay 0.01)."""
    import torch

    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    raise ValueError(f"unknown optimizer {kind!r}; allowed: {', '.join(OPTIMIZERS)}")


# ---- models and data -----------------------------------------------------------------------------------------
_MODEL_CACHE = {}


def fresh_model(name):
    """make_model(name), built once per process and deep-copied after: a 25M-parameter init takes a while."""
    import copy

    if name not in _MODEL_CACHE:
        _MODEL_CACHE[name] = make_model(name)
    net, shape = _MODEL_CACHE[name]
    return copy.deepcopy(net), shape


def make_model(name, seed=0):
    import torch

    torch.manual_seed(seed)
    nn = torch.nn
    if name == "mlp25m":  # communication-heavy: 25.2M parameters, little compute per byte
        return nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048), nn.ReLU(),
                             nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 10)), (2048,)
    if name == "mlp_small":  # for quick runs and tests
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)), (256,)
    if name == "cnn":  # compute-heavy: ~0.3M parameters, many FLOPs per byte
        return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(128, 10)), (3, 32, 32)
    if name in ("resnet18", "vgg16"):  # real architectures at CIFAR size (bagua_lite.bench.zoo): 11.2M / 15.0M
        from . import zoo as models
        return getattr(models, name)(num_classes=10, cifar=True), (3, 32, 32)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def make_batches(shape, batch_size, n_batches, rank, seed=0):
    """Synthetic but learnable data: labels from a fixed random teacher, inputs per rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dim = 1
    for s in shape:
        dim *= s
    teacher = torch.randn(dim, 10, generator=g)
    gr = torch.Generator().manual_seed(seed + 1000 + rank)
    out = []
    for _ in range(n_batches):
        x = torch.randn(batch_size, *shape, generator=gr)
        out.append((x, (x.reshape(batch_size, -1) @ teacher).argmax(1)))
    return out


# ---- one rank -----------------------------------------------------------------------------------------------
def _tx_bytes():
    """Bytes this network namespace sent on its non-loopback interfaces (None on plain loopback)."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if not iface:
        return None
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def _run_cell(cell, cfg, model_name, batches, rank, world, straggler="none"):
    """Train ``model_name`` with one algorithm; returns per-step times (every rank's) and counters.

    ``straggler="half"``: rank ``STRAGGLER_RANK`` sleeps, at the start of each step, for as long as its
    previous step's own work took (see the module docstring). An asynchronous algorithm runs a fixed
    number of steps with no per-step collective and exchanges the step times once, at the end.
    """
    import torch
    import torch.distributed as dist

    import bagua_lite
    from bagua_lite import comm

    gc.collect()  # the previous cell's model, buffers and DDP reducer are gone before this one is timed
    net, _ = fresh_model(model_name)
    name, options = cell["name"], cell["options"]
    opt = make_optimizer(cell.get("optimizer", "sgd"), net.parameters())
    wrapper, ours = None, name not in BASELINES
    if ours:
        from bagua_lite.algorithms import build

        # Every rank built the same seeded model, so the start-up broadcast (DDP always does one; neither
        # is timed) is skipped: it costs seconds per cell on a slow emulated link.
        wrapper = bagua_lite.DistributedModel(net, opt, algorithm=build(name, **options),
                                              bucket_size_mb=cfg["bucket_size_mb"], broadcast_parameters=False)
        model = wrapper
    else:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        # powerSGD_hook with several buckets on gloo crashes (its per-bucket callbacks launch collectives
        # out of order); it runs reliably with one bucket, so that is how we run it.
        cap = 4096 if name == "ddp_powersgd" else cfg["bucket_size_mb"]
        # init_sync=False: every rank built the same seeded model (as for ours, the start-up broadcast is
        # skipped; neither is timed, it only costs the run seconds on a slow link)
        model = DDP(net, bucket_cap_mb=cap, init_sync=False)
        if name == "ddp_fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name == "ddp_powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=options.get("rank", 4),
                                                start_powerSGD_iter=2, min_compression_rate=0.5)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    asynchronous = ours and bool(getattr(wrapper.algorithm, "asynchronous", False))
    slow = straggler == "half" and rank == STRAGGLER_RANK
    loss_fn = torch.nn.CrossEntropyLoss()
    times, losses, waits, busy, sent, tx = [], [], [], [], [], []
    rank_times = [[] for _ in range(world)]  # rank_times[r]: rank r's own measured step times
    own = []  # this rank's (asynchronous: exchanged after the last step)
    warm = cfg["warmup_steps"]
    if ours and name == "auto":
        # timed from the second step of its pick: the probe steps and the switch are set-up, as
        # start_powerSGD_iter is for the PowerSGD baseline
        warm = max(warm, int(wrapper.algorithm.probe_steps) + 1)
    cycle, measure, most = 1, cfg["steps"], cfg["max_steps"]
    step = 0
    pending_sleep = 0.0  # the straggler's sleep for its previous step, taken at the start of the next
    if asynchronous:
        dist.barrier()  # the ranks start the cell together; no collective of ours after this until the end
    while step < warm + measure:
        if step == warm and ours:
            # A periodic relaxation (local SGD, decentralized with an interval) is timed over whole
            # cycles, at least two; the summary averages within a cycle and takes the median across.
            cycle = max(1, int(wrapper.algorithm.cycle))
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
        tx0 = _tx_bytes()
        wait0 = wrapper.timings["backward_wait_s"] if ours else 0.0
        if ours:
            wrapper._engine.reset_stats()
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
            if ours:
                waits.append(wrapper.timings["backward_wait_s"] - wait0)
                busy.append(wrapper._engine.stats()["busy_seconds"])
            sent.append(comm.bytes_sent())
            tx1 = _tx_bytes()
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
        picked = getattr(wrapper.algorithm, "picked", None)
        picked = repr(picked) if picked is not None else None
        wrapper.close()  # on every rank: an asynchronous algorithm ends its background work collectively
    return {"times": times, "rank_times": rank_times, "loss": losses[-1] if losses else float("nan"),
            "waits": waits, "busy": busy, "bytes": sent, "tx_bytes": tx, "picked": picked, "cycle": cycle,
            "asynchronous": asynchronous}


def _compute_floor(model_name, batches, cfg):
    """Per-step time with no communication at all (every rank computing at once, as in training)."""
    import torch
    import torch.distributed as dist

    net, _ = fresh_model(model_name)
    opt = make_optimizer("sgd", net.parameters())  # the floor keeps SGD whatever the cells use
    loss_fn = torch.nn.CrossEntropyLoss()
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


def worker_main(cfg, network, result_path):
    """Runs on every rank (spawned by the launcher or under torchrun); rank 0 appends JSON lines.

    Joins the default process group from the environment, unless one exists already (then it is left
    as it was found: the tests run the matrix on their own gloo group).
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("BAGUA_LITE_BENCH_THREADS", "1")))
    from .. import runtime
    # Before anything is measured: the floor, the DDP baselines and our algorithms share one allocator.
    tuned = runtime.tune_cpu_allocator()
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["timeout_s"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    from .. import cost_model

    net = cost_model.probe_network()
    machine = cost_model.calibrate_machine()

    def emit(record):
        if rank == 0:
            with open(result_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    emit({"kind": "network", "network": network, "world_size": world, "alpha": net.alpha, "beta": net.beta,
          "host_local": net.host_local,
          "machine": machine.__dict__, "malloc_tuned": tuned})
    for model_name in cfg["models"]:
        model0, shape = fresh_model(model_name)
        numel = sum(p.numel() for p in model0.parameters())
        batches = make_batches(shape, cfg["batch_size"], cfg["warmup_steps"] + cfg["max_steps"], rank)
        floor = _compute_floor(model_name, batches, cfg)
        from ..bucket import plan_model_buckets  # the buckets DistributedModel will make
        bucket_numels = [sum(p.numel() for p in b) for b in plan_model_buckets(model0, cfg["bucket_size_mb"])]
        emit({"kind": "floor", "network": network, "world_size": world, "model": model_name, "numel": numel,
              "step_s": floor, "bucket_numels": bucket_numels})
        for straggler in cfg["stragglers"]:
            for cell in cfg["algorithms"]:
                res = _run_cell(cell, cfg, model_name, batches, rank, world, straggler)
                work = cost_model.Workload(numel=numel, compute_s=floor, bucket_numels=bucket_numels)
                if straggler != "none":
                    pred = {"skipped": "the cost model knows no stragglers"}
                else:
                    try:
                        pred = cost_model.predict(cell["name"], cell["options"], world, work, net, machine)
                    except Exception as e:  # noqa: BLE001  (a model gap must not lose the measurement)
                        pred = {"error": str(e)}
                emit({"kind": "cell", "network": network, "world_size": world, "model": model_name,
                      "algorithm": cell["name"], "label": cell["label"], "options": cell["options"],
                      "optimizer": cell.get("optimizer", "sgd"), "straggler": straggler, "floor_s": floor,
                      "numel": numel, "batch_size": cfg["batch_size"], "prediction": pred, **res})
    if owned:
        dist.destroy_process_group()


# ---- launcher --------------------------------------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_last_progress = [None]


def _progress(done, total, label, width=30):
    """A progress bar on a terminal; one line per change otherwise (CI logs)."""
    if _last_progress[0] == (done, label):
        return
    _last_progress[0] = (done, label)
    filled = int(width * done / max(1, total))
    bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:60]}"
    sys.stderr.write(f"\r{bar:<100}" if sys.stderr.isatty() else bar + "\n")
    sys.stderr.flush()


def launch(cfg, config_path, network, world_size, result_path, total):
    """Start ``world_size`` workers for one network condition; wait, showing progress."""
    from . import netem

    threads = os.environ.get("BAGUA_LITE_BENCH_THREADS", "1")
    env_base = dict(os.environ, WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                    BAGUA_LITE_BENCH_NETWORK=network, OMP_NUM_THREADS=threads,
                    BAGUA_LITE_BENCH_THREADS=threads)
    port = _free_port()
    emu = None
    try:
        rate = netem.NETWORKS[network]
        if rate is not None:
            emu = netem.EmulatedNetwork(world_size, rate).__enter__()
            master = emu.address(0)
        else:
            master = "127.0.0.1"
        procs = []
        for r in range(world_size):
            env = dict(env_base, RANK=str(r), LOCAL_RANK=str(r), MASTER_ADDR=master, MASTER_PORT=str(port))
            argv = [sys.executable, "-m", "bagua_lite.bench", "--config", config_path, "--worker",
                    "--network", network, "--result-file", result_path]
            if emu is not None:
                env["GLOO_SOCKET_IFNAME"] = emu.interface(r)
                argv = emu.command(r, argv)
            procs.append(subprocess.Popen(argv, env=env))
        deadline = time.monotonic() + cfg["timeout_s"] * 2
        while any(p.poll() is None for p in procs):
            cells = _count_cells(result_path)
            _progress(cells, total, f"{network} P={world_size}")  # the file holds every launch's cells
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
        return sum(1 for line in f if '"kind": "cell"' in line)


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- analysis and output ---------------------------------------------------------------------------------------
def cycle_median(values, cycle=1):
    """Median over whole cycles of the per-cycle mean: a per-step figure that counts a periodic
    algorithm's communication step (a plain per-step median would drop it as an outlier)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    cycle = max(1, int(cycle))
    if len(values) < cycle:
        return statistics.fmean(values)
    chunks = [values[i:i + cycle] for i in range(0, len(values) - cycle + 1, cycle)]
    return statistics.median(statistics.fmean(ch) for ch in chunks)


def _ddp_baseline(cells, c):
    """The DDP cell ``c`` is compared with: same network, P, model and straggler condition; the same
    optimizer if the matrix measured DDP with it, else the first plain DDP cell of that group."""
    group = [d for d in cells if d["algorithm"] == "ddp" and d["network"] == c["network"]
             and d["world_size"] == c["world_size"] and d["model"] == c["model"]
             and d.get("straggler", "none") == c.get("straggler", "none")]
    same = [d for d in group if d.get("optimizer", "sgd") == c.get("optimizer", "sgd")]
    return (same or group or [None])[0]


def _cell_figures(c):
    """step_s, samples_per_s, each rank's median step time and the non-stragglers' median of a cell."""
    cyc = c.get("cycle", 1)
    step = cycle_median(c["times"], cyc)
    rank_s = [cycle_median(ts, cyc) for ts in c.get("rank_times") or []]
    straggler = c.get("straggler", "none")
    others = [t for r, t in enumerate(rank_s) if t is not None and not (straggler != "none" and r == STRAGGLER_RANK)]
    fast = statistics.median(others) if others else None
    if c.get("asynchronous") and rank_s and all(rank_s):
        samples = c["batch_size"] * sum(1.0 / t for t in rank_s)  # no rank waits for the others
    else:
        samples = c["world_size"] * c["batch_size"] / step
    return step, samples, (rank_s or None), fast


def summarize(records):
    """Turn raw records into one row per cell with medians (over whole cycles) and ratios."""
    cells = [r for r in records if r["kind"] == "cell"]
    rows = []
    for c in cells:
        cyc = c.get("cycle", 1)
        step, samples, rank_s, fast = _cell_figures(c)
        world = c["world_size"]
        straggler = c.get("straggler", "none")
        ddp = _ddp_baseline(cells, c)
        ddp_samples = _cell_figures(ddp)[1] if ddp else None
        wait = cycle_median(c["waits"], cyc)
        busy = cycle_median(c["busy"], cyc)
        # bagua_lite's own counter sees our collectives only; DDP's bytes show on emulated links' counters.
        counted = cycle_median(c["bytes"], cyc) if c["bytes"] and c["algorithm"] not in BASELINES else None
        # with a straggler the step includes its sleep: that is not communication
        comm_s = max(0.0, step - c["floor_s"]) if straggler == "none" else None
        hidden = None
        if busy:
            hidden = max(0.0, min(1.0, 1.0 - (wait or 0.0) / busy))
        pred = c.get("prediction") or {}
        pred_step = pred.get("step_s")
        rows.append({
            "network": c["network"], "world_size": world, "model": c["model"], "algorithm": c["label"],
            "name": c["algorithm"], "optimizer": c.get("optimizer", "sgd"), "straggler": straggler,
            "asynchronous": bool(c.get("asynchronous", False)),
            "step_s": step, "fast_s_per_step": fast, "rank_s_per_step": rank_s,
            "steps_measured": len(c["times"]), "samples_per_s": samples,
            "speedup_vs_ddp": (samples / ddp_samples) if ddp_samples else None,
            "ddp_baseline": ddp["label"] if ddp else None, "floor_s": c["floor_s"],
            "comm_exposed_s": comm_s, "engine_busy_s": busy, "hidden_share": hidden,
            "bytes_per_step_counted": counted, "bytes_per_step_wire": cycle_median(c["tx_bytes"], cyc),
            "final_loss": c["loss"], "predicted_step_s": pred_step,
            "prediction_error": (abs(pred_step - step) / step) if pred_step else None,
            "picked": c.get("picked"),
        })
    return rows


def print_table(rows, out=sys.stdout):
    # Optional columns, shown only where they say something: the straggler condition when the matrix
    # has more than one, the non-stragglers' s/step when there is a straggler or an asynchronous
    # algorithm, the optimizer when a row is not SGD.
    stragglers = list(dict.fromkeys(r["straggler"] for r in rows))
    show_straggler = len(stragglers) > 1
    show_fast = any(r["straggler"] != "none" or r["asynchronous"] for r in rows)
    show_opt = any(r["optimizer"] != "sgd" for r in rows)
    hdr = (f"{'network':<9}{'P':>3} {'model':<9} " + (f"{'straggler':<10}" if show_straggler else "")
           + f"{'algorithm':<34}" + (f"{'optim':<6}" if show_opt else "") + f"{'s/step':>8}"
           + (f"{'fast':>7}" if show_fast else "")
           + f"{'samples/s':>10}{'vs DDP':>8}"
           f"{'floor':>7}{'exposed':>8}{'hidden':>7}{'MB/step':>9}{'loss':>8}{'pred':>7}{'err':>6}")
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    def fmt(v, f):
        return format("-", f[0] + f[1:].split(".")[0].rstrip("%")) if v is None else format(v, f)

    for r in rows:
        mb = r["bytes_per_step_wire"] if r["bytes_per_step_wire"] is not None else r["bytes_per_step_counted"]
        print(f"{r['network']:<9}{r['world_size']:>3} {r['model']:<9} "
              + (f"{r['straggler'][:9]:<10}" if show_straggler else "")
              + f"{r['algorithm'][:33]:<34}" + (f"{r['optimizer']:<6}" if show_opt else "")
              + f"{r['step_s']:>8.3f}" + (fmt(r["fast_s_per_step"], ">7.3f") if show_fast else "")
              + f"{r['samples_per_s']:>10.1f}{fmt(r['speedup_vs_ddp'], '>8.2f')}{r['floor_s']:>7.3f}"
              f"{fmt(r['comm_exposed_s'], '>8.3f')}{fmt(r['hidden_share'], '>7.0%')}"
              f"{fmt(None if mb is None else mb / 1e6, '>9.2f')}"
              f"{r['final_loss']:>8.3f}{fmt(r['predicted_step_s'], '>7.3f')}{fmt(r['prediction_error'], '>6.0%')}",
              file=out)
    print("MB/step: bytes this rank sent per step (network namespace counter on emulated links, bagua_lite's "
          "own counter on loopback; '-' prediction: no model). hidden: share of engine time overlapped with "
          "backward.", file=out)
    if show_fast:
        print(f"s/step: the slowest rank's; fast: the median rank other than the straggler (rank {STRAGGLER_RANK}). "
              "straggler 'half': rank 0 sleeps as long as each of its steps took. Asynchronous algorithms' "
              "samples/s add up every rank's own rate.", file=out)
    if not show_straggler and stragglers != ["none"]:
        print(f"every row ran with straggler condition {stragglers[0]!r}", file=out)


def auto_report(rows, out=sys.stdout):
    groups = {}
    for r in rows:
        groups.setdefault((r["network"], r["world_size"], r["model"], r["straggler"]), []).append(r)
    hits, total = 0, 0
    for key, rs in groups.items():
        autos = [r for r in rs if r["name"] == "auto"]
        others = [r for r in rs if r["name"] != "auto"]
        if not autos or not others:
            continue
        best = min(others, key=lambda r: r["step_s"])
        ok = autos[0]["step_s"] <= 1.1 * best["step_s"]
        hits += ok
        total += 1
        where = f"{key[0]} P={key[1]} {key[2]}" + (f" straggler={key[3]}" if key[3] != "none" else "")
        print(f"auto on {where}: picked {autos[0]['picked']}, {autos[0]['step_s']:.3f} s/step; "
              f"best measured {best['algorithm']} {best['step_s']:.3f} s/step -> {'within' if ok else 'NOT within'} 10%",
              file=out)
    if total:
        print(f"auto's pick within 10% of the best measured algorithm in {hits}/{total} cells", file=out)


def projection_report(records, world_sizes, out=sys.stdout):
    from .. import cost_model

    nets = {(r["network"], r["world_size"]): r for r in records if r["kind"] == "network"}
    floors = {(r["network"], r["world_size"], r["model"]): r for r in records if r["kind"] == "floor"}
    algs = {}
    for r in records:
        if r["kind"] == "cell":
            algs[r["label"]] = (r["algorithm"], r["options"])
    result = []
    for (network, P, model), fl in sorted(floors.items()):
        nr = nets[(network, P)]
        # A projection is to a real cluster: links between hosts (host_local off), this rank's compute
        net = cost_model.Network(alpha=nr["alpha"], beta=nr["beta"])
        machine = cost_model.Machine(**nr["machine"])
        work = cost_model.Workload(numel=fl["numel"], compute_s=fl["step_s"], bucket_numels=fl.get("bucket_numels"))
        cands = [(n, o) for n, o in algs.values() if n in cost_model.PREDICTABLE]
        proj = cost_model.project(cands, world_sizes, work, net, machine)
        print(f"\nprojection for {model} on {network} (alpha={net.alpha * 1e6:.1f} us, "
              f"beta={1 / max(net.beta, 1e-30) * 8 / 1e9:.2f} Gbit/s, compute {fl['step_s']:.3f} s, measured at P={P}):",
              file=out)
        for p in proj:
            p.update(network=network, model=model)
            result.append(p)
        _projection_table(proj, out)
    return result


def _projection_table(proj, out):
    """Algorithms as rows, cluster sizes as columns, 's/step (speed-up over DDP)' per cell; the raw
    figures (comm, bytes, auto's pick) stay in results.json."""
    sizes = sorted({p["world_size"] for p in proj})
    rows = {}
    for p in proj:
        cell = f"{p['step_s']:.3g} ({p['speedup_vs_ddp']:.2f}x)"
        if p.get("picked"):
            cell += f" {p['picked'].split('(')[0]}"
        rows.setdefault(p["algorithm"], {})[p["world_size"]] = cell
    width = max([len(a) for a in rows] + [9])
    cols = {P: max([len(r.get(P, "")) for r in rows.values()] + [len(f"P={P}")]) for P in sizes}
    print("  " + "algorithm".ljust(width) + "".join(f"  {f'P={P}':>{cols[P]}}" for P in sizes), file=out)
    for alg, cells in rows.items():
        print("  " + alg.ljust(width) + "".join(f"  {cells.get(P, '-'):>{cols[P]}}" for P in sizes), file=out)


def write_outputs(rows, projections, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"rows": rows, "projections": projections}, f, indent=2)
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("benchmark: matplotlib not installed; no plot (pip install matplotlib)", file=sys.stderr)
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        rs = [r for r in rows if r["model"] == model]
        def where(r):
            return f"{r['network']} P={r['world_size']}" + (f" straggler={r['straggler']}"
                                                              if r["straggler"] != "none" else "")
        nets = list(dict.fromkeys(where(r) for r in rs))
        algs = list(dict.fromkeys(r["algorithm"] for r in rs))
        width = 0.8 / max(1, len(nets))
        for i, net in enumerate(nets):
            vals = []
            for a in algs:
                m = [r for r in rs if r["algorithm"] == a and where(r) == net]
                vals.append(m[0]["samples_per_s"] if m else 0)
            ax.bar([j + i * width for j in range(len(algs))], vals, width, label=net)
        ax.set_xticks([j + width * (len(nets) - 1) / 2 for j in range(len(algs))])
        ax.set_xticklabels([a[:22] for a in algs], rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("samples/s")
        ax.set_title(f"throughput, {model}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "throughput.png"), dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/benchmark.yaml")
    ap.add_argument("--project", default="", help="comma-separated world sizes to project to, e.g. 16,32,128,1024")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--network", default="loopback", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cfg = load_benchmark_config(args.config)
    project = [int(p) for p in args.project.split(",") if p.strip()] or list(cfg["project"])

    if args.worker or ("RANK" in os.environ and "WORLD_SIZE" in os.environ and args.result_file is None):
        # Under torchrun on a real cluster: measure here; rank 0 writes the results.
        path = args.result_file or os.path.join(args.out, "records.jsonl")
        if not args.worker:
            os.makedirs(args.out, exist_ok=True)
        worker_main(cfg, os.environ.get("BAGUA_LITE_BENCH_NETWORK", args.network), path)
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
        from . import netem

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
        per_launch = len(cfg["models"]) * len(cfg["stragglers"]) * len(cfg["algorithms"])
        total = per_launch * len(networks) * len(cfg["world_sizes"])
        t0 = time.monotonic()
        for network in networks:
            for P in cfg["world_sizes"]:
                launch(cfg, args.config, network, P, path, total)
        _progress(total, total, f"done in {time.monotonic() - t0:.0f} s")
        sys.stderr.write("\n")
        records = _read(path)
    rows = summarize(records)
    print_table(rows)
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
    write_outputs(rows, projections, args.out)
    print(f"wrote {args.out}/results.json, results.csv, throughput.png")


if __name__ == "__main__":
    main()
