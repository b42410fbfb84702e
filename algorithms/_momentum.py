"""Momentum correction (Lin et al., DGC, ICLR'18), the optimizer's side of Top-k and gTop-k (``_sparse``).

On by default: with ``torch.optim.SGD`` and momentum m, the momentum (and the weight decay) are applied by
the sparsifier before the selection, u' <- m * u + g + wd * w, and the optimizer's own are suspended during
each ``optimizer.step()`` (its param groups read as the user set them at any other time). Every gradient
then contributes its whole momentum-weighted sum, only later for entries that wait in the residual: at
density 1 this is exactly SGD with momentum. Without it (``momentum_correction=0``) the optimizer's
momentum acts on the sparse averages, and gtopk at density 0.01 ends 3 points below dense on digits. DGC
also zeroes u where entries were sent ("momentum factor masking"); we do not: on digits at P = 4 (6 seeds)
masking cost 0.3-1.0 points for gtopk and topk, and it turns density 1 into SGD without momentum.

The optimizer's step then only applies w -= lr * g, and g is zero except where the sparse result wrote:
the update is applied at those k entries (``_C.sparse_sgd_step_``) and those parameters' ``.grad`` are
hidden from the optimizer inside its step, instead of the optimizer's pass over every weight (reading w
and g, writing w: on a CPU a third of a sparse step's memory traffic; mlp25m, 1 Gbit/s, P = 4, alternating
runs: topk 0.317 -> 0.290 s/step, gtopk 0.305 -> 0.285, medians). A gradient modified in place after
backward (clipping, a loss scaler's unscale) is refused; one replaced keeps the optimizer's dense step.
"""
import torch

from bagua_lite import _C
from bagua_lite.bucket import refuse_changed

OPTIMIZER = "optimizer"  # momentum_correction's default (None means it too): the optimizer's momentum and decay


def check(who, setting):
    """The option ``momentum_correction`` as used: ``OPTIMIZER`` (also for None) or a float in [0, 1)."""
    if setting is None or setting == OPTIMIZER:
        return OPTIMIZER
    if not isinstance(setting, (int, float)) or isinstance(setting, bool) or not 0 <= setting < 1:
        raise ValueError(f"{who}: momentum_correction must be {OPTIMIZER!r} (the default: the SGD optimizer's "
                         f"momentum) or a number in [0, 1), got {setting!r}")
    return float(setting)


class MomentumCorrection:
    """``setting``: ``OPTIMIZER`` (the SGD optimizer's momentum and decay) or m (for every tensor, no decay)."""

    def __init__(self, who, setting):
        self.who, self.setting = who, setting

    def resolve(self, model):
        """``suspended`` lists the SGD param groups with momentum, whose momentum and weight decay are applied
        by the sparsifier and suspended during the step; ``group[bucket][pos]`` is a tensor's group index
        among them (None: no correction). The groups are read live by index, so schedules and
        ``load_state_dict`` (which replaces the group dicts) are followed. ``active``: u is kept."""
        self.model, opt, mc = model, model.optimizer, self.setting
        self.suspended = []
        if mc == OPTIMIZER and isinstance(opt, torch.optim.SGD):
            for i, g in enumerate(opt.param_groups):
                if not g.get("momentum"):
                    continue
                for key, plain in (("nesterov", False), ("dampening", 0), ("maximize", False)):
                    if g.get(key, plain) != plain:
                        raise ValueError(
                            f"{self.who}: momentum_correction takes the SGD optimizer's momentum, but param "
                            f"group {i} sets {key}={g[key]!r}, which it does not apply; use {key}={plain}, or "
                            f"momentum_correction: 0 to leave the momentum to the optimizer (it then acts on "
                            f"the sparse averages)")
                self.suspended.append(i)
        elif mc != OPTIMIZER and mc > 0:
            bad = next((i for i, g in enumerate(opt.param_groups) if g.get("momentum")), None)
            if bad is not None:
                raise ValueError(
                    f"{self.who}: momentum_correction={mc} and the optimizer's param group {bad} has momentum "
                    f"{opt.param_groups[bad]['momentum']}: momentum would be applied twice. Use momentum_correction: "
                    f"{OPTIMIZER} (the default: the algorithm takes the optimizer's momentum) or an optimizer "
                    f"without momentum")
        group_of = {id(p): i for i in self.suspended for p in opt.param_groups[i]["params"]}
        self.group = [[group_of.get(id(p)) for p in b.params] for b in model.buckets]
        self.active = bool(self.suspended) if mc == OPTIMIZER else mc > 0
        self._saved = None
        self._committed = None  # [the .grad objects] per bucket after the round, or None
        self._hidden = []       # (param, its .grad) set aside during the optimizer's step

    def momentum_and_decay(self, bucket, position):
        """(m, wd) of tensor ``position`` of bucket ``bucket``."""
        if self.setting != OPTIMIZER:
            return self.setting, 0.0
        i = self.group[bucket][position]
        if i is None:
            return 0.0, 0.0
        g = self.model.optimizer.param_groups[i]
        return g["momentum"], g["weight_decay"]

    def commit(self, written):
        """The round is kept: what the step may apply sparsely, if it is still this when the step comes
        (``written``: per bucket, the entries the sparse result wrote)."""
        if self.suspended:
            self._committed = [[p.grad for p in b.params] for b in self.model.buckets]
            for b, w in zip(self.model.buckets, written):
                b.seal(w)

    def before_step(self, written):
        """The optimizer applies the (already corrected) update without momentum or decay, and for the
        parameters whose sparse result is untouched, not at all: ``_sparse_step`` did it."""
        opt = self.model.optimizer
        self.restore()  # a step that raised after the last suspend (its after_step never ran)
        if not self.suspended:
            return
        if self._committed is not None:
            # (a loss scaler's unscale_ would also leave residuals and momenta at the old scale)
            corrected = [b for b in self.model.buckets if any(gi is not None for gi in self.group[b.index])]
            refuse_changed(self.who, corrected, "With momentum correction (the default with SGD momentum) .grad "
                           "holds the momentum-corrected sparse update", "set momentum_correction: 0 (then .grad is "
                           "the sparse average of gradient plus residual and clipping clips that) or drop the change",
                           self.model.grad_scaler)
        groups = [opt.param_groups[i] for i in self.suspended]
        self._saved = [(g["momentum"], g["weight_decay"]) for g in groups]
        for g in groups:
            g["momentum"], g["weight_decay"] = 0.0, 0.0
        self._sparse_step(opt, written)

    def _sparse_step(self, opt, written):
        """w -= lr * g at the entries written, O(k), exactly the optimizer's update with momentum and decay
        suspended; a ``.grad`` replaced keeps the optimizer's dense step, and so does a second step()."""
        committed, self._committed = self._committed, None
        for b, grads in zip(self.model.buckets, committed or ()):
            idx = written[b.index]
            if idx is None or b.flat.device.type != "cpu":  # the O(k) kernel is the CPU's: elsewhere the
                continue  # optimizer's dense step, the same update (g is zero off the written entries)
            params, offsets, lrs = [], [], []
            for j, (p, g) in enumerate(zip(b.params, grads)):
                gi = self.group[b.index][j]
                if gi is None or g is None or p.grad is not g:
                    continue
                params.append(p.detach())
                offsets.append(b.offsets[j])
                lrs.append(float(opt.param_groups[gi]["lr"]))
                self._hidden.append((p, g))
            if params:
                _C.sparse_sgd_step_(params, offsets, b.flat, idx, lrs)
        if self._hidden:
            torch.autograd.graph.increment_version([p for p, _ in self._hidden])  # as the optimizer's would
            for p, _ in self._hidden:
                p.grad = None

    def restore(self, forget: bool = False):
        """After the step (or a step that raised): ``.grad`` and the param groups read as the user set them
        (``forget``: the kept round's sparse step goes too, as after a lost peer)."""
        self._committed = None if forget else self._committed
        for p, g in self._hidden:
            p.grad = g
        self._hidden = []
        if self._saved is not None:
            opt = self.model.optimizer
            for i, (m, wd) in zip(self.suspended, self._saved):
                opt.param_groups[i]["momentum"], opt.param_groups[i]["weight_decay"] = m, wd
            self._saved = None
