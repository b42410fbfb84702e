"""Every difference between the torch releases bagua_lite supports (2.11 and newer), in one place.

The rest of the package calls these and never tests ``torch.__version__`` itself; the C++ side has its
twin in ``csrc/compat.h``. CI builds and runs a smoke subset against the oldest supported torch, so a
newer-only API used anywhere else fails there before it lands.
"""
import torch
import torch.distributed as dist

#: the oldest torch release bagua_lite builds and runs on
OLDEST = (2, 11)


def torch_version(version: str = None):
    """(major, minor) of ``version`` (default: the installed torch's), ignoring any local suffix."""
    parts = (version or torch.__version__).split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def check_supported(version: str = None) -> None:
    """Raise a clear error on a torch older than :data:`OLDEST`."""
    if torch_version(version) < OLDEST:
        raise ImportError(f"bagua_lite needs torch {OLDEST[0]}.{OLDEST[1]} or newer, found torch "
                          f"{version or torch.__version__}; upgrade torch, then rebuild bagua_lite "
                          "(pip install --no-build-isolation -e .)")


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns from then on).
if hasattr(dist, "all_gather_single"):
    all_gather_single = dist.all_gather_single
else:
    all_gather_single = dist.all_gather_into_tensor


def scaler_scales(scaler):
    """(scale, 1 / scale) of a ``torch.amp.GradScaler`` as its ``unscale_`` computes them (device tensors,
    no host synchronisation), or None before the scaler's first ``scale()`` or when it is disabled."""
    scale = getattr(scaler, "_scale", None) if scaler is not None and scaler.is_enabled() else None
    if scale is None:
        return None
    return scale, scale.double().reciprocal().float()


def backend_for(group, device_type: str):
    """The name of the backend ``group`` uses for tensors on ``device_type`` ("cpu", "cuda"), or None."""
    try:
        return group._get_backend(torch.device(device_type)).name()
    except RuntimeError:
        return None


def takes_cpu_tensors(group) -> bool:
    """Whether ``group``'s backend carries CPU tensors (gloo, ``"cpu:gloo,cuda:nccl"``); NCCL does not."""
    return backend_for(group, "cpu") is not None


def group_timeout(group):
    """The timeout ``group``'s collectives run with (torch's default when the backend does not say)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001  (no backend for that device, or one without options)
            continue
    return dist.default_pg_timeout
