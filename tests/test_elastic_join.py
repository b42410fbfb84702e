"""A replacement joins a running fault-tolerant job (``fault_tolerant=True``) and takes the state from a peer.

Real processes and gloo over loopback, every worker a client of a TCPStore served by this test (as in
tests/test_elastic_membership.py). A worker SIGKILLs itself at a given step; this test, standing in for a
process manager, starts a replacement as soon as it sees the kill: the same code and environment, which
``bagua_lite.init_process_group()`` turns into a joiner. The survivors carry on meanwhile; the replacement
is admitted at a step boundary the survivors choose (timing decides which step: every check is written
against the step it was admitted at). Each worker trains on its own data, by its member id and step count.

Checked: the survivors lose no step to the join (only the failure's); once admitted, the replacement's
module and optimizer state are rank 0's bit for bit, its step count is the members', its per-rank algorithm
state is a fresh worker's; the replicas are bit-identical after every step from then on; and the final
weights equal bit for bit a run started afresh at the new world size from the state every member had when
the join completed.
"""
import copy
import hashlib
import os
import signal
import tempfile
import time

import pytest
import torch
import torch.nn.functional as F

import bagua_lite
from bagua_lite.algorithms import build
from cluster import _context
from test_elastic_membership import _batch, _flat, _join, _net

STEPS = 14


def _digest(net):
    return hashlib.sha256(_flat(net).numpy().tobytes()).hexdigest()


def _snapshot(model, net, opt):
    return {"module": {k: v.clone() for k, v in net.state_dict().items()},  # copies: training goes on
            "optimizer": copy.deepcopy(opt.state_dict()), "algorithm": model.algorithm_state_dict()}


def _worker(rank, P, port, out, algo, options, kill_at, replacement):
    """Generation-0 worker ``rank`` of P (``replacement``: started later, it joins)."""
    store = _join(port, rank, P)
    started = time.time()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    res = {"digests": {}, "discarded": [], "changes": [], "snap": None, "started": started}

    def changed(old, new):
        res["changes"].append((old, new, model.algorithm.step if model_box else None))  # None: in the constructor
        if model_box and new > old:  # a join completed: the state the reference starts from
            res["snap"] = (model.algorithm.step, _snapshot(model, net, opt))
    model_box = []
    model = bagua_lite.DistributedModel(net, opt, build(algo, **options), bucket_size_mb=0.001,
                                        fault_tolerant=True, on_membership_change=changed)
    model_box.append(model)
    me = model._elastic.membership.me
    if replacement:
        res["joined_at"] = model.algorithm.step
        res["snap"] = (model.algorithm.step, _snapshot(model, net, opt))
        res["admitted_s"] = time.time() - started
    while model.algorithm.step < STEPS:
        s = model.algorithm.step
        if me == rank and kill_at.get(rank) == s and not replacement:
            store.set(f"killed/{rank}", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(me, s)
        try:
            F.cross_entropy(model(x), y).backward()
            opt.step()
        except bagua_lite.MembershipChanged:
            res["discarded"].append(s)
        else:
            res["digests"][s] = _digest(net)
            if replacement and "first_step_s" not in res:
                res["first_step_s"] = time.time() - started
        opt.zero_grad()
        time.sleep(0.05)  # a step of a real model: the replacement starts while the others train
    res.update(weights=_flat(net), me=me, members=model._elastic.membership.members, world=model.world_size)
    torch.save(res, os.path.join(out, f"result_{me}.pt"))
    model.close()


def _reference(rank, P, port, out, algo, options, members, start):
    """The members after the join, afresh at world size P, from the state each had when it completed."""
    _join(port, rank, P)
    me = members[rank]
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model = bagua_lite.DistributedModel(net, opt, build(algo, **options), bucket_size_mb=0.001)
    step, snap = torch.load(os.path.join(out, f"result_{me}.pt"), weights_only=False)["snap"]
    assert step == start, (me, step, start)
    net.load_state_dict(snap["module"])
    opt.load_state_dict(snap["optimizer"])
    model.load_algorithm_state_dict(snap["algorithm"])
    while model.algorithm.step < STEPS:
        x, y = _batch(me, model.algorithm.step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    torch.save(_flat(net), os.path.join(out, f"reference_{me}.pt"))
    model.close()


def _run(P, fn, args, replace=(), deadline_s=90):
    """P workers against a store served here; for each rank in ``replace``, a replacement started once the
    store says that rank was killed (a process manager's job). Returns (store, {name: exit code})."""
    import datetime
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    ctx = _context()
    procs = {r: ctx.Process(target=fn, args=(r, P, store.port) + args + ((False,) if replace is not None else ()),
                            daemon=True) for r in range(P)}
    for p in procs.values():
        p.start()
    end = time.monotonic() + deadline_s
    pending = list(replace or ())
    while pending and time.monotonic() < end:
        for r in list(pending):
            if store.check([f"killed/{r}"]):
                procs[f"replacement{r}"] = ctx.Process(target=fn, args=(r, P, store.port) + args + (True,),
                                                       daemon=True)
                procs[f"replacement{r}"].start()
                pending.remove(r)
        time.sleep(0.02)
    for p in procs.values():
        p.join(timeout=max(0.1, end - time.monotonic()))
    hung = [name for name, p in procs.items() if p.is_alive()]
    for name in hung:
        procs[name].kill()
        procs[name].join()
    assert not hung, f"{hung} still running after {deadline_s} s (a hang)"
    return store, {name: p.exitcode for name, p in procs.items()}


CASES = [  # (algorithm, options, P, rank killed, step it is killed at)
    ("gradient_allreduce", {}, 4, 2, 3),
    ("gradient_allreduce", {"compression": "sign"}, 3, 0, 4),  # rank 0 dies: a survivor sends the state
    ("topk", {"density": 0.1}, 4, 1, 3),
    ("gtopk", {"density": 0.1}, 5, 3, 4),
    ("powersgd", {"rank": 2, "warmup_steps": 2}, 4, 2, 3),  # the Q's are shared: the joiner copies them
]


@pytest.mark.parametrize("algo,options,P,victim,kill_step", CASES,
                         ids=[f"{a}{'-' + '-'.join(map(str, o.values())) if o else ''}-P{P}" for a, o, P, _, _ in CASES])
def test_a_replacement_joins_and_trains_bit_identical_to_a_fresh_run(algo, options, P, victim, kill_step):
    out = tempfile.mkdtemp(prefix="bagua_lite_join_")
    store, codes = _run(P, _worker, (out, algo, options, {victim: kill_step}), replace=[victim])
    assert codes.pop(victim) == -signal.SIGKILL, codes
    assert set(codes.values()) == {0}, codes
    survivors = [r for r in range(P) if r != victim]
    res = {r: torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False) for r in survivors}
    joiner = torch.load(os.path.join(out, f"result_{P}.pt"), weights_only=False)  # ids go on from P
    start = joiner["joined_at"]
    assert kill_step < start < STEPS, (kill_step, start)  # admitted while the others trained
    members = survivors + [P]
    for r, x in res.items():
        assert x["discarded"] == [kill_step], x["discarded"]  # the failure's step only: the join costs none
        assert [c[:2] for c in x["changes"]] == [(P, P - 1), (P - 1, P)], x["changes"]
        assert x["snap"][0] == start and x["members"] == members and x["world"] == P
        assert sorted(x["digests"]) == list(range(STEPS))
    assert joiner["changes"] == [(P - 1, P, None)] and joiner["members"] == members
    assert joiner["discarded"] == [] and sorted(joiner["digests"]) == list(range(start, STEPS))
    # the state came from rank 0 of the new group (the lowest surviving id): module and optimizer bit for bit
    src = res[survivors[0]]["snap"][1]
    mine = joiner["snap"][1]
    for k, v in src["module"].items():
        assert torch.equal(v, mine["module"][k]), k
    for i, st in src["optimizer"]["state"].items():
        assert torch.equal(st["momentum_buffer"], mine["optimizer"]["state"][i]["momentum_buffer"]), i
    assert mine["algorithm"]["step"] == start
    fresh = build(algo, **options)  # per-rank state: a fresh worker's (zeros), shared state: rank 0's
    for name, tensors in mine["algorithm"].items():
        if name == "step":
            continue
        if name in ("qs",):
            assert all(torch.equal(a, b) for a, b in zip(tensors, src["algorithm"][name])), name
        else:
            assert all(not t.any() for t in tensors), f"{name}: a joiner's own state starts empty"
    del fresh
    for s in range(start, STEPS):  # replicas bit-identical from the join on
        assert len({res[r]["digests"][s] for r in survivors} | {joiner["digests"][s]}) == 1, s
    _, ref_codes = _run(P, _reference, (out, algo, options, members, start), replace=None)
    assert set(ref_codes.values()) == {0}, ref_codes
    for me in members:
        got = joiner["weights"] if me == P else res[me]["weights"]
        ref = torch.load(os.path.join(out, f"reference_{me}.pt"), weights_only=False)
        assert torch.equal(got, ref), f"member {me}: max |diff| {(got - ref).abs().max().item()}"
    print(f"\n{algo} {options} P={P}: replacement admitted at step {start} (killed at {kill_step}), "
          f"{joiner['admitted_s']:.2f} s from its start to admitted, {joiner['first_step_s']:.2f} s to its first step")
