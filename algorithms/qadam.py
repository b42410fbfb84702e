"""QAdam / 1-bit Adam (Tang et al. 2021; BAGUA's q_adam): Adam whose momentum, not its gradient, travels
compressed once Adam's second moment has settled and been frozen. The optimizer is the user's own
``torch.optim.Adam`` or ``AdamW``; with g the local gradient (plus wd * x for Adam's coupled decay)::

    step < warmup_steps:   g <- mean over ranks of g;  Adam's own step (m and v both updated)
    afterwards (v frozen): m_local <- beta1 * m + (1 - beta1) * g            # in the bucket, per rank
                           m <- compressed_mean(m_local; error feedback e)     # e per bucket, kept here
                           t <- t + 1;  x <- x * (1 - lr * wd)                 # AdamW only
                           x <- x - lr * clip(m / (1 - beta1^t) / (sqrt(v_hat) + eps), B)
    v_hat = v / (1 - beta2^T): v bias-corrected once, at the freeze (T = Adam steps taken so far), then
    constant. (Keeping Adam's 1 - beta2^t correction on a frozen v would shrink the denominator as t
    grows and inflate every step, up to sqrt(1 / (1 - beta2^T)) times: 4.5x for T = 50.)
    B = max(1, (1 - beta1) / sqrt(1 - beta2)): no coordinate steps further than Adam itself ever can
    (Kingma & Ba 2015, section 2.1); a frozen v that was ~0 during warm-up would otherwise divide by eps.

m is identical on every rank (it is the previous step's averaged momentum), so the replicas stay
identical. The post-warm-up update runs in an optimizer step pre-hook, which then sets ``.grad`` to None
so that torch's step skips the parameter. ``compression``: any registered compressor (not ``none``); the
framework's error-feedback residual keeps what it lost, on the sender's side only (1-bit Adam also keeps
one on the reducer's side). Steps after warm-up need a synchronised backward before ``optimizer.step()``.
The default is ``fp16``: its error is relative to each value, while ``minmax_uint8`` (half the bytes; BAGUA's
choice) errs by up to half a step of the bucket's range on every coordinate, and a coordinate whose frozen
v is tiny divides that by sqrt(v): on scikit-learn's digits (pixels that are almost always blank) the
model diverges with it. Use it where every coordinate's v is well away from 0.
"""
import torch

from bagua_lite import comm, compressors
from bagua_lite import cost_model as cm
from bagua_lite.algorithm import Algorithm, register


@register("qadam")
class QAdam(Algorithm):
    #: the optimizers it works with (bagua_lite.demo gives it Adam; in the benchmark set optimizer: adam)
    optimizer_kinds = ("adam", "adamw")

    def __init__(self, warmup_steps: int = 100, compression: str = "fp16"):
        super().__init__()
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 1:
            raise ValueError(f"qadam: warmup_steps must be an int >= 1 (Adam's second moment is estimated "
                             f"during warm-up, then frozen), got {warmup_steps!r}")
        if compression is None or compression == "none":
            raise ValueError(f"qadam: compression must be a compressor, got {compression!r}; choose one of "
                             + ", ".join(repr(n) for n in compressors.registered_compressors() if n != "none"))
        self.compressor = compressors.get_compressor(compression, "qadam")
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

    def init(self, model):
        opt = model.optimizer
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(f"qadam: the optimizer must be torch.optim.Adam or torch.optim.AdamW, got "
                            f"{type(opt).__name__} ({type(opt).__module__}.{type(opt).__qualname__})")
        for i, group in enumerate(opt.param_groups):
            for flag in ("amsgrad", "maximize"):
                if group.get(flag, False):
                    raise ValueError(f"qadam: param group {i} has {flag}=True; qadam supports neither amsgrad "
                                     f"nor maximize (set them False)")
        mine = {p for b in model.buckets for p in b.params}
        self._groups = {p: g for g in opt.param_groups for p in g["params"] if p in mine}
        self.residuals = [torch.zeros_like(b.flat) for b in model.buckets]
        # checkpointed, and as before the round if it is discarded (a rank's gradient was non-finite)
        self.register_state("residuals", self.residuals, rollback=True)
        # sqrt(v_hat) + eps per parameter, made once at the freeze (v is constant afterwards), and one
        # scratch buffer for the step: nothing of the model's size is allocated per step
        self._denoms = {}
        self._scratch = {}
        for p in mine:
            key = (p.dtype, p.device)
            if key not in self._scratch or self._scratch[key].numel() < p.numel():
                self._scratch[key] = torch.empty(p.numel(), dtype=p.dtype, device=p.device)

    def bucket_ops(self, bucket):
        pg, residual = self.process_group, self.residuals[bucket.index]
        dense = self.native.AllreduceOp(pg, False).run  # warm-up: pre-scaled by 1/P in on_gradient
        if self.compressor.native:
            compressed = self.native.CompressedAllreduceOp(pg, self.compressor.name, True, residual).run
        else:
            def compressed(flat):  # a user's Python compressor
                comm.compressed_allreduce(flat, self.compressor, group=pg, residual=residual)

        def qadam_allreduce(flat, b=bucket.index):  # Op.run releases the GIL for the collective
            if self.step < self.warmup_steps:
                return dense(flat)
            if b in self.nonfinite_buckets:  # the round is discarded on every rank: travel as zeros
                flat.zero_()
            compressed(flat)
        return [qadam_allreduce]

    def on_gradient(self, bucket, position, grad):
        if self.step < self.warmup_steps:  # gradient averaging, as gradient_allreduce
            return self.fill(bucket, position, grad, 1.0 / self.world_size)
        p, m = bucket.params[position], bucket.view(position)
        self.fill(bucket, position, grad)  # g (zeros if this rank got none)
        group = self._groups.get(p)
        if group is None or "exp_avg_sq" not in self.model.optimizer.state.get(p, {}):
            # not in the optimizer, or no Adam state yet (no rank used it during warm-up): its gradient
            # travels as it is, and torch's Adam steps it from the average
            return
        if group["weight_decay"] and not self._decoupled(group):
            m.add_(p.detach(), alpha=group["weight_decay"])  # Adam's coupled decay: g + wd * x
        beta1 = float(group["betas"][0])
        m.mul_(1 - beta1).add_(self._state(p)["exp_avg"], alpha=beta1)  # m_local

    def commit_round(self):
        self._synced = True
        if self.step >= self.warmup_steps:
            for b in self.model.buckets:
                b.seal()

    def before_step(self):
        """After warm-up, Adam's update from the averaged momentum and the frozen v."""
        optimizer = self.model.optimizer
        synced, self._synced = self._synced, False
        if self.step < self.warmup_steps:
            return
        if not synced:
            raise RuntimeError("qadam: after warm-up every optimizer.step() needs a synchronised backward "
                               "first (its momentum is what the ranks exchange)")
        if any(b.changed() for b in self.model.buckets):
            raise RuntimeError(
                "qadam: .grad was changed in place between backward and optimizer.step() (torch.nn.utils."
                "clip_grad_norm_/clip_grad_value_, GradScaler's unscale_, or your own edit). After the warm-up "
                ".grad holds the ranks' averaged Adam momentum, not a gradient, so clipping or rescaling it "
                "is not what it does under DDP; leave .grad as backward left it")
        with torch.no_grad():
            for group in optimizer.param_groups:
                lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
                beta1, beta2 = (float(b) for b in group["betas"])
                for p in group["params"]:
                    if p.grad is None or p not in self._groups or "exp_avg_sq" not in optimizer.state.get(p, {}):
                        continue  # (no Adam state yet: an ordinary Adam step on the averaged gradient)
                    state = self._state(p)
                    state["exp_avg"].copy_(p.grad)  # the averaged momentum, same on every rank
                    if self.step == self.warmup_steps or p not in self._denoms:  # the freeze (or a resume)
                        if self.step == self.warmup_steps:
                            state["exp_avg_sq"].div_(1 - beta2 ** float(state["step"]))
                        self._denoms[p] = state["exp_avg_sq"].sqrt().add_(eps)
                    state["step"] += 1
                    t = float(state["step"])
                    if wd and self._decoupled(group):
                        p.mul_(1 - lr * wd)
                    # m_hat / (sqrt(v_hat) + eps), at most Adam's own largest step: B = max(1, (1 - beta1) /
                    # sqrt(1 - beta2)) (Kingma & Ba, section 2.1). A live v keeps Adam under it; a frozen one
                    # does not: a coordinate whose gradient was ~0 during warm-up (a ReLU unit not yet
                    # active) would later step m / eps, up to 1e8 x lr, and the model blows up.
                    ratio = self._scratch[(p.dtype, p.device)][:p.numel()].view_as(p)
                    torch.div(state["exp_avg"], self._denoms[p], out=ratio)
                    bound = max(1.0, (1 - beta1) / (1 - beta2) ** 0.5) * (1 - beta1 ** t)
                    ratio.clamp_(-bound, bound)
                    p.add_(ratio, alpha=-lr / (1 - beta1 ** t))
                    p.grad = None  # torch's Adam.step skips it

    def _decoupled(self, group):
        return group.get("decoupled_weight_decay", isinstance(self.model.optimizer, torch.optim.AdamW))

    def _state(self, p):
        state = self.model.optimizer.state.get(p, {})
        if "exp_avg_sq" not in state:
            raise RuntimeError(f"qadam: a parameter of shape {tuple(p.shape)} has no Adam state after warm-up "
                               f"(it needs at least one optimizer step with a gradient during warm-up)")
        return state
