"""What ShardedModel needs to know of an FSDP2 model, read through public members only: which group is the
replicate group, which modules are FSDP units, which parameters each unit owns, and how long the flat
gradient is that FSDP2 hands a unit's all-reduce hook (this rank's shard of every parameter of the unit,
each padded to the same length on every rank of the shard group, back to back).

Everything here refuses a model it cannot serve before any collective runs, naming what to do instead.
"""
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _compat

REPLICATE, SHARD = "replicate", "shard"  # the mesh dimension names torch's HSDP examples use


class Unit:
    """One FSDP unit: the module, the trainable parameters it owns (not those of nested units; in FSDP2's
    order, the module's), and the layout of the reduce-scattered gradient FSDP2 hands its all-reduce hook on this
    rank: each parameter's shard padded to whole rows of ceil(dim0 / shards), back to back."""

    def __init__(self, index: int, name: str, module, params: List[Tuple[str, torch.nn.Parameter]], shards: int):
        self.index, self.name, self.module = index, name, module
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        # each parameter's shard: dim 0 split in ``shards`` chunks of ceil(dim0 / shards) rows (the last ones
        # padded), so every rank's flat gradient has the same length, and this rank's unpadded rows
        self.offsets, self.lengths, self.shapes, n = [], [], [], 0
        for p in self.params:
            shape = (-(-p.shape[0] // shards),) + tuple(p.shape[1:])  # the padded shard: whole rows
            self.offsets.append(n)
            self.lengths.append(p.to_local().numel())
            self.shapes.append(shape)
            n += torch.Size(shape).numel()
        self.numel = n

    def slots(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter's padded shard in ``flat``, shaped like it (rows, ...)."""
        return [flat[o:o + torch.Size(s).numel()].view(s) for o, s in zip(self.offsets, self.shapes)]

    def first_nonfinite(self, flat: torch.Tensor) -> Optional[str]:
        """The name of the first parameter whose slice of ``flat`` holds inf/NaN, or None."""
        for name, o, n in zip(self.names, self.offsets, self.lengths):
            if n and not bool(torch.isfinite(flat[o:o + n]).all()):
                return name
        return None


def resolve_groups(mesh, replicate_group, who: str):
    """(replicate group, the 1-D shard mesh the parameters must be on, or None) from the user's ``mesh``
    (2-D, dimensions named "replicate" and "shard") or ``replicate_group``; exactly one of them."""
    if (mesh is None) == (replicate_group is None):
        raise ValueError(f"{who}: pass exactly one of mesh= (a 2-D DeviceMesh with dimensions named "
                         f"{REPLICATE!r} and {SHARD!r}) and replicate_group= (the process group of this rank's "
                         f"replicas), got mesh={mesh!r}, replicate_group={replicate_group!r}")
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim != 2 or set(names) != {REPLICATE, SHARD}:
            raise ValueError(f"{who}: mesh must be a 2-D DeviceMesh with dimensions named {REPLICATE!r} and "
                             f"{SHARD!r} (init_device_mesh(device, (replicas, shards), mesh_dim_names=("
                             f"{REPLICATE!r}, {SHARD!r}))), got {mesh.ndim} dimension(s) named {names}")
        return mesh.get_group(REPLICATE), mesh[SHARD]
    if not isinstance(replicate_group, dist.ProcessGroup):
        raise TypeError(f"{who}: replicate_group must be a torch.distributed ProcessGroup, got "
                        f"{type(replicate_group).__name__}")
    return replicate_group, None


def find_units(module, shard_mesh, replicate_group, who: str) -> List[Unit]:
    """The FSDP units of ``module`` in module order, each with the parameters it owns; refuses a model
    that is not sharded by ``fully_shard`` over one shard dimension."""
    # imported here, not with bagua_lite: FSDP2 and DTensor add 1 s to every process's import otherwise
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(module, FSDPModule):
        raise TypeError(f"{who}: the model must be sharded with torch.distributed.fsdp.fully_shard (over the shard "
                        f"dimension of the mesh) before it is handed over, got a {type(module).__name__} that is "
                        f"not; for a model every rank holds whole, use bagua_lite.DistributedModel")
    owner = {}
    units = [(name, m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    for name, m in units:  # outer units first: a nested unit's parameters are re-assigned to it
        for pname, p in m.named_parameters():
            owner[p] = (name, f"{name}.{pname}" if name else pname)
    shards, world = None, dist.get_world_size()
    for p, (_, pname) in owner.items():
        if not isinstance(p, DTensor):
            raise ValueError(f"{who}: parameter {pname!r} is not sharded (not a DTensor); fully_shard the module "
                             f"that holds it, or the whole model, over the shard mesh")
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise ValueError(
                f"{who}: parameter {pname!r} is placed {tuple(p.placements)} over a {p.device_mesh.ndim}-D mesh; "
                f"bagua_lite relaxes the exchange across replicas of a model sharded as Shard(0) over the shard "
                f"dimension only: fully_shard(module, mesh=mesh[{SHARD!r}]) (over a 2-D mesh, FSDP2 runs its "
                f"own HSDP and averages across replicas itself)")
        if p.dim() == 0:
            raise ValueError(f"{who}: parameter {pname!r} is a 0-dimensional tensor; give it a dimension "
                             f"(shape [1]) so that it shards like the others")
        if shard_mesh is not None and not torch.equal(p.device_mesh.mesh, shard_mesh.mesh):
            raise ValueError(f"{who}: parameter {pname!r} is sharded over ranks {p.device_mesh.mesh.tolist()}, "
                             f"not over mesh[{SHARD!r}] (ranks {shard_mesh.mesh.tolist()})")
        shards = p.device_mesh.size()
    if shards is None:
        raise ValueError(f"{who}: the model has no parameters")
    replicas = replicate_group.size()
    if replicas * shards != world:
        raise ValueError(f"{who}: {replicas} replicas x {shards} shards = {replicas * shards} ranks, but the job has "
                         f"{world}: every rank must be in one replica group and one shard group")
    out = []
    for name, m in units:
        mine = [(pname, p) for p, (unit, pname) in owner.items() if unit == name and p.requires_grad]
        if not mine:
            continue
        own, reduce = mine[0][1].dtype, _compat.fsdp_reduce_dtype(m)
        if reduce not in (None, own):
            raise ValueError(
                f"{who}: unit {name or '<root>'!r} reduce-scatters its gradients in {reduce} (its "
                f"MixedPrecisionPolicy), its parameters are {own}: bagua_lite relaxes gradients in the "
                f"parameters' dtype; keep the reduction in it, e.g. MixedPrecisionPolicy(param_dtype="
                f"torch.bfloat16, reduce_dtype={own}) (compute in bf16, the exchange then goes in the "
                f"algorithm's codec: compression='bf16' or 'fp16' halves it)")
        out.append(Unit(len(out), name, m, mine, shards))
    return out
