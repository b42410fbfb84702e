"""qadam (QAdam / 1-bit Adam) on real spawned gloo groups, P = 1..5, one round trip per world size.

* warm-up: qadam + Adam equals gradient_allreduce + Adam bit for bit, step by step (several buckets);
* after warm-up (Adam with coupled weight decay, and AdamW with decoupled decay, minmax_uint8):
  exp_avg_sq never changes, exp_avg is the communicated momentum (the bucket's content), the Adam step
  counter is the same tensor type torch keeps, replicas are bit-identical after every step, and the
  loss on a fixed batch falls;
* one post-warm-up step against a float64 reference built from plain torch: the momentum is the mean of
  the ranks' local momenta beta1 * m + (1 - beta1) * (g (+ wd * x)) up to compression (exactly, at P = 1;
  with minmax_uint8, fp16 and a user's Python compressor),
  and the parameters moved by Adam's update with that momentum and the frozen second moment (after a
  scheduler-style change of lr);
* resuming from (module, optimizer, algorithm) state dicts is bit-identical to an uninterrupted run;
* errors: a non-Adam optimizer (TypeError naming it), amsgrad / maximize, a bad compression or
  warm-up, and a step without a synchronised backward after warm-up.
"""
import copy
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua_lite
import bagua_lite.algorithms
from bagua_lite.algorithm import build

from test_compressors import AbsMax4  # noqa: F401  (registers the user compressor "absmax4_test")

D_IN, HIDDEN, CLASSES = 8, 16, 4
WARMUP = 3
LEVELS = {"minmax_uint8": 255, "fp16": 255, "absmax4_test": 7}  # quantization steps over a range
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET_MB = 0.0003  # ~300 bytes: the 212 parameters in two buckets
_W_TRUE = torch.randn(D_IN, CLASSES, generator=torch.Generator().manual_seed(5))


def _net(seed=0):
    torch.manual_seed(seed)  # tanh, not ReLU: no dead unit whose frozen second moment is 0
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES))


def _batch(rank, step, n=32):
    g = torch.Generator().manual_seed(rank * 7919 + step * 31 + 17)
    x = torch.randn(n, D_IN, generator=g)
    return x, (x @ _W_TRUE).argmax(1)


def _flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


def _optimizer(kind, net, lr=1e-2, **kw):
    return {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[kind](
        net.parameters(), lr=lr, **kw)


def _model(kind, opt_kw=None, alg="qadam", **alg_kw):
    net = _net()
    opt = _optimizer(kind, net, **(opt_kw or {}))
    return net, opt, bagua_lite.DistributedModel(net, opt, build(alg, **alg_kw), bucket_size_mb=BUCKET_MB)


def _step(model, opt, rank, s):
    x, y = _batch(rank, s)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _same_on_all_ranks(t):
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(torch.equal(e, everyone[0]) for e in everyone)


def _warmup_matches_gradient_allreduce(rank, wd):
    a = _model("adam", {"weight_decay": wd}, warmup_steps=10)
    b = _model("adam", {"weight_decay": wd}, alg="gradient_allreduce")
    assert len(a[2].buckets) >= 2, a[2].buckets
    for s in range(4):
        for net, opt, model in (a, b):
            _step(model, opt, rank, s)
        assert torch.equal(_flat(a[0]), _flat(b[0])), f"warm-up step {s}: qadam differs from gradient_allreduce"
    for _, _, model in (a, b):
        model.close()


def _post_warmup(rank, P, kind, wd, compression="minmax_uint8", steps=25, check_at=WARMUP + 4):
    net, opt, model = _model(kind, {"weight_decay": wd}, warmup_steps=WARMUP, compression=compression)
    params = list(net.parameters())
    x_eval, y_eval = _batch(1000, 0, n=256)

    def eval_loss():
        with torch.no_grad():
            return float(F.cross_entropy(net(x_eval), y_eval))
    first = eval_loss()
    for s in range(steps):
        frozen = [opt.state[p]["exp_avg_sq"].clone() for p in params] if s >= WARMUP else None
        if s == check_at:
            opt.param_groups[0]["lr"] *= 0.5  # as a scheduler would
            before = _reference_inputs(rank, model, opt, params, s, kind, wd)
        _step(model, opt, rank, s)
        assert _same_on_all_ranks(_flat(net)), f"{kind}: replicas differ after step {s}"
        if frozen is None:
            continue
        b2 = opt.param_groups[0]["betas"][1]
        for p, v in zip(params, frozen):
            if s == WARMUP:  # the freeze: bias-corrected once by the WARMUP Adam steps it had
                assert torch.equal(opt.state[p]["exp_avg_sq"], v / (1 - b2 ** float(WARMUP))), kind
            else:
                assert torch.equal(opt.state[p]["exp_avg_sq"], v), f"{kind}: exp_avg_sq changed at step {s}"
            st = opt.state[p]["step"]
            assert isinstance(st, torch.Tensor) and st.dtype == torch.float32 and float(st) == s + 1, st
        for b in model.buckets:
            for j, p in enumerate(b.params):
                assert torch.equal(opt.state[p]["exp_avg"], b.view(j)), f"{kind}: exp_avg is not the bucket's momentum"
                assert p.grad is None, "the pre-hook hands torch's Adam no gradient"
        if s == check_at:
            _check_reference(P, model, opt, params, s, kind, wd, before, LEVELS[compression])
    last = eval_loss()
    model.close()
    assert last < (0.8 if steps >= 20 else 1.0) * first, f"{kind}: held-out loss {first:.4f} -> {last:.4f}"
    return first, last


def _slots(model):
    """param -> (bucket, offset): where its gradient / momentum and its residual live in bucket layout."""
    return {p: (b, b.offsets[j]) for b in model.buckets for j, p in enumerate(b.params)}


def _residual(model, p):
    b, o = _slots(model)[p]
    return model.algorithm.residuals[b.index][o:o + p.numel()].double().view_as(p).clone()


def _reference_inputs(rank, model, opt, params, s, kind, wd):
    """This rank's local momentum for step s from plain torch (autograd.grad: no bucket hooks), plus
    what the step starts from: weights and error-feedback residuals."""
    x, y = _batch(rank, s)
    g = torch.autograd.grad(F.cross_entropy(model.module(x), y), params)
    beta1 = opt.param_groups[0]["betas"][0]
    m_local = []
    for p, gp in zip(params, g):
        gp = gp.double() + (wd * p.detach().double() if kind == "adam" else 0)
        m_local.append(beta1 * opt.state[p]["exp_avg"].double() + (1 - beta1) * gp)
    return {"x": [p.detach().double().clone() for p in params], "m_local": m_local,
            "residual": [_residual(model, p) for p in params]}


def _check_reference(P, model, opt, params, s, kind, wd, before, levels):
    group = opt.param_groups[0]
    lr, (b1, b2), eps, t = group["lr"], group["betas"], group["eps"], s + 1
    for i, p in enumerate(params):
        m = opt.state[p]["exp_avg"].double()
        # error feedback: rank r sent m_local + old residual and kept the part compression lost as its new
        # residual; what remains is the one compression of the averaged chunk (< a quantization step)
        sent = before["m_local"][i] + before["residual"][i] - _residual(model, p)
        everyone = [torch.empty_like(sent) for _ in range(P)]
        dist.all_gather(everyone, sent)
        mean = torch.stack(everyone).mean(0)
        b, _ = _slots(model)[p]
        tol = 1e-6 + (0 if P == 1 else float(b.flat.max() - b.flat.min()) / levels)
        err = float((m - mean).abs().max())
        assert err <= tol, f"{kind} param {i}: momentum is {err} away from the ranks' mean (tolerance {tol})"
        v = opt.state[p]["exp_avg_sq"].double()
        x = before["x"][i] * (1 - lr * wd if kind == "adamw" else 1.0)
        # v: bias-corrected once, at the freeze; no coordinate steps further than Adam's bound B allows
        bound = max(1.0, (1 - b1) / (1 - b2) ** 0.5)
        want = x - lr * ((m / (1 - b1 ** t)) / (v.sqrt() + eps)).clamp(-bound, bound)
        err = float((p.detach().double() - want).abs().max())
        assert err < 1e-6, f"{kind} param {i}: update differs from Adam with frozen v by {err}"


def _resume(rank, total=10, cut=6):
    def run(model, opt, lo, hi):
        for s in range(lo, hi):
            _step(model, opt, rank, s)

    alg = {"warmup_steps": WARMUP, "compression": "minmax_uint8"}
    net, opt, model = _model("adamw", {"weight_decay": 0.05}, **alg)
    run(model, opt, 0, total)
    model.close()
    want = _flat(net)

    net, opt, model = _model("adamw", {"weight_decay": 0.05}, **alg)
    run(model, opt, 0, cut)
    saved = {"net": net.state_dict(), "opt": opt.state_dict(), "alg": model.algorithm_state_dict()}
    assert any(float(r.abs().max()) > 0 for r in saved["alg"]["residuals"]) or dist.get_world_size() == 1
    model.close()
    net2 = _net(seed=123)
    net2.load_state_dict(saved["net"])
    opt2 = _optimizer("adamw", net2, weight_decay=0.05)
    opt2.load_state_dict(saved["opt"])
    model2 = bagua_lite.DistributedModel(net2, opt2, build("qadam", **alg), bucket_size_mb=BUCKET_MB)
    model2.load_algorithm_state_dict(saved["alg"])
    run(model2, opt2, cut, total)
    model2.close()
    assert torch.equal(_flat(net2), want), "resumed run differs from the uninterrupted one"


def _step_count_reads(rank):
    """Adam's step count: under a plain Adam (a host tensor) read once per parameter, at the freeze, then
    counted by qadam, a load_state_dict (new step tensors) read again once, with weights and counts equal to
    those of reading it at every step; under a fused (or capturable) Adam, which keeps it on the device where
    each read is a host synchronisation, read once in all, at the freeze: the bias corrections are made there,
    in fp64 from a copy of the counts, and the weights are those of the host's arithmetic bit for bit (on a
    CPU)."""
    import bagua_lite.algorithms.parts.frozen_adam as frozen_adam
    reads, real_read, real_count = [], frozen_adam.host_read, frozen_adam.FrozenAdam._count
    real_on_device = frozen_adam.FrozenAdam._step_on_device

    def counted(t):
        reads.append(t)
        return real_read(t)

    def train(fused):
        net, opt, model = _model("adamw", {"weight_decay": 0.05, "fused": fused}, warmup_steps=WARMUP)
        per_step = []
        for s in range(WARMUP + 5):
            if s == WARMUP + 4:
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new step tensors: read again
            del reads[:]
            _step(model, opt, rank, s)
            per_step.append(len(reads))
        model.close()
        return _flat(net), [float(opt.state[p]["step"]) for p in net.parameters()], per_step

    frozen_adam.host_read = counted
    try:
        weights, counts, per_step = train(False)
        n = len(counts)
        assert per_step == [0] * WARMUP + [n, 0, 0, 0, n], per_step
        assert counts == [WARMUP + 5.0] * n, counts
        frozen_adam.FrozenAdam._count = lambda self, p, step: int(real_read(step)[0])  # read every time
        try:
            want, want_counts, _ = train(False)
        finally:
            frozen_adam.FrozenAdam._count = real_count
        assert torch.equal(weights, want) and counts == want_counts, "counting differs from reading"

        weights, counts, per_step = train(True)
        assert per_step == [0] * WARMUP + [1, 0, 0, 0, 0], per_step  # at the freeze: did Adam step (_took_steps)
        assert counts == [WARMUP + 5.0] * n, counts
        frozen_adam.FrozenAdam._step_on_device = lambda self, group, ps, freeze, found_inf: \
            self._step_on_host(group, ps, freeze)  # the host's arithmetic on the same fused Adam
        try:
            want, want_counts, _ = train(True)
        finally:
            frozen_adam.FrozenAdam._step_on_device = real_on_device
        assert counts == want_counts, (counts, want_counts)
        assert torch.equal(weights, want), "the device's arithmetic differs from the host's"
    finally:
        frozen_adam.host_read = real_read


class _Branched(torch.nn.Module):
    """A head used only from step ``late_from`` on: no rank gives it a gradient during the warm-up."""

    def __init__(self, late_from):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(D_IN, CLASSES), torch.nn.Linear(D_IN, CLASSES)
        self.late_from, self.s = late_from, 0

    def forward(self, x):
        return self.a(x) + (self.b(x) if self.s >= self.late_from else 0.0)


def _late_parameter(rank, P):
    """A parameter with no Adam state at the freeze takes an ordinary Adam step when it first has a gradient
    (its state begins there), and at its next step is frozen with its v bias-corrected by its own count, as the
    others were at the freeze (before: left as Adam's live v, 1 / (1 - beta2) = 1000x too small). Resumed from a
    checkpoint taken between the two: bit for bit the uninterrupted run."""
    late, total = WARMUP + 1, WARMUP + 4

    def run(fused, cut=None):
        net = _Branched(late)
        opt = torch.optim.Adam(net.parameters(), lr=1e-2, fused=fused)
        model = bagua_lite.DistributedModel(net, opt, build("qadam", warmup_steps=WARMUP), bucket_size_mb=BUCKET_MB)
        v_seen = {}
        for s in range(total):
            if s == cut:  # a new model, optimizer and algorithm from the checkpoint
                saved = {"net": net.state_dict(), "opt": opt.state_dict(), "alg": model.algorithm_state_dict()}
                model.close()
                net = _Branched(late)
                net.load_state_dict(saved["net"])
                opt = torch.optim.Adam(net.parameters(), lr=1e-2, fused=fused)
                opt.load_state_dict(saved["opt"])
                model = bagua_lite.DistributedModel(net, opt, build("qadam", warmup_steps=WARMUP),
                                                    bucket_size_mb=BUCKET_MB)
                model.load_algorithm_state_dict(saved["alg"])
            net.s = s
            _step(model, opt, rank, s)
            if "exp_avg_sq" in opt.state.get(net.b.weight, {}):
                v_seen[s] = opt.state[net.b.weight]["exp_avg_sq"].clone()
        model.close()
        return _flat(net), v_seen

    for fused in (False, True):
        weights, v = run(fused)
        assert sorted(v) == list(range(late, total)), sorted(v)
        beta2 = 0.999
        assert torch.allclose(v[late + 1], v[late] / (1 - beta2), rtol=1e-6), "the late parameter's v not corrected"
        assert torch.equal(v[late + 2], v[late + 1]), "frozen: v no longer changes"
        resumed, _ = run(fused, cut=late + 1)
        assert torch.equal(resumed, weights), f"fused={fused}: resumed between a late Adam step and its freeze differs"


def test_the_frozen_update_skipped_on_the_device_changes_nothing():
    """A fused Adam's step given ``found_inf``: where it is 0, the update is the one without it, bit for bit;
    where it is 1 (the round held inf/NaN, now in .grad), weights, m, v and step are as before, bit for bit."""
    from bagua_lite.algorithms.parts.frozen_adam import FrozenAdam

    def trained(found_inf, bad_at=None):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
        for _ in range(3):  # Adam's own warm-up
            net(torch.randn(4, 6)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        adam, g, history = FrozenAdam(opt, set(net.parameters())), torch.Generator().manual_seed(1), []
        for k in range(5):
            for p in net.parameters():
                p.grad = torch.full(p.shape, float("nan")) if k == bad_at else torch.randn(p.shape, generator=g)
            adam.step(freeze=k == 0, found_inf=None if found_inf is None else torch.tensor(float(k == bad_at)))
            history.append([t.clone() for t in list(net.parameters()) + [
                opt.state[p][key] for p in net.parameters() for key in ("exp_avg", "exp_avg_sq", "step")]])
        return history

    plain, zero, skipped = trained(None), trained(0.0), trained(0.0, bad_at=2)
    assert all(torch.equal(a, b) for x, y in zip(plain, zero) for a, b in zip(x, y)), "found_inf = 0 differs"
    assert all(torch.equal(a, b) for a, b in zip(skipped[2], skipped[1])), "the skipped step changed something"
    assert all(torch.isfinite(t).all() for t in skipped[-1]) and not torch.equal(skipped[-1][0], skipped[2][0])


def _warmup_all_skipped(rank, P):
    """Every warm-up step skipped (rank 0's loss infinite, a GradScaler given to the model). The scaler does not
    call a plain Adam's step() for a skipped step, so those steps do not count and the warm-up goes on; a
    fused Adam's step() is called and skips on the device, so they count, and at the freeze Adam holds the
    state of steps it skipped (step 0, v = 0: v_hat would be 0 / 0): refused with a clear error, nothing
    changed."""
    out = []
    for fused in (False, True):
        net = _net()
        opt = _optimizer("adam", net, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
        model = bagua_lite.DistributedModel(net, opt, build("qadam", warmup_steps=WARMUP), bucket_size_mb=BUCKET_MB,
                                            grad_scaler=scaler)
        start = _flat(net)
        for s in range(WARMUP + 1):
            x, y = _batch(rank, s)
            loss = F.cross_entropy(model(x), y) * (float("inf") if rank == 0 and s < WARMUP else 1.0)
            scaler.scale(loss).backward()
            try:
                scaler.step(opt)
            except RuntimeError as e:
                out.append((fused, s, str(e), torch.equal(_flat(net), start)))
                break
            scaler.update()
            opt.zero_grad()
        model.close()
    return out


def test_a_warm_up_in_which_adam_never_stepped_is_refused_at_the_freeze(clusters):
    for out in clusters.get(2).run(_warmup_all_skipped):
        assert [o[:2] for o in out] == [(True, WARMUP)], out
        for fused, _, msg, unchanged in out:
            assert "Adam took no step during the warm-up" in msg and "warmup_steps" in msg and unchanged, (fused, msg)


def _errors(rank):
    def raises(exc, pattern, fn):
        with pytest.raises(exc) as info:
            fn()
        assert re.search(pattern, str(info.value)), str(info.value)

    raises(TypeError, r"torch\.optim\.Adam or torch\.optim\.AdamW, got SGD \(", lambda: _model("sgd", warmup_steps=2))
    raises(ValueError, r"amsgrad=True", lambda: _model("adam", {"amsgrad": True}, warmup_steps=2))
    raises(ValueError, r"maximize=True", lambda: _model("adamw", {"maximize": True}, warmup_steps=2))
    net, opt, model = _model("adam", warmup_steps=1)
    _step(model, opt, rank, 0)
    raises(RuntimeError, r"synchronised backward", opt.step)  # after warm-up, no backward
    model.close()


def _r_all(rank, P):
    _errors(rank)
    _warmup_matches_gradient_allreduce(rank, wd=0.01)
    losses = {(kind, wd): _post_warmup(rank, P, kind, wd) for kind, wd in (("adam", 0.01), ("adamw", 0.1))}
    for compression in ("fp16", "absmax4_test"):  # another native compressor; a user's, in Python
        _post_warmup(rank, P, "adam", 0.0, compression=compression, steps=WARMUP + 3, check_at=WARMUP + 1)
    _resume(rank)
    _step_count_reads(rank)
    _late_parameter(rank, P)
    return losses


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5], ids=lambda p: f"P{p}")
def test_qadam(clusters, P):
    res = clusters.get(P).run(_r_all, timeout=120)
    assert all(r == res[0] for r in res), "ranks saw different held-out losses"


def test_bad_options_are_clear():
    with pytest.raises(ValueError, match=r"unknown compression 'int3'.*'fp16'.*'minmax_uint8'"):
        build("qadam", compression="int3")
    with pytest.raises(ValueError, match=r"compression must be a compressor, not 'none'; choose one of .*'fp16'"):
        build("qadam", compression="none")
    with pytest.raises(ValueError, match=r"warmup_steps must be an int >= 1.*got 0"):
        build("qadam", warmup_steps=0)
    with pytest.raises(TypeError, match=r"warmup_steps"):
        build("qadam", warmup_steps=2.5)
    alg = bagua_lite.load_config(os.path.join(ROOT, "configs", "qadam.yaml")).algorithm
    assert alg.name == "qadam" and "adam" in alg.optimizer_kinds


def _r_unseen_coordinate(rank, P):
    """Input feature 0 is 0 during warm-up, so its weights get no gradient and a frozen v of 0; then it
    turns on. Unclipped, m / (sqrt(0) + eps) would step those weights by ~1e5 x lr; Adam's bound holds."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    model = bagua_lite.DistributedModel(net, opt, build("qadam", warmup_steps=2))
    g = torch.Generator().manual_seed(rank)
    moves = []
    for s in range(6):
        x = torch.randn(8, 4, generator=g)
        if s < 2:
            x[:, 0] = 0
        before = net.weight.detach()[:, 0].clone()
        F.cross_entropy(model(x), torch.randint(0, 3, (8,), generator=g)).backward()
        opt.step()
        opt.zero_grad()
        moves.append(float((net.weight.detach()[:, 0] - before).abs().max()))
    model.close()
    assert float(opt.state[net.weight]["exp_avg_sq"][:, 0].abs().max()) == 0  # frozen with nothing seen
    return moves


@pytest.mark.parametrize("P", [1, 3])
def test_frozen_variance_of_an_unseen_coordinate_stays_within_adams_bound(clusters, P):
    bound = max(1.0, 0.1 / 0.001 ** 0.5) * 1e-2  # B * lr for Adam's default betas
    for r, moves in enumerate(clusters.get(P).run(_r_unseen_coordinate)):
        assert moves[:2] == [0.0, 0.0], moves
        assert 0 < max(moves[2:]) <= bound * (1 + 1e-5), f"rank {r}: feature 0's weights moved {moves}"
