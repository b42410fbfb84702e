"""DistributedModel end to end on real spawned gloo groups (P = 2, 3, 4), plus config validation.

What is checked, per world size (each remote function batches many checks into one round trip):

* ``gradient_allreduce`` matches ``torch.nn.parallel.DistributedDataParallel`` (same init model, per-rank
  data and SGD-with-momentum) within 1e-6 after 20 steps, with several buckets; also with ``no_sync``
  gradient accumulation, and with a parameter that gets no gradient on some steps / on some ranks.
* every centralized algorithm leaves all replicas bit-identical after every step;
* ``decentralized``: ``all`` keeps replicas identical, ``ring`` shrinks their spread in pure averaging
  rounds, ``shift_one`` partners agree, ``communication_interval`` is respected;
* ``local_sgd``: identical during warm-up and right after each averaging step, different in between;
* checkpoints: ``model.module.state_dict()`` and gtopk's ``algorithm.state_dict()`` round-trip (resuming
  gives bit-identical training);
* a user-defined ``bagua_lite.Algorithm`` (random-k) registered here, selected from YAML, trains;
* convergence on scikit-learn's digits at P = 4: every ``configs/*.yaml`` within 2 points of dense SGD,
  gtopk (density 0.01) within 1 point; the relaxations of BAGUA's space also at P = 3 (odd);
* bad configurations raise clear errors naming the key (single process), and ranks started with
  different configurations all fail at set-up, naming the differing rank.
"""
import copy
import hashlib
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua_lite
import bagua_lite.algorithms
from bagua_lite import comm
from bagua_lite.algorithm import build
from bagua_lite.algorithms.gtopk import GTopK

from cluster import Cluster, RemoteError
from test_compressors import AbsMax4  # noqa: F401  (registers the user compressor "absmax4_test")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = (2, 3, 4)

D_IN, HIDDEN, CLASSES = 16, 64, 8


# ---------------------------------------------------------------------------------------------------------
# a user-defined algorithm (module level: the spawned ranks register it when they unpickle a task of this
# module, exactly as the test process did on import)


@bagua_lite.algorithms.register("randomk_test")
class RandomKTest(bagua_lite.Algorithm):
    """Random-k sparsification: every rank picks the same k random coordinates per bucket and step (a
    shared seed), averages just those values with an allreduce; optional error feedback keeps the rest."""

    def __init__(self, density: float = 0.1, error_feedback: bool = True, seed: int = 0):
        super().__init__()
        if not 0 < density <= 1:
            raise ValueError(f"randomk_test: density must be in (0, 1], got {density}")
        self.density, self.error_feedback, self.seed = float(density), error_feedback, seed

    def init(self, model):
        self.residuals = [torch.zeros_like(b.flat) for b in model.buckets]

    def bucket_ops(self, bucket):
        def randomk(flat, b=bucket):
            n = flat.numel()
            k = max(1, int(self.density * n))
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step * 1009 + b.index)
            idx = torch.randperm(n, generator=g)[:k]
            acc = flat + self.residuals[b.index] if self.error_feedback else flat.clone()
            values = acc[idx].contiguous()
            comm.allreduce(values, "avg", group=self.process_group)
            if self.error_feedback:
                acc[idx] = 0
                self.residuals[b.index].copy_(acc)
            flat.zero_()
            flat[idx] = values
        return [randomk]

    def state_dict(self):
        return {"step": self.step, "residuals": [r.clone() for r in self.residuals]}

    def load_state_dict(self, state):
        self.step = int(state["step"])
        for dst, src in zip(self.residuals, state["residuals"]):
            dst.copy_(src)


# ---------------------------------------------------------------------------------------------------------
# helpers (used on the ranks)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


class Branchy(torch.nn.Module):
    """A trunk and head always used, plus ``extra`` used only when the caller asks for it."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = torch.nn.Linear(D_IN, HIDDEN)
        self.extra = torch.nn.Linear(HIDDEN, CLASSES)
        self.head = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, use_extra):
        h = torch.relu(self.trunk(x))
        out = self.head(h)
        return out + self.extra(h) if use_extra else out


_TEACHER = torch.Generator().manual_seed(99)
_W_TRUE = torch.randn(D_IN, CLASSES, generator=_TEACHER)


def _batch(rank, step, n=16, seed=0):
    """Rank- and step-specific data of a learnable task (labels from a fixed linear teacher)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + step * 31 + 17)
    x = torch.randn(n, D_IN, generator=g)
    return x, (x @ _W_TRUE).argmax(1)


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def _sha(t):
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _max_diff(a, b):
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def _sgd(module, lr=0.05, momentum=0.9):
    return torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)


def _step(model, opt, x, y, *args, set_to_none=True):
    loss = F.cross_entropy(model(x, *args), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    return loss.item()


def _ddp(module, **kw):
    return torch.nn.parallel.DistributedDataParallel(module, **kw)


# ---------------------------------------------------------------------------------------------------------
# remote: gradient_allreduce against DDP (plain, no_sync accumulation, unused parameters)


def _r_ddp_equivalence(rank, P):
    out = {}
    # 1. plain training, 20 steps, several buckets
    base = _mlp()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    ddp, opt_a = _ddp(a), _sgd(a)
    opt_b = _sgd(b)
    model = bagua_lite.DistributedModel(b, opt_b, "gradient_allreduce", bucket_size_mb=0.004)
    out["buckets"] = len(model.buckets)
    start = _flat(b)
    for s in range(20):
        x, y = _batch(rank, s)
        _step(ddp, opt_a, x, y)
        _step(model, opt_b, x, y)
    model.close()
    out["plain"] = _max_diff(a, b)
    out["moved"] = float((_flat(b) - start).abs().max())
    out["plain_sha"] = _sha(_flat(b))

    # 2. gradient accumulation: k micro-batches, the first k-1 under no_sync; both zero_grad flavours,
    #    and a branch used in the early micro-batches only (its gradient lives only in the accumulation)
    for set_to_none in (True, False):
        a, b = Branchy(), Branchy()
        ddp, opt_a = _ddp(a, find_unused_parameters=True), _sgd(a)
        opt_b = _sgd(b)
        model = bagua_lite.DistributedModel(b, opt_b, "gradient_allreduce", bucket_size_mb=0.001)
        k = 3
        for s in range(5):
            for net, opt in ((ddp, opt_a), (model, opt_b)):
                for m in range(k):
                    x, y = _batch(rank, s * k + m)
                    use_extra = m < k - 1 or s % 2 == 0
                    ctx = net.no_sync() if m < k - 1 else _nullcontext()
                    with ctx:
                        (F.cross_entropy(net(x, use_extra), y) / k).backward()
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
        model.close()
        out[f"no_sync_set_to_none={set_to_none}"] = _max_diff(a, b)
        out[f"no_sync_sha_{set_to_none}"] = _sha(_flat(b))

    # 3. a parameter without gradient: on some steps (all ranks), and only on some ranks. Plain SGD: DDP
    #    leaves a globally unused parameter's .grad None (the optimizer skips it) where bagua_lite hands
    #    the optimizer zeros, which only momentum/weight decay could tell apart.
    for case in ("some_steps", "some_ranks"):
        a, b = Branchy(), Branchy()
        ddp, opt_a = _ddp(a, find_unused_parameters=True), _sgd(a, momentum=0.0)
        opt_b = _sgd(b, momentum=0.0)
        model = bagua_lite.DistributedModel(b, opt_b, "gradient_allreduce", bucket_size_mb=0.001)
        for s in range(8):
            x, y = _batch(rank, s)
            use_extra = (s % 3 == 0) if case == "some_steps" else (rank == 0)
            _step(ddp, opt_a, x, y, use_extra)
            _step(model, opt_b, x, y, use_extra)
        model.close()
        out[f"unused_{case}"] = _max_diff(a, b)
        out[f"unused_sha_{case}"] = _sha(_flat(b))
        out[f"extra_moved_{case}"] = float((b.extra.weight - Branchy().extra.weight).abs().max())
    return out


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("P", WORLD, ids=lambda p: f"P{p}")
def test_gradient_allreduce_matches_ddp(clusters, P):
    res = clusters.get(P).run(_r_ddp_equivalence, timeout=120)
    for r, out in enumerate(res):
        assert out["buckets"] >= 3, f"rank {r}: expected several buckets, got {out['buckets']}"
        assert out["moved"] > 1e-2, f"rank {r}: parameters barely moved ({out['moved']})"
        assert out["plain"] < 1e-6, f"rank {r}: differs from DDP by {out['plain']} after 20 steps"
        for key in ("no_sync_set_to_none=True", "no_sync_set_to_none=False", "unused_some_steps",
                    "unused_some_ranks"):
            assert out[key] < 1e-6, f"rank {r}: {key}: differs from DDP by {out[key]}"
        for case in ("some_steps", "some_ranks"):
            assert out[f"extra_moved_{case}"] > 1e-4, f"rank {r}: the sometimes-used branch never trained"
    for key in ("plain_sha", "no_sync_sha_True", "no_sync_sha_False", "unused_sha_some_steps",
                "unused_sha_some_ranks"):
        assert len({out[key] for out in res}) == 1, f"{key}: replicas differ across ranks"


# ---------------------------------------------------------------------------------------------------------
# remote: every algorithm, per-step replica hashes


CENTRALIZED = {
    "ga_none": ("gradient_allreduce", {}),
    "ga_fp16": ("gradient_allreduce", {"compression": "fp16"}),
    "ga_minmax_uint8": ("gradient_allreduce", {"compression": "minmax_uint8"}),
    "ga_bf16": ("gradient_allreduce", {"compression": "bf16"}),
    "ga_sign_error_feedback": ("gradient_allreduce", {"compression": "sign"}),
    "ga_user_compressor": ("gradient_allreduce", {"compression": "absmax4_test"}),
    "hierarchical": ("gradient_allreduce", {"hierarchical": True, "ranks_per_node": 2}),
    "hierarchical_fp16": ("gradient_allreduce", {"hierarchical": True, "ranks_per_node": 2,
                                                 "compression": "fp16"}),
    "topk": ("topk", {"density": 0.05, "warmup_densities": [0.5], "warmup_steps_per_stage": 2}),
    "topk_optimizer_momentum": ("topk", {"density": 0.05, "momentum_correction": 0}),
    "gtopk_layerwise": ("gtopk", {"density": 0.05, "warmup_densities": [], "layerwise": True}),
    "gtopk": ("gtopk", {"density": 0.05, "warmup_densities": [0.5], "warmup_steps_per_stage": 2}),
    "gtopk_exact": ("gtopk", {"density": 0.05, "warmup_densities": [], "exact": True}),
    "gtopk_4bit": ("gtopk", {"density": 0.3, "warmup_densities": [], "value_bits": 4}),
    "gtopk_4bit_union": ("gtopk", {"density": 0.3, "warmup_densities": [], "value_bits": 4, "final_union": True}),
    "randomk_test": ("randomk_test", {"density": 0.2}),
}


def _train_hashes(rank, name, options, steps, lr=0.05, momentum=0.9, bucket_size_mb=0.005, flats=False):
    """Train from a common init on per-rank data; per step: this replica's hash (and flat weights)."""
    net = _mlp()
    opt = _sgd(net, lr, momentum)
    alg = build(name, **options)
    model = bagua_lite.DistributedModel(net, opt, alg, bucket_size_mb=bucket_size_mb)
    hashes, weights, losses = [], [], []
    for s in range(steps):
        x, y = _batch(rank, s)
        losses.append(_step(model, opt, x, y))
        w = _flat(net)
        hashes.append(_sha(w))
        if flats:
            weights.append(w)
    model.close()
    return {"hashes": hashes, "weights": weights, "losses": losses, "final": _flat(net),
            "buckets": len(model.buckets)}


def _r_centralized(rank, P, steps):
    return {label: _train_hashes(rank, name, opts, steps) for label, (name, opts) in CENTRALIZED.items()}


@pytest.mark.parametrize("P", WORLD, ids=lambda p: f"P{p}")
def test_centralized_replicas_bit_identical_every_step(clusters, P):
    steps = 6
    res = clusters.get(P).run(_r_centralized, steps, timeout=120)
    for label in CENTRALIZED:
        per_rank = [r[label] for r in res]
        assert per_rank[0]["buckets"] >= 3, f"{label}: expected several buckets"
        for s in range(steps):
            hs = [pr["hashes"][s] for pr in per_rank]
            assert len(set(hs)) == 1, f"{label}: replicas differ after step {s + 1}: {hs}"
        # it trains: the weights change every step
        assert len(set(per_rank[0]["hashes"])) == steps, f"{label}: some step left the weights unchanged"
    # the hierarchy computes the same average as the flat allreduce (up to summation order)
    diff = float((res[0]["hierarchical"]["final"] - res[0]["ga_none"]["final"]).abs().max())
    assert diff < 1e-5, f"hierarchical allreduce drifts from flat allreduce by {diff}"
    # and fp16 stays close to full precision over a few steps
    diff = float((res[0]["ga_fp16"]["final"] - res[0]["ga_none"]["final"]).abs().max())
    assert diff < 1e-2, f"fp16 compression drifts from full precision by {diff}"


def _r_error_feedback_mass(rank, P):
    """Error feedback loses nothing: sum over ranks of (gradients) == sum over ranks of (final residual)
    + P * (what the optimizer applied), for aggregations that sum exactly what they select."""
    out = {}
    lr = 0.1
    cases = {"topk": ("topk", {"density": 0.05}),
             "gtopk_exact": ("gtopk", {"density": 0.05, "warmup_densities": [], "exact": True})}
    if P <= 2:  # 4-bit values: each rank keeps what its levels left out; beyond 2 ranks a merged set is
        # quantized again before it is sent, and that error is no rank's
        cases["gtopk_4bit"] = ("gtopk", {"density": 0.3, "warmup_densities": [], "value_bits": 4})
        cases["gtopk_4bit_union"] = ("gtopk", {"density": 0.3, "warmup_densities": [], "value_bits": 4,
                                               "final_union": True})
    for label, (name, opts) in cases.items():
        net = _mlp()
        opt = _sgd(net, lr=lr, momentum=0.0)
        model = bagua_lite.DistributedModel(net, opt, build(name, **opts), bucket_size_mb=0.005)
        params = list(net.parameters())
        start = _flat(net).double()
        grads = torch.zeros_like(start)
        for s in range(5):
            x, y = _batch(rank, s)
            # this rank's own gradient at the current weights (autograd.grad: no .grad, no bucket hooks)
            g = torch.autograd.grad(F.cross_entropy(net(x), y), params)
            grads += torch.cat([t.reshape(-1) for t in g]).double()
            _step(model, opt, x, y)
        applied = (start - _flat(net).double()) / lr
        # residuals live in bucket layout (reverse parameter order): put them back in parameter order
        where = {p: (b, j) for b in model.buckets for j, p in enumerate(b.params)}
        residual = torch.cat([model.algorithm.residuals[where[p][0].index][
            where[p][0].offsets[where[p][1]]:where[p][0].offsets[where[p][1]] + p.numel()] for p in params]).double()
        model.close()
        out[label] = {"grads": grads, "residual": residual, "applied": applied}
    return out


def _r_block_max_parity(rank, P):
    """topk and gtopk with block maxima (the default) train exactly as with a selection over the whole
    bucket, and their selections really take the block-maxima path."""
    kern = bagua_lite.kernels
    real, paths = kern.topk_out, []

    def spy(x, k, values, indices, block_max=None):
        real(x, k, values, indices, block_max)
        paths.append(bagua_lite._C._topk_last_path() if block_max is not None else 0)

    out = {}
    kern.topk_out = spy
    try:
        for name, opts in (("topk", {"density": 0.003}), ("gtopk", {"density": 0.003, "warmup_densities": []})):
            for use in (True, False):
                net = _mlp()
                opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
                algo = build(name, **opts)
                algo.use_block_max = use
                model = bagua_lite.DistributedModel(net, opt, algo, bucket_size_mb=0.01)
                del paths[:]
                for s in range(6):
                    _step(model, opt, *_batch(rank, s))
                out[(name, use)] = {"weights": _sha(_flat(net)),
                                    "residuals": _sha(torch.cat([r.reshape(-1) for r in algo.residuals])),
                                    "paths": sorted(set(paths)), "buckets": len(model.buckets)}
                model.close()
    finally:
        kern.topk_out = real
    return out


def _r_layerwise(rank, P):
    """Per tensor: how many entries of its gradient the averaged sparse result holds after one step."""
    out = {}
    for layerwise in (False, True):
        net = _mlp()
        with torch.no_grad():
            net[2].weight.mul_(30.0)  # a middle layer that dwarfs the gradients before it and after it
        opt = _sgd(net, momentum=0.0)
        model = bagua_lite.DistributedModel(net, opt, build("gtopk", density=0.02, warmup_densities=[],
                                                            layerwise=layerwise), bucket_size_mb=1.0)
        F.cross_entropy(model(*_batch(rank, 0)[:1]), _batch(rank, 0)[1]).backward()
        out[layerwise] = {"buckets": len(model.buckets), "k": model.algorithm.k_for(model.buckets[0]),
                          "nonzero": [int((p.grad != 0).sum()) for p in net.parameters()],
                          "numel": [p.numel() for p in net.parameters()]}
        opt.zero_grad()
        model.close()
    return out


@pytest.mark.parametrize("P", (1, 3), ids=lambda p: f"P{p}")
def test_layerwise_selection_gives_every_tensor_its_share(clusters, P):
    for r, out in enumerate(clusters.get(P).run(_r_layerwise, timeout=60)):
        whole, per = out[False], out[True]
        assert whole["buckets"] == per["buckets"] == 1
        # one selection over the bucket leaves some tensor with nothing this step (so the check below means
        # something): the scaled middle layer takes it all
        assert 0 in whole["nonzero"], whole
        # layer-wise: every tensor sends max(1, round(density * n_i)) entries; each rank's selection
        # survives the global merge only in part, but every tensor gets some
        want = [max(1, round(0.02 * n)) for n in per["numel"]]
        assert per["k"] == sum(want), (per["k"], want)
        assert all(nz > 0 for nz in per["nonzero"]), per
        if P == 1:  # one rank: exactly its selection
            assert per["nonzero"] == want, (per["nonzero"], want)


def _r_momentum_correction(rank, P):
    """topk and gtopk at density 1 send everything, so with momentum correction (default: the optimizer's
    momentum and weight decay, applied before the selection) they must train exactly like DDP with that
    optimizer: momentum applied once, never masked away, never compounded."""
    out = {}
    for label, name, opts in (("topk", "topk", {}), ("gtopk", "gtopk", {}),
                              ("topk_layerwise", "topk", {"layerwise": True}),
                              ("gtopk_optimizer_momentum", "gtopk", {"momentum_correction": 0})):
        base = _mlp()
        a, b = copy.deepcopy(base), copy.deepcopy(base)
        sgd = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
        ddp, opt_a = _ddp(a), torch.optim.SGD(a.parameters(), **sgd)
        opt_b = torch.optim.SGD(b.parameters(), **sgd)
        model = bagua_lite.DistributedModel(b, opt_b, build(name, density=1.0, warmup_densities=[], **opts),
                                            bucket_size_mb=0.004)
        for s in range(10):
            x, y = _batch(rank, s)
            _step(ddp, opt_a, x, y)
            _step(model, opt_b, x, y)
        out[label] = {"diff": _max_diff(a, b), "groups": [(g["momentum"], g["weight_decay"]) for g in opt_b.param_groups],
                      "buffers": sum("momentum_buffer" in opt_b.state.get(p, {}) for p in b.parameters())}
        model.close()
    errors = {}
    for label, opt_kw, opts in (("twice", dict(momentum=0.9), {"momentum_correction": 0.9}),
                                ("nesterov", dict(momentum=0.9, nesterov=True), {}),
                                ("dampening", dict(momentum=0.9, dampening=0.1), {})):
        net = _mlp()
        try:
            bagua_lite.DistributedModel(net, torch.optim.SGD(net.parameters(), lr=0.05, **opt_kw),
                                        build("gtopk", density=0.1, **opts)).close()
            errors[label] = None
        except ValueError as e:
            errors[label] = str(e)
    out["errors"] = errors
    return out


def _r_sparse_optimizer_step(rank, P):
    """topk/gtopk at density 0.1 with momentum correction: the algorithm applies the step itself at the k
    entries the sparse result wrote (the optimizer's dense pass skipped: .grad is None inside step, back
    afterwards, and the optimizer's param groups as the user set them throughout), and the weights end as the
    dense update leaves them (forced by handing it a copy of .grad). A step whose update raises leaves .grad
    hidden until the next forward.
    With momentum correction a clip_grad_norm_ between backward and step (in place on the .grad views,
    which hold the corrected update, not a gradient) is refused; without momentum, clipping clips the
    sparse average and the optimizer's dense step sees the clipped values."""
    out = {}
    for name in ("topk", "gtopk"):
        base = _mlp()
        nets = {"sparse": copy.deepcopy(base), "dense": copy.deepcopy(base), "clipped": copy.deepcopy(base),
                "refused": copy.deepcopy(base)}
        models, opts, hidden, groups = {}, {}, {k: [] for k in nets}, {k: [] for k in nets}
        for k, net in nets.items():
            if k == "clipped":  # no momentum: nothing to correct, w -= lr * g with g the clipped average
                opts[k] = torch.optim.SGD(net.parameters(), lr=0.05)
            else:
                opts[k] = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
            models[k] = bagua_lite.DistributedModel(net, opts[k], build(name, density=0.1, warmup_densities=[]),
                                                    bucket_size_mb=0.004)
            # registered after the model's hook: sees what torch's SGD sees
            def seen(o, *_, k=k):  # returns None: a pre-hook's result would replace step()'s arguments
                hidden[k].append(sum(p.grad is None for g in o.param_groups for p in g["params"]))
                groups[k].append([(g["momentum"], g["weight_decay"]) for g in o.param_groups])
            opts[k].register_step_pre_hook(seen)
        grads_after, updates, refusal = [], [], None
        for s in range(8):
            x, y = _batch(rank, s)
            for k in nets:
                if k == "refused" and refusal is not None:
                    continue
                F.cross_entropy(models[k](x), y).backward()
                if k == "dense":  # a copy of .grad: the optimizer's own dense step on the same values
                    for p in nets[k].parameters():
                        p.grad = p.grad.clone()
                elif k in ("clipped", "refused"):
                    torch.nn.utils.clip_grad_norm_(nets[k].parameters(), 0.05)
                before = [p.detach().clone() for p in nets[k].parameters()]
                if k == "refused":
                    try:
                        opts[k].step()
                    except RuntimeError as e:
                        refusal = (s, str(e), all(torch.equal(p.detach(), w)
                                                  for p, w in zip(nets[k].parameters(), before)))
                    continue
                opts[k].step()
                grads = [p.grad for p in nets[k].parameters()]
                if k != "dense":
                    # w_after = w_before - lr * g, with g the (clipped) gradient the step saw
                    updates.append(max(float((p.detach() - (w - 0.05 * g)).abs().max())
                                       for p, w, g in zip(nets[k].parameters(), before, grads)))
                if k == "sparse":
                    grads_after.append(all(g is not None for g in grads))
                opts[k].zero_grad()
        diff = _max_diff(nets["sparse"], nets["dense"])
        # an update that raises (a hook after the model's): .grad stays hidden until the next forward
        def boom(*_):
            raise ValueError("boom")
        handle = opts["sparse"].register_step_pre_hook(boom)
        x, y = _batch(rank, 8)
        F.cross_entropy(models["sparse"](x), y).backward()
        try:
            opts["sparse"].step()
        except ValueError:
            pass
        handle.remove()
        raised = {"hidden_after_raise": all(p.grad is None for p in nets["sparse"].parameters()),
                  "groups_after_raise": [(g["momentum"], g["weight_decay"]) for g in opts["sparse"].param_groups]}
        with torch.no_grad():
            models["sparse"](x)
        raised["back_after_forward"] = all(p.grad is not None for p in nets["sparse"].parameters())
        out[name] = {"diff": diff, "hidden": hidden, "groups": groups,
                     "raised": raised,
                     "grads_after": grads_after, "update_err": max(updates), "refusal": refusal,
                     "nparams": len(list(base.parameters()))}
        for m in models.values():
            m.close()
    return out


@pytest.mark.parametrize("P", (1, 3), ids=lambda p: f"P{p}")
def test_sparse_optimizer_step_is_the_optimizers_step(clusters, P):
    for r, res in enumerate(clusters.get(P).run(_r_sparse_optimizer_step, timeout=120)):
        for name, o in res.items():
            n = o["nparams"]
            assert o["hidden"]["sparse"] == [n] * 9, (r, name, o["hidden"])   # torch's SGD saw no gradient (the
            # ninth step's update raised after it)
            assert o["hidden"]["dense"] == [n] * 8, (r, name, o["hidden"])    # nor a replaced one
            assert o["hidden"]["clipped"] == [0] * 8, (r, name, o["hidden"])  # no momentum: the optimizer's step
            assert o["groups"]["sparse"] == [[(0.9, 0.01)]] * 9, (r, name)   # never written, not even inside step
            assert o["raised"] == {"hidden_after_raise": True, "groups_after_raise": [(0.9, 0.01)],
                                   "back_after_forward": True}, (r, name, o["raised"])
            assert all(o["grads_after"]), (r, name)                           # and .grad is back after step
            assert o["diff"] < 1e-6, (r, name, o["diff"])                     # the same weights as the dense step
            assert o["update_err"] < 1e-6, (r, name, o["update_err"])
            step, msg, unchanged = o["refusal"]                               # clipping the corrected update
            assert step == 0 and unchanged and "clip_grad_norm_" in msg and "momentum_correction: 0" in msg, \
                (r, name, o["refusal"])
            assert o["hidden"]["refused"] == [], (r, name)                    # refused before the optimizer ran


@pytest.mark.parametrize("P", (1, 3, 4), ids=lambda p: f"P{p}")
def test_sparse_momentum_correction_at_density_one_is_ddp_with_momentum(clusters, P):
    res = clusters.get(P).run(_r_momentum_correction, timeout=120)
    for r, out in enumerate(res):
        for label in ("topk", "gtopk", "topk_layerwise", "gtopk_optimizer_momentum"):
            assert out[label]["diff"] < 1e-5, f"rank {r}, {label}: differs from DDP + SGD(momentum, wd) by {out[label]['diff']}"
            # the user's optimizer reads as configured (its param groups are never written)
            assert out[label]["groups"] == [(0.9, 0.01)], (label, out[label]["groups"])
        # with momentum correction the optimizer keeps no momentum of its own; without, it does
        assert out["topk"]["buffers"] == 0 and out["gtopk"]["buffers"] == 0, out["gtopk"]["buffers"]
        assert out["gtopk_optimizer_momentum"]["buffers"] == 6
        err = out["errors"]
        assert err["twice"] and "momentum would be applied twice" in err["twice"], err["twice"]
        assert err["nesterov"] and "nesterov=True" in err["nesterov"], err["nesterov"]
        assert err["dampening"] and "dampening=0.1" in err["dampening"], err["dampening"]


@pytest.mark.parametrize("P", (1, 3), ids=lambda p: f"P{p}")
def test_block_max_selection_trains_identically(clusters, P):
    for r, out in enumerate(clusters.get(P).run(_r_block_max_parity, timeout=120)):
        for name in ("topk", "gtopk"):
            on, off = out[(name, True)], out[(name, False)]
            assert on["buckets"] > 1, on  # several buckets, each with its own bounds
            assert on["paths"] == [5], f"rank {r}, {name}: selections took paths {on['paths']}, not block maxima (5)"
            assert off["paths"] == [0], off["paths"]
            assert on["weights"] == off["weights"] and on["residuals"] == off["residuals"], (r, name)


@pytest.mark.parametrize("P", WORLD, ids=lambda p: f"P{p}")
def test_error_feedback_conserves_gradient_mass(clusters, P):
    res = clusters.get(P).run(_r_error_feedback_mass, timeout=60)
    for label in res[0]:
        total = sum(r[label]["grads"] for r in res)
        kept = sum(r[label]["residual"] for r in res)
        applied = res[0][label]["applied"]
        assert float(kept.abs().max()) > 1e-3, f"{label}: no residual left: the check would be vacuous"
        err = float((kept + P * applied - total).abs().max())
        assert err < 1e-4, f"{label}: sum of gradients != residuals + P * applied update (max error {err})"


def _local_grad(net, x, y):
    """This rank's gradient at the current weights, on a fresh copy (no hooks, no communication)."""
    ref = _mlp()
    ref.load_state_dict(net.state_dict())
    F.cross_entropy(ref(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in ref.parameters()])


def _mix(mode, rank, P, everyone, exchange):
    """W x_t for this rank, from every rank's x_t."""
    if mode == "all":
        return torch.stack(everyone).mean(0)
    if mode == "shift_one":
        partner = bagua_lite._C.shift_one_partner(rank, P, exchange)
        return everyone[rank] if partner < 0 else (everyone[rank] + everyone[partner]) / 2
    if mode == "ring_one_way":
        peers = [(rank - 1) % P] if P > 1 else []
    else:
        peers = sorted({(rank - 1) % P, (rank + 1) % P} - {rank})
    return (everyone[rank] + sum(everyone[j] for j in peers)) / (len(peers) + 1)


def _ring_rounds(rank, name, peer_selection="ring", **options):
    """Diverge with local training (different data per rank, no averaging for 5 steps), then pure
    averaging rounds (lr = 0): returns the weights before the first round and after each round."""
    net = _mlp()
    opt = _sgd(net, lr=0.1, momentum=0.0)
    model = bagua_lite.DistributedModel(net, opt, build(name, peer_selection=peer_selection, communication_interval=6,
                                                        **options), bucket_size_mb=0.01)
    for s in range(5):
        x, y = _batch(rank, s)
        _step(model, opt, x, y)
    diverged = _flat(net)
    x, y = _batch(rank, 5)
    _step(model, opt, x, y)  # the 6th step: its update and the first averaging round (W x_5 - lr g)
    rounds = [_flat(net)]
    model.algorithm.communication_interval = 1
    for g in opt.param_groups:
        g["lr"] = 0.0
    for s in range(8):
        x, y = _batch(rank, 100 + s)
        _step(model, opt, x, y)
        rounds.append(_flat(net))
    model.close()
    return diverged, rounds


def _r_decentralized(rank, P):
    out = {}
    # Every step against the reference x_{t+1} = W x_t - lr * grad f_rank(x_t) (plain SGD), W per mode;
    # with communication_interval 3 the steps in between are purely local.
    lr = 0.1
    for mode, interval in (("ring", 1), ("ring_one_way", 1), ("shift_one", 1), ("all", 1), ("all", 3), ("ring", 2)):
        net = _mlp()
        opt = _sgd(net, lr=lr, momentum=0.0)
        model = bagua_lite.DistributedModel(net, opt, build("decentralized", peer_selection=mode,
                                                            communication_interval=interval), bucket_size_mb=0.01)
        errs, moved = [], 0.0
        for s in range(6):
            x, y = _batch(rank, s)
            before, g = _flat(net), _local_grad(net, x, y)
            exchange = model.algorithm.exchanges
            _step(model, opt, x, y)
            everyone = [torch.zeros_like(before) for _ in range(P)]
            dist.all_gather(everyone, before)
            mixed = _mix(mode, rank, P, everyone, exchange) if (s + 1) % interval == 0 else before
            errs.append(float((_flat(net) - (mixed - lr * g)).abs().max()))
            moved = max(moved, float((_flat(net) - before).abs().max()))
        model.close()
        out[f"{mode}/{interval}"] = (max(errs), moved, model.algorithm.exchanges)
    out["ring_diverged"], out["ring_rounds"] = _ring_rounds(rank, "decentralized")
    out["lp_diverged"], out["lp_rounds"] = _ring_rounds(rank, "low_precision_decentralized")
    out["lp1_diverged"], out["lp1_rounds"] = _ring_rounds(rank, "low_precision_decentralized", "ring_one_way")
    out["lpall_diverged"], out["lpall_rounds"] = _ring_rounds(rank, "decentralized", "all", compression="fp16")
    return out


def _spread(ws):
    stack = torch.stack(ws).double()
    return float((stack - stack.mean(0)).abs().max())


@pytest.mark.parametrize("P", WORLD, ids=lambda p: f"P{p}")
def test_decentralized(clusters, P):
    res = clusters.get(P).run(_r_decentralized, timeout=120)
    for key in ("ring/1", "ring_one_way/1", "shift_one/1", "all/1", "all/3", "ring/2"):
        for r, out in enumerate(res):
            err, moved, exchanges = out[key]
            assert moved > 1e-3, f"{key}: rank {r} barely moved ({moved})"
            assert err < 1e-5, f"{key}: rank {r} differs from W x_t - lr g by {err}"
            interval = int(key.split("/")[1])
            assert exchanges == (6 // interval if P > 1 else 0), f"{key}: {exchanges} exchanges"
    # ring, pure averaging rounds: the spread shrinks every round and the mean is kept
    # (exact ring; uint8 ring; uint8 one-way ring, whose second eigenvalue is 0.71 at P = 4; fp16 all)
    for prefix, floor, shrink in (("ring", 1e-6, 1e-3), ("lp", 1e-4, 1e-3), ("lp1", 1e-4, 0.15), ("lpall", 1e-3, 1e-3)):
        start = _spread([r[f"{prefix}_diverged"] for r in res])
        pure = [_spread([r[f"{prefix}_rounds"][i] for r in res]) for i in range(len(res[0][f"{prefix}_rounds"]))]
        if P == 1:
            assert max(pure) == 0
            continue
        assert start > 1e-3, f"{prefix}: replicas did not diverge before averaging (spread {start})"
        for i in range(2, len(pure)):
            if pure[i - 1] <= floor:
                assert pure[i] <= floor * 3, f"{prefix}: replicas drifted apart again in round {i + 1}: {pure}"
            elif prefix == "ring":
                assert pure[i] < pure[i - 1], f"{prefix}: spread grew in averaging round {i + 1}: {pure}"
        assert pure[-1] <= max(shrink * start, floor), f"{prefix}: spread did not shrink: {start} {pure}"
        if prefix == "ring" and P == 4:
            # W = (L + I + R)/3 on a 4-ring: the disagreement shrinks by 1/3 per round (second eigenvalue)
            ratios = [pure[i] / pure[i - 1] for i in range(2, 5)]
            assert all(r < 0.4 for r in ratios), f"ring P=4: spread ratios {ratios}, expected <= 1/3"
            assert pure[0] > 1e-4  # not a global average: one round does not reach consensus
        means = [torch.stack([r[f"{prefix}_rounds"][i] for r in res]).double().mean(0) for i in range(len(pure))]
        for i in range(2, len(means)):
            assert float((means[i] - means[1]).abs().max()) < 1e-5, f"{prefix}: averaging does not keep the mean"


def _r_compressed_gossip(rank, P):
    """The compressed exchange (CHOCO) against a plain-torch replay of every rank's copies, with messages cut
    into chunks of 700 elements (the first of 150): chunk edges fall inside parameters and between them.
    fp16 is elementwise, so the chunking must not change a single value."""
    import bagua_lite.algorithms.low_precision_decentralized as dec
    out = {}
    saved = dec.FIRST_CHUNK, dec.CHUNK
    dec.FIRST_CHUNK, dec.CHUNK = 150, 700
    try:
        for mode in ("ring", "ring_one_way", "all"):
            lr, gamma = 0.1, 0.8
            net = _mlp()
            opt = _sgd(net, lr=lr, momentum=0.0)
            model = bagua_lite.DistributedModel(net, opt, build("decentralized", peer_selection=mode, compression="fp16",
                                                                consensus_step=gamma), bucket_size_mb=0.01)
            assert len(model.algorithm.chunks) > 3 or P == 1
            x_hat = [_flat(net) for _ in range(P)]  # everyone's public copy, replayed here
            nbrs = {"ring": sorted({(rank - 1) % P, (rank + 1) % P} - {rank}),
                    "ring_one_way": [(rank - 1) % P] if P > 1 else [], "all": [j for j in range(P) if j != rank]}[mode]
            errs = []
            for s in range(5):
                x, y = _batch(rank, s)
                before, g = _flat(net), _local_grad(net, x, y)
                _step(model, opt, x, y)
                everyone = [torch.zeros_like(before) for _ in range(P)]
                dist.all_gather(everyone, before)
                if P > 1:
                    for j in range(P):
                        x_hat[j] = x_hat[j] + (everyone[j] - x_hat[j]).half().float()
                mean = torch.stack([x_hat[j] for j in [rank] + nbrs]).mean(0)
                expect = before - lr * g + gamma * (mean - x_hat[rank])
                errs.append(float((_flat(net) - expect).abs().max()))
            model.close()
            out[mode] = max(errs)
    finally:
        dec.FIRST_CHUNK, dec.CHUNK = saved
    return out


@pytest.mark.parametrize("P", (1, 3, 4), ids=lambda p: f"P{p}")
def test_compressed_gossip_matches_reference(clusters, P):
    for r, out in enumerate(clusters.get(P).run(_r_compressed_gossip, timeout=120)):
        for mode, err in out.items():
            assert err < 1e-5, f"{mode}: rank {r} differs from the CHOCO replay by {err}"


def _r_local_sgd(rank, P, compression):
    return _train_hashes(rank, "local_sgd", {"period": 3, "warmup_steps": 4, "compression": compression}, 11)["hashes"]


@pytest.mark.parametrize("compression", ["none", "minmax_uint8", "absmax4_test"])
@pytest.mark.parametrize("P", WORLD, ids=lambda p: f"P{p}")
def test_local_sgd(clusters, P, compression):
    res = clusters.get(P).run(_r_local_sgd, compression, timeout=60)
    for s in range(11):
        step = s + 1
        distinct = len({r[s] for r in res})
        if step <= 4 or (step - 4) % 3 == 0:
            assert distinct == 1, f"local_sgd: replicas differ after step {step} (warm-up or averaging step)"
        else:
            assert distinct == P, f"local_sgd: replicas agree after local step {step}"


# ---------------------------------------------------------------------------------------------------------
# remote: checkpoints, a user algorithm from YAML, mismatched configurations


def _r_checkpoints(rank, P):
    out = {}
    # the wrapped module's state dict round-trips
    net = _mlp()
    opt = _sgd(net)
    model = bagua_lite.DistributedModel(net, opt, "gradient_allreduce", bucket_size_mb=0.01)
    for s in range(3):
        _step(model, opt, *_batch(rank, s))
    sd = model.module.state_dict()
    fresh = _mlp(seed=123)
    fresh.load_state_dict(sd)
    x, _ = _batch(rank, 50)
    out["module_keys"] = sorted(sd)
    out["module_roundtrip"] = torch.equal(_flat(fresh), _flat(net)) and torch.equal(fresh(x), net(x))
    model.close()

    # gtopk: residuals (and DGC momenta) round-trip through the algorithm's state dict, and resuming from
    # (module, optimizer, algorithm) state continues bit-identically
    opts = {"density": 0.05, "warmup_densities": []}  # momentum correction: the optimizer's (default)
    net = _mlp()
    opt = _sgd(net)
    model = bagua_lite.DistributedModel(net, opt, build("gtopk", **opts), bucket_size_mb=0.005)
    for s in range(4):
        _step(model, opt, *_batch(rank, s))
    ck_module, ck_opt = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    ck_alg = model.algorithm.state_dict()
    saved = [r.clone() for r in ck_alg["residuals"]]
    for s in range(4, 7):
        _step(model, opt, *_batch(rank, s))
    uninterrupted = _flat(net)
    model.close()
    out["residual_norm"] = sum(float(r.norm()) for r in saved)
    out["snapshot_kept"] = all(torch.equal(a, b) for a, b in zip(saved, ck_alg["residuals"]))

    net2 = _mlp(seed=7)
    net2.load_state_dict(ck_module)
    opt2 = _sgd(net2)
    opt2.load_state_dict(ck_opt)
    model2 = bagua_lite.DistributedModel(net2, opt2, build("gtopk", **opts), bucket_size_mb=0.005)
    model2.algorithm.load_state_dict(ck_alg)
    out["loaded_step"] = model2.algorithm.step
    out["residuals_loaded"] = all(torch.equal(a, b) for a, b in zip(model2.algorithm.residuals, saved))
    out["momenta_loaded"] = all(torch.equal(a, b) for a, b in zip(model2.algorithm.momenta, ck_alg["momenta"]))
    for s in range(4, 7):
        _step(model2, opt2, *_batch(rank, s))
    out["resumed_equal"] = torch.equal(_flat(net2), uninterrupted)
    model2.close()

    # without the algorithm state (residuals lost) the continuation differs: the check above is not vacuous
    net3 = _mlp(seed=7)
    net3.load_state_dict(ck_module)
    opt3 = _sgd(net3)
    opt3.load_state_dict(ck_opt)
    model3 = bagua_lite.DistributedModel(net3, opt3, build("gtopk", **opts), bucket_size_mb=0.005)
    model3.algorithm.step = 4
    for s in range(4, 7):
        _step(model3, opt3, *_batch(rank, s))
    out["without_state_differs"] = not torch.equal(_flat(net3), uninterrupted)
    model3.close()
    return out


@pytest.mark.parametrize("P", WORLD, ids=lambda p: f"P{p}")
def test_state_dict_roundtrips(clusters, P):
    res = clusters.get(P).run(_r_checkpoints, timeout=60)
    for r, out in enumerate(res):
        assert out["module_roundtrip"], f"rank {r}: module state dict does not round-trip"
        assert not any(k.startswith("module.") for k in out["module_keys"]), out["module_keys"]
        assert out["residual_norm"] > 0, f"rank {r}: gtopk residuals are all zero: nothing to round-trip"
        assert out["snapshot_kept"], f"rank {r}: algorithm.state_dict() aliases live residuals"
        assert out["loaded_step"] == 4
        assert out["residuals_loaded"] and out["momenta_loaded"], f"rank {r}: residuals/momenta not restored"
        assert out["resumed_equal"], f"rank {r}: resuming from state dicts diverges from uninterrupted training"
        assert out["without_state_differs"], f"rank {r}: dropping the residuals changed nothing (vacuous check)"


def _r_ddp_in_type(rank, P):
    from torch.nn.parallel import DistributedDataParallel as DDP
    net = _mlp()
    opt = _sgd(net, lr=0.1)
    model = bagua_lite.DistributedModel(net, opt, "gtopk")
    out = {"isinstance": isinstance(model, DDP), "static_graph": getattr(model, "static_graph", None),
           "broadcast_buffers": model.broadcast_buffers, "refused": {}}
    calls = {"reducer": lambda: model.reducer,
             "require_forward_param_sync": lambda: model.require_forward_param_sync,
             "register_comm_hook": lambda: model.register_comm_hook(None, lambda s, b: None),
             "join": lambda: model.join(), "scatter": lambda: model.scatter((), {}, [0])}
    for name, call in calls.items():
        try:
            call()
            out["refused"][name] = "not refused"
        except NotImplementedError as e:
            out["refused"][name] = str(e)
    # DDP's flag that scripts set (nanoGPT): no_sync()'s meaning (tests/test_loop_shapes.py: bit for bit)
    flags = [model.require_backward_grad_sync]
    with model.no_sync():
        flags.append(model.require_backward_grad_sync)
    model.require_backward_grad_sync = False
    flags.append(model.require_backward_grad_sync)
    model.require_backward_grad_sync = True
    flags.append(model.require_backward_grad_sync)
    try:
        model.require_backward_grad_sync = "yes"
    except TypeError as e:
        flags.append(str(e))
    out["grad_sync_flag"] = flags
    before = _flat(net).clone()
    model.train(False)  # nn.Module's train, not DDP's: the flag reaches the inner module
    out["eval_reaches_inner"] = not net.training
    model.train()
    _step(model, opt, *_batch(rank, 0))  # still trains after the refusals
    out["trained"] = not torch.equal(before, _flat(net))
    model.close()
    return out


def test_distributed_model_is_a_ddp_in_type_only(clusters):
    for o in clusters.get(2).run(_r_ddp_in_type, timeout=60):
        assert o["isinstance"] and o["static_graph"] is False and o["broadcast_buffers"] is True
        for name, msg in o["refused"].items():
            assert "in type only" in msg and name.split()[-1] in msg, (name, msg)
        assert "no_sync" in o["refused"]["require_forward_param_sync"]
        flags = o["grad_sync_flag"]
        assert flags[:4] == [True, False, False, True] and "True or False, got 'yes'" in flags[4], flags
        assert o["eval_reaches_inner"] and o["trained"]


RANDOMK_YAML = """
algorithm:
  name: randomk_test
  density: 0.25
  error_feedback: {ef}
bucket_size_mb: 0.005
"""


def _r_user_algorithm(rank, P):
    out = {}
    for ef in ("true", "false"):
        cfg = bagua_lite.parse_config(RANDOMK_YAML.format(ef=ef))
        assert type(cfg.algorithm) is RandomKTest and cfg.algorithm.error_feedback == (ef == "true")
        net = _mlp()
        opt = _sgd(net, lr=0.1)
        model = bagua_lite.DistributedModel(net, opt, cfg.algorithm, bucket_size_mb=cfg.bucket_size_mb)
        losses, hashes = [], []
        fixed = [_batch(rank, s % 4, n=32) for s in range(4)]  # a small per-rank training set, revisited
        for s in range(40):
            losses.append(_step(model, opt, *fixed[s % 4]))
            hashes.append(_sha(_flat(net)))
        out[ef] = {"losses": losses, "hashes": hashes, "residual_norm": sum(float(r.norm()) for r in
                                                                           model.algorithm.residuals)}
        model.close()
    return out


@pytest.mark.parametrize("P", WORLD, ids=lambda p: f"P{p}")
def test_user_defined_algorithm_from_yaml(clusters, P):
    assert "randomk_test" in bagua_lite.algorithms.registered()
    res = clusters.get(P).run(_r_user_algorithm, timeout=60)
    for ef in ("true", "false"):
        for s in range(40):
            assert len({r[ef]["hashes"][s] for r in res}) == 1, f"randomk (ef={ef}): replicas differ at step {s}"
        for r, out in enumerate(res):
            first, last = sum(out[ef]["losses"][:4]) / 4, sum(out[ef]["losses"][-4:]) / 4
            # without error feedback 3/4 of every gradient is dropped: slower, but it must still learn
            bound = 0.7 if ef == "true" else 0.9
            assert last < bound * first, f"rank {r}, randomk (ef={ef}): loss {first:.3f} -> {last:.3f}"
        norms = [out[ef]["residual_norm"] for out in res]
        assert all(n > 0 for n in norms) if ef == "true" else all(n == 0 for n in norms)


def _r_mismatched(rank, P, which):
    opts = {"density": 0.01}
    bucket = 1.0
    if rank == P - 1:
        if which in ("option", "direct_instance"):
            opts["density"] = 0.02
        else:
            bucket = 2.0
    net = _mlp()
    try:
        alg = GTopK(**opts) if which == "direct_instance" else build("gtopk", **opts)
        bagua_lite.DistributedModel(net, _sgd(net), alg, bucket_size_mb=bucket)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("P", WORLD, ids=lambda p: f"P{p}")
@pytest.mark.parametrize("which", ["option", "bucket_size_mb", "direct_instance"])
def test_mismatched_configs_fail_on_every_rank(clusters, P, which):
    msgs = clusters.get(P).run(_r_mismatched, which, timeout=60)
    for r, msg in enumerate(msgs):
        assert msg is not None, f"rank {r}: DistributedModel accepted a configuration that differs on rank {P - 1}"
        assert re.search(rf"rank\(s\) \[{P - 1}\] differ", msg), f"rank {r}: {msg}"


# ---------------------------------------------------------------------------------------------------------
# convergence on real data


def _training_configs():
    from bagua_lite.demo import digits_configs

    return digits_configs(ROOT)


def _r_digits(rank, P, paths, epochs):
    from bagua_lite.demo import train_digits

    return {os.path.basename(p): train_digits(bagua_lite.load_config(p), epochs=epochs) for p in paths}


def test_digits_convergence_every_config(clusters):
    """4 ranks, the demo's recipe (same lr, epochs, momentum and lr schedule for every algorithm).

    A config whose algorithm is ``auto`` picks its relaxation from timings taken at run time (loopback on
    a loaded 2-core machine: the pick varies run to run), so it is held to a sanity floor only; the
    algorithms it can pick are each held to the bound through their own configs.
    """
    paths = _training_configs()
    names = [os.path.basename(p) for p in paths]
    assert "gradient_allreduce.yaml" in names and "gtopk.yaml" in names, names
    res = clusters.get(4).run(_r_digits, paths, 20, timeout=240)
    acc = {name: res[0][name]["accuracy"] for name in names}
    print("held-out accuracy:", {k: round(v, 4) for k, v in acc.items()})
    base = acc["gradient_allreduce.yaml"]
    assert base > 0.95, f"dense SGD itself reaches only {base}"
    gtopk = bagua_lite.load_config(os.path.join(ROOT, "examples", "digits", "gtopk.yaml")).algorithm
    assert gtopk.density == 0.01, "the 1-point bound below is stated for gtopk at density 0.01"
    for path in paths:
        name, a = os.path.basename(path), acc[os.path.basename(path)]
        if bagua_lite.load_config(path).algorithm.name == "auto":
            assert a > 0.8, f"{name}: held-out accuracy {a:.4f}"
            continue
        bound = 0.01 if name == "gtopk.yaml" else 0.02
        assert a >= base - bound, f"{name}: held-out accuracy {a:.4f} vs gradient_allreduce {base:.4f} (all {acc})"


ODD_P_CONFIGS = ("gradient_allreduce.yaml", "decentralized.yaml", "low_precision_decentralized.yaml",
                 "local_sgd_uint8.yaml", "async_model_average.yaml", "powersgd.yaml", "qadam.yaml")


def test_digits_convergence_of_the_relaxations_at_odd_p(clusters):
    """P = 3 (odd: shift_one sits a rank out, rings are odd, trees unbalanced): the relaxations of the
    whole space, each within 2 points of dense SGD with the demo's recipe, as at P = 4."""
    recipes = {os.path.basename(p): p for p in _training_configs()}
    paths = [recipes[name] for name in ODD_P_CONFIGS]
    res = clusters.get(3).run(_r_digits, paths, 20, timeout=240)
    acc = {name: res[0][name]["accuracy"] for name in ODD_P_CONFIGS}
    print("held-out accuracy at P = 3:", {k: round(v, 4) for k, v in acc.items()})
    base = acc["gradient_allreduce.yaml"]
    assert base > 0.95, f"dense SGD itself reaches only {base}"
    for name, a in acc.items():
        assert a >= base - 0.02, f"{name}: held-out accuracy {a:.4f} at P = 3 vs gradient_allreduce {base:.4f}"


# ---------------------------------------------------------------------------------------------------------
# bad input, single process


def _raises(exc, pattern, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert re.search(pattern, str(info.value)), f"message {str(info.value)!r} does not match {pattern!r}"
    return str(info.value)


def test_which_algorithms_check_the_step_before_their_buckets():
    """The extra step-count collective ahead of bucket 0 runs only where message sizes or collectives
    depend on the step (a warm-up, a density schedule); a user's algorithm is assumed to depend on it."""
    expect = {
        ("gradient_allreduce", ()): False, ("topk", ()): False, ("gtopk", ()): False, ("powersgd", ()): False,
        ("gtopk", (("warmup_densities", (0.5,)), ("warmup_steps_per_stage", 2))): True,
        ("powersgd", (("warmup_steps", 2),)): True, ("qadam", (("warmup_steps", 2),)): True,
        ("local_sgd", (("warmup_steps", 2),)): True, ("local_sgd", ()): False,
        ("randomk_test", ()): True,
    }
    for (name, options), want in expect.items():
        assert build(name, **dict(options)).step_dependent_wire is want, (name, options)


def test_unknown_algorithm_lists_known_ones():
    msg = _raises(ValueError, r"unknown algorithm 'gtop_k'", bagua_lite.parse_config, "algorithm: gtop_k\n")
    for known in ("decentralized", "gradient_allreduce", "gtopk", "local_sgd", "topk", "randomk_test"):
        assert known in msg, msg
    # a config's dict where the name goes: named as it is, not an unhashable-type TypeError
    _raises(ValueError, r"unknown algorithm \{'name': 'gtopk'\}; known algorithms: .*gtopk", build, {"name": "gtopk"})


@pytest.mark.parametrize("text, pattern", [
    ("algorithm: gtopk\nbucket_size: 4\n", r"unknown key 'bucket_size'.*did you mean 'bucket_size_mb'"),
    ("algorithms: gtopk\n", r"unknown key 'algorithms'.*did you mean 'algorithm'"),
    ("algorithm:\n  name: gtopk\n  densty: 0.01\n", r"unknown option 'densty'.*did you mean 'density'"),
    ("algorithm:\n  name: local_sgd\n  periode: 4\n", r"unknown option 'periode'.*did you mean 'period'"),
    ("algorithm:\n  name: decentralized\n  peer_selction: ring\n",
     r"unknown option 'peer_selction'.*did you mean 'peer_selection'"),
    ("algorithm:\n  name: gradient_allreduce\n  compresion: fp16\n",
     r"unknown option 'compresion'.*did you mean 'compression'"),
])
def test_misspelled_keys_suggest_nearest(text, pattern):
    _raises(ValueError, pattern, bagua_lite.parse_config, text)


@pytest.mark.parametrize("text, exc, pattern", [
    ("algorithm:\n  name: gtopk\n  density: 0\n", ValueError, r"density must be in \(0, 1\], got 0"),
    ("algorithm:\n  name: gtopk\n  density: 1.5\n", ValueError, r"density must be in \(0, 1\], got 1.5"),
    ("algorithm:\n  name: topk\n  density: -0.1\n", ValueError, r"density must be in \(0, 1\]"),
    ("algorithm:\n  name: gtopk\n  density: 0.01\n  warmup_densities: [0.5, 2.0]\n", ValueError,
     r"every warmup_densities entry must be in \(0, 1\], got 2.0"),
    ("algorithm:\n  name: gtopk\n  warmup_steps_per_stage: -1\n", ValueError, r"warmup_steps_per_stage must be an int >= 0"),
    ("algorithm:\n  name: topk\n  momentum_correction: 1.0\n", ValueError,
     r"momentum_correction must be 'optimizer' .* or a number in \[0, 1\), got 1.0"),
    ("algorithm:\n  name: topk\n  momentum_correction: adam\n", ValueError, r"momentum_correction .* got 'adam'"),
    ("algorithm:\n  name: gtopk\n  layerwise: 1\n", TypeError, r"option 'layerwise' must be of type bool"),
    ("algorithm:\n  name: local_sgd\n  period: -2\n", ValueError, r"period must be >= 1, got -2"),
    ("algorithm:\n  name: local_sgd\n  period: 0\n", ValueError, r"period must be >= 1, got 0"),
    ("algorithm:\n  name: local_sgd\n  warmup_steps: -1\n", ValueError, r"warmup_steps must be >= 0"),
    ("algorithm:\n  name: decentralized\n  communication_interval: 0\n", ValueError,
     r"communication_interval must be an int >= 1"),
    ("algorithm:\n  name: decentralized\n  peer_selection: star\n", ValueError, r"peer_selection='star'.*ring"),
    ("algorithm:\n  name: gradient_allreduce\n  compression: int4\n", ValueError,
     r"gradient_allreduce: unknown compression 'int4'; choose one of 'none', .*'fp16'"),
    ("algorithm:\n  name: local_sgd\n  compression: int4\n", ValueError, r"local_sgd: unknown compression 'int4'"),
    ("algorithm:\n  name: decentralized\n  compression: int8\n", ValueError, r"decentralized: unknown compression 'int8'"),
    ("algorithm:\n  name: decentralized\n  peer_selection: shift_one\n  compression: fp16\n", ValueError,
     r"compression='fp16' needs fixed neighbours.*not 'shift_one'"),
    ("algorithm:\n  name: decentralized\n  consensus_step: 0\n", ValueError, r"consensus_step.*must be in \(0, 1\], got 0"),
    ("algorithm:\n  name: low_precision_decentralized\n  compression: none\n", ValueError,
     r"low_precision_decentralized: compression must be a compressor, not 'none'"),
    ("algorithm: gtopk\nbucket_size_mb: 0\n", ValueError, r"bucket_size_mb must be > 0"),
    ("algorithm: gtopk\nbucket_size_mb: 2000000\n", ValueError, r"bucket_size_mb must be > 0 and <= 1048576"),
    ("algorithm: gtopk\nbucket_size_mb: -1.5\n", ValueError, r"bucket_size_mb must be > 0"),
    ("algorithm: gtopk\nbucket_size_mb: .nan\n", ValueError, r"bucket_size_mb must be > 0 and <= .*finite.*got nan"),
    ("algorithm: gtopk\nbucket_size_mb: .inf\n", ValueError, r"bucket_size_mb must be > 0 and <= .*got inf"),
    ("algorithm:\n  name: local_sgd\n  period: 100000000000000000000\n", ValueError,
     r"option 'period' = 100000000000000000000 is absurdly large"),
    ("algorithm:\n  name: gtopk\n  density: .nan\n", ValueError, r"option 'density' must be finite, got nan"),
    ("algorithm:\n  name: gtopk\n  warmup_densities: [0.5, .inf]\n", ValueError,
     r"option 'warmup_densities' must be finite, got inf"),
    ("algorithm: gtopk\nalgorithm: topk\n", ValueError, r"key 'algorithm' is given twice \(line 2\)"),
    ("algorithm:\n  name: gtopk\n  density: 0.1\n  density: 0.2\n", ValueError, r"key 'density' is given twice"),
    # wrong types
    ("algorithm: gtopk\nbucket_size_mb: big\n", TypeError, r"bucket_size_mb must be a number.*str"),
    ("algorithm: gtopk\nbucket_size_mb: true\n", TypeError, r"bucket_size_mb must be a number.*bool"),
    ("algorithm:\n  name: gtopk\n  density: high\n", TypeError, r"'density' must be of type float.*str"),
    ("algorithm:\n  name: gtopk\n  exact: 1\n", TypeError, r"'exact' must be of type bool.*int"),
    ("algorithm:\n  name: gtopk\n  warmup_densities: 0.5\n", TypeError, r"'warmup_densities' must be of type"),
    ("algorithm:\n  name: local_sgd\n  period: 2.5\n", TypeError, r"'period' must be of type int.*float"),
    ("algorithm:\n  name: local_sgd\n  period: '4'\n", TypeError, r"'period' must be of type int.*str"),
    ("algorithm:\n  name: gradient_allreduce\n  hierarchical: 'yes'\n", TypeError, r"'hierarchical' must be of type bool"),
    ("algorithm:\n  name: gradient_allreduce\n  compression: 8\n", TypeError, r"'compression' must be of type str"),
    ("algorithm:\n  name: decentralized\n  communication_interval: true\n", TypeError,
     r"'communication_interval' must be of type int.*bool"),
    ("algorithm: 5\n", ValueError, r"'algorithm' must be a name or a mapping"),
    ("algorithm:\n  density: 0.1\n", ValueError, r"'algorithm' must be a name or a mapping with a 'name' key"),
    ("bucket_size_mb: 1\n", ValueError, r"missing required key 'algorithm'"),
    ("- gtopk\n", ValueError, r"expected a mapping at the top level"),
])
def test_bad_values_name_the_key(text, exc, pattern):
    _raises(exc, pattern, bagua_lite.parse_config, text)


def test_distributed_model_validates_before_any_traffic():
    net = _mlp()
    opt = _sgd(net)
    for bad in (0, -1, "25", True, float("nan"), float("inf")):
        _raises(ValueError, r"bucket_size_mb must be a finite number > 0", bagua_lite.DistributedModel, net, opt,
                "gradient_allreduce", bucket_size_mb=bad)
    _raises(ValueError, r"unknown algorithm 'nope'.*gtopk", bagua_lite.DistributedModel, net, opt, "nope")
    _raises(TypeError, r"optimizer must be a torch.optim.Optimizer", bagua_lite.DistributedModel, net, "sgd")
    _raises(TypeError, r"algorithm must be a bagua_lite.Algorithm, a registered name or a YAML config path",
            bagua_lite.DistributedModel, net, opt, 42)
    _raises(ValueError, r"unknown algorithm 'gtopk.yml'.*or a YAML config: no file 'gtopk.yml' here",
            bagua_lite.DistributedModel, net, opt, "gtopk.yml")
    if not dist.is_initialized():  # (this test process never joins a group; the ranks live in cluster.py)
        _raises(RuntimeError, r"torch.distributed is not initialized", bagua_lite.DistributedModel, net, opt)


def _r_algorithm_from_config(rank, P, path):
    """``algorithm=`` a YAML path (its bucket size too, unless given) or a shipped config's name trains bit
    for bit as the algorithm the config builds, with the config's bucket size."""
    out = {}
    cfg = bagua_lite.load_config(path)
    for label, spec, kw in (("path", path, {}), ("built", cfg.algorithm, {"bucket_size_mb": cfg.bucket_size_mb}),
                            ("path_own_bucket", path, {"bucket_size_mb": 0.5}), ("shipped", "bytegrad", {}),
                            ("shipped_built", bagua_lite.load_config("bytegrad").algorithm,
                             {"bucket_size_mb": bagua_lite.load_config("bytegrad").bucket_size_mb})):
        net = _mlp()
        opt = _sgd(net, lr=0.1)
        model = bagua_lite.DistributedModel(net, opt, spec, **kw)
        for s in range(3):
            _step(model, opt, *_batch(rank, s))
        out[label] = (_flat(net), repr(model.algorithm), model.bucket_size_mb)
        model.close()
    return out


def test_algorithm_may_be_a_config(clusters, tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("algorithm:\n  name: gtopk\n  density: 0.2\n  warmup_densities: []\nbucket_size_mb: 0.004\n")
    for o in clusters.get(2).run(_r_algorithm_from_config, str(path), timeout=60):
        assert torch.equal(o["path"][0], o["built"][0]) and o["path"][1:] == o["built"][1:], (o["path"], o["built"])
        assert o["path"][2] == 0.004 and o["path_own_bucket"][2] == 0.5 and "density=0.2" in o["path"][1]
        assert torch.equal(o["shipped"][0], o["shipped_built"][0]) and "minmax_uint8" in o["shipped"][1]


def test_load_config_of_every_shipped_config_and_missing_file(tmp_path):
    for p in _training_configs():
        cfg = bagua_lite.load_config(p)
        assert isinstance(cfg.algorithm, bagua_lite.Algorithm) and cfg.bucket_size_mb > 0
    _raises(FileNotFoundError, r"no such file", bagua_lite.load_config, str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm:\n  name: topk\n  dens1ty: 0.1\n")
    _raises(ValueError, r"unknown option 'dens1ty'.*did you mean 'density'", bagua_lite.load_config, str(bad))


def test_yaml_exponent_floats_are_floats():
    # YAML 1.1 reads 1e-3 as a string; our loader reads it as the float users mean.
    cfg = bagua_lite.parse_config("algorithm:\n  name: gtopk\n  density: 1e-3\nbucket_size_mb: 2.5e1\n")
    assert cfg.algorithm.density == 0.001 and cfg.bucket_size_mb == 25.0


class Skippable(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(D_IN, CLASSES)

    def forward(self, x, skip):
        return x[:, :CLASSES] * 2.0 if skip else self.lin(x)


def _r_rank_without_gradients(rank, P):
    """On rank 1 the output depends on the input only: none of its parameters gets a gradient. It must
    still run every bucket (with zeros), so rank 0's collectives complete instead of hanging."""
    net = Skippable()
    opt = _sgd(net, momentum=0.0)
    model = bagua_lite.DistributedModel(net, opt, algorithm="gradient_allreduce", bucket_size_mb=0.001)
    x, y = _batch(rank, 0)
    x.requires_grad_(True)
    torch.nn.functional.cross_entropy(model(x, skip=(rank == 1)), y).backward()
    grads = [p.grad.clone() for p in net.parameters()]
    # the reference: rank 0's own gradient, averaged with rank 1's zeros
    ref = Skippable()
    x0, y0 = _batch(0, 0)
    torch.nn.functional.cross_entropy(ref(x0, skip=False), y0).backward()
    model.close()
    return [float((g - r.grad / P).abs().max()) for g, r in zip(grads, ref.parameters())]


def test_rank_whose_parameters_get_no_gradient_does_not_hang(clusters):
    res = clusters.get(2).run(_r_rank_without_gradients, timeout=60)
    for rank_diffs in res:
        assert max(rank_diffs) < 1e-6, res


# ---------------------------------------------------------------------------------------------------------
# local: bucket planning, periodic algorithms' cycle, allocator tuning


def test_plan_buckets_small_leftovers_join_the_next_parameter():
    from bagua_lite.bucket import plan_buckets
    sizes = lambda plan: [[p.numel() for p in b] for b in plan]  # noqa: E731
    P = lambda n: torch.nn.Parameter(torch.zeros(n))  # noqa: E731
    cap = 1000 * 4  # bytes: 1000 floats
    # a bias (10) between two oversized weights travels with the next weight, not alone
    ps = [P(2000), P(10), P(2000), P(10), P(2000)]
    assert sizes(plan_buckets(ps, cap)) == [[2000], [10, 2000], [10, 2000]]
    # a bucket past a quarter of the cap closes as before when the next one would not fit
    ps = [P(300), P(800), P(100), P(100)]
    assert sizes(plan_buckets(ps, cap)) == [[300], [800, 100, 100]]
    ps = [P(200), P(800), P(500)]
    assert sizes(plan_buckets(ps, cap)) == [[200, 800], [500]]
    # dtype changes always split
    ps = [P(10), torch.nn.Parameter(torch.zeros(10, dtype=torch.float64))]
    assert sizes(plan_buckets(ps, cap)) == [[10], [10]]


def test_cycle_of_periodic_algorithms():
    from bagua_lite.algorithms import build
    assert build("gradient_allreduce").cycle == 1 and build("gtopk").cycle == 1
    assert build("decentralized", communication_interval=3).cycle == 3
    a = build("local_sgd", period=4, warmup_steps=2)
    assert a.cycle == 1  # dense warm-up steps
    a.step = 2
    assert a.cycle == 4


_ALLOC_PROBE = """
import resource, torch, bagua_lite
print(bagua_lite.tune_cpu_allocator(), bagua_lite.tune_cpu_allocator())
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a training step's pattern: gradient-sized blocks (above glibc's 32 MiB) made and freed
    a, b = torch.empty(16 << 20), torch.empty(16 << 20)
    a.fill_(1.0); b.fill_(2.0)
    del a, b
    c = torch.empty(9 << 20)
    c.fill_(3.0)
    del c
step(); step()
before = faults()
for _ in range(4):
    step()
print((faults() - before) / (4 * (164 << 20) // 4096))  # share of the touched pages that were fresh
"""


@pytest.mark.parametrize("enabled", [True, False])
def test_tune_cpu_allocator_reuses_large_blocks(enabled):
    import subprocess
    import sys
    env = dict(os.environ, BAGUA_LITE_TUNE_MALLOC="1" if enabled else "0")
    out = subprocess.run([sys.executable, "-c", _ALLOC_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    flags, fresh = out.stdout.split("\n")[:2]
    fresh = float(fresh)
    if enabled:
        # glibc still hands back some blocks (0.2-0.6 measured), never all of them
        assert flags == "True True"
        assert fresh < 0.75, f"freed blocks were not reused: {fresh:.0%} of the pages were fresh"
    else:
        assert flags == "False False"
        assert fresh > 0.9, f"expected fresh pages every step without tuning, got {fresh:.0%}"


def _r_decentralized_dead_peer(rank, P, victim, name):
    net = _mlp()
    opt = _sgd(net, lr=0.05, momentum=0.0)
    model = bagua_lite.DistributedModel(net, opt, build(name), bucket_size_mb=0.01)
    for s in range(3):
        _step(model, opt, *_batch(rank, s))
    if rank == victim:
        os._exit(1)
    t0 = time.monotonic()
    try:
        for s in range(3, 10_000):
            _step(model, opt, *_batch(rank, s))
    except RuntimeError as e:
        return ("raised", time.monotonic() - t0, str(e))
    return ("returned", time.monotonic() - t0, "")


@pytest.mark.parametrize("name", ["decentralized", "low_precision_decentralized"])
def test_decentralized_dead_peer_raises(name):
    """A peer dies between exchanges: the survivors' training thread raises (the compressed exchange's
    background thread hands its error over) within the process group's timeout, never hangs: the
    algorithm's own groups take the user's timeout, not torch's 30-minute default."""
    P, victim, pg_timeout = 3, 1, 5
    c = Cluster(P, timeout_s=pg_timeout)
    try:
        with pytest.raises(RemoteError) as info:
            c.run(_r_decentralized_dead_peer, victim, name, timeout=90, grace=pg_timeout + 20)
        err = info.value
        assert err.dead == [victim], str(err)
        survivors = {r: v for r, (ok, v) in err.partial.items() if ok}
        assert sorted(survivors) == [0, 2], str(err)
        for r, (what, elapsed, msg) in survivors.items():
            assert what == "raised", (r, what, elapsed, msg)
            if name == "low_precision_decentralized":
                assert "weight exchange failed on rank" in msg, (r, msg)
            # what ended the wait: the dead peer's connection, or the user's timeout (gloo names it in ms)
            assert "by peer" in msg or f"Timed out waiting {pg_timeout * 1000}ms" in msg, (r, msg)
            print(f"{name}: rank {r} raised {elapsed:.2f} s after rank {victim} died (group timeout {pg_timeout} s)")
    finally:
        c.close()


class _WithEmpty(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.empty = torch.nn.Parameter(torch.empty(0))  # registered first: its gradient is ready last
        self.net = _mlp()

    def forward(self, x):
        return self.net(x) + self.empty.sum()


def _r_empty_bucket(rank, P, name):
    torch.manual_seed(0)
    net = _WithEmpty()
    opt = _sgd(net)
    model = bagua_lite.DistributedModel(net, opt, build(name, density=0.1), bucket_size_mb=0.001)
    assert any(b.numel == 0 for b in model.buckets), model.buckets
    for s in range(4):
        _step(model, opt, *_batch(rank, s))
    model.close()
    return _sha(_flat(net))


@pytest.mark.parametrize("name", ["topk", "gtopk"])
def test_sparse_algorithms_skip_an_empty_bucket(clusters, name):
    """A zero-size parameter alone in a bucket: nothing to select, no k = 1 of 0 elements (it raised)."""
    hashes = clusters.get(3).run(_r_empty_bucket, name, timeout=60)
    assert len(set(hashes)) == 1, "replicas differ"


def _r_layout_mismatch(rank, P, which):
    net = _mlp()
    if rank == P - 1:
        if which == "shape":
            net[2] = torch.nn.Linear(HIDDEN, HIDDEN + 1)
            net[4] = torch.nn.Linear(HIDDEN + 1, CLASSES)
        elif which == "frozen":
            net[0].bias.requires_grad_(False)
        else:  # dtype
            net[4].double()
    try:
        bagua_lite.DistributedModel(net, _sgd(net), "gradient_allreduce")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("which, pattern", [
    ("shape", r"parameter #2: rank 0 has '2.weight' shape \[64, 64\] torch.float32 requires_grad=True, "
              r"rank {r} has '2.weight' shape \[65, 64\]"),
    ("frozen", r"parameter #1: rank 0 has '0.bias' .*requires_grad=True, rank {r} has '0.bias' .*requires_grad=False"),
    ("dtype", r"parameter #4: rank 0 has '4.weight' shape \[8, 64\] torch.float32 .*rank {r} has .*torch.float64"),
])
@pytest.mark.parametrize("P", (2, 3))
def test_model_layout_mismatch_raises_on_every_rank(clusters, P, which, pattern):
    """As DDP: a model that differs across ranks is refused at wrap time, on every rank, naming the first
    differing parameter (before, the broadcast of parameters aborted one process with SIGABRT)."""
    for r, msg in enumerate(clusters.get(P).run(_r_layout_mismatch, which, timeout=60)):
        assert msg is not None, f"rank {r} accepted a model that differs on rank {P - 1}"
        assert re.search(rf"rank\(s\) \[{P - 1}\] differ", msg) and re.search(pattern.format(r=P - 1), msg), msg


class _BN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.bn, self.out = torch.nn.Linear(D_IN, HIDDEN), torch.nn.BatchNorm1d(HIDDEN), torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


def _r_broadcast_buffers(rank, P, name, broadcast):
    net = _BN()
    opt = _sgd(net)
    model = bagua_lite.DistributedModel(net, opt, name, broadcast_buffers=broadcast)
    errs = []
    for s in range(4):
        x, y = _batch(rank, s)
        start = {k: v.clone() for k, v in net.state_dict().items()}
        owner = [None] * P
        dist.all_gather_object(owner, start)
        ref = _BN()  # rank 0's buffers and this rank's parameters, this rank's batch: what DDP computes
        buffers = dict(net.named_buffers())
        ref.load_state_dict({**start, **{k: v for k, v in owner[0].items() if k in buffers}})
        ref(x)
        _step(model, opt, x, y)
        errs.append(max(float((net.bn.running_mean - ref.bn.running_mean).abs().max()),
                        float((net.bn.running_var - ref.bn.running_var).abs().max())))
    mine = torch.cat([net.bn.running_mean, net.bn.running_var])
    everyone = [torch.zeros_like(mine) for _ in range(P)]
    dist.all_gather(everyone, mine)
    model.close()
    return max(errs), float((torch.stack(everyone) - mine).abs().max())


@pytest.mark.parametrize("name", ["gradient_allreduce", "gtopk", "local_sgd"])
def test_broadcast_buffers_like_ddp(clusters, name):
    """Every training forward starts from rank 0's buffers (BatchNorm statistics), as DDP's default; with
    broadcast_buffers=False each rank keeps its own."""
    P = 3
    for r, (err, spread) in enumerate(clusters.get(P).run(_r_broadcast_buffers, name, True, timeout=60)):
        assert err < 1e-6, f"rank {r}: buffers are not rank 0's updated by this rank's batch ({err})"
    spreads = [spread for _, spread in clusters.get(P).run(_r_broadcast_buffers, name, False, timeout=60)]
    assert max(spreads) > 1e-3, "without broadcast_buffers the ranks' statistics should differ"


def _r_out_of_step(rank, P):
    net = _mlp()
    opt = _sgd(net)
    model = bagua_lite.DistributedModel(net, opt, build("local_sgd", period=3), bucket_size_mb=0.01)
    try:
        for s in range(7):
            _step(model, opt, *_batch(rank, s))
            if rank == P - 1 and s == 1:  # its step count jumps ahead (a resume from another step's checkpoint)
                model.algorithm.step += 1
    except RuntimeError as e:
        return str(e)
    finally:
        model.close()
    return None


@pytest.mark.parametrize("P", (2, 3))
def test_local_sgd_ranks_out_of_step_raise_on_every_rank(clusters, P):
    """local_sgd averages when a rank's own step count says so; counts that disagree (one rank resumed from
    another step) used to pair averages of different steps silently. Now every rank raises."""
    for r, msg in enumerate(clusters.get(P).run(_r_out_of_step, timeout=60)):
        # rank P-1 reached step 6 and waits in its average; the others reached step 3 and wait in theirs
        counts = ", ".join(f"rank {q}: {6 if q == P - 1 else 3}" for q in range(P))
        assert msg is not None and "out of step" in msg and counts in msg, (r, msg)


def _r_decentralized_out_of_step(rank, P, name, options):
    net = _mlp()
    opt = _sgd(net)
    model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.01)
    try:
        for s in range(6):
            _step(model, opt, *_batch(rank, s))
            if rank == P - 1 and s == 1:
                opt.step()  # an extra step (a second optimizer.step() in a branch only this rank takes)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        model.close()
    return None


@pytest.mark.parametrize("P, name, options", [
    (4, "decentralized", {"peer_selection": "ring"}),  # rank 1 is no neighbour of rank 3: learns by fail fast
    (4, "decentralized", {"peer_selection": "shift_one"}),
    (3, "decentralized", {"peer_selection": "all"}),
    (4, "low_precision_decentralized", {}),
], ids=["ring_P4", "shift_one_P4", "all_P3", "low_precision_P4"])
def test_decentralized_ranks_out_of_step_raise_on_every_rank(P, name, options):
    """Each weight exchange carries the step count it started at: a rank that took an extra step is
    caught at its next exchange by its peers and itself, and the other ranks learn it by fail fast."""
    c = Cluster(P)  # its own group: ranks that stop on an error may leave exchanges in flight
    try:
        res = c.run(_r_decentralized_out_of_step, name, options, timeout=90)
    finally:
        c.close()
    for r, msg in enumerate(res):
        assert msg is not None and "ranks are out of step" in msg, (r, msg)
    # the third step's exchange starts at step 2 on every rank but the last, which took an extra one
    assert any(f"is at step 2, rank {P - 1} at step 3" in m or "from 2 to 3" in m for m in res), res


def _r_autograd_grad(rank, P, name):
    net = _mlp()
    opt = _sgd(net)
    model = bagua_lite.DistributedModel(net, opt, build(name), bucket_size_mb=0.01)
    untouched = True
    for s in range(4):
        x, y = _batch(rank, s)
        if rank == 0:  # a gradient penalty / saliency map on one rank only, before the real step
            xr = x.clone().requires_grad_(True)
            (gx,) = torch.autograd.grad(model(xr).pow(2).sum(), xr)
            (gw,) = torch.autograd.grad(model(xr).sum(), next(net.parameters()))  # w.r.t. a parameter too
            untouched &= all(p.grad is None for p in net.parameters()) and gx.abs().sum() > 0
        _step(model, opt, x, y)
    model.close()
    return untouched, _sha(_flat(net))


@pytest.mark.parametrize("name", ["gradient_allreduce", "gtopk"])
def test_autograd_grad_on_one_rank_starts_no_round(clusters, name):
    """As DDP: torch.autograd.grad (w.r.t. inputs or parameters) communicates nothing and leaves .grad
    alone; it used to start a full round on that rank only, and the replicas diverged."""
    res = clusters.get(3).run(_r_autograd_grad, name, timeout=60)
    assert all(untouched for untouched, _ in res), res
    assert len({sha for _, sha in res}) == 1, "replicas differ"


def _r_topk_verifies(rank, P):
    """The k and dtype headers of topk's exchange are checked (a host read on a GPU) at each bucket's first
    exchange and when the density schedule changes its k, not at the repeats in between."""
    from bagua_lite import comm
    real, calls = comm.sparse_allgather, []

    def recorded(values, indices, group=None, k=None, out=None, verify=True):
        calls.append((k, verify))
        return real(values, indices, group=group, k=k, out=out, verify=verify)

    comm.sparse_allgather = recorded
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        model = bagua_lite.DistributedModel(net, opt, build("topk", density=0.05, warmup_densities=[0.5],
                                                            warmup_steps_per_stage=2), bucket_size_mb=0.004)
        per_step = []
        for s in range(5):
            del calls[:]
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank * 100 + s))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            per_step.append(list(calls))
        buckets = len(model.buckets)
        model.close()
        return buckets, per_step
    finally:
        comm.sparse_allgather = real


@pytest.mark.parametrize("P", [2, 3], ids=lambda p: f"P{p}")
def test_topk_verifies_each_exchange_once_per_k(clusters, P):
    for buckets, per_step in clusters.get(P).run(_r_topk_verifies):
        assert buckets >= 2 and all(len(c) == buckets for c in per_step), per_step
        verified = [[v for _, v in c] for c in per_step]
        # steps 0, 1 at density 0.5; from step 2 at 0.05: every bucket's k changes, so it is checked again
        assert verified == [[True] * buckets, [False] * buckets, [True] * buckets, [False] * buckets,
                            [False] * buckets], per_step
        assert all(per_step[2][b][0] < per_step[1][b][0] for b in range(buckets)), per_step
