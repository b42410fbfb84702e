"""The test harness itself (cluster.py): what it reports when a rank dies, and that one task's process
groups are gone before the next task starts."""
import collections
import os
import signal

import pytest

from cluster import Cluster, RemoteError


def _failure(fn):
    """The RemoteError of running ``fn`` on a fresh cluster of 2 (torn down after)."""
    c = Cluster(2)
    try:
        with pytest.raises(RemoteError) as err:
            c.run(fn, timeout=60, grace=5)
    finally:
        c.close()
    return err.value


def _r_crash(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # as a crash in native code would
    return rank


def test_a_rank_killed_by_a_signal_is_named_with_it_and_its_stack_printed():
    """A rank that dies of a signal is named with the signal, and the error carries the end of its stderr
    with its Python stack (faulthandler), so a crash seen once in CI says where it happened."""
    err = _failure(_r_crash)
    assert err.dead == [1], err.dead
    msg = str(err)
    assert "rank 1: killed by SIGSEGV" in msg, msg
    tail = msg[msg.index("--- rank 1's stderr, the end ---"):]
    assert "Fatal Python error: Segmentation fault" in tail, tail
    assert "in _r_crash" in tail, tail  # the line it died on
    # the native frames too, before faulthandler's Python stacks (here the interpreter's own)
    assert "bagua_lite: native backtrace of the crashing thread (SIGSEGV)" in msg.splitlines()[0], msg
    assert tail.index("native backtrace") < tail.index("Fatal Python error"), tail


def _r_crash_in_a_native_thread(rank, world):
    """Rank 1 starts a thread that never runs Python and calls strlen(NULL) (as a bug in a thread of gloo's
    or of the engine's would crash), while its Python threads wait."""
    if rank == 1:
        import ctypes
        import time
        libc, thread = ctypes.CDLL(None), ctypes.c_ulong()
        libc.pthread_create(ctypes.byref(thread), None, ctypes.cast(libc.strlen, ctypes.c_void_p), None)
        time.sleep(60)
    return rank


def test_a_crash_in_a_thread_that_never_ran_python_shows_its_native_frames():
    """faulthandler prints only Python threads' stacks: a crash in one of gloo's threads or the engine's
    left no frame of its own in the log (a flaky SIGSEGV in CI, its every Python thread waiting). The
    harness's ranks write the crashing thread's native backtrace first (``_C._install_crash_trace``), and
    the error's first line says so."""
    err = _failure(_r_crash_in_a_native_thread)
    msg = str(err)
    assert err.dead == [1] and "rank 1: killed by SIGSEGV" in msg, msg
    assert "native backtrace of the crashing thread (SIGSEGV)" in msg.splitlines()[0], msg
    tail = msg[msg.index("--- rank 1's stderr, the end ---"):]
    frames = tail[tail.index("native backtrace"):tail.index("Fatal Python error")]
    assert "_C.cpython" in frames, frames  # the handler's own frame, then the thread's
    assert "Current thread" not in tail, tail  # faulthandler: no Python thread was the one that crashed


def _r_ok(rank, world):
    return rank


def _r_abort(rank, world):
    """Dies as an uncaught C++ exception does (gloo's on a mismatched message): its words, then SIGABRT."""
    if rank == 1:
        os.write(2, b"terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
                    b"  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 272 vs 16.\n")
        os.abort()
    return rank


def test_a_rank_aborted_is_named_with_its_last_words_first_and_the_tasks_run_before_it():
    """What a dead rank printed of why (gloo's what(), the C library's heap errors) is in the error's first
    line, and the tasks the cluster ran before are at its end: a report that keeps only both ends of a
    long error (as CI's does) still says why a rank died and what ran before it."""
    c = Cluster(2)
    try:
        c.run(_r_ok)
        with pytest.raises(RemoteError) as err:
            c.run(_r_abort, timeout=60, grace=5)
    finally:
        c.close()
    first, last = str(err.value).splitlines()[0], str(err.value).splitlines()[-1]
    assert "rank 1: killed by SIGABRT: terminate called after throwing an instance of 'gloo::EnforceNotMet'" in first
    assert "272 vs 16" in first, first
    assert last.endswith("previous tasks, oldest first: _r_ok"), last


def _gloo_threads():
    """This process's gloo threads by name (two workers per group, one event loop per group's device)."""
    names = collections.Counter()
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names[f.read().strip()] += 1
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return {k: v for k, v in names.items() if "gloo" in k}


def _r_threads(rank, world):
    return _gloo_threads()


def _r_models(rank, world):
    """What the HSDP and algorithm tests make: a 2 x 2 mesh with FSDP2 and a ShardedModel (DiLoCo), a
    DistributedModel whose algorithm makes groups of its own; trained a few steps, then closed."""
    import torch
    import bagua_lite
    import test_hsdp_semantics as T
    net, opt, relaxed = T._model(2, 2, T.DILOCO)
    for x, y in T._batches(rank, 3):
        T._loss(net, x, y).backward()
        opt.step()
        opt.zero_grad()
    relaxed.close()
    T._full(net)  # DTensor's redistribution (and its caches) too
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua_lite.DistributedModel(model, opt, algorithm=bagua_lite.algorithms.build("low_precision_decentralized"))
    for _ in range(3):
        ddp(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    ddp.close()
    return _gloo_threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_a_tasks_groups_are_freed_before_the_next_task_starts():
    """Each task's groups (its meshes', its algorithms') are destroyed and freed when the next task
    arrives, while every rank is idle: none of their threads is left. Before, DTensor's caches and reference
    cycles kept them alive, and the garbage collector tore them down at some moment of a later task, on
    whichever thread ran it (the ranks of a long session held 40 groups' threads)."""
    c = Cluster(4)
    try:
        idle = c.run(_r_threads)
        for _ in range(2):
            busy = c.run(_r_models)
            after = c.run(_r_threads)
            for r in range(4):
                assert sum(busy[r].values()) > sum(idle[r].values()), (r, busy[r], idle[r])  # made groups
                assert after[r] == idle[r], (r, after[r], idle[r])
    finally:
        c.close()
