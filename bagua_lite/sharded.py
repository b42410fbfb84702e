"""ShardedModel: a bagua_lite relaxation across the replicas of a model sharded with FSDP2 (HSDP).

Inside each replica group FSDP2 runs as the user set it up (``fully_shard(block, mesh=mesh["shard"])``):
it gathers the weights for forward and backward and reduce-scatters the gradients, so each rank holds its
shard of every weight and of every gradient. Nothing crosses replicas except what the algorithm sends,
and it sends each rank's shards, across the replicate group only (rank s of every replica holds the same
shard):

- gradient relaxations (gradient_allreduce with any codec, topk, gtopk) run in FSDP2's all-reduce hook
  (``FSDPModule.set_all_reduce_hook``), where FSDP2 hands each unit's reduce-scattered gradient, one flat
  tensor per unit: that tensor is the unit's bucket. With no codec the hook sums over the replicas and
  divides, which is FSDP2's own HSDP bit for bit;
- weight relaxations (local_sgd, diloco, streaming diloco) act on the local shards after the optimizer's
  step, exact because their math is elementwise: sharded DiLoCo equals unsharded DiLoCo over the same
  replicas.

The step around them is DistributedModel's (the same refusals, agreement and fail fast): a closure, a
GradScaler, clipping and ``set_requires_gradient_sync`` work as they do under FSDP2 alone. Details and
what is refused: docs/hsdp.md.
"""
import functools
import io
import os
from typing import Union

import torch
import torch.distributed as dist

from . import _C, _compat, _control, _groups, agreement, step_hooks
from ._failfast import FailFast
from ._groups import new_group_like
from .agreement import RoundAgreement
from .algorithm import Algorithm, registered, registered_class
from .bucket import Bucket, all_zero, defer_nonfinite_checks, host_read
from .config import algorithm_from
from .services import Services
from .shard_units import find_units, resolve_groups
from .step_hooks import StepHooks
from .verdict import DeviceVerdict
from .wrappable import ParametersAtWrap

WHO = "ShardedModel"


class ShardedModel(StepHooks, Services, RoundAgreement):
    """Run ``algorithm`` across the replicas of ``module``, a model sharded with FSDP2's ``fully_shard`` over
    the shard dimension of a (replicate, shard) mesh, stepped by ``optimizer``.

    ``mesh``: the 2-D ``DeviceMesh`` with dimensions named ``"replicate"`` and ``"shard"`` whose shard
    dimension the model was sharded over; or ``replicate_group``: the process group of this rank's replicas
    (rank s of each replica group). ``algorithm``: a name, an :class:`Algorithm` or a config, as for
    :class:`~bagua_lite.DistributedModel`; those that act on shards are accepted (``Algorithm.on_shards``),
    the others refused here, before any traffic. ``broadcast_parameters`` (default True): every replica
    starts from replica 0's shards. ``grad_scaler``: the loop's ``torch.amp.GradScaler``, as for
    DistributedModel.

    The model stays the user's: call it, step the optimizer, clip its DTensor gradients and save it with
    ``torch.distributed.checkpoint`` as without bagua_lite. This object adds the algorithm's state
    (:meth:`state_dict`, a ``Stateful`` for ``torch.distributed.checkpoint``) and :meth:`close`.

    Example::

        mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
        for block in net.blocks:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(net, mesh=mesh["shard"])
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        relaxed = bagua_lite.ShardedModel(net, opt, algorithm="diloco", mesh=mesh)
        for x, y in loader:
            loss_fn(net(x), y).backward(); opt.step(); opt.zero_grad()
    """

    #: what an algorithm sees: it runs on each rank's shards (buckets: one per FSDP unit, ``params``: the local
    #: shards), across ``process_group``, the replicate group
    sharded = True
    _waits_every_bucket = True  # each unit's hook waits for its round (StepHooks._serial)

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 algorithm: Union[str, os.PathLike, Algorithm] = "gradient_allreduce", *, mesh=None,
                 replicate_group=None, broadcast_parameters: bool = True, grad_scaler=None):
        self._hooks, self._engine = [], None
        algorithm, _ = algorithm_from(algorithm, WHO)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{WHO}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(f"{WHO}: grad_scaler must be a torch.amp.GradScaler or None, got "
                            f"{type(grad_scaler).__name__}")
        if not getattr(type(algorithm), "on_shards", False):
            raise ValueError(f"{WHO}: {algorithm.name} does not run on shards of an FSDP2 model; those that do: "
                             f"{', '.join(on_shards())}")
        algorithm.check_shards(optimizer)
        step_hooks.check_not_wrapped(module, WHO)
        step_hooks.check_steps_only(module, optimizer, WHO)
        group, shard_mesh = resolve_groups(mesh, replicate_group, WHO)
        if not dist.is_initialized():
            raise RuntimeError(f"{WHO}: torch.distributed is not initialized")
        if not _compat.takes_cpu_tensors(group) or not _compat.takes_cpu_tensors(dist.group.WORLD):
            raise ValueError(f"{WHO}: the replicate group and the default group must carry CPU tensors (gloo, or "
                             f"init_process_group(\"cpu:gloo,cuda:nccl\")): the step agreement travels on them")
        self.units = find_units(module, shard_mesh, group, WHO)
        self.module, self.optimizer, self.algorithm = module, optimizer, algorithm
        self.configured_algorithm = algorithm
        self.process_group, self.rank, self.world_size = group, group.rank(), group.size()
        self.membership, self._elastic = None, None
        self.bucket_size_mb = 0.0  # one bucket per FSDP unit (in the config check's digest)
        self.grad_scaler = grad_scaler
        self._failfast = FailFast(dist.get_rank())
        self._no_tensor = torch.empty(0)
        self._engine_abandoned = False
        self._nonfinite_error, self._local_bad, self._unsynced = None, None, False
        self._backward_active, self._round_scales = False, None
        self._agreed = torch.zeros(3, dtype=torch.int64)
        self._check_same_config()
        self._take_group(dist.group.WORLD)  # a copy, if another open model uses the replicate group
        # The step agreement travels on every rank's group: on a copy of it where an open DistributedModel's
        # engine sends on it (a model feeding this one: its buckets may be in flight during this agreement).
        world = dist.group.WORLD
        self._world = new_group_like(world) if _groups.any_rank(_groups.in_use(world), world) else world
        self._hold(self._world)  # a DistributedModel made later takes a copy of it
        with torch.no_grad():  # every parameter's shard, frozen ones too: replicas start alike
            if broadcast_parameters and self.world_size > 1:
                src = dist.get_global_rank(group, 0)
                for p in module.parameters():
                    dist.broadcast(p.to_local(), src, group=group)
        #: the local shards of the trainable parameters, in module order: what weight relaxations average
        #: (``owners``: the DTensor parameter of each, whose ``requires_grad`` says whether it is frozen now)
        self.owners = [p for p in module.parameters() if p.requires_grad]
        self.params = [p.to_local() for p in self.owners]
        self._frozen = ParametersAtWrap(module, WHO, "FSDP2 unit as a whole")
        # a bucket per unit, a slot per parameter shaped like its padded shard (PowerSGD sees matrices)
        self.buckets = []
        for u in self.units:
            like = u.params[0].to_local()
            self.buckets.append(Bucket(u.index, [torch.empty(s, dtype=like.dtype, device=like.device) for s in u.shapes]))
        # Where checks stay on the device (CUDA kernels, or BAGUA_LITE_DEFER_CHECKS=1): each bucket's flag,
        # read once per synchronised round, and a local flag read once at the step of a local round.
        self._nonfinite_flags = defer_nonfinite_checks(self.buckets)
        self._local_flag = None if self._nonfinite_flags is None else self._nonfinite_flags.new_zeros(1)
        self._local_unread = []
        self._verdict = None if self._nonfinite_flags is None else DeviceVerdict(self.buckets, self._nonfinite_flags)
        self._engine = _C.Engine()
        algorithm.model = self
        try:  # the algorithm's own refusals come before any hook is in place
            algorithm.init(self)
            for b in self.buckets:
                b.ops = list(algorithm.bucket_ops(b))
        except BaseException:
            self._engine.shutdown()
            self._release_group()
            raise
        self._param_ids = {id(p) for p in module.parameters()}
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(lambda *_: self._after_step()),
                       module.register_forward_pre_hook(self._pre_forward)]
        for u in self.units:
            u.module.set_all_reduce_hook(functools.partial(self._on_reduced, u))
        step_hooks.watch_foreign_steps(self)

    # ---- one step ------------------------------------------------------------------------------------------
    @_compat.compiler_disable
    def _pre_forward(self, _module, _args):
        self._failfast.raise_if_failed("its ranks are out of step for good: restart from the last checkpoint")
        self._frozen.check()
        if torch.is_grad_enabled():
            self._settle_skipped_step()
        self._algorithm_hook(self.algorithm.before_forward)

    def _on_reduced(self, unit, out: torch.Tensor) -> None:
        """FSDP2's all-reduce hook of ``unit``: ``out`` is this rank's reduce-scattered gradient of the unit
        (averaged inside the replica); it leaves holding what the algorithm makes of it across replicas."""
        b = self.buckets[unit.index]
        if out.numel() != b.numel or out.dtype != b.dtype:
            frozen = [n for n, p in zip(unit.names, unit.params) if not p.requires_grad]
            if frozen and len(frozen) < len(unit.params):  # FSDP2 reduce-scatters the others only
                raise RuntimeError(
                    f"{WHO}: parameter {frozen[0]!r} of FSDP2 unit {unit.name or '<root>'!r} was frozen after "
                    f"ShardedModel was built, while other parameters of the unit train: freeze a unit whole (every "
                    f"parameter of the module given to fully_shard; unfreezing it later is fine), or freeze it "
                    f"before building ShardedModel (for good)")
            raise RuntimeError(
                f"{WHO}: FSDP2 handed unit {unit.name or '<root>'!r} a reduced gradient of {out.numel()} {out.dtype} "
                f"elements, {b.numel} {b.dtype} expected: a parameter of the unit got no gradient in this backward "
                f"(unused: call model.set_reduce_scatter_unused_params(True), as DDP's find_unused_parameters), or a "
                f"MixedPrecisionPolicy set after ShardedModel was built reduces in another dtype")
        if not self.algorithm.sync_gradients():
            if self._local_stepped:
                self._local_stepped = False
            if self._local_flag is not None:  # the answer stays on the device, read once at the step
                _C.scale_flagged_(out, out, 1.0, self._local_flag)  # the same tensor, scale 1: a check only
                self._local_unread.extend(unit.params)  # hook order, to name the first bad one as at once
                if not self._note_queued:
                    self._note_queued = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._note_held)
            elif self._local_bad is None and not _C.all_finite(out):  # stays local: this rank skips the step
                name = unit.first_nonfinite(out)
                self._local_bad = unit.params[unit.names.index(name) if name in unit.names else 0]
            return
        if not self._backward_active:
            self._start_round()
        if self._round_scales is not None:  # the algorithm sees the true gradient (as DistributedModel's)
            out.mul_(self._round_scales[1])
        for j, grad in enumerate(unit.slots(out)):
            self.algorithm.on_gradient(b, j, grad)
        ops = b.ops if self._round_scales is None else \
            list(b.ops) + [lambda flat, s=self._round_scales[0]: flat.mul_(s)]
        self._engine.submit(b.index, b.flat, ops)
        self._wait_engine()
        out.copy_(b.flat)

    def _start_round(self):
        self._begin_round()
        self._backward_active = True
        self._round_scales = _compat.scaler_scales(self.grad_scaler)
        self._verdict_round = self._verdict is not None and self._verdict.begin_round(
            self.algorithm, self.optimizer, self._round_scales is not None, sharded=True)
        self._nonfinite_error = None
        if self._nonfinite_flags is not None:
            self._nonfinite_flags.zero_()  # on the device's stream, ahead of this round's checks
        self.algorithm.nonfinite_buckets.clear()
        self.algorithm.kept_state.begin_round()
        if self.algorithm.step_dependent_wire:  # sizes depend on the step: agree before the first unit travels
            self._agree(0)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_round)

    def _grads_discarded(self, first=None) -> bool:
        """Whether the loop threw the last round's gradients away since it ended: every ``.grad`` None
        (``zero_grad()``), or zeroed in place (its version counter moved since the round, and it reads all
        zero: read only then). FSDP2 sets this round's ``.grad`` after the units' hooks."""
        zeroed = []
        with torch.no_grad():
            for p, version in zip(self.owners, self._round_versions or [None] * len(self.owners)):
                if p.grad is None:
                    continue
                if p.grad._version == version:  # the DTensor's: an in-place op on it leaves its local tensor's
                    return False
                zeroed.append(p.grad.to_local())
        return all_zero(zeroed)

    def _finish_round(self):
        """After the last unit's hook: one MAX allreduce over every rank of (a non-finite gradient anywhere,
        step, -step); the round is kept, or discarded on every rank alike (``.grad`` NaN everywhere)."""
        self._backward_active = False
        bad = bool(self.algorithm.nonfinite_buckets)
        if self._verdict_round:  # agreed over every rank on the device, no read (bagua_lite.verdict)
            self._engine.submit(-1, self._no_tensor, [self._verdict.flags_op(self._world, self._first_grad)])
            self._wait_engine()
        elif not bad and self._nonfinite_flags is not None:  # the checks left on the device: one read per round
            bad = any(host_read(self._nonfinite_flags))
        if not self._agree(1 if bad else 0):
            self.algorithm.commit_round()
            with torch.no_grad():  # (a zero_grad in place moves them)
                self._round_versions = [None if p.grad is None else p.grad._version for p in self.owners]
            if self._verdict_round:
                self._verdict.pending = True
            return
        self.algorithm.kept_state.roll_back()
        with torch.no_grad():
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.to_local().fill_(float("nan"))
        self._nonfinite_error = (
            f"bagua_lite: non-finite gradient (inf or NaN) at step {self.algorithm.step} on some rank; every rank "
            f"skipped this round: .grad is NaN on all ranks and {self.algorithm.name}'s state is as before it. A "
            f"loss scaler (torch.amp.GradScaler) skips such steps; without one, optimizer.step() refuses to apply "
            f"it (this is rank {dist.get_rank()}). Look for what produced the inf/NaN: learning rate, loss, inputs")

    def _first_grad(self):
        """One element of this rank's gradient shards (the first of the first non-empty one), for a loss
        scaler's check to see a round the device verdict discarded: each rank's scaler checks its own."""
        for p in self.module.parameters():
            g = None if p.grad is None else p.grad.to_local()
            if g is not None and g.numel():
                return g.as_strided((1,), (1,), g.storage_offset())
        return None

    def _agree(self, bad: int) -> bool:
        """One MAX allreduce over every rank of (bad, step, -step): raise on every rank if the step counts
        differ (nothing applied); return whether any rank had ``bad``."""
        self._agreed[0] = bad
        agreement.encode(self.algorithm.step, self._agreed[1:])
        try:
            dist.all_reduce(self._agreed, op=dist.ReduceOp.MAX, group=self._world)
        except RuntimeError as e:
            self._failfast.announce(f"the step agreement failed: {e}")
            raise
        lo, hi = int(-self._agreed[2]), int(self._agreed[1])
        if lo != hi:
            msg = (f"bagua_lite: ranks are out of step: a synchronised backward ran at optimizer step counts {lo} "
                   f"to {hi} (this is rank {dist.get_rank()} at {self.algorithm.step}). Every rank must call "
                   f"backward() and optimizer.step() the same number of times; nothing was applied in this round")
            self.algorithm.kept_state.roll_back()
            self._failfast.announce(msg)
            raise RuntimeError(msg)
        return bool(self._agreed[0])

    # ---- the rest of the public face -------------------------------------------------------------------------
    @property
    def control_group(self):
        return _control.of(self.process_group)

    def new_group(self):
        """A new replicate group for an algorithm's own traffic: every rank makes every replica group's copy,
        in the same order (``dist.new_group`` is collective over the job), and keeps its own."""
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, dist.get_process_group_ranks(self.process_group))
        mine = None
        for ranks in sorted({tuple(r) for r in rows}):
            group = new_group_like(self.process_group, list(ranks))
            if dist.get_rank() in ranks:
                mine = group
        return mine

    def switch_algorithm(self, algorithm):
        raise NotImplementedError(f"{WHO}: switching algorithms (auto) is not supported on shards")

    def state_dict(self) -> dict:
        """This rank's part, under a key of its own rank: ``torch.distributed.checkpoint`` saves every rank's,
        and each rank loads its own back (resume on the same mesh).

        - ``"algorithm"``: the algorithm's state (residuals, anchors, outer optimizer, a sync in flight) as one
          serialized object. DCP loads into the tensors a fresh run's state dict already has, and a fresh
          algorithm lacks some of what a running one keeps (the outer optimizer's momentum appears at its first
          step, a sync in flight only while one is), so this part travels as bytes, whatever its structure.
        - ``"weights"`` and ``"optimizer"``: this rank's local weight shards, and the optimizer's sharded state
          of each (by parameter name); only under an algorithm whose replicas train apart between syncs (one
          that overrides ``sync_gradients``: DiLoCo, local SGD). Their weights and inner optimizer states then
          differ across replicas, while DCP saves one copy of each shard of the model's and the optimizer's
          state dicts for all replicas (it takes equal DTensor shards on different ranks for copies)."""
        self._settle_skipped_step()
        blob = io.BytesIO()
        torch.save(self.algorithm.state_dict(), blob)
        mine = {"algorithm": blob.getvalue()}
        if type(self.algorithm).sync_gradients is not Algorithm.sync_gradients:
            params = dict(self.module.named_parameters())
            mine["weights"] = {n: p.detach().to_local().clone() for n, p in params.items()}
            mine["optimizer"] = {}
            for n, p in params.items():
                sharded = {k: v.detach().to_local().clone() for k, v in self.optimizer.state.get(p, {}).items()
                           if isinstance(v, torch.Tensor) and hasattr(v, "to_local")}  # DTensors, sharded as p
                if sharded:
                    mine["optimizer"][n] = sharded
        return {f"rank{dist.get_rank()}": mine}

    def load_state_dict(self, state: dict) -> None:
        """Each rank takes its own part of :meth:`state_dict` back. Its weights and optimizer state, where
        saved, replace what the model's and the optimizer's state dicts brought (``dcp.load`` calls this after
        loading those, into the model's own storage)."""
        key = f"rank{dist.get_rank()}"
        if key not in state:
            raise ValueError(f"{WHO}: the saved state has no {key!r} (saved on {len(state)} ranks, with keys "
                             f"{sorted(state)[:4]}...): resume on the same mesh")
        mine = state[key]
        algorithm = mine["algorithm"]
        if isinstance(algorithm, (bytes, bytearray)):
            algorithm = torch.load(io.BytesIO(algorithm), weights_only=True)
        self.algorithm.load_state_dict(algorithm)
        params = dict(self.module.named_parameters())
        with torch.no_grad():
            for n, local in mine.get("weights", {}).items():
                params[n].to_local().copy_(local)
            for n, saved in mine.get("optimizer", {}).items():
                kept = self.optimizer.state.get(params[n], {})
                for k, local in saved.items():
                    if hasattr(kept.get(k), "to_local"):
                        kept[k].to_local().copy_(local)

    def close(self) -> None:
        """Remove the hooks, end the algorithm's own work and stop the engine thread."""
        self._failfast.announce_closed(self.algorithm.step)  # a peer waiting in a later step stops (uneven)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for u in self.units:
            u.module.set_all_reduce_hook(None)
        step_hooks.forget(self)
        self._release_group()
        try:
            self.algorithm.close()
        finally:
            if self._engine is not None and not self._engine_abandoned:
                self._engine.shutdown()
            if self._verdict is not None:  # a step a fused optimizer skipped that no forward since reported
                self._verdict.warn_unreported(lambda step, local: self._result_error(step, local, late=True))


def on_shards():
    """The registered algorithms that run on the shards of an FSDP2 model."""
    return [n for n in registered() if getattr(registered_class(n), "on_shards", False)]
