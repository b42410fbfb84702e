"""Step agreement: the one check that ranks are at the same optimizer step count where their collectives
pair up. A rank that took a step more or fewer than its peers would pair a bucket, an average or an
exchange with theirs one step apart, and the replicas would differ without a word (or gloo would abort on
messages of different sizes). Every rank compares the same numbers, so every rank raises alike, before
anything is applied.

The step count rides in a message the caller sends anyway, never in a collective of its own on the hot
path; there are two encodings and one comparison (:func:`span`, :func:`check`):

- per rank (:func:`steps_span`): the model's agreement after the buckets, an all_gather of a few ints per
  rank that also carries the non-finite and unused-parameter bits (the error lists every rank's count);
  ``DistributedModel.check_in_step`` is the same all_gather on its own, for a periodic average;
- ``(step, -step)`` (:func:`encode`): the elementwise max over ranks is (highest, -lowest), so one MAX
  allreduce (:func:`post_max`: streaming DiLoCo's sync, gossip under ``all``) gives the range. Gossip's
  ring and shift_one exchanges are point to point, with no collective to ride in: the pair travels as a
  16-byte message to each peer, posted ahead of the data, and the peers' pairs as received give the range.
"""
from typing import Callable, Iterable, Sequence, Tuple

import torch
import torch.distributed as dist


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
