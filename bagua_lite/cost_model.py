"""The alpha-beta cost model: what one training step costs under each algorithm, and at which P it pays.

A message of ``m`` bytes costs ``alpha + m * beta`` (Hockney; BAGUA and gTop-k S-SGD use the same
model). Each rank has one full-duplex link: it can send and receive at once, but two messages it sends
at the same time share its bandwidth (the benchmark's emulated networks rate-limit each rank's
interface, which is exactly this). Notation, per bucket of ``n`` elements of ``e`` bytes
(``m = n * e``), on ``P`` ranks:

    ring(m)   = floor(2 (P-1) m / P)   bytes a rank sends in a ring allreduce (what comm counts)
    T_ring(m) = 2 (P-1) alpha + ring(m) beta
    k         = max(1, min(n, round(density * n)))          (as ErrorFeedbackSparsifier.k_for)
    wire(c)   = 2c (fp16, bf16) | 8 + c (minmax_uint8: float32 min and max, then c bytes)
                | 4 + ceil(c/8) (sign: float32 mean |x|, then a bit per element)
                | a user's compressor: its wire_bytes(c), padded to 8 bytes (pad(x) = 8 ceil(x/8))
                  wherever its buffers are (the Python path of the compressed allreduce)
    codec     = one compress + decompress round trip per element: Machine.fp16_s_per_elem,
                bf16_s_per_elem, quantize_s_per_elem (minmax_uint8 and users'), sign_s_per_elem
    CA(n)     = the compressed allreduce of n elements (gradient_allreduce's, below): its bytes,
                2 (P-1) alpha + bytes beta, and local n codec (3 + 1/P)/2; with a residual (error
                feedback) + n (codec/2 + 2 add)
    c_i       = n // P + (i < n % P)                         (chunk i of a compressed allreduce)
    P'        = the largest power of two <= P,   L = log2 P'

What travels is each algorithm's own description: its ``traffic`` classmethod returns a :class:`Traffic`
(message triples built from :func:`ring`, :func:`compressed_allreduce`, :func:`weight_average`, and local
work from :class:`Machine`), and this module times it (the overlap, shared cores, rounds: below). A user's
algorithm that describes its traffic is predicted and can be one of auto's candidates. What the built-ins
and the DDP baselines describe, per step (``bytes_per_rank`` = what ``bagua_lite.comm.bytes_sent()`` counts
on the busiest rank, summed over buckets; the latency term counts sequential messages):

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
``gradient_allreduce`` compression none: ring(m), T_ring(m); local: the divide. fp16: as ddp_fp16 (a ring
                       allreduce of the half-precision bucket, pre-scaled by 1/P: ring(2n), T_ring(2n)).
                       Any other compressor (csrc/collectives/compressed_allreduce.cpp): all-to-all
                       of compressed chunks, rank i sends sum_{j != i} wire(c_j); then allgather
                       of its recompressed chunk padded to wire(c_0): (P-1) wire(c_0). Busiest rank:
                       the one with the smallest chunk (rank P-1). Time: (P-1) alpha for the
                       all-to-all (the P-1 sends serialise on the sender's link) + (P-1) alpha for
                       the ring allgather + bytes * beta. Local: compress n (1 + 1/P) and
                       decompress 2n elements: (3 + 1/P)/2 codec round trips per element; sign
                       (error feedback) adds its residual: + n (codec/2 + 2 add). This is CA(n).
                       ``hierarchical``: treated as dense (flat ring) — a model gap, stated here.
``topk``               TopKAllReduce (csrc/collectives/sparse_allreduce.cpp): k is the same on every
                       rank, so one allgather of [k, dtype as 2 int64][k values][k int32] (no size
                       exchange first): (P-1) (16 + k (e + 4)) bytes, (P-1) alpha. Local: topk
                       select (n * topk; n * topk_bounded where the selection has block maxima,
                       density <= 1/256 and not layerwise) + error-feedback add and zero of the dense output
                       (2 n * add) + scatter of the P k pre-divided pairs (P k * add).
``gtopk``              recursive doubling (csrc/collectives/gtopk_allreduce.cpp), message k (e + 4):
                       L swaps (send and receive at once: alpha + k (e + 4) beta each); if P != P',
                       one fold before and one unfold after, sequential: + 2 (alpha + k (e + 4) beta).
                       Busiest rank: rank 0, L + [P != P'] messages. ``exact``: + T_ring(k e) and
                       ring(k e) bytes. Local: topk + 2 n * add as for topk, plus a merge of 2k
                       pairs per message (2k * merge each) and the scatter of k pairs.
``powersgd``           ours (algorithms/powersgd.py), per bucket on the engine, steady state (after
                       ``warmup_steps``; ``warmup_step_s`` = gradient_allreduce's step). A bucket's
                       matrices (rows_j x cols_j, compressed when rows cols >= min_compression_rate
                       (rows + cols) r) and its dense rest d: allreduce of the P's, then of
                       [Q's | dense]: ring(e r sum rows) + ring(e (r sum cols + d)) bytes, one
                       T_ring per allreduce made. Shapes from the cost-model-only option
                       ``bucket_shapes`` (per bucket, its parameters' shapes); without it one
                       matrix per bucket, rows = round(sqrt n) as ddp_powersgd, cols = n // rows,
                       the rest dense. Local per matrix of N elements: N add (error feedback) +
                       4 max(2 N r flops, N add) (M Q, M^T P, M - P Q^T, P Q^T) + 2 rows r^2
                       flops (QR); dense: 3 d + r sum cols passes. Overlapped like the buckets.
``qadam``              steady state (after ``warmup_steps``; ``warmup_step_s`` = gradient_allreduce's
                       step): each bucket's momentum through CA(n) with ``compression`` (default
                       fp16, as algorithms/qadam.py) and a residual: bytes and time exactly
                       gradient_allreduce's with that compression plus the residual's work, on the
                       engine (overlapped); plus 3 n add for the momentum (gradient hook) and the
                       update (step pre-hook) on the training thread, never hidden.
``decentralized``      a weight exchange every ``communication_interval`` steps (amortised: divided
                       by it), on the flat weights (m = all parameters): started when forward starts,
                       applied after the optimizer step. Unit u = m, or with ``compression``
                       pad(wire(n)) (decentralized pads its wire buffers). ring: P >= 3 sends u to
                       both neighbours at once on one link: alpha + 2 u beta, 2u bytes; P = 2, and
                       ring_one_way and shift_one always, one peer: alpha + u beta, u bytes (odd P
                       under shift_one: one rank sits each exchange out; the model reports the busy
                       ones). all: exact T_ring(m), ring(m); compressed: a ring allgather,
                       (P-1) alpha + (P-1) u beta, (P-1) u bytes. Local, exact (training thread,
                       never hidden): gather, sum of the k peers' (k-1), subtract, apply: k + 2
                       passes (all: 4). Compressed, with d = peers received from (ring 2, or 1 at
                       P = 2; ring_one_way 1; all P-1): the exchange's thread does 2 add passes +
                       (d + 2)/2 codec round trips (compress + d + 1 decompressions), the training
                       thread 1 (the apply), and the wire starts after the first chunk (2^20
                       elements: 1 add + half a codec round trip each) is packed. The transfer
                       overlaps with the whole step: exposed = max(0, first + T - busy), busy =
                       compute_s (+ the thread's work when Machine.cores_per_rank < 2: it is taken
                       from the compute); with cores_per_rank < 2 each message's latency is protocol
                       work on the computing cores, one alpha per peer sent to (ring: 2), never hidden,
                       and on a host_local network the bytes are copies on those cores too:
                       exposed = peers alpha (+ the rest of T, hidden as above; host_local: all of it).
                       (Measured at P = 4 on 2 cores, 17k parameters: the ring's exchange added 1.6-2 ms
                       a step, where one hidden alpha predicted none.)
``low_precision_decentralized``
                       decentralized with compression minmax_uint8 (and peer_selection ring) by
                       default; compression none is an error, as in the algorithm.
``local_sgd``          steady state: T_ring(m) of the weights every ``period`` steps, after the
                       step (not overlapped): (T_ring(m) + 3 n * add) / period per step, ring(m) /
                       period bytes. With ``compression``: CA(n) of the change since the last
                       average, with a residual, instead of T_ring(m), and 5 passes (snapshot,
                       x - anchor, + anchor, anchor copy, apply) plus CA's instead of 3. Warm-up steps
                       cost what gradient_allreduce costs; that figure is returned as
                       ``warmup_step_s``.
``async_model_average`` steady state: a background round every I = sync_interval_ms / 1000 s plus
                       its own length: T_a = the average's transfer (T_ring(m), or CA(n) with
                       ``compression``) + 2 (P-1) alpha (the go-on flag), local L_a = 4 passes
                       (snapshot, copy, apply as x + avg - snapshot: 2), compressed 6 + CA's;
                       period = I + T_a + L_a. The training thread never waits: with
                       Machine.cores_per_rank < 2 the round's CPU, c = L_a (+ T_a on a host_local
                       network), is stolen from it, so step = compute_s / (1 - c / period);
                       otherwise step = compute_s. Bytes per step: the average's bytes (ring(m) or
                       CA's) times step / period (``rounds_per_step``; ``bytes_per_round`` too;
                       ``bytes_per_rank()`` refuses it: it needs the step time). ``warmup_step_s``:
                       gradient_allreduce's step.
``auto``               whatever :func:`choose` picks from the options' ``candidates`` (with their
                       ``network`` override and ``efficiency`` if any, as the algorithm does);
                       predicted under ``net``.
=====================  ==========================================================================

Options not given take the registered algorithm's defaults (read from its signature); an
unknown algorithm, compression or peer_selection, and combinations the algorithms refuse (compression
with shift_one, low_precision_decentralized or qadam without compression), raise ValueError. On P = 1
nothing is sent; the after-step averaging algorithms are taken as doing no local work either.

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
``Machine.round_s`` is the fixed cost of one of our synchronous rounds beyond the network's alpha: the
agreement all_gather after the buckets, the engine's hand-offs and, on shared cores, waiting for the
peers to be scheduled. Every bucketed algorithm of ours pays it each step (DDP's reducer does not: its
baselines leave it out), local SGD at each average (round_s / period) and decentralized at each exchange
(round_s / communication_interval); async averaging's rounds are off the training thread. It is 0 unless
measured: auto takes it from its probe, the mean wait of the small all_gather it runs between local probe
steps (what our rounds add to their data collective: the agreement, local SGD's step check). On loopback
it measured 0.6-0.8 ms with 2 processes on 2 cores and 5.5-10 ms with 4.

Time to accuracy: a cheap step is worth nothing if the model needs more of them. :func:`choose` ranks
candidates by ``step_s * efficiency``, where ``efficiency`` is the candidate's steps to a target accuracy
over dense SGD's (1.0 for exact dense algorithms; < 1 reaches it in fewer steps). That product is the
predicted time to accuracy in units of dense SGD's steps to target. Efficiencies come from the caller
(a mapping label-or-name -> ratio, e.g. :func:`efficiencies_from_results` of the benchmark's convergence
``results.json``), else from ``DEFAULT_EFFICIENCY`` (measured on scikit-learn digits, see there), else 1.0.

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
           "bytes_per_rank", "label", "normalize_candidates", "efficiency_of", "check_efficiency",
           "efficiencies_from_results", "PREDICTABLE", "DEFAULT_AUTO_CANDIDATES", "DEFAULT_EFFICIENCY"]

PREDICTABLE: Tuple[str, ...] = ("ddp", "ddp_fp16", "ddp_powersgd", "gradient_allreduce", "topk", "gtopk",
                                "powersgd", "qadam", "decentralized", "low_precision_decentralized", "local_sgd", "diloco",
                                "async_model_average", "auto")

#: auto's default candidates, most exact first (ties within auto's tolerance go to the earlier one)
DEFAULT_AUTO_CANDIDATES = (
    {"name": "gradient_allreduce"},
    {"name": "gradient_allreduce", "options": {"compression": "fp16"}},
    {"name": "gtopk", "options": {"density": 0.001}},
    {"name": "topk", "options": {"density": 0.001}},
    {"name": "local_sgd"},
)

#: Steps to 0.95 held-out accuracy measured by the benchmark's convergence mode (configs/
#: benchmark_convergence.yaml as of issue 11, before its auto cells: the demo's MLP on scikit-learn digits,
#: P = 4, SGD momentum 0.9, constant lr 0.05, batch 16 per rank, evaluated every 11 steps, budget 330
#: steps; the same steps on loopback and at 1 Gbit/s). DDP, DDP + fp16 and gradient_allreduce: 154.
#: topk and gtopk at density 0.01 with their default momentum correction (the optimizer's momentum applied
#: before the selection); without it neither reached the target in the budget. None: never reached it.
DIGITS_STEPS_TO_TARGET: Dict[str, Optional[int]] = {
    "gradient_allreduce": 154, "local_sgd": 132, "decentralized": 165, "topk": 187, "gtopk": 264}
DIGITS_BUDGET = 330

#: Statistical efficiency (steps to the target over dense SGD's) when the caller gives none, from
#: ``DIGITS_STEPS_TO_TARGET``: ratio = steps / 154; one that never reached the target gets the penalty
#: budget / dense = 330 / 154 (a lower bound on its true ratio). A built-in default is never below 1.0:
#: local SGD's 132 steps (0.86) is one run of one small model, and no relaxation is assumed to need fewer
#: steps than the exact algorithm it relaxes (with it, auto would leave dense SGD on a compute-bound job,
#: where nothing is to be saved). Give ``efficiency`` (or your own convergence results) to auto for other
#: models and recipes. Keys are labels (name and options, as :func:`label` writes them) or names; a
#: label wins over its name. Not listed (powersgd, qadam, the other compressors, ...): 1.0, "assumed".
DEFAULT_EFFICIENCY: Dict[str, float] = {
    name: max(1.0, (steps or DIGITS_BUDGET) / DIGITS_STEPS_TO_TARGET["gradient_allreduce"])
    for name, steps in DIGITS_STEPS_TO_TARGET.items()}
DEFAULT_EFFICIENCY["gradient_allreduce(compression=fp16)"] = 1.0  # DDP + fp16_compress_hook: 154 steps too

_MINMAX_HEADER = 8  # two float32: min and max (csrc/kernels/compress.cpp)
_SIGN_HEADER = 4    # one float32: the mean |x|

#: the built-in compressors' wire sizes (bagua_lite/compressors.py); all run natively (no padding)
_BUILTIN_WIRE = {
    "fp16": lambda n: 2 * n,
    "bf16": lambda n: 2 * n,
    "minmax_uint8": lambda n: _MINMAX_HEADER + n,
    "sign": lambda n: _SIGN_HEADER + (n + 7) // 8,
}
_BUILTIN_FEEDBACK = ("sign",)  # compressors that ask for error-feedback memory


def _defaults(name) -> dict:
    """The registered algorithm's option defaults, read from its signature (none for the DDP baselines)."""
    import inspect

    from . import algorithms  # noqa: F401  (registers the built-ins)
    from .algorithm import _REGISTRY

    cls = _REGISTRY.get(name)
    if cls is None:
        return {}
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if k != "self" and p.default is not inspect.Parameter.empty}


_PEER_SELECTIONS = ("ring", "ring_one_way", "shift_one", "all")
_QADAM_EXTRA_PASSES = 3  # momentum (in the gradient hook) and the update (step pre-hook), per element


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
    #                                   selection at density <= 1/256; 0: taken as topk's)


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


# ---- traffic ---------------------------------------------------------------------------------------------------
def ring_bytes(nbytes: int, P: int) -> int:
    """Bytes one rank sends in a ring allreduce, as csrc/collectives/process_group_ops.cpp counts them."""
    return 2 * (P - 1) * int(nbytes) // P if P > 1 and nbytes > 0 else 0


def aligned(nbytes: int) -> int:
    """Rounded up to 8 bytes, as wire buffers handed to Python compressors and decentralized's are."""
    return (int(nbytes) + 7) // 8 * 8


def compressor_info(compression):
    """(wire_bytes(n), native, error_feedback) of a compression: a built-in by its formula, anything else
    looked up in :mod:`bagua_lite.compressors` (a user's registered compressor); ValueError when unknown."""
    if isinstance(compression, str) and compression in _BUILTIN_WIRE:
        return _BUILTIN_WIRE[compression], True, compression in _BUILTIN_FEEDBACK
    if compression is None or compression == "none":
        raise ValueError("cost_model: compression 'none' has no wire format")
    from . import compressors  # a user's compressor: only the registry knows its wire size

    comp = compressors.get_compressor(compression, "cost_model")  # ValueError naming the known ones
    return comp.wire_bytes, bool(comp.native), bool(comp.error_feedback)


def wire_bytes(compression, n: int) -> int:
    """Bytes of ``n`` elements compressed with ``compression``."""
    return int(compressor_info(compression)[0](int(n)))


def codec_s(compression, machine) -> float:
    """One compress + decompress round trip, seconds per element (a user's compressor: as minmax_uint8)."""
    if compression == "fp16":
        return machine.fp16_s_per_elem
    if compression == "bf16":
        return machine.bf16_s_per_elem or machine.fp16_s_per_elem
    if compression == "sign":
        return machine.sign_s_per_elem or machine.quantize_s_per_elem
    return machine.quantize_s_per_elem


def k_of(density: float, n: int) -> int:
    return max(1, min(n, int(round(float(density) * n))))


def pow2_core(P: int) -> int:
    c = 1
    while c * 2 <= P:
        c *= 2
    return c


def side(n: int) -> int:
    """The side of the square matrix a bucket of n elements is taken as when no shapes are given."""
    return max(1, int(round(math.sqrt(n))))


def _powersgd_sizes(options, n):
    r = int(options.get("rank", options.get("matrix_approximation_rank", 4)))
    shapes = options.get("shapes")
    if shapes:
        rows = sum(int(s[0]) for s in shapes)
        cols = sum(int(s[1]) for s in shapes)
    else:
        rows = cols = side(n)
    return r, rows * r, cols * r, int(options.get("uncompressed", 0))


def ring(nbytes: int, P: int) -> Tuple[int, int, int]:
    """(bytes a rank sends, sequential latency terms, critical-path bytes) of a ring allreduce of
    ``nbytes``: ring(m) bytes, T_ring(m)."""
    if P <= 1 or nbytes <= 0:
        return 0, 0, 0
    b = ring_bytes(nbytes, P)
    return b, 2 * (P - 1), b


def compressed_allreduce(compression, P, n, rank):
    """(bytes ``rank`` sends (None: the busiest), sequential latency terms, critical-path bytes) of
    comm.compressed_allreduce of n elements: the all-to-all of compressed chunks, then the allgather of
    the reduced chunks padded to chunk 0's wire. A Python compressor's buffers are padded to 8 bytes."""
    if P <= 1 or n <= 0:
        return 0, 0, 0
    wire, native, _ = compressor_info(compression)
    size = (lambda c: int(wire(c))) if native else (lambda c: aligned(wire(c)))  # noqa: E731
    sizes = [size(n // P + (1 if i < n % P else 0)) for i in range(P)]
    total = sum(sizes)
    per_rank = [total - sizes[i] + (P - 1) * sizes[0] for i in range(P)]
    busiest = max(per_rank)
    return (busiest if rank is None else per_rank[rank]), 2 * (P - 1), busiest


def compressed_allreduce_s(compression, P, n, machine, residual):
    """Local work of one compressed allreduce of n elements: compress n (1 + 1/P), decompress 2n; with a
    residual (error feedback) also add it, decompress what was sent and subtract: + n/2 round trips and
    2 passes."""
    if P <= 1:
        return 0.0
    codec = codec_s(compression, machine)
    t = n * codec * (3 + 1 / P) / 2
    if residual:
        t += n * (codec / 2 + 2 * machine.add_s_per_elem)
    return t


def weight_average(compression, P, n, e, rank):
    """One weight average (bagua_lite.averaging): a ring allreduce of the weights, or the compressed
    allreduce of their change since the last average."""
    if compression == "none":
        b = ring_bytes(n * e, P)
        return b, 2 * (P - 1), b
    return compressed_allreduce(compression, P, n, rank)


def weight_average_s(compression, P, n, machine, apply_passes):
    """Local work of one weight average: snapshot, copy into the work buffer, apply (local_sgd: 1 pass,
    async: 2). Compressed: snapshot, x - anchor, + anchor, anchor copy, apply, and the compressed allreduce
    with its residual."""
    if P <= 1:
        return 0.0
    add = machine.add_s_per_elem
    if compression == "none":
        return (2 + apply_passes) * n * add
    return (4 + apply_passes) * n * add + compressed_allreduce_s(compression, P, n, machine, True)


@dataclass
class Traffic:
    """What an algorithm moves in one steady-state step and the local work around it, as the algorithm
    describes it (``Algorithm.traffic``); the cost model turns it into time with its network and machine
    formulas. A triple ``(bytes sent, sequential latency terms, critical-path bytes)`` describes one
    message pattern (see :func:`ring`, :func:`compressed_allreduce`, :func:`weight_average`).

    ``when``:
      ``buckets``          every step, bucket by bucket as backward makes them ready (pipelined on the
                           engine behind backward: the overlap formula in the module docstring);
      ``end_of_backward``  every step, one message once backward is over (nothing overlapped);
      ``with_step``        an exchange every ``every`` steps, started when forward starts and waited for
                           after the optimizer step (overlapped with the whole step);
      ``after_step``       an exchange every ``every`` steps after the optimizer step (not overlapped);
      ``background``       a thread's exchange every ``interval_s`` plus its own length (never waited for).
    """
    when: str
    buckets: Sequence[Tuple[float, int, float]] = ()  # buckets/end_of_backward: per bucket
    bucket_local_s: Sequence[float] = ()              # ... its local work on the engine
    serial_s: float = 0.0     # per step, on the training thread, never hidden
    exchange: Tuple[float, int, float] = (0, 0, 0)    # with_step / after_step / background: one exchange
    local_s: float = 0.0      # the exchange's work on the training thread
    thread_s: float = 0.0     # with_step: its work on its own thread
    first_s: float = 0.0      # with_step: its work before its wire starts
    every: int = 1            # steps per exchange
    messages: int = 0         # with_step: messages whose latency is protocol work on shared cores
    interval_s: float = 0.0   # background: the pause between rounds
    extra_latencies: int = 0  # background: small collectives per round beside the data
    rounds: bool = True       # pays Machine.round_s: one of our synchronous rounds (not torch DDP's reducer)
    warmup: bool = False      # starts with dense steps: the prediction adds ``warmup_step_s``

    def bytes_per_step(self) -> float:
        if self.when in ("buckets", "end_of_backward"):
            return float(sum(b[0] for b in self.buckets))
        return self.exchange[0] / self.every


def per_bucket(numels, P, comm, local=None, machine=None) -> Tuple[list, list]:
    """(message triples, local seconds) of ``comm(n, i)`` and ``local(n, i)`` over the buckets: no message
    on P = 1 or for an empty bucket; no local time without a ``machine`` (bytes only)."""
    comms = [(0, 0, 0) if P <= 1 or n <= 0 else comm(int(n), i) for i, n in enumerate(numels)]
    locals_ = [local(int(n), i) if local is not None and machine is not None else 0.0 for i, n in enumerate(numels)]
    return comms, locals_


# ---- the DDP baselines (torch's DDP with its comm hooks: not ours, so described here) -----------------------
def _ddp(options, P, numels, e, machine, rank):
    comms, locals_ = per_bucket(numels, P, lambda n, i: ring(n * e, P), lambda n, i: n * machine.add_s_per_elem,
                                machine)
    return Traffic("buckets", comms, locals_, rounds=False)


def _ddp_fp16(options, P, numels, e, machine, rank):
    comms, locals_ = per_bucket(numels, P, lambda n, i: ring(2 * n, P),
                                lambda n, i: n * (machine.fp16_s_per_elem + machine.add_s_per_elem), machine)
    return Traffic("buckets", comms, locals_, rounds=False)


def _ddp_powersgd(options, P, numels, e, machine, rank):
    """One bucket, ready at the end of backward: no overlap."""
    n = sum(int(x) for x in numels)
    r, p_elems, q_elems, unc = _powersgd_sizes(options, n)
    parts = [ring(4 * p_elems, P), ring(4 * q_elems, P)] + ([ring(unc * e, P)] if unc else [])
    comm = (sum(x[0] for x in parts), sum(x[1] for x in parts), sum(x[2] for x in parts)) if P > 1 and n > 0 \
        else (0, 0, 0)
    local = 0.0
    if machine is not None and P > 1:
        add = machine.add_s_per_elem
        local = max(3 * 2.0 * n * r * machine.matmul_s_per_flop, 3 * n * add) + 4 * n * add
    return Traffic("end_of_backward", [comm], [local])


_BASELINES = {"ddp": _ddp, "ddp_fp16": _ddp_fp16, "ddp_powersgd": _ddp_powersgd}


# ---- from an algorithm to its traffic ------------------------------------------------------------------------
def _algorithm_class(name):
    from . import algorithms  # noqa: F401  (registers the built-ins)
    from .algorithm import Algorithm, _REGISTRY

    cls = _REGISTRY.get(name)
    if cls is None or getattr(cls.traffic, "__func__", None) is Algorithm.traffic.__func__:
        return None
    return cls


def predictable(name: str) -> bool:
    """Whether the cost model can predict ``name``: a DDP baseline, auto, or a registered algorithm that
    describes its traffic (``Algorithm.traffic``)."""
    return name in _BASELINES or name == "auto" or _algorithm_class(name) is not None


def _check_name(algorithm):
    if not isinstance(algorithm, str) or not predictable(algorithm):
        raise ValueError(f"cost_model: cannot predict {algorithm!r}: it is neither a DDP baseline nor a registered "
                         f"algorithm that describes its traffic (Algorithm.traffic); predictable: "
                         f"{', '.join(PREDICTABLE)}")


def _options(name, options):
    """The options with the algorithm's defaults filled in, checked by the algorithm itself (its
    constructor: the same errors as building it); options it does not take (the cost-model-only
    ``bucket_shapes``) are passed through."""
    defaults = _defaults(name)
    cls = _algorithm_class(name)
    if cls is not None:
        cls(**{k: v for k, v in options.items() if k in defaults})
    return {**defaults, **options}


def traffic_of(algorithm: str, options: dict, P: int, bucket_numels: Sequence[int], elem_bytes: int = 4,
               machine: Optional["Machine"] = None, rank: Optional[int] = None) -> Traffic:
    """The :class:`Traffic` of ``algorithm`` with ``options`` (defaults filled in) on ``P`` ranks."""
    _check_name(algorithm)
    options = dict(options or {})
    numels = [int(n) for n in bucket_numels]
    if algorithm in _BASELINES:
        return _BASELINES[algorithm](options, P, numels, elem_bytes, machine, rank)
    return _algorithm_class(algorithm).traffic(_options(algorithm, options), P, numels, elem_bytes, machine, rank)


def bytes_per_rank(algorithm: str, options: dict, P: int, bucket_numels: Sequence[int], elem_bytes: int = 4,
                   rank: Optional[int] = None) -> float:
    """Bytes ``rank`` (None: the busiest rank) sends per step, as ``bagua_lite.comm.bytes_sent()`` counts
    them for our algorithms (torch's own traffic for the ddp baselines). Periodic exchanges (local_sgd
    after warm-up, decentralized with an interval) are amortised per step, so may be fractional. A
    background exchange's bytes per step depend on the step time: take them from :func:`predict`."""
    _check_name(algorithm)
    if algorithm == "auto":
        raise ValueError("cost_model.bytes_per_rank: resolve 'auto' with choose() first")
    t = traffic_of(algorithm, options, P, bucket_numels, elem_bytes, None, rank)
    if t.when == "background":
        raise ValueError(f"cost_model.bytes_per_rank: {algorithm}'s bytes per step depend on the step time "
                         f"(its exchange runs in the background); take predict(...)['bytes_per_rank'] (or its "
                         f"'bytes_per_round')")
    return t.bytes_per_step()


# ---- time ------------------------------------------------------------------------------------------------------
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
    compute) and ``bytes_per_rank`` (busiest rank, per step); algorithms with a warm-up add
    ``warmup_step_s``, background ones ``rounds_per_step`` and ``bytes_per_round``. What travels is the
    algorithm's own description (:class:`Traffic`); the formulas that time it are in the module docstring.
    """
    _check_name(algorithm)
    options = dict(options or {})
    P = int(P)
    if P < 1:
        raise ValueError(f"cost_model.predict: P must be >= 1, got {P}")
    if algorithm == "auto":
        cands = normalize_candidates(options.get("candidates", DEFAULT_AUTO_CANDIDATES))
        pick_net = Network(**options["network"]) if options.get("network") else net
        i, picks = choose(cands, P, work, pick_net, machine, tolerance=options.get("tolerance", 0.05),
                          efficiency=check_efficiency(options.get("efficiency"), cands))
        name, opts = cands[i]
        out = predict(name, opts, P, work, net, machine)
        out["picked"] = label(name, opts)
        out["efficiency"] = picks[i]["efficiency"]
        out["weighted_s"] = out["step_s"] * out["efficiency"]
        return out
    numels = work.buckets()
    t = traffic_of(algorithm, options, P, numels, int(work.elem_bytes), machine)
    extra = {"warmup_step_s": predict("gradient_allreduce", {}, P, work, net, machine)["step_s"]} if t.warmup else {}
    return _time(t, P, work, numels, net, machine, extra)


def _time(t: Traffic, P, work, numels, net, machine, extra):
    backward_s = work.backward_fraction * work.compute_s
    shared = 0 < machine.cores_per_rank < 2  # ranks share cores: CPU work cannot hide behind compute
    round_s = machine.round_s if P > 1 and t.rounds else 0.0  # one of our synchronous rounds
    if t.when == "end_of_backward":
        _, lat, crit = t.buckets[0]
        comm, local = lat * net.alpha + crit * net.beta, float(t.bucket_local_s[0])
        return _result(work, local, comm, local + comm, t.bytes_per_step(), **extra)
    if t.when == "buckets":  # ours on the engine, or DDP's reducer: overlapped with backward
        comms = [lat * net.alpha + crit * net.beta for _, lat, crit in t.buckets]
        locals_ = list(t.bucket_local_s)
        if shared and net.host_local:  # moving bytes is CPU work too: nothing hides
            exposed = sum(locals_) + sum(comms)
        elif shared:  # no spare core: local work adds to the step, waiting still hides
            exposed = sum(locals_) + _pipeline(comms, numels, backward_s)
        else:
            exposed = _pipeline([a + b for a, b in zip(locals_, comms)], numels, backward_s)
        return _result(work, sum(locals_) + t.serial_s, sum(comms) + round_s, exposed + t.serial_s + round_s,
                       t.bytes_per_step(), **extra)
    b, lat, crit = t.exchange
    every = t.every
    if t.when == "with_step":  # started when forward starts, waited for after the optimizer step
        if shared and P > 1 and t.messages:  # the messages' protocol work runs one after another
            lat = max(lat, t.messages)
        transfer = lat * net.alpha + crit * net.beta
        main, thread, first = t.local_s, t.thread_s, t.first_s
        # the transfer (and the exchange's thread) runs during forward + backward + step; with shared cores
        # the thread's work is taken from the compute, each message's latency is protocol work on those
        # cores, and on one host (host_local) the bytes are copies on them too: none of it hides
        busy = work.compute_s + (thread if shared else 0.0)
        if shared:
            rest = crit * net.beta
            exposed = lat * net.alpha + (rest if net.host_local else max(0.0, first + rest - busy))
        else:
            exposed = max(0.0, first + transfer - busy)
        transfer += round_s  # the exchange's wait is a round every rank makes
        exposed += round_s
        return _result(work, (main + thread) / every, transfer / every,
                       (main + (thread if shared else 0.0) + exposed) / every, t.bytes_per_step(), **extra)
    if t.when == "after_step":  # after the step, every `every` steps, nothing overlapped
        comm = (lat * net.alpha + crit * net.beta + round_s) / every
        local = t.local_s / every
        return _result(work, local, comm, local + comm, t.bytes_per_step(), **extra)
    if t.when == "background":  # a thread of its own, every interval_s; never waited for
        transfer = lat * net.alpha + crit * net.beta + t.extra_latencies * net.alpha
        local = t.local_s
        period = t.interval_s + transfer + local  # one round: the pause, then the exchange
        stolen = (local + (transfer if net.host_local else 0.0)) if shared else 0.0  # CPU per round
        step = work.compute_s / (1.0 - stolen / period)  # step = compute + stolen * step / period
        rounds = step / period
        return _result(work, local * rounds, transfer * rounds, stolen * rounds, b * rounds,
                       rounds_per_step=rounds, bytes_per_round=float(b), **extra)
    raise ValueError(f"cost_model: Traffic.when must be one of buckets, end_of_backward, with_step, after_step, "
                     f"background; got {t.when!r}")


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


def _key(text: str) -> str:
    return text.replace(" ", "")


def check_efficiency(efficiency, candidates=None, who="auto") -> Dict[str, float]:
    """``efficiency`` as a dict label-or-name -> ratio, or ValueError naming the bad key and what is
    allowed: keys are strings (with ``candidates``, one of their labels or names), ratios finite numbers
    > 0 (steps to target over dense SGD's)."""
    if efficiency is None:
        return {}
    if not isinstance(efficiency, dict):
        raise ValueError(f"{who}: efficiency must be a mapping of algorithm label or name to a ratio "
                         f"(steps to target / dense SGD's steps), got {efficiency!r}")
    allowed = None
    if candidates is not None:
        cands = normalize_candidates(candidates)
        allowed = list(dict.fromkeys([label(n, o) for n, o in cands] + [n for n, _ in cands]))
    out = {}
    for k, v in efficiency.items():
        if not isinstance(k, str):
            raise ValueError(f"{who}: efficiency key {k!r} must be an algorithm label or name (a string)")
        if allowed is not None and _key(k) not in {_key(a) for a in allowed}:
            raise ValueError(f"{who}: efficiency key {k!r} names no candidate; allowed: {', '.join(allowed)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{who}: efficiency[{k!r}] must be a finite number > 0 (steps to target over "
                             f"dense SGD's; 1.0 = as dense), got {v!r}")
        out[_key(k)] = float(v)
    return out


def efficiency_of(name: str, options: Optional[dict] = None, efficiency: Optional[dict] = None) -> Tuple[float, str]:
    """``(ratio, source)`` of one candidate: the caller's ``efficiency`` (label, then name), then
    ``DEFAULT_EFFICIENCY`` (label, then name; source ``"digits"``), else ``(1.0, "assumed")``."""
    given = {_key(k): v for k, v in (efficiency or {}).items()}
    defaults = {_key(k): v for k, v in DEFAULT_EFFICIENCY.items()}
    lab = _key(label(name, options))
    for table, source in ((given, "given"), (defaults, "digits")):
        for k in (lab, name):
            if k in table:
                return float(table[k]), source
    return 1.0, "assumed"


def efficiencies_from_results(results, model: Optional[str] = None, world_size: Optional[int] = None,
                              network: Optional[str] = None, dense=("ddp", "gradient_allreduce")) -> Dict[str, float]:
    """Efficiencies from the benchmark's convergence results (``results.json``: a path, its parsed dict,
    or its ``rows``), keyed by the rows' labels (``algorithm``), and by name where a name has one label.

    Per (network, P, model, seed) cell (restricted to ``model``, ``world_size``, ``network`` when given), the
    reference is the first row of a ``dense`` algorithm (``ddp``, or ``gradient_allreduce`` with no
    compression) that reached the target: ratio = steps_to_target / its steps_to_target. A row that never
    reached the target gets the penalty ``steps_run / dense steps`` (its budget over dense's steps: a lower
    bound on its true ratio). Over several cells a label gets the median ratio. ``auto`` rows are skipped.
    Raises ValueError when no cell has a dense row that reached the target.
    """
    import json

    if isinstance(results, str):
        with open(results) as f:
            results = json.load(f)
    rows = results.get("rows", results) if isinstance(results, dict) else results
    if isinstance(results, dict) and results.get("mode", "convergence") != "convergence":
        raise ValueError(f"efficiencies_from_results: expected convergence results, got mode {results.get('mode')!r}")
    cells = {}
    for r in rows:
        if "steps_to_target" not in r:
            raise ValueError("efficiencies_from_results: a row has no steps_to_target: not convergence results")
        if (model is not None and r["model"] != model) or (world_size is not None and r["world_size"] != world_size) \
                or (network is not None and r["network"] != network) or r.get("name") == "auto":
            continue
        cells.setdefault((r["network"], r["world_size"], r["model"], r.get("seed", 0)), []).append(r)
    ratios, names = {}, {}
    for rs in cells.values():
        ref = next((r for r in rs if r.get("name") in dense and r["steps_to_target"]
                    and (r.get("options") or {}).get("compression", "none") == "none"), None)
        if ref is None:
            continue
        for r in rs:
            steps = r["steps_to_target"] if r["steps_to_target"] is not None else r["steps_run"]
            ratios.setdefault(_key(r["algorithm"]), []).append(steps / ref["steps_to_target"])
            names.setdefault(r.get("name", r["algorithm"]), set()).add(_key(r["algorithm"]))
    if not ratios:
        raise ValueError("efficiencies_from_results: no cell with a dense row (" + ", ".join(dense)
                         + ") that reached the target" + (f" for model={model}" if model else "")
                         + (f" P={world_size}" if world_size else "") + (f" network={network}" if network else ""))
    out = {k: statistics.median(v) for k, v in ratios.items()}
    for name, labels in names.items():
        if len(labels) == 1 and name not in out:
            out[name] = out[next(iter(labels))]
    return out


def choose(candidates, P: int, work: Workload, net: Network, machine: Machine,
           tolerance: float = 0.05, efficiency: Optional[dict] = None) -> Tuple[int, List[dict]]:
    """Index of the candidate to run and every candidate's prediction, ranked by time to accuracy.

    Each prediction gains ``efficiency`` (steps to target over dense SGD's, from :func:`efficiency_of`
    with the caller's ``efficiency`` mapping), ``efficiency_source`` and ``weighted_s`` = ``step_s *
    efficiency``, the predicted time to accuracy in units of dense SGD's steps to target. The smallest
    ``weighted_s`` wins, except that an earlier candidate (the list runs from most to least exact) within
    ``tolerance`` of it is preferred. Deterministic: equal inputs give the same index on every rank.
    """
    cands = normalize_candidates(candidates)
    preds = [predict(name, opts, P, work, net, machine) for name, opts in cands]
    for (name, opts), p in zip(cands, preds):
        p["efficiency"], p["efficiency_source"] = efficiency_of(name, opts, efficiency)
        p["weighted_s"] = p["step_s"] * p["efficiency"]
    best = min(p["weighted_s"] for p in preds)
    for i, p in enumerate(preds):
        if p["weighted_s"] <= best * (1 + tolerance):
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
