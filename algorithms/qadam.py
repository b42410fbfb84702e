"""QAdam / 1-bit Adam (Tang et al. 2021; BAGUA's q_adam): Adam whose momentum, not its gradient, travels
compressed once Adam's second moment has settled and been frozen. The optimizer is the user's own
``torch.optim.Adam`` or ``AdamW``; with g the local gradient (plus wd * x for Adam's coupled decay)::

    step < warmup_steps:   g <- mean over ranks of g;  Adam's own step (m and v both updated)
    afterwards (v frozen): m_local <- beta1 * m + (1 - beta1) * g            # in the bucket, per rank
                           m <- compressed_mean(m_local; error feedback e)     # e per bucket, kept here
                           t <- t + 1;  x <- x * (1 - lr * wd)                 # AdamW only
                           x <- x - lr * clip(m / (1 - beta1^t) / (sqrt(v_hat) + eps), B)

with v_hat (v bias-corrected once, at the freeze) and the bound B explained in ``parts.frozen_adam``, which
holds the optimizer's side. m is identical on every rank (it is the previous step's averaged momentum),
so the replicas stay identical. The post-warm-up update runs in an optimizer step pre-hook, which then
sets ``.grad`` to None so that torch's step skips the parameter. ``compression``: any registered
compressor (not ``none``); the framework's error-feedback residual keeps what it lost, on the sender's
side only (1-bit Adam also keeps one on the reducer's side). Steps after warm-up need a synchronised
backward before ``optimizer.step()``. The default is ``fp16``: its error is relative to each value, while
``minmax_uint8`` (half the bytes; BAGUA's choice) errs by up to half a step of the bucket's range on every
coordinate, and a coordinate whose frozen v is tiny divides that by sqrt(v): on scikit-learn's digits
(pixels that are almost always blank) the model diverges with it. Use it where every coordinate's v is
well away from 0.
"""
import torch

from bagua_lite import comm
from bagua_lite import cost_model as cm
from bagua_lite._options import compressor, int_at_least
from bagua_lite.algorithm import Algorithm, register
from bagua_lite.bucket import refuse_changed
from bagua_lite.verdict import scaler_set_found_inf

from .parts.frozen_adam import FrozenAdam


@register("qadam")
class QAdam(Algorithm):
    #: the optimizers it works with (bagua_lite.demo gives it Adam; in the benchmark set optimizer: adam)
    optimizer_kinds = ("adam", "adamw")

    def __init__(self, warmup_steps: int = 100, compression: str = "fp16"):
        super().__init__()
        int_at_least(self.name, "warmup_steps", warmup_steps, 1, " (Adam's second moment is estimated during "
                     "warm-up, then frozen)")
        self.compressor = compressor(self.name, compression)
        self.warmup_steps, self.compression = warmup_steps, compression
        self._synced = False

    @classmethod
    def traffic(cls, o, P, numels, elem_bytes=4, machine=None, rank=None):
        """After the warm-up (dense, as gradient_allreduce): each bucket's momentum through the compressed
        allreduce with a residual, on the engine; the momentum (in the gradient hook) and the update
        (before the step) are 3 passes on the training thread, never hidden."""
        c = o["compression"]
        comms, locals_ = cm.per_bucket(numels, P, lambda n, i: cm.compressed_allreduce(c, P, n, rank),
                                       lambda n, i: cm.compressed_allreduce_s(c, P, n, machine, residual=True), machine)
        serial = 3 * sum(numels) * machine.add_s_per_elem if machine is not None else 0.0
        return cm.Traffic("buckets", comms, locals_, serial_s=serial, warmup=True)

    @property
    def step_dependent_wire(self):
        return self.warmup_steps > 0  # what travels changes when the warm-up ends

    #: fault tolerance: the optimizer's m and frozen v change only in a kept round's step (the same on every
    #: rank, so a joiner takes them from rank 0 with the optimizer's state); the residuals are per rank and
    #: put back with a discarded round
    supports_membership_change = True

    def regroup(self):
        self._synced = False  # the discarded round's

    #: a bad rank's bucket travels as zeros (the codecs reject NaN) and the residuals are put back on the
    #: device where the agreed flags say so; the frozen Adam update skips with the fused Adam's found_inf
    device_verdict = "flags"

    def init(self, model):
        self.adam = FrozenAdam(model.optimizer, [p for b in model.buckets for p in b.params])
        self.residuals = [torch.zeros_like(b.flat) for b in model.buckets]
        # checkpointed, and as before the round if it is discarded (a rank's gradient was non-finite)
        self.register_state("residuals", self.residuals, rollback=True)
        # the parameters whose Adam state began after the freeze, not yet frozen (as Adam's state: on every rank)
        self.register_state("joining", [self.adam.joining], shared=True)

    def bucket_ops(self, bucket):
        pg, residual = self.process_group, self.residuals[bucket.index]
        dense = self.native.AllreduceOp(pg, False).run  # warm-up: pre-scaled by 1/P in on_gradient
        if self.compressor.native:
            compressed = self.native.CompressedAllreduceOp(pg, self.compressor.name, True, residual).run
        else:
            def compressed(flat):  # a user's Python compressor
                comm.compressed_allreduce(flat, self.compressor, group=pg, residual=residual)

        def qadam_allreduce(flat):  # Op.run releases the GIL for the collective
            if self.step < self.warmup_steps:
                return dense(flat)
            if bucket.nonfinite_seen(self.nonfinite_buckets):  # discarded on every rank: zeros
                flat.zero_()
            compressed(flat)
        return [qadam_allreduce]

    def on_gradient(self, bucket, position, grad):
        if self.step < self.warmup_steps:  # gradient averaging, as gradient_allreduce
            return self.fill(bucket, position, grad, 1.0 / self.world_size)
        self.fill(bucket, position, grad)  # g (zeros if this rank got none)
        self.adam.local_momentum(bucket.params[position], bucket.view(position))

    @property
    def grad_holds_update(self) -> bool:
        return self.step >= self.warmup_steps  # .grad: the ranks' averaged Adam momentum

    def commit_round(self):
        self._synced = True
        if self.step >= self.warmup_steps:
            for b in self.model.buckets:
                b.seal()

    def before_step(self):
        """After warm-up, Adam's update from the averaged momentum and the frozen v."""
        synced, self._synced = self._synced, False
        if self.step < self.warmup_steps:
            return
        opt = self.model.optimizer
        if not synced:
            if not scaler_set_found_inf(opt):  # (a found_inf of the model's own comes with a kept round)
                raise RuntimeError("qadam: after warm-up every optimizer.step() needs a synchronised backward "
                                   "first (its momentum is what the ranks exchange)")
            # else a round discarded for inf/NaN that a GradScaler's step() skips on the device (a fused Adam)
        else:  # late: the frozen Adam update below skips with the found_inf a deferred answer joins
            refuse_changed(self.name, self.model, self.model.buckets, "After the warm-up .grad holds the ranks' "
                           "averaged Adam momentum", "leave .grad as backward left it", late=True)
        self.adam.step(freeze=self.step == self.warmup_steps, found_inf=getattr(opt, "found_inf", None),
                       grad_scale=getattr(opt, "grad_scale", None))
