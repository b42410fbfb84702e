"""The cost model's network and machine: what a link and a rank's local work cost (:class:`Network`,
:class:`Machine`), the job's shape (:class:`Workload`), and how they are measured on the running job
(:func:`probe_network`, :func:`calibrate_machine`). The formulas over them are in :mod:`bagua_lite.cost_model`.
Imports without torch (measuring imports it)."""
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence


@dataclass
class Network:
    alpha: float   # seconds per message (latency)
    beta: float    # seconds per byte
    host_local: bool = False   # one host, no rate limit: moving bytes is CPU work (kernel copies), not waiting


@dataclass
class Machine:
    """Local per-element costs, measured once (seconds per element)."""
    topk_s_per_elem: float        # bagua_lite.kernels.topk on float32
    quantize_s_per_elem: float    # minmax_uint8 compress + decompress
    fp16_s_per_elem: float        # fp16 compress + decompress
    add_s_per_elem: float         # a streaming add (error feedback, averaging)
    merge_s_per_elem: float = 0.0     # kernels.merge_topk, per input pair (0: taken as 4x topk)
    matmul_s_per_flop: float = 0.0    # a skinny (n x n) @ (n x 4) matmul, as PowerSGD runs (0: one pass)
    cores_per_rank: float = 0.0       # CPU cores per rank on a host (0: unknown, taken as plenty)
    bf16_s_per_elem: float = 0.0      # bf16 compress + decompress (0: taken as fp16's)
    sign_s_per_elem: float = 0.0      # sign compress + decompress (0: taken as minmax_uint8's)
    round_s: float = 0.0              # our synchronous round's fixed cost beyond alpha (agreement, hand-offs;
    #                                   auto measures it in its probe; 0: none)
    topk_bounded_s_per_elem: float = 0.0  # kernels.topk_out given block maxima, per element of x (topk/gtopk's


@dataclass
class Workload:
    numel: int                    # gradient elements (model parameters)
    elem_bytes: int = 4
    compute_s: float = 0.0        # forward + backward + optimizer per step with no communication
    backward_fraction: float = 0.66   # share of compute_s that is backward (overlap window)
    n_buckets: int = 1
    bucket_numels: Optional[Sequence[int]] = None   # exact bucket sizes (overrides numel / n_buckets)

    def buckets(self) -> List[int]:
        if self.bucket_numels:
            return [int(b) for b in self.bucket_numels]
        B = max(1, int(self.n_buckets))
        n = int(self.numel)
        return [n // B + (1 if i < n % B else 0) for i in range(B)]


#: A same-host path faster than this (bits/s) is taken as CPU-bound copies (see probe_network).
HOST_LOCAL_MIN_BPS = 5e9
_PROBED: Dict[tuple, "Network"] = {}  # what probe_network measured in this process, per group


def probe_network(group=None, sizes=(8, 1 << 16, 1 << 22, 1 << 24), repeats=6, reuse=False,
                  device=None) -> Network:
    """Measure alpha and beta by ping-pong, every pair of ranks at once (collective: call on all ranks).

    Ranks pair up (0-1, 2-3, ...; with odd P the last rank idles), so the links, and on one host the
    kernel's copies, are as busy as in a collective. For each size (bytes), ``repeats`` round trips after
    one warm-up; t(m) = median half round trip. Fit ``t = alpha + beta * m``: alpha from the 8-byte
    message, beta from the two largest (4 and 16 MB, past any rate limiter's burst); alpha is clamped at
    0 and beta kept > 0. The slowest pair's fit (max alpha, max beta) goes to every rank, so all ranks
    return the same Network. ``host_local``: every rank reported the same host name and the path runs
    faster than ``HOST_LOCAL_MIN_BPS`` (5 Gbit/s): memory copies, not a rate-limited link (an emulated
    1 Gbit/s link between namespaces of one host is waiting, not CPU work). One rank: ``Network(0, 0)``.
    ``reuse=True`` returns what an earlier call in this process measured for the same ranks, sizes and
    repeats, if any (every rank must pass the same ``reuse``; a 1 Gbit/s probe moves about 250 MB).
    ``device``: where the ping-pong buffers live (default: the CPU where ``group`` carries CPU tensors, else
    the current CUDA device), so the probe times the transport the data will take.
    """
    import torch
    import torch.distributed as dist

    from bagua_lite import _compat, _control  # like torch above: the formulas import without torch

    if group is None:
        group = dist.group.WORLD
    P, me = dist.get_world_size(group), dist.get_rank(group)
    if P == 1:
        return Network(0.0, 0.0)
    key = (tuple(dist.get_process_group_ranks(group)), tuple(sizes), repeats)
    if reuse and key in _PROBED:
        return _PROBED[key]
    import socket
    import zlib

    control = _control.setup(group)  # collective, like this probe; made once per group
    if device is None or torch.device(device).type != "cpu" and _compat.backend_for(group, "cuda") in (None, "gloo"):
        # gloo moves CUDA tensors through the host, and its send/recv takes none: time the host path
        device = "cpu" if _compat.takes_cpu_tensors(group) else torch.device("cuda", torch.cuda.current_device())
    host = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64)
    hosts = [torch.zeros_like(host) for _ in range(P)]
    dist.all_gather(hosts, host, group=control)
    host_local = len({int(h) for h in hosts}) == 1
    fit = torch.zeros(2, dtype=torch.float64)
    partner = me + 1 if me % 2 == 0 else me - 1
    if partner < P:
        first = me % 2 == 0
        peer = dist.get_global_rank(group, partner)
        points = []
        for size in sizes:
            buf = torch.zeros(int(size), dtype=torch.uint8, device=device)
            times = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                if first:
                    dist.send(buf, peer, group=group)
                    dist.recv(buf, peer, group=group)
                    if buf.is_cuda:
                        torch.cuda.synchronize(buf.device)  # a round trip done, not merely queued
                else:
                    dist.recv(buf, peer, group=group)
                    dist.send(buf, peer, group=group)
                if i:
                    times.append((time.perf_counter() - t0) / 2)
            points.append((float(size), statistics.median(times)))
        if first:
            fit[0], fit[1] = _fit_alpha_beta(points)
    dist.all_reduce(fit, op=dist.ReduceOp.MAX, group=control)
    host_local = host_local and float(fit[1]) < 8.0 / HOST_LOCAL_MIN_BPS
    _PROBED[key] = Network(alpha=float(fit[0]), beta=float(fit[1]), host_local=host_local)
    return _PROBED[key]


def _fit_alpha_beta(points):
    """alpha from the smallest message, beta from the slope between the two largest.

    A least-squares fit over all sizes lets the mid-sized messages set beta, and those can ride a
    rate limiter's burst allowance (tc tbf) or a NIC's buffers at more than the sustained rate; the
    largest messages are the ones that see the link's sustained bandwidth. a >= 0, b > 0.
    """
    points = sorted(points)
    (m0, t0), (m1, t1), (m2, t2) = points[0], points[-2], points[-1]
    b = (t2 - t1) / (m2 - m1) if m2 > m1 else 0.0
    if b <= 0:
        b = t2 / m2
    a = max(0.0, t0 - b * m0)
    return a, max(b, 1e-15)


def cores_per_rank(local_world_size: Optional[int] = None) -> float:
    """CPU cores this process may use divided by the ranks on this host (``LOCAL_WORLD_SIZE``, as torchrun
    and the benchmark set it; 1 when unset)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return cores / max(1, int(local_world_size))


def calibrate_machine(numel=1 << 22, repeats=5) -> Machine:
    """Time the local kernels on ``numel`` float32 elements (median of ``repeats``), per element; and
    :func:`cores_per_rank`."""
    import torch

    from . import kernels  # lazy: the formulas import without torch

    numel = int(numel)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g)
    y = torch.randn(numel, generator=g)
    z = torch.empty_like(x)

    def med(fn):
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    k = max(1, numel // 1000)
    topk = med(lambda: kernels.topk(x, k)) / numel
    bounds = kernels.block_max_combine_(torch.zeros((numel + 63) // 64, dtype=torch.int32), x)
    kv, ki = torch.empty(k), torch.empty(k, dtype=torch.int32)
    bounded = med(lambda: kernels.topk_out(x, k, kv, ki, bounds)) / numel
    quant = med(lambda: kernels.decompress(kernels.compress(x, "minmax_uint8"), "minmax_uint8", numel)) / numel
    fp16 = med(lambda: kernels.decompress(kernels.compress(x, "fp16"), "fp16", numel)) / numel
    bf16 = med(lambda: kernels.decompress(kernels.compress(x, "bf16"), "bf16", numel)) / numel
    sign = med(lambda: kernels.decompress(kernels.compress(x, "sign"), "sign", numel)) / numel
    add = med(lambda: torch.add(x, y, out=z)) / numel
    s = max(1, min(numel // 16, 1 << 16))
    av, ai = kernels.topk(x[: 4 * s].contiguous(), s)
    bv, bi = kernels.topk(y[: 4 * s].contiguous(), s)
    merge = med(lambda: kernels.merge_topk(av, ai, bv, bi, s)) / (2 * s)
    side = max(4, int(math.isqrt(numel)))
    M = x[: side * side].view(side, side) if side * side <= numel else torch.randn(side, side, generator=g)
    Q = torch.randn(side, 4, generator=g)
    matmul = med(lambda: M @ Q) / (2.0 * side * side * 4)
    return Machine(topk_s_per_elem=topk, quantize_s_per_elem=quant, fp16_s_per_elem=fp16, add_s_per_elem=add,
                   merge_s_per_elem=merge, matmul_s_per_flop=matmul, cores_per_rank=cores_per_rank(),
                   bf16_s_per_elem=bf16, sign_s_per_elem=sign, topk_bounded_s_per_elem=bounded)
