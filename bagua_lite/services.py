"""What an algorithm uses of its DistributedModel besides its buckets, parameters, optimizer, group, rank and
world size: running its own collectives on the engine with fail fast, and the peers' failure news."""
from ._failfast import PeerFailedError
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
