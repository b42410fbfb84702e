"""``async_model_average``'s background thread: every ``interval_s``, on a process group of its own, the
ranks agree whether to go on (a MIN of one flag: 0 once a rank is stopping), then each takes a snapshot
of its weights under L, averages it over the ranks without L (training goes on) and applies the average
under L as x + (avg - snapshot), keeping the local steps taken meanwhile (the loop of that module's
docstring). L (:class:`StepLock`) is held by the training thread across each ``optimizer.step()``.
``rounds`` counts completed averages (equal on all ranks); a failed round's exception is ``worker.error``.
With ``fault_tolerant=True`` the go-on flag also carries rank 0's count of workers waiting to join (a MIN of
``[go_on, -waiting]``): every rank's thread ends in the same round (``admission``) and each training thread
admits them at its next step boundary; after a lost peer the thread is ``abandon``ed (it may sit in a
collective with the lost peer until the old group's timeout) and never writes the weights again.
The average writes the weights' storage directly (not through autograd), so one landing between a forward
and its backward is no autograd error; that backward uses partly averaged weights, as in BAGUA. A step that
raises leaves L held until the next forward (or close) releases it.
"""
import threading
import warnings

import torch
import torch.distributed as dist

from bagua_lite import _control
from bagua_lite._worker import Worker


class StepLock:
    """L: held by the training thread from ``hold()`` (before an optimizer step) to ``release()`` (after it;
    again harmless), taken by the thread with ``with``. A step that raises leaves it held until the next
    ``release()``, from the next forward or close."""

    def __init__(self):
        self._lock, self._held = threading.Lock(), False  # _held: only the training thread reads or writes it

    def hold(self):
        if not self._held:  # a step that raised left it held: keep it
            self._lock.acquire()
            self._held = True

    def release(self):
        if self._held:
            self._held = False
            self._lock.release()

    def __enter__(self):
        self._lock.acquire()

    def __exit__(self, *exc):
        self._lock.release()


class AveragingThread:
    def __init__(self, averager, group, interval_s: float, step_lock: StepLock, joiners=None, rounds: int = 0):
        self.averager, self.group, self.interval_s, self.step_lock = averager, group, interval_s, step_lock
        self.joiners = joiners  # rank 0 with fault tolerance: how many workers wait to join (else None)
        self.rounds = rounds
        self.admission = False  # the threads ended so that the members admit the workers waiting to join
        self.abandoned = False  # set under the step lock: a round still in flight never applies
        self.round_lock = threading.Lock()  # a whole round vs. state_dict / load_state_dict
        self.worker = Worker("async_model_average")

    def start(self):
        self.worker.submit(self._run)

    def stop(self, wait_s: float, give_up) -> None:
        """End the thread after its round in flight, waiting at most ``wait_s`` seconds and no longer once
        ``give_up()`` (a failed peer: its collective may wait until the group's timeout)."""
        gave_up = []

        def asked():
            gave_up[:] = [give_up()]
            return gave_up[0]
        if not self.worker.stop(wait_s, give_up=asked):
            why = "a peer's communication failed or it was lost" if gave_up and gave_up[0] else \
                f"it did not stop within {wait_s:.0f}s"
            warnings.warn(f"async_model_average: left the background averaging thread behind ({why}); "
                          f"it is a daemon and ends with the process")

    def restart(self):
        """A new, not yet started thread after the last one stopped (pause, then resume); ``rounds`` and
        an error kept from the old one carry over."""
        if self.worker.busy:
            raise RuntimeError("async_model_average: the averaging thread is still running")
        error, self.worker = self.worker.error, Worker(self.worker.name)
        self.worker.error = error

    def abandon(self):
        """After a lost peer (fault tolerance): this thread never writes the weights again and ends at its next
        look (its collective, on a destroyed group, may wait for the lost peer until that group's timeout).
        The exit hook waits for it (``Worker.abandon``)."""
        self.step_lock.release()  # held by the training thread if a step raised: take it below, never block
        with self.step_lock:
            self.abandoned = True
        self.worker.abandon()  # sets stopping, which wakes its wait between rounds

    def _run(self):
        flag, stopping = torch.ones(2, dtype=torch.int32), self.worker.stopping
        while True:
            stopping.wait(self.interval_s)  # stop() wakes it
            if self.abandoned:
                return
            flag[0] = 0 if stopping.is_set() else 1
            flag[1] = -self.joiners() if self.joiners is not None else 0
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_control.of(self.group))
            if int(flag[0]) == 0:
                return
            if int(flag[1]) < 0:  # the same round on every rank: each admits at its next step boundary
                self.admission = True
                return
            with self.round_lock:
                with self.step_lock:
                    if self.abandoned:
                        return
                    self.averager.snapshot()
                self.averager.reduce(self.group)
                with self.step_lock:
                    if self.abandoned:  # the survivors re-formed meanwhile: their average replaces this one
                        return
                    self.averager.apply(delta=True)
                self.rounds += 1
