"""How much of the gradient communication DistributedModel hides behind backward.

Spawns P gloo processes on loopback (file init). On a communication-heavy MLP (default: 8 layers of
1024x1024 after a 1024-wide input, ~8.4M parameters = 34 MB of fp32 gradients, batch 32) every rank
times, per iteration (all ranks released by a barrier; an iteration's time is the slowest rank's):

(a) ``full``     forward + backward + optimizer step through ``DistributedModel`` with
                 ``gradient_allreduce``: buckets are allreduced on the engine thread as backward goes on
(b) ``compute``  the same step through ``DistributedModel`` with a no-op algorithm (same buckets, hooks and
                 copies, no communication)
(c) ``comm``     communication only: the same buckets' ops (the allreduces of (a)) submitted to an engine
                 back to back, nothing else running
(d) ``ddp``      the same step with ``torch.nn.parallel.DistributedDataParallel`` (bucket_cap_mb = the
                 same bucket size), as a baseline

and reports the medians and the hidden share of communication

    hidden = (b + c - a) / c      (1: communication fully overlapped with backward; 0: none; < 0: the
                                   overlap costs more than it hides, e.g. threads fighting for cores)

plus ``exposed``: the time (a) spends after backward waiting for the last buckets (DistributedModel's
``timings["backward_wait_s"]``). Nothing here asserts on time: the numbers depend on the machine
(on a 2-core box, P=2 ranks x (compute thread + engine thread) share 2 cores).

    python benchmarks/bench_overlap.py                              # P = 2, defaults
    python benchmarks/bench_overlap.py --world-size 4 --layers 4 --iters 15
"""
import argparse
import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for an in-place build

from _ranks import spawned_ranks  # noqa: E402  (benchmarks/, the script's own folder)

MODES = ("compute", "comm", "full", "ddp")


def _make_mlp(width, layers, classes=10, seed=0):
    import torch

    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*mods)


def _worker(rank, P, init_file, args, out):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import bagua_lite
    from bagua_lite import _C

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=300))
    try:
        class NoComm(bagua_lite.Algorithm):
            """Buckets and hooks as usual, no ops: the compute-only baseline."""
            name = "no_comm (benchmark)"

        g = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(args.batch, args.width, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        loss_fn = torch.nn.CrossEntropyLoss()

        def build(kind):
            net = _make_mlp(args.width, args.layers)
            opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
            if kind == "ddp":
                return net, opt, torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=args.bucket_size_mb)
            alg = NoComm() if kind == "compute" else "gradient_allreduce"
            return net, opt, bagua_lite.DistributedModel(net, opt, alg, bucket_size_mb=args.bucket_size_mb)

        def train_step(model, opt):
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        models = {k: build(k) for k in ("compute", "full", "ddp")}
        n_params = sum(p.numel() for p in models["full"][0].parameters())
        full = models["full"][2]
        engine = _C.Engine()

        def comm_only():
            for b in full.buckets:
                engine.submit(b.index, b.flat, b.ops)
            engine.wait_all()

        steps = {
            "compute": lambda: train_step(models["compute"][2], models["compute"][1]),
            "comm": comm_only,
            "full": lambda: train_step(full, models["full"][1]),
            "ddp": lambda: train_step(models["ddp"][2], models["ddp"][1]),
        }
        times = {m: [] for m in MODES}
        wait = []
        for rnd in range(args.rounds):  # interleave the modes so that drift hits all of them alike
            for mode in MODES:
                for i in range(args.warmup + args.iters):
                    dist.barrier()
                    w0 = full.timings["backward_wait_s"]
                    t0 = time.perf_counter()
                    steps[mode]()
                    dt = time.perf_counter() - t0
                    if i >= args.warmup:
                        times[mode].append(dt)
                        if mode == "full":
                            wait.append(full.timings["backward_wait_s"] - w0)
        # an iteration's time is its slowest rank's
        for mode in MODES:
            t = torch.tensor(times[mode], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[mode] = t.tolist()
        w = torch.tensor(wait, dtype=torch.float64)
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
        for _, _, m in models.values():
            if hasattr(m, "close"):
                m.close()
        engine.shutdown()
        if rank == 0:
            out.put(("ok", {"times": times, "wait": w.tolist(), "params": n_params,
                            "buckets": len(full.buckets), "bucket_mb": [b.nbytes() / 2 ** 20 for b in full.buckets]}))
    except BaseException:  # noqa: BLE001
        import traceback
        out.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise
    finally:
        dist.destroy_process_group()


def run(args):
    with spawned_ranks(args.world_size, _worker, (args,), prefix="bagua_lite_overlap_") as (procs, out):
        deadline = time.monotonic() + args.timeout
        while True:
            try:
                status, payload = out.get(timeout=2)
                break
            except Exception:  # queue.Empty
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise SystemExit(f"bench_overlap: a rank died: exit codes {[p.exitcode for p in procs]}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"bench_overlap: no result within {args.timeout}s")
        if status != "ok":
            raise SystemExit(f"bench_overlap: {payload}")
        return payload


def report(args, res):
    med = {m: statistics.median(res["times"][m]) for m in MODES}
    q = {m: statistics.quantiles(res["times"][m], n=10) if len(res["times"][m]) >= 2 else [med[m]] * 9
         for m in MODES}
    a, b, c = med["full"], med["compute"], med["comm"]
    exposed = statistics.median(res["wait"])
    print(f"bench_overlap: P={args.world_size}, MLP {args.layers}x{args.width} ({res['params'] / 1e6:.2f}M params, "
          f"{res['params'] * 4 / 2 ** 20:.1f} MB of gradients), batch {args.batch}, {res['buckets']} buckets of "
          f"<= {args.bucket_size_mb} MB, {args.threads} compute thread(s)/rank, "
          f"{len(res['times']['full'])} timed iterations per mode (slowest rank each)")
    labels = {"full": "(a) full step, DistributedModel gradient_allreduce",
              "compute": "(b) compute only (same step, no-op algorithm)",
              "comm": "(c) communication only (the same buckets' allreduces)",
              "ddp": "(d) DDP full step (baseline)"}
    print(f"{'':<56}{'median ms':>10}{'p10 ms':>9}{'p90 ms':>9}")
    for m in ("full", "compute", "comm", "ddp"):
        print(f"{labels[m]:<56}{med[m] * 1e3:>10.2f}{q[m][0] * 1e3:>9.2f}{q[m][-1] * 1e3:>9.2f}")
    print(f"{'exposed communication in (a) (wait after backward)':<56}{exposed * 1e3:>10.2f}")
    print(f"hidden share of communication  (b + c - a) / c = ({b * 1e3:.2f} + {c * 1e3:.2f} - {a * 1e3:.2f}) / "
          f"{c * 1e3:.2f} = {(b + c - a) / c:.2f}")
    print(f"DistributedModel vs DDP: {a / med['ddp']:.2f}x DDP's iteration time")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8, help="hidden width x width layers")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-size-mb", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=8, help="timed iterations per mode and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations per mode and round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the modes (interleaved)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    if args.world_size < 2:
        raise SystemExit("bench_overlap: --world-size must be >= 2 (communication is what is measured)")
    report(args, run(args))


if __name__ == "__main__":
    main()
