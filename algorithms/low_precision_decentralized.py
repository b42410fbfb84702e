"""Low-precision decentralized SGD (BAGUA's): decentralized SGD that sends compressed weight *differences*
with error compensation instead of weights (CHOCO-gossip, Koloskova et al. 2019). Every rank keeps x_hat,
the copy of its weights its peers know, and the sum of the copies it receives (neighbours must be fixed:
``ring``, ``ring_one_way`` or ``all``; the exchange itself is ``parts.gossip.Gossip``'s):

    forward starts:   q_i <- C(x_t - x_hat_i), send q_i to the neighbours
    backward, step:   x' <- x_t - lr * update(grad f(x_t))            (the user's optimizer, local)
    after the step:   x_hat_j <- x_hat_j + D(q_j) for i and every neighbour j
                      x_{t+1} <- x' + gamma * (mean over i and neighbours of x_hat  -  x_hat_i)

What compression loses stays in x_t - x_hat_i and is sent again next time: nothing is forgotten.
The exchange runs on a background thread while forward and backward run: it compresses chunk by chunk
(each chunk goes on the wire as soon as it is packed), folds the received copies in as they arrive, and
leaves the training thread one pass, x' + delta, after the step. The optimizer step waits for the packing
only (it reads x_t), never for the transfer. ``decentralized`` with a ``compression`` is this exchange.
"""
import threading

import torch
import torch.distributed as dist

from bagua_lite import _C, cost_model as cm
from bagua_lite._options import compressor
from bagua_lite._worker import Worker
from bagua_lite.algorithm import register

from .parts.gossip import Gossip
from .parts.peers import degree, traffic

# elements per compressed message: the wire starts once the (smaller) first chunk is packed
FIRST_CHUNK, CHUNK = 1 << 20, 1 << 22


@register("low_precision_decentralized")
class LowPrecisionDecentralized(Gossip):
    """Defaults: uint8 differences on a one-way ring. Each rank sends to one neighbour, half the bytes of
    the two-way ``ring`` (a third of DDP's at P >= 3 would be two thirds), at a slower mixing rate (W's
    second eigenvalue 0.71 against 0.33 at P = 4) that the digits convergence test shows costs no accuracy."""

    def __init__(self, peer_selection: str = "ring_one_way", communication_interval: int = 1,
                 compression: str = "minmax_uint8", consensus_step: float = 1.0):
        super().__init__(peer_selection, communication_interval, consensus_step)
        self.compressor = compressor(self.name, compression, " (that is plain decentralized)")
        if peer_selection == "shift_one":
            raise ValueError(f"{self.name}: compression={compression!r} needs fixed neighbours (each keeps a copy "
                             f"of what the others know); use peer_selection 'ring', 'ring_one_way' or 'all', not 'shift_one'")

    @classmethod
    def traffic(cls, o, P, numels, elem_bytes=4, machine=None, rank=None):
        """q to each peer (``all``: an allgather), padded to 8 bytes; its thread packs x_t - x_hat, compresses,
        decompresses every q received and its own, and forms the delta; the training thread applies it."""
        n, c = sum(numels), o["compression"]
        unit, local = cm.aligned(cm.wire_bytes(c, n)), (0.0, 0.0, 0.0)
        if machine is not None and P > 1:  # (training thread, exchange thread, before the first chunk's wire)
            add, codec, d = machine.add_s_per_elem, cm.codec_s(c, machine), degree(o["peer_selection"], P)
            local = (n * add, n * (2 * add + codec * (d + 2) / 2), min(n, FIRST_CHUNK) * (add + codec / 2))
        return traffic(o, P, n, unit, ((P - 1) * unit, P - 1, (P - 1) * unit), *local)

    def init(self, model):
        super().init(model)
        P = model.world_size
        self.x_hat = [f.clone() for f in self.snap]
        degree = len(self.peers.fixed[1]) if self.peer_selection != "all" else P - 1
        self.nbr_sum = [f * degree for f in self.snap]  # every copy starts at the common x_0
        self.register_state("x_hat", self.x_hat)
        self.register_state("nbr_sum", self.nbr_sum)
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
                wire = torch.empty(_aligned(self.compressor.wire_bytes(b - a)), dtype=torch.uint8, device=flat.device)
                self.chunks.append((g, a, b, wire, [(p, lo, hi) for p, lo, hi in pieces if lo < b and hi > a]))
        self._receive_buffers()
        # fault tolerance: an exchange thread of an older membership never writes again (_drop_exchange)
        self._generation, self._fold_lock = 0, threading.Lock()
        if model.membership is not None and model.membership.joining:
            self._restart_gossip()  # a joiner, admitted: as the members do in regroup()

    def _receive_buffers(self):
        senders = len(self.peers.fixed[1]) if self.peer_selection != "all" else self.world_size
        self.recv = [[torch.empty_like(c[3]) for c in self.chunks] for _ in range(senders)]

    # ---- fault tolerance ---------------------------------------------------------------------------------
    def _drop_exchange(self):
        """The exchange thread may sit in a transfer with the lost peer, or between two chunks: it is
        abandoned, and the generation it was started in no longer matches, which it checks under the fold
        lock before it packs, posts or folds any chunk (so it never writes x_hat, the neighbours' sum or a
        buffer again, nor posts on the new groups)."""
        with self._fold_lock:
            self._generation += 1
        self._worker.abandon()
        self._worker = Worker(self._worker.name)
        self._packed, self._done = threading.Event(), threading.Event()
        super()._drop_exchange()

    def regroup(self):
        """The ring re-forms: CHOCO's copies are made again with the new neighbours (see _restart_gossip)."""
        super().regroup()
        self._restart_gossip()

    def _restart_gossip(self):
        """After a membership change the neighbours are new and an exchange may have been folded in on some
        ranks only, so what each rank knows of its neighbours' copies no longer holds. Every rank's copy
        becomes its own weights, x_hat_i <- x_i, and the neighbours' sum is their copies, received exactly
        (one full-precision exchange with the new neighbours; under ``all`` an allreduce)."""
        with torch.no_grad():
            for x_hat, flat in zip(self.x_hat, self.weights.gather()):
                x_hat.copy_(flat)
            if self.world_size == 1:
                for nbr in self.nbr_sum:
                    nbr.zero_()
                return
            if self.peer_selection == "all":
                for nbr, x_hat in zip(self.nbr_sum, self.x_hat):
                    nbr.copy_(x_hat)
                self.model.run_collective(f"{self.name} restart", lambda: [
                    dist.all_reduce(nbr, group=self.peers.group) for nbr in self.nbr_sum])
                for nbr, x_hat in zip(self.nbr_sum, self.x_hat):
                    nbr.sub_(x_hat)
                return
            frm = self.peers.of(self.exchanges)[1]
            copies = [[torch.empty_like(x) for x in self.x_hat] for _ in frm]
            works = [w for i, x in enumerate(self.x_hat)
                     for w in self.peers.post(x, [c[i] for c in copies], i, self.exchanges, counted=False)]
            self.model.run_collective(f"{self.name} restart", lambda: [w.wait() for w in works])
            for i, nbr in enumerate(self.nbr_sum):
                nbr.zero_()
                for c in copies:
                    nbr.add_(c[i])

    def before_step(self):
        self._wait(self._packed)  # the thread has packed this exchange's snapshot: the step may go on

    def _start(self):
        generation, packed = self._generation, self._packed
        return self._in_background(lambda: self._compressed_exchange(generation, packed))

    def _compressed_exchange(self, generation, packed):
        """On the exchange thread: x_t - x_hat into self.snap, compressed and posted chunk by chunk; then,
        as each chunk arrives, x_hat and the neighbours' sum updated and self.snap = (d + 1) (mean - x_hat).
        Each chunk's work is done under the fold lock, only while the membership is the one it started in."""
        C, P, posted = self.compressor, self.world_size, []
        peers, recv, exchange = self.peers, self.recv, self.exchanges
        with torch.no_grad():
            for i, (g, a, b, wire, pieces) in enumerate(self.chunks):  # q = C(x_t - x_hat), chunk by chunk
                with self._fold_lock:
                    if self._generation != generation:
                        return
                    diff, x_hat = self.snap[g][a:b], self.x_hat[g]
                    for p, lo, hi in pieces:
                        s, e = max(lo, a), min(hi, b)
                        torch.sub(p.detach().reshape(-1)[s - lo:e - lo], x_hat[s:e], out=diff[s - a:e - a])
                    C.compress(diff, wire.narrow(0, 0, C.wire_bytes(b - a)))
                    if self.peer_selection == "all":
                        posted.append([dist.all_gather([r[i] for r in recv], wire, group=peers.group,
                                                       async_op=True)])
                        _C.count_sent((P - 1) * wire.nbytes, P - 1)  # ring allgather
                    else:
                        posted.append(peers.post(wire, [r[i] for r in recv], i, exchange))
            packed.set()  # x_t is read: the optimizer may step
            own = peers.rank if self.peer_selection == "all" else None
            degree = len(recv) - (own is not None)
            scale = self.consensus_step / (degree + 1)
            for i, ((g, a, b, wire, _), works) in enumerate(zip(self.chunks, posted)):  # as chunks arrive
                for w in works:
                    w.wait()
                self._fold_lock.acquire()
                if self._generation != generation:
                    self._fold_lock.release()
                    return
                self._scale = scale
                try:
                    self._fold(C, g, a, b, wire, [r[i] for j, r in enumerate(recv) if j != own], degree)
                finally:
                    self._fold_lock.release()

    def _fold(self, C, g, a, b, wire, received, degree):
        """One chunk arrived: x_hat_j += D(q_j) over the neighbours and x_hat_i += D(q_i), then the chunk's
        delta (d + 1) (mean - x_hat) into self.snap."""
        size, nbr_sum, x_hat = C.wire_bytes(b - a), self.nbr_sum[g][a:b], self.x_hat[g][a:b]
        received = [q.narrow(0, 0, size) for q in received]
        if C.native and _C.gossip_fold(C.name, wire.narrow(0, 0, size), received, x_hat, nbr_sum,
                                       self.snap[g][a:b], float(degree)):
            return  # the same three steps as below, in one pass over memory
        for q in received:  # x_hat_j += D(q_j), summed over the neighbours
            C.decompress(q, nbr_sum, accumulate=True)
        C.decompress(wire.narrow(0, 0, size), x_hat, accumulate=True)
        torch.add(nbr_sum, x_hat, alpha=-degree, out=self.snap[g][a:b])  # (d + 1) (mean - x_hat)

    def _apply(self, peers):
        self._add([(delta, self._scale) for delta in self.snap])


def _aligned(nbytes):
    return (nbytes + 7) // 8 * 8
