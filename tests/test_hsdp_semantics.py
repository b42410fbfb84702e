"""ShardedModel's step semantics on real gloo groups: P = 4 as 2 replicas x 2 shards (3 x 2 where cheap).

The loop around a ShardedModel is FSDP2's own, and what a user does in it must keep working:

1. closure: ``opt.step(closure)`` trains bit for bit as the plain loop (gradient_allreduce, gtopk, diloco).
2. accumulation: ``set_requires_gradient_sync(False)`` on the first micro-batches, True on the last, under
   gradient_allreduce, equals FSDP2's native HSDP doing the same, bit for bit.
3. GradScaler: ``ShardedModel(..., grad_scaler=scaler)`` with the AMP recipe trains bit for bit as without a
   scaler (fp32, the default power-of-two scale); and torch's own scaler agrees on found_inf within a shard
   group (DTensor all-reduces it) but not across replicas, which is ShardedModel's job.
4. clip_grad_norm_ on the DTensor gradients: ShardedModel(gradient_allreduce) equals native HSDP, bit for bit.
5. torch.distributed.checkpoint: save model, optimizer and ``relaxed`` (a Stateful) at step k, resume in a fresh
   run, train to N: bit for bit the uninterrupted run (gtopk's residuals, DiLoCo's anchor and outer momentum);
   resuming without the algorithm's state does not.
6. a non-finite gradient on one rank: optimizer.step() raises FloatingPointError on every rank, nothing moves
   (weights, residuals), training goes on in step; under a GradScaler every rank skips and keeps one scale.
7. a peer dies or raises before its backward: every other rank raises (a RuntimeError) instead of hanging;
   a replica that closes after fewer steps (uneven inputs) makes the other's ranks raise at once.
8. refusals raise on every rank before any collective, and leave the model, the optimizer and the group usable.

Every parity compares each full weight (``full_tensor()``) with torch.equal. The model's dim 0 (13, 5) does
not divide the shard count, so FSDP2 pads the last shard.
"""
import contextlib
import datetime
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import bagua_lite
from cluster import Cluster, RemoteError

STEPS = 5
GTOPK = {"name": "gtopk", "density": 0.3, "momentum_correction": 0}
DILOCO = {"name": "diloco", "period": 2}


# ---- helpers (run on the ranks) ---------------------------------------------------------------------------
def _net():
    torch.manual_seed(0)  # the same weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 13), torch.nn.Tanh(),
                               torch.nn.Linear(13, 5))


def _sharded(R, S, native=False, timeout_s=None, mp_policy=None):
    """The tiny net, each Linear and the root fully_shard-ed over mesh["shard"] (``native``: over the 2-D mesh,
    FSDP2's own HSDP). ``timeout_s``: the mesh groups' timeout (init_device_mesh gives them torch's default,
    30 minutes for gloo, not the default group's). ``mp_policy``: FSDP2's MixedPrecisionPolicy for every unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    override = None
    if timeout_s is not None:
        options = dist.ProcessGroupGloo._Options()  # noqa: SLF001 - the documented way to set a mesh's timeout
        options._timeout = datetime.timedelta(seconds=timeout_s)  # noqa: SLF001
        override = {"replicate": ("gloo", options), "shard": ("gloo", options)}
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"), backend_override=override)
    net = _net()
    policy = mp_policy or MixedPrecisionPolicy()
    for i in (0, 2, 4):
        fully_shard(net[i], mesh=mesh if native else mesh["shard"], mp_policy=policy)
    fully_shard(net, mesh=mesh if native else mesh["shard"], mp_policy=policy)
    return net, mesh


def _algorithm(spec):
    if isinstance(spec, dict):
        spec = dict(spec)
        return bagua_lite.algorithm.build(spec.pop("name"), **spec)
    return spec


def _model(R, S, spec, grad_scaler=None, timeout_s=None):
    """(net, SGD with momentum, ShardedModel); ``spec`` None: native HSDP and no ShardedModel."""
    net, mesh = _sharded(R, S, native=spec is None, timeout_s=timeout_s)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    relaxed = None if spec is None else \
        bagua_lite.ShardedModel(net, opt, algorithm=_algorithm(spec), mesh=mesh, grad_scaler=grad_scaler)
    return net, opt, relaxed


def _batches(rank, n):
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    return [(torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)) for _ in range(n)]


def _loss(net, x, y):
    return ((net(x) - y) ** 2).mean()


def _full(net):
    return [p.detach().full_tensor().clone() for p in net.parameters()]


def _plain(t):
    """A detached CPU copy of a tensor or DTensor (whole)."""
    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).clone()


def _tensors(state):
    """Every tensor in a nested state dict, in a fixed order, cloned (a DTensor: this rank's shard)."""
    if isinstance(state, torch.Tensor):
        state = state.detach()
        return [(state.to_local() if isinstance(state, DTensor) else state).clone()]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def _close(relaxed):
    if relaxed is not None:
        relaxed.close()


# ---- helpers (either side) -----------------------------------------------------------------------------------
def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _twin(rank, S=2):
    """Rank ``rank``'s shard on the next replica (the mesh is row-major: rank = replica * S + shard)."""
    return (rank + S) % (2 * S)


@pytest.fixture
def c4(clusters):
    return clusters.get(4)


@pytest.fixture
def c6(clusters):
    return clusters.get(6)


# ---- 1. closure -------------------------------------------------------------------------------------------------
def _r_closure(rank, world, spec):
    """The plain loop, then ``opt.step(closure)`` on fresh copies: (weights after every step, losses) of each."""
    runs = []
    for use_closure in (False, True):
        net, opt, relaxed = _model(2, 2, spec)
        history, losses = [], []
        for x, y in _batches(rank, STEPS):
            if use_closure:
                def closure(x=x, y=y):
                    opt.zero_grad()
                    loss = _loss(net, x, y)
                    loss.backward()
                    return loss
                loss = opt.step(closure)
            else:
                loss = _loss(net, x, y)
                loss.backward()
                opt.step()
            opt.zero_grad()
            history.append(_full(net))
            losses.append(loss.detach().clone())
        _close(relaxed)
        runs.append((history, losses))
    return runs


@pytest.mark.parametrize("spec", ["gradient_allreduce", GTOPK, DILOCO], ids=["allreduce", "gtopk", "diloco"])
def test_closure_is_the_plain_loop(c4, spec):
    for rank, ((plain, plain_loss), (closed, closed_loss)) in enumerate(c4.run(_r_closure, spec)):
        for step in range(STEPS):
            assert _equal(closed[step], plain[step]), (rank, step)
            assert torch.equal(closed_loss[step], plain_loss[step]), (rank, step)  # step(closure) returns the loss
        assert not _equal(plain[0], plain[-1])  # it trained


# ---- 2. gradient accumulation -----------------------------------------------------------------------------------
def _r_accumulate(rank, world, R, S, spec, micro=3):
    net, opt, relaxed = _model(R, S, spec)
    batches = _batches(rank, STEPS * micro)
    history = []
    for step in range(STEPS):
        for m in range(micro):
            net.set_requires_gradient_sync(m == micro - 1)
            x, y = batches[step * micro + m]
            (_loss(net, x, y) / micro).backward()
        opt.step()
        opt.zero_grad()
        history.append(_full(net))
    _close(relaxed)
    return history


@pytest.mark.parametrize("shape", [(2, 2), (3, 2)], ids=["2x2", "3x2"])
def test_accumulation_with_set_requires_gradient_sync_equals_native_hsdp(c4, c6, shape):
    R, S = shape
    c = c4 if R * S == 4 else c6
    native = c.run(_r_accumulate, R, S, None)
    ours = c.run(_r_accumulate, R, S, "gradient_allreduce")
    for rank in range(R * S):
        for step in range(STEPS):
            assert _equal(ours[rank][step], native[rank][step]), (rank, step)
    assert not _equal(native[0][0], native[0][-1])


# ---- 3. GradScaler ----------------------------------------------------------------------------------------------
def _r_scaled(rank, world, spec):
    """Without a scaler, then through a default GradScaler: (weights after every step, the algorithm's
    state tensors, the scales) of each."""
    runs = []
    for scaled in (False, True):
        scaler = torch.amp.GradScaler("cpu") if scaled else None
        net, opt, relaxed = _model(2, 2, spec, grad_scaler=scaler)
        history, scales = [], []
        for x, y in _batches(rank, STEPS):
            loss = _loss(net, x, y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            opt.zero_grad()
            history.append(_full(net))
        runs.append((history, _tensors(relaxed.algorithm.state_dict()), scales))
        _close(relaxed)
    return runs


@pytest.mark.parametrize("spec", ["gradient_allreduce", GTOPK], ids=["allreduce", "gtopk"])
def test_grad_scaler_is_bit_for_bit_the_unscaled_run(c4, spec):
    for rank, ((plain, plain_state, _), (scaled, scaled_state, scales)) in enumerate(c4.run(_r_scaled, spec)):
        for step in range(STEPS):
            assert _equal(scaled[step], plain[step]), (rank, step)
        assert _equal(scaled_state, plain_state), rank  # gtopk's residuals saw true gradients
        assert scales == [2.0 ** 16] * STEPS, scales  # no step was skipped
        assert not _equal(plain[0], plain[-1])


def _r_found_inf(rank, world):
    """FSDP2 alone over the shard mesh, an inf put into rank 1's local gradient shard after backward: the
    found_inf each rank's GradScaler computes in unscale_, and its scale after update()."""
    net, _ = _sharded(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = _batches(rank, 1)[0]
    scaler.scale(_loss(net, x, y)).backward()
    if rank == 1:
        next(net.parameters()).grad.to_local().view(-1)[0] = float("inf")
    scaler.unscale_(opt)
    found = float(sum(v.item() for v in scaler._found_inf_per_device(opt).values()))  # noqa: SLF001
    scaler.step(opt)
    scaler.update()
    return found, scaler.get_scale()


def test_torch_grad_scaler_agrees_within_a_shard_group_only(c4):
    """What ShardedModel builds on: DTensor's unscale_ all-reduces found_inf over the parameters' (shard) mesh,
    so rank 0 skips with rank 1; the other replica (ranks 2, 3) does not hear of it. Across replicas the
    agreement is ShardedModel's (test_nonfinite_gradient_under_a_grad_scaler_skips_on_every_rank)."""
    out = c4.run(_r_found_inf)
    assert [f for f, _ in out] == [1.0, 1.0, 0.0, 0.0], out
    assert [s for _, s in out] == [2.0 ** 15, 2.0 ** 15, 2.0 ** 16, 2.0 ** 16], out


# ---- 4. clip_grad_norm_ -----------------------------------------------------------------------------------------
def _r_clip(rank, world, R, S, spec):
    net, opt, relaxed = _model(R, S, spec)
    history, norms = [], []
    for x, y in _batches(rank, STEPS):
        _loss(net, x, y).backward()
        norms.append(_plain(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        history.append(_full(net))
    _close(relaxed)
    return history, norms


@pytest.mark.parametrize("shape", [(2, 2), (3, 2)], ids=["2x2", "3x2"])
def test_clip_grad_norm_equals_native_hsdp(c4, c6, shape):
    R, S = shape
    c = c4 if R * S == 4 else c6
    native = c.run(_r_clip, R, S, None)
    ours = c.run(_r_clip, R, S, "gradient_allreduce")
    for rank in range(R * S):
        (ours_w, ours_n), (native_w, native_n) = ours[rank], native[rank]
        for step in range(STEPS):
            assert _equal(ours_w[step], native_w[step]), (rank, step)
            assert torch.equal(ours_n[step], native_n[step]), (rank, step)
    assert max(float(n) for n in native[0][1]) > 0.5  # the clipping did act


# ---- 5. checkpoint through torch.distributed.checkpoint ---------------------------------------------------------
K, N = 4, 7  # save after step K (not a multiple of DiLoCo's period 3), train to N


def _dcp_state(net, opt, relaxed, with_algorithm=True):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}
    if with_algorithm:
        state["bagua_lite"] = relaxed
    return state


def _r_checkpoint(rank, world, spec, path, mode):
    """``mode`` "through": train to N, saving after step K; "resume": a fresh run loads that checkpoint and
    trains from K to N; "without_algorithm": the same but loads only the model and the optimizer (and the
    step count). Returns the final full weights and the algorithm's state tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    net, opt, relaxed = _model(2, 2, spec)
    batches, start = _batches(rank, N), 0
    if mode != "through":
        state = _dcp_state(net, opt, relaxed, with_algorithm=mode == "resume")
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(net, state["model"])
        set_optimizer_state_dict(net, opt, state["optim"])
        if mode == "without_algorithm":
            relaxed.algorithm.step = K  # the rest of relaxed's part is missing: residuals; anchor, outer
            # momentum and (replicas differ between syncs) this rank's own shards
        start = K
    for step in range(start, N):
        x, y = batches[step]
        _loss(net, x, y).backward()
        opt.step()
        opt.zero_grad()
        if mode == "through" and step + 1 == K:
            dcp.save(_dcp_state(net, opt, relaxed), checkpoint_id=path)
    out = _full(net), _tensors(relaxed.algorithm.state_dict()), relaxed.algorithm.step
    relaxed.close()
    return out


@pytest.mark.parametrize("spec", [GTOPK, {"name": "diloco", "period": 3},
                                  {"name": "diloco", "period": 4, "fragments": 2, "overlap": 1}],
                         ids=["gtopk", "diloco", "streaming-diloco"])  # streaming: a sync in flight at K
def test_dcp_resume_is_bit_for_bit_the_uninterrupted_run(c4, tmp_path, spec):
    path = str(tmp_path / "checkpoint")
    through = c4.run(_r_checkpoint, spec, path, "through")
    resumed = c4.run(_r_checkpoint, spec, path, "resume")
    partial = c4.run(_r_checkpoint, spec, path, "without_algorithm")
    for rank in range(4):
        weights, state, step = through[rank]
        assert step == N
        assert _equal(resumed[rank][0], weights), rank
        assert _equal(resumed[rank][1], state), rank
        assert resumed[rank][2] == N
    # relaxed's part of the checkpoint is what made the difference
    assert any(not _equal(partial[rank][0], through[rank][0]) for rank in range(4))


# ---- 6. a non-finite gradient on one rank -----------------------------------------------------------------------
BAD = 2  # the step at which rank 1's input holds a NaN


@contextlib.contextmanager
def _deferred_checks(deferred):
    """Within it, ShardedModels built leave their non-finite checks on the device as on a GPU (one read per
    round, BAGUA_LITE_DEFER_CHECKS=1) where ``deferred``; else they answer at once."""
    if deferred:
        os.environ["BAGUA_LITE_DEFER_CHECKS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("BAGUA_LITE_DEFER_CHECKS", None)


def _r_nonfinite(rank, world, scaled, deferred=False):
    """gtopk; at step BAD rank 1's input holds a NaN. Returns, per step, whether optimizer.step() raised
    FloatingPointError and whether the weights, momenta and residuals came through that step unchanged,
    plus the weights after every step, the scales and the final step count."""
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    with _deferred_checks(deferred):
        net, opt, relaxed = _model(2, 2, GTOPK, grad_scaler=scaler)
    assert (relaxed._nonfinite_flags is not None) == deferred
    raised, unchanged, history, scales = [], [], [], []
    for step, (x, y) in enumerate(_batches(rank, STEPS)):
        if step == BAD and rank == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        before = _full(net) + _tensors(opt.state_dict()["state"]) + [r.clone() for r in relaxed.algorithm.residuals]
        loss = _loss(net, x, y)
        try:
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            raised.append(False)
        except FloatingPointError:
            raised.append(True)
        opt.zero_grad()
        after = _full(net) + _tensors(opt.state_dict()["state"]) + [r.clone() for r in relaxed.algorithm.residuals]
        unchanged.append(_equal(before, after))
        history.append(_full(net))
    out = raised, unchanged, history, scales, relaxed.algorithm.step
    relaxed.close()
    return out


def _check_skipped_in_step(out, raises):
    for rank, (raised, unchanged, history, _, steps) in enumerate(out):
        assert raised == [raises and s == BAD for s in range(STEPS)], (rank, raised)
        assert unchanged == [s == BAD for s in range(STEPS)], (rank, unchanged)  # only that step moved nothing
        assert steps == STEPS - 1, (rank, steps)  # the skipped step does not count, on any rank
        for step in range(STEPS):  # and the replicas stay identical throughout
            assert _equal(history[step], out[_twin(rank)][2][step]), (rank, step)


@pytest.mark.parametrize("deferred", [False, True], ids=["at_once", "deferred"])
def test_nonfinite_gradient_raises_on_every_rank_and_training_goes_on(c4, deferred):
    _check_skipped_in_step(c4.run(_r_nonfinite, False, deferred), raises=True)


@pytest.mark.parametrize("deferred", [False, True], ids=["at_once", "deferred"])
def test_nonfinite_gradient_under_a_grad_scaler_skips_on_every_rank(c4, deferred):
    out = c4.run(_r_nonfinite, True, deferred)
    _check_skipped_in_step(out, raises=False)
    for rank in range(4):
        scales = out[rank][3]
        assert scales == out[0][3], (rank, scales)  # one scale on every rank
        assert scales[BAD] == scales[BAD - 1] / 2, scales  # the skip backed it off


def _r_local_nonfinite(rank, world, deferred):
    """diloco (gradients stay local); at step BAD rank 1's input holds a NaN. Returns, per step, the
    FloatingPointError's message or None, and the weights after every step."""
    with _deferred_checks(deferred):
        net, opt, relaxed = _model(2, 2, DILOCO)
    assert (relaxed._local_flag is not None) == deferred
    errors, history = [], []
    for step, (x, y) in enumerate(_batches(rank, STEPS)):
        if step == BAD and rank == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        _loss(net, x, y).backward()
        _step_recorded(net, opt, errors, history)
    relaxed.close()
    return errors, history


def _step_recorded(net, opt, errors, history):
    """``opt.step()``, its FloatingPointError's message (or None) into ``errors``, then the weights."""
    try:
        opt.step()
        errors.append(None)
    except FloatingPointError as e:
        errors.append(str(e))
    opt.zero_grad()
    history.append(_full(net))


def test_local_nonfinite_gradient_skips_on_its_rank_alike_deferred_or_at_once(c4):
    """A local gradient's check left on the device (read once at the step) names the same parameter, skips
    the same step on the same ranks and leaves the same weights as the check that answers at once."""
    at_once, deferred = c4.run(_r_local_nonfinite, False), c4.run(_r_local_nonfinite, True)
    for rank in range(4):
        errors = at_once[rank][0]
        # rank 1's replica (ranks 0 and 1: FSDP2 reduce-scatters inside it) skips step BAD, the other does not
        assert [e is not None for e in errors] == [rank < 2 and s == BAD for s in range(STEPS)], (rank, errors)
        assert deferred[rank][0] == errors, (rank, deferred[rank][0], errors)
        for step in range(STEPS):
            assert _equal(deferred[rank][1][step], at_once[rank][1][step]), (rank, step)
    assert "first in parameter" in at_once[1][0][BAD], at_once[1][0][BAD]



def _r_local_accumulated(rank, world, deferred, bad_micro, skip=None):
    """diloco, two micro-batches a step accumulated without set_requires_gradient_sync(False); at step BAD
    rank 1's micro-batch ``bad_micro`` holds a NaN. With ``skip`` ("to_none" or "in_place"), rank 1's loop
    skips that step itself (no optimizer.step(), then zero_grad with set_to_none=True or False). Returns the
    step count each forward found, the errors, the weights after every step and the host's reads of the
    checks left on the device."""
    from bagua_lite import sharded, step_hooks
    reads, read = [], step_hooks.host_read
    sharded.host_read = step_hooks.host_read = lambda t: reads.append(1) or read(t)
    try:
        with _deferred_checks(deferred):
            net, opt, relaxed = _model(2, 2, DILOCO)
        errors, history, seen = [], [], []
        batches = _batches(rank, 2 * STEPS)
        for step in range(STEPS):
            for micro in range(2):
                x, y = batches[2 * step + micro]
                if step == BAD and rank == 1 and micro == bad_micro:
                    x = x.clone()
                    x[0, 0] = float("nan")
                loss = _loss(net, x, y)
                seen.append(relaxed.algorithm.step)
                loss.backward()
            if skip and step == BAD and rank == 1:
                errors.append("skipped")
                opt.zero_grad(set_to_none=skip == "to_none")  # (in place on DTensors: their own versions move)
                history.append(_full(net))
                continue
            _step_recorded(net, opt, errors, history)
        relaxed.close()
        return seen, errors, history, len(reads)
    finally:
        sharded.host_read = step_hooks.host_read = read


@pytest.mark.parametrize("deferred", [False, True], ids=["at_once", "deferred"])
def test_a_nonfinite_micro_batch_accumulated_is_refused_at_its_step_and_counted_once(c4, deferred):
    """As tests/test_nonfinite.py's test of the same name for DistributedModel: an early micro-batch's NaN is
    refused at the step and counted once, bit for bit as when the last micro-batch holds it (before, the next
    forward counted a step for it, and the replica ran a step ahead). With the checks on the device, the
    micro-batches' forwards read nothing: each step reads its checks once."""
    first, last = c4.run(_r_local_accumulated, deferred, 0), c4.run(_r_local_accumulated, deferred, 1)
    for rank in range(4):
        assert first[rank][3] == last[rank][3] == (STEPS if deferred else 0), (rank, first[rank][3], last[rank][3])
        assert first[rank][0] == last[rank][0] == [s for s in range(STEPS) for _ in range(2)], (rank, first[rank][0])
        assert [e is not None for e in first[rank][1]] == [rank < 2 and s == BAD for s in range(STEPS)], rank
        assert first[rank][1] == last[rank][1], rank
        for step in range(STEPS):
            assert _equal(first[rank][2][step], last[rank][2][step]), (rank, step)

@pytest.mark.parametrize("skip", ["to_none", "in_place"])
def test_a_step_the_loop_skips_counts_alike_with_the_checks_on_the_device(c4, skip):
    """As tests/test_nonfinite.py's test of the same name: rank 1's loop skips the step of its bad micro-batch
    (its replica peer, rank 0, steps and is refused); the skipped step counts at the next forward, told from
    one more micro-batch by the DTensor gradients' versions: bit for bit the checks that answer at once."""
    deferred, at_once = c4.run(_r_local_accumulated, True, 1, skip), c4.run(_r_local_accumulated, False, 1, skip)
    for rank in range(4):
        a, b = deferred[rank], at_once[rank]
        assert a[0] == b[0] == [s for s in range(STEPS) for _ in range(2)], (rank, a[0])
        assert a[1] == b[1] and [e for e in a[1] if e] == (["skipped"] if rank == 1 else [a[1][BAD]] if rank == 0
                                                            else []), (rank, a[1])
        for step in range(STEPS):
            assert _equal(a[2][step], b[2][step]), (rank, step)
        assert a[3] == STEPS, (rank, a[3])


SIGN = {"name": "gradient_allreduce", "compression": "sign"}
DENSE = {"name": "gradient_allreduce"}
# (fused optimizer, GradScaler): what refuses a bad round on the device, so that its verdict can stay there
DRIVERS = {"fused": (True, False), "scaler": (False, True), "fused_scaler": (True, True)}


def _r_device_verdict(rank, world, spec, driver, deferred):
    """At step BAD rank 1's input holds a NaN; a FloatingPointError from the step, or (a step late) from the
    forward, is recorded and the loop goes on (a forward's error retries the batch). Returns the errors,
    the weights after every step, the scales and the host's reads of answers left on the device."""
    from bagua_lite import sharded, step_hooks, verdict
    fused, scaled = DRIVERS[driver]
    reads, read = [], sharded.host_read
    sharded.host_read = step_hooks.host_read = verdict.host_read = lambda t: reads.append(1) or read(t)
    try:
        with _deferred_checks(deferred):
            net, mesh = _sharded(2, 2)
            opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=fused)  # (a fused SGD does not take DTensors)
            scaler = torch.amp.GradScaler("cpu") if scaled else None
            relaxed = bagua_lite.ShardedModel(net, opt, algorithm=_algorithm(spec), mesh=mesh, grad_scaler=scaler)
        errors, history, scales, rounds = [], [], [], 0
        batches, step = _batches(rank, STEPS), 0
        while step < STEPS:
            x, y = batches[step]
            if step == BAD and rank == 1:
                x = x.clone()
                x[0, 0] = float("nan")
            try:
                loss = _loss(net, x, y)
            except FloatingPointError as e:
                errors.append(("forward", step, str(e)))
                continue
            (scaler.scale(loss) if scaler else loss).backward()
            rounds += relaxed._verdict_round
            try:
                if scaler:
                    scaler.step(opt)
                    scaler.update()
                    scales.append(scaler.get_scale())
                else:
                    opt.step()
            except FloatingPointError as e:
                errors.append(("step", step, str(e)))
            opt.zero_grad()
            history.append(_full(net))
            step += 1
        relaxed.close()
        return errors, history, scales, len(reads), rounds
    finally:
        sharded.host_read = step_hooks.host_read = verdict.host_read = read


@pytest.mark.parametrize("driver", list(DRIVERS))
@pytest.mark.parametrize("spec", [DENSE, SIGN, GTOPK], ids=["dense", "sign", "gtopk"])
def test_verdict_left_on_the_device_across_shards(c4, spec, driver):
    """With the checks left on the device, a fused optimizer or a GradScaler: the round's flags are agreed over
    every rank on the device (MAX allreduce), the state put back there (sign's residuals, gtopk's working
    copies of its residuals), so nothing is read,
    and every step's weights and scales are bit for bit those of the checks that answer at once; without a
    scaler the error comes at the next forward instead of at optimizer.step()."""
    at_once, deferred = c4.run(_r_device_verdict, spec, driver, False), c4.run(_r_device_verdict, spec, driver, True)
    for rank in range(4):
        errors, history, scales, reads, rounds = deferred[rank]
        assert (reads, rounds) == (0, STEPS), (rank, reads, rounds)
        assert at_once[rank][4] == 0
        for step in range(STEPS):
            assert _equal(history[step], at_once[rank][1][step]), (rank, step)
            assert _equal(history[step], deferred[_twin(rank)][1][step]), (rank, step)
        assert _equal(history[BAD], history[BAD - 1]) and not _equal(history[-1], history[BAD])
        assert scales == at_once[rank][2]
        if DRIVERS[driver][1]:
            assert errors == at_once[rank][0] == [], (rank, errors, at_once[rank][0])
            assert scales[BAD] == scales[BAD - 1] / 2, scales
        else:
            assert [e[:2] for e in at_once[rank][0]] == [("step", BAD)], at_once[rank][0]
            assert [e[:2] for e in errors] == [("forward", BAD + 1)], errors
            assert f"at step {BAD}:" in errors[0][2] and "skipped that step on the device" in errors[0][2]


# ---- 7. a peer failure ------------------------------------------------------------------------------------------
FAILS_AT = 2


def _r_peer_fails(rank, world, spec, how, timeout_s):
    """Rank 1 dies (os._exit) or raises (and stays alive) after its forward and before its backward at step
    FAILS_AT; the others train on. Returns what a survivor saw: (raised, its exception's type names,
    seconds into the step, message)."""
    net, opt, relaxed = _model(2, 2, spec, timeout_s=timeout_s)
    t0 = time.monotonic()
    for step, (x, y) in enumerate(_batches(rank, 50)):
        loss = _loss(net, x, y)
        if rank == 1 and step == FAILS_AT:
            if how == "exit":
                os._exit(1)
            raise ValueError("rank 1 fails before its backward")
        t0 = time.monotonic()
        try:
            loss.backward()
            opt.step()
            opt.zero_grad()
        except Exception as e:  # noqa: BLE001 - what the user's loop would catch
            return True, [c.__name__ for c in type(e).__mro__], time.monotonic() - t0, str(e)[:500]
    return False, [], time.monotonic() - t0, ""


@pytest.mark.parametrize("spec,how", [(GTOPK, "exit"), (GTOPK, "raise"), (DILOCO, "exit")],
                         ids=["gtopk-exit", "gtopk-raise", "diloco-exit"])
def test_peer_failure_raises_on_every_survivor(spec, how):
    """A cluster of its own whose groups (the mesh's too) time out after 3 s, torn down afterwards: every
    survivor raises a RuntimeError (gloo's, or bagua_lite.PeerFailedError) well within the harness's wait;
    none hangs. A rank that raised and lives on is seen only through the timeout, as a stopped one."""
    pg_timeout = 3
    c = Cluster(4, timeout_s=pg_timeout)
    try:
        with pytest.raises(RemoteError) as failed:  # rank 1 died or raised
            c.run(_r_peer_fails, spec, how, pg_timeout, timeout=60, grace=4 * pg_timeout + 20)
    finally:
        c.close()
    survivors = {r: v for r, (ok, v) in failed.value.partial.items() if ok}
    assert sorted(survivors) == [0, 2, 3], failed.value  # each answered: nobody hung
    for rank, (raised, names, seconds, msg) in survivors.items():
        assert raised and "RuntimeError" in names, (rank, names, msg)
        assert seconds < 4 * pg_timeout + 10, (rank, seconds, msg)
        print(f"{how}: rank {rank} raised {names[0]} after {seconds:.1f} s: {msg[:120]}")


def _r_uneven(rank, world, spec):
    """Replica 0 (ranks 0, 1) has 3 batches, replica 1 (ranks 2, 3) 5: (the exception's type and message or
    None, the last step begun) per rank."""
    net, opt, relaxed = _model(2, 2, spec)
    error, step = None, 0
    try:
        for step, (x, y) in enumerate(_batches(rank, 3 if rank < 2 else 5)):
            _loss(net, x, y).backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001
        error = (type(e).__name__, str(e))
    finally:
        _close(relaxed)
    return error, step


@pytest.mark.parametrize("spec", ["gradient_allreduce", DILOCO], ids=["allreduce", "diloco"])
def test_uneven_inputs_across_replicas_fail_the_ranks_left_waiting_fast(spec):
    """torch's default timeout (30 minutes): replica 0 closes after 3 steps, and replica 1's ranks, whose
    exchange across replicas waits in step 4, raise at once, naming a rank that closed and the cause. (Inside
    a replica, FSDP2's own collectives would wait.)"""
    c = Cluster(4, timeout_s=1800)
    try:
        res = c.run(_r_uneven, spec, timeout=60)
    finally:
        c.close()
    assert res[0] == (None, 2) and res[1] == (None, 2), res[:2]
    for rank in (2, 3):
        error, step = res[rank]
        assert error is not None and error[0] == "PeerFailedError" and step == 3, (rank, res[rank])
        assert re.search(r"rank [01] closed this model after 3 steps", error[1]) and "uneven inputs" in error[1], error


# ---- 8. refusals ------------------------------------------------------------------------------------------------
# case: the exception every rank must raise. (powersgd and DiLoCo's overlap run on shards: accepted,
# tests/test_hsdp.py.)
REFUSALS = {
    "not_sharded": TypeError,
    "native_hsdp": ValueError,
    "mesh_and_replicate_group": ValueError,
    "neither_mesh_nor_group": ValueError,
    "decentralized": ValueError,
    "qadam": ValueError,
    "gtopk_with_sgd_momentum_correction": ValueError,
    "bf16_reduce_dtype": ValueError,  # a MixedPrecisionPolicy reducing in bf16 (param_dtype bf16, no reduce_dtype)
}


def _refused_attempt(case, net, opt, mesh):
    """The call ``case`` makes: a ShardedModel that must be refused."""
    build = bagua_lite.ShardedModel
    if case == "mesh_and_replicate_group":
        return build(net, opt, algorithm="gradient_allreduce", mesh=mesh, replicate_group=mesh.get_group("replicate"))
    if case == "neither_mesh_nor_group":
        return build(net, opt, algorithm="gradient_allreduce")
    if case in ("decentralized", "qadam"):
        return build(net, opt, algorithm=case, mesh=mesh)
    if case == "gtopk_with_sgd_momentum_correction":  # SGD with momentum 0.9, default momentum correction
        return build(net, opt, algorithm=bagua_lite.algorithm.build("gtopk", density=0.3), mesh=mesh)
    return build(net, opt, algorithm="gradient_allreduce", mesh=mesh)  # not_sharded, native_hsdp


def _sequence_numbers(groups):
    return [g._get_sequence_number_for_group() for g in groups]  # noqa: SLF001 - counts the collectives


def _r_refusal(rank, world, case):
    """(the exception's type and message; whether a group of the mesh saw a collective during the refused
    call; the control: whether one all_reduce then moves the counters, and its sum; whether the same net and
    optimizer then train under a valid ShardedModel as fresh ones do, or the error)."""
    from torch.distributed.device_mesh import init_device_mesh

    if case == "not_sharded":
        net, mesh = _net(), init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    elif case == "bf16_reduce_dtype":
        from torch.distributed.fsdp import MixedPrecisionPolicy
        net, mesh = _sharded(2, 2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    else:
        net, mesh = _sharded(2, 2, native=case == "native_hsdp")
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    groups = [dist.group.WORLD, mesh.get_group("replicate"), mesh.get_group("shard")]
    before = _sequence_numbers(groups)
    try:
        _refused_attempt(case, net, opt, mesh)
        error = (None, "not refused")
    except Exception as e:  # noqa: BLE001
        error = (type(e).__name__, str(e))
    traffic = _sequence_numbers(groups) != before
    probe = torch.ones(1)
    dist.all_reduce(probe)  # the group still works: every rank is in step
    counted = _sequence_numbers(groups) != before  # the control: a collective does move the counters
    retrained = None
    if case not in ("not_sharded", "native_hsdp", "bf16_reduce_dtype"):  # the refused model, handed over again
        mine, fresh = _train_gtopk(net, opt, mesh, rank), _train_gtopk(*_fresh_model_and_mesh(), rank)
        retrained = mine if isinstance(mine, str) else mine == fresh
    return error, traffic, counted, int(probe.item()), retrained


def _fresh_model_and_mesh():
    net, mesh = _sharded(2, 2)
    return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), mesh


def _train_gtopk(net, opt, mesh, rank):
    """Two steps under gtopk (momentum_correction=0): the full weights as lists (for ==), or the error."""
    relaxed = None
    try:
        relaxed = bagua_lite.ShardedModel(net, opt, algorithm=_algorithm(GTOPK), mesh=mesh)
        for x, y in _batches(rank, 2):
            _loss(net, x, y).backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    finally:
        _close(relaxed)
    return [w.flatten().tolist() for w in _full(net)]


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_come_before_any_traffic_on_every_rank(c4, case):
    for rank, (error, traffic, counted, probe, retrained) in enumerate(c4.run(_r_refusal, case)):
        assert error[0] == REFUSALS[case].__name__, (rank, error)
        assert "ShardedModel" in error[1] or "gtopk" in error[1], (rank, error)  # it names who refused
        assert counted and probe == 4, (rank, counted, probe)  # the group works (and the counters count)
        assert retrained in (None, True), (rank, retrained)
        assert not traffic, (rank, f"{case}: a collective ran before the refusal")
