"""The benchmark end to end on a tiny matrix (loopback, 2 ranks): outputs exist and say something true."""
import csv
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_benchmark_writes_table_json_csv_png(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "bagua_lite.benchmark", "--config", "configs/benchmark_quick.yaml",
                           "--out", str(out), "--project", "16,1024"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "s/step" in text and "vs DDP" in text
    rows = json.loads((out / "results.json").read_text())["rows"]
    names = [r["name"] for r in rows]
    assert names == ["ddp", "ddp_fp16", "ddp_powersgd", "gradient_allreduce", "gtopk", "topk", "local_sgd"]
    ddp = rows[0]
    assert ddp["speedup_vs_ddp"] == pytest.approx(1.0)
    for r in rows:
        assert r["step_s"] > 0 and r["samples_per_s"] == pytest.approx(2 * 16 / r["step_s"])
        # min_cell_s (2 s) is far more than 6 steps of this model take: every cell measured max_steps
        assert r["steps_measured"] == 6, (r["name"], r["steps_measured"])
        assert r["final_loss"] == r["final_loss"]  # not NaN
    # our algorithms count their own bytes: dense = ring allreduce of the whole model, gtopk far less
    dense = next(r for r in rows if r["name"] == "gradient_allreduce")
    gtopk = next(r for r in rows if r["name"] == "gtopk")
    numel = 256 * 512 + 512 + 512 * 10 + 10
    assert dense["bytes_per_step_counted"] == pytest.approx(2 * (2 - 1) * numel * 4 / 2, rel=1e-6)
    assert 0 < gtopk["bytes_per_step_counted"] < dense["bytes_per_step_counted"] / 10
    # local SGD averages the weights every 2nd step: timed over whole periods, so its figure per step
    # is half a dense allreduce (a per-step median would have hidden the averaging step and said 0)
    local = next(r for r in rows if r["name"] == "local_sgd")
    assert local["bytes_per_step_counted"] == pytest.approx(dense["bytes_per_step_counted"] / 2, rel=1e-6)
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (out / "throughput.png").stat().st_size > 1000
    # the projection covers the requested sizes
    projections = json.loads((out / "results.json").read_text())["projections"]
    assert {p["world_size"] for p in projections} == {16, 1024}


def test_bad_benchmark_config_is_rejected_before_launch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("world_sizes: [2]\nnetwork: [loopback]\nalgorithms: [ddp]\n")
    proc = subprocess.run([sys.executable, "-m", "bagua_lite.benchmark", "--config", str(bad), "--out",
                           str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "unknown key 'network'" in proc.stderr and "did you mean 'networks'" in proc.stderr


@pytest.mark.parametrize("extra, pattern", [
    ("max_steps: 3", r"max_steps must be an int >= steps \(5\), got 3"),
    ("min_cell_s: -1", r"min_cell_s must be a number of seconds >= 0, got -1"),
    ("steps: 0", r"steps must be an int >= 1, got 0"),
])
def test_bad_step_settings_name_the_value(tmp_path, extra, pattern):
    from bagua_lite.benchmark import load_benchmark_config

    p = tmp_path / "c.yaml"
    p.write_text("steps: 5\nalgorithms: [ddp]\n" + extra + "\n" if not extra.startswith("steps") else
                 "algorithms: [ddp]\n" + extra + "\n")
    with pytest.raises(ValueError, match=pattern):
        load_benchmark_config(str(p))


def test_every_shipped_benchmark_config_validates():
    import glob

    from bagua_lite.benchmark import load_benchmark_config

    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "benchmark*.yaml")))
    assert len(paths) >= 3
    for p in paths:
        cfg = load_benchmark_config(p)
        names = [a["name"] for a in cfg["algorithms"]]
        assert "ddp" in names, f"{p}: every benchmark measures DDP in the same run"


def test_cycle_median_counts_the_periodic_step():
    from bagua_lite.benchmark import cycle_median
    # period 4: one expensive averaging step per cycle must show in the per-step figure
    times = [0.2, 2.2, 0.2, 0.2, 0.2, 1.8, 0.2, 0.2]
    assert cycle_median(times, 4) == pytest.approx((0.6 + 2.2 + 0.6 + 1.8) / 8)
    assert cycle_median(times, 1) == pytest.approx(0.2)  # the plain median drops it
    assert cycle_median([1.0, 3.0], 4) == pytest.approx(2.0)  # shorter than a cycle: the mean
    assert cycle_median([None, 1.0, 2.0, 9.0]) == 2.0 and cycle_median([]) is None
