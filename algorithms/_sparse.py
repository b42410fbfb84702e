"""What Top-k and gTop-k share: error-feedback memory, a density schedule, momentum correction.

Per bucket and step (flat gradient g of n elements, k = density * n):
    u' <- m * u + g + wd * w     (momentum correction, m and wd the optimizer's; else u' = g)  } per tensor,
    acc <- residual + u'         (error feedback: what was not sent before)                    } as autograd
                                                                                                  produces it
    V, I <- topk(acc, k)         (one selection over the bucket; ``layerwise=True``: k_i = density * n_i
                                  per tensor, at least 1; the rest runs on the engine thread)
    aggregate(V, I, acc, g)      (the subclass: how the selection travels; writes the average into g
                                  and removes what was sent from acc, which becomes the residual)

The pass that writes acc also leaves the largest magnitude of every 64 entries (block maxima), so the
selection reads only the ~k blocks that can hold the top k, not the whole bucket: exactly the same
selection (mlp25m, P = 4, loopback: topk's selections took 9-10 ms of CPU per rank and step, now 2.6-2.8).

Momentum correction (Lin et al., DGC, ICLR'18) is on by default: with ``torch.optim.SGD`` and momentum m,
the momentum (and the weight decay) are applied here, before the selection, and the optimizer's own are
suspended during each ``optimizer.step()`` (its param groups read as the user set them at any other time).
Every gradient then contributes its whole momentum-weighted sum, only later for entries that wait in the
residual: at density 1 this is exactly SGD with momentum. Without it (``momentum_correction=0``) the
optimizer's momentum acts on the sparse averages, and gtopk at density 0.01 ends 3 points below dense
on digits. DGC also zeroes u where entries were sent ("momentum factor masking"); we do not: on digits
at P = 4 (6 seeds) masking cost 0.3-1.0 points for gtopk and topk, and it turns density 1 into SGD
without momentum. Layer-wise selection (DGC's) measured the same as one selection per bucket there, and
costs a selection call per tensor, so it is an option.

The optimizer's step then only applies w -= lr * g, and g is zero except where the sparse result wrote:
with momentum correction the algorithm applies it at those k entries (``_C.sparse_sgd_step_``) and hides
those parameters' ``.grad`` from the optimizer inside its step, instead of the optimizer's pass over every
weight (mlp25m, 1 Gbit/s, P = 4, alternating runs: topk 0.317 -> 0.290 s/step, gtopk 0.305 -> 0.285,
medians). A gradient modified in place after backward (clipping, a loss scaler's unscale) keeps the
optimizer's own dense step.

acc and u' are working copies (double buffers, swapped in when the round is committed): if any rank's
gradient was non-finite the round is discarded and residual and u stay exactly as they were. A rank's
non-finite gradient never enters acc (checked in the same pass that adds it), so the kernels see finite
values and the exchange completes on every rank.
"""
from typing import List, Sequence

import torch

from bagua_lite import _C, kernels
from bagua_lite import cost_model as cm
from bagua_lite.algorithm import Algorithm

OPTIMIZER = "optimizer"  # momentum_correction's default (None means it too): the optimizer's momentum and decay


class ErrorFeedbackSparsifier(Algorithm):
    use_block_max = True  # selection reads only the blocks that can hold the top k (False: the whole bucket)

    def __init__(self, density: float = 0.001, warmup_densities: Sequence[float] = (),
                 warmup_steps_per_stage: int = 0, momentum_correction=None, layerwise: bool = False):
        super().__init__()
        if not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"{self.name}: density must be in (0, 1], got {density!r}")
        for d in warmup_densities:
            if not isinstance(d, (int, float)) or isinstance(d, bool) or not 0 < d <= 1:
                raise ValueError(f"{self.name}: every warmup_densities entry must be in (0, 1], got {d!r}")
        if warmup_steps_per_stage < 0:
            raise ValueError(f"{self.name}: warmup_steps_per_stage must be >= 0, got {warmup_steps_per_stage}")
        if momentum_correction is None:
            momentum_correction = OPTIMIZER
        if momentum_correction != OPTIMIZER and (not isinstance(momentum_correction, (int, float))
                                                 or isinstance(momentum_correction, bool)
                                                 or not 0 <= momentum_correction < 1):
            raise ValueError(f"{self.name}: momentum_correction must be {OPTIMIZER!r} (the default: the SGD "
                             f"optimizer's momentum) or a number in [0, 1), got {momentum_correction!r}")
        if not isinstance(layerwise, bool):
            raise TypeError(f"{self.name}: layerwise must be true or false, got {layerwise!r}")
        self.density = float(density)
        self.warmup_densities: List[float] = [float(d) for d in warmup_densities]
        self.warmup_steps_per_stage = warmup_steps_per_stage
        self.momentum_correction = momentum_correction if momentum_correction == OPTIMIZER else float(momentum_correction)
        self.layerwise = layerwise

    @classmethod
    def traffic(cls, o, P, numels, elem_bytes=4, machine=None, rank=None):
        """Per bucket on the engine, overlapped with backward: the selection of k = density n entries (at
        the bounded rate where the bucket has block maxima: one selection, k at most a quarter of its
        64-entry blocks), error feedback and the output's clearing (2 passes), momentum correction (a
        pass, unless momentum_correction is 0), and the subclass's exchange (``sparse_traffic``)."""
        def comm_(n, i):
            return cls.sparse_traffic(o, P, cm.k_of(o["density"], n), elem_bytes, rank)[0]

        def local(n, i):
            add, k = machine.add_s_per_elem, cm.k_of(o["density"], n)
            mc = 0.0 if o["momentum_correction"] == 0 else n * add
            bounded = machine.topk_bounded_s_per_elem and not o["layerwise"] and 4 * k <= -(-n // 64)
            select = n * (machine.topk_bounded_s_per_elem if bounded else machine.topk_s_per_elem)
            return select + 2 * n * add + mc + cls.sparse_traffic(o, P, k, elem_bytes, rank, machine)[1]
        return cm.Traffic("buckets", *cm.per_bucket(numels, P, comm_, local, machine))

    @classmethod
    def sparse_traffic(cls, o, P, k, elem_bytes, rank, machine=None):
        """(message triple, local seconds after the selection) of exchanging k (value, index) pairs."""
        raise NotImplementedError

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

    def segments(self, bucket, density=None):
        """[(lo, hi, k_i)] of the bucket's selection at ``density`` (default: the current one): one per
        non-empty tensor (layer-wise), or the whole bucket."""
        d = self.current_density() if density is None else density
        key = (bucket.index, d)
        if key not in self._segments:
            spans = ([(lo, lo + p.numel()) for lo, p in zip(bucket.offsets, bucket.params) if p.numel()]
                     if self.layerwise else [(0, bucket.numel)])
            self._segments[key] = [(lo, hi, max(1, min(hi - lo, int(round(d * (hi - lo)))))) for lo, hi in spans]
        return self._segments[key]

    def k_for(self, bucket, density=None) -> int:
        """Entries the bucket selects per rank and step: the sum of its segments' k_i."""
        return sum(k for _, _, k in self.segments(bucket, density))

    def init(self, model):
        self._segments = {}
        self._resolve_momentum(model)
        self.residuals = [torch.zeros_like(b.flat) for b in model.buckets]
        self.momenta = [torch.zeros_like(b.flat) if self._mc else None for b in model.buckets]
        self._acc = [torch.zeros_like(b.flat) for b in model.buckets]  # this round's residual + u'
        self._u = [torch.zeros_like(b.flat) if self._mc else None for b in model.buckets]
        kmax = max(self.k_for(b, d) for b in model.buckets for d in [self.density] + self.warmup_densities)
        # Block maxima of acc (kernels.topk_out's block_max), raised in the pass that writes acc: the
        # selection then reads the ~k blocks of 64 that can hold the top k, not the whole bucket. A bucket's
        # are used only if every one of its tensors was written with them this round (_filled), and are
        # zeroed after each selection. Not with layer-wise segments (they do not align with the blocks).
        self._bmax = [torch.zeros((b.numel + 63) // 64, dtype=torch.int32)
                      if self.use_block_max and not self.layerwise and b.dtype == torch.float32
                      and b.flat.device.type == "cpu" else None for b in model.buckets]
        self._filled = [0] * len(model.buckets)
        self._values = torch.empty(kmax, dtype=model.buckets[0].dtype)
        self._indices = torch.empty(kmax, dtype=torch.int32)
        # Between steps a bucket holds only the last sparse result; remembering where it wrote lets
        # the next step clear k entries instead of the whole bucket (None: clear everything).
        self._written = [None] * len(model.buckets)
        # sparse optimizer step: what the committed round left in the buckets (see _sparse_step)
        self._committed = None  # [the .grad objects] per bucket after the round, or None
        self._hidden = []       # (param, its .grad) set aside during the optimizer's step

    def _resolve_momentum(self, model):
        """Momentum correction's sources. Default (``OPTIMIZER``): ``self._suspended`` lists the SGD param
        groups with momentum, whose momentum and weight decay are applied here and suspended during the
        step; ``self._group[bucket][pos]`` is a tensor's group index among them (None: no correction). The
        groups are read live by index, so schedules and ``load_state_dict`` (which replaces the group
        dicts) are followed. A number m: the same m for every tensor, no weight decay."""
        opt, mc = model.optimizer, self.momentum_correction
        self._suspended = []
        if mc == OPTIMIZER and isinstance(opt, torch.optim.SGD):
            for i, g in enumerate(opt.param_groups):
                if not g.get("momentum"):
                    continue
                for key, plain in (("nesterov", False), ("dampening", 0), ("maximize", False)):
                    if g.get(key, plain) != plain:
                        raise ValueError(
                            f"{self.name}: momentum_correction takes the SGD optimizer's momentum, but param "
                            f"group {i} sets {key}={g[key]!r}, which it does not apply; use {key}={plain}, or "
                            f"momentum_correction: 0 to leave the momentum to the optimizer (it then acts on "
                            f"the sparse averages)")
                self._suspended.append(i)
        elif mc != OPTIMIZER and mc > 0:
            bad = next((i for i, g in enumerate(opt.param_groups) if g.get("momentum")), None)
            if bad is not None:
                raise ValueError(
                    f"{self.name}: momentum_correction={mc} and the optimizer's param group {bad} has momentum "
                    f"{opt.param_groups[bad]['momentum']}: momentum would be applied twice. Use momentum_correction: "
                    f"{OPTIMIZER} (the default: the algorithm takes the optimizer's momentum) or an optimizer "
                    f"without momentum")
        group_of = {id(p): i for i in self._suspended for p in opt.param_groups[i]["params"]}
        self._group = [[group_of.get(id(p)) for p in b.params] for b in model.buckets]
        self._mc = bool(self._suspended) if mc == OPTIMIZER else mc > 0
        self._saved = None

    def _momentum_and_decay(self, bucket, position):
        if self.momentum_correction != OPTIMIZER:
            return self.momentum_correction, 0.0
        i = self._group[bucket][position]
        if i is None:
            return 0.0, 0.0
        g = self.model.optimizer.param_groups[i]
        return g["momentum"], g["weight_decay"]

    def before_step(self):
        """The optimizer applies the (already corrected) update without momentum or decay, and for the
        parameters whose sparse result is untouched, not at all: ``_sparse_step`` did it."""
        opt = self.model.optimizer
        self._restore(opt)  # a step that raised after the last suspend (its after_step never ran)
        if not self._suspended:
            return
        self._refuse_edited_update()
        groups = [opt.param_groups[i] for i in self._suspended]
        self._saved = [(g["momentum"], g["weight_decay"]) for g in groups]
        for g in groups:
            g["momentum"], g["weight_decay"] = 0.0, 0.0
        self._sparse_step(opt)

    def _refuse_edited_update(self):
        """With momentum correction ``.grad`` holds the momentum-corrected sparse update, not a gradient:
        clipping it (``clip_grad_norm_``) is not what DDP clips, and a loss scaler's ``unscale_`` leaves the
        residuals and momenta at the old scale when the scale changes. Either would train differently
        without a word, so a ``.grad`` changed in place between backward and step is refused (every rank
        runs the same code, so every rank refuses)."""
        if self._committed is None:
            return
        for b in self.model.buckets:
            if any(gi is not None for gi in self._group[b.index]) and b.changed():
                raise RuntimeError(
                    f"{self.name}: .grad was changed in place between backward and optimizer.step() "
                    f"(torch.nn.utils.clip_grad_norm_/clip_grad_value_, GradScaler's unscale_, or your own "
                    f"edit). With momentum correction (the default with SGD momentum) .grad holds the "
                    f"momentum-corrected sparse update, so the change would not be DDP's; set "
                    f"momentum_correction: 0 (then .grad is the sparse average of gradient plus residual and "
                    f"clipping clips that) or drop the change")

    def _sparse_step(self, opt):
        """With momentum and decay suspended, SGD's step is w -= lr * g, and this round's g is zero except
        at the entries the sparse result wrote (``_written``): apply it there (``_C.sparse_sgd_step_``, O(k))
        and hide those parameters' ``.grad`` from the optimizer during its step, instead of its pass over
        every weight (reading w and g, writing w: on a CPU a third of a sparse step's memory traffic).
        Exactly the optimizer's update. A ``.grad`` changed in place was refused before this
        (``_refuse_edited_update``); one replaced keeps the optimizer's dense step, and so does a second
        step() on the same gradients."""
        committed, self._committed = self._committed, None
        if committed is None:
            return
        for b, grads in zip(self.model.buckets, committed):
            idx = self._written[b.index]
            if idx is None:
                continue
            params, offsets, lrs = [], [], []
            for j, (p, g) in enumerate(zip(b.params, grads)):
                gi = self._group[b.index][j]
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

    def after_step(self):
        self._restore(self.model.optimizer)

    def _restore(self, opt):
        for p, g in self._hidden:  # the step is over: .grad reads as after backward
            p.grad = g
        self._hidden = []
        if self._saved is not None:
            for i, (m, wd) in zip(self._suspended, self._saved):
                opt.param_groups[i]["momentum"], opt.param_groups[i]["weight_decay"] = m, wd
            self._saved = None

    def close(self):
        self._restore(self.model.optimizer)

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
        bm = self._bmax[b]  # raised to acc's magnitudes in the same pass
        if self._mc:
            # one pass: u' = m u + g (+ wd w), acc = residual + u'; a non-finite g is left out (u' = m u)
            m, wd = self._momentum_and_decay(b, position)
            w = bucket.params[position].detach().reshape(-1) if wd and g is not None else None
            if not _C.momentum_add_checked(self._u[b][lo:hi], acc, self.momenta[b][lo:hi], residual, g, m, w, wd,
                                           bm, lo) and g is not None:
                self.nonfinite_buckets.add(b)
        elif g is None:
            acc.copy_(residual)
            if bm is not None:
                kernels.block_max_combine_(bm, acc, lo)
        elif not _C.add_checked(acc, residual, g, bm, lo):  # acc = residual + g, or residual if g holds inf/NaN
            self.nonfinite_buckets.add(b)
        self._filled[b] += 1

    def bucket_ops(self, bucket):
        if bucket.numel == 0:  # zero-size parameters only: nothing to select or send (the same on every rank)
            return []

        def sparsify_and_aggregate(flat, b=bucket):
            acc = self._acc[b.index]  # gradient + old residual (on_gradient)
            bm = self._bmax[b.index]
            bounds = bm if bm is not None and self._filled[b.index] == len(b.params) else None
            k = 0
            for lo, hi, ki in self.segments(b):
                v, i = self._values[k:k + ki], self._indices[k:k + ki]
                kernels.topk_out(acc[lo:hi], ki, v, i, bounds)  # bounds: one segment, the whole bucket
                if lo:
                    i.add_(lo)
                k += ki
            if bm is not None:
                bm.zero_()
            self._filled[b.index] = 0
            values, indices = self._values[:k], self._indices[:k]
            self.aggregate(values, indices, acc, flat, b)
        sparsify_and_aggregate.__name__ = f"{self.name}_bucket{bucket.index}"
        return [sparsify_and_aggregate]

    def aggregate(self, values, indices, acc, flat, bucket) -> None:
        """Exchange the selection, write the averaged sparse gradient into ``flat`` (``clear_result``
        first), remove what was sent from ``acc`` (the rest stays as the residual)."""
        raise NotImplementedError

    def commit_round(self):
        """The working copies become the state (a swap, no copy)."""
        self.residuals, self._acc = self._acc, self.residuals
        if self._mc:
            self.momenta, self._u = self._u, self.momenta
        if self._suspended:  # what the step may apply sparsely, if it is still this when the step comes
            self._committed = [[p.grad for p in b.params] for b in self.model.buckets]
            for b, w in zip(self.model.buckets, self._written):
                b.seal(w)

    def discard_round(self):
        self._written = [None] * len(self._written)  # the framework overwrites the buckets (NaN)
        for bm in self._bmax:
            if bm is not None:
                bm.zero_()
        self._filled = [0] * len(self._filled)
        self._committed = None

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
