"""The thread an algorithm runs its own communication on, beside training, and how it ends.

One daemon thread per :class:`Worker` runs the submitted jobs in order (an exchange per step, or one long
job such as a periodic averaging loop that returns once ``stopping`` is set). A job's exception is kept
in ``error`` for the training thread to raise. At exit the thread must not sit in a collective: one that
fails as the peers exit would wake it during interpreter finalization and abort the process. So the
first job registers an exit hook that stops the thread once its job in flight is done, waiting at most
``runtime.exit_wait_s()`` seconds.

    worker = Worker("bagua_lite-decentralized")
    worker.submit(exchange, done)            # exchange() runs on the thread, then done is set
    model.wait_for(done)                     # fail fast while waiting (see DistributedModel.wait_for)
    if worker.error is not None: ...         # raise it on the training thread
    worker.stop(timeout, give_up=model.peer_failed)   # close(): after the jobs submitted so far
"""
import atexit
import queue
import threading
import time
import warnings
import weakref

from . import _C, runtime
from ._failfast import POLL_S


class Worker:
    def __init__(self, name: str):
        self.name = name
        self.error = None                  # the first exception a job raised (see take_error)
        self.stopping = threading.Event()  # set by stop(): a long job ends its loop when it sees it
        self._jobs, self._thread = queue.Queue(), None
        self._pending, self._count = 0, threading.Lock()  # jobs queued or running

    @property
    def started(self) -> bool:
        """Whether a job was ever submitted (the thread then runs until stopped)."""
        return self._thread is not None or self.stopping.is_set()

    @property
    def busy(self) -> bool:
        """Whether a job is queued or running."""
        return self._pending > 0

    def submit(self, job, *events) -> None:
        """Run ``job()`` on the thread after the jobs before it, then set ``events`` (cleared here), also if
        it raised (its exception is in ``error`` by then). The first job starts the thread."""
        if self.stopping.is_set():
            raise RuntimeError(f"{self.name}: the worker thread was stopped")
        for event in events:
            event.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
            self._atexit = lambda ref=weakref.ref(self): ref() and ref()._stop_at_exit()
            atexit.register(self._atexit)
        with self._count:
            self._pending += 1
        self._jobs.put((job, events))

    def _serve(self):
        _C.serial_intra_op_here()  # no OpenMP team beside the trainer's (csrc/common.h says why)
        while (item := self._jobs.get()) is not None:
            job, events = item
            try:
                job()
            except BaseException as e:  # noqa: B902 (raised on the training thread by its owner)
                if self.error is None:
                    self.error = e
            with self._count:
                self._pending -= 1
            for event in events:
                event.set()
            del item, job, events  # hold nothing of the owner's while idle

    def take_error(self):
        """The kept exception, cleared (None if no job failed)."""
        error, self.error = self.error, None
        return error

    def stop(self, timeout: float = None, give_up=None) -> bool:
        """Set ``stopping`` and end the thread once the jobs submitted so far are done, waiting at most
        ``timeout`` seconds (None: as long as it takes), and no longer once ``give_up()`` (asked every
        POLL_S seconds; e.g. ``model.peer_failed``: the job may wait on a failed peer until the group's
        timeout). Returns whether the thread ended; if not, the exit hook waits for it again."""
        thread = self._thread
        if not self.stopping.is_set():
            self.stopping.set()
            self._jobs.put(None)
        if thread is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while thread.is_alive() and not (give_up is not None and give_up()):
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if wait <= 0:
                break
            thread.join(wait)
        if thread.is_alive():
            return False
        self._thread = None
        atexit.unregister(self._atexit)
        return True

    def abandon(self) -> None:
        """Leave the thread to itself (fault tolerance: it may wait in a collective with a lost peer, or with a
        survivor whose own thread failed, until that process ends or the group's timeout): its job is told to
        stop and nothing waits for it now. The exit hook still waits for it (at most ``exit_wait_s``), since
        its collective fails, and wakes it, as those peers exit: during interpreter finalization that would
        abort the process."""
        if not self.stopping.is_set():
            self.stopping.set()
            self._jobs.put(None)

    def _stop_at_exit(self):
        if not self.stop(runtime.exit_wait_s()):
            warnings.warn(f"{self.name}: its thread was still in a job at exit; it is a daemon and ends with "
                          f"the process")
