"""DistributedModel's optimizer step: the one step pre-hook (a closure's forward and backward, then the
refusals: a discarded round, a failed peer, a non-finite gradient, a missing synchronised backward, then
the algorithm's ``before_step``) and post-hook (the step count, the algorithm's ``after_step``, joiners
admitted at the boundary)."""
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import _C
from .bucket import host_read
from .verdict import scaler_record, scaler_set_found_inf, scaler_stepped
from ._failfast import PeerFailedError

_LIVE = weakref.WeakSet()  # DistributedModels not yet closed, for _refuse_foreign_step
_FOREIGN_HOOK = []


def _refuse_foreign_step(optimizer, args, kwargs):
    """A global optimizer step pre-hook: an optimizer other than a live model's own that would step that
    model's parameters is refused, since the model's step accounting, refusals and algorithm hooks ride on
    its own optimizer (a second optimizer's step would apply gradients no algorithm saw through)."""
    for model in list(_LIVE):
        if optimizer is model.optimizer:
            continue
        if model._steps_parameters_of(optimizer):
            raise RuntimeError(
                f"bagua_lite: a {type(optimizer).__name__} steps parameters of a DistributedModel built with "
                f"another optimizer (a {type(model.optimizer).__name__}, not this one); a DistributedModel takes "
                f"one optimizer for all its parameters: give it one optimizer with several param groups. To "
                f"change optimizers mid-training, call close() on the model and wrap it again with the new one")


def watch_foreign_steps(model) -> None:
    """From now on, refuse another optimizer's step over ``model``'s parameters (until :func:`forget`)."""
    if not _FOREIGN_HOOK:
        _FOREIGN_HOOK.append(register_optimizer_step_pre_hook(_refuse_foreign_step))
    _LIVE.add(model)


def check_not_wrapped(module, who: str) -> None:
    """Refuse a module whose parameters an open model already holds: both models' hooks would fire in every
    backward and step (two rounds, each writing ``.grad``). Before any traffic."""
    params = {id(p): n for n, p in module.named_parameters()}
    for model in list(_LIVE):
        name = model._holds_one_of(params)
        if name is not None:
            raise ValueError(f"{who}: parameter {name!r} is already wrapped by an open {type(model).__name__}: "
                             f"close() that one first (to change the algorithm or the optimizer, close and wrap "
                             f"again)")


def check_steps_only(module, optimizer, who: str) -> None:
    """Refuse an optimizer that steps a parameter the module does not hold: nothing averages it, so it would
    train on each rank alone and the replicas drift apart (as under DDP, without a word)."""
    mine = {id(p) for p in module.parameters()}
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in mine:
                raise ValueError(
                    f"{who}: the optimizer steps a parameter that is not in the wrapped module (param group {i}, "
                    f"shape {list(p.shape)}): nothing would average it, so it would train on each rank alone and "
                    f"the replicas drift apart. Make it part of the module (an attribute of it; models trained "
                    f"together with one optimizer: one nn.ModuleDict wrapped once), or give it an optimizer of "
                    f"its own if it is meant to differ across ranks")


def local_flag(flags):
    """The one-element flag a DistributedModel's local checks set on the device (``flags``: the buckets'
    deferred checks, or None: the checks answer at once, and so do these). float32: the check at the end of
    each backward ORs into it as torch's loss scaler does into its ``found_inf``."""
    return None if flags is None else flags.new_zeros(1, dtype=torch.float32)


def forget(model) -> None:
    _LIVE.discard(model)


def _local(t):
    """A gradient's local tensor: a DTensor's shard (ShardedModel), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _versions(grads):
    """Each gradient's version counter; a DTensor's, with its shard's (in place on the DTensor, a zero_grad,
    moves the first only; FSDP2's accumulation into the shard, the second only)."""
    plain = torch.Tensor
    return [None if g is None else g._version if type(g) is plain else _subclass_version(g) for g in grads]


def _subclass_version(g):
    with torch.no_grad():  # (a DTensor's to_local() is then the shard itself, not a view made through autograd)
        return g._version, _local(g)._version


def take_closure(optimizer, args, kwargs):
    """(closure or None, args, kwargs without it) of an ``optimizer.step(...)`` call; ``args[0]`` is the
    optimizer itself (as torch hands them to a step pre-hook)."""
    if kwargs.get("closure") is not None:
        kwargs = dict(kwargs)
        return kwargs.pop("closure"), args, kwargs
    if len(args) > 1 and callable(args[1]):
        return args[1], args[:1] + tuple(args[2:]), kwargs
    return None, args, kwargs


class StepHooks:
    """The optimizer's step hooks of a DistributedModel (a mixin: it shares the model's state)."""

    #: where gradients stay local and their checks stay on the device: the flag the hooks set (one int32;
    #: DistributedModel sets it up, None: checks answer at once), and the parameters checked since it was
    #: last read, in hook order
    _local_flag = None
    #: a synchronised round started since the last optimizer.step() (see _begin_round), and the model's
    #: GradScaler's record of the iteration then
    _round_unstepped, _round_record = False, None
    #: whether backward's thread waits for the engine after each bucket it hands it: always (ShardedModel's
    #: units), or beside a torch DDP/FSDP made after the model on its group (_serial: Services._check_alone,
    #: which looks again whenever _groups.senders_signature() moved from _senders_seen)
    _waits_every_bucket, _serial, _senders_seen = False, False, None
    #: the version counters of the gradients a kept round left (buckets, or shards' ``.grad``): see _grads_discarded
    _round_versions = None
    #: how many param groups the optimizer had when check_steps_only last passed
    _groups_checked = None
    _local_unread = ()
    #: the ``_local_unread`` list as a backward left it, with its gradients and their version counters (_note_held)
    _local_held = None
    #: ShardedModel: a backward's _note_held is queued (its hook sees the shards before FSDP2 sets ``.grad``)
    _note_queued = False
    #: gradients that stay local, handed over since the last check (DistributedModel's hooks; see _check_local)
    _local_pending = ()
    _local_one = None
    #: optimizer.step() was reached since the last backward of gradients that stay local (see _settle_skipped_step)
    _local_stepped = True
    #: where checks stay on the device: the verdict read off a round's result (bagua_lite.verdict), else None
    _verdict = None

    def _check_local(self):
        """The deferred checks of the gradients that stay local (``_local_pending``), at the end of each backward
        (before a loss scaler or the loop can touch them): one multi-tensor pass over them all, as a loss
        scaler's ``unscale_`` (scale 1), ORed into ``_local_flag`` on the device. A kernel or so per backward
        on a GPU, not one per parameter."""
        if not self._local_pending:
            return
        pending, self._local_pending = self._local_pending, []
        fresh = not self._local_unread  # the first backward since the last read: pending is all that is unread
        self._local_unread.extend(pending)
        grads = [p.grad for p in pending]  # (once each: a parameter's .grad costs a tenth of a us to get)
        by_dtype = {}  # one list per dtype, as the scaler groups them (torch's fast path takes one dtype)
        for g in {id(p): g for p, g in zip(pending, grads) if g is not None}.values():  # (accumulated: once each)
            by_dtype.setdefault(g.dtype, []).append(g)
        if by_dtype and self._local_one is None:
            self._local_one = torch.ones_like(self._local_flag)
        for same in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(same, self._local_flag, self._local_one)
        self._note_held(grads if fresh else None)

    def _note_held(self, grads=None):
        """At the end of a backward whose local checks stay on the device: the gradients they checked since
        the last read (each parameter once, in hook order), and their version counters, so that the next
        forward can tell micro-batches accumulating toward a step (``.grad`` as the backward left it) from a
        skipped step (``zero_grad()`` moved it) without reading the flag (_held_unchanged). ``grads``: those
        of ``_local_unread``, where the caller has them."""
        self._note_queued = False
        unread = self._local_unread
        if grads is None:
            if self._local_held is not None:  # a backward before this one is unread too: each parameter once
                unread = self._local_unread = list({id(p): p for p in unread}.values())
            grads = [p.grad for p in unread]
        self._local_held = unread, grads, _versions(grads)

    def _held_unchanged(self) -> bool:
        """No optimizer.step() since the last local backward, whose checks are unread, and every gradient it
        left is still there, unchanged: another micro-batch toward the step ahead, which reads the checks."""
        if self._local_stepped or self._local_pending or self._local_held is None:
            return False
        unread, grads, versions = self._local_held
        return unread is self._local_unread and len(unread) == len(grads) and all(
            p.grad is g for p, g in zip(unread, grads)) and versions == _versions(grads)

    def _read_local_flag(self):
        """The deferred local checks, read once: on inf/NaN, the first parameter in hook order that holds it."""
        self._check_local()
        if not self._local_unread:
            return
        checked, self._local_unread, self._local_held = self._local_unread, [], None
        if host_read(self._local_flag)[0]:
            self._local_flag.zero_()
            if self._local_bad is None:
                self._local_bad = next(
                    (p for p in checked if p.grad is not None and not _C.all_finite(_local(p.grad))), checked[0])

    def _holds_one_of(self, names):
        """``names[id(p)]`` of the first parameter ``p`` of this model that is in ``names``, or None."""
        return next((names[i] for i in self._param_ids if i in names), None)

    def _steps_parameters_of(self, optimizer) -> bool:
        """Whether ``optimizer`` holds any of this model's parameters."""
        return any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"])

    def _begin_round(self, first=None):
        """At the start of a synchronised round (``first``: the parameter whose gradient began it, if one did).
        A kept round the loop threw away without a step (``zero_grad()`` left every ``.grad`` None: a GAN's
        discriminator after the generator's step) is undone first, as if it never ran: the plain loop
        forgets those gradients, so error feedback's residuals and PowerSGD's state must too. Where
        ``.grad`` holds an update (``Algorithm.grad_holds_update``), a second round before the step is refused
        instead, before any gradient is handed over."""
        self._check_alone()
        if self._round_unstepped and self._last_round_kept():
            if not self.algorithm.grad_holds_update and self._grads_discarded(first):
                self.algorithm.kept_state.roll_back()  # the backups are still those of the round thrown away
                self.algorithm.undo_round()
            elif self.algorithm.grad_holds_update:
                raise RuntimeError(
                    f"bagua_lite: a second synchronised backward before optimizer.step() (this is rank {self.rank}, "
                    f"step {self.algorithm.step}, {self.algorithm.name}): after the first, .grad holds "
                    f"{self.algorithm.name}'s update, not a gradient, and its state (momenta) already took that "
                    f"gradient; another backward would add a gradient to the update (or, after zero_grad, count "
                    f"both). Accumulate micro-batches under no_sync() (or model.require_backward_grad_sync = False) "
                    f"for all but the last, as with DDP; a backward whose gradients this model's optimizer will not "
                    f"step (a GAN's discriminator during the generator's step) goes under no_sync() too, or with its "
                    f"parameters frozen (requires_grad_(False)); weights and optimizer are as the first backward "
                    f"left them")
        self._round_unstepped, self._round_record = True, scaler_record(self.grad_scaler, self.optimizer)
        self._failfast.step = None if self.algorithm.asynchronous else self.algorithm.step + 1  # (uneven inputs)

    def _last_round_kept(self) -> bool:
        """Whether the last synchronised round's update is still waiting for its step: not if it was discarded
        for inf/NaN, nor if the model's GradScaler ended the iteration since (its ``step()`` skips
        ``optimizer.step()`` after an overflow, which the round may not know on the host)."""
        return self._nonfinite_error is None and not scaler_stepped(self.grad_scaler, self.optimizer,
                                                                    self._round_record)

    def _before_step(self, optimizer, args, kwargs):
        """The optimizer's step pre-hook, the only one: a closure first (it runs forward and backward, as
        in ``loss = closure(); optimizer.step()``), then the refusals, then the algorithm's ``before_step``.
        Whatever it raises, the rounds before it are spent (a next backward starts afresh)."""
        try:
            return self._step_checks(optimizer, args, kwargs)
        finally:
            self._round_unstepped = False

    def _step_checks(self, optimizer, args, kwargs):
        if len(optimizer.param_groups) != self._groups_checked:  # add_param_group() since: look again
            check_steps_only(self.module, optimizer, type(self).__name__)
            self._groups_checked = len(optimizer.param_groups)
        if self._verdict is not None:
            self._verdict.clear()  # a found_inf left by a step that raised after its pre-hook
        self._raise_skipped_on_device()
        closure, args, kwargs = take_closure(optimizer, args, kwargs)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            calls = []

            def evaluated():
                if calls:
                    raise RuntimeError(
                        f"bagua_lite: {type(optimizer).__name__}.step evaluated its closure a second time in one "
                        f"step; each evaluation would be a communication round whose count differs between ranks. "
                        f"Use an optimizer that evaluates the closure once per step (SGD, Adam, ...)")
                calls.append(1)
                return loss
            kwargs = dict(kwargs, closure=evaluated)
        self._local_stepped = True  # (after the closure's backward) the local gradients have their step
        if self._elastic is not None and self._elastic.pending is not None:
            raise self._elastic.take_pending()  # the step in flight was discarded on every survivor
        self._failfast.raise_if_failed("nothing is applied: restart from the last checkpoint")
        if self._nonfinite_error is not None and not scaler_set_found_inf(optimizer, self._verdict):
            raise FloatingPointError(self._nonfinite_error)  # (a GradScaler's found_inf skips on the device)
        self._check_local()  # (made at the end of each backward: nothing is left to check here)
        if self._local_unread and self._verdict is not None and self._verdict.hand_over_local(
                optimizer, self.grad_scaler, self._local_flag, self.algorithm.step):
            self._local_unread, self._local_held = [], None  # left to the scaler's check, or a fused found_inf
        self._read_local_flag()
        if self._local_bad is not None and not scaler_set_found_inf(optimizer, self._verdict):
            name = next((n for n, q in self.module.named_parameters() if q is self._local_bad), "?")
            raise FloatingPointError(
                f"bagua_lite: non-finite gradient (inf or NaN) on rank {self.rank} at step {self.algorithm.step}, "
                f"first in parameter {name!r}. Under {self.algorithm.name} gradients stay local, so only this rank "
                f"skips the step: its weights are unchanged and the step still counts, so the ranks stay in "
                f"step (a loss scaler, torch.amp.GradScaler, skips such steps without this error). Look for "
                f"what produced the inf/NaN: learning rate, loss, inputs")
        if self._unsynced and self.algorithm.sync_gradients():
            raise RuntimeError(
                f"bagua_lite: optimizer.step() after a backward under no_sync() with no synchronised backward "
                f"since (this is rank {self.rank}, step {self.algorithm.step}, {self.algorithm.name}): its "
                f"gradients are this rank's own and the replicas would drift apart. Run the last micro-batch's "
                f"backward outside no_sync(), as with DDP")
        if self._verdict is not None:  # the last refusal: a fused optimizer may take it, skipping on the device
            self._verdict.hand_over(optimizer, self.grad_scaler, self.algorithm.step,
                                    lambda: self._result_error(self.algorithm.step))
        self._algorithm_hook(self.algorithm.before_step)
        return (args, kwargs) if closure is not None else None

    def _settle_skipped_step(self):
        """A local non-finite gradient's step was skipped (by a loss scaler, or ``optimizer.step()`` raised):
        it still counts, as a step that moved nothing, so this rank's schedule (exchanges, periodic
        averages) stays paired with its peers'. Runs at the next training forward, or before a checkpoint. Not
        while micro-batches accumulate toward a step still ahead (no ``optimizer.step()`` since their backward,
        and the bad gradient still held): that step refuses it. A scaler's skip, or the loop's, let it go."""
        self._raise_skipped_on_device()
        if self._note_queued:  # a backward that raised before its end: its note never came (queue the next one)
            self._note_queued = False
        elif self._held_unchanged():  # accumulating: whatever the flag says, it waits for that step
            return
        self._read_local_flag()
        bad = self._local_bad
        if bad is None:
            return
        if not self._local_stepped and bad.grad is not None and not _C.all_finite(_local(bad.grad)):
            if self._local_flag is not None:  # back on the device, for the step to hand over as it would have
                self._local_flag.fill_(1)
                self._local_unread.append(bad)
                self._local_bad = None
            return
        self._local_bad, self._local_stepped = None, True
        self._after_step()

    def _result_error(self, step, local=False, late=False):
        if local:
            return (f"bagua_lite: non-finite gradient (inf or NaN) on rank {self.rank} at step {step}. Under "
                    f"{self.algorithm.name} gradients stay local, so only this rank skipped the step, on the device "
                    f"(the fused {type(self.optimizer).__name__}'s found_inf): its weights are unchanged and the step "
                    f"counted, so the ranks stay in step. This error comes a step late, as the check stayed on the "
                    f"device; a loss scaler (torch.amp.GradScaler) skips such steps without it. Look for what "
                    f"produced the inf/NaN: learning rate, loss, inputs")
        what = (f"the fused {type(self.optimizer).__name__} skipped that step on the device on every rank (weights "
                f"and optimizer state are as before it); this error comes a step late, as the verdict stayed on "
                f"the device" if late else "optimizer.step() refuses to apply it on every rank")
        return (f"bagua_lite: non-finite gradient (inf or NaN) at step {step}: the averaged "
                f"gradient held inf/NaN on every rank (some rank's gradient did); {what} (this is rank {self.rank}). "
                f"A loss scaler (torch.amp.GradScaler) skips such steps without this error. Look for what produced "
                f"the inf/NaN: learning rate, loss, inputs")

    def _raise_skipped_on_device(self):
        """A step the fused optimizer skipped on the device for a non-finite result or an algorithm's refusal
        (bagua_lite.verdict): raise its error now, once."""
        skipped = None if self._verdict is None else self._verdict.skipped_step()
        if skipped is not None:
            raise FloatingPointError(self._result_error(*skipped, late=True))
        refused = None if self._verdict is None else self._verdict.refused_step()
        if refused is not None:  # an algorithm's refusal the fused optimizer applied (bucket.refuse_changed)
            raise RuntimeError(refused)

    def _after_step(self):
        if self._verdict is not None:
            self._verdict.clear()
        self._local_bad = None
        self._unsynced = False
        self.algorithm.step += 1
        self._algorithm_hook(self.algorithm.after_step)
        if self._elastic is not None and (self._elastic.grow_after_step or self._elastic.admits_now()):
            self._elastic.grow()  # a worker waits to join: the next step runs with it

    def _algorithm_hook(self, hook):
        """Run an algorithm hook that may communicate (its own exchanges, averages, threads' errors): if it
        raises, this model's ranks are out of step for good, so tell the peers (fail fast) first. With
        ``fault_tolerant=True`` and an algorithm that heals itself (DiLoCo's in-step sync), a lost peer is
        recovered from here and the step raises MembershipChanged."""
        # the step its communication is in: after_step's, the step just taken; the others', the one being taken
        self._failfast.step = None if self.algorithm.asynchronous else \
            self.algorithm.step + (hook != self.algorithm.after_step)
        try:
            hook()
        except Exception as e:
            if isinstance(e, RuntimeError) and self._elastic is not None \
                    and self.algorithm.heals_itself:  # PeerFailedError is one
                self._elastic.recover(e, periodic="sync")
                raise self._elastic.take_pending() from e
            if not isinstance(e, PeerFailedError):
                self._failfast.announce(f"{self.algorithm.name}.{hook.__name__} raised {type(e).__name__}: {e}")
            raise
