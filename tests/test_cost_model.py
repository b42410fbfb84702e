"""The alpha-beta cost model (bagua_lite.cost_model) and the auto algorithm built on it.

Unit tests check predict()'s byte counts against hand-computed values and its times against the
formulas of the module docstring; cluster tests (real gloo groups on loopback) check the network probe,
that predicted bytes equal what bagua_lite.comm.bytes_sent() counts for one real step, and that auto picks
one algorithm on every rank, says so in one line, and trains.
"""
import contextlib
import io
import logging
import math
import os
import re

import pytest
import torch
import torch.distributed as dist

import bagua_lite
import bagua_lite.algorithms.auto  # noqa: F401  (registers "auto")
from bagua_lite import comm
from bagua_lite import cost_model as cm
from bagua_lite.algorithms import build

N, DENSITY = 1000, 0.01  # k = 10; float32: m = 4000 bytes
ZERO = cm.Machine(0.0, 0.0, 0.0, 0.0)

# Hand-computed bytes per rank (busiest rank), one bucket of N float32 elements.
#   ring(m) = floor(2(P-1)m/P); fp16 chunks c_i: wire 2c; minmax_uint8: wire 8 + c.
#   P=3 chunks 334, 333, 333: fp16 a2a (busiest) 2000-666 = 1334, allgather 2*668 -> 2670;
#                             minmax a2a 1024-341 = 683, allgather 2*342 -> 1367.
HAND = {
    ("gradient_allreduce", ()): {2: 4000, 3: 5333, 4: 6000, 5: 6400, 8: 7000},
    ("ddp", ()): {2: 4000, 3: 5333, 4: 6000, 5: 6400, 8: 7000},
    ("ddp_fp16", ()): {2: 2000, 3: 2666, 4: 3000, 5: 3200, 8: 3500},
    ("gradient_allreduce", (("compression", "fp16"),)): {2: 2000, 3: 2670, 4: 3000, 5: 3200, 8: 3500},
    ("gradient_allreduce", (("compression", "minmax_uint8"),)): {2: 1016, 3: 1367, 4: 1548, 5: 1664, 8: 1862},
    # (P-1) * (24 meta + k * 8)
    ("topk", (("density", DENSITY),)): {2: 104, 3: 208, 4: 312, 5: 416, 8: 728},
    # messages of k * 8 = 80 bytes: log2 P' rounds (+1 on rank 0 when P is not a power of two)
    ("gtopk", (("density", DENSITY),)): {2: 80, 3: 160, 4: 160, 5: 240, 8: 240},
    # + ring(k * 4 = 40)
    ("gtopk", (("density", DENSITY), ("exact", True))): {2: 120, 3: 213, 4: 220, 5: 304, 8: 310},
    ("decentralized", ()): {2: 4000, 3: 8000, 4: 8000, 5: 8000, 8: 8000},
    ("decentralized", (("peer_selection", "shift_one"),)): {2: 4000, 3: 4000, 4: 4000, 5: 4000, 8: 4000},
    ("decentralized", (("peer_selection", "all"),)): {2: 4000, 3: 5333, 4: 6000, 5: 6400, 8: 7000},
    ("decentralized", (("communication_interval", 2),)): {2: 2000, 3: 4000, 4: 4000, 5: 4000, 8: 4000},
    ("local_sgd", ()): {2: 1000, 3: 1333.25, 4: 1500, 5: 1600, 8: 1750},
    # P-matrix 40*4 = 160 elements, Q-matrix 25*4 = 100: ring(640) + ring(400)
    ("ddp_powersgd", (("rank", 4), ("shapes", ((40, 25),)))): {2: 1040, 3: 1386, 4: 1560, 5: 1664, 8: 1820},
}


@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
def test_bytes_match_hand_computed(P):
    work = cm.Workload(numel=N)
    for (name, opts), by_p in HAND.items():
        got = cm.predict(name, dict(opts), P, work, cm.Network(1e-5, 1e-9), ZERO)["bytes_per_rank"]
        assert got == by_p[P], f"{name}{dict(opts)} at P={P}: predicted {got}, hand-computed {by_p[P]}"


def test_bytes_per_rank_differ_by_rank_where_the_wire_does():
    fp16 = [cm.bytes_per_rank("gradient_allreduce", {"compression": "fp16"}, 3, [N], rank=r) for r in range(3)]
    assert fp16 == [2668, 2670, 2670]  # rank 0 holds the 334-element chunk and sends the others less
    mm = [cm.bytes_per_rank("gradient_allreduce", {"compression": "minmax_uint8"}, 3, [N], rank=r) for r in range(3)]
    assert mm == [1366, 1367, 1367]
    g5 = [cm.bytes_per_rank("gtopk", {"density": DENSITY}, 5, [N], rank=r) for r in range(5)]
    assert g5 == [240, 160, 160, 160, 80]  # rank 0: 2 rounds + unfold; rank 4: fold only
    g3 = [cm.bytes_per_rank("gtopk", {"density": DENSITY}, 3, [N], rank=r) for r in range(3)]
    assert g3 == [160, 80, 80]
    # Buckets add up, each with its own k.
    two = cm.bytes_per_rank("topk", {"density": DENSITY}, 4, [600, 400])
    assert two == 3 * (24 + 6 * 8) + 3 * (24 + 4 * 8)


def test_times_follow_the_formulas():
    net = cm.Network(alpha=1e-3, beta=1e-6)
    work = cm.Workload(numel=N)  # compute 0: everything is exposed
    t = lambda name, P, **o: cm.predict(name, o, P, work, net, ZERO)  # noqa: E731
    assert t("ddp", 4)["comm_s"] == pytest.approx(6e-3 + 6000e-6)
    assert t("ddp", 4)["step_s"] == pytest.approx(6e-3 + 6000e-6)
    assert t("gtopk", 5, density=DENSITY)["comm_s"] == pytest.approx(4e-3 + 4 * 80e-6)  # 2 rounds + fold + unfold
    assert t("gtopk", 8, density=DENSITY)["comm_s"] == pytest.approx(3e-3 + 3 * 80e-6)
    assert t("topk", 4, density=DENSITY)["comm_s"] == pytest.approx(6e-3 + 312e-6)
    assert t("gradient_allreduce", 4, compression="fp16")["comm_s"] == pytest.approx(6e-3 + 3000e-6)
    assert t("decentralized", 4)["comm_s"] == pytest.approx(1e-3 + 8000e-6)  # both neighbours share the link
    assert t("decentralized", 4, peer_selection="shift_one")["comm_s"] == pytest.approx(1e-3 + 4000e-6)
    assert t("local_sgd", 4, period=4)["comm_s"] == pytest.approx((6e-3 + 6000e-6) / 4)
    for P in (1,):
        for name in ("ddp", "gtopk", "topk", "gradient_allreduce", "decentralized", "local_sgd"):
            assert t(name, P)["comm_s"] == 0 and t(name, P)["bytes_per_rank"] == 0


def test_overlap_pipeline():
    # 4 buckets of 250 floats at P=2: 1000 bytes each; backward 0.5 s (compute 1 s).
    work = cm.Workload(numel=N, compute_s=1.0, backward_fraction=0.5, n_buckets=4)
    # 0.1 s per bucket: ready at .125 .25 .375 .5, finish .225 .35 .475 .6 -> 0.1 s exposed
    p = cm.predict("gradient_allreduce", {}, 2, work, cm.Network(0.0, 1e-4), ZERO)
    assert p["comm_s"] == pytest.approx(0.4) and p["hidden_s"] == pytest.approx(0.3)
    assert p["step_s"] == pytest.approx(1.1)
    # 0.5 s per bucket: finish .625 1.125 1.625 2.125 -> 1.625 exposed
    p = cm.predict("gradient_allreduce", {}, 2, work, cm.Network(0.0, 5e-4), ZERO)
    assert p["step_s"] == pytest.approx(2.625) and p["hidden_s"] == pytest.approx(0.375)
    # after-step exchanges and the one-bucket PowerSGD hook hide nothing
    for name, o in (("local_sgd", {}), ("decentralized", {}), ("ddp_powersgd", {"rank": 2})):
        p = cm.predict(name, o, 2, work, cm.Network(0.0, 1e-4), ZERO)
        assert p["hidden_s"] == 0 and p["step_s"] == pytest.approx(1.0 + p["comm_s"] + p["compression_s"])


MACHINE = cm.Machine(topk_s_per_elem=2e-9, quantize_s_per_elem=8e-9, fp16_s_per_elem=4e-9, add_s_per_elem=2e-9,
                     merge_s_per_elem=4e-8, matmul_s_per_flop=2e-10)
WORK = cm.Workload(numel=25_000_000, compute_s=0.28, n_buckets=4)
ALL = [("ddp", {}), ("ddp_fp16", {}), ("ddp_powersgd", {"rank": 4}), ("gradient_allreduce", {}),
       ("gradient_allreduce", {"compression": "fp16"}), ("gradient_allreduce", {"compression": "minmax_uint8"}),
       ("topk", {"density": 0.001}), ("gtopk", {"density": 0.001}), ("gtopk", {"density": 0.001, "exact": True}),
       ("decentralized", {}), ("decentralized", {"peer_selection": "shift_one"}), ("local_sgd", {}), ("auto", {})]


def test_every_predictable_algorithm_is_covered():
    assert {n for n, _ in ALL} == set(cm.PREDICTABLE)
    with pytest.raises(ValueError, match="cannot predict 'nope'"):
        cm.predict("nope", {}, 4, WORK, cm.Network(0, 0), MACHINE)


def test_more_bandwidth_is_faster():
    for name, o in ALL:
        steps = [cm.predict(name, o, 8, WORK, cm.Network(5e-5, beta), MACHINE)["step_s"] for beta in (1e-7, 1e-8, 1e-9)]
        assert steps[0] > steps[1] > steps[2], f"{name}{o}: {steps}"
        keys = cm.predict(name, o, 8, WORK, cm.Network(5e-5, 1e-8), MACHINE)
        for k in ("step_s", "compute_s", "compression_s", "comm_s", "hidden_s", "bytes_per_rank"):
            assert keys[k] >= 0, (name, k)


def test_gtopk_grows_with_log_p_and_topk_with_p():
    g = lambda P: cm.predict("gtopk", {"density": DENSITY}, P, cm.Workload(numel=N), cm.Network(0, 1e-9), ZERO)  # noqa
    tk = lambda P: cm.predict("topk", {"density": DENSITY}, P, cm.Workload(numel=N), cm.Network(0, 1e-9), ZERO)  # noqa
    for P in (2, 4, 16, 128, 1024):
        assert g(P)["bytes_per_rank"] == 80 * math.log2(P)
        assert tk(P)["bytes_per_rank"] == (P - 1) * 104
    # non-powers of two pay one more message than the power of two below them
    assert g(1000)["bytes_per_rank"] == 80 * (9 + 1)
    rows = cm.project([("gtopk", {"density": 0.001}), ("topk", {"density": 0.001}), ("ddp", {})],
                      [16, 32, 128, 1024], WORK, cm.Network(5e-5, 8e-9), MACHINE)
    assert len(rows) == 12 and [r["world_size"] for r in rows[::3]] == [16, 32, 128, 1024]
    sp = {(r["algorithm"], r["world_size"]): r["speedup_vs_ddp"] for r in rows}
    assert all(sp[("ddp", P)] == 1.0 for P in (16, 32, 128, 1024))
    assert sp[("gtopk(density=0.001)", 1024)] > sp[("topk(density=0.001)", 1024)]
    assert sp[("topk(density=0.001)", 1024)] < sp[("topk(density=0.001)", 16)]


def test_auto_prediction_and_choice():
    slow, fast = cm.Network(5e-5, 8e-9), cm.Network(1e-6, 1e-12)
    assert cm.predict("auto", {}, 4, WORK, slow, MACHINE)["picked"].startswith(("gtopk", "topk"))
    assert cm.predict("auto", {}, 4, WORK, fast, MACHINE)["picked"] == "gradient_allreduce"
    # the `network` option decides the pick; the prediction is still made on `net`
    p = cm.predict("auto", {"network": {"alpha": 5e-5, "beta": 8e-9}}, 4, WORK, fast, MACHINE)
    assert p["picked"].startswith(("gtopk", "topk")) and p["comm_s"] < 1e-3
    # tolerance: an earlier candidate within it wins over a later, slightly faster one
    cands = [("local_sgd", {"period": 4}), ("local_sgd", {"period": 5})]
    i, preds = cm.choose(cands, 4, WORK, slow, MACHINE, tolerance=0.0)
    assert i == 1 and preds[1]["step_s"] < preds[0]["step_s"]
    assert cm.choose(cands, 4, WORK, slow, MACHINE, tolerance=0.5)[0] == 0
    assert cm.normalize_candidates(["topk", {"name": "gtopk", "options": {"density": 0.1}},
                                    {"name": "topk", "density": 0.2}, ("local_sgd", {"period": 2})]) == \
        [("topk", {}), ("gtopk", {"density": 0.1}), ("topk", {"density": 0.2}), ("local_sgd", {"period": 2})]


def test_auto_options_are_checked():
    with pytest.raises(ValueError, match="candidate 'ddp' is not allowed"):
        build("auto", candidates=["ddp"])
    with pytest.raises(ValueError, match="unknown option 'densty'"):
        build("auto", candidates=[{"name": "gtopk", "options": {"densty": 0.1}}])
    with pytest.raises(ValueError, match="network must be"):
        build("auto", network={"alpha": 1e-5})
    with pytest.raises(ValueError, match="probe_steps=0 needs compute_s"):
        build("auto", probe_steps=0)
    cfg = bagua_lite.load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "auto.yaml"))
    assert cfg.algorithm.name == "auto" and len(cfg.algorithm.candidates) == 5


# ---------------------------------------------------------------------------------------------------------
# on real gloo groups


def _r_probe(rank, P):
    default = cm.probe_network()
    small = cm.probe_network(sizes=(8, 1 << 14, 1 << 18, 1 << 20), repeats=5)
    # reuse=True: the measurement of the same sizes and repeats made earlier in this process, no traffic
    again = cm.probe_network(sizes=(8, 1 << 14, 1 << 18, 1 << 20), repeats=5, reuse=True)
    assert again is small
    other = cm.probe_network(sizes=(8, 1 << 14, 1 << 18, 1 << 20), repeats=4, reuse=True)  # not measured yet
    assert other is not small
    remeasured = cm.probe_network(sizes=(8, 1 << 14, 1 << 18, 1 << 20), repeats=5)  # reuse=False: measures
    assert remeasured is not small
    return [(default.alpha, default.beta), (small.alpha, small.beta), default.host_local, small.host_local]


@pytest.mark.parametrize("P", [2, 3, 4])
def test_probe_network_same_on_every_rank(clusters, P):
    res = clusters.get(P).run(_r_probe)
    assert len({(r[2], r[3]) for r in res}) == 1, res  # every rank agrees
    for r in res:  # one host and no rate limit: host_local exactly when faster than 5 Gbit/s
        assert r[2] == (r[0][1] < 8 / cm.HOST_LOCAL_MIN_BPS) and r[3] == (r[1][1] < 8 / cm.HOST_LOCAL_MIN_BPS), r
    for net in range(2):
        alphas_betas = {tuple(r[net]) for r in res}
        assert len(alphas_betas) == 1, f"ranks disagree: {res}"
        alpha, beta = res[0][net]
        assert alpha >= 0 and 1e-13 < beta < 1e-6, (alpha, beta)  # loopback: somewhere above 1 MB/s


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(50, 40), torch.nn.ReLU(), torch.nn.Linear(40, 7))  # 2327 params


def _one_step(model, opt, rank, seed=0):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x, y = torch.randn(16, 50, generator=g), torch.randint(0, 7, (16,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


BYTES_CASES = [("gradient_allreduce", {}), ("gradient_allreduce", {"compression": "fp16"}),
               ("gradient_allreduce", {"compression": "minmax_uint8"}), ("topk", {"density": 0.01}),
               ("gtopk", {"density": 0.01}), ("gtopk", {"density": 0.01, "exact": True}),
               ("decentralized", {}), ("decentralized", {"peer_selection": "all"}),
               ("local_sgd", {"period": 2})]


def _r_bytes(rank, P, cases, bucket_size_mb, steps):
    out = []
    for name, opts in cases:
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        model = bagua_lite.DistributedModel(net, opt, algorithm=build(name, **opts), bucket_size_mb=bucket_size_mb)
        numels = [b.numel for b in model.buckets]
        comm.reset_traffic()
        for s in range(steps):
            _one_step(model, opt, rank, s)
        sent = comm.bytes_sent() / steps
        model.close()
        out.append((name, opts, numels, sent))
    return out


@pytest.mark.parametrize("P", [2, 3, 4])
def test_predicted_bytes_equal_counted_bytes(clusters, P):
    c = clusters.get(P)
    checks = [(BYTES_CASES[:6], 100.0, 1), (BYTES_CASES[6:], 100.0, 2),
              ([("gradient_allreduce", {"compression": "fp16"}), ("topk", {"density": 0.01}),
                ("gtopk", {"density": 0.01})], 0.003, 1)]  # two buckets: 327 and 2000 floats
    for cases, mb, steps in checks:
        res = c.run(_r_bytes, cases, mb, steps)
        for i, (name, opts) in enumerate(cases):
            numels = res[0][i][2]
            assert sum(numels) == 2327 and len(numels) == (2 if mb < 1 else 1)
            counted = [r[i][3] for r in res]
            work = cm.Workload(numel=2327, bucket_numels=numels)
            pred = cm.predict(name, opts, P, work, cm.Network(1e-5, 1e-9), ZERO)["bytes_per_rank"]
            assert max(counted) == pred, f"{name}{opts} P={P}: counted {counted}, predicted {pred}"
            if name != "decentralized":
                per_rank = [cm.bytes_per_rank(name, opts, P, numels, rank=r) for r in range(P)]
                assert counted == per_rank, f"{name}{opts} P={P}: counted {counted}, predicted {per_rank}"


def _flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _r_auto(rank, P, options, steps, check_replicas):
    logger = logging.getLogger("bagua_lite")
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    stdout = io.StringIO()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    try:
        with contextlib.redirect_stdout(stdout):
            model = bagua_lite.DistributedModel(net, opt, algorithm="auto" if options is None else build("auto", **options),
                                                bucket_size_mb=100.0)
            alg = model.algorithm
            losses, identical, picked_at, bytes_after = [], [], None, None
            for s in range(steps):
                comm.reset_traffic()
                losses.append(_one_step(model, opt, rank, seed=0))  # one fixed batch per rank
                if alg.picked is not None and picked_at is None:
                    picked_at = s
                elif picked_at is not None and bytes_after is None:
                    bytes_after = comm.bytes_sent()
                if check_replicas:
                    mine = _flat_params(model)
                    everyone = [torch.empty_like(mine) for _ in range(P)]
                    dist.all_gather(everyone, mine)
                    identical.append(all(torch.equal(everyone[0], t) for t in everyone))
            state = alg.state_dict()
            model.close()
            # a fresh auto restored from the state runs the same pick without probing again
            net2 = _net()
            opt2 = torch.optim.SGD(net2.parameters(), lr=0.1)
            model2 = bagua_lite.DistributedModel(net2, opt2, algorithm=build(
                "auto", network={"alpha": 1e-5, "beta": 1e-9}, candidates=["gradient_allreduce"], machine=ZERO.__dict__))
            model2.load_algorithm_state_dict(state)
            restored = (model2.algorithm.picked_label, model2.algorithm.step, model2.algorithm.delegate.step)
            _one_step(model2, opt2, rank)
            model2.close()
    finally:
        logger.removeHandler(handler)
    return {"picked": alg.picked_label, "repr": repr(alg.picked), "decision": alg.decision, "losses": losses,
            "identical": identical, "picked_at": picked_at, "bytes_after": bytes_after, "numels": [b.numel for b in model.buckets],
            "log": [r for r in records if "bagua_lite auto" in r], "stdout": stdout.getvalue(), "restored": restored}


def _check_auto(res, P, expect=None):
    picks = {r["picked"] for r in res}
    assert len(picks) == 1, f"ranks picked differently: {picks}"
    pick = picks.pop()
    if expect is not None:
        assert pick == expect, res[0]["decision"]["line"]
    d = res[0]["decision"]
    assert all(r["decision"]["predictions"] == d["predictions"] for r in res)
    # the pick is what the cost model says for the (rank-maxed) inputs auto used
    work = cm.Workload(numel=sum(d["bucket_numels"]), compute_s=d["compute_s"], n_buckets=len(d["bucket_numels"]),
                       bucket_numels=d["bucket_numels"])
    i, _ = cm.choose([tuple(c) for c in d["candidates"]], P, work, cm.Network(**d["network"]), cm.Machine(**d["machine"]))
    assert i == d["picked"] and cm.label(*d["candidates"][i]) == pick
    # one line, on rank 0 only, in the log and on stdout
    line = d["line"]
    assert re.match(rf"bagua_lite auto: picked {re.escape(pick)}: predicted [0-9.e-]+ s/step.*\(alpha=.*beta=.*"
                    rf" params, compute .* s.*, P={P}\)$", line), line
    assert res[0]["log"] == [line] and res[0]["stdout"].count("bagua_lite auto:") == 1 and line in res[0]["stdout"]
    assert all(r["log"] == [] and "bagua_lite auto" not in r["stdout"] for r in res[1:])
    for r in res:
        assert r["losses"][-1] < 0.9 * r["losses"][0], r["losses"]
        assert r["restored"][0] == pick and r["restored"][1] == len(r["losses"])
    return pick, d


def test_auto_picks_sparse_on_a_slow_network_and_trains(clusters):
    P = 2
    opts = {"network": {"alpha": 1e-4, "beta": 1e-6},  # 1 MB/s: dense is 9 ms/step, gtopk microseconds
            "candidates": ["gradient_allreduce", {"name": "gtopk", "options": {"density": 0.1}}]}
    res = clusters.get(P).run(_r_auto, opts, 12, True)
    pick, d = _check_auto(res, P, expect="gtopk(density=0.1)")
    assert all(all(r["identical"]) for r in res), [r["identical"] for r in res]
    assert all(r["picked_at"] == 1 for r in res)  # after the 2 probe steps
    # after the switch the wire carries gtopk's bytes, not the dense probe's
    pred = cm.bytes_per_rank("gtopk", {"density": 0.1}, P, res[0]["numels"])
    assert [r["bytes_after"] for r in res] == [pred] * P
    assert res[0]["repr"].startswith("GTopK(")


def test_auto_stays_dense_on_a_fast_network(clusters):
    P = 4
    res = clusters.get(P).run(_r_auto, {"network": {"alpha": 0.0, "beta": 1e-13}}, 8, True)
    _check_auto(res, P, expect="gradient_allreduce")
    assert all(all(r["identical"]) for r in res)
    assert [r["bytes_after"] for r in res] == [cm.bytes_per_rank("gradient_allreduce", {}, P, [2327])] * P


def test_auto_probes_for_real(clusters):
    # real network probe and calibration; the default candidates' densities (0.001) are for large
    # models, so on this tiny net the sparse candidates get a density that can learn in 8 steps
    P = 4
    candidates = ["gradient_allreduce", {"name": "gradient_allreduce", "compression": "fp16"},
                  {"name": "gtopk", "density": 0.2}, {"name": "topk", "density": 0.2}, "local_sgd"]
    res = clusters.get(P).run(_r_auto, {"candidates": candidates}, 8, False)
    pick, d = _check_auto(res, P)
    assert d["network_source"] == "probed" and d["compute_s"] > 0
    assert {r["decision"]["network"]["beta"] for r in res} == {d["network"]["beta"]} and d["network"]["beta"] > 0


def test_auto_single_candidate(clusters):
    P = 4
    res = clusters.get(P).run(_r_auto, {"candidates": [{"name": "local_sgd", "period": 2}], "probe_steps": 1}, 8, False)
    _check_auto(res, P, expect="local_sgd(period=2)")
    assert all(r["picked_at"] == 0 for r in res)


def test_shared_cores_do_not_hide_local_work():
    import dataclasses
    net = cm.Network(1e-4, 8e-9)
    for name, o in (("gtopk", {"density": 0.001}), ("topk", {"density": 0.001}),
                    ("gradient_allreduce", {"compression": "fp16"})):
        roomy = cm.predict(name, o, 4, WORK, net, dataclasses.replace(MACHINE, cores_per_rank=4.0))
        shared = cm.predict(name, o, 4, WORK, net, dataclasses.replace(MACHINE, cores_per_rank=0.5))
        assert roomy == cm.predict(name, o, 4, WORK, net, MACHINE)  # 0 (unknown) behaves as plenty of cores
        assert shared["compression_s"] == roomy["compression_s"] > 0
        # local work is paid in full; only the network time may still hide behind backward
        assert shared["step_s"] >= WORK.compute_s + shared["compression_s"] - 1e-12
        assert shared["step_s"] >= roomy["step_s"], name
        if name != "gradient_allreduce":  # communication-bound: its local work was exposed anyway
            assert shared["step_s"] > roomy["step_s"], name
        assert shared["hidden_s"] <= shared["comm_s"] + 1e-12


def test_cores_per_rank_counts_ranks_on_the_host(monkeypatch):
    import os
    cores = len(os.sched_getaffinity(0))
    assert cm.cores_per_rank(4) == pytest.approx(cores / 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cm.cores_per_rank() == pytest.approx(cores / 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert cm.cores_per_rank() == pytest.approx(cores)


def test_host_local_transfers_do_not_hide_on_shared_cores():
    import dataclasses
    shared = dataclasses.replace(MACHINE, cores_per_rank=0.5)
    fast = cm.Network(1e-5, 4e-10)  # a loopback-like path: comm smaller than backward
    for name, o in (("gradient_allreduce", {}), ("ddp", {}), ("gtopk", {"density": 0.001})):
        remote = cm.predict(name, o, 4, WORK, fast, shared)
        local = cm.predict(name, o, 4, WORK, dataclasses.replace(fast, host_local=True), shared)
        assert local["hidden_s"] == 0
        assert local["step_s"] == pytest.approx(WORK.compute_s + local["compression_s"] + local["comm_s"])
        assert local["step_s"] >= remote["step_s"]
    # with a core to spare, host_local changes nothing
    roomy = dataclasses.replace(MACHINE, cores_per_rank=4.0)
    assert cm.predict("ddp", {}, 4, WORK, dataclasses.replace(fast, host_local=True), roomy) == \
        cm.predict("ddp", {}, 4, WORK, fast, roomy)
