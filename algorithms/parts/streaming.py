"""Streaming DiLoCo's parts (Douillard et al., arXiv 2501.18512): the parameters split into fragments that
sync in turn, and one thread that runs a fragment's sync while training goes on.

The thread runs syncs in the order they were started, on a process group of its own (the model's group
stays the training thread's). Each sync first agrees on the step it started at (``bagua_lite.agreement``:
one MAX allreduce of two ints, on the thread, so no step waits for it); ranks that disagree skip the data
on every rank alike, and the merge then raises: a rank a step ahead would otherwise pair its fragment with
the others' and the replicas would silently differ.
"""
import threading

import torch

from bagua_lite import _control, agreement
from bagua_lite._worker import Worker


def split(params, fragments):
    """``fragments`` contiguous runs of ``params`` (the model's order) holding about equal numbers of
    elements, none empty (needs ``len(params) >= fragments``)."""
    total, runs, run, acc = sum(p.numel() for p in params), [], [], 0
    for i, p in enumerate(params):
        run.append(p)
        acc += p.numel()
        needed, left = fragments - len(runs) - 1, len(params) - i - 1
        if needed > 0 and (acc * fragments >= total * (len(runs) + 1) or left == needed):
            runs.append(run)
            run = []
    return runs + [run]


class Sync:
    """One fragment's sync in flight: ``done`` is set once the thread finished it (``error`` if it failed,
    ``steps`` the (lowest, highest) step the ranks started it at)."""

    def __init__(self, fn, step):
        self.fn, self.step = fn, step
        self.done, self.error, self.steps = threading.Event(), None, None

    def saved(self, work):
        """What a checkpoint keeps of a finished sync not merged yet (its result is in ``work``)."""
        return {"step": self.step, "steps": self.steps, "work": [w.clone() for w in work]}

    def wait(self, model, what):
        """Wait for the sync, failing fast (its collective may wait on a failed peer); raise, on every rank
        alike, if it failed or the ranks started it at different steps."""
        model.wait_for(self.done, self.step)  # a peer that closed after this step still finishes it
        if self.error is not None:
            model.fail(f"{what} failed: {self.error}")
            raise RuntimeError(f"{what} failed on rank {model.rank}: {self.error}") from self.error
        agreement.check(*self.steps, lambda: (
            f"{what}: ranks are out of step: they started it at steps {self.steps[0]} to {self.steps[1]} (this "
            f"rank ({model.rank}): {self.step}). Every rank must call optimizer.step() once per step, the same "
            f"number of times; nothing was averaged"))

    @classmethod
    def restored(cls, saved, work):
        job = cls(None, saved["step"])
        job.steps = tuple(saved["steps"])
        for w, s in zip(work, saved["work"]):
            w.copy_(s)
        job.done.set()
        return job


class Background:
    """The thread that runs syncs (``submit``) one after another on its own process group."""

    def __init__(self, model, name):
        self.group = model.new_group()  # collective: every rank builds it, in order
        self.worker = Worker(f"bagua_lite-{name}")
        self._steps = torch.zeros(2, dtype=torch.int64)

    def submit(self, fn, step) -> Sync:
        job = Sync(fn, step)
        self.worker.submit(lambda: self._run(job), job.done)
        return job

    def _run(self, job):
        try:
            agreement.post_max(agreement.encode(job.step, self._steps), _control.of(self.group))
            job.steps = agreement.span([self._steps])
            if job.steps[0] == job.steps[1]:  # every rank alike: all skip the data, or none
                job.fn(self.group)
        except BaseException as e:  # noqa: B902 (raised on the training thread by the merge)
            job.error = e

    def stop(self, give_up=None) -> bool:
        """End the thread once the syncs queued before are done (sooner if ``give_up()``)."""
        return self.worker.stop(None, give_up)
