"""Averaging model weights over a group, dense or compressed: the "weights travel" axis that local SGD
and asynchronous model averaging share.

Dense:       x <- mean_r x_r                                   (one allreduce of the flat weights)
Compressed:  every rank holds the same anchor a (the last average, identical everywhere) and sends
             only the change since then, compressed with error feedback e_r:
                 d_r <- x_r - a ;  avg <- a + compressed_allreduce(d_r, residual=e_r)
                 a <- avg
             The weights themselves are never quantized, only how far each rank moved; what the
             compression lost stays in e_r and is sent at the next average.

An outer optimizer (DiLoCo) keeps the anchor for dense averaging too (``anchored=True``) and takes
``reduce_change()``, the average of the ranks' changes since the anchor, as the negated pseudo-gradient.

``chunks`` k > 1: the dense averages of ``start_sync`` and ``reduce_work`` allreduce each flat buffer as k
nearly equal contiguous pieces (views made once), all posted before any is waited for, so gloo's worker
threads run two at a time (see ``comm.allreduce_start``). The pieces depend only on the buffer's length,
so every rank cuts the same ones; on 3 or more ranks the sums' rounding is that of the pieces' rings.

``snapshot()``, ``reduce()`` and ``apply()`` are separate so an asynchronous caller can copy the weights
under a lock, communicate without it, and then add ``average - snapshot`` to weights that went on
training meanwhile (``apply(delta=True)``). A synchronous caller sets the weights to the average
(``apply(delta=False)``), which keeps replicas bit-identical.
"""
from typing import List, Optional

import torch

from . import comm, compressors
from .bucket import FlatWeights, check_unconverted


class WeightAverager:
    def __init__(self, params: List[torch.nn.Parameter], compression="none", who: str = "averaging",
                 anchored: bool = False, chunks: int = 1, owners: Optional[dict] = None, aliased=None):
        self.weights = FlatWeights(params)
        self.owners = owners or {}  # id(tensor) -> the parameter whose requires_grad it follows (a shard's)
        # ``params`` given as the ``.data`` of ``aliased``: what snapshot() checks they still are
        self.aliased = list(zip(params, aliased)) if aliased is not None else []
        self.compressor = compressors.get_compressor(compression, who)
        self.snaps = [flat.clone() for flat in self.weights.gather()]  # x at snapshot()
        self.work = [torch.empty_like(f) for f in self.snaps]           # the average, once reduced
        self.pieces = [comm.split_even(w, chunks) for w in self.work]   # views: a dense sync's allreduces
        self.anchored = anchored or self.compressor is not None
        if self.anchored:
            self.anchors = [f.clone() for f in self.snaps]  # identical on all ranks (weights start equal)
            self.residuals = [torch.zeros_like(f) for f in self.snaps] if self.compressor is not None else []

    def reset_anchor(self) -> None:
        """Make the current weights the anchor (call where every replica holds the same weights)."""
        if self.anchored:
            for anchor, flat in zip(self.anchors, self.weights.gather()):
                anchor.copy_(flat)
            for residual in self.residuals:
                residual.zero_()

    def reduce_change(self, group) -> List[torch.Tensor]:
        """The ranks' mean change since the anchor, mean_r (x_r - a), into the work buffers (compressed
        with error feedback where a compressor is set; collective). Needs ``anchored``."""
        self.take_change()
        return self.reduce_work(group)

    def take_change(self) -> None:
        """This rank's change since the anchor, x - a, into the work buffers (local; needs ``anchored``),
        read from the parameters themselves: one pass, no flat copy of the weights first."""
        with torch.no_grad():
            for x, a, w in self._slices(self.anchors, self.work):
                torch.sub(x, a, out=w)

    def _slices(self, *flats):
        """(parameter as a flat view, then the matching slice of each of ``flats``) per parameter."""
        for g, (group, _) in enumerate(self.weights.groups):
            o = 0
            for p in group:
                n = p.numel()
                check_unconverted(p, flats[0][g])
                yield (p.detach().view(-1) if p.is_contiguous() else p.detach().reshape(-1),
                       *(f[g][o:o + n] for f in flats))
                o += n

    def frozen_spans(self) -> List[tuple]:
        """(flat buffer index, offset, length) of each parameter that does not require grad now."""
        spans = []
        for g, (group, _) in enumerate(self.weights.groups):
            o = 0
            for p in group:
                if not self.owners.get(id(p), p).requires_grad:
                    spans.append((g, o, p.numel()))
                o += p.numel()
        return spans

    def reduce_work(self, group) -> List[torch.Tensor]:
        """Average the work buffers over ``group`` in place (collective), compressed with error feedback
        where a compressor is set. Touches only the work buffers and residuals, never the parameters, so
        it may run on another thread while training goes on."""
        if self.compressor is None:
            self._post(group).wait()
            return self.work
        for i, work in enumerate(self.work):
            comm.compressed_allreduce(work, self.compressor, group=group, residual=self.residuals[i])
        return self.work

    def _post(self, group) -> "_Posted":
        """The dense average of the work buffers started: every buffer's pieces posted, none waited for."""
        return _Posted([comm.allreduce_start(work, "avg", group=group, pieces=pieces)
                        for work, pieces in zip(self.work, self.pieces)])

    def load_anchor(self, keep: float = 0.0) -> None:
        """Set the weights to the anchor (after an outer optimizer moved it); with ``keep`` > 0 to the mix
        ``keep * x + (1 - keep) * anchor`` instead (streaming DiLoCo's merge of a sync that ran while
        training went on)."""
        with torch.no_grad():  # per parameter, from the anchor's slice: no flat copy of the weights
            for g, (group, _) in enumerate(self.weights.groups):
                o = 0
                for p in group:
                    a = self.anchors[g][o:o + p.numel()].view_as(p)
                    p.mul_(keep).add_(a, alpha=1.0 - keep) if keep else p.copy_(a)
                    o += p.numel()

    def snapshot(self) -> None:
        """Copy the current weights (call under the caller's lock if others may step meanwhile)."""
        for alias, p in self.aliased:  # a .data replaced (model.double(), .to(), p.data = ...) after wrapping
            if p.data_ptr() != alias.data_ptr() or p.dtype != alias.dtype:
                raise RuntimeError(
                    f"bagua_lite: parameter of shape {tuple(p.shape)} no longer holds the storage it had when the "
                    f"model was wrapped ({p.dtype} now, {alias.dtype} then; a conversion such as .double() or "
                    f".to(), or an assignment to .data): the averaging would go on with the old one. Convert or "
                    f"assign before wrapping, or wrap the model again after")
        for snap, flat in zip(self.snaps, self.weights.gather()):
            snap.copy_(flat)

    def reduce(self, group) -> None:
        """Average the snapshot over ``group`` into the work buffers (collective: every rank calls it)."""
        for i, (snap, work) in enumerate(zip(self.snaps, self.work)):
            if self.compressor is None:
                work.copy_(snap)
                comm.allreduce(work, "avg", group=group)
            else:
                torch.sub(snap, self.anchors[i], out=work)
                comm.compressed_allreduce(work, self.compressor, group=group, residual=self.residuals[i])
                work.add_(self.anchors[i])
                self.anchors[i].copy_(work)

    def apply(self, delta: bool) -> None:
        """Write the average into the parameters: ``x <- avg`` or, with ``delta``, ``x <- x + avg - snapshot``."""
        with torch.no_grad():
            for (group, _), snap, work in zip(self.weights.groups, self.snaps, self.work):
                if delta:
                    work.sub_(snap)  # the work buffer becomes avg - snapshot (no temporaries)
                o = 0
                for p in group:
                    n = p.numel()
                    p.add_(work[o:o + n].view_as(p)) if delta else p.copy_(work[o:o + n].view_as(p))
                    o += n

    def average(self, group) -> None:
        """Synchronous: snapshot, reduce, set every replica to the average."""
        self.snapshot()
        self.reduce(group)
        self.apply(delta=False)

    def average_dense(self, group) -> None:
        """Synchronous and uncompressed, whatever the compressor: every replica <- the plain mean of the
        weights, which becomes the anchor (residuals zeroed). For a membership change, after which the
        ranks' anchors may differ (a round some completed and others did not)."""
        self.snapshot()
        for snap, work in zip(self.snaps, self.work):
            work.copy_(snap)
            comm.allreduce(work, "avg", group=group)
        self.apply(delta=False)
        self.reset_anchor()

    def start_sync(self, group) -> "_Posted":
        """``average``/``reduce_change`` started (dense, no compressor): anchored, the change x - a
        (``take_change``) into the work buffers, else the weights themselves, each read straight from the
        parameters; then their allreduce is started (collective) and the caller may issue other collectives
        before ``wait()``; then ``apply(delta=False)`` (not anchored), or the work buffers hold the mean
        change (anchored). The same collectives on the same values as ``reduce_change`` (anchored) or a copy
        of the weights into the work buffers + ``reduce_work``, so the same bits. Several flat buffers
        (parameters of several dtypes): all of them are posted before it returns."""
        if self.compressor is not None:
            raise ValueError("WeightAverager.start_sync: dense averaging only (a compressor is set)")
        if self.anchored:
            self.take_change()
        else:
            with torch.no_grad():
                for x, w in self._slices(self.work):
                    w.copy_(x)
        return self._post(group)

    def state_dict(self) -> dict:
        if not self.anchored:
            return {}
        return {"anchors": [a.clone() for a in self.anchors], "residuals": [r.clone() for r in self.residuals]}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if not self.anchored or not state:
            return
        for dst, src in zip(self.anchors + self.residuals, state["anchors"] + state["residuals"]):
            dst.copy_(src)


class _Posted:
    """Allreduces of the work buffers in flight: ``wait()`` returns once every one holds its result."""

    def __init__(self, pending):
        self._pending = pending

    def wait(self) -> None:
        for p in self._pending:
            p.wait()
