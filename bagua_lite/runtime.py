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

Process exit. Once CPython starts finalizing, a thread other than the main one that asks for the GIL is
ended with ``pthread_exit``; inside C++ code (a destructor) that is ``std::terminate``: "terminate called
without an active exception" and SIGABRT, after the program's own work is done. Two such threads
outlived ``main()``: gloo's ``pt_gloo_runloop`` workers, which release each finished collective after its
waiter returned and need the GIL when one of its tensors' Python objects is already gone; and an engine
worker of a model whose peer failed, still inside a collective that fails when the peers exit. So, when
this module is imported (by ``import bagua_lite``):

* ``torch.distributed.nn.functional`` is imported if no process group exists yet. Its functions take
  ``group=group.WORLD`` as a default argument, evaluated at import; torch imports it on the first optimizer
  it builds, and if that happens after ``init_process_group`` the defaults keep the default group alive for
  good, so ``destroy_process_group()`` no longer ends its gloo threads.
* :func:`_release_at_exit` is registered with ``atexit``, which runs while the interpreter is whole: every
  engine worker gets up to ``BAGUA_LITE_EXIT_WAIT_S`` seconds (default 30) to leave the collective it is in
  (with a failed peer it fails as the peers exit) and is joined; then a garbage collection frees models
  nobody holds any more (they form reference cycles), and with them the last references to process
  groups ``destroy_process_group()`` already let go of: their gloo threads are joined now, with the GIL
  free, instead of in finalization. (A model still referenced at exit, e.g. a module global, keeps its
  groups and their threads alive into finalization; ``model.close()`` does not let go of them.)
"""
import atexit
import ctypes
import ctypes.util
import gc
import logging
import os
import sys
import threading
import time

import torch

from . import _C

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



EXIT_WAIT_ENV = "BAGUA_LITE_EXIT_WAIT_S"
EXIT_WAIT_S = 30.0


def exit_wait_s() -> float:
    """Seconds bagua_lite waits at process exit for a thread still in an op or collective (its engine workers;
    an algorithm may wait as long for a thread of its own): ``BAGUA_LITE_EXIT_WAIT_S``, default 30."""
    text = os.environ.get(EXIT_WAIT_ENV, "").strip()
    try:
        return max(0.0, float(text)) if text else EXIT_WAIT_S
    except ValueError:
        log.warning("bagua_lite: %s=%r is not a number of seconds; using %s", EXIT_WAIT_ENV, text, EXIT_WAIT_S)
        return EXIT_WAIT_S


def _release_at_exit() -> None:
    """atexit: stop every engine worker and free unreachable models while other threads may still take the
    GIL (see the module docstring). Does nothing in a process that never made a model's engine."""
    if not _C._engines_created():
        return
    budget, t0 = exit_wait_s(), time.monotonic()
    running = _C._stop_engines_for_exit(min(1.0, budget))
    if running and budget > 1.0:
        print(f"bagua_lite: at exit, waiting up to {budget:.0f}s for {running} engine thread(s) still running an "
              f"op (after a peer failed, its collective fails as the peers exit); {EXIT_WAIT_ENV} sets the "
              f"limit", file=sys.stderr, flush=True)
        running = _C._stop_engines_for_exit(max(0.0, budget - (time.monotonic() - t0)))
    if running:
        print(f"bagua_lite: {running} engine thread(s) still running an op after {budget:.0f}s: left to the "
              f"process's end (if one returns during interpreter finalization, the process aborts)",
              file=sys.stderr, flush=True)
    gc.collect()


def _bind_group_defaults_early() -> None:
    """Import ``torch.distributed.nn.functional`` before any process group exists (see the module
    docstring): its ``group=group.WORLD`` defaults then stay None, which means the default group at call
    time, instead of holding the first default group alive forever."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return
    try:
        import torch.distributed.nn.functional  # noqa: F401
    except ImportError:  # a torch without that module has no such defaults either
        pass


_bind_group_defaults_early()
atexit.register(_release_at_exit)


_kept = threading.local()


def kept_buffer(slot: str, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The first ``n`` elements of a grow-only buffer per (thread, slot, dtype, device), as the C++ core's
    ``scratch_bytes``: once warm, a call that needs working space allocates nothing. The caller holds it
    only until it returns: the next call with the same slot on the same thread gets the same memory."""
    pools = _kept.__dict__.setdefault("pools", {})
    key = (slot, dtype, str(device))
    buf = pools.get(key)
    if buf is None or buf.numel() < n:
        buf = pools[key] = torch.empty(max(n, 0 if buf is None else buf.numel() * 3 // 2), dtype=dtype,
                                       device=device)
    return buf[:n]
