"""One benchmark cell's model: ours (a DistributedModel) or a PyTorch DDP baseline, with its optimizer."""
from .config import BASELINES, make_optimizer, optimizer_momentum


def wrap(cell, cfg, net):
    """(model to call, our DistributedModel or None for a DDP baseline, optimizer) of one cell.

    The optimizer is the cell's (``make_optimizer``); SGD's momentum is 0 under an algorithm given its own
    (gtopk/topk with a number ``momentum_correction``, see ``optimizer_momentum``)."""
    import bagua_lite

    name, options = cell["name"], cell["options"]
    kind = cell.get("optimizer", "sgd")
    if name not in BASELINES:
        from bagua_lite.algorithms import build

        algorithm = build(name, **options)
        opt = make_optimizer(kind, net.parameters(), cfg.get("lr"), optimizer_momentum(algorithm))
        # Every rank built the same seeded model, so the start-up broadcast (DDP always does one; neither
        # is timed) is skipped: it costs seconds per cell on a slow emulated link.
        wrapper = bagua_lite.DistributedModel(net, opt, algorithm=algorithm,
                                              bucket_size_mb=cfg["bucket_size_mb"], broadcast_parameters=False)
        return wrapper, wrapper, opt
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    opt = make_optimizer(kind, net.parameters(), cfg.get("lr"))
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
    return model, None, opt
