"""Benchmark gtopk_allreduce against sparse_allreduce (TopKAllReduce) and dense allreduce.

Spawns P gloo processes on loopback for each world size. Each rank draws its own random gradient of
``size`` elements, selects k = density * size entries with ``bagua_lite.kernels.topk`` and then times,
per call (all ranks released by a barrier; a call's time is the slowest rank's):

* ``gtopk_allreduce(values, indices, k)``   recursive doubling, 2k*(4+4)*log2(P) bytes per core rank
* ``... canonical=True``                    the same rounds as fixed-size tensor ops (what a GPU runs: no
                                            host copy), the same bytes
* ``sparse_allreduce(values, indices, n, out=buf)``  one allgather of (P-1) * k*(4+4) bytes per rank
* ``allreduce(dense)``                      ring allreduce of the whole n-element gradient

and reports the median, plus the bytes each rank sent in one call (``bagua_lite.comm.bytes_sent()``)
next to the formula.

    python benchmarks/bench_gtopk.py                       # 25M elements, density 0.001, P = 4, 8
    python benchmarks/bench_gtopk.py --sizes 1000000 --world-sizes 2,3,5 --repeats 10
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


def gtopk_formula(rank, P, k, elem=4):
    """Bytes rank `rank` sends in one gtopk_allreduce: k*(elem+4) per message (see gtopk_allreduce.cpp)."""
    if P == 1 or k == 0:
        return 0
    core = 1 << (P.bit_length() - 1)
    msg, rounds = k * (elem + 4), core.bit_length() - 1
    if rank >= core:
        return msg                   # folds its set into rank - core
    return rounds * msg + (msg if rank + core < P else 0)  # + sends the result back to rank + core


def sparse_formula(P, k, elem=4):
    return 0 if P == 1 else (P - 1) * 3 * 8 + (P - 1) * k * (elem + 4)  # meta allgather + data allgather


def dense_formula(P, n, elem=4):
    return 0 if P == 1 else 2 * (P - 1) * n * elem // P


def _worker(rank, P, init_file, sizes, density, repeats, dense_repeats, warmup, out):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import bagua_lite
    from bagua_lite import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=300))
    try:
        for n in sizes:
            k = max(1, int(round(n * density)))
            g = torch.Generator().manual_seed(1000 + rank)
            x = torch.randn(n, generator=g)
            vals, idx = bagua_lite.kernels.topk(x, k)

            def timed(fn, reps):
                for _ in range(warmup):
                    fn()
                times = []
                for _ in range(reps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                comm.reset_traffic()
                fn()
                return times, comm.bytes_sent()

            dense = torch.empty_like(x)
            rows = {
                "gtopk_allreduce": timed(lambda: comm.gtopk_allreduce(vals, idx, k), repeats),
                "gtopk canonical": timed(lambda: comm.gtopk_allreduce(vals, idx, k, canonical=True), repeats),
                "sparse_allreduce": timed(lambda: comm.sparse_allreduce(vals, idx, n, out=dense), repeats),
                "allreduce (dense)": timed(lambda: comm.allreduce(dense.copy_(x), op="sum"), dense_repeats),
            }
            out.put((rank, n, k, rows))
            del dense, x
    except BaseException as e:  # noqa: BLE001
        import traceback
        out.put((rank, None, None, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_world(P, args):
    results = {}
    worker_args = (args.sizes, args.density, args.repeats, args.dense_repeats, args.warmup)
    with spawned_ranks(P, _worker, worker_args) as (procs, out):
        expected = P * len(args.sizes)
        while len(results) < expected:
            try:
                rank, n, k, rows = out.get(timeout=5)
            except Exception:  # queue.Empty
                if any(not p.is_alive() and p.exitcode != 0 for p in procs):
                    raise RuntimeError(f"P={P}: a rank died: exit codes {[p.exitcode for p in procs]}")
                continue
            if n is None:
                raise RuntimeError(f"P={P} rank {rank} failed:\n{rows}")
            results[(n, rank)] = (k, rows)
    return results


def report(P, results, sizes):
    lines = []
    for n in sizes:
        k = results[(n, 0)][0]
        for name in ("gtopk_allreduce", "gtopk canonical", "sparse_allreduce", "allreduce (dense)"):
            per_rank = [results[(n, r)][1][name] for r in range(P)]
            reps = len(per_rank[0][0])
            slowest = [max(per_rank[r][0][i] for r in range(P)) for i in range(reps)]
            med_ms = statistics.median(slowest) * 1e3
            sent = [per_rank[r][1] for r in range(P)]
            if name.startswith("gtopk"):
                want = [gtopk_formula(r, P, k) for r in range(P)]
            elif name == "sparse_allreduce":
                want = [sparse_formula(P, k)] * P
            else:
                want = [dense_formula(P, n)] * P
            same = sent == want
            fmt = (lambda v: f"{v[0]:,}" if len(set(v)) == 1 else f"{min(v):,}..{max(v):,}")
            lines.append(f"{P:>3} {n:>11,} {k:>8,} {name:<18} {med_ms:>10.2f} {reps:>5} {fmt(sent):>22} "
                         f"{fmt(want):>22} {'yes' if same else 'NO':>6}")
            if not same:
                lines.append(f"      per rank sent={sent} formula={want}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="25000000", help="comma-separated gradient sizes (elements)")
    ap.add_argument("--density", type=float, default=0.001, help="k = density * size")
    ap.add_argument("--world-sizes", default="4,8", help="comma-separated numbers of processes")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls of each sparse collective")
    ap.add_argument("--dense-repeats", type=int, default=5, help="timed calls of the dense allreduce")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    args.sizes = [int(float(s)) for s in args.sizes.split(",")]
    worlds = [int(p) for p in args.world_sizes.split(",")]

    header = (f"{'P':>3} {'numel':>11} {'k':>8} {'collective':<18} {'median ms':>10} {'calls':>5} "
              f"{'bytes sent / rank':>22} {'formula':>22} {'match':>6}")
    print(f"# density={args.density}, float32 values + int32 indices; a call's time is its slowest rank's;"
          f" cpu_count={os.cpu_count()}")
    print("# gtopk formula per core rank: 2k*4*log2(P') bytes (P' = largest power of two <= P), plus one"
          " k*8-byte message per fold/unfold send")
    print(header)
    print("-" * len(header))
    all_ok = True
    for P in worlds:
        t0 = time.time()
        lines = report(P, run_world(P, args), args.sizes)
        for line in lines:
            print(line, flush=True)
            all_ok &= " NO" not in line
        print(f"#   (P={P} took {time.time() - t0:.0f}s)", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
