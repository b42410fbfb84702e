"""The framework's side of ``Algorithm.register_state``: what an algorithm declared, kept, rolled back and
snapshotted for it."""
import torch

from . import _C


class KeptState:
    """What an algorithm declared with :meth:`Algorithm.register_state`, and what the framework does with it
    (the model and fault tolerance call these; an algorithm only registers): copy the ``rollback=True``
    tensors aside before a synchronised round, put them back when the round is discarded, snapshot and
    restore all of them (a survivor taking a round late)."""

    def __init__(self):
        self._kept = {}  # name -> (tensors, their backups or None)
        self._shared = set()  # registered with shared=True: the same on every rank (a joiner copies it)
        self._working = []  # register_working_copies: callables -> [(working copy, the state it replaces)]

    def add(self, name, tensors, rollback, shared):
        self._kept[name] = (tensors, [torch.empty_like(t) for t in tensors] if rollback else None)
        if shared:
            self._shared.add(name)
        else:
            self._shared.discard(name)

    def add_working(self, pairs) -> None:
        self._working.append(pairs)

    def items(self):
        """(name, tensors) of every registered state, in registration order."""
        return [(name, tensors) for name, (tensors, _) in self._kept.items()]

    def tensors(self, name):
        return self._kept[name][0]

    def shared(self):
        """The names registered with ``shared=True``, sorted."""
        return sorted(self._shared)

    def begin_round(self) -> None:
        """Before a synchronised round's first bucket op: the ``rollback=True`` tensors copied aside."""
        for tensors, backups in self._kept.values():
            if backups is not None:
                for b, t in zip(backups, tensors):
                    b.copy_(t)

    def roll_back(self) -> None:
        """The round is discarded: the ``rollback=True`` tensors as :meth:`begin_round` found them."""
        for tensors, backups in self._kept.values():
            if backups is not None:
                for b, t in zip(backups, tensors):
                    t.copy_(b)

    def roll_back_flagged(self, flags) -> None:
        """:meth:`roll_back` decided on the device: the ``rollback=True`` tensors put back only where one of
        ``flags`` (int32, on their device) is set, with no host read (bagua_lite.verdict); and each working
        copy declared with ``register_working_copies`` made equal to the state it would replace there, so that
        the swap that ``commit_round`` makes on the host keeps the state as it was."""
        for tensors, backups in self._kept.values():
            if backups is not None:
                for b, t in zip(backups, tensors):
                    _C.copy_flagged_(t, b, flags)
        for pairs in self._working:
            for working, state in pairs():
                _C.copy_flagged_(working, state, flags)

    def snapshot(self):
        """Copies of every registered tensor (for :meth:`restore`)."""
        return [[t.clone() for t in tensors] for tensors, _ in self._kept.values()]

    def restore(self, snapshot) -> None:
        for (tensors, _), kept in zip(self._kept.values(), snapshot):
            for t, k in zip(tensors, kept):
                t.copy_(k)
