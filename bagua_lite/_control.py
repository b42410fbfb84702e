"""Where control traffic travels: the one place that decides.

Control traffic is the small host-side messages around the data: the step agreement with its non-finite
and unused-parameter bits, the config check, checkpoint flags, a pick or a layout sent as a Python object,
the step pairs that ride ahead of a weight exchange. It is made of CPU tensors (int64, or the bytes of
an object collective), because the host decides on it.

- A group whose backend carries CPU tensors (gloo, or ``"cpu:gloo,cuda:nccl"``) carries its own control
  traffic: no second group, nothing changes on a CPU job.
- A group that carries device tensors only (NCCL) gets one gloo group over the same ranks, made once from
  the same store right where that group is made (``setup``), with the same timeout. Its failures are
  ordinary gloo errors, and fail fast and the heartbeat see them, where an NCCL collective would hang
  until NCCL's own watchdog. The alternative, control values as device tensors on the NCCL group, would
  put a device-to-host copy in every step's agreement: the host needs the values to decide.

``BAGUA_LITE_CONTROL_GROUP=side`` makes the gloo group for every group, even one that carries CPU
tensors (to keep control messages off a busy data group, and to test this module on a CPU machine).
Every call site asks ``of(group)``; no other module tests a backend for this.
"""
import os

import torch.distributed as dist

from bagua_lite._compat import group_timeout, takes_cpu_tensors

MODES = ("auto", "side")
_side = {}  # id(data group) -> (data group, its gloo control group)


def mode() -> str:
    value = os.environ.get("BAGUA_LITE_CONTROL_GROUP", "auto")
    if value not in MODES:
        raise ValueError(f"BAGUA_LITE_CONTROL_GROUP={value!r} is not allowed; choose one of {', '.join(MODES)}")
    return value


def needs_side_group(group) -> bool:
    """Whether ``group``'s control traffic needs a gloo group of its own."""
    return mode() == "side" or not takes_cpu_tensors(group)


def setup(group, ranks=None, timeout=None):
    """Make ``group``'s control group if it needs one; return the group control traffic uses.

    Collective like ``dist.new_group``: call it on every rank that made ``group``, right after making it,
    in the same order (``ranks``: ``group``'s global ranks, where the caller has them).
    """
    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
        # Not a member: still take part in making the control group when the members make one. A group
        # made by dist.new_group has the default group's backend, so the default group decides alike here.
        if ranks is not None and needs_side_group(dist.group.WORLD):
            dist.new_group(ranks, backend="gloo", timeout=timeout)
        return group
    if id(group) in _side:
        return _side[id(group)][1]
    if not needs_side_group(group):
        return group
    ranks = dist.get_process_group_ranks(group) if ranks is None else ranks
    side = dist.new_group(ranks, backend="gloo", timeout=timeout or group_timeout(group))
    _side[id(group)] = (group, side)
    return side


def of(group):
    """The group that carries ``group``'s control traffic (``group`` itself, or the gloo group ``setup`` made)."""
    entry = _side.get(id(group))
    if entry is not None and entry[0] is group:
        return entry[1]
    if needs_side_group(group):
        raise RuntimeError(f"bagua_lite: the process group {group} (backend {dist.get_backend(group)!r}) carries "
                           "no CPU tensors and has no control group; create groups for bagua_lite with "
                           "bagua_lite's helpers (or call bagua_lite._control.setup(group) on every rank right "
                           "after making it)")
    return group


def is_side_group(group) -> bool:
    """Whether ``group`` is a control group this module made."""
    return any(side is group for _, side in _side.values())


def forget(group) -> None:
    """Stop routing ``group``'s control traffic through the group ``setup`` made (``group`` is no longer used;
    e.g. a test that forced ``BAGUA_LITE_CONTROL_GROUP=side`` for a while)."""
    _side.pop(id(group), None)
