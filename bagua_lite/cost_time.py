"""The cost model's predictions: from an algorithm's name and options to its :class:`Traffic` (its own
description, ``Algorithm.traffic``; the DDP baselines are described here, as torch's DDP is not ours) and
from that to the time of one step, with the overlap, shared-core and round rules of
:mod:`bagua_lite.cost_model`. Knows no algorithm of ours by name. Imports without torch."""
from typing import List, Optional, Sequence

from .cost_network import Machine, Network, Workload
from .cost_traffic import Traffic, dense_allreduce, per_bucket, ring, side


def option_defaults(name) -> dict:
    """The registered algorithm's option defaults, read from its signature (none for the DDP baselines)."""
    import inspect

    from . import algorithms  # noqa: F401  (registers the built-ins; lazy: the formulas import without torch)
    from .algorithm import registered_class  # lazy: the formulas import without torch

    cls = registered_class(name)
    if cls is None:
        return {}
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if k != "self" and p.default is not inspect.Parameter.empty}


# ---- the DDP baselines (torch's DDP with its comm hooks: not ours, so described here) -----------------------
def _ddp(options, P, numels, e, machine, rank):
    comms, locals_ = per_bucket(numels, P, lambda n, i: ring(n * e, P), lambda n, i: n * machine.add_s_per_elem,
                                machine)
    return Traffic("buckets", comms, locals_, rounds=False)


def _ddp_fp16(options, P, numels, e, machine, rank):
    comms, locals_ = per_bucket(numels, P, lambda n, i: ring(2 * n, P),
                                lambda n, i: n * (machine.fp16_s_per_elem + machine.add_s_per_elem), machine)
    return Traffic("buckets", comms, locals_, rounds=False)


def _powersgd_sizes(options, n):
    r = int(options.get("rank", options.get("matrix_approximation_rank", 4)))
    shapes = options.get("shapes")
    if shapes:
        rows = sum(int(s[0]) for s in shapes)
        cols = sum(int(s[1]) for s in shapes)
    else:
        rows = cols = side(n)
    return r, rows * r, cols * r, int(options.get("uncompressed", 0))


def _ddp_powersgd(options, P, numels, e, machine, rank):
    """One bucket, ready at the end of backward: no overlap."""
    n = sum(int(x) for x in numels)
    r, p_elems, q_elems, unc = _powersgd_sizes(options, n)
    parts = [ring(4 * p_elems, P), ring(4 * q_elems, P)] + ([ring(unc * e, P)] if unc else [])
    comm = (sum(x[0] for x in parts), sum(x[1] for x in parts), sum(x[2] for x in parts)) if P > 1 and n > 0 \
        else (0, 0, 0)
    local = 0.0
    if machine is not None and P > 1:
        add = machine.add_s_per_elem
        local = max(3 * 2.0 * n * r * machine.matmul_s_per_flop, 3 * n * add) + 4 * n * add
    return Traffic("end_of_backward", [comm], [local])


_BASELINES = {"ddp": _ddp, "ddp_fp16": _ddp_fp16, "ddp_powersgd": _ddp_powersgd}


# ---- from an algorithm to its traffic ------------------------------------------------------------------------
def _algorithm_class(name):
    from . import algorithms  # noqa: F401  (registers the built-ins; lazy: the formulas import without torch)
    from .algorithm import Algorithm, registered_class  # lazy: the formulas import without torch

    cls = registered_class(name)
    if cls is None or (getattr(cls.traffic, "__func__", None) is Algorithm.traffic.__func__
                       and getattr(cls.predicted_as, "__func__", None) is Algorithm.predicted_as.__func__):
        return None
    return cls


def runs_another(name) -> bool:
    """Whether ``name``'s prediction is another algorithm's (``Algorithm.predicted_as``: auto's pick)."""
    from .algorithm import Algorithm  # lazy: the formulas import without torch

    cls = _algorithm_class(name)
    return cls is not None and getattr(cls.predicted_as, "__func__", None) is not Algorithm.predicted_as.__func__


def predictable(name: str) -> bool:
    """Whether the cost model can predict ``name``: a DDP baseline, or a registered algorithm that describes
    its traffic (``Algorithm.traffic``) or says what it runs instead (``Algorithm.predicted_as``: auto)."""
    return name in _BASELINES or _algorithm_class(name) is not None


def predictable_names() -> List[str]:
    """Every name :func:`predict` takes: the DDP baselines, then the registered algorithms it can predict."""
    from .algorithm import registered  # lazy: the formulas import without torch

    return list(_BASELINES) + [n for n in registered() if _algorithm_class(n) is not None]


def _check_name(algorithm):
    if not isinstance(algorithm, str) or not predictable(algorithm):
        raise ValueError(f"cost_model: cannot predict {algorithm!r}: it is neither a DDP baseline nor a registered "
                         f"algorithm that describes its traffic (Algorithm.traffic); predictable: "
                         f"{', '.join(predictable_names())}")


def _options(name, options):
    """The options with the algorithm's defaults filled in, checked by the algorithm itself (its
    constructor: the same errors as building it); options it does not take (the cost-model-only
    ``bucket_shapes``) are passed through."""
    defaults = option_defaults(name)
    cls = _algorithm_class(name)
    if cls is not None:
        cls(**{k: v for k, v in options.items() if k in defaults})
    return {**defaults, **options}


def traffic_of(algorithm: str, options: dict, P: int, bucket_numels: Sequence[int], elem_bytes: int = 4,
               machine: Optional["Machine"] = None, rank: Optional[int] = None) -> Traffic:
    """The :class:`Traffic` of ``algorithm`` with ``options`` (defaults filled in) on ``P`` ranks."""
    _check_name(algorithm)
    options = dict(options or {})
    numels = [int(n) for n in bucket_numels]
    if algorithm in _BASELINES:
        return _BASELINES[algorithm](options, P, numels, elem_bytes, machine, rank)
    return _algorithm_class(algorithm).traffic(_options(algorithm, options), P, numels, elem_bytes, machine, rank)


def bytes_per_rank(algorithm: str, options: dict, P: int, bucket_numels: Sequence[int], elem_bytes: int = 4,
                   rank: Optional[int] = None) -> float:
    """Bytes ``rank`` (None: the busiest rank) sends per step, as ``bagua_lite.comm.bytes_sent()`` counts
    them for our algorithms (torch's own traffic for the ddp baselines). Periodic exchanges (local_sgd
    after warm-up, decentralized with an interval) are amortised per step, so may be fractional. A
    background exchange's bytes per step depend on the step time: take them from :func:`predict`."""
    _check_name(algorithm)
    if algorithm not in _BASELINES and runs_another(algorithm):
        raise ValueError(f"cost_model.bytes_per_rank: {algorithm!r} runs another algorithm, which depends on the "
                         f"network and machine: resolve it with predict() (its 'picked') first")
    t = traffic_of(algorithm, options, P, bucket_numels, elem_bytes, None, rank)
    if t.when == "background":
        raise ValueError(f"cost_model.bytes_per_rank: {algorithm}'s bytes per step depend on the step time "
                         f"(its exchange runs in the background); take predict(...)['bytes_per_rank'] (or its "
                         f"'bytes_per_round')")
    return t.bytes_per_step()


# ---- time ------------------------------------------------------------------------------------------------------
def pipeline(engine_s: List[float], numels: List[int], backward_s: float) -> float:
    """Exposed time of buckets run in order on one worker as backward makes them ready."""
    total = sum(numels) or 1
    finish, seen = 0.0, 0
    for e_i, n_i in zip(engine_s, numels):
        seen += n_i
        finish = max(backward_s * seen / total, finish) + e_i
    return max(0.0, finish - backward_s)


def _result(work, compression_s, comm_s, exposed_s, nbytes, **extra):
    hidden = max(0.0, compression_s + comm_s - exposed_s)
    out = {"step_s": work.compute_s + compression_s + comm_s - hidden, "compute_s": work.compute_s,
           "compression_s": compression_s, "comm_s": comm_s, "hidden_s": hidden, "bytes_per_rank": nbytes}
    out.update(extra)
    return out


def predict(algorithm: str, options: dict, P: int, work: Workload, net: Network, machine: Machine) -> dict:
    """Predicted time of one steady-state step of ``algorithm`` with ``options`` on ``P`` ranks.

    Returns ``step_s``, ``compute_s``, ``compression_s`` (local work: compression, selection,
    averaging), ``comm_s`` (network), ``hidden_s`` (the part of compression + comm overlapped with
    compute) and ``bytes_per_rank`` (busiest rank, per step); algorithms with a warm-up add
    ``warmup_step_s``, background ones ``rounds_per_step`` and ``bytes_per_round``. What travels is the
    algorithm's own description (:class:`Traffic`); the formulas that time it are in the module docstring.
    """
    _check_name(algorithm)
    options = dict(options or {})
    P = int(P)
    if P < 1:
        raise ValueError(f"cost_model.predict: P must be >= 1, got {P}")
    if algorithm not in _BASELINES and runs_another(algorithm):  # it runs another one (auto: its pick)
        name, opts, extra = _algorithm_class(algorithm).predicted_as(options, P, work, net, machine)
        out = predict(name, opts, P, work, net, machine)
        out.update(extra)
        if "efficiency" in extra:
            out["weighted_s"] = out["step_s"] * out["efficiency"]
        return out
    numels = work.buckets()
    e = int(work.elem_bytes)
    t = traffic_of(algorithm, options, P, numels, e, machine)
    extra = {}
    if t.warmup:  # its dense warm-up steps cost plain synchronous SGD's
        extra["warmup_step_s"] = _time(dense_allreduce(P, numels, e, machine), P, work, numels, net, machine,
                                       {})["step_s"]
    return _time(t, P, work, numels, net, machine, extra)


def _time(t: Traffic, P, work, numels, net, machine, extra):
    backward_s = work.backward_fraction * work.compute_s
    shared = 0 < machine.cores_per_rank < 2  # ranks share cores: CPU work cannot hide behind compute
    round_s = machine.round_s if P > 1 and t.rounds else 0.0  # one of our synchronous rounds
    if t.when == "end_of_backward":
        _, lat, crit = t.buckets[0]
        comm, local = lat * net.alpha + crit * net.beta, float(t.bucket_local_s[0])
        return _result(work, local, comm, local + comm, t.bytes_per_step(), **extra)
    if t.when == "buckets":  # ours on the engine, or DDP's reducer: overlapped with backward
        comms = [lat * net.alpha + crit * net.beta for _, lat, crit in t.buckets]
        locals_ = list(t.bucket_local_s)
        if shared and net.host_local:  # moving bytes is CPU work too: nothing hides
            exposed = sum(locals_) + sum(comms)
        elif shared:  # no spare core: local work adds to the step, waiting still hides
            exposed = sum(locals_) + pipeline(comms, numels, backward_s)
        else:
            exposed = pipeline([a + b for a, b in zip(locals_, comms)], numels, backward_s)
        return _result(work, sum(locals_) + t.serial_s, sum(comms) + round_s, exposed + t.serial_s + round_s,
                       t.bytes_per_step(), **extra)
    b, lat, crit = t.exchange
    every = t.every
    if t.when == "with_step":  # started when forward starts, waited for after the optimizer step
        if shared and P > 1 and t.messages:  # the messages' protocol work runs one after another
            lat = max(lat, t.messages)
        transfer = lat * net.alpha + crit * net.beta
        main, thread, first = t.local_s, t.thread_s, t.first_s
        # the transfer (and the exchange's thread) runs during forward + backward + step; with shared cores
        # the thread's work is taken from the compute, each message's latency is protocol work on those
        # cores, and on one host (host_local) the bytes are copies on them too: none of it hides
        busy = work.compute_s + (thread if shared else 0.0)
        if shared:
            rest = crit * net.beta
            exposed = lat * net.alpha + (rest if net.host_local else max(0.0, first + rest - busy))
        else:
            exposed = max(0.0, first + transfer - busy)
        transfer += round_s  # the exchange's wait is a round every rank makes
        exposed += round_s
        return _result(work, (main + thread) / every, transfer / every,
                       (main + (thread if shared else 0.0) + exposed) / every, t.bytes_per_step(), **extra)
    if t.when == "after_step":  # after the step, every `every` steps, nothing overlapped
        comm = (lat * net.alpha + crit * net.beta + round_s) / every
        local = t.local_s / every
        return _result(work, local, comm, local + comm, t.bytes_per_step(), **extra)
    if t.when == "background":  # a thread of its own, every interval_s; never waited for
        transfer = lat * net.alpha + crit * net.beta + t.extra_latencies * net.alpha
        local = t.local_s
        period = t.interval_s + transfer + local  # one round: the pause, then the exchange
        stolen = (local + (transfer if net.host_local else 0.0)) if shared else 0.0  # CPU per round
        step = work.compute_s / (1.0 - stolen / period)  # step = compute + stolen * step / period
        rounds = step / period
        return _result(work, local * rounds, transfer * rounds, stolen * rounds, b * rounds,
                       rounds_per_step=rounds, bytes_per_round=float(b), **extra)
    raise ValueError(f"cost_model: Traffic.when must be one of buckets, end_of_backward, with_step, after_step, "
                     f"background; got {t.when!r}")
