"""The benchmark's configuration: the YAML matrix, validated before any process starts.

Keys (``CONFIG_KEYS``), besides world sizes, networks, models and step counts:

``algorithms``   entries ``name`` or ``{name: ..., <the algorithm's options>, label: ..., optimizer: ...}``.
                 ``optimizer`` (taken by the benchmark, never passed to the algorithm) is one of
                 ``sgd`` (default: SGD, lr 0.01, momentum 0.9), ``adam`` (Adam, lr 1e-3) or ``adamw``
                 (AdamW, lr 1e-3, weight decay 0.01); the DDP baselines take it too, so an algorithm that
                 needs Adam (qadam) is compared with ``{name: ddp, optimizer: adam}``. The compute floor
                 always uses SGD. ``lr`` in an entry (also the benchmark's) is that row's learning rate,
                 over the config's ``lr``: a row tuned on its own (a sparsifier under Adam, whose
                 per-element steps shrink with the density, wants a larger rate) says so in its label.
``stragglers``   a matrix axis, default ``[none]``; ``half``: rank 0 runs at half speed (see ``runner``).
``lr``           the learning rate of every cell's optimizer (default: 0.01 for sgd, 1e-3 for adam/adamw).
``floor_each_cell`` where the compute floor (the same step without communication, SGD,
                 ``warmup_steps`` + max(8, ``steps``) steps) is measured. Default false: once in every
                 repeat, in the middle of the repeat's list of cells (``runner.rotation``), so no row is
                 more than half a repeat away in time from the floor it divides by (its repeat's) and a
                 machine whose speed drifts (steal time on a shared VM) moves both alike. It costs about
                 one cheap cell per repeat. True: right before every cell instead, and that cell divides by it:
                 the nearest in time, at the cost of one floor per cell (about doubling a run of cheap
                 cells).
``repeats``      run the whole list of algorithms this many times in a row (default 1: A B C; 2: A B C A B
                 C), in the same processes, each repeat with its own floor; a row pools its cell's steps over
                 the repeats (its s/step is the median of all of them, its floor the median of its repeats'
                 floors) and lists each repeat's own s/step and x floor, so an order effect (the first cell
                 of a run measured slower) or a slow minute of the machine weighs one repeat, not the
                 figure. With one floor in the whole run per model and P (repeats 1, one network) a drift
                 of the machine's speed cannot be told from the floors; with several, floors further apart
                 than ``report.DRIFT_LIMIT`` (1.25x) make the table and the plot say the machine's speed
                 moved, and a row faster than its floor is marked (``!``) whatever the spread.

``mode``         ``throughput`` (default: seconds per step over a few timed steps) or ``convergence``:
                 every algorithm trains the model's task (``bench.data``) from the same seed until the
                 held-out ``metric`` reaches ``target`` or the budget runs out. Convergence keys:
``metric``       ``accuracy`` (default; the target is reached at >= target) or ``loss`` (held-out
                 cross-entropy; reached at <= target).
``target``       the number to reach (required; accuracy in (0, 1], loss > 0).
``max_steps``    the step budget (required in convergence mode).
``time_budget_s`` a training-time budget per cell in seconds (optional; checked at each evaluation).
``eval_every``   steps between evaluations (default 20); the time to target is known to this resolution.
``eval_samples`` size of the held-out set of the synthetic tasks (default 512; digits has its own 359).
``seed``         the seed of the weights and of the task's data (default 0; the same for every cell).
``seeds``        instead of ``seed``, a list of seeds: every cell runs once per seed, and the tables, the
                 plot's ranking and auto's score take the median over seeds (time to target of a seed
                 that never reached it counts as infinite), so a gap that is one trajectory's noise does
                 not decide. The JSON/CSV keep one row per seed.
``stop_at_target`` stop a cell at the evaluation that reaches the target (default true); false trains
                 every cell for the whole budget, so ``final_metric`` compares algorithms at equal steps.
``project_time`` (convergence mode, default false) project the time to target instead of training on
                 every throttled link: every cell trains once, on loopback (unthrottled), which gives its
                 steps to target and its curve; then, on each other network of ``networks``, a timing run
                 measures its seconds per step over whole cycles of the algorithm (the throughput mode's
                 machinery), and time to target = steps to target x that s/step. Valid only for algorithms
                 whose trajectory does not depend on timing: an asynchronous one (async_model_average) and
                 ``auto`` (its pick depends on the network) are refused, and so is a sparse density
                 schedule. An algorithm with ``warmup_steps`` > 0 is timed in both phases (the warm-up's
                 steps count at its s/step, the rest at the s/step after it). The table says "PROJECTED".
``timing_steps`` (with ``project_time``) measured steps per cell in a timing run, at least, rounded up to
                 whole cycles and at least two cycles (default 6).
``timing_warmup_steps`` (with ``project_time``) unmeasured steps before them (default 2).
``timing_repeats`` (with ``project_time``) time the whole list of algorithms this many times in a row on
                 each throttled network (default 1; 3: A B C A B C A B C), in the same processes; a row's
                 s/step (and bytes per step) is the median over the repeats of each repeat's own figure
                 (``report.project_records``), so a slow minute of a shared machine or an order effect
                 weighs one repeat, not the projection; the row lists each repeat's s/step.
``shards``       ranks per replica (default 1: every rank holds the whole model). > 1: every cell's model is
                 sharded with FSDP2 (``fully_shard``) over that many consecutive ranks and replicated over
                 world / shards (HSDP; ``cells.wrap_sharded``); it must divide every world size. The rows
                 allowed then: the baseline ``hsdp`` (FSDP2's own HSDP: ``fully_shard`` over the 2-D mesh,
                 no bagua_lite) and our algorithms that run on shards (``bagua_lite.ShardedModel``;
                 topk/gtopk under SGD with momentum_correction 0). The DDP baselines and torchft's DiLoCo
                 train whole models and are refused, as ``hsdp`` is with shards 1. Mode convergence only:
                 throughput mode's compute floor, bucket plan and cost-model predictions describe a whole
                 model on every rank. The ``MB/step`` figures are the bytes crossing replicas (FSDP2's
                 own traffic inside a replica is not counted by bagua_lite's counter).
``ranks_per_node`` consecutive ranks per emulated node (default 1). > 1: on an emulated link a node is one
                 network namespace holding that many ranks, which talk to each other over the namespace's
                 own loopback (not rate-limited), while traffic between nodes crosses the node's
                 rate-limited veth, shared by its ranks (``runner.launch``); it must divide every world
                 size. The link's byte counter is then the node's, divided by ``ranks_per_node``. With
                 ``shards`` > 1 a node of ``shards`` ranks holds one replica: FSDP2's per-step gathers stay
                 inside it, and only what crosses replicas pays the slow link.
``fsdp_units``   (with ``shards`` > 1) what ``fully_shard`` wraps, for every row alike: ``blocks`` (default: each
                 transformer block, or top-level child, a unit of its own, then the root; forward and
                 backward gather one block at a time, as FSDP2's examples shard) or ``root`` (the whole
                 model one unit: one gather and one reduce-scatter per pass, ZeRO-2/3 without per-block
                 overlap).
``reshard_after_forward`` (with ``shards`` > 1) FSDP2's option of that name for every unit and row (default
                 true, FSDP2's: gather again in backward; false: keep the gathered weights from forward
                 to backward, one all-gather per step instead of two, at the memory of the whole unit).
The ``ddp_topk_hook``, ``ddp_gtopk_hook`` (option ``density``, default 0.001) and ``ddp_compressed_hook`` (option
``compression``, default minmax_uint8) baselines are DDP with ``bagua_lite.hooks``' hook of that name (the
optimizer's SGD momentum acts on the averaged sparse gradient: no momentum correction under a hook).
The ``torchft_diloco`` baseline (optional: needs ``pip install torchft==0.2.0 --no-deps`` and its
opentelemetry dependencies, the ``torchft`` extra) is torchft's DiLoCo (``torchft.local_sgd.DiLoCo``) with
its Manager and lighthouse, options ``period`` (H, default 500), ``outer_optimizer`` (default SGD lr 0.7,
Nesterov momentum 0.9), ``fragments``, ``fragment_sync_delay``, ``fragment_update_alpha`` (torchft's
streaming options); without torchft the row is skipped with a one-line note. The model ``hf_gpt2``
(Hugging Face's GPT-2 built from a small config) needs the ``transformers`` extra, and is skipped the
same way without it.

The throughput-only keys (``steps``, ``min_cell_s``, ``warmup_steps``, ``stragglers``, ``project``,
``floor_each_cell``, ``repeats``) are
refused in convergence mode, and the convergence keys in throughput mode.
"""
import difflib
import os

import yaml

from .. import algorithms  # noqa: F401  (registers built-ins)
from .. import hooks
from ..algorithm import build
from ..algorithms.diloco import outer_optimizer_class
from ..config import shipped_configs, shipped_path
from ..sharded import on_shards
from . import netem, zoo
from .gpu_step import check_step_config

# DDP with one of bagua_lite.hooks' communication hooks: name -> (hook, its state's one option)
HOOK_BASELINES = {"ddp_topk_hook": ("topk_hook", "density"), "ddp_gtopk_hook": ("gtopk_hook", "density"),
                  "ddp_compressed_hook": ("compressed_hook", "compression")}
#: FSDP2's own HSDP (fully_shard over the 2-D (replicate, shard) mesh): the reference of sharded cells
SHARDED_BASELINES = ("hsdp",)
BASELINES = ("ddp", "ddp_fp16", "ddp_powersgd", *HOOK_BASELINES, "torchft_diloco", *SHARDED_BASELINES)
TORCHFT_OPTIONS = ("period", "outer_optimizer", "fragments", "fragment_sync_delay", "fragment_update_alpha")
OPTIMIZERS = ("sgd", "adam", "adamw")  # per algorithm entry; see make_optimizer
STRAGGLERS = ("none", "half")  # the ``stragglers`` axis; see the module docstring
STRAGGLER_RANK = 0  # the rank that runs slow under ``half``
MODES = ("throughput", "convergence", "step")  # step: gpu_step's table, one process (configs/benchmark_gpu.yaml)
FSDP_UNITS = ("blocks", "root")  # the ``fsdp_units`` key; see cells.shard_units
METRICS = ("accuracy", "loss")
THROUGHPUT_KEYS = ("steps", "warmup_steps", "min_cell_s", "stragglers", "project", "floor_each_cell", "repeats")
CONVERGENCE_KEYS = ("target", "metric", "time_budget_s", "eval_every", "eval_samples", "stop_at_target", "seed",
                    "seeds", "project_time", "timing_steps", "timing_warmup_steps", "timing_repeats")
CONFIG_KEYS = ("mode", "world_sizes", "networks", "models", "algorithms", "batch_size", "bucket_size_mb",
               "timeout_s", "max_steps", "lr", "shards", "ranks_per_node", "fsdp_units", "reshard_after_forward"
               ) + THROUGHPUT_KEYS + CONVERGENCE_KEYS


# ---- configuration -----------------------------------------------------------------------------------------
def load_benchmark_config(path):
    """Read and check a benchmark config: a file, or a shipped one by name (``benchmark_lm``)."""
    if not os.path.isfile(path):
        shipped = shipped_path(path, benchmark=True)
        if shipped is None:
            raise FileNotFoundError(f"benchmark config: no such file {path!r}, and no shipped benchmark config of "
                                    f"that name (shipped: {', '.join(shipped_configs(benchmark=True))})")
        path = str(shipped)
    with open(path) as f:
        cfg = yaml.safe_load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"benchmark config {path}: expected a mapping")
    if cfg.get("mode") == "step":
        return check_step_config(cfg)
    for key in cfg:
        if key not in CONFIG_KEYS:
            near = difflib.get_close_matches(key, CONFIG_KEYS, n=1)
            raise ValueError(f"benchmark config: unknown key {key!r}" + (f"; did you mean {near[0]!r}?" if near else "")
                             + f" (allowed: {', '.join(CONFIG_KEYS)})")
    mode = cfg.get("mode", "throughput")
    if mode not in MODES:
        raise ValueError(f"benchmark config: unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    wrong = [k for k in cfg if k in (CONVERGENCE_KEYS if mode == "throughput" else THROUGHPUT_KEYS)]
    if wrong:
        other = "convergence" if mode == "throughput" else "throughput"
        raise ValueError(f"benchmark config: {wrong[0]!r} is a key of mode {other}, not of mode {mode} "
                         f"(mode {mode} takes: {', '.join(k for k in CONFIG_KEYS if k not in (CONVERGENCE_KEYS if mode == 'throughput' else THROUGHPUT_KEYS))})")
    if mode == "convergence":
        _check_convergence(cfg)
    out = {"mode": "throughput", "lr": None, "world_sizes": [4], "networks": ["loopback"], "models": ["mlp25m"], "steps": 5, "warmup_steps": 2,
           "batch_size": 32, "bucket_size_mb": 25.0, "project": [], "timeout_s": 900, "min_cell_s": 0.0,
           "max_steps": None, "stragglers": ["none"], "floor_each_cell": False, "repeats": 1, "shards": 1,
           "ranks_per_node": 1, "fsdp_units": "blocks", "reshard_after_forward": True}
    if mode == "convergence":
        out.update(metric="accuracy", eval_every=20, eval_samples=512, time_budget_s=None, stop_at_target=True, seed=0,
                   project_time=False, timing_steps=6, timing_warmup_steps=2, timing_repeats=1)
    out.update(cfg)
    if mode == "convergence":
        out["seeds"] = list(cfg.get("seeds", [out["seed"]]))
        out["seed"] = out["seeds"][0]
    lr = out["lr"]
    if lr is not None and (not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr <= 0):
        raise ValueError(f"benchmark config: lr must be a number > 0 (or absent: the optimizer's default), got {lr!r}")
    for key, lowest in (("steps", 1), ("warmup_steps", 0), ("repeats", 1)):
        v = out[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < lowest:
            raise ValueError(f"benchmark config: {key} must be an int >= {lowest}, got {v!r}")
    if out["max_steps"] is None:
        out["max_steps"] = out["steps"]
    if mode == "convergence":
        out["steps"] = 1  # the step budget is max_steps
    if not isinstance(out["max_steps"], int) or isinstance(out["max_steps"], bool) or out["max_steps"] < out["steps"]:
        raise ValueError(f"benchmark config: max_steps must be an int >= steps ({out['steps']}), "
                         f"got {out['max_steps']!r}")
    if not isinstance(out["floor_each_cell"], bool):
        raise ValueError(f"benchmark config: floor_each_cell must be true or false, got {out['floor_each_cell']!r}")
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
    _check_layout(out)
    skipped = []  # one-line notes: optional rows and models whose package is not installed
    for m in out["models"]:
        if m not in zoo.MODELS:
            raise ValueError(f"benchmark config: unknown model {m!r}; known: {', '.join(zoo.MODELS)}")
    models = []
    for m in out["models"]:
        why = zoo.optional_model_missing(m)
        if why:
            skipped.append(f"model {m} skipped: {why}")
        else:
            models.append(m)
    if not models:
        raise ValueError("benchmark config: no model left to run (" + "; ".join(skipped) + ")")
    out["models"] = models
    for n in out["networks"]:
        if n not in netem.NETWORKS:
            raise ValueError(f"benchmark config: unknown network {n!r}; known: {', '.join(netem.NETWORKS)}")
    algs = []
    for entry in out.get("algorithms") or []:
        entry = {"name": entry} if isinstance(entry, str) else dict(entry)
        label = entry.pop("label", None)
        name = entry.pop("name")
        # the benchmark's own key, never an option of the algorithm
        optimizer = entry.pop("optimizer", "sgd")
        if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
            raise ValueError(f"benchmark config: algorithm {name!r}: unknown optimizer {optimizer!r}; "
                             f"allowed: {', '.join(OPTIMIZERS)}")
        row_lr = entry.pop("lr", None)
        if row_lr is not None and (not isinstance(row_lr, (int, float)) or isinstance(row_lr, bool) or row_lr <= 0):
            raise ValueError(f"benchmark config: algorithm {name!r}: lr must be a number > 0 (or absent: the "
                             f"config's lr, else the optimizer's default), got {row_lr!r}")
        if name == "ddp_powersgd":
            entry.setdefault("rank", 4)
        elif name == "torchft_diloco":
            _check_torchft(entry)
            _check_row_layout(name, entry, optimizer, out["shards"], label or _label(name, entry, optimizer))  # first
            ok, why = torchft_available()
            if not ok:
                skipped.append(f"{label or _label(name, entry, optimizer)} skipped: torchft is not installed ({why}; "
                               "pip install torchft==0.2.0 --no-deps and opentelemetry-sdk "
                               "opentelemetry-exporter-otlp-proto-http, or the bagua_lite[torchft] extra)")
                continue
        elif name in HOOK_BASELINES:
            hook_state(name, entry)  # validate now, before any process starts
        elif name in SHARDED_BASELINES:
            if entry:
                raise ValueError(f"benchmark config: {name} takes no options (it is FSDP2's own HSDP), got "
                                 f"{', '.join(sorted(entry))}")
        label = label or _label(name, entry, optimizer, row_lr)
        algorithm = None
        if name not in BASELINES:
            algorithm = build(name, **entry)  # validate now, before any process starts
            if mode == "convergence" and out["project_time"]:
                _check_projectable(name, algorithm, label)
        _check_row_layout(name, entry, optimizer, out["shards"], label, algorithm)
        algs.append({"name": name, "options": entry, "optimizer": optimizer, "label": label,
                     **({"lr": row_lr} if row_lr is not None else {})})
    if not algs:
        raise ValueError("benchmark config: 'algorithms' must list at least one algorithm"
                         + (" (" + "; ".join(skipped) + ")" if skipped else ""))
    out["algorithms"] = algs
    out["skipped"] = skipped
    return out


def hook_state(name, options):
    """(state, hook) of a ``HOOK_BASELINES`` row: DDP + ``bagua_lite.hooks.<hook>`` with its state built from
    the row's one option (``density`` for the sparse hooks, ``compression`` for compressed_hook)."""
    hook, key = HOOK_BASELINES[name]
    extra = sorted(set(options) - {key})
    if extra:
        raise ValueError(f"benchmark config: {name} has no option {extra[0]!r}; allowed: {key}")
    state = (hooks.SparseState if key == "density" else hooks.CompressedState)(**options)
    return state, getattr(hooks, hook)


def torchft_available():
    """(True, "") when torchft imports, else (False, why)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at INFO
    try:
        import torchft  # noqa: F401  (lazy: torchft is optional)
        import torchft.local_sgd  # noqa: F401  (lazy: torchft is optional)
    except Exception as e:  # noqa: BLE001  (ImportError, or a missing dependency of torchft's own)
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def _check_torchft(options):
    """The options of a ``torchft_diloco`` entry, checked whether or not torchft is installed."""
    for k in options:
        if k not in TORCHFT_OPTIONS:
            raise ValueError(f"benchmark config: torchft_diloco has no option {k!r}; allowed: {', '.join(TORCHFT_OPTIONS)}")
    period, frags = options.get("period", 500), options.get("fragments", 1)
    delay, alpha = options.get("fragment_sync_delay", 0), options.get("fragment_update_alpha", 0.0)
    for key, v, low in (("period", period, 1), ("fragments", frags, 1), ("fragment_sync_delay", delay, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"benchmark config: torchft_diloco: {key} must be an int >= {low}, got {v!r}")
    if period % frags:
        raise ValueError(f"benchmark config: torchft_diloco: period ({period}) must be a multiple of fragments ({frags})")
    if delay >= period // frags:
        raise ValueError(f"benchmark config: torchft_diloco: fragment_sync_delay ({delay}) must be < period / fragments "
                         f"({period // frags})")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 <= alpha <= 1:
        raise ValueError(f"benchmark config: torchft_diloco: fragment_update_alpha must be in [0, 1], got {alpha!r}")
    if "outer_optimizer" in options:
        outer_optimizer_class(options["outer_optimizer"], "benchmark config: torchft_diloco")


def _check_layout(out):
    """``shards`` and ``ranks_per_node``: ints >= 1 dividing every world size; shards > 1 in mode convergence;
    ``fsdp_units`` and ``reshard_after_forward`` only with shards > 1."""
    for key in ("shards", "ranks_per_node"):
        v = out[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"benchmark config: {key} must be an int >= 1, got {v!r}")
        bad = [p for p in out["world_sizes"] if p % v]
        if bad:
            raise ValueError(f"benchmark config: {key} ({v}) must divide every world size; it does not divide "
                             f"{', '.join(map(str, bad))} (world_sizes: {out['world_sizes']})")
    if out["fsdp_units"] not in FSDP_UNITS:
        raise ValueError(f"benchmark config: fsdp_units must be one of {', '.join(FSDP_UNITS)}, got {out['fsdp_units']!r}")
    if not isinstance(out["reshard_after_forward"], bool):
        raise ValueError("benchmark config: reshard_after_forward must be true or false, got "
                         f"{out['reshard_after_forward']!r}")
    if out["shards"] == 1 and (out["fsdp_units"] != "blocks" or not out["reshard_after_forward"]):
        raise ValueError("benchmark config: fsdp_units and reshard_after_forward shape an FSDP2-sharded model; "
                         "they need shards > 1 (shards: 1 trains whole models)")
    if out["shards"] > 1 and out["mode"] != "convergence":
        raise ValueError(f"benchmark config: shards ({out['shards']}) > 1 needs mode convergence: throughput mode's "
                         "compute floor, bucket plan and cost-model predictions describe a whole model on every rank; "
                         "for step times of sharded cells use mode convergence with project_time: true")


def _check_row_layout(name, options, optimizer, shards, label, algorithm=None):
    """Which rows a layout takes: with ``shards`` > 1 the ``hsdp`` baseline and our algorithms that run on
    shards (``ShardedModel``); with shards 1 every row but ``hsdp``. Refused before any process starts,
    with what to do instead."""
    if shards == 1:
        if name in SHARDED_BASELINES:
            raise ValueError(f"benchmark config: {label}: {name} is FSDP2's HSDP over a (replicate, shard) mesh; "
                             "it needs shards > 1 (set shards: 2, or use ddp for whole models on every rank)")
        return
    allowed = f"with shards > 1 the rows allowed are {', '.join(SHARDED_BASELINES)} and {', '.join(on_shards())}"
    if name in BASELINES and name not in SHARDED_BASELINES:
        raise ValueError(f"benchmark config: {label}: {name} trains a whole model on every rank, not an FSDP2-sharded "
                         f"one (shards: {shards}); {allowed} (hsdp is FSDP2's own HSDP, the reference; "
                         "gradient_allreduce with compression fp16 is the fp16 hook's counterpart)")
    if algorithm is None:
        return
    if not getattr(type(algorithm), "on_shards", False):
        raise ValueError(f"benchmark config: {label}: {name} does not run on shards of an FSDP2 model "
                         f"(shards: {shards}); {allowed}")
    if getattr(algorithm, "hierarchical", False):
        raise ValueError(f"benchmark config: {label}: hierarchical: true is refused on shards (the replicate group "
                         "already spans nodes); drop it")
    # the algorithm's own refusals on shards with this row's optimizer (gtopk/topk: momentum correction
    # under SGD with momentum), asked of a stand-in optimizer of the row's kind, before any process starts
    import torch

    stand_in = make_optimizer(optimizer, [torch.nn.Parameter(torch.zeros(1))], None, optimizer_momentum(algorithm))
    try:
        algorithm.check_shards(stand_in)
    except ValueError as e:
        raise ValueError(f"benchmark config: {label} (optimizer {optimizer}, shards: {shards}): {e}") from None


def _check_projectable(name, algorithm, label):
    """project_time takes the steps from an unthrottled run: refuse what would take other steps elsewhere."""
    why = None
    if getattr(algorithm, "asynchronous", False):
        why = "it is asynchronous: how far its replicas drift apart depends on timing, so its trajectory does too"
    elif name == "auto":
        why = "its pick depends on the network it probes, so its trajectory does too"
    elif getattr(algorithm, "warmup_densities", None) and getattr(algorithm, "warmup_steps_per_stage", 0):
        why = ("its density schedule changes its traffic stage by stage, and a projection times two phases at "
               "most (a warm-up given by warmup_steps, and what follows)")
    if why:
        raise ValueError(f"benchmark config: project_time cannot project {label}: {why}; "
                         "run it with project_time: false (measured on the throttled link itself)")


def _check_convergence(cfg):
    """The convergence keys of a raw config (mode: convergence), with messages naming key and value."""
    def number(key, v, low, *, integer=False, high=None):
        kind = "an int" if integer else "a number"
        ok = isinstance(v, int if integer else (int, float)) and not isinstance(v, bool) and v > low - integer
        if ok and high is not None:
            ok = v <= high
        if not ok:
            bound = (f">= {low}" if integer else f"> {low}") + (f" and <= {high}" if high is not None else "")
            raise ValueError(f"benchmark config: {key} must be {kind} {bound}, got {v!r}")

    metric = cfg.get("metric", "accuracy")
    if metric not in METRICS:
        raise ValueError(f"benchmark config: unknown metric {metric!r}; allowed: {', '.join(METRICS)}")
    if "target" not in cfg:
        raise ValueError("benchmark config: mode convergence needs a target (the held-out "
                         f"{metric} to reach, e.g. target: 0.95)")
    number("target", cfg["target"], 0, high=1 if metric == "accuracy" else None)
    if "max_steps" not in cfg:
        raise ValueError("benchmark config: mode convergence needs max_steps (the step budget per cell)")
    number("max_steps", cfg["max_steps"], 1, integer=True)
    number("eval_every", cfg.get("eval_every", 20), 1, integer=True)
    number("eval_samples", cfg.get("eval_samples", 512), 1, integer=True)
    if cfg.get("time_budget_s") is not None:
        number("time_budget_s", cfg["time_budget_s"], 0)
    number("seed", cfg.get("seed", 0), 0, integer=True)
    if "seeds" in cfg:
        seeds = cfg["seeds"]
        if "seed" in cfg:
            raise ValueError("benchmark config: give seed (one) or seeds (a list), not both")
        if not isinstance(seeds, list) or not seeds:
            raise ValueError(f"benchmark config: seeds must be a non-empty list of ints >= 0, got {seeds!r}")
        for v in seeds:
            number("seeds entry", v, 0, integer=True)
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"benchmark config: seeds lists a seed twice: {seeds!r}")
    if not isinstance(cfg.get("stop_at_target", True), bool):
        raise ValueError(f"benchmark config: stop_at_target must be true or false, got {cfg['stop_at_target']!r}")
    if not isinstance(cfg.get("project_time", False), bool):
        raise ValueError(f"benchmark config: project_time must be true or false, got {cfg['project_time']!r}")
    for key in ("timing_steps", "timing_warmup_steps", "timing_repeats"):
        if key in cfg and not cfg.get("project_time", False):
            raise ValueError(f"benchmark config: {key} sets the timing runs of project_time: true; "
                             "without it the time to target is measured directly")
    number("timing_steps", cfg.get("timing_steps", 6), 1, integer=True)
    number("timing_warmup_steps", cfg.get("timing_warmup_steps", 2), 0, integer=True)
    number("timing_repeats", cfg.get("timing_repeats", 1), 1, integer=True)


def _label(name, options, optimizer="sgd", lr=None):
    extra = ([] if optimizer == "sgd" else [optimizer]) + ([] if lr is None else [f"lr={lr:g}"])
    suffix = f"[{', '.join(extra)}]" if extra else ""
    if not options:
        return name + suffix
    short = ",".join(f"{k}={v}" for k, v in sorted(options.items()) if k not in ("warmup_densities",))
    return f"{name}({short}){suffix}"


def optimizer_momentum(algorithm, momentum=0.9):
    """The optimizer's SGD momentum for ``algorithm``: ``momentum``, unless the algorithm was given its own
    (topk/gtopk with a number ``momentum_correction > 0``): then 0, plain SGD, so that momentum is applied
    once. With their default, ``momentum_correction: optimizer``, they take the optimizer's momentum."""
    mc = getattr(algorithm, "momentum_correction", 0.0)
    return 0.0 if isinstance(mc, float) and mc > 0 else momentum


def cell_lr(cell, cfg):
    """The learning rate of a cell's optimizer: its row's ``lr``, else the config's (None: the default)."""
    return cell.get("lr") or cfg.get("lr")


def make_optimizer(kind, params, lr=None, momentum=0.9):
    """The optimizer of a cell: ``sgd`` (lr 0.01, ``momentum``), ``adam`` (lr 1e-3), ``adamw`` (lr 1e-3,
    torch's default weight decay 0.01); ``lr`` (the config's) overrides the default rate."""
    import torch

    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr or 0.01, momentum=momentum)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr or 1e-3)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr or 1e-3)
    raise ValueError(f"unknown optimizer {kind!r}; allowed: {', '.join(OPTIMIZERS)}")

