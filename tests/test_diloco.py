"""diloco: H inner steps, then an outer optimizer on the averaged pseudo-gradient (theta - mean x), on real
gloo groups, against a reference written with plain torch and one allreduce per piece of the flat change
(``sync_chunks`` nearly equal contiguous pieces: on 3 or more ranks gloo's ring rounds each element's sum by
where it falls in the buffer reduced, so the reference cuts the same pieces); local_sgd as its outer SGD
at lr 1; checkpoints that resume the anchor and the outer momentum bit for bit."""
import os
import re

import pytest
import torch
import torch.nn.functional as F

import bagua_lite
from bagua_lite.algorithms import build

H = 3
CHUNKS = build("diloco").sync_chunks  # the default


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))


def _batch(rank, s):
    g = torch.Generator().manual_seed(rank * 1009 + s)
    x = torch.randn(16, 10, generator=g)
    return x, x[:, :4].argmax(1)


def _inner(net):
    return torch.optim.AdamW(net.parameters(), lr=3e-3)


def _flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _average_in_pieces(flat, chunks):
    """``flat`` averaged over the ranks as the sync does: ``chunks`` contiguous pieces (``n % chunks`` of them
    one element longer, first), each its own allreduce."""
    n = flat.numel()
    k = min(chunks, n)
    bounds = [i * (n // k) + min(i, n % k) for i in range(k + 1)]
    for a, b in zip(bounds, bounds[1:]):
        bagua_lite.comm.allreduce(flat[a:b], "avg")
    return flat


def _set_weights(net, flat):
    with torch.no_grad():
        o = 0
        for p in net.parameters():
            p.copy_(flat[o:o + p.numel()].view_as(p))
            o += p.numel()


def _inner_loop(rank, steps, sync):
    """Plain torch: AdamW inner steps on this rank's batches, ``sync(net)`` after every H of them."""
    net = _net()
    opt = _inner(net)
    for s in range(steps):
        x, y = _batch(rank, s)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        if (s + 1) % H == 0:
            sync(net)
    return net


def _reference(rank, steps, outer, chunks=CHUNKS):
    """Plain torch: AdamW inner steps; every H steps the pseudo-gradient theta - mean x (the flat change
    averaged in ``chunks`` pieces, as the algorithm's) and the outer optimizer's step on theta; every
    replica <- theta."""
    theta = _flat(_net()).clone()
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[outer["name"]]
    outer_opt = cls([theta], **{k: v for k, v in outer.items() if k != "name"})

    def sync(net):
        theta.grad = _average_in_pieces(_flat(net) - theta, chunks).neg_()
        outer_opt.step()
        _set_weights(net, theta)
    return _flat(_inner_loop(rank, steps, sync)), outer_opt.state_dict()["state"]


def _reference_local_sgd(rank, steps, chunks):
    """Plain torch: AdamW inner steps; every H steps every replica <- the mean of the flat weights (averaged
    in ``chunks`` pieces)."""
    return _flat(_inner_loop(rank, steps, lambda net: _set_weights(net, _average_in_pieces(_flat(net), chunks))))


def _train(rank, name, options, steps, ckpt=None, resume_at=None):
    net = _net()
    opt = _inner(net)
    model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.001)
    start = 0
    if ckpt is not None and resume_at is not None:
        for s in range(resume_at):
            x, y = _batch(rank, s)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        bagua_lite.save_checkpoint(ckpt, model, opt, step=resume_at)
        model.close()
        net = _net()
        opt = _inner(net)
        model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.001)
        start = bagua_lite.load_checkpoint(ckpt, model, opt)["step"]
    for s in range(start, steps):
        x, y = _batch(rank, s)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    state = model.algorithm.state_dict()
    model.close()
    return _flat(net), state


def _r_against_reference(rank, P, outer, ckpt):
    steps = 4 * H + 1
    ref, ref_outer = _reference(rank, steps, outer)
    mine, state = _train(rank, "diloco", {"period": H, "outer_optimizer": outer}, steps)
    resumed, state2 = _train(rank, "diloco", {"period": H, "outer_optimizer": outer}, steps, ckpt, resume_at=H + 2)
    outer_same = all(torch.equal(a, b) for k in ref_outer for a, b in
                     zip(ref_outer[k].values(), state["fragments"][0]["outer"]["state"][k].values()) if isinstance(a, torch.Tensor))
    return {"same": torch.equal(ref, mine), "outer_same": outer_same and bool(ref_outer),
            "resumed": torch.equal(mine, resumed), "moved": float((mine - _flat(_net())).abs().max())}


@pytest.mark.parametrize("P", (1, 2, 3, 5), ids=lambda p: f"P{p}")
def test_diloco_is_the_reference_and_resumes_bit_for_bit(clusters, P, tmp_path):
    for outer in ({"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}, {"name": "adam", "lr": 0.01}):
        for r, o in enumerate(clusters.get(P).run(_r_against_reference, outer, str(tmp_path / outer["name"]),
                                                   timeout=120)):
            assert o["same"] and o["outer_same"], (P, outer, r, o)
            assert o["resumed"], (P, outer, r, "the resumed run differs")
            assert o["moved"] > 0, (P, outer, r)


def _r_local_sgd_is_outer_sgd_lr1(rank, P):
    steps = 3 * H
    a, _ = _train(rank, "local_sgd", {"period": H}, steps)
    # the same outer step taken through the pseudo-gradient (momentum 0 given as a number keeps it off the
    # plain-average path): theta - (theta - mean x), equal to mean x up to rounding
    b, _ = _train(rank, "diloco", {"period": H, "outer_optimizer": {"name": "sgd", "lr": 1.0, "dampening": 0.5}}, steps)
    c, _ = _train(rank, "diloco", {"period": H, "outer_optimizer": {"name": "SGD", "lr": 1}}, steps)
    return float((a - b).abs().max()), torch.equal(a, c)


@pytest.mark.parametrize("P", (2, 3), ids=lambda p: f"P{p}")
def test_local_sgd_is_diloco_with_outer_sgd_at_lr_one(clusters, P):
    for r, (diff, same) in enumerate(clusters.get(P).run(_r_local_sgd_is_outer_sgd_lr1, timeout=120)):
        assert diff < 1e-6 and same, (r, diff, same)


def _r_compressed(rank, P):
    steps = 2 + 2 * H  # the warm-up, then two syncs: the last step ends in one
    mine, state = _train(rank, "diloco", {"period": H, "compression": "minmax_uint8", "warmup_steps": 2}, steps)
    everyone = [torch.empty_like(mine) for _ in range(P)]
    torch.distributed.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], t) for t in everyone), float(sum(r.abs().sum() for r in
                                                                       state["fragments"][0]["averager"]["residuals"]))


def test_diloco_compressed_pseudo_gradient_keeps_replicas_identical(clusters):
    for r, (identical, residual) in enumerate(clusters.get(3).run(_r_compressed, timeout=120)):
        assert identical and residual > 0, (r, identical, residual)  # error feedback kept what uint8 lost


def _frozen(s):
    """Steps at which the last layer is frozen: from inside the second period (steps 3-5) to the end of the
    third, so its replicas differ at the sync after step 5, and two whole periods follow frozen."""
    return 4 <= s < 12


def _r_frozen(rank, P, options):
    """The last layer frozen after some outer steps (so it has outer momentum) and unfrozen later; returns the
    flat weights after every step, through diloco and through plain torch: AdamW inner steps, every H steps
    an outer optimizer over one tensor per parameter, given the negated mean change as .grad where the
    parameter requires grad, and for a frozen one no .grad (torch leaves it and its state alone) and the
    mean change added as is."""
    steps = 6 * H

    def loop(net, opt, call, sync=None):
        history = []
        for s in range(steps):
            net[2].requires_grad_(not _frozen(s))
            x, y = _batch(rank, s)
            F.cross_entropy(call(x), y).backward()
            opt.step()
            opt.zero_grad()
            if sync is not None and (s + 1) % H == 0:
                sync()
            history.append(_flat(net))
        return history

    net = _net()
    opt = _inner(net)
    model = bagua_lite.DistributedModel(net, opt, build("diloco", period=H, **options), bucket_size_mb=0.001)
    mine = loop(net, opt, model)
    model.close()
    outer = options.get("outer_optimizer", {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True})
    if options.get("fragments", 1) > 1:
        return mine, None
    net = _net()
    opt = _inner(net)
    params = list(net.parameters())
    thetas = [p.detach().clone() for p in params]
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[outer["name"]]
    outer_opt = cls(thetas, **{k: v for k, v in outer.items() if k != "name"})

    def sync():
        change, o = _average_in_pieces(_flat(net) - torch.cat([t.reshape(-1) for t in thetas]), CHUNKS), 0
        for p, t in zip(params, thetas):
            c = change[o:o + p.numel()].view_as(p)
            o += p.numel()
            if p.requires_grad:
                t.grad = c.neg()
            else:
                t.grad = None
                t.add_(c)
        outer_opt.step()
        with torch.no_grad():
            for p, t in zip(params, thetas):
                p.copy_(t)
    return mine, loop(net, opt, net, sync)


@pytest.mark.parametrize("P", (2, 3), ids=lambda p: f"P{p}")
def test_a_parameter_frozen_mid_training_is_not_moved_by_the_outer_momentum(clusters, P):
    """A parameter frozen after wrapping is left alone by the inner optimizer (its .grad is None), and by the
    outer one: at a sync it takes the replicas' mean change as is, its outer momentum kept for when it is
    unfrozen. Bit for bit a plain-torch DiLoCo whose outer optimizer holds one tensor per parameter; a frozen
    layer moves only at the first sync after freezing (its replicas differed), and not at the next two. Without
    the rule the outer momentum went on moving it (0.0083, then 0.017, in a reproduction at P = 2). Compressed,
    it also takes at the next syncs what its error feedback still owed it from before, alike on every replica."""
    n = sum(p.numel() for p in _net().parameters())
    last = slice(n - 24 * 4 - 4, n)
    for options in ({}, {"outer_optimizer": {"name": "adam", "lr": 0.01}},
                    {"fragments": 2, "overlap": 1}, {"compression": "absmax4"}):
        res = clusters.get(P).run(_r_frozen, options, timeout=120)
        # synced at the ends of steps 5, 8, 11, 14, 17; streaming: the last layer's fragment (offset 1, overlap
        # 1) merges at the ends of steps 4, 7, 10, 13, 16, and the sync it merges at step 4 left before freezing
        first = 4 if "fragments" in options else 5
        for r, (mine, ref) in enumerate(res):
            where = (P, options, r)
            assert not torch.equal(mine[first][last], mine[first - 1][last]), where  # replicas averaged
            if "compression" in options:  # what error feedback still owes it arrives at syncs: nothing between
                assert all(torch.equal(mine[s][last], mine[s - 1][last]) for s in (6, 7, 9, 10)), where
                assert all(torch.equal(mine[s][last], res[0][0][s][last]) for s in range(first, 12)), where
            else:
                assert all(torch.equal(mine[s][last], res[0][0][first][last]) for s in range(first, 12)), where
            assert not torch.equal(mine[-1][last], mine[11][last]), where  # it trains again
            if "fragments" not in options:
                assert torch.equal(mine[-1], res[0][0][-1]), where  # replicas identical after the last sync
            if ref is not None and "compression" not in options:
                same = [torch.equal(a, b) for a, b in zip(mine, ref)]
                if options:  # Adam's step count is one per flat anchor here, per parameter there
                    assert all(same[:12]), (where, same)
                else:
                    assert all(same), (where, same)


def _r_chunked(rank, P, chunks):
    steps = 3 * H + 1
    outer = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}
    ref, _ = _reference(rank, steps, outer, chunks)
    net = _net()
    opt = _inner(net)
    model = bagua_lite.DistributedModel(net, opt, build("diloco", period=H, outer_optimizer=outer, sync_chunks=chunks),
                                        bucket_size_mb=0.001)
    frag = model.algorithm.averager
    made = [(id(p), p.data_ptr()) for pieces in frag.pieces for p in pieces]
    for s in range(steps):
        x, y = _batch(rank, s)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    views = all(p.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() and p._base is not None
                for w, pieces in zip(frag.work, frag.pieces) for p in pieces)
    sizes = [[p.numel() for p in pieces] for pieces in frag.pieces]
    kept = made == [(id(p), p.data_ptr()) for pieces in frag.pieces for p in pieces]  # made once, not per sync
    model.close()
    local, _ = _train(rank, "local_sgd", {"period": H, "sync_chunks": chunks}, steps)
    local_ref = _reference_local_sgd(rank, steps, chunks)
    return {"diloco": torch.equal(ref, _flat(net)), "local_sgd": torch.equal(local_ref, local),
            "views": views, "kept": kept, "sizes": sizes}


@pytest.mark.parametrize("P", (3, 5), ids=lambda p: f"P{p}")
def test_sync_in_chunks_is_the_reference_in_the_same_pieces_bit_for_bit(clusters, P):
    """diloco (its anchored change) and local_sgd (the weights themselves), each flat buffer cut into k pieces
    posted at once, against plain torch averaging the same pieces one after another; k = 1 is one allreduce
    of the whole buffer, the behaviour before the option. The pieces are views of the work buffer made once."""
    n = sum(p.numel() for p in _net().parameters())  # 364
    for chunks in sorted({1, 2, 7, CHUNKS}):
        for r, o in enumerate(clusters.get(P).run(_r_chunked, chunks, timeout=120)):
            assert o["diloco"] and o["local_sgd"], (P, chunks, r, o)
            assert o["views"] and o["kept"], (P, chunks, r, o)
            assert o["sizes"] == [[n // chunks + (i < n % chunks) for i in range(chunks)]], (P, chunks, o["sizes"])


def test_split_even_cuts_nearly_equal_contiguous_views():
    t = torch.arange(10.0)
    for chunks, sizes in ((1, [10]), (3, [4, 3, 3]), (4, [3, 3, 2, 2]), (10, [1] * 10), (25, [1] * 10)):
        pieces = bagua_lite.comm.split_even(t, chunks)
        assert [p.numel() for p in pieces] == sizes, chunks
        assert torch.equal(torch.cat(pieces), t) and all(p.data_ptr() >= t.data_ptr() for p in pieces)
    pieces[3].fill_(-1)
    assert t[3] == -1  # views: nothing copied


@pytest.mark.parametrize("name", ("diloco", "local_sgd"))
def test_bad_sync_chunks_are_named_before_any_traffic(name):
    """No process group here: the check runs in the constructor, before any collective."""
    cls = type(build(name))
    for bad in (0, -1, 1.5, "x", True, None):
        got = re.escape(repr(bad))
        with pytest.raises(ValueError, match=rf"^{name}: sync_chunks must be an int >= 1 \(.*\), got {got}$"):
            cls(sync_chunks=bad)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"^{name}: sync_chunks must be an int >= 1 .*, got {bad}$"):
            build(name, sync_chunks=bad)
    for bad in (1.5, "x", True):  # through build() (and configs), its option type check speaks first
        got = re.escape(repr(bad))
        with pytest.raises(TypeError, match=rf"option 'sync_chunks' must be of type int .*, got \w+ {got}$"):
            build(name, sync_chunks=bad)
    with pytest.raises(ValueError, match=rf"{name}: sync_chunks must be an int >= 1 .*, got 0"):
        bagua_lite.parse_config(f"algorithm:\n  name: {name}\n  sync_chunks: 0\n")
    assert build(name, sync_chunks=1).sync_chunks == 1


def test_bad_outer_optimizer_is_named_before_any_traffic():
    with pytest.raises(ValueError, match="outer_optimizer name 'nesterov_sgd' is not a torch.optim optimizer"):
        build("diloco", outer_optimizer={"name": "nesterov_sgd"})
    with pytest.raises(ValueError, match="lrr"):
        build("diloco", outer_optimizer={"name": "sgd", "lr": 0.7, "lrr": 1})
    with pytest.raises(ValueError, match="period must be >= 1, got 0"):
        build("diloco", period=0)
    cfg = bagua_lite.parse_config("algorithm:\n  name: diloco\n  period: 50\n  outer_optimizer: {name: sgd, lr: 0.5, "
                                  "momentum: 0.9, nesterov: true}\n")
    assert cfg.algorithm.period == 50 and cfg.algorithm.outer_spec["lr"] == 0.5
    assert os.path.basename(__file__)  # (module is importable by the workers)
