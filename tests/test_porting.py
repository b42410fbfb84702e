"""docs/porting.md's ports, run as written: each original script and its bagua_lite port in examples/porting/,
launched the way their docstrings say (torchrun; `accelerate launch`; Lightning's own launcher; torchft's
lighthouse and one torchrun per replica group), 2 processes on CPU. With ``gradient_allreduce`` (and
``diloco`` against torchft's DiLoCo) every rank's loss at every step must be the same float as the
original's. The diffs in docs/porting.md must be the files' own diffs, and each port must stay within its
goal of changed lines.
"""
import difflib
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORTS = os.path.join(ROOT, "examples", "porting")
DOC = os.path.join(ROOT, "docs", "porting.md")
LOSS = re.compile(r"(rank|replica) (\d+) (iter|step) ([0-9.]+): loss ([0-9.e+-]+)")

# (original, port, the most lines the port may add: the goals of docs/porting.md)
CASES = {
    "nanogpt": ("nanogpt_ddp.py", "nanogpt_bagua_lite.py", 5),
    "accelerate": ("accelerate_ddp.py", "accelerate_bagua_lite.py", 7),
    "lightning": ("lightning_ddp.py", "lightning_bagua_lite.py", 4),  # 3 besides the strategy line
    "torchft_diloco": ("diloco_torchft.py", "diloco_bagua_lite.py", 16),
}


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    env.pop("LOCAL_RANK", None)
    env.update(extra)
    return env


def _torchrun(script, nproc=2, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return subprocess.Popen(cmd + [os.path.join(PORTS, script)], env=_env(**env), cwd=PORTS,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _accelerate(script, *args, flags=("--multi_gpu",), **env):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *flags, "--num_processes", "2",
           os.path.join(PORTS, script), *args]
    return subprocess.Popen(cmd, env=_env(ACCELERATE_USE_CPU="1", **env), cwd=PORTS,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _python(script, *args):
    return subprocess.Popen([sys.executable, os.path.join(PORTS, script), *args], env=_env(), cwd=PORTS,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# torch's own abort at interpreter exit, in a script that does not import bagua_lite: gloo's worker threads
# can outlive main() and ask for the GIL during finalization, which ends them inside a C++ destructor
# (bagua_lite/runtime.py; importing bagua_lite prevents it, so the ports must exit 0). It comes after the
# script's work: every loss has been printed, and _same counts them.
_TORCH_EXIT_ABORT = "terminate called without an active exception"


def _exited_cleanly(p, text, original):
    if p.returncode == 0:
        return True
    return original and _TORCH_EXIT_ABORT in text and (p.returncode == -6 or "(SIGABRT)" in text)


def test_only_an_original_may_end_in_torchs_exit_abort():
    class Done:
        returncode = 1  # torchrun's, when a worker died of SIGABRT
    text = f"rank 0 iter 11: loss 4.4\n{_TORCH_EXIT_ABORT}\n  exitcode  : -6 (pid: 1)  (SIGABRT)\n"
    assert _exited_cleanly(Done, text, original=True)
    assert not _exited_cleanly(Done, text, original=False)  # a port imports bagua_lite: it must exit 0
    assert not _exited_cleanly(Done, "Traceback ... RuntimeError\n  (SIGABRT)\n", original=True)  # another failure


def _losses(*procs, timeout=300, original=False):
    """{(rank, step): loss text} of every line the processes printed; each must exit 0 (``original``: the
    user's script without bagua_lite may also end in torch's exit-time abort)."""
    out = {}
    for p in procs:
        text, _ = p.communicate(timeout=timeout)
        assert _exited_cleanly(p, text, original), f"exit {p.returncode}:\n{text[-4000:]}"
        for m in LOSS.finditer(text):
            out[(int(m.group(2)), m.group(4))] = m.group(5)
    return out


def _same(original, port, expected):
    assert len(original) == expected, f"the original printed {len(original)} losses, expected {expected}"
    differ = [(k, original[k], port.get(k)) for k in sorted(original) if port.get(k) != original[k]]
    assert not differ and len(port) == len(original), f"losses differ (rank, step, original, port): {differ[:5]}"


def _diff(name):
    original, port, _ = CASES[name]
    with open(os.path.join(PORTS, original)) as f:
        a = f.read().splitlines()
    with open(os.path.join(PORTS, port)) as f:
        b = f.read().splitlines()
    lines = list(difflib.unified_diff(a, b, original, port, n=1, lineterm=""))
    added = sum(1 for line in lines if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in lines if line.startswith("-") and not line.startswith("---"))
    return "\n".join(lines), added, removed


@pytest.mark.parametrize("name", list(CASES))
def test_the_doc_shows_each_port_s_own_diff_within_its_goal(name):
    diff, added, removed = _diff(name)
    with open(DOC) as f:
        doc = f.read()
    assert f"```diff\n{diff}\n```" in doc, f"docs/porting.md does not show the current diff of {name}:\n{diff}"
    assert f"{added} lines added, {removed} removed" in doc, f"{name}: +{added} -{removed} not stated in the doc"
    assert added <= CASES[name][2], f"{name}: the port adds {added} lines, the goal is {CASES[name][2]}"


def test_nanogpt_port_has_the_same_losses_as_ddp():
    _same(_losses(_torchrun("nanogpt_ddp.py"), original=True), _losses(_torchrun("nanogpt_bagua_lite.py")), 2 * 12)


def test_accelerate_port_has_the_same_losses_and_saves_its_state(tmp_path):
    pytest.importorskip("accelerate")
    original = _losses(_accelerate("accelerate_ddp.py", str(tmp_path / "ddp")), original=True)
    port = _losses(_accelerate("accelerate_bagua_lite.py", str(tmp_path / "port")))
    _same(original, port, 2 * 2 * 6)
    saved = sorted(os.listdir(tmp_path / "port" / "epoch_1"))
    assert "model.safetensors" in saved and "bagua_lite" in saved, saved
    assert sorted(os.listdir(tmp_path / "port" / "epoch_1" / "bagua_lite")) == ["rank0.pt", "rank1.pt"]


def test_accelerate_launch_of_one_process_is_refused_with_the_command_that_starts_n():
    pytest.importorskip("accelerate")
    p = _accelerate("accelerate_bagua_lite.py", flags=("--cpu",))
    text, _ = p.communicate(timeout=120)
    assert p.returncode != 0, text[-2000:]
    assert "the Accelerator runs 1 process" in text and "accelerate launch --multi_gpu --num_processes N" in text, \
        text[-2000:]


def test_lightning_port_has_the_same_losses_as_ddp():
    pytest.importorskip("lightning")
    _same(_losses(_python("lightning_ddp.py"), original=True), _losses(_python("lightning_bagua_lite.py")), 2 * 8)


def test_torchft_diloco_port_has_the_same_losses_as_torchft():
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        address = "http://localhost:" + lighthouse.address().rsplit(":", 1)[1]
        groups = [_torchrun("diloco_torchft.py", nproc=1, REPLICA_GROUP_ID=str(i),
                            TORCHFT_LIGHTHOUSE=address) for i in range(2)]
        original = _losses(*groups, original=True)
    finally:
        lighthouse.shutdown()
    _same(original, _losses(_torchrun("diloco_bagua_lite.py")), 2 * 20)

