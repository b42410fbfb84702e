"""DistributedModel's DDP face: a ``DistributedDataParallel`` in type only, so that whatever unwraps a DDP by
``isinstance`` and ``.module`` reaches the wrapped module, with every member that needs DDP's own
machinery (its C++ reducer, its join hooks) refused on use, saying what to do instead."""
import torch
from torch.nn.parallel import DistributedDataParallel


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


class DDPType(DistributedDataParallel):
    """DDP's type without its machinery: ``DistributedDataParallel.__init__`` never runs."""

    # DDP's members over its reducer and join machinery; the nn.Module ones DDP overrides are put back.
    reducer = _ddp_only_attribute("reducer", "bagua_lite's buckets live in the C++ engine")
    require_forward_param_sync = _ddp_only_attribute(
        "require_forward_param_sync", "use model.no_sync() (or require_backward_grad_sync = False) around the forward "
        "and backward that must not sync (Accelerate: accelerator.no_sync / accumulate; trigger_sync_in_backward is "
        "not supported)")
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
