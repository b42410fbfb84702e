"""Real architectures for the benchmark, written in plain ``torch.nn`` (no torchvision: the wheel pip finds
next to our CPU torch is a CUDA build that does not import). The layer layouts are torchvision's; the
ImageNet variants reproduce torchvision's published parameter counts exactly (checked in the tests:
resnet18 11,689,512; vgg16 138,357,544), and the CIFAR variants (32x32 inputs) change only the stem or the
classifier, as is usual for CIFAR:

* ``resnet18(num_classes=10, cifar=True)``: 3x3 stride-1 stem, no max-pool (11,173,962 parameters).
* ``vgg16(num_classes=10, cifar=True)``: VGG-16's 13 conv layers (with batch norm) and a 512-512-10
  classifier: 14,990,922 parameters, the communication-heavy case of the gTop-k paper (15.0M).

* ``gpt(vocab, seq_len, d_model, layers, heads)``: a GPT-style decoder-only language model (token and
  position embeddings, pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, a final LayerNorm
  and an LM head tied to the token embedding). ``gpt_small`` in the benchmark is vocab 256, 64 tokens,
  d_model 256, 4 layers, 4 heads: 3,241,472 parameters, ``gpt_parameters`` gives the closed form.

* ``hf_gpt2``: Hugging Face's ``GPT2LMHeadModel`` built locally from a ``GPT2Config`` of gpt_small's size
  (vocab 256, 64 positions, d_model 256, 4 layers, 4 heads, no dropout: 3,241,472 parameters, the same
  count), on the same Markov task. Needs the optional ``transformers`` package (the ``transformers``
  extra); the benchmark skips the model with a one-line note without it.

Weights are random (seeded by the caller); nothing is downloaded.
"""
import torch
from torch import nn

__all__ = ["resnet18", "vgg16", "gpt", "gpt_parameters", "count_parameters"]


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


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which a position sees itself and the positions before it."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"gpt: d_model ({d_model}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GPTBlock(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids (batch, seq) -> next-token logits (batch, seq, vocab)."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, layers: int, heads: int):
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.Sequential(*[GPTBlock(d_model, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one (vocab, d_model) matrix embeds and predicts
        for m in self.modules():  # GPT-2's initialisation: N(0, 0.02) weights, zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx):
        if idx.shape[1] > self.seq_len:
            raise ValueError(f"gpt: sequence of {idx.shape[1]} tokens, longer than seq_len {self.seq_len}")
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos(pos))))


def gpt(vocab: int = 256, seq_len: int = 64, d_model: int = 256, layers: int = 4, heads: int = 4) -> nn.Module:
    return GPT(vocab, seq_len, d_model, layers, heads)


def gpt_parameters(vocab: int, seq_len: int, d_model: int, layers: int) -> int:
    """The closed form of ``count_parameters(gpt(...))``: embeddings (the LM head is tied to the token
    embedding), per block two LayerNorms (4d), qkv (3d^2 + 3d), output projection (d^2 + d) and the MLP
    (4d^2 + 4d + 4d^2 + d), i.e. 12d^2 + 13d, and the final LayerNorm (2d)."""
    d = d_model
    return vocab * d + seq_len * d + layers * (12 * d * d + 13 * d) + 2 * d


# ---- the benchmark's models, by name ---------------------------------------------------------------------------
MODELS = ("mlp25m", "cnn", "mlp_small", "mlp_digits", "resnet18", "vgg16", "gpt_small", "hf_gpt2")
#: models that need an optional package: name -> (module to import, how to install it)
OPTIONAL_MODELS = {"hf_gpt2": ("transformers", "pip install transformers --no-deps and its light dependencies "
                                               "(huggingface_hub, tokenizers, safetensors, regex, tqdm, typer), "
                                               "or the bagua_lite[transformers] extra")}


def optional_model_missing(name):
    """Why ``name`` cannot be built here (its optional package is not installed), or None."""
    import importlib.util

    if name not in OPTIONAL_MODELS:
        return None
    module, how = OPTIONAL_MODELS[name]
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed ({how})"
    return None


class HFGPT2(nn.Module):
    """Hugging Face's GPT-2 (``transformers.GPT2LMHeadModel``) from a local config: token ids (batch, seq) ->
    next-token logits (batch, seq, vocab), as ``GPT``. No download: the config is built here."""

    def __init__(self, vocab: int = 256, seq_len: int = 64, d_model: int = 256, layers: int = 4, heads: int = 4):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel  # lazy: transformers is optional
        from transformers.utils import logging as hf_logging  # lazy: transformers is optional

        hf_logging.set_verbosity_error()
        config = GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=d_model, n_layer=layers, n_head=heads,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                            use_cache=False)
        self.gpt2 = GPT2LMHeadModel(config)

    def forward(self, idx):
        return self.gpt2(input_ids=idx, use_cache=False).logits


class InputSpec:
    """What a model eats: float tensors of ``shape`` per sample, or (``vocab`` set) token ids of length
    ``shape[0]`` whose targets are the next tokens. ``task`` names its convergence task (bench.data)."""

    def __init__(self, shape, vocab=None, task="teacher"):
        self.shape, self.vocab, self.task = tuple(shape), vocab, task

    def __repr__(self):
        return f"InputSpec(shape={self.shape}, vocab={self.vocab}, task={self.task!r})"


_MODEL_CACHE = {}


def fresh_model(name, seed=0):
    """make_model(name, seed), built once per process and deep-copied after: a 25M-parameter init takes a while."""
    import copy

    if (name, seed) not in _MODEL_CACHE:
        _MODEL_CACHE[name, seed] = make_model(name, seed)
    net, spec = _MODEL_CACHE[name, seed]
    return copy.deepcopy(net), spec


def make_mlp(seed=0):
    """The digits MLP of the demo and the convergence benchmark (64 -> 128 -> 64 -> 10)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def make_model(name, seed=0):
    """(module, InputSpec) of a benchmark model, with weights from ``seed``."""
    torch.manual_seed(seed)
    if name == "mlp25m":  # communication-heavy: 25.2M parameters, little compute per byte
        return nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048), nn.ReLU(),
                             nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 10)), InputSpec((2048,))
    if name == "mlp_small":  # for quick runs and tests
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)), InputSpec((256,))
    if name == "mlp_digits":  # the demo's MLP on scikit-learn's digits (8x8 images, 10 classes): 17,226 parameters
        return make_mlp(seed), InputSpec((64,), task="digits")
    if name == "cnn":  # compute-heavy: ~0.3M parameters, many FLOPs per byte
        return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(128, 10)), InputSpec((3, 32, 32))
    if name in ("resnet18", "vgg16"):  # real architectures at CIFAR size: 11.2M / 15.0M
        return globals()[name](num_classes=10, cifar=True), InputSpec((3, 32, 32))
    if name == "gpt_small":  # the Adam/AdamW case (qadam): 3.2M parameters, 64-token sequences
        return gpt(vocab=256, seq_len=64, d_model=256, layers=4, heads=4), InputSpec((64,), vocab=256, task="markov")
    if name == "hf_gpt2":  # the same size and task through Hugging Face's implementation (optional package)
        why = optional_model_missing(name)
        if why:
            raise ValueError(f"model hf_gpt2: {why}")
        return HFGPT2(vocab=256, seq_len=64, d_model=256, layers=4, heads=4), InputSpec((64,), vocab=256, task="markov")
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
