"""Two models wrapped in one process and trained in one loop: a GAN's generator and discriminator.

The loop, as DCGAN's example writes it: the discriminator's step (``fake = G(z)``, D on real and on
``fake.detach()``), then the generator's (``D(fake)`` backward, which also gives the discriminator gradients
the loop throws away with the next ``optD.zero_grad()``). The plain loop forgets those gradients. So each
variant of the generator's step must train exactly as the one where the discriminator's backward runs
under ``no_sync()`` (no round at all), bit for bit, on every rank, with identical replicas:

- ``thrown_away``: DCGAN's loop as written: the discriminator's round in the generator's step runs, and is
  undone when the next round finds every ``.grad`` None (error feedback's residuals, PowerSGD's state);
- ``thrown_away_in_place``: the same with ``zero_grad(set_to_none=False)`` (the gradients zeroed in place);
- ``frozen``: the discriminator's parameters frozen for the generator's step (WGAN's loop);
- ``unwrapped``: the generator's step through ``D.module``, the model the wrapper holds;
- ``thrown_away_scaled``: DCGAN's loop under one GradScaler for both models (``scaler.step`` of each optimizer,
  one ``update()``), against the no_sync loop under the same scaler: the scaler's ``update()`` after the
  generator's step is no step of the discriminator's optimizer.

Where ``.grad`` holds an update (momentum correction, qadam after its warm-up), the discriminator's round
cannot be undone, and the round after it is refused (``thrown_away``, ``thrown_away_in_place``, ``unwrapped``),
naming the way out (no_sync, or frozen).

Before, the two models' engines posted their collectives on one group from two threads, in an order that
differed across ranks, and gloo aborted the process; now a model whose group another open model uses takes
a copy of it.
"""
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua_lite
from bagua_lite.algorithms import build

STEPS = 6  # a multiple of local SGD's and DiLoCo's period: their replicas end a period identical
ALGORITHMS = {
    "gradient_allreduce": ("gradient_allreduce", {}, "sgd"),
    "bytegrad": ("gradient_allreduce", {"compression": "minmax_uint8"}, "sgd"),
    "sign": ("gradient_allreduce", {"compression": "sign"}, "sgd"),
    "powersgd": ("powersgd", {"rank": 2, "min_compression_rate": 1.0}, "sgd"),
    "topk_no_correction": ("topk", {"density": 0.2, "momentum_correction": 0}, "sgd"),
    "gtopk_no_correction": ("gtopk", {"density": 0.2, "momentum_correction": 0}, "sgd"),
    "topk": ("topk", {"density": 0.2}, "sgd"),
    "qadam": ("qadam", {"warmup_steps": 2}, "adam"),
    "local_sgd": ("local_sgd", {"period": 2}, "sgd"),
    "diloco": ("diloco", {"period": 2}, "sgd"),
    "decentralized": ("decentralized", {}, "sgd"),
}
HOLDS_UPDATE = {"topk", "qadam"}  # .grad holds the update: the round after a thrown-away one is refused
VARIANTS = ("thrown_away", "thrown_away_in_place", "frozen", "unwrapped", "thrown_away_scaled")


def _nets():
    torch.manual_seed(0)
    G = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    D = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return G, D


def _batch(rank, step):
    """(z, real): the generator's noise and a real batch for this rank and step."""
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 8, generator=gen)


def _optimizer(kind, net):
    if kind == "adam":
        return torch.optim.Adam(net.parameters(), lr=1e-2)
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def _train(rank, label, variant):
    """STEPS GAN steps; returns (weights of G and D, None) or (None, (step, error, D unchanged by it)).
    ``*_scaled``: one GradScaler for both models, stepping both optimizers and updating once an iteration, as
    torch's AMP recipe for several optimizers does (a power-of-two scale that does not change: exact)."""
    name, options, kind = ALGORITHMS[label]
    G, D = _nets()
    opt_g, opt_d = _optimizer(kind, G), _optimizer(kind, D)
    scaled = variant.endswith("_scaled")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=10 ** 6) if scaled else None
    scale = scaler.scale if scaled else (lambda loss: loss)
    g = bagua_lite.DistributedModel(G, opt_g, build(name, **options), bucket_size_mb=0.0005, grad_scaler=scaler)
    d = bagua_lite.DistributedModel(D, opt_d, build(name, **options), bucket_size_mb=0.0005, grad_scaler=scaler)
    keep = variant == "thrown_away_in_place"
    try:
        for s in range(STEPS):
            z, real = _batch(rank, s)
            opt_d.zero_grad(set_to_none=not keep)
            before = [p.detach().clone() for p in D.parameters()]
            try:
                fake = g(z)
                scale(F.softplus(-d(real)).mean() + F.softplus(d(fake.detach())).mean()).backward()
            except RuntimeError as e:
                return None, (s, str(e), all(torch.equal(a, p) for a, p in zip(before, D.parameters())))
            scaler.step(opt_d) if scaled else opt_d.step()
            opt_g.zero_grad(set_to_none=not keep)
            if variant.startswith("no_sync"):
                with d.no_sync():
                    scale(F.softplus(-d(fake)).mean()).backward()
            elif variant == "frozen":
                D.requires_grad_(False)
                F.softplus(-d(fake)).mean().backward()
                D.requires_grad_(True)
            else:
                scale(F.softplus(-(D if variant == "unwrapped" else d)(fake)).mean()).backward()
            if scaled:
                scaler.step(opt_g)
                scaler.update()
            else:
                opt_g.step()
    finally:
        g.close()
        d.close()
    return [p.detach().clone() for p in list(G.parameters()) + list(D.parameters())], None


def _r_gan(rank, world, labels):
    out = {}
    for label in labels:
        out[label] = {v: _train(rank, label, v) for v in ("no_sync", "no_sync_scaled") + VARIANTS}
    return out


@pytest.mark.parametrize("P", (2, 3), ids=lambda p: f"P{p}")
@pytest.mark.parametrize("labels", [["gradient_allreduce", "bytegrad", "sign", "powersgd"],
                                    ["topk_no_correction", "gtopk_no_correction", "topk", "qadam"],
                                    ["local_sgd", "diloco", "decentralized"]],
                         ids=["dense_and_codecs", "sparse_and_momentum", "local"])
def test_a_gans_thrown_away_discriminator_round_leaves_no_trace(clusters, P, labels):
    results = clusters.get(P).run(_r_gan, labels)
    for label in labels:
        reference, refused = results[0][label]["no_sync"]
        assert refused is None and results[0][label]["no_sync_scaled"][1] is None, (label, refused)
        for r in range(1, P if label != "decentralized" else 1):  # identical replicas
            assert all(torch.equal(a, b) for a, b in zip(reference, results[r][label]["no_sync"][0])), (label, r)
        for variant in VARIANTS:
            for r in range(P):
                weights, refused = results[r][label][variant]
                if label in HOLDS_UPDATE and variant != "frozen":
                    assert weights is None, (label, variant, r)
                    step, msg, unchanged = refused
                    assert step == (2 if label == "qadam" else 1) and unchanged, (label, variant, refused)
                    assert "second synchronised backward" in msg and "no_sync()" in msg and "GAN" in msg, msg
                    continue
                assert refused is None, (label, variant, r, refused)
                # each rank's own reference (decentralized's replicas differ)
                mine = results[r][label]["no_sync_scaled" if variant.endswith("_scaled") else "no_sync"][0]
                assert all(torch.equal(a, b) for a, b in zip(weights, mine)), (label, variant, r)


def _r_groups(rank, world):
    group = dist.new_group(list(range(world)))  # no model of an earlier test holds it

    def wrap(**kw):
        net = torch.nn.Linear(3, 2)
        return bagua_lite.DistributedModel(net, torch.optim.SGD(net.parameters(), lr=0.1), group=group, **kw)
    a, b, c = wrap(), wrap(), wrap()
    copies = (a.process_group is group, b.process_group is not group, c.process_group not in (group, b.process_group),
              dist.get_process_group_ranks(c.process_group) == list(range(world)), c.rank == rank)
    try:
        wrap(fault_tolerant=True)
        refused = None
    except ValueError as e:
        refused = str(e)
    a.close()
    d = wrap()  # the group is free again (b and c have their copies)
    for m in (b, c, d):
        m.close()
    e = wrap()
    e.close()
    return copies, (d.process_group is group, e.process_group is group), refused


def test_a_model_whose_group_another_open_model_uses_takes_a_copy(clusters):
    for copies, own, refused in clusters.get(3).run(_r_groups):
        assert copies == (True,) * 5 and own == (True, True)
        assert refused is not None and "fault_tolerant=True" in refused and "no other open model" in refused, refused


SHARDED = {
    "gradient_allreduce": {"name": "gradient_allreduce"},
    "sign": {"name": "gradient_allreduce", "compression": "sign"},
    "gtopk": {"name": "gtopk", "density": 0.3, "momentum_correction": 0},
    "diloco": {"name": "diloco", "period": 2},
}


def _train_sharded(rank, label, variant):
    """The GAN's loop on two FSDP2 models (2 replicas x 2 shards), each under its ShardedModel. The reference
    is ``frozen``: FSDP2 keeps what a backward under ``set_requires_gradient_sync(False)`` accumulated past
    ``zero_grad()``, so no_sync is no reference there."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    G, D = _nets()
    for net in (G, D):
        for unit in (net[0], net[2], net):
            fully_shard(unit, mesh=mesh["shard"])
    opt_g, opt_d = _optimizer("sgd", G), _optimizer("sgd", D)
    spec = dict(SHARDED[label])
    g = bagua_lite.ShardedModel(G, opt_g, build(spec.pop("name"), **spec), mesh=mesh)
    spec = dict(SHARDED[label])
    d = bagua_lite.ShardedModel(D, opt_d, build(spec.pop("name"), **spec), mesh=mesh)
    copied = d.process_group is not g.process_group and \
        dist.get_process_group_ranks(d.process_group) == dist.get_process_group_ranks(g.process_group)
    keep = variant == "thrown_away_in_place"
    try:
        for s in range(STEPS):
            z, real = _batch(rank, s)
            opt_d.zero_grad(set_to_none=not keep)
            fake = G(z)
            (F.softplus(-D(real)).mean() + F.softplus(D(fake.detach())).mean()).backward()
            opt_d.step()
            opt_g.zero_grad(set_to_none=not keep)
            D.requires_grad_(variant != "frozen")
            F.softplus(-D(fake)).mean().backward()
            D.requires_grad_(True)
            opt_g.step()
    finally:
        g.close()
        d.close()
    return copied, [p.detach().full_tensor() for p in list(G.parameters()) + list(D.parameters())]


def _r_gan_sharded(rank, world):
    return {label: {v: _train_sharded(rank, label, v) for v in ("frozen", "thrown_away", "thrown_away_in_place")}
            for label in SHARDED}


def test_a_gans_thrown_away_round_leaves_no_trace_on_shards(clusters):
    results = clusters.get(4).run(_r_gan_sharded)
    for label in SHARDED:
        reference = results[0][label]["frozen"][1]
        for r in range(4):
            for variant in ("frozen", "thrown_away", "thrown_away_in_place"):
                copied, weights = results[r][label][variant]
                assert copied, (label, variant, r)
                assert all(torch.equal(a, b) for a, b in zip(weights, reference)), (label, variant, r)


def _r_feeding(rank, world, first):
    """A DistributedModel (an encoder kept whole) feeding a ShardedModel (the FSDP2 body after it), one loss
    through both: the body's backward ends first, and its step agreement travels on every rank's group while
    the encoder's buckets may still be in flight on it (before: gloo aborted the process)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    body = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    for unit in (body[0], body[2], body):
        fully_shard(unit, mesh=mesh["shard"])
    opt_e, opt_b = torch.optim.SGD(encoder.parameters(), lr=0.05), torch.optim.SGD(body.parameters(), lr=0.05)
    make_e = lambda: bagua_lite.DistributedModel(encoder, opt_e, bucket_size_mb=0.01)  # noqa: E731
    make_b = lambda: bagua_lite.ShardedModel(body, opt_b, "gradient_allreduce", mesh=mesh)  # noqa: E731
    if first == "encoder":
        e, b = make_e(), make_b()
    else:
        b, e = make_b(), make_e()
    try:
        for s in range(STEPS * 3):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(rank * 100 + s))
            body(e(x)).square().mean().backward()
            opt_e.step()
            opt_b.step()
            opt_e.zero_grad()
            opt_b.zero_grad()
    finally:
        b.close()
        e.close()
    copied = e.process_group is not dist.group.WORLD
    weights = [p.detach().clone() for p in encoder.parameters()] + [p.detach().full_tensor() for p in body.parameters()]
    return copied, weights


def test_a_model_feeding_a_sharded_model_trains_in_one_backward(clusters):
    runs = {first: clusters.get(4).run(_r_feeding, first) for first in ("encoder", "body")}
    for first, results in runs.items():
        for r in range(4):
            copied, weights = results[r]
            assert copied == (first == "body"), (first, r)  # made after the ShardedModel: a copy of the group
            assert all(torch.equal(a, b) for a, b in zip(weights, results[0][1])), (first, r)  # replicas alike
            assert all(torch.equal(a, b) for a, b in zip(weights, runs["encoder"][r][1])), (first, r)  # same bits


class _Skew(torch.autograd.Function):
    """The identity, whose backward waits 30 ms per rank: the encoder's backward (torch's collectives) then
    starts at a different time on each rank, against the head's rounds in flight on the engine's thread."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.03 * dist.get_rank())
        return g


def _r_beside_torch(rank, world, kind, order, apart):
    """An encoder under torch's own DDP or ``fully_shard`` (FSDP2, one unit per layer) over the job's group,
    feeding a head under a DistributedModel. Both send on that group in backward, from two threads: with one
    loss through both, their collectives met in an order that differed across ranks, and gloo hung until the
    timeout or aborted. ``order``: "torch_first" (the DistributedModel, made second, finds it at wrapping and
    takes a copy), "own_group" (the reference: the head given a group of its own), "ours_first" (found at
    the first round, named in a warning, and from then on the head waits for each bucket in backward, so
    that both post their collectives from backward's thread) or "ours_late" (the encoder wrapped after the
    head's first step: found at the next round); ``apart``: the encoder and the head in backwards of their
    own (the head fed the encoder's output detached). Every order starts with a step of the head alone.
    Returns whether the head took a copy of the group, the warnings naming the wrapper, whether the head
    waited for its buckets at the end (and, for DDP, once the encoder's DDP was dropped), and the weights."""
    import warnings
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    head = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    opt_h = torch.optim.SGD(head.parameters(), lr=0.1)

    def wrap_encoder():
        if kind == "ddp":
            return DistributedDataParallel(encoder, bucket_cap_mb=0.0001)
        mesh = init_device_mesh("cpu", (world,))
        for unit in (encoder[0], encoder[2], encoder):
            fully_shard(unit, mesh=mesh)
        return encoder
    own = dist.new_group(list(range(world))) if order == "own_group" else None
    wrap_head = lambda: bagua_lite.DistributedModel(head, opt_h, "gtopk", bucket_size_mb=0.0001, group=own)  # noqa: E731
    if order == "ours_first":
        h, e = wrap_head(), wrap_encoder()
    elif order == "ours_late":
        h, e = wrap_head(), None
    else:
        e, h = wrap_encoder(), wrap_head()
    y = torch.arange(8) % 16

    def head_alone(seed):
        F.cross_entropy(h(torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))), y).backward()
        opt_h.step()
        opt_h.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            head_alone(rank * 100 + 99)
            e = wrap_encoder() if e is None else e
            opt_e = torch.optim.SGD(encoder.parameters(), lr=0.1)
            for s in range(4):
                x = torch.randn(8, 8, generator=torch.Generator().manual_seed(rank * 100 + s))
                if apart:
                    z = e(x)
                    z.square().mean().backward()
                    F.cross_entropy(h(z.detach()), y).backward()
                else:
                    F.cross_entropy(h(_Skew.apply(e(x))), y).backward()
                opt_e.step()
                opt_h.step()
                opt_e.zero_grad()
                opt_h.zero_grad()
            serial = [h._serial]
            weights = [p.detach().clone() for p in head.parameters()]
            weights += [p.detach().full_tensor() if kind == "fully_shard" else p.detach().clone()
                        for p in encoder.parameters()]
            if kind == "ddp":  # torch's DDP dropped: the head's next round overlaps again
                del e, opt_e
                head_alone(rank * 100 + 98)
                serial.append(h._serial)
        finally:
            h.close()
    named = [str(w.message) for w in caught if "made after this model sends on its process group" in str(w.message)]
    return h.process_group is not dist.group.WORLD, named, serial, weights


@pytest.mark.parametrize("kind", ("ddp", "fully_shard"))
def test_a_model_beside_torchs_own_ddp_or_fsdp_on_its_group_takes_a_copy_or_waits_for_its_buckets(clusters, kind):
    """Bit for bit the head on a group of its own, whichever is made first, in one backward or two. Without
    the wait, "ours_first" in one backward aborted (gloo) on every run."""
    cluster = clusters.get(3)
    name = "DistributedDataParallel" if kind == "ddp" else "fully_shard (FSDP2) module"
    for apart in (False, True):
        reference = cluster.run(_r_beside_torch, kind, "own_group", apart)
        assert all(named == [] and not any(serial) for _, named, serial, _ in reference)
        for order in ("torch_first", "ours_first", "ours_late"):
            for r, (copied, named, serial, weights) in enumerate(cluster.run(_r_beside_torch, kind, order, apart)):
                assert copied == (order == "torch_first"), (order, apart, r)
                assert all(map(torch.equal, weights, reference[r][3])), (order, apart, r)  # the head on its own group
                assert all(map(torch.equal, weights, reference[0][3])), (order, apart, r)  # replicas alike
                if order == "torch_first":
                    assert named == [] and serial == [False] * len(serial), (order, apart, r, named, serial)
                else:  # named once, at the round after it was made, on every rank; waits until it is dropped
                    assert len(named) == 1 and f"a torch {name} made after" in named[0], (order, apart, r, named)
                    assert "waits for each bucket's communication" in named[0], named[0]
                    assert serial == ([True, False] if kind == "ddp" else [True]), (order, apart, r, serial)


class _MyDDP(torch.nn.parallel.DistributedDataParallel):
    """A user's subclass of torch's DDP: it sends on its group as DDP does."""


def _r_torch_users(rank, world):
    """What torch_users finds on the job's group as wrappers come and go: none before, none for our own model
    (a DDP in type only), a user's subclass of DDP, a fully_shard param group (one per module that holds
    parameters), none on another group, and not one that was dropped."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from bagua_lite import _groups

    own = dist.new_group(list(range(world)))
    found = [_groups.torch_users(dist.group.WORLD)]
    net = torch.nn.Linear(4, 4)
    model = bagua_lite.DistributedModel(net, torch.optim.SGD(net.parameters(), lr=0.1))
    found.append(_groups.torch_users(dist.group.WORLD))
    ddp = _MyDDP(torch.nn.Linear(4, 4))
    found.append(_groups.torch_users(dist.group.WORLD))
    sharded = torch.nn.Sequential(torch.nn.Linear(4, 4))
    fully_shard(sharded[0], mesh=init_device_mesh("cpu", (world,)))
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)))  # holds no parameter of its own
    found.append(sorted(_groups.torch_users(dist.group.WORLD)))
    found.append(_groups.torch_users(own))
    model.close()
    del ddp
    found.append(_groups.torch_users(dist.group.WORLD))
    return found


def test_torch_users_finds_ddp_subclasses_and_fully_shard_param_groups_but_not_ours(clusters):
    for found in clusters.get(2).run(_r_torch_users):
        ddp, fsdp = "DistributedDataParallel", "fully_shard (FSDP2) module"
        assert found == [[], [], [ddp], [ddp, fsdp], [], [fsdp]], found
