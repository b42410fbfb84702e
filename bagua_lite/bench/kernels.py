"""The kernel benchmark: top-k and every built-in codec against the memory floor and torch, in one run.

    python -m bagua_lite.bench.kernels                      # CUDA when there is a device, else the CPU
    python -m bagua_lite.bench.kernels --device cpu --sizes 25000000 --threads 1

For each kernel and size it prints the median time (CUDA events on a GPU, wall time on the CPU), the
bytes it must move over that time (GB/s), and its time over the floor: the time to move those bytes at
the bandwidth of a device-to-device (or memory-to-memory) copy measured in the same run. The one-read
floor of a top-k is reading x once; a codec's is reading its input and writing its output once (decode
with accumulate: reading the wire and out, writing out). Next to each, the same operation written with
torch ops (``torch.topk(x.abs(), k)``; ``x.half()``; aminmax then the quantization formula; ``x.abs().mean()``
and ``x >= 0``; ``x.abs().max()`` then ``round(x / scale)``), timed in the same run. No assertion on time.
"""
import argparse
import json
import statistics
import time

import torch

from .. import compressors
from .. import kernels as K

CODECS = ["fp16", "bf16", "minmax_uint8", "sign", "absmax4", "absmax2", "topk3_absmax2"]


def timer(device):
    """median_ms(fn, repeats): the median time of one call, by CUDA events or the wall clock."""
    if device.type == "cuda":
        def median_ms(fn, repeats):
            fn()
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            return statistics.median(times)
    else:
        def median_ms(fn, repeats):
            fn()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
    return median_ms


def _torch_codec(name, x, out, k):
    """(encode, decode-and-add) of codec ``name`` written with torch ops, for the comparison."""
    if name in ("fp16", "bf16"):
        dt = torch.float16 if name == "fp16" else torch.bfloat16
        h = x.to(dt)
        return (lambda: x.to(dt)), (lambda: out.add_(h))
    if name == "minmax_uint8":
        def enc():
            lo, hi = torch.aminmax(x)
            return ((x - lo) * (255.0 / (hi - lo))).round_().clamp_(0, 255).to(torch.uint8)
        q, (lo, hi) = enc(), torch.aminmax(x)
        return enc, (lambda: out.add_(q.float() * ((hi - lo) / 255.0) + lo))
    if name == "sign":
        bits, s = x >= 0, x.abs().mean()
        return (lambda: (x.abs().mean(), x >= 0)), (lambda: out.add_(torch.where(bits, s, -s)))
    if name in ("absmax4", "absmax2"):
        levels = 7 if name == "absmax4" else 1

        def enc():
            s = x.abs().max() / levels
            return torch.round(x / s).to(torch.int8), s
        codes, s = enc()
        return enc, (lambda: out.add_(codes.float() * s))
    if name == "topk3_absmax2":
        idx = torch.topk(x.abs(), k).indices

        def enc():
            i = torch.topk(x.abs(), k).indices
            v = x[i]
            return i, torch.round(v / v.abs().max()).to(torch.int8)
        return enc, (lambda: out.index_add_(0, idx, x[idx]))
    raise ValueError(name)


def run(device, sizes, densities, repeats):
    median_ms = timer(device)
    rows = []
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, generator=g).to(device)
        y = torch.empty_like(x)
        copy_ms = median_ms(lambda: y.copy_(x), repeats)
        bw = 2 * x.nbytes / (copy_ms * 1e-3)  # bytes/s, read and write counted

        def row(what, ms, nbytes, torch_ms, note=""):
            floor_ms = nbytes / bw * 1e3
            rows.append({"kernel": what, "n": n, "ms": ms, "GB/s": nbytes / (ms * 1e-3) / 1e9, "floor_ms": floor_ms,
                         "x_floor": ms / floor_ms, "torch_ms": torch_ms, "vs_torch": torch_ms / ms, "note": note})

        rows.append({"kernel": "copy (the floor's bandwidth)", "n": n, "ms": copy_ms, "GB/s": bw / 1e9,
                     "floor_ms": copy_ms, "x_floor": 1.0, "torch_ms": float("nan"), "vs_torch": float("nan"), "note": ""})
        for d in densities:
            k = K.topk_count(n, d)
            v, i = torch.empty(k, device=device), torch.empty(k, dtype=torch.int32, device=device)
            ours = median_ms(lambda: K.topk_out(x, k, v, i), repeats)
            ref = median_ms(lambda: torch.topk(x.abs(), k), max(3, repeats // 3))
            row(f"topk density {d:g}", ours, x.nbytes, ref, note=f"k = {k:,}")
        out = torch.zeros_like(x)
        for name in CODECS:
            comp = compressors.get_compressor(name)
            wire = torch.empty(comp.wire_bytes(n), dtype=torch.uint8, device=device)
            k = comp.k(n) if hasattr(comp, "k") else 0
            t_enc, t_dec = _torch_codec(name, x, out, k)
            enc = median_ms(lambda: comp.compress(x, wire), repeats)
            dec = median_ms(lambda: comp.decompress(wire, out, accumulate=True), repeats)
            ref_enc, ref_dec = median_ms(t_enc, repeats), median_ms(t_dec, repeats)
            row(f"{name} encode", enc, x.nbytes + wire.numel(), ref_enc)
            dec_bytes = wire.numel() + (2 * x.nbytes if k == 0 else 8 * k)  # sparse: k reads and writes of out
            row(f"{name} decode+add", dec, dec_bytes, ref_dec)
    return rows


def print_table(rows, device):
    print(f"{'kernel':<28}{'n':>13}{'ms':>10}{'GB/s':>9}{'x floor':>9}{'torch ms':>11}{'vs torch':>10}  note")
    for r in rows:
        print(f"{r['kernel']:<28}{r['n']:>13,}{r['ms']:>10.3f}{r['GB/s']:>9.1f}{r['x_floor']:>9.2f}"
              f"{r['torch_ms']:>11.3f}{r['vs_torch']:>9.2f}x  {r['note']}")
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"CUDA kernels: {K.cuda_kernels_enabled()}; floor = bytes / the copy's bandwidth; medians")


def profile(device, n, densities):
    """Where the time of one call goes: each kernel it launches, by the profiler's device time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    calls = [(f"topk density {d}", lambda d=d: K.topk(x, max(1, int(n * d)))) for d in densities]
    for name in ("minmax_uint8", "sign", "topk3_absmax2"):
        comp = compressors.get_compressor(name)
        wire = torch.empty(comp.wire_bytes(n), dtype=torch.uint8, device=device)
        calls.append((f"{name} encode", lambda comp=comp, wire=wire: comp.compress(x, wire)))
        calls.append((f"{name} decode+add", lambda comp=comp, wire=wire: comp.decompress(wire, x, accumulate=True)))
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    for label, fn in calls:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        with torch_profile(activities=[activity]) as prof:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
        print(f"\n{label} at n = {n:,}:")
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=10, max_name_column_width=60))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    ap.add_argument("--sizes", default=None, help="comma-separated element counts (default: 25M,100M on a GPU, "
                                                 "25M on the CPU)")
    ap.add_argument("--densities", default="0.001,0.01", help="top-k densities")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--profile", action="store_true",
                    help="also print each device kernel's time inside one top-k and one codec call (torch.profiler)")
    args = ap.parse_args(argv)
    name = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    if name not in ("cpu", "cuda"):
        ap.error(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if name == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible")
    device = torch.device(name)
    if args.threads:
        torch.set_num_threads(args.threads)
    default = "25000000,100000000" if name == "cuda" else "25000000"
    sizes = [int(s) for s in (args.sizes or default).split(",")]
    densities = [float(d) for d in args.densities.split(",")]
    bad = [s for s in sizes if s < 1] + [d for d in densities if not 0 < d <= 1]
    if bad:
        ap.error(f"sizes must be >= 1 and densities in (0, 1], got {bad}")
    rows = run(device, sizes, densities, args.repeats)
    print_table(rows, device)
    if args.profile:
        profile(device, sizes[0], densities)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
