"""Benchmark the built-in compressors' C++ paths on CPU against the torch one-liners they replace.

For each built-in (fp16, bf16, minmax_uint8, sign) prints the median wall time of compressing n float32
values into a preallocated wire buffer and of decompressing them (added into a float32 buffer, as the
collectives do), next to
  * the torch equivalent (``x.half()``, ``x.bfloat16()``; for minmax_uint8 ``aminmax`` then the
    quantization formula in tensor ops; for sign ``x.abs().mean()`` and ``x >= 0``),
  * ``x.sum()``: one read pass over x, a lower bound for anything that reads x once.
One intra-op thread by default (each rank of the benchmark runs with one). No assertions on time.

    python benchmarks/bench_compress.py [--n 25000000] [--repeats 9] [--threads 1]
"""
import argparse

import torch

from bagua_lite import _C
from bench_topk import median_ms


def torch_quantize(x):
    lo, hi = torch.aminmax(x)
    scale = 255.0 / float(hi - lo)
    return ((x - lo) * scale).round_().clamp_(0, 255).to(torch.uint8)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=25_000_000)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.n, generator=torch.Generator().manual_seed(0))
    acc = torch.zeros_like(x)
    baselines = {"fp16": lambda: x.half(), "bf16": lambda: x.bfloat16(), "minmax_uint8": lambda: torch_quantize(x),
                 "sign": lambda: (x.abs().mean(), x >= 0)}
    print(f"n = {args.n:,} float32, {args.threads} thread(s), median of {args.repeats}")
    print(f"{'compressor':<14}{'compress ms':>12}{'decompress+add ms':>19}{'torch ms':>10}{'vs torch':>10}{'x.sum() ms':>12}")
    for name, baseline in baselines.items():
        wire = _C.compress(x, name)  # a wire buffer of the right size
        c, d, t, s = median_ms([lambda: _C.compress_into(x, name, wire),
                                lambda: _C.decompress_into(wire, name, acc, True),
                                baseline, lambda: x.sum()], args.repeats)
        print(f"{name:<14}{c:>12.2f}{d:>19.2f}{t:>10.2f}{t / c:>9.2f}x{s:>12.2f}")


if __name__ == "__main__":
    main()
