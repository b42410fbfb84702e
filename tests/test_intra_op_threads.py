"""The threads bagua_lite runs beside training do their ATen work serially, with no OpenMP team of their own.

A second team on cores the trainer's team already uses makes OpenMP put its idle threads to sleep instead of
spinning, and the trainer's parallel ops then wait for their team to wake: on this machine a local SGD run's
forward and backward took 1.7-2.3x the plain loop's from its first periodic average on (2 intra-op threads),
and 1.07-1.10x once the engine's thread ran serially (docs/design_notes.md). What is checked here is the
mechanism, in a fresh process: the engine's thread and an algorithm's worker thread count one intra-op
thread, an op they run starts no thread, and the trainer's count (and what threads started later inherit)
stays what the trainer set.
"""
import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, os, threading, torch
torch.set_num_threads(2)
import bagua_lite
from bagua_lite import _C
from bagua_lite._worker import Worker

def threads():
    return len(os.listdir("/proc/self/task"))

x = torch.randn(4_000_000)
(x * 2).sum()  # the trainer's own team is up
seen = {}
engine = _C.Engine()
engine.submit(-1, x, [lambda flat: None])
engine.wait_all()  # the engine's thread has started
before = threads()

def op(flat):
    seen["engine"] = torch.get_num_threads()
    (flat * 2).sum()  # large enough to run in parallel with 2 threads

engine.submit(0, x, [op])
engine.wait_all()
seen["threads the engine's op started"] = threads() - before
done = threading.Event()
worker = Worker("bagua_lite-test")
worker.submit(lambda: seen.__setitem__("worker", torch.get_num_threads()) or (x * 3).sum(), done)
done.wait(60)
worker.stop(60)
later = threading.Thread(target=lambda: seen.__setitem__("a thread started later", torch.get_num_threads()))
later.start()
later.join()
seen["trainer"] = torch.get_num_threads()
print(json.dumps(seen))
"""


def test_engine_and_worker_threads_run_serially_and_leave_the_trainers_count_alone(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"engine": 1, "threads the engine's op started": 0, "worker": 1, "a thread started later": 2,
                    "trainer": 2}, seen
