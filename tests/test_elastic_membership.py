"""Survivors carry on (``fault_tolerant=True``): workers SIGKILLed mid-run, the others finish every step.

Real processes (forked from tests/cluster.py's forkserver, which imported torch once), each joining with
``bagua_lite.init_process_group()`` as a client of a TCPStore served by this test process, so the store
outlives every worker (not torchrun: its agent tears down every worker when one fails). Each worker trains on its own
data (by its global rank, the same in every run) and kills itself with SIGKILL at the top of its chosen
step. Checked: the survivors finish all steps with exactly one step discarded per failure, their replicas
are bit-identical after every step, and their final weights equal bit for bit a reference run in which the
same survivors, at the new world size and in the same rank order, start from the state they had when the
failure came (a per-rank snapshot) and train the steps after it.
"""
import datetime
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

D_IN, HIDDEN, CLASSES = 12, 32, 5
STEPS = 12
STEPS_OF = {"async_model_average": 60}  # its ranks do not wait for each other: paced, so they meet the loss
PACE_S = {"async_model_average": 0.1}


def _steps(algo):
    return STEPS_OF.get(algo, STEPS)
TIMEOUT_S = 30  # the groups' timeout: abandoned collectives end by then; no test waits for it


def _net(batchnorm=False):
    torch.manual_seed(0)
    norm = [torch.nn.BatchNorm1d(HIDDEN)] if batchnorm else []  # buffers: broadcast before every forward
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), *norm, torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


def _batch(rank, step):
    g = torch.Generator().manual_seed(rank * 7919 + step * 31 + 5)
    x = torch.randn(16, D_IN, generator=g)
    return x, (x[:, :CLASSES] * 3).argmax(1)


def _flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


def _digest(net):
    return hashlib.sha256(_flat(net).numpy().tobytes()).hexdigest()


def _join(port, rank, world_size, timeout_s=TIMEOUT_S):
    """Each worker started on its own against a store served elsewhere (here: by the test), as a per-worker
    launch does: the environment torchrun would set, every worker a client of the store
    (TORCHELASTIC_USE_AGENT_STORE), and bagua_lite.init_process_group()."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    bagua_lite.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _train(rank, P, port, out, algo, options, kills, min_workers, window, batchnorm=False, how=signal.SIGKILL,
           timeout_s=TIMEOUT_S, heartbeat_s=10.0):
    """A fault-tolerant worker: rank ``rank`` of ``P``; ``kills``: {global rank: step it sends itself ``how``
    at (SIGKILL, or SIGSTOP: stopped, not dead)}."""
    store = _join(port, rank, P, timeout_s)
    net = _net(batchnorm)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    changes = []
    model = bagua_lite.DistributedModel(net, opt, build(algo, **options), bucket_size_mb=0.001,
                                        fault_tolerant=True, min_workers=min_workers, rejoin_window_s=window,
                                        heartbeat_timeout_s=heartbeat_s,
                                        on_membership_change=lambda old, new: changes.append((old, new)))
    result = {"rank": rank, "digests": {}, "discarded": [], "at_change": [], "next_step_at": [], "recoveries": [],
              "error": None}
    # a synchronous algorithm's survivors keep equal step counts, so the loop counts its own iterations; one
    # that heals itself may move a survivor's step count on, so the loop follows it (docs/fault_tolerance.md)
    follows_step = getattr(model.algorithm, "heals_itself", False)
    i = 0
    try:
        while i < _steps(algo):
            if i in kills.values() and not follows_step:  # everyone's state at the failure step: the reference starts from it
                torch.save({"module": net.state_dict(), "optimizer": opt.state_dict(),
                            "algorithm": model.algorithm_state_dict()}, os.path.join(out, f"snap{i}_{rank}.pt"))
            if kills.get(rank) == i:
                store.set(f"killed_at/{i}", repr(time.time()))
                os.kill(os.getpid(), how)
            x, y = _batch(rank, i)
            try:
                F.cross_entropy(model(x), y).backward()
                opt.step()
            except bagua_lite.MembershipChanged as e:
                result["discarded"].append((i, e.old_world_size, e.new_world_size, model.rank))
                result["at_change"].append(_digest(net))
                result["recoveries"].append(model._elastic.last_recovery)
            else:
                result["digests"][i] = _digest(net)
                if len(result["next_step_at"]) < len(result["discarded"]):
                    result["next_step_at"].append((i, time.time()))
            opt.zero_grad()
            time.sleep(PACE_S.get(algo, 0))
            i = model.algorithm.step if follows_step else i + 1
    except bagua_lite.MembershipError as e:
        result["error"] = (str(e), time.time())
    result.update(weights=_flat(net), steps=model.algorithm.step, world=model.world_size, changes=changes,
                  nodes=getattr(model.algorithm, "nodes", None))
    torch.save(result, os.path.join(out, f"result_{rank}.pt"))
    model.close()


def _reference(rank, P, port, out, algo, options, members, start, batchnorm):
    """The same survivors without the dead ranks: new rank ``rank`` is global rank ``members[rank]``, from
    its snapshot at step ``start``, training steps ``start + 1 ..`` on its own data at world size P."""
    _join(port, rank, P)
    me = members[rank]
    net = _net(batchnorm)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model = bagua_lite.DistributedModel(net, opt, build(algo, **options), bucket_size_mb=0.001)
    snap = torch.load(os.path.join(out, f"snap{start}_{me}.pt"), weights_only=False)
    net.load_state_dict(snap["module"])
    opt.load_state_dict(snap["optimizer"])
    model.load_algorithm_state_dict(snap["algorithm"])
    for i in range(start + 1, STEPS):
        x, y = _batch(me, i)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    torch.save({"weights": _flat(net)}, os.path.join(out, f"reference_{me}.pt"))
    model.close()


def _launch(P, fn, *args, deadline_s=60, stopped=()):
    """Start P processes running fn(rank, P, port, *args) against a TCPStore served here; wait for all of
    them (a SIGKILLed one too; the ranks in ``stopped`` are SIGKILLed once the others ended); return their
    exit codes. No process outlives this call."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    ctx = _context()
    procs = [ctx.Process(target=fn, args=(r, P, store.port) + args, daemon=True) for r in range(P)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    for r, p in enumerate(procs):
        if r not in stopped:
            p.join(timeout=max(0.1, end - time.monotonic()))
    for r in stopped:
        procs[r].kill()
        procs[r].join()
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    assert not hung, f"{fn.__name__}: rank(s) {hung} still running after {deadline_s} s (a hang)"
    codes = [p.exitcode for p in procs]
    return store, codes


CASES = [  # (algorithm, options, P, {global rank: step it is killed at}, BatchNorm buffers)
    ("gradient_allreduce", {}, 4, {2: 4}, False),
    ("gradient_allreduce", {}, 4, {0: 5}, True),  # the buffers' source dies: found in the forward's broadcast
    ("gradient_allreduce", {"compression": "sign"}, 5, {4: 3, 1: 7}, False),  # error feedback, two kills
    ("topk", {"density": 0.1}, 4, {1: 5}, False),
    ("gtopk", {"density": 0.1}, 5, {3: 4, 0: 8}, False),  # rank 0 dies too; P 5 -> 4 -> 3
    ("powersgd", {"rank": 2, "warmup_steps": 2}, 4, {0: 6}, False),  # step checked before the buckets
]


@pytest.mark.parametrize("algo,options,P,kills,batchnorm", CASES,
                         ids=[f"{a}{'-' + '-'.join(map(str, o.values())) if o else ''}-P{P}-kill{len(k)}"
                              f"{'-batchnorm' if bn else ''}" for a, o, P, k, bn in CASES])
def test_survivors_carry_on_bit_identical_to_a_run_without_the_dead(tmp_path, algo, options, P, kills, batchnorm):
    out = str(tmp_path)
    store, codes = _launch(P, _train, out, algo, options, kills, 1, 2.0, batchnorm)
    dead = sorted(kills)
    survivors = [r for r in range(P) if r not in kills]
    assert [codes[r] for r in dead] == [-signal.SIGKILL] * len(dead), codes
    assert [codes[r] for r in survivors] == [0] * len(survivors), codes
    results = {r: torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False) for r in survivors}
    kill_steps = sorted(kills.values())
    worlds = [P - n for n in range(len(kills) + 1)]
    for r, res in results.items():
        assert res["error"] is None, res["error"]
        # exactly the failure steps were discarded, each one once; every other step completed
        assert [d[0] for d in res["discarded"]] == kill_steps, res["discarded"]
        assert [(d[1], d[2]) for d in res["discarded"]] == list(zip(worlds, worlds[1:]))
        assert res["changes"] == list(zip(worlds, worlds[1:]))
        assert sorted(res["digests"]) == [i for i in range(STEPS) if i not in kill_steps]
        assert res["steps"] == STEPS - len(kills) and res["world"] == P - len(kills)
        assert res["discarded"][-1][3] == survivors.index(r)  # the new rank: order of the global ranks
    first = results[survivors[0]]
    for r in survivors[1:]:  # replicas bit-identical after every step, before and after each change
        assert results[r]["digests"] == first["digests"], f"rank {r} differs from rank {survivors[0]}"
    for n, k in enumerate(kill_steps):
        killed_at = float(store.get(f"killed_at/{k}"))
        resumed = max(dict(results[r]["next_step_at"])[k + 1] for r in survivors)
        rec = [results[r]["recoveries"][n] for r in survivors]
        detected = max(x["started_at"] for x in rec) - killed_at
        print(f"\n{algo} {options} P={P}: failure {n + 1} at step {k}: {resumed - killed_at:.2f} s from the kill to "
              f"every survivor's next completed step; detected after {detected:.2f} s "
              f"(last survivor), membership agreed in {max(x['membership_s'] for x in rec):.2f} s, new group and "
              f"checks {max(x['regroup_s'] for x in rec):.3f} s; steps lost beyond the discarded one: 0")
    # the strong check: the same survivors, without the dead, from the state at the last failure
    start = kill_steps[-1]
    _, ref_codes = _launch(len(survivors), _reference, out, algo, options, survivors, start, batchnorm)
    assert ref_codes == [0] * len(survivors), ref_codes
    for r in survivors:
        ref = torch.load(os.path.join(out, f"reference_{r}.pt"), weights_only=False)["weights"]
        assert torch.equal(results[r]["weights"], ref), \
            f"rank {r}: max |diff| {(results[r]['weights'] - ref).abs().max().item()}"


ASYNC = [({"sync_interval_ms": 50}, 5, {3: 4}), ({"sync_interval_ms": 50, "compression": "minmax_uint8"}, 4, {0: 3, 2: 7})]


@pytest.mark.parametrize("options,P,kills", ASYNC, ids=[f"P{P}-kill{len(k)}-{o.get('compression', 'dense')}"
                                                        for o, P, k in ASYNC])
def test_async_model_average_survivors_average_once_and_carry_on(tmp_path, options, P, kills):
    """Asynchronous averaging has no step boundary the ranks share: each survivor learns of the loss before
    one of its forwards (its averaging thread failed, a peer said so in the store), discards that step, and
    the survivors average their weights once on the new group: bit-identical there, whatever each had
    trained meanwhile, and with compression their anchors are that average too. Then each goes on alone."""
    out = str(tmp_path)
    store, codes = _launch(P, _train, out, "async_model_average", options, kills, 1, 2.0)
    survivors = [r for r in range(P) if r not in kills]
    assert [codes[r] for r in survivors] == [0] * len(survivors) and \
        [codes[r] for r in kills] == [-signal.SIGKILL] * len(kills), codes
    results = {r: torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False) for r in survivors}
    worlds = [P - n for n in range(len(kills) + 1)]
    for r, res in results.items():
        assert res["error"] is None, res["error"]
        assert [(d[1], d[2]) for d in res["discarded"]] == list(zip(worlds, worlds[1:])), res["discarded"]
        assert res["changes"] == list(zip(worlds, worlds[1:])) and res["world"] == P - len(kills)
        assert res["steps"] == _steps("async_model_average"), res["steps"]  # discarded steps are taken again
        assert sorted(res["digests"]) == list(range(_steps("async_model_average")))
        assert res["discarded"][-1][3] == survivors.index(r)
    for n in range(len(kills)):  # the average at each change: the same weights on every survivor
        assert len({results[r]["at_change"][n] for r in survivors}) == 1, [results[r]["at_change"] for r in survivors]
    first = sorted(kills.items(), key=lambda kv: kv[1])[0][1]
    killed_at = float(store.get(f"killed_at/{first}"))
    resumed = max(results[r]["next_step_at"][0][1] for r in survivors)
    print(f"\nasync_model_average {options} P={P}: {resumed - killed_at:.2f} s from the first kill to every "
          f"survivor's next completed step")


@pytest.mark.parametrize("algo,options", [("gtopk", {"density": 0.1}), ("decentralized", {}),
                                          ("async_model_average", {"sync_interval_ms": 50})])
def test_a_stopped_worker_is_left_out_when_its_heartbeat_stops(tmp_path, algo, options):
    """SIGSTOP: the worker is not dead and its connections stay open, so gloo would raise on its peers only
    at the group's timeout, torch's default 30 minutes here. Its heartbeat stops instead: after
    heartbeat_timeout_s (3 s) of waiting for it the survivors leave it out and carry on."""
    out = str(tmp_path)
    store, codes = _launch(4, _train, out, algo, options, {2: 4}, 1, 2.0, False, signal.SIGSTOP, 1800, 3.0,
                           stopped=(2,))
    assert codes == [0, 0, -signal.SIGKILL, 0], codes
    results = [torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False) for r in (0, 1, 3)]
    for res in results:
        assert res["error"] is None and len(res["discarded"]) == 1, res["discarded"]
        assert res["discarded"][0][1:3] == (4, 3), res["discarded"]
        assert res["steps"] == STEPS - 1 or algo != "gtopk", res["steps"]
        if algo == "gtopk":  # synchronous: the stopped worker's step 4 is the one discarded
            assert res["discarded"][0][0] == 4 and res["digests"] == results[0]["digests"]
    killed_at = float(store.get("killed_at/4"))
    resumed = max(res["next_step_at"][0][1] for res in results)
    print(f"\n{algo}: SIGSTOP at step 4: {resumed - killed_at:.2f} s from the stop to every survivor's next "
          f"completed step (group timeout 1800 s, heartbeat timeout 3 s, rejoin window 2 s)")


def _dies_while_re_forming(rank, P, port, out):
    """_train, except that rank 1 dies as the survivors of the first loss connect their new group."""
    if rank == 1:
        from bagua_lite import elastic

        connect = elastic.reform

        def reform(base, g, *args, **kwargs):
            if g == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return connect(base, g, *args, **kwargs)
        elastic.reform = reform
    _train(rank, P, port, out, "gradient_allreduce", {}, {2: 3}, 1, 2.0, False, signal.SIGKILL, 1800, 3.0)


def test_a_member_lost_while_the_survivors_re_form_is_left_out_by_the_next_generation(tmp_path):
    """A second loss in the second or so the survivors spend connecting their new group: the dead member
    never joins gloo's rendezvous, which would hold the others for the group's timeout (30 minutes here).
    They watch its heartbeat while they connect, give that generation up and form the next one without it:
    one step discarded for both losses, and the two left go on bit-identical, bit for bit a run of the two
    from the state at the failure step."""
    out = str(tmp_path)
    _, codes = _launch(4, _dies_while_re_forming, out)
    assert codes == [0, -signal.SIGKILL, -signal.SIGKILL, 0], codes
    results = {r: torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False) for r in (0, 3)}
    for r, res in results.items():
        assert res["error"] is None, res["error"]
        assert [d[:3] for d in res["discarded"]] == [(3, 4, 2)], res["discarded"]
        assert res["changes"] == [(4, 2)] and res["world"] == 2 and res["steps"] == STEPS - 1
        assert res["recoveries"][0]["generations_given_up"] == 1, res["recoveries"]  # [0, 1, 3], then [0, 3]
        assert sorted(res["digests"]) == [i for i in range(STEPS) if i != 3]
    assert results[0]["digests"] == results[3]["digests"]
    _, ref_codes = _launch(2, _reference, out, "gradient_allreduce", {}, [0, 3], 3, False)
    assert ref_codes == [0, 0], ref_codes
    for r in (0, 3):
        ref = torch.load(os.path.join(out, f"reference_{r}.pt"), weights_only=False)["weights"]
        assert torch.equal(results[r]["weights"], ref), r


def test_fewer_than_min_workers_raises_on_every_survivor(tmp_path):
    out = str(tmp_path)
    store, codes = _launch(4, _train, out, "gradient_allreduce", {}, {1: 3}, 4, 2.0)
    assert codes == [0, -signal.SIGKILL, 0, 0], codes
    killed_at = float(store.get("killed_at/3"))
    for r in (0, 2, 3):
        res = torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False)
        assert res["error"] is not None, f"rank {r} carried on below min_workers"
        msg, when = res["error"]
        assert "only 3 worker(s) left" in msg and "min_workers=4" in msg and "checkpoint" in msg, msg
        assert res["steps"] == 3 and sorted(res["digests"]) == [0, 1, 2]  # nothing of step 3 applied
        print(f"\nrank {r}: MembershipError {when - killed_at:.2f} s after the kill")


@bagua_lite.algorithms.register("ft_fails_on_rank1_test")
class FailsOnRank1(type(build("gradient_allreduce"))):
    """Dense averaging whose bucket op raises on rank 1 at step 2 (a bug, not a lost worker)."""

    def bucket_ops(self, bucket):
        def average_or_fail(flat):
            if self.model.rank == 1 and self.step == 2:
                raise ValueError("a deliberate failure in bucket op average_or_fail")
            bagua_lite.comm.allreduce(flat, "sum", group=self.process_group)
        return [average_or_fail]


def _bug(rank, P, port, out):
    _join(port, rank, P)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = bagua_lite.DistributedModel(net, opt, build("ft_fails_on_rank1_test"), bucket_size_mb=0.001,
                                        fault_tolerant=True)
    error = None
    try:
        for i in range(STEPS):
            x, y = _batch(rank, i)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001
        error = (type(e).__name__, str(e), model.algorithm.step)
    torch.save(error, os.path.join(out, f"bug_{rank}.pt"))


def test_a_failure_with_every_worker_alive_raises_on_every_rank(tmp_path):
    """Not a lost worker (every member registers again at once): no membership change, no endless
    discarding: every rank raises, naming the op's error."""
    out = str(tmp_path)
    _, codes = _launch(4, _bug, out)
    assert codes == [0] * 4, codes
    for r in range(4):
        error = torch.load(os.path.join(out, f"bug_{r}.pt"), weights_only=False)
        assert error is not None and error[0] == "RuntimeError", (r, error)
        assert "every member is still there" in error[1] and error[2] == 2, (r, error)
    assert "deliberate failure" in torch.load(os.path.join(out, "bug_1.pt"), weights_only=False)[1]


@bagua_lite.algorithms.register("ft_not_elastic_test")
class NotElastic(bagua_lite.Algorithm):
    """An algorithm of one's own that does not say it carries on after a membership change."""

    def bucket_ops(self, bucket):
        return [self.native.AllreduceOp(self.process_group, True)]

    @classmethod
    def traffic(cls, options, P, numels, elem_bytes=4, machine=None, rank=None):  # so auto may name it
        dense = type(build("gradient_allreduce"))
        return dense.traffic({"compression": "none", "hierarchical": False, "ranks_per_node": 0}, P, numels,
                             elem_bytes, machine, rank)


def _refusals(rank, P, port, out):
    _join(port, rank, P)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    errors = {}
    for name, options in (("ft_not_elastic_test", {}),
                          ("auto", {"candidates": ["gtopk", "ft_not_elastic_test"]})):
        try:
            bagua_lite.DistributedModel(net, opt, build(name, **options), fault_tolerant=True).close()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    model = bagua_lite.DistributedModel(net, opt, "gradient_allreduce")  # the default: no membership state
    errors["default_has_no_controller"] = model._elastic is None and model.membership is None
    model.close()
    torch.save(errors, os.path.join(out, "refusals.pt"))


def test_an_algorithm_that_does_not_opt_in_is_refused_with_fault_tolerant(tmp_path):
    out = str(tmp_path)
    _, codes = _launch(1, _refusals, out)
    assert codes == [0]
    errors = torch.load(os.path.join(out, "refusals.pt"), weights_only=False)
    assert errors.pop("default_has_no_controller") is True
    for name, msg in errors.items():
        assert msg is not None, f"{name} was accepted with fault_tolerant=True"
        assert "supports_membership_change" in msg and "every built-in one does" in msg and name in msg, msg


def test_a_worker_lost_during_autos_probe_ends_the_run_with_a_clear_error(tmp_path):
    """auto's probe steps measure the job before it picks: a loss there is not healed (nothing is picked to
    heal it); every survivor raises MembershipError naming the probe, instead of a stray error or a hang."""
    options = {"probe_steps": 6, "network": {"alpha": 1e-4, "beta": 1e-6},
               "machine": {"topk_s_per_elem": 0.0, "quantize_s_per_elem": 0.0, "fp16_s_per_elem": 0.0,
                           "add_s_per_elem": 0.0},
               "candidates": ["gradient_allreduce", {"name": "gtopk", "options": {"density": 0.1}}]}
    out = str(tmp_path)
    _, codes = _launch(4, _train, out, "auto", options, {2: 2}, 1, 2.0)
    assert codes == [0, 0, -signal.SIGKILL, 0], codes
    for r in (0, 1, 3):
        res = torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False)
        assert res["error"] is not None, f"rank {r} carried on"
        assert "lost during its probe" in res["error"][0] and "restart" in res["error"][0], res["error"][0]


def test_hierarchical_allreduce_finds_its_nodes_again(tmp_path):
    """Hierarchical allreduce on two "nodes" of two ranks (ranks_per_node 2): rank 1 dies, so node 0 keeps one
    rank and the survivors' ranks are 0, 1, 2 for member ids 0, 2, 3. The nodes are found by member id, not
    counted by rank: [[0], [1, 2]] (a fresh run at P = 3 would count [[0, 1], [2]]). The survivors go on
    bit-identical; their final weights equal the fresh run's up to the order of the sums."""
    options = {"hierarchical": True, "ranks_per_node": 2}
    out = str(tmp_path)
    _, codes = _launch(4, _train, out, "gradient_allreduce", options, {1: 4}, 1, 2.0)
    assert codes == [0, -signal.SIGKILL, 0, 0], codes
    results = {r: torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False) for r in (0, 2, 3)}
    for r, res in results.items():
        assert res["error"] is None and [d[0] for d in res["discarded"]] == [4], res["discarded"]
        assert res["nodes"] == [[0], [1, 2]], res["nodes"]
        assert res["digests"] == results[0]["digests"] and sorted(res["digests"]) == [i for i in range(STEPS) if i != 4]
    _, ref_codes = _launch(3, _reference, out, "gradient_allreduce", options, [0, 2, 3], 4, False)
    assert ref_codes == [0] * 3, ref_codes
    ref = torch.load(os.path.join(out, "reference_0.pt"), weights_only=False)["weights"]
    assert torch.allclose(results[0]["weights"], ref, rtol=0, atol=1e-5), (results[0]["weights"] - ref).abs().max()
