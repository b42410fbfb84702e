"""DistributedModel: the training wrapper. One step reads top to bottom across its parts (see DESIGN.md):

1. ``forward`` (here): buffers broadcast, fault tolerance's look at the store, ``algorithm.before_forward()``,
   then the wrapped module; the end-of-backward callback is armed when backward reaches the output.
2. ``backward`` (:mod:`bagua_lite.scheduler`): each ready gradient into its bucket, buckets to the engine in
   one fixed order, the wait for them at the end of backward.
3. the agreement (:mod:`bagua_lite.agreement`): step counts, non-finite gradients and unused parameters,
   committed or discarded on every rank alike.
4. ``optimizer.step()`` (:mod:`bagua_lite.step_hooks`): a closure, the refusals, ``algorithm.before_step()``,
   the optimizer's update, ``algorithm.after_step()``.
Around them: what algorithms call (:mod:`bagua_lite.services`), joiners' admission
(:mod:`bagua_lite.admission`), the DDP type (:mod:`bagua_lite._ddp_type`), membership (:mod:`bagua_lite.elastic`).
"""
import contextlib
import os
import functools
import math
from typing import Optional, Union

import torch
import torch.distributed as dist

from . import _C, _compat, _control, accelerate_support, agreement, comm, elastic, launch, runtime, step_hooks
from ._ddp_type import DDPType
from ._failfast import FailFast, PeerFailedError
from ._groups import resolve_group
from .admission import Admission, check_fault_tolerant, join_running_job
from .agreement import RoundAgreement
from .algorithm import Algorithm
from .bucket import Bucket, defer_nonfinite_checks, plan_buckets, plan_model_buckets
from .config import algorithm_from
from .scheduler import Scheduler
from .services import Services
from .step_hooks import StepHooks
from .verdict import DeviceVerdict
from .wrappable import check_wrappable


class _Port:
    """What fault tolerance (:class:`bagua_lite.elastic.Controller`) may change of a model, lent to it by the
    model: its engine, its fail-fast key, its group, a discarded round, and the collectives of a recovery or
    an admission. The controller reads the rest through the model's public members."""

    def __init__(self, model, gather_ints, share_state, admit):
        self._model = model
        #: every rank's list of ints (the step agreement's all_gather); rank src's state to every rank; a
        #: member's side of admitting joiners once the new generation's group is formed
        self.gather_ints, self.share_state, self.admit = gather_ints, share_state, admit

    @property
    def failfast(self):
        return self._model._failfast

    @failfast.setter
    def failfast(self, failfast):
        self._model._failfast = failfast

    def renew_engine(self):
        """A new engine; the old one, whose worker may sit in a collective with a lost peer, abandoned."""
        m = self._model
        if not m._engine_abandoned:
            m._engine.abandon()
        m._engine, m._engine_abandoned = _C.Engine(), False

    def discard_round(self):
        """The round in flight discarded: the algorithm's rollback state put back, the buckets zeroed."""
        m = self._model
        m.algorithm.kept_state.roll_back()
        with torch.no_grad():
            for b in m.buckets:
                b.flat.zero_()

    def use_group(self, group):
        m = self._model
        m.process_group, m.rank, m.world_size = group, group.rank(), group.size()



class DistributedModel(Scheduler, RoundAgreement, StepHooks, Services, Admission, DDPType):
    """Wrap ``module`` and its ``optimizer`` for data-parallel training with a bagua_lite algorithm.

    ``algorithm`` is an :class:`Algorithm` instance, a registered name, or what ``bagua_lite.load_config``
    takes (a YAML path, a shipped config's name). ``bucket_size_mb`` caps a gradient bucket (default: the
    config's, else 25). Parameters and buffers are broadcast from rank 0 at set-up, and every rank must
    pass the same algorithm options and bucket size and build the same model (checked: a mismatch names
    the differing rank). ``broadcast_buffers`` (default True, as DDP): rank 0's buffers are broadcast
    before every forward with gradients enabled (not for asynchronous algorithms).

    ``grad_scaler``: the ``torch.amp.GradScaler`` of a mixed-precision loop (``scaler.scale(loss).backward()``,
    ``scaler.unscale_(opt)``, ``scaler.step(opt)``), or None. Given, each gradient is unscaled as it is handed
    to the algorithm and each bucket goes back to ``.grad`` at the scaler's scale after the algorithm's ops,
    so residuals, momenta and selections are at one scale whatever the scaler does, and ``unscale_`` of a ``.grad`` that holds more than
    a gradient (topk/gtopk's momentum correction, qadam) is expected. With a power-of-two scale (the
    scaler's default) an algorithm trains bit for bit as it does without a scaler, and an overflow step is
    skipped on every rank. Settable later (``model.grad_scaler = scaler``), between steps.

    ``accelerator``: the ``accelerate.Accelerator`` of a script that keeps ``accelerator.prepare(model, ...)``:
    prepare then keeps this model as it is, Accelerate's mixed precision and GradScaler apply, and
    ``save_state``/``load_state`` save and restore every rank's own state (:mod:`bagua_lite.accelerate_support`).

    ``fault_tolerant`` (default False; see :mod:`bagua_lite.elastic`): when a peer dies, the survivors
    discard the step in flight, agree on the new membership through the rendezvous store, go on on a new
    process group among themselves, and ``optimizer.step()`` of that step raises
    :class:`bagua_lite.MembershipChanged` (catch it and go on with the next batch);
    ``on_membership_change(old_world_size, new_world_size)`` is called first. Fewer than ``min_workers``
    left: every survivor raises :class:`bagua_lite.MembershipError` (checkpoint then, and restart).
    ``rejoin_window_s``: how long the survivors wait for each other to register before the membership is
    closed (a survivor busy for longer when the peer fails is left out). ``heartbeat_timeout_s``: a member
    whose heartbeat (a store key each worker's thread bumps every 0.5 s) stood still this long while the
    others waited for it (a stopped or hung process, whose connections stay open) is treated as lost, so
    the survivors do not wait for the process group's timeout. A worker started later with
    ``bagua_lite.init_process_group()`` joins at a step boundary and receives the state from rank 0. For
    every built-in algorithm with any options (gradient_allreduce, hierarchical too, topk, gtopk, powersgd,
    qadam, local_sgd/diloco, streaming too, decentralized and low_precision_decentralized,
    async_model_average, and auto); an algorithm of one's own that does not set
    ``supports_membership_change`` is refused. The rendezvous store must
    outlive every worker (served outside the workers; not under torchrun, whose agent tears every worker
    down when one fails: docs/fault_tolerance.md).

    A ``torch.nn.parallel.DistributedDataParallel`` in type only, so that whatever unwraps a DDP by
    ``isinstance`` and ``.module`` reaches the wrapped module: Accelerate's ``unwrap_model``, ``get_state_dict``
    and ``save_model``, ``torch.distributed.checkpoint``'s state-dict helpers (plain keys), the user's own
    ``isinstance(model, DDP)``. ``DistributedDataParallel.__init__`` never runs and DDP's reducer does not
    exist: the members that need it (``register_comm_hook``, ``join``, ``reducer``,
    ``require_forward_param_sync``, ...) raise :class:`NotImplementedError` saying what to use instead.
    ``require_backward_grad_sync``, which training scripts set for gradient accumulation, works as DDP's:
    False means :meth:`no_sync`.

    Example::

        model = bagua_lite.DistributedModel(net, opt, algorithm="gtopk", bucket_size_mb=25)
        for x, y in loader:
            loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    """


    #: whole parameters on every rank (:class:`bagua_lite.ShardedModel`'s is True: algorithms see shards)
    sharded = False

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 algorithm: Union[str, os.PathLike, Algorithm] = "gradient_allreduce",
                 bucket_size_mb: Optional[float] = None,
                 group=None, broadcast_parameters: bool = True, broadcast_buffers: bool = True,
                 fault_tolerant: bool = False, min_workers: int = 1, on_membership_change=None,
                 rejoin_window_s: float = 2.0, heartbeat_timeout_s: float = 10.0, grad_scaler=None,
                 accelerator=None):
        torch.nn.Module.__init__(self)  # not DDP's: none of its machinery is built
        self._backward_active = False
        if accelerator is not None:
            grad_scaler = accelerate_support.check(accelerator, grad_scaler)
        self.grad_scaler = grad_scaler  # checked before any traffic
        algorithm, config_bucket = algorithm_from(algorithm, "DistributedModel")
        if bucket_size_mb is None:
            bucket_size_mb = config_bucket if config_bucket is not None else 25.0
        if not isinstance(bucket_size_mb, (int, float)) or isinstance(bucket_size_mb, bool) \
                or not math.isfinite(bucket_size_mb) or bucket_size_mb <= 0:
            raise ValueError(f"DistributedModel: bucket_size_mb must be a finite number > 0, got {bucket_size_mb!r}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedModel: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not hasattr(optimizer, "_optimizer_step_pre_hooks"):
            raise TypeError(
                f"DistributedModel: optimizer is a {type(optimizer).__name__} that wraps an optimizer without being one "
                f"(it never ran torch.optim.Optimizer.__init__, so it takes no step hooks; Accelerate's "
                f"AcceleratedOptimizer is one): build the DistributedModel with the optimizer you created, then "
                f"hand that optimizer to the wrapper (under Accelerate: DistributedModel(net, optimizer, "
                f"accelerator=accelerator) first, then accelerator.prepare(model, optimizer, loader))")
        self._frozen = check_wrappable(module, optimizer)  # the parameters at wrapping (ParametersAtWrap)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("DistributedModel: torch.optim.LBFGS evaluates its closure a data-dependent number of "
                             "times per step, so ranks would run different numbers of communication rounds; use an "
                             "optimizer that evaluates it once (SGD, Adam, AdamW, ...)")
        self.module = module
        self.optimizer = optimizer
        self.algorithm = algorithm
        self.bucket_size_mb = float(bucket_size_mb)
        # a joiner's membership: it waits here to be admitted into the running job, whose state it then receives
        membership = join_running_job(algorithm, group, fault_tolerant, min_workers, on_membership_change,
                                      rejoin_window_s, heartbeat_timeout_s)
        broadcast_parameters = broadcast_parameters or membership is not None
        self.process_group = resolve_group(group, "DistributedModel")
        self.rank = self.process_group.rank()
        self.world_size = self.process_group.size()
        if not isinstance(fault_tolerant, bool):
            raise TypeError(f"DistributedModel: fault_tolerant must be True or False, got {fault_tolerant!r}")
        if fault_tolerant and _control.needs_side_group(self.process_group):
            raise ValueError(f"DistributedModel: fault_tolerant=True needs a process group that carries CPU tensors "
                             f"(gloo, or \"cpu:gloo,cuda:nccl\"), not {dist.get_backend(self.process_group)!r}. On "
                             f"GPUs, init_process_group(\"cpu:gloo,cuda:nccl\") (BAGUA_LITE_CONTROL_GROUP not 'side')")
        _control.setup(self.process_group)  # the group this model's control traffic takes (control_group)
        if fault_tolerant:
            check_fault_tolerant(algorithm, min_workers, on_membership_change, rejoin_window_s, self.world_size,
                                  heartbeat_timeout_s)

        self.broadcast_buffers = bool(broadcast_buffers)
        self._round_scales = None  # the scaler's (scale, 1 / scale) for this round's buckets
        self._check_same_config()
        self._take_group(self.control_group, fault_tolerant)  # a copy, if another open model uses the group
        if broadcast_parameters:
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    comm.broadcast(t.data, 0, self.process_group)

        # Buckets in the order gradients become ready: reverse registration order.
        self.params = [p for p in module.parameters() if p.requires_grad]
        if any(p.device.type == "cpu" for p in self.params):
            runtime.tune_cpu_allocator()  # reuse gradient-sized blocks instead of page-faulting them each step
        self.buckets = [Bucket(i, ps) for i, ps in enumerate(plan_model_buckets(module, self.bucket_size_mb))]
        self._nonfinite_flags = defer_nonfinite_checks(self.buckets)  # None: the hooks' checks answer at once
        self._local_flag = step_hooks.local_flag(self._nonfinite_flags)  # None: the local checks answer at once
        self._local_unread, self._local_pending = [], []
        self._verdict = None if self._nonfinite_flags is None else DeviceVerdict(self.buckets, self._nonfinite_flags)
        self._index = {p: i for i, p in enumerate(self.params)}
        self._used_words = max(1, -(-len(self.params) // agreement.BITS))
        self._slot = {}  # param -> (bucket index, position)
        for b in self.buckets:
            for j, p in enumerate(b.params):
                self._slot[p] = (b.index, j)
        self._engine = _C.Engine()
        self._failfast = FailFast(self.rank)
        self._elastic = None  # fault_tolerant=True: the membership and the step to discard (bagua_lite.elastic)
        if fault_tolerant:
            if self._failfast.store is None:
                raise ValueError("DistributedModel: fault_tolerant=True needs the rendezvous store of the default "
                                 "process group (init it with a store, torchrun's or an init_method)")
            port = _Port(self, self._gather_ints, self._share_state, functools.partial(self._admit, joining=False))
            self._elastic = elastic.Controller(self, port, min_workers, on_membership_change, rejoin_window_s,
                                               membership, heartbeat_timeout_s)
        #: with ``fault_tolerant=True``, what an opted-in algorithm sees of the membership (MembershipView), else None
        self.membership = elastic.MembershipView(self._elastic) if fault_tolerant else None
        self._no_tensor = torch.empty(0)
        self._engine_abandoned = False
        self._nonfinite_error = None
        self._local_bad = None  # first parameter with a non-finite local gradient (relaxations that keep them local)
        self._unsynced = False  # a backward ran under no_sync() and no synchronised round followed it yet
        self._sync_enabled = True
        self._ready = [0] * len(self.buckets)
        self._marked = [[False] * len(b.params) for b in self.buckets]
        self._next_bucket = 0
        self.timings = {"backward_wait_s": 0.0, "agree_s": 0.0}  # waited for the buckets, in the agreement after
        #: the algorithm the model was built with; ``algorithm`` differs from it after a
        #: :meth:`switch_algorithm` (auto hands the model its pick)
        self.configured_algorithm = algorithm
        # The model owns the optimizer's hooks; algorithms see them as before_step()/after_step().
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(lambda *_: self._after_step())]
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self._param_ids = {id(p) for p in module.parameters()}
        step_hooks.watch_foreign_steps(self)
        try:  # a refusal from here on (the algorithm's, Accelerate's) leaves the module and optimizer as they were
            self._install(algorithm)
            if accelerator is not None:
                accelerate_support.attach(self, accelerator)
            if membership is not None:
                self._admit(joining=True)
                launch.joined()
                if on_membership_change is not None:
                    on_membership_change(len(membership.read(membership.generation - 1)), self.world_size)
        except BaseException:
            self._undo_construction()
            raise

    def _install(self, algorithm):
        algorithm.model = self
        self.algorithm = algorithm
        algorithm.init(self)
        if self.algorithm is not algorithm:  # its init handed the model another algorithm (auto)
            return
        ops = [list(algorithm.bucket_ops(b)) for b in self.buckets]
        for b, o in zip(self.buckets, ops):
            b.ops = o

    def switch_algorithm(self, algorithm: Algorithm) -> None:
        """Hand the training to ``algorithm`` from the next step on (auto hands the model its pick). Call at
        a step boundary, on every rank alike (from an algorithm's ``init`` or ``after_step``, or between
        steps): the current algorithm is closed, ``algorithm`` takes over the step count and is set up on
        this model's buckets exactly as if the model had been built with it."""
        if not isinstance(algorithm, Algorithm):
            raise TypeError(f"switch_algorithm: expected a bagua_lite.Algorithm, got {type(algorithm).__name__}")
        if self._backward_active:
            raise RuntimeError("switch_algorithm: called inside a backward; switch at a step boundary")
        old = self.algorithm
        algorithm.step = old.step
        old.close()
        self._install(algorithm)

    # ---- user-facing ---------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._pre_forward()
        out = self.module(*args, **kwargs)
        self._post_forward(out)
        return out

    # Under torch.compile of the wrapped model only the module is traced: the hooks around it talk to the
    # engine, threads and the store, which dynamo cannot trace, and must run eagerly on every call.
    @_compat.compiler_disable
    def _pre_forward(self):
        if torch.nn.parallel.DistributedDataParallel._get_active_ddp_module() is not None:
            # Every rank is inside a DDP forward alike, so every rank raises here before any traffic of ours.
            raise RuntimeError(
                "bagua_lite: this DistributedModel runs inside a DistributedDataParallel, which would average every "
                "gradient a second time (Accelerate's accelerator.prepare(model) on several processes adds one): "
                "build it with DistributedModel(net, optimizer, ..., accelerator=accelerator), which "
                "accelerator.prepare(model, optimizer, loader) then keeps as it is")
        self._failfast.raise_if_failed("its ranks are out of step for good: restart from the last checkpoint")
        self._frozen.check()
        if self._sync_enabled and torch.is_grad_enabled():
            self._settle_skipped_step()
        if self.broadcast_buffers and self._sync_enabled and torch.is_grad_enabled() and not self.algorithm.asynchronous:
            if self._elastic is None:
                self._sync_buffers()
            elif self._elastic.pending is None:
                try:  # a peer's failure is seen (fail fast) instead of waited for
                    self._sync_buffers()
                except (PeerFailedError, RuntimeError) as e:
                    self._elastic.recover(e)  # this step is discarded: it runs locally, optimizer.step() raises
        if self._elastic is not None and self._elastic.pending is None and not self.algorithm.sync_gradients() \
                and torch.is_grad_enabled():
            try:  # local steps run no collective: look at the store for a lost peer (one round trip)
                self._failfast.check()
                self.algorithm.peer_lost()  # its own thread's communication (asynchronous averaging)
                if self.algorithm.asynchronous:  # no wait of this thread watches the heartbeats: look here
                    self._elastic.watch_every()
            except PeerFailedError as e:
                self._elastic.recover(e, periodic="store")  # this step runs locally, optimizer.step() raises
            margin = self.algorithm.store_admission_margin
            if margin is not None and self._elastic.pending is None:
                self._elastic.look_for_admission(margin)
        self._algorithm_hook(self.algorithm.before_forward)

    def _sync_buffers(self):
        """DDP's ``broadcast_buffers``: rank 0's buffers (BatchNorm's statistics) to every rank before each training
        forward, one broadcast per dtype. Asynchronous algorithms skip it (every rank would wait for rank 0)."""
        buffers = [b for b in self.module.buffers() if b.numel()] if self.world_size > 1 else []
        if not buffers:  # one rank: nothing to send, not even the walk over every submodule
            return
        self._failfast.step = self.algorithm.step + 1  # the step this broadcast is in (a peer may have closed)
        with torch.no_grad():
            for group in plan_buckets(buffers, 1 << 62):  # one flat tensor per dtype and device
                flat = torch._utils._flatten_dense_tensors(group)
                send = functools.partial(comm.broadcast, flat, 0, self.process_group)  # on the engine: fail fast
                send() if flat.is_cuda and self._elastic is None else self.run_collective("broadcast_buffers", send)
                for b, synced in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                    b.copy_(synced)


    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's flag, with :meth:`no_sync`'s meaning: set False, the forwards and backwards that follow
        accumulate gradients locally; set True again before the last micro-batch's forward (nanoGPT's
        ``model.require_backward_grad_sync = (micro_step == steps - 1)``), bit for bit as ``no_sync()``."""
        return self._sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value):
        if value not in (True, False):
            raise TypeError(f"DistributedModel: require_backward_grad_sync must be True or False, got {value!r}")
        if self._backward_active:
            raise RuntimeError("DistributedModel: require_backward_grad_sync set inside a backward; set it before "
                               "the forward, as with DDP")
        self._sync_enabled = bool(value)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside the block, like DDP's ``no_sync``."""
        old = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = old

    def close(self):
        """Remove hooks, end the algorithm's own work (``Algorithm.close``) and stop the engine thread."""
        self._failfast.announce_closed(self.algorithm.step)  # a peer waiting in a later step stops (uneven)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        step_hooks.forget(self)
        self._release_group()
        try:
            self.algorithm.close()  # first: it may still take part in an admission (async_model_average)
        finally:
            if self._elastic is not None:
                self._elastic.close()
            if not self._engine_abandoned:
                self._engine.shutdown()
            if self._verdict is not None:  # a step a fused optimizer skipped that no forward since reported
                self._verdict.warn_unreported(lambda step, local: self._result_error(step, local, late=True))

    def algorithm_state_dict(self) -> dict:
        """The algorithm's state (residuals, momenta, counters); after a switch (auto's pick), the configured
        algorithm's state too, so loading it switches to the same pick."""
        self._settle_skipped_step()
        state = self.algorithm.state_dict()
        if self.algorithm is not self.configured_algorithm:
            return {"configured": self.configured_algorithm.state_dict(), "active": state}
        return state

    def load_algorithm_state_dict(self, state: dict) -> None:
        if set(state) == {"configured", "active"}:
            self.configured_algorithm.load_state_dict(state["configured"])  # switches to the saved pick
            self.algorithm.load_state_dict(state["active"])
        else:
            self.algorithm.load_state_dict(state)

    @property
    def grad_scaler(self):
        """The loop's ``torch.amp.GradScaler`` (see the class docstring), or None."""
        return self._grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler):
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"DistributedModel: grad_scaler must be a torch.amp.GradScaler or None, got "
                            f"{type(scaler).__name__}")
        if self._backward_active:
            raise RuntimeError("DistributedModel: grad_scaler set inside a backward; set it between steps")
        self._grad_scaler = scaler

    def engine_stats(self, reset: bool = False) -> dict:
        """The engine thread's counters since the last reset (``busy_seconds``: time it ran ops), as the
        benchmark reads them; ``reset``: zero them after reading."""
        stats = self._engine.stats()
        if reset:
            self._engine.reset_stats()
        return stats

    @property
    def control_group(self):
        """The group that carries this model's control traffic: the model's group, or the gloo group made
        beside an NCCL one (``bagua_lite._control``)."""
        return _control.of(self.process_group)







