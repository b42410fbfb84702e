"""ShardedModel against references, on real gloo groups: P = 4 as 2 replicas x 2 shards and P = 6 as 3 x 2.

- The identity relaxation (gradient_allreduce, no codec) equals FSDP2's own HSDP (``fully_shard`` over the
  2-D mesh) bit for bit; so do topk and gtopk at density 1 on two replicas (a sum of two is exact in any order).
- Sharded DiLoCo and local SGD equal the unsharded algorithm written out on whole tensors (each parameter's
  ``full_tensor()``, averaged over the replicas, stepped by the same outer optimizer): bit for bit on two
  replicas, where a sum's order cannot matter; within float rounding on three, where gloo's ring sums
  each element in an order set by where it falls in the buffer, a shard's or a whole tensor's.
- gtopk below density 1: the selection is per FSDP unit's shard (k = density x the shard's length), the
  result the same on every replica, and the residual keeps what was not sent.
- Activation checkpointing of every unit (reentrant or not) changes no bit, for gradient and weight relaxations.
- Codecs: every replica holds the same weights (gradient codecs) or the same anchor (DiLoCo's outer weights)
  after every step, streaming DiLoCo with overlap included.
"""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint

import bagua_lite
from cluster import Cluster

STEPS = 6


def _net():
    torch.manual_seed(0)  # 13 rows: each parameter's last shard is padded
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 13), torch.nn.Tanh(),
                               torch.nn.Linear(13, 5))


class _Checkpointed(torch.nn.Module):
    """A layer whose activations are recomputed in backward (torchtitan wraps each block so, then shards it)."""

    def __init__(self, inner, reentrant):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


def _sharded(R, S, native=False, bf16=False, reentrant=None):
    """``bf16``: compute in bf16, reduce in fp32 (MixedPrecisionPolicy), the mixed precision ShardedModel takes.
    ``reentrant``: None, or every unit activation-checkpointed with ``use_reentrant`` so."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    net = _net()
    if reentrant is not None:
        for i in (0, 2, 4):
            net[i] = _Checkpointed(net[i], reentrant)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for i in (0, 2, 4):
        fully_shard(net[i], mesh=mesh if native else mesh["shard"], mp_policy=policy)
    fully_shard(net, mesh=mesh if native else mesh["shard"], mp_policy=policy)
    return net, mesh


def _algorithm(spec):
    if isinstance(spec, dict):
        spec = dict(spec)
        return bagua_lite.algorithm.build(spec.pop("name"), **spec)
    return spec


def _batches(rank, steps=STEPS):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)) for _ in range(steps)]


def _full(net):
    return [p.detach().full_tensor().clone() for p in net.parameters()]


def _r_train(rank, world, R, S, spec, optimizer="sgd", after_step=None, frozen=False, bf16=False, reentrant=None):
    """Train STEPS steps; ``spec`` None: FSDP2's native HSDP. Returns the full weights after every step.
    ``frozen``: the middle layer's bias does not train (FSDP2 leaves it out of the reduce-scatter).
    ``bf16``: under a MixedPrecisionPolicy computing in bf16 and reducing in fp32.
    ``reentrant``: activation checkpointing (see ``_sharded``); the input then requires grad, so the first
    unit's reentrant recomputation has a gradient to give."""
    net, mesh = _sharded(R, S, native=spec is None, bf16=bf16, reentrant=reentrant)
    if frozen:
        net[2].bias.requires_grad_(False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd" \
        else torch.optim.AdamW(net.parameters(), lr=0.01)
    relaxed = None if spec is None else bagua_lite.ShardedModel(net, opt, algorithm=_algorithm(spec), mesh=mesh)
    history = []
    for x, y in _batches(rank):
        x.requires_grad_(reentrant is not None)
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        history.append(_full(net) if after_step is None else after_step(net, relaxed))
    if relaxed is not None:
        relaxed.close()
    return history


@pytest.fixture(scope="module")
def c4():
    c = Cluster(4)
    yield c
    c.close()


@pytest.fixture(scope="module")
def c6():
    c = Cluster(6)
    yield c
    c.close()


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("shape,optimizer", [((2, 2), "sgd"), ((3, 2), "sgd"), ((2, 2), "adamw")])
def test_identity_equals_native_hsdp(c4, c6, shape, optimizer):
    R, S = shape
    c = c4 if R * S == 4 else c6
    native = c.run(_r_train, R, S, None, optimizer)
    ours = c.run(_r_train, R, S, "gradient_allreduce", optimizer)
    for rank in range(R * S):
        for step in range(STEPS):
            assert _equal(ours[rank][step], native[rank][step]), (rank, step)
    assert not _equal(native[0][0], native[0][-1])  # it trained


def test_identity_equals_native_hsdp_in_mixed_precision(c4):
    """bf16 compute with an fp32 reduction (MixedPrecisionPolicy): FSDP2 hands the hook fp32 gradients."""
    native = c4.run(_r_train, 2, 2, None, "adamw", None, False, True)
    ours = c4.run(_r_train, 2, 2, "gradient_allreduce", "adamw", None, False, True)
    fp32 = c4.run(_r_train, 2, 2, None, "adamw")
    for rank in range(4):
        for step in range(STEPS):
            assert _equal(ours[rank][step], native[rank][step]), (rank, step)
    assert not _equal(native[0][-1], fp32[0][-1])  # bf16 compute did change the numbers


def test_identity_equals_native_hsdp_with_a_frozen_parameter(c4):
    native = c4.run(_r_train, 2, 2, None, "sgd", None, True)
    ours = c4.run(_r_train, 2, 2, "gradient_allreduce", "sgd", None, True)
    for rank in range(4):
        assert _equal(ours[rank][-1], native[rank][-1]), rank
        assert torch.equal(ours[rank][-1][3], ours[rank][0][3])  # the frozen bias did not move


def _r_unfreeze(rank, world, spec, after_wrap, layer=False):
    """The middle layer's bias (``layer``: the whole layer, its FSDP2 unit) frozen before wrapping
    (``after_wrap`` False) or right after, trainable from step 3 on. Returns (refused: (step, message) or
    None, the full weights after every step)."""
    net, mesh = _sharded(2, 2, native=spec is None)
    frozen = net[2] if layer else net[2].bias
    frozen.requires_grad_(after_wrap)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    relaxed = None if spec is None else bagua_lite.ShardedModel(net, opt, algorithm=_algorithm(spec), mesh=mesh)
    history, refused = [], None
    for step, (x, y) in enumerate(_batches(rank)):
        frozen.requires_grad_(step >= 3)
        try:
            ((net(x) - y) ** 2).mean().backward()
        except RuntimeError as e:
            refused = (step, str(e))
            break
        opt.step()
        opt.zero_grad()
        history.append(_full(net))
    if relaxed is not None:
        relaxed.close()
    return refused, history


@pytest.mark.parametrize("spec", ["gradient_allreduce", {"name": "diloco", "period": 2}], ids=["identity", "diloco"])
def test_a_parameter_unfrozen_after_wrapping_is_refused_unless_its_unit_was_wrapped_trainable(c4, spec):
    """Frozen when ShardedModel was built, a parameter has no bucket: unfrozen, it would train on each replica
    alone (0.056 apart after four steps in a reproduction without the refusal). Refused at the next forward
    on every rank, naming it. A unit wrapped trainable and frozen whole after, trains once unfrozen, the
    identity as FSDP2's own HSDP does it; frozen in part after wrapping (FSDP2 then reduce-scatters the
    rest only), it is refused in that backward, naming it."""
    for rank, (refused, history) in enumerate(c4.run(_r_unfreeze, spec, False)):
        assert refused is not None and refused[0] == 3 and "'2.bias'" in refused[1], (rank, refused)
        assert "when the model was wrapped" in refused[1] and len(history) == 3, rank
    ours = c4.run(_r_unfreeze, spec, True, True)
    for rank, (refused, history) in enumerate(ours):
        assert refused is None, (rank, refused)
        assert all(torch.equal(history[s][i], history[0][i]) for s in (1, 2) for i in (2, 3)), rank
        assert not torch.equal(history[-1][3], history[2][3]), rank
        assert _equal(history[-1], ours[0][1][-1]), rank  # the replicas (and shards) agree
    if spec == "gradient_allreduce":
        native = c4.run(_r_unfreeze, None, True, True)
        for rank in range(4):
            assert all(_equal(a, b) for a, b in zip(ours[rank][1], native[rank][1])), rank
    for rank, (refused, history) in enumerate(c4.run(_r_unfreeze, spec, True)):
        assert refused is not None and refused[0] == 0 and "'2.bias'" in refused[1], (rank, refused)
        assert "frozen after ShardedModel was built" in refused[1] and not history, refused[1]


def _r_frozen_diloco(rank, world):
    """diloco (H = 2) with the middle unit frozen for steps 3-7, after it has outer momentum: the full weights
    after every step."""
    net, mesh = _sharded(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    relaxed = bagua_lite.ShardedModel(net, opt, algorithm=_algorithm({"name": "diloco", "period": 2}), mesh=mesh)
    history = []
    for step, (x, y) in enumerate(_batches(rank, 10)):
        net[2].requires_grad_(not 3 <= step < 8)
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        history.append(_full(net))
    relaxed.close()
    return history


def test_diloco_leaves_a_unit_frozen_after_building_alone(c4):
    """Frozen after some syncs, the unit takes its replicas' mean change at the next sync (the end of step 3),
    then stays bit for bit as it is at the syncs of steps 5 and 7: the outer momentum does not move it (it is
    the DTensor parameter's requires_grad that counts, not its local shard's); unfrozen, it trains again."""
    res = c4.run(_r_frozen_diloco)
    for rank, history in enumerate(res):
        for i in (2, 3):
            assert not torch.equal(history[3][i], history[2][i]), (rank, i)
            assert all(torch.equal(history[s][i], history[3][i]) for s in range(3, 8)), (rank, i)
            assert not torch.equal(history[-1][i], history[7][i]), (rank, i)
        assert all(_equal(history[s], res[0][s]) for s in (3, 5, 7, 9)), rank  # replicas agree after each sync


@pytest.mark.parametrize("reentrant", [False, True], ids=["checkpoint", "checkpoint_reentrant"])
@pytest.mark.parametrize("spec", ["gradient_allreduce", {"name": "gtopk", "density": 0.3, "momentum_correction": 0},
                                  {"name": "diloco", "period": 2}], ids=["identity", "gtopk", "diloco"])
def test_activation_checkpointing_changes_nothing(c4, spec, reentrant):
    """Every unit's activations recomputed in backward (in a nested backward of its own when reentrant):
    every step bit for bit the same algorithm without it, and the identity FSDP2's own HSDP without it."""
    plain = c4.run(_r_train, 2, 2, spec)
    checkpointed = c4.run(_r_train, 2, 2, spec, "sgd", None, False, False, reentrant)
    for rank in range(4):
        for step in range(STEPS):
            assert _equal(checkpointed[rank][step], plain[rank][step]), (rank, step)
    if spec == "gradient_allreduce":
        native = c4.run(_r_train, 2, 2, None)
        assert all(_equal(checkpointed[r][-1], native[r][-1]) for r in range(4))


@pytest.mark.parametrize("name", ["topk", "gtopk"])
def test_sparsifiers_at_density_one_equal_native_hsdp(c4, name):
    native = c4.run(_r_train, 2, 2, None)
    ours = c4.run(_r_train, 2, 2, {"name": name, "density": 1.0, "momentum_correction": 0})
    for rank in range(4):
        assert _equal(ours[rank][-1], native[rank][-1]), rank


def _r_diloco_reference(rank, world, R, S, period, outer):
    """DiLoCo written out on whole tensors over the same FSDP2 replicas: every ``period`` steps each
    parameter's full tensor is averaged over the replicate group as the change since the anchor, the
    outer optimizer steps the (whole) anchor, and each rank takes its shard of the anchor back. ``outer``
    None: local SGD, the weights themselves averaged (no anchor)."""
    net, mesh = _sharded(R, S)
    group = mesh.get_group("replicate")
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    anchors = [w.clone() for w in _full(net)]
    outer_opt = torch.optim.SGD(anchors, **outer) if outer else None
    history = []
    for step, (x, y) in enumerate(_batches(rank), 1):
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step % period == 0:
            with torch.no_grad():
                for p, anchor in zip(net.parameters(), anchors):
                    if outer_opt is None:
                        anchor.copy_(p.detach().full_tensor())
                        dist.all_reduce(anchor, group=group)
                        anchor.div_(R)
                        continue
                    change = p.detach().full_tensor() - anchor
                    dist.all_reduce(change, group=group)
                    anchor.grad = change.div_(R).neg_()
                if outer_opt is not None:
                    outer_opt.step()
                s = mesh["shard"].get_local_rank()
                for p, anchor in zip(net.parameters(), anchors):
                    p.to_local().copy_(torch.chunk(anchor, S, dim=0)[s])
        history.append(_full(net))
    return history


NESTEROV = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


@pytest.mark.parametrize("shape", [(2, 2), (3, 2)])
@pytest.mark.parametrize("name", ["diloco", "local_sgd"])
def test_sharded_diloco_equals_unsharded(c4, c6, shape, name):
    R, S = shape
    c = c4 if R * S == 4 else c6
    if name == "diloco":
        spec = {"name": "diloco", "period": 2, "outer_optimizer": {"name": "sgd", **NESTEROV}}
        reference = c.run(_r_diloco_reference, R, S, 2, NESTEROV)
    else:
        spec = {"name": "local_sgd", "period": 2}
        reference = c.run(_r_diloco_reference, R, S, 2, None)
    ours = c.run(_r_train, R, S, spec)
    for rank in range(R * S):
        for step in range(STEPS):
            if R == 2:
                assert _equal(ours[rank][step], reference[rank][step]), (rank, step)
            else:
                for a, b in zip(ours[rank][step], reference[rank][step]):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for step in (1, 3, 5):  # after every sync (steps 2, 4, 6) every replica holds the same weights
        assert all(_equal(ours[r][step], ours[0][step]) for r in range(R * S))
    assert not _equal(ours[0][0], ours[S][0])  # between syncs replicas differ (rank S: replica 1, shard 0)


def _r_gtopk_selection(rank, world, density):
    """One gtopk step's gradients on shards: per FSDP unit, how many entries are nonzero in this rank's
    shard of every parameter's .grad, the unit's shard length, the local .grad, and the residuals."""
    net, mesh = _sharded(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    relaxed = bagua_lite.ShardedModel(net, opt, algorithm=_algorithm(
        {"name": "gtopk", "density": density, "momentum_correction": 0, "warmup_densities": []}), mesh=mesh)
    x, y = _batches(rank, 1)[0]
    ((net(x) - y) ** 2).mean().backward()
    units = []
    for u in relaxed.units:
        local = torch.cat([p.grad.to_local().reshape(-1) for p in u.params])
        units.append({"numel": u.numel, "nonzero": int((local != 0).sum()), "grad": local.clone(),
                      "k": relaxed.algorithm.k_for(relaxed.buckets[u.index])})
    residual = [r.clone() for r in relaxed.algorithm.residuals]
    relaxed.close()
    return units, residual


def test_gtopk_selects_per_shard(c4):
    """k = density x each unit's shard length; replicas of a shard get the same sparse average, whose
    nonzeros are at most k; the residual holds what was not sent (nonzero: a dense gradient lost entries)."""
    out = c4.run(_r_gtopk_selection, 0.2)
    for rank in range(4):
        units, residual = out[rank]
        for u in units:
            assert abs(u["k"] - 0.2 * u["numel"]) <= 1, u  # of the shard's length, not the whole tensor's
            assert 0 < u["nonzero"] <= u["k"]
        assert any(float(r.abs().sum()) > 0 for r in residual)
    mesh_rank = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}  # rank -> (replica, shard): row-major mesh
    for rank in range(4):
        replica, shard = mesh_rank[rank]
        twin = next(r for r, (rep, sh) in mesh_rank.items() if sh == shard and rep != replica)
        for a, b in zip(out[rank][0], out[twin][0]):
            assert torch.equal(a["grad"], b["grad"])


def _r_layout(rank, world):
    """Where FSDP2 put each parameter's sharded .grad in the flat tensor it handed the unit's hook (it views
    that tensor), against the unit's layout: offsets and padded shapes."""
    net, mesh = _sharded(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    relaxed = bagua_lite.ShardedModel(net, opt, algorithm="gradient_allreduce", mesh=mesh)
    handed = {}
    for u in relaxed.units:
        hook = functools.partial(relaxed._on_reduced, u)  # noqa: SLF001 - the test watches the hook's input
        u.module.set_all_reduce_hook(lambda out, u=u, hook=hook: (handed.__setitem__(u.index, out), hook(out)))
    x, y = _batches(rank, 1)[0]
    ((net(x) - y) ** 2).mean().backward()
    out = []
    for u in relaxed.units:
        base = handed[u.index]
        assert base.numel() == u.numel
        for p, offset, shape in zip(u.params, u.offsets, u.shapes):
            local = p.grad.to_local()
            out.append(((local.data_ptr() - base.data_ptr()) // base.element_size(), offset,
                        tuple(local.shape[1:]), shape[1:], local.shape[0] <= shape[0]))
    relaxed.close()
    return out


def test_unit_layout_is_fsdp2s(c4):
    for rank_layout in c4.run(_r_layout):
        assert len(rank_layout) == 6  # 3 units x (weight, bias)
        for at, offset, cols, padded_cols, fits in rank_layout:
            assert at == offset and cols == padded_cols and fits


def _r_anchors(net, relaxed):
    return [a.clone() for frag in relaxed.algorithm.frags for a in frag.anchors]


@pytest.mark.parametrize("spec", [
    {"name": "gradient_allreduce", "compression": "fp16"},
    {"name": "gradient_allreduce", "compression": "minmax_uint8"},
    {"name": "gradient_allreduce", "compression": "sign"},
    {"name": "topk", "density": 0.1, "momentum_correction": 0},
    {"name": "gtopk", "density": 0.1, "momentum_correction": 0},
    {"name": "gtopk", "density": 0.1, "momentum_correction": 0, "layerwise": True},
    {"name": "gtopk", "density": 0.3, "momentum_correction": 0, "value_bits": 4},  # 3 replicas: fold, requantize
    {"name": "gtopk", "density": 0.3, "momentum_correction": 0, "value_bits": 4, "final_union": True},  # 2k back
    {"name": "powersgd", "rank": 1, "min_compression_rate": 1.0},
])
def test_gradient_codecs_keep_replicas_identical(c6, spec):
    out = c6.run(_r_train, 3, 2, spec)
    for step in range(STEPS):
        assert all(_equal(out[r][step], out[0][step]) for r in range(6)), step
    assert not _equal(out[0][0], out[0][-1])


@pytest.mark.parametrize("spec", [
    {"name": "diloco", "period": 2, "compression": "absmax4"},
    {"name": "diloco", "period": 2, "compression": "topk3_absmax2", "outer_optimizer": {"name": "sgd", "lr": 1.0}},
    {"name": "diloco", "period": 4, "compression": "absmax4", "fragments": 2, "overlap": 1, "alpha": 0.5},
    {"name": "local_sgd", "period": 2, "compression": "minmax_uint8"},
])
def test_weight_codecs_keep_anchors_identical(c6, spec):
    """Each replica's shard s ends every step with the same anchor (the outer weights) as rank s of the
    other replicas; the anchor moved (syncs happened)."""
    out = c6.run(_r_train, 3, 2, spec, "sgd", _r_anchors)
    for step in range(STEPS):
        for rank in range(6):
            assert _equal(out[rank][step], out[rank % 2][step]), (rank, step)  # rank = replica * 2 + shard
    assert not _equal(out[0][0], out[0][-1])
