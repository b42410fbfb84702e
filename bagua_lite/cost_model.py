"""The alpha-beta cost model: what one training step costs under each algorithm, and at which P it pays.

A message of ``m`` bytes costs ``alpha + m * beta`` (Hockney; BAGUA and gTop-k S-SGD use the same
model). Each rank has one full-duplex link: it can send and receive at once, but two messages it sends
at the same time share its bandwidth (the benchmark's emulated networks rate-limit each rank's
interface, which is exactly this). Notation, per bucket of ``n`` elements of ``e`` bytes
(``m = n * e``), on ``P`` ranks:

    ring(m)   = floor(2 (P-1) m / P)   bytes a rank sends in a ring allreduce (what comm counts)
    T_ring(m) = 2 (P-1) alpha + ring(m) beta
    k         = max(1, min(n, round(density * n)))          (as ErrorFeedbackSparsifier.k_for)
    wire(c)   = 2c (fp16) | 8 + c (minmax_uint8: float32 min and max, then c bytes)
    c_i       = n // P + (i < n % P)                         (chunk i of a compressed allreduce)
    P'        = the largest power of two <= P,   L = log2 P'

Every algorithm, what travels per step (``bytes_per_rank`` = what ``bagua_lite.comm.bytes_sent()``
counts on the busiest rank, summed over buckets; the latency term counts sequential messages):

=====================  ==========================================================================
``ddp``                torch DDP, ring allreduce per bucket: ring(m) bytes, T_ring(m); local: one
                       divide (n * add). Overlapped with backward bucket by bucket (see below).
``ddp_fp16``           fp16_compress_hook: ring(2n) bytes, T_ring(2n); local: cast there and back
                       (n * fp16) plus the divide. Overlapped.
``ddp_powersgd``       powerSGD_hook, rank r (option ``rank``, as the benchmark passes it, or
                       ``matrix_approximation_rank``), steady state (after start_powerSGD_iter).
                       Matrices from option ``shapes`` ([[rows, cols], ...]); without it, one
                       square matrix of n elements: rows = cols = sqrt(n). Two allreduces, of the
                       P-matrices (sum rows * r) and the Q-matrices (sum cols * r):
                       bytes ring(4 r sum rows) + ring(4 r sum cols), time 2 T_ring(...) terms;
                       plus one dense allreduce of whatever is left uncompressed (``uncompressed``
                       option, elements; default 0). Local: three skinny matmuls (M Q, M^T P,
                       P Q^T: 2 n r flops each) at max(flop rate, one pass over M), and four passes
                       for error feedback. One bucket (the benchmark runs it so): no overlap.
``gradient_allreduce`` compression none: ring(m), T_ring(m); local: the divide.
                       fp16 / minmax_uint8 (csrc/collectives/compressed_allreduce.cpp): all-to-all
                       of compressed chunks, rank i sends sum_{j != i} wire(c_j); then allgather
                       of its recompressed chunk padded to wire(c_0): (P-1) wire(c_0). Busiest rank:
                       the one with the smallest chunk (rank P-1). Time: (P-1) alpha for the
                       all-to-all (the P-1 sends serialise on the sender's link) + (P-1) alpha for
                       the ring allgather + bytes * beta. Local: compress n (1 + 1/P) and
                       decompress 2n elements: (3 + 1/P)/2 codec round trips per element.
                       ``hierarchical``: treated as dense (flat ring) — a model gap, stated here.
``topk``               TopKAllReduce (csrc/collectives/sparse_allreduce.cpp): an allgather of
                       (k, numel, dtype) as 3 int64, then an allgather of [k values][k int32]:
                       (P-1) 24 + (P-1) k (e + 4) bytes; gloo's allgather is a ring, so
                       2 (P-1) alpha. Local: topk select (n * topk) + error-feedback add and zero of
                       the dense output (2 n * add) + scatter of the P k pre-divided pairs (P k * add).
``gtopk``              recursive doubling (csrc/collectives/gtopk_allreduce.cpp), message k (e + 4):
                       L swaps (send and receive at once: alpha + k (e + 4) beta each); if P != P',
                       one fold before and one unfold after, sequential: + 2 (alpha + k (e + 4) beta).
                       Busiest rank: rank 0, L + [P != P'] messages. ``exact``: + T_ring(k e) and
                       ring(k e) bytes. Local: topk + 2 n * add as for topk, plus a merge of 2k
                       pairs per message (2k * merge each) and the scatter of k pairs.
``decentralized``      after the optimizer step, on the flat weights (m = all parameters), every
                       ``communication_interval`` steps (amortised: divided by it). ring: P >= 3
                       sends m to both neighbours at once on one link: alpha + 2 m beta, 2m bytes;
                       P = 2 a single exchange: alpha + m beta, m bytes. shift_one: one partner:
                       alpha + m beta, m bytes (odd P: one rank sits each exchange out; the model
                       reports the busy ones). all: T_ring(m), ring(m). Local: gather + scatter +
                       the averaging (ring 5, shift_one 4, all 3 passes over n). Never overlapped.
``local_sgd``          steady state: T_ring(m) of the weights every ``period`` steps, after the
                       step (not overlapped): (T_ring(m) + 3 n * add) / period per step, ring(m) /
                       period bytes. Warm-up steps cost what gradient_allreduce costs; that figure
                       is returned as ``warmup_step_s``.
``auto``               whatever :func:`choose` picks from the options' ``candidates`` (with their
                       ``network`` override if any, as the algorithm does); predicted under ``net``.
=====================  ==========================================================================

Overlap (the engine, or DDP's reducer): backward lasts ``Tb = backward_fraction * compute_s``; bucket i
is ready when the share of parameters up to and including it has its gradients,
``ready_i = Tb * (n_0 + ... + n_i) / n``; one worker runs buckets in order, each taking
``e_i = local_i + comm_i``: ``finish_i = max(ready_i, finish_{i-1}) + e_i``. What sticks out after
backward, ``exposed = max(0, finish_last - Tb)``, is paid; the rest is ``hidden_s``. So
``step_s = compute_s + compression_s + comm_s - hidden_s``. That needs a core for the engine thread
next to autograd's: with ``Machine.cores_per_rank < 2`` (ranks share cores, as 4 ranks on 2 cores do)
local work (compression, selection, error feedback) cannot hide; only waiting on the network can, and the
pipeline runs over the communication times alone: ``exposed = compression_s + pipeline(comm_i)``. On one
host with no rate limit (``Network.host_local``: loopback) and shared cores the transfer is kernel copies
on those same cores, so nothing hides: ``exposed = compression_s + comm_s``.

Local costs come from :class:`Machine` (per element, measured by :func:`calibrate_machine`).

Example::

    net = Network(alpha=5e-5, beta=8e-9)                    # 1 Gbit/s
    mach = calibrate_machine()
    work = Workload(numel=25_000_000, compute_s=0.28, n_buckets=4)
    predict("gtopk", {"density": 0.001}, 4, work, net, mach)["step_s"]
    project([("gtopk", {"density": 0.001}), ("gradient_allreduce", {})], [16, 1024], work, net, mach)
"""
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Network", "Machine", "Workload", "probe_network", "calibrate_machine", "predict", "project", "choose",
           "bytes_per_rank", "label", "normalize_candidates", "PREDICTABLE", "DEFAULT_AUTO_CANDIDATES"]

PREDICTABLE: Tuple[str, ...] = ("ddp", "ddp_fp16", "ddp_powersgd", "gradient_allreduce", "topk", "gtopk",
                                "decentralized", "local_sgd", "auto")

#: auto's default candidates, most exact first (ties within auto's tolerance go to the earlier one)
DEFAULT_AUTO_CANDIDATES = (
    {"name": "gradient_allreduce"},
    {"name": "gradient_allreduce", "options": {"compression": "fp16"}},
    {"name": "gtopk", "options": {"density": 0.001}},
    {"name": "topk", "options": {"density": 0.001}},
    {"name": "local_sgd"},
)

_MINMAX_HEADER = 8  # two float32: min and max (csrc/kernels/compress.cpp)


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


# ---- measuring ------------------------------------------------------------------------------------------------
_PROBED: Dict[tuple, "Network"] = {}  # what probe_network measured in this process, per group


def probe_network(group=None, sizes=(8, 1 << 16, 1 << 22, 1 << 24), repeats=6, reuse=False) -> Network:
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
    """
    import torch
    import torch.distributed as dist

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

    host = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64)
    hosts = [torch.zeros_like(host) for _ in range(P)]
    dist.all_gather(hosts, host, group=group)
    host_local = len({int(h) for h in hosts}) == 1
    fit = torch.zeros(2, dtype=torch.float64)
    partner = me + 1 if me % 2 == 0 else me - 1
    if partner < P:
        first = me % 2 == 0
        peer = dist.get_global_rank(group, partner)
        points = []
        for size in sizes:
            buf = torch.zeros(int(size), dtype=torch.uint8)
            times = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                if first:
                    dist.send(buf, peer, group=group)
                    dist.recv(buf, peer, group=group)
                else:
                    dist.recv(buf, peer, group=group)
                    dist.send(buf, peer, group=group)
                if i:
                    times.append((time.perf_counter() - t0) / 2)
            points.append((float(size), statistics.median(times)))
        if first:
            fit[0], fit[1] = _fit_alpha_beta(points)
    dist.all_reduce(fit, op=dist.ReduceOp.MAX, group=group)
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

    from . import kernels

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
    quant = med(lambda: kernels.decompress(kernels.compress(x, "minmax_uint8"), "minmax_uint8", numel)) / numel
    fp16 = med(lambda: kernels.decompress(kernels.compress(x, "fp16"), "fp16", numel)) / numel
    add = med(lambda: torch.add(x, y, out=z)) / numel
    s = max(1, min(numel // 16, 1 << 16))
    av, ai = kernels.topk(x[: 4 * s].contiguous(), s)
    bv, bi = kernels.topk(y[: 4 * s].contiguous(), s)
    merge = med(lambda: kernels.merge_topk(av, ai, bv, bi, s)) / (2 * s)
    side = max(4, int(math.isqrt(numel)))
    M = x[: side * side].view(side, side) if side * side <= numel else torch.randn(side, side)
    Q = torch.randn(side, 4, generator=g)
    matmul = med(lambda: M @ Q) / (2.0 * side * side * 4)
    return Machine(topk_s_per_elem=topk, quantize_s_per_elem=quant, fp16_s_per_elem=fp16, add_s_per_elem=add,
                   merge_s_per_elem=merge, matmul_s_per_flop=matmul, cores_per_rank=cores_per_rank())


# ---- traffic ---------------------------------------------------------------------------------------------------
def _ring(nbytes: int, P: int) -> int:
    """Bytes one rank sends in a ring allreduce, as csrc/collectives/process_group_ops.cpp counts them."""
    return 2 * (P - 1) * int(nbytes) // P if P > 1 and nbytes > 0 else 0


def _wire(compression: str, n: int) -> int:
    if compression == "fp16":
        return 2 * n
    if compression == "minmax_uint8":
        return _MINMAX_HEADER + n
    raise ValueError(f"cost_model: unknown compression {compression!r}")


def _k(density: float, n: int) -> int:
    return max(1, min(n, int(round(float(density) * n))))


def _core(P: int) -> int:
    c = 1
    while c * 2 <= P:
        c *= 2
    return c


def _powersgd_sizes(options, n):
    r = int(options.get("rank", options.get("matrix_approximation_rank", 4)))
    shapes = options.get("shapes")
    if shapes:
        rows = sum(int(s[0]) for s in shapes)
        cols = sum(int(s[1]) for s in shapes)
    else:
        rows = cols = max(1, int(round(math.sqrt(n))))
    return r, rows * r, cols * r, int(options.get("uncompressed", 0))


def _bucket_comm(name, options, P, n, e, rank):
    """(bytes sent by ``rank``, sequential latency terms, transfer bytes on the critical path) of one
    bucket's collective(s) in one step. For per-step weight exchanges n is all parameters."""
    if P <= 1 or n <= 0:
        return 0, 0, 0
    m = n * e
    if name == "ddp" or (name == "gradient_allreduce" and options.get("compression", "none") == "none"):
        b = _ring(m, P)
        return b, 2 * (P - 1), b
    if name == "ddp_fp16":
        b = _ring(2 * n, P)
        return b, 2 * (P - 1), b
    if name == "ddp_powersgd":
        r, p_elems, q_elems, unc = _powersgd_sizes(options, n)
        parts = [_ring(4 * p_elems, P), _ring(4 * q_elems, P)] + ([_ring(unc * e, P)] if unc else [])
        return sum(parts), 2 * (P - 1) * len(parts), sum(parts)
    if name == "gradient_allreduce":
        c = options["compression"]
        chunk = [n // P + (1 if i < n % P else 0) for i in range(P)]
        total = sum(_wire(c, ci) for ci in chunk)
        per_rank = lambda i: total - _wire(c, chunk[i]) + (P - 1) * _wire(c, chunk[0])  # noqa: E731
        b = per_rank(rank if rank is not None else P - 1)
        return b, 2 * (P - 1), per_rank(P - 1)
    if name == "topk":
        k = _k(options.get("density", 0.001), n)
        b = (P - 1) * 24 + (P - 1) * k * (e + 4)
        return b, 2 * (P - 1), b
    if name == "gtopk":
        k = _k(options.get("density", 0.001), n)
        msg = k * (e + 4)
        core = _core(P)
        L = core.bit_length() - 1
        r = 0 if rank is None else rank
        msgs = (L + (1 if r + core < P else 0)) if r < core else 1
        b = msgs * msg
        lat = L + (2 if P > core else 0)
        crit = lat * msg
        if options.get("exact", False):
            b += _ring(k * e, P)
            lat += 2 * (P - 1)
            crit += _ring(k * e, P)
        return b, lat, crit
    if name == "decentralized":
        mode = options.get("peer_selection", "ring")
        if mode == "all":
            b = _ring(m, P)
            return b, 2 * (P - 1), b
        if mode == "ring" and P >= 3:
            return 2 * m, 1, 2 * m
        return m, 1, m  # ring with P = 2, or shift_one (a busy rank)
    if name == "local_sgd":
        b = _ring(m, P)
        return b, 2 * (P - 1), b
    raise ValueError(f"cost_model: cannot predict {name!r}; predictable: {', '.join(PREDICTABLE)}")


def _check_name(algorithm):
    if algorithm not in PREDICTABLE:
        raise ValueError(f"cost_model: cannot predict {algorithm!r}; predictable: {', '.join(PREDICTABLE)}")


def bytes_per_rank(algorithm: str, options: dict, P: int, bucket_numels: Sequence[int], elem_bytes: int = 4,
                   rank: Optional[int] = None) -> float:
    """Bytes ``rank`` (None: the busiest rank) sends per step, as ``bagua_lite.comm.bytes_sent()`` counts
    them for our algorithms (torch's own traffic for the ddp baselines). Periodic exchanges (local_sgd
    after warm-up, decentralized with an interval) are amortised per step, so may be fractional."""
    _check_name(algorithm)
    options = dict(options or {})
    n_total = sum(int(b) for b in bucket_numels)
    if algorithm in ("decentralized", "local_sgd"):
        b = _bucket_comm(algorithm, options, P, n_total, elem_bytes, rank)[0]
        every = options.get("communication_interval", 1) if algorithm == "decentralized" else options.get("period", 4)
        return b / every
    if algorithm == "ddp_powersgd":
        return float(_bucket_comm(algorithm, options, P, n_total, elem_bytes, rank)[0])
    if algorithm == "auto":
        raise ValueError("cost_model.bytes_per_rank: resolve 'auto' with choose() first")
    return float(sum(_bucket_comm(algorithm, options, P, int(n), elem_bytes, rank)[0] for n in bucket_numels))


# ---- time ------------------------------------------------------------------------------------------------------
def _local_s(name, options, P, n, machine):
    """Local work on one bucket (compression, selection, averaging), seconds."""
    add, topk = machine.add_s_per_elem, machine.topk_s_per_elem
    merge = machine.merge_s_per_elem or 4 * topk
    if name == "ddp":
        return n * add
    if name == "ddp_fp16":
        return n * (machine.fp16_s_per_elem + add)
    if name == "ddp_powersgd":
        r, p_elems, q_elems, _ = _powersgd_sizes(options, n)
        flops = 3 * 2.0 * n * r
        mm = max(flops * machine.matmul_s_per_flop, 3 * n * add)
        return mm + 4 * n * add
    if name == "gradient_allreduce":
        c = options.get("compression", "none")
        if c == "none":
            return n * add if P > 1 else 0.0
        if P == 1:
            return 0.0
        codec = machine.fp16_s_per_elem if c == "fp16" else machine.quantize_s_per_elem
        return n * codec * (3 + 1 / P) / 2
    if name in ("topk", "gtopk"):
        k = _k(options.get("density", 0.001), n)
        mc = n * add if options.get("momentum_correction", 0.0) else 0.0
        base = n * topk + 2 * n * add + mc  # acc += g; dense output zeroed (the average divides k values)
        if name == "topk":
            return base + P * k * add
        core = _core(P)
        rounds = (core.bit_length() - 1) + (1 if P > core else 0)
        return base + rounds * 2 * k * merge + k * add
    raise AssertionError(name)


def _pipeline(engine_s: List[float], numels: List[int], backward_s: float) -> float:
    """Exposed time of buckets run in order on one worker as backward makes them ready."""
    total = sum(numels) or 1
    finish, seen = 0.0, 0
    for e_i, n_i in zip(engine_s, numels):
        seen += n_i
        finish = max(backward_s * seen / total, finish) + e_i
    return max(0.0, finish - backward_s)


def _result(work, compression_s, comm_s, exposed_s, nbytes, **extra):
    hidden = max(0.0, compression_s + comm_s - exposed_s)
    out = {"step_s": work.compute_s + compression_s + comm_s - hidden, "compute_s": work.compute_s,
           "compression_s": compression_s, "comm_s": comm_s, "hidden_s": hidden, "bytes_per_rank": nbytes}
    out.update(extra)
    return out


def predict(algorithm: str, options: dict, P: int, work: Workload, net: Network, machine: Machine) -> dict:
    """Predicted time of one steady-state step of ``algorithm`` with ``options`` on ``P`` ranks.

    Returns ``step_s``, ``compute_s``, ``compression_s`` (local work: compression, selection,
    averaging), ``comm_s`` (network), ``hidden_s`` (the part of compression + comm overlapped with
    backward) and ``bytes_per_rank`` (busiest rank, per step). The formulas are in the module docstring.
    """
    _check_name(algorithm)
    options = dict(options or {})
    P = int(P)
    if P < 1:
        raise ValueError(f"cost_model.predict: P must be >= 1, got {P}")
    e = int(work.elem_bytes)
    numels = work.buckets()
    n_total = sum(numels)
    backward_s = work.backward_fraction * work.compute_s

    if algorithm == "auto":
        cands = normalize_candidates(options.get("candidates", DEFAULT_AUTO_CANDIDATES))
        pick_net = Network(**options["network"]) if options.get("network") else net
        i, _ = choose(cands, P, work, pick_net, machine, tolerance=options.get("tolerance", 0.05))
        name, opts = cands[i]
        out = predict(name, opts, P, work, net, machine)
        out["picked"] = label(name, opts)
        return out

    if algorithm == "ddp_powersgd":  # one bucket, ready at the end of backward: no overlap
        _, lat, crit = _bucket_comm(algorithm, options, P, n_total, e, None)
        comm = lat * net.alpha + crit * net.beta
        local = _local_s(algorithm, options, P, n_total, machine) if P > 1 else 0.0
        return _result(work, local, comm, local + comm, float(_bucket_comm(algorithm, options, P, n_total, e, None)[0]))

    if algorithm in ("decentralized", "local_sgd"):
        every = int(options.get("communication_interval", 1) if algorithm == "decentralized" else options.get("period", 4))
        _, lat, crit = _bucket_comm(algorithm, options, P, n_total, e, None)
        comm = (lat * net.alpha + crit * net.beta) / every
        if algorithm == "decentralized":
            passes = {"ring": 5, "shift_one": 4, "all": 3}[options.get("peer_selection", "ring")]
        else:
            passes = 3
        local = (passes * n_total * machine.add_s_per_elem / every) if P > 1 else 0.0
        extra = {}
        if algorithm == "local_sgd":
            extra["warmup_step_s"] = predict("gradient_allreduce", {}, P, work, net, machine)["step_s"]
        return _result(work, local, comm, local + comm, bytes_per_rank(algorithm, options, P, numels, e), **extra)

    # Bucketed gradient algorithms: ours (engine) and DDP's reducer, overlapped with backward.
    locals_, comms = [], []
    for n in numels:
        _, lat, crit = _bucket_comm(algorithm, options, P, n, e, None)
        comms.append(lat * net.alpha + crit * net.beta)
        locals_.append(_local_s(algorithm, options, P, n, machine))
    if 0 < machine.cores_per_rank < 2 and net.host_local:  # moving bytes is CPU work too: nothing hides
        exposed = sum(locals_) + sum(comms)
    elif 0 < machine.cores_per_rank < 2:  # no spare core: local work adds to the step, waiting still hides
        exposed = sum(locals_) + _pipeline(comms, numels, backward_s)
    else:
        exposed = _pipeline([a + b for a, b in zip(locals_, comms)], numels, backward_s)
    return _result(work, sum(locals_), sum(comms), exposed, bytes_per_rank(algorithm, options, P, numels, e))


# ---- choosing and projecting -------------------------------------------------------------------------------
def label(name: str, options: Optional[dict] = None) -> str:
    """``gtopk(density=0.001)``: the name and the options given (warm-up schedules left out)."""
    opts = {k: v for k, v in sorted((options or {}).items()) if k not in ("warmup_densities",)}
    if not opts:
        return name
    return f"{name}(" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")"


def normalize_candidates(candidates) -> List[Tuple[str, dict]]:
    """Candidates as ``(name, options)`` from names, ``{"name": n, "options": {...}}``,
    ``{"name": n, **options}`` or ``(name, options)`` pairs."""
    out = []
    for c in candidates:
        if isinstance(c, str):
            out.append((c, {}))
        elif isinstance(c, dict):
            if "name" not in c:
                raise ValueError(f"auto: a candidate needs a 'name', got {c!r}")
            if "options" in c:
                extra = set(c) - {"name", "options"}
                if extra or not isinstance(c["options"], dict):
                    raise ValueError(f"auto: candidate {c!r}: give options either under 'options' or inline")
                out.append((c["name"], dict(c["options"])))
            else:
                out.append((c["name"], {k: v for k, v in c.items() if k != "name"}))
        elif isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], dict):
            out.append((c[0], dict(c[1])))
        else:
            raise ValueError(f"auto: cannot read candidate {c!r}; give a name or {{name: ..., options: {{...}}}}")
    if not out:
        raise ValueError("auto: candidates must list at least one algorithm")
    return out


def choose(candidates, P: int, work: Workload, net: Network, machine: Machine,
           tolerance: float = 0.05) -> Tuple[int, List[dict]]:
    """Index of the candidate to run and every candidate's prediction.

    The fastest predicted candidate wins, except that an earlier candidate (the list runs from most
    to least exact) within ``tolerance`` of the fastest step time is preferred. Deterministic: equal
    inputs give the same index on every rank.
    """
    cands = normalize_candidates(candidates)
    preds = [predict(name, opts, P, work, net, machine) for name, opts in cands]
    best = min(p["step_s"] for p in preds)
    for i, p in enumerate(preds):
        if p["step_s"] <= best * (1 + tolerance):
            return i, preds
    raise AssertionError("unreachable")


def project(algorithms: List[Tuple[str, dict]], world_sizes: List[int], work: Workload, net: Network,
            machine: Machine) -> List[dict]:
    """Predicted step time and speed-up over ``ddp`` of each algorithm at each world size.

    One row per (P, algorithm): ``world_size``, ``algorithm`` (its label), ``step_s``,
    ``speedup_vs_ddp``, ``comm_s``, ``bytes_per_rank`` (and ``picked`` for auto).
    """
    rows = []
    for P in world_sizes:
        ddp = predict("ddp", {}, P, work, net, machine)["step_s"]
        for name, opts in algorithms:
            p = predict(name, opts, P, work, net, machine)
            row = {"world_size": int(P), "algorithm": label(name, opts), "step_s": p["step_s"],
                   "speedup_vs_ddp": ddp / p["step_s"] if p["step_s"] > 0 else float("inf"),
                   "comm_s": p["comm_s"], "bytes_per_rank": p["bytes_per_rank"]}
            if "picked" in p:
                row["picked"] = p["picked"]
            rows.append(row)
    return rows
