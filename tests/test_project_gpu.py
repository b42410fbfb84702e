"""The projection from one GPU's measured step to clusters (bagua_lite.bench.project_gpu): its traffic formulas
against hand counts, the measured step at P = 1, the bound of a cell, and the command's files and refusals."""
import json
import math
import statistics
import os
import subprocess
import sys

import pytest

from bagua_lite.bench import project_gpu as pg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_PARAMS = 1_000_000


def _rows(plain=20.0, ddp=22.0, **ours):
    rows = [{"row": "plain", "ms": plain, "params": N_PARAMS}, {"row": "ddp", "ms": ddp, "params": N_PARAMS}]
    rows += [{"row": r.replace("_", " ").replace("gradient allreduce", "gradient_allreduce"), "ms": ms,
              "params": N_PARAMS} for r, ms in ours.items()]
    return rows


def test_dense_ring_sends_two_p_minus_one_over_p_of_the_gradient_through_each_node():
    for P, G in ((16, 8), (32, 8), (24, 8), (4, 1), (4, 2)):
        nbytes, msgs, inside = pg.exchange("dense", {"wire": "fp32"}, N_PARAMS, P, G)
        # one ring through every rank: each node's link carries what every edge carries
        assert nbytes == pytest.approx(2 * (P - 1) / P * 4 * N_PARAMS) and msgs == 2 * (P - 1) and inside == 0.0
    # one node: nothing crosses, the ring runs at the inside constants
    assert pg.exchange("dense", {"wire": "fp16"}, N_PARAMS, 8, 8)[:2] == (0.0, 0)
    assert pg.exchange("dense", {"wire": "fp16"}, N_PARAMS, 8, 8)[2] == pytest.approx(
        14 * pg.ALPHA_IN + 14 / 8 * 2 * N_PARAMS * pg.BETA_IN)
    # hierarchical: a reduce to each node's leader, a ring of the N leaders, a broadcast back
    assert pg.traffic_of("gradient_allreduce", {"hierarchical": True})[0] == ("hierarchical", {"wire": "fp32"})
    W = 4 * N_PARAMS
    assert pg.exchange("hierarchical", {"wire": "fp32"}, N_PARAMS, 8, 2) == pytest.approx(
        (2 * 3 / 4 * W, 6, 2 * (pg.ALPHA_IN + W * pg.BETA_IN)))
    # a codec's bytes are its wire format's
    assert pg.exchange("dense", {"wire": "minmax_uint8"}, N_PARAMS, 16, 8)[0] == pytest.approx(15 / 8 * (N_PARAMS + 8))


def test_gtopk_crosses_nodes_in_log2_n_rounds_of_every_gpus_pairs():
    k = 1000  # density 0.001 of 1M
    for P, G in ((64, 8), (256, 8), (32, 1), (8, 8)):
        N = P // G
        nbytes, msgs, _ = pg.exchange("gtopk", {"density": 0.001}, N_PARAMS, P, G)
        rounds = int(math.log2(N)) if N > 1 else 0
        assert msgs == rounds and nbytes == rounds * G * 8 * k
    # topk gathers every rank's pairs: its bytes grow with P, gtopk's with log P
    t = [pg.exchange("topk", {"density": 0.001}, N_PARAMS, P, 8)[0] for P in (32, 256)]
    g = [pg.exchange("gtopk", {"density": 0.001}, N_PARAMS, P, 8)[0] for P in (32, 256)]
    assert t == [31 * 8 * k, 255 * 8 * k]  # NCCL's ring allgather: (P - 1) pairs through each node's link
    assert g[1] / g[0] == pytest.approx(5 / 2)  # log2 of 32 nodes over log2 of 4
    # gloo's allgather sends each rank's pairs to each rank of the other nodes: G (P - G) of them leave a node
    direct = dict(pg.LINKS, allgather="direct")
    assert pg.exchange("topk", {"density": 0.001}, N_PARAMS, 8, 2, links=direct)[:2] == (2 * 6 * 8 * k, 6)


def test_powersgd_sends_rank_r_factors_and_whole_vectors():
    assert pg.powersgd_bytes([(100, 50), (50,)], 4) == 4 * (4 * 150 + 50)
    assert pg.powersgd_bytes([(3, 2)], 4) == 4 * (2 * 5)  # the rank cannot exceed the matrix's


def test_p1_is_the_measured_step_and_a_slow_link_is_bandwidth_bound():
    rows = _rows(gradient_allreduce=25.0, gtopk_0_001=30.0)
    rows[-1]["row"] = "gtopk 0.001"
    cells = pg.project(rows, [1, 8, 64], [1, 100])
    at = {(c["row"], c["P"], c["gbits"]): c for c in cells}
    assert at["gradient_allreduce", 1, 1]["step_s"] == pytest.approx(0.025)
    assert at["ddp", 8, 1]["bound"] == "compute"  # one node: nothing crosses a slow link
    assert at["ddp", 64, 1]["bound"] == "bandwidth" and at["ddp", 64, 1]["step_s"] > at["ddp", 64, 100]["step_s"]
    assert at["gtopk 0.001", 64, 1]["x_ddp"] > 1 > at["gtopk 0.001", 8, 1]["x_ddp"]
    for c in cells:  # the parts add up to the step
        parts = c["compute_s"] + c["own_s"] + c["bandwidth_s"] + c["latency_s"]
        assert c["step_s"] == pytest.approx(parts) or c["P"] == 1
        assert c["x_ddp_to_target"] == pytest.approx(c["x_ddp"] / c["efficiency"])


def test_command_writes_its_table_and_refuses_what_it_cannot_project(tmp_path):
    step = tmp_path / "step.json"
    step.write_text(json.dumps(_rows(gradient_allreduce=25.0)))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bagua_lite.bench.project_gpu", "--step", str(step), "--sizes",
                           "8,16", "--gbits", "10", "--out", str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "PROJECTED, 10 Gbit/s between nodes:" in proc.stdout
    cells = json.loads((out / "projection.json").read_text())
    assert {(c["row"], c["P"]) for c in cells} == {(r, P) for r in ("ddp", "gradient_allreduce") for P in (8, 16)}
    assert (out / "projection.md").read_text().strip() == proc.stdout.strip()
    assert (out / "projection.png").stat().st_size > 1000
    other = subprocess.run([sys.executable, "-m", "bagua_lite.bench.project_gpu", "--step", str(step), "--model",
                            "resnet18"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert other.returncode != 0 and f"no rows of model 'resnet18' in {step}" in other.stderr
    step.write_text(json.dumps([{"row": "plain", "ms": 20.0, "params": N_PARAMS}]))
    bad = subprocess.run([sys.executable, "-m", "bagua_lite.bench.project_gpu", "--step", str(step)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "the step results need the 'ddp' row" in bad.stderr
    with pytest.raises(ValueError, match=r"P \(12\) must be a multiple of the GPUs per node \(8\)"):
        pg.project(_rows(), [12], [10])


@pytest.mark.parametrize("model", ["gpt", "resnet18"])
def test_powersgd_shapes_are_the_measured_models(model):
    from bagua_lite.bench.gpu_step import build_model
    from bagua_lite.bench.zoo import count_parameters

    for small in (False, True):
        n = count_parameters(build_model(model, small))
        shapes = pg.reference_shapes(model, n)
        assert sum(math.prod(s) for s in shapes) == n
    with pytest.raises(ValueError, match=r"project_gpu: 12345 parameters is neither size of gpu_step's"):
        pg.reference_shapes(model, 12345)


# ---- project_check: the link model against the benchmark's runs in nodes --------------------------------------
def _net(network, P, alpha, beta):
    return {"kind": "network", "network": network, "world_size": P, "alpha": alpha, "beta": beta, "host_local": False,
            "machine": {}}


def _cell(network, P, label, name, options, step, floor, numel=N_PARAMS):
    return {"kind": "cell", "network": network, "world_size": P, "model": "m", "algorithm": name, "label": label,
            "options": options, "optimizer": "sgd", "straggler": "none", "floor_s": floor, "repeat": 0,
            "numel": numel, "batch_size": 8, "times": [step] * 4, "rank_times": [[step] * 4] * P, "loss": 1.0,
            "waits": [], "busy": [], "bytes": [0] * 4, "tx_bytes": [None] * 4, "picked": None, "cycle": 1,
            "asynchronous": False}


def test_check_predicts_each_emulated_cell_from_the_constants_measured_in_its_run():
    from bagua_lite.bench import project_check as pc

    a_in, b_in, a_out = 2e-3, 1 / 2e9, 5e-3
    nodes = [_net("loopback", 4, a_in, b_in), _net("1gbit", 4, a_out, 1 / 1e8),
             _cell("loopback", 4, "local_sgd(period=4)", "local_sgd", {"period": 4}, 0.5, 0.4),
             _cell("1gbit", 4, "local_sgd(period=4)", "local_sgd", {"period": 4}, 0.5, 0.4),
             _cell("1gbit", 4, "ddp", "ddp", {}, 0.5, 0.4)]
    single = [_cell("loopback", 1, "local_sgd(period=4)", "local_sgd", {"period": 4}, 0.13, 0.1),
              _cell("loopback", 1, "ddp", "ddp", {}, 0.1, 0.1)]
    cells = pc.check(nodes, single, 2)
    assert [(c["network"], c["row"]) for c in cells] == [("1gbit", "local_sgd(period=4)"), ("1gbit", "ddp")]
    c = cells[0]
    # by hand: 2 nodes of 2; the fp32 weights' ring through the 4 ranks every 4 steps, each of its 6 steps
    # waiting for the 1 Gbit/s link that leaves the node; the own cost 0.03 s at P = 1, scaled by 0.4 / 0.1
    W = 4 * N_PARAMS
    ring = 2 * 3 / 4 * W * 8 / 1e9 + 6 * a_out
    assert c["predicted_s"] == pytest.approx(0.4 + 0.03 * 4 + ring / 4)
    assert c["error"] == pytest.approx(abs(c["predicted_s"] - 0.5) / 0.5)
    assert c["links"] == {"alpha_in": a_in, "beta_in": b_in, "alpha_out": a_out, "allgather": "direct"}
    assert c["nodes"] == 2
    per, overall = pc.medians(cells)
    assert set(per) == {("1gbit", 4)} and overall == pytest.approx(statistics.median(x["error"] for x in cells))

    with pytest.raises(ValueError, match=r"needs the loopback network at P = 4"):
        pc.check(nodes[1:], single, 2)
    with pytest.raises(ValueError, match=r"the row 'ddp' was not measured at P = 1"):
        pc.check(nodes, single[:1], 2)
    with pytest.raises(ValueError, match=r"the row 'topk' needs its option 'density'"):
        pc.bench_traffic("topk", {})
    with pytest.raises(ValueError, match=r"no traffic model for the row 'decentralized'"):
        pc.bench_traffic("decentralized", {})


def test_check_command_writes_its_table_and_refuses_what_it_cannot_check(tmp_path):
    nodes = [_net("loopback", 4, 1e-3, 1e-9), _net("1gbit", 4, 2e-3, 1e-8),
             _cell("1gbit", 4, "ddp", "ddp", {}, 0.5, 0.4)]
    single = [_cell("loopback", 1, "ddp", "ddp", {}, 0.1, 0.1)]
    for name, recs in (("nodes.jsonl", nodes), ("single.jsonl", single)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    cmd = [sys.executable, "-m", "bagua_lite.bench.project_check", "--nodes", "nodes.jsonl", "--single", "single.jsonl"]
    proc = subprocess.run(cmd + ["--ranks-per-node", "2", "--out", "o"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "| 1gbit | 4 (2) | ddp |" in proc.stdout and "median error, every cell:" in proc.stdout
    assert json.loads((tmp_path / "o" / "check.json").read_text())[0]["row"] == "ddp"
    bad = subprocess.run(cmd + ["--ranks-per-node", "3"], cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode == 2 and "--ranks-per-node 3 does not divide P = [4]" in bad.stderr
