"""The benchmark's configuration: the YAML matrix, validated before any process starts.

Keys (``CONFIG_KEYS``), besides world sizes, networks, models and step counts:

``algorithms``   entries ``name`` or ``{name: ..., <the algorithm's options>, label: ..., optimizer: ...}``.
                 ``optimizer`` (taken by the benchmark, never passed to the algorithm) is one of
                 ``sgd`` (default: SGD, lr 0.01, momentum 0.9), ``adam`` (Adam, lr 1e-3) or ``adamw``
                 (AdamW, lr 1e-3, weight decay 0.01); the DDP baselines take it too, so an algorithm that
                 needs Adam (qadam) is compared with ``{name: ddp, optimizer: adam}``. The compute floor
                 always uses SGD.
``stragglers``   a matrix axis, default ``[none]``; ``half``: rank 0 runs at half speed (see ``runner``).
"""

import yaml

from .zoo import MODELS

BASELINES = ("ddp", "ddp_fp16", "ddp_powersgd")
OPTIMIZERS = ("sgd", "adam", "adamw")  # per algorithm entry; see make_optimizer
STRAGGLERS = ("none", "half")  # the ``stragglers`` axis; see the module docstring
STRAGGLER_RANK = 0  # the rank that runs slow under ``half``
CONFIG_KEYS = ("world_sizes", "networks", "models", "algorithms", "steps", "warmup_steps", "batch_size",
               "bucket_size_mb", "project", "timeout_s", "min_cell_s", "max_steps", "stragglers")


# ---- configuration -----------------------------------------------------------------------------------------
def load_benchmark_config(path):
    import difflib

    with open(path) as f:
        cfg = yaml.safe_load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"benchmark config {path}: expected a mapping")
    for key in cfg:
        if key not in CONFIG_KEYS:
            near = difflib.get_close_matches(key, CONFIG_KEYS, n=1)
            raise ValueError(f"benchmark config: unknown key {key!r}" + (f"; did you mean {near[0]!r}?" if near else "")
                             + f" (allowed: {', '.join(CONFIG_KEYS)})")
    out = {"world_sizes": [4], "networks": ["loopback"], "models": ["mlp25m"], "steps": 5, "warmup_steps": 2,
           "batch_size": 32, "bucket_size_mb": 25.0, "project": [], "timeout_s": 900, "min_cell_s": 0.0,
           "max_steps": None, "stragglers": ["none"]}
    out.update(cfg)
    for key, lowest in (("steps", 1), ("warmup_steps", 0)):
        v = out[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < lowest:
            raise ValueError(f"benchmark config: {key} must be an int >= {lowest}, got {v!r}")
    if out["max_steps"] is None:
        out["max_steps"] = out["steps"]
    if not isinstance(out["max_steps"], int) or isinstance(out["max_steps"], bool) or out["max_steps"] < out["steps"]:
        raise ValueError(f"benchmark config: max_steps must be an int >= steps ({out['steps']}), "
                         f"got {out['max_steps']!r}")
    m = out["min_cell_s"]
    if not isinstance(m, (int, float)) or isinstance(m, bool) or m < 0:
        raise ValueError(f"benchmark config: min_cell_s must be a number of seconds >= 0, got {m!r}")
    stragglers = out["stragglers"]
    if not isinstance(stragglers, list) or not stragglers:
        raise ValueError(f"benchmark config: stragglers must be a non-empty list of {', '.join(STRAGGLERS)}, "
                         f"got {stragglers!r}")
    for s in stragglers:
        if not isinstance(s, str) or s not in STRAGGLERS:
            raise ValueError(f"benchmark config: unknown straggler condition {s!r} in stragglers; "
                             f"allowed: {', '.join(STRAGGLERS)}")
    if len(set(stragglers)) != len(stragglers):
        raise ValueError(f"benchmark config: stragglers lists a condition twice: {stragglers!r}")
    for p in out["world_sizes"]:
        if not isinstance(p, int) or p < 1:
            raise ValueError(f"benchmark config: world_sizes must be ints >= 1, got {p!r}")
    for m in out["models"]:
        if m not in MODELS:
            raise ValueError(f"benchmark config: unknown model {m!r}; known: {', '.join(MODELS)}")
    from . import netem

    for n in out["networks"]:
        if n not in netem.NETWORKS:
            raise ValueError(f"benchmark config: unknown network {n!r}; known: {', '.join(netem.NETWORKS)}")
    algs = []
    from .. import algorithms  # noqa: F401  (registers built-ins)
    from ..algorithm import build

    for entry in out.get("algorithms") or []:
        entry = {"name": entry} if isinstance(entry, str) else dict(entry)
        label = entry.pop("label", None)
        name = entry.pop("name")
        # the benchmark's own key, never an option of the algorithm
        optimizer = entry.pop("optimizer", "sgd")
        if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
            raise ValueError(f"benchmark config: algorithm {name!r}: unknown optimizer {optimizer!r}; "
                             f"allowed: {', '.join(OPTIMIZERS)}")
        if name == "ddp_powersgd":
            entry.setdefault("rank", 4)
        elif name not in BASELINES:
            build(name, **entry)  # validate now, before any process starts
        algs.append({"name": name, "options": entry, "optimizer": optimizer,
                     "label": label or _label(name, entry, optimizer)})
    if not algs:
        raise ValueError("benchmark config: 'algorithms' must list at least one algorithm")
    out["algorithms"] = algs
    return out


def _label(name, options, optimizer="sgd"):
    suffix = "" if optimizer == "sgd" else f"[{optimizer}]"
    if not options:
        return name + suffix
    short = ",".join(f"{k}={v}" for k, v in sorted(options.items()) if k not in ("warmup_densities",))
    return f"{name}({short}){suffix}"


def make_optimizer(kind, params):
    """The optimizer of a cell: ``sgd`` (lr 0.01, momentum 0.9), ``adam`` (lr 1e-3), ``adamw`` (lr 1e-3,
    torch's default weight decay 0.01)."""
    import torch

    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    raise ValueError(f"unknown optimizer {kind!r}; allowed: {', '.join(OPTIMIZERS)}")

