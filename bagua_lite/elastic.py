"""Survivors carry on: ``DistributedModel(..., fault_tolerant=True)`` keeps training when a worker dies.

    model = bagua_lite.DistributedModel(net, opt, "gradient_allreduce", fault_tolerant=True, min_workers=2)
    for x, y in loader:
        try:
            loss_fn(model(x), y).backward(); opt.step()
        except bagua_lite.MembershipChanged:
            pass                      # this step was discarded on every survivor; the next one runs
        opt.zero_grad()

When a peer dies (its collective raises on a neighbour, which tells the others through the fail-fast key),
every survivor, in whatever call of the step it learns it (forward, backward):

1. discards the step in flight: the algorithm's ``register_state(..., rollback=True)`` tensors are put
   back, the algorithm's own transient state is reset (``Algorithm.regroup``), the buckets are zeroed, the
   optimizer is not touched, the step count does not advance; the engine that may sit in a collective
   with the dead peer is abandoned and a new one started;
2. agrees on the new membership through the rendezvous store (:class:`Membership`): it registers under the
   next generation number; the set is closed once every member of the last generation registered, or
   ``rejoin_window_s`` seconds after this rank registered, by one atomic ``compare_set`` that only the first
   closer wins, so every survivor reads the same set (a rank registering after it is excluded and raises);
3. builds a new process group among the members (torch's own, ``dist.new_group`` on the rendezvous store,
   the old group's backend and timeout), checks on it that every member is at the same step count, and
   rebuilds what depends on the group: ``process_group``, ``rank``, ``world_size``, the fail-fast key, the
   algorithm's bucket ops. Per-rank state that stays consistent is kept (error-feedback residuals,
   Top-k/gTop-k residuals and momenta, PowerSGD's residuals and Q's: each survivor's own);
4. calls ``on_membership_change(old_world_size, new_world_size)`` (learning rate, batch accounting), and
   ``optimizer.step()`` of that step raises :class:`MembershipChanged`: catch it and go on with the next
   batch. ``rank`` and ``world_size`` of the model are the new ones from then on (a survivor's data
   stays its own: the global rank, ``torch.distributed.get_rank()``, does not change).

Fewer than ``min_workers`` left: every survivor raises :class:`MembershipError` instead (save a checkpoint
from the last good state you kept, and restart). The store must outlive any worker: a TCPStore/FileStore
served outside the workers (each worker a client: ``TORCHELASTIC_USE_AGENT_STORE=True`` with
``bagua_lite.init_process_group``); a store hosted by a worker (plain ``env://``: rank 0 serves it) dies with
it, and then nothing can agree. Not under torchrun: its agent tears every worker down when one fails.
"""
import time

import torch.distributed as dist


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
    """The member set (global ranks) of one fault-tolerant model, one generation after another, agreed
    through ``store`` under ``key``. Generation 0 is every rank of the model's first group."""

    POLL_S = 0.02

    def __init__(self, store, key, members, me, window_s):
        self.store, self.key, self.members, self.me, self.window_s = store, key, list(members), me, window_s
        self.generation = 0

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
        members = [int(r) for r in self.store.get(closed).decode().split(",")]
        self.generation = g
        if self.me not in members:
            raise MembershipError(
                f"bagua_lite: rank {self.me} registered for generation {g} after the survivors had closed it "
                f"({members}, {self.window_s} s after the first of them registered): it is no longer a member. "
                f"A rank that is busy longer than rejoin_window_s when a peer fails is left out; raise the window")
        return members


def new_group(members, like):
    """A process group over the global ranks ``members`` with ``like``'s backend and timeout, created by
    the members only (the others may be dead)."""
    from ._groups import group_timeout
    return dist.new_group(members, timeout=group_timeout(like), backend=dist.get_backend(like),
                          use_local_synchronization=True)


class Controller:
    """What ``DistributedModel(..., fault_tolerant=True)`` adds to the model: the membership, the step to
    discard (``pending``, raised by ``optimizer.step()``) and :meth:`recover`."""

    def __init__(self, model, min_workers, on_membership_change, rejoin_window_s):
        self.model = model
        self.min_workers = min_workers
        self.callback = on_membership_change
        self.key = model._failfast.key.replace("/failed/", "/membership/")
        self.membership = Membership(model._failfast.store, self.key,
                                     dist.get_process_group_ranks(model.process_group), dist.get_rank(),
                                     rejoin_window_s)
        self.pending = None       # the MembershipChanged that this step's optimizer.step() raises
        self.comm_error = None    # the last exception of the model's own step-control collective
        #: the last recovery: when it started (time.time()), seconds to agree on the members, seconds to
        #: build the new group and check it
        self.last_recovery = None

    def recover(self, error):
        """A collective of this step failed (``error``): discard the step, agree on the survivors, re-form
        the group and rebuild what depends on it; or raise (see the module docstring)."""
        import torch

        from . import _C
        from ._failfast import FailFast

        started, t0 = time.time(), time.monotonic()
        m, alg = self.model, self.model.algorithm
        m._failfast.announce(f"{type(error).__name__}: {error}")  # the other survivors stop waiting
        if not m._engine_abandoned:
            m._engine.abandon()  # its worker may sit in a collective with the dead peer
        m._engine, m._engine_abandoned = _C.Engine(), False
        alg._roll_back()
        with torch.no_grad():
            for b in m.buckets:
                b.flat.zero_()
        old_members, old_world, step = self.membership.members, m.world_size, alg.step
        members = self.membership.next()
        g = self.membership.generation
        t1 = time.monotonic()
        if len(members) == len(old_members):
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
        pg = new_group(members, m.process_group)
        m.process_group, m.rank, m.world_size = pg, pg.rank(), pg.size()
        m._failfast = FailFast(m.rank, f"{self.key}/gen{g}/failed")
        self.membership.members = members
        try:
            steps = [r[0] for r in m._gather_ints([step])]
        except Exception as e:  # noqa: BLE001 - another failure while re-forming
            m._failfast.failed = str(e)
            raise MembershipError(f"bagua_lite: a peer failed again while the survivors {members} re-formed "
                                  f"the group (generation {g}): {e}") from e
        if len(set(steps)) > 1:
            msg = (f"bagua_lite: the survivors {members} had applied different steps when the peer failed "
                   f"(step counts {steps}): the failure came while the last step was being agreed, and some "
                   f"applied it; this slice of fault tolerance cannot heal that. Restart from a checkpoint")
            m._failfast.failed = msg
            raise MembershipError(msg)
        alg.regroup()
        for b in m.buckets:
            b.ops = list(alg.bucket_ops(b))
        self.last_recovery = {"started_at": started, "membership_s": t1 - t0, "regroup_s": time.monotonic() - t1}
        if self.callback is not None:
            self.callback(old_world, m.world_size)
        self.pending = MembershipChanged(
            f"bagua_lite: a peer left at step {step} (world size {old_world} -> {m.world_size}, generation {g}, "
            f"global ranks {members}): the step was discarded on every survivor, nothing of it was applied, and "
            f"the model now runs on the survivors' group (this rank is {m.rank} of {m.world_size}). Go on with "
            f"the next batch", old_world, m.world_size, g)

    def take_pending(self):
        """The MembershipChanged to raise now (once), or None."""
        pending, self.pending = self.pending, None
        return pending
