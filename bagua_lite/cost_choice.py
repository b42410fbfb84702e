"""Choosing by time to accuracy: an algorithm's label, its statistical efficiency (steps to a target
accuracy over dense SGD's, read from the benchmark's convergence results: the caller's, else the figures
measured on scikit-learn digits shipped in ``digits_convergence.json``), the pick among candidates that
auto makes (:func:`choose`), and projections over world sizes (:func:`project`). Imports without torch."""
import json
import math
import os
import statistics
from typing import Dict, List, Optional, Tuple

from .cost_network import Machine, Network, Workload
from .cost_time import predict

#: The convergence results behind :data:`DEFAULT_EFFICIENCY` (see the file's ``note``).
DIGITS_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits_convergence.json")


def label(name: str, options: Optional[dict] = None) -> str:
    """``gtopk(density=0.001)``: the name and the options given (warm-up schedules left out)."""
    opts = {k: v for k, v in sorted((options or {}).items()) if k not in ("warmup_densities",)}
    if not opts:
        return name
    return f"{name}(" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")"


def normalize_candidates(candidates) -> List[Tuple[str, dict]]:
    """Candidates as ``(name, options)`` from names, ``{"name": n, "options": {...}}``,
    ``{"name": n, **options}`` or ``(name, options)`` pairs."""
    out = []
    for c in candidates:
        if isinstance(c, str):
            out.append((c, {}))
        elif isinstance(c, dict):
            if "name" not in c:
                raise ValueError(f"auto: a candidate needs a 'name', got {c!r}")
            if "options" in c:
                extra = set(c) - {"name", "options"}
                if extra or not isinstance(c["options"], dict):
                    raise ValueError(f"auto: candidate {c!r}: give options either under 'options' or inline")
                out.append((c["name"], dict(c["options"])))
            else:
                out.append((c["name"], {k: v for k, v in c.items() if k != "name"}))
        elif isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], dict):
            out.append((c[0], dict(c[1])))
        else:
            raise ValueError(f"auto: cannot read candidate {c!r}; give a name or {{name: ..., options: {{...}}}}")
    if not out:
        raise ValueError("auto: candidates must list at least one algorithm")
    return out


def _key(text: str) -> str:
    return text.replace(" ", "")


def check_efficiency(efficiency, candidates=None, who="auto") -> Dict[str, float]:
    """``efficiency`` as a dict label-or-name -> ratio, or ValueError naming the bad key and what is
    allowed: keys are strings (with ``candidates``, one of their labels or names), ratios finite numbers
    > 0 (steps to target over dense SGD's)."""
    if efficiency is None:
        return {}
    if not isinstance(efficiency, dict):
        raise ValueError(f"{who}: efficiency must be a mapping of algorithm label or name to a ratio "
                         f"(steps to target / dense SGD's steps), got {efficiency!r}")
    allowed = None
    if candidates is not None:
        cands = normalize_candidates(candidates)
        allowed = list(dict.fromkeys([label(n, o) for n, o in cands] + [n for n, _ in cands]))
    out = {}
    for k, v in efficiency.items():
        if not isinstance(k, str):
            raise ValueError(f"{who}: efficiency key {k!r} must be an algorithm label or name (a string)")
        if allowed is not None and _key(k) not in {_key(a) for a in allowed}:
            raise ValueError(f"{who}: efficiency key {k!r} names no candidate; allowed: {', '.join(allowed)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{who}: efficiency[{k!r}] must be a finite number > 0 (steps to target over "
                             f"dense SGD's; 1.0 = as dense), got {v!r}")
        out[_key(k)] = float(v)
    return out


def efficiencies_from_results(results, model: Optional[str] = None, world_size: Optional[int] = None,
                              network: Optional[str] = None, dense=("ddp", "gradient_allreduce")) -> Dict[str, float]:
    """Efficiencies from the benchmark's convergence results (``results.json``: a path, its parsed dict,
    or its ``rows``), keyed by the rows' labels (``algorithm``), and by name where a name has one label.

    Per (network, P, model, seed) cell (restricted to ``model``, ``world_size``, ``network`` when given), the
    reference is the first row of a ``dense`` algorithm (``ddp``, or ``gradient_allreduce`` with no
    compression) that reached the target: ratio = steps_to_target / its steps_to_target. A row that never
    reached the target gets the penalty ``steps_run / dense steps`` (its budget over dense's steps: a lower
    bound on its true ratio). Over several cells a label gets the median ratio. Rows of an algorithm that ran
another one it ``picked`` (auto) are skipped: the pick's own row says it.
    Raises ValueError when no cell has a dense row that reached the target.
    """
    if isinstance(results, str):
        with open(results) as f:
            results = json.load(f)
    rows = results.get("rows", results) if isinstance(results, dict) else results
    if isinstance(results, dict) and results.get("mode", "convergence") != "convergence":
        raise ValueError(f"efficiencies_from_results: expected convergence results, got mode {results.get('mode')!r}")
    cells = {}
    for r in rows:
        if "steps_to_target" not in r:
            raise ValueError("efficiencies_from_results: a row has no steps_to_target: not convergence results")
        if (model is not None and r["model"] != model) or (world_size is not None and r["world_size"] != world_size) \
                or (network is not None and r["network"] != network) or r.get("picked"):
            continue
        cells.setdefault((r["network"], r["world_size"], r["model"], r.get("seed", 0)), []).append(r)
    ratios, names = {}, {}
    for rs in cells.values():
        ref = next((r for r in rs if r.get("name") in dense and r["steps_to_target"]
                    and (r.get("options") or {}).get("compression", "none") == "none"), None)
        if ref is None:
            continue
        for r in rs:
            steps = r["steps_to_target"] if r["steps_to_target"] is not None else r["steps_run"]
            ratios.setdefault(_key(r["algorithm"]), []).append(steps / ref["steps_to_target"])
            names.setdefault(r.get("name", r["algorithm"]), set()).add(_key(r["algorithm"]))
    if not ratios:
        raise ValueError("efficiencies_from_results: no cell with a dense row (" + ", ".join(dense)
                         + ") that reached the target" + (f" for model={model}" if model else "")
                         + (f" P={world_size}" if world_size else "") + (f" network={network}" if network else ""))
    out = {k: statistics.median(v) for k, v in ratios.items()}
    for name, labels in names.items():
        if len(labels) == 1 and name not in out:
            out[name] = out[next(iter(labels))]
    return out


def _default_efficiency() -> Dict[str, float]:
    """Statistical efficiency when the caller gives none: :func:`efficiencies_from_results` of
    ``DIGITS_RESULTS``, never below 1.0. Local SGD's 132 steps there (0.86) are one run of one small
    model, and no relaxation is assumed to need fewer steps than the exact algorithm it relaxes (with it,
    auto would leave dense SGD on a compute-bound job, where nothing is to be saved). Give ``efficiency``
    (or your own convergence results) to auto for other models and recipes. Keys are labels (name and
    options, as :func:`label` writes them) or names; a label wins over its name. Not listed (powersgd,
    qadam, the other compressors, ...): 1.0, "assumed"."""
    return {k: max(1.0, v) for k, v in efficiencies_from_results(DIGITS_RESULTS).items()}


DEFAULT_EFFICIENCY: Dict[str, float] = _default_efficiency()


def efficiency_of(name: str, options: Optional[dict] = None, efficiency: Optional[dict] = None) -> Tuple[float, str]:
    """``(ratio, source)`` of one candidate: the caller's ``efficiency`` (label, then name), then
    ``DEFAULT_EFFICIENCY`` (label, then name; source ``"digits"``), else ``(1.0, "assumed")``."""
    given = {_key(k): v for k, v in (efficiency or {}).items()}
    defaults = {_key(k): v for k, v in DEFAULT_EFFICIENCY.items()}
    lab = _key(label(name, options))
    for table, source in ((given, "given"), (defaults, "digits")):
        for k in (lab, name):
            if k in table:
                return float(table[k]), source
    return 1.0, "assumed"


def choose(candidates, P: int, work: Workload, net: Network, machine: Machine,
           tolerance: float = 0.05, efficiency: Optional[dict] = None) -> Tuple[int, List[dict]]:
    """Index of the candidate to run and every candidate's prediction, ranked by time to accuracy.

    Each prediction gains ``efficiency`` (steps to target over dense SGD's, from :func:`efficiency_of`
    with the caller's ``efficiency`` mapping), ``efficiency_source`` and ``weighted_s`` = ``step_s *
    efficiency``, the predicted time to accuracy in units of dense SGD's steps to target. The smallest
    ``weighted_s`` wins, except that an earlier candidate (the list runs from most to least exact) within
    ``tolerance`` of it is preferred. Deterministic: equal inputs give the same index on every rank.
    """
    cands = normalize_candidates(candidates)
    preds = [predict(name, opts, P, work, net, machine) for name, opts in cands]
    for (name, opts), p in zip(cands, preds):
        p["efficiency"], p["efficiency_source"] = efficiency_of(name, opts, efficiency)
        p["weighted_s"] = p["step_s"] * p["efficiency"]
    best = min(p["weighted_s"] for p in preds)
    for i, p in enumerate(preds):
        if p["weighted_s"] <= best * (1 + tolerance):
            return i, preds
    raise AssertionError("unreachable")


def project(algorithms: List[Tuple[str, dict]], world_sizes: List[int], work: Workload, net: Network,
            machine: Machine) -> List[dict]:
    """Predicted step time and speed-up over ``ddp`` of each algorithm at each world size.

    One row per (P, algorithm): ``world_size``, ``algorithm`` (its label), ``step_s``,
    ``speedup_vs_ddp``, ``comm_s``, ``bytes_per_rank`` (and ``picked`` for auto).
    """
    rows = []
    for P in world_sizes:
        ddp = predict("ddp", {}, P, work, net, machine)["step_s"]
        for name, opts in algorithms:
            p = predict(name, opts, P, work, net, machine)
            row = {"world_size": int(P), "algorithm": label(name, opts), "step_s": p["step_s"],
                   "speedup_vs_ddp": ddp / p["step_s"] if p["step_s"] > 0 else float("inf"),
                   "comm_s": p["comm_s"], "bytes_per_rank": p["bytes_per_rank"]}
            if "picked" in p:
                row["picked"] = p["picked"]
            rows.append(row)
    return rows
