"""Process-level tuning for CPU training.

glibc's malloc serves every allocation above its mmap threshold (dynamic, at most 32 MiB by default)
with a fresh ``mmap`` and returns it with ``munmap`` on free. Autograd allocates each step's gradients
and activations anew, so for a model with large layers every step page-faults (and the kernel zeroes)
hundreds of megabytes: on the 2-core reference machine that is 20-40% of a 25M-parameter MLP's step.
:func:`tune_cpu_allocator` raises the mmap and trim thresholds so freed blocks are kept and reused, as
PyTorch's CUDA caching allocator does on GPUs (and as PyTorch's CPU performance guide gets by preloading
jemalloc or tcmalloc). The process keeps its peak heap instead of returning it to the system.

:class:`~bagua_lite.DistributedModel` calls it for CPU models; ``BAGUA_LITE_TUNE_MALLOC=0`` turns that off.
The benchmark calls it once per worker before anything is measured, so the compute floor, the DDP
baselines and every algorithm run with the same allocator.
"""
import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("bagua_lite")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
ENV = "BAGUA_LITE_TUNE_MALLOC"
_state = {"done": False, "applied": False}


def tune_cpu_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 31) -> bool:
    """Keep large freed blocks for reuse (glibc ``mallopt``). Returns whether the setting is in force.

    Idempotent; does nothing (returns False) where libc has no ``mallopt`` (musl, macOS) or when the
    environment sets ``BAGUA_LITE_TUNE_MALLOC=0``.
    """
    if _state["done"]:
        return _state["applied"]
    _state["done"] = True
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, int(min(mmap_threshold, 2 ** 31 - 1))))
    ok = bool(mallopt(_M_TRIM_THRESHOLD, int(min(trim_threshold, 2 ** 31 - 1)))) and ok
    _state["applied"] = ok
    if ok:
        log.debug("bagua_lite: malloc keeps freed blocks up to %d bytes for reuse", mmap_threshold)
    return ok

