"""bagua_lite.save_checkpoint / load_checkpoint on real gloo groups.

* Resume is bit-identical to an uninterrupted run for every deterministic algorithm (residuals, momenta,
  decentralized copies, local SGD's anchor, PowerSGD's warm start, QAdam's frozen variance), with
  dropout in the model (the RNG state travels too) and ``extra`` returned as saved;
* a checkpoint written at another world size, bucket layout or algorithm is refused on every rank with an
  error naming what differs; a dense algorithm (no per-rank state) may change world size, with a warning;
* a file left half-written by a crash never replaces the previous checkpoint.
"""
import os

import pytest
import torch
import torch.nn.functional as F

import bagua_lite
from bagua_lite.algorithm import build

D_IN, HIDDEN, CLASSES = 16, 48, 6
_W_TRUE = torch.randn(D_IN, CLASSES, generator=torch.Generator().manual_seed(5))

CASES = {
    "gradient_allreduce": ("gradient_allreduce", {}, "sgd"),
    "bytegrad": ("gradient_allreduce", {"compression": "minmax_uint8"}, "sgd"),
    "signsgd": ("gradient_allreduce", {"compression": "sign"}, "sgd"),
    "topk": ("topk", {"density": 0.05}, "sgd"),
    "gtopk": ("gtopk", {"density": 0.05}, "sgd"),  # momentum correction: the optimizer's momentum (default)
    "decentralized": ("decentralized", {}, "sgd"),
    "low_precision_decentralized": ("low_precision_decentralized", {}, "sgd"),
    "local_sgd": ("local_sgd", {"period": 3, "warmup_steps": 2, "compression": "minmax_uint8"}, "sgd"),
    "powersgd": ("powersgd", {"rank": 2}, "sgd"),
    "qadam": ("qadam", {"warmup_steps": 2}, "adam"),
}


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


def _wrap(case, bucket_size_mb=0.004):
    name, opts, kind = CASES[case]
    net = _net()
    opt = (torch.optim.Adam(net.parameters(), lr=1e-2) if kind == "adam"
           else torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    return net, opt, bagua_lite.DistributedModel(net, opt, build(name, **opts), bucket_size_mb=bucket_size_mb)


def _train(rank, net, opt, model, lo, hi, seed=True):
    if seed:  # dropout masks: per rank; a resumed run does not reseed, it continues the checkpoint's RNG
        torch.manual_seed(1000 + rank)
    for s in range(lo, hi):
        g = torch.Generator().manual_seed(rank * 7919 + s)
        x = torch.randn(16, D_IN, generator=g)
        F.cross_entropy(model(x), (x @ _W_TRUE).argmax(1)).backward()
        opt.step()
        opt.zero_grad()


def _flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _r_resume(rank, P, case, path, total=9, cut=5):
    net, opt, model = _wrap(case)
    _train(rank, net, opt, model, 0, total)
    straight = _flat(net).clone()
    model.close()

    net, opt, model = _wrap(case)
    _train(rank, net, opt, model, 0, cut)
    bagua_lite.save_checkpoint(path, model, opt, step=cut, note="hi")
    _train(rank, net, opt, model, cut, cut + 2)  # moves on, then is thrown away
    model.close()

    net, opt, model = _wrap(case)  # a fresh process's view: new model, optimizer and algorithm
    _train(rank, net, opt, model, 0, 1)  # and some state of its own, which the load must replace
    extra = bagua_lite.load_checkpoint(path, model, opt)
    _train(rank, net, opt, model, cut, total, seed=False)
    model.close()
    return extra, float((_flat(net) - straight).abs().max())


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_is_bit_identical(clusters, tmp_path, case):
    for r, (extra, diff) in enumerate(clusters.get(3).run(_r_resume, case, str(tmp_path / "ckpt"), timeout=120)):
        assert extra == {"step": 5, "note": "hi"}, extra
        assert diff == 0.0, f"{case}, rank {r}: resumed run differs from the uninterrupted one by {diff}"


def _r_save(rank, P, case, path, bucket_size_mb=0.004):
    net, opt, model = _wrap(case, bucket_size_mb)
    _train(rank, net, opt, model, 0, 3)
    bagua_lite.save_checkpoint(path, model, opt, step=3)
    model.close()
    return _flat(net)


def _r_load(rank, P, case, path, bucket_size_mb=0.004):
    import warnings
    net, opt, model = _wrap(case, bucket_size_mb)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            extra = bagua_lite.load_checkpoint(path, model, opt)
        return ("loaded", extra, [str(w.message) for w in caught], _flat(net))
    except ValueError as e:
        return ("refused", str(e), [], None)
    finally:
        model.close()


@pytest.mark.parametrize("saved, loaded, pattern", [
    (("gtopk", 2, 0.004), ("gtopk", 3, 0.004), r"world size: checkpoint 2, now 3"),
    (("gtopk", 3, 0.004), ("gtopk", 3, 0.05), r"bucket layout"),
    (("gtopk", 3, 0.004), ("topk", 3, 0.004), r"algorithm: checkpoint gtopk, now topk"),
    (("topk", 3, 0.004), ("gtopk", 3, 0.004), r"algorithm: checkpoint topk, now gtopk"),
])
def test_mismatched_checkpoint_is_refused_on_every_rank(clusters, tmp_path, saved, loaded, pattern):
    path = str(tmp_path / "ckpt")
    clusters.get(saved[1]).run(_r_save, saved[0], path, saved[2], timeout=60)
    for r, (what, msg, _, _) in enumerate(clusters.get(loaded[1]).run(_r_load, loaded[0], path, loaded[2], timeout=60)):
        assert what == "refused", f"rank {r} loaded a checkpoint that does not fit"
        assert "does not fit this model" in msg and __import__("re").search(pattern, msg), msg


def test_dense_checkpoint_may_change_world_size(clusters, tmp_path):
    path = str(tmp_path / "ckpt")
    weights = clusters.get(2).run(_r_save, "gradient_allreduce", path, timeout=60)
    for r, (what, extra, warns, flat) in enumerate(clusters.get(3).run(_r_load, "gradient_allreduce", path, timeout=60)):
        assert what == "loaded" and extra == {"step": 3}, (r, what, extra)
        assert any("world size: checkpoint 2, now 3" in w and "rank 0's file" in w for w in warns), warns
        assert torch.equal(flat, weights[0])


def _r_crash_mid_write(rank, P, path):
    net, opt, model = _wrap("gtopk")
    _train(rank, net, opt, model, 0, 2)
    bagua_lite.save_checkpoint(path, model, opt, step=2)
    good = open(os.path.join(path, f"rank{rank}.pt"), "rb").read()
    real_save = torch.save

    def dying_save(obj, f, *a, **k):  # writes half a file, then fails (a full disk; a kill is the same)
        f.write(b"\x80\x02partial")
        raise OSError("No space left on device")
    torch.save = dying_save
    try:
        bagua_lite.save_checkpoint(path, model, opt, step=3)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    finally:
        torch.save = real_save
    assert raised is not None and "failed on rank(s) [0, 1]" in raised and "No space left" in raised, raised
    model.close()
    return open(os.path.join(path, f"rank{rank}.pt"), "rb").read() == good


def test_crash_mid_write_keeps_the_previous_checkpoint(clusters, tmp_path):
    assert all(clusters.get(2).run(_r_crash_mid_write, str(tmp_path / "ckpt"), timeout=60))
