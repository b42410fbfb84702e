"""What Top-k and gTop-k share: error-feedback memory, a density schedule, DGC momentum correction.

Per bucket and step (flat gradient g of n elements, k = density * n):
    u' <- m * u + g               (momentum correction, if enabled; else u' = g)   } per parameter, as
    acc <- residual + u'          (error feedback: what was not sent before)       } autograd produces it
    V, I <- topk(acc, k)          (local selection; the rest runs on the engine thread)
    aggregate(V, I, acc, g)       (the subclass: how the selection travels; writes the average into g
                                   and removes what was sent from acc, which becomes the residual)
acc and u' are working copies (double buffers, swapped in when the round is committed): if any rank's
gradient was non-finite the round is discarded and residual and u stay exactly as they were. A rank's
non-finite gradient never enters acc (checked in the same pass that adds it), so the kernels see finite
values and the exchange completes on every rank.
"""
from typing import List, Sequence

import torch

from bagua_lite import _C, kernels
from bagua_lite.algorithm import Algorithm


class ErrorFeedbackSparsifier(Algorithm):
    def __init__(self, density: float = 0.001, warmup_densities: Sequence[float] = (),
                 warmup_steps_per_stage: int = 0, momentum_correction: float = 0.0):
        super().__init__()
        if not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"{self.name}: density must be in (0, 1], got {density!r}")
        for d in warmup_densities:
            if not isinstance(d, (int, float)) or isinstance(d, bool) or not 0 < d <= 1:
                raise ValueError(f"{self.name}: every warmup_densities entry must be in (0, 1], got {d!r}")
        if warmup_steps_per_stage < 0:
            raise ValueError(f"{self.name}: warmup_steps_per_stage must be >= 0, got {warmup_steps_per_stage}")
        if not 0 <= momentum_correction < 1:
            raise ValueError(f"{self.name}: momentum_correction must be in [0, 1), got {momentum_correction}")
        self.density = float(density)
        self.warmup_densities: List[float] = [float(d) for d in warmup_densities]
        self.warmup_steps_per_stage = warmup_steps_per_stage
        self.momentum_correction = float(momentum_correction)

    @property
    def step_dependent_wire(self):
        return bool(self.warmup_densities) and self.warmup_steps_per_stage > 0  # k follows the schedule

    def current_density(self) -> float:
        """The schedule: each warm-up density for ``warmup_steps_per_stage`` steps, then the target."""
        if self.warmup_steps_per_stage > 0:
            stage = self.step // self.warmup_steps_per_stage
            if stage < len(self.warmup_densities):
                return self.warmup_densities[stage]
        return self.density

    def k_for(self, bucket) -> int:
        return max(1, min(bucket.numel, int(round(self.current_density() * bucket.numel))))

    def init(self, model):
        self.residuals = [torch.zeros_like(b.flat) for b in model.buckets]
        self.momenta = [torch.zeros_like(b.flat) if self.momentum_correction else None for b in model.buckets]
        self._acc = [torch.zeros_like(b.flat) for b in model.buckets]  # this round's residual + u'
        self._u = [torch.zeros_like(b.flat) if self.momentum_correction else None for b in model.buckets]
        kmax = max(max(1, int(round(max([self.density] + self.warmup_densities) * b.numel))) for b in model.buckets)
        self._values = torch.empty(kmax, dtype=model.buckets[0].dtype)
        self._indices = torch.empty(kmax, dtype=torch.int32)
        # Between steps a bucket holds only the last sparse result; remembering where it wrote lets
        # the next step clear k entries instead of the whole bucket (None: clear everything).
        self._written = [None] * len(model.buckets)

    def clear_result(self, flat, bucket_index):
        """Zero the bucket cheaply: only the entries the previous step's result wrote."""
        prev = self._written[bucket_index]
        if prev is None:
            flat.zero_()
        else:
            kernels.ef_remove_(flat, prev)

    def on_gradient(self, bucket, position, grad):
        """Error feedback straight from autograd: acc = residual + g (or u' = m*u + g; acc = residual + u'),
        one pass into the working copy, no copy into the bucket (the bucket only ever holds the aggregated
        sparse result). A non-finite g is not added (acc = residual) and the bucket is marked."""
        lo = bucket.offsets[position]
        hi = lo + bucket.params[position].numel()
        b = bucket.index
        residual, acc = self.residuals[b][lo:hi], self._acc[b][lo:hi]
        g = None if grad is None else grad.reshape(-1)
        if grad is not None and grad.data_ptr() == bucket.view(position).data_ptr():
            # autograd accumulated into the bucket slot itself (no_sync with zero_grad(set_to_none=False)):
            # after it is added below, the slot no longer holds only last step's sparse result.
            self._written[b] = None
        if self.momentum_correction:
            if g is not None and not _C.all_finite(g):
                self.nonfinite_buckets.add(b)
                g = None
            u, u_new = self.momenta[b][lo:hi], self._u[b][lo:hi]
            if g is not None:
                torch.add(g, u, alpha=self.momentum_correction, out=u_new)
            else:
                torch.mul(u, self.momentum_correction, out=u_new)
            torch.add(residual, u_new, out=acc)
        elif g is None:
            acc.copy_(residual)
        elif not _C.add_checked(acc, residual, g):  # acc = residual + g, or residual if g holds inf/NaN
            self.nonfinite_buckets.add(b)

    def bucket_ops(self, bucket):
        if bucket.numel == 0:  # zero-size parameters only: nothing to select or send (the same on every rank)
            return []

        def sparsify_and_aggregate(flat, b=bucket):
            acc = self._acc[b.index]  # gradient + old residual (on_gradient)
            k = self.k_for(b)
            values, indices = self._values[:k], self._indices[:k]
            kernels.topk_out(acc, k, values, indices)
            sent = self.aggregate(values, indices, acc, flat, b)
            if self.momentum_correction:
                kernels.ef_remove_(self._u[b.index], sent)
        sparsify_and_aggregate.__name__ = f"{self.name}_bucket{bucket.index}"
        return [sparsify_and_aggregate]

    def aggregate(self, values, indices, acc, flat, bucket) -> torch.Tensor:
        """Exchange the selection, write the averaged sparse gradient into ``flat`` (``clear_result``
        first), remove what was sent from ``acc`` (it stays as the residual); return the indices removed."""
        raise NotImplementedError

    def commit_round(self):
        """The working copies become the state (a swap, no copy)."""
        self.residuals, self._acc = self._acc, self.residuals
        if self.momentum_correction:
            self.momenta, self._u = self._u, self.momenta

    def discard_round(self):
        self._written = [None] * len(self._written)  # the framework overwrites the buckets (NaN)

    def state_dict(self):
        return {"step": self.step, "residuals": [r.clone() for r in self.residuals],
                "momenta": [m.clone() if m is not None else None for m in self.momenta]}

    def load_state_dict(self, state):
        self.step = int(state["step"])
        for dst, src in zip(self.residuals, state["residuals"]):
            dst.copy_(src)
        for dst, src in zip(self.momenta, state["momenta"]):
            if dst is not None and src is not None:
                dst.copy_(src)
