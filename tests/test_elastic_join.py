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
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua_lite
from bagua_lite.algorithms import build
from cluster import _context
from test_elastic_membership import _batch, _flat, _join, _net

STEPS = 18
STEPS_OF = {"decentralized": 30,  # its joiners are admitted interval * (P + 2) steps after rank 0 sees them
            "low_precision_decentralized": 30,
            "async_model_average": 100}  # its ranks do not wait for each other: enough steps for a join


def _steps(algo, options=None):
    if (options or {}).get("overlap"):  # streaming diloco admits joiners period + overlap + 2 steps ahead
        return 40
    return STEPS_OF.get(algo, STEPS)


def _optimizer(algo, net):
    if algo == "qadam":  # Adam's momentum travels; its v is frozen after the warm-up
        return torch.optim.Adam(net.parameters(), lr=0.01)
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def _digest(net):
    return hashlib.sha256(_flat(net).numpy().tobytes()).hexdigest()


def _snapshot(model, net, opt):
    return {"module": {k: v.clone() for k, v in net.state_dict().items()},  # copies: training goes on
            "optimizer": copy.deepcopy(opt.state_dict()), "algorithm": copy.deepcopy(model.algorithm_state_dict())}


def _worker(rank, P, port, out, algo, options, kill_at, replacement):
    """Generation-0 worker ``rank`` of P (``replacement``: started later, it joins)."""
    store = _join(port, rank, P)
    started = time.time()
    net = _net()
    opt = _optimizer(algo, net)
    res = {"digests": {}, "discarded": [], "changes": [], "snap": None, "started": started, "after_change": {}}

    def changed(old, new):
        res["changes"].append((old, new, model.algorithm.step if model_box else None))  # None: in the constructor
        if model_box:  # the last change's state: the state a reference run starts from
            res["snap"] = (model.algorithm.step, _snapshot(model, net, opt))
    model_box = []
    model = bagua_lite.DistributedModel(net, opt, build(algo, **options), bucket_size_mb=0.001,
                                        fault_tolerant=True, on_membership_change=changed)
    model_box.append(model)
    me = model.membership.member_id
    res["joining"] = model.membership.joining  # read after the constructor: a joiner's generation is > 0
    if replacement:
        res["joined_at"] = model.algorithm.step
        res["snap"] = (model.algorithm.step, _snapshot(model, net, opt))
        res["admitted_s"] = time.time() - started
    while model.algorithm.step < _steps(algo, options):
        s = model.algorithm.step
        if me == rank and kill_at.get(rank) == s and not replacement:
            store.set(f"killed/{rank}", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(me, s)
        try:
            F.cross_entropy(model(x), y).backward()
            opt.step()
        except bagua_lite.MembershipChanged as e:
            res["discarded"].append(s)
            res["after_change"][s] = _digest(net)
            res.setdefault("messages", []).append(str(e))
        else:
            res["digests"][s] = _digest(net)
            if replacement and "first_step_s" not in res:
                res["first_step_s"] = time.time() - started
        opt.zero_grad()
        time.sleep(0.05)  # a step of a real model: the replacement starts while the others train
    res.update(weights=_flat(net), me=me, members=model._elastic.membership.members, world=model.world_size,
               active=repr(model.algorithm))
    torch.save(res, os.path.join(out, f"result_{me}.pt"))
    model.close()


def _reference(rank, P, port, out, algo, options, members, start):
    """The members after the join, afresh at world size P, from the state each had when it completed."""
    _join(port, rank, P)
    me = members[rank]
    net = _net()
    opt = _optimizer(algo, net)
    model = bagua_lite.DistributedModel(net, opt, build(algo, **options), bucket_size_mb=0.001)
    step, snap = torch.load(os.path.join(out, f"result_{me}.pt"), weights_only=False)["snap"]
    assert step == start, (me, step, start)
    net.load_state_dict(snap["module"])
    opt.load_state_dict(snap["optimizer"])
    model.load_algorithm_state_dict(snap["algorithm"])
    while model.algorithm.step < _steps(algo, options):
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


def _killed_run(tmp_path, P, algo, options, kills, replaced):
    """P workers, each of ``kills`` SIGKILLed at its step (and replaced if ``replaced``); every other worker
    must end well. Returns (output dir, survivors, {survivor: its result})."""
    out = str(tmp_path)
    _, codes = _run(P, _worker, (out, algo, options, kills), replace=list(kills) if replaced else [])
    for r in kills:
        assert codes.pop(r) == -signal.SIGKILL, codes
    assert set(codes.values()) == {0}, codes
    survivors = [r for r in range(P) if r not in kills]
    return out, survivors, {r: torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False) for r in survivors}


def _assert_a_fresh_run_ends_alike(out, algo, options, members, start, results):
    """The strong check: ``members`` started afresh at their number from the state each had at step ``start``
    end with the weights of ``results`` ({member id: its result}) bit for bit."""
    _, ref_codes = _run(len(members), _reference, (out, algo, options, members, start), replace=None)
    assert set(ref_codes.values()) == {0}, ref_codes
    for me in members:
        got = results[me]["weights"]
        ref = torch.load(os.path.join(out, f"reference_{me}.pt"), weights_only=False)
        assert torch.equal(got, ref), f"member {me}: max |diff| {(got - ref).abs().max().item()}"


CASES = [  # (algorithm, options, P, rank killed, step it is killed at)
    ("gradient_allreduce", {}, 4, 2, 3),
    ("gradient_allreduce", {"compression": "sign"}, 3, 0, 4),  # rank 0 dies: a survivor sends the state
    ("topk", {"density": 0.1}, 4, 1, 3),
    ("gtopk", {"density": 0.1}, 5, 3, 4),
    ("powersgd", {"rank": 2, "warmup_steps": 2}, 4, 2, 3),  # the Q's are shared: the joiner copies them
    ("qadam", {"warmup_steps": 2}, 4, 1, 4),  # after the freeze: Adam's m and frozen v come from rank 0
]


@pytest.mark.parametrize("algo,options,P,victim,kill_step", CASES,
                         ids=[f"{a}{'-' + '-'.join(map(str, o.values())) if o else ''}-P{P}" for a, o, P, _, _ in CASES])
def test_a_replacement_joins_and_trains_bit_identical_to_a_fresh_run(tmp_path, algo, options, P, victim, kill_step):
    out, survivors, res = _killed_run(tmp_path, P, algo, options, {victim: kill_step}, True)
    joiner = torch.load(os.path.join(out, f"result_{P}.pt"), weights_only=False)  # ids go on from P
    start = joiner["joined_at"]
    assert kill_step < start < STEPS, (kill_step, start)  # admitted while the others trained
    assert joiner["joining"] and not any(r["joining"] for r in res.values())  # model.membership.joining
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
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(mine["optimizer"]["state"][i][k])), (i, k)
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
    _assert_a_fresh_run_ends_alike(out, algo, options, members, start, {**res, P: joiner})
    print(f"\n{algo} {options} P={P}: replacement admitted at step {start} (killed at {kill_step}), "
          f"{joiner['admitted_s']:.2f} s from its start to admitted, {joiner['first_step_s']:.2f} s to its first step")


def _split(rank, P, port, out, algo, options, k, victim, behind):
    """The dead worker's part of step ``k``'s agreement reaches some survivors only: here it dies after its
    backward (its part sent), and on rank ``behind`` the agreement is made to fail as if that part had not
    arrived. The others apply step k and meet the failure in step k + 1."""
    _join(port, rank, P)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model = bagua_lite.DistributedModel(net, opt, build(algo, **options), bucket_size_mb=0.001, fault_tolerant=True)
    res = {"digests": {}, "discarded": [], "at_failure": None, "snap": None}
    if rank == behind:
        gather = model._gather_ints

        def failing(values, *args, **kwargs):
            rows = gather(values, *args, **kwargs)
            if len(values) > 2 and model.algorithm.step == k and res["at_failure"] is None:
                res["at_failure"] = model.algorithm_state_dict()  # this round's result, not yet committed
                model._elastic.comm_error = e = RuntimeError("simulated: the step agreement failed here")
                raise e
            return rows
        model._gather_ints = failing
    def after_backward(s):
        if rank == victim and s == k:
            os.kill(os.getpid(), signal.SIGKILL)  # after its part of the agreement went out

    def on_change(s):
        res["snap"] = (model.algorithm.step, _snapshot(model, net, opt))
    _train_and_save(model, net, opt, rank, STEPS, res, out, after_backward=after_backward, on_change=on_change)


@pytest.mark.parametrize("algo,options", [("gradient_allreduce", {}), ("gradient_allreduce", {"compression": "sign"}),
                                          ("gtopk", {"density": 0.1})], ids=["dense", "sign", "gtopk"])
def test_a_step_agreed_by_some_survivors_only_is_taken_late_by_the_others(tmp_path, algo, options):
    P, k, victim, behind = 4, 4, 3, 1
    out = str(tmp_path)
    _, codes = _run(P, _split, (out, algo, options, k, victim, behind), replace=None)
    assert codes == {0: 0, 1: 0, 2: 0, 3: -signal.SIGKILL}, codes
    res = {r: torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False) for r in (0, 1, 2)}
    assert res[behind]["discarded"] == [k]            # its step k raised, and was then taken from the others
    assert res[0]["discarded"] == res[2]["discarded"] == [k + 1]  # they had applied k: k + 1 was discarded
    assert k in res[0]["digests"] and k not in res[behind]["digests"]
    for r in (0, 1, 2):
        assert res[r]["snap"][0] == k + 1, res[r]["snap"][0]
        # a discarded step is retried at the same step count; the one taken late is not run here
        assert sorted(res[r]["digests"]) == [s for s in range(STEPS) if r != behind or s != k]
    for s in range(k + 1, STEPS):  # bit-identical from then on
        assert len({res[r]["digests"][s] for r in (0, 1, 2)}) == 1, s
    healed = res[behind]["snap"][1]
    assert all(torch.equal(v, res[0]["snap"][1]["module"][n]) for n, v in healed["module"].items())
    at_failure = res[behind]["at_failure"]  # register_state: the round's result; gtopk: the state before it
    for name, tensors in at_failure.items():
        if name != "step" and algo != "gtopk":  # the round's result was kept, not rolled back
            assert all(torch.equal(a, b) for a, b in zip(tensors, healed["algorithm"][name])), name
    if algo == "gtopk":  # the round's working copies were swapped in (committed late)
        assert any(not torch.equal(a, b) for a, b in zip(at_failure["residuals"], healed["algorithm"]["residuals"]))
    if algo == "gradient_allreduce" and options:  # error feedback: the result differs from the state before
        before = res[0]["snap"][1]["algorithm"]["residuals"]
        assert any(not torch.equal(a, b) for a, b in zip(healed["algorithm"]["residuals"], before))
    # the strong check: a fresh run of the three from the state each had once healed
    _, ref_codes = _run(3, _reference, (out, algo, options, [0, 1, 2], k + 1), replace=None)
    assert set(ref_codes.values()) == {0}, ref_codes
    for r in (0, 1, 2):
        ref = torch.load(os.path.join(out, f"reference_{r}.pt"), weights_only=False)
        assert torch.equal(res[r]["weights"], ref), f"rank {r}: max |diff| {(res[r]['weights'] - ref).abs().max().item()}"


def _late(rank, P, port, out, replacement):
    """Train 3 steps; a replacement started after the job ended must not wait for ever."""
    _join(port, rank, P)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    try:
        model = bagua_lite.DistributedModel(net, opt, "gradient_allreduce", fault_tolerant=True)
    except bagua_lite.MembershipError as e:
        torch.save(str(e), os.path.join(out, "late.pt"))
        return
    for s in range(3):
        x, y = _batch(rank, s)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model.close()
    if rank == 0:
        dist.TCPStore("127.0.0.1", port, is_master=False).set("killed/0", "ended")  # _run starts the "replacement" now: after the job ended


def test_a_worker_joining_a_job_that_ended_raises_instead_of_waiting(tmp_path):
    out = str(tmp_path)
    _, codes = _run(2, _late, (out,), replace=[0], deadline_s=60)
    assert set(codes.values()) == {0}, codes
    msg = torch.load(os.path.join(out, "late.pt"), weights_only=False)
    assert "has ended" in msg and "before admitting it" in msg, msg


PERIODIC = [  # (algorithm, options, P, {rank: step it is killed at}, replaced)
    ("local_sgd", {"period": 4}, 4, {2: 5}, False),   # dies between syncs: the sync at 8 is finished by the rest
    ("diloco", {"period": 4, "outer_optimizer": {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}},
     5, {1: 3, 0: 9}, False),                          # two kills, rank 0 among them: 5 -> 4 -> 3
    ("local_sgd", {"period": 4, "warmup_steps": 2}, 4, {1: 6}, True),  # a replacement joins at a later sync
    ("diloco", {"period": 4}, 3, {0: 6}, True),
    # compressed syncs: each rank's error feedback stays its own (a joiner's starts at zero)
    ("diloco", {"period": 4, "compression": "minmax_uint8"}, 4, {2: 5}, True),
    ("local_sgd", {"period": 4, "compression": "sign"}, 5, {3: 2, 0: 9}, False),
]


@pytest.mark.parametrize("algo,options,P,kills,replaced", PERIODIC,
                         ids=[f"{a}-P{P}-kill{len(k)}{'-join' if j else ''}" for a, _, P, k, j in PERIODIC])
def test_local_sgd_and_diloco_finish_the_round_without_the_lost_worker(tmp_path, algo, options, P, kills, replaced):
    """Local steps run no collective, so the survivors meet the loss in the next sync (after the optimizer's
    update of that step, which is kept) and finish that sync among themselves: nothing of any survivor's
    work is lost. A replacement is admitted at a later sync and takes the state from rank 0."""
    period = options["period"]
    out, survivors, res = _killed_run(tmp_path, P, algo, options, kills, replaced)
    warm = options.get("warmup_steps", 0)
    sync_steps = [i for i in range(STEPS) if i + 1 > warm and (i + 1 - warm) % period == 0]
    syncs = [min(i for i in sync_steps if i >= k) for k in sorted(kills.values())]  # the steps whose sync failed
    for r, x in res.items():
        assert x["discarded"] == syncs, (r, x["discarded"], syncs, x["messages"])  # MembershipChanged there
        # no step lost, none retrained: the loop goes on at the next step count
        assert sorted(x["digests"]) == [s for s in range(STEPS) if s not in syncs], (r, x["messages"])
    for s in range(STEPS):  # after every sync the replicas are identical
        if s in sync_steps:
            digests = {r: {**res[r]["digests"], **res[r]["after_change"]} for r in survivors}  # healed syncs too
            assert len({digests[r][s] for r in survivors if s in digests[r]}) == 1, s
    members = survivors + ([P] if replaced else [])
    if replaced:
        joiner = torch.load(os.path.join(out, f"result_{P}.pt"), weights_only=False)
        start = joiner["joined_at"]
        assert start - 1 in sync_steps and syncs[-1] < start < STEPS, start  # admitted right after a sync
        assert joiner["members"] == members and sorted(joiner["digests"]) == list(range(start, STEPS))
        for r in survivors:
            assert res[r]["snap"][0] == start
        _assert_a_fresh_run_ends_alike(out, algo, options, members, start, {**res, P: joiner})


def _every_change_alike(out, res, survivors, P, kills, replaced, steps):
    """For the algorithms whose survivors may stand at different step counts when they meet a loss: one
    MembershipChanged per loss on every survivor, the changes' world sizes, every survivor leaving the last
    change at one step count, and a joiner (``replaced``, added to ``res``) with rank 0's module. Returns
    (members, that step count, rank 0's snapshot there, the joiner's or None)."""
    members = survivors + ([P] if replaced else [])
    for r, x in res.items():
        assert len(x["discarded"]) == len(kills), (r, x["discarded"], x.get("messages"))  # one per loss
        assert [c[:2] for c in x["changes"]] == [(P - i, P - i - 1) for i in range(len(kills))] + \
            ([(P - len(kills), P - len(kills) + 1)] if replaced else []), x["changes"]
        assert x["members"] == members and x["world"] == len(members)
    starts = {res[r]["snap"][0] for r in survivors}  # the furthest survivor's step count, on every one
    assert len(starts) == 1, starts
    start = starts.pop()
    assert max(kills.values()) <= start < steps, (start, kills)
    src, mine = res[survivors[0]]["snap"][1], None
    if replaced:
        joiner = res[P] = torch.load(os.path.join(out, f"result_{P}.pt"), weights_only=False)
        assert joiner["joined_at"] == start and joiner["members"] == members
        assert sorted(joiner["digests"]) == list(range(start, steps))
        mine = joiner["snap"][1]
        for k, v in src["module"].items():  # rank 0's weights
            assert torch.equal(v, mine["module"][k]), k
    return members, start, src, mine


DECENTRALIZED = [  # (algorithm, options, P, {rank: step it is killed at}, replaced)
    ("decentralized", {"peer_selection": "ring"}, 5, {2: 4}, False),
    ("decentralized", {"peer_selection": "ring"}, 4, {0: 3, 2: 11}, False),  # two kills, rank 0 first: 4 -> 3 -> 2
    ("decentralized", {"peer_selection": "shift_one", "communication_interval": 2}, 4, {1: 5}, False),
    ("decentralized", {"peer_selection": "ring"}, 4, {1: 3}, True),
    ("decentralized", {"peer_selection": "all"}, 3, {0: 4}, True),
    # compressed gossip (CHOCO): each rank's copies of its neighbours are made again with the new ring
    ("decentralized", {"peer_selection": "ring", "compression": "minmax_uint8"}, 5, {2: 4, 0: 12}, False),
    ("low_precision_decentralized", {}, 4, {1: 3}, True),  # ring_one_way
    ("low_precision_decentralized", {"peer_selection": "all", "compression": "sign"}, 4, {0: 5}, True),
]


@pytest.mark.parametrize("algo,options,P,kills,replaced", DECENTRALIZED,
                         ids=[f"{a}-{o.get('peer_selection', 'default')}{'-' + o['compression'] if 'compression' in o else ''}"
                              f"-P{P}-kill{len(k)}{'-join' if j else ''}" for a, o, P, k, j in DECENTRALIZED])
def test_decentralized_re_forms_its_ring_and_admits_a_replacement(tmp_path, algo, options, P, kills, replaced):
    """Decentralized SGD has no collective of all ranks: a neighbour of the lost worker meets the loss in
    its exchange, the others at their next step's look at the store. The survivors keep their own weights
    (replicas differ by design), drop the exchange in flight where it had not completed, take the furthest
    survivor's step and exchange counts, and re-form the ring. A replacement is admitted at the step rank 0
    posts in the store and starts from rank 0's weights; the members keep theirs. After the last change the
    run is bit for bit a fresh run of its members from the state each had then."""
    steps = _steps(algo)
    out, survivors, res = _killed_run(tmp_path, P, algo, options, kills, replaced)
    members, start, src, mine = _every_change_alike(out, res, survivors, P, kills, replaced, steps)
    if replaced:  # rank 0's optimizer state too
        for i, st in src["optimizer"]["state"].items():
            assert torch.equal(st["momentum_buffer"], mine["optimizer"]["state"][i]["momentum_buffer"]), i
        assert mine["algorithm"]["exchanges"] == src["algorithm"]["exchanges"]
        # the members kept their own weights: they still differ from rank 0's (not overwritten by the join)
        for r in survivors[1:]:
            other = res[r]["snap"][1]["module"]
            assert any(not torch.equal(v, other[k]) for k, v in src["module"].items()), r
    if "x_hat" in res[survivors[0]]["snap"][1]["algorithm"]:  # compressed gossip: CHOCO's copies made again
        n, selection = len(members), options.get("peer_selection", "ring_one_way")
        x_hat = {i: res[m]["snap"][1]["algorithm"]["x_hat"][0] for i, m in enumerate(members)}
        for i, m in enumerate(members):
            own = torch.cat([v.reshape(-1) for v in res[m]["snap"][1]["module"].values()])
            assert torch.equal(x_hat[i], own), m  # its copy is its weights
            frm = [j for j in range(n) if j != i] if selection == "all" else \
                [(i - 1) % n] if selection == "ring_one_way" else sorted({(i - 1) % n, (i + 1) % n} - {i})
            expected = torch.zeros_like(own)
            for j in frm:
                expected += x_hat[j]
            got = res[m]["snap"][1]["algorithm"]["nbr_sum"][0]
            if selection == "all":  # an allreduce of every copy minus its own: the same up to rounding
                assert torch.allclose(got, expected, rtol=0, atol=1e-5), m
            else:  # received exactly, summed in the order of the neighbours
                assert torch.equal(got, expected), m
    _assert_a_fresh_run_ends_alike(out, algo, options, members, start, res)


@pytest.mark.parametrize("options,P,victim", [({"sync_interval_ms": 50}, 4, 1),
                                              ({"sync_interval_ms": 50, "compression": "minmax_uint8"}, 5, 0)],
                         ids=["dense-P4", "minmax_uint8-P5-rank0"])
def test_async_model_average_admits_a_replacement_through_its_averaging_rounds(tmp_path, options, P, victim):
    """Asynchronous averaging: the news of a waiting joiner rides in the background threads' go-on flag, so
    every member's thread ends in the same round and each member admits the joiner at its own next step
    boundary. The joiner starts from rank 0's optimizer state and step count; then members and joiner
    average their weights once: at the join every one of them holds the same weights, bit for bit."""
    algo, steps = "async_model_average", _steps("async_model_average")
    out, survivors, res = _killed_run(tmp_path, P, algo, options, {victim: 8}, True)
    joiner = torch.load(os.path.join(out, f"result_{P}.pt"), weights_only=False)
    members = survivors + [P]
    for r, x in res.items():
        assert len(x["discarded"]) == 1, (r, x["discarded"], x.get("messages"))  # the loss's step only
        assert [c[:2] for c in x["changes"]] == [(P, P - 1), (P - 1, P)], x["changes"]
        assert x["members"] == members and x["world"] == P
        assert sorted(x["digests"]) == list(range(steps)), r  # the discarded step was taken again
    assert joiner["changes"] == [(P - 1, P, None)] and joiner["members"] == members
    src, mine = res[survivors[0]]["snap"], joiner["snap"]
    assert mine[0] == joiner["joined_at"] == src[0] < steps, (mine[0], src[0])  # rank 0's step count
    for r in survivors:  # the average at the join: one set of weights on every member and the joiner
        assert res[r]["snap"][0] >= 8
        for k, v in mine[1]["module"].items():
            assert torch.equal(v, res[r]["snap"][1]["module"][k]), (r, k)
    for i, st in src[1]["optimizer"]["state"].items():  # rank 0's optimizer state
        assert torch.equal(st["momentum_buffer"], mine[1]["optimizer"]["state"][i]["momentum_buffer"]), i
    assert any(not torch.equal(src[1]["optimizer"]["state"][i]["momentum_buffer"], st["momentum_buffer"])
               for r in survivors[1:] for i, st in res[r]["snap"][1]["optimizer"]["state"].items())  # their own
    assert sorted(joiner["digests"]) == list(range(mine[0], steps))
    print(f"\n{algo} {options} P={P}: replacement admitted at rank 0's step {mine[0]}, {joiner['admitted_s']:.2f} s "
          f"from its start to admitted, {joiner['first_step_s']:.2f} s to its first step")


def _dies_in_the_sync(rank, P, port, out, algo, options, k, victim):
    """Rank ``victim`` dies inside step ``k``'s sync, after the step check, as the data is to travel: every
    survivor has compressed its change (updating its residual) when the exchange fails, none completes."""
    _join(port, rank, P)
    net = _net()
    opt = _optimizer(algo, net)
    model = bagua_lite.DistributedModel(net, opt, build(algo, **options), bucket_size_mb=0.001, fault_tolerant=True)
    if rank == victim:
        frag = model.algorithm.frags[0]
        reduce_work = frag.reduce_work

        def dies(group):
            if model.algorithm.step == k + 1:  # inside step k's after_step (the count moved on first)
                os.kill(os.getpid(), signal.SIGKILL)
            return reduce_work(group)
        frag.reduce_work = dies
    res = {"digests": {}, "discarded": [], "snap": None}

    def at_top(s):
        if s == k:  # the reference run starts here, with P - 1 workers
            res["snap"] = (s, _snapshot(model, net, opt))
    _train_and_save(model, net, opt, rank, STEPS, res, out, at_top)


def _train_and_save(model, net, opt, rank, steps, res, out, at_top=None, after_backward=None, on_change=None):
    """Train on this rank's data until the step count reaches ``steps`` (a discarded step is taken again:
    its count did not move); ``at_top(step)`` first in each, ``after_backward(step)`` before its
    ``optimizer.step()``, ``on_change(step)`` after a MembershipChanged; then save ``res`` with the final
    weights."""
    nothing = lambda s: None  # noqa: E731
    at_top, after_backward, on_change = at_top or nothing, after_backward or nothing, on_change or nothing
    while model.algorithm.step < steps:
        s = model.algorithm.step
        at_top(s)
        x, y = _batch(rank, s)
        try:
            F.cross_entropy(model(x), y).backward()
            after_backward(s)
            opt.step()
        except bagua_lite.MembershipChanged:
            res["discarded"].append(s)
            on_change(s)
        else:
            res["digests"][s] = _digest(net)
        opt.zero_grad()
    res.update(weights=_flat(net), me=rank)
    torch.save(res, os.path.join(out, f"result_{rank}.pt"))
    model.close()


@pytest.mark.parametrize("algo,options", [("diloco", {"period": 4, "compression": "minmax_uint8"}),
                                          ("local_sgd", {"period": 4, "compression": "sign"})])
def test_a_compressed_sync_that_failed_on_every_survivor_is_sent_again_with_the_residuals_before_it(
        tmp_path, algo, options):
    """Compressing a change updates the residual before anything travels, so a sync whose exchange then
    fails everywhere has touched every survivor's error feedback. The survivors put it back and finish the
    sync among themselves: bit for bit a fresh run of the three from the state each had before the step."""
    P, k, victim = 4, 7, 3  # step 7 ends the second period
    out = str(tmp_path)
    _, codes = _run(P, _dies_in_the_sync, (out, algo, options, k, victim), replace=None)
    assert codes == {0: 0, 1: 0, 2: 0, 3: -signal.SIGKILL}, codes
    res = {r: torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False) for r in (0, 1, 2)}
    for r in (0, 1, 2):
        assert res[r]["discarded"] == [k], res[r]["discarded"]  # the step's update was kept, its sync finished
        assert sorted(res[r]["digests"]) == [s for s in range(STEPS) if s != k]
    for s in range(k + 4, STEPS, 4):  # the syncs after it: the replicas identical again
        assert len({res[r]["digests"][s] for r in (0, 1, 2)}) == 1, s
    _assert_a_fresh_run_ends_alike(out, algo, options, [0, 1, 2], k, res)


STREAMING = [  # (options, P, {rank: step it is killed at}, replaced)
    ({"period": 4, "overlap": 1}, 4, {2: 5}, True),
    ({"period": 4, "overlap": 2, "fragments": 2, "alpha": 0.5}, 5, {1: 6, 0: 17}, False),  # rank 0 second
    ({"period": 6, "overlap": 2, "fragments": 3, "compression": "minmax_uint8"}, 4, {3: 9}, True),
]


@pytest.mark.parametrize("options,P,kills,replaced", STREAMING,
                         ids=[f"H{o['period']}-tau{o['overlap']}-F{o.get('fragments', 1)}-P{P}-kill{len(k)}"
                              f"{'-' + o['compression'] if 'compression' in o else ''}{'-join' if j else ''}"
                              for o, P, k, j in STREAMING])
def test_streaming_diloco_drops_the_syncs_in_flight_and_admits_through_the_store(tmp_path, options, P, kills, replaced):
    """Streaming DiLoCo syncs on a background thread and merges each sync ``overlap`` steps later, so the
    survivors meet a loss at a merge (or in the store before a step) at different step counts. A fragment
    whose sync some survivor merged is taken from it by the others (anchors, outer optimizer state, merged
    into their own weights); every sync merged nowhere is dropped everywhere (its change stays in the
    weights); every survivor takes the furthest one's step count, and the background thread and group are
    made again. A joiner is admitted at the step rank 0 posts in the store, once the syncs in flight finished;
    it gets them with rank 0's state. After the last change the run is bit for bit a fresh run of its
    members from the state each had then."""
    algo, steps = "diloco", _steps("diloco", options)
    out, survivors, res = _killed_run(tmp_path, P, algo, options, kills, replaced)
    members, start, src, mine = _every_change_alike(out, res, survivors, P, kills, replaced, steps)
    if replaced:
        for f, (a, b) in enumerate(zip(src["algorithm"]["fragments"], mine["algorithm"]["fragments"])):
            assert all(torch.equal(x, y) for x, y in zip(a["averager"]["anchors"], b["averager"]["anchors"])), f
            assert (a["pending"] is None) == (b["pending"] is None), f  # a sync in flight travels with the state
    _assert_a_fresh_run_ends_alike(out, algo, options, members, start, res)


def _behind_at_a_merge(rank, P, port, out, options, victim, behind):
    """Streaming diloco (period 4, overlap 1): the sync started after step 3 is merged after step 4. On rank
    ``behind`` that merge fails (as if its sync had; simulated), the others merge it, and ``victim`` dies
    right after its own merge: a sync merged by some survivors only."""
    store = _join(port, rank, P)
    net = _net()
    opt = _optimizer("diloco", net)
    model = bagua_lite.DistributedModel(net, opt, build("diloco", **options), bucket_size_mb=0.001,
                                        fault_tolerant=True)
    alg = model.algorithm
    res = {"digests": {}, "discarded": [], "snap": None}
    if rank == behind:
        merge = alg._merge

        def fails(f):
            if alg.step == 5:
                alg.pending.pop(f)  # its result never arrives here
                store.wait([f"dead/{victim}"])  # after the victim's own merge: it is gone, not a member
                time.sleep(0.3)
                raise RuntimeError("simulated: fragment 0's sync failed on this rank")
            return merge(f)
        alg._merge = fails

    def changed(old, new):
        res["snap"] = (alg.step, _snapshot(model, net, opt))
    model._elastic.callback = changed

    def at_top(s):
        if rank == victim and s == 5:
            store.set(f"dead/{victim}", "1")
            os.kill(os.getpid(), signal.SIGKILL)
    _train_and_save(model, net, opt, rank, _steps("diloco", options), res, out, at_top)


def test_streaming_diloco_survivors_behind_by_a_merge_take_it_from_one_that_made_it(tmp_path):
    options = {"period": 4, "overlap": 1}
    P, victim, behind = 4, 3, 1
    out = str(tmp_path)
    _, codes = _run(P, _behind_at_a_merge, (out, options, victim, behind), replace=None)
    assert codes == {0: 0, 1: 0, 2: 0, 3: -signal.SIGKILL}, codes
    res = {r: torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False) for r in (0, 1, 2)}
    assert res[behind]["discarded"] == [4]  # its step 4 raised at the merge (the update kept)
    # the others went on with local steps and met the loss at a later merge (or in the store before a step)
    assert len(res[0]["discarded"]) == 1 and res[0]["discarded"] == res[2]["discarded"], res[0]["discarded"]
    assert res[0]["discarded"][0] >= 5
    snaps = {r: res[r]["snap"] for r in (0, 1, 2)}
    start = snaps[0][0]
    assert {s[0] for s in snaps.values()} == {start}, snaps  # the behind one took the others' step count
    for r in (1, 2):  # the merge taken: the anchors and outer momentum of rank 0
        a, b = snaps[0][1], snaps[r][1]
        fa, fb = a["algorithm"]["fragments"][0], b["algorithm"]["fragments"][0]
        assert all(torch.equal(x, y) for x, y in zip(fa["averager"]["anchors"], fb["averager"]["anchors"])), r
        for i, st in fa["outer"]["state"].items():
            assert torch.equal(st["momentum_buffer"], fb["outer"]["state"][i]["momentum_buffer"]), (r, i)
    _assert_a_fresh_run_ends_alike(out, "diloco", options, [0, 1, 2], start, res)


AUTO = {"probe_steps": 0, "compute_s": 0.01, "network": {"alpha": 1e-4, "beta": 1e-6},  # 1 MB/s: sparse wins
        "machine": {"topk_s_per_elem": 0.0, "quantize_s_per_elem": 0.0, "fp16_s_per_elem": 0.0,
                    "add_s_per_elem": 0.0},
        "candidates": ["gradient_allreduce", {"name": "gtopk", "options": {"density": 0.1}}],
        "efficiency": {"gtopk(density=0.1)": 1.0}}


def test_auto_carries_on_with_its_pick_and_a_joiner_takes_the_pick_from_rank_0(tmp_path):
    """auto hands the model its pick, which then heals as it does on its own; a joiner's auto does not
    probe: it takes rank 0's pick (and decision) and is set up with it where the members regroup."""
    P = 4
    out, survivors, res = _killed_run(tmp_path, P, "auto", AUTO, {1: 4}, True)
    joiner = torch.load(os.path.join(out, f"result_{P}.pt"), weights_only=False)
    members = survivors + [P]
    start = joiner["joined_at"]
    for r, x in res.items():
        assert x["discarded"] == [4] and x["active"].startswith("GTopK(") and x["members"] == members, x
        assert x["snap"][0] == start
    assert joiner["active"] == res[0]["active"] and joiner["snap"][1]["algorithm"]["configured"]["picked"] == \
        res[0]["snap"][1]["algorithm"]["configured"]["picked"]
    for s in range(start, STEPS):  # replicas bit-identical from the join on
        assert len({res[r]["digests"][s] for r in survivors} | {joiner["digests"][s]}) == 1, s
    _assert_a_fresh_run_ends_alike(out, "auto", AUTO, members, start, {**res, P: joiner})
