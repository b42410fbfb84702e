"""async_model_average on real spawned gloo groups (P = 1..5), one round trip per world size:

* warm-up steps are bit-identical to gradient_allreduce;
* after warm-up, ranks training at different speeds (rank 0 sleeps every step) take different numbers of
  steps, the background thread runs the same number of rounds on every rank, and the replicas' spread
  stays far below that of the same training without averaging; after close() ``average_now()`` makes
  them identical;
* close() interrupts the thread's wait between rounds (an interval of an hour does not hold it up);
* close() called at different times (each rank trains on until the rank before it has closed) returns on
  every rank while the later ones still train;
* minmax_uint8 compression still learns; an optimizer step that raises does not leave the step lock held;
  state_dict / load_state_dict round-trip while the thread runs;
* a dead peer (os._exit) makes the survivors' training thread raise, naming the background averaging;
* bad options raise ValueError naming the option (single process).
"""
import os
import time
import uuid

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua_lite
import bagua_lite.algorithms  # noqa: F401
from bagua_lite.algorithm import build
from bagua_lite.algorithms.async_model_average import AsyncModelAverage

from cluster import Cluster, RemoteError

D_IN, HIDDEN, CLASSES = 16, 32, 8
_W_TRUE = torch.randn(D_IN, CLASSES, generator=torch.Generator().manual_seed(99))


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


def _batch(rank, step, n=16):
    g = torch.Generator().manual_seed(rank * 7919 + step * 31 + 17)
    x = torch.randn(n, D_IN, generator=g)
    return x, (x @ _W_TRUE).argmax(1)


def _flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


def _model(name, lr=0.05, **options):
    net = _mlp()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    return net, opt, bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.002)


def _step(model, opt, rank, s):
    x, y = _batch(rank, s)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _timed(rank, seconds, interval_ms, warmup=5, slow_s=0.03, fast_s=0.005):
    """Warm-up, then train for `seconds` of wall time; every step rank 0 sleeps slow_s, the others fast_s
    (which also keeps P processes from saturating a small machine)."""
    net, opt, model = _model("async_model_average", sync_interval_ms=interval_ms, warmup_steps=warmup)
    for s in range(warmup):
        _step(model, opt, rank, s)
    dist.barrier()  # start the timed phase together (the default group is idle after warm-up)
    t0, s = time.monotonic(), warmup
    while time.monotonic() - t0 < seconds:
        time.sleep(slow_s if rank == 0 else fast_s)
        _step(model, opt, rank, s)
        s += 1
    w = _flat(net)
    model.close()
    model.algorithm.average_now()
    return {"w": w, "steps": s, "rounds": model.algorithm.rounds, "after_average": _flat(net)}


def _r_async(rank, P, token):
    out = {}
    # (a) warm-up == gradient_allreduce, bit for bit
    for name, opts in (("ga", ("gradient_allreduce", {})),
                       ("am", ("async_model_average", {"warmup_steps": 6, "sync_interval_ms": 3_600_000}))):
        net, opt, model = _model(opts[0], **opts[1])
        out[name] = [(_step(model, opt, rank, s), _flat(net)) for s in range(6)]
        t = time.monotonic()
        # the thread started after step 6 and waits an hour for its first round: close must wake it (were it
        # to wait, the run would outlast the harness's timeout)
        model.close()
        out[name + "_close_s"] = time.monotonic() - t
        if name == "am":
            out["am_thread_ended"], out["am_rounds"] = not model.algorithm.thread.worker.busy, model.algorithm.rounds
    # (b) different speeds, fast averaging vs. none
    out["avg"] = _timed(rank, 1.0, 20)
    out["local"] = _timed(rank, 1.0, 10_000_000)
    # (c) close at different times: rank 0 trains 0.3 s, then closes; every other rank trains on until the
    # rank before it has returned from close(), then closes. A close() that waited for a later rank's would
    # never return (the run would outlast the harness's timeout).
    store = dist.distributed_c10d._get_default_store()
    net, opt, model = _model("async_model_average", sync_interval_ms=50)
    t0, s = time.monotonic(), 0
    while (time.monotonic() - t0 < 0.3) if rank == 0 else not store.check([f"{token}/closed/{rank - 1}"]):
        _step(model, opt, rank, s)
        s += 1
    t = time.monotonic()
    model.close()
    out["stagger_close_s"], out["stagger_rounds"] = time.monotonic() - t, model.algorithm.rounds
    out["stagger_thread_ended"] = not model.algorithm.thread.worker.busy
    store.set(f"{token}/closed/{rank}", "1")
    # (d) minmax_uint8 learns; a step that raises; state round-trip while running
    net, opt, model = _model("async_model_average", lr=0.1, sync_interval_ms=20, compression="minmax_uint8")
    heldout = _batch(10_000, 0, n=512)  # the same for every rank: learning judged on it, not on the
    out["heldout_before"] = _heldout_loss(net, heldout)  # noisy losses of the last training batches
    losses = [_step(model, opt, rank, s) for s in range(60)]
    boom = opt.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(ValueError("boom")))
    try:
        _step(model, opt, rank, 60)
    except ValueError:
        out["boom_raised"] = True
    boom.remove()
    opt.zero_grad()
    before = model.algorithm.rounds  # the step lock is still held here: the next forward releases it
    losses += [_step(model, opt, rank, s) for s in range(61, 160)]
    time.sleep(0.1)
    dist.barrier()  # nobody closes (which ends every rank's rounds) before all got here
    out["rounds_after_boom"] = model.algorithm.rounds - before
    model.algorithm.load_state_dict(model.algorithm.state_dict())
    model.close()
    out["heldout_after"] = _heldout_loss(net, heldout)  # the averaging thread has ended
    return out


def _heldout_loss(net, batch):
    with torch.no_grad():
        return F.cross_entropy(net(batch[0]), batch[1]).item()


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5], ids=lambda p: f"P{p}")
def test_async_model_average(clusters, P):
    res = clusters.get(P).run(_r_async, f"test_async_model_average/{uuid.uuid4().hex}", timeout=120)
    for r, out in enumerate(res):
        for (la, wa), (lb, wb) in zip(out["ga"], out["am"]):
            assert la == lb and torch.equal(wa, wb), f"rank {r}: warm-up differs from gradient_allreduce"
        assert out["am_thread_ended"] and out["am_rounds"] == 0, f"rank {r}: close() did not end the waiting thread"
        assert out["stagger_thread_ended"], f"rank {r}: staggered close() left the averaging thread running"
        print(f"P={P} rank {r}: close() {out['am_close_s']:.2f} s, staggered close() {out['stagger_close_s']:.2f} s")
        assert out.get("boom_raised") and out["rounds_after_boom"] > 0, f"rank {r}: a failed step stalled averaging"
        first, last = out["heldout_before"], out["heldout_after"]
        assert last < 0.7 * first, f"rank {r}: minmax_uint8 does not learn: held-out loss {first:.3f} -> {last:.3f}"
    for key in ("avg", "local"):  # every thread ran the same rounds; average_now() makes replicas identical
        assert len({out[key]["rounds"] for out in res}) == 1, [out[key]["rounds"] for out in res]
        assert all(torch.equal(out[key]["after_average"], res[0][key]["after_average"]) for out in res)
    assert len({out["stagger_rounds"] for out in res}) == 1, [out["stagger_rounds"] for out in res]
    assert res[0]["avg"]["rounds"] >= 5 and res[0]["local"]["rounds"] == 0
    if P > 1:
        steps = [out["avg"]["steps"] for out in res]
        assert steps[0] < max(steps[1:]), f"the slow rank 0 kept pace (not asynchronous?): steps {steps}"
        spread = {}
        for k in ("avg", "local"):  # the largest distance of a replica from the mean, per coordinate
            ws = torch.stack([o[k]["w"] for o in res])
            spread[k] = float((ws - ws.mean(0)).abs().max())
        print(f"P={P} steps {steps} rounds {res[0]['avg']['rounds']} spread {spread}")
        assert spread["avg"] < 0.3 * spread["local"], f"replicas' spread with / without averaging: {spread}"


def _r_dead_peer(rank, P, victim):
    net, opt, model = _model("async_model_average", sync_interval_ms=20, warmup_steps=3)
    t0 = time.monotonic()
    try:
        # inside the try: the ranks run at their own pace, so the victim may die while a survivor is still in
        # its first 10 steps, and the survivor's error may come from any of its steps
        for s in range(10):
            _step(model, opt, rank, s)
        if rank == victim:
            os._exit(1)
        s = 10
        while time.monotonic() - t0 < 60:
            _step(model, opt, rank, s)
            s += 1
            time.sleep(0.005)
    except RuntimeError as e:
        return ("raised", time.monotonic() - t0, str(e))
    finally:
        model.close()
    return ("returned", time.monotonic() - t0, "")


def test_dead_peer_raises_in_training_thread():
    P, victim, pg_timeout = 3, 1, 5
    c = Cluster(P, timeout_s=pg_timeout)
    try:
        with pytest.raises(RemoteError) as info:
            c.run(_r_dead_peer, victim, timeout=90, grace=pg_timeout + 20)
        err = info.value
        assert err.dead == [victim], str(err)
        survivors = {r: v for r, (ok, v) in err.partial.items() if ok}
        assert sorted(survivors) == [r for r in range(P) if r != victim], str(err)
        for r, (what, elapsed, msg) in survivors.items():
            assert what == "raised", (r, what, elapsed, msg)
            assert "background averaging failed" in msg, (r, msg)
            print(f"rank {r}: raised {elapsed:.2f} s after rank {victim} died (group timeout {pg_timeout} s)")
    finally:
        c.close()


@pytest.mark.parametrize("options, pattern", [
    ({"sync_interval_ms": 0}, r"sync_interval_ms must be an int >= 1.*got 0"),
    ({"sync_interval_ms": -5}, r"sync_interval_ms.*got -5"),
    ({"sync_interval_ms": 0.5}, r"sync_interval_ms.*got 0.5"),
    ({"warmup_steps": -1}, r"warmup_steps must be an int >= 0, got -1"),
    ({"compression": "bogus"}, r"unknown compression 'bogus'.*'minmax_uint8'"),
])
def test_bad_options(options, pattern):
    with pytest.raises(ValueError, match=pattern):
        AsyncModelAverage(**options)
    if not any(isinstance(v, float) for v in options.values()):  # build() type-checks floats first
        with pytest.raises(ValueError, match=pattern):
            build("async_model_average", **options)
    else:
        with pytest.raises(TypeError, match="sync_interval_ms"):
            build("async_model_average", **options)


def _r_pause_resume(rank, P, warmup):
    """pause() / resume() around an evaluation, as BAGUA's abort/resume: the rounds stop on every rank in
    the same round, average_now() then makes the replicas identical, and resume() starts them again."""
    net, opt, model = _model("async_model_average", sync_interval_ms=10, warmup_steps=warmup)
    alg, s, out = model.algorithm, 0, {}
    if warmup:
        alg.pause()  # in the warm-up: nothing runs yet, and the averaging must not start at its end
        for s in range(warmup + 3):
            _step(model, opt, rank, s)
        s += 1
        out["paused_in_warmup_rounds"] = alg.rounds
        out["started_while_paused"] = alg.thread.worker.busy
        alg.resume()
    deadline = time.monotonic() + 60
    while (alg.rounds < 3 or s < warmup + 5) and time.monotonic() < deadline:
        time.sleep(0.005)
        _step(model, opt, rank, s)
        s += 1
    out["rounds_before_pause"] = alg.rounds
    time.sleep(0.05 * rank)  # ranks pause at different times
    alg.pause()
    paused_at = alg.rounds
    for _ in range(5):  # local steps while paused: no round runs
        time.sleep(0.02)
        _step(model, opt, rank, s)
        s += 1
    out["rounds_while_paused"] = alg.rounds - paused_at
    out["paused_at"] = paused_at
    alg.average_now()
    out["evaluated"] = _flat(net)  # what an evaluation sees
    alg.resume()
    deadline = time.monotonic() + 60
    while alg.rounds < paused_at + 3 and time.monotonic() < deadline:
        time.sleep(0.005)
        _step(model, opt, rank, s)
        s += 1
    out["rounds_after_resume"] = alg.rounds - paused_at
    dist.barrier()
    model.close()
    alg.average_now()
    out["final"] = _flat(net)
    return out


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("warmup", [0, 4])
def test_pause_and_resume_around_an_evaluation(clusters, P, warmup):
    res = clusters.get(P).run(_r_pause_resume, warmup, timeout=180)
    for r, out in enumerate(res):
        assert out["rounds_before_pause"] >= 3, out["rounds_before_pause"]
        assert out["rounds_while_paused"] == 0, f"rank {r}: {out['rounds_while_paused']} rounds while paused"
        assert out["paused_at"] == res[0]["paused_at"], "every rank's averaging stops in the same round"
        assert out["rounds_after_resume"] >= 3, f"rank {r}: averaging did not resume"
        assert torch.equal(out["evaluated"], res[0]["evaluated"]), f"rank {r}: replicas differ after average_now"
        assert torch.equal(out["final"], res[0]["final"])
        if warmup:
            assert out["paused_in_warmup_rounds"] == 0 and not out["started_while_paused"]
