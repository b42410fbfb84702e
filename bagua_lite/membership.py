"""The membership of a fault-tolerant job, agreed through the rendezvous store: who the members of each
generation are (:class:`Membership`), each generation's process group (:func:`reform`), a joiner's wait to
be admitted, the heartbeats that tell a stopped member from a slow one, and the state a joiner or a survivor
behind receives (:func:`broadcast_state`). :mod:`bagua_lite.elastic` drives these when a peer is lost or a
worker joins; this module knows the store and process groups, not models or algorithms.
"""
import threading
import time

import torch
import torch.distributed as dist

from ._failfast import POLL_S, PeerFailedError
from ._worker import Worker
from .launch import FT_KEY as KEY  # the job's membership keys, on the store of generation 0

JOIN_POLL_S = 0.5       # how often rank 0 looks for workers waiting to join
HEARTBEAT_S = 0.5       # how often each worker's heartbeat thread bumps its key


class MembershipChanged(RuntimeError):
    """A peer left: the step in flight was discarded on every survivor and the model now runs on the
    survivors' new process group. Raised by ``optimizer.step()`` (a loop catches it and goes on)."""

    def __init__(self, msg, old_world_size, new_world_size, generation):
        super().__init__(msg)
        self.old_world_size, self.new_world_size, self.generation = old_world_size, new_world_size, generation


class MembershipError(RuntimeError):
    """The survivors cannot carry on: fewer than ``min_workers`` left, this rank was left out of the new
    membership, or the survivors had committed different steps."""


class Membership:
    """The member set of the job, one generation after another, agreed through ``store`` under ``key``.
    Members are ids: generation 0's ranks are 0..N-1, a joiner gets N, N+1, ... in the order it registered;
    a generation's process group ranks its members in that order."""

    POLL_S = 0.02

    def __init__(self, store, key, members, me, window_s, generation=0):
        self.store, self.key, self.members, self.me, self.window_s = store, key, list(members), me, window_s
        self.generation = generation

    def close(self, g, members):
        """Propose ``members`` for generation ``g`` (the first proposal wins); return the winning list."""
        self.store.compare_set(f"{self.key}/gen{g}/members", "", ",".join(map(str, members)))
        return self.read(g)

    def read(self, g):
        return [int(r) for r in self.store.get(f"{self.key}/gen{g}/members").decode().split(",")]

    def grown(self):
        """Rank 0 of the members only: the next generation with every registered joiner not yet admitted
        added, proposed and agreed; the joiners' registrations are then marked admitted."""
        joined = int(self.store.add(f"{self.key}/joined", 0))
        admitted = int(self.store.add(f"{self.key}/admitted", 0))
        first = int(self.store.get(f"{self.key}/world0"))
        members = self.close(self.generation + 1, self.members + [first + k for k in range(admitted, joined)])
        self.store.add(f"{self.key}/admitted", joined - admitted)
        return members

    def waiting(self) -> int:
        """How many registered joiners are not admitted yet (one store round trip each)."""
        return int(self.store.add(f"{self.key}/joined", 0)) - int(self.store.add(f"{self.key}/admitted", 0))

    def next(self):
        """Register for the next generation and return its members (sorted global ranks). Every caller
        gets the same list; raises MembershipError if this rank is not in it."""
        g = self.generation + 1
        base = f"{self.key}/gen{g}"
        self.store.set(f"{base}/alive/{self.me}", "1")
        self.store.add(f"{base}/count", 1)
        deadline = time.monotonic() + self.window_s
        closed = f"{base}/members"
        while not self.store.check([closed]):
            if self.store.add(f"{base}/count", 0) >= len(self.members) or time.monotonic() >= deadline:
                alive = [r for r in self.members if self.store.check([f"{base}/alive/{r}"])]
                self.store.compare_set(closed, "", ",".join(map(str, alive)))  # the first closer wins
                break
            time.sleep(self.POLL_S)
        members = self.read(g)
        self.generation = g
        if self.me not in members:
            raise MembershipError(
                f"bagua_lite: rank {self.me} registered for generation {g} after the survivors had closed it "
                f"({members}, {self.window_s} s after the first of them registered): it is no longer a member. "
                f"A rank that is busy longer than rejoin_window_s when a peer fails is left out; raise the window")
        return members


def reform(base, g, members, me, backend, timeout, watch=None):
    """Generation ``g``'s default process group over ``members`` (ids; this process is ``me``): the old
    default group (and every group made from it) destroyed, a new one made by the members only on a store
    prefix of its own, with the old backend and timeout. ``watch`` (a :class:`PulseWatch` of the members):
    called every half second while gloo connects, so a member that dies or stops now raises
    :class:`MembershipError` within the heartbeat timeout instead of holding the others for the group's
    (after a loss the survivors then form the next generation without it; while admitting a joiner it ends
    the run). The connecting thread is left to the group's timeout: it cannot complete without that member."""
    if dist.is_initialized():
        dist.destroy_process_group()

    # A client of its own: gloo's rendezvous blocks its client in get() until every member has written its
    # address, and one left waiting for a lost member must not hold the client the membership agrees on.
    store = _own_client(base) if watch is not None else base

    def connect():
        dist.init_process_group(backend, store=dist.PrefixStore(f"{KEY}/gen{g}", store), rank=members.index(me),
                                world_size=len(members), timeout=timeout)
    if watch is None:
        connect()
        return dist.group.WORLD
    done = threading.Event()
    worker = Worker("bagua_lite-reform")
    worker.submit(connect, done)
    while not done.wait(POLL_S):
        try:
            watch()
        except PeerFailedError as e:  # the connecting thread is left to the group's timeout
            raise MembershipError(f"bagua_lite: a member was lost again while the members {members} formed "
                                  f"generation {g}'s process group: {e}") from e
    error = worker.take_error()
    if error is not None:
        raise error
    worker.stop()
    return dist.group.WORLD


def broadcast_state(state, group, src=0):
    """``state`` (nested dicts, lists and tuples of tensors and plain values) from rank ``src`` of ``group``
    to every rank (the others pass None); the tensors travel as one flat buffer per dtype, the rest pickled.
    The buffers travel from the host (a copy where the sender keeps them on a device), so every rank takes
    part with a CPU tensor, whatever device each keeps its state on; the receivers' loaders move it."""
    tensors = []

    def strip(x):  # the structure, each tensor replaced by its index in ``tensors``
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach())
            return _TensorSlot(len(tensors) - 1)
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(strip(v) for v in x)
        return x
    is_src = group.rank() == src
    box = [None]
    if is_src:
        skeleton = strip(state)
        box = [(skeleton, [(tuple(t.shape), t.dtype) for t in tensors])]
    dist.broadcast_object_list(box, group_src=src, group=group)
    skeleton, metas = box[0]
    received = [None] * len(metas)
    for dtype in sorted({dt for _, dt in metas}, key=str):
        idx = [i for i, (_, dt) in enumerate(metas) if dt == dtype]
        sizes = [int(torch.Size(metas[i][0]).numel()) for i in idx]
        flat = torch.cat([tensors[i].reshape(-1).cpu() for i in idx]) if is_src else torch.empty(sum(sizes), dtype=dtype)
        dist.broadcast(flat, group_src=src, group=group)
        for i, piece in zip(idx, flat.split(sizes)):
            received[i] = piece.view(metas[i][0])

    def fill(x):
        if isinstance(x, _TensorSlot):
            return received[x.index]
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(fill(v) for v in x)
        return x
    return fill(skeleton)


class _TensorSlot:
    """Where a tensor stood in a state :func:`broadcast_state` sends (pickled in its place)."""

    def __init__(self, index):
        self.index = index


def wait_for_admission(base, window_s, poll_s=0.05):
    """A joiner: register, then wait (as long as it takes: the members admit joiners at a step boundary)
    for the generation that lists it. Returns its Membership (the caller makes the process group)."""
    me = int(base.get(f"{KEY}/world0")) + int(base.add(f"{KEY}/joined", 1)) - 1
    g = int(base.get(f"{KEY}/generation")) + 1
    heartbeat = Heartbeat(base, me)  # from now on: the members watch it while they connect with it
    while True:
        if base.check([f"{KEY}/closed"]):
            heartbeat.stop()
            raise MembershipError(f"bagua_lite: the job this worker was to join has ended (its model was closed) "
                                  f"before admitting it (joiner id {me})")
        if base.check([f"{KEY}/gen{g}/members"]):
            membership = Membership(base, KEY, [], me, window_s, g)
            members = membership.read(g)
            if me in members:
                membership.members = members
                membership.heartbeat = heartbeat
                return membership
            g += 1
            continue
        time.sleep(poll_s)


def _own_client(store):
    """A client of ``store`` of its own (``Store.clone``): a store client serves one call at a time, so the
    heartbeat and the watch must not queue behind a blocking call of another thread (gloo's rendezvous
    waits in ``get`` until every member has written its address)."""
    try:
        return store.clone()
    except Exception:  # noqa: BLE001 - a store without clone: the shared client, which then may queue
        return store


class Heartbeat:
    """This worker's pulse: a daemon thread bumps ``bagua_lite/ft/beat/<id>`` in the store every
    ``HEARTBEAT_S`` seconds. A stopped process (SIGSTOP, a hung host) keeps its connections open, so its peers'
    collectives would wait for the process group's timeout; its pulse stops, which :class:`PulseWatch` sees."""

    def __init__(self, store, me):
        self.store, self.key = _own_client(store), f"{KEY}/beat/{me}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bagua_lite-heartbeat", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 - a slow or unreachable store: try again at the next beat (a
                pass           # thread that stopped here would have its live worker taken for a lost one)

    def stop(self):
        self._stop.set()


class PulseWatch:
    """Called at every poll while a member waits for its peers (``FailFast.watch``): raises
    ``PeerFailedError`` naming a member whose heartbeat stood still for ``timeout_s`` seconds of waiting.
    ``store``: a client no other thread blocks (this worker's :class:`Heartbeat`'s, whose calls are short)."""

    def __init__(self, store, members, me, timeout_s):
        self.store, self.timeout_s = store, timeout_s
        self.seen = {m: (None, 0.0) for m in members if m != me}  # id -> (last count, when it last moved)

    def __call__(self, closed_ok=False):
        """``closed_ok``: a member that closed its model (an asynchronous one's ranks end their loops at
        different times) is no longer watched instead of being treated as lost."""
        now = time.monotonic()
        for m, (count, since) in list(self.seen.items()):
            try:
                now_count = int(self.store.add(f"{KEY}/beat/{m}", 0))
                if now_count == count and now - since > self.timeout_s and closed_ok \
                        and self.store.check([f"{KEY}/left/{m}"]):
                    del self.seen[m]
                    continue
            except Exception:  # noqa: BLE001 - the store will say more at the next membership change
                return
            if now_count != count:
                self.seen[m] = (now_count, now)
            elif now - since > self.timeout_s:
                raise PeerFailedError(
                    f"bagua_lite: member {m}'s heartbeat stood still for {now - since:.1f} s while this rank waited "
                    f"for it (heartbeat_timeout_s={self.timeout_s}): a stopped or hung process, treated as lost")
