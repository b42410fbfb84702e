"""Who a rank exchanges weights with in decentralized SGD, how a message gets there, and the cost model's
view of one exchange (``degree``, ``traffic``). Used by ``parts.gossip.Gossip``.

Peers: ``ring`` (both neighbours), ``ring_one_way`` (send to the right, receive from the left), ``shift_one``
(one partner that rotates each exchange; odd P: one rank sits out), ``all`` (everyone, by collectives).
"""
import torch

from bagua_lite import _C, _compat, _control, cost_model as cm
from bagua_lite._groups import new_group_like

PEER_SELECTIONS = ("ring", "ring_one_way", "shift_one", "all")


def check_selection(who, peer_selection):
    if peer_selection not in PEER_SELECTIONS:
        raise ValueError(f"{who}: peer_selection={peer_selection!r} is not allowed; "
                         f"choose one of {', '.join(PEER_SELECTIONS)}")
    return peer_selection


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


class Peers:
    """``peer_selection``'s peers of this rank, over process groups of their own (collective: every rank of
    the model builds them, in the same order)."""

    def __init__(self, model, peer_selection):
        self.selection, self.rank, self.size = peer_selection, model.rank, model.world_size
        # Our traffic only, and one group per direction: a TCP connection that carries bulk data both ways
        # queues each side's acknowledgements behind its data and halves the rate (measured: a 100 MB
        # swap over an emulated 1 Gbit/s link takes 1.67 s on one connection, 0.84 s on two).
        self.group = new_group_like(model.process_group)  # lower -> higher rank (and all's collectives)
        self.down = new_group_like(model.process_group)   # higher -> lower rank
        P, me = self.size, self.rank
        # fixed neighbours as (send to, receive from); one neighbour at P = 2, none at P = 1
        both = sorted({(me - 1) % P, (me + 1) % P} - {me})
        one_way = ([(me + 1) % P], [(me - 1) % P]) if P > 1 else ([], [])
        self.fixed = one_way if peer_selection == "ring_one_way" else (both, both)
        #: how many ranks this rank receives from in one exchange, at most
        self.senders = max(1, len(self.fixed[1])) if peer_selection.startswith("ring") else 1
        self._host = {}  # device buffer -> its host copy, for a transport without device send/recv

    def staged(self, t) -> bool:
        """Whether ``t`` travels through a host copy: gloo carries CUDA tensors in collectives but not in
        send/recv (it would be handed a device pointer), so on a gloo group they are staged through the host."""
        return t.device.type != "cpu" and _compat.backend_for(self.group, t.device.type) in (None, "gloo")

    def _host_copy(self, t):
        """A host buffer for ``t``, made once per device buffer (reused every exchange)."""
        key = (t.data_ptr(), t.numel(), t.dtype)
        host = self._host.get(key)
        if host is None:
            host = self._host[key] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=torch.cuda.is_available())
        return host

    def of(self, exchange):
        """(ranks this rank sends to, ranks it receives from) in exchange number ``exchange``."""
        if self.selection == "shift_one":
            partner = _C.shift_one_partner(self.rank, self.size, exchange)
            return ([partner], [partner]) if partner >= 0 else ([], [])
        return self.fixed

    def post(self, t, recv, tag, exchange, counted=True, control=False):
        """Send t to the exchange's peers and receive theirs into recv (one direction per group): the works.
        ``control``: t is a control message (host-side step pair), sent over the groups' control groups."""
        me, (to, frm), works = self.rank, self.of(exchange), []
        up, down = (_control.of(self.group), _control.of(self.down)) if control else (self.group, self.down)
        if to and self.staged(t):
            t = self._host_copy(t).copy_(t.reshape(-1))
        for peer in to:
            works.append((up if me < peer else down).send([t], peer, tag))
            if counted:
                _C.count_sent(t.nbytes, 1)
        for buf, peer in zip(recv, frm):
            if self.staged(buf):
                host = self._host_copy(buf)
                works.append(_StagedRecv((up if peer < me else down).recv([host], peer, tag), host, buf))
            else:
                works.append((up if peer < me else down).recv([buf], peer, tag))
        return works


class _StagedRecv:
    """A receive into a host buffer that, once waited for, lands in its device buffer (``Peers.post``)."""

    def __init__(self, work, host, device_buffer):
        self.work, self.host, self.device_buffer = work, host, device_buffer

    def wait(self, *args):
        done = self.work.wait(*args)
        self.device_buffer.view(-1).copy_(self.host)
        return done
