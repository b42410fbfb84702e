"""bagua_lite's rank helpers (BAGUA's get_rank, get_local_rank, ...): from the default group on real gloo
groups, from torchrun's environment under torchrun, and an error naming the variable where a
multi-process job's launcher did not set it."""
import os
import subprocess
import sys

import pytest

import bagua_lite


def _r_ranks(rank, P):
    os.environ.pop("LOCAL_RANK", None)
    out = {"rank": bagua_lite.get_rank(), "world": bagua_lite.get_world_size()}
    try:
        bagua_lite.get_local_rank()
    except RuntimeError as e:
        out["error"] = str(e)
    os.environ["LOCAL_RANK"] = str(rank % 2)
    try:
        out["local"] = bagua_lite.get_local_rank()
    finally:
        del os.environ["LOCAL_RANK"]
    return out


@pytest.mark.parametrize("P", [3])
def test_ranks_in_a_gloo_group(clusters, P):
    for r, out in enumerate(clusters.get(P).run(_r_ranks)):
        assert (out["rank"], out["world"], out["local"]) == (r, P, r % 2)
        assert "LOCAL_RANK" in out["error"] and "torchrun" in out["error"]


def test_single_process_without_a_group(monkeypatch):
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert (bagua_lite.get_rank(), bagua_lite.get_world_size(), bagua_lite.get_local_rank(),
            bagua_lite.get_local_size(), bagua_lite.get_node_rank()) == (0, 1, 0, 1, 0)
    monkeypatch.setenv("LOCAL_RANK", "x1")
    with pytest.raises(ValueError, match="LOCAL_RANK='x1' is not an integer"):
        bagua_lite.get_local_rank()


def _torchrun(tmp_path, code, nproc, *options):
    """Run ``code`` as a script under torchrun in ``tmp_path``; each rank reports through files of its own
    (two processes' prints interleave on torchrun's shared stdout)."""
    (tmp_path / "script.py").write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                          str(nproc), *options, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]


def test_under_torchrun(tmp_path):
    # one collective before the group goes: without it a rank could finish and close its end while its
    # peer was still connecting (gloo's "connectFullMesh failed ... Connection closed by peer", seen once
    # under a loaded full run), and a group that has carried nothing proves little
    _torchrun(tmp_path, "import torch, torch.distributed as dist, bagua_lite\n"
                        "dist.init_process_group('gloo')\n"
                        "t = torch.ones(1)\n"
                        "dist.all_reduce(t)\n"
                        "r = [bagua_lite.get_rank(), bagua_lite.get_world_size(), bagua_lite.get_local_rank(),"
                        " bagua_lite.get_local_size(), bagua_lite.get_node_rank(), int(t.item())]\n"
                        "open(f'ranks{dist.get_rank()}', 'w').write(' '.join(map(str, r)))\n"
                        "dist.destroy_process_group()\n", 2)
    assert [(tmp_path / f"ranks{r}").read_text() for r in range(2)] == ["0 2 0 2 0 2", "1 2 1 2 0 2"]


def test_init_process_group_refuses_before_any_traffic(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="did not set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        bagua_lite.init_process_group()
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="backend must be one of 'gloo', 'nccl', 'cpu:gloo,cuda:nccl', got 'mpi'"):
        bagua_lite.init_process_group("mpi")


def _r_twice(rank, P):
    try:
        bagua_lite.init_process_group()
    except RuntimeError as e:
        return str(e)


def test_init_process_group_refuses_a_second_group(clusters):
    for msg in clusters.get(2).run(_r_twice):
        assert "already exists" in msg


def test_a_torchrun_restart_reconnects(tmp_path):
    """A worker SIGKILLed in the first attempt: torchrun restarts the group (the agent's store keeps the
    first attempt's keys) and every worker of the second attempt joins and runs a collective. The restart
    with checkpoints, bit for bit: tests/test_examples.py::test_elastic_restart_resumes_bit_identically."""
    _torchrun(
        tmp_path, "import os, signal, torch, torch.distributed as dist, bagua_lite\n"
        "bagua_lite.init_process_group()\n"
        "attempt = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "if attempt == 0 and dist.get_rank() == 1:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "if attempt == 1:\n"
        "    open(f'joined{dist.get_rank()}', 'w').write(str(int(t)))\n"
        "dist.barrier() if attempt == 1 else __import__('time').sleep(60)\n"
        "dist.destroy_process_group()\n", 3, "--max-restarts", "1", "--monitor-interval", "0.2")
    joined = [(tmp_path / f"joined{r}").read_text() if (tmp_path / f"joined{r}").exists() else None for r in range(3)]
    assert joined == ["6", "6", "6"], joined  # 1 + 2 + 3 on every rank of attempt 1
