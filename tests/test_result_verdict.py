"""A round's non-finite verdict read off its result on the device (bagua_lite.verdict), with no host read.

Where the checks stay on the device (a GPU; here the CPU with BAGUA_LITE_DEFER_CHECKS=1), dense averaging
(gradient_allreduce with no codec or fp16) under a GradScaler or with a fused optimizer leaves its verdict
in the result, and the codecs, PowerSGD, topk, gtopk and qadam agree their flags on the device and put their
state back there: nothing reads it (``bucket.host_read`` is counted), and training is bit for bit what the
checks that answer at once give: the bad step skipped on every rank, the same scales, the same weights
after it. A fused optimizer without a scaler skips the step on the device and the error comes one step
late, at the next training forward.
"""
import os

import pytest
import torch
import torch.nn.functional as F

import bagua_lite
from bagua_lite.algorithms import build

BAD_STEP, BAD_RANK, STEPS = 3, 1, 7
CODECS = {"dense": ("gradient_allreduce", {}), "fp16": ("gradient_allreduce", {"compression": "fp16"}),
          "bf16": ("gradient_allreduce", {"compression": "bf16"}),
          # no state either, their verdict agreed from the buckets' flags
          "uint8": ("gradient_allreduce", {"compression": "minmax_uint8"}),
          "hierarchical": ("gradient_allreduce", {"hierarchical": True, "ranks_per_node": 2}),
          # and with state, put back on the device: error-feedback residuals, PowerSGD's residuals and Q's
          "sign": ("gradient_allreduce", {"compression": "sign"}),
          "powersgd": ("powersgd", {"rank": 2, "min_compression_rate": 1.0}),
          # double-buffered residuals, a discarded round's working copies put back on the device
          "topk": ("topk", {"density": 0.25, "momentum_correction": 0}),
          "gtopk": ("gtopk", {"density": 0.25, "momentum_correction": 0}),
          "gtopk_4bit": ("gtopk", {"density": 0.25, "momentum_correction": 0, "value_bits": 4})}
# with momentum correction (SGD's momentum, the default), which refuses a loss scaler: a fused SGD alone; the
# algorithm's own update skips with the optimizer's, and refuse_changed's answer joins the verdict there (the
# checks that answer at once read it once per step)
MOMENTUM_CORRECTED = {"topk_mc": ("topk", {"density": 0.25}), "gtopk_mc": ("gtopk", {"density": 0.25})}
# qadam after its freeze (at step 2, before BAD_STEP): its flags agreed, its residuals put back, its own frozen
# Adam update skipped with the fused Adam's found_inf (the scaler's, or the verdict's, with refuse_changed's
# answer joined to it); where that answer cannot join (a GradScaler's found_inf, or at once) it is read
QADAM = {"qadam": ("qadam", {"warmup_steps": 2})}
QADAM_CHANGED_READS = STEPS - 2 - 1  # the steps after the freeze that apply a round kept at once
# relaxations whose gradients stay local: only the bad rank skips, through its scaler or its fused optimizer
LOCAL = {"local_sgd": ("local_sgd", {"period": 2}), "diloco": ("diloco", {"period": 2}),
         "decentralized": ("decentralized", {})}
# (fused optimizer, GradScaler): the drivers that refuse a bad round on the device
DRIVERS = {"scaler": (False, True), "fused": (True, False), "fused_scaler": (True, True)}


def _run(rank, P, codec, fused, scaler_on, deferred, step_with_scaler=True, unscale_first=False):
    """STEPS steps of a small MLP under bf16 autocast, rank BAD_RANK's loss (P = 1: rank 0's) times inf at
    BAD_STEP; a FloatingPointError from the step or (a step late) from the forward is recorded and the loop goes on, a
    forward's error retrying the same batch. Counts host reads of answers left on the device."""
    from bagua_lite import agreement, bucket, step_hooks, verdict
    reads = []
    read = bucket.host_read
    agreement.host_read = bucket.host_read = verdict.host_read = step_hooks.host_read = \
        lambda t: reads.append(1) or read(t)
    if deferred:
        os.environ["BAGUA_LITE_DEFER_CHECKS"] = "1"
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                  torch.nn.Linear(32, 5))
        opt = torch.optim.Adam(net.parameters(), lr=1e-2, fused=fused) if codec in QADAM else \
            torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler_on else None
        name, options = {**CODECS, **MOMENTUM_CORRECTED, **QADAM, **LOCAL}[codec]
        model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.002,
                                            grad_scaler=scaler)
        out = {"weights": [], "errors": [], "scale": [], "rounds_on_device": 0, "reads": 0, "buckets": 0}
        s = 0
        while s < STEPS:
            g = torch.Generator().manual_seed(rank * 7919 + s * 31 + 5)
            x = torch.randn(16, 12, generator=g)
            try:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), (x[:, :5] * 3).argmax(1))
            except FloatingPointError as e:
                out["errors"].append(("forward", s, str(e)))
                continue
            if s == BAD_STEP and rank == min(BAD_RANK, P - 1):
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler else loss).backward()
            out["rounds_on_device"] += model._verdict_round
            try:
                if scaler and step_with_scaler:
                    scaler.step(opt)
                    scaler.update()
                    out["scale"].append(float(scaler.get_scale()))
                elif scaler and unscale_first:  # the scaler's check, then a step it does not gate
                    scaler.unscale_(opt)
                    try:
                        opt.step()
                    finally:
                        scaler.update()
                else:
                    opt.step()
            except FloatingPointError as e:
                out["errors"].append(("step", s, str(e)))
            opt.zero_grad()
            out["weights"].append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone())
            s += 1
        out["reads"], out["buckets"] = len(reads), len(model.buckets)
        out["found_inf_left"], out["steps"] = hasattr(opt, "found_inf"), model.algorithm.step
        model.close()
        return out
    finally:
        agreement.host_read = bucket.host_read = verdict.host_read = step_hooks.host_read = read
        os.environ.pop("BAGUA_LITE_DEFER_CHECKS", None)


def _codecs(driver):
    return list(CODECS) + (list(MOMENTUM_CORRECTED) if driver == "fused" else []) + list(QADAM)


def _r_both(rank, P, driver):
    fused, scaler_on = DRIVERS[driver]
    return {codec: (_run(rank, P, codec, fused, scaler_on, False), _run(rank, P, codec, fused, scaler_on, True))
            for codec in _codecs(driver)}


@pytest.mark.parametrize("P", (1, 2, 3), ids=lambda p: f"P{p}")
@pytest.mark.parametrize("driver", list(DRIVERS))
def test_verdict_stays_in_the_result(clusters, P, driver):
    fused, scaler_on = DRIVERS[driver]
    res = clusters.get(P).run(_r_both, driver, timeout=240)
    for codec in _codecs(driver):
        # momentum correction's refuse_changed at once: one read of its in-place check per step it applies a
        # kept round; on the device none (its answer goes to the fused optimizer's found_inf)
        changed = (0, STEPS - 1 if codec in MOMENTUM_CORRECTED else 0)
        if codec in QADAM:  # (a fused Adam's step under the scaler: the bad round was kept on the device, and read)
            changed = ({"fused": 0, "scaler": QADAM_CHANGED_READS, "fused_scaler": QADAM_CHANGED_READS + 1}[driver],
                       QADAM_CHANGED_READS)
        for r in range(P):
            at_once, device = res[r][codec]
            assert device["buckets"] >= 2, device["buckets"]
            # every round's verdict stayed on the device and nothing read it; at once nothing is left to read
            assert device["rounds_on_device"] == STEPS and device["reads"] == changed[0], (codec, r, device["reads"])
            assert at_once["rounds_on_device"] == 0 and at_once["reads"] == changed[1], (codec, r, at_once["reads"])
            assert not device["found_inf_left"] and not at_once["found_inf_left"]
            for s in range(STEPS):  # bit for bit the weights the checks that answer at once give
                assert torch.equal(device["weights"][s], at_once["weights"][s]), (codec, driver, r, s)
                assert torch.equal(device["weights"][s], res[0][codec][1]["weights"][s]), "replicas differ"
            assert device["scale"] == at_once["scale"]
            assert all(torch.isfinite(w).all() for w in device["weights"]), (codec, driver, r)
            # the bad step moved nothing, and training went on
            assert torch.equal(device["weights"][BAD_STEP], device["weights"][BAD_STEP - 1])
            assert not torch.equal(device["weights"][-1], device["weights"][BAD_STEP])
            if scaler_on:  # the scaler skips (a fused optimizer: on the device, by the found_inf it sets)
                assert at_once["errors"] == device["errors"] == [], (codec, driver, r, device["errors"])
                assert device["scale"][BAD_STEP] < device["scale"][BAD_STEP - 1]
            else:  # at once: step() refuses; on the device: skipped there, the error at the next forward
                assert [e[:2] for e in at_once["errors"]] == [("step", BAD_STEP)], at_once["errors"]
                assert [e[:2] for e in device["errors"]] == [("forward", BAD_STEP + 1)], device["errors"]
                msg = device["errors"][0][2]
                assert f"at step {BAD_STEP}:" in msg and "skipped that step on the device" in msg, msg


def _r_local(rank, P, driver):
    fused, scaler_on = DRIVERS[driver]
    return {label: (_run(rank, P, label, fused, scaler_on, False), _run(rank, P, label, fused, scaler_on, True))
            for label in LOCAL}


@pytest.mark.parametrize("P", (2, 3), ids=lambda p: f"P{p}")
@pytest.mark.parametrize("driver", list(DRIVERS))
def test_local_checks_go_to_the_scaler_or_the_fused_optimizer(clusters, P, driver):
    """Gradients that stay local (local SGD, DiLoCo, decentralized), checked on the device: the scaler's check
    or the fused optimizer's found_inf skips the bad rank's step with no read of the check (one, at the
    next forward, where a non-fused optimizer's scaler skipped a step, to count it), bit for bit as the
    checks that answer at once; without a scaler the error comes at the next forward, on the bad rank."""
    fused, scaler_on = DRIVERS[driver]
    res = clusters.get(P).run(_r_local, driver, timeout=240)
    for label in LOCAL:
        for r in range(P):
            at_once, device = res[r][label]
            bad = r == min(BAD_RANK, P - 1)
            assert device["reads"] == (1 if bad and not fused else 0), (label, driver, r, device["reads"])
            assert not device["found_inf_left"] and device["steps"] == at_once["steps"] == STEPS
            for s in range(STEPS):
                # a refused step counts at the next forward (its after_step, an average, then runs there), a step
                # skipped on the device counts at once: the weights as recorded after the bad step may differ
                if not (bad and s == BAD_STEP and not scaler_on):
                    assert torch.equal(device["weights"][s], at_once["weights"][s]), (label, driver, r, s)
            assert device["scale"] == at_once["scale"]
            assert all(torch.isfinite(w).all() for w in device["weights"]), (label, driver, r)
            if scaler_on or not bad:
                assert at_once["errors"] == device["errors"] == [], (label, driver, r, device["errors"])
            else:
                assert [e[:2] for e in at_once["errors"]] == [("step", BAD_STEP)], at_once["errors"]
                assert [e[:2] for e in device["errors"]] == [("forward", BAD_STEP + 1)], device["errors"]
                msg = device["errors"][0][2]
                assert f"on rank {r} at step {BAD_STEP}." in msg and "only this rank skipped" in msg, msg


def _r_bypass(rank, P, unscale_first):
    """A GradScaler given to the model, then optimizer.step() called without it (after the scaler's unscale_,
    or not): the verdict is read."""
    return {label: _run(rank, P, label, False, True, True, step_with_scaler=False, unscale_first=unscale_first)
            for label in ("dense", "local_sgd")}


@pytest.mark.parametrize("P", (1, 3), ids=lambda p: f"P{p}")
@pytest.mark.parametrize("unscale_first", [False, True], ids=["plain_step", "unscale_then_plain_step"])
def test_a_step_without_its_scaler_reads_the_verdict(clusters, P, unscale_first):
    """Nothing gates this step but the model (the scaler's unscale_ checked .grad, but a step its own step()
    does not make is not held back by it): the model reads the verdict, or the local flag, at
    optimizer.step() (one read per step, on the training thread) and refuses the bad round there."""
    for r, outs in enumerate(clusters.get(P).run(_r_bypass, unscale_first, timeout=240)):
        out = outs["dense"]
        assert out["reads"] == STEPS, (r, out["reads"])
        assert all(torch.isfinite(w).all() for w in out["weights"]), r
        assert [e[:2] for e in out["errors"]] == [("step", BAD_STEP)], out["errors"]
        assert torch.equal(out["weights"][BAD_STEP], out["weights"][BAD_STEP - 1])
        assert "refuses to apply it on every rank" in out["errors"][0][2]
        local, bad = outs["local_sgd"], r == min(BAD_RANK, P - 1)
        assert local["reads"] == STEPS and all(torch.isfinite(w).all() for w in local["weights"]), r
        assert [e[:2] for e in local["errors"]] == ([("step", BAD_STEP)] if bad else []), local["errors"]


def _r_not_eligible(rank, P):
    """qadam after its freeze: its verdict stays on the device with a fused Adam (whose found_inf its own update
    skips with) and is read with a plain one, which cannot skip there; the kinds of the others."""
    os.environ["BAGUA_LITE_DEFER_CHECKS"] = "1"
    try:
        on_device = []
        for fused in (True, False):
            net = torch.nn.Linear(4, 2)
            opt = torch.optim.Adam(net.parameters(), lr=0.1, fused=fused)
            model = bagua_lite.DistributedModel(net, opt, build("qadam", warmup_steps=1))
            for _ in range(2):  # the warm-up's round, then a frozen one
                net(torch.ones(3, 4)).sum().backward()
                opt.step()
            on_device.append(model._verdict_round)
            model.close()
        kinds = [build("gradient_allreduce", **o).device_verdict for o in
                 ({}, {"compression": "bf16"}, {"compression": "minmax_uint8"}, {"hierarchical": True},
                  {"compression": "sign"})]
        return on_device, kinds, [build(n).device_verdict for n in ("topk", "gtopk", "powersgd", "qadam")]
    finally:
        os.environ.pop("BAGUA_LITE_DEFER_CHECKS", None)


def test_only_rounds_that_can_be_refused_on_the_device_leave_their_verdict_there(clusters):
    for out in clusters.get(2).run(_r_not_eligible, timeout=120):
        assert out == ([True, False], ["result", "result", "flags", "flags", "flags"],
                       ["flags", "flags", "flags", "flags"]), out


def _r_changed_in_place(rank, P, name, deferred):
    """Momentum correction (.grad holds the corrected update) under a fused SGD: at step CHANGED every rank
    edits .grad through .data (no version counter moves, so only the values tell). At once: step() refuses
    with nothing applied. On the device: the fused SGD and the algorithm's own update skip the step there,
    the error comes at the next forward, and nothing is read."""
    from bagua_lite import bucket
    reads, read = [], bucket.host_read
    bucket.host_read = lambda t: reads.append(1) or read(t)
    if deferred:
        os.environ["BAGUA_LITE_DEFER_CHECKS"] = "1"
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, fused=True)
        model = bagua_lite.DistributedModel(net, opt, build(name, density=0.25), bucket_size_mb=0.002)
        weights, errors = [], []
        for s in range(CHANGED + 2):
            x = torch.randn(16, 12, generator=torch.Generator().manual_seed(rank * 7919 + s * 31 + 5))
            try:
                loss = F.cross_entropy(model(x), (x[:, :5] * 3).argmax(1))
            except RuntimeError as e:
                errors.append(("forward", s, str(e)))
                break
            loss.backward()
            if s == CHANGED:
                for p in net.parameters():
                    p.grad.data.mul_(0.5)
            try:
                opt.step()
            except RuntimeError as e:
                errors.append(("step", s, str(e)))
                break
            finally:
                opt.zero_grad()
            weights.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone())
        left = hasattr(opt, "found_inf")
        model.close()
        return weights, errors, len(reads), left
    finally:
        bucket.host_read = read
        os.environ.pop("BAGUA_LITE_DEFER_CHECKS", None)


CHANGED = 3


def _r_changed_both(rank, P, name):
    return _r_changed_in_place(rank, P, name, False), _r_changed_in_place(rank, P, name, True)


@pytest.mark.parametrize("P", (1, 3), ids=lambda p: f"P{p}")
@pytest.mark.parametrize("name", ["topk", "gtopk"])
def test_a_change_in_place_answered_on_the_device_skips_there(clusters, P, name):
    for r, (at_once, device) in enumerate(clusters.get(P).run(_r_changed_both, name, timeout=120)):
        assert [e[:2] for e in at_once[1]] == [("step", CHANGED)], at_once[1]
        assert [e[:2] for e in device[1]] == [("forward", CHANGED + 1)], device[1]
        assert at_once[2] == CHANGED + 1 and device[2] == 0, (at_once[2], device[2])  # reads
        assert not at_once[3] and not device[3]  # no found_inf left on the optimizer
        assert len(at_once[0]) == CHANGED and len(device[0]) == CHANGED + 1
        for s in range(CHANGED):  # bit for bit until the change, and the changed step moved nothing
            assert torch.equal(at_once[0][s], device[0][s]), (r, s)
        assert torch.equal(device[0][CHANGED], device[0][CHANGED - 1]), r
        msg = device[1][0][2]
        assert ".grad was changed in place" in msg and f"skipped step {CHANGED} on the device" in msg, msg
        assert "a step late" in msg and "a step late" not in at_once[1][0][2]


def _r_last_step_bad(rank, P):
    """A fused optimizer's skip on the device in the last step, with no forward after it: close() warns."""
    import warnings
    os.environ["BAGUA_LITE_DEFER_CHECKS"] = "1"
    try:
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, fused=True)
        model = bagua_lite.DistributedModel(net, opt, "gradient_allreduce")
        before = net.weight.detach().clone()
        (model(torch.ones(3, 4)).sum() * (float("inf") if rank == P - 1 else 1.0)).backward()
        opt.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.close()
        return torch.equal(net.weight, before), [str(w.message) for w in caught if w.category is RuntimeWarning]
    finally:
        os.environ.pop("BAGUA_LITE_DEFER_CHECKS", None)


def test_a_skip_no_forward_reported_warns_at_close(clusters):
    for unchanged, warned in clusters.get(2).run(_r_last_step_bad, timeout=120):
        assert unchanged
        assert len(warned) == 1 and "at step 0:" in warned[0] and "skipped that step on the device" in warned[0], warned
