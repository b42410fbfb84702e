"""bagua_lite.bench.zoo: torchvision's layer layouts in plain torch.nn (torchvision does not import here).

The ImageNet variants must have exactly torchvision's published parameter counts; the CIFAR variants
run a 32x32 batch forward and backward, and train a step under DistributedModel (BatchNorm buffers and
all) at P = 2 with the replicas identical afterwards."""
import hashlib

import pytest
import torch
import torch.nn.functional as F

import bagua_lite
from bagua_lite.bench import zoo as models


@pytest.mark.parametrize("name, published", [("resnet18", 11_689_512), ("vgg16", 138_357_544)])
def test_imagenet_variants_match_torchvisions_parameter_counts(name, published):
    assert models.count_parameters(getattr(models, name)(num_classes=1000, cifar=False)) == published


@pytest.mark.parametrize("name, count", [("resnet18", 11_173_962), ("vgg16", 14_990_922)])
def test_cifar_variants_forward_and_backward(name, count):
    torch.manual_seed(0)
    net = getattr(models, name)()
    assert models.count_parameters(net) == count
    out = net(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


def _r_train(rank, P, name):
    torch.manual_seed(0)
    net = getattr(models, name)()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    model = bagua_lite.DistributedModel(net, opt, "gradient_allreduce")
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model.close()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("name", ["resnet18", "vgg16"])
def test_cifar_variants_train_under_distributed_model(clusters, name):
    assert len(set(clusters.get(2).run(_r_train, name, timeout=120))) == 1
