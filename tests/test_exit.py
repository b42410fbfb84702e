"""Process exit: no thread is left to ask for the GIL once the interpreter finalizes.

A thread other than the main one that asks CPython for the GIL during finalization is ended with
``pthread_exit``; from C++ that is ``std::terminate`` ("terminate called without an active exception",
SIGABRT) after the program's work is done. bagua_lite.runtime's atexit hook prevents it (see its
docstring): engine workers are stopped and joined, and gloo's worker threads of the process groups the
program destroyed are joined, before finalization. These tests run a fresh interpreter each and look at
what is left when the hook has run (an atexit callback registered before ``import bagua_lite`` runs after
bagua_lite's).
"""
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")

THREADS_AT_EXIT = """
import atexit, os
def _threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
atexit.register(lambda: print("threads after bagua_lite's exit hook:", len(_threads()), _threads(), flush=True))
"""


def _run(code, env=None, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


ENGINE_OP_AT_EXIT = THREADS_AT_EXIT + """
import threading, time, torch, bagua_lite
from bagua_lite import _C
eng = _C.Engine()
started = threading.Event()
def slow(flat):
    started.set()
    time.sleep(1.0)  # the GIL is free: the main thread reaches the end of the program meanwhile
    print("op finished", flush=True)
eng.submit(0, torch.zeros(1), [slow])
started.wait()
print("main finished", flush=True)
"""


def test_engine_op_running_at_exit_finishes_before_finalization():
    """The engine worker is inside a Python op when the program ends: the exit hook lets it finish and
    joins it; without that wait it would wake during finalization and abort the process."""
    proc = _run(ENGINE_OP_AT_EXIT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "terminate called" not in out, out
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["main finished", "op finished"], out
    assert lines[2].startswith("threads after bagua_lite's exit hook: 1 "), out  # the main thread alone


def test_engine_op_exit_wait_is_bounded():
    """BAGUA_LITE_EXIT_WAIT_S bounds the wait: the process says it leaves the thread behind, and exits."""
    proc = _run(ENGINE_OP_AT_EXIT.replace("time.sleep(1.0)", "time.sleep(600)"),
                env={"BAGUA_LITE_EXIT_WAIT_S": "2"}, timeout=60)
    assert "still running an op after 2s: left to the process's end" in proc.stderr, proc.stderr[-3000:]


RANK = THREADS_AT_EXIT + """
import torch, torch.distributed as dist, bagua_lite
def main():  # the model is local, as in examples/train.py: unreachable (a reference cycle) once main returns
    dist.init_process_group("gloo")
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)  # torch's first optimizer, built after init_process_group
    model = bagua_lite.DistributedModel(net, opt, algorithm=ALGORITHM)
    for _ in range(25):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    model.close()
    dist.destroy_process_group()
main()
"""


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "decentralized", "local_sgd"])
def test_destroyed_process_groups_end_before_finalization(algorithm):
    """After close() and destroy_process_group(), no gloo thread is left when the interpreter finalizes:
    neither the model's reference cycles nor torch's own references keep a process group alive. (A model
    still referenced at exit, e.g. a module global, keeps its groups and their threads alive until then.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    P = 2
    code = RANK.replace("ALGORITHM", repr(algorithm))
    procs = []
    for r in range(P):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RANK=str(r), WORLD_SIZE=str(P),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{algorithm}: a rank did not finish in 180 s")
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, (r, out[-3000:])
        assert "threads after bagua_lite's exit hook: 1 " in out, (r, out[-3000:])  # the main thread alone
