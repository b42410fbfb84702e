"""How long diloco's / local_sgd's dense sync takes with its allreduce cut into pieces (``sync_chunks``).

P gloo ranks, each its own process (on an emulated network each in its own namespace, see
``bagua_lite.bench.netem``), average a buffer of ``--numel`` floats (default 25M: mlp25m's weights) with
``bagua_lite.comm.allreduce_start`` over ``split_even(buffer, c)``: all c pieces posted, then waited for,
as the sync does. Every c of ``--chunks`` in turn, ``--repeats`` rounds (interleaved, so drift hits all
alike); a sync's time is its slowest rank's. Prints the median, min and max per c, and whether c's
result equals c=1's bit for bit (per-rank random data).

    python benchmarks/bench_sync_chunks.py                                   # P=4, loopback
    python benchmarks/bench_sync_chunks.py --network 100mbit --repeats 5     # as root: tc-limited links
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _child(rank, P, init, numel, chunks, repeats):
    import datetime

    import torch
    import torch.distributed as dist

    from bagua_lite import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=600))
    source = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))
    buf = torch.empty_like(source)
    views = {c: comm.split_even(buf, c) for c in chunks}  # made once, as the averager does

    def sync(c):
        comm.allreduce_start(buf, "avg", pieces=views[c]).wait()

    same, first = {}, None
    for c in chunks:  # bits: each c's average of the same data against the first's
        buf.copy_(source)
        sync(c)
        if first is None:
            first = buf.clone()
        same[c] = bool(torch.equal(buf, first))
    del first
    times = {c: [] for c in chunks}
    for _ in range(repeats):
        for c in chunks:
            dist.barrier()
            t0 = time.perf_counter()
            sync(c)
            times[c].append(time.perf_counter() - t0)
    t = torch.tensor([times[c] for c in chunks], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a sync ends when its slowest rank's does
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "same": {str(c): same[c] for c in chunks}, "times": t.tolist()}), flush=True)


def run(args):
    from bagua_lite.bench import netem

    rate = netem.NETWORKS[args.network]
    with netem.EmulatedNetwork(args.world_size, rate) as net:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init = f"tcp://{net.address(0)}:{port}"
        procs = []
        for r in range(args.world_size):
            env = {**os.environ, **net.env(r), "OMP_NUM_THREADS": "1"}
            argv = [sys.executable, os.path.abspath(__file__), "--child", str(r), str(args.world_size), init,
                    str(args.numel), ",".join(map(str, args.chunks)), str(args.repeats)]
            procs.append(subprocess.Popen(net.command(r, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env))
        outs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=args.timeout)
                if p.returncode != 0:
                    raise SystemExit(f"bench_sync_chunks: a rank failed (exit {p.returncode}):\n{err}")
                outs.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    return outs


def report(args, outs):
    times = outs[0]["times"]
    mb = args.numel * 4 / 1e6
    print(f"bench_sync_chunks: P={args.world_size}, {args.network}, {args.numel} floats ({mb:g} MB), "
          f"{args.repeats} repeats per chunk count (slowest rank each)")
    print(f"{'chunks':>6}{'median s':>10}{'min s':>8}{'max s':>8}{'vs 1':>7}  bits as chunks={args.chunks[0]}")
    base = statistics.median(times[0])
    for c, t in zip(args.chunks, times):
        same = all(o["same"][str(c)] for o in outs)
        med = statistics.median(t)
        print(f"{c:>6}{med:>10.3f}{min(t):>8.3f}{max(t):>8.3f}{med / base:>7.2f}  {'yes' if same else 'NO'}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        rank, P, init, numel, chunks, repeats = argv[1:7]
        _child(int(rank), int(P), init, int(numel), [int(c) for c in chunks.split(",")], int(repeats))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--chunks", type=lambda s: [int(c) for c in s.split(",")], default=[1, 2, 4, 8],
                    help="comma-separated chunk counts; the first is the reference for the bits (default 1,2,4,8)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--network", default="loopback", choices=["loopback", "10gbit", "1gbit", "100mbit"],
                    help="loopback, or a tc-limited network of namespaces (needs root)")
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args(argv)
    if args.world_size < 2:
        raise SystemExit("bench_sync_chunks: --world-size must be >= 2")
    report(args, run(args))


if __name__ == "__main__":
    main()
