"""Who this process is, as BAGUA's ``get_rank`` / ``get_local_rank`` helpers, for code ported from it.

    import bagua_lite
    torch.cuda.set_device(bagua_lite.get_local_rank())   # one GPU per process on a node
    if bagua_lite.get_rank() == 0: print("logging from rank 0 of", bagua_lite.get_world_size())

Global rank and size come from the default process group (0 and 1 before one exists, as a single
process); the per-node ones from the launcher's environment (torchrun sets ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``). A process of a multi-process job started without them gets an
error naming the variable, never a guess.
"""
import os

import torch.distributed as dist


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (default: the default group), or 0 without a process group."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    """The number of processes in ``group`` (default: the default group), or 1 without a process group."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _from_env(name: str, what: str, single: int) -> int:
    value = os.environ.get(name)
    if value is None:
        if get_world_size() == 1:
            return single
        raise RuntimeError(f"bagua_lite: {what} is not known: the launcher did not set {name} (torchrun sets it; "
                           f"with another launcher, set it in each process's environment)")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"bagua_lite: {name}={value!r} is not an integer") from None


def get_local_rank() -> int:
    """This process's rank among the processes of its node (``LOCAL_RANK``): its GPU index, usually."""
    return _from_env("LOCAL_RANK", "the local rank", 0)


def get_local_size() -> int:
    """The number of processes on this node (``LOCAL_WORLD_SIZE``)."""
    return _from_env("LOCAL_WORLD_SIZE", "the number of processes on this node", 1)


def get_node_rank() -> int:
    """This node's index among the nodes of the job (torchrun's ``GROUP_RANK``)."""
    return _from_env("GROUP_RANK", "the node rank", 0)
