"""The README as a user pastes it: every ``bagua_lite.<name>`` it shows resolves after a plain
``import bagua_lite`` (an optional extra's module by importing it, as the README says), and the quickstart
runs as written, from a directory outside the repository, under torchrun."""
import importlib
import os
import re
import subprocess
import sys

import bagua_lite

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def _resolve(dotted):
    parts = dotted.split(".")
    obj = bagua_lite
    for i, part in enumerate(parts[1:], start=1):
        if not hasattr(obj, part):  # a submodule not imported by `import bagua_lite` (an extra's)
            importlib.import_module(".".join(parts[:i + 1]))
        obj = getattr(obj, part)
    return obj


def test_every_name_the_readme_shows_exists():
    names = sorted(set(re.findall(r"\bbagua_lite(?:\.[A-Za-z_][A-Za-z0-9_]*)+", README)))
    names = [n for n in names if not n.endswith(("_C", ".py")) and not n.startswith("bagua_lite.bench")]
    assert len(names) >= 12, names
    # names the README shows bare, after a `bagua_lite.` one in the same sentence
    names += [f"bagua_lite.{n}" for n in ("init_process_group", "MembershipChanged", "PeerFailedError", "get_world_size", "get_local_rank", "get_local_size", "get_node_rank",
                                          "shipped_configs", "load_config", "save_checkpoint", "load_checkpoint")]
    names += [f"bagua_lite.hooks.{n}" for n in ("topk_hook", "compressed_hook", "CompressedState")]
    missing = []
    for n in names:
        try:
            _resolve(n)
        except (AttributeError, ImportError) as e:
            missing.append(f"{n}: {e}")
    assert not missing, missing


def test_the_quickstart_runs_as_pasted_from_anywhere(tmp_path):
    block = re.search(r"## Quickstart.*?```python\n(.*?)```", README, re.S).group(1)
    assert 'load_config("gtopk")' in block
    (tmp_path / "quickstart.py").write_text(block)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "quickstart.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loss = float(re.search(r"GTopK\(.*\): final loss ([0-9.]+)", out.stdout).group(1))
    assert loss < 0.7, out.stdout  # chance on the toy task is log(4) = 1.39


def test_the_sharded_snippet_runs_as_pasted_from_anywhere(tmp_path):
    """The FSDP2 (HSDP) section's script, under torchrun on 4 processes: 2 replicas x 2 shards."""
    block = re.search(r"## Sharded models.*?```python\n(.*?)```", README, re.S).group(1)
    assert "bagua_lite.ShardedModel(" in block
    (tmp_path / "hsdp.py").write_text(block)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                          "hsdp.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.search(r"DiLoCo\((.*)\): final loss ([0-9.]+)", out.stdout)
    assert found and "fragments=2" in found.group(1) and "overlap=2" in found.group(1), out.stdout
