"""gTop-k's rounds as fixed-size tensor ops (comm.gtopk_allreduce(canonical=True): what a GPU runs, with no host
copy) train bit for bit as the host's merge: BAGUA_LITE_TENSOR_ROUNDS=1 makes the CPU take them. gtopk with
momentum correction, layer-wise, P = 2, 3 and 5 (5 folds an extra rank in and hands it the result), with the
checks left on the device as a GPU leaves them and a non-finite gradient on one rank under a fused SGD.
"""
import os

import pytest
import torch
import torch.nn.functional as F

import bagua_lite
from bagua_lite.algorithms import build

STEPS, BAD_STEP = 6, 3
# densities under 1/32, where the indices travel as a list (a bitmap would be smaller above: the host's path)
CASES = {"gtopk": {"density": 0.02}, "layerwise": {"density": 0.02, "layerwise": True},
         "no_correction": {"density": 0.01, "momentum_correction": 0}}


def _train(rank, P, options, tensor_rounds, fused):
    from bagua_lite import comm
    calls, call = [], comm.gtopk_allreduce

    def counted(*args, **kwargs):
        calls.append(kwargs.get("canonical", False))
        return call(*args, **kwargs)
    comm.gtopk_allreduce = counted
    os.environ["BAGUA_LITE_DEFER_CHECKS"] = "1"
    if tensor_rounds:
        os.environ["BAGUA_LITE_TENSOR_ROUNDS"] = "1"
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(12, 48), torch.nn.ReLU(), torch.nn.Linear(48, 48), torch.nn.ReLU(),
                                  torch.nn.Linear(48, 5))
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, fused=fused)
        model = bagua_lite.DistributedModel(net, opt, build("gtopk", **options), bucket_size_mb=0.004)
        lists = [(b.numel + 7) // 8 >= 4 * model.algorithm.k_for(b) for b in model.buckets]
        assert len(lists) >= 2 and all(lists), lists
        weights, errors, s = [], [], 0
        while s < STEPS:
            g = torch.Generator().manual_seed(rank * 7919 + s * 31 + 5)
            x = torch.randn(16, 12, generator=g)
            try:
                loss = F.cross_entropy(model(x), (x[:, :5] * 3).argmax(1))
            except FloatingPointError as e:  # a step skipped on the device, reported a step late
                errors.append(("forward", s, str(e)[:60]))
                continue
            if fused and s == BAD_STEP and rank == P - 1:
                loss = loss * float("inf")
            loss.backward()
            try:
                opt.step()
            except FloatingPointError as e:
                errors.append(("step", s, str(e)[:60]))
            opt.zero_grad()
            weights.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone())
            s += 1
        state = model.algorithm_state_dict()
        model.close()
        return weights, state, errors, calls
    finally:
        comm.gtopk_allreduce = call
        os.environ.pop("BAGUA_LITE_DEFER_CHECKS", None)
        os.environ.pop("BAGUA_LITE_TENSOR_ROUNDS", None)


def _r_both(rank, P, fused):
    return {label: (_train(rank, P, options, False, fused), _train(rank, P, options, True, fused))
            for label, options in CASES.items()}


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_sgd_bad_step"])
@pytest.mark.parametrize("P", (2, 3, 5), ids=lambda p: f"P{p}")
def test_gtopk_tensor_rounds_train_as_the_host_merge(clusters, P, fused):
    res = clusters.get(P).run(_r_both, fused, timeout=240)
    for label in CASES:
        for r in range(P):
            (w_host, st_host, err_host, calls_host), (w_t, st_t, err_t, calls_t) = res[r][label]
            # the host's merge where not asked; the tensor rounds, for every bucket of every round, where asked
            assert calls_host and not any(calls_host), (label, r)
            assert calls_t and all(calls_t) and len(calls_t) == len(calls_host), (label, r, calls_t)
            assert err_t == err_host, (label, r, err_t, err_host)
            for s in range(STEPS):
                assert torch.equal(w_t[s], w_host[s]), (label, r, s)
                assert torch.equal(w_t[s], res[0][label][1][0][s]), f"{label}: replicas differ after step {s}"
            for a, b in zip(st_t["residuals"], st_host["residuals"]):
                assert torch.equal(a, b), (label, r)
            if fused:  # the bad step moved nothing, and was reported at the next forward
                assert torch.equal(w_t[BAD_STEP], w_t[BAD_STEP - 1]), (label, r)
                assert [e[:2] for e in err_t] == [("forward", BAD_STEP + 1)], err_t
            assert not torch.equal(w_t[-1], w_t[0]), f"{label}: rank {r} did not train"


def _r_steady(rank, P):
    """test_allocations' watch over gtopk's steady steps with the tensor rounds (the indices as a list)."""
    import algo_matrix
    from test_allocations import _r_steady_allocations
    os.environ["BAGUA_LITE_TENSOR_ROUNDS"] = "1"
    try:
        algo_matrix.ALGORITHMS["gtopk_tensor_rounds"] = ("gtopk", {"density": 0.02})
        return _r_steady_allocations(rank, P, ("gtopk_tensor_rounds",))
    finally:
        os.environ.pop("BAGUA_LITE_TENSOR_ROUNDS", None)


@pytest.mark.parametrize("P", (2, 3), ids=lambda p: f"P{p}")
def test_the_rounds_allocate_nothing_proportional_to_the_model(clusters, P):
    """The merge's temporaries (2k entries and their positions) come from a scratch arena kept across calls:
    a steady step allocates no more than the plain loop's (gloo's own buffers aside), as for every algorithm
    in test_allocations (P = 3 folds a rank in and hands it the result)."""
    from test_allocations import MIN_BYTES, _frames, _ours
    problems = []
    for rank, res in enumerate(clusters.get(P).run(_r_steady, timeout=300)):
        for i, (step, plain_step) in enumerate(zip(res["gtopk_tensor_rounds"], res["plain"])):
            problems += [f"rank {rank}, watched step {i}: {size} bytes at\n      {_frames(where)}"
                         for size, where in _ours(step, plain_step)]
    assert not problems, f"{len(problems)} allocation(s) of >= {MIN_BYTES} bytes:\n" + "\n".join(problems[:6])
