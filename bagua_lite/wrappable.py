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

And, at every training forward, that no parameter frozen when the model was wrapped has started to train
(:class:`FrozenAtWrap`).
"""
import sys

import torch
from torch.nn.parallel import DistributedDataParallel


def check_wrappable(module, who="DistributedModel") -> "FrozenAtWrap":
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
    return FrozenAtWrap(module, who)


class FrozenAtWrap:
    """The parameters that did not require grad when the model was wrapped. None of them has a bucket or
    takes part in weight averaging, so one unfrozen later (gradual unfreezing of a backbone) would train on
    each rank alone and the replicas would drift apart, silently (what DDP does). ``check`` refuses that at
    the next training forward, before any traffic; it costs one attribute read per frozen parameter."""

    def __init__(self, module, who="DistributedModel", what="parameter"):
        self.who, self.what = who, what  # what may be frozen after wrapping: a parameter, or a whole unit
        self.frozen = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]

    def check(self):
        if not torch.is_grad_enabled():  # an evaluation trains nothing
            return
        for name, p in self.frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"{self.who}: parameter {name!r} did not require grad when the model was wrapped and now does: "
                    f"it has no place in the {self.who}'s buckets, so it would train on each rank alone and the "
                    f"replicas would drift apart. Wrap the model with every parameter that will ever train "
                    f"requiring grad, then freeze what should wait after wrapping (each {self.what}: "
                    f"requires_grad_(False); it then gets no gradient, its .grad stays None, and unfreezing it "
                    f"later is fine), or wrap the model again after unfreezing")
