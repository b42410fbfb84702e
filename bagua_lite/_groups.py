"""Resolving and validating the process-group argument shared by every collective."""
import gc
import sys
import weakref

import torch
import torch.distributed as dist

from bagua_lite import _control
from bagua_lite._compat import group_timeout  # noqa: F401  (re-exported: callers import it from here)


def resolve_group(group, fn):
    """Return the ``ProcessGroup`` to use for ``fn``, or raise a clear error before any traffic."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"bagua_lite.comm.{fn}: torch.distributed is not initialized; "
                           "call torch.distributed.init_process_group(...) first")
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"bagua_lite.comm.{fn}: rank {dist.get_rank()} is not a member of the given group; "
                         "call collectives only on ranks that belong to the group")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"bagua_lite.comm.{fn}: group must be a torch.distributed ProcessGroup or None, "
                        f"got {type(group).__name__}")
    return group


def check_device(t, group, fn, name="t"):
    """NCCL moves CUDA tensors only; gloo is our CPU transport."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"bagua_lite.comm.{fn}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    backend = dist.get_backend(group)
    if backend == "nccl" and not t.is_cuda:
        raise ValueError(f"bagua_lite.comm.{fn}: `{name}` is on {t.device} but the group's backend is nccl, "
                         "which needs CUDA tensors")


def new_group_like(group, ranks=None):
    """A new process group over ``ranks`` (default: ``group``'s) with ``group``'s timeout.

    ``dist.new_group`` would otherwise take torch's default of 30 minutes, not the timeout the user gave
    ``init_process_group``: a dead peer would then hang an algorithm's own traffic for half an hour.
    Collective: every rank of the default group calls it, in the same order."""
    ranks = dist.get_process_group_ranks(group) if ranks is None else ranks
    new = dist.new_group(ranks, timeout=group_timeout(group))
    _control.setup(new, ranks, group_timeout(group))  # its control traffic's group, made with it
    return new


# Open models (DistributedModel, ShardedModel) per group: id(group) -> (group, the open models whose engine
# sends on it; weakly held: one whose constructor raised no longer counts once collected). Two engines on one
# group would post their collectives from two threads, in an order that differs across ranks; gloo then
# aborts the process ("Received data size doesn't match expected size").
_engines_on = {}


def in_use(group) -> bool:
    """Whether an open model of this process sends its engine's traffic on ``group``, or one of torch's own
    data-parallel wrappers sends on it during backward (see :func:`torch_users`)."""
    entry = _engines_on.get(id(group))
    return (entry is not None and entry[0] is group and len(entry[1]) > 0) or bool(torch_users(group))


# torch's data-parallel wrappers that post collectives from backward's thread, where they are defined, and the
# attributes naming their groups (FSDP2's param groups name theirs in ``mesh_info``). A module not imported
# holds no instance, so nothing is imported for this.
_TORCH_SENDERS = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel", ("process_group",), "DistributedDataParallel"),
    ("torch.distributed.fsdp._common_utils", "_FSDPState", ("process_group", "_inter_node_pg"),
     "FullyShardedDataParallel"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup", (), "fully_shard (FSDP2) module"),
)


def _groups_of(obj):
    info = getattr(obj, "mesh_info", None)  # FSDPParamGroup
    if info is not None:
        return [getattr(info, a, None) for a in ("shard_process_group", "replicate_process_group")]
    return [getattr(obj, a, None) for _, _, attrs, _ in _TORCH_SENDERS for a in attrs]


def _subclasses(cls) -> list:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        if c not in out:
            out.append(c)
            todo.extend(c.__subclasses__())
    return out


def _sender_classes() -> dict:
    """torch's wrapper classes that send in backward (and their subclasses; not ours, a DDP in type only),
    each with the name an error gives it."""
    from bagua_lite._ddp_type import DDPType  # a DistributedModel is a DDP in type only: not one of them
    label_of = {}
    for module, name, _, label in _TORCH_SENDERS:
        base = getattr(sys.modules.get(module), name, None)  # not imported: no instance
        for cls in _subclasses(base) if base is not None else ():
            if not issubclass(cls, DDPType):
                label_of.setdefault(cls, label)
    return label_of


def torch_users(group) -> list:
    """One name per torch data-parallel wrapper of this process (DDP, FSDP, a ``fully_shard`` param group) that
    sends on ``group`` in backward, as our engine does: their collectives and ours would interleave in an
    order that differs across ranks. An instance of a Python class refers to its class, so the collector's
    referrers of these classes are their instances: one pass in C over its objects (what ``gc.freeze()`` froze
    is not seen), about 0.07 s per 3 million objects."""
    label_of = _sender_classes()

    def find():
        return [label_of[type(o)] for o in gc.get_referrers(*label_of)  # no class given: none
                if type(o) in label_of and any(g is group for g in _groups_of(o))]
    found = find()
    if found:
        gc.collect()  # not one the loop already dropped (a cycle keeps it until a collection)
        found = find()
    return found


def senders_signature() -> tuple:
    """Changes whenever an instance of one of torch's sending wrappers is made or dropped (each instance holds
    a reference to its class), in microseconds: :func:`torch_users`'s pass over every object is then only
    needed when it changed."""
    return tuple((id(cls), sys.getrefcount(cls)) for cls in _sender_classes())


def hold(group, model) -> None:
    entry = _engines_on.get(id(group))
    if entry is None or entry[0] is not group:
        entry = _engines_on[id(group)] = (group, weakref.WeakSet())
    entry[1].add(model)


def release(group, model) -> None:
    entry = _engines_on.get(id(group))
    if entry is not None and entry[0] is group:
        entry[1].discard(model)
        if not entry[1]:
            del _engines_on[id(group)]


def any_rank(flag: bool, group) -> bool:
    """Whether ``flag`` is true on any rank of ``group`` (one MAX allreduce of one int64 on it)."""
    t = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t[0])
