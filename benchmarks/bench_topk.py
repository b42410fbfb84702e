"""Benchmark bagua_lite.kernels.topk (exact top-k by magnitude) on CPU.

For each configuration prints the median wall time of
  * ours:        bagua_lite.kernels.topk(x, k)   (and topk_out into preallocated buffers)
  * block_max:   topk_out given x's block maxima (float32; as topk/gtopk's error-feedback pass leaves them,
                 computed here before timing): reads only the blocks that can hold the top k
  * torch.topk:  torch.topk(x.abs(), k)          (the obvious baseline: one abs pass + a partial sort)
  * x.sum():     one read pass over x            (a lower bound for anything that reads x once)
and the ratios "speed-up vs torch.topk" (torch.topk / ours) and "ratio vs x.sum()" (ours / sum).

The headline configuration is --n / --k (default: 25M float32 randn, k = 25,000); a few other sizes,
densities, dtypes and adversarial inputs follow unless --main-only is given. No assertions on time.

    python benchmarks/bench_topk.py [--n 25000000] [--k 25000] [--repeats 11] [--main-only]
"""
import argparse
import statistics
import time

import torch

from bagua_lite import kernels


def median_ms(fns, repeats, warmup=2):
    """Median wall time (ms) of each function in `fns`, timed in interleaved rounds so that a change
    in machine load during the run affects all of them alike (the ratios are what matters)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(ts) for ts in times]


def make_input(kind, n, dtype, gen):
    if kind == "randn":
        x = torch.randn(n, generator=gen)
    elif kind == "sparse90":  # 90% exact zeros, like a gradient of a partly-used embedding
        x = torch.randn(n, generator=gen) * (torch.rand(n, generator=gen) < 0.1)
    elif kind == "all-equal":  # every |x| ties: the sampled threshold overflows -> exact fallback
        x = torch.ones(n)
    elif kind == "sorted":  # magnitudes ascending along the index
        x = torch.randn(n, generator=gen).abs().sort().values
    else:
        raise ValueError(kind)
    return x.to(dtype).contiguous()


def bench(kind, n, k, dtype, repeats, with_torch=True):
    gen = torch.Generator().manual_seed(0)
    x = make_input(kind, n, dtype, gen)
    values = torch.empty(k, dtype=dtype)
    indices = torch.empty(k, dtype=torch.int32)

    fns = [lambda: kernels.topk(x, k), lambda: kernels.topk_out(x, k, values, indices), lambda: x.sum()]
    if dtype == torch.float32:
        bounds = kernels.block_max_combine_(torch.zeros((n + 63) // 64, dtype=torch.int32), x)
        fns.append(lambda: kernels.topk_out(x, k, values, indices, bounds))
    ours, ours_out, total, *bounded = median_ms(fns, repeats)
    ref = median_ms([lambda: torch.topk(x.abs(), k)], max(3, repeats // 2), warmup=1)[0] if with_torch else float("nan")

    # Sanity (not timing): same selection as torch.topk as a set of magnitudes.
    v, i = kernels.topk(x, k)
    assert torch.equal(x[i.long()], v)
    if bounded:
        kernels.topk_out(x, k, values, indices, bounds)
        assert torch.equal(indices, i) and torch.equal(values, v)
    return dict(kind=kind, n=n, k=k, dtype=str(dtype).replace("torch.", ""), ours=ours, ours_out=ours_out,
                topk=ref, sum=total, block_max=bounded[0] if bounded else None)


def report(row):
    speedup = row["topk"] / row["ours"]
    vs_sum = row["ours"] / row["sum"]
    print(f"{row['kind']:>9} {row['dtype']:>8} n={row['n']:>10,} k={row['k']:>9,} | "
          f"ours {row['ours']:8.2f} ms  (topk_out {row['ours_out']:8.2f})  torch.topk {row['topk']:9.2f} ms  "
          f"x.sum() {row['sum']:7.2f} ms | speed-up vs torch.topk {speedup:7.1f}x  ratio vs x.sum() {vs_sum:5.2f}"
          + (f" | block_max {row['block_max']:7.2f} ms ({row['ours_out'] / row['block_max']:.1f}x topk_out)"
             if row["block_max"] is not None else ""),
          flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=25_000_000)
    parser.add_argument("--k", type=int, default=25_000)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--main-only", action="store_true", help="only the --n/--k float32 randn configuration")
    args = parser.parse_args()

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; median of {args.repeats} runs")
    report(bench("randn", args.n, args.k, torch.float32, args.repeats))
    if args.main_only:
        return
    n, k = args.n, args.k
    configs = [
        ("randn", n, 10 * k, torch.float32),       # 10x denser
        ("randn", n, max(1, k // 25), torch.float32),  # very sparse selection
        ("randn", n // 25, max(1, k // 25), torch.float32),  # small tensor, same density
        ("randn", n, k, torch.float16),
        ("randn", n, k, torch.bfloat16),
        ("randn", n, k, torch.float64),
        ("sparse90", n, k, torch.float32),
        ("sorted", n, k, torch.float32),
        ("all-equal", n, k, torch.float32),      # exact fallback path
    ]
    for kind, cn, ck, dt in configs:
        report(bench(kind, cn, ck, dt, args.repeats))


if __name__ == "__main__":
    main()
