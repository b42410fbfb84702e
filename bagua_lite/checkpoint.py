"""One-call checkpoints of a DistributedModel: module, optimizer, the algorithm's per-rank state, RNG.

    bagua_lite.save_checkpoint("ckpt/step1000", model, optimizer, step=1000)
    extra = bagua_lite.load_checkpoint("ckpt/step1000", model, optimizer)   # -> {"step": 1000}

``path`` is a directory; every rank writes its own ``rank<r>.pt`` in it (error-feedback residuals,
momenta and decentralized copies differ per rank), atomically: a temporary file is written, flushed,
fsync'ed and renamed over the old one, so a rank killed mid-write leaves the previous checkpoint intact.
Both calls are collective (every rank of the model's group calls them) and end with a check that every
rank succeeded, so a failure on one rank raises on all of them instead of leaving the others waiting.

What was written is checked on load: world size, the algorithm and its options, and the bucket layout
(sizes and dtypes) must match, or loading raises naming what differs. One exception, said in a warning:
an algorithm whose state holds no tensors (dense gradient averaging: every rank has the same weights and
optimizer state) may resume at another world size; every rank then loads rank 0's file.
"""
import os
import warnings

import torch
import torch.distributed as dist

FORMAT = 1


def _file(path, rank):
    return os.path.join(path, f"rank{rank}.pt")


def model_meta(model):
    """What a checkpoint must match to be loaded into ``model``: world size, algorithm, options, bucket layout."""
    alg = model.configured_algorithm  # auto, not its pick: a resumed auto switches to the same pick
    return {"world_size": model.world_size, "algorithm": alg.name, "options": repr(sorted(alg.options().items())),
            "buckets": [[b.numel, str(b.dtype)] for b in model.buckets]}


def has_tensors(obj):
    """Whether ``obj`` (a state dict, possibly nested in dicts, lists and tuples) holds any tensor."""
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(has_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_tensors(v) for v in obj)
    return False


def failed_ranks(model, error):
    """Every rank learns whether any rank failed; returns the failed ranks (an empty list: none)."""
    flags = torch.zeros(model.world_size, dtype=torch.int64)
    flags[model.rank] = int(error is not None)
    dist.all_reduce(flags, group=model.control_group)
    return [r for r in range(model.world_size) if flags[r]]


def save_checkpoint(path, model, optimizer, **extra):
    """Write this rank's checkpoint into directory ``path`` (collective). ``extra``: anything picklable
    (the step, the epoch, a scheduler's state_dict), returned by :func:`load_checkpoint`."""
    error = None
    try:
        os.makedirs(path, exist_ok=True)
        state = {"format": FORMAT, "rank": model.rank, "meta": model_meta(model), "module": model.module.state_dict(),
                 "optimizer": optimizer.state_dict(), "algorithm": model.algorithm_state_dict(),
                 "rng": torch.get_rng_state(), "extra": extra}
        final = _file(path, model.rank)
        tmp = f"{final}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except Exception as e:  # noqa: BLE001  (reported on every rank below)
        error = e
    failed = failed_ranks(model, error)
    if failed:
        raise RuntimeError(f"save_checkpoint({path!r}): failed on rank(s) {failed}"
                           + (f"; here: {type(error).__name__}: {error}" if error is not None else "")) from error


def meta_differences(saved, now):
    """What differs between two :func:`model_meta` (saved, now), one line each; an empty list: they match."""
    out = []
    for key, what in (("world_size", "world size"), ("algorithm", "algorithm"), ("options", "algorithm options"),
                      ("buckets", "bucket layout (bucket sizes and dtypes)")):
        if saved[key] != now[key]:
            a, b = saved[key], now[key]
            if key == "buckets":
                a, b = f"{len(a)} buckets {a[:4]}...", f"{len(b)} buckets {b[:4]}..."
            out.append(f"{what}: checkpoint {a}, now {b}")
    return out


def load_checkpoint(path, model, optimizer):
    """Load this rank's checkpoint from directory ``path`` into ``model`` (a DistributedModel, wrapped
    the same way as when it was saved) and ``optimizer`` (collective). Returns the ``extra`` it was saved
    with. Raises ValueError naming what differs (world size, algorithm, options, bucket layout)."""
    error, state = None, None
    try:
        now = model_meta(model)
        own = _file(path, model.rank)
        if not os.path.exists(own) and not os.path.exists(_file(path, 0)):
            raise FileNotFoundError(f"no checkpoint for rank {model.rank} in {path!r} (expected {own})")
        state = torch.load(own if os.path.exists(own) else _file(path, 0), map_location="cpu", weights_only=False)
        if state.get("format") != FORMAT:
            raise ValueError(f"{path!r} is not a bagua_lite checkpoint of format {FORMAT}")
        diffs = meta_differences(state["meta"], now)
        stateless = not has_tensors(state["algorithm"])
        only_world_size = diffs and all(d.startswith("world size") for d in diffs)
        if only_world_size and stateless:
            if state["rank"] != 0:
                state = torch.load(_file(path, 0), map_location="cpu", weights_only=False)
            warnings.warn(f"load_checkpoint: {diffs[0]}; {state['meta']['algorithm']} keeps no per-rank state, "
                          f"so every rank resumes from rank 0's file", stacklevel=2)
        elif diffs:
            raise ValueError(f"load_checkpoint({path!r}): the checkpoint does not fit this model: " + "; ".join(diffs))
        elif not os.path.exists(own):
            raise FileNotFoundError(f"no checkpoint for rank {model.rank} in {path!r} (expected {own})")
        elif state["rank"] != model.rank:
            raise ValueError(f"load_checkpoint({path!r}): {own} holds rank {state['rank']}'s state, not rank "
                             f"{model.rank}'s (every rank resumes from its own file)")
    except Exception as e:  # noqa: BLE001
        error = e
    failed = failed_ranks(model, error)
    if failed:
        if isinstance(error, ValueError):
            raise error
        raise RuntimeError(f"load_checkpoint({path!r}): failed on rank(s) {failed}"
                           + (f"; here: {type(error).__name__}: {error}" if error is not None else "")) from error
    model.module.load_state_dict(state["module"])
    optimizer.load_state_dict(state["optimizer"])
    model.load_algorithm_state_dict(state["algorithm"])
    torch.set_rng_state(state["rng"])
    return state["extra"]
