"""Figures for clusters we cannot rent: one GPU's measured step, projected to P GPUs in nodes over slow links.

    python -m bagua_lite.bench.project_gpu --step step.json [--sizes 8,32,128,256] [--gbits 1,10,25,100]
                                           [--gpus-per-node 8] [--nics 1] [--out DIR]
    (DIR: projection.json, projection.md and projection.png)

What is measured (on one GPU, ``python -m bagua_lite.bench.gpu_step --json step.json``, P = 1): the plain
loop's step, which is the compute, and each row's step; a row's time over the plain loop's is its own cost per
step (hooks, bucket copies, codecs, selection), which it pays at any P. What is modelled: the links.

The cluster: P GPUs, G per node, N = P / G nodes. Inside a node NVLink-class links (``ALPHA_IN``, ``BETA_IN``:
stated constants, not measured here; ``project_check`` passes measured ones); between nodes one link of R
Gbit/s per node (``ALPHA_OUT``), shared by the node's G GPUs (``nics`` links per node divide the time). A message of m bytes costs alpha + m beta.
Per step, with n gradient elements, W the bytes of a whole gradient on the wire and k = density n pairs of
8 bytes (a float32 value and an int32 index):
- dense ring (DDP, its fp16 hook, gradient_allreduce with a codec; W = 4n, 2n, n + 8, n / 8 + 4): one
  ring through all P ranks, node after node, as NCCL's ring algorithm and gloo's ring allreduce run it:
  each node's link carries 2 (P-1)/P W bytes in 2 (P-1) messages, and the edges inside the node run at
  the same time (one node: 2 (G-1)/G W at the inside constants). A hierarchical allreduce (Horovod's,
  BAGUA's) would send 2 (N-1)/N W: half as much at N = 2, within 7% of the ring from N = 16;
- gradient_allreduce ``hierarchical``: a reduce to each node's leader, a ring of the N leaders, a broadcast
  back: 2 (N-1)/N W through each node's link in 2 (N-1) messages, and a reduce and a broadcast of W inside;
- topk: every rank's k pairs reach every other rank (an allgather): NCCL's ring passes each rank's pairs
  once through every edge, (P-1) k 8 bytes through each node's link in P - 1 messages; gloo's allgather
  (``LINKS["allgather"] = "direct"``, project_check) sends each rank's pairs to each rank of the other
  nodes, G (P-G) k 8 bytes;
- gtopk: recursive doubling, log2 P rounds of k pairs; the log2 N rounds whose partner is in another node
  send all G GPUs' pairs through the node's link at once (G k 8 bytes a round), the log2 G others stay
  inside (P not a power of two: the next one up);
- powersgd rank r: a dense ring of the P factors, then one of the Q factors (r rows and r cols per matrix),
  with the 1-D tensors whole, fp32;
- qadam: the dense ring of its compressed momentum (fp16 by default);
- local_sgd, diloco with period H: a dense ring of the fp32 weights every H steps, after the step.
Every row but PowerSGD's sends bucket by bucket (25 MB buckets), each bucket an exchange of its own with its
own latencies. The synchronous gradient rows (and DDP's) run their buckets during backward, ``BACKWARD_FRACTION`` of the
compute; only what sticks out after it is paid (``cost_time.pipeline``). The periodic rows' averages are
not overlapped.

Each cell says what bounds it: the largest of compute, own (the row's measured cost over the plain loop),
bandwidth (exposed bytes x beta) and latency (exposed messages x alpha). Time to target is s/step times steps
to target, with the steps as a ratio to DDP's (``cost_choice.efficiency_of``, or ``--efficiency`` with a
convergence run's ``results.json``); the tables say PROJECTED.
"""
import argparse
import json
import math
import os

from ..cost_choice import efficiency_of, efficiencies_from_results
from ..cost_time import pipeline
from ..cost_traffic import k_of, wire_bytes
from . import gpu_step
from .plot import pyplot

ALPHA_IN, BETA_IN = 5e-6, 1 / 150e9   # inside a node: NVLink-class, per GPU
ALPHA_OUT = 25e-6                     # between nodes, per message
# project_check passes measured constants, and gloo's allgather ("direct")
LINKS = {"alpha_in": ALPHA_IN, "beta_in": BETA_IN, "alpha_out": ALPHA_OUT, "allgather": "ring"}
BACKWARD_FRACTION = 0.66              # the share of a step that is backward (the overlap window)
BUCKET_BYTES = 25 * 2**20

def traffic(row):
    """((kind of traffic, its options), (algorithm, options) for its steps to target) of one of gpu_step's rows:
    what the row sends, in the terms of the module docstring, read from the row's own algorithm and options."""
    return traffic_of(*gpu_step.ROWS[row])


def traffic_of(name, options):
    """``traffic`` of an algorithm (or ``ddp`` with ``hook`` None, fp16 or powersgd) and its options."""
    if name == "ddp":
        hook = options.get("hook")
        if hook == "powersgd":
            return ("powersgd", {"rank": gpu_step.DDP_POWERSGD_RANK}), ("ddp_powersgd", {})
        return ("dense", {"wire": hook or "fp32"}), ("ddp_fp16" if hook else "ddp", {})
    if name in ("topk", "gtopk"):
        return (name, {"density": options["density"]}), (name, options)
    if name == "powersgd":
        return ("powersgd", {"rank": options["rank"]}), (name, options)
    if name in ("local_sgd", "diloco"):
        return ("periodic", {"period": options["period"]}), (name, options)
    # gradient_allreduce and qadam: a dense ring of their codec's bytes (qadam's default codec: fp16)
    codec = options.get("compression", "fp16" if name == "qadam" else "none")
    kind = "hierarchical" if options.get("hierarchical") else "dense"
    return (kind, {"wire": "fp32" if codec == "none" else codec}), (name, {})


def projectable(row):
    return row in gpu_step.ROWS and gpu_step.ROWS[row][0] != "plain"


def wire(kind, n):
    """Bytes of n gradient elements on the wire: fp32, or a codec's (cost_traffic.wire_bytes)."""
    return 4 * n if kind == "fp32" else wire_bytes(kind, n)


def powersgd_bytes(shapes, rank):
    """fp32 bytes PowerSGD sends per round: r (rows + cols) per matrix (its P and Q), 1-D tensors whole."""
    total = 0
    for shape in shapes:
        if len(shape) >= 2:
            rows, cols = shape[0], math.prod(shape[1:])
            total += min(rank, rows, cols) * (rows + cols)
        else:
            total += math.prod(shape)
    return 4 * total


def link(P, G, gbits, nics=1):
    """Seconds per byte through one node's links (P must fill whole nodes)."""
    if P % G and P > G:
        raise ValueError(f"project_gpu: P ({P}) must be a multiple of the GPUs per node ({G})")
    return 8 / (gbits * 1e9 * nics)


def exchange(kind, options, n, P, G, shapes=None, links=None):
    """(bytes through a node's link, messages across nodes, seconds inside the node) of one exchange."""
    links = links or LINKS
    a_in, b_in = links["alpha_in"], links["beta_in"]
    g = min(G, P)
    N = max(1, P // g)
    if kind in ("dense", "periodic", "powersgd", "hierarchical"):
        if kind == "powersgd":
            W = powersgd_bytes(shapes, options["rank"])
        else:
            W = wire(options.get("wire", "fp32"), n)
        if kind == "hierarchical":  # reduce to the node's leader, a ring of the N leaders, broadcast back
            inside = 2 * (math.ceil(math.log2(g)) * a_in + W * b_in) if g > 1 else 0.0
            return (2 * (N - 1) / N * W, 2 * (N - 1), inside) if N > 1 else (0.0, 0, inside)
        if N == 1:
            return 0.0, 0, (2 * (g - 1) * a_in + 2 * (g - 1) / g * W * b_in) if g > 1 else 0.0
        # one ring through every rank, node after node: each of its 2 (P-1) steps waits for the edge that
        # leaves the node, and the edges inside run at the same time
        return 2 * (P - 1) / P * W, 2 * (P - 1), 0.0
    k = k_of(options["density"], n)
    pairs = 8 * k
    if kind == "topk":
        if N == 1:
            return 0.0, 0, ((g - 1) * a_in + (g - 1) * pairs * b_in) if g > 1 else 0.0
        if links.get("allgather", "ring") == "ring":  # NCCL's: every rank's pairs pass each edge once
            return (P - 1) * pairs, P - 1, 0.0
        return g * (P - g) * pairs, P - g, 0.0  # direct (gloo's): each rank's pairs to each rank of the other nodes
    if kind == "gtopk":
        rounds_out = math.ceil(math.log2(N)) if N > 1 else 0
        rounds_in = math.ceil(math.log2(g)) if g > 1 else 0
        return rounds_out * g * pairs, rounds_out, rounds_in * (a_in + pairs * b_in)
    raise ValueError(f"project_gpu: unknown traffic kind {kind!r}")


def project_row(row, measured, plain_s, n, P, G, gbits, nics=1, shapes=None, links=None):
    """One cell of gpu_step's ``row``: s/step and its parts, and what bounds it (``project_traffic``)."""
    return project_traffic(traffic(row)[0], measured, plain_s, n, P, G, gbits, nics, shapes, links)


def project_traffic(traffic_kind, measured, plain_s, n, P, G, gbits, nics=1, shapes=None, links=None):
    """One cell: s/step and its parts, and what bounds it. ``measured``: the row's step at P = 1 (its own
    cost is that over ``plain_s``, the compute); ``links``: LINKS's keys (default: LINKS)."""
    kind, options = traffic_kind
    links = links or LINKS
    beta_out = link(P, G, gbits, nics)
    own = max(0.0, measured - plain_s)
    if P == 1:
        return {"step_s": measured, "compute_s": plain_s, "own_s": own, "bandwidth_s": 0.0, "latency_s": 0.0,
                "bound": "compute" if plain_s >= own else "own"}
    buckets = max(1, math.ceil(4 * n / BUCKET_BYTES))
    numels = [n // buckets + (1 if i < n % buckets else 0) for i in range(buckets)]
    if kind == "powersgd":  # one round over every matrix: a ring of the P factors, then one of the Qs
        nbytes, msgs, inside = exchange(kind, options, n, P, G, shapes, links)
        msgs, inside = 2 * msgs, 2 * inside
    else:  # bucket by bucket, each its own exchange (its own latencies)
        per = [exchange(kind, options, b, P, G, links=links) for b in numels]
        nbytes, msgs, inside = (sum(x[j] for x in per) for j in range(3))
    bw, lat = nbytes * beta_out, msgs * links["alpha_out"] + inside
    if kind == "periodic":
        H = options["period"]
        exposed_bw, exposed_lat = bw / H, lat / H
    else:
        comm = bw + lat
        exposed = pipeline([comm / buckets] * buckets, numels, BACKWARD_FRACTION * plain_s)
        share = exposed / comm if comm else 0.0
        exposed_bw, exposed_lat = bw * share, lat * share
    step = plain_s + own + exposed_bw + exposed_lat
    parts = {"compute": plain_s, "own": own, "bandwidth": exposed_bw, "latency": exposed_lat}
    return {"step_s": step, "compute_s": plain_s, "own_s": own, "bandwidth_s": exposed_bw, "latency_s": exposed_lat,
            "bytes_per_node": nbytes, "bound": max(parts, key=parts.get)}


def reference_shapes(model, params):
    """The parameter shapes of gpu_step's ``model`` at the size that has ``params`` parameters (its reference
    size or its ``--small`` one), built on the meta device (no memory)."""
    import torch  # lazy: the projection itself is arithmetic; only PowerSGD's shapes need the model

    from .gpu_step import build_model  # lazy: gpu_step builds torch models, as above

    for small in (False, True):
        with torch.device("meta"):
            shapes = [tuple(p.shape) for p in build_model(model, small).parameters()]
        if sum(math.prod(s) for s in shapes) == params:
            return shapes
    raise ValueError(f"project_gpu: {params} parameters is neither size of gpu_step's {model!r}")


def project(step_rows, sizes, gbits_list, G=8, nics=1, efficiency=None, shapes=None):
    """Every measured row at every (P, link speed): a list of cells with s/step, x DDP per step and to target."""
    by = {r["row"]: r for r in step_rows if "ms" in r}
    for need in ("plain", "ddp"):
        if need not in by:
            raise ValueError(f"project_gpu: the step results need the {need!r} row (measured in the same run)")
    plain_s, n = by["plain"]["ms"] / 1e3, int(by["plain"]["params"])
    rows = [r for r in by if projectable(r)]
    steps = {r: efficiency_of(*traffic(r)[1], efficiency) for r in rows}  # (ratio, source)
    ddp_steps = steps["ddp"][0]
    cells = []
    for gbits in gbits_list:
        for P in sizes:
            got = {r: project_row(r, by[r]["ms"] / 1e3, plain_s, n, P, G, gbits, nics, shapes) for r in rows}
            ddp = got["ddp"]["step_s"]
            for r in rows:
                eff, source = steps[r]
                c = got[r]
                cells.append({"P": P, "gbits": gbits, "row": r, **c, "x_ddp": ddp / c["step_s"],
                              "efficiency": eff, "efficiency_source": source,
                              "x_ddp_to_target": ddp * ddp_steps / (c["step_s"] * eff)})
    return cells


def table(cells, gbits):
    sizes = sorted({c["P"] for c in cells})
    rows = list(dict.fromkeys(c["row"] for c in cells))
    at = {(c["row"], c["P"]): c for c in cells if c["gbits"] == gbits}
    head = "| row | " + " | ".join(f"P = {P}: s/step, x DDP (to target), bound" for P in sizes) + " |"
    lines = [f"PROJECTED, {gbits:g} Gbit/s between nodes:", head, "|---|" + "---|" * len(sizes)]
    for r in rows:
        cols = [f"{at[r, P]['step_s']:.3f}, {at[r, P]['x_ddp']:.2f}x ({at[r, P]['x_ddp_to_target']:.2f}x), "
                f"{at[r, P]['bound']}" for P in sizes]
        lines.append(f"| {r} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def write_table(out_dir, stem, cells, text):
    """``stem``.json (the cells) and ``stem``.md (the printed table) in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(cells, f, indent=1)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(text + "\n")


def plot(cells, path):
    """x DDP to target against P, one panel per link speed, a line per row (torch's rows grey, dashed)."""
    plt = pyplot()
    if plt is None:
        return False
    speeds = list(dict.fromkeys(c["gbits"] for c in cells))
    fig, axes = plt.subplots(1, len(speeds), figsize=(4.2 * len(speeds), 3.8), squeeze=False, sharey=True)
    for ax, g in zip(axes[0], speeds):
        for r in dict.fromkeys(c["row"] for c in cells):
            pts = sorted((c["P"], c["x_ddp_to_target"]) for c in cells if c["row"] == r and c["gbits"] == g)
            torch_row = r.startswith("ddp")
            ax.plot([p for p, _ in pts], [v for _, v in pts], marker=".", label=r,
                    color="k" if torch_row else None, linestyle="--" if torch_row else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel("GPUs (P)")
        ax.set_title(f"{g:g} Gbit/s between nodes", fontsize=9)
    axes[0][0].set_ylabel("x DDP, time to target (PROJECTED)")
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step", required=True, help="gpu_step's --json results (P = 1, one GPU)")
    p.add_argument("--model", default="gpt", help="the step results' model to project (gpu_step --models)")
    p.add_argument("--sizes", default="8,32,128,256")
    p.add_argument("--gbits", default="1,10,25,100", help="link speeds between nodes, Gbit/s")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nics", type=int, default=1, help="inter-node links per node (default 1, shared)")
    p.add_argument("--efficiency", default=None, help="a convergence run's results.json: steps to target per row")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        gbits = [float(s) for s in args.gbits.split(",") if s.strip()]
    except ValueError as e:
        p.error(f"--sizes takes ints and --gbits numbers, comma-separated ({e})")
    if not sizes or min(sizes) < 1 or not gbits or min(gbits) <= 0:
        p.error(f"--sizes must be ints >= 1 and --gbits > 0, got {args.sizes!r} and {args.gbits!r}")
    if args.gpus_per_node < 1 or args.nics < 1:
        p.error("--gpus-per-node and --nics must be >= 1")
    with open(args.step) as f:
        rows = [r for r in json.load(f) if r.get("model", "gpt") == args.model]
    if not rows:
        p.error(f"no rows of model {args.model!r} in {args.step}")
    eff = None
    if args.efficiency:
        with open(args.efficiency) as f:
            eff = efficiencies_from_results(json.load(f))
    # PowerSGD's factors follow the matrices: the reference transformer's (resnet18's convolutions: as matrices)
    powersgd = any(projectable(r.get("row")) and traffic(r["row"])[0][0] == "powersgd" for r in rows)
    shapes = reference_shapes(args.model, int(rows[0]["params"])) if powersgd else None
    cells = project(rows, sizes, gbits, args.gpus_per_node, args.nics, eff, shapes)
    text = "\n\n".join(table(cells, g) for g in gbits)
    print(text)
    if args.out:
        write_table(args.out, "projection", cells, text)
        plot(cells, os.path.join(args.out, "projection.png"))
    return cells


if __name__ == "__main__":
    main()
