"""How ``auto`` decides, once its probe is done, on every rank alike:

    inputs <- max over ranks            (one collective; one decision on every rank)
    pick   <- cost_model.choose(candidates, P, workload, network, machine, efficiency)
    replicas: a pick that needs identical replicas (everything but local SGD without warm-up or
              compression, and uncompressed decentralized SGD) first gets the average of the parameters
              and of the optimizer's state (momentum, Adam's moments) on every rank: one allreduce, as a
              local SGD average; the others go on from where their probe steps left them
    log one line: the pick, every candidate's s/step x efficiency, the inputs

Ranked by predicted time to accuracy: each candidate's predicted step time times its statistical
efficiency, the steps it needs to reach a target over dense SGD's (1.0 for exact dense algorithms).
Efficiencies, first found wins: the ``efficiency`` option (``{label or name: ratio}``, e.g.
``{"gtopk(density=0.01)": 1.4, "local_sgd": 0.9}``), then ``efficiency_from`` (the ``results.json`` of a
benchmark convergence run: ratios of its rows' ``steps_to_target`` to dense's, its rows at this P if it
has any; see ``cost_model.efficiencies_from_results``), then ``cost_model.DEFAULT_EFFICIENCY`` (measured
on scikit-learn digits), else 1.0. ``candidates`` run from most to least exact; a candidate within
``tolerance`` of the best predicted time to accuracy is preferred over later ones, so a compute-bound job
stays on dense SGD.
"""
import dataclasses

import torch
import torch.distributed as dist

from bagua_lite import comm, cost_model
from bagua_lite.algorithm import build, registered

NOT_CANDIDATES = ("auto", "ddp", "ddp_fp16", "ddp_powersgd")


def check_candidates(candidates):
    """The candidates, normalized to [(name, options)], each a registered algorithm that describes its
    traffic, with its options checked now, before any traffic."""
    candidates = cost_model.normalize_candidates(candidates)
    for name, opts in candidates:
        if name in NOT_CANDIDATES or name not in registered() or not cost_model.predictable(name):
            raise ValueError(f"auto: candidate {name!r} is not allowed: a candidate is a registered algorithm "
                             f"that describes its traffic (Algorithm.traffic), such as "
                             + ", ".join(n for n in cost_model.predictable_names() if n not in NOT_CANDIDATES))
        build(name, **opts)
    return candidates


def check_efficiency_from(path):
    """``efficiency_from``: None, or a readable convergence results.json."""
    if path is not None:
        if not isinstance(path, str):
            raise ValueError(f"auto: efficiency_from must be the path of a convergence results.json, got {path!r}")
        try:
            cost_model.efficiencies_from_results(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"auto: efficiency_from {path!r}: {e}") from None
    return path


def agree(model, step, compute_s, machine):
    """(compute_s, machine), each the max over the ranks (the slowest rank sets the pace, and every rank
    decides on equal inputs); raises on every rank if the ranks decide at different step counts."""
    fields = [f.name for f in dataclasses.fields(cost_model.Machine)]
    inputs = torch.tensor([step, -step, compute_s] + [getattr(machine, f) for f in fields], dtype=torch.float64)
    if model.world_size > 1:
        model.run_collective("auto decision", lambda: dist.all_reduce(inputs, op=dist.ReduceOp.MAX,
                                                                      group=model.process_group))
    hi, lo = int(inputs[0]), -int(inputs[1])
    if hi != lo:
        raise RuntimeError(f"bagua_lite: ranks are out of step: auto's decision came at different optimizer "
                           f"step counts (from {lo} to {hi}; this is rank {model.rank}, at step {step}). "
                           f"Every rank must call optimizer.step() the same number of times")
    return float(inputs[2]), cost_model.Machine(**{f: float(v) for f, v in zip(fields, inputs[3:].tolist())})


def workload(model, compute_s, backward_fraction):
    numels = [b.numel for b in model.buckets]
    return cost_model.Workload(numel=sum(numels), elem_bytes=model.buckets[0].flat.element_size(),
                               compute_s=compute_s, backward_fraction=backward_fraction,
                               n_buckets=len(numels), bucket_numels=numels)


def efficiencies(option, results_path, P):
    """The efficiencies in effect: the results file's (its rows at P if any), under the option's."""
    table = {}
    if results_path is not None:
        try:
            table = cost_model.efficiencies_from_results(results_path, world_size=P)
        except ValueError:
            table = cost_model.efficiencies_from_results(results_path)
    table.update(option)
    return table


def keeps_unequal_replicas(name, opts):
    """Whether a pick can start from replicas that differ (after local probe steps) as it would on its own:
    local SGD without warm-up (its first average comes at step H whatever the replicas) and without
    compression (which averages changes from an anchor that must be equal everywhere), and uncompressed
    decentralized SGD (its replicas differ by design and its exchanges send whatever they hold)."""
    if name == "local_sgd":
        return not opts.get("warmup_steps", 0) and opts.get("compression", "none") == "none"
    return name == "decentralized" and opts.get("compression", "none") == "none"  # compressed: copies from a common x_0


def average_replicas(model):
    """After local probe steps: every rank's parameters and optimizer state become their average over
    the ranks (one allreduce per dtype), so a synchronous pick starts from identical replicas. The
    optimizer's floating-point state of these parameters (SGD's momentum, Adam's moments; a step
    counter is equal everywhere and stays so)."""
    opt = model.optimizer
    tensors = [p.data for p in model.params]
    for p in model.params:
        tensors += [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    by_dtype = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(group)
            comm.allreduce(flat, "avg", group=model.process_group)
            for t, avg in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                t.copy_(avg)


def line(candidates, i, preds, tolerance, work, machine, network, network_source, probe_compute, P):
    """The one line auto logs: the pick and why, every other candidate, the inputs."""
    labels = [cost_model.label(n, o) for n, o in candidates]
    best = min(range(len(preds)), key=lambda j: preds[j]["weighted_s"])

    def terms(p):
        return (f"{p['step_s']:.3g} s/step x efficiency {p['efficiency']:.3g} ({p['efficiency_source']}) "
                f"= {p['weighted_s']:.3g}")

    others = "; ".join(f"{labels[j]} {terms(preds[j])}" for j in range(len(preds)) if j != i)
    why = ""
    if best != i:
        why = (f"; within {tolerance:.0%} of the best, {labels[best]} {preds[best]['weighted_s']:.3g}, "
               f"and listed earlier")
    probes = ""
    if probe_compute:
        probes = " (this rank's probe steps: " + ", ".join(f"{c:.3g}" for c in probe_compute) + " s)"
    gbit = f"{8 / network.beta / 1e9:.3g} Gbit/s" if network.beta > 0 else "inf Gbit/s"
    params = f"{work.numel / 1e6:.3g}M" if work.numel >= 100_000 else f"{work.numel}"
    return (f"bagua_lite auto: picked {labels[i]}: predicted {terms(preds[i])}, ranked by time to accuracy "
            f"(s/step x steps to target relative to dense SGD)" + (f"; vs {others}" if others else "") + why
            + f" (alpha={network.alpha:.3g} s, beta={network.beta:.3g} s/B = {gbit} {network_source}, "
              f"{params} params, compute {work.compute_s:.3g} s{probes}, "
              f"round {machine.round_s:.3g} s, P={P})")
