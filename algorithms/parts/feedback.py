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

    def add(self, bucket, position, grad, m=0.0, wd=0.0, block_max=None) -> bool:
        """The pass above for tensor ``position`` of ``bucket`` (``grad`` None: no gradient), raising
        ``block_max`` (if given) to acc's magnitudes on the way. False if ``grad`` held inf/NaN: then it
        was left out (acc = residual, u' = m u)."""
        lo = bucket.offsets[position]
        hi = lo + bucket.params[position].numel()
        b = bucket.index
        residual, acc = self.residuals[b][lo:hi], self.acc[b][lo:hi]
        g = None if grad is None else grad.reshape(-1)
        if self.momentum:
            w = bucket.params[position].detach().reshape(-1) if wd and g is not None else None
            return _C.momentum_add_checked(self._u[b][lo:hi], acc, self.momenta[b][lo:hi], residual, g, m, w, wd,
                                           block_max, lo) or g is None
        if g is None:
            acc.copy_(residual)
            if block_max is not None:
                kernels.block_max_combine_(block_max, acc, lo)
            return True
        return _C.add_checked(acc, residual, g, block_max, lo)  # acc = residual + g, or residual if g is not finite

    def commit(self):
        """The working copies become the state (a swap, no copy)."""
        self.residuals, self.acc = self.acc, self.residuals
        if self.momentum:
            self.momenta, self._u = self._u, self.momenta

    def state_dict(self):
        return {"residuals": [r.clone() for r in self.residuals],
                "momenta": [m.clone() if m is not None else None for m in self.momenta]}

    def load_state_dict(self, state):
        for dst, src in zip(self.residuals, state["residuals"]):
            dst.copy_(src)
        for dst, src in zip(self.momenta, state["momenta"]):
            if dst is not None and src is not None:
                dst.copy_(src)
