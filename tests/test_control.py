"""Control traffic under a backend that carries device tensors only (NCCL), checked on a CPU machine.

NCCL refuses every CPU tensor ("No backend type associated with device type cpu"); the step agreement, the
config check, checkpoint flags, objects and step pairs are CPU tensors, so they must travel over the gloo
group that ``bagua_lite._control`` makes beside such a group. Two doubles stand in for NCCL here:

- a real process group whose backend is registered for CUDA only: it refuses CPU tensors exactly as NCCL
  does, and ``_control`` must see that and make the gloo group;
- ``BAGUA_LITE_CONTROL_GROUP=side`` plus a guard that refuses every CPU int64 tensor (what control messages
  are made of: the model here has no integer buffers, and data never is int64) on any group but a control
  group. Every algorithm trains under the guard, bit for bit as it does without it.
"""
import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import bagua_lite
from bagua_lite import _compat, _control

from algo_matrix import build_model, loss_of, pick, weights


def _device_only_backend(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)  # never reached with a CPU tensor


def _r_device_only_group(rank, P):
    if "cuda_only_double" not in dist.Backend.backend_list:
        dist.Backend.register_backend("cuda_only_double", _device_only_backend, devices=["cuda"])
    ranks = list(range(P))
    group = dist.new_group(ranks, backend="cuda_only_double")
    out = {"takes_cpu": _compat.takes_cpu_tensors(group), "world_takes_cpu": _compat.takes_cpu_tensors(dist.group.WORLD)}
    try:  # what NCCL answers for a CPU tensor, and what this double answers
        dist.all_reduce(torch.ones(1), group=group)
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
    try:
        _control.of(group)
        out["of_before_setup"] = None
    except RuntimeError as e:
        out["of_before_setup"] = str(e)
    control = _control.setup(group, ranks)
    out["same_again"] = _control.setup(group) is control and _control.of(group) is control
    out["side_is_gloo"] = _compat.backend_for(control, "cpu") == "gloo" and _control.is_side_group(control)
    mine = torch.tensor([rank, 10 * rank + 1], dtype=torch.int64)
    everyone = torch.empty(2 * P, dtype=torch.int64)
    _compat.all_gather_single(everyone, mine, group=_control.of(group))
    out["gathered"] = everyone.tolist()
    out["gloo_world_is_its_own"] = _control.of(dist.group.WORLD) is dist.group.WORLD
    _control.forget(group)
    return out


@pytest.mark.parametrize("P", [1, 3])
def test_a_device_only_group_gets_a_gloo_control_group(clusters, P):
    for r, out in enumerate(clusters.get(P).run(_r_device_only_group)):
        assert out["world_takes_cpu"] and not out["takes_cpu"], out
        assert "No backend type associated with device type cpu" in out["refused"], out
        assert "carries no CPU tensors and has no control group" in out["of_before_setup"], out
        assert out["same_again"] and out["side_is_gloo"] and out["gloo_world_is_its_own"], out
        assert out["gathered"] == [v for q in range(P) for v in (q, 10 * q + 1)], (r, out)


def test_control_group_mode_is_checked(monkeypatch):
    monkeypatch.setenv("BAGUA_LITE_CONTROL_GROUP", "sideways")
    with pytest.raises(ValueError, match=r"BAGUA_LITE_CONTROL_GROUP='sideways' is not allowed; choose one of auto, side"):
        _control.mode()


def test_compat_parses_versions():
    assert _compat.torch_version("2.11.0+cu130") == (2, 11)
    assert _compat.torch_version("2.13.0+cpu") == (2, 13)
    assert _compat.torch_version("3.0.1") == (3, 0)
    _compat.check_supported("2.11.0")
    with pytest.raises(ImportError, match=r"needs torch 2.11 or newer, found torch 2.10.1"):
        _compat.check_supported("2.10.1")


# ---- the guard: every algorithm, its control traffic on the control groups only ----------------------------
_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "reduce", "gather", "scatter", "send", "recv",
                "isend", "irecv", "all_gather_into_tensor", "all_gather_single", "all_to_all_single", "reduce_scatter_tensor")


class ControlOnDataGroup(AssertionError):
    pass


@contextlib.contextmanager
def _guard(counts):
    """Refuse a CPU int64 tensor on any group but a control group, as NCCL refuses any CPU tensor; count
    the control messages the control groups carried. Patches torch.distributed's functions (also the
    names torch's own object collectives call) and ProcessGroup's point-to-point methods."""
    def check(fn, tensors, group):
        group = dist.group.WORLD if group is None else group
        if not any(isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.device.type == "cpu" for t in tensors):
            return
        if _control.is_side_group(group):
            counts[fn] = counts.get(fn, 0) + 1
            return
        raise ControlOnDataGroup(f"{fn}: a CPU int64 tensor (control traffic) on a data group "
                                 f"{dist.get_process_group_ranks(group)}")

    def wrap(fn, original):
        def guarded(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            tensors += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            group = kwargs.get("group", next((a for a in args if isinstance(a, dist.ProcessGroup)), None))
            check(fn, tensors, group)
            return original(*args, **kwargs)
        return guarded

    def wrap_method(fn, original):
        def guarded(self, tensors, *args, **kwargs):
            check(fn, tensors, self)
            return original(self, tensors, *args, **kwargs)
        return guarded

    saved = []
    for module in (dist, c10d, _compat):
        for fn in _COLLECTIVES:
            if hasattr(module, fn):
                saved.append((module, fn, getattr(module, fn)))
                setattr(module, fn, wrap(fn, getattr(module, fn)))
    for fn in ("send", "recv"):
        saved.append((dist.ProcessGroup, fn, dist.ProcessGroup.__dict__[fn]))  # the raw descriptor, to put back
        setattr(dist.ProcessGroup, fn, wrap_method(f"ProcessGroup.{fn}", getattr(dist.ProcessGroup, fn)))
    try:
        yield
    finally:
        for owner, fn, original in reversed(saved):
            setattr(owner, fn, original)


ALGORITHMS = pick("dense", "uint8", "hierarchical", "topk", "gtopk", "powersgd", "qadam", "decentralized",
                  "decentralized_all", "low_precision_decentralized", "local_sgd", "streaming_diloco", "auto")


def _train(rank, name, options, steps=6):
    net, opt, model = build_model(name, options)
    for step in range(steps):
        loss_of(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    model.check_in_step("the test's final check")
    return model, opt, weights(net)


def _r_guarded(rank, P, names, ckpt_dir):
    out = {}
    for key in names:
        name, options = ALGORITHMS[key]
        model, _, plain = _train(rank, name, options)
        model.close()
        counts = {}
        os.environ["BAGUA_LITE_CONTROL_GROUP"] = "side"
        try:
            with _guard(counts):
                model, opt, guarded = _train(rank, name, options)
                if key == "dense":  # checkpoint flags and the config check are control traffic too
                    bagua_lite.save_checkpoint(os.path.join(ckpt_dir, "c"), model, opt, step=6)
                    bagua_lite.load_checkpoint(os.path.join(ckpt_dir, "c"), model, opt)
                model.close()
        finally:
            del os.environ["BAGUA_LITE_CONTROL_GROUP"]
            _control.forget(dist.group.WORLD)
        out[key] = {"same": torch.equal(plain, guarded), "counts": counts}
    return out


def _r_guard_catches(rank, P):
    with _guard({}):
        try:
            dist.all_reduce(torch.zeros(2, dtype=torch.int64))
        except ControlOnDataGroup as e:
            return str(e)
    return None


@pytest.mark.parametrize("P", [2, 3])
def test_every_algorithm_keeps_control_traffic_off_the_data_group(clusters, tmp_path, P):
    cluster = clusters.get(P)
    assert all("control traffic) on a data group" in e for e in cluster.run(_r_guard_catches))
    names = list(ALGORITHMS) if P == 3 else ["dense", "gtopk", "decentralized", "streaming_diloco"]
    for r, out in enumerate(cluster.run(_r_guarded, names, str(tmp_path), timeout=300)):
        for key in names:
            assert out[key]["same"], f"{key}, rank {r}: control traffic on its own group changed the result"
            assert out[key]["counts"], f"{key}, rank {r}: no control message went over the control group"


def _r_fault_tolerant_refused(rank, P):
    os.environ["BAGUA_LITE_CONTROL_GROUP"] = "side"
    try:
        net = torch.nn.Linear(4, 2)
        bagua_lite.DistributedModel(net, torch.optim.SGD(net.parameters(), lr=0.1), "gradient_allreduce",
                                    fault_tolerant=True)
    except ValueError as e:
        return str(e)
    finally:
        del os.environ["BAGUA_LITE_CONTROL_GROUP"]
        _control.forget(dist.group.WORLD)
    return None


def test_fault_tolerance_needs_a_group_that_carries_cpu_tensors(clusters):
    for msg in clusters.get(2).run(_r_fault_tolerant_refused):
        assert msg is not None and "fault_tolerant=True needs a process group that carries CPU tensors" in msg, msg
