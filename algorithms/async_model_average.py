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
thread exits, so ranks may close at different times (a rank closing later trains locally). ``pause()`` /
``resume()`` (BAGUA's abort/resume) do the same around an evaluation, on every rank alike; after either,
``average_now()`` (collective) makes the replicas identical. A failed background collective (a dead peer,
a timeout) raises on the training thread at its next forward or step. How the thread writes the weights
and holds L: :mod:`._averaging_thread`. The averaging group is made with ``new_group``, so every rank of
the default group must build the model (the usual whole-world case).

Fault tolerance (``DistributedModel(..., fault_tolerant=True)``): the ranks share no step boundary, so a
lost peer is found before a forward (a survivor's thread raised and it said so in the store, or the lost
peer's heartbeat stood still), and that step is discarded. The survivors abandon their threads (a round in
flight never applies), average their weights once on the new group (dense: every replica and anchor equal
again) and start a new thread at their next step. Joiners ride in the go-on flag: every thread ends in the
same round, each member admits them at its next step boundary, a joiner starts from rank 0's weights and
optimizer state, and the members and joiners average their weights once, as after a loss.
"""
import torch.distributed as dist

from bagua_lite import _control, cost_model as cm
from bagua_lite._failfast import PeerFailedError
from bagua_lite._groups import group_timeout
from bagua_lite._options import int_at_least
from bagua_lite.algorithm import Algorithm, register
from bagua_lite.averaging import WeightAverager
from bagua_lite.compressors import get_compressor

from .parts.averaging_thread import AveragingThread, StepLock


@register("async_model_average")
class AsyncModelAverage(Algorithm):
    asynchronous = True
    #: fault tolerance: see the module docstring
    supports_membership_change = True
    #: the survivors' step counts differ (asynchronous), and a change is healed by an average, not by a step
    heals_itself = True
    #: members keep their own weights when a worker joins (the average that follows takes them all in)
    replicas_differ = True

    def __init__(self, sync_interval_ms: int = 500, warmup_steps: int = 0, compression: str = "none"):
        super().__init__()
        self.sync_interval_ms = int_at_least(self.name, "sync_interval_ms", sync_interval_ms, 1, " (milliseconds)")
        self.warmup_steps = int_at_least(self.name, "warmup_steps", warmup_steps, 0)
        get_compressor(compression, self.name)  # unknown names: ValueError listing the known ones
        self.compression = compression
        self.thread = None  # the averaging thread (made in init)
        self.paused = False
        self._step_lock = StepLock()  # L: optimizer.step() vs. the thread's snapshot / apply

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
        self._build(model)
        if model.membership is not None and model.membership.joining:  # a joiner, admitted: mirrors regroup()
            self._average_all()  # its thread starts once the step count came (load_shared_state_dict)
        elif self.warmup_steps == 0:
            self.thread.start()

    def _build(self, model, rounds: int = 0):
        """The averaging group, the averager and a thread not yet started."""
        ranks = dist.get_process_group_ranks(model.process_group)
        # collective: every rank creates it; the background thread's traffic never meets the model's group
        self.group = dist.new_group(ranks, backend="gloo", timeout=group_timeout(model.process_group))
        _control.setup(self.group, ranks)  # a no-op unless BAGUA_LITE_CONTROL_GROUP=side
        self._stop_wait_s = group_timeout(self.group).total_seconds() + self.sync_interval_ms / 1000 + 10
        # .data: average the storage without bumping autograd's version counters (see the docstring)
        self.averager = WeightAverager([p.data for p in model.params], self.compression, "async_model_average",
                                       aliased=model.params)
        joiners = model.membership.joiners_waiting if model.membership is not None else None
        self.thread = AveragingThread(self.averager, self.group, self.sync_interval_ms / 1000, self._step_lock,
                                      joiners, rounds)

    # ---- fault tolerance ------------------------------------------------------------------------------------
    def heal(self):
        """A lost peer, on the survivors' new group: nothing here; :meth:`regroup` averages them."""

    def regroup(self):
        """A membership change (a lost peer, or joiners admitted): the old thread abandoned (a round in flight
        never applies), a new group, averager and thread (started at the next step), and one dense average
        of every member's weights on the new group, so the replicas and the anchor are equal again."""
        old = self.thread
        old.abandon()
        self._build(self.model, old.rounds)
        self._average_all()

    def _average_all(self):
        self.model.run_collective(f"{self.name} average on a membership change",
                                  lambda: self.averager.average_dense(self.model.process_group))

    def peer_lost(self):
        """Before a local step's forward: the background averaging failed (a peer lost) is this step's news."""
        error = self.thread.worker.error
        if error is not None:
            raise PeerFailedError(f"async_model_average: the background averaging failed: "
                                  f"{type(error).__name__}: {error}") from error

    def shared_state_dict(self):
        return {"step": self.step, "paused": self.paused, "rounds": self.thread.rounds}

    def load_shared_state_dict(self, state):
        self.step, self.paused, self.thread.rounds = int(state["step"]), bool(state["paused"]), int(state["rounds"])

    @property
    def rounds(self) -> int:
        """Completed background averages (equal on all ranks)."""
        return 0 if self.thread is None else self.thread.rounds

    # ---- warm-up: dense gradient averaging, exactly as gradient_allreduce -----------------------------
    def sync_gradients(self):
        return self.step < self.warmup_steps

    def on_gradient(self, bucket, position, grad):
        self.fill(bucket, position, grad, 1.0 / self.world_size)  # the allreduce sums

    def bucket_ops(self, bucket):
        return [self.native.AllreduceOp(self.process_group, False)]

    # ---- the training thread ------------------------------------------------------------------------------
    def _check(self):
        self.model.check_peers()  # a peer's failure: its averaging thread would never answer ours
        error = self.thread.worker.error
        if error is not None:
            raise RuntimeError(f"async_model_average: the background averaging failed: "
                               f"{type(error).__name__}: {error}") from error

    def before_forward(self):
        self._step_lock.release()  # only if an optimizer step raised between its pre and post hooks
        if self.model.membership is None:  # else the model asked peer_lost() already, where a loss is healed
            self._check()

    def before_step(self):
        self._step_lock.hold()

    def after_step(self):
        self._step_lock.release()
        if self.model.membership is None:
            self._check()
        elif self.thread.admission:  # every rank's thread ended in the same round: admit at this boundary
            self.model.membership.admit_after_step()
            return
        if self.step == self.warmup_steps:
            self.averager.reset_anchor()  # replicas are identical at the end of warm-up
        if not self.paused and not self.thread.worker.started and self.step >= self.warmup_steps:
            self.thread.start()

    def pause(self):
        """On every rank (BAGUA's ``abort``), e.g. before an evaluation: the first rank to pause ends every
        rank's averaging in the same round (the threads stay paired); steps meanwhile are local."""
        self._check()
        self.paused = True
        self.thread.stop(self._stop_wait_s, self.model.peer_failed)

    def resume(self):
        """On every rank, after :meth:`pause`: averaging starts again (in a warm-up: when it ends)."""
        if self.paused:
            self._check()
            self.paused = False
            self.thread.restart()
            if self.step >= self.warmup_steps:
                self.thread.start()

    def close(self):
        """Stop the thread after its round in flight; its collective may wait on a failed rank, so not after
        a peer failed (the exit hook waits for it then, even though the peers are known to have failed).
        With fault tolerance, a rank whose thread ended to admit joiners first takes part in that admission
        (the other members wait for it at their next step boundary), then ends everyone's averaging."""
        self._step_lock.release()
        if self.model.membership is not None and self.thread.admission and not self.model.peer_failed():
            self.model.membership.admit_now()
            if not self.paused and self.step >= self.warmup_steps:
                self.thread.start()  # its first round says stop: the others' new threads end with it
        self.thread.stop(self._stop_wait_s, self.model.peer_failed)


    def average_now(self):
        """After ``close()`` or ``pause()`` on every rank (collective): every replica <- the average."""
        if self.thread.worker.busy:
            raise RuntimeError("async_model_average: average_now() needs close() or pause() first")
        self.averager.average(self.group)

    # ---- state ----------------------------------------------------------------------------------------------
    def state_dict(self):
        self._step_lock.release()  # (a failed step's) held step lock would block the round we wait for
        with self.thread.round_lock:
            return {"step": self.step, "averager": self.averager.state_dict()}

    def load_state_dict(self, state):
        self._step_lock.release()
        with self.thread.round_lock:
            self.step = int(state["step"])
            self.averager.load_state_dict(state.get("averager"))
