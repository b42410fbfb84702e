"""project_gpu's link model against measurement: nodes of several ranks joined by emulated links.

    python -m bagua_lite.bench.project_check --nodes NODES/records.jsonl --single SINGLE/records.jsonl
                                             --ranks-per-node 2 [--out DIR]
    (DIR: check.json and check.md)

project_gpu projects one GPU's step to clusters of nodes: the compute and each row's own cost are measured,
the links are modelled (hierarchical rings, topk's allgather, gtopk's rounds through a node's shared link).
That link model can be run against measurement on this machine: the throughput benchmark with
``ranks_per_node`` > 1 puts each node in a network namespace (loopback inside, one rate-limited link per
node, shared by its ranks). Two runs of the same rows (``configs/benchmark_nodes.yaml`` and
``configs/benchmark_nodes_p1.yaml``):

- ``--nodes``: the rows at P ranks in nodes of ``--ranks-per-node``, on ``loopback`` and on emulated links;
- ``--single``: the same rows at P = 1, as project_gpu's step is measured: a row's own cost is its step over
  the compute floor there.

Each emulated cell is predicted as project_gpu predicts a GPU cluster (``project_gpu.project_traffic``), with
what this machine measured in its place: the compute is the cell's own floor (P ranks sharing the cores),
a row's own cost is its P = 1 cost scaled by the floors' ratio (ranks sharing cores do all local work that
much slower), the link between nodes is the emulated rate with the alpha the benchmark's probe measured on
that network, the constants inside a node are the probe's alpha and beta on loopback at the same P, and
topk's allgather is gloo's (direct: each rank's pairs to each rank of the other nodes).
The error is |predicted - measured| / measured, per cell, with its median per network and P.
"""
import argparse
import json
import statistics

from . import netem, project_gpu
from .report import summarize

# The benchmark's rows as project_gpu's (algorithm, options); the others are refused by name.
_BENCH = {"ddp": ("ddp", {}), "ddp_fp16": ("ddp", {"hook": "fp16"})}
_OURS = ("gradient_allreduce", "qadam", "topk", "gtopk", "powersgd", "local_sgd", "diloco")


def bench_traffic(name, options):
    """project_gpu's (kind of traffic, options) for a benchmark row."""
    if name in _BENCH:
        return project_gpu.traffic_of(*_BENCH[name])[0]
    if name == "ddp_powersgd":
        return "powersgd", {"rank": options.get("rank", 1)}  # torch's hook's default rank
    if name not in _OURS:
        raise ValueError(f"project_check: no traffic model for the row {name!r}; modelled: "
                         f"{', '.join(list(_BENCH) + ['ddp_powersgd', *_OURS])}")
    try:
        return project_gpu.traffic_of(name, options)[0]
    except KeyError as e:
        raise ValueError(f"project_check: the row {name!r} needs its option {e.args[0]!r} in the config "
                         "(the model does not guess an algorithm's default)") from None


def load(path):
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not any(r["kind"] == "cell" for r in records):
        raise ValueError(f"project_check: {path} has no throughput cells (a records.jsonl of mode throughput)")
    return records


def _options(records):
    return {(c["network"], c["world_size"], c["label"]): (c["algorithm"], c["options"])
            for c in records if c["kind"] == "cell"}


def _rate_gbits(network):
    rate = netem.NETWORKS.get(network)
    return None if rate is None else netem.parse_rate(rate) / 1e9


def own_costs(single):
    """{label: (own s/step at P = 1, the P = 1 floor)} from the single-rank run."""
    rows = [r for r in summarize(single) if r["world_size"] == 1 and r["straggler"] == "none"]
    if not rows:
        raise ValueError("project_check: --single has no P = 1 cells")
    return {r["algorithm"]: (max(0.0, r["step_s"] - r["floor_s"]), r["floor_s"]) for r in rows}


def check(nodes, single, ranks_per_node, shapes=None):
    """Every emulated cell of ``nodes``: measured and predicted s/step, the error and the bound."""
    own = own_costs(single)
    nets = {(r["network"], r["world_size"]): r for r in nodes if r["kind"] == "network"}
    opts = _options(nodes)
    cells = []
    for r in summarize(nodes):
        gbits = _rate_gbits(r["network"])
        if gbits is None or r["straggler"] != "none":
            continue
        P = r["world_size"]
        loop = nets.get(("loopback", P))
        if loop is None:
            raise ValueError(f"project_check: --nodes needs the loopback network at P = {P} (the constants "
                             "inside a node)")
        if r["algorithm"] not in own:
            raise ValueError(f"project_check: the row {r['algorithm']!r} was not measured at P = 1 (--single)")
        own1, floor1 = own[r["algorithm"]]
        plain = r["floor_s"]
        name, options = opts[(r["network"], P, r["algorithm"])]
        links = {"alpha_in": loop["alpha"], "beta_in": loop["beta"], "alpha_out": nets[(r["network"], P)]["alpha"],
                 "allgather": "direct"}
        pred = project_gpu.project_traffic(bench_traffic(name, options), plain + own1 * plain / floor1, plain,
                                           _numel(nodes, r), P, ranks_per_node, gbits,
                                           shapes=shapes, links=links)
        cells.append({"network": r["network"], "P": P, "nodes": P // ranks_per_node, "row": r["algorithm"],
                      "measured_s": r["step_s"], "predicted_s": pred["step_s"], "floor_s": plain,
                      "own_s": pred["own_s"], "bandwidth_s": pred["bandwidth_s"], "latency_s": pred["latency_s"],
                      "bound": pred["bound"], "error": abs(pred["step_s"] - r["step_s"]) / r["step_s"],
                      "links": links})
    if not cells:
        raise ValueError("project_check: --nodes has no cells on an emulated network (1gbit, 100mbit, ...)")
    return cells


def _numel(records, row):
    return next(c["numel"] for c in records if c["kind"] == "cell" and c["label"] == row["algorithm"])


def medians(cells):
    """{(network, P): median error} and the median over every cell."""
    groups = {}
    for c in cells:
        groups.setdefault((c["network"], c["P"]), []).append(c["error"])
    return {k: statistics.median(v) for k, v in groups.items()}, statistics.median(c["error"] for c in cells)


def table(cells):
    per, overall = medians(cells)
    lines = ["| network | P (nodes) | row | measured s/step | predicted | error | bound |", "|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['network']} | {c['P']} ({c['nodes']}) | {c['row']} | {c['measured_s']:.3f} | "
                     f"{c['predicted_s']:.3f} | {100 * c['error']:.0f}% | {c['bound']} |")
    lines.append("")
    lines += [f"median error, {n} P = {P}: {100 * e:.0f}%" for (n, P), e in per.items()]
    lines.append(f"median error, every cell: {100 * overall:.0f}%")
    return "\n".join(lines)


def _shapes(records):
    """PowerSGD's matrices: the parameter shapes of the run's model (only when a PowerSGD row is checked)."""
    from .zoo import fresh_model  # lazy: builds a torch model, needed for PowerSGD rows only

    models = {c["model"] for c in records if c["kind"] == "cell"}
    if len(models) != 1:
        raise ValueError(f"project_check: --nodes must hold one model, got {sorted(models)}")
    return [tuple(p.shape) for p in fresh_model(models.pop())[0].parameters()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", required=True, help="records.jsonl of the run in nodes (ranks_per_node > 1)")
    p.add_argument("--single", required=True, help="records.jsonl of the same rows at P = 1")
    p.add_argument("--ranks-per-node", type=int, required=True, help="the --nodes run's ranks_per_node")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.ranks_per_node < 2:
        p.error(f"--ranks-per-node must be >= 2 (nodes of one rank have no inside), got {args.ranks_per_node}")
    try:
        nodes, single = load(args.nodes), load(args.single)
        bad = sorted({c["world_size"] for c in nodes if c["kind"] == "cell" and c["world_size"] % args.ranks_per_node})
        if bad:
            raise ValueError(f"project_check: --ranks-per-node {args.ranks_per_node} does not divide P = {bad}")
        powersgd = any(c["kind"] == "cell" and "powersgd" in c["algorithm"] for c in nodes)
        cells = check(nodes, single, args.ranks_per_node, _shapes(nodes) if powersgd else None)
    except ValueError as e:
        p.error(str(e))
    text = table(cells)
    print(text)
    if args.out:
        project_gpu.write_table(args.out, "check", cells, text)
    return cells


if __name__ == "__main__":
    main()
