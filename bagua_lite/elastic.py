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
import time

import torch.distributed as dist

from . import launch
from ._compat import group_timeout
from ._failfast import POLL_S, FailFast, PeerFailedError
from .membership import JOIN_POLL_S, KEY, Heartbeat, Membership, MembershipChanged, MembershipError, PulseWatch, reform
# re-exported: the store protocol's names as users and tests know them from here
from .membership import HEARTBEAT_S, broadcast_state, wait_for_admission  # noqa: F401


class MembershipView:
    """What an algorithm that opts into fault tolerance (``supports_membership_change``) sees of it, as
    ``model.membership`` (None without ``fault_tolerant=True``): where this worker stands in the job, and
    the few collectives a healing or admitting algorithm runs. An algorithm that does not opt in never
    needs it."""

    def __init__(self, controller):
        self._controller = controller

    @property
    def generation(self) -> int:
        """The membership's generation: 0 for the job's first members, one more for every change."""
        return self._controller.membership.generation

    @property
    def joining(self) -> bool:
        """Read in ``init``: this process is a worker admitted into a running job (it receives the state
        from rank 0 after ``init``), not one of the job's first members."""
        return self._controller.membership.generation > 0

    @property
    def member_id(self) -> int:
        """This worker's id for the job's lifetime (its first generation's rank; joiners count on from there),
        unlike ``model.rank``, which is its rank in the current generation's group."""
        return self._controller.membership.me

    @property
    def changing(self) -> bool:
        """A peer was lost in this step: it is discarded (nothing of it travels or is applied) and
        ``optimizer.step()`` raises :class:`MembershipChanged`."""
        return self._controller.pending is not None

    @property
    def admitting(self) -> bool:
        """Workers waiting to join are admitted after this step's ``optimizer.step()``, at the step rank 0 posted
        in the store (``Algorithm.store_admission_margin``): what must finish on the old group, finishes now."""
        return self._controller.admits_now()

    def joiners_waiting(self) -> int:
        """Rank 0: how many workers wait to join (looked up in the store at most every ``JOIN_POLL_S``); other
        ranks: 0. An algorithm whose own thread carries this news passes it on to every rank."""
        return self._controller.joiners_waiting()

    def admit_after_step(self) -> None:
        """Admit the workers waiting to join after this step's ``optimizer.step()`` (call on every rank alike)."""
        self._controller.grow_after_step = True

    def admit_now(self) -> None:
        """Admit the workers waiting to join now, at a step boundary (every rank alike)."""
        self._controller.grow()

    def gather_ints(self, values):
        """Every rank's list of ints (one all_gather on the control group; fails fast): a list per rank."""
        return self._controller.port.gather_ints(values)

    def share_state(self, src: int, receive: bool) -> None:
        """Rank ``src``'s parameters, buffers, optimizer state and algorithm shared state to every rank (a
        collective); ``receive``: this rank loads the optimizer's and the algorithm's (it was behind)."""
        self._controller.port.share_state(src, receive)


class Controller:
    """What ``DistributedModel(..., fault_tolerant=True)`` adds to the model: the membership, the step to
    discard (``pending``, raised by ``optimizer.step()``) and :meth:`recover`. It reads the model's public
    members and changes the model only through ``port``, the few operations the model lends it (its engine,
    its fail-fast key, its group, discarding a round, the collectives of an admission)."""

    def __init__(self, model, port, min_workers, on_membership_change, rejoin_window_s, membership=None,
                 heartbeat_timeout_s=10.0):
        self.model = model
        self.port = port
        self.min_workers = min_workers
        self.callback = on_membership_change
        self.backend, self.timeout = dist.get_backend(model.process_group), group_timeout(model.process_group)
        if membership is None:  # generation 0: every rank of the default group
            base = launch.job_store(port.failfast.store)
            if model.process_group is not dist.group.WORLD:
                raise ValueError("DistributedModel: fault_tolerant=True runs on the default process group (each "
                                 "generation's members make a new one); do not pass group=")
            if base.check([f"{KEY}/open"]):
                raise RuntimeError(
                    "DistributedModel: a fault-tolerant model already runs in this job (the store has "
                    f"{KEY}/open): one fault-tolerant model per job; a worker joining a running job calls "
                    "bagua_lite.init_process_group() first, which then makes no group and lets this model join")
            membership = Membership(base, KEY, range(model.world_size), model.rank, rejoin_window_s)
            port.failfast = FailFast(model.rank, f"{KEY}/gen0/failed")
            model.process_group.barrier().wait()  # every rank checked "open" before rank 0 sets it
            if model.rank == 0:
                base.set(f"{KEY}/gen0/members", ",".join(map(str, range(model.world_size))))
                base.set(f"{KEY}/world0", str(model.world_size))
                base.set(f"{KEY}/generation", "0")
                base.set(f"{KEY}/open", "1")
        else:  # a joiner, admitted
            port.failfast = FailFast(model.rank, f"{KEY}/gen{membership.generation}/failed")
        self.membership = membership
        self.base = membership.store
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat = getattr(membership, "heartbeat", None) or Heartbeat(self.base, membership.me)
        port.failfast.watch = self._pulse_watch(membership.members)
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
        started, t0 = time.time(), time.monotonic()
        m, alg, port = self.model, self.model.algorithm, self.port
        m.fail(f"{type(error).__name__}: {error}")  # the other survivors stop waiting
        port.renew_engine()  # the old one's worker may sit in a collective with the dead peer
        # The agreement can fail here after a peer got it whole (the dead worker's part reached some): those
        # apply the round. Keep this rank's result of it, to take the round late if they did.
        late = alg.kept_state.snapshot() if buckets_done else None
        port.discard_round()
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
                port.failfast.failed = msg
                raise MembershipError(msg) from error
            self.membership.members = members
            try:
                self._use(g, members)  # a member lost while gloo connects: MembershipError (heartbeat watch)
                steps = [r[0] for r in port.gather_ints([step])]  # one lost after it: its failure, fail fast
                break
            except (MembershipError, RuntimeError) as e:  # PeerFailedError is one
                tries += 1
                error = e
                FailFast(m.rank, f"{KEY}/gen{g}/failed").announce(f"lost while re-forming: {e}")  # the others
                port.renew_engine()  # of generation g stop waiting in its first collective
        healed = ""
        if periodic:
            try:
                alg.heal()
            except Exception as e:  # noqa: BLE001 - another failure while healing
                port.failfast.failed = str(e)
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
                port.failfast.failed = msg
                raise MembershipError(msg)
            if behind:  # the others applied the round whose agreement failed here: take it late
                alg.kept_state.restore(late)
                alg.commit_round()
            port.share_state(steps.index(hi), receive=behind)  # their weights, optimizer and step count
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
        self.admit_at = None  # a store admission posted for the last generation does not carry over
        watch = self._pulse_watch(members)
        pg = reform(self.base, g, members, self.membership.me, self.backend, self.timeout, watch)
        self.port.use_group(pg)
        self.port.failfast = FailFast(pg.rank(), f"{KEY}/gen{g}/failed")
        self.port.failfast.watch = watch
        if pg.rank() == 0:
            self.base.set(f"{KEY}/generation", str(g))

    def _pulse_watch(self, members):
        return PulseWatch(self.heartbeat.store, members, self.membership.me, self.heartbeat_timeout_s)

    def watch_every(self):
        """The heartbeat watch, at most every ``POLL_S`` seconds, for a training thread that never waits for
        its peers (asynchronous averaging: its thread's collectives would wait for a stopped peer until the
        group's timeout). A member that closed its model is not a lost one there."""
        now = time.monotonic()
        if now >= self._next_watch:
            self._next_watch = now + POLL_S
            self.port.failfast.watch(closed_ok=True)

    def joiners_waiting(self) -> int:
        """Rank 0: the number of workers waiting to join, looked up at most every JOIN_POLL_S (0 between);
        the others: 0. Rides in the step agreement, so every member learns it at the same step."""
        if self.model.rank != 0 or time.monotonic() < self.next_join_check \
                or not self.model.algorithm.admits_joiners:  # auto while it probes
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
                self.model.fail(msg)
                raise MembershipError(msg)

    def admits_now(self) -> bool:
        """After ``optimizer.step()``: store admission's step is reached."""
        return self.admit_at is not None and self.model.algorithm.step == self.admit_at

    def grow(self):
        """After ``optimizer.step()`` of a step whose agreement said joiners wait: every member and the
        joiners form the next generation and rank 0 sends the joiners the state (the model's admission)."""
        t0 = time.monotonic()
        m, mb = self.model, self.membership
        self.grow_after_step = False
        g = mb.generation + 1
        old_world = m.world_size
        if m.rank == 0:
            members = mb.grown()
        else:
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
        self.port.admit()  # regroups the algorithm where the joiner's constructor sets it up
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
