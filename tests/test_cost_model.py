"""The alpha-beta cost model (bagua_lite.cost_model) and the auto algorithm built on it.

Unit tests check predict()'s byte counts against hand-computed values and its times against the
formulas of the module docstring; cluster tests (real gloo groups on loopback) check the network probe,
that predicted bytes equal what bagua_lite.comm.bytes_sent() counts for one real step, and that auto picks
one algorithm on every rank, says so in one line, and trains.
"""
import contextlib
import dataclasses
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
    # fp16: a ring allreduce of the half-precision bucket, as ddp_fp16
    ("gradient_allreduce", (("compression", "fp16"),)): {2: 2000, 3: 2666, 4: 3000, 5: 3200, 8: 3500},
    # bf16: the compressed allreduce (all-to-all of chunks, then allgather of the rank's padded chunk)
    ("gradient_allreduce", (("compression", "bf16"),)): {2: 2000, 3: 2670, 4: 3000, 5: 3200, 8: 3500},
    ("gradient_allreduce", (("compression", "minmax_uint8"),)): {2: 1016, 3: 1367, 4: 1548, 5: 1664, 8: 1862},
    # (P-1) * (16 header + k * 8): one allgather, no size exchange
    ("topk", (("density", DENSITY),)): {2: 96, 3: 192, 4: 288, 5: 384, 8: 672},
    # messages of k * 8 = 80 bytes: log2 P' rounds (+1 on rank 0 when P is not a power of two)
    ("gtopk", (("density", DENSITY),)): {2: 80, 3: 160, 4: 160, 5: 240, 8: 240},
    # + ring(k * 4 = 40)
    ("gtopk", (("density", DENSITY), ("exact", True))): {2: 120, 3: 213, 4: 220, 5: 304, 8: 310},
    # k = 250: the indices as a bitmap of N bits (125 bytes < 4k): messages of 1000 + 125
    ("gtopk", (("density", 0.25),)): {2: 1125, 3: 2250, 4: 2250, 5: 3375, 8: 3375},
    # 4-bit values: 4 scales (16 bytes) + 125 bytes of levels + the 125-byte bitmap = 266
    ("gtopk", (("density", 0.25), ("value_bits", 4))): {2: 266, 3: 532, 4: 532, 5: 798, 8: 798},
    # final_union: the same rounds; the hand-back to an extra rank laid out for 2k = 500 entries:
    # 8 scales (32) + 250 bytes of levels + the bitmap (125) = 407
    ("gtopk", (("density", 0.25), ("value_bits", 4), ("final_union", True))):
        {2: 266, 3: 266 + 407, 4: 532, 5: 532 + 407, 8: 798},
    ("decentralized", ()): {2: 4000, 3: 8000, 4: 8000, 5: 8000, 8: 8000},
    ("decentralized", (("peer_selection", "shift_one"),)): {2: 4000, 3: 4000, 4: 4000, 5: 4000, 8: 4000},
    ("decentralized", (("peer_selection", "all"),)): {2: 4000, 3: 5333, 4: 6000, 5: 6400, 8: 7000},
    ("decentralized", (("communication_interval", 2),)): {2: 2000, 3: 4000, 4: 4000, 5: 4000, 8: 4000},
    ("local_sgd", ()): {2: 1000, 3: 1333.25, 4: 1500, 5: 1600, 8: 1750},
    # P-matrix 40*4 = 160 elements, Q-matrix 25*4 = 100: ring(640) + ring(400)
    ("ddp_powersgd", (("rank", 4), ("shapes", ((40, 25),)))): {2: 1040, 3: 1386, 4: 1560, 5: 1664, 8: 1820},
    # bf16: the same 2 bytes per element as fp16
    ("gradient_allreduce", (("compression", "bf16"),)): {2: 2000, 3: 2670, 4: 3000, 5: 3200, 8: 3500},
    # sign: wire(c) = 4 + ceil(c/8); P=2 chunks 500: 67 + 67; P=3 chunks 334/333/333 all 46 bytes:
    # 2*46 + 2*46; P=4 chunks 250 (36): 3*36 + 3*36; P=5 chunks 200 (29); P=8 chunks 125 (20)
    ("gradient_allreduce", (("compression", "sign"),)): {2: 134, 3: 184, 4: 216, 5: 232, 8: 280},
    # qadam after warm-up: its momentum through gradient_allreduce's compressed allreduce (default fp16)
    ("qadam", ()): {2: 2000, 3: 2670, 4: 3000, 5: 3200, 8: 3500},
    ("qadam", (("compression", "minmax_uint8"),)): {2: 1016, 3: 1367, 4: 1548, 5: 1664, 8: 1862},
    ("qadam", (("compression", "sign"),)): {2: 134, 3: 184, 4: 216, 5: 232, 8: 280},
    # ours, one bucket taken as a 32 x 31 matrix (round(sqrt 1000) rows) + 8 dense elements, rank 4:
    # ring(4 * 32*4 = 512) + ring(4 * (31*4 + 8) = 528)
    ("powersgd", ()): {2: 1040, 3: 1386, 4: 1560, 5: 1663, 8: 1820},
    # rank 16: 992 < 2 * (32 + 31) * 16, so the bucket travels dense: ring(4000)
    ("powersgd", (("rank", 16),)): {2: 4000, 3: 5333, 4: 6000, 5: 6400, 8: 7000},
    # exact shapes: a 40 x 25 matrix alone is ddp_powersgd's case; a 40 x 24 matrix and a 40-vector:
    # ring(4 * 40*4 = 640) + ring(4 * (24*4 + 40) = 544)
    ("powersgd", (("bucket_shapes", (((40, 25),),)),)): {2: 1040, 3: 1386, 4: 1560, 5: 1664, 8: 1820},
    ("powersgd", (("bucket_shapes", (((40, 24), (40,)),)),)): {2: 1184, 3: 1578, 4: 1776, 5: 1894, 8: 2072},
    # one peer: the right neighbour
    ("decentralized", (("peer_selection", "ring_one_way"),)): {2: 4000, 3: 4000, 4: 4000, 5: 4000, 8: 4000},
    # compressed differences, the wire padded to 8: minmax 8 + 1000 = 1008 per peer; sign 4 + 125 -> 136
    ("decentralized", (("compression", "minmax_uint8"),)): {2: 1008, 3: 2016, 4: 2016, 5: 2016, 8: 2016},
    ("decentralized", (("compression", "sign"), ("peer_selection", "ring_one_way"))): {P: 136 for P in (2, 3, 4, 5, 8)},
    ("decentralized", (("compression", "fp16"), ("communication_interval", 2))):
        {2: 1000, 3: 2000, 4: 2000, 5: 2000, 8: 2000},
    # all, compressed: a ring allgather of every rank's 2000 fp16 bytes: (P-1) * 2000
    ("decentralized", (("compression", "fp16"), ("peer_selection", "all"))):
        {2: 2000, 3: 4000, 4: 6000, 5: 8000, 8: 14000},
    ("low_precision_decentralized", ()): {P: 1008 for P in (2, 3, 4, 5, 8)},  # one-way ring by default
    ("low_precision_decentralized", (("peer_selection", "ring"),)): {2: 1008, 3: 2016, 4: 2016, 5: 2016, 8: 2016},
    # the compressed allreduce of the change every period steps: minmax / 4, sign / 2
    ("local_sgd", (("compression", "minmax_uint8"),)): {2: 254, 3: 341.75, 4: 387, 5: 416, 8: 465.5},
    ("local_sgd", (("compression", "sign"), ("period", 2))): {2: 67, 3: 92, 4: 108, 5: 116, 8: 140},
}


@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
def test_bytes_match_hand_computed(P):
    work = cm.Workload(numel=N)
    for (name, opts), by_p in HAND.items():
        got = cm.predict(name, dict(opts), P, work, cm.Network(1e-5, 1e-9), ZERO)["bytes_per_rank"]
        assert got == by_p[P], f"{name}{dict(opts)} at P={P}: predicted {got}, hand-computed {by_p[P]}"


def test_bytes_per_rank_differ_by_rank_where_the_wire_does():
    bf16 = [cm.bytes_per_rank("gradient_allreduce", {"compression": "bf16"}, 3, [N], rank=r) for r in range(3)]
    assert bf16 == [2668, 2670, 2670]  # rank 0 holds the 334-element chunk and sends the others less
    mm = [cm.bytes_per_rank("gradient_allreduce", {"compression": "minmax_uint8"}, 3, [N], rank=r) for r in range(3)]
    assert mm == [1366, 1367, 1367]
    g5 = [cm.bytes_per_rank("gtopk", {"density": DENSITY}, 5, [N], rank=r) for r in range(5)]
    assert g5 == [240, 160, 160, 160, 80]  # rank 0: 2 rounds + unfold; rank 4: fold only
    g3 = [cm.bytes_per_rank("gtopk", {"density": DENSITY}, 3, [N], rank=r) for r in range(3)]
    assert g3 == [160, 80, 80]
    # Buckets add up, each with its own k.
    two = cm.bytes_per_rank("topk", {"density": DENSITY}, 4, [600, 400])
    assert two == 3 * (16 + 6 * 8) + 3 * (16 + 4 * 8)


def test_times_follow_the_formulas():
    net = cm.Network(alpha=1e-3, beta=1e-6)
    work = cm.Workload(numel=N)  # compute 0: everything is exposed
    t = lambda name, P, **o: cm.predict(name, o, P, work, net, ZERO)  # noqa: E731
    assert t("ddp", 4)["comm_s"] == pytest.approx(6e-3 + 6000e-6)
    assert t("ddp", 4)["step_s"] == pytest.approx(6e-3 + 6000e-6)
    assert t("gtopk", 5, density=DENSITY)["comm_s"] == pytest.approx(4e-3 + 4 * 80e-6)  # 2 rounds + fold + unfold
    assert t("gtopk", 8, density=DENSITY)["comm_s"] == pytest.approx(3e-3 + 3 * 80e-6)
    assert t("topk", 4, density=DENSITY)["comm_s"] == pytest.approx(3e-3 + 288e-6)  # one allgather
    assert t("gradient_allreduce", 4, compression="fp16")["comm_s"] == pytest.approx(6e-3 + 3000e-6)
    assert t("decentralized", 4)["comm_s"] == pytest.approx(1e-3 + 8000e-6)  # both neighbours share the link
    assert t("decentralized", 4, peer_selection="shift_one")["comm_s"] == pytest.approx(1e-3 + 4000e-6)
    assert t("local_sgd", 4, period=4)["comm_s"] == pytest.approx((6e-3 + 6000e-6) / 4)
    for P in (1,):
        for name in ("ddp", "gtopk", "topk", "gradient_allreduce", "decentralized", "local_sgd", "powersgd", "qadam",
                     "low_precision_decentralized", "async_model_average"):
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
    for name, o in (("local_sgd", {}), ("ddp_powersgd", {"rank": 2})):
        p = cm.predict(name, o, 2, work, cm.Network(0.0, 1e-4), ZERO)
        assert p["hidden_s"] == 0 and p["step_s"] == pytest.approx(1.0 + p["comm_s"] + p["compression_s"])
    # decentralized's exchange runs during the whole step (1 s): 0.4 s hide, 2 s stick out by 1 s
    p = cm.predict("decentralized", {}, 2, work, cm.Network(0.0, 1e-4), ZERO)
    assert p["comm_s"] == pytest.approx(0.4) and p["hidden_s"] == pytest.approx(0.4)
    assert p["step_s"] == pytest.approx(1.0)
    p = cm.predict("decentralized", {}, 2, work, cm.Network(0.0, 5e-4), ZERO)
    assert p["comm_s"] == pytest.approx(2.0) and p["hidden_s"] == pytest.approx(1.0)
    assert p["step_s"] == pytest.approx(2.0)


MACHINE = cm.Machine(topk_s_per_elem=2e-9, quantize_s_per_elem=8e-9, fp16_s_per_elem=4e-9, add_s_per_elem=2e-9,
                     merge_s_per_elem=4e-8, matmul_s_per_flop=2e-10)
WORK = cm.Workload(numel=25_000_000, compute_s=0.28, n_buckets=4)
ALL = [("ddp", {}), ("ddp_fp16", {}), ("ddp_powersgd", {"rank": 4}), ("gradient_allreduce", {}),
       ("gradient_allreduce", {"compression": "fp16"}), ("gradient_allreduce", {"compression": "minmax_uint8"}),
       ("topk", {"density": 0.001}), ("gtopk", {"density": 0.001}), ("gtopk", {"density": 0.001, "exact": True}),
       ("decentralized", {}), ("decentralized", {"peer_selection": "shift_one"}), ("local_sgd", {}), ("auto", {}),
       ("gradient_allreduce", {"compression": "bf16"}), ("gradient_allreduce", {"compression": "sign"}),
       ("decentralized", {"peer_selection": "ring_one_way"}), ("decentralized", {"compression": "minmax_uint8"}),
       ("decentralized", {"compression": "fp16", "peer_selection": "all"}), ("low_precision_decentralized", {}),
       ("local_sgd", {"compression": "minmax_uint8"}), ("powersgd", {"rank": 4}), ("qadam", {}),
       ("qadam", {"compression": "minmax_uint8"}), ("async_model_average", {}),
       ("async_model_average", {"compression": "sign", "sync_interval_ms": 100}), ("diloco", {"period": 50}),
       ("diloco", {"period": 50, "compression": "minmax_uint8", "outer_optimizer": {"name": "adam", "lr": 0.1}})]


BUILTIN_NAMES = {"ddp", "ddp_fp16", "ddp_powersgd"} | {
    n for n in bagua_lite.algorithms.registered()
    if bagua_lite.algorithm.registered_class(n).__module__.startswith("bagua_lite.algorithms.")}


def test_every_predictable_algorithm_is_covered():
    assert {n for n, _ in ALL} == {n for n in cm.predictable_names() if n in BUILTIN_NAMES}
    with pytest.raises(ValueError, match="cannot predict 'nope'"):
        cm.predict("nope", {}, 4, WORK, cm.Network(0, 0), MACHINE)


def test_more_bandwidth_is_faster():
    for name, o in ALL:
        steps = [cm.predict(name, o, 8, WORK, cm.Network(5e-5, beta), MACHINE)["step_s"] for beta in (1e-7, 1e-8, 1e-9)]
        if name == "async_model_average":  # the training thread never waits (cores to spare): compute only
            assert steps == pytest.approx([WORK.compute_s] * 3), f"{name}{o}: {steps}"
            # ... but the rounds get shorter, so more of them (and more bytes) fall into each step
            sent = [cm.predict(name, o, 8, WORK, cm.Network(5e-5, beta), MACHINE)["bytes_per_rank"]
                    for beta in (1e-7, 1e-8, 1e-9)]
            assert 0 < sent[0] < sent[1] < sent[2], f"{name}{o}: {sent}"
        elif name == "auto":  # auto minimises time to accuracy (step x efficiency), not the step alone
            preds = [cm.predict(name, o, 8, WORK, cm.Network(5e-5, beta), MACHINE) for beta in (1e-7, 1e-8, 1e-9)]
            weighted = [p["weighted_s"] for p in preds]
            assert weighted[0] > weighted[1] > weighted[2], f"{name}{o}: {weighted}"
            assert all(p["weighted_s"] == pytest.approx(p["step_s"] * p["efficiency"]) for p in preds)
        else:
            assert steps[0] > steps[1] > steps[2], f"{name}{o}: {steps}"
        keys = cm.predict(name, o, 8, WORK, cm.Network(5e-5, 1e-8), MACHINE)
        for k in ("step_s", "compute_s", "compression_s", "comm_s", "hidden_s", "bytes_per_rank"):
            assert keys[k] >= 0, (name, k)


def test_gtopk_grows_with_log_p_and_topk_with_p():
    g = lambda P: cm.predict("gtopk", {"density": DENSITY}, P, cm.Workload(numel=N), cm.Network(0, 1e-9), ZERO)  # noqa
    tk = lambda P: cm.predict("topk", {"density": DENSITY}, P, cm.Workload(numel=N), cm.Network(0, 1e-9), ZERO)  # noqa
    for P in (2, 4, 16, 128, 1024):
        assert g(P)["bytes_per_rank"] == 80 * math.log2(P)
        assert tk(P)["bytes_per_rank"] == (P - 1) * 96
    # non-powers of two pay one more message than the power of two below them
    assert g(1000)["bytes_per_rank"] == 80 * (9 + 1)
    rows = cm.project([("gtopk", {"density": 0.001}), ("topk", {"density": 0.001}), ("ddp", {})],
                      [16, 32, 128, 1024], WORK, cm.Network(5e-5, 8e-9), MACHINE)
    assert len(rows) == 12 and [r["world_size"] for r in rows[::3]] == [16, 32, 128, 1024]
    sp = {(r["algorithm"], r["world_size"]): r["speedup_vs_ddp"] for r in rows}
    assert all(sp[("ddp", P)] == 1.0 for P in (16, 32, 128, 1024))
    assert sp[("gtopk(density=0.001)", 1024)] > sp[("topk(density=0.001)", 1024)]
    assert sp[("topk(density=0.001)", 1024)] < sp[("topk(density=0.001)", 16)]


def test_round_cost_is_paid_per_synchronous_round():
    """Machine.round_s: every step of our bucketed algorithms, local SGD per average, decentralized per
    exchange; not DDP's reducer, not async averaging's background rounds, nothing at P = 1."""
    net = cm.Network(1e-4, 1e-9)
    with_round = dataclasses.replace(MACHINE, round_s=0.002)
    cases = {("gradient_allreduce", ()): 0.002, ("gtopk", (("density", 0.01),)): 0.002,
             ("gradient_allreduce", (("compression", "fp16"),)): 0.002, ("powersgd", ()): 0.002,
             ("local_sgd", (("period", 4),)): 0.0005, ("decentralized", (("communication_interval", 2),)): 0.001,
             ("ddp", ()): 0.0, ("ddp_fp16", ()): 0.0, ("async_model_average", ()): 0.0}
    for (name, opts), extra in cases.items():
        a = cm.predict(name, dict(opts), 4, WORK, net, MACHINE)["step_s"]
        b = cm.predict(name, dict(opts), 4, WORK, net, with_round)["step_s"]
        assert b - a == pytest.approx(extra, abs=1e-9), (name, opts, b - a)
        assert cm.predict(name, dict(opts), 1, WORK, net, with_round)["step_s"] == \
            pytest.approx(cm.predict(name, dict(opts), 1, WORK, net, MACHINE)["step_s"]), name
    # a compute-bound tiny model on shared cores (digits at P = 2 on loopback): without the round both look
    # alike (5% apart) and the tolerance keeps the earlier-listed dense one; with the 2 ms round measured
    # there, local SGD (one round in 4 steps) wins, as it does when measured (1.2 against 3.2 ms a step)
    tiny = cm.Workload(numel=17_226, compute_s=0.0029, n_buckets=1)
    shared = dataclasses.replace(MACHINE, cores_per_rank=1.0)
    cands = [("gradient_allreduce", {}), ("local_sgd", {})]
    loop = cm.Network(9e-5, 2.5e-10, host_local=True)
    assert cm.choose(cands, 2, tiny, loop, shared, tolerance=0.1)[0] == 0
    assert cm.choose(cands, 2, tiny, loop, dataclasses.replace(shared, round_s=0.002), tolerance=0.1)[0] == 1


def test_auto_prediction_and_choice():
    slow, fast = cm.Network(5e-5, 8e-9), cm.Network(1e-6, 1e-12)
    # as efficient as dense, or with the built-in digits ratios (1.2 and 1.7 times dense's steps), the
    # sparse candidates' cheap steps win at 1 Gbit/s; needing 3 times the steps, local SGD gets there first
    as_dense = {"efficiency": {"gtopk": 1.0, "topk": 1.0}}
    assert cm.predict("auto", as_dense, 4, WORK, slow, MACHINE)["picked"].startswith(("gtopk", "topk"))
    assert cm.predict("auto", {}, 4, WORK, slow, MACHINE)["picked"].startswith(("gtopk", "topk"))
    slow_to_converge = {"efficiency": {"gtopk": 3.0, "topk": 3.0}}
    assert cm.predict("auto", slow_to_converge, 4, WORK, slow, MACHINE)["picked"] == "local_sgd"
    assert cm.predict("auto", {}, 4, WORK, fast, MACHINE)["picked"] == "gradient_allreduce"
    # the `network` option decides the pick; the prediction is still made on `net`
    p = cm.predict("auto", {"network": {"alpha": 5e-5, "beta": 8e-9}, **as_dense}, 4, WORK, fast, MACHINE)
    assert p["picked"].startswith(("gtopk", "topk")) and p["comm_s"] < 1e-3
    # tolerance: an earlier candidate within it wins over a later, slightly faster one
    cands = [("local_sgd", {"period": 4}), ("local_sgd", {"period": 5})]
    i, preds = cm.choose(cands, 4, WORK, slow, MACHINE, tolerance=0.0)
    assert i == 1 and preds[1]["step_s"] < preds[0]["step_s"]
    assert cm.choose(cands, 4, WORK, slow, MACHINE, tolerance=0.5)[0] == 0
    assert cm.normalize_candidates(["topk", {"name": "gtopk", "options": {"density": 0.1}},
                                    {"name": "topk", "density": 0.2}, ("local_sgd", {"period": 2})]) == \
        [("topk", {}), ("gtopk", {"density": 0.1}), ("topk", {"density": 0.2}), ("local_sgd", {"period": 2})]


def test_efficiency_flips_the_pick():
    # at 1 Gbit/s on 25M parameters gtopk's step is far cheaper than dense's; weighed by efficiency the
    # pick flips to dense once gtopk needs more than dense's step / gtopk's step times the steps
    net = cm.Network(5e-5, 8e-9)
    cands = ["gradient_allreduce", {"name": "gtopk", "density": 0.001}]
    i, preds = cm.choose(cands, 4, WORK, net, MACHINE, efficiency={"gtopk": 1.0})
    assert i == 1 and preds[1]["step_s"] < preds[0]["step_s"] / 2
    ratio = preds[0]["step_s"] / preds[1]["step_s"]
    i, preds = cm.choose(cands, 4, WORK, net, MACHINE, efficiency={"gtopk(density=0.001)": ratio * 1.2})
    assert i == 0 and preds[1]["efficiency"] == pytest.approx(ratio * 1.2)
    assert preds[1]["weighted_s"] == pytest.approx(preds[1]["step_s"] * ratio * 1.2)
    assert (preds[0]["efficiency"], preds[0]["efficiency_source"]) == (1.0, "digits")
    # a label wins over its name; the tolerance still prefers the earlier (exact) candidate
    assert cm.efficiency_of("gtopk", {"density": 0.001}, {"gtopk": 3.0, "gtopk(density=0.001)": 2.0}) == (2.0, "given")
    i, _ = cm.choose(cands, 4, WORK, net, MACHINE, tolerance=0.25, efficiency={"gtopk": ratio * 0.9})
    assert i == 0
    # the built-in defaults come from the digits run; unknown algorithms are assumed exact
    assert cm.efficiency_of("gtopk", {"density": 0.01}) == (pytest.approx(264 / 154), "digits")
    assert cm.efficiency_of("topk", {"density": 0.01}) == (pytest.approx(187 / 154), "digits")
    assert cm.efficiency_of("decentralized") == (pytest.approx(165 / 154), "digits")
    assert cm.efficiency_of("local_sgd") == (1.0, "digits")  # 132/154 measured, never below dense
    assert cm.efficiency_of("powersgd", {"rank": 4}) == (1.0, "assumed")


def _conv_row(network, P, name, label, steps, steps_run=330, options=None, model="mlp_digits"):
    return {"network": network, "world_size": P, "model": model, "name": name, "algorithm": label,
            "options": options or {}, "steps_to_target": steps, "steps_run": steps_run}


def test_efficiencies_from_convergence_results(tmp_path):
    import json
    rows = [_conv_row("loopback", 4, "ddp", "ddp", 154), _conv_row("loopback", 4, "local_sgd", "local_sgd", 132),
            _conv_row("loopback", 4, "gtopk", "gtopk(density=0.01)", None, options={"density": 0.01}),
            {**_conv_row("loopback", 4, "auto", "auto", 99), "picked": "local_sgd"},  # as the benchmark writes it
            _conv_row("1gbit", 4, "ddp", "ddp", 100), _conv_row("1gbit", 4, "local_sgd", "local_sgd", 120),
            _conv_row("1gbit", 4, "gtopk", "gtopk(density=0.01)", 150, options={"density": 0.01}),
            _conv_row("loopback", 2, "gradient_allreduce", "gradient_allreduce", 50),
            _conv_row("loopback", 2, "local_sgd", "local_sgd", 100)]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"mode": "convergence", "rows": rows}))
    eff = cm.efficiencies_from_results(str(path), world_size=4, network="loopback")
    # never reached: budget / dense steps; auto's own rows are no evidence
    assert eff == {"ddp": 1.0, "local_sgd": pytest.approx(132 / 154), "gtopk(density=0.01)": pytest.approx(330 / 154),
                   "gtopk": pytest.approx(330 / 154)}
    # several cells: the median of the cells' ratios; gradient_allreduce is a dense reference too
    eff = cm.efficiencies_from_results(rows)
    assert eff["local_sgd"] == pytest.approx(sorted([132 / 154, 1.2, 2.0])[1])
    assert eff["gtopk"] == pytest.approx(((330 / 154) + 1.5) / 2)
    # a candidate's label as auto writes it ("a, b") matches the benchmark's ("a,b")
    assert cm.efficiency_of("gtopk", {"density": 0.01}, eff)[0] == pytest.approx(eff["gtopk(density=0.01)"])
    with pytest.raises(ValueError, match="no cell with a dense row"):
        cm.efficiencies_from_results([_conv_row("loopback", 4, "ddp", "ddp", None),
                                      _conv_row("loopback", 4, "local_sgd", "local_sgd", 100)])
    with pytest.raises(ValueError, match="not convergence results"):
        cm.efficiencies_from_results([{"network": "loopback", "step_s": 0.1}])
    # auto takes the file; a missing file is refused at construction
    a = build("auto", candidates=["gradient_allreduce", "local_sgd", {"name": "gtopk", "density": 0.01}],
              efficiency_from=str(path), efficiency={"gtopk": 0.5})
    assert a._efficiency(4)["gtopk"] == 0.5  # the option wins over the file
    assert a._efficiency(4)["local_sgd"] == pytest.approx((132 / 154 + 1.2) / 2)  # the file's rows at P=4
    assert a._efficiency(8)["local_sgd"] == pytest.approx(1.2)  # no rows at P=8: all of them
    with pytest.raises(ValueError, match="efficiency_from .*nope.json"):
        build("auto", efficiency_from=str(tmp_path / "nope.json"))


@pytest.mark.parametrize("eff, pattern", [
    ({"gtopk": 0}, r"efficiency\['gtopk'\] must be a finite number > 0 .*got 0"),
    ({"gtopk": -1.5}, r"efficiency\['gtopk'\] must be a finite number > 0 .*got -1.5"),
    ({"local_sgd": "fast"}, r"efficiency\['local_sgd'\] must be a finite number > 0 .*got 'fast'"),
    ({"local_sgd": float("nan")}, r"efficiency\['local_sgd'\] must be a finite number > 0"),
    ({"local_sgd": True}, r"efficiency\['local_sgd'\] must be a finite number > 0 .*got True"),
    ({"powersgd": 1.0}, r"efficiency key 'powersgd' names no candidate; allowed: gradient_allreduce, "
                        r"gtopk\(density=0.01\), local_sgd, gtopk$"),
    ({3: 1.0}, r"efficiency key 3 must be an algorithm label or name"),
    ([1.0, 2.0], r"efficiency must be a mapping of algorithm label or name to a ratio"),
])
def test_bad_efficiency_names_the_key_and_what_is_allowed(eff, pattern):
    cands = ["gradient_allreduce", {"name": "gtopk", "density": 0.01}, "local_sgd"]
    with pytest.raises(ValueError, match=pattern):
        build("auto", candidates=cands, efficiency=eff)
    with pytest.raises(ValueError, match=pattern):
        cm.predict("auto", {"candidates": cands, "efficiency": eff}, 4, WORK, cm.Network(5e-5, 8e-9), MACHINE)


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


# ---- the relaxations added to the model: powersgd, qadam, decentralized's overlap, compression, async -------
SIGN_N = {2: 134, 3: 184, 4: 216, 5: 232, 8: 280}  # gradient_allreduce with sign on N elements (see HAND)


def test_bytes_per_rank_of_the_relaxations():
    # the compressed averages are gradient_allreduce's compressed allreduce, rank by rank
    mm = [cm.bytes_per_rank("local_sgd", {"compression": "minmax_uint8", "period": 1}, 3, [N], rank=r)
          for r in range(3)]
    assert mm == [1366, 1367, 1367]
    assert [cm.bytes_per_rank("qadam", {}, 3, [N], rank=r) for r in range(3)] == [2668, 2670, 2670]  # fp16
    # qadam and powersgd are per bucket; fp16 over buckets of 600 and 400 at P=2: 1200 + 800
    assert cm.bytes_per_rank("qadam", {}, 2, [600, 400]) == 2000
    # powersgd, exact shapes per bucket: bucket 0 holds a 100-vector only (one allreduce, ring(400) = 400 at
    # P = 2); bucket 1 a 40 x 25 matrix (ring(640) + ring(400))
    assert cm.bytes_per_rank("powersgd", {"bucket_shapes": [[(100,)], [(40, 25)]]}, 2, [100, 1000]) == 400 + 640 + 400
    # min_compression_rate: 40 x 25 (1000 elements) against (40 + 25) * 4 = 260: compressed at 3.8, dense at 4
    assert cm.bytes_per_rank("powersgd", {"bucket_shapes": [[(40, 25)]], "min_compression_rate": 3.8}, 2, [N]) == 1040
    assert cm.bytes_per_rank("powersgd", {"bucket_shapes": [[(40, 25)]], "min_compression_rate": 4.0}, 2, [N]) == 4000
    # a 4-d tensor is a matrix of shape[0] rows: 8 x (5*5*5) = 8 x 125, rank 1: ring(4 * 8) + ring(4 * 125)
    assert cm.bytes_per_rank("powersgd", {"rank": 1, "bucket_shapes": [[(8, 5, 5, 5)]]}, 2, [N]) == 32 + 500
    # decentralized exchanges the whole model at once, whatever the buckets: 2 * pad(8 + 1000)
    assert cm.bytes_per_rank("decentralized", {"compression": "minmax_uint8"}, 4, [600, 400]) == 2016
    # half-precision elements (elem_bytes 2): decentralized sends 2 bytes per weight per neighbour
    assert cm.bytes_per_rank("decentralized", {"peer_selection": "ring_one_way"}, 4, [N], elem_bytes=2) == 2000


def _user_compressor():
    """A user's Python compressor: test_compressors' absmax 4-bit one ([scale f32][n int8 codes], error
    feedback), registered as "absmax4_test" when that module is imported (here and in spawned ranks)."""
    import test_compressors  # noqa: F401
    return "absmax4_test"


def test_a_users_compressor_is_sized_by_its_wire_bytes():
    c = _user_compressor()
    # P = 3, chunks 334/333/333: wires 338/337/337, padded to 344 each on the Python path:
    # all-to-all 2 * 344 + allgather 2 * 344 (unpadded would be 1351)
    assert cm.bytes_per_rank("gradient_allreduce", {"compression": c}, 3, [N]) == 1376
    assert cm.bytes_per_rank("decentralized", {"compression": c}, 3, [N]) == 2 * 1008  # pad(1004) per neighbour
    # its codec is taken as minmax_uint8's; it asks for error feedback, so the residual's work is added
    mach = cm.Machine(0.0, 1e-9, 0.0, 0.0)
    p = cm.predict("gradient_allreduce", {"compression": c}, 2, cm.Workload(numel=N), cm.Network(0, 0), mach)
    assert p["compression_s"] == pytest.approx(N * 1e-9 * (3.5 / 2 + 0.5))


def test_times_of_the_relaxations_follow_the_formulas():
    net = cm.Network(alpha=1e-3, beta=1e-6)
    work = cm.Workload(numel=N)  # compute 0: everything is exposed
    t = lambda name, P, **o: cm.predict(name, o, P, work, net, ZERO)  # noqa: E731
    assert t("gradient_allreduce", 4, compression="sign")["comm_s"] == pytest.approx(6e-3 + 216e-6)
    assert t("gradient_allreduce", 4, compression="bf16")["comm_s"] == pytest.approx(6e-3 + 3000e-6)
    assert t("qadam", 4)["comm_s"] == pytest.approx(6e-3 + 3000e-6)
    assert t("powersgd", 4)["comm_s"] == pytest.approx(12e-3 + 1560e-6)  # two allreduces
    assert t("powersgd", 4, rank=16)["comm_s"] == pytest.approx(6e-3 + 6000e-6)  # dense: one
    assert t("decentralized", 4, peer_selection="ring_one_way")["comm_s"] == pytest.approx(1e-3 + 4000e-6)
    assert t("decentralized", 4, compression="minmax_uint8")["comm_s"] == pytest.approx(1e-3 + 2016e-6)
    assert t("low_precision_decentralized", 2)["comm_s"] == pytest.approx(1e-3 + 1008e-6)
    assert t("decentralized", 4, compression="fp16", peer_selection="all")["comm_s"] == pytest.approx(3e-3 + 6000e-6)
    assert t("decentralized", 4, compression="fp16", communication_interval=2)["comm_s"] == \
        pytest.approx((1e-3 + 2 * 2000e-6) / 2)  # both neighbours, every other step
    assert t("local_sgd", 4, compression="minmax_uint8")["comm_s"] == pytest.approx((6e-3 + 1548e-6) / 4)
    for name in ("powersgd", "qadam", "local_sgd", "async_model_average"):  # dense gradient averaging
        assert t(name, 4)["warmup_step_s"] == pytest.approx(t("gradient_allreduce", 4)["step_s"])

    add, q8, f16, b16, sg = 2e-9, 8e-9, 4e-9, 3e-9, 6e-9
    mach = cm.Machine(topk_s_per_elem=0.0, quantize_s_per_elem=q8, fp16_s_per_elem=f16, add_s_per_elem=add,
                      bf16_s_per_elem=b16, sign_s_per_elem=sg)
    L = lambda name, P, **o: cm.predict(name, o, P, work, net, mach)["compression_s"]  # noqa: E731
    n = N
    ca = lambda codec, P, residual: n * codec * (3 + 1 / P) / 2 + (n * (codec / 2 + 2 * add) if residual else 0)  # noqa
    assert L("gradient_allreduce", 4, compression="bf16") == pytest.approx(ca(b16, 4, False))
    assert L("gradient_allreduce", 4, compression="sign") == pytest.approx(ca(sg, 4, True))  # error feedback
    assert L("gradient_allreduce", 1, compression="sign") == 0
    # uncalibrated (0) bf16 and sign are costed as fp16 and minmax_uint8
    old = dataclasses.replace(mach, bf16_s_per_elem=0.0, sign_s_per_elem=0.0)
    for c, like in (("bf16", "fp16"), ("sign", "minmax_uint8")):
        got = cm.predict("gradient_allreduce", {"compression": c}, 4, work, net, old)["compression_s"]
        assert got == pytest.approx(ca(f16 if c == "bf16" else q8, 4, c == "sign"))
        assert like  # (documentation)
    # qadam: the residual'd compressed allreduce plus 3 passes on the training thread (P = 1: those only)
    assert L("qadam", 4) == pytest.approx(ca(f16, 4, True) + 3 * n * add)
    assert L("qadam", 1, compression="minmax_uint8") == pytest.approx(3 * n * add)
    # decentralized, exact: gather, (peers - 1) sums, subtract, apply; all: gather, copy, subtract, apply
    assert L("decentralized", 4) == pytest.approx(4 * n * add)
    assert L("decentralized", 2) == pytest.approx(3 * n * add)
    assert L("decentralized", 4, peer_selection="ring_one_way") == pytest.approx(3 * n * add)
    assert L("decentralized", 5, peer_selection="shift_one") == pytest.approx(3 * n * add)
    assert L("decentralized", 4, peer_selection="all") == pytest.approx(4 * n * add)
    assert L("decentralized", 4, communication_interval=2) == pytest.approx(4 * n * add / 2)
    # compressed, d peers received from: 3 passes + compress + (d + 1) decompressions = (d + 2)/2 round trips
    assert L("decentralized", 4, compression="minmax_uint8") == pytest.approx(n * (3 * add + q8 * 4 / 2))
    assert L("low_precision_decentralized", 2) == pytest.approx(n * (3 * add + q8 * 3 / 2))
    assert L("low_precision_decentralized", 4, peer_selection="ring_one_way") == \
        pytest.approx(n * (3 * add + q8 * 3 / 2))
    assert L("decentralized", 5, compression="fp16", peer_selection="all") == pytest.approx(n * (3 * add + f16 * 6 / 2))
    # local_sgd compressed: snapshot, x - anchor, + anchor, anchor copy, apply + the residual'd allreduce
    assert L("local_sgd", 4, compression="sign", period=2) == pytest.approx((5 * n * add + ca(sg, 4, True)) / 2)
    assert L("local_sgd", 4, period=2) == pytest.approx(3 * n * add / 2)
    # powersgd, a 40 x 25 matrix at rank 4: N add + 4 max(2 N r flops, N add) + QR 2 * 40 * r^2 flops
    # + the Q's share of the mean's divide (25 * 4)
    for flop in (1e-10, 1e-9):  # memory-bound, then flop-bound matmuls
        m = dataclasses.replace(mach, matmul_s_per_flop=flop)
        got = cm.predict("powersgd", {"bucket_shapes": [[(40, 25)]]}, 4, work, net, m)["compression_s"]
        assert got == pytest.approx(n * add + 4 * max(2 * n * 4 * flop, n * add) + 2 * 40 * 16 * flop + 100 * add)
    # a dense bucket: in and out of the wire and the divide
    got = cm.predict("powersgd", {"bucket_shapes": [[(1000,)]]}, 4, work, net, mach)["compression_s"]
    assert got == pytest.approx(3 * n * add)


def test_qadam_overlaps_its_allreduce_but_not_its_momentum():
    work = cm.Workload(numel=N, compute_s=1.0, backward_fraction=0.5, n_buckets=4)
    mach = cm.Machine(0.0, 0.0, 0.0, 1e-5)  # add only: 3 passes = 0.03 s, the residual's 2 passes engine-side
    p = cm.predict("qadam", {}, 2, work, cm.Network(0.0, 1e-6), mach)
    ga = cm.predict("gradient_allreduce", {"compression": "fp16"}, 2, work, cm.Network(0.0, 1e-6), mach)
    assert p["comm_s"] == ga["comm_s"] and p["bytes_per_rank"] == ga["bytes_per_rank"]
    # the allreduces and the residuals' 2 passes hide behind backward (but the last bucket's, 5 ms + 0.5 ms
    # for its 500 bytes); the 3 training-thread passes never do
    last = 2 * 250 * 1e-5 + 500e-6
    assert p["step_s"] == pytest.approx(1.0 + 3 * N * 1e-5 + last)
    assert p["hidden_s"] == pytest.approx(p["comm_s"] + 2 * N * 1e-5 - last)


def test_powersgd_is_bucketed_and_overlapped_unlike_the_ddp_hook():
    work = cm.Workload(numel=4 * 250_000, compute_s=1.0, backward_fraction=0.5, n_buckets=4)
    net = cm.Network(1e-4, 1e-7)
    ours = cm.predict("powersgd", {"rank": 4}, 4, work, net, ZERO)
    hook = cm.predict("ddp_powersgd", {"rank": 4}, 4, work, net, ZERO)
    assert ours["hidden_s"] > 0 and hook["hidden_s"] == 0
    assert ours["step_s"] < hook["step_s"]
    # a smaller rank sends fewer bytes; a rank too large for the buckets falls back to dense
    sent = [cm.predict("powersgd", {"rank": r}, 4, work, net, ZERO)["bytes_per_rank"] for r in (1, 2, 4, 8, 16)]
    assert sent == sorted(sent) and len(set(sent)) == 5
    dense = cm.predict("gradient_allreduce", {}, 4, work, net, ZERO)["bytes_per_rank"]
    assert cm.predict("powersgd", {"rank": 1000}, 4, work, net, ZERO)["bytes_per_rank"] == dense


COMPRESSIONS = ("none", "fp16", "bf16", "minmax_uint8", "sign")


@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
def test_more_compression_sends_fewer_bytes(P):
    work = cm.Workload(numel=100_003, compute_s=0.1, n_buckets=3)
    net = cm.Network(5e-5, 8e-9)
    cases = [("gradient_allreduce", {}), ("qadam", {}), ("local_sgd", {}), ("decentralized", {}),
             ("decentralized", {"peer_selection": "ring_one_way"}), ("decentralized", {"peer_selection": "all"}),
             ("decentralized", {"communication_interval": 2}), ("async_model_average", {})]
    for name, o in cases:
        sent, comm_s = {}, {}
        for c in COMPRESSIONS:
            if name == "qadam" and c == "none":
                continue
            p = cm.predict(name, dict(o, compression=c), P, work, net, MACHINE)
            # async: per round (per step, a cheaper round means more rounds per step)
            sent[c] = p["bytes_per_round"] if name == "async_model_average" else p["bytes_per_rank"]
            comm_s[c] = p["comm_s"] / p["rounds_per_step"] if name == "async_model_average" else p["comm_s"]
        if o.get("peer_selection") == "all":
            # compressed, 'all' is an allgather: (P-1) wires against the exact allreduce's 2(P-1)/P m, so
            # fp16 saves only at P < 4 (P = 4: 3 * 2n against 1.5 * 4n, and the wire is padded) and loses beyond
            dense = sent.pop("none")
            assert (sent["fp16"] < dense) == (P < 4), (P, sent, dense)
            comm_s.pop("none")
        # (gradient_allreduce's fp16 is a ring allreduce of the half bucket, bf16 the compressed allreduce:
        # the same bytes but for the chunks' rounding)
        assert sent["fp16"] == pytest.approx(sent["bf16"], rel=1e-3) and comm_s["fp16"] == pytest.approx(comm_s["bf16"], rel=1e-3)
        assert sent.get("none", math.inf) > max(sent["fp16"], sent["bf16"]) > sent["minmax_uint8"] > sent["sign"] > 0, \
            f"{name}{o} P={P}: {sent}"
        assert comm_s.get("none", math.inf) > max(comm_s["fp16"], comm_s["bf16"]) > comm_s["minmax_uint8"] > comm_s["sign"]
    # low_precision_decentralized is decentralized with minmax_uint8 on a one-way ring (half of ring's
    # bytes at P >= 3)
    lp = cm.predict("low_precision_decentralized", {}, P, work, net, MACHINE)
    assert lp == cm.predict("decentralized", {"compression": "minmax_uint8", "peer_selection": "ring_one_way"},
                            P, work, net, MACHINE)
    one = cm.bytes_per_rank("decentralized", {"peer_selection": "ring_one_way"}, P, work.buckets())
    assert cm.bytes_per_rank("decentralized", {}, P, work.buckets()) == (2 * one if P >= 3 else one)


def test_decentralized_overlaps_its_exchange_with_the_step():
    work = cm.Workload(numel=1_000_000, compute_s=0.5)
    net = cm.Network(1e-4, 1e-8)  # at most 8 MB to two neighbours (0.08 s), or a (P-1) allgather: under 0.5 s
    shared = dataclasses.replace(MACHINE, cores_per_rank=0.5)
    roomy = dataclasses.replace(MACHINE, cores_per_rank=4.0)
    loopback = dataclasses.replace(net, host_local=True)
    for o in ({}, {"peer_selection": "ring_one_way"}, {"peer_selection": "shift_one"},
              {"compression": "minmax_uint8"}, {"peer_selection": "all"},
              {"compression": "sign", "peer_selection": "all"}, {"communication_interval": 3}):
        for P in (2, 3, 4, 8):
            p = cm.predict("decentralized", o, P, work, net, MACHINE)
            assert 0 < p["comm_s"] < work.compute_s
            # below the non-overlapped sum: the whole transfer hides, the local passes do not...
            assert p["step_s"] < work.compute_s + p["compression_s"] + p["comm_s"]
            apply = work.numel * MACHINE.add_s_per_elem
            if "compression" not in o:
                assert p["step_s"] == pytest.approx(work.compute_s + p["compression_s"])
                assert p["hidden_s"] == pytest.approx(p["comm_s"])
                # shared cores: each message's latency is CPU work on the computing cores, not hidden
                q = cm.predict("decentralized", o, P, work, net, shared)
                msgs = 2 if o.get("peer_selection", "ring") == "ring" and P >= 3 else 1
                lat = 2 * (P - 1) if o.get("peer_selection") == "all" else msgs
                assert q["step_s"] == pytest.approx(work.compute_s + q["compression_s"]
                                                    + lat * net.alpha / o.get("communication_interval", 1))
            else:  # ...except a compressed exchange's, on its own thread: only the apply is exposed
                assert p["step_s"] == pytest.approx(work.compute_s + apply)
                assert p["compression_s"] > 2 * apply
                assert p["hidden_s"] == pytest.approx(p["comm_s"] + p["compression_s"] - apply)
                # with shared cores the thread's work is taken from the compute; the bytes still hide,
                # the messages' latency does not
                q = cm.predict("decentralized", o, P, work, net, shared)
                msgs = (P - 1) if o.get("peer_selection") == "all" else (2 if P >= 3 else 1)
                assert q["step_s"] == pytest.approx(work.compute_s + q["compression_s"] + msgs * net.alpha)
            # with cores to spare loopback changes nothing
            assert cm.predict("decentralized", o, P, work, loopback, roomy) == p
            # shared cores on one host: the transfer is copies on the computing cores, nothing hides
            q = cm.predict("decentralized", o, P, work, loopback, shared)
            assert q["hidden_s"] == pytest.approx(0, abs=1e-12)
            assert q["step_s"] == pytest.approx(work.compute_s + q["compression_s"] + q["comm_s"])
    # a transfer longer than the step: the step's compute hides in it, the excess is paid
    p = cm.predict("decentralized", {}, 4, work, cm.Network(1e-4, 1e-6), MACHINE)  # 8 s
    assert p["hidden_s"] == pytest.approx(work.compute_s)
    assert p["step_s"] == pytest.approx(p["compression_s"] + p["comm_s"])
    # every third step: a third of the exposed time per step
    p3 = cm.predict("decentralized", {"communication_interval": 3}, 4, work, cm.Network(1e-4, 1e-6), MACHINE)
    assert p3["step_s"] == pytest.approx(work.compute_s + (p["step_s"] - work.compute_s) / 3)


def test_async_model_average_steady_state():
    work = cm.Workload(numel=N, compute_s=1.0)
    net = cm.Network(0.0, 1e-6)
    o = {"sync_interval_ms": 1000}
    # a round: 1 s asleep + ring(4000) = 6000 bytes at 1 us = 6 ms; the training thread never waits
    p = cm.predict("async_model_average", o, 4, work, net, ZERO)
    assert p["step_s"] == pytest.approx(1.0) and p["rounds_per_step"] == pytest.approx(1 / 1.006)
    assert p["bytes_per_round"] == 6000 and p["bytes_per_rank"] == pytest.approx(6000 / 1.006)
    assert p["comm_s"] == pytest.approx(0.006 / 1.006) and p["hidden_s"] == pytest.approx(p["comm_s"])
    # ranks sharing cores on one host: the round's transfer is CPU taken from training,
    # step = 1 / (1 - 0.006 / 1.006) = 1.006 s: exactly one round per step
    shared = dataclasses.replace(ZERO, cores_per_rank=0.5)
    q = cm.predict("async_model_average", o, 4, work, dataclasses.replace(net, host_local=True), shared)
    assert q["step_s"] == pytest.approx(1.006) and q["rounds_per_step"] == pytest.approx(1.0)
    assert q["bytes_per_rank"] == pytest.approx(6000) and q["hidden_s"] == pytest.approx(0.0, abs=1e-12)
    # ... over a real link only the local passes are taken (none here)
    assert cm.predict("async_model_average", o, 4, work, net, shared)["step_s"] == pytest.approx(1.0)
    # the local passes (snapshot, copy, apply as 2) are stolen when cores are shared: 4 * 1000 * 1e-5 = 0.04 s
    busy = cm.Machine(0.0, 0.0, 0.0, 1e-5, cores_per_rank=0.5)
    r = cm.predict("async_model_average", o, 4, work, net, busy)
    assert r["step_s"] == pytest.approx(1.0 / (1 - 0.04 / 1.046))
    # latency: the go-on flag's allreduce adds 2 (P-1) alpha to the round's 2 (P-1) alpha
    lat = cm.predict("async_model_average", o, 4, work, cm.Network(1e-3, 0.0), ZERO)
    assert lat["rounds_per_step"] == pytest.approx(1 / 1.012) and lat["bytes_per_round"] == 6000
    # compressed: the compressed allreduce of the change (sign at P = 4: 216 bytes a round)
    assert cm.predict("async_model_average", dict(o, compression="sign"), 4, work, net, ZERO)["bytes_per_round"] == 216
    # averaging less often sends fewer bytes per step
    per_step = [cm.predict("async_model_average", {"sync_interval_ms": ms}, 4, work, net, ZERO)["bytes_per_rank"]
                for ms in (10, 100, 1000)]
    assert per_step[0] > per_step[1] > per_step[2] > 0
    with pytest.raises(ValueError, match="depend on the step time"):
        cm.bytes_per_rank("async_model_average", {}, 4, [N])


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8])
def test_every_prediction_is_finite_and_positive(P):
    machines = [MACHINE, dataclasses.replace(MACHINE, cores_per_rank=0.5),
                dataclasses.replace(MACHINE, cores_per_rank=4.0)]
    nets = [cm.Network(5e-5, 8e-9), cm.Network(1e-5, 4e-10, host_local=True), cm.Network(0.0, 0.0)]
    for name, o in ALL:
        for mach in machines:
            for net in nets:
                p = cm.predict(name, o, P, WORK, net, mach)
                for k, v in p.items():
                    if not isinstance(v, str):
                        assert math.isfinite(v) and v >= 0, (name, o, P, k, v)
                assert p["step_s"] >= WORK.compute_s * (1 - 1e-12) and p["step_s"] > 0, (name, o, P)
                assert p["hidden_s"] <= p["compression_s"] + p["comm_s"] + 1e-12
                assert p["step_s"] == pytest.approx(WORK.compute_s + p["compression_s"] + p["comm_s"] - p["hidden_s"])
                if P == 1:
                    assert p["bytes_per_rank"] == 0 and p["comm_s"] == 0, (name, o)
                if name not in ("auto", "async_model_average"):  # predict reports what bytes_per_rank says
                    assert p["bytes_per_rank"] == cm.bytes_per_rank(name, o, P, WORK.buckets())


def test_unknown_names_and_refused_combinations_raise():
    net, work = cm.Network(5e-5, 8e-9), cm.Workload(numel=N)
    for bad in ("nope", "powerSGD", "q_adam", "async", ""):
        with pytest.raises(ValueError, match="cannot predict"):
            cm.predict(bad, {}, 4, work, net, MACHINE)
        with pytest.raises(ValueError, match="cannot predict"):
            cm.bytes_per_rank(bad, {}, 4, [N])
    for name in ("gradient_allreduce", "qadam", "local_sgd", "decentralized", "low_precision_decentralized",
                 "async_model_average"):
        for P in (1, 4):
            with pytest.raises(ValueError, match="unknown compression 'int3'"):
                cm.predict(name, {"compression": "int3"}, P, work, net, MACHINE)
    refused = [("decentralized", {"peer_selection": "star"}, "peer_selection='star'"),
               ("decentralized", {"compression": "fp16", "peer_selection": "shift_one"}, "shift_one"),
               ("low_precision_decentralized", {"peer_selection": "shift_one"}, "shift_one"),
               ("low_precision_decentralized", {"compression": "none"}, "not 'none'"),
               ("qadam", {"compression": "none"}, "compression must be a compressor, not 'none'"),
               ("local_sgd", {"period": 0}, "period must be"),
               ("decentralized", {"communication_interval": 0}, "communication_interval must be"),
               ("powersgd", {"rank": 0}, "rank must be"),
               ("powersgd", {"bucket_shapes": [[(40, 20)]]}, "holds 800 elements, the bucket 1000"),
               ("async_model_average", {"sync_interval_ms": 0}, "sync_interval_ms must be")]
    for name, o, msg in refused:
        with pytest.raises(ValueError, match=re.escape(msg)):
            cm.predict(name, o, 4, work, net, MACHINE)


def test_defaults_are_the_algorithms_defaults():
    # read from the registered classes, so a changed default changes the prediction
    import inspect
    assert cm.option_defaults("local_sgd")["period"] == inspect.signature(type(build("local_sgd")).__init__).parameters["period"].default
    assert cm.option_defaults("low_precision_decentralized")["compression"] == "minmax_uint8"
    assert cm.option_defaults("ddp") == {}
    assert {n for n in cm.predictable_names() if not n.startswith("ddp")} <= set(bagua_lite.algorithms.registered())


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


# (name, options, optimizer, steps before counting, steps counted): the relaxations' steady state
RELAXATION_CASES = [
    ("gradient_allreduce", {"compression": "bf16"}, "sgd", 0, 1),
    ("gradient_allreduce", {"compression": "sign"}, "sgd", 0, 1),
    ("qadam", {"warmup_steps": 1}, "adam", 1, 1),
    ("qadam", {"warmup_steps": 1, "compression": "sign"}, "adam", 1, 1),
    ("powersgd", {"rank": 2}, "sgd", 0, 2),
    ("decentralized", {"peer_selection": "ring_one_way"}, "sgd", 0, 2),
    ("decentralized", {"compression": "minmax_uint8"}, "sgd", 0, 2),
    ("decentralized", {"compression": "sign", "peer_selection": "all"}, "sgd", 0, 2),
    ("low_precision_decentralized", {}, "sgd", 0, 2),
    ("local_sgd", {"period": 2, "compression": "minmax_uint8"}, "sgd", 0, 2),
    ("gtopk", {"density": 0.25}, "sgd", 0, 1),                     # the bitmap index coding
    ("gtopk", {"density": 0.25, "value_bits": 4}, "sgd", 0, 1),     # and 4-bit values
    ("gtopk", {"density": 0.25, "value_bits": 4, "final_union": True}, "sgd", 0, 1),  # a hand-back of 2k
    # a user's Python compressor: its buffers padded to 8 bytes (2327 + 4 -> 2336 for decentralized)
    ("gradient_allreduce", {"compression": "absmax4_test"}, "sgd", 0, 1),
    ("decentralized", {"compression": "absmax4_test"}, "sgd", 0, 2),
]


def _r_bytes_steady(rank, P, cases, bucket_size_mb):
    _user_compressor()  # registered in this process too
    out = []
    for name, opts, optimizer, before, steps in cases:
        net = _net()
        opt = (torch.optim.Adam(net.parameters(), lr=1e-3) if optimizer == "adam"
               else torch.optim.SGD(net.parameters(), lr=0.05))
        model = bagua_lite.DistributedModel(net, opt, algorithm=build(name, **opts), bucket_size_mb=bucket_size_mb)
        numels = [b.numel for b in model.buckets]
        shapes = [[tuple(p.shape) for p in b.params] for b in model.buckets]
        for s in range(before):
            _one_step(model, opt, rank, s)
        comm.reset_traffic()
        for s in range(before, before + steps):
            _one_step(model, opt, rank, s)
        sent = comm.bytes_sent() / steps
        model.close()
        out.append((numels, shapes, sent))
    return out


@pytest.mark.parametrize("P", [2, 3, 4])
def test_predicted_bytes_equal_counted_bytes_for_the_relaxations(clusters, P):
    _user_compressor()  # the prediction below sizes it here, whichever test this worker ran before
    c = clusters.get(P)
    two_buckets = [case for case in RELAXATION_CASES if case[0] in ("gradient_allreduce", "qadam", "powersgd")]
    for mb, cases in ((100.0, RELAXATION_CASES), (0.003, two_buckets)):  # 0.003 MB: buckets of 327 and 2000
        res = c.run(_r_bytes_steady, cases, mb)
        for i, (name, opts, *_) in enumerate(cases):
            numels, shapes = res[0][i][0], res[0][i][1]
            assert sum(numels) == 2327 and len(numels) == (2 if mb < 1 else 1)
            counted = [r[i][2] for r in res]
            if name == "powersgd":  # the exact shapes, or the model takes each bucket as one square matrix
                opts = dict(opts, bucket_shapes=shapes)
            work = cm.Workload(numel=2327, bucket_numels=numels)
            pred = cm.predict(name, opts, P, work, cm.Network(1e-5, 1e-9), ZERO)["bytes_per_rank"]
            assert max(counted) == pred, f"{name}{opts} P={P} {mb} MB: counted {counted}, predicted {pred}"
            if "decentralized" not in name:
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
            alg = model.configured_algorithm
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
            state = model.algorithm_state_dict()
            active = model.algorithm  # auto handed the model its pick
            model.close()
            # a fresh auto restored from the state runs the same pick without probing again
            net2 = _net()
            opt2 = torch.optim.SGD(net2.parameters(), lr=0.1)
            model2 = bagua_lite.DistributedModel(net2, opt2, algorithm=build(
                "auto", network={"alpha": 1e-5, "beta": 1e-9}, candidates=["gradient_allreduce"], machine=ZERO.__dict__))
            model2.load_algorithm_state_dict(state)
            restored = (model2.configured_algorithm.picked_label, model2.algorithm.step,
                        type(model2.algorithm) is type(active) and model2.algorithm is not model2.configured_algorithm)
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
    i, _ = cm.choose([tuple(c) for c in d["candidates"]], P, work, cm.Network(**d["network"]), cm.Machine(**d["machine"]),
                     efficiency=d["efficiency"])
    assert i == d["picked"] and cm.label(*d["candidates"][i]) == pick
    # one line, on rank 0 only, in the log and on stdout
    line = d["line"]
    assert re.match(rf"bagua_lite auto: picked {re.escape(pick)}: predicted [0-9.e-]+ s/step x efficiency "
                    rf"[0-9.e-]+ \(\w+\) = [0-9.e-]+, ranked by time to accuracy .*\(alpha=.*beta=.*"
                    rf" params, compute .* s.*, P={P}\)$", line), line
    assert res[0]["log"] == [line] and res[0]["stdout"].count("bagua_lite auto:") == 1 and line in res[0]["stdout"]
    assert all(r["log"] == [] and "bagua_lite auto" not in r["stdout"] for r in res[1:])
    for r in res:
        assert r["losses"][-1] < 0.9 * r["losses"][0], r["losses"]
        assert r["restored"][0] == pick and r["restored"][1] == len(r["losses"]) and r["restored"][2]
    return pick, d


def test_auto_picks_sparse_on_a_slow_network_and_trains(clusters):
    P = 2
    opts = {"network": {"alpha": 1e-4, "beta": 1e-6},  # 1 MB/s: dense is 9 ms/step, gtopk microseconds
            "candidates": ["gradient_allreduce", {"name": "gtopk", "options": {"density": 0.1}}],
            # as efficient as dense (the built-in digits penalty, 2.1, would keep this compute-bound net dense)
            "efficiency": {"gtopk(density=0.1)": 1.0}}
    res = clusters.get(P).run(_r_auto, opts, 12, True)
    pick, d = _check_auto(res, P, expect="gtopk(density=0.1)")
    # 3 local probe steps (each rank on its own batch), then the replicas averaged and identical for good
    assert all(r["identical"] == [False] * 2 + [True] * 10 for r in res), [r["identical"] for r in res]
    assert all(r["picked_at"] == 2 for r in res)  # after the 3 probe steps
    # after the switch the wire carries gtopk's bytes, not the dense probe's
    pred = cm.bytes_per_rank("gtopk", {"density": 0.1}, P, res[0]["numels"])
    assert [r["bytes_after"] for r in res] == [pred] * P
    assert res[0]["repr"].startswith("GTopK(")


def test_auto_stays_dense_on_a_fast_network(clusters):
    P = 4
    # a network and a machine (its round included) that cost nothing: dense SGD is as fast as anything
    res = clusters.get(P).run(_r_auto, {"network": {"alpha": 0.0, "beta": 1e-13}, "machine": ZERO.__dict__}, 8, True)
    _check_auto(res, P, expect="gradient_allreduce")
    assert all(r["identical"] == [False] * 2 + [True] * 6 for r in res), [r["identical"] for r in res]
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
    # the round's fixed cost, measured in the probe (max over ranks, as every machine figure) and shown
    assert d["machine"]["round_s"] >= 0 and f"round {d['machine']['round_s']:.3g} s" in d["line"]
    assert {r["decision"]["network"]["beta"] for r in res} == {d["network"]["beta"]} and d["network"]["beta"] > 0


def _r_auto_vs_reference(rank, P, probe_steps, momentum):
    """auto whose only candidate is dense SGD against plain torch: local SGD steps for the probe, then
    the parameters and the momentum averaged over the ranks (all_reduce), then DDP from there."""
    a, b = _net(), _net()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.5, momentum=momentum)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.5, momentum=momentum)
    model = bagua_lite.DistributedModel(b, opt_b, build("auto", candidates=["gradient_allreduce"], probe_steps=probe_steps,
                                                        network={"alpha": 1e-5, "beta": 1e-9}, machine=ZERO.__dict__))
    ddp = None
    diffs, checks = [], []
    for s in range(probe_steps + 3):
        checks.append(model.algorithm.step_dependent_wire)  # read when the step's backward starts (auto's, then the pick's)
        _one_step(ddp if ddp is not None else a, opt_a, rank, seed=s)
        if s == probe_steps - 1:  # the reference's average, then DDP (which broadcasts rank 0's equal weights)
            with torch.no_grad():
                for p in a.parameters():
                    dist.all_reduce(p.data)
                    p.data /= P
                    buf = opt_a.state[p].get("momentum_buffer")
                    if buf is not None:
                        dist.all_reduce(buf)
                        buf /= P
            ddp = torch.nn.parallel.DistributedDataParallel(a)
        _one_step(model, opt_b, rank, seed=s)
        diffs.append(max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters())))
    mom = max(float((opt_a.state[p]["momentum_buffer"] - opt_b.state[q]["momentum_buffer"]).abs().max())
              for p, q in zip(a.parameters(), b.parameters())) if momentum else 0.0
    mine = _flat_params(b)
    everyone = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(everyone, mine)
    model.close()
    return diffs, checks, mom, all(torch.equal(everyone[0], t) for t in everyone)


@pytest.mark.parametrize("P", (2, 3, 4), ids=lambda p: f"P{p}")
def test_auto_probe_steps_are_local_then_the_replicas_are_averaged(clusters, P):
    # probe steps: local SGD (nothing travels); a synchronous pick then starts from the average of the
    # parameters and of the optimizer's momentum, and from there is DDP's exact dense SGD
    for momentum in (0.0, 0.9):
        for r, (diffs, checks, mom, identical) in enumerate(clusters.get(P).run(_r_auto_vs_reference, 3, momentum,
                                                                                 timeout=60)):
            assert max(diffs) < 1e-6 and mom < 1e-6, (r, momentum, diffs, mom)
            assert identical, (r, momentum)
            # no step check ahead of the buckets: while probing none travel, then it is the pick's own
            # answer (gradient_allreduce: none)
            assert checks == [False] * 6, (r, checks)


def _r_auto_vs_local_sgd(rank, P, steps):
    """auto picking local SGD against local SGD on its own, same start, same batches."""
    a, b = _net(), _net()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.5, momentum=0.9)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.5, momentum=0.9)
    alone = bagua_lite.DistributedModel(a, opt_a, build("local_sgd", period=4))
    auto = bagua_lite.DistributedModel(b, opt_b, build("auto", candidates=["local_sgd"], network={"alpha": 1e-5, "beta": 1e-9},
                                                       machine=ZERO.__dict__))
    for s in range(steps):
        _one_step(alone, opt_a, rank, seed=s)
        _one_step(auto, opt_b, rank, seed=s)
    same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    picked = auto.configured_algorithm.picked_label
    alone.close()
    auto.close()
    return same, picked


@pytest.mark.parametrize("P", (2, 3), ids=lambda p: f"P{p}")
def test_auto_picking_local_sgd_is_local_sgd_bit_for_bit(clusters, P):
    # its probe steps are local SGD's first steps and its step count is the training's: after 10 steps
    # (averages at 4 and 8) the weights equal local SGD's own
    for r, (same, picked) in enumerate(clusters.get(P).run(_r_auto_vs_local_sgd, 10, timeout=60)):
        assert picked == "local_sgd" and same, (r, picked, same)


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


def test_topk_selection_cost_with_block_maxima():
    """Where the algorithm has block maxima (density <= 1/256, one selection per bucket), its selection
    costs topk_bounded_s_per_elem per element; elsewhere (layerwise, dense densities) topk_s_per_elem."""
    import dataclasses
    net = cm.Network(1e-4, 1e-9)
    bounded = dataclasses.replace(MACHINE, topk_bounded_s_per_elem=0.5e-9)
    n = WORK.numel
    for name in ("topk", "gtopk"):
        sel = lambda m, **o: cm.predict(name, {"density": 0.001, **o}, 4, WORK, net, m)["compression_s"]  # noqa: E731
        assert sel(MACHINE) - sel(bounded) == pytest.approx(n * (2e-9 - 0.5e-9), rel=1e-6), name
        assert sel(MACHINE, layerwise=True) == pytest.approx(sel(bounded, layerwise=True)), name
        dense = lambda m: cm.predict(name, {"density": 0.05}, 4, WORK, net, m)["compression_s"]  # noqa: E731
        assert dense(MACHINE) == pytest.approx(dense(bounded)), name  # 4k > blocks: the plain selection


@bagua_lite.algorithms.register("users_allreduce_test")
class _UsersAllreduce(bagua_lite.Algorithm):
    """A user's algorithm: dense averaging, describing its traffic (one ring allreduce per bucket)."""

    @classmethod
    def traffic(cls, o, P, numels, elem_bytes=4, machine=None, rank=None):
        return cm.Traffic("buckets", *cm.per_bucket(numels, P, lambda n, i: cm.ring(n * elem_bytes, P),
                                                    lambda n, i: n * machine.add_s_per_elem, machine))

    def on_gradient(self, bucket, position, grad):
        self.fill(bucket, position, grad, 1.0 / self.world_size)

    def bucket_ops(self, bucket):
        return [self.native.AllreduceOp(self.process_group, False)]


@bagua_lite.algorithms.register("users_silent_test")
class _UsersSilent(_UsersAllreduce):
    traffic = bagua_lite.Algorithm.traffic  # describes nothing


def test_a_users_algorithm_that_describes_its_traffic_is_predicted():
    net = cm.Network(5e-5, 8e-9)
    mine = cm.predict("users_allreduce_test", {}, 4, WORK, net, MACHINE)
    dense = cm.predict("gradient_allreduce", {}, 4, WORK, net, MACHINE)
    assert mine["step_s"] == dense["step_s"] and mine["bytes_per_rank"] == dense["bytes_per_rank"] > 0
    assert cm.predictable("users_allreduce_test") and not cm.predictable("users_silent_test")
    with pytest.raises(ValueError, match="cannot predict 'users_silent_test'.*describes its traffic"):
        cm.predict("users_silent_test", {}, 4, WORK, net, MACHINE)
    with pytest.raises(ValueError, match="candidate 'users_silent_test' is not allowed"):
        build("auto", candidates=["users_silent_test"], probe_steps=0, compute_s=0.1)


def _r_users_candidate(rank, P):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = bagua_lite.DistributedModel(net, opt, build(
        "auto", candidates=["local_sgd", "users_allreduce_test"], probe_steps=0, compute_s=0.1,
        network={"alpha": 1e-5, "beta": 1e-10}, machine=ZERO.__dict__, efficiency={"local_sgd": 100.0}))
    picked = type(model.algorithm).__name__
    for s in range(3):
        g = torch.Generator().manual_seed(rank * 10 + s)
        x = torch.randn(4, 8, generator=g)
        torch.nn.functional.cross_entropy(model(x), x[:, :3].argmax(1)).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(P)]
    dist.all_gather(everyone, flat)
    model.close()
    return picked, all(torch.equal(everyone[0], t) for t in everyone)


def test_a_users_algorithm_can_be_autos_pick(clusters):
    # local SGD declared 100x less efficient: auto picks the user's dense algorithm, which then trains
    for picked, identical in clusters.get(2).run(_r_users_candidate, timeout=60):
        assert picked == "_UsersAllreduce" and identical, (picked, identical)


def test_diloco_moves_local_sgds_bytes_and_adds_its_outer_step():
    net = cm.Network(5e-5, 8e-9)
    for P in (2, 4):
        plain = cm.predict("local_sgd", {"period": 50}, P, WORK, net, MACHINE)
        outer = cm.predict("diloco", {"period": 50}, P, WORK, net, MACHINE)
        as_average = cm.predict("diloco", {"period": 50, "outer_optimizer": {"name": "sgd", "lr": 1}}, P, WORK, net,
                                MACHINE)
        assert outer["bytes_per_rank"] == plain["bytes_per_rank"] == cm.ring_bytes(WORK.numel * 4, P) / 50
        assert as_average["step_s"] == plain["step_s"] < outer["step_s"]  # 4 passes of the outer step
        assert outer["compression_s"] == pytest.approx(plain["compression_s"] + 4 * WORK.numel * MACHINE.add_s_per_elem / 50)
