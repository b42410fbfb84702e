"""What DistributedModel refuses to wrap, on every rank before any traffic (P = 2, gloo): a model sharded with
FSDP2's fully_shard (DTensor parameters: every algorithm exchanges whole tensors), a model that is or holds
a DistributedDataParallel (gradients would be averaged twice), an embedding with sparse gradients that trains
(the buckets are dense), and what is not a module at all. After the refusals the group still works: a plain
model then trains, and so does one whose sparse embedding is frozen. A DistributedModel itself cannot be copied
or pickled (deepcopy, torch.save, swa_utils.AveragedModel), with an error that says what to copy instead."""
import copy as copy_module
import io

import pytest
import torch

import bagua_lite
from cluster import Cluster


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _refused(make):
    try:
        module = make()
        params = module.parameters() if isinstance(module, torch.nn.Module) else _net().parameters()
        bagua_lite.DistributedModel(module, torch.optim.SGD(params, lr=0.1)).close()
        return None
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"


def _r_refusals(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def sharded():
        net = _net()
        fully_shard(net[0], mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net

    out = {
        "fsdp2": _refused(sharded),
        "ddp": _refused(lambda: torch.nn.parallel.DistributedDataParallel(_net())),
        "ddp_inside": _refused(lambda: torch.nn.Sequential(torch.nn.parallel.DistributedDataParallel(_net()))),
        "ours_inside": _refused(lambda: torch.nn.Sequential(
            bagua_lite.DistributedModel(n := _net(), torch.optim.SGD(n.parameters(), lr=0.1)))),
        "not_a_module": _refused(lambda: _net().parameters()),
        "sparse_embedding": _refused(lambda: torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4, sparse=True), _net())),
        "frozen_sparse_embedding": _refused(lambda: torch.nn.Sequential(
            torch.nn.EmbeddingBag(10, 4, sparse=True).requires_grad_(False), _net())),
    }
    net = _net()  # the group is still in step: a plain model trains
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = bagua_lite.DistributedModel(net, opt)
    for what, copy in (("deepcopy", copy_module.deepcopy), ("torch.save", lambda m: torch.save(m, io.BytesIO())),
                       ("AveragedModel", torch.optim.swa_utils.AveragedModel)):
        try:
            copy(model)
        except TypeError as e:
            out[what] = str(e)
    swa = torch.optim.swa_utils.AveragedModel(model.module)  # what the refusal says to do instead
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    swa.update_parameters(model.module)
    model.close()
    out["trained"] = [p.detach().clone() for p in net.parameters()]
    out["averaged"] = [p.detach().clone() for p in swa.module.parameters()]
    return out


def test_sharded_and_doubly_wrapped_models_are_refused_on_every_rank():
    c = Cluster(2)
    try:
        res = c.run(_r_refusals, timeout=120)
    finally:
        c.close()
    for r, o in enumerate(res):
        assert o["fsdp2"] and o["fsdp2"].startswith("ValueError: DistributedModel: parameter '0.weight' is a DTensor") \
            and "bagua_lite.ShardedModel(" in o["fsdp2"] and "2-D" in o["fsdp2"], o["fsdp2"]
        assert o["ddp"] and "the module itself is a DistributedDataParallel" in o["ddp"] \
            and "average every gradient twice" in o["ddp"], o["ddp"]
        assert o["ddp_inside"] and "its submodule '0' is a DistributedDataParallel" in o["ddp_inside"], o["ddp_inside"]
        assert o["ours_inside"] and "its submodule '0' is a DistributedModel" in o["ours_inside"], o["ours_inside"]
        assert o["not_a_module"] and o["not_a_module"].startswith("TypeError: DistributedModel: module must be a "
                                                                   "torch.nn.Module, got generator"), o["not_a_module"]
        assert o["sparse_embedding"] and o["sparse_embedding"].startswith(
            "ValueError: DistributedModel: submodule '0' is EmbeddingBag(..., sparse=True)") \
            and "sparse=False" in o["sparse_embedding"], o["sparse_embedding"]
        assert o["frozen_sparse_embedding"] is None, o["frozen_sparse_embedding"]
        for what in ("deepcopy", "torch.save", "AveragedModel"):  # it said: cannot pickle ProcessGroup
            assert "a DistributedModel cannot be copied or pickled" in o.get(what, ""), (what, o.get(what))
            assert "AveragedModel(model.module)" in o[what], o[what]
        # swa_utils averages the first update in as the weights themselves
        assert all(torch.equal(a, b) for a, b in zip(o["averaged"], o["trained"])), r
    assert all(torch.equal(a, b) for a, b in zip(res[0]["trained"], res[1]["trained"]))


def test_a_plain_module_is_not_refused():
    from bagua_lite.wrappable import check_wrappable
    net = _net()
    check_wrappable(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="got int"):
        check_wrappable(3, None)


def _r_owned(rank, world):
    torch.manual_seed(0)
    net = _net()
    temperature = torch.nn.Parameter(torch.ones(()))  # a learnable scale kept beside the model, not in it
    out = {}

    def refusal(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None
    out["outside"] = refusal(lambda: bagua_lite.DistributedModel(
        net, torch.optim.SGD(list(net.parameters()) + [temperature], lr=0.1)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = bagua_lite.DistributedModel(net, opt)
    out["twice"] = refusal(lambda: bagua_lite.DistributedModel(net, torch.optim.SGD(net.parameters(), lr=0.1)))
    opt.add_param_group({"params": [temperature]})
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    (model(x) * temperature).square().mean().backward()
    before = [p.detach().clone() for p in net.parameters()]
    out["added"] = refusal(opt.step)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, net.parameters())) and float(temperature) == 1.0
    model.close()
    again = bagua_lite.DistributedModel(net, torch.optim.SGD(net.parameters(), lr=0.1))  # closed: wrapped again
    again.close()
    return out


def test_what_the_optimizer_steps_is_what_the_model_averages(clusters):
    """A parameter the optimizer steps outside the wrapped module (a learnable temperature kept beside the model,
    a param group added later) trained on each rank alone: 0.874 and 0.858 on two ranks after three steps in a
    reproduction, without a word (as under DDP). The same module wrapped twice ran both models' hooks. Each is
    refused before anything changes, naming what to do; a module whose model was closed wraps again."""
    for out in clusters.get(2).run(_r_owned):
        assert out["outside"] is not None and "not in the wrapped module" in out["outside"], out["outside"]
        assert "param group 0, shape []" in out["outside"], out["outside"]
        assert out["twice"] is not None and "already wrapped by an open DistributedModel" in out["twice"], out["twice"]
        assert out["added"] is not None and "param group 1, shape []" in out["added"], out["added"]
        assert out["unchanged"]
