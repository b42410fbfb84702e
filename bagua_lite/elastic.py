"""Survivors carry on: ``DistributedModel(..., fault_tolerant=True)`` keeps training when a worker dies.

    model = bagua_lite.DistributedModel(net, opt, "gradient_allreduce", fault_tolerant=True, min_workers=2)
    for x, y in loader:
        try:
            loss_fn(model(x), y).backward(); opt.step()
        except bagua_lite.MembershipChanged:
            pass                      # this step was discarded on every survivor; the next one runs
        opt.zero_grad()

When a peer dies (its collective raises on a neighbour, which tells the others through the fail-fast key;
a stopped one, whose connections stay open, once its heartbeat, a store key its thread bumps every
``HEARTBEAT_S``, stood still for ``heartbeat_timeout_s`` while a survivor waited for it), every survivor,
in whatever call of the step it learns it (forward, backward):

1. discards the step in flight: the algorithm's ``register_state(..., rollback=True)`` tensors are put
   back, the algorithm's own transient state is reset (``Algorithm.regroup``), the buckets are zeroed, the
   optimizer is not touched, the step count does not advance; the engine that may sit in a collective
   with the dead peer is abandoned and a new one started;
2. agrees on the new membership through the rendezvous store (:class:`Membership`): it registers under the
   next generation number; the set is closed once every member of the last generation registered, or
   ``rejoin_window_s`` seconds after this rank registered, by one atomic ``compare_set`` that only the first
   closer wins, so every survivor reads the same set (a rank registering after it is excluded and raises);
3. makes the next generation's default process group among the members (see below; a member lost while
   they connect, or in their first collective, is left out by one more generation, formed the same way), checks on it that
   every member is at the same step count (one behind by a step whose agreement reached the others only
   takes that step late from them), and rebuilds what depends on the group: ``process_group``, ``rank``,
   ``world_size``, the fail-fast key, the algorithm's bucket ops. Per-rank state that stays consistent is
   kept (error-feedback residuals, Top-k/gTop-k residuals and momenta, PowerSGD's residuals and Q's);
4. calls ``on_membership_change(old_world_size, new_world_size)`` (learning rate, data sharding), and
   ``optimizer.step()`` of that step raises :class:`MembershipChanged`: catch it and go on with the next
   batch. An algorithm that syncs in ``after_step`` (local SGD, DiLoCo, decentralized: ``heals_itself``)
   keeps that step's update and brings its survivors together in ``heal()`` instead (DiLoCo finishes its
   round; decentralized drops the exchange in flight and moves step counts to the furthest survivor's).

Joining (a replacement, or one more worker): a process started later with the same environment and
``bagua_lite.init_process_group()`` finds the job running (the store's ``bagua_lite/ft/open``) and makes no
process group; its ``DistributedModel(..., fault_tolerant=True)`` registers and waits. Rank 0 of the
members sees the registration at most every ``JOIN_POLL_S`` seconds and says so in the step agreement it
sends anyway, so every member learns it at the same step; after that step's ``optimizer.step()`` every
member and the joiners form the next generation's process group (an algorithm with no collective of all
ranks in its steps, decentralized, admits them instead at a step rank 0 posts in the store:
``Algorithm.store_admission_margin``), and rank 0 sends the joiners the
module's parameters and buffers, the optimizer's state (and param groups) and the algorithm's shared
state (its step count, and what it registered with ``shared=True``); a joiner's per-rank state (residuals,
momenta) starts empty, as a new worker's. No step is discarded; the members pause for the new group and
that transfer only. ``on_membership_change(old, new)`` runs on every member and on the joiner.

Every generation's process group is the default one (``torch.distributed.group.WORLD``), made afresh by
``torch.distributed.init_process_group`` on a store prefix of its own (``bagua_lite/ft/gen<g>``) after
the last one is destroyed (every other group of the process with it), so ``torch.distributed`` calls of
the user's own see the members of the current generation: ``dist.get_rank()`` is the rank in it (members
in the order they were first admitted), ``dist.get_world_size()`` its size.

Fewer than ``min_workers`` left: every survivor raises :class:`MembershipError` instead (save a checkpoint
from the last good state you kept, and restart). The store must outlive any worker: a TCPStore/FileStore
served outside the workers (each worker a client: ``TORCHELASTIC_USE_AGENT_STORE=True`` with
``bagua_lite.init_process_group``); a store hosted by a worker (plain ``env://``: rank 0 serves it) dies with
it, and then nothing can agree. Not under torchrun: its agent tears every worker down when one fails.
"""
import threading
import time

import torch
import torch.distributed as dist

KEY = "bagua_lite/ft"   # the job's membership keys, on the store of generation 0 (one fault-tolerant model per job)
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
    from ._failfast import POLL_S, PeerFailedError
    from ._worker import Worker

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
        from ._failfast import PeerFailedError

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


class Controller:
    """What ``DistributedModel(..., fault_tolerant=True)`` adds to the model: the membership, the step to
    discard (``pending``, raised by ``optimizer.step()``) and :meth:`recover`."""

    def __init__(self, model, min_workers, on_membership_change, rejoin_window_s, membership=None,
                 heartbeat_timeout_s=10.0):
        from ._failfast import FailFast
        from ._groups import group_timeout

        self.model = model
        self.min_workers = min_workers
        self.callback = on_membership_change
        self.backend, self.timeout = dist.get_backend(model.process_group), group_timeout(model.process_group)
        if membership is None:  # generation 0: every rank of the default group
            from . import launch
            base = launch._STORE.get("store", model._failfast.store)
            if model.process_group is not dist.group.WORLD:
                raise ValueError("DistributedModel: fault_tolerant=True runs on the default process group (each "
                                 "generation's members make a new one); do not pass group=")
            if base.check([f"{KEY}/open"]):
                raise RuntimeError(
                    "DistributedModel: a fault-tolerant model already runs in this job (the store has "
                    f"{KEY}/open): one fault-tolerant model per job; a worker joining a running job calls "
                    "bagua_lite.init_process_group() first, which then makes no group and lets this model join")
            membership = Membership(base, KEY, range(model.world_size), model.rank, rejoin_window_s)
            model._failfast = FailFast(model.rank, f"{KEY}/gen0/failed")
            model.process_group.barrier().wait()  # every rank checked "open" before rank 0 sets it
            if model.rank == 0:
                base.set(f"{KEY}/gen0/members", ",".join(map(str, range(model.world_size))))
                base.set(f"{KEY}/world0", str(model.world_size))
                base.set(f"{KEY}/generation", "0")
                base.set(f"{KEY}/open", "1")
        else:  # a joiner, admitted
            model._failfast = FailFast(model.rank, f"{KEY}/gen{membership.generation}/failed")
        self.membership = membership
        self.base = membership.store
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat = getattr(membership, "heartbeat", None) or Heartbeat(self.base, membership.me)
        model._failfast.watch = self._pulse_watch(membership.members)
        self.next_join_check = 0.0
        self._next_watch = 0.0
        self.grow_after_step = False  # a joiner waits: admit it after this step's optimizer.step()
        self.admit_at = None  # store admission (Algorithm.store_admission_margin): the step count to admit at
        self.pending = None       # the MembershipChanged that this step's optimizer.step() raises
        self.comm_error = None    # the last exception of the model's own step-control collective
        #: the last recovery: when it started (time.time()), seconds to agree on the members, seconds to
        #: build the new group and check it, generations given up (a member lost while forming them)
        self.last_recovery = None

    def recover(self, error, buckets_done=False, periodic=False):
        """A collective of this step failed (``error``): discard the step, agree on the survivors, re-form
        the group and rebuild what depends on it; or raise (see the module docstring). ``buckets_done``:
        it was the step agreement, after every bucket had completed here. ``periodic``: "sync", an
        algorithm's own sync after the optimizer's update (kept), or "store", a look at the store before a
        local step (that step is discarded); the algorithm heals itself (``heal()``)."""
        from . import _C

        started, t0 = time.time(), time.monotonic()
        m, alg = self.model, self.model.algorithm
        m._failfast.announce(f"{type(error).__name__}: {error}")  # the other survivors stop waiting
        if not m._engine_abandoned:
            m._engine.abandon()  # its worker may sit in a collective with the dead peer
        m._engine, m._engine_abandoned = _C.Engine(), False
        # The agreement can fail here after a peer got it whole (the dead worker's part reached some): those
        # apply the round. Keep this rank's result of it, to take the round late if they did.
        late = [[t.clone() for t in tensors] for tensors, _ in alg._kept.values()] if buckets_done else None
        alg._roll_back()
        with torch.no_grad():
            for b in m.buckets:
                b.flat.zero_()
        old_world, step, tries = m.world_size, alg.step, 0
        while True:  # one generation per try: a member lost while the others re-form is left out by the next
            last = self.membership.members
            members = self.membership.next()
            g = self.membership.generation
            t1 = time.monotonic()
            if len(members) == len(last):
                raise RuntimeError(f"bagua_lite: a collective failed at step {step} and every member is still "
                                   f"there (generation {g}): not a lost worker, so the model does not carry on "
                                   f"(this is rank {m.rank}): {error}") from error
            if len(members) < self.min_workers:
                msg = (f"bagua_lite: only {len(members)} worker(s) left (global ranks {members}), fewer than "
                       f"min_workers={self.min_workers}: training cannot go on (this is global rank "
                       f"{self.membership.me}, step {step}). Save a checkpoint from the state you have and restart "
                       f"with more workers")
                m._failfast.failed = msg
                raise MembershipError(msg) from error
            self.membership.members = members
            try:
                self._use(g, members)  # a member lost while gloo connects: MembershipError (heartbeat watch)
                steps = [r[0] for r in m._gather_ints([step])]  # one lost after it: its failure, fail fast
                break
            except (MembershipError, RuntimeError) as e:  # PeerFailedError is one
                tries += 1
                error = e
                from ._failfast import FailFast
                FailFast(m.rank, f"{KEY}/gen{g}/failed").announce(f"lost while re-forming: {e}")  # the others
                if not m._engine_abandoned:  # of generation g stop waiting in its first collective
                    m._engine.abandon()
                m._engine, m._engine_abandoned = _C.Engine(), False
        healed = ""
        if periodic:
            try:
                alg.heal()
            except Exception as e:  # noqa: BLE001 - another failure while healing
                m._failfast.failed = str(e)
                raise MembershipError(f"bagua_lite: the survivors {members} could not bring {alg.name}'s state "
                                      f"together after the loss (generation {g}): {e}") from e
            healed = f"; {alg.name}'s round in progress was healed (step count now {alg.step})"
        elif len(set(steps)) > 1:
            lo, hi = min(steps), max(steps)
            behind = step == lo
            if hi - lo != 1 or (behind and late is None):
                msg = (f"bagua_lite: the survivors {members} had applied different steps when the peer failed "
                       f"(step counts {steps}) and this rank cannot take the missing one (this is rank {m.rank}). "
                       f"Restart from a checkpoint")
                m._failfast.failed = msg
                raise MembershipError(msg)
            if behind:  # the others applied the round whose agreement failed here: take it late
                for (tensors, _), kept in zip(alg._kept.values(), late):
                    for t, k in zip(tensors, kept):
                        t.copy_(k)
                alg.commit_round()
            m._share_state(steps.index(hi), receive=behind)  # their weights, optimizer and step count
            healed = (f"; the step agreement of step {lo} had reached some survivors only, who applied it: the "
                      f"others took it from them")
        alg.regroup()
        for b in m.buckets:
            b.ops = list(alg.bucket_ops(b))
        self.last_recovery = {"started_at": started, "membership_s": t1 - t0, "regroup_s": time.monotonic() - t1,
                              "generations_given_up": tries}
        if self.callback is not None:
            self.callback(old_world, m.world_size)
        if periodic and self.grow_after_step:  # the healed sync said joiners wait: admit them now, where every
            self.grow()                         # survivor stands (a survivor may have come from its local steps)
        what = ("this step's update was applied; " if periodic == "sync" else
                "the step was discarded on every survivor, nothing of it was applied; ")
        self.pending = MembershipChanged(
            f"bagua_lite: a peer left at step {step} (world size {old_world} -> {m.world_size}, generation {g}, "
            f"members {members}): {what}the model now runs on the survivors' group (this rank is {m.rank} of "
            f"{m.world_size}){healed}. Go on with the next batch", old_world, m.world_size, g)

    def _use(self, g, members):
        """Run the model on generation ``g``'s new default group (``members``)."""
        from ._failfast import FailFast

        m = self.model
        self.admit_at = None  # a store admission posted for the last generation does not carry over
        watch = self._pulse_watch(members)
        pg = reform(self.base, g, members, self.membership.me, self.backend, self.timeout, watch)
        m.process_group, m.rank, m.world_size = pg, pg.rank(), pg.size()
        m._failfast = FailFast(m.rank, f"{KEY}/gen{g}/failed")
        m._failfast.watch = watch
        if m.rank == 0:
            self.base.set(f"{KEY}/generation", str(g))

    def _pulse_watch(self, members):
        return PulseWatch(self.heartbeat.store, members, self.membership.me, self.heartbeat_timeout_s)

    def watch_every(self):
        """The heartbeat watch, at most every ``POLL_S`` seconds, for a training thread that never waits for
        its peers (asynchronous averaging: its thread's collectives would wait for a stopped peer until the
        group's timeout). A member that closed its model is not a lost one there."""
        from ._failfast import POLL_S

        now = time.monotonic()
        if now >= self._next_watch:
            self._next_watch = now + POLL_S
            self.model._failfast.watch(closed_ok=True)

    def joiners_waiting(self) -> int:
        """Rank 0: the number of workers waiting to join, looked up at most every JOIN_POLL_S (0 between);
        the others: 0. Rides in the step agreement, so every member learns it at the same step."""
        if self.model.rank != 0 or time.monotonic() < self.next_join_check \
                or not getattr(self.model.algorithm, "admits_joiners", True):  # auto while it probes
            return 0
        self.next_join_check = time.monotonic() + JOIN_POLL_S
        try:
            return max(0, self.membership.waiting())
        except Exception:  # noqa: BLE001 - the store will say more at the next membership change
            return 0

    def look_for_admission(self, margin):
        """Store admission, once per step before its forward (algorithms with no collective of all ranks
        in their steps, whose ``store_admission_margin`` is ``margin``): rank 0, seeing joiners wait, posts
        the step count to admit them at, ``margin`` steps past its own; every member reads it (one store
        round trip while none is posted) and admits them after ``optimizer.step()`` reaches it."""
        if self.admit_at is not None:
            return
        key, step = f"{KEY}/gen{self.membership.generation}/admit_at", self.model.algorithm.step
        if self.joiners_waiting():
            self.base.compare_set(key, "", str(step + margin))  # rank 0 only: the first post stands
        if self.base.check([key]):
            self.admit_at = int(self.base.get(key))
            if step >= self.admit_at:
                msg = (f"bagua_lite: this rank (global {self.membership.me}) is at step {step}, already past step "
                       f"{self.admit_at} at which rank 0 admits a joiner ({margin} steps past its own when it saw "
                       f"it): the members cannot form the new group at one step. Restart from a checkpoint")
                self.model._failfast.announce(msg)
                raise MembershipError(msg)

    def admits_now(self) -> bool:
        """After ``optimizer.step()``: store admission's step is reached."""
        return self.admit_at is not None and self.model.algorithm.step == self.admit_at

    def grow(self):
        """After ``optimizer.step()`` of a step whose agreement said joiners wait: every member and the
        joiners form the next generation and rank 0 sends the joiners the state (``DistributedModel._admit``)."""
        t0 = time.monotonic()
        m, alg, mb = self.model, self.model.algorithm, self.membership
        self.grow_after_step = False
        g = mb.generation + 1
        old_world = m.world_size
        if m.rank == 0:
            members = mb.grown()
        else:
            from ._failfast import PeerFailedError

            watch = self._pulse_watch(mb.members)
            while not self.base.check([f"{KEY}/gen{g}/members"]):  # rank 0 publishes them at once
                try:
                    watch()
                except PeerFailedError as e:
                    raise MembershipError(f"bagua_lite: rank 0 did not publish generation {g}'s members while "
                                          f"admitting a joiner: {e}. Restart from a checkpoint") from e
                time.sleep(Membership.POLL_S)
            members = mb.read(g)
        mb.generation, mb.members = g, members
        self._use(g, members)
        m._admit(joining=False)  # regroups the algorithm where the joiner's constructor sets it up
        self.last_join = {"members": members, "seconds": time.monotonic() - t0}
        if self.callback is not None:
            self.callback(old_world, m.world_size)

    def close(self):
        """The model is closed: workers still waiting to join are told the job has ended (rank 0)."""
        try:  # not lost: an asynchronous peer still training stops watching this worker's heartbeat
            self.heartbeat.store.set(f"{KEY}/left/{self.membership.me}", "1")
        except Exception:  # noqa: BLE001 - the store may be gone with the job
            pass
        self.heartbeat.stop()
        if self.model.rank == 0:
            try:  # on the heartbeat's own client: the shared one may be held by a failed rendezvous
                self.heartbeat.store.set(f"{KEY}/closed", "1")
            except Exception:  # noqa: BLE001 - the store may be gone with the job
                pass

    def take_pending(self):
        """The MembershipChanged to raise now (once), or None."""
        pending, self.pending = self.pending, None
        return pending
