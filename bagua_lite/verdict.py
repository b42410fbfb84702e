"""The non-finite verdict of a round read off its result on the device, with no host synchronisation.

Where the checks stay on the device (a GPU), a round's inf/NaN verdict is normally read on the host once,
on the engine's thread, so that ``optimizer.step()`` can refuse the round before anything is applied and
the algorithm's state can be put back. An algorithm can do without (``Algorithm.device_verdict``):

- ``"result"``: its round's result is the same on every rank and holds inf/NaN wherever any rank's
  gradient did (dense averaging, in fp32 or cast to fp16 or bf16), so the result itself is the agreed
  verdict: each bucket's last op takes its (min, max) in one pass (``torch.aminmax``: NaN propagates, an inf
  is an extreme, finite values cannot overflow, unlike a sum), into a row kept per bucket; nothing is sent;
- ``"flags"``: the buckets' flags are MAX-allreduced on the model's group after the last bucket (on the
  device: NCCL's stream); where they say so, the state registered with ``rollback=True`` is put back by a
  copy that returns at once otherwise (``_C.copy_flagged_``), and the first element of bucket 0 is set to NaN
  so that a loss scaler's check of ``.grad`` sees it (ByteGrad, hierarchical, error feedback, PowerSGD: a bad
  rank's bucket travels as zeros or as whatever its codec makes of NaN).

The verdict is then left on the device and handed to what refuses the step there:

- a ``torch.amp.GradScaler`` driving the step: its own check of ``.grad`` sees the non-finite result (the
  scaler's one read per step, as under DDP; none with a fused optimizer, whose ``found_inf`` it sets);
- a fused optimizer (``fused=True``) without one: the verdict becomes the optimizer's ``found_inf``, so it
  skips the step on the device on every rank, and the ``FloatingPointError`` a refused round raises comes
  one step late, at the next training forward (or ``optimizer.step()``), read from a copy that is complete
  by then;
- otherwise (a step the scaler does not make itself: a plain ``optimizer.step()``, even after its
  ``unscale_``) the verdict is read at ``optimizer.step()`` and the round refused there.

No per-step allocation proportional to the model. (A float64 sum of the result would be as exact as its
(min, max) but 20x slower on a CPU, which converts element by element.)
"""
import sys
import warnings

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from .bucket import host_read


def skips_on_device(optimizer) -> bool:
    """Whether ``optimizer`` skips a step on the device when given ``found_inf`` (torch's fused optimizers)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and \
        all(g.get("fused") for g in optimizer.param_groups)


def scaler_checked(scaler, optimizer) -> bool:
    """Whether ``scaler``'s ``unscale_`` checked ``optimizer``'s gradients this step and this is its ``step()``
    calling ``optimizer.step()``, which it does only where that check found none (``unscale_`` followed by a
    plain ``optimizer.step()`` is not: that step is the model's to refuse)."""
    if scaler is None or not scaler.is_enabled():
        return False
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    return state is not None and state.get("stage") is OptState.UNSCALED and _inside_step_of(scaler)


def scaler_record(scaler, optimizer):
    """The GradScaler's record of this iteration's optimizers (``update()`` replaces it) and whether its
    ``step(optimizer)`` had run in it already, or None."""
    if scaler is None:
        return None
    states = getattr(scaler, "_per_optimizer_states", None)
    return states, _stepped(states, optimizer)


def _stepped(states, optimizer) -> bool:
    state = None if states is None else states.get(id(optimizer))
    return state is not None and state.get("stage") is OptState.STEPPED


def scaler_stepped(scaler, optimizer, record) -> bool:
    """Whether ``scaler.step(optimizer)`` ran since ``record`` (its ``scaler_record`` then): it skips
    ``optimizer.step()`` after an overflow. An ``update()`` alone is no step of this optimizer: one scaler
    shared by a GAN's two optimizers updates once per iteration, after both steps. No read."""
    if scaler is None or record is None:
        return False
    states, then = record
    now = getattr(scaler, "_per_optimizer_states", None)
    return (_stepped(states, optimizer) and not then) or (now is not states and _stepped(now, optimizer))


def _inside_step_of(scaler) -> bool:
    frame = sys._getframe(2)
    for _ in range(16):  # the optimizer's step, its hooks' wrapper, ours: a few frames up
        if frame is None:
            return False
        if frame.f_code.co_name == "step" and frame.f_locals.get("self") is scaler:
            return True
        frame = frame.f_back
    return False


def scaler_set_found_inf(optimizer, verdict=None) -> bool:
    """Whether a GradScaler gave ``optimizer`` (a fused one) its ``found_inf`` for this step: the scaler
    checked ``.grad`` and the optimizer skips on the device where it found inf/NaN."""
    found = getattr(optimizer, "found_inf", None)
    return found is not None and skips_on_device(optimizer) and (verdict is None or found is not verdict.found_inf)


class DeviceVerdict:
    """A model's round verdicts left on the device (each bucket's result's (min, max), or the agreed flags),
    and the one a fused optimizer took there, to report a step late."""

    def __init__(self, buckets, flags):
        device = buckets[0].device
        self.flags, self._first = flags, buckets[0].flat[:1]
        self.kind = ""  # this round's: "result", "flags" or "" (read on the host)
        self._kept = None  # the algorithm's KeptState, for "flags"
        by_dtype = {}
        for b in buckets:
            by_dtype.setdefault(b.dtype, []).append(b.index)
        #: per bucket dtype, a (min, max) row per bucket of its result (a bucket with no element stays at 0)
        self.extremes = [torch.zeros(len(ix), 2, dtype=dtype, device=device) for dtype, ix in by_dtype.items()]
        self._row = {i: t[r] for t, ix in zip(self.extremes, by_dtype.values()) for r, i in enumerate(ix)}
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)  # what a fused optimizer reads
        self.pending = False  # this round's verdict is on the device, for optimizer.step() to hand over
        self._late = None  # ((host copy, event or None), step, local): a verdict a fused optimizer applied
        self._set_on = None  # the optimizer whose found_inf is ours during its step
        self._refused = None  # ((host copy, event or None), step, error): a refusal a fused optimizer applied

    def begin_round(self, algorithm, optimizer, scaled: bool, sharded: bool = False) -> bool:
        """Whether this round's verdict stays on the device (the checks deferred, no fault tolerance): an
        algorithm that allows it (``device_verdict``), and something that refuses on the device (``scaled``: a
        GradScaler's round, or a fused optimizer). ``sharded``: the ranks of a replica hold different shards
        of the result, so the verdict is always agreed from the flags."""
        kind = getattr(algorithm, "device_verdict", "")
        kind = "flags" if sharded and kind == "result" else kind
        self.kind = kind if kind in ("result", "flags") and (scaled or skips_on_device(optimizer)) else ""
        self._kept = algorithm.kept_state
        self.pending = False  # a round that never reached optimizer.step() is over
        return bool(self.kind)

    def ops(self, index: int, last: bool, group):
        """The bucket's ops after its own: "result": its (min, max) into its row; "flags", after the last
        bucket: the flags agreed over ``group`` (MAX), and where they say so the round's state put back and
        bucket 0's first element NaN."""
        if self.kind == "result":
            row = self._row[index]

            def result_extremes(flat):
                if flat.numel():
                    torch.aminmax(flat, out=(row[0], row[1]))
            return [result_extremes]
        if self.kind != "flags" or not last:
            return []
        return [self.flags_op(group, lambda: self._first)]

    def flags_op(self, group, target):
        """The op that agrees the flags over ``group`` (MAX), puts the round's state back where they say so and
        sets ``target()`` (one element of ``.grad``, or None) to NaN there."""
        flags, kept = self.flags, self._kept

        def agreed_flags(_flat):
            if group is not None and group.size() > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            kept.roll_back_flagged(flags)
            first = target()
            if first is not None:
                first.masked_fill_(flags.amax() != 0, float("nan"))
        return agreed_flags

    def _finite(self) -> torch.Tensor:
        """On the device: whether this round was free of inf/NaN on every rank (a 0-d bool)."""
        if self.kind == "flags":
            return (self.flags == 0).all()
        return torch.stack([torch.isfinite(t).all() for t in self.extremes]).all()

    def hand_over(self, optimizer, scaler, step: int, error) -> None:
        """At ``optimizer.step()`` of a round whose verdict stayed on the device: leave it to the scaler that
        checked ``.grad``, give it to a fused optimizer as ``found_inf``, or else read it and raise
        ``FloatingPointError(error())`` if the result held inf/NaN."""
        if not self.pending:
            return
        self.pending = False
        if scaler_set_found_inf(optimizer, self):
            return  # a GradScaler set it for a fused optimizer: its check of .grad skips on the device
        if scaler_checked(scaler, optimizer):
            return  # the scaler's unscale_ checked .grad, and its step() steps only where it found none
        if skips_on_device(optimizer):
            torch.logical_not(self._finite(), out=self.found_inf)
            optimizer.found_inf, self._set_on = self.found_inf, optimizer
            self._late = self._copy_for_later(), step, False
            return
        if not host_read(self._finite())[0]:
            raise FloatingPointError(error())

    def hand_over_local(self, optimizer, scaler, flag, step: int) -> bool:
        """At ``optimizer.step()`` after a local round (gradients that stay on this rank, checked into the
        one-element ``flag`` on the device; only this rank skips a bad one): whether it is handled without a read.
        The scaler that checked ``.grad`` covers it; a fused optimizer takes the flag as ``found_inf`` (skipped
        on the device, the error a step late). The flag is cleared on the device for the next round."""
        if scaler_set_found_inf(optimizer, self) or scaler_checked(scaler, optimizer):
            flag.zero_()
            return True
        if not skips_on_device(optimizer):
            return False
        torch.ne(flag[0], 0, out=self.found_inf)
        flag.zero_()
        optimizer.found_inf, self._set_on = self.found_inf, optimizer
        self._late = self._copy_for_later(), step, True
        return True

    def refuse_late(self, optimizer, refused, step: int, error) -> bool:
        """A refusal answered on the device (``refused``, a 0-d bool: ``.grad`` changed in place,
        ``bucket.refuse_changed``) left to the fused optimizer that took this round's verdict (``hand_over``):
        its step skips where it is set, joined to the verdict in ``found_inf``, and ``RuntimeError(error(step))``
        comes a step late, at the next training forward. False where there is no such optimizer (its verdict
        was read, or a GradScaler gave it the ``found_inf``, which the scaler's update would read as an
        overflow): the caller reads it."""
        if getattr(optimizer, "found_inf", None) is not self.found_inf:
            return False
        self.found_inf.copy_(torch.logical_or(self.found_inf, refused))
        self._refused = self._copy_for_later(refused), step, error
        return True

    def refused_step(self):
        """The error of the last refusal a fused optimizer applied on the device (``refuse_late``), or None."""
        refused, self._refused = self._refused, None
        if refused is None:
            return None
        copy, step, error = refused
        return error(step) if self._is_set(copy) else None

    def clear(self) -> None:
        """Take back the ``found_inf`` given for a step (after it, or at the next one's start)."""
        if self._set_on is not None:
            if getattr(self._set_on, "found_inf", None) is self.found_inf:
                del self._set_on.found_inf
            self._set_on = None

    def _copy_for_later(self, t=None):
        t = self.found_inf if t is None else t
        if t.device.type != "cuda":
            return t.clone(), None
        host = torch.empty((), dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def skipped_step(self):
        """(step count, local) of the last step a fused optimizer skipped on the device for this verdict, or
        None (read from the copy made at that step: complete by now, or waited for, not synchronised with
        the device's later work)."""
        late, self._late = self._late, None
        if late is None:
            return None
        copy, step, local = late
        return (step, local) if self._is_set(copy) else None

    @staticmethod
    def _is_set(copy) -> bool:
        """Whether a ``_copy_for_later`` holds a nonzero value (complete by now, or waited for)."""
        host, event = copy
        if event is not None:
            event.synchronize()
        return bool(host)

    def warn_unreported(self, error) -> None:
        """At close: a step skipped on the device that no later forward reported, as a warning."""
        skipped = self.skipped_step()
        if skipped is not None:
            warnings.warn(error(*skipped), RuntimeWarning, stacklevel=3)
        refused = self.refused_step()
        if refused is not None:
            warnings.warn(refused, RuntimeWarning, stacklevel=3)
