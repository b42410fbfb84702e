"""The error-feedback memory of Top-k and gTop-k (``parts.sparse``; GRACE's "memory"): per bucket the residual
(what was not sent yet) and, with momentum correction, the momentum u.

As autograd produces each gradient g of a tensor, one pass writes the working copies:
    u' <- m * u + g + wd * w     (with momentum correction; else u' = g)
    acc <- residual + u'         (what the selection reads; the exchange removes what was sent from it)
acc and u' are double buffers, swapped in when the round is committed (no copy): if any rank's gradient
was non-finite the round is discarded and residual and u stay exactly as they were. A rank's non-finite
gradient never enters acc (checked in the same pass that adds it), so the kernels see finite values and
the exchange completes on every rank.
"""
import torch

from bagua_lite import _C, kernels


class SparseMemory:
    def __init__(self, buckets, momentum: bool):
        self.residuals = [torch.zeros_like(b.flat) for b in buckets]
        self.momenta = [torch.zeros_like(b.flat) if momentum else None for b in buckets]
        self.acc = [torch.zeros_like(b.flat) for b in buckets]  # this round's residual + u'
        self._u = [torch.zeros_like(b.flat) if momentum else None for b in buckets]
        self.momentum = momentum
        # Each tensor's slice of each buffer, made once: slicing four buffers per gradient per step was a
        # third of the hook's host time. They follow their buffers through commit's swaps.
        self._rv, self._av, self._mv, self._uv = (_slices(bufs, buckets) for bufs in
                                                  (self.residuals, self.acc, self.momenta, self._u))

    def add(self, bucket, position, grad, m=0.0, wd=0.0, block_max=None) -> bool:
        """The pass above for tensor ``position`` of ``bucket`` (``grad`` None: no gradient), raising
        ``block_max`` (if given) to acc's magnitudes on the way. False if ``grad`` held inf/NaN: then it
        was left out (acc = residual, u' = m u). With the bucket's ``nonfinite_flag`` (checks left on the
        device) the answer goes there instead, read once per round at the agreement, and this returns True."""
        b = bucket.index
        lo = bucket.offsets[position]
        residual, acc = self._rv[b][position], self._av[b][position]
        g = None if grad is None else grad.reshape(-1)
        flag = bucket.nonfinite_flag
        if self.momentum:
            w = bucket.params[position].detach().reshape(-1) if wd and g is not None else None
            if flag is not None:
                _C.momentum_add_flagged_(self._uv[b][position], acc, self._mv[b][position], residual, g, m, w, wd,
                                         block_max, lo, flag)
                return True
            return _C.momentum_add_checked(self._uv[b][position], acc, self._mv[b][position], residual, g, m, w, wd,
                                           block_max, lo) or g is None
        if g is not None and flag is not None:
            _C.add_flagged_(acc, residual, g, block_max, lo, flag)
            return True
        if g is None:
            acc.copy_(residual)
            if block_max is not None:
                kernels.block_max_combine_(block_max, acc, lo)
            return True
        return _C.add_checked(acc, residual, g, block_max, lo)  # acc = residual + g, or residual if g is not finite

    def working_pairs(self):
        """[(working copy, the state it replaces)] of every buffer :meth:`commit` swaps (for a round
        discarded on the device: ``Algorithm.register_working_copies``)."""
        pairs = list(zip(self.acc, self.residuals))
        if self.momentum:
            pairs += list(zip(self._u, self.momenta))
        return pairs

    def commit(self):
        """The working copies become the state (a swap, no copy)."""
        self.residuals, self.acc = self.acc, self.residuals
        self._rv, self._av = self._av, self._rv
        if self.momentum:
            self.momenta, self._u = self._u, self.momenta
            self._mv, self._uv = self._uv, self._mv

    def state_dict(self):
        return {"residuals": [r.clone() for r in self.residuals],
                "momenta": [m.clone() if m is not None else None for m in self.momenta]}

    def load_state_dict(self, state):
        for dst, src in zip(self.residuals, state["residuals"]):
            dst.copy_(src)
        for dst, src in zip(self.momenta, state["momenta"]):
            if dst is not None and src is not None:
                dst.copy_(src)


def _slices(buffers, buckets):
    """Per bucket, the flat slice of its buffer that each of its tensors occupies (None: no buffer)."""
    return [None if t is None else [t[lo:lo + p.numel()] for lo, p in zip(b.offsets, b.params)]
            for t, b in zip(buffers, buckets)]
