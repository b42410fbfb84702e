"""Real architectures for the benchmark, written in plain ``torch.nn`` (no torchvision: the wheel pip finds
next to our CPU torch is a CUDA build that does not import). The layer layouts are torchvision's; the
ImageNet variants reproduce torchvision's published parameter counts exactly (checked in the tests:
resnet18 11,689,512; vgg16 138,357,544), and the CIFAR variants (32x32 inputs) change only the stem or the
classifier, as is usual for CIFAR:

* ``resnet18(num_classes=10, cifar=True)``: 3x3 stride-1 stem, no max-pool (11,173,962 parameters).
* ``vgg16(num_classes=10, cifar=True)``: VGG-16's 13 conv layers (with batch norm) and a 512-512-10
  classifier: 14,990,922 parameters, the communication-heavy case of the gTop-k paper (15.0M).

Weights are random (seeded by the caller); nothing is downloaded.
"""
import torch
from torch import nn

__all__ = ["resnet18", "vgg16", "count_parameters"]


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with an identity (or 1x1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 10, cifar: bool = True):
        super().__init__()
        if cifar:  # 32x32 inputs: a 3x3 stride-1 stem and no max-pool keep the 4x4 maps at the end
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nn.Module):
    def __init__(self, num_classes: int = 10, cifar: bool = True, batch_norm: bool = None):
        super().__init__()
        batch_norm = cifar if batch_norm is None else batch_norm
        layers, cin = [], 3
        for v in _VGG16:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            layers += [nn.Conv2d(cin, v, 3, padding=1)] + ([nn.BatchNorm2d(v)] if batch_norm else []) + [nn.ReLU()]
            cin = v
        self.features = nn.Sequential(*layers)
        if cifar:  # 32x32 -> 1x1x512 after five pools
            self.classifier = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, num_classes))
        else:      # torchvision's: 7x7x512 -> 4096 -> 4096 -> classes, with dropout
            self.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Dropout(),
                                            nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(), nn.Linear(4096, num_classes))
        self.cifar = cifar

    def forward(self, x):
        x = self.features(x)
        if not self.cifar:
            x = nn.functional.adaptive_avg_pool2d(x, 7)
        return self.classifier(torch.flatten(x, 1))


def resnet18(num_classes: int = 10, cifar: bool = True) -> nn.Module:
    return ResNet18(num_classes, cifar)


def vgg16(num_classes: int = 10, cifar: bool = True) -> nn.Module:
    return VGG16(num_classes, cifar)


# ---- the benchmark's models, by name ---------------------------------------------------------------------------
MODELS = ("mlp25m", "cnn", "mlp_small", "resnet18", "vgg16")
_MODEL_CACHE = {}


def fresh_model(name):
    """make_model(name), built once per process and deep-copied after: a 25M-parameter init takes a while."""
    import copy

    if name not in _MODEL_CACHE:
        _MODEL_CACHE[name] = make_model(name)
    net, shape = _MODEL_CACHE[name]
    return copy.deepcopy(net), shape


def make_model(name, seed=0):
    import torch

    torch.manual_seed(seed)
    nn = torch.nn
    if name == "mlp25m":  # communication-heavy: 25.2M parameters, little compute per byte
        return nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048), nn.ReLU(),
                             nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 10)), (2048,)
    if name == "mlp_small":  # for quick runs and tests
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)), (256,)
    if name == "cnn":  # compute-heavy: ~0.3M parameters, many FLOPs per byte
        return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(128, 10)), (3, 32, 32)
    if name in ("resnet18", "vgg16"):  # real architectures at CIFAR size (bagua_lite.bench.zoo): 11.2M / 15.0M
        return globals()[name](num_classes=10, cifar=True), (3, 32, 32)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")

