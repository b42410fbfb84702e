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
The exchange itself (peers, groups, step counts, fail fast) is ``parts.gossip.Gossip``'s.

``compression`` (any registered compressor, e.g. ``minmax_uint8``) sends compressed weight *differences*
with error compensation instead (CHOCO-gossip, with its ``consensus_step``): ``decentralized`` with a
compression is built as ``low_precision_decentralized``'s exchange under this name and these defaults.
"""
import torch
import torch.distributed as dist

from bagua_lite import _C, cost_model as cm
from bagua_lite.algorithm import register

from .parts.gossip import Gossip
from .parts.peers import degree, traffic
from .low_precision_decentralized import LowPrecisionDecentralized


@register("decentralized")
class Decentralized(Gossip):
    def __new__(cls, peer_selection: str = "ring", communication_interval: int = 1, compression: str = "none",
                consensus_step: float = 1.0):
        if cls is Decentralized and compression not in (None, "none"):
            return CompressedDecentralized(peer_selection, communication_interval, compression, consensus_step)
        return super().__new__(cls)

    def __init__(self, peer_selection: str = "ring", communication_interval: int = 1, compression: str = "none",
                 consensus_step: float = 1.0):
        """``consensus_step`` (CHOCO's gamma) applies with a ``compression`` only: W is applied whole here."""
        super().__init__(peer_selection, communication_interval, consensus_step)
        if compression not in (None, "none"):  # only a subclass gets here (see __new__)
            raise ValueError(f"{self.name}: {type(self).__name__} exchanges weights, not compression={compression!r}")

    @classmethod
    def traffic(cls, o, P, numels, elem_bytes=4, machine=None, rank=None):
        """x_t to each peer (``all``: a ring allreduce of the weights), overlapped with the whole step; on the
        training thread: gather x_t, sum the peers' (all: a copy), subtract k x_t, apply."""
        if o["compression"] not in (None, "none"):
            return LowPrecisionDecentralized.traffic(o, P, numels, elem_bytes, machine, rank)
        n, mode = sum(numels), o["peer_selection"]
        passes = 4 if mode == "all" else degree(mode, P) + 2
        local = passes * n * machine.add_s_per_elem if machine is not None and P > 1 else 0.0
        return traffic(o, P, n, n * elem_bytes, cm.ring(n * elem_bytes, P), local_s=local)

    def init(self, model):
        super().init(model)
        self._receive_buffers()

    def _receive_buffers(self):
        """One flat buffer per peer and dtype (fault tolerance: made again when the ring re-forms)."""
        self.recv = [[torch.empty_like(f) for f in self.snap] for _ in range(self.peers.senders)]


    def _start(self):
        send = self.weights.gather()  # x_t, into self.snap
        if self.peer_selection == "all":
            P = self.world_size
            works = [dist.all_reduce(t, group=self.peers.group, async_op=True) for t in self._sum_buffers()]
            _C.count_sent(sum(2 * (P - 1) * t.nbytes // P for t in send), len(send))  # ring allreduce
            return works
        return [w for i, t in enumerate(send) for w in self._post(t, [r[i] for r in self.recv], i)]

    def _sum_buffers(self):
        for snap, buf in zip(self.snap, self.recv[0]):
            buf.copy_(snap)
        return self.recv[0]

    def _apply(self, peers):
        self._add(self._exact_deltas(peers))

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


class CompressedDecentralized(LowPrecisionDecentralized):
    """``decentralized`` with a ``compression``: the compressed exchange, named and defaulted as decentralized."""
    name = "decentralized"
