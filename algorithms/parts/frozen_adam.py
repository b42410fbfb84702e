"""QAdam's optimizer side (``qadam``): Adam's update from the ranks' averaged momentum and a frozen v, on
the user's own ``torch.optim.Adam`` or ``AdamW`` and its state.

    m_local <- beta1 * m + (1 - beta1) * g        (g plus wd * x for Adam's coupled decay)  local_momentum
    m <- the averaged m_local;  t <- t + 1;  x <- x * (1 - lr * wd) (AdamW only)             step
    x <- x - lr * clip(m / (1 - beta1^t) / (sqrt(v_hat) + eps), B)

v_hat = v / (1 - beta2^T): v bias-corrected once, at the freeze (T = Adam steps taken so far), then
constant. (Keeping Adam's 1 - beta2^t correction on a frozen v would shrink the denominator as t grows
and inflate every step, up to sqrt(1 / (1 - beta2^T)) times: 4.5x for T = 50.)
B = max(1, (1 - beta1) / sqrt(1 - beta2)): no coordinate steps further than Adam itself ever can
(Kingma & Ba 2015, section 2.1); a frozen v that was ~0 during warm-up would otherwise divide by eps.
"""
import torch

from bagua_lite.bucket import host_read


class FrozenAdam:
    def __init__(self, opt, params):
        """``opt``: the model's optimizer (checked here); ``params``: the parameters whose momentum travels, in
        the same order on every rank."""
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(f"qadam: the optimizer must be torch.optim.Adam or torch.optim.AdamW, got "
                            f"{type(opt).__name__} ({type(opt).__module__}.{type(opt).__qualname__})")
        for i, group in enumerate(opt.param_groups):
            for flag in ("amsgrad", "maximize"):
                if group.get(flag, False):
                    raise ValueError(f"qadam: param group {i} has {flag}=True; qadam supports neither amsgrad "
                                     f"nor maximize (set them False)")
        self.opt = opt
        params = list(params)
        members = set(params)
        self.groups = {p: g for g in opt.param_groups for p in g["params"] if p in members}
        # A parameter with no Adam state at the freeze (no gradient on any rank during the warm-up) gets it
        # from an ordinary Adam step afterwards; its v is bias-corrected when it is frozen, at its next step.
        # 1 here from that Adam step until then (the algorithm's state: a checkpoint in between resumes it;
        # the same on every rank, as Adam's state is).
        self._index = {p: i for i, p in enumerate(params)}
        self.joining = torch.zeros(len(params), dtype=torch.uint8)
        # sqrt(v_hat) + eps per parameter, made once at the freeze (v is constant afterwards), and one
        # scratch buffer for the step: nothing of the model's size is allocated per step
        self._denoms = {}
        self._scratch = {}
        # param -> (its optimizer step tensor, the count it holds), for a plain Adam: its step is read once (at
        # the freeze; again when the tensor is another: a load_state_dict), then counted here as this class
        # advances it. A fused or capturable Adam keeps the count on the device, where a read would be a host
        # synchronisation: param -> (that tensor, an fp64 copy there), advanced with it (_count_on_device).
        self._steps = {}
        self._counts = {}
        for p in params:
            key = (p.dtype, p.device)
            if key not in self._scratch or self._scratch[key].numel() < p.numel():
                self._scratch[key] = torch.empty(p.numel(), dtype=p.dtype, device=p.device)

    def local_momentum(self, p, m):
        """m (holding g) <- this rank's m_local; left as g if p has no Adam state yet (no rank used it during
        warm-up, or it is not in the optimizer): its gradient travels, and torch's Adam steps it."""
        group = self.groups.get(p)
        if group is None or "exp_avg_sq" not in self.opt.state.get(p, {}):
            return
        if group["weight_decay"] and not self._decoupled(group):
            m.add_(p.detach(), alpha=group["weight_decay"])  # Adam's coupled decay: g + wd * x
        beta1 = float(group["betas"][0])
        m.mul_(1 - beta1).add_(self._state(p)["exp_avg"], alpha=beta1)  # m_local

    def step(self, freeze: bool, found_inf=None, grad_scale=None):
        """The update for every parameter with Adam state, from the averaged momentum in ``.grad``, which is
        then set to None so that torch's step skips it. ``freeze``: the first step after warm-up.
        ``found_inf``, ``grad_scale``: what a fused Adam was given for this step (a round whose verdict stayed
        on the device, a GradScaler's step): skipped where ``found_inf`` is set, and ``.grad`` at the scale
        ``grad_scale`` (the scaler left it scaled, for the fused kernel to unscale), as that Adam's own step."""
        if freeze and not any("exp_avg_sq" in self.opt.state.get(p, {}) for p in self.groups):
            self._took_steps(0)  # (a plain Adam whose every warm-up step a GradScaler skipped has no state)
        for p in self.groups:
            if p.grad is not None and "exp_avg_sq" not in self.opt.state.get(p, {}):
                self.joining[self._index[p]] = 1  # Adam's own step below makes its state
        with torch.no_grad():
            for group in self.opt.param_groups:
                ps = [p for p in group["params"] if p.grad is not None and p in self.groups
                      and "exp_avg_sq" in self.opt.state.get(p, {})]  # (else: Adam's own step on the average)
                if not ps:
                    continue
                if grad_scale is not None:  # 1 / scale in fp32, as the scaler's unscale_ makes it
                    torch._foreach_mul_([p.grad for p in ps], grad_scale.double().reciprocal().float())
                if group.get("fused") or group.get("capturable"):
                    self._step_on_device(group, ps, freeze, found_inf)
                elif found_inf is None or not host_read(found_inf)[0]:
                    self._step_on_host(group, ps, freeze)
                for p in ps:
                    p.grad = None  # torch's Adam.step skips it

    def _step_on_host(self, group, ps, freeze):
        """Adam's ``step`` counts held on the host: the bias corrections are host floats."""
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        beta1, beta2 = (float(b) for b in group["betas"])
        states = [self._state(p) for p in ps]
        counts = [self._count(p, state["step"]) for p, state in zip(ps, states)]
        if freeze:
            self._took_steps(min(counts))
        for p, state, taken in zip(ps, states, counts):
            state["exp_avg"].copy_(p.grad)  # the averaged momentum, same on every rank
            if freeze or p not in self._denoms:  # the freeze, a parameter frozen late, or a resume
                if self._freezes(p, freeze):
                    state["exp_avg_sq"].div_(1 - beta2 ** float(taken))
                self._denoms[p] = state["exp_avg_sq"].sqrt().add_(eps)
            state["step"] += 1  # in place on a tensor: on its device
            self._steps[p] = (state["step"], taken + 1)
            t = float(taken + 1)
            if wd and self._decoupled(group):
                p.mul_(1 - lr * wd)
            # m_hat / (sqrt(v_hat) + eps), at most Adam's own largest step: B = max(1, (1 - beta1) /
            # sqrt(1 - beta2)) (Kingma & Ba, section 2.1). A live v keeps Adam under it; a frozen one
            # does not: a coordinate whose gradient was ~0 during warm-up (a ReLU unit not yet
            # active) would later step m / eps, up to 1e8 x lr, and the model blows up.
            ratio = self._ratio(p, state)
            bound = self._bound(beta1, beta2) * (1 - beta1 ** t)
            ratio.clamp_(-bound, bound)
            p.add_(ratio, alpha=-lr / (1 - beta1 ** t))

    def _step_on_device(self, group, ps, freeze, found_inf):
        """A fused or capturable Adam keeps ``step`` on the device, where every read would be a host
        synchronisation: the same update with its bias corrections made there, in fp64 from a copy of each
        count kept beside it (so on a CPU they are the host path's bit for bit), a few kernels per param
        group; the counts are read once, at the freeze, to refuse a warm-up in which Adam never stepped.
        Where ``found_inf`` is set nothing changes (weights, m, step), as in the fused Adam's own skipped
        step; v is frozen either way."""
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        beta1, beta2 = (float(b) for b in group["betas"])
        states = [self._state(p) for p in ps]
        steps = [s["step"] for s in states]
        counts = [self._count_on_device(p, step) for p, step in zip(ps, steps)]
        if freeze:  # the run's one read of the counts
            self._took_steps(int(host_read(torch.stack(counts).min())[0]))
        for p, state, taken in zip(ps, states, counts):
            if freeze or p not in self._denoms:  # the freeze, a parameter frozen late, or a resume
                if self._freezes(p, freeze):
                    # (a late parameter whose Adam step was skipped has v = 0 at count 0: divided by 1, not 0)
                    bc2 = torch.pow(beta2, taken).neg_().add_(1)
                    state["exp_avg_sq"].div_(bc2 if freeze else torch.where(taken == 0, 1.0, bc2))
                self._denoms[p] = state["exp_avg_sq"].sqrt().add_(eps)
        bc1 = torch._foreach_pow(beta1, torch._foreach_add(counts, 1))  # 1 - beta1^t, t = this step's count
        torch._foreach_neg_(bc1)
        torch._foreach_add_(bc1, 1)
        hi = torch._foreach_mul(bc1, self._bound(beta1, beta2))
        lo = torch._foreach_neg(hi)
        scale = torch._foreach_div([torch.full_like(counts[0], -lr)] * len(ps), bc1)  # 0 where skipped
        decay, skip, advance = 1 - lr * wd, None, 1
        if found_inf is not None:
            skip = found_inf != 0
            advance = torch.logical_not(skip).float()
            torch._foreach_mul_(scale, advance)
            decay = torch.where(skip, 1.0, decay)
        torch._foreach_add_(steps, advance)
        torch._foreach_add_(counts, advance)
        for i, (p, state) in enumerate(zip(ps, states)):
            if skip is None:
                state["exp_avg"].copy_(p.grad)  # the averaged momentum, same on every rank
            else:  # a skipped round's .grad may hold inf/NaN: m stays
                torch.where(skip, state["exp_avg"], p.grad, out=state["exp_avg"])
            if wd and self._decoupled(group):
                p.mul_(decay)
            ratio = self._ratio(p, state)  # finite where skipped (the kept m): times a scale of 0
            ratio.clamp_(lo[i], hi[i])
            p.addcmul_(ratio, scale[i])

    def _freezes(self, p, freeze):
        """Whether p's v is bias-corrected now: at the freeze, or at the first frozen step of a parameter whose
        Adam state began after it (else its v was corrected before a checkpoint this run resumed)."""
        i = self._index[p]
        late = bool(self.joining[i])
        self.joining[i] = 0
        return freeze or late

    @staticmethod
    def _took_steps(taken):
        """At the freeze: Adam's state holds a second moment only if Adam took a step (a fused Adam makes its
        state in a step it then skips: a GradScaler's overflow, a non-finite round), else v is 0 and v_hat
        0 / 0."""
        if taken == 0:
            raise RuntimeError("qadam: Adam took no step during the warm-up (every warm-up step was skipped: a "
                               "GradScaler's overflow or a non-finite gradient), so it has no second moment to "
                               "freeze; raise warmup_steps (nothing was changed at this step)")

    def _count_on_device(self, p, step):
        """An fp64 copy of ``step`` (the optimizer's count of p, a device tensor), made once (again when the
        tensor is another: a load_state_dict) and advanced with it."""
        known = self._counts.get(p)
        if known is None or known[0] is not step:
            known = self._counts[p] = (step, step.detach().to(torch.float64))
        return known[1]

    def _ratio(self, p, state):
        """m / (sqrt(v_hat) + eps) in the step's scratch buffer."""
        ratio = self._scratch[(p.dtype, p.device)][:p.numel()].view_as(p)
        return torch.div(state["exp_avg"], self._denoms[p], out=ratio)

    @staticmethod
    def _bound(beta1, beta2):
        return max(1.0, (1 - beta1) / (1 - beta2) ** 0.5)

    def _count(self, p, step):
        """The Adam steps ``step`` (the optimizer's count of p) holds: this class's own count of it while it is
        the tensor advanced last, else read (one host read)."""
        known = self._steps.get(p)
        if known is not None and known[0] is step:
            return known[1]
        return int(host_read(step)[0]) if isinstance(step, torch.Tensor) else int(step)

    def _decoupled(self, group):
        return group.get("decoupled_weight_decay", isinstance(self.opt, torch.optim.AdamW))

    def _state(self, p):
        state = self.opt.state.get(p, {})
        if "exp_avg_sq" not in state:
            raise RuntimeError(f"qadam: a parameter of shape {tuple(p.shape)} has no Adam state after warm-up "
                               f"(it needs at least one optimizer step with a gradient during warm-up)")
        return state
