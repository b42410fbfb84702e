"""The kernel benchmark (python -m bagua_lite.bench.kernels) on the CPU: every kernel row is printed with its
time, bandwidth, ratio to the floor and the torch equivalent, and bad arguments are refused by name."""
import json
import os
import subprocess
import sys

import pytest

from bagua_lite.bench import kernels as bench_kernels


def test_kernel_benchmark_prints_every_kernel_against_the_floor_and_torch(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "bagua_lite.bench.kernels", "--device", "cpu", "--sizes", "40000",
                           "--densities", "0.001,0.01", "--repeats", "3", "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    names = [r["kernel"] for r in rows]
    expected = ["topk density 0.001", "topk density 0.01"] + [
        f"{c} {op}" for c in bench_kernels.CODECS for op in ("encode", "decode+add")]
    assert [n for n in names if not n.startswith("copy")] == expected
    for r in rows:
        assert r["n"] == 40000 and r["ms"] > 0 and r["GB/s"] > 0 and r["x_floor"] > 0, r
        assert r["kernel"].startswith("copy") or r["torch_ms"] > 0, r
        assert r["kernel"] in proc.stdout
    assert "floor = bytes / the copy's bandwidth" in proc.stdout


@pytest.mark.parametrize("argv, message", [(["--device", "tpu"], "--device must be auto, cpu or cuda, got 'tpu'"),
                                           (["--device", "cpu", "--sizes", "0"], "sizes must be >= 1"),
                                           (["--device", "cpu", "--densities", "1.5"], "densities in")])
def test_kernel_benchmark_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_kernels.main(argv)
    assert message in capsys.readouterr().err


def test_step_benchmark_measures_every_row_it_is_given_against_plain_and_ddp(tmp_path):
    """python -m bagua_lite.bench.gpu_step on the CPU (a small model): each row's step time, the table with the
    ratios to the plain loop and DDP; an unknown row is refused by name."""
    out = tmp_path / "rows.json"
    rows = ["plain", "ddp", "gradient_allreduce fp16", "topk 0.001", "local_sgd period 8"]
    proc = subprocess.run([sys.executable, "-m", "bagua_lite.bench.gpu_step", "--device", "cpu", "--small",
                           "--steps", "2", "--warmup", "1", "--rows", ",".join(rows), "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert [r["row"] for r in got] == rows
    for r in got:
        assert "error" not in r and r["ms"] > 0 and r["host_ms"] > 0, r
        assert f"| {r['row']} | {r['ms']:.2f} |" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "bagua_lite.bench.gpu_step", "--device", "cpu", "--rows", "plain,dpp"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert bad.returncode != 0 and "unknown rows ['dpp']" in bad.stderr


def test_step_benchmark_counts_syncs_in_all_and_on_the_training_thread():
    """count_syncs (the GPU's syncs/step column): torch's sync warnings made in a step, on any thread (the
    engine's reads the deferred flags) and on the calling one, the most of any step, and where they were
    made; other warnings are not counted and the debug mode is set for the step only."""
    import threading
    import warnings
    from bagua_lite.bench import gpu_step
    modes, calls = [], []

    def step():
        calls.append(len(calls))
        warnings.warn(f"{gpu_step.SYNC_WARNING} on the training thread")
        warnings.warn("an unrelated warning")
        others = 1 if len(calls) == 1 else 3  # the larger step is the one reported
        t = threading.Thread(target=lambda: [warnings.warn(f"{gpu_step.SYNC_WARNING} elsewhere") for _ in range(others)])
        t.start()
        t.join()
    got = gpu_step.count_syncs(step, steps=2, debug_mode=modes.append)
    assert got["all"] == 4 and got["training thread"] == 1, got
    assert modes == ["warn", "default", "warn", "default"] and len(calls) == 2
    assert sum(n for _, n in got["sites"]) == 6 and all("test_bench_kernels.py" in s for s, _ in got["sites"]), got


STEP_CONFIG = """
mode: step
device: cpu
small: true
models: [gpt, resnet18]
steps: 2
warmup: 1
rows: [plain, ddp, gradient_allreduce, gtopk 0.001]
"""


def test_step_config_runs_through_the_benchmark_and_writes_its_table(tmp_path):
    """A ``mode: step`` config (configs/benchmark_gpu.yaml's kind) through ``python -m bagua_lite.bench``: one
    process, both models, every row measured, and results.json/csv, table.md and the plot written."""
    cfg = tmp_path / "step.yaml"
    cfg.write_text(STEP_CONFIG)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bagua_lite.bench", "--config", str(cfg), "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads((out / "results.json").read_text())
    rows = ["plain", "ddp", "gradient_allreduce", "gtopk 0.001"]
    assert [(r["model"], r["row"]) for r in got] == [(m, r) for m in ("gpt", "resnet18") for r in rows]
    for r in got:
        assert "error" not in r and r["ms"] > 0, r
        # our counter sees our rows only; at P = 1 a collective sends nothing
        assert r["mb_per_step"] is None if r["row"] in ("plain", "ddp") else r["mb_per_step"] == 0, r
    assert got[0]["params"] != got[4]["params"]  # two models
    table = (out / "table.md").read_text()
    assert "## gpt on cpu" in table and "## resnet18 on cpu" in table
    for r in got:
        assert f"| {r['row']} | {r['ms']:.2f} |" in table
    assert (out / "results.csv").read_text().count("\n") == 1 + len(got)
    assert (out / "step.png").stat().st_size > 1000


@pytest.mark.parametrize("text, message", [
    ("rows: [plain, dpp]", "unknown rows ['dpp']; known: plain, ddp"),
    ("models: [vit]", "unknown models ['vit']; known: gpt, resnet18"),
    ("steps: 0", "steps must be an int >= 1, got 0"),
    ("device: tpu", "device must be auto, cpu or cuda, got 'tpu'"),
    ("world_sizes: [2]", "unknown key 'world_sizes' for mode step"),
    ("small: 1", "small must be true or false, got 1"),
])
def test_step_config_refuses_bad_values_by_name(tmp_path, text, message):
    from bagua_lite.bench.config import load_benchmark_config

    p = tmp_path / "s.yaml"
    p.write_text(f"mode: step\n{text}\n")
    with pytest.raises(ValueError) as e:
        load_benchmark_config(str(p))
    assert message in str(e.value)


def test_shipped_gpu_benchmark_config_is_every_row_on_both_models():
    from bagua_lite.bench import gpu_step
    from bagua_lite.bench.config import load_benchmark_config

    cfg = load_benchmark_config("benchmark_gpu")
    assert cfg["mode"] == "step" and cfg["rows"] == list(gpu_step.ROWS) and cfg["models"] == list(gpu_step.MODELS)
