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


# ---- the GPT-style language model (gpt_small in the benchmark) -----------------------------------------------
@pytest.mark.parametrize("vocab, seq, d, layers, heads", [(256, 64, 256, 4, 4), (100, 16, 32, 2, 4), (50, 8, 24, 3, 3)])
def test_gpt_parameter_count_is_the_closed_form(vocab, seq, d, layers, heads):
    net = models.gpt(vocab, seq, d, layers, heads)
    assert models.count_parameters(net) == models.gpt_parameters(vocab, seq, d, layers)
    assert net.head.weight is net.tok.weight  # tied: the LM head adds no parameters
    # counting every module's own parameters counts the shared matrix twice
    assert sum(p.numel() for m in net.modules() for p in m.parameters(recurse=False)) == (
        models.gpt_parameters(vocab, seq, d, layers) + vocab * d)


def test_gpt_small_is_the_benchmarks_3m_model():
    net, spec = models.make_model("gpt_small")
    assert models.count_parameters(net) == 3_241_472 == 256 * 256 + 64 * 256 + 4 * (12 * 256**2 + 13 * 256) + 2 * 256
    assert spec.vocab == 256 and spec.shape == (64,) and spec.task == "markov"
    out = net(torch.randint(0, 256, (2, 64)))
    assert out.shape == (2, 64, 256)


def test_gpt_is_causal():
    torch.manual_seed(0)
    net = models.gpt(64, 16, 32, 2, 4).eval()
    x = torch.randint(0, 64, (1, 16))
    y = x.clone()
    y[0, 10] = (x[0, 10] + 1) % 64  # change one token: logits before it must not move, at and after it must
    a, b = net(x), net(y)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:], atol=1e-4)


def test_gpt_learns_the_markov_task():
    from bagua_lite.bench import data

    torch.manual_seed(0)
    net = models.gpt(vocab=256, seq_len=32, d_model=64, layers=2, heads=4)
    task = data.make_task(models.InputSpec((32,), vocab=256, task="markov"), 0, 1, 16, 64)
    acc0, loss0 = data.evaluate(net, task)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    for s in range(80):
        x, y = task.batch(s)
        data.loss_fn(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    acc, loss = data.evaluate(net, task)
    # from a uniform guess (log 256 = 5.5 nats) towards the chain's entropy rate (about 1 nat)
    assert loss0 > 5.0 and loss < 0.6 * loss0 and acc > 0.2 > acc0, (loss0, loss, acc0, acc)


def _r_train_gpt(rank, P):
    torch.manual_seed(0)
    net = models.gpt(vocab=64, seq_len=16, d_model=32, layers=2, heads=4)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    model = bagua_lite.DistributedModel(net, opt, "gradient_allreduce")
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randint(0, 64, (4, 17), generator=g)
        F.cross_entropy(model(x[:, :-1]).reshape(-1, 64), x[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    model.close()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()


def test_gpt_with_tied_weights_trains_under_distributed_model(clusters):
    assert len(set(clusters.get(2).run(_r_train_gpt, timeout=120))) == 1
