"""The peer exchange shared by ``decentralized`` (exact D-PSGD) and ``low_precision_decentralized``
(compressed gossip). A subclass says what travels (``_start``) and what it changes (``_apply``):

    forward starts:   send the step count, then _start(): post this exchange's messages  (non-blocking)
    after the step:   wait for them (fail fast), check every peer started at this step, _apply(peers)

The step count is ``bagua_lite.agreement``'s (step, -step) pair: in one MAX allreduce under ``all``, else a
16-byte message to each peer posted ahead of the data (point to point, there is no collective to ride in).

Who the peers are and how a message reaches them: ``parts.peers.Peers``.
"""
import threading

import torch

from bagua_lite import _control, agreement
from bagua_lite._options import int_at_least, within
from bagua_lite._worker import Worker
from bagua_lite.algorithm import Algorithm
from bagua_lite.bucket import FlatWeights

from .peers import Peers, check_selection

STEP_TAG = 1 << 24  # p2p tag of the step count that travels with each exchange (data tags are indices)


class Gossip(Algorithm):
    def __init__(self, peer_selection: str, communication_interval: int, consensus_step: float):
        super().__init__()
        self.peer_selection = check_selection(self.name, peer_selection)
        self.communication_interval = int_at_least(self.name, "communication_interval", communication_interval, 1)
        self.consensus_step = float(within(self.name, "consensus_step", consensus_step, "(0, 1]", " (CHOCO's gamma)"))
        self.exchanges, self._works, self._step_works = 0, None, []
        # an exchange on a thread of its own (low_precision_decentralized's): _in_background
        self._worker = Worker("bagua_lite-decentralized")
        self._packed, self._done = threading.Event(), threading.Event()

    @property
    def cycle(self):
        return self.communication_interval

    def sync_gradients(self):
        return False

    def init(self, model):
        self.weights = FlatWeights(model.params)
        self.peers = Peers(model, self.peer_selection)
        self.snap = self.weights.gather()  # one flat buffer per dtype, refilled in place by gather()
        self._step_out = torch.zeros(2, dtype=torch.int64)
        self._step_in = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]

    def _post(self, t, recv, tag, counted=True, control=False):
        """Send t to this exchange's peers and receive theirs into recv (see ``Peers.post``)."""
        return self.peers.post(t, recv, tag, self.exchanges, counted, control)

    def _receive_buffers(self):
        """What this rank receives into (made in ``init`` and again when the ring re-forms)."""

    # ---- fault tolerance (DistributedModel(..., fault_tolerant=True)) ---------------------------------------
    supports_membership_change = True
    #: a lost peer is healed by :meth:`heal` (survivors may be up to the exchange in flight apart)
    heals_itself = True
    replicas_differ = True

    @property
    def store_admission_margin(self):
        # a rank gets at most one exchange ahead of each neighbour, so at most P/2 exchanges ahead of rank 0
        # (shift_one's partners: P - 1); and one more step before it reads the store
        return self.communication_interval * (self.world_size + 2)

    def heal(self):
        """After a lost peer, on the survivors' new group (a collective). The exchange in flight is dropped
        where it had not completed (a survivor that completed it keeps its average: replicas differ by design,
        so nothing is rolled back), and every survivor takes the furthest survivor's step and exchange counts
        (one behind skips its missing local steps), so their exchanges pair up again."""
        self._drop_exchange()
        rows = self.model.membership.gather_ints([self.step, self.exchanges])
        self.step, self.exchanges = max(r[0] for r in rows), max(r[1] for r in rows)

    def regroup(self):
        """The ring re-forms over the new group: peers and their process groups made again."""
        self._drop_exchange()
        self.peers = Peers(self.model, self.peer_selection)
        self._receive_buffers()

    def _drop_exchange(self):
        """Forget the exchange in flight (its peer may be gone); one on a thread is abandoned there."""
        self._works, self._step_works = None, []

    def shared_state_dict(self):
        return {**super().shared_state_dict(), "exchanges": self.exchanges}

    def load_shared_state_dict(self, state):
        super().load_shared_state_dict(state)
        self.exchanges = int(state["exchanges"])

    # ---- one exchange: started when forward starts, applied after the optimizer step ----------------------
    def before_forward(self):
        if self.model.membership is not None and self.model.membership.changing:
            return  # a discarded step (a peer was lost): it exchanges nothing
        if self._works is not None or not torch.is_grad_enabled() or self.world_size == 1 \
                or (self.step + 1) % self.communication_interval:
            return
        # the step count goes first, before any data (on any thread): the same order on every rank
        agreement.encode(self.step, self._step_out)
        if self.peer_selection == "all":  # one MAX allreduce: the range of every rank's step
            self._step_in[0].copy_(self._step_out)
            self._step_works = [agreement.post_max(self._step_in[0], _control.of(self.peers.group), async_op=True)]
        else:  # 16 bytes per peer, not counted as traffic
            self._step_works = self._post(self._step_out, self._step_in, STEP_TAG, counted=False, control=True)
        self._works = self._start()

    def after_step(self):
        if self._works is None:
            return
        if self._worker.started:
            self._wait(self._done)
        works, self._works = self._works + self._step_works, None
        self.model.run_collective(f"{self.name} exchange", lambda: [w.wait() for w in works])
        peers = self.peers.of(self.exchanges)[1]
        self._check_steps(peers)
        self.exchanges += 1
        with torch.no_grad():
            self._apply(peers)

    def _check_steps(self, frm):
        """Did every peer start this exchange at this rank's step? (A rank that took a step more or fewer
        would otherwise average with its peers' weights of another step from now on, silently.)"""
        mine, received = int(self._step_out[0]), self._step_in[:1] if self.peer_selection == "all" else \
            self._step_in[:len(frm)]
        lo, hi = agreement.span([self._step_out] + received)
        if self.peer_selection == "all":
            theirs = [f"step counts from {lo} to {hi} across ranks"]
        else:
            theirs = [f"rank {peer} at step {int(t[0])}" for peer, t in zip(frm, received) if int(t[0]) != mine]
        agreement.check(lo, hi, lambda: (
            f"{self.name}: ranks are out of step at a weight exchange: this rank ({self.model.rank}) is at step "
            f"{mine}, {'; '.join(theirs)}. Every rank must call optimizer.step() once per step, the same number "
            f"of times; nothing was averaged"))

    def _add(self, deltas):
        """Parameters += scale * delta, for one (delta, scale) per flat group (delta None: left as they are)."""
        for (group, _), (delta, scale) in zip(self.weights.groups, deltas):
            o = 0
            for p in group if delta is not None else ():
                p.add_(delta[o:o + p.numel()].view_as(p), alpha=scale)
                o += p.numel()

    # ---- an exchange on a thread of its own (low_precision_decentralized's) -----------------------------
    def _in_background(self, job):
        """Run job() on the exchange thread; it sets self._packed once done reading the weights (or ends)."""
        self._worker.submit(job, self._packed, self._done)
        return []  # in flight (on the thread)

    def _wait(self, event):
        """Wait for the thread with fail fast (it may wait on a failed peer); raise its error, told to the peers."""
        if self._works is None:
            return
        self.model.wait_for(event)
        error = self._worker.take_error()
        if error is not None:
            self._works = None
            self.model.fail(f"{self.name}: the weight exchange failed: {error}")
            raise RuntimeError(f"{self.name}: the weight exchange failed on rank {self.model.rank}: {error}") from error

    def close(self):
        if self.model.peer_failed():  # nobody will answer: the (daemon) thread stays until its exchange
            self._works = None        # fails; its exit hook waits for that
            return
        self._worker.stop()  # it ends once its exchange in flight, if any, is done
        if self._works is not None:  # an exchange in flight: finish it so peers are not left waiting
            for w in self._works + self._step_works:
                w.wait()
            self._works = None

    def state_dict(self):
        return {**super().state_dict(), "exchanges": self.exchanges}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.exchanges = int(state["exchanges"])
