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
