"""The peer exchange shared by ``decentralized`` (exact D-PSGD) and ``low_precision_decentralized``
(compressed gossip). A subclass says what travels (``_start``) and what it changes (``_apply``):

    forward starts:   send the step count, then _start(): post this exchange's messages  (non-blocking)
    after the step:   wait for them (fail fast), check every peer started at this step, _apply(peers)

Peers: ``ring`` (both neighbours), ``ring_one_way`` (send to the right, receive from the left), ``shift_one``
(one partner that rotates each exchange; odd P: one rank sits out), ``all`` (everyone, by collectives).
"""
import atexit
import queue
import threading
import weakref

import torch
import torch.distributed as dist

from bagua_lite import _C, cost_model as cm, runtime
from bagua_lite._groups import new_group_like
from bagua_lite.algorithm import Algorithm
from bagua_lite.bucket import FlatWeights

PEER_SELECTIONS = ("ring", "ring_one_way", "shift_one", "all")
STEP_TAG = 1 << 24  # p2p tag of the step count that travels with each exchange (data tags are indices)


def degree(peer_selection, P):
    """How many peers a rank hears from in one exchange (on P >= 2; shift_one: its one partner)."""
    return P - 1 if peer_selection == "all" else 2 if peer_selection == "ring" and P >= 3 else 1


def traffic(o, P, n, unit, collective, local_s=0.0, thread_s=0.0, first_s=0.0):
    """The cost model's view (a ``cost_model.Traffic``) of an exchange of n elements every
    communication_interval steps, overlapped with the step: ``unit`` bytes to each peer, or under ``all``
    the ``collective``'s (bytes, latency terms, critical-path bytes)."""
    mode, peers = o["peer_selection"], degree(o["peer_selection"], P)
    exchange = (0, 0, 0) if P <= 1 or n <= 0 else collective if mode == "all" else (peers * unit, 1, peers * unit)
    return cm.Traffic("with_step", exchange=exchange, local_s=local_s, thread_s=thread_s, first_s=first_s,
                      every=o["communication_interval"], messages=0 if mode == "all" else peers)


class Gossip(Algorithm):
    def __init__(self, peer_selection: str, communication_interval: int, consensus_step: float):
        super().__init__()
        if peer_selection not in PEER_SELECTIONS:
            raise ValueError(f"{self.name}: peer_selection={peer_selection!r} is not allowed; "
                             f"choose one of {', '.join(PEER_SELECTIONS)}")
        if communication_interval < 1:
            raise ValueError(f"{self.name}: communication_interval must be >= 1, got {communication_interval}")
        if not 0 < consensus_step <= 1:
            raise ValueError(f"{self.name}: consensus_step (CHOCO's gamma) must be in (0, 1], got {consensus_step}")
        self.peer_selection, self.communication_interval = peer_selection, communication_interval
        self.consensus_step, self.exchanges = float(consensus_step), 0
        self._works, self._step_works, self._thread, self._error = None, [], None, None
        self._jobs, self._packed, self._done = queue.Queue(), threading.Event(), threading.Event()  # (the thread's)

    @property
    def cycle(self):
        return self.communication_interval

    def sync_gradients(self):
        return False

    def init(self, model):
        self.weights = FlatWeights(model.params)
        # Our traffic only, and one group per direction: a TCP connection that carries bulk data both ways
        # queues each side's acknowledgements behind its data and halves the rate (measured: a 100 MB
        # swap over an emulated 1 Gbit/s link takes 1.67 s on one connection, 0.84 s on two).
        self.group = new_group_like(model.process_group)  # lower -> higher rank (and all's collectives)
        self.down = new_group_like(model.process_group)   # higher -> lower rank
        P, me = model.world_size, model.rank
        # fixed neighbours as (send to, receive from); one neighbour at P = 2, none at P = 1
        both = sorted({(me - 1) % P, (me + 1) % P} - {me})
        one_way = ([(me + 1) % P], [(me - 1) % P]) if P > 1 else ([], [])
        self.fixed = one_way if self.peer_selection == "ring_one_way" else (both, both)
        self.snap = self.weights.gather()  # one flat buffer per dtype, refilled in place by gather()
        self._step_out = torch.zeros(2, dtype=torch.int64)
        self._step_in = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]

    def _peers(self):
        """(ranks this rank sends to, ranks it receives from) in this exchange."""
        if self.peer_selection == "shift_one":
            partner = _C.shift_one_partner(self.model.rank, self.world_size, self.exchanges)
            return ([partner], [partner]) if partner >= 0 else ([], [])
        return self.fixed

    def _post(self, t, recv, tag, counted=True):
        """Send t to this exchange's peers and receive theirs into recv (one direction per group)."""
        me, (to, frm), works = self.model.rank, self._peers(), []
        for peer in to:
            works.append((self.group if me < peer else self.down).send([t], peer, tag))
            if counted:
                _C.count_sent(t.nbytes, 1)
        for buf, peer in zip(recv, frm):
            works.append((self.group if peer < me else self.down).recv([buf], peer, tag))
        return works

    # ---- one exchange: started when forward starts, applied after the optimizer step ----------------------
    def before_forward(self):
        if self._works is not None or not torch.is_grad_enabled() or self.world_size == 1 \
                or (self.step + 1) % self.communication_interval:
            return
        # the step count goes first, before any data (on any thread): the same order on every rank
        self._step_out[0], self._step_out[1] = self.step, -self.step
        if self.peer_selection == "all":  # max of (step, -step): the range of every rank's step
            self._step_in[0].copy_(self._step_out)
            self._step_works = [dist.all_reduce(self._step_in[0], op=dist.ReduceOp.MAX, group=self.group,
                                                async_op=True)]
        else:  # 16 bytes per peer, not counted as traffic
            self._step_works = self._post(self._step_out, self._step_in, STEP_TAG, counted=False)
        self._works = self._start()

    def after_step(self):
        if self._works is None:
            return
        if self._thread is not None:
            self._wait(self._done)
        works, self._works = self._works + self._step_works, None
        self.model.run_collective(f"{self.name} exchange", lambda: [w.wait() for w in works])
        peers = self._peers()[1]
        self._check_steps(peers)
        self.exchanges += 1
        with torch.no_grad():
            self._apply(peers)

    def _check_steps(self, frm):
        """Did every peer start this exchange at this rank's step? (A rank that took a step more or fewer
        would otherwise average with its peers' weights of another step from now on, silently.)"""
        mine = int(self._step_out[0])
        if self.peer_selection == "all":
            hi, lo = int(self._step_in[0][0]), -int(self._step_in[0][1])
            theirs = [] if hi == lo else [f"step counts from {lo} to {hi} across ranks"]
        else:
            theirs = [f"rank {peer} at step {int(t[0])}" for peer, t in zip(frm, self._step_in) if int(t[0]) != mine]
        if theirs:
            raise RuntimeError(f"{self.name}: ranks are out of step at a weight exchange: this rank "
                               f"({self.model.rank}) is at step {mine}, {'; '.join(theirs)}. Every rank must call "
                               f"optimizer.step() once per step, the same number of times; nothing was averaged")

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
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="bagua_lite-decentralized", daemon=True)
            self._thread.start()
            # At exit the thread must not sit in a collective: one that fails as the peers exit would wake it
            # during interpreter finalization and abort the process. End it after its exchange.
            self._atexit = lambda ref=weakref.ref(self): ref() and ref()._end_thread(runtime.exit_wait_s())
            atexit.register(self._atexit)
        self._packed.clear()
        self._done.clear()
        self._jobs.put(job)
        return []  # in flight (on the thread)

    def _serve(self):
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except BaseException as e:  # noqa: B902 (raised on the training thread by _wait)
                self._error = e
            self._packed.set()
            self._done.set()

    def _wait(self, event):
        """Wait for the thread with fail fast (it may wait on a failed peer); raise its error, told to the peers."""
        if self._works is None:
            return
        self.model.wait_for(event)
        if self._error is not None:
            error, self._error, self._works = self._error, None, None
            self.model.fail(f"{self.name}: the weight exchange failed: {error}")
            raise RuntimeError(f"{self.name}: the weight exchange failed on rank {self.model.rank}: {error}") from error

    def _end_thread(self, timeout=None):
        """Stop the exchange thread once its exchange in flight, if any, is done (at most ``timeout`` s)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            atexit.unregister(self._atexit)
            self._jobs.put(None)
            thread.join(timeout)

    def close(self):
        if self.model.peer_failed():  # nobody will answer: the (daemon) thread stays until its exchange
            self._works = None        # fails; the exit hook registered with it waits for that
            return
        self._end_thread()  # it ends once its exchange in flight, if any, is done
        if self._works is not None:  # an exchange in flight: finish it so peers are not left waiting
            for w in self._works + self._step_works:
                w.wait()
            self._works = None

    def state_dict(self):
        return {**super().state_dict(), "exchanges": self.exchanges}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.exchanges = int(state["exchanges"])
