"""What an algorithm uses of its DistributedModel besides its buckets, parameters, optimizer, group, rank and
world size: running its own collectives on the engine with fail fast, and the peers' failure news."""
import warnings

import torch.distributed as dist

from ._failfast import PeerFailedError
from . import _groups, step_hooks
from ._groups import new_group_like


class Services:
    """A DistributedModel's services to its algorithm (a mixin: it shares the model's state)."""

    def __reduce_ex__(self, protocol):
        # copy.deepcopy and pickle (torch.save) both come here; the model's groups, engine and threads cannot
        # be copied, and a copy that made groups of its own would be a collective nobody else joins
        raise TypeError(
            f"a {type(self).__name__} cannot be copied or pickled (it holds process groups, an engine thread and "
            f"hooks): copy or save the module it wraps (AveragedModel(model.module) for EMA/SWA, "
            f"torch.save(model.state_dict()))")

    def _take_group(self, agree_on, fault_tolerant=False) -> None:
        """Keep this model's group, or, where another open model of this process already sends its engine's
        traffic on it (a GAN's generator and discriminator, a teacher trained beside its student), take a copy
        of its own (``new_group``): the two engines' collectives then never meet. Decided alike on every rank
        of ``agree_on``, which carries that one allreduce (every rank makes the copy); ``close()`` lets go of
        it. A fault-tolerant model refuses a group in use instead."""
        if fault_tolerant:  # no collective here: a joiner's constructor and the members' admission mirror each other
            if _groups.in_use(self.process_group):
                raise ValueError(f"{type(self).__name__}: fault_tolerant=True needs a process group no other open "
                                 f"model of this process uses (its membership changes remake the group); give the "
                                 f"other model one of its own: group=torch.distributed.new_group(...)")
        elif self.world_size > 1 and _groups.any_rank(_groups.in_use(self.process_group), agree_on):
            self.process_group = self.new_group()
        self._hold(self.process_group)

    def _hold(self, group) -> None:
        """Count this model as sending on ``group`` until ``close()`` (``_release_group``)."""
        self._held_groups = getattr(self, "_held_groups", []) + [group]
        _groups.hold(group, self)

    def _check_alone(self) -> None:
        """At each round: whether a torch DDP or FSDP made after this model sends on one of its groups in
        backward too (one made before it was found at wrapping, and this model took a copy). In one backward
        through both, their collectives and the engine's would meet in an order that differs across ranks
        (gloo aborts the process), so from then on backward's thread waits for the engine after every bucket
        it hands it: every collective on the group is then posted from that thread, in backward's order, on
        every rank. That costs the overlap, so it is named in a warning; it ends when that wrapper is dropped.
        Looked for again only when an instance of torch's wrappers was made or dropped (microseconds)."""
        if self.world_size == 1 or self._waits_every_bucket:
            return
        seen = _groups.senders_signature()
        if seen == self._senders_seen:
            return
        self._senders_seen = seen
        found = next(((g, users[0]) for g in getattr(self, "_held_groups", ()) for users in [_groups.torch_users(g)]
                      if users), None)
        serial = found is not None and self._elastic is None
        if found is not None and (serial != self._serial or not serial):
            group, user = found
            fix = (f"make the {user} before this model, which then takes a group of its own, or give it one "
                   f"(DistributedDataParallel(..., process_group=torch.distributed.new_group()); fully_shard(..., "
                   f"mesh=DeviceMesh.from_group(torch.distributed.new_group(), device_type)))")
            if serial:
                what = (f"so that, should one backward run through both, their collectives meet in one order on "
                        f"every rank, this model now waits for each bucket's communication before backward goes "
                        f"on (its overlap with backward is lost; the result is the same). To keep the overlap, {fix}")
            else:  # a fault-tolerant model's rounds recover from a lost peer at the end of backward
                what = (f"if one backward runs through both, their collectives meet in an order that differs across "
                        f"ranks (gloo aborts the process, or it hangs until the timeout): {fix}")
            warnings.warn(f"{type(self).__name__}: a torch {user} made after this model sends on its process group "
                          f"(ranks {dist.get_process_group_ranks(group)}) during backward, as this model does; "
                          f"{what}", stacklevel=3)
        self._serial = serial

    def _release_group(self) -> None:
        for group in getattr(self, "_held_groups", ()):
            _groups.release(group, self)

    def _undo_construction(self) -> None:
        """The constructor raised after taking hooks, a thread and the group: let go of them all, so that the
        module and optimizer train as they would have without it (a refused model's hooks went on firing in
        the backward and steps of the model wrapped next)."""
        for h in getattr(self, "_hooks", ()):
            h.remove()
        self._hooks = []
        step_hooks.forget(self)
        self._release_group()
        if getattr(self, "_elastic", None) is not None:
            self._elastic.close()
        if getattr(self, "_engine", None) is not None and not self._engine_abandoned:
            self._engine.shutdown()

    def fail(self, what: str) -> None:
        """Tell every peer that this model's communication failed (they raise ``PeerFailedError`` within a
        second instead of waiting for the process group's timeout). Never raises."""
        self._failfast.announce(what)

    def check_peers(self) -> None:
        """Raise :class:`PeerFailedError` if a peer announced a failure (looks at most twice a second)."""
        self._failfast.check_every()

    def peer_failed(self) -> bool:
        """Whether this model's communication is known to be broken, here or on a peer (never raises); with
        ``fault_tolerant=True`` also whether a member's heartbeat stood still (a stopped peer, which would
        hold an algorithm's thread in its collective until the group's timeout)."""
        if self._failfast.peer_failed():
            return True
        if self._elastic is not None:
            try:
                self._elastic.watch_every()
            except PeerFailedError:
                return True
        return False

    def new_group(self):
        """A new process group over this model's ranks, with its timeout, for an algorithm's own traffic (a
        thread's). Collective: every rank of the job calls it, in the same order."""
        return new_group_like(self.process_group)

    def wait_for(self, event, step=None) -> None:
        """``event.wait()`` for an algorithm's own thread's work, raising :class:`PeerFailedError` if a peer
        fails meanwhile (the thread may sit in a collective with the failed peer until the timeout), or closed
        the model before ``step``, the step the work was started in (default: the step this rank is in)."""
        self._failfast.wait_event(event, step)

    def _wait_engine(self):
        """Wait for every task on the engine, failing fast: a peer's announced failure raises
        PeerFailedError within POLL_S; this rank's own failure is announced to the peers."""
        try:
            self._failfast.wait_engine(self._engine)
        except PeerFailedError:
            self._engine.abandon()  # its worker may sit in a collective until the group's timeout
            self._engine_abandoned = True
            raise
        except RuntimeError as e:  # this rank's op failed (or its collective, with a peer's death)
            self._failfast.announce(str(e))
            raise

    def run_collective(self, what: str, fn):
        """Run ``fn()``, an algorithm's own collectives outside the buckets (a periodic weight average, the
        wait for a peer exchange), on the engine thread while this thread waits with fail fast: if a peer
        announced a failure this raises :class:`PeerFailedError` within a second instead of waiting out the
        process group's timeout (30 minutes by default). ``fn``'s result is returned."""
        self._failfast.raise_if_failed()
        result = []

        def op(_flat):
            result.append(fn())
        op.__name__ = what
        self._engine.submit(-2, self._no_tensor, [op])
        self._wait_engine()
        return result[0]
