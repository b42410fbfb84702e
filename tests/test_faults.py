"""Faults: a rank whose communication fails while its process stays alive, a killed rank, a stopped rank.

The process groups here use torch's default 30-minute timeout where the point is that nobody waits for it
(fail fast through the store), and a short one where a stopped (SIGSTOP) rank can only be detected by the
timeout. Every survivor must raise, naming what failed, never hang.
"""
import os
import signal
import threading
import time

import pytest
import torch
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


def _r_fail_alive(rank, P):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = bagua_lite.DistributedModel(net, opt, build("fails_on_rank1_test"), bucket_size_mb=0.001)
    t0 = None
    try:
        for s in range(6):
            t0 = time.monotonic()
            _step(model, opt, rank, s)
        return ("no error", 0.0, "")
    except Exception as e:  # noqa: BLE001 - the user's "catch and carry on" pattern
        elapsed = time.monotonic() - t0
        if rank == 1:
            time.sleep(6)  # stays alive (evaluation, logging...) well past the peers' error
        try:
            model(_batch(rank, 0)[0])
            after = "forward worked"
        except RuntimeError as again:
            after = str(again)
        return (type(e).__name__, elapsed, str(e), after)
    finally:
        model.close()


@pytest.mark.parametrize("P", (3, 4), ids=lambda p: f"P{p}")
def test_failure_on_a_live_rank_fails_every_peer_fast(P):
    """torch's default timeout (30 min): the peers must raise within seconds, naming rank 1 and its op."""
    c = Cluster(P, timeout_s=1800)
    try:
        res = c.run(_r_fail_alive, timeout=60)
    finally:
        c.close()
    what, elapsed, msg, after = res[1]
    assert what == "RuntimeError" and "average_or_fail" in msg and "deliberate failure" in msg, res[1]
    for r in set(range(P)) - {1}:
        what, elapsed, msg, after = res[r]
        assert what == "PeerFailedError", (r, res[r])
        assert elapsed < 5, f"rank {r} took {elapsed:.1f}s to learn of rank 1's failure"
        assert "rank 1:" in msg and "average_or_fail" in msg, (r, msg)
        assert "communication failed earlier" in after, (r, after)  # the model stays failed


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
    if rank == 1:
        time.sleep(4)  # stays alive (evaluation, logging...) well past the peers' error
    t0 = time.monotonic()
    model.close()
    return result + (time.monotonic() - t0,)


@pytest.mark.parametrize("label", list(OWN))
@pytest.mark.parametrize("P", (3, 4), ids=lambda p: f"P{p}")
def test_live_failure_in_an_algorithms_own_communication_fails_every_peer_fast(P, label):
    """torch's default timeout (30 min): a periodic average, a peer exchange, an exchange thread or a
    background averaging thread fails on rank 1, which stays alive; every peer raises within seconds and
    closes its model without waiting for the timeout either."""
    c = Cluster(P, timeout_s=1800)
    try:
        res = c.run(_r_own_failure, label, timeout=90)
    finally:
        c.close()
    what, t_fail, msg, _ = res[1]
    assert what in ("RuntimeError", "ValueError") and "deliberate failure" in msg, res[1]
    for r in set(range(P)) - {1}:
        what, t_raise, msg, close_s = res[r]
        assert what == "PeerFailedError", (r, res[r])
        assert t_raise - t_fail < 5, f"rank {r} took {t_raise - t_fail:.1f}s to learn of rank 1's failure"
        assert "rank 1:" in msg and "deliberate failure" in msg, (r, msg)
        assert close_s < 5, f"rank {r}: close() took {close_s:.1f}s"


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
    net = _net()
    opt = (torch.optim.Adam(net.parameters(), lr=1e-3) if label == "qadam"
           else torch.optim.SGD(net.parameters(), lr=0.05))
    model = bagua_lite.DistributedModel(net, opt, _algorithm(label), bucket_size_mb=0.001)
    for s in range(4):
        _step(model, opt, rank, s)
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


@pytest.mark.parametrize("how", ["kill", "sigstop"])
@pytest.mark.parametrize("P", (3, 4), ids=lambda p: f"P{p}")
def test_killed_or_stopped_peer_every_algorithm(P, how):
    """Survivors raise within the group's timeout + 10 s for every algorithm; 0 hangs."""
    pg_timeout, victim = 3, P - 1
    hung, slow = [], []
    for label in EVERY:
        c = Cluster(P, timeout_s=pg_timeout)
        try:
            try:
                res = c.run(_r_peer_fault, label, victim, how, pg_timeout, timeout=pg_timeout + 30,
                            grace=pg_timeout + 20)
                survivors = dict(enumerate(res))
            except RemoteError as err:  # the killed victim (or a survivor that failed to answer)
                survivors = {r: v for r, (ok, v) in err.partial.items() if ok}
            for r in set(range(P)) - {victim}:
                if r not in survivors:
                    hung.append((label, r))
                    continue
                what, elapsed, msg = survivors[r]
                if what != "raised":
                    hung.append((label, r, what))
                elif elapsed > pg_timeout + 10:
                    slow.append((label, r, round(elapsed, 1)))
        finally:
            if how == "sigstop":
                for p in c._procs:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
            c.close()
    assert not hung, f"survivors that did not raise: {hung}"
    assert not slow, f"survivors slower than timeout + 10 s: {slow}"
