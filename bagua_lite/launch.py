"""``bagua_lite.init_process_group``: the default process group from the launcher's environment, set up so
that a torchrun restart always reconnects (BAGUA had one too).

    bagua_lite.init_process_group()          # gloo on CPU; on CUDA "cpu:gloo,cuda:nccl" and this process's GPU
    model = bagua_lite.DistributedModel(net, optimizer, algorithm="gtopk")

Why not plain ``dist.init_process_group()``: under ``torchrun --max-restarts N`` the rendezvous store is the
agent's, and it outlives a failed attempt. A new attempt's group would read the keys the old one left
there (gloo's peer addresses: "Connection refused", or a wait until the timeout), so each attempt's group
here gets a store prefix of its own (``TORCHELASTIC_RESTART_COUNT``).
"""
import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from .ranks import get_local_rank

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: what a GPU job gets by default: NCCL for CUDA tensors, gloo for CPU ones (the control traffic)
GPU_BACKEND = "cpu:gloo,cuda:nccl"
BACKENDS = ("gloo", "nccl", GPU_BACKEND)
#: the fault-tolerant job's keys, on the store of generation 0 (bagua_lite.membership; one such model per job):
#: here because init_process_group looks there for a running job to join
FT_KEY = "bagua_lite/ft"
#: the store init_process_group gave the default group (fault tolerance keeps its membership there: the
#: default group's own store is prefixed by its name, which a joiner cannot know)
_STORE = {}
#: set when this process joins a running fault-tolerant job: {"store": the job's store, "group": (backend,
#: timeout)}; its DistributedModel(..., fault_tolerant=True) is admitted and makes the process group
_JOIN = {}


def init_process_group(backend: Optional[str] = None, timeout: Optional[timedelta] = None) -> None:
    """Join the default process group described by the environment torchrun sets (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``; any launcher that sets them works). ``backend``: one of
    :data:`BACKENDS` (default: ``"cpu:gloo,cuda:nccl"`` where CUDA is available, else gloo). With NCCL this
    process's GPU becomes ``LOCAL_RANK``'s; NCCL's group carries the data, and gloo's the host-side control
    traffic (plain ``"nccl"`` gets a gloo group for it made beside, see ``bagua_lite._control``, and refuses
    ``fault_tolerant=True``). ``timeout``: the group's (default: torch's)."""
    if dist.is_initialized():
        raise RuntimeError("bagua_lite.init_process_group: the default process group already exists; call it "
                           "once per process, instead of torch.distributed.init_process_group")
    missing = [name for name in _ENV if not os.environ.get(name)]
    if missing:
        raise RuntimeError(f"bagua_lite.init_process_group: the launcher did not set {', '.join(missing)} "
                           f"(start the processes with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and "
                           f"MASTER_PORT in each)")
    if backend is None:
        backend = GPU_BACKEND if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"bagua_lite.init_process_group: backend must be one of "
                         f"{', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")
    if "nccl" in backend:
        torch.cuda.set_device(get_local_rank())
    kwargs = {} if timeout is None else {"timeout": timeout}
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if _JOIN:
        raise RuntimeError("bagua_lite.init_process_group: this process already joins a running fault-tolerant "
                           "job; build its DistributedModel(..., fault_tolerant=True)")
    store, rank, world_size = next(rendezvous("env://", **kwargs))
    store = dist.PrefixStore(f"bagua_lite/attempt{attempt}", store)
    if store.check([f"{FT_KEY}/open"]):  # a fault-tolerant job runs: join it (DistributedModel waits to be admitted)
        _JOIN.update(store=store, group=(backend, timeout if timeout is not None else dist.default_pg_timeout))
        return
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
    _STORE["store"] = store


def job_store(default=None):
    """The store :func:`init_process_group` made the default group from, or ``default``."""
    return _STORE.get("store", default)


def joining():
    """``(store, (backend, timeout))`` when this process joins a running fault-tolerant job (its
    ``DistributedModel(..., fault_tolerant=True)`` is admitted and makes the process group), else None."""
    return (_JOIN["store"], _JOIN["group"]) if _JOIN else None


def joined() -> None:
    """The join is done: the process group exists now."""
    _JOIN.clear()
