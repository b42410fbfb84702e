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


def test_under_torchrun(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text("import torch.distributed as dist, bagua_lite\n"
                      "dist.init_process_group('gloo')\n"
                      "print('RANKS', bagua_lite.get_rank(), bagua_lite.get_world_size(), bagua_lite.get_local_rank(),"
                      " bagua_lite.get_local_size(), bagua_lite.get_node_rank(), flush=True)\n"
                      "dist.destroy_process_group()\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = sorted(line.split()[1:] for line in out.stdout.splitlines() if line.startswith("RANKS"))
    assert lines == [["0", "2", "0", "2", "0"], ["1", "2", "1", "2", "0"]], out.stdout
