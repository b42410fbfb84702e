"""The README's "write your own algorithm" example, exec'd as pasted after a plain ``import bagua_lite``,
gets what the README promises without a line of its own: identical replicas, checkpoints that resume bit
for bit, non-finite rounds skipped on every rank with its residuals as before, ranks out of step caught."""
import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_loaded = {}


def _readme_algorithm():
    """The README's code block, run once per process (registering twice would be refused)."""
    if "cls" not in _loaded:
        readme = open(os.path.join(ROOT, "README.md")).read()
        section = readme[readme.index("### Writing your own algorithm"):]
        code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
        namespace = {}
        cwd = os.getcwd()
        os.chdir(tempfile.gettempdir())  # from any directory
        try:
            exec(compile(code, "README.md", "exec"), namespace)
        finally:
            os.chdir(cwd)
        _loaded["cls"] = namespace["FP16ErrorFeedback"]
    return _loaded["cls"]


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batch(rank, s):
    g = torch.Generator().manual_seed(rank * 101 + s)
    x = torch.randn(16, 10, generator=g)
    return x, x[:, :4].argmax(1)


def _make():
    import bagua_lite
    _readme_algorithm()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    return net, opt, bagua_lite.DistributedModel(net, opt, "fp16_error_feedback", bucket_size_mb=0.001)


def _step(model, opt, rank, s, bad=False):
    x, y = _batch(rank, s)
    loss = F.cross_entropy(model(x), y)
    if bad:
        loss = loss * float("inf")
    loss.backward()
    try:
        opt.step()
        return None
    except FloatingPointError as e:
        return str(e)
    finally:
        opt.zero_grad()


def _flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _r_readme_algorithm(rank, P, ckpt):
    import bagua_lite
    out = {}
    # uninterrupted, 8 steps
    net, opt, model = _make()
    assert type(model.algorithm).__name__ == "FP16ErrorFeedback"
    for s in range(8):
        _step(model, opt, rank, s)
    out["final"] = _flat(net)
    out["residual_norm"] = float(sum(r.norm() for r in model.algorithm.residuals))
    model.close()
    # 4 steps, checkpoint, a fresh model resumes for 4 more
    net, opt, model = _make()
    for s in range(4):
        _step(model, opt, rank, s)
    bagua_lite.save_checkpoint(ckpt, model, opt, step=4)
    model.close()
    net, opt, model = _make()
    assert bagua_lite.load_checkpoint(ckpt, model, opt)["step"] == 4
    for s in range(4, 8):
        _step(model, opt, rank, s)
    out["resumed"] = _flat(net)
    model.close()
    # a non-finite gradient on rank 1 at step 2: skipped everywhere, residuals as before
    net, opt, model = _make()
    errors = []
    for s in range(4):
        before = model.algorithm_state_dict()
        w = _flat(net)
        err = _step(model, opt, rank, s, bad=(s == 2 and rank == 1))
        if err is not None:
            errors.append(s)
            after = model.algorithm_state_dict()
            out["state_kept"] = all(torch.equal(a, b) for a, b in zip(before["residuals"], after["residuals"]))
            out["weights_kept"] = torch.equal(w, _flat(net))
    out["nonfinite_steps"] = errors
    model.close()
    # rank P-1 a step ahead: every rank raises
    net, opt, model = _make()
    try:
        for s in range(3):
            _step(model, opt, rank, s)
            if s == 0 and rank == P - 1:
                model.algorithm.step += 1
        out["out_of_step"] = None
    except RuntimeError as e:
        out["out_of_step"] = str(e)
    model.close()
    everyone = [torch.empty_like(out["final"]) for _ in range(P)]
    dist.all_gather(everyone, out["final"])
    out["replicas_identical"] = all(torch.equal(everyone[0], t) for t in everyone)
    return out


@pytest.mark.parametrize("P", (2, 3), ids=lambda p: f"P{p}")
def test_readme_algorithm_gets_the_contract_for_free(clusters, P, tmp_path):
    res = clusters.get(P).run(_r_readme_algorithm, str(tmp_path / "ckpt"), timeout=120)
    for r, o in enumerate(res):
        assert o["replicas_identical"], r
        assert o["residual_norm"] > 0, "fp16 rounding left nothing in the residuals: the example did nothing"
        assert torch.equal(o["final"], o["resumed"]), f"rank {r}: the resumed run differs"
        assert o["nonfinite_steps"] == [2] and o["state_kept"] and o["weights_kept"], (r, o["nonfinite_steps"])
        assert o["out_of_step"] and "out of step" in o["out_of_step"], (r, o["out_of_step"])
