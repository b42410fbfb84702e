"""A GradScaler under every algorithm: DistributedModel(..., grad_scaler=scaler).

The model unscales each bucket before the algorithm's ops and hands ``.grad`` back at the scaler's scale,
so residuals, momenta and selections see true gradients, and the scaler's ``unscale_`` of a ``.grad`` that
holds more than a gradient (topk/gtopk's momentum correction, qadam) is expected, not refused. With a
power-of-two scale every step is then the same arithmetic as without a scaler: bit for bit. An overflow
on one rank is skipped by every rank's scaler.
"""
import pytest
import torch

import bagua_lite
from bagua_lite.algorithms import build

from algo_matrix import CENTRALIZED, build_model, loss_of, pick, weights

ALGORITHMS = pick("dense", "fp16", "uint8", "sign", "topk", "gtopk", "gtopk_no_correction", "powersgd", "qadam",
                  "decentralized", "local_sgd", "diloco")
STEPS = 6


def _run(rank, name, options, scaler_scale=None, overflow_at=None, fused=False, unscale=True):
    """Train STEPS steps (SGD with momentum and weight decay: momentum correction folds the decay in, so a
    gradient at the wrong scale shows); with ``scaler_scale``, through a GradScaler of that (constant) scale
    given to the model. ``overflow_at``: on rank 1, that step's loss is made infinite. ``fused``: torch's fused
    optimizer; ``unscale``: the scaler's ``unscale_`` before its ``step()`` (without it, a fused optimizer
    gets ``.grad`` at the scale and the scale itself). Weights after every step."""
    scaler = None if scaler_scale is None else \
        torch.amp.GradScaler("cpu", init_scale=scaler_scale, growth_interval=10 ** 6)
    net, opt, model = build_model(name, options, grad_scaler=scaler, weight_decay=1e-2, fused=fused)
    history, scales = [], []
    for step in range(STEPS):
        loss = loss_of(model, rank, step)
        if step == overflow_at and rank == 1:
            loss = loss * float("inf")
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            if unscale:
                scaler.unscale_(opt)  # the AMP recipe's explicit unscale (where clipping would go)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        opt.zero_grad()
        history.append(weights(net))
    model.close()
    return history, scales


def _r_parity(rank, P, keys):
    out = {}
    for key in keys:
        name, options = ALGORITHMS[key]
        plain, _ = _run(rank, name, options)
        scaled, scales = _run(rank, name, options, scaler_scale=2.0 ** 12)
        out[key] = {"same": all(torch.equal(a, b) for a, b in zip(plain, scaled)),
                    "scales": scales, "last": scaled[-1]}
    return out


def test_every_algorithm_under_a_grad_scaler_is_bit_for_bit_the_unscaled_run(clusters):
    P = 3
    res = clusters.get(P).run(_r_parity, list(ALGORITHMS), timeout=300)
    for key in ALGORITHMS:
        for r in range(P):
            o = res[r][key]
            assert o["scales"] == [2.0 ** 12] * STEPS, (key, r, o["scales"])  # no step was skipped
            assert o["same"], f"{key}, rank {r}: training under the GradScaler differs from training without it"
        if key in CENTRALIZED:
            assert all(torch.equal(res[0][key]["last"], res[r][key]["last"]) for r in range(P)), key


def _r_overflow(rank, P, keys):
    out = {}
    for key in keys:
        name, options = ALGORITHMS[key]
        weights, scales = _run(rank, name, options, scaler_scale=2.0 ** 12, overflow_at=3)
        out[key] = {"weights": weights, "scales": scales}
    return out


def test_an_overflow_on_one_rank_is_skipped_by_every_rank(clusters):
    P = 2
    keys = [key for key in ALGORITHMS if key in CENTRALIZED]
    res = clusters.get(P).run(_r_overflow, keys, timeout=300)
    for key in keys:
        for r in range(P):
            w, scales = res[r][key]["weights"], res[r][key]["scales"]
            assert scales == [2.0 ** 12] * 3 + [2.0 ** 11] * 3, (key, r, scales)  # step 3 skipped, scale halved
            assert torch.equal(w[3], w[2]), f"{key}, rank {r}: the overflow step moved the weights"
            assert not torch.equal(w[5], w[3]) and torch.isfinite(w[5]).all(), f"{key}, rank {r}: no training after"
            assert torch.equal(w[5], res[0][key]["weights"][5]), f"{key}: replicas differ"


def _r_fused(rank, P, keys):
    out = {}
    for key in keys:
        name, options = ALGORITHMS[key]
        plain, _ = _run(rank, name, options, fused=True)
        scaled, scales = _run(rank, name, options, scaler_scale=2.0 ** 12, fused=True, unscale=False)
        skipped, skipped_scales = _run(rank, name, options, scaler_scale=2.0 ** 12, overflow_at=3, fused=True,
                                       unscale=False)
        out[key] = {"same": all(torch.equal(a, b) for a, b in zip(plain, scaled)), "scales": scales,
                    "skipped": skipped, "skipped_scales": skipped_scales}
    return out


def test_a_fused_optimizer_stepped_by_the_scaler_alone_trains_as_without_it(clusters):
    """The AMP recipe without ``unscale_`` (no clipping): GradScaler.step() hands a fused optimizer ``.grad`` at
    the scale with the scale itself, and an algorithm that applies its own update in ``optimizer.step()``
    (topk/gtopk's momentum correction, qadam after its freeze) must unscale as the fused kernel does: bit for
    bit the run without a scaler. An overflow on one rank after qadam's freeze is skipped by every rank, the
    frozen Adam update with it (the scaler's found_inf, on the device)."""
    P = 2
    keys = [key for key in ALGORITHMS if key in CENTRALIZED]
    res = clusters.get(P).run(_r_fused, keys, timeout=300)
    for key in keys:
        for r in range(P):
            o = res[r][key]
            assert o["scales"] == [2.0 ** 12] * STEPS, (key, r, o["scales"])
            assert o["same"], f"{key}, rank {r}: a fused optimizer under the scaler's step() differs from without it"
            w, scales = o["skipped"], o["skipped_scales"]
            assert scales == [2.0 ** 12] * 3 + [2.0 ** 11] * 3, (key, r, scales)
            assert torch.equal(w[3], w[2]), f"{key}, rank {r}: the overflow step moved the weights"
            assert not torch.equal(w[5], w[3]) and torch.isfinite(w[5]).all(), f"{key}, rank {r}: no training after"
            assert torch.equal(w[5], res[0][key]["skipped"][5]), f"{key}: replicas differ"


def _r_foreign_scaler(rank, P):
    """A GradScaler the model was not given steps a fused optimizer without unscale_: where .grad holds more
    than a gradient, the first such step is refused before anything changes."""
    out = {}
    for key in ("topk", "gtopk", "qadam", "dense"):
        name, options = ALGORITHMS[key]
        net, opt, model = build_model(name, options, weight_decay=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=10 ** 6)
        out[key] = None
        for step in range(STEPS):
            before = weights(net)
            scaler.scale(loss_of(model, rank, step)).backward()
            try:
                scaler.step(opt)
            except RuntimeError as e:
                out[key] = (step, str(e), torch.equal(before, weights(net)))
                break
            scaler.update()
            opt.zero_grad()
        model.close()
    return out


def test_a_scaler_the_model_was_not_given_stepping_a_fused_optimizer_is_refused(clusters):
    for out in clusters.get(2).run(_r_foreign_scaler):
        for key, at in (("topk", 0), ("gtopk", 0), ("qadam", ALGORITHMS["qadam"][1]["warmup_steps"])):
            step, msg, unchanged = out[key]
            assert step == at and unchanged, (key, out[key])
            assert "was not given the scaler" in msg and "grad_scaler=scaler" in msg, msg
        assert out["dense"] is None, out["dense"]  # .grad is a gradient: the fused kernel unscales it, as under DDP


def _r_clip_refused(rank, P):
    net = torch.nn.Linear(10, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    model = bagua_lite.DistributedModel(net, opt, build("gtopk", density=0.5), grad_scaler=scaler)
    scaler.scale(net(torch.randn(4, 10)).square().mean()).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)  # clips the momentum-corrected update: refused
    try:
        scaler.step(opt)
    except RuntimeError as e:
        return str(e)
    finally:
        model.close()


def test_clipping_after_the_scalers_unscale_is_still_refused(clusters):
    for msg in clusters.get(2).run(_r_clip_refused):
        assert msg is not None and ".grad was changed in place" in msg and "grad_scaler is no change" in msg, msg


def test_grad_scaler_is_checked_before_any_traffic():
    net = torch.nn.Linear(4, 2)
    with pytest.raises(TypeError, match=r"grad_scaler must be a torch.amp.GradScaler or None, got float"):
        bagua_lite.DistributedModel(net, torch.optim.SGD(net.parameters(), lr=0.1), grad_scaler=2.0 ** 16)


def _r_accumulate(rank, P, keys):
    """Two micro-batches a step, the first under no_sync() (gradients accumulate, scaled, until the synced
    backward), with and without the scaler; both zero_grad flavours."""
    out = {}
    for key in keys:
        name, options = ALGORITHMS[key]
        runs = []
        for scaled in (False, True):
            for set_to_none in (True, False):
                scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=10 ** 6) if scaled else None
                net, opt, model = build_model(name, options, grad_scaler=scaler, weight_decay=1e-2)
                for step in range(4):
                    with model.no_sync():
                        loss = loss_of(model, rank, 100 + step)
                        (scaler.scale(loss) if scaled else loss).backward()
                    loss = loss_of(model, rank, step)
                    (scaler.scale(loss) if scaled else loss).backward()
                    if scaled:
                        scaler.step(opt)
                        scaler.update()
                    else:
                        opt.step()
                    opt.zero_grad(set_to_none=set_to_none)
                model.close()
                runs.append(weights(net))
        out[key] = [torch.equal(runs[0], r) for r in runs[1:]]
    return out


def test_accumulation_under_no_sync_with_a_grad_scaler(clusters):
    keys = ["dense", "topk", "gtopk", "powersgd", "qadam"]
    for r, out in enumerate(clusters.get(2).run(_r_accumulate, keys)):
        for key in keys:
            assert all(out[key]), f"{key}, rank {r}: accumulation under the scaler differs {out[key]}"


def _r_fp16_autocast(rank, P, keys):
    """The consumer-GPU recipe on the CPU: fp16 autocast and a GradScaler whose first scale (2^24) overflows
    fp16's backward, so the first steps are skipped and the scale backs off until training goes on."""
    out = {}
    for key in keys:
        name, options = ALGORITHMS[key]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
        net, opt, model = build_model(name, options, grad_scaler=scaler)
        start, scales = weights(net), []
        for step in range(14):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model, rank, step)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            opt.zero_grad()
        model.close()
        out[key] = {"scales": scales, "start": start, "end": weights(net)}
    return out


def test_fp16_autocast_with_a_grad_scaler_skips_overflows_and_trains_under_every_algorithm(clusters):
    P = 2
    res = clusters.get(P).run(_r_fp16_autocast, list(ALGORITHMS), timeout=300)
    for key in ALGORITHMS:
        for r in range(P):
            o = res[r][key]
            assert o["scales"][0] < 2.0 ** 24 and o["scales"][-1] == o["scales"][-2], (key, r, o["scales"])
            assert torch.isfinite(o["end"]).all() and not torch.equal(o["end"], o["start"]), (key, r)
        if key in CENTRALIZED:
            assert torch.equal(res[0][key]["end"], res[1][key]["end"]), f"{key}: replicas differ"
