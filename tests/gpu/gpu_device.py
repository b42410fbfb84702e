"""Which device the GPU suite checks (``BAGUA_LITE_GPU_CHECK``: cuda, or cpu standing in for it)."""
import multiprocessing as mp
import os
import queue
import tempfile

import pytest
import torch

DEVICE = os.environ.get("BAGUA_LITE_GPU_CHECK", "cuda")


def device():
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("BAGUA_LITE_GPU_CHECK=cuda, and no CUDA device is visible")
    return torch.device("cuda", 0) if DEVICE == "cuda" else torch.device("cpu")


def spawn_ranks(worker, P, args, timeout=240):
    """Start ``P`` spawned processes running ``worker(rank, P, *args, store_path, results)`` (each joins a
    process group through the file store at ``store_path`` and puts ``(rank, out)`` on ``results``), and
    collect them: ``({rank: out}, exit codes)``; a rank silent for ``timeout`` seconds is killed."""
    ctx = mp.get_context("spawn")
    fd, store = tempfile.mkstemp(prefix="bagua_lite_gpu_")
    os.close(fd)
    os.unlink(store)
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, P, *args, store, results)) for r in range(P)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < P:
            try:
                rank, out = results.get(timeout=timeout)
                got[rank] = out
            except queue.Empty:
                break
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return got, [p.exitcode for p in procs]
