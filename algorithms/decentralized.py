"""Decentralized SGD (D-PSGD, Lian et al. 2017): each rank averages its weights with its peers instead of
averaging gradients with everyone, and the exchange overlaps with the step's compute (as BAGUA does):

    forward starts:   send x_t to the peers                            (non-blocking)
    backward, step:   x' <- x_t - lr * update(grad f(x_t))            (the user's optimizer, local)
    after the step:   x_{t+1} <- x' + (W x_t - x_t)  =  W x_t - lr * update

W: ``ring`` (both neighbours, 1/3 each), ``ring_one_way`` (send to the right neighbour, receive from the
left, 1/2 each: W = (I + shift) / 2 is doubly stochastic, so the mean is kept, at half the bytes and
decompression work of ``ring``), ``shift_one`` (one partner that rotates each exchange, 1/2 each; odd P:
one rank sits out), ``all`` (everyone). Every ``communication_interval`` steps; in between the
steps are purely local. Replicas differ by design; under ``ring`` their spread shrinks geometrically.

``compression`` (any registered compressor, e.g. ``minmax_uint8``) sends compressed weight *differences*
with error compensation instead of weights (CHOCO-gossip, Koloskova et al. 2019; the scheme of BAGUA's
low-precision decentralized SGD). Every rank keeps x_hat, the copy of its weights its peers know, and
the sum of the copies it receives (neighbours must be fixed: ``ring``, ``ring_one_way`` or ``all``):

    forward starts:   q_i <- C(x_t - x_hat_i), send q_i to the neighbours
    after the step:   x_hat_j <- x_hat_j + D(q_j) for i and every neighbour j
                      x_{t+1} <- x' + gamma * (mean over i and neighbours of x_hat  -  x_hat_i)

What compression loses stays in x_t - x_hat_i and is sent again next time: nothing is forgotten.
The compressed exchange runs on a background thread while forward and backward run: it compresses chunk
by chunk (each chunk goes on the wire as soon as it is packed), folds the received copies in as they
arrive, and leaves the training thread one pass, x' + delta, after the step. The optimizer step waits for
the packing only (it reads x_t), never for the transfer.
"""
import queue
import threading

import torch
import torch.distributed as dist

from bagua_lite import _C, compressors
from bagua_lite._groups import new_group_like
from bagua_lite.algorithm import Algorithm, register
from bagua_lite.bucket import FlatWeights

PEER_SELECTIONS = ("ring", "ring_one_way", "shift_one", "all")
# elements per compressed message: the wire starts once the (smaller) first chunk is packed
FIRST_CHUNK, CHUNK = 1 << 20, 1 << 22
STEP_TAG = 1 << 24  # p2p tag of the step count that travels with each exchange (data tags are indices)


@register("decentralized")
class Decentralized(Algorithm):
    def __init__(self, peer_selection: str = "ring", communication_interval: int = 1, compression: str = "none",
                 consensus_step: float = 1.0):
        super().__init__()
        if peer_selection not in PEER_SELECTIONS:
            raise ValueError(f"{self.name}: peer_selection={peer_selection!r} is not allowed; "
                             f"choose one of {', '.join(PEER_SELECTIONS)}")
        if communication_interval < 1:
            raise ValueError(f"{self.name}: communication_interval must be >= 1, got {communication_interval}")
        self.compressor = compressors.get_compressor(compression, self.name)
        if self.compressor is not None and peer_selection == "shift_one":
            raise ValueError(f"{self.name}: compression={compression!r} needs fixed neighbours (each keeps a copy "
                             f"of what the others know); use peer_selection 'ring', 'ring_one_way' or 'all', not 'shift_one'")
        if not 0 < consensus_step <= 1:
            raise ValueError(f"{self.name}: consensus_step (CHOCO's gamma) must be in (0, 1], got {consensus_step}")
        self.peer_selection = peer_selection
        self.communication_interval = communication_interval
        self.consensus_step = float(consensus_step)
        self.exchanges = 0
        self._works = None

    @property
    def cycle(self):
        return self.communication_interval

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
        self.snap = self.weights.gather()  # refilled in place by gather(): x_t, or x_t - x_hat when compressed
        # every exchange also carries the step count it started at, so ranks out of step are caught
        self._step_out = torch.zeros(2, dtype=torch.int64)
        self._step_in = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
        self._step_works = []
        if self.compressor is None:
            senders = max(1, len(self.fixed[1])) if self.peer_selection.startswith("ring") else 1
            self.recv = [[torch.empty_like(f) for f in self.snap] for _ in range(senders)]
            return
        self.x_hat = [f.clone() for f in self.snap]
        degree = len(self.fixed[1]) if self.peer_selection != "all" else P - 1
        self.nbr_sum = [f * degree for f in self.snap]  # every copy starts at the common x_0
        # chunks: (group, start, end, its wire buffer, the pieces of parameters it covers)
        self.chunks = []
        for g, (params, flat) in enumerate(self.weights.groups):
            pieces, o = [], 0
            for p in params:
                pieces.append((p, o, o + p.numel()))
                o += p.numel()
            bounds = [0] + list(range(FIRST_CHUNK, flat.numel(), CHUNK)) + [flat.numel()]
            for a, b in zip(bounds, bounds[1:]):
                if a >= b:
                    continue
                wire = torch.empty(_aligned(self.compressor.wire_bytes(b - a)), dtype=torch.uint8)
                self.chunks.append((g, a, b, wire, [(p, lo, hi) for p, lo, hi in pieces if lo < b and hi > a]))
        senders = degree if self.peer_selection != "all" else P
        self.recv = [[torch.empty_like(c[3]) for c in self.chunks] for _ in range(senders)]
        self._jobs, self._packed, self._done, self._error = queue.Queue(), threading.Event(), threading.Event(), None
        self._thread = threading.Thread(target=self._serve, name="bagua_lite-decentralized", daemon=True)
        self._thread.start()

    def sync_gradients(self):
        return False

    def before_step(self):
        if self.compressor is not None:
            self._wait(self._packed)  # the thread has packed this exchange's snapshot: the step may go on

    def _peers(self):
        """(ranks this rank sends to, ranks it receives from) in this exchange."""
        if self.peer_selection == "shift_one":
            partner = _C.shift_one_partner(self.model.rank, self.world_size, self.exchanges)
            return ([partner], [partner]) if partner >= 0 else ([], [])
        return self.fixed

    # ---- the exchange: started when forward starts, applied after the optimizer step ---------------------
    def before_forward(self):
        if self._works is not None or not torch.is_grad_enabled() or self.world_size == 1 \
                or (self.step + 1) % self.communication_interval:
            return
        self._step_works = self._post_steps()  # before the thread posts anything: same order on every rank
        if self.compressor is not None:
            self._packed.clear()
            self._done.clear()
            self._works = []  # in flight (on the thread)
            self._jobs.put(True)
            return
        send = self.weights.gather()  # x_t, into self.snap
        if self.peer_selection == "all":
            P = self.world_size
            self._works = [dist.all_reduce(t, group=self.group, async_op=True) for t in self._sum_buffers()]
            _C.count_sent(sum(2 * (P - 1) * t.nbytes // P for t in send), len(send))  # ring allreduce
            return
        self._works = [w for i, t in enumerate(send) for w in self._post(t, [r[i] for r in self.recv], i)]

    def _post_steps(self):
        """Send this exchange's step count with it (16 bytes per peer, not counted as traffic)."""
        self._step_out[0], self._step_out[1] = self.step, -self.step
        if self.peer_selection == "all":  # max of (step, -step): the range of every rank's step
            self._step_in[0].copy_(self._step_out)
            return [dist.all_reduce(self._step_in[0], op=dist.ReduceOp.MAX, group=self.group, async_op=True)]
        me, (to, frm), works = self.model.rank, self._peers(), []
        for peer in to:
            works.append((self.group if me < peer else self.down).send([self._step_out], peer, STEP_TAG))
        for buf, peer in zip(self._step_in, frm):
            works.append((self.group if peer < me else self.down).recv([buf], peer, STEP_TAG))
        return works

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

    def _post(self, t, recv, tag):
        """Send t to this exchange's peers and receive theirs into recv (one direction per group)."""
        me, (to, frm), works = self.model.rank, self._peers(), []
        for peer in to:
            works.append((self.group if me < peer else self.down).send([t], peer, tag))
            _C.count_sent(t.nbytes, 1)
        for buf, peer in zip(recv, frm):
            works.append((self.group if peer < me else self.down).recv([buf], peer, tag))
        return works

    # ---- the compressed exchange, on the background thread ---------------------------------------------
    def _serve(self):
        while self._jobs.get():
            try:
                self._compressed_exchange()
            except BaseException as e:  # noqa: B902 (raised on the training thread by _wait)
                self._error = e
            finally:
                self._packed.set()
                self._done.set()

    def _compressed_exchange(self):
        C, P, posted = self.compressor, self.world_size, []
        with torch.no_grad():
            for i, (g, a, b, wire, pieces) in enumerate(self.chunks):  # q = C(x_t - x_hat), chunk by chunk
                diff, x_hat = self.snap[g][a:b], self.x_hat[g]
                for p, lo, hi in pieces:
                    s, e = max(lo, a), min(hi, b)
                    torch.sub(p.detach().reshape(-1)[s - lo:e - lo], x_hat[s:e], out=diff[s - a:e - a])
                C.compress(diff, wire.narrow(0, 0, C.wire_bytes(b - a)))
                if self.peer_selection == "all":
                    posted.append([dist.all_gather([r[i] for r in self.recv], wire, group=self.group, async_op=True)])
                    _C.count_sent((P - 1) * wire.nbytes, P - 1)  # ring allgather
                else:
                    posted.append(self._post(wire, [r[i] for r in self.recv], i))
            self._packed.set()  # x_t is read: the optimizer may step
            own = self.model.rank if self.peer_selection == "all" else None
            degree = len(self.recv) - (own is not None)
            self._scale = self.consensus_step / (degree + 1)
            for i, ((g, a, b, wire, _), works) in enumerate(zip(self.chunks, posted)):  # as chunks arrive
                for w in works:
                    w.wait()
                size, nbr_sum, x_hat = C.wire_bytes(b - a), self.nbr_sum[g][a:b], self.x_hat[g][a:b]
                received = [recv[i].narrow(0, 0, size) for j, recv in enumerate(self.recv) if j != own]
                if C.native and _C.gossip_fold(C.name, wire.narrow(0, 0, size), received, x_hat, nbr_sum,
                                               self.snap[g][a:b], float(degree)):
                    continue  # the same three steps as below, in one pass over memory
                for q in received:  # x_hat_j += D(q_j), summed over the neighbours
                    C.decompress(q, nbr_sum, accumulate=True)
                C.decompress(wire.narrow(0, 0, size), x_hat, accumulate=True)
                torch.add(nbr_sum, x_hat, alpha=-degree, out=self.snap[g][a:b])  # (d + 1) (mean - x_hat)

    def _wait(self, event):
        if self._works is not None:
            self.model.wait_for(event)  # the thread may wait on a failed peer: fail fast
            if self._error is not None:
                error, self._error, self._works = self._error, None, None
                self.model.fail(f"{self.name}: the weight exchange failed: {error}")
                raise RuntimeError(f"{self.name}: the weight exchange failed on rank {self.model.rank}: {error}") \
                    from error

    def _sum_buffers(self):
        for snap, buf in zip(self.snap, self.recv[0]):
            buf.copy_(snap)
        return self.recv[0]

    def after_step(self):
        if self._works is None:
            return
        if self.compressor is not None:
            self._wait(self._done)
        works, self._works = self._works + self._step_works, None
        self.model.run_collective(f"{self.name} exchange", lambda: [w.wait() for w in works])
        peers = self._peers()[1]
        self._check_steps(peers)
        self.exchanges += 1
        with torch.no_grad():
            if self.compressor is not None:
                deltas = [(delta, self._scale) for delta in self.snap]
            else:
                deltas = self._exact_deltas(peers)
            for (group, _), (delta, scale) in zip(self.weights.groups, deltas):
                if delta is None:
                    continue
                o = 0
                for p in group:
                    p.add_(delta[o:o + p.numel()].view_as(p), alpha=scale)
                    o += p.numel()

    def _exact_deltas(self, peers):
        """(buffer, scale) per flat group with W x_t - x_t = scale * buffer: for k peers (or all P ranks)
        the buffer is sum(x_peers) - k x_t, the scale 1 / (k + 1), two passes at most."""
        deltas = []
        for i, snap in enumerate(self.snap):
            buf = self.recv[0][i]
            if self.peer_selection == "all":  # buf holds the sum over all P ranks
                deltas.append((buf.add_(snap, alpha=-self.world_size), 1.0 / self.world_size))
                continue
            if not peers:  # odd P under shift_one: this rank sits the exchange out
                deltas.append((None, 0.0))
                continue
            for j in range(1, len(peers)):
                buf.add_(self.recv[j][i])
            deltas.append((buf.add_(snap, alpha=-len(peers)), 1.0 / (len(peers) + 1)))
        return deltas

    def close(self):
        if self.model.peer_failed():  # nobody will answer: leave the (daemon) thread behind
            self._works = None
            if getattr(self, "_thread", None) is not None:
                self._thread = None
            return
        if self._works is not None:  # an exchange in flight: finish it so peers are not left waiting
            if self.compressor is not None:
                self._done.wait()
            for w in self._works + self._step_works:
                w.wait()
            self._works = None
        if getattr(self, "_thread", None) is not None:
            self._jobs.put(False)
            self._thread.join()
            self._thread = None

    def state_dict(self):
        state = {"step": self.step, "exchanges": self.exchanges}
        if self.compressor is not None:
            state.update(x_hat=[t.clone() for t in self.x_hat], nbr_sum=[t.clone() for t in self.nbr_sum])
        return state

    def load_state_dict(self, state):
        self.step, self.exchanges = int(state["step"]), int(state["exchanges"])
        if self.compressor is not None:
            for dst, src in zip(self.x_hat + self.nbr_sum, state["x_hat"] + state["nbr_sum"]):
                dst.copy_(src)


@register("low_precision_decentralized")
class LowPrecisionDecentralized(Decentralized):
    """BAGUA's low-precision decentralized SGD: ``decentralized`` exchanging weight differences compressed
    to uint8 with error compensation (the defaults; every option of ``decentralized`` applies). Its ring
    is one-way by default: each rank sends to one neighbour, half the bytes of the two-way ``ring`` (a
    third of DDP's at P >= 3 would be two thirds), at a slower mixing rate (W's second eigenvalue 0.71
    against 0.33 at P = 4) that the digits convergence test shows costs no accuracy."""

    def __init__(self, peer_selection: str = "ring_one_way", communication_interval: int = 1,
                 compression: str = "minmax_uint8", consensus_step: float = 1.0):
        if compression == "none":
            raise ValueError("low_precision_decentralized: compression must be a compressor, not 'none' "
                             "(that is plain decentralized)")
        super().__init__(peer_selection, communication_interval, compression, consensus_step)


def _aligned(nbytes):
    return (nbytes + 7) // 8 * 8
