"""What the multi-process benchmark scripts share: P spawned ranks on a fresh gloo FileStore."""
import contextlib
import multiprocessing as mp
import os
import tempfile


@contextlib.contextmanager
def spawned_ranks(P, target, args, prefix="bagua_lite_bench_"):
    """Start ``target(rank, P, init_file, *args, out)`` in P spawned processes; yield ``(procs, out)``, the
    processes and the queue they report on. On exit every rank is joined (killed after 30 s) and the
    store file is removed."""
    ctx = mp.get_context("spawn")
    fd, init_file = tempfile.mkstemp(prefix=prefix)
    os.close(fd)
    os.unlink(init_file)  # FileStore creates it
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, P, init_file, *args, out)) for r in range(P)]
    for p in procs:
        p.start()
    try:
        yield procs, out
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
