"""Step agreement: the one check that ranks are at the same optimizer step count where their collectives
pair up. A rank that took a step more or fewer than its peers would pair a bucket, an average or an
exchange with theirs one step apart, and the replicas would differ without a word (or gloo would abort on
messages of different sizes). Every rank compares the same numbers, so every rank raises alike, before
anything is applied.

The step count rides in a message the caller sends anyway, never in a collective of its own on the hot
path; there are two encodings and one comparison (:func:`span`, :func:`check`):

- per rank (:func:`steps_span`): the model's agreement of each round, an all_gather of a few ints per rank
  that also carries the non-finite and unused-parameter bits (the error lists every rank's count), posted
  with the last bucket where its row is known by then, else after the buckets;
  ``DistributedModel.check_in_step`` is the same all_gather on its own, for a periodic average;
- ``(step, -step)`` (:func:`encode`): the elementwise max over ranks is (highest, -lowest), so one MAX
  allreduce (:func:`post_max`: streaming DiLoCo's sync, gossip under ``all``) gives the range. Gossip's
  ring and shift_one exchanges are point to point, with no collective to ride in: the pair travels as a
  16-byte message to each peer, posted ahead of the data, and the peers' pairs as received give the range.
"""
import hashlib
import json
import threading
from typing import Callable, Iterable, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _compat, _control
from ._failfast import PeerFailedError
from .bucket import host_read

BITS = 62  # parameters per int64 word of the used-parameter bitmap
_ALL_USED = (1 << BITS) - 1


def encode(step: int, out: torch.Tensor = None) -> torch.Tensor:
    """``(step, -step)`` as int64 (into ``out`` if given): the message each rank contributes."""
    out = torch.empty(2, dtype=torch.int64) if out is None else out
    out[0], out[1] = step, -step
    return out


def post_max(encoded: torch.Tensor, group, async_op: bool = False):
    """MAX-allreduce an :func:`encode` d pair over ``group`` in place (it becomes (highest, -lowest))."""
    return dist.all_reduce(encoded, op=dist.ReduceOp.MAX, group=group, async_op=async_op)


def span(pairs: Iterable[torch.Tensor]) -> Tuple[int, int]:
    """(lowest, highest) step of :func:`encode` d pairs: peers' pairs as received, or a MAX-reduced one."""
    pairs = list(pairs)
    return -max(int(p[1]) for p in pairs), max(int(p[0]) for p in pairs)


def steps_span(steps: Sequence[int]) -> Tuple[int, int]:
    """(lowest, highest) of every rank's step count."""
    return min(steps), max(steps)


def check(lo: int, hi: int, error: Callable[[], str]) -> None:
    """Raise ``RuntimeError(error())`` unless every rank is at the same step (``lo == hi``)."""
    if lo != hi:
        raise RuntimeError(error())


def config_digest(algorithm, bucket_size_mb: float) -> int:
    text = json.dumps({"algorithm": algorithm.name, "options": algorithm.options(), "bucket_size_mb": bucket_size_mb},
                      sort_keys=True, default=repr)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _digest(obj) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(obj).encode()).digest()[:7], "little")


class RoundAgreement:
    """DistributedModel's agreement between ranks (a mixin: it shares the model's state): the config check at
    set-up, and after every synchronised round's buckets one all_gather that says whether every rank is at
    the same step, whether any rank's gradient held inf/NaN (the round is committed or discarded on every
    rank) and which parameters no rank used."""

    #: the buckets' non-finite flags where the checks stay on the device (bucket.defer_nonfinite_checks)
    _nonfinite_flags = None
    #: the round's agreement posted with the last bucket (:meth:`_agreement_op`): [work (True: one rank's row,
    #: made), rows]
    _posted = None
    #: this round's non-finite verdict stays on the device (bagua_lite.verdict): no flag is read on the host
    _verdict_round = False

    def _check_same_config(self):
        """One all_gather of two digests: the algorithm's config and the module's parameter layout (names,
        shapes, dtypes, requires_grad, as DDP checks). A mismatch raises on every rank, naming the ranks
        (and, for the layout, the first differing parameter) before any collective that could abort."""
        layout = [(name, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
                  for name, p in self.module.named_parameters()]
        configured = getattr(self, "configured_algorithm", self.algorithm)  # auto, also once it picked
        mine = torch.tensor([config_digest(configured, self.bucket_size_mb), _digest(layout)], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self.control_group)
        differ = [r for r, d in enumerate(everyone) if int(d[0]) != int(everyone[0][0])]
        if differ:
            raise ValueError(f"DistributedModel: ranks were started with different configurations: rank(s) "
                             f"{differ} differ from rank 0 (this is rank {self.rank}, running "
                             f"{configured!r}, bucket_size_mb={self.bucket_size_mb})")
        differ = [r for r, d in enumerate(everyone) if int(d[1]) != int(everyone[0][1])]
        if differ:
            layouts = [None] * self.world_size
            dist.all_gather_object(layouts, layout, group=self.control_group)
            r, ref, other = differ[0], layouts[0], layouts[differ[0]]
            i = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
            what = lambda entry: ("no parameter" if entry is None else  # noqa: E731
                                  f"{entry[0]!r} shape {list(entry[1])} {entry[2]} requires_grad={entry[3]}")
            raise ValueError(
                f"DistributedModel: the model differs across ranks: rank(s) {differ} differ from rank 0 "
                f"(this is rank {self.rank}); first difference, parameter #{i}: rank 0 has "
                f"{what(ref[i] if i < len(ref) else None)}, rank {r} has {what(other[i] if i < len(other) else None)}. "
                f"Every rank must build the same model and freeze the same parameters")

    def _gather_ints(self, values, group=None, on_engine=False):
        """Every rank's list of ints (one all_gather of len(values) int64 per rank), as a list per rank.
        ``on_engine``: called from an op on the engine thread (else, with fault_tolerant, it runs there)."""
        if self.world_size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        out = torch.empty(self.world_size * len(values), dtype=torch.int64)
        pg = _control.of(self.process_group if group is None else group)
        if self._elastic is not None and not on_engine:  # so that a peer's failure is seen, not waited for
            try:
                self.run_collective("step agreement", lambda: _compat.all_gather_single(out, mine, group=pg))
            except (PeerFailedError, RuntimeError) as e:
                self._elastic.comm_error = e
                raise
            return out.view(self.world_size, len(values)).tolist()
        try:  # blocking: a peer that failed in this round's buckets never gets here (they fail fast)
            _compat.all_gather_single(out, mine, group=pg)
        except RuntimeError as e:
            self._failfast.announce(f"a step-control all_gather failed: {e}")
            raise
        return out.view(self.world_size, len(values)).tolist()

    def _gather_with_joiners(self, values, group=None, on_engine=False):
        """:meth:`_gather_ints`, with fault tolerance on the model's group also carrying rank 0's count of
        workers waiting to join (so every member learns it at the same step and admits them after it);
        returned without that column."""
        if self._elastic is None or group is not None:
            return self._gather_ints(values, group, on_engine)
        rows = self._gather_ints([self._elastic.joiners_waiting()] + list(values), group, on_engine)
        if any(row[0] for row in rows):
            self._elastic.grow_after_step = True  # on every rank alike
        return [row[1:] for row in rows]

    def _step_count_check(self, _flat):
        """Before any bucket travels: do all ranks enter this round at the same step count?"""
        self._check_steps([r[0] for r in self._gather_ints([self.algorithm.step], on_engine=True)],
                          "nothing was exchanged")

    def _check_steps(self, steps, what):
        """Raise (``agreement.check``) unless every rank's step count in ``steps`` is the same."""
        check(*steps_span(steps), lambda: self._out_of_step(steps, what))

    def _out_of_step(self, steps, what):
        """The error for ranks whose step counts differ, or None."""
        lo, hi = steps_span(steps)
        if lo == hi:
            return None
        by_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
        return (f"bagua_lite: ranks are out of step: a synchronised backward started at different optimizer step "
                f"counts ({by_rank}; this is rank {self.rank}). Every rank must call backward() and "
                f"optimizer.step() the same number of times (a rank took an extra step or skipped one); {what} "
                f"in this round")

    def _round_values(self, unused, flags=True):
        """This rank's row of the agreement: first non-finite bucket (-1: none), step count, used-bit words.
        ``flags``: with the checks left on the device, read their flags too (one host read); False: the
        row of what the host knows (:meth:`_agreement_op` reads the flags on the engine's thread)."""
        bad = set(self.algorithm.nonfinite_buckets)
        if flags and self._nonfinite_flags is not None:
            bad.update(i for i, v in enumerate(host_read(self._nonfinite_flags)) if v)
        words = [_ALL_USED] * self._used_words  # bit set: used on this rank
        for i in unused:
            words[i // BITS] &= ~(1 << (i % BITS))
        return [min(bad) if bad else -1, self.algorithm.step] + words

    def _agreement_op(self, unused):
        """The round's agreement as the first op of the last bucket, posted without waiting, so its all_gather
        travels with that bucket's collectives instead of after them (on a latency-bound step it was a round
        trip of its own). By the time the last bucket is submitted every gradient went through its fill
        check and the unused parameters are known (``unused``; a last bucket completed by the hooks had all
        its parameters used, and so had every earlier bucket). In the engine's one order it pairs with the
        same collective on every rank. Where the checks stay on the device, their flags are read here, on
        the engine's thread, which waits for the fills that set them (the backward's last kernels), not for
        the buckets' collectives, and the training thread waits for no flag at all (one rank alone makes no
        collective: its row is the agreement). None where the agreement carries more (fault tolerance: the
        joiners, run_collective) or one rank needs none: :meth:`_agree_after_round` then gathers after the
        buckets, else it waits for this one."""
        self._posted = None
        flags = None if self._verdict_round else self._nonfinite_flags
        if self._elastic is not None or (self.world_size == 1 and flags is None):
            return None
        values = self._round_values(unused, flags=False)
        out = torch.empty(self.world_size * len(values), dtype=torch.int64)
        pg = None if self.world_size == 1 else _control.of(self.process_group)
        posted = self._posted = [None, out]

        def step_agreement(_flat):
            if flags is not None:  # the first bad bucket of those the host knew and those flagged
                known = [values[0]] if values[0] >= 0 else []
                values[0] = min([i for i, v in enumerate(host_read(flags)) if v] + known, default=-1)
            if pg is None:  # one rank: its row is the agreement
                out.copy_(torch.tensor(values, dtype=torch.int64))
                posted[0] = True
                return
            posted[0] = _compat.all_gather_single(out, torch.tensor(values, dtype=torch.int64), group=pg,
                                                  async_op=True)
        return step_agreement

    def _take_posted(self):
        """The rows of the agreement :meth:`_agreement_op` posted (after the engine's wait), or None."""
        posted, self._posted = self._posted, None
        if posted is None:
            return None
        work, out = posted
        if work is None:  # the engine ran the round's buckets without it: a bug, never a guess at the rows
            raise RuntimeError("bagua_lite: internal error: the round's agreement was not posted with its last bucket")
        if work is True:
            return out.view(self.world_size, -1).tolist()
        try:
            if not work.is_completed():  # wait failing fast: a peer that failed after its buckets never posts it
                done = threading.Event()
                work.get_future().add_done_callback(lambda _f: done.set())
                self._failfast.wait_event(done)
            work.wait()
        except PeerFailedError:
            raise
        except RuntimeError as e:
            self._failfast.announce(f"a step-control all_gather failed: {e}")
            raise
        return out.view(self.world_size, -1).tolist()

    def _agree_after_round(self, unused):
        """After the buckets, one all_gather: did any rank's gradient hold inf/NaN (commit or discard the
        round on every rank), and which parameters did no rank use (their ``.grad`` becomes None, as with
        DDP, so weight decay and momentum leave them alone)? ``unused``: this rank's unused parameters."""
        rows = self._take_posted()
        if rows is None:
            rows = self._gather_with_joiners(self._round_values(unused, flags=not self._verdict_round))
        firsts = [row[0] for row in rows]
        msg = self._out_of_step([row[1] for row in rows], "nothing was applied")
        if msg:
            self.algorithm.kept_state.roll_back()
            self._failfast.announce(msg)  # the model is failed: forward() and optimizer.step() refuse
            raise RuntimeError(msg)
        if any(w != _ALL_USED for row in rows for w in row[2:]):  # some rank left some parameter out
            used = [0] * self._used_words
            for row in rows:
                used = [a | b for a, b in zip(used, row[2:])]
            for i, p in enumerate(self.params):
                if not used[i // BITS] >> (i % BITS) & 1:
                    p.grad = None
        ranks = [r for r, b in enumerate(firsts) if b >= 0]
        if not ranks:
            self.algorithm.commit_round()
            self._round_versions = [b.flat._version for b in self.buckets]  # (a zero_grad in place moves them)
            if self._verdict_round:  # left on the device, for optimizer.step() to hand over
                self._verdict.pending = True
            return
        self.algorithm.kept_state.roll_back()
        with torch.no_grad():
            for b in self.buckets:
                b.flat.fill_(float("nan"))
        where = ", ".join(f"rank {r} (bucket {firsts[r]} first)" for r in ranks)
        self._nonfinite_error = (
            f"bagua_lite: non-finite gradient (inf or NaN) at step {self.algorithm.step} on {where}; every rank "
            f"skipped this round: .grad is NaN on all ranks and {self.algorithm.name}'s state (residuals, "
            f"momenta) is as before it. A loss scaler (torch.amp.GradScaler) skips such steps; without one, "
            f"optimizer.step() refuses to apply it (this is rank {self.rank}). Look for what produced the "
            f"inf/NaN: learning rate, loss, inputs")

    def check_in_step(self, what: str, group=None) -> None:
        """Raise on every rank unless all ranks are at the same step count: one all_gather of one int.
        ``what`` says what the check guards ("nothing was exchanged"). Blocking: call it where the
        collective belongs, e.g. inside :meth:`run_collective`'s function ahead of a periodic average."""
        rows = self._gather_with_joiners([self.algorithm.step], group, on_engine=True)
        self._check_steps([r[0] for r in rows], what)