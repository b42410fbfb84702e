"""DistributedModel: the training wrapper and its bucketing scheduler.

One step, as data (see DESIGN.md):
1. ``forward``: ``algorithm.before_forward()``, then the wrapped module.
2. ``backward``: each parameter's post-accumulate-grad hook makes ``.grad`` a view of its bucket slot
   and marks it ready. The moment the *next bucket in order* is complete it is handed to the C++ engine,
   whose worker thread runs that bucket's ops while autograd goes on with earlier layers.
3. end of backward (an autograd engine callback): buckets not yet handed over (parameters that got no
   gradient this step are zero-filled) are submitted, the scheduler waits for the engine, results are
   in ``.grad``; the ranks agree (one tiny all_gather) whether any rank's gradient held inf/NaN: if not,
   ``algorithm.commit_round()``; if so, the algorithm's ``register_state(..., rollback=True)`` tensors are
   put back as they were before the round and every rank's ``.grad`` becomes NaN (a loss scaler skips
   the step; without one ``optimizer.step()`` raises, naming the ranks).
4. ``optimizer.step()``: a closure's forward and backward first, then ``algorithm.before_step()``, the
   optimizer's update, ``algorithm.after_step()`` (the model's own step hooks: no algorithm has any).
The agreement after the buckets also carries every rank's step count, so a rank that took a step more or
fewer than the others is reported on every rank before anything is applied; where message sizes depend
on the step (``algorithm.step_dependent_wire``), a synchronised backward also starts with that check,
before any bucket travels.
Buckets are submitted in one fixed order on every rank, so collectives always match across ranks.
"""
import contextlib
import functools
import hashlib
import json
import math
import time
import weakref
from typing import Union

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import _C, _compat, _control, agreement, comm, launch, runtime
from ._failfast import FailFast, PeerFailedError
from ._groups import resolve_group
from . import elastic
from .algorithm import Algorithm, build
from .bucket import Bucket, plan_buckets, plan_model_buckets


_BITS = 62  # parameters per int64 word of the used-parameter bitmap
_ALL_USED = (1 << _BITS) - 1


def _config_digest(algorithm: Algorithm, bucket_size_mb: float) -> int:
    text = json.dumps({"algorithm": algorithm.name, "options": algorithm.options(), "bucket_size_mb": bucket_size_mb},
                      sort_keys=True, default=repr)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


_LIVE = weakref.WeakSet()  # DistributedModels not yet closed, for _refuse_foreign_step
_FOREIGN_HOOK = []


def _refuse_foreign_step(optimizer, args, kwargs):
    """A global optimizer step pre-hook: an optimizer other than a live model's own that would step that
    model's parameters is refused, since the model's step accounting, refusals and algorithm hooks ride on
    its own optimizer (a second optimizer's step would apply gradients no algorithm saw through)."""
    for model in list(_LIVE):
        if optimizer is model.optimizer:
            continue
        mine = model._param_ids
        if any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
            raise RuntimeError(
                f"bagua_lite: a {type(optimizer).__name__} steps parameters of a DistributedModel built with "
                f"another optimizer ({type(model.optimizer).__name__}); a DistributedModel takes one optimizer "
                f"for all its parameters: give it one optimizer with several param groups")


def _take_closure(optimizer, args, kwargs):
    """(closure or None, args, kwargs without it) of an ``optimizer.step(...)`` call; ``args[0]`` is the
    optimizer itself (as torch hands them to a step pre-hook)."""
    if kwargs.get("closure") is not None:
        kwargs = dict(kwargs)
        return kwargs.pop("closure"), args, kwargs
    if len(args) > 1 and callable(args[1]):
        return args[1], args[:1] + tuple(args[2:]), kwargs
    return None, args, kwargs


def _digest(obj) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(obj).encode()).digest()[:7], "little")


def _check_fault_tolerant(algorithm, min_workers, callback, window, world_size, heartbeat):
    """``fault_tolerant=True``'s arguments, refused before any traffic (the same on every rank)."""
    if not getattr(algorithm, "supports_membership_change", False):
        raise ValueError(
            f"DistributedModel: fault_tolerant=True needs an algorithm that carries on when the membership "
            f"changes (Algorithm.supports_membership_change): every built-in one does, with any options "
            f"(gradient_allreduce, topk, gtopk, powersgd, qadam, local_sgd, diloco, decentralized, "
            f"low_precision_decentralized, async_model_average, and auto when each of its candidates does); "
            f"got {algorithm.name} ({algorithm!r}), which does not say it does (docs/fault_tolerance.md: what an "
            f"algorithm of one's own needs)")
    top = world_size if world_size is not None else float("inf")  # a joiner does not know the size yet
    if not isinstance(min_workers, int) or isinstance(min_workers, bool) or not 1 <= min_workers <= top:
        raise ValueError(f"DistributedModel: min_workers must be an int in [1, world size {world_size}], "
                         f"got {min_workers!r}")
    if callback is not None and not callable(callback):
        raise TypeError(f"DistributedModel: on_membership_change must be callable(old_world_size, "
                        f"new_world_size), got {type(callback).__name__}")
    if not isinstance(window, (int, float)) or isinstance(window, bool) or not 0 < window < 3600:
        raise ValueError(f"DistributedModel: rejoin_window_s must be a number of seconds in (0, 3600), got "
                         f"{window!r}")
    if not isinstance(heartbeat, (int, float)) or isinstance(heartbeat, bool) or not 1 <= heartbeat <= 86400:
        raise ValueError(f"DistributedModel: heartbeat_timeout_s must be a number of seconds in [1, 86400] (at "
                         f"least two heartbeats of {elastic.HEARTBEAT_S} s), got {heartbeat!r}")


def _ddp_only(what: str, instead: str):
    """A DDP member that needs DDP's own machinery (its C++ reducer), which a DistributedModel does not
    have: refused on use with what to do instead."""
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(
            f"bagua_lite.DistributedModel is a DistributedDataParallel in type only (so that tools which unwrap "
            f"DDP reach its module); it has no DDP reducer, so DDP's {what} does not apply: {instead}")
    return refuse


def _ddp_only_attribute(name: str, instead: str) -> property:
    refuse = _ddp_only(name, instead)
    return property(refuse, refuse)


class DistributedModel(DistributedDataParallel):
    """Wrap ``module`` and its ``optimizer`` for data-parallel training with a bagua_lite algorithm.

    ``algorithm`` is an :class:`Algorithm` instance or a registered name. ``bucket_size_mb`` caps a
    gradient bucket. Parameters and buffers are broadcast from rank 0 at set-up, and every rank must
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
    ``require_backward_grad_sync``, ...) raise :class:`NotImplementedError` saying what to use instead.

    Example::

        model = bagua_lite.DistributedModel(net, opt, algorithm="gtopk", bucket_size_mb=25)
        for x, y in loader:
            loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    """

    # DDP's members over its reducer and join machinery; the nn.Module ones DDP overrides are put back.
    reducer = _ddp_only_attribute("reducer", "bagua_lite's buckets live in the C++ engine")
    require_backward_grad_sync = _ddp_only_attribute(
        "require_backward_grad_sync", "use model.no_sync() around the forward and backward that must not sync "
        "(Accelerate: accelerator.no_sync / accumulate; trigger_sync_in_backward is not supported)")
    require_forward_param_sync = _ddp_only_attribute("require_forward_param_sync", "use model.no_sync()")
    register_comm_hook = _ddp_only(
        "register_comm_hook", "pick the compression with the algorithm (algorithm=..., compression=...), or "
        "use bagua_lite.hooks on a torch DDP model")
    join = _ddp_only("join", "uneven inputs are not supported; give every rank the same number of batches")
    join_hook = _ddp_only("join_hook", "uneven inputs are not supported")
    join_device = _ddp_only_attribute("join_device", "uneven inputs are not supported")
    join_process_group = _ddp_only_attribute("join_process_group", "uneven inputs are not supported")
    _distributed_rank = _ddp_only_attribute("_distributed_rank", "use model.rank")
    scatter = _ddp_only("scatter", "inputs are not scattered: each process feeds its own batch")
    gather = _ddp_only("gather", "outputs are not gathered: each process keeps its own")
    to_kwargs = _ddp_only("to_kwargs", "inputs are not scattered: each process feeds its own batch")
    will_sync_module_buffers = _ddp_only("will_sync_module_buffers", "read model.broadcast_buffers")
    _get_ddp_logging_data = _ddp_only("_get_ddp_logging_data", "read model.timings")
    _set_static_graph = _ddp_only("_set_static_graph", "bagua_lite needs no static graph")
    static_graph = False  # read by Lightning through getattr; bagua_lite's graph may change every step
    broadcast_buffers = True  # a plain attribute here (a read-only property on DDP); set in __init__
    train = torch.nn.Module.train
    __getstate__ = torch.nn.Module.__getstate__
    __setstate__ = torch.nn.Module.__setstate__

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 algorithm: Union[str, Algorithm] = "gradient_allreduce", bucket_size_mb: float = 25.0,
                 group=None, broadcast_parameters: bool = True, broadcast_buffers: bool = True,
                 fault_tolerant: bool = False, min_workers: int = 1, on_membership_change=None,
                 rejoin_window_s: float = 2.0, heartbeat_timeout_s: float = 10.0, grad_scaler=None):
        torch.nn.Module.__init__(self)  # not DDP's: none of its machinery is built
        self._backward_active = False
        self.grad_scaler = grad_scaler  # checked before any traffic
        if isinstance(algorithm, str):
            from . import algorithms  # noqa: F401  (registers the built-ins)
            algorithm = build(algorithm)
        if not isinstance(algorithm, Algorithm):
            raise TypeError(f"DistributedModel: algorithm must be a bagua_lite.Algorithm or a registered name, "
                            f"got {type(algorithm).__name__}")
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
                f"hand that optimizer to the wrapper (under Accelerate: DistributedModel(net, optimizer) first, then "
                f"accelerator.prepare(optimizer, loader))")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("DistributedModel: torch.optim.LBFGS evaluates its closure a data-dependent number of "
                             "times per step, so ranks would run different numbers of communication rounds; use an "
                             "optimizer that evaluates it once (SGD, Adam, AdamW, ...)")
        self.module = module
        self.optimizer = optimizer
        self.algorithm = algorithm
        self.bucket_size_mb = float(bucket_size_mb)
        membership = None  # a joiner's: it waits here to be admitted into the running job
        joining = launch._JOIN.get("store")  # set by bagua_lite.init_process_group when a job already runs
        if joining is not None:
            if fault_tolerant is not True or group is not None:
                raise RuntimeError(
                    "DistributedModel: this process joins a running fault-tolerant job (bagua_lite.init_process_group"
                    "() found it in the store and made no process group): build the model with fault_tolerant=True "
                    "and no group=, as the job's other workers did")
            _check_fault_tolerant(algorithm, min_workers, on_membership_change, rejoin_window_s, None,
                                  heartbeat_timeout_s)
            membership = elastic.wait_for_admission(joining, rejoin_window_s)
            elastic.reform(joining, membership.generation, membership.members, membership.me,
                           *launch._JOIN["group"], watch=elastic.PulseWatch(
                               membership.heartbeat.store, membership.members, membership.me, heartbeat_timeout_s))
            broadcast_parameters = True  # the members send theirs (DistributedModel._admit)
        self.process_group = resolve_group(group, "DistributedModel")
        self.rank = self.process_group.rank()
        self.world_size = self.process_group.size()
        if not isinstance(fault_tolerant, bool):
            raise TypeError(f"DistributedModel: fault_tolerant must be True or False, got {fault_tolerant!r}")
        if fault_tolerant and _control.needs_side_group(self.process_group):
            raise ValueError(f"DistributedModel: fault_tolerant=True needs a process group that carries CPU tensors "
                             f"(gloo, or \"cpu:gloo,cuda:nccl\"); this one's backend is "
                             f"{dist.get_backend(self.process_group)!r}. On GPUs, init_process_group("
                             f"\"cpu:gloo,cuda:nccl\") (BAGUA_LITE_CONTROL_GROUP must not be 'side')")
        _control.setup(self.process_group)  # the group this model's control traffic takes (control_group)
        if fault_tolerant:
            _check_fault_tolerant(algorithm, min_workers, on_membership_change, rejoin_window_s, self.world_size,
                                  heartbeat_timeout_s)

        self.broadcast_buffers = bool(broadcast_buffers)
        self._round_scales = None  # the scaler's (scale, 1 / scale) for this round's buckets
        self._check_same_config()
        if broadcast_parameters:
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    comm.broadcast(t.data, 0, self.process_group)

        # Buckets in the order gradients become ready: reverse registration order.
        self.params = [p for p in module.parameters() if p.requires_grad]
        if any(p.device.type == "cpu" for p in self.params):
            runtime.tune_cpu_allocator()  # reuse gradient-sized blocks instead of page-faulting them each step
        self.buckets = [Bucket(i, ps) for i, ps in enumerate(plan_model_buckets(module, self.bucket_size_mb))]
        self._index = {p: i for i, p in enumerate(self.params)}
        self._used_words = max(1, -(-len(self.params) // _BITS))
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
            self._elastic = elastic.Controller(self, min_workers, on_membership_change, rejoin_window_s, membership,
                                               heartbeat_timeout_s)
        self._no_tensor = torch.empty(0)
        self._engine_abandoned = False
        self._nonfinite_error = None
        self._local_bad = None  # first parameter with a non-finite local gradient (relaxations that keep them local)
        self._unsynced = False  # a backward ran under no_sync() and no synchronised round followed it yet
        self._sync_enabled = True
        self._backward_active = False
        self._ready = [0] * len(self.buckets)
        self._marked = [[False] * len(b.params) for b in self.buckets]
        self._next_bucket = 0
        # seconds this process waited: for the buckets after backward, and in the agreement after them
        self.timings = {"backward_wait_s": 0.0, "agree_s": 0.0}
        #: the algorithm the model was built with; ``algorithm`` differs from it after a
        #: :meth:`switch_algorithm` (auto hands the model its pick)
        self.configured_algorithm = algorithm
        # The model owns the optimizer's hooks; algorithms see them as before_step()/after_step().
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(lambda *_: self._after_step())]
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self._param_ids = {id(p) for p in module.parameters()}
        if not _FOREIGN_HOOK:
            _FOREIGN_HOOK.append(register_optimizer_step_pre_hook(_refuse_foreign_step))
        _LIVE.add(self)
        self.algorithm = algorithm
        self._install(algorithm)
        if membership is not None:
            self._admit(joining=True)
            launch._JOIN.clear()
            if on_membership_change is not None:
                on_membership_change(len(membership.read(membership.generation - 1)), self.world_size)

    def _admit(self, joining: bool):
        """Fault tolerance, a joiner admitted (generation just formed): what a joiner's constructor sends
        and receives, mirrored on every member, in the constructor's order: the config check, rank 0's
        parameters and buffers, the algorithm's set-up on the new group (``init`` on the joiner, ``regroup``
        on the members: it may make process groups), then the optimizer's state and the algorithm's shared
        state, which a joiner loads."""
        if not joining:
            self._check_same_config()
            self._share_weights(0, keep_own=self.algorithm.replicas_differ)
            if self.configured_algorithm is not self.algorithm:  # auto's pick: a joiner's auto takes it in init
                box = [self.configured_algorithm.state_dict() if self.rank == 0 else None]
                dist.broadcast_object_list(box, group_src=0, group=self.control_group)
            self.algorithm.regroup()
            for b in self.buckets:
                b.ops = list(self.algorithm.bucket_ops(b))
        self._share_state(0, receive=joining, weights=False)

    def _share_weights(self, src: int, keep_own: bool = False):
        """Rank ``src``'s parameters and buffers to every rank (a collective); ``keep_own``: this rank
        receives them into scratch copies and keeps its own (replicas that differ by design)."""
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                comm.broadcast(t.data.clone() if keep_own and self.rank != src else t.data, src,
                               self.process_group)

    def _share_state(self, src: int, receive: bool, weights: bool = True):
        """Rank ``src``'s parameters and buffers (``weights``), optimizer state and algorithm shared state to
        every rank (a collective); ``receive``: this rank loads the latter two (a joiner, a survivor behind)."""
        if weights:
            self._share_weights(src)
        state = {"optimizer": self.optimizer.state_dict(), "algorithm": self.algorithm.shared_state_dict()} \
            if self.rank == src else None
        state = elastic.broadcast_state(state, self.process_group, src)
        if receive:
            self.optimizer.load_state_dict(state["optimizer"])
            self.algorithm.load_shared_state_dict(state["algorithm"])

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
    @torch.compiler.disable
    def _pre_forward(self):
        if torch.nn.parallel.DistributedDataParallel._get_active_ddp_module() is not None:
            # Every rank is inside a DDP forward alike, so every rank raises here before any traffic of ours.
            raise RuntimeError(
                "bagua_lite: this DistributedModel runs inside a DistributedDataParallel, which would average every "
                "gradient a second time (Accelerate's accelerator.prepare(model) on several processes adds one): "
                "do not prepare the model; prepare the optimizer, data loaders and schedulers only, "
                "accelerator.prepare(optimizer, loader), after building the DistributedModel")
        self._failfast.raise_if_failed("its ranks are out of step for good: restart from the last checkpoint")
        if self._sync_enabled and torch.is_grad_enabled():
            self._settle_skipped_step()
        if self.broadcast_buffers and self._sync_enabled and torch.is_grad_enabled() and not self.algorithm.asynchronous:
            if self._elastic is None:
                self._sync_buffers()
            elif self._elastic.pending is None:
                try:  # on the engine, so that a peer's failure is seen (fail fast) instead of waited for
                    self.run_collective("broadcast_buffers", self._sync_buffers)
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

    @torch.compiler.disable
    def _post_forward(self, out):
        if torch.is_grad_enabled() and self._sync_enabled:
            # Arm the end-of-backward callback as soon as backward reaches the output, so a rank whose
            # parameters get no gradient at all still runs every bucket (and its peers do not hang).
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._on_output_grad, node=t.grad_fn))

    def _sync_buffers(self):
        """DDP's ``broadcast_buffers``: rank 0's buffers (BatchNorm's running statistics) to every rank
        before each training forward, one coalesced broadcast per dtype. Asynchronous algorithms skip it
        (it would make every rank wait for rank 0 each step); their averaging carries parameters only."""
        buffers = [b for b in self.module.buffers() if b.numel()]
        if self.world_size == 1 or not buffers:
            return
        with torch.no_grad():
            for group in plan_buckets(buffers, 1 << 62):  # one flat tensor per dtype and device
                flat = torch._utils._flatten_dense_tensors(group)
                comm.broadcast(flat, 0, self.process_group)
                for b, synced in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                    b.copy_(synced)

    def _on_output_grad(self, grad, node=None):
        if self._elastic is not None and self._elastic.pending is not None:
            return grad  # a discarded step (a peer was lost in its forward): nothing travels
        if self._sync_enabled and self.algorithm.sync_gradients() and self._accumulates(node):
            self._start_backward()
        return grad

    def _accumulates(self, node) -> bool:
        """False during ``torch.autograd.grad`` (gradient penalties, saliency) and ``backward(inputs=...)``
        that leaves our parameters out: like DDP they start no communication round and leave ``.grad``
        alone. A ``backward()`` starts one, even when none of this rank's parameters takes part in it (they
        contribute zeros, so the peers' collectives complete)."""
        try:
            if any(torch._C._will_engine_execute_node(get_gradient_edge(p).node) for p in self.params):
                return True
        except RuntimeError:  # torch refuses to answer for a leaf during autograd.grad()
            return False
        # No parameter accumulates: either none is in this graph (a backward() this rank's parameters sit
        # out: run the round) or the backward skips them (autograd.grad w.r.t. inputs: do not).
        mine, seen, stack = {id(p) for p in self.params}, set(), [node]
        while stack:
            n = stack.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            if id(getattr(n, "variable", None)) in mine:
                return False
            stack.extend(f for f, _ in n.next_functions)
        return True

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
        for h in self._hooks:
            h.remove()
        self._hooks = []
        _LIVE.discard(self)
        try:
            self.algorithm.close()  # first: it may still take part in an admission (async_model_average)
        finally:
            if self._elastic is not None:
                self._elastic.close()
            if not self._engine_abandoned:
                self._engine.shutdown()

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

    @property
    def control_group(self):
        """The group that carries this model's control traffic: the model's group, or the gloo group made
        beside an NCCL one (``bagua_lite._control``)."""
        return _control.of(self.process_group)

    # ---- set-up checks ---------------------------------------------------------------------------------
    def _check_same_config(self):
        """One all_gather of two digests: the algorithm's config and the module's parameter layout (names,
        shapes, dtypes, requires_grad, as DDP checks). A mismatch raises on every rank, naming the ranks
        (and, for the layout, the first differing parameter) before any collective that could abort."""
        layout = [(name, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
                  for name, p in self.module.named_parameters()]
        configured = getattr(self, "configured_algorithm", self.algorithm)  # auto, also once it picked
        mine = torch.tensor([_config_digest(configured, self.bucket_size_mb), _digest(layout)], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self.control_group)
        differ = [r for r, d in enumerate(everyone) if int(d[0]) != int(everyone[0][0])]
        if differ:
            raise ValueError(f"DistributedModel: ranks were started with different configurations: rank(s) "
                             f"{differ} differ from rank 0 (this is rank {self.rank}, running "
                             f"{configured!r}, bucket_size_mb={self.bucket_size_mb})")
        differ = [r for r, d in enumerate(everyone) if int(d[1]) != int(everyone[0][1])]
        if differ:
            layouts = [None] * self.world_size
            dist.all_gather_object(layouts, layout, group=self.control_group)
            r, ref, other = differ[0], layouts[0], layouts[differ[0]]
            i = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
            what = lambda entry: ("no parameter" if entry is None else  # noqa: E731
                                  f"{entry[0]!r} shape {list(entry[1])} {entry[2]} requires_grad={entry[3]}")
            raise ValueError(
                f"DistributedModel: the model differs across ranks: rank(s) {differ} differ from rank 0 "
                f"(this is rank {self.rank}); first difference, parameter #{i}: rank 0 has "
                f"{what(ref[i] if i < len(ref) else None)}, rank {r} has {what(other[i] if i < len(other) else None)}. "
                f"Every rank must build the same model and freeze the same parameters")

    # ---- the scheduler -----------------------------------------------------------------------------------
    def _on_grad_ready(self, p):
        if self._elastic is not None and self._elastic.pending is not None:
            return  # a discarded step (a peer was lost in its forward): nothing travels
        if not self._sync_enabled:
            if not self._unsynced and self.algorithm.sync_gradients():
                self._unsynced = True
            return
        if not self.algorithm.sync_gradients():
            # The gradient stays on this rank (decentralized, local SGD, async): check it while it is hot.
            if self._local_bad is None and p.grad is not None and not _C.all_finite(p.grad):
                self._local_bad = p
            return
        self._start_backward()
        bi, j = self._slot[p]
        self._hand_over(self.buckets[bi], j, p)
        if not self._marked[bi][j]:
            self._marked[bi][j] = True
            self._ready[bi] += 1
        self._submit_ready()

    def _start_backward(self):
        if not self._backward_active:
            if self.algorithm.step_dependent_wire:
                # Sizes depend on the step: check it on the engine ahead of bucket 0, overlapped with
                # backward. Otherwise the step count rides in the agreement after the buckets.
                self._engine.submit(-1, self._no_tensor, [self._step_count_check])
            self._backward_active = True
            self._round_scales = _compat.scaler_scales(self.grad_scaler)  # (scale, 1 / scale) or None
            self._nonfinite_error = None
            self.algorithm.nonfinite_buckets.clear()
            self.algorithm._begin_round()  # register_state(rollback=True): before any bucket op runs
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _gather_ints(self, values, group=None, on_engine=False):
        """Every rank's list of ints (one all_gather of len(values) int64 per rank), as a list per rank.
        ``on_engine``: called from an op on the engine thread (else, with fault_tolerant, it runs there)."""
        if self.world_size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        out = torch.empty(self.world_size * len(values), dtype=torch.int64)
        pg = _control.of(self.process_group if group is None else group)
        if self._elastic is not None and not on_engine:  # so that a peer's failure is seen, not waited for
            try:
                self.run_collective("step agreement", lambda: _compat.all_gather_single(out, mine, group=pg))
            except (PeerFailedError, RuntimeError) as e:
                self._elastic.comm_error = e
                raise
            return out.view(self.world_size, len(values)).tolist()
        try:  # blocking: a peer that failed in this round's buckets never gets here (they fail fast)
            _compat.all_gather_single(out, mine, group=pg)
        except RuntimeError as e:
            self._failfast.announce(f"a step-control all_gather failed: {e}")
            raise
        return out.view(self.world_size, len(values)).tolist()

    def _gather_with_joiners(self, values, group=None, on_engine=False):
        """:meth:`_gather_ints`, with fault tolerance on the model's group also carrying rank 0's count of
        workers waiting to join (so every member learns it at the same step and admits them after it);
        returned without that column."""
        if self._elastic is None or group is not None:
            return self._gather_ints(values, group, on_engine)
        rows = self._gather_ints([self._elastic.joiners_waiting()] + list(values), group, on_engine)
        if any(row[0] for row in rows):
            self._elastic.grow_after_step = True  # on every rank alike
        return [row[1:] for row in rows]

    def _step_count_check(self, _flat):
        """Before any bucket travels: do all ranks enter this round at the same step count?"""
        self._check_steps([r[0] for r in self._gather_ints([self.algorithm.step], on_engine=True)],
                          "nothing was exchanged")

    def _check_steps(self, steps, what):
        """Raise (``agreement.check``) unless every rank's step count in ``steps`` is the same."""
        agreement.check(*agreement.steps_span(steps), lambda: self._out_of_step(steps, what))

    def _out_of_step(self, steps, what):
        """The error for ranks whose step counts differ, or None."""
        lo, hi = agreement.steps_span(steps)
        if lo == hi:
            return None
        by_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
        return (f"bagua_lite: ranks are out of step: a synchronised backward started at different optimizer step "
                f"counts ({by_rank}; this is rank {self.rank}). Every rank must call backward() and "
                f"optimizer.step() the same number of times (a rank took an extra step or skipped one); {what} "
                f"in this round")

    def _agree_after_round(self, unused):
        """After the buckets, one all_gather: did any rank's gradient hold inf/NaN (commit or discard the
        round on every rank), and which parameters did no rank use (their ``.grad`` becomes None, as with
        DDP, so weight decay and momentum leave them alone)? ``unused``: this rank's unused parameters."""
        bad = self.algorithm.nonfinite_buckets
        words = [_ALL_USED] * self._used_words  # bit set: used on this rank
        for i in unused:
            words[i // _BITS] &= ~(1 << (i % _BITS))
        rows = self._gather_with_joiners([min(bad) if bad else -1, self.algorithm.step] + words)
        firsts = [row[0] for row in rows]
        msg = self._out_of_step([row[1] for row in rows], "nothing was applied")
        if msg:
            self.algorithm._roll_back()
            self._failfast.announce(msg)  # the model is failed: forward() and optimizer.step() refuse
            raise RuntimeError(msg)
        if any(w != _ALL_USED for row in rows for w in row[2:]):  # some rank left some parameter out
            used = [0] * self._used_words
            for row in rows:
                used = [a | b for a, b in zip(used, row[2:])]
            for i, p in enumerate(self.params):
                if not used[i // _BITS] >> (i % _BITS) & 1:
                    p.grad = None
        ranks = [r for r, b in enumerate(firsts) if b >= 0]
        if not ranks:
            self.algorithm.commit_round()
            return
        self.algorithm._roll_back()
        with torch.no_grad():
            for b in self.buckets:
                b.flat.fill_(float("nan"))
        where = ", ".join(f"rank {r} (bucket {firsts[r]} first)" for r in ranks)
        self._nonfinite_error = (
            f"bagua_lite: non-finite gradient (inf or NaN) at step {self.algorithm.step} on {where}; every rank "
            f"skipped this round: .grad is NaN on all ranks and {self.algorithm.name}'s state (residuals, "
            f"momenta) is as before it. A loss scaler (torch.amp.GradScaler) skips such steps; without one, "
            f"optimizer.step() refuses to apply it (this is rank {self.rank}). Look for what produced the "
            f"inf/NaN: learning rate, loss, inputs")

    def _before_step(self, optimizer, args, kwargs):
        """The optimizer's step pre-hook, the only one: a closure first (it runs forward and backward, as
        in ``loss = closure(); optimizer.step()``), then the refusals, then the algorithm's ``before_step``."""
        closure, args, kwargs = _take_closure(optimizer, args, kwargs)
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
        if self._elastic is not None and self._elastic.pending is not None:
            raise self._elastic.take_pending()  # the step in flight was discarded on every survivor
        self._failfast.raise_if_failed("nothing is applied: restart from the last checkpoint")
        if self._nonfinite_error is not None:
            raise FloatingPointError(self._nonfinite_error)
        if self._local_bad is not None:
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
        self._algorithm_hook(self.algorithm.before_step)
        return (args, kwargs) if closure is not None else None

    def _settle_skipped_step(self):
        """A local non-finite gradient's step was skipped (by a loss scaler, or ``optimizer.step()`` raised):
        it still counts, as a step that moved nothing, so this rank's schedule (exchanges, periodic
        averages) stays paired with its peers'. Runs at the next training forward, or before a checkpoint."""
        if self._local_bad is not None:
            self._local_bad = None
            self._after_step()

    def _hand_over(self, b, j, p):
        """Give parameter j's gradient (or None) to the algorithm, then make ``.grad`` its bucket slot. With a
        loss scaler the algorithm gets the true gradient (one more pass: residuals, momenta and selections
        then stay at one scale whatever the scaler does)."""
        if self._round_scales is not None and p.grad is not None:
            p.grad.mul_(self._round_scales[1])
        self.algorithm.on_gradient(b, j, p.grad)
        p.grad = b.view(j)

    def _scaled(self, ops):
        """``ops``, then the bucket back at the loss scaler's scale (``_hand_over`` unscaled what went in), so
        ``.grad`` reaches the scaler's ``unscale_`` as it expects. Device tensors: no host synchronisation."""
        if self._round_scales is None:
            return ops
        scale = self._round_scales[0]
        return list(ops) + [lambda flat: flat.mul_(scale)]

    def _submit_ready(self):
        while self._next_bucket < len(self.buckets) and \
                self._ready[self._next_bucket] == len(self.buckets[self._next_bucket].params):
            b = self.buckets[self._next_bucket]
            self._engine.submit(b.index, b.flat, self._scaled(b.ops))
            self._next_bucket += 1

    def _finish_backward(self):
        # Parameters without a gradient this step contribute zeros, so every rank runs every bucket.
        unused = []
        for b in self.buckets[self._next_bucket:]:
            for j, p in enumerate(b.params):
                if not self._marked[b.index][j]:
                    if p.grad is None:
                        unused.append(self._index[p])
                    self._hand_over(b, j, p)  # p.grad is None, or what no_sync steps accumulated
                    self._marked[b.index][j] = True
            self._ready[b.index] = len(b.params)
        self._submit_ready()
        t0 = time.perf_counter()
        lost = None
        try:
            self._wait_engine()
        except (PeerFailedError, RuntimeError) as e:
            if self._elastic is None:
                raise
            lost = e
        finally:
            self.timings["backward_wait_s"] += time.perf_counter() - t0
            self._backward_active = False
            self._unsynced = False
            self._next_bucket = 0
            self._ready = [0] * len(self.buckets)
            self._marked = [[False] * len(b.params) for b in self.buckets]
        if lost is not None:
            self._elastic.recover(lost)  # discard this round, re-form the group (or raise)
            return
        t0 = time.perf_counter()
        try:
            self._agree_after_round(unused)
        except RuntimeError as e:
            if self._elastic is None or e is not self._elastic.comm_error:
                raise
            lost = e
        finally:
            self.timings["agree_s"] += time.perf_counter() - t0
        if lost is not None:
            self._elastic.recover(lost, buckets_done=True)

    def _after_step(self):
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
        try:
            hook()
        except Exception as e:
            if isinstance(e, RuntimeError) and self._elastic is not None \
                    and getattr(self.algorithm, "heals_itself", False):  # PeerFailedError is one
                self._elastic.recover(e, periodic="sync")
                raise self._elastic.take_pending() from e
            if not isinstance(e, PeerFailedError):
                self._failfast.announce(f"{self.algorithm.name}.{hook.__name__} raised {type(e).__name__}: {e}")
            raise

    # ---- what an algorithm uses of the model (besides buckets, params, optimizer, process_group, rank,
    # world_size, run_collective and switch_algorithm) --------------------------------------------------------
    def check_in_step(self, what: str, group=None) -> None:
        """Raise on every rank unless all ranks are at the same step count: one all_gather of one int.
        ``what`` says what the check guards ("nothing was exchanged"). Blocking: call it where the
        collective belongs, e.g. inside :meth:`run_collective`'s function ahead of a periodic average."""
        rows = self._gather_with_joiners([self.algorithm.step], group, on_engine=True)
        self._check_steps([r[0] for r in rows], what)

    def fail(self, what: str) -> None:
        """Tell every peer that this model's communication failed (they raise ``PeerFailedError`` within a
        second instead of waiting for the process group's timeout). Never raises."""
        self._failfast.announce(what)

    def check_peers(self) -> None:
        """Raise :class:`PeerFailedError` if a peer announced a failure (looks at most twice a second)."""
        self._failfast.check_every()

    def peer_failed(self) -> bool:
        """Whether this model's communication is known to be broken, here or on a peer (never raises); with
        ``fault_tolerant=True`` also whether a member's heartbeat stood still (a stopped peer, which would
        hold an algorithm's thread in its collective until the group's timeout)."""
        if self._failfast.peer_failed():
            return True
        if self._elastic is not None:
            try:
                self._elastic.watch_every()
            except PeerFailedError:
                return True
        return False

    def wait_for(self, event) -> None:
        """``event.wait()`` for an algorithm's own thread's work, raising :class:`PeerFailedError` if a peer
        fails meanwhile (the thread may sit in a collective with the failed peer until the timeout)."""
        self._failfast.wait_event(event)

    def _wait_engine(self):
        """Wait for every task on the engine, failing fast: a peer's announced failure raises
        PeerFailedError within POLL_S; this rank's own failure is announced to the peers."""
        try:
            self._failfast.wait_engine(self._engine)
        except PeerFailedError:
            self._engine.abandon()  # its worker may sit in a collective until the group's timeout
            self._engine_abandoned = True
            raise
        except RuntimeError as e:  # this rank's op failed (or its collective, with a peer's death)
            self._failfast.announce(str(e))
            raise

    def run_collective(self, what: str, fn):
        """Run ``fn()``, an algorithm's own collectives outside the buckets (a periodic weight average, the
        wait for a peer exchange), on the engine thread while this thread waits with fail fast: if a peer
        announced a failure this raises :class:`PeerFailedError` within a second instead of waiting out the
        process group's timeout (30 minutes by default). ``fn``'s result is returned."""
        self._failfast.raise_if_failed()
        result = []

        def op(_flat):
            result.append(fn())
        op.__name__ = what
        self._engine.submit(-2, self._no_tensor, [op])
        self._wait_engine()
        return result[0]
