"""Asynchronous model averaging (BAGUA, Gan et al. 2021): every rank trains without waiting for the
others, while a background thread averages the weights over all ranks every ``sync_interval_ms``.

    step < warmup_steps:  gradients averaged every step (as gradient_allreduce); then start the thread
    training thread:      x <- x - lr * local grad                         (optimizer.step() under L)
    background thread, on a process group of its own, every sync_interval_ms:
        go_on <- MIN over ranks of (0 if this rank is closing else 1)      (all agree on the last round)
        if not go_on: exit
        with L: s <- x                                                     (snapshot)
        avg <- mean over ranks of s                                        (no lock: training goes on)
        with L: x <- x + (avg - s)                                         (keeps the local steps taken meanwhile)

``compression``: ``none`` averages the weights; any registered compressor averages each rank's change
since the last average instead, with error feedback (see :mod:`bagua_lite.averaging`).

Stopping: ``DistributedModel.close()`` on a rank makes its next flag 0; in that round every rank's
thread sees 0 and exits, so ranks may close at different times (a rank closing later finds its thread
already gone; its remaining steps are purely local). ``rounds`` counts completed averages (equal on all
ranks). If the background collective fails (a dead peer, a timeout), the training thread raises a
RuntimeError at its next forward or step. After ``close()`` on every rank, ``average_now()`` (collective)
makes the replicas identical. The averaging writes the weights' storage directly (not through autograd),
so an average landing between a forward and its backward is not an autograd error; that backward then
uses partly averaged weights, as in BAGUA. L is taken by optimizer step pre/post hooks; a step that
raises leaves it held until the next forward (or close) releases it. The averaging group is made with
``new_group``, so every rank of the default group must build the model (the usual whole-world case).
"""
import atexit
import threading
import time
import warnings
import weakref

import torch
import torch.distributed as dist

from bagua_lite import cost_model as cm, runtime
from bagua_lite._failfast import POLL_S
from bagua_lite._groups import group_timeout
from bagua_lite.algorithm import Algorithm, register
from bagua_lite.averaging import WeightAverager
from bagua_lite.compressors import get_compressor


@register("async_model_average")
class AsyncModelAverage(Algorithm):
    asynchronous = True

    def __init__(self, sync_interval_ms: int = 500, warmup_steps: int = 0, compression: str = "none"):
        super().__init__()
        if not isinstance(sync_interval_ms, int) or isinstance(sync_interval_ms, bool) or sync_interval_ms < 1:
            raise ValueError(f"async_model_average: sync_interval_ms must be an integer >= 1 (milliseconds), "
                             f"got {sync_interval_ms!r}")
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
            raise ValueError(f"async_model_average: warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        get_compressor(compression, "async_model_average")  # unknown names: ValueError listing the known ones
        self.sync_interval_ms, self.warmup_steps, self.compression = sync_interval_ms, warmup_steps, compression
        self.rounds, self.error = 0, None  # completed background averages; the thread's exception
        self._thread, self._closing = None, False
        self._wake = threading.Event()
        self._lock = threading.Lock()  # optimizer.step() vs. snapshot / apply
        self._round = threading.Lock()  # a whole round vs. state_dict / load_state_dict
        self._step_locked = False      # the training thread holds _lock (only it reads or writes this)

    @classmethod
    def traffic(cls, o, P, numels, elem_bytes=4, machine=None, rank=None):
        """After the warm-up: a background weight average every sync_interval_ms plus its own length, and
        the go-on flag's allreduce; local: snapshot, copy, apply as x + avg - snapshot (2 passes)."""
        n, c = sum(numels), o["compression"]
        local = cm.weight_average_s(c, P, n, machine, apply_passes=2) if machine is not None else 0.0
        return cm.Traffic("background", exchange=cm.weight_average(c, P, n, elem_bytes, None), local_s=local,
                          interval_s=o["sync_interval_ms"] / 1000.0, extra_latencies=2 * (P - 1), warmup=True)

    @property
    def step_dependent_wire(self):
        return self.warmup_steps > 0  # what travels changes when the warm-up ends

    def init(self, model):
        ranks = dist.get_process_group_ranks(model.process_group)
        # collective: every rank creates it; the background thread's traffic never meets the model's group
        self.group = dist.new_group(ranks, backend="gloo", timeout=group_timeout(model.process_group))
        self._timeout_s = group_timeout(self.group).total_seconds()
        # .data: average the storage without bumping autograd's version counters (see the docstring)
        self.averager = WeightAverager([p.data for p in model.params], self.compression, "async_model_average")
        # At exit the thread must not be inside its collective when the interpreter finalizes (it would wake
        # there and abort the process): wait for it even after a peer failed (it fails as the peers exit).
        self._atexit = lambda ref=weakref.ref(self): ref() and ref()._stop(runtime.exit_wait_s(), at_exit=True)
        atexit.register(self._atexit)
        if self.warmup_steps == 0:
            self._start()

    # ---- warm-up: dense gradient averaging, exactly as gradient_allreduce -----------------------------
    def sync_gradients(self):
        return self.step < self.warmup_steps

    def on_gradient(self, bucket, position, grad):
        self.fill(bucket, position, grad, 1.0 / self.world_size)  # the allreduce sums

    def bucket_ops(self, bucket):
        return [self.native.AllreduceOp(self.process_group, False)]

    # ---- the training thread ------------------------------------------------------------------------------
    def _lock_step(self):
        if not self._step_locked:  # a step that raised left it held: keep it
            self._lock.acquire()
            self._step_locked = True

    def _unlock_step(self):
        if self._step_locked:
            self._step_locked = False
            self._lock.release()

    def _check(self):
        self.model.check_peers()  # a peer's failure: its averaging thread would never answer ours
        if self.error is not None:
            raise RuntimeError(f"async_model_average: the background averaging failed: "
                               f"{type(self.error).__name__}: {self.error}") from self.error

    def before_forward(self):
        self._unlock_step()  # only if an optimizer step raised between its pre and post hooks
        self._check()

    def before_step(self):
        self._lock_step()

    def after_step(self):
        self._unlock_step()
        self._check()
        if self._thread is None and not self._closing and self.step >= self.warmup_steps:
            if self.step == self.warmup_steps:
                self.averager.reset_anchor()  # replicas are identical at the end of warm-up
            self._start()

    # ---- the background thread ----------------------------------------------------------------------------
    def _start(self):
        self._thread = threading.Thread(target=self._run, name="async_model_average", daemon=True)
        self._thread.start()

    def _run(self):
        flag = torch.ones(1, dtype=torch.int32)
        try:
            while True:
                self._wake.wait(self.sync_interval_ms / 1000)
                flag.fill_(0 if self._closing else 1)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
                if int(flag) == 0:
                    return
                with self._round:
                    with self._lock:
                        self.averager.snapshot()
                    self.averager.reduce(self.group)
                    with self._lock:
                        self.averager.apply(delta=True)
                    self.rounds += 1
        except Exception as e:  # noqa: BLE001  (reported to the training thread)
            self.error = e

    def _stop(self, join_timeout_s, at_exit=False):
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            deadline, failed = time.monotonic() + join_timeout_s, False
            while self._thread.is_alive() and time.monotonic() < deadline and (at_exit or not failed):
                self._thread.join(POLL_S)
                # its collective may wait on a failed rank: do not wait out the group's timeout
                failed = self.model is not None and self.model.peer_failed()
            if self._thread.is_alive():
                why = "a rank's communication failed" if failed else f"it did not stop within {join_timeout_s:.0f}s"
                warnings.warn(f"async_model_average: left the background averaging thread behind ({why}); "
                              f"it is a daemon and ends with the process")

    def close(self):
        self._unlock_step()
        self._stop(join_timeout_s=self._timeout_s + self.sync_interval_ms / 1000 + 10)
        if self._thread is None or not self._thread.is_alive():  # else the exit hook waits for it again
            atexit.unregister(self._atexit)

    def average_now(self):
        """After ``close()`` on every rank (collective): every replica <- the average (compressed if set)."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("async_model_average: average_now() needs close() first (the thread still runs)")
        self.averager.average(self.group)

    # ---- state ----------------------------------------------------------------------------------------------
    def state_dict(self):
        self._unlock_step()  # (a failed step's) held step lock would block the round we wait for
        with self._round:
            return {"step": self.step, "averager": self.averager.state_dict()}

    def load_state_dict(self, state):
        self._unlock_step()
        with self._round:
            self.step = int(state["step"])
            self.averager.load_state_dict(state.get("averager"))
