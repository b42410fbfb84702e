"""Non-finite gradients on one rank, and ranks out of step, for every algorithm that averages gradients.

A rank whose gradient holds inf/NaN must not crash its peers or pollute state: the ranks agree on it in
the same round, every rank's ``.grad`` comes out NaN (so ``torch.amp.GradScaler`` skips the step on every
rank), error-feedback residuals / momenta / PowerSGD's Q stay as they were, and without a scaler
``optimizer.step()`` raises the same error on every rank, naming the bad rank. Checked against the state
before the step, bit for bit, at odd and even P.
"""
import contextlib
import hashlib
import os
import threading

import pytest
import torch
import torch.nn.functional as F

import bagua_lite
from bagua_lite.algorithms import build

D_IN, HIDDEN, CLASSES = 12, 32, 5
BAD_STEP, BAD_RANK, STEPS = 3, 1, 6

# (algorithm, options, optimizer): every gradient-averaging path, with state where it has one.
CASES = {
    "gradient_allreduce": ("gradient_allreduce", {}, "sgd"),
    "fp16": ("gradient_allreduce", {"compression": "fp16"}, "sgd"),
    "bf16": ("gradient_allreduce", {"compression": "bf16"}, "sgd"),  # no guard: inf/NaN travel as they are
    "bytegrad": ("gradient_allreduce", {"compression": "minmax_uint8"}, "sgd"),
    "sign_error_feedback": ("gradient_allreduce", {"compression": "sign"}, "sgd"),
    "hierarchical": ("gradient_allreduce", {"hierarchical": True, "ranks_per_node": 2}, "sgd"),
    "topk": ("topk", {"density": 0.1}, "sgd"),
    "topk_momentum_correction": ("topk", {"density": 0.1}, "sgd"),  # the default: the optimizer's momentum
    "gtopk": ("gtopk", {"density": 0.1, "warmup_densities": [0.5], "warmup_steps_per_stage": 2}, "sgd"),
    "powersgd": ("powersgd", {"rank": 2, "min_compression_rate": 1.0}, "sgd"),
    "qadam": ("qadam", {"warmup_steps": 2}, "adam"),
    "local_sgd_warmup": ("local_sgd", {"period": 2, "warmup_steps": STEPS}, "sgd"),
    "async_warmup": ("async_model_average", {"warmup_steps": STEPS, "sync_interval_ms": 50}, "sgd"),
}


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


def _batch(rank, step):
    g = torch.Generator().manual_seed(rank * 7919 + step * 31 + 5)
    x = torch.randn(16, D_IN, generator=g)
    return x, (x[:, :CLASSES] * 3).argmax(1)


def _sha(obj) -> str:
    h = hashlib.sha1()

    def walk(o):
        if isinstance(o, torch.Tensor):
            h.update(o.detach().contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(o, dict):
            for k in sorted(o, key=str):
                h.update(str(k).encode())
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        else:
            h.update(repr(o).encode())
    walk(obj)
    return h.hexdigest()


def _weights(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


def _optimizer(kind, net):
    if kind == "adam":
        return torch.optim.Adam(net.parameters(), lr=1e-3)
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def _train_step(model, net, opt, scaler, rank, s, out, after_backward=None):
    """One step under bf16 autocast; at BAD_STEP rank BAD_RANK's loss is multiplied by inf. Records the
    scaler's scale, a FloatingPointError from the step (the usual "skip the bad step" loop goes on) and
    the weights after the step."""
    x, y = _batch(rank, s)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    if s == BAD_STEP and rank == BAD_RANK:
        loss = loss * float("inf")
    (scaler.scale(loss) if scaler else loss).backward()
    if after_backward is not None:
        after_backward()
    try:
        if scaler:
            scaler.step(opt)
            scaler.update()
            out["scale"].append(float(scaler.get_scale()))
        else:
            opt.step()
    except FloatingPointError as e:
        out["errors"].append((s, str(e)))
    opt.zero_grad()
    out["weights"].append(_weights(net))


def _r_scaled(rank, P, label, scaler_on):
    """Train STEPS steps under bf16 autocast; at BAD_STEP rank BAD_RANK's loss is multiplied by inf."""
    name, options, kind = CASES[label]
    if scaler_on and name in ("topk", "gtopk"):
        # momentum correction refuses a loss scaler (test_loss_scaler_under_momentum_correction_is_refused)
        options = dict(options, momentum_correction=0)
    if scaler_on and name == "qadam":
        # after its warm-up qadam refuses a loss scaler (.grad holds the averaged momentum; test_loop_shapes):
        # the scaler's skip is checked in its warm-up, where the bad step falls
        options = dict(options, warmup_steps=STEPS)
    net = _net()
    opt = _optimizer(kind, net)
    model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.002)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler_on else None
    out = {"weights": [], "state": [], "grad_finite": [], "errors": [], "scale": []}
    for s in range(STEPS):
        _train_step(model, net, opt, scaler, rank, s, out, after_backward=lambda: out["grad_finite"].append(
            all(bool(torch.isfinite(p.grad).all()) for p in net.parameters() if p.grad is not None)))
        out["state"].append(_sha(model.algorithm_state_dict()))
    model.close()
    return out


def _check(res, P, label, scaler_on):
    centralized = not label.startswith("async")  # async warm-up is synchronous too: replicas equal
    for r, out in enumerate(res):
        assert all(torch.isfinite(w).all() for w in out["weights"]), f"{label}: rank {r} weights went non-finite"
        # the bad step changed nothing on any rank: weights and the algorithm's state (residuals, momenta)
        assert torch.equal(out["weights"][BAD_STEP], out["weights"][BAD_STEP - 1]), \
            f"{label}: rank {r} applied the non-finite step"
        before, after = out["state"][BAD_STEP - 1], out["state"][BAD_STEP]
        # the state dict holds the step counter, which a skipped step does not advance
        assert before == after, f"{label}: rank {r}'s algorithm state changed in the discarded round"
        # ... every rank saw NaN gradients in that step (so a scaler skips it everywhere), none otherwise
        assert out["grad_finite"] == [s != BAD_STEP for s in range(STEPS)], (label, r, out["grad_finite"])
        # ... and training went on afterwards
        assert not torch.equal(out["weights"][-1], out["weights"][BAD_STEP]), f"{label}: rank {r} stopped training"
        if scaler_on:
            assert out["errors"] == [], (label, r, out["errors"])
        else:
            assert [s for s, _ in out["errors"]] == [BAD_STEP], (label, r, out["errors"])
            msg = out["errors"][0][1]
            assert f"rank {BAD_RANK} (bucket" in msg and "non-finite gradient" in msg, msg
    if scaler_on:
        assert len({tuple(o["scale"]) for o in res}) == 1, f"{label}: the scalers disagree: {[o['scale'] for o in res]}"
        assert res[0]["scale"][BAD_STEP] < res[0]["scale"][BAD_STEP - 1], "the scaler did not see the overflow"
    if centralized:
        for s in range(STEPS):
            assert len({bytes(o["weights"][s].view(torch.uint8).numpy()) for o in res}) == 1, \
                f"{label}: replicas differ after step {s}"


def _r_all(rank, P, scaler_on):
    return {label: _r_scaled(rank, P, label, scaler_on) for label in CASES}


@pytest.mark.parametrize("P", (3, 4), ids=lambda p: f"P{p}")
@pytest.mark.parametrize("scaler_on", [True, False], ids=["grad_scaler", "no_scaler"])
def test_nonfinite_gradient_on_one_rank(clusters, P, scaler_on):
    res = clusters.get(P).run(_r_all, scaler_on, timeout=240)
    for label in CASES:
        _check([r[label] for r in res], P, label, scaler_on)


# the algorithms whose gradients go into their buckets through Bucket.fill, or into topk/gtopk's error
# feedback: on a GPU their checks stay there
DEFERRED = ("gradient_allreduce", "fp16", "bf16", "bytegrad", "sign_error_feedback", "hierarchical", "powersgd", "qadam",
            "async_warmup", "topk", "topk_momentum_correction", "gtopk")


def _r_deferred(rank, P, scaler_on):
    """The checks a GPU leaves on the device (a flag per bucket, read once per round at the agreement), run on
    the CPU with BAGUA_LITE_DEFER_CHECKS=1: the same outcome, bit for bit, as the checks that answer at once."""
    os.environ["BAGUA_LITE_DEFER_CHECKS"] = "1"
    try:
        net = _net()
        model = bagua_lite.DistributedModel(net, _optimizer("sgd", net), "gradient_allreduce", bucket_size_mb=0.002)
        flags = [b.nonfinite_flag is not None for b in model.buckets]
        model.close()
        return flags, {label: _r_scaled(rank, P, label, scaler_on) for label in DEFERRED}
    finally:
        del os.environ["BAGUA_LITE_DEFER_CHECKS"]


@pytest.mark.parametrize("scaler_on", [True, False], ids=["grad_scaler", "no_scaler"])
def test_nonfinite_gradient_checked_on_the_device(clusters, scaler_on):
    res = clusters.get(3).run(_r_deferred, scaler_on, timeout=240)
    assert all(all(flags) for flags, _ in res), [flags for flags, _ in res]
    at_once = clusters.get(3).run(_r_all, scaler_on, timeout=240)
    for label in DEFERRED:
        _check([r[label] for _, r in res], 3, label, scaler_on)
        for r in range(3):  # the same error, naming the same rank and its first bad bucket
            assert res[r][1][label]["errors"] == at_once[r][label]["errors"], (label, r)


def _r_one_rank(rank, P, scaler_on):
    """One rank alone, the bad one (BAD_RANK's batches), with the checks deferred and at once."""
    assert P == 1
    at_once = {label: _r_scaled(BAD_RANK, P, label, scaler_on) for label in DEFERRED}
    _, deferred = _r_deferred(BAD_RANK, P, scaler_on)
    return at_once, deferred


@pytest.mark.parametrize("scaler_on", [True, False], ids=["grad_scaler", "no_scaler"])
def test_nonfinite_gradient_on_one_rank_alone_deferred_or_at_once(clusters, scaler_on):
    """P = 1 (a GPU's NCCL group of one): the deferred checks' row is made on the engine's thread, with no
    collective; the outcome, the error and the weights are those of the checks that answer at once."""
    (at_once, deferred), = clusters.get(1).run(_r_one_rank, scaler_on, timeout=240)
    for label in DEFERRED:
        a, d = at_once[label], deferred[label]
        assert a["grad_finite"] == [s != BAD_STEP for s in range(STEPS)], (label, a["grad_finite"])
        assert d["errors"] == a["errors"] and d["scale"] == a["scale"] and d["grad_finite"] == a["grad_finite"], label
        assert len(a["errors"]) == (0 if scaler_on else 1), (label, a["errors"])
        assert all(torch.equal(x, y) for x, y in zip(d["weights"], a["weights"])), label
        assert torch.equal(a["weights"][BAD_STEP], a["weights"][BAD_STEP - 1]), f"{label}: the bad step applied"


def _r_out_of_step(rank, P, name, options):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.002)
    x, y = _batch(rank, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    if rank == P - 1:
        opt.step()  # an extra step (e.g. a second optimizer.step() in a branch only this rank takes)
    before = _weights(net)
    try:
        F.cross_entropy(model(x), y).backward()
        return ("no error", None)
    except RuntimeError as e:
        return (str(e), torch.equal(before, _weights(net)))
    finally:
        model.close()


@pytest.mark.parametrize("name, options", [
    ("gradient_allreduce", {}),
    ("gtopk", {"density": 0.1, "warmup_densities": [0.5], "warmup_steps_per_stage": 1}),  # k depends on step
    ("powersgd", {"rank": 2}),
    # auto decided after its one (local) probe step, on every rank at its first optimizer.step(); the extra
    # step is its pick's, whose agreement catches it (every probe step ends in one collective, the k-th
    # step's on every rank, so while probing a rank cannot get a step ahead of its peers)
    ("auto", {"candidates": ["gradient_allreduce"], "probe_steps": 1, "network": {"alpha": 1e-4, "beta": 1e-9}}),
], ids=["gradient_allreduce", "gtopk", "powersgd", "auto_after_probe"])
@pytest.mark.parametrize("P", (3, 4), ids=lambda p: f"P{p}")
def test_ranks_out_of_step_raise_on_every_rank(clusters, P, name, options):
    res = clusters.get(P).run(_r_out_of_step, name, options, timeout=60)
    for r, (msg, unchanged) in enumerate(res):
        assert "ranks are out of step" in msg and f"rank {P - 1}: 2" in msg and "rank 0: 1" in msg, (r, msg)
        assert unchanged, f"rank {r}: weights changed"


# Relaxations whose gradients stay on their rank: a non-finite gradient stays local too.
LOCAL_CASES = {
    "decentralized": ("decentralized", {"peer_selection": "ring"}),
    "shift_one": ("decentralized", {"peer_selection": "shift_one"}),
    "low_precision_decentralized": ("low_precision_decentralized", {}),
    "local_sgd": ("local_sgd", {"period": 2}),
    "local_sgd_uint8": ("local_sgd", {"period": 2, "compression": "minmax_uint8"}),
    "async": ("async_model_average", {"sync_interval_ms": 20}),
}
LOCAL_STEPS = 8  # local SGD averages at steps 2, 4, 6, 8: the last one ends the run


def _r_local(rank, P, label, scaler_on):
    """As _r_scaled, for a relaxation that keeps gradients local; without a scaler the bad rank catches
    the FloatingPointError and goes on, the usual "skip the bad step" loop."""
    name, options = LOCAL_CASES[label]
    net = _net()
    opt = _optimizer("sgd", net)
    model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.002)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler_on else None
    out = {"weights": [], "opt": [], "errors": [], "scale": []}
    for s in range(LOCAL_STEPS):
        _train_step(model, net, opt, scaler, rank, s, out)
        out["opt"].append(_sha(opt.state_dict()))
    out["step"] = model.algorithm_state_dict()["step"]
    model.close()
    if name == "async_model_average":
        model.algorithm.average_now()  # collective: every rank must get here, in step
    out["final"] = _weights(net)
    return out


def _r_local_all(rank, P, scaler_on):
    return {label: _r_local(rank, P, label, scaler_on) for label in LOCAL_CASES}


@pytest.mark.parametrize("P", (3, 4), ids=lambda p: f"P{p}")
@pytest.mark.parametrize("scaler_on", [True, False], ids=["grad_scaler", "no_scaler"])
def test_nonfinite_local_gradient_skips_on_its_rank_only(clusters, P, scaler_on):
    """decentralized, low-precision decentralized, local SGD and async after warm-up: the bad rank skips
    its update (its momentum untouched, its weights finite), its peers go on, nothing non-finite reaches
    anyone, and the skipped step still counts, so exchanges and periodic averages stay paired."""
    res = clusters.get(P).run(_r_local_all, scaler_on, timeout=240)
    for label in LOCAL_CASES:
        outs = [r[label] for r in res]
        for r, out in enumerate(outs):
            assert all(torch.isfinite(w).all() for w in out["weights"]), f"{label}: rank {r} went non-finite"
            assert out["step"] == LOCAL_STEPS, f"{label}: rank {r} counted {out['step']} steps, not {LOCAL_STEPS}"
            skipped = r == BAD_RANK
            # the optimizer (momentum) moved on every step except the bad rank's bad one
            assert (out["opt"][BAD_STEP] == out["opt"][BAD_STEP - 1]) == skipped, (label, r)
            assert not torch.equal(out["weights"][-1], out["weights"][BAD_STEP]), f"{label}: rank {r} stopped"
            if scaler_on:
                assert out["errors"] == [], (label, r, out["errors"])
                dropped = out["scale"][BAD_STEP] < out["scale"][BAD_STEP - 1]
                assert dropped == skipped, (label, r, out["scale"])
            elif skipped:
                assert [s for s, _ in out["errors"]] == [BAD_STEP], (label, r, out["errors"])
                msg = out["errors"][0][1]
                assert f"on rank {BAD_RANK}" in msg and "non-finite gradient" in msg and "in parameter '4." in msg, msg
            else:
                assert out["errors"] == [], (label, r, out["errors"])
        if label.startswith("local_sgd") or label == "async":  # the run ends with an average over all ranks
            assert len({bytes(o["final"].view(torch.uint8).numpy()) for o in outs}) == 1, \
                f"{label}: replicas differ after the final average"


def _r_local_deferred(rank, P, scaler_on):
    """_r_local_all with the checks a GPU leaves on the device (BAGUA_LITE_DEFER_CHECKS=1)."""
    os.environ["BAGUA_LITE_DEFER_CHECKS"] = "1"
    try:
        net = _net()
        model = bagua_lite.DistributedModel(net, _optimizer("sgd", net), "local_sgd", bucket_size_mb=0.002)
        deferred = model._local_flag is not None
        model.close()
        return deferred, _r_local_all(rank, P, scaler_on)
    finally:
        del os.environ["BAGUA_LITE_DEFER_CHECKS"]


@pytest.mark.parametrize("scaler_on", [True, False], ids=["grad_scaler", "no_scaler"])
def test_nonfinite_local_gradient_checked_on_the_device(clusters, scaler_on):
    """The same outcome when the local checks leave their answer on the device until the step reads it."""
    res = clusters.get(3).run(_r_local_deferred, scaler_on, timeout=240)
    assert all(deferred for deferred, _ in res)
    plain = clusters.get(3).run(_r_local_all, scaler_on, timeout=240)
    for label in LOCAL_CASES:
        for r in range(3):
            got, want = res[r][1][label], plain[r][label]
            assert got["errors"] == want["errors"] and got["scale"] == want["scale"], (label, r)
            assert got["step"] == want["step"], (label, r)
            if label != "async":  # its averaging follows the clock: not repeatable
                assert all(torch.equal(a, b) for a, b in zip(got["weights"], want["weights"])), (label, r)
                assert got["opt"] == want["opt"], (label, r)


def _r_local_reads(rank, P, micro_batches=1, no_sync=False):
    """Six steps of each relaxation that keeps gradients local, with the checks left on the device,
    counting the host's reads of their answers (``bucket.host_read``) and where they are made. Each step
    accumulates ``micro_batches`` backwards in ``.grad``, all but the last under no_sync() if ``no_sync``."""
    from bagua_lite import _C, step_hooks
    read, trainer = step_hooks.host_read, threading.get_ident()
    check, per_tensor = torch._amp_foreach_non_finite_check_and_unscale_, _C.scale_flagged_
    counts = {}

    def counted(t):
        where = "training thread" if threading.get_ident() == trainer else "other thread"
        counts[where] = counts.get(where, 0) + 1
        return read(t)

    def counted_check(grads, found, scale):
        counts["checks"] = counts.get("checks", 0) + 1
        counts["tensors checked"] = counts.get("tensors checked", 0) + len(grads)
        return check(grads, found, scale)

    def counted_per_tensor(*args):
        counts["per-tensor checks"] = counts.get("per-tensor checks", 0) + 1
        return per_tensor(*args)
    step_hooks.host_read = counted
    torch._amp_foreach_non_finite_check_and_unscale_ = counted_check
    _C.scale_flagged_ = counted_per_tensor
    os.environ["BAGUA_LITE_DEFER_CHECKS"] = "1"
    cases = dict(LOCAL_CASES, diloco=("diloco", {"period": 2}))
    try:
        out = {}
        for label, (name, options) in cases.items():
            net = _net()
            opt = _optimizer("sgd", net)
            model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.002)
            counts.clear()
            for s in range(6):
                for m in range(micro_batches):
                    x, y = _batch(rank, s * micro_batches + m)
                    with model.no_sync() if no_sync and m < micro_batches - 1 else contextlib.nullcontext():
                        F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            out[label] = dict(counts)
            model.close()
            if name == "async_model_average":
                model.algorithm.average_now()  # collective: every rank must get here, in step
        return out, len(list(_net().parameters()))
    finally:
        step_hooks.host_read = read
        torch._amp_foreach_non_finite_check_and_unscale_, _C.scale_flagged_ = check, per_tensor
        del os.environ["BAGUA_LITE_DEFER_CHECKS"]


@pytest.mark.parametrize("micro_batches,no_sync", [(1, False), (3, False), (3, True)],
                         ids=["one_backward", "accumulated", "accumulated_no_sync"])
def test_local_checks_left_on_the_device_are_read_once_per_step(clusters, micro_batches, no_sync):
    """Where gradients stay local (decentralized, local SGD, DiLoCo, async), the checks' one flag is read
    once per step, at optimizer.step(), on the training thread: the refusal must come before the optimizer
    applies (on a GPU, one host synchronisation per local step; a synchronous round's flags are read on
    the engine's thread instead: test_the_agreement_travels_with_the_last_bucket). The check itself is one
    multi-tensor pass over every gradient at the end of each backward (one dtype here), not a kernel per
    parameter: on a GPU a launch or so per local step instead of one per parameter. Micro-batches
    accumulated without no_sync() are checked at each backward, and their forwards read nothing (.grad is
    as the last backward left it: the step ahead reads them all); under no_sync() they are checked once."""
    backwards = 6 * (1 if no_sync else micro_batches)
    for r, (out, n_params) in enumerate(clusters.get(2).run(_r_local_reads, micro_batches, no_sync, timeout=240)):
        for label, counts in out.items():
            assert counts == {"training thread": 6, "checks": backwards, "tensors checked": backwards * n_params}, \
                (label, r, counts)



ACCUMULATED = {"local_sgd": ("local_sgd", {"period": 2}), "diloco": ("diloco", {"period": 2}),
               "decentralized": ("decentralized", {"peer_selection": "ring"})}


def _r_accumulated(rank, P, bad_micro, scaler_on, deferred, fused=False, skip=None):
    """Two micro-batches a step, accumulated in ``.grad`` without no_sync() (where gradients stay local
    nothing is held back by it); at BAD_STEP rank BAD_RANK's micro-batch ``bad_micro`` gives inf/NaN.
    With ``skip`` ("to_none" or "in_place"), the bad rank's loop skips that step itself (no
    optimizer.step(), then zero_grad with set_to_none=True or False), as a loop that checks its loss does.
    Records the step count each forward finds, the errors, the scales and the weights after each step."""
    if deferred:
        os.environ["BAGUA_LITE_DEFER_CHECKS"] = "1"
    try:
        out = {}
        for label, (name, options) in ACCUMULATED.items():
            net = _net()
            opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, fused=fused)
            model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.002)
            assert (model._local_flag is not None) == deferred
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler_on else None
            rec = {"weights": [], "errors": [], "seen": [], "scale": []}
            for s in range(LOCAL_STEPS):
                for micro in range(2):
                    x, y = _batch(rank, 2 * s + micro)
                    try:
                        logits = model(x)
                    except FloatingPointError as e:  # a fused optimizer's skip on the device, a step late
                        rec["errors"].append(("forward", s, str(e)))
                        logits = model(x)
                    loss = F.cross_entropy(logits, y)
                    rec["seen"].append(model.algorithm.step)
                    if s == BAD_STEP and rank == BAD_RANK and micro == bad_micro:
                        loss = loss * float("inf")
                    (scaler.scale(loss) if scaler else loss).backward()
                if skip and s == BAD_STEP and rank == BAD_RANK:
                    rec["errors"].append(("skipped", s))
                    opt.zero_grad(set_to_none=skip == "to_none")
                    rec["weights"].append(_weights(net))
                    continue
                try:
                    if scaler:
                        scaler.step(opt)
                        scaler.update()
                        rec["scale"].append(float(scaler.get_scale()))
                    else:
                        opt.step()
                except FloatingPointError as e:
                    rec["errors"].append(("step", s, str(e)))
                opt.zero_grad()
                rec["weights"].append(_weights(net))
            rec["step"] = model.algorithm_state_dict()["step"]
            model.close()
            out[label] = rec
        return out
    finally:
        os.environ.pop("BAGUA_LITE_DEFER_CHECKS", None)


@pytest.mark.parametrize("mode", ["at_once", "deferred", "grad_scaler", "deferred_fused", "deferred_grad_scaler"])
def test_a_nonfinite_micro_batch_accumulated_without_no_sync_is_refused_at_its_step(clusters, mode):
    """A non-finite gradient in an early micro-batch, under a relaxation that keeps gradients local: the
    next micro-batch's forward took it for a skipped step and counted one, then the step refused it and it
    counted again: the bad rank ran a step ahead of its peers' schedule (their averages and exchanges paired
    with the wrong steps; at the end it waited in a step its peers never ran). Now it is refused at its step
    (or skipped there by the scaler) and counted once, exactly as when the last micro-batch holds it: bit for
    bit the same weights, errors and scales, on every rank (P = 3). A fused optimizer with the checks on the
    device skips it there, the error coming at the next forward."""
    scaler_on, deferred, fused = mode.endswith("grad_scaler"), mode.startswith("deferred"), mode.endswith("fused")
    first = clusters.get(3).run(_r_accumulated, 0, scaler_on, deferred, fused, timeout=240)
    last = clusters.get(3).run(_r_accumulated, 1, scaler_on, deferred, fused, timeout=240)
    for label in ACCUMULATED:
        for r in range(3):
            a, b = first[r][label], last[r][label]
            assert a["seen"] == b["seen"] == [s for s in range(LOCAL_STEPS) for _ in range(2)], (label, r, a["seen"])
            assert a["step"] == b["step"] == LOCAL_STEPS, (label, r)
            refused = [] if r != BAD_RANK or scaler_on else [("forward", BAD_STEP + 1)] if fused else [("step", BAD_STEP)]
            assert [e[:2] for e in a["errors"]] == refused and a["errors"] == b["errors"], (label, r, a["errors"])
            assert a["scale"] == b["scale"], (label, r)
            assert all(torch.equal(u, v) for u, v in zip(a["weights"], b["weights"])), (label, r)
            assert all(torch.isfinite(w).all() for w in a["weights"]), (label, r)
            if r == BAD_RANK and not fused:  # (fused: the skipped step's period-end average runs in that step)
                assert torch.equal(a["weights"][BAD_STEP], a["weights"][BAD_STEP - 1]), (label, r)


@pytest.mark.parametrize("skip", ["to_none", "in_place"])
def test_a_step_the_loop_skips_counts_alike_with_the_checks_on_the_device(clusters, skip):
    """The bad rank's loop skips the step of its non-finite micro-batch itself (no optimizer.step(), then
    zero_grad): the skipped step counts at the next forward, which with the checks on the device is told
    from one more micro-batch by the gradients' version counters (zero_grad in place moves them; set to
    None, they are gone): the same step counts, errors and weights, bit for bit, as the checks that answer
    at once, on every rank (P = 3)."""
    deferred = clusters.get(3).run(_r_accumulated, 1, False, True, False, skip, timeout=240)
    at_once = clusters.get(3).run(_r_accumulated, 1, False, False, False, skip, timeout=240)
    for label in ACCUMULATED:
        for r in range(3):
            a, b = deferred[r][label], at_once[r][label]
            assert a["seen"] == b["seen"] == [s for s in range(LOCAL_STEPS) for _ in range(2)], (label, r, a["seen"])
            assert a["step"] == b["step"] == LOCAL_STEPS, (label, r)
            assert a["errors"] == b["errors"] == ([("skipped", BAD_STEP)] if r == BAD_RANK else []), (label, r)
            assert all(torch.equal(u, v) for u, v in zip(a["weights"], b["weights"])), (label, r)


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(D_IN, HIDDEN)
        self.extra = torch.nn.Linear(HIDDEN, CLASSES)
        self.head = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, use_extra):
        h = torch.relu(self.trunk(x))
        return self.head(h) + self.extra(h) if use_extra else self.head(h)


def _r_unused(rank, P, name):
    """Step 0: no rank uses ``extra``; step 1: only the last rank does. With weight decay and momentum."""
    net = _Branchy()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
    model = bagua_lite.DistributedModel(net, opt, build(name), bucket_size_mb=0.002)
    seen = []
    for s, use in enumerate([False, rank == P - 1]):
        before = net.extra.weight.detach().clone()
        x, y = _batch(rank, s)
        F.cross_entropy(model(x, use), y).backward()
        seen.append((net.extra.weight.grad is None, net.head.weight.grad is None))
        opt.step()
        opt.zero_grad()
        seen.append(torch.equal(before, net.extra.weight))
    model.close()
    return seen, _weights(net)


@pytest.mark.parametrize("name", ["gradient_allreduce", "gtopk"])
def test_parameters_no_rank_used_keep_grad_none(clusters, name):
    P = 3
    res = clusters.get(P).run(_r_unused, name, timeout=60)
    for r, (seen, _) in enumerate(res):
        # step 0: extra unused everywhere -> .grad None, weight untouched by weight decay/momentum
        assert seen[0] == (True, False) and seen[1] is True, (r, seen)
        # step 1: used on one rank -> every rank gets its (averaged) gradient; dense SGD moves it (under
        # gtopk momentum and weight decay travel through the sparse selection: it moves if selected)
        assert seen[2] == (False, False), (r, seen)
        if name == "gradient_allreduce":
            assert seen[3] is False, (r, seen)
    assert len({bytes(w.view(torch.uint8).numpy()) for _, w in res}) == 1, "replicas differ"


def _r_scaler_refused(rank, P, name):
    net = _net()
    opt = _optimizer("sgd", net)
    model = bagua_lite.DistributedModel(net, opt, build(name, density=0.1), bucket_size_mb=0.002)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    x, y = _batch(rank, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    before = _weights(net)
    try:
        scaler.step(opt)
        msg = None
    except RuntimeError as e:
        msg = str(e)
    same = torch.equal(before, _weights(net))
    model.close()
    return msg, same


@pytest.mark.parametrize("name", ["topk", "gtopk"])
def test_loss_scaler_under_momentum_correction_is_refused(clusters, name):
    """unscale_ rescales .grad in place without moving its version counter; under momentum correction the
    residuals and momenta hold scaled values, which a change of scale would silently mis-weight."""
    for r, (msg, same) in enumerate(clusters.get(3).run(_r_scaler_refused, name, timeout=60)):
        assert msg and "GradScaler" in msg and "momentum_correction: 0" in msg, (r, msg)
        assert same, f"rank {r}: weights changed by a refused step"


RIDES = ("gradient_allreduce", "fp16", "sign_error_feedback", "topk", "gtopk", "powersgd", "qadam")


def _r_agreement_path(rank, P, deferred):
    """Six steps of each algorithm, counting the agreements gathered after the buckets (``_gather_ints``),
    those posted with the last bucket (``_agreement_op``) and the host's reads of answers left on the device
    (``bucket.host_read``: one host synchronisation each on a GPU), by where they are made; ``deferred``:
    the checks left on the device (BAGUA_LITE_DEFER_CHECKS=1)."""
    from bagua_lite import agreement, bucket
    counts = {"gathered": 0, "posted": 0, "verdict reads": 0, "changed reads": 0, "on the training thread": 0}
    gather, post = agreement.RoundAgreement._gather_ints, agreement.RoundAgreement._agreement_op
    read = bucket.host_read

    def counted_gather(self, *a, **k):
        counts["gathered"] += 1
        return gather(self, *a, **k)

    def counted_post(self, unused):
        op = post(self, unused)
        counts["posted"] += op is not None
        return op

    trainer = threading.get_ident()

    def counted_read(where):
        def host_read(t):
            counts[where] += 1
            counts["on the training thread"] += threading.get_ident() == trainer
            return read(t)
        return host_read
    agreement.RoundAgreement._gather_ints, agreement.RoundAgreement._agreement_op = counted_gather, counted_post
    agreement.host_read, bucket.host_read = counted_read("verdict reads"), counted_read("changed reads")
    if deferred:
        os.environ["BAGUA_LITE_DEFER_CHECKS"] = "1"
    try:
        out = {}
        for label in RIDES:
            name, options, kind = CASES[label]
            net = _net()
            opt = _optimizer(kind, net)
            model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.002)
            counts.update({k: 0 for k in counts})  # set-up's own checks are not a round's
            for s in range(6):
                x, y = _batch(rank, s)
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            # a step-dependent wire (gtopk's warm-up) also checks the step count ahead of bucket 0, every round
            checks = 6 if model.algorithm.step_dependent_wire else 0
            out[label] = (dict(counts, gathered=counts["gathered"] - checks), len(model.buckets), _weights(net))
            model.close()
        return out
    finally:
        agreement.RoundAgreement._gather_ints, agreement.RoundAgreement._agreement_op = gather, post
        agreement.host_read = bucket.host_read = read
        os.environ.pop("BAGUA_LITE_DEFER_CHECKS", None)


# steps (of 6) whose .grad holds more than a gradient, so refuse_changed reads its answer once (Bucket.changed
# compares on the bucket's device, the CPU's too):
# topk/gtopk's momentum correction (SGD's momentum: on by default) every step, qadam's after its warm-up
CHANGED_READS = {"topk": 6, "gtopk": 6, "qadam": 4}


@pytest.mark.parametrize("P", (1, 2, 3), ids=lambda p: f"P{p}")
def test_the_agreement_travels_with_the_last_bucket(clusters, P):
    """Every round's agreement is posted as the last bucket's first op, overlapping that bucket's collectives,
    and none is gathered after the buckets: where the hooks' checks answer at once (CPU), and where they
    leave their answers on the device (GPU), whose flags the engine's thread then reads once per round as it
    posts the agreement, so the training thread waits for none (refuse_changed reads once more, on the
    training thread, where .grad holds more than a gradient). Both give the same weights, bit for bit, on
    every rank (what the agreement decides does not depend on where it travels). One rank alone gathers
    nothing, and where its checks stay on the device its row is made on the engine's thread all the same."""
    cluster = clusters.get(P)
    at_once, deferred = cluster.run(_r_agreement_path, False, timeout=240), cluster.run(_r_agreement_path, True)
    for label in RIDES:
        for r in range(P):
            (counts, buckets, w), (counts_deferred, _, w_deferred) = at_once[r][label], deferred[r][label]
            assert buckets >= 2, (label, buckets)
            changed = CHANGED_READS.get(label, 0)
            # one rank alone: nothing to gather, the row is made where it is known (_gather_ints sends nothing)
            at_once_path = {"gathered": 6, "posted": 0} if P == 1 else {"gathered": 0, "posted": 6}
            assert counts == {**at_once_path, "verdict reads": 0, "changed reads": changed,
                              "on the training thread": changed}, (label, r, counts)
            # the flags are read on the engine's thread as the agreement is posted: the training thread reads
            # none (refuse_changed's read is its own, in optimizer.step())
            assert counts_deferred == {"gathered": 0, "posted": 6, "verdict reads": 6, "changed reads": changed,
                                       "on the training thread": changed}, (label, r, counts_deferred)
            assert torch.equal(w, w_deferred), f"{label}: rank {r}'s weights depend on where the agreement travels"
            assert torch.equal(w, at_once[0][label][2]), f"{label}: replicas differ"
