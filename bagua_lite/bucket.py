"""Buckets: parameters grouped into flat buffers that their gradients (or weights) are views of."""
import os
from typing import List, Optional

import torch

from bagua_lite import _C, _compat


_SEAL_SAMPLE = 64  # entries Bucket.seal keeps: a uniform rescale changes every nonzero one


def host_read(t: torch.Tensor) -> list:
    """The values of a small tensor of answers left on the device (non-finite flags, changed-in-place
    checks), as a list: every read the host makes of such an answer goes through here, and on a GPU each
    call is one host synchronisation (tests count the calls per step with the CPU standing in)."""
    return t.reshape(-1).tolist()


class Bucket:
    """A flat buffer holding the gradients of ``params`` back to back, in bucket order.

    ``flat`` is allocated once; ``view(i)`` is parameter i's slot shaped like the parameter. After set-up
    each ``param.grad`` is such a view, so the result of a bucket's ops lands in ``.grad`` with no copy.
    """

    def __init__(self, index: int, params: List[torch.nn.Parameter]):
        if not params:
            raise ValueError("Bucket: needs at least one parameter")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"Bucket {index}: parameters must share dtype and device, got {dtypes} / {devices}")
        self.index = index
        self.params = list(params)
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.offsets = []
        n = 0
        for p in self.params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.flat = torch.zeros(n, dtype=self.dtype, device=self.device)
        self._views = [self.flat[o:o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]
        self.ops = []
        #: autograd accumulated a gradient into a slot outside a synchronised round (under no_sync(), while
        #: ``.grad`` was the slot): the bucket holds more than the last round left there (sparse results)
        self.touched = False
        self._sealed = None
        #: one int32 on the bucket's device that the non-finite check sets instead of answering the host
        #: (``defer_nonfinite_checks``); None: the check answers at once
        self.nonfinite_flag = None

    def fill(self, i: int, grad, scale: float = 1.0) -> bool:
        """``grad * scale`` into slot i in one pass (grad None: zeros), and whether grad was all finite. With a
        ``nonfinite_flag`` the answer stays on the device, so the hook does not wait for the GPU: the flag is
        set, this returns True, and the round's agreement reads the flags."""
        if self.nonfinite_flag is not None:
            _C.scale_flagged_(self.view(i), grad, scale, self.nonfinite_flag)
            return True
        return _C.scale_checked(self.view(i), grad, scale)

    def nonfinite_seen(self, known=()) -> bool:
        """Whether this round's gradients are known to hold inf/NaN without waiting: the bucket's index is in
        ``known`` (an algorithm's ``nonfinite_buckets``, from checks made at once), or a deferred check has
        set its flag where reading it costs no wait (a CPU flag). A device flag is left alone until the
        agreement: there the codecs take NaN without raising, and the round is discarded on every rank all
        the same."""
        if self.index in known:
            return True
        flag = self.nonfinite_flag
        return flag is not None and flag.device.type == "cpu" and bool(flag.item())

    def view(self, i: int) -> torch.Tensor:
        return self._views[i]

    def seal(self, where: torch.Tensor = None) -> None:
        """Remember the result as this round left it, so :meth:`changed` can tell whether ``.grad`` was
        changed in place before the optimizer's step: clipping moves the version counter, a loss scaler's
        ``unscale_`` does not but rescales every entry, so a few entries are kept too (``where``: indices
        to keep, e.g. a sparse result's written entries; default the first ones)."""
        idx = None if where is None else where[:_SEAL_SAMPLE]
        sample = self.flat[idx] if idx is not None else self.flat[:_SEAL_SAMPLE].clone()
        self._sealed = (self.flat._version, sample, idx)

    def changed(self, inv_scale=None):
        """Whether the flat buffer was changed in place since :meth:`seal`, without waiting for the device:
        True or False where the host can tell (False if never sealed; True if the version counter moved),
        else a 0-d bool tensor on the bucket's device. ``inv_scale``: the model's loss scaler's 1 / scale;
        its ``unscale_`` (exactly that rescale) is no change."""
        if self._sealed is None:
            return False
        version, sample, idx = self._sealed
        if self.flat._version != version:
            return True
        now = self.flat[idx] if idx is not None else self.flat[:_SEAL_SAMPLE]
        # bit for bit: a NaN written in place counts as a change, one the round left there (a round discarded
        # on the device poisons an element for a loss scaler: bagua_lite.verdict) does not
        moved = (_bits(now) != _bits(sample)).any()
        return moved if inv_scale is None else moved & (now != sample * inv_scale).any()

    def nbytes(self) -> int:
        return self.numel * self.flat.element_size()

    def __repr__(self):
        return f"Bucket({self.index}, params={len(self.params)}, numel={self.numel}, dtype={self.dtype})"


def all_zero(tensors) -> bool:
    """Whether every element of ``tensors`` is zero (one host read for all of them; True for none)."""
    return not tensors or not bool(torch.stack([t.ne(0).any() for t in tensors]).any())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of their width (a view: equal bits compare equal, NaN too)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def refuse_changed(who: str, model, buckets, holds: str, instead: str, late: bool = False) -> None:
    """Raise if any of ``buckets`` was changed in place since it was sealed, for an algorithm whose ``.grad``
    ``holds`` more than a gradient: clipping it, or the ``unscale_`` of a loss scaler the model does not
    know, would not do what it does under DDP, and would train differently without a word. The ``unscale_``
    of the model's own ``grad_scaler`` is expected (the model handed ``.grad`` over at the scaler's scale).
    Every rank runs the same check, so every rank refuses; ``instead``: what the user can do.

    What the host cannot tell (no version counter moved) is a 0-d answer on the device. ``late``: the
    algorithm's own update skips with a fused optimizer's ``found_inf``, so where the model's verdict can
    take the answer there (``DeviceVerdict.refuse_late``) the step is skipped on the device and the error
    comes a step late, with no host read; else the answer is read here."""
    scaler = model.grad_scaler
    if scaler is None and getattr(model.optimizer, "grad_scale", None) is not None:
        # GradScaler.step() of a fused optimizer without its unscale_: .grad is at the scale and so is what the
        # algorithm built from it (residuals, momenta), mis-weighted whenever the scale changes
        raise RuntimeError(
            f"{who}: a GradScaler steps the fused {type(model.optimizer).__name__} with .grad at its scale, but the "
            f"model was not given the scaler. {holds}, and the state the algorithm keeps from it would be at the "
            f"scaler's scale, wrong whenever the scale changes; pass it: DistributedModel(..., grad_scaler=scaler)")
    scales = _compat.scaler_scales(scaler)
    inv = None if scales is None else scales[1]
    seen = [b.changed(inv) for b in buckets]
    on_device = [d for d in seen if not isinstance(d, bool)]

    def error(step=None):
        scaler_hint = "; with a GradScaler, pass it: DistributedModel(..., grad_scaler=scaler)" if scaler is None \
            else " (the unscale_ of the model's grad_scaler is no change)"
        when = "" if step is None else (
            f" The fused {type(model.optimizer).__name__} skipped step {step} on the device on every rank (weights "
            f"and optimizer state are as before it); this error comes a step late, as the check stayed there.")
        return (f"{who}: .grad was changed in place between backward and optimizer.step() (torch.nn.utils."
                f"clip_grad_norm_/clip_grad_value_, GradScaler's unscale_, or your own edit). {holds}, not "
                f"a gradient, so the change would not be what it is under DDP; {instead}{scaler_hint}.{when}")
    if any(d is True for d in seen):
        raise RuntimeError(error())
    if not on_device:
        return
    # one answer for every bucket (one host synchronisation on a GPU, where a check per bucket made one each)
    answer = torch.stack(on_device).any()
    verdict = getattr(model, "_verdict", None)
    if late and verdict is not None and verdict.refuse_late(model.optimizer, answer, model.algorithm.step, error):
        return
    if host_read(answer)[0]:
        raise RuntimeError(error())


def plan_buckets(params: List[torch.nn.Parameter], bucket_bytes: int) -> List[List[torch.nn.Parameter]]:
    """Split parameters (given in the order gradients become ready) into buckets of ~``bucket_bytes``.

    A bucket closes when adding the next parameter would exceed the cap, or when dtype/device change.
    A bucket still smaller than a quarter of the cap does not close: its small leftovers (biases
    between large weights, say) join the next parameter rather than travel alone, because every bucket
    costs a collective's latency and a sync point. So a parameter larger than the cap gets a bucket of
    its own plus, at most, a quarter-cap of small neighbours ready before it.
    """
    small = bucket_bytes // 4
    buckets, cur, cur_bytes = [], [], 0
    for p in params:
        nb = p.numel() * p.element_size()
        if cur and (p.dtype != cur[0].dtype or p.device != cur[0].device
                    or (cur_bytes + nb > bucket_bytes and cur_bytes >= small)):
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(p)
        cur_bytes += nb
    if cur:
        buckets.append(cur)
    return buckets


def plan_model_buckets(module: torch.nn.Module, bucket_size_mb: float) -> List[List[torch.nn.Parameter]]:
    """The buckets DistributedModel makes for ``module``: its trainable parameters in the order their
    gradients become ready (reverse registration order), planned with :func:`plan_buckets`."""
    params = [p for p in module.parameters() if p.requires_grad]
    return plan_buckets(params[::-1], int(bucket_size_mb * 2 ** 20))


def check_unconverted(p, like, module=None, held=None) -> None:
    """Raise if parameter ``p`` (or ``held``, its gradient) is no longer of ``like``'s dtype and device, which the
    buckets and weight buffers made at wrapping have (``module.half()``, ``.double()`` or ``.to(...)`` after
    wrapping); ``module`` names it."""
    held = p if held is None else held
    if held.dtype == like.dtype and held.device == like.device:
        return
    name = repr(next((n for n, q in module.named_parameters() if q is p), "?")) if module is not None \
        else f"of shape {tuple(p.shape)}"
    raise RuntimeError(
        f"bagua_lite: parameter {name} is {p.dtype} on {p.device} now, but was {like.dtype} on {like.device} "
        f"when the model was wrapped, which is what its buckets and weight buffers hold; convert the model "
        f"(.half(), .double(), .to(...)) before wrapping it, or wrap it again after (for mixed precision, "
        f"torch.autocast keeps the parameters as they are)")


class FlatWeights:
    """A reusable flat copy of a parameter list's weights, for algorithms that average weights."""

    def __init__(self, params: List[torch.nn.Parameter]):
        self.groups = []
        for group in plan_buckets(params, 1 << 62):  # split only by dtype/device
            flat = torch.empty(sum(p.numel() for p in group), dtype=group[0].dtype, device=group[0].device)
            self.groups.append((group, flat))

    def gather(self):
        with torch.no_grad():
            for group, flat in self.groups:
                o = 0
                for p in group:
                    check_unconverted(p, flat)
                    flat[o:o + p.numel()].copy_(p.detach().reshape(-1))
                    o += p.numel()
        return [flat for _, flat in self.groups]

    def scatter(self):
        with torch.no_grad():
            for group, flat in self.groups:
                o = 0
                for p in group:
                    p.copy_(flat[o:o + p.numel()].view_as(p))
                    o += p.numel()


def defer_nonfinite_checks(buckets: List[Bucket]) -> Optional[torch.Tensor]:
    """Gives every bucket a ``nonfinite_flag`` when the checks should stay on the device: CUDA buckets with the
    CUDA kernels (a host answer per gradient would make each hook wait for the GPU), or any device with
    ``BAGUA_LITE_DEFER_CHECKS=1`` (how the CPU tests run the GPU's logic). Returns the flags, one int32 per
    bucket, read once per round; None when the checks answer at once."""
    devices = {b.device for b in buckets}
    if len(devices) != 1:
        return None
    device = devices.pop()
    if not ((device.type == "cuda" and _C.cuda_kernels_enabled()) or os.environ.get("BAGUA_LITE_DEFER_CHECKS") == "1"):
        return None
    flags = torch.zeros(len(buckets), dtype=torch.int32, device=device)
    for b in buckets:
        b.nonfinite_flag = flags[b.index:b.index + 1]
    return flags
