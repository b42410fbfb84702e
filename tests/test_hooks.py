"""bagua_lite.hooks under torch DDP on real gloo groups: each hook's output against a reference computed from
every rank's gradient, replicas bit-identical, DDP + hook trains bit for bit as DistributedModel with the
matching algorithm, non-finite rounds, checkpoints (pickling), and errors before any collective."""
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import bagua_lite
from bagua_lite import hooks
from bagua_lite.algorithms import build


@bagua_lite.register_compressor("hooks_test_f32")
class Float32Bytes(bagua_lite.Compressor):
    """Lossless (the float32 bytes), in Python, declaring error feedback: the generic path, exactly checkable."""
    error_feedback = True

    def wire_bytes(self, n):
        return 4 * n

    def compress(self, x, out):
        out.view(torch.float32).copy_(x.reshape(-1))

    def decompress(self, wire, out, accumulate=False):
        v = wire.view(torch.float32).view_as(out)
        out.add_(v) if accumulate else out.copy_(v)


N = 997  # one parameter of N entries: its gradient is exactly what the test feeds in


class Vector(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(N))

    def forward(self, x):
        return (self.w * x).sum()  # d/dw = x


def _grad(rank, step):
    return torch.randn(N, generator=torch.Generator().manual_seed(1000 * step + rank))


def _state(kind, arg):
    return hooks.SparseState(density=arg) if kind in ("topk", "gtopk") else hooks.CompressedState(compression=arg)


HOOK = {"topk": hooks.topk_hook, "gtopk": hooks.gtopk_hook, "compressed": hooks.compressed_hook}


def _r_one_bucket(rank, P, cases, steps):
    """Per case: every rank's gradients and the hook's outputs over ``steps`` steps, and the final residual."""
    out = {}
    for kind, arg in cases:
        state = _state(kind, arg)
        model = DDP(Vector())
        model.register_comm_hook(state, HOOK[kind])
        grads, results = [], []
        for step in range(steps):
            g = _grad(rank, step)
            model(g).backward()
            grads.append(g)
            results.append(model.module.w.grad.clone())
            model.module.w.grad = None
        residual = state.residuals.get(0)
        out[(kind, arg)] = (grads, results, None if residual is None else residual.clone())
    return out


def _topk_set(x, k):
    """{index: value} of the k largest |x| (ties: lower index), numpy float32."""
    order = np.argsort(-np.abs(x), kind="stable")[:k]
    return {int(i): x[i] for i in order}


def _merge(a, b, k):
    s = dict(a)
    for i, v in b.items():
        s[i] = np.float32(s[i] + v) if i in s else v
    keep = sorted(s, key=lambda i: (-abs(s[i]), i))[:k]
    return {i: s[i] for i in keep}


def _gtopk_reference(sets, k):
    """The recursive doubling of bagua_lite.comm.gtopk_allreduce, simulated: fold, swap rounds, unfold."""
    P = len(sets)
    core = 1
    while core * 2 <= P:
        core *= 2
    S = [dict(s) for s in sets]
    for r in range(P - core):
        S[r] = _merge(S[r], S[r + core], k)
    d = 1
    while d < core:
        S[:core] = [_merge(S[r], S[r ^ d], k) for r in range(core)]
        d *= 2
    return S[0]


def _reference(kind, arg, grads, P):
    """(outputs per step, final residual per rank) computed from every rank's gradients, in numpy."""
    steps = len(grads[0])
    residual = [np.zeros(N, np.float32) for _ in range(P)]
    outs = []
    for step in range(steps):
        accs = [residual[r] + grads[r][step].numpy() for r in range(P)]
        avg = np.zeros(N, np.float32)
        if kind in ("topk", "gtopk"):
            k = bagua_lite.kernels.topk_count(N, arg)
            sets = [_topk_set(a, k) for a in accs]
            if kind == "topk":
                for r in range(P):
                    for i, v in sets[r].items():
                        avg[i] += np.float32(v / np.float32(P))
                sent = [set(s) for s in sets]
            else:
                g = _gtopk_reference(sets, k)
                for i, v in g.items():
                    avg[i] = np.float32(v / np.float32(P))
                sent = [set(g) & set(s) for s in sets]
            for r in range(P):
                residual[r] = accs[r].copy()
                residual[r][sorted(sent[r])] = 0
        else:  # a lossless compressor: chunk sums in rank order, then / P
            for r in range(P):
                avg += grads[r][step].numpy()
            avg /= np.float32(P)
        outs.append(avg)
    return outs, residual


@pytest.mark.parametrize("P", [2, 3, 4])
def test_each_hook_matches_a_reference_from_all_ranks(clusters, P):
    """Two steps of one bucket (the second with the first's residual): topk, gtopk and a lossless Python
    compressor with error feedback bit for bit; fp16 and minmax_uint8 within their rounding."""
    cases = [("topk", 0.01), ("gtopk", 0.02), ("compressed", "hooks_test_f32"), ("compressed", "fp16"),
             ("compressed", "minmax_uint8")]
    res = clusters.get(P).run(_r_one_bucket, cases, 2)
    for case in cases:
        kind, arg = case
        grads = [res[r][case][0] for r in range(P)]
        outs = [res[r][case][1] for r in range(P)]
        for r in range(1, P):
            assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[r])), f"{case}: ranks differ"
        if kind == "compressed" and arg != "hooks_test_f32":
            exact = [sum(g[s] for g in grads) / P for s in range(2)]
            for s in range(2):
                if arg == "fp16":
                    assert torch.allclose(outs[0][s], exact[s], rtol=2e-3, atol=1e-3), case
                else:  # two uint8 quantizations over ranges < 2 * 4.5 sigma: at most ~2 steps of 9/255
                    err = (outs[0][s] - exact[s]).abs().max().item()
                    assert 0 < err < 2 * 9 / 255, (case, err)
            continue
        want, residual = _reference(kind, arg, grads, P)
        for s in range(2):
            got = outs[0][s].numpy()
            assert np.array_equal(got, want[s]), f"{case} step {s}: {np.abs(got - want[s]).max()}"
            if kind != "compressed":
                k = bagua_lite.kernels.topk_count(N, arg)
                assert k <= np.count_nonzero(got) <= (P * k if kind == "topk" else k), case
        for r in range(P):
            mine = res[r][case][2]
            assert mine is not None and np.array_equal(mine.numpy(), residual[r]), f"{case}: rank {r} residual"


# ---- training parity: DDP + hook vs DistributedModel + algorithm -------------------------------------------------

class MLP(torch.nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        torch.manual_seed(0)
        if layers == 1:  # softmax regression: one parameter, so DDP's first-step bucket layout is ours too
            self.body = torch.nn.Linear(12, 5, bias=False)
        else:
            self.body = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 40),
                                            torch.nn.ReLU(), torch.nn.Linear(40, 5))

    def forward(self, x):
        return self.body(x)


def _batch(rank, step):
    g = torch.Generator().manual_seed(rank * 7919 + step * 31 + 5)
    x = torch.randn(16, 12, generator=g)
    return x, (x[:, :5] * 3).argmax(1)


# (hook kind, its argument, the algorithm and options it matches, optimizer momentum, layers). DDP lays its
# first step's bucket out in registration order, then rebuilds it in the order gradients became ready, which
# is DistributedModel's order (reverse registration) for this MLP. The sparse hooks' results do not depend on
# the layout (a top-k by magnitude, sums in rank order), so they match from step 0 on the 3-layer MLP. A
# compressor's chunks and quantization ranges do, so its bit-for-bit parity is checked on a one-parameter
# model, and on the MLP only the replicas' identity and a tolerance (the first step differs by the layout).
PARITY = [
    ("topk", 0.05, ("topk", {"density": 0.05, "momentum_correction": 0}), 0.9, 3),
    ("gtopk", 0.05, ("gtopk", {"density": 0.05, "momentum_correction": 0}), 0.9, 3),
    ("gtopk", 0.3, ("gtopk", {"density": 0.3, "momentum_correction": 0}), 0.0, 3),
    ("compressed", "minmax_uint8", ("gradient_allreduce", {"compression": "minmax_uint8"}), 0.9, 1),
    ("compressed", "sign", ("gradient_allreduce", {"compression": "sign"}), 0.0, 1),
    ("compressed", "fp16", ("gradient_allreduce", {"compression": "fp16"}), 0.9, 1),
    ("compressed", "hooks_test_f32", ("gradient_allreduce", {"compression": "hooks_test_f32"}), 0.0, 1),
    ("compressed", "minmax_uint8", ("gradient_allreduce", {"compression": "minmax_uint8"}), 0.9, 3),
    ("compressed", "sign", ("gradient_allreduce", {"compression": "sign"}), 0.0, 3),
]
STEPS = 20


def _train(rank, use_ddp, case):
    kind, arg, (name, options), momentum, layers = case
    net = MLP(layers)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=momentum)
    if use_ddp:
        model = DDP(net)  # ~2.5k parameters: one bucket (DDP's first bucket holds up to 1 MiB)
        state = _state(kind, arg)
        model.register_comm_hook(state, HOOK[kind])
    else:
        model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=25)
    losses = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    if use_ddp:
        buckets = len(state._memory)
    else:
        buckets = len(model.buckets)
        model.close()
    return weights, losses, buckets


def _r_parity(rank, P, cases):
    return [(_train(rank, True, c), _train(rank, False, c)) for c in cases]


@pytest.mark.parametrize("P", [2, 3, 4])
def test_ddp_with_hook_trains_as_distributed_model(clusters, P):
    """20 steps: replicas bit-identical under DDP + each hook, and the weights bit for bit those of
    DistributedModel with the matching algorithm (one bucket on each side; see PARITY for the exception)."""
    res = clusters.get(P).run(_r_parity, PARITY, timeout=120)
    for c, case in enumerate(PARITY):
        (w_ddp, losses, nb_ddp), (w_ours, _, nb_ours) = res[0][c]
        assert nb_ddp == 1 and nb_ours == 1, (case, nb_ddp, nb_ours)
        for r in range(1, P):
            assert torch.equal(res[r][c][0][0], w_ddp), f"{case[:2]}: DDP replicas differ (rank {r})"
            assert torch.equal(res[r][c][1][0], w_ours), f"{case[:2]}: bagua_lite replicas differ (rank {r})"
        diff = (w_ddp - w_ours).abs().max().item()
        if case[0] == "compressed" and case[4] > 1:  # another layout on the first step (see PARITY)
            assert diff < 0.05, f"{case[:2]}, P={P}, MLP: max diff {diff}"
        else:
            assert torch.equal(w_ddp, w_ours), f"{case[:2]}, P={P}: max diff {diff}"
        assert sum(losses[-4:]) < sum(losses[:4]), f"{case[:2]}: does not learn {losses}"
        assert not torch.equal(w_ddp, torch.cat([p.detach().reshape(-1) for p in MLP(case[4]).parameters()]))


# ---- non-finite rounds, checkpoints --------------------------------------------------------------------------------

def _r_nonfinite(rank, P, cases):
    out = {}
    for kind, arg in cases:
        state = _state(kind, arg)
        model = DDP(Vector())
        model.register_comm_hook(state, HOOK[kind])
        model(_grad(rank, 0)).backward()
        before = {i: r.clone() for i, r in state.residuals.items()}
        g = _grad(rank, 1)
        if rank == P - 1:
            g[3] = float("nan")
        model.module.w.grad = None
        model(g).backward()
        nan_grad = bool(torch.isnan(model.module.w.grad).all())
        kept = all(torch.equal(before[i], r) for i, r in state.residuals.items())
        model.module.w.grad = None
        model(_grad(rank, 2)).backward()  # and the next round is finite again
        out[(kind, arg)] = (nan_grad, kept, bool(torch.isfinite(model.module.w.grad).all()))
    return out


def test_a_non_finite_gradient_on_one_rank_is_seen_by_every_rank(clusters):
    """One rank's NaN: every rank's .grad is NaN (a GradScaler skips the step everywhere, as under DDP) and
    every residual stays as before the round."""
    cases = [("topk", 0.01), ("gtopk", 0.01), ("compressed", "sign"), ("compressed", "minmax_uint8")]
    res = clusters.get(3).run(_r_nonfinite, cases)
    for r, per in enumerate(res):
        for case, (nan_grad, kept, recovered) in per.items():
            assert nan_grad and kept and recovered, (r, case, nan_grad, kept, recovered)


def _r_resume(rank, P, kind, arg, layers):
    """Three steps (DDP rebuilt its bucket after the first), pickle the state; the next step with the original
    and with the unpickled copy on a fresh DDP of the same weights (whose first step has DDP's first layout)."""
    a = _state(kind, arg)
    m1 = DDP(MLP(layers))
    m1.register_comm_hook(a, HOOK[kind])
    for step in range(3):
        x, y = _batch(rank, step)
        F.cross_entropy(m1(x), y).backward()
        m1.module.zero_grad()
    b = pickle.loads(pickle.dumps(a))
    net = MLP(layers)
    net.load_state_dict(m1.module.state_dict())
    m2 = DDP(net)
    m2.register_comm_hook(b, HOOK[kind])
    grads = []
    for m in (m1, m2):
        x, y = _batch(rank, 3)
        F.cross_entropy(m(x), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.module.parameters()]))
    residuals = []  # per parameter, in the model's order (the two DDPs' bucket layouts differ)
    for s, m in ((a, m1), (b, m2)):
        slices = []
        for p in m.module.parameters():
            mem, at = s._where[id(p)]
            slices.append(mem.residual[at:at + p.numel()])
        residuals.append(torch.cat(slices))
    moved = sorted(b._restored) == []  # every saved residual was claimed
    return (torch.equal(*grads), torch.equal(*residuals), b.process_group is None, bool(a.residuals), moved,
            bool(residuals[0].abs().sum() > 0))


# the MLP for gtopk (its residuals must follow the parameters from DDP's rebuilt layout back to its first);
# one parameter for sign, whose chunks depend on the layout (see PARITY)
@pytest.mark.parametrize("kind, arg, layers", [("gtopk", 0.05, 3), ("compressed", "sign", 1)])
def test_state_pickles_without_its_group_and_resumes_bit_for_bit(clusters, kind, arg, layers):
    for got in clusters.get(2).run(_r_resume, kind, arg, layers):
        assert all(got), got


# ---- errors before any collective ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -0.1, 1.01, float("nan"), "0.1", True])
def test_bad_density_raises_at_construction(bad):
    # no process group exists in this process: the error comes before any collective could run
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"SparseState: density must be in \(0, 1\], got"):
        hooks.SparseState(density=bad)


def test_bad_compression_raises_at_construction_listing_the_allowed_names():
    with pytest.raises(ValueError, match=r"unknown compression 'int3'; choose one of .*'fp16'.*'hooks_test_f32'.*"
                                         r"'minmax_uint8'.*'sign'") as e:
        hooks.CompressedState(compression="int3")
    assert "'none'" not in str(e.value)
    with pytest.raises(ValueError, match="not 'none'"):
        hooks.CompressedState(compression="none")
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup"):
        hooks.SparseState(process_group="world")
    assert hooks.CompressedState(compression="hooks_test_f32").compressor.error_feedback


def test_hooks_are_reachable_from_a_plain_import():
    import importlib
    top = importlib.import_module("bagua_lite")
    assert top.hooks.gtopk_hook is hooks.gtopk_hook and top.hooks.SparseState is hooks.SparseState
    for h in (hooks.topk_hook, hooks.gtopk_hook, hooks.compressed_hook):
        assert "register_comm_hook(state, bagua_lite.hooks." in h.__doc__ and "travels" in h.__doc__


# ---- the benchmark's rows ---------------------------------------------------------------------------------------------

def _r_bench_rows(rank, P, cells):
    """Each hook row as the benchmark builds it (bench.cells.wrap), two steps: the hook ran and replicas agree."""
    from bagua_lite.bench.cells import wrap
    out = []
    for cell in cells:
        net = MLP()
        model, ours, opt, handle = wrap(cell, {"bucket_size_mb": 25, "lr": 0.05}, net)
        bagua_lite.comm.reset_traffic()
        for step in range(2):
            x, y = _batch(rank, step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        out.append((ours is None and handle is None and isinstance(model, DDP),
                    bagua_lite.comm.bytes_sent(), torch.cat([p.detach().reshape(-1) for p in net.parameters()])))
    return out


def test_benchmark_hook_rows_are_ddp_with_the_hook(clusters, tmp_path):
    from bagua_lite.bench.config import load_benchmark_config
    cfg = tmp_path / "b.yaml"
    cfg.write_text("world_sizes: [3]\nnetworks: [loopback]\nmodels: [mlp25m]\nalgorithms: [ddp, "
                   "{name: ddp_topk_hook, density: 0.01}, {name: ddp_gtopk_hook, density: 0.01}, "
                   "{name: ddp_compressed_hook, compression: sign}]\n")
    cells = load_benchmark_config(str(cfg))["algorithms"][1:]
    assert [c["label"] for c in cells] == ["ddp_topk_hook(density=0.01)", "ddp_gtopk_hook(density=0.01)",
                                           "ddp_compressed_hook(compression=sign)"]
    res = clusters.get(3).run(_r_bench_rows, cells)
    for i, cell in enumerate(cells):
        assert all(r[i][0] for r in res), cell
        assert all(r[i][1] > 0 for r in res), f"{cell['label']}: bagua_lite's counter saw no traffic"
        assert all(torch.equal(r[i][2], res[0][i][2]) for r in res), f"{cell['label']}: replicas differ"
    for bad, pattern in (("{name: ddp_gtopk_hook, density: 2}", r"SparseState: density must be in \(0, 1\]"),
                         ("{name: ddp_compressed_hook, compression: int3}", "unknown compression 'int3'"),
                         ("{name: ddp_topk_hook, rank: 4}", "ddp_topk_hook has no option 'rank'; allowed: density")):
        cfg.write_text(f"world_sizes: [2]\nnetworks: [loopback]\nmodels: [mlp25m]\nalgorithms: [ddp, {bad}]\n")
        with pytest.raises(ValueError, match=pattern):
            load_benchmark_config(str(cfg))
