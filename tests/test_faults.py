"""Faults: a rank whose communication fails while its process stays alive, a killed rank, a stopped rank.

The process groups here use torch's default 30-minute timeout where the point is that nobody waits for it
(fail fast through the store), and a short one where a stopped (SIGSTOP) rank can only be detected by the
timeout. Every survivor must raise, naming what failed, never hang.
"""
import concurrent.futures
import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua_lite
from bagua_lite.algorithms import build
from cluster import Cluster, RemoteError

D_IN, HIDDEN, CLASSES = 12, 32, 5


@bagua_lite.algorithms.register("fails_on_rank1_test")
class FailsOnRank1(bagua_lite.Algorithm):
    """Dense averaging whose bucket op raises on rank 1 at step 2 before posting its collective (as a bug
    or a bad value in a user's algorithm would), so the peers are left waiting in theirs."""

    def bucket_ops(self, bucket):
        def average_or_fail(flat):
            if self.model.rank == 1 and self.step == 2:
                raise ValueError("a deliberate failure in bucket op average_or_fail")
            bagua_lite.comm.allreduce(flat, "avg", group=self.process_group)
        return [average_or_fail]


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


def _batch(rank, step):
    g = torch.Generator().manual_seed(rank * 7919 + step * 31 + 5)
    x = torch.randn(16, D_IN, generator=g)
    return x, (x[:, :CLASSES] * 3).argmax(1)


def _step(model, opt, rank, s):
    x, y = _batch(rank, s)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _tell_rank1(what, rank):
    """A peer of rank 1 says it got this far (rank 1 waits for it in :func:`_peers_reached`)."""
    dist.distributed_c10d._get_default_store().set(f"test_faults/{what}/{rank}", "1")


def _peers_reached(what, P, wait_s=60):
    """On rank 1, alive after its own failure: wait until every peer said ``what``; whether they all did.

    A peer that would only raise once rank 1's process ends, or once the group's timeout (30 min) passes,
    never says it while rank 1 waits here, so this proves the fail-fast path without timing anything;
    ``wait_s`` only bounds the wait in that case, so that the test fails instead of hanging."""
    keys = [f"test_faults/{what}/{r}" for r in range(P) if r != 1]
    try:
        dist.distributed_c10d._get_default_store().wait(keys, datetime.timedelta(seconds=wait_s))
    except RuntimeError:  # the store's wait timed out
        return False
    return True


def _r_fail_alive(rank, P):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = bagua_lite.DistributedModel(net, opt, build("fails_on_rank1_test"), bucket_size_mb=0.001)
    t0, s = None, 0
    try:
        for s in range(6):
            t0 = time.monotonic()
            _step(model, opt, rank, s)
        return ("no error", 0.0, "", "", s, None)
    except Exception as e:  # noqa: BLE001 - the user's "catch and carry on" pattern
        elapsed = time.monotonic() - t0
        peers_raised = None
        if rank == 1:
            peers_raised = _peers_reached("raised", P)  # stays alive (evaluation, logging...) meanwhile
        else:
            _tell_rank1("raised", rank)
        try:
            model(_batch(rank, 0)[0])
            after = "forward worked"
        except RuntimeError as again:
            after = str(again)
        return (type(e).__name__, elapsed, str(e), after, s, peers_raised)
    finally:
        model.close()


@pytest.mark.parametrize("P", (3, 4), ids=lambda p: f"P{p}")
def test_failure_on_a_live_rank_fails_every_peer_fast(P):
    """torch's default timeout (30 min): while rank 1 stays alive, every peer raises in the step rank 1
    failed in, naming rank 1 and its op."""
    c = Cluster(P, timeout_s=1800)
    try:
        res = c.run(_r_fail_alive, timeout=60)
    finally:
        c.close()
    what, elapsed, msg, after, step, peers_raised = res[1]
    assert what == "RuntimeError" and "average_or_fail" in msg and "deliberate failure" in msg, res[1]
    assert step == 2, res[1]
    assert peers_raised, f"not every peer raised while rank 1 stayed alive: {res}"
    for r in set(range(P)) - {1}:
        what, elapsed, msg, after, step, _ = res[r]
        assert what == "PeerFailedError", (r, res[r])
        assert step == 2, f"rank {r} raised in step {step}, not in step 2 where rank 1 failed"
        assert "rank 1:" in msg and "average_or_fail" in msg, (r, msg)
        assert "communication failed earlier" in after, (r, after)  # the model stays failed
        print(f"P={P} rank {r}: PeerFailedError {elapsed:.2f} s into step 2")


# ---- a live rank's failure in an algorithm's own communication (not its buckets) ---------------------
def _fail_on_call(fn, n, what):
    """``fn`` that raises on its n-th call (1-based), as a bug or a bad value would."""
    calls = [0]

    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == n:
            raise ValueError(f"a deliberate failure in {what}")
        return fn(*a, **kw)
    return wrapped


OWN = {  # label: (algorithm options, what fails on rank 1)
    "local_sgd": ({"period": 2}, "averager.start_sync"),  # its weight average, on the engine
    "decentralized": ({}, "_exact_deltas"),  # after its exchange, on the training thread
    "low_precision_decentralized": ({}, "_compressed_exchange"),  # on its exchange thread, before sending
    "async_model_average": ({"sync_interval_ms": 20}, "averager.reduce"),  # on its averaging thread
    "diloco": ({"period": 2, "overlap": 1}, "averager.reduce_work"),  # a streaming sync, on its thread
}


def _r_own_failure(rank, P, label):
    options, target = OWN[label]
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    alg = build(label, **options)
    model = bagua_lite.DistributedModel(net, opt, alg, bucket_size_mb=0.001)
    if rank == 1:
        owner, attr = (alg.averager, target.split(".")[1]) if "." in target else (alg, target)
        setattr(owner, attr, _fail_on_call(getattr(owner, attr), 3, target))
    t_end = time.monotonic() + 25
    try:
        s = 0
        while time.monotonic() < t_end:
            _step(model, opt, rank, s)
            s += 1
            if label == "async_model_average":
                time.sleep(0.01)
        result = ("no error", time.time(), "")
    except Exception as e:  # noqa: BLE001 - the user's "catch and carry on" pattern
        result = (type(e).__name__, time.time(), str(e))
    peers_closed = None
    if rank == 1:
        # stays alive (evaluation, logging...), its model still open, until every peer has raised and closed
        peers_closed = _peers_reached("closed", P)
    t0 = time.monotonic()
    model.close()
    close_s = time.monotonic() - t0
    if rank != 1:
        _tell_rank1("closed", rank)
    return result + (close_s, peers_closed)


@pytest.mark.parametrize("label", list(OWN))
@pytest.mark.parametrize("P", (3, 4), ids=lambda p: f"P{p}")
def test_live_failure_in_an_algorithms_own_communication_fails_every_peer_fast(P, label):
    """torch's default timeout (30 min): a periodic average, a peer exchange, an exchange thread or a
    background averaging thread fails on rank 1, which stays alive with its model open; every peer raises
    and closes its model meanwhile, waiting neither for rank 1 nor for the timeout."""
    c = Cluster(P, timeout_s=1800)
    try:
        res = c.run(_r_own_failure, label, timeout=90)
    finally:
        c.close()
    what, t_fail, msg, _, peers_closed = res[1]
    assert what in ("RuntimeError", "ValueError") and "deliberate failure" in msg, res[1]
    assert peers_closed, f"not every peer raised and closed its model while rank 1 stayed alive: {res}"
    for r in set(range(P)) - {1}:
        what, t_raise, msg, close_s, _ = res[r]
        assert what == "PeerFailedError", (r, res[r])
        assert "rank 1:" in msg and "deliberate failure" in msg, (r, msg)
        print(f"P={P} {label} rank {r}: raised {t_raise - t_fail:.2f} s after rank 1's failure, "
              f"close() {close_s:.2f} s")


# ---- a killed or stopped peer, under every algorithm that communicates each step ----------------------
EVERY = {
    "gradient_allreduce": {}, "bytegrad": {"compression": "minmax_uint8"}, "topk": {"density": 0.1},
    "gtopk": {"density": 0.1}, "powersgd": {"rank": 2}, "qadam": {"warmup_steps": 2},
    "decentralized": {}, "low_precision_decentralized": {}, "local_sgd": {"period": 2},
    "async_model_average": {"sync_interval_ms": 20},
    "diloco": {"period": 2, "fragments": 2, "overlap": 1},  # streaming: syncs on a thread of their own
}


def _algorithm(label):
    opts = dict(EVERY[label])
    name = "gradient_allreduce" if label == "bytegrad" else label
    return build(name, **opts)


def _r_peer_fault(rank, P, label, victim, how, timeout_s):
    # every rank's first 4 steps end before the victim fails: a survivor slower than the victim would otherwise
    # meet the failure there (an algorithm's own thread, async averaging's, talks to the victim meanwhile).
    # On a group of its own: the model's group may carry an algorithm thread's collective at any time.
    ready = dist.new_group(backend="gloo")
    net = _net()
    opt = (torch.optim.Adam(net.parameters(), lr=1e-3) if label == "qadam"
           else torch.optim.SGD(net.parameters(), lr=0.05))
    model = bagua_lite.DistributedModel(net, opt, _algorithm(label), bucket_size_mb=0.001)
    for s in range(4):
        _step(model, opt, rank, s)
    dist.barrier(group=ready)
    if rank == victim:
        if how == "kill":
            os._exit(1)
        # answer first (a stopped rank never would, and the harness would wait for it), then stop in
        # half a second: its peers are then waiting for it in their next step
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        return ("victim", 0.0, "")
    t0 = time.monotonic()
    try:
        for s in range(4, 100_000):
            _step(model, opt, rank, s)
            if label == "async_model_average":
                time.sleep(0.01)
            if time.monotonic() - t0 > timeout_s + 12:
                return ("still training", time.monotonic() - t0, "")
    except Exception as e:  # noqa: BLE001
        return ("raised", time.monotonic() - t0, f"{type(e).__name__}: {e}")
    return ("returned", time.monotonic() - t0, "")


STAGGER_S = 0.5  # between the starts of two algorithms' clusters (see the test's docstring)


def _fault_under(label, c, P, victim, how, pg_timeout):
    """One algorithm's cluster through the fault: (hung, raised_after) entries."""
    hung, raised_after, why = [], [], ""
    try:
        res = c.run(_r_peer_fault, label, victim, how, pg_timeout, timeout=pg_timeout + 30, grace=pg_timeout + 20)
        survivors = dict(enumerate(res))
    except RemoteError as err:  # the killed victim (or a survivor that failed to answer)
        survivors = {r: v for r, (ok, v) in err.partial.items() if ok}
        why = str(err)
    for r in set(range(P)) - {victim}:
        if r not in survivors:  # with how it exited, if it did, and the end of its stderr (stacks if a signal)
            hung.append((label, r, "no result", why[-3000:]))
            continue
        what, elapsed, msg = survivors[r]
        if what != "raised":
            hung.append((label, r, what))
        else:
            raised_after.append((label, r, round(elapsed, 1)))
    return hung, raised_after


@pytest.mark.parametrize("how", ["kill", "sigstop"])
@pytest.mark.parametrize("P", (3, 4), ids=lambda p: f"P{p}")
def test_killed_or_stopped_peer_every_algorithm(P, how):
    """Survivors raise for every algorithm; 0 hangs (a survivor still training 12 s past the group's timeout,
    or not answering the harness, counts as hung).

    Each algorithm has a cluster of its own, and the clusters run side by side, started STAGGER_S apart:
    a survivor spends its time waiting (for the group's timeout after a SIGSTOP, for the failure to reach
    it after a kill), so the waits overlap instead of adding up (40 s -> 10 s at P = 4), while only about
    one cluster at a time builds its model and takes its first steps on the 2 cores."""
    pg_timeout, victim = 3, P - 1
    clusters = {}

    def close(c):
        if how == "sigstop":
            for p in c._procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
        c.close()
    with concurrent.futures.ThreadPoolExecutor(len(EVERY)) as pool:
        try:
            futures = []
            for label in EVERY:
                clusters[label] = Cluster(P, timeout_s=pg_timeout)
                futures.append(pool.submit(_fault_under, label, clusters[label], P, victim, how, pg_timeout))
                time.sleep(STAGGER_S)
            outcomes = [f.result() for f in futures]
        finally:
            list(pool.map(close, clusters.values()))
    hung = [h for o in outcomes for h in o[0]]
    raised_after = [r for o in outcomes for r in o[1]]
    print(f"P={P} {how}, group timeout {pg_timeout} s: survivors raised after (s): {raised_after}")
    assert not hung, f"survivors that did not raise: {hung}"


# ---- uneven inputs: a rank that ran out of batches and closed its model ---------------------------------
UNEVEN = {
    "dense_buffers": ("gradient_allreduce", {}),  # waits first in the forward's broadcast of BatchNorm's buffers
    "gtopk": ("gtopk", {"density": 0.1}),       # in its buckets' rounds
    "diloco": ("diloco", {"period": 2}),         # in its sync, after step 4
    # the sync its thread started after step 4, merged after step 5
    "streaming": ("diloco", {"period": 2, "fragments": 2, "overlap": 1}),
    "asynchronous": ("async_model_average", {"sync_interval_ms": 20}),  # ranks run different step counts
}


def _r_uneven(rank, P, label):
    name, options = UNEVEN[label]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.BatchNorm1d(HIDDEN), torch.nn.ReLU(),
                              torch.nn.Linear(HIDDEN, CLASSES)) if label == "dense_buffers" else _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.001)
    error, s = None, 0
    try:
        for s in range(3 if rank == 0 else 5):
            _step(model, opt, rank, s)
    except Exception as e:  # noqa: BLE001
        error = (type(e).__name__, str(e))
    finally:
        model.close()
    return error, s


@pytest.mark.parametrize("label", sorted(UNEVEN))
def test_uneven_inputs_fail_the_ranks_left_waiting_fast(label):
    """Rank 0 has 3 batches, the others 5 (an IterableDataset or a sampler that does not pad): rank 0 closes
    its model after 3 steps, and every other rank, waiting in step 4's communication, raises at once, naming
    rank 0 and the cause, instead of waiting out torch's default 30-minute timeout (what it did before: gloo
    says nothing while rank 0's process lives on). An asynchronous algorithm's ranks may run different numbers
    of steps: each runs its own."""
    c = Cluster(3, timeout_s=1800)
    try:
        res = c.run(_r_uneven, label, timeout=60)
    finally:
        c.close()
    assert res[0] == (None, 2), res[0]
    for r in (1, 2):
        error, s = res[r]
        if label == "asynchronous":
            assert error is None and s == 4, (r, res[r])
            continue
        assert error is not None and error[0] == "PeerFailedError", (r, res[r])
        assert s == (4 if label == "streaming" else 3), (r, res[r])
        assert "rank 0 closed this model after 3 steps" in error[1] and "uneven inputs" in error[1], error[1]
