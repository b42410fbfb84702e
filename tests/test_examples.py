"""Every training config in configs/ runs end to end through examples/train.py under torchrun, in its
digits recipe where examples/digits/ has one (``bagua_lite.demo.digits_configs``), all of them in turn in
one torchrun (a start of torchrun and its ranks costs more than a config's 2 epochs):

    torchrun --standalone --nproc_per_node 2 examples/train.py --config <every config> --epochs 2

(``torchrun`` is run as ``python -m torch.distributed.run`` of this interpreter.) It must exit 0 (any other
exit code fails every config, an abort at interpreter exit after any of them included), and for each config
rank 0 must print its ``test_accuracy=`` line with an accuracy well above chance (10 classes). Benchmark
configs (``configs/benchmark*.yaml``) describe benchmark matrices, not a training run, and are left out.
"""
import math
import os
import re
import subprocess
import sys

import pytest

from bagua_lite.demo import digits_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = digits_configs(ROOT)
EPOCHS = 2
FLOOR = 0.3  # chance is 0.1; 2 epochs at P = 2 reach 0.55 (topk at density 0.01) to 0.8 (dense SGD)
LINE = re.compile(r"^(?P<config>\S+\.yaml): .* world_size=(?P<world>\d+) final_loss=(?P<loss>[0-9.]+) "
                  r"test_accuracy=(?P<acc>[0-9.]+)$", re.M)


def test_there_are_configs():
    names = [os.path.basename(p) for p in CONFIGS]
    for required in ("gradient_allreduce.yaml", "gtopk.yaml", "topk.yaml", "decentralized.yaml", "local_sgd.yaml"):
        assert required in names, names


@pytest.fixture(scope="module")
def every_config_under_torchrun():
    """(exit code, stdout, stdout and stderr) of one torchrun training every config in turn."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", "train.py"), "--config", *CONFIGS, "--epochs", str(EPOCHS)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30 * len(CONFIGS))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun did not finish in {e.timeout}s\n{(e.stdout or b'')[-3000:]!r}\n"
                    f"{(e.stderr or b'')[-3000:]!r}")
    return proc.returncode, proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_example_runs_under_torchrun(path, every_config_under_torchrun):
    code, stdout, out = every_config_under_torchrun
    name = os.path.basename(path)
    assert code == 0, f"torchrun of every config: exit code {code}\n{out[-5000:]}"
    matches = [m for m in LINE.finditer(stdout) if m["config"] == name]
    assert len(matches) == 1, f"{name}: expected exactly one result line (rank 0's), got {len(matches)}:\n{out[-5000:]}"
    m = matches[0]
    assert int(m["world"]) == 2
    acc, loss = float(m["acc"]), float(m["loss"])
    assert FLOOR < acc <= 1.0, f"{name}: test_accuracy={acc} (floor {FLOOR})\n{out[-3000:]}"
    assert loss < math.log(10), f"{name}: final_loss={loss}: no better than uniform guessing"


def test_a_bad_config_among_several_stops_torchrun_before_any_training(tmp_path):
    """Every config is checked before the process group starts: a bad one anywhere in the list trains none."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm:\n  name: gtopk\n  density: 2.0\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", "train.py"), "--config", CONFIGS[0], str(bad), "--epochs", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert not LINE.search(proc.stdout), proc.stdout  # the first, valid config did not train
    assert "density must be in (0, 1], got 2.0" in proc.stderr, proc.stderr[-3000:]


def _elastic(tmp, tag, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = os.path.join(tmp, f"{tag}.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
           "--max-restarts", "3", "--monitor-interval", "0.2", os.path.join(ROOT, "examples", "elastic.py"),
           "--ckpt", os.path.join(tmp, f"ckpt_{tag}"), "--steps", "30", "--every", "5", "--out", out, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    import torch
    return torch.load(out), proc.stdout + proc.stderr


def test_elastic_restart_resumes_bit_identically(tmp_path):
    """A worker killed at step 17 (checkpoints every 5): torchrun restarts the group, training resumes
    from step 15 and ends with exactly the weights of an uninterrupted run (gtopk: per-rank residuals)."""
    import torch
    clean, _ = _elastic(str(tmp_path), "clean")
    killed, log = _elastic(str(tmp_path), "killed", "--kill-at", "17", "--kill-rank", "1")
    assert "attempt 1: resuming from step15 (step 15)" in log, log[-3000:]
    assert "attempt 1: done, 30 steps" in log, log[-3000:]
    diff = max(float((a - b).abs().max()) for a, b in zip(clean, killed))
    assert all(torch.equal(a, b) for a, b in zip(clean, killed)), f"final weights differ by up to {diff}"


def test_the_demo_prints_its_table_and_leaves_no_rendezvous_directory(tmp_path):
    """``scripts/run_demo.sh``'s module (``python -m bagua_lite.demo``), at P = 2 on one config for one
    epoch, from outside the repository: a table row for the config, exit 0, and none of its temporary
    directories left (TMPDIR points tempfile at tmp_path; torch may keep a cache of its own there)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TMPDIR=str(tmp_path))
    config = os.path.join(ROOT, "configs", "gradient_allreduce.yaml")
    cmd = [sys.executable, "-m", "bagua_lite.demo", "--configs", config, "--world-size", "2", "--epochs", "1"]
    proc = subprocess.run(cmd, cwd="/", env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"demo exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert re.search(r"^gradient_allreduce\.yaml\s+GradientAllReduce\(", proc.stdout, re.M), proc.stdout
    left = [n for n in os.listdir(tmp_path) if n.startswith("bagua_lite_")]
    assert left == [], left
