"""Fault tolerance's side of a DistributedModel: its arguments checked, and a joiner's admission (what a
joiner's constructor receives and every member sends, in the constructor's order). The membership itself
is :mod:`bagua_lite.elastic`'s."""
import torch
import torch.distributed as dist

from . import comm, launch
from .membership import HEARTBEAT_S, PulseWatch, broadcast_state, reform, wait_for_admission


def check_fault_tolerant(algorithm, min_workers, callback, window, world_size, heartbeat):
    """``fault_tolerant=True``'s arguments, refused before any traffic (the same on every rank)."""
    if not algorithm.supports_membership_change:
        raise ValueError(
            f"DistributedModel: fault_tolerant=True needs an algorithm that carries on when the membership "
            f"changes (Algorithm.supports_membership_change): every built-in one does, with any options "
            f"(gradient_allreduce, topk, gtopk, powersgd, qadam, local_sgd, diloco, decentralized, "
            f"low_precision_decentralized, async_model_average, and auto when each of its candidates does); "
            f"got {algorithm.name} ({algorithm!r}), which does not say it does (docs/fault_tolerance.md: what an "
            f"algorithm of one's own needs)")
    top = world_size if world_size is not None else float("inf")  # a joiner does not know the size yet
    if not isinstance(min_workers, int) or isinstance(min_workers, bool) or not 1 <= min_workers <= top:
        raise ValueError(f"DistributedModel: min_workers must be an int in [1, world size {world_size}], "
                         f"got {min_workers!r}")
    if callback is not None and not callable(callback):
        raise TypeError(f"DistributedModel: on_membership_change must be callable(old_world_size, "
                        f"new_world_size), got {type(callback).__name__}")
    if not isinstance(window, (int, float)) or isinstance(window, bool) or not 0 < window < 3600:
        raise ValueError(f"DistributedModel: rejoin_window_s must be a number of seconds in (0, 3600), got "
                         f"{window!r}")
    if not isinstance(heartbeat, (int, float)) or isinstance(heartbeat, bool) or not 1 <= heartbeat <= 86400:
        raise ValueError(f"DistributedModel: heartbeat_timeout_s must be a number of seconds in [1, 86400] (at "
                         f"least two heartbeats of {HEARTBEAT_S} s), got {heartbeat!r}")


def join_running_job(algorithm, group, fault_tolerant, min_workers, on_membership_change, rejoin_window_s,
                     heartbeat_timeout_s):
    """In a DistributedModel's constructor: when this process joins a running fault-tolerant job
    (``bagua_lite.init_process_group()`` found it in the store and made no process group), wait to be
    admitted and make the new generation's group; its Membership, or None for a process that does not join."""
    join = launch.joining()
    if join is None:
        return None
    joining, (backend, timeout) = join
    if fault_tolerant is not True or group is not None:
        raise RuntimeError(
            "DistributedModel: this process joins a running fault-tolerant job (bagua_lite.init_process_group"
            "() found it in the store and made no process group): build the model with fault_tolerant=True "
            "and no group=, as the job's other workers did")
    check_fault_tolerant(algorithm, min_workers, on_membership_change, rejoin_window_s, None, heartbeat_timeout_s)
    membership = wait_for_admission(joining, rejoin_window_s)
    reform(joining, membership.generation, membership.members, membership.me, backend, timeout,
           watch=PulseWatch(membership.heartbeat.store, membership.members, membership.me, heartbeat_timeout_s))
    return membership


class Admission:
    """The collectives that bring a joiner (or a survivor behind) to the members' state (a mixin)."""

    def _admit(self, joining: bool):
        """Fault tolerance, a joiner admitted (generation just formed): what a joiner's constructor sends
        and receives, mirrored on every member, in the constructor's order: the config check, rank 0's
        parameters and buffers, the algorithm's set-up on the new group (``init`` on the joiner, ``regroup``
        on the members: it may make process groups), then the optimizer's state and the algorithm's shared
        state, which a joiner loads."""
        if not joining:
            self._check_same_config()
            self._share_weights(0, keep_own=self.algorithm.replicas_differ)
            if self.configured_algorithm is not self.algorithm:  # auto's pick: a joiner's auto takes it in init
                box = [self.configured_algorithm.state_dict() if self.rank == 0 else None]
                dist.broadcast_object_list(box, group_src=0, group=self.control_group)
            self.algorithm.regroup()
            for b in self.buckets:
                b.ops = list(self.algorithm.bucket_ops(b))
        self._share_state(0, receive=joining, weights=False)

    def _share_weights(self, src: int, keep_own: bool = False):
        """Rank ``src``'s parameters and buffers to every rank (a collective); ``keep_own``: this rank
        receives them into scratch copies and keeps its own (replicas that differ by design)."""
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                comm.broadcast(t.data.clone() if keep_own and self.rank != src else t.data, src,
                               self.process_group)

    def _share_state(self, src: int, receive: bool, weights: bool = True):
        """Rank ``src``'s parameters and buffers (``weights``), optimizer state and algorithm shared state to
        every rank (a collective); ``receive``: this rank loads the latter two (a joiner, a survivor behind)."""
        if weights:
            self._share_weights(src)
        state = {"optimizer": self.optimizer.state_dict(), "algorithm": self.algorithm.shared_state_dict()} \
            if self.rank == src else None
        state = broadcast_state(state, self.process_group, src)
        if receive:
            self.optimizer.load_state_dict(state["optimizer"])
            self.algorithm.load_shared_state_dict(state["algorithm"])
