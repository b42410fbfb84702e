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


def join_group(rank, P, backend, device, store_path):
    """In a spawned rank: the rank's device (GPU 0 for every rank: one GPU), and the process group joined
    through the file store at ``store_path``."""
    import datetime
    import faulthandler

    import torch.distributed as dist
    from bagua_lite import _C
    faulthandler.enable()  # a rank that dies of a signal prints its Python stacks, and the crashing
    _C._install_crash_trace()  # thread's native frames (NCCL's, gloo's and the engine's threads run no Python)
    if device == "cuda":
        torch.cuda.set_device(0)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    dist.init_process_group(backend, store=dist.FileStore(store_path, P), rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=120))
    return dev


def serve_rows(rank, P, backend, device, store_path, results, names, row):
    """A spawned rank's whole life for a table of rows: join the group, ``row(dev, name)`` for each name (an
    exception becomes that row's traceback, as a string, not the end of the run), leave the group, and put
    ``(rank, {name: result})`` on ``results`` (``{"__fatal__": traceback}`` if the rank itself failed)."""
    import traceback
    try:
        import torch.distributed as dist
        dev = join_group(rank, P, backend, device, store_path)
        out = {}
        for name in names:
            try:
                out[name] = row(dev, name)
            except Exception:  # noqa: BLE001 - a row of the table, not the end of the run
                out[name] = traceback.format_exc(limit=3)
        dist.destroy_process_group()
        results.put((rank, out))
    except BaseException:  # noqa: BLE001
        results.put((rank, {"__fatal__": traceback.format_exc()}))


def spawn_ranks(worker, P, args, timeout=240):
    """Start ``P`` spawned processes running ``worker(rank, P, *args, store_path, results)`` (each joins a
    process group through the file store at ``store_path`` and puts ``(rank, out)`` on ``results``), and
    collect them: ``({rank: out}, exit codes)``; when a rank dies without a result, or none is heard from for
    ``timeout`` seconds, the rest are killed."""
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
        silent = 0.0
        while len(got) < P and silent < timeout:
            try:
                rank, out = results.get(timeout=1.0)
                got[rank], silent = out, 0.0
            except queue.Empty:
                silent += 1.0
                # a rank that died without a result (an abort in a collective) leaves its peers waiting on
                # it until their group's timeout, per algorithm: stop now and report the exit codes
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return got, [p.exitcode for p in procs]
