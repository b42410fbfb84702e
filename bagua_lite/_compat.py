"""Every difference between the torch releases bagua_lite supports (2.11 and newer), in one place.

The rest of the package calls these and never tests ``torch.__version__`` itself; the C++ side has its
twin in ``csrc/compat.h``. CI builds and runs a smoke subset against the oldest supported torch, so a
newer-only API used anywhere else fails there before it lands.
"""
import functools
import sys

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


def fsdp_reduce_dtype(unit):
    """The dtype FSDP2 casts ``unit``'s gradients to for its reduce-scatter, and so hands its all-reduce hook:
    the MixedPrecisionPolicy's reduce_dtype, else its param_dtype; None where the policy casts nothing (the
    parameters' own dtype) or where this torch keeps the policy elsewhere (the hook's own check then catches
    a mismatch). FSDP2 has no public getter for the policy: this reads the attribute fully_shard stores it in
    (torch 2.11-2.13)."""
    try:
        policy = unit._get_fsdp_state()._mp_policy
    except AttributeError:
        return None
    return policy.reduce_dtype or policy.param_dtype


def compiler_disable(fn):
    """``torch.compiler.disable(fn)`` without importing dynamo at bagua_lite's import (2.5 s of every
    process's start, on top of torch's own 2.3). Until something imports ``torch._dynamo`` nothing can trace
    ``fn`` and it runs as it is; from then on it runs through torch's own disable, so a trace that inlines
    the wrapper still stops at ``fn`` and runs it eagerly. The wrapper also carries the mark torch's disable
    sets (2.11-2.13), so dynamo skips it outright. tests/test_loop_shapes.py checks both hooks are skipped."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    call._torchdynamo_disable = True
    call._torchdynamo_orig_callable = fn
    return call
