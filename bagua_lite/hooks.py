"""DDP communication hooks: bagua_lite's sparse and compressed exchanges under ``torch.nn.parallel.DDP``.

For a training loop that keeps PyTorch's ``DistributedDataParallel`` and only changes what its gradient
buckets send. A hook is a function ``hook(state, bucket)``; the state object holds its options and its
per-bucket memory (error-feedback residuals), allocated once per DDP bucket and reused every step::

    state = bagua_lite.hooks.SparseState(density=0.01)
    ddp_model.register_comm_hook(state, bagua_lite.hooks.gtopk_hook)

==================  ===========================================================  ========================
hook (state)        what travels per bucket of n elements and step (P ranks)     the same as
==================  ===========================================================  ========================
``topk_hook``       each rank's k = density*n (value, int32 index) pairs,        ``topk``,
(SparseState)       allgathered: (8k + 16)(P-1) bytes sent per rank (fp32)       ``momentum_correction=0``
``gtopk_hook``      recursive doubling: log2 P swaps of k pairs, 8k bytes each   ``gtopk``,
(SparseState)                                                                    ``momentum_correction=0``
``compressed_hook`` the bucket compressed by any registered compressor,          ``gradient_allreduce``
(CompressedState)   reduce-scattered and allgathered (fp16: a half allreduce)    ``(compression=...)``
==================  ===========================================================  ========================

The hooks run the same kernels and collectives as those algorithms, so with one bucket on each side (and
an optimizer without momentum, or whose momentum acts on the averaged gradient in both) DDP + hook trains
bit for bit as ``bagua_lite.DistributedModel`` with that algorithm (``tests/test_hooks.py``). Where they
cannot coincide: momentum correction (topk/gtopk's default with SGD momentum) moves the optimizer's
momentum in front of the selection, and a DDP hook never sees the optimizer; here the optimizer's momentum
acts on the sparse average, as with ``momentum_correction: 0``. And a bucket's layout: DDP's first step
lays a bucket out in registration order, later ones in the order gradients became ready (DistributedModel's
order for a sequential model). The sparse hooks' results do not depend on the order (top-k by magnitude,
sums in rank order); a compressor's chunks and ranges do, so compressed_hook's first step matches
gradient_allreduce's only where the orders agree (e.g. one parameter per bucket).

A bucket's work runs on one background thread per state, in bucket order (the same on every rank), and the
hook returns at once a ``torch.futures.Future`` that the thread completes, so the exchange overlaps with the
rest of backward as DDP's allreduce does. Collectives go through :mod:`bagua_lite.comm` on the state's
``process_group`` (default: the world), gloo or NCCL; there is no CUDA-only path (CUDA tensors take ATen's).

Non-finite gradients (a loss scaler's overflow): if any rank's bucket holds inf or NaN, every rank's result
for that bucket is non-finite (so a ``GradScaler`` skips the step on every rank, as under plain DDP) and
every rank's residual stays as it was before the step. The sparse hooks carry this in their own exchange (a
rank with a non-finite gradient sends +inf values, which survive the merges); ``compressed_hook`` adds one
4-byte allreduce per bucket in front of the compressed exchange, since a quantizer cannot carry inf.

Checkpoints: a state pickles (``torch.save``) without its process group and thread, with its residuals per
parameter; a new DDP of the same model (same bucket sizes) with the unpickled state resumes bit for bit. DDP
rebuilds its buckets once after the first step (in the order gradients became ready): residuals follow
their parameters into the new layout, exactly.
"""
import math
from typing import Dict, Optional

import torch
import torch.distributed as dist

from . import _C, comm, compressors, kernels
from ._options import compressor as _compressor_option
from ._options import within
from ._worker import Worker

__all__ = ["SparseState", "CompressedState", "topk_hook", "gtopk_hook", "compressed_hook"]


class _Memory:
    """One bucket's error-feedback memory: the ``residual`` (None: no error feedback) and, for the sparse
    hooks, this step's working copy ``acc`` (swapped in when the step's result is finite), for the
    parameters ``key`` (ids) of ``shapes``."""

    def __init__(self, numel, like, key, shapes, k=0, feedback=True, working_copy=True):
        self.residual = torch.zeros(numel, dtype=like.dtype, device=like.device) if feedback else None
        self.acc = torch.zeros_like(self.residual) if feedback and working_copy else None
        self.key, self.shapes = key, shapes
        self.values = torch.empty(k, dtype=like.dtype, device=like.device)
        self.indices = torch.empty(k, dtype=torch.int32, device=like.device)
        self.half = None  # compressed_hook's fp16 wire, allocated on first use

    def commit(self):
        self.residual, self.acc = self.acc, self.residual


class _HookState:
    """What both states share: the process group, the per-bucket memory, the thread, pickling."""

    _options = ()  # the constructor's arguments but the process group, pickled with the residuals

    def __init__(self, process_group):
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"{type(self).__name__}: process_group must be a torch.distributed ProcessGroup or "
                            f"None (the default group), got {type(process_group).__name__}")
        self.process_group = process_group
        self._memory: Dict[int, _Memory] = {}
        self._where = {}     # id(param) -> (its _Memory, offset): where its residual lives now
        self._origin = {}    # id(param) -> (bucket index, position) where this state first saw it
        self._restored = {}  # (bucket index, position) -> a parameter's residual from a checkpoint
        self._worker = None

    @property
    def residuals(self) -> Dict[int, torch.Tensor]:
        """{DDP bucket index: its error-feedback residual (flat, the bucket's layout)}; empty without feedback."""
        return {i: m.residual for i, m in sorted(self._memory.items()) if m.residual is not None}

    def _group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _k(self, numel):
        return 0

    def _feedback(self):
        return True

    _working_copy = True  # the sparse hooks' double buffer (compressed_hook skips a non-finite round instead)

    def _bucket_memory(self, bucket, buf) -> _Memory:
        """The bucket's memory, allocated on its first step; after DDP rebuilt its buckets (a new parameter
        list at this index) a new one, each parameter's residual copied from where it was (or, the first
        time, from a checkpoint: by where the saving state first saw the parameter, i.e. DDP's first-step
        layout, which a new DDP of the same model repeats)."""
        i, params = bucket.index(), bucket.parameters()
        key = tuple(id(p) for p in params)
        mem = self._memory.get(i)
        if mem is not None and mem.key == key:
            return mem
        shapes = tuple(tuple(p.shape) for p in params)
        new = _Memory(buf.numel(), buf, key, shapes, self._k(buf.numel()), self._feedback(),
                      self._working_copy)
        offset = 0
        for j, p in enumerate(params):
            n = p.numel()
            origin = self._origin.setdefault(id(p), (i, j))
            if new.residual is not None and id(p) in self._where:
                old, at = self._where[id(p)]
                new.residual[offset:offset + n].copy_(old.residual[at:at + n])
            elif new.residual is not None and origin in self._restored:
                saved = self._restored.pop(origin)
                if saved.shape != p.shape:
                    raise ValueError(f"{type(self).__name__}: the checkpointed residual of DDP bucket {i}, "
                                     f"parameter {j} has shape {tuple(saved.shape)}, this model's parameter there "
                                     f"{tuple(p.shape)}; load it into the same model, DDP bucket sizes and hook")
                new.residual[offset:offset + n].copy_(saved.reshape(-1))
            self._where[id(p)] = (new, offset)
            offset += n
        self._memory[i] = new
        return new

    def _submit(self, bucket, work) -> torch.futures.Future[torch.Tensor]:
        """Run ``work(buf, memory, group)`` on the state's thread; the future resolves to the bucket's buffer."""
        buf = bucket.buffer()
        fut = torch.futures.Future()
        group = self._group()
        mem = self._bucket_memory(bucket, buf)

        def job():
            try:
                work(buf, mem, group)
            except BaseException as e:  # noqa: B902 - DDP raises it from backward
                fut.set_exception(e)
            else:
                fut.set_result(buf)
        if self._worker is None:
            self._worker = Worker(f"bagua_lite-{type(self).__name__}")
        self._worker.submit(job)
        return fut

    def __getstate__(self):
        """The options and each parameter's residual, keyed by (bucket index, position) where this state first
        saw it; not the process group (as torch's ``PowerSGDState``) nor the thread."""
        residuals = {}
        for mem in self._memory.values():
            if mem.residual is None:
                continue
            offset = 0
            for pid, shape in zip(mem.key, mem.shapes):
                n = math.prod(shape)
                residuals[self._origin[pid]] = mem.residual[offset:offset + n].clone().view(shape)
                offset += n
        return {"options": {name: getattr(self, name) for name in self._options}, "residuals": residuals}

    def __setstate__(self, state):
        """The process group is the default one; set ``process_group`` after loading for another."""
        type(self).__init__(self, **state["options"])
        self._restored = dict(state["residuals"])


class SparseState(_HookState):
    """State of :func:`topk_hook` and :func:`gtopk_hook`: each DDP bucket's residual (what was not sent yet)
    and its top-k buffers, allocated on the bucket's first step and reused.

    ``density``: the share of each bucket's entries a rank selects per step, in (0, 1]:
    k = round(density * n), at least 1 (as the ``topk``/``gtopk`` algorithms).

    Example::

        state = bagua_lite.hooks.SparseState(density=0.01)
        ddp_model.register_comm_hook(state, bagua_lite.hooks.gtopk_hook)
    """

    _options = ("density",)

    def __init__(self, process_group=None, density: float = 0.001):
        within("SparseState", "density", density, "(0, 1]")
        super().__init__(process_group)
        self.density = float(density)

    def _k(self, numel):
        return kernels.topk_count(numel, self.density) if numel else 0

    def _exchange(self, buf, mem, group, aggregate):
        """acc = residual + g; the top k of acc travel (``aggregate``: writes the average into ``buf`` and
        removes what was sent from acc); acc becomes the residual if every rank's gradient was finite."""
        if buf.numel() == 0:
            return
        finite = _C.add_checked(mem.acc, mem.residual, buf, None, 0)  # acc = residual (+ g if g is finite)
        k = mem.values.numel()
        kernels.topk_out(mem.acc, k, mem.values, mem.indices)
        if not finite:
            mem.values.fill_(math.inf)  # the marker every rank will see (inf + x = inf, never NaN)
        g_values = aggregate(buf, mem, group, k)
        if bool(torch.isfinite(g_values).all()):
            mem.commit()
        else:
            buf.fill_(math.nan)  # some rank's gradient was non-finite: the residual stays as it was


def _topk_aggregate(buf, mem, group, k):
    kernels.ef_remove_(mem.acc, mem.indices)  # every entry selected here is sent
    g_values, g_indices = comm.sparse_allgather(mem.values.div_(group.size()), mem.indices, group=group, k=k)
    buf.zero_()
    kernels.scatter_add_(buf, g_values, g_indices)  # summed in rank order: the same bits on every rank
    return g_values


def _gtopk_aggregate(buf, mem, group, k):
    g_values, g_indices = comm.gtopk_allreduce(mem.values, mem.indices, k, group=group, numel=buf.numel())
    kernels.ef_remove_(mem.acc, g_indices[torch.isin(g_indices, mem.indices)])  # only what this rank sent
    buf.zero_()
    kernels.scatter_add_(buf, g_values.div_(group.size()), g_indices)
    return g_values


def topk_hook(state: SparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Top-k sparsification with error feedback, aggregated by allgather (TopKAllReduce).

    Each rank adds the bucket's gradient to its residual, selects the k = density * n entries of largest
    magnitude, and allgathers them as one message of [k values][k int32 indices]; every rank sums the P
    sets (divided by P) in rank order into the bucket, zeros elsewhere. The residual keeps the rest.

    What travels per bucket and step: each rank sends its 8k bytes (fp32) and a 16-byte header to each of
    the P - 1 others, (8k + 16)(P - 1) bytes, growing with P (gtopk_hook's does not). Example, 1% of each bucket::

        state = bagua_lite.hooks.SparseState(density=0.01)
        ddp_model.register_comm_hook(state, bagua_lite.hooks.topk_hook)
    """
    return state._submit(bucket, lambda buf, mem, group: state._exchange(buf, mem, group, _topk_aggregate))


def gtopk_hook(state: SparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Global Top-k (gTop-k S-SGD) with error feedback: every rank ends with the same k entries.

    Each rank adds the bucket's gradient to its residual and selects its k = density * n largest entries;
    recursive doubling (``bagua_lite.comm.gtopk_allreduce``) merges the ranks' sets, keeping the k largest
    sums, in log2 P rounds. The bucket becomes those k sums divided by P, zeros elsewhere; the residual
    keeps the rest, i.e. everything but the entries this rank sent that survived globally.

    What travels per bucket and step: log2 P messages of 8k bytes (fp32) per rank (+1 for ranks beyond the
    largest power of two); above a density of 1/32 the indices go as a bitmap of the bucket, n/8 bytes. Example, 1% of each bucket::

        state = bagua_lite.hooks.SparseState(density=0.01)
        ddp_model.register_comm_hook(state, bagua_lite.hooks.gtopk_hook)
    """
    return state._submit(bucket, lambda buf, mem, group: state._exchange(buf, mem, group, _gtopk_aggregate))


class CompressedState(_HookState):
    """State of :func:`compressed_hook`: the compressor and, where it declares ``error_feedback`` (``sign``,
    the DiLoCo family's, a user's), a residual per DDP bucket.

    ``compression``: a registered compressor's name (``fp16``, ``bf16``, ``minmax_uint8``, ``sign``,
    ``absmax4``, ``topk3_absmax2``, ..., or your own from ``bagua_lite.register_compressor``) or an instance.

    Example::

        state = bagua_lite.hooks.CompressedState(compression="minmax_uint8")
        ddp_model.register_comm_hook(state, bagua_lite.hooks.compressed_hook)
    """

    _options = ("compression",)

    def __init__(self, process_group=None, compression="minmax_uint8"):
        allowed = [n for n in compressors.registered_compressors() if n != "none"]
        if isinstance(compression, str) and compression not in allowed + ["none"]:
            raise ValueError(f"CompressedState: unknown compression {compression!r}; choose one of "
                             + ", ".join(repr(n) for n in allowed)
                             + " (or register your own with bagua_lite.register_compressor)")
        self.compressor = _compressor_option("CompressedState", compression, " (DDP without a hook is 'none')")
        super().__init__(process_group)
        self.compression = compression

    _working_copy = False

    def _feedback(self):
        return self.compressor.error_feedback


def _compressed_allreduce(state: CompressedState, buf, mem, group):
    P = group.size()
    if state.compressor.name == "fp16" and state.compressor.native:
        # gradient_allreduce's fp16 path: pre-scaled by 1/P, one allreduce of the half-precision bucket
        # (inf/NaN travel in it to every rank)
        _C.scale_checked(buf, buf, 1.0 / P)
        if mem.half is None:
            mem.half = torch.empty(buf.numel(), dtype=torch.float16, device=buf.device)
        mem.half.copy_(buf)
        dist.all_reduce(mem.half, group=group)
        buf.copy_(mem.half)
        _C.count_sent(2 * (P - 1) * mem.half.nbytes // P, 2 * (P - 1))
        return
    # A quantizer cannot carry inf/NaN: the ranks first agree whether any bucket is non-finite.
    bad = torch.tensor([0 if _C.all_finite(buf) else 1], dtype=torch.int32, device=buf.device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if int(bad.item()):
        buf.fill_(math.nan)  # every rank; nothing compressed travels and the residual stays as it was
        return
    comm.compressed_allreduce(buf, state.compressor, group=group,
                              residual=mem.residual)


def compressed_hook(state: CompressedState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket through a compressor, as ``gradient_allreduce(compression=...)`` does.

    Each rank compresses its P chunks of the bucket (plus its residual, where the compressor asks for error
    feedback), an all-to-all gives rank r every rank's chunk r, which it decompresses, averages,
    recompresses and allgathers (``bagua_lite.comm.compressed_allreduce``); every rank ends with the same
    bits. ``fp16`` is one allreduce of the bucket in half precision, pre-scaled by 1/P.

    What travels per bucket and step, per rank, for n elements: about 2 (P-1)/P * wire_bytes(n), with
    wire_bytes(n) = n + 8 per chunk for ``minmax_uint8``, n/8 + 4 for ``sign``, 2n for ``fp16``/``bf16``
    (a quarter, 1/32, a half of DDP's fp32 allreduce); plus a 4-byte allreduce (non-finite agreement)
    except for ``fp16``. Example::

        state = bagua_lite.hooks.CompressedState(compression="minmax_uint8")
        ddp_model.register_comm_hook(state, bagua_lite.hooks.compressed_hook)
    """
    return state._submit(bucket, lambda buf, mem, group: _compressed_allreduce(state, buf, mem, group))
