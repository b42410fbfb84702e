"""Primitive collectives of bagua_lite, over any ``torch.distributed`` process group.

Each function validates its arguments (raising before any traffic), then runs in the C++ core with the
GIL released and returns when its result is in place. Every rank of the group must call the same
collectives in the same order, as with ``torch.distributed``. ``group=None`` means the default group.

What travels, per call on P ranks (m = bytes of the tensor):

==========================  =====================================================================
``allreduce``               dense ring allreduce: 2(P-1)/P * m per rank (``allreduce_start``: the same,
                            returning at once, optionally as one allreduce per piece of ``split_even``;
                            its ``wait()`` returns when the result is in place)
``compressed_allreduce``    compressed chunks: all-to-all, then allgather of the reduced chunks
``sparse_allreduce``        one allgather of [k values][k int32 indices] per rank (TopKAllReduce)
``sparse_allgather``        the same exchange, returning every rank's pairs instead of their sum
``gtopk_allreduce``         recursive doubling: log2(P) swaps of k (value, index) pairs
``broadcast``               the tensor from ``src`` to everyone
==========================  =====================================================================

Example::

    import torch, torch.distributed as dist, bagua_lite
    dist.init_process_group("gloo")
    g = torch.randn(1000)
    vals, idx = bagua_lite.kernels.topk(g, 10)
    vals, idx = bagua_lite.comm.gtopk_allreduce(vals, idx, k=10)   # same set on every rank
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _C, _compat, compressors, runtime
from ._groups import check_device, resolve_group

__all__ = ["allreduce", "allreduce_start", "split_even", "compressed_allreduce", "sparse_allreduce", "sparse_allgather",
           "gtopk_allreduce", "broadcast", "bytes_sent", "messages_sent", "reset_traffic"]

_OPS = ("avg", "sum")
_COMPRESSIONS = ("fp16", "minmax_uint8")


def _choice(fn, name, value, allowed):
    if value not in allowed:
        raise ValueError(f"bagua_lite.comm.{fn}: {name}={value!r} is not allowed; choose one of "
                         + ", ".join(repr(a) for a in allowed))


def allreduce(t: torch.Tensor, op: str = "avg", group=None) -> torch.Tensor:
    """Dense allreduce of ``t`` in place; ``op`` is ``"avg"`` or ``"sum"``. Returns ``t``."""
    _choice("allreduce", "op", op, _OPS)
    pg = resolve_group(group, "allreduce")
    check_device(t, pg, "allreduce")
    _C.allreduce(pg, t, op == "avg")
    return t


class PendingAllreduce:
    """An :func:`allreduce_start` in flight: ``wait()`` returns ``t`` once it holds the result."""

    def __init__(self, works, t, divide_by):
        self._works, self._t, self._divide_by = works, t, divide_by

    def wait(self) -> torch.Tensor:
        if self._works is not None:
            works, self._works = self._works, None
            for work in works:
                work.wait()
            if self._divide_by > 1:
                self._t.div_(self._divide_by)  # as allreduce's op="avg": the sum, then one division
        return self._t


def split_even(t: torch.Tensor, chunks: int) -> List[torch.Tensor]:
    """``t`` (contiguous) as ``min(chunks, t.numel())`` contiguous views that tile it in order, of nearly
    equal length (the first ``numel % chunks`` one element longer). They depend on ``numel`` and ``chunks``
    only, never on timing, so every rank cuts the same pieces. Views: nothing is copied or allocated
    beyond the view objects; make them once and pass them to :func:`allreduce_start` at every call."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"bagua_lite.comm.split_even: chunks must be an int >= 1, got {chunks!r}")
    if not t.is_contiguous():
        raise ValueError("bagua_lite.comm.split_even: t must be contiguous")
    flat, n = t.view(-1), t.numel()
    k = max(1, min(chunks, n))
    bounds = [i * (n // k) + min(i, n % k) for i in range(k + 1)]
    return [flat[bounds[i]:bounds[i + 1]] for i in range(k)]


def allreduce_start(t: torch.Tensor, op: str = "avg", group=None,
                    pieces: Optional[Sequence[torch.Tensor]] = None) -> PendingAllreduce:
    """:func:`allreduce` started and not waited for: the same collective (the group's SUM, then a
    division for ``"avg"``), so the same bits in ``t``, while the caller works on. Call ``wait()`` on
    the result before reading or writing ``t``; other collectives may be issued meanwhile (the group
    runs them in the order issued, the same on every rank).

    ``pieces``: views that tile ``t`` in order (:func:`split_even`); each gets an allreduce of its own, all
    posted before this returns. gloo runs queued collectives on its worker threads (2 per device by
    default), so two pieces travel at once and one's reduction overlaps the other's transfer. The ring
    sums an element in an order set by where it falls in the buffer reduced, so on 3 or more ranks the
    bits may differ from one allreduce of ``t`` (they are the same on every rank, and from call to call
    for the same pieces). Counted as one allreduce of ``t``'s bytes, one ring's messages per piece."""
    _choice("allreduce_start", "op", op, _OPS)
    pg = resolve_group(group, "allreduce_start")
    check_device(t, pg, "allreduce_start")
    if not t.is_contiguous():
        raise ValueError("bagua_lite.comm.allreduce_start: t must be contiguous")
    if op == "avg" and not t.is_floating_point():
        raise ValueError(f"bagua_lite.comm.allreduce_start(op='avg'): t must be floating point, got {t.dtype}")
    pieces = [t] if pieces is None else list(pieces)
    if t.numel() > 0:
        _check_tiling(t, pieces)
    P = pg.size()
    if P == 1 or t.numel() == 0:
        return PendingAllreduce(None, t, 1)
    works = [dist.all_reduce(piece, op=dist.ReduceOp.SUM, group=pg, async_op=True) for piece in pieces]
    _C.count_sent(2 * (P - 1) * t.nbytes // P, 2 * (P - 1) * len(pieces))  # what allreduce counts, per ring
    return PendingAllreduce(works, t, P if op == "avg" else 1)


def _check_tiling(t, pieces):
    at, size = t.data_ptr(), t.element_size()
    for piece in pieces:
        if (not isinstance(piece, torch.Tensor) or piece.dtype != t.dtype or not piece.is_contiguous()
                or piece.numel() == 0 or piece.data_ptr() != at):
            raise ValueError("bagua_lite.comm.allreduce_start: pieces must be non-empty contiguous views that tile "
                             "t in order (bagua_lite.comm.split_even(t, chunks))")
        at += piece.numel() * size
    if at != t.data_ptr() + t.numel() * size:
        raise ValueError(f"bagua_lite.comm.allreduce_start: the pieces cover {(at - t.data_ptr()) // size} of t's "
                         f"{t.numel()} elements; they must tile all of t")


def compressed_allreduce(t: torch.Tensor, compression="fp16", group=None, op: str = "avg",
                         residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Low-precision allreduce of ``t`` in place (BAGUA's centralized path; ``minmax_uint8`` is ByteGrad).

    ``compression``: a registered name (``fp16``, ``bf16``, ``minmax_uint8``, ``sign``, a user's) or a
    :class:`bagua_lite.Compressor`; ``"none"`` is a plain allreduce. Each rank compresses its P chunks,
    an all-to-all gives rank r every rank's chunk r, which it decompresses, reduces, recompresses and
    allgathers. Every rank ends with bit-identical ``t``. With ``residual`` (a tensor like ``t``: the
    error-feedback memory) each rank sends its chunks plus the residual and keeps what compression lost
    there. With one rank nothing is exchanged and ``t`` is left exactly as it is. Returns ``t``.
    """
    comp = compressors.get_compressor(compression, "bagua_lite.comm.compressed_allreduce")
    _choice("compressed_allreduce", "op", op, _OPS)
    pg = resolve_group(group, "compressed_allreduce")
    check_device(t, pg, "compressed_allreduce")
    if residual is not None and (not isinstance(residual, torch.Tensor) or residual.shape != t.shape
                                 or residual.dtype != t.dtype or not residual.is_contiguous()):
        raise ValueError(f"bagua_lite.comm.compressed_allreduce: residual must be a contiguous tensor of t's shape "
                         f"{tuple(t.shape)} and dtype {t.dtype}, got "
                         f"{getattr(residual, 'shape', type(residual).__name__)}")
    if comp is None:
        return allreduce(t, op, group=pg)
    if comp.native:
        _C.compressed_allreduce(pg, t, comp.name, op == "avg", residual)
    else:
        _compressed_allreduce_py(pg, t, comp, op == "avg", residual)
    return t


def _compressed_allreduce_py(pg, t, comp, average, residual):
    """The same reduce-scatter + allgather on compressed chunks, for a compressor written in Python."""
    if not t.is_contiguous() or not t.is_floating_point():
        raise ValueError(f"bagua_lite.comm.compressed_allreduce: t must be a contiguous floating tensor, "
                         f"got {t.dtype}, contiguous={t.is_contiguous()}")
    P, me, n = pg.size(), pg.rank(), t.numel()
    if P == 1:
        return
    flat = t.view(-1)
    res = residual.view(-1) if residual is not None else None
    bounds = [i * (n // P) + min(i, n % P) for i in range(P + 1)]
    chunk = [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(P)]
    wire = [comp.wire_bytes(length) for _, length in chunk]
    send_splits = [_aligned(w) for w in wire]  # every wire buffer starts at an 8-byte boundary
    send = runtime.kept_buffer("send", sum(send_splits), torch.uint8, t.device)
    off = 0
    for (start, length), size, split in zip(chunk, wire, send_splits):
        encode_residual = res.narrow(0, start, length) if res is not None else None
        compressors.encode(comp, flat.narrow(0, start, length), send.narrow(0, off, size), encode_residual)
        off += split
    piece = send_splits[me]
    recv = runtime.kept_buffer("recv", piece * P, torch.uint8, t.device)
    dist.all_to_all_single(recv, send, [piece] * P, send_splits, group=pg)
    mine = flat.narrow(0, *chunk[me])
    for r in range(P):
        comp.decompress(recv.narrow(0, r * piece, wire[me]), mine, accumulate=r > 0)
    if average:
        mine.div_(P)
    slot = send_splits[0]
    own = runtime.kept_buffer("own", slot, torch.uint8, t.device)
    own[wire[me]:].zero_()  # the padding travels too: zeros, as every time
    comp.compress(mine, own.narrow(0, 0, wire[me]))
    gathered = runtime.kept_buffer("gathered", slot * P, torch.uint8, t.device)
    _compat.all_gather_single(gathered, own, group=pg)
    for r, (start, length) in enumerate(chunk):
        comp.decompress(gathered.narrow(0, r * slot, wire[r]), flat.narrow(0, start, length), accumulate=False)
    _C.count_sent(sum(send_splits) - piece + (P - 1) * slot, 2 * (P - 1))


def _aligned(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def sparse_allreduce(values: torch.Tensor, indices: torch.Tensor, numel: int, group=None,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TopKAllReduce: sum every rank's sparse (values, int32 indices) into a dense tensor of ``numel``.

    One allgather of packed ``[k values][k indices]`` buffers (padded to the largest k); ranks may hold
    different k. Summation runs in rank order, so all ranks get the same bits. With ``out`` (a
    contiguous float tensor of ``numel`` elements) the result is written there instead of a new tensor.
    """
    pg = resolve_group(group, "sparse_allreduce")
    check_device(values, pg, "sparse_allreduce", "values")
    if not isinstance(numel, int) or isinstance(numel, bool):
        raise TypeError(f"bagua_lite.comm.sparse_allreduce: numel must be an int, got {type(numel).__name__}")
    return _C.sparse_allreduce(pg, values, indices, numel, out)


def sparse_allgather(values: torch.Tensor, indices: torch.Tensor, group=None,
                     k: Optional[int] = None, out=None, verify: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every rank's sparse (values, int32 indices), concatenated in rank order: the exchange of
    :func:`sparse_allreduce` without the sum (ranks may hold different k; dtypes must match).

    For a caller that keeps a dense result between steps: it scatters these itself (e.g.
    ``kernels.scatter_add_``) and next time clears only these indices instead of the whole tensor.

    ``k``: every rank sends exactly ``k`` pairs, as Top-k's selection guarantees by construction. The
    exchange of the ranks' sizes is then skipped (one message round instead of two); each block carries
    its k and dtype and every receiver checks them. Only for a k that is the same on every rank by
    construction: a peer that sends more pairs than ``k`` makes gloo abort the receiving process.
    ``verify=False`` (with ``k``) leaves the received k and dtype unchecked: on a GPU the check reads them back
    to the host, a synchronisation per call, so a caller that repeats an exchange it has verified (the same
    ``k`` and dtype on the same group, in the same order on every rank) checks only the first.

    ``out``: ``(values_buffer, indices_buffer)`` kept by the caller across calls (the values' dtype and
    int32, contiguous, on the values' device): the result is written into their first elements and
    returned as views of them, so a step allocates nothing; a result longer than a buffer comes back in
    a new tensor.
    """
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
        raise ValueError(f"bagua_lite.comm.sparse_allgather: k must be an int >= 0 or None, got {k!r}")
    if not isinstance(verify, bool):
        raise TypeError(f"bagua_lite.comm.sparse_allgather: verify must be a bool, got {verify!r}")
    pg = resolve_group(group, "sparse_allgather")
    check_device(values, pg, "sparse_allgather", "values")
    out_values, out_indices = _out_pair(out, "sparse_allgather")
    return _C.sparse_allgather(pg, values, indices, -1 if k is None else k, out_values, out_indices, verify)


def _out_pair(out, fn):
    if out is None:
        return None, None
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise TypeError(f"bagua_lite.comm.{fn}: out must be None or a pair of tensors (values, indices), got {out!r}")
    return out


def gtopk_allreduce(values: torch.Tensor, indices: torch.Tensor, k: int, group=None,
                    exact: bool = False, numel: Optional[int] = None,
                    value_bits: Optional[int] = None, final_union: bool = False,
                    out=None, canonical: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Global Top-k of the ranks' sparse sets (gTop-k S-SGD), by recursive doubling.

    In round r each rank swaps its k (value, index) pairs with rank XOR 2^r, sums equal indices and
    keeps the k largest by magnitude (ties: lower index). Ranks beyond the largest power of two fold
    into a partner first and receive the result last. Sum semantics; returns at most k entries with
    ascending int32 indices, bit-identical on every rank. ``exact=True`` adds one k-sized allreduce so
    each value is the exact sum over ranks at its index. ``k`` must be the same on all ranks.

    ``numel``: the dense length the indices lie in (checked); where a bitmap of ``numel`` bits is smaller
    than k int32 indices (density above 1/32), the indices travel as that bitmap. ``value_bits=4``: the
    values travel as 4-bit levels with one float32 scale per 64 entries (about 0.56 bytes per value
    instead of 4), and ``values`` is overwritten with what of this rank's contribution the result holds:
    the decoded level of each entry it sent that the result kept, 0 elsewhere (its error feedback
    subtracts that; the rest stays in its residual). A merged
    set is quantized again before each later round, so with more than 2 ranks the sums also carry that
    error. Needs distinct indices and ``exact=False``; the same ``numel`` and ``value_bits`` on all ranks.

    ``final_union=True``: the last round keeps the whole merged set of its two partners (at most 2k
    entries) instead of its k largest. The bytes on the wire are the same (a round's messages are its
    inputs; when P is not a power of two the hand-back to the extra ranks is laid out for 2k entries), and
    more of what the ranks sent is applied; at P = 2 it is the sum of both ranks' sets. The same on all ranks.

    ``out``: ``(values_buffer, indices_buffer)``, as :func:`sparse_allgather`'s (k entries at most, 2k with
    ``final_union``).

    ``canonical=True``: the caller guarantees that ``(values, indices)`` holds exactly k entries with strictly
    ascending indices (as :func:`bagua_lite.kernels.topk` returns them); it is not checked, since that would
    read the indices back. With values in their dtype, an index list (density at most 1/32), ``exact`` and
    ``final_union`` False, every set then holds exactly k entries and the rounds run as fixed-size tensor ops
    where the tensors lie: on a GPU, no host copy and no host synchronisation. The messages and the result are
    bit for bit those of the host's merge.
    """
    if not isinstance(k, int) or isinstance(k, bool):
        raise TypeError(f"bagua_lite.comm.gtopk_allreduce: k must be an int, got {type(k).__name__}")
    if numel is not None and (not isinstance(numel, int) or isinstance(numel, bool) or numel < 0):
        raise ValueError(f"bagua_lite.comm.gtopk_allreduce: numel must be an int >= 0 or None, got {numel!r}")
    if value_bits not in (None, 4) or isinstance(value_bits, bool):
        raise ValueError(f"bagua_lite.comm.gtopk_allreduce: value_bits must be None (the values' dtype) or 4, "
                         f"got {value_bits!r}")
    if not isinstance(final_union, bool):
        raise TypeError(f"bagua_lite.comm.gtopk_allreduce: final_union must be a bool, got {final_union!r}")
    pg = resolve_group(group, "gtopk_allreduce")
    check_device(values, pg, "gtopk_allreduce", "values")
    out_values, out_indices = _out_pair(out, "gtopk_allreduce")
    if not isinstance(canonical, bool):
        raise TypeError(f"bagua_lite.comm.gtopk_allreduce: canonical must be a bool, got {canonical!r}")
    return tuple(_C.gtopk_allreduce(pg, values, indices, k, bool(exact), -1 if numel is None else numel,
                                    value_bits or 0, final_union, out_values, out_indices, canonical))


def broadcast(t: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Broadcast ``t`` in place from ``src`` (a rank within ``group``). Returns ``t``."""
    pg = resolve_group(group, "broadcast")
    check_device(t, pg, "broadcast")
    _C.broadcast(pg, t, int(src))
    return t


def bytes_sent() -> int:
    """Bytes this process has put on the wire through bagua_lite since the last reset.

    Point-to-point messages (gtopk_allreduce, sparse exchanges) are counted exactly; library collectives
    count what the ring algorithm sends per rank (allreduce 2(P-1)/P*m, allgather (P-1)*m).
    """
    return _C.bytes_sent()


def messages_sent() -> int:
    return _C.messages_sent()


def reset_traffic() -> None:
    _C.reset_traffic()
