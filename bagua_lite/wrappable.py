"""What a DistributedModel may wrap: a module that every rank holds whole and that no other data-parallel
wrapper averages. Checked before any traffic, so that a sharded or doubly wrapped model is refused with
its reason instead of training silently wrong.

- Parameters that are DTensors (FSDP2's ``fully_shard``, tensor parallelism): each rank holds a shard, while
  a DistributedModel exchanges whole parameters and gradients across ranks. Relaxations across the
  replicas of an FSDP2-sharded model are :class:`bagua_lite.ShardedModel`'s.
- A ``DistributedDataParallel`` (or another DistributedModel) inside: it would average every gradient a
  second time.
"""
import sys

import torch
from torch.nn.parallel import DistributedDataParallel


def check_wrappable(module, who="DistributedModel"):
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{who}: module must be a torch.nn.Module, got {type(module).__name__}")
    for name, m in module.named_modules():
        if isinstance(m, DistributedDataParallel):
            where = "the module itself" if name == "" else f"its submodule {name!r}"
            raise ValueError(
                f"{who}: {where} is a {type(m).__name__}, which averages gradients itself; wrapping it would "
                f"average every gradient twice. Pass the plain module (the DDP's .module)")
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
