"""What the DiLoCo family's classes share: option checks, the outer optimizer given as ``{name: <a torch.optim
class, any case>, <its keyword arguments>}``, its special case that is plain averaging (local SGD), and the
traffic description."""
import inspect

import torch

from bagua_lite import cost_model as cm

DEFAULT_OUTER = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}
PLAIN = {"name": "sgd", "lr": 1.0}  # the outer step that is the average itself: local SGD


def plain_average(spec) -> bool:
    """Outer SGD at lr 1 without momentum or decay sets theta to the mean of the replicas: it is taken as
    that average (local SGD's exact path), not as theta - (theta - mean)."""
    spec = DEFAULT_OUTER if spec is None else spec
    rest = {k: v for k, v in spec.items() if k not in ("name", "lr")}
    return spec.get("name", "").lower() == "sgd" and spec.get("lr") == 1 and not any(rest.values())


def outer_optimizer_class(spec, who):
    """(torch.optim class, keyword arguments) of an ``outer_optimizer`` option, checked by building it."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError(f"{who}: outer_optimizer must be {{name: <torch.optim class>, <its options>}}, got {spec!r}")
    classes = {n.lower(): c for n, c in vars(torch.optim).items()
               if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    cls = classes.get(spec["name"].lower())
    if cls is None or cls is torch.optim.LBFGS:
        raise ValueError(f"{who}: outer_optimizer name {spec['name']!r} is not a torch.optim optimizer; choose one "
                         f"of {', '.join(sorted(n for n in classes if n != 'lbfgs'))}")
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    try:
        cls([torch.zeros(1)], **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{who}: outer_optimizer {spec!r}: {e}") from None
    return cls, kwargs


def check_options(who, period, warmup_steps, fragments, overlap, alpha):
    for key, v, low in (("period", period, 1), ("warmup_steps", warmup_steps, 0), ("fragments", fragments, 1),
                        ("overlap", overlap, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{who}: {key} must be >= {low}, got {v!r}")
    if fragments > period or overlap >= period:
        raise ValueError(f"{who}: fragments ({fragments}) must be <= period ({period}) and overlap "
                         f"({overlap}) < period: each fragment syncs once every period steps")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < 1:
        raise ValueError(f"{who}: alpha (the local weights' share in a merge) must be in [0, 1), got {alpha!r}")


def check_sync_chunks(who, sync_chunks):
    if not isinstance(sync_chunks, int) or isinstance(sync_chunks, bool) or sync_chunks < 1:
        raise ValueError(f"{who}: sync_chunks must be an int >= 1 (the number of pieces a dense sync's allreduce is "
                         f"cut into, all posted at once; 1: one allreduce per flat buffer), got {sync_chunks!r}")


def family_traffic(o, P, numels, elem_bytes=4, machine=None, rank=None):
    """After the warm-up: a sync of 1/F of the weights every period/F steps (F = ``fragments``) after the
    step (a ring allreduce of the weights or of their change, or the compressed allreduce of the change; an
    outer optimizer adds a few passes). With ``overlap`` it runs beside the steps: predicted as overlapped
    with one step (``with_step``), a bound, since it may hide behind ``overlap`` steps."""
    F = o.get("fragments", 1)
    n, c = sum(numels) / F, o["compression"]
    local = 0.0
    if machine is not None:
        local = cm.weight_average_s(c, P, n, machine, apply_passes=1)
        if not plain_average(o.get("outer_optimizer", PLAIN)):
            local += 4 * n * machine.add_s_per_elem
    return cm.Traffic("with_step" if o.get("overlap", 0) else "after_step", local_s=local, warmup=True,
                      exchange=cm.weight_average(c, P, int(n), elem_bytes, rank), every=o["period"] // F)
