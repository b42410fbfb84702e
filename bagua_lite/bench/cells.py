"""One benchmark cell's model: ours (a DistributedModel), a PyTorch DDP baseline, or torchft's DiLoCo,
with its optimizer; with ``shards`` > 1 an FSDP2-sharded model: ours (a ShardedModel) or FSDP2's own HSDP."""
import datetime
import logging
import os
import socket

import bagua_lite

from ..algorithms import build
from ..algorithms.diloco import DEFAULT_OUTER, outer_optimizer_class
from .config import (BASELINES, HOOK_BASELINES, cell_lr, hook_state, make_optimizer, optimizer_momentum,
                     torchft_available)


def wrap(cell, cfg, net):
    """(model to call, our DistributedModel or None, optimizer, baseline handle or None) of one cell.

    The optimizer is the cell's (``make_optimizer``); SGD's momentum is 0 under an algorithm given its own
    (gtopk/topk with a number ``momentum_correction``, see ``optimizer_momentum``). The handle is set for
    a baseline that needs closing or that is periodic (``torchft_diloco``: ``.cycle``, ``.close()``). With
    ``shards`` > 1 in the config: ``wrap_sharded``."""
    if cfg.get("shards", 1) > 1:
        return wrap_sharded(cell, cfg, net)
    name, options = cell["name"], cell["options"]
    kind = cell.get("optimizer", "sgd")
    if name not in BASELINES:
        algorithm = build(name, **options)
        opt = make_optimizer(kind, net.parameters(), cell_lr(cell, cfg), optimizer_momentum(algorithm))
        # Every rank built the same seeded model, so the start-up broadcast (DDP always does one; neither
        # is timed) is skipped: it costs seconds per cell on a slow emulated link.
        wrapper = bagua_lite.DistributedModel(net, opt, algorithm=algorithm,
                                              bucket_size_mb=cfg["bucket_size_mb"], broadcast_parameters=False)
        return wrapper, wrapper, opt, None
    opt = make_optimizer(kind, net.parameters(), cell_lr(cell, cfg))
    if name == "torchft_diloco":
        return net, None, opt, TorchftDiLoCo(net, opt, options, cfg["timeout_s"])
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    # powerSGD_hook with several buckets on gloo crashes (its per-bucket callbacks launch collectives
    # out of order); it runs reliably with one bucket, so that is how we run it.
    cap = 4096 if name == "ddp_powersgd" else cfg["bucket_size_mb"]
    # init_sync=False: every rank built the same seeded model (as for ours, the start-up broadcast is
    # skipped; neither is timed, it only costs the run seconds on a slow link)
    model = DDP(net, bucket_cap_mb=cap, init_sync=False)
    if name == "ddp_fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "ddp_powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=options.get("rank", 4),
                                            start_powerSGD_iter=2, min_compression_rate=0.5)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif name in HOOK_BASELINES:
        model.register_comm_hook(*hook_state(name, options))
    return model, None, opt, None


# ---- sharded cells (``shards`` > 1): HSDP ------------------------------------------------------------------------
_MESHES = {}  # (default group, world, shards) -> the (replicate, shard) mesh


def shard_mesh(shards):
    """The job's 2-D mesh, replicas x ``shards``, dimensions named ("replicate", "shard"): consecutive ranks
    form a replica (with ``ranks_per_node`` = shards, a node). Made once per process and default group:
    ``init_device_mesh`` creates process groups, collectively over the job, and every cell of a run uses
    the same layout, so a run of many cells does not pile up groups."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    key = (id(dist.group.WORLD), world, shards)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", (world // shards, shards), mesh_dim_names=("replicate", "shard"))
    return _MESHES[key]


def shard_units(net):
    """The modules that become FSDP units of their own before the root does: a transformer's blocks
    (gpt_small's ``net.blocks``, hf_gpt2's ``transformer.h``), so that forward and backward gather one
    block's weights at a time, as FSDP2's examples shard; any other model: its top-level children that
    hold parameters. The root's unit keeps what is left (gpt_small: the embeddings, tied to the LM head,
    and the final LayerNorm)."""
    blocks = getattr(net, "blocks", None)
    if blocks is None and hasattr(net, "gpt2"):
        blocks = net.gpt2.transformer.h
    if blocks is not None:
        return list(blocks.children())
    return [m for m in net.children() if any(True for _ in m.parameters())]


def wrap_sharded(cell, cfg, net):
    """(model to call, our ShardedModel or None, optimizer, None) of a cell whose model is FSDP2-sharded over
    ``shards`` ranks and replicated over world / shards (HSDP). ``hsdp``, the baseline: ``fully_shard`` over
    the 2-D mesh, FSDP2 averages across replicas itself. Ours: ``fully_shard`` over the shard dimension,
    and ``bagua_lite.ShardedModel`` runs the algorithm across replicas. Every rank built the same seeded
    model, so ShardedModel's start-up broadcast is skipped (as DistributedModel's is in ``wrap``). The
    model to call is the FSDP2 module itself: ShardedModel hooks it, the loop stays FSDP2's. The config's
    ``fsdp_units`` (blocks: ``shard_units`` then the root; root: the root alone) and
    ``reshard_after_forward`` shape every row's sharding alike."""
    from torch.distributed.fsdp import fully_shard

    name, options = cell["name"], cell["options"]
    kind = cell.get("optimizer", "sgd")
    mesh = shard_mesh(cfg["shards"])
    over = mesh if name == "hsdp" else mesh["shard"]
    keep = {"reshard_after_forward": cfg.get("reshard_after_forward", True)}
    for unit in shard_units(net) if cfg.get("fsdp_units", "blocks") == "blocks" else ():
        fully_shard(unit, mesh=over, **keep)
    fully_shard(net, mesh=over, **keep)
    if name == "hsdp":
        return net, None, make_optimizer(kind, net.parameters(), cell_lr(cell, cfg)), None
    if name in BASELINES:  # config refuses these; a clear error if a caller builds a cell by hand
        raise ValueError(f"benchmark: {name} does not run on an FSDP2-sharded model (shards: {cfg['shards']})")
    algorithm = build(name, **options)
    opt = make_optimizer(kind, net.parameters(), cell_lr(cell, cfg), optimizer_momentum(algorithm))
    relaxed = bagua_lite.ShardedModel(net, opt, algorithm=algorithm, mesh=mesh, broadcast_parameters=False)
    return net, relaxed, opt, None


def tx_bytes():
    """Bytes this rank sent on its network namespace's non-loopback interface (None on plain loopback).

    The interface is the node's: with ``ranks_per_node`` > 1 (the launcher's ``BAGUA_LITE_BENCH_RANKS_PER_NODE``;
    1 when unset, as under torchrun) its counter holds what all of them sent, so it is divided by their
    number: the mean over the node's ranks, which step together. Traffic between them takes the
    namespace's loopback and is not counted: the figure is what crosses the slow link."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if not iface:
        return None
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            sent = int(f.read())
    except OSError:
        return None
    return sent / max(1, int(os.environ.get("BAGUA_LITE_BENCH_RANKS_PER_NODE", "1")))


# ---- torchft's DiLoCo, the optional baseline ----------------------------------------------------------------------
def own_address():
    """The address the other ranks reach this rank at: the launcher's ``BAGUA_LITE_BENCH_ADDR`` (an emulated
    link's namespace address, or 127.0.0.1), else this host's name resolved (under torchrun)."""
    addr = os.environ.get("BAGUA_LITE_BENCH_ADDR")
    if addr:
        return addr
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def split_fragments(net, n):
    """``n`` modules that hold the parameters of ``net`` in order, in contiguous groups of about equal size
    (torchft's streaming DiLoCo syncs one fragment at a time). One fragment: ``[net]`` itself."""
    import torch

    if n == 1:
        return [net]
    params = list(net.parameters())
    if n > len(params):
        raise ValueError(f"torchft_diloco: fragments ({n}) is more than the model's {len(params)} parameter tensors")
    total = sum(p.numel() for p in params)
    groups, cur, acc = [], [], 0
    for i, p in enumerate(params):
        cur.append(p)
        acc += p.numel()
        left = len(params) - i - 1
        if (acc >= total * (len(groups) + 1) / n or left == n - len(groups) - 1) and len(groups) < n - 1 and left:
            groups.append(cur)
            cur = []
    groups.append(cur)
    out = []
    for g in groups:
        m = torch.nn.Module()
        m.params = torch.nn.ParameterList(g)  # the same Parameter objects: stepping them steps the model
        out.append(m)
    return out


class TorchftDiLoCo:
    """torchft's DiLoCo (``torchft.local_sgd.DiLoCo``) on this rank, for the ``torchft_diloco`` row.

    Every rank is one torchft replica group of one process: its own TCPStore and ``Manager`` (synchronous
    quorum, as DiLoCo requires; ``init_sync`` off, since every rank built the same seeded weights), a
    torchft ``ProcessGroupGloo`` that the manager configures at each new quorum, and the lighthouse that
    forms the quorums run by rank 0 (``torchft._torchft.LighthouseServer``, in rank 0's process and network
    namespace, ``min_replicas`` = P), its address broadcast over the benchmark's own process group. The
    inner optimizer is the cell's; the outer one ``outer_optimizer`` (default SGD lr 0.7, Nesterov momentum
    0.9, as ours), one per fragment. ``period`` is DiLoCo's H (torchft's ``sync_every``); ``fragments``,
    ``fragment_sync_delay`` and ``fragment_update_alpha`` are torchft's streaming options."""

    def __init__(self, net, inner, options, timeout_s=900):
        import torch.distributed as dist

        ok, why = torchft_available()
        if not ok:
            raise RuntimeError(f"torchft_diloco: torchft does not import ({why})")
        from torchft import Manager, ProcessGroupGloo  # lazy: torchft is optional
        from torchft._torchft import LighthouseServer  # lazy: torchft is optional
        from torchft.local_sgd import DiLoCo  # lazy: torchft is optional

        # its manager warns at every new quorum that it cannot reset NCCL's flight recorder (CPU: none)
        logging.getLogger("torchft.manager").setLevel(logging.ERROR)
        rank, world = dist.get_rank(), dist.get_world_size()
        self.cycle = int(options.get("period", 500))
        self.lighthouse = None
        addr = [None]
        if rank == 0:
            self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world)
            port = int(self.lighthouse.address().rsplit(":", 1)[1])
            addr = [f"http://{_host(os.environ.get('MASTER_ADDR') or own_address())}:{port}"]
        dist.broadcast_object_list(addr, 0)
        me = own_address()
        self.store = dist.TCPStore(me, 0, is_master=True, wait_for_workers=False)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                               min_replica_size=world, use_async_quorum=False, replica_id=f"bagua_bench_{rank}",
                               store_addr=me, store_port=self.store.port, rank=0, world_size=1,
                               lighthouse_addr=addr[0], hostname=me, init_sync=False, timeout=timeout,
                               quorum_timeout=timeout, connect_timeout=timeout)
        fragments = split_fragments(net, int(options.get("fragments", 1)))
        cls, kwargs = outer_optimizer_class(dict(options.get("outer_optimizer") or DEFAULT_OUTER), "torchft_diloco")
        outers = [cls(f.parameters(), **kwargs) for f in fragments]
        self.diloco = DiLoCo(self.manager, fragments, inner, outers if len(outers) > 1 else outers[0],
                             sync_every=self.cycle, pin_memory=False,
                             fragment_sync_delay=int(options.get("fragment_sync_delay", 0)),
                             fragment_update_alpha=float(options.get("fragment_update_alpha", 0.0)))
        self.diloco.__enter__()

    def close(self):
        import torch.distributed as dist

        self.diloco.__exit__(None, None, None)
        dist.barrier()  # every rank is done with its last quorum before any manager or the lighthouse goes
        self.manager.shutdown(wait=True)
        dist.barrier()
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
        self.diloco = self.manager = self.store = self.lighthouse = None


def _host(addr):
    return f"[{addr}]" if ":" in addr else addr
