"""Fail fast: a rank whose communication failed tells its peers, so none of them waits out the timeout.

gloo gives a waiting peer no error while the failed rank's process stays alive (the user caught the
exception, or went on to evaluation): it waits for the process group's timeout, 30 minutes by default,
and ``ProcessGroup.abort()`` does not close gloo's connections. So the failing rank writes one key into the
rendezvous store every rank already shares (torchrun's TCPStore, or the init_method's store), and a rank
waiting for its own buckets looks at that key every ``POLL_S`` seconds. The key is per
``DistributedModel`` (models are created in the same order on every rank), so a failure of one model
never affects another made later in the same job.
"""
import itertools
import time

import torch.distributed as dist

POLL_S = 0.5
_models = itertools.count()


class PeerFailedError(RuntimeError):
    """Another rank's communication failed; this rank stopped waiting for it."""


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group (a user-made group only): no fail-fast channel
        return None


class FailFast:
    def __init__(self, rank: int, key: str = None):
        self.rank = rank
        self.key = f"bagua_lite/failed/{next(_models)}" if key is None else key
        self.store = _default_store()
        self.failed = None  # set once this model's communication is known to be broken
        self._next_check = 0.0
        #: called at every poll of a wait (fault tolerance's heartbeat watch: raises PeerFailedError)
        self.watch = None
        #: the step whose communication this rank is in (set by the model; None: not watched, as under an
        #: asynchronous algorithm, whose ranks run different numbers of steps by design)
        self.step = None

    def announce(self, what: str) -> None:
        """This rank's communication failed: tell every peer (best effort; never raises)."""
        if self.failed is None:
            self.failed = f"rank {self.rank}: {what}"
        if self.store is not None:
            try:
                self.store.set(self.key, f"rank {self.rank}: {what}")
            except Exception:  # noqa: BLE001 - the store may be gone with the job
                pass

    def announce_closed(self, steps: int) -> None:
        """This rank closed its model after ``steps`` steps: a peer that waits in a later step's communication
        would wait for it until the group's timeout (uneven inputs), so it is told (best effort; the first
        rank to close is the one named)."""
        if self.store is None or self.failed is not None:
            return
        try:
            if self.store.add(self.key + "/closers", 1) == 1:
                self.store.set(self.key + "/closed", f"{self.rank} {steps}")
        except Exception:  # noqa: BLE001 - the store may be gone with the job
            pass

    def check_closed(self, step=None) -> None:
        """Raise :class:`PeerFailedError` if a peer closed this model before ``step`` (default: ``self.step``),
        whose communication it will then never join."""
        step = self.step if step is None else step
        if self.store is None or step is None:
            return
        try:
            if not self.store.check([self.key + "/closed"]):
                return
            rank, steps = (int(v) for v in self.store.get(self.key + "/closed").decode().split())
        except Exception:  # noqa: BLE001 - the store's host is gone: the collective will say more
            return
        if step <= steps:
            return  # that peer took part in this step: its communication completes
        self.failed = f"rank {rank} closed the model after {steps} steps"
        raise PeerFailedError(
            f"bagua_lite: rank {self.rank} stops waiting: rank {rank} closed this model after {steps} steps, and "
            f"this rank waits in step {step}'s communication, which rank {rank} will never join: the ranks ran "
            f"different numbers of steps (uneven inputs). Give every rank the same number of batches "
            f"(DistributedSampler pads every rank to the same count; an IterableDataset or a sampler of your own "
            f"must too), or stop every rank at the same step (an all_reduce of a 'done' flag before each step)")

    def raise_if_failed(self, consequence: str = "") -> None:
        """Refuse to go on once this model's communication is known to be broken (``consequence``: what
        that means for the caller, e.g. "nothing is applied")."""
        if self.failed is not None:
            raise RuntimeError(f"bagua_lite: this model's communication failed earlier ({self.failed})"
                               + (f"; {consequence}" if consequence else ""))

    def check(self) -> None:
        """Raise :class:`PeerFailedError` if any rank announced a failure."""
        if self.store is None:
            return
        try:
            if not self.store.check([self.key]):
                return
            text = self.store.get(self.key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store's host is gone: the collective will say more
            return
        self.failed = text
        raise PeerFailedError(f"bagua_lite: rank {self.rank} stops waiting: a peer's communication failed "
                              f"({text}). Every rank of this model raises; restart from the last checkpoint")

    def wait_engine(self, engine) -> None:
        """``engine.wait_all()``, looking for a peer's failure every POLL_S seconds."""
        while not engine.wait_all_for(POLL_S):
            self.check()
            self.check_closed()
            if self.watch is not None:
                self.watch()

    def peer_failed(self) -> bool:
        """Whether this model is known to be failed (here or on a peer), without raising."""
        try:
            self.check()
        except PeerFailedError:
            pass
        return self.failed is not None

    def check_every(self, seconds: float = POLL_S) -> None:
        """:meth:`check`, at most once per ``seconds`` (for a loop that polls between its own work)."""
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + seconds
            self.check()

    def wait_event(self, event, step=None) -> None:
        """``event.wait()`` for an algorithm's own thread, looking for a peer's failure every POLL_S seconds
        (the thread may sit in a collective with the failed rank until the group's timeout); ``step``: the
        step the awaited work was started in (default: the one this rank is in)."""
        while not event.wait(POLL_S):
            self.check()
            self.check_closed(step)
            if self.watch is not None:
                self.watch()
