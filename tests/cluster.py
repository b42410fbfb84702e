"""Real multi-process gloo groups on loopback for tests.

``Cluster(P)`` starts P processes (forked from a forkserver that imported torch once) that join one gloo
process group and then serve tasks: a test calls ``cluster.run(fn, *args)`` with a module-level function
``fn(rank, world_size, *args)``, every rank runs it, and the per-rank results come back as a list (index =
rank). A remote exception is re-raised here with every failing rank's traceback (a rank that gave no result:
how it exited and the end of its stderr, which goes to a log file per rank); the cluster is then torn down,
because a group whose ranks fell out of step cannot be trusted for the next test.
"""
import datetime
import itertools
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback


def _worker(rank, world_size, init_file, timeout_s, tasks, results, log):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # stderr to this rank's log: the forkserver's own stderr is whatever pytest captured when the first
    # cluster of the session started, so what a crashing rank prints would land in another test's output
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)
    import faulthandler
    faulthandler.enable()  # a rank that dies of a signal writes every thread's Python stack to its log
    import torch
    import torch.distributed as dist
    from bagua_lite import _C
    _C._install_crash_trace()  # and the crashing thread's native frames: gloo's and the engine's have no Python

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    import gc
    gc.freeze()  # what the imports made is never garbage: a collection between tasks skips it (0.5 s -> ms)
    made = set()
    while True:
        try:
            task = tasks.get()  # unpickling imports fn's module, which may itself fail
        except BaseException:  # noqa: BLE001
            results.put((rank, False, "could not receive the task:\n" + traceback.format_exc()))
            continue
        if task is None:
            break
        _destroy(made)
        fn, args = task
        before = _groups()
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc()))
        made = _groups() - before
    dist.destroy_process_group()


def _groups():
    import torch.distributed as dist
    return set(dist.distributed_c10d._world.pg_map)


def _destroy(groups):
    """Destroys the process groups the previous task made (its algorithms' groups, their control groups,
    its device meshes'), when the next one arrives: every rank has finished it then (run() hands out a task
    only after every rank's result), so no peer is inside a collective on them. A cluster serves hundreds
    of tasks, and each gloo group it keeps holds threads that wake up all the time: left alone, they took a
    third of a core per idle rank and slowed every later test."""
    if not groups:
        return
    import torch.distributed as dist
    from bagua_lite import _control
    for g in groups:
        try:
            dist.destroy_process_group(g)
        except Exception:  # noqa: BLE001 - already destroyed by the task itself
            pass
    for key, (data, side) in list(_control._side.items()):
        if data in groups or side in groups:
            del _control._side[key]
    _forget_meshes()
    groups.clear()  # the caller's set was the last reference outside the task's own objects
    # Free them now, while no peer is in a collective: a gloo group lives until its last reference goes,
    # and the task's models, meshes and modules hold theirs in reference cycles. Left to the garbage
    # collector, a group (its worker threads, its sockets) was torn down at some moment of a later task,
    # on whichever thread ran the collection, while that task's own groups were busy.
    import gc
    gc.collect()


def _forget_meshes():
    """Forgets the meshes whose groups were destroyed. The benchmark keeps its meshes for its next cell, and
    DTensor caches its sharding decisions by DeviceMesh, where two meshes of one shape and names compare
    equal: the next task would be handed this task's mesh, whose groups are gone ("Could not resolve the
    process group registered under the name ..."). Both are needed (either alone fails the HSDP tests)."""
    import sys
    cells = sys.modules.get("bagua_lite.bench.cells")
    if cells is not None:
        cells._MESHES.clear()  # the benchmark's meshes, one per shape for all the cells of a run
    if "torch.distributed.tensor" not in sys.modules:
        return
    import torch
    from torch.distributed.tensor import DTensor
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    # the redistribution caches hold meshes too (and, through them, the groups): a planner per mesh, the
    # transforms per pair of specs, the topology per mesh
    from torch.distributed.tensor import _collective_utils, _redistribute
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()
    for fn in (getattr(_redistribute, "_gen_transform_infos", None),
               getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)):
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


def _exit_status(code):
    """A dead rank's exit code in words (multiprocessing gives -N for the signal N that killed it)."""
    if code is None or code >= 0:
        return f"exit code {code}"
    import signal
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


class RemoteError(RuntimeError):
    """A task failed, timed out or lost a rank. ``partial``: {rank: (ok, value)} of the ranks that did
    report; ``dead``: the ranks whose process had exited."""

    def __init__(self, msg, partial=None, dead=()):
        super().__init__(msg)
        self.partial = dict(partial or {})
        self.dead = list(dead)


# what the ranks would otherwise import each on its own: dynamo (torch.optim's constructors import it),
# FSDP2 and DTensor (the HSDP tests); bagua_lite itself imports none of them
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor",
            "bagua_lite", "cluster"]


def _context():
    """Ranks are forked from a forkserver that imported torch and bagua_lite once (a group of 4 starts in
    0.1 s instead of 2.6 s of spawning and importing). The server itself forks nothing else, starts no
    threads, and imports torch with OMP_NUM_THREADS=1 (libgomp reads it when it loads)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    from multiprocessing import forkserver
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return ctx


class Cluster:
    def __init__(self, world_size, timeout_s=60):
        self.world_size = world_size
        ctx = _context()
        fd, self._init_file = tempfile.mkstemp(prefix="bagua_lite_pg_")
        os.close(fd)
        os.unlink(self._init_file)  # FileStore creates it
        self._logs = []
        for r in range(world_size):
            fd, path = tempfile.mkstemp(prefix=f"bagua_lite_rank{r}_", suffix=".log")
            os.close(fd)
            self._logs.append(path)
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, world_size, self._init_file, timeout_s, self._tasks[r], self._results,
                                         self._logs[r]))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        self.broken = False
        self._history = []

    def run(self, fn, *args, timeout=180, grace=30):
        """Run ``fn(rank, world_size, *args)`` on every rank; return the results in rank order.

        Fails fast instead of hanging: if a rank's process exits, or a rank reports an error, the others
        get at most ``grace`` more seconds (they may be stuck in a collective with it) before this raises.
        """
        if self.broken:
            raise RemoteError(f"{fn.__name__}: cluster is broken by an earlier failure")
        for q in self._tasks:
            q.put((fn, args))
        got = {}
        deadline = time.monotonic() + timeout
        dead = []
        while len(got) + len(dead) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, ok, value = self._results.get(timeout=min(0.5, deadline - now))
                got[rank] = (ok, value)
                if not ok:
                    deadline = min(deadline, time.monotonic() + grace)
                continue
            except queue.Empty:
                pass
            newly_dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got and r not in dead]
            if newly_dead:
                dead += newly_dead
                deadline = min(deadline, time.monotonic() + grace)
                if len(got) + len(dead) >= self.world_size:
                    # Drain anything a rank put just before exiting.
                    try:
                        while True:
                            rank, ok, value = self._results.get(timeout=0.2)
                            got[rank] = (ok, value)
                    except queue.Empty:
                        pass
                    break
        errors = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
        missing = [r for r in range(self.world_size) if r not in got]
        if errors or missing:
            self.broken = True
            dead = sorted(set(dead) | {r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got})
            parts = []
            if missing:
                codes = ", ".join(f"rank {r}: {_exit_status(self._procs[r].exitcode)}{self._last_words(r)}"
                                  for r in dead)
                parts.append(f"no result from rank(s) {missing} (dead: {dead}; {codes or 'none exited'})")
            if errors:
                parts.append(f"failed on {len(errors)} rank(s):\n" + "\n".join(errors))
            for r in missing:  # dead, or still inside something: what it last wrote
                parts.append(f"--- rank {r}'s stderr, the end ---\n{self.log_tail(r)}")
            if self._history:  # what ran before it on these processes: a failure may come from a task's leftovers
                parts.append(f"this cluster's previous tasks, oldest first: {', '.join(self._history)}")
            raise RemoteError(f"{fn.__name__}: " + "; ".join(parts), partial=got, dead=dead)
        self._history = (self._history + [fn.__name__])[-12:]
        return [got[r][1] for r in range(self.world_size)]

    _WHY = ("terminate called", "what():", "Fatal Python error", "malloc", "free()", "corrupted", "double free",
            "native backtrace of the crashing thread")

    def _last_words(self, rank):
        """What a dead rank said of why it died (gloo's or the C library's message), for the error's first
        line: the end of its log, quoted further on, may be cut where a report is excerpted."""
        try:
            with open(self._logs[rank], errors="replace") as f:
                log = [ln.strip() for ln in f]
        except OSError:
            return ""
        lines = []
        for i, ln in enumerate(log):
            if any(w in ln for w in self._WHY):
                lines.append(ln)
                if "native backtrace" in ln:  # with its top frames (each file's name, not its path), after ours
                    frames = itertools.takewhile(lambda f: "[0x" in f, log[i + 2:i + 8])
                    lines.append(" < ".join(os.path.basename(f) for f in frames))
        return (": " + " | ".join(lines[-5:])[:1500]) if lines else ""

    def log_tail(self, rank, chars=6000):
        """The end of what ``rank`` wrote to stderr (its log file)."""
        try:
            with open(self._logs[rank], errors="replace") as f:
                return f.read()[-chars:]
        except OSError as e:
            return f"(no log: {e})"

    def close(self):
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001
                    pass
        for p in self._procs:
            p.join(timeout=2 if self.broken else 10)  # a broken group may hang in its teardown
            if p.is_alive():
                p.kill()
        for path in [self._init_file] + self._logs:
            if os.path.exists(path):
                os.unlink(path)
