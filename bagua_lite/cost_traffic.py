"""The cost model's message and work formulas: bytes on the wire per compressor, the ring and compressed
allreduces, weight averages, and :class:`Traffic`, the description of one step that an algorithm returns
from ``Algorithm.traffic`` (notation: :mod:`bagua_lite.cost_model`). Imports without torch."""
import math
from dataclasses import dataclass
from typing import Sequence, Tuple

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


def dense_allreduce(P, numels, elem_bytes=4, machine=None) -> "Traffic":
    """A ring allreduce of every bucket on our engine, then the divide: plain synchronous SGD's step
    (gradient_allreduce without compression, and the dense warm-up of an algorithm that starts with one)."""
    e = elem_bytes
    return Traffic("buckets", *per_bucket(numels, P, lambda n, i: ring(n * e, P),
                                          lambda n, i: n * machine.add_s_per_elem if P > 1 else 0.0, machine))
