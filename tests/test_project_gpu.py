"""The projection from one GPU's measured step to clusters (bagua_lite.bench.project_gpu): its traffic formulas
against hand counts, the measured step at P = 1, the bound of a cell, and the command's files and refusals."""
import json
import math
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


def test_dense_ring_sends_two_n_minus_one_over_n_of_the_gradient_through_each_node():
    for P, G in ((16, 8), (32, 8), (24, 8), (4, 1)):
        N = P // G
        nbytes, msgs, inside = pg.exchange("dense", {"wire": "fp32"}, N_PARAMS, P, G)
        assert nbytes == pytest.approx(2 * (N - 1) / N * 4 * N_PARAMS) and msgs == 2 * (N - 1)
        assert (inside > 0) == (G > 1)
    # one node: nothing crosses
    assert pg.exchange("dense", {"wire": "fp16"}, N_PARAMS, 8, 8)[:2] == (0.0, 0)
    # a codec's bytes are its wire format's
    assert pg.exchange("dense", {"wire": "minmax_uint8"}, N_PARAMS, 16, 8)[0] == pytest.approx(N_PARAMS + 8)


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
    assert t[1] / t[0] > 8 and g[1] / g[0] == pytest.approx(5 / 2)  # log2 of 32 nodes over log2 of 4


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
