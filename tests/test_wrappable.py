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
        bagua_lite.DistributedModel(module, torch.optim.SGD(_net().parameters(), lr=0.1)).close()
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
    check_wrappable(_net())
    with pytest.raises(TypeError, match="got int"):
        check_wrappable(3)
