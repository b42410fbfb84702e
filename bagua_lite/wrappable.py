"""What a DistributedModel may wrap: a module that every rank holds whole and that no other data-parallel
wrapper averages. Checked before any traffic, so that a sharded or doubly wrapped model is refused with
its reason instead of training silently wrong.

- Parameters that are DTensors (FSDP2's ``fully_shard``, tensor parallelism): each rank holds a shard, while
  a DistributedModel exchanges whole parameters and gradients across ranks. Relaxations across the
  replicas of an FSDP2-sharded model are :class:`bagua_lite.ShardedModel`'s.
- A ``DistributedDataParallel`` (or another DistributedModel) inside: it would average every gradient a
  second time.
- An ``Embedding``/``EmbeddingBag`` with ``sparse=True`` that trains: its gradient is a sparse tensor, and the
  buckets hold dense gradients (the codecs, top-k and the optimizer-side updates are dense).

- Parameters an open model already holds (the same module wrapped twice), and an optimizer that steps a
  parameter the module does not hold (it would train on each rank alone).

And, at every training forward, that no parameter frozen when the model was wrapped has started to train,
and that no trainable parameter has joined the module since (:class:`ParametersAtWrap`).
"""
import sys

import torch
from torch.nn.modules.module import register_module_module_registration_hook, register_module_parameter_registration_hook
from torch.nn.parallel import DistributedDataParallel

from . import step_hooks


def check_wrappable(module, optimizer, who="DistributedModel") -> "ParametersAtWrap":
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{who}: module must be a torch.nn.Module, got {type(module).__name__}")
    for name, m in module.named_modules():
        if isinstance(m, DistributedDataParallel):
            where = "the module itself" if name == "" else f"its submodule {name!r}"
            raise ValueError(
                f"{who}: {where} is a {type(m).__name__}, which averages gradients itself; wrapping it would "
                f"average every gradient twice. Pass the plain module (the DDP's .module)")
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            raise ValueError(
                f"{who}: submodule {name!r} is {type(m).__name__}(..., sparse=True), whose gradient is a sparse "
                f"tensor; bagua_lite's buckets hold dense gradients. Build it with sparse=False (the default; "
                f"with torch.optim.SparseAdam, use Adam), or freeze it")
    # A DTensor exists only once torch.distributed.tensor is imported; importing it here would add 1 s to
    # every process's import of bagua_lite.
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    for name, p in module.named_parameters():
        if dtensor is not None and isinstance(p, dtensor):
            raise ValueError(
                f"{who}: parameter {name!r} is a DTensor sharded over {p.device_mesh} (FSDP2's fully_shard or "
                f"tensor parallelism), but a DistributedModel exchanges whole parameters and gradients, which "
                f"every rank must hold. For a relaxation across the replicas of an FSDP2 model, shard it over "
                f"the shard dimension of a 2-D (replicate, shard) mesh and use bagua_lite.ShardedModel(model, "
                f"optimizer, algorithm=..., mesh=mesh) (docs/hsdp.md)")
    step_hooks.check_not_wrapped(module, who)
    step_hooks.check_steps_only(module, optimizer, who)
    return ParametersAtWrap(module, who)


# Submodules and parameters registered anywhere in this process: a parameter can join a wrapped module only
# through a registration, so the full comparison runs only after one, and a step costs one int comparison.
_registrations = [0]
_watching = []


def _count(*_):
    _registrations[0] += 1  # returns None: the registration goes on unchanged


class ParametersAtWrap:
    """The module's parameters when it was wrapped. Those that did not require grad then have no bucket and
    take no part in weight averaging, so one unfrozen later (gradual unfreezing of a backbone) would train on
    each rank alone and the replicas would drift apart, silently (what DDP does). So would a parameter that
    joined the module later (a replaced layer or head, resized embeddings). ``check`` refuses both at the next
    training forward, before any traffic; it costs one attribute read per frozen parameter, and a look at the
    module's parameters only after a module or parameter was registered somewhere since the last look. A
    parameter that joins frozen (a frozen teacher attached for distillation) is let in as frozen."""

    def __init__(self, module, who="DistributedModel", what="parameter"):
        if not _watching:
            _watching.extend((register_module_module_registration_hook(_count),
                              register_module_parameter_registration_hook(_count)))
        self.module, self.who, self.what = module, who, what  # what may be frozen later: a parameter, or a unit
        self.frozen = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]
        self.known = {id(p): p for p in module.parameters()}  # the values keep the ids from being reused
        self.seen = _registrations[0]

    def check(self):
        if not torch.is_grad_enabled():  # an evaluation trains nothing
            return
        if self.seen != _registrations[0]:
            self._look()
        for name, p in self.frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"{self.who}: parameter {name!r} did not require grad when the model was wrapped and now does: "
                    f"it has no place in the {self.who}'s buckets, so it would train on each rank alone and the "
                    f"replicas would drift apart. Wrap the model with every parameter that will ever train "
                    f"requiring grad, then freeze what should wait after wrapping (each {self.what}: "
                    f"requires_grad_(False); it then gets no gradient, its .grad stays None, and unfreezing it "
                    f"later is fine), or wrap the model again after unfreezing")

    def _look(self):
        for name, p in self.module.named_parameters():
            if id(p) in self.known:
                continue
            if p.requires_grad:
                raise RuntimeError(
                    f"{self.who}: parameter {name!r} joined the model after it was wrapped (a replaced layer or "
                    f"head, resized embeddings): it has no place in the {self.who}'s buckets, so it would train "
                    f"on each rank alone and the replicas would drift apart. Change the model before wrapping "
                    f"it, or wrap it again after the change (a new {self.who} and optimizer)")
            self.known[id(p)] = p
            self.frozen.append((name, p))
        self.seen = _registrations[0]
