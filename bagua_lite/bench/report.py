"""The benchmark's reports: the summary rows, the tables, auto's score, projections, JSON/CSV and plots."""
import csv
import json
import os
import statistics
import sys
import textwrap

from .. import cost_model
from .config import BASELINES, HOOK_BASELINES, STRAGGLER_RANK
from .plot import pyplot


def cycle_median(values, cycle=1):
    """Median over whole cycles of the per-cycle mean: a per-step figure that counts a periodic
    algorithm's communication step (a plain per-step median would drop it as an outlier)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    cycle = max(1, int(cycle))
    if len(values) < cycle:
        return statistics.fmean(values)
    chunks = [values[i:i + cycle] for i in range(0, len(values) - cycle + 1, cycle)]
    return statistics.median(statistics.fmean(ch) for ch in chunks)


def _counted(name):
    """Whether bagua_lite's traffic counter sees a row's collectives: ours, and DDP with bagua_lite's hooks."""
    return name not in BASELINES or name in HOOK_BASELINES


def _ddp_baseline(cells, c, name="algorithm", base="ddp"):
    """The DDP cell ``c`` is compared with: same network, P, model and straggler condition; the same
    optimizer if the matrix measured DDP with it, else the first plain DDP cell of that group. ``name``:
    the key holding the algorithm's name (``algorithm`` in records, ``name`` in summary rows); ``base``
    another baseline to find the same way (``ddp_fp16``, ``torchft_diloco``, ...)."""
    group = [d for d in cells if d[name] == base and d["network"] == c["network"]
             and d["world_size"] == c["world_size"] and d["model"] == c["model"]
             and d.get("straggler", "none") == c.get("straggler", "none")]
    same = [d for d in group if d.get("optimizer", "sgd") == c.get("optimizer", "sgd")]
    return (same or group or [None])[0]


#: the data-parallel reference a convergence table compares with: (baseline name, how the table names it).
#: DDP for whole models; FSDP2's own HSDP for sharded ones (``shards`` > 1, where the config allows no ddp row)
REFERENCES = (("ddp", "DDP"), ("hsdp", "HSDP"))


def reference(rows):
    """(name, title) of the reference of a table's rows (``REFERENCES``): DDP when it has a DDP row or no
    HSDP row, else native HSDP. Its ``speedup_vs_<name>`` and ``bytes_vs_<name>`` fill the ``vs`` columns."""
    if not any(r["name"] == "ddp" for r in rows) and any(r["name"] == "hsdp" for r in rows):
        return REFERENCES[1]
    return REFERENCES[0]


def _cell_figures(c):
    """step_s, samples_per_s, each rank's median step time and the non-stragglers' median of a cell."""
    cyc = c.get("cycle", 1)
    step = cycle_median(c["times"], cyc)
    rank_s = [cycle_median(ts, cyc) for ts in c.get("rank_times") or []]
    straggler = c.get("straggler", "none")
    others = [t for r, t in enumerate(rank_s) if t is not None and not (straggler != "none" and r == STRAGGLER_RANK)]
    fast = statistics.median(others) if others else None
    if c.get("asynchronous") and rank_s and all(rank_s):
        samples = c["batch_size"] * sum(1.0 / t for t in rank_s)  # no rank waits for the others
    else:
        samples = c["world_size"] * c["batch_size"] / step
    return step, samples, (rank_s or None), fast


_LISTS = ("times", "waits", "busy", "bytes", "tx_bytes")  # a cell record's per-step series


DRIFT_LIMIT = 1.25  # floors of one model and P further apart than this (max / min): the machine's speed moved


def _floors(records):
    """{(network, P, model): [floor records, in the order measured]}."""
    out = {}
    for r in records:
        if r["kind"] == "floor":
            out.setdefault((r["network"], r["world_size"], r["model"]), []).append(r)
    return out


def _cell_floor(c, floors):
    """The floor a cell record divides by: its own (``floor_each_cell``), else its repeat's, measured in
    the same rotation (``runner.rotation``); records without one (an interrupted run) take the median of
    their model's floors."""
    if c.get("floor_s") is not None:
        return c["floor_s"]
    mine = floors.get((c["network"], c["world_size"], c["model"]), [])
    same = [f["step_s"] for f in mine if f.get("repeat", 0) == c.get("repeat", 0) and "before" not in f]
    pick = same or [f["step_s"] for f in mine]
    return statistics.median(pick) if pick else None


def merge_repeats(cells, floors=None):
    """One record per cell of the matrix: the repeats of a cell (``repeats`` in the config; same network,
    P, model, label, straggler condition and optimizer) pooled, their per-step series concatenated,
    ``repeat_step_s`` / ``repeat_floor_s`` each repeat's own s/step and floor (the floor measured in that
    repeat's rotation, or right before the cell with ``floor_each_cell``; ``floors`` as ``_floors``
    returns them), and ``floor_s`` the median of the repeats' floors."""
    floors = floors or {}
    groups = {}
    for c in cells:
        key = (c["network"], c["world_size"], c["model"], c["label"], c.get("straggler", "none"),
               c.get("optimizer", "sgd"))
        groups.setdefault(key, []).append(c)
    out = []
    for same in groups.values():
        m = dict(same[0])
        m["repeat_step_s"] = [cycle_median(c["times"], c.get("cycle", 1)) for c in same]
        m["repeat_floor_s"] = [_cell_floor(c, floors) for c in same]
        known = [f for f in m["repeat_floor_s"] if f is not None]
        m["floor_s"] = statistics.median(known) if known else None
        if len(same) > 1:
            for f in _LISTS:
                m[f] = [v for c in same for v in (c.get(f) or [])]
            if same[0].get("rank_times"):
                m["rank_times"] = [[t for c in same for t in c["rank_times"][r]]
                                   for r in range(len(same[0]["rank_times"]))]
            m["loss"] = same[-1]["loss"]
            m["picked"] = next((c.get("picked") for c in same if c.get("picked")), None)
        out.append(m)
    return out


def _predict(c, nets, floors):
    """The cost model's prediction for a merged cell, made with the floor the row is compared with (a
    prediction adds communication to the compute it is given): a dict with ``step_s``, or ``skipped`` /
    ``error``."""
    if c.get("straggler", "none") != "none":
        return {"skipped": "the cost model knows no stragglers"}
    nr = nets.get((c["network"], c["world_size"]))
    if nr is None or not c["floor_s"]:
        return {"skipped": "no network probe or floor recorded"}
    mine = floors.get((c["network"], c["world_size"], c["model"])) or [{}]
    work = cost_model.Workload(numel=c["numel"], compute_s=c["floor_s"], bucket_numels=mine[0].get("bucket_numels"))
    net = cost_model.Network(alpha=nr["alpha"], beta=nr["beta"], host_local=nr.get("host_local", False))
    try:
        return cost_model.predict(c["algorithm"], c["options"], c["world_size"], work, net,
                                  cost_model.Machine(**nr["machine"]))
    except Exception as e:  # noqa: BLE001  (a model gap must not lose the measurement)
        return {"error": str(e)}


def floor_spread(records, limit=DRIFT_LIMIT):
    """How far apart the compute floors of each model and P of the run are: one dict per (model, P) with
    at least two floor measurements (across networks, repeats and, with ``floor_each_cell``, cells; the
    floor has no communication, so the network does not change it): ``measurements``, ``min_s`` /
    ``max_s`` and where each was measured (``fastest`` / ``slowest``: network, repeat, next cell),
    ``ratio`` = max / min, and ``drifted``: ratio > ``limit``. The floors of six runs of
    benchmark_sparse_floor.yaml (docs/results.md) are within 1.15x of each other; a wider spread means the machine's speed moved during the run (another job, steal
    time), and rows measured at different times are then not comparable with each other."""
    groups = {}
    for r in records:
        if r["kind"] == "floor":
            groups.setdefault((r["model"], r["world_size"]), []).append(r)

    def where(f):
        return (f"{f['network']}, repeat {f.get('repeat', 0) + 1}"
                + (f", before {f['before']}" if f.get("before") else ""))

    out = []
    for (model, P), fs in groups.items():
        if len(fs) < 2:
            continue
        lo, hi = min(fs, key=lambda f: f["step_s"]), max(fs, key=lambda f: f["step_s"])
        ratio = hi["step_s"] / lo["step_s"] if lo["step_s"] > 0 else float("inf")
        out.append({"model": model, "world_size": P, "measurements": len(fs), "min_s": lo["step_s"],
                    "max_s": hi["step_s"], "fastest": where(lo), "slowest": where(hi), "ratio": ratio,
                    "limit": limit, "drifted": ratio > limit})
    return out


def drift_lines(spread):
    """One sentence per drifted (model, P) of ``floor_spread``'s list."""
    return [f"the machine's speed moved during the run: the compute floor of {d['model']} at P={d['world_size']} "
            f"measured {d['min_s']:.3f} s ({d['fastest']}) to {d['max_s']:.3f} s ({d['slowest']}), "
            f"{d['ratio']:.2f}x apart over {d['measurements']} measurements (more than {d['limit']:.2f}x): "
            "rows measured at different times are not comparable; each row's x floor uses its own repeats' floors"
            for d in spread if d["drifted"]]


def summarize(records):
    """Turn raw records into one row per cell with medians (over whole cycles) and ratios; a cell
    measured more than once (``repeats``) is one row over all its steps (``merge_repeats``), compared
    with the median of its repeats' floors; ``below_floor``: its s/step is under that floor (x floor < 1:
    only a change of the machine's speed between floor and row makes that)."""
    floors = _floors(records)
    nets = {(r["network"], r["world_size"]): r for r in records if r["kind"] == "network"}
    cells = merge_repeats([r for r in records if r["kind"] == "cell"], floors)
    rows = []
    for c in cells:
        cyc = c.get("cycle", 1)
        step, samples, rank_s, fast = _cell_figures(c)
        world = c["world_size"]
        straggler = c.get("straggler", "none")
        ddp = _ddp_baseline(cells, c)
        ddp_samples = _cell_figures(ddp)[1] if ddp else None
        wait = cycle_median(c["waits"], cyc)
        busy = cycle_median(c["busy"], cyc)
        # bagua_lite's own counter sees our collectives only (ours and bagua_lite.hooks'); DDP's bytes show on
        # emulated links' counters.
        counted = cycle_median(c["bytes"], cyc) if c["bytes"] and _counted(c["algorithm"]) else None
        floor = c["floor_s"]
        # with a straggler the step includes its sleep: that is not communication
        comm_s = max(0.0, step - floor) if straggler == "none" and floor else None
        hidden = None
        if busy:
            hidden = max(0.0, min(1.0, 1.0 - (wait or 0.0) / busy))
        pred = _predict(c, nets, floors)
        pred_step = pred.get("step_s")
        rows.append({
            "network": c["network"], "world_size": world, "model": c["model"], "algorithm": c["label"],
            "name": c["algorithm"], "optimizer": c.get("optimizer", "sgd"), "straggler": straggler,
            "asynchronous": bool(c.get("asynchronous", False)),
            "step_s": step, "fast_s_per_step": fast, "rank_s_per_step": rank_s,
            "steps_measured": len(c["times"]), "samples_per_s": samples,
            "speedup_vs_ddp": (samples / ddp_samples) if ddp_samples else None,
            "ddp_baseline": ddp["label"] if ddp else None, "floor_s": floor,
            "vs_floor": step / floor if floor else None, "below_floor": bool(floor and step < floor),
            "comm_exposed_s": comm_s, "engine_busy_s": busy, "hidden_share": hidden,
            "bytes_per_step_counted": counted, "bytes_per_step_wire": cycle_median(c["tx_bytes"], cyc),
            "final_loss": c["loss"], "predicted_step_s": pred_step,
            "prediction_error": (abs(pred_step - step) / step) if pred_step else None,
            "picked": c.get("picked"), "repeats": len(c["repeat_step_s"]), "repeat_step_s": c["repeat_step_s"],
            "repeat_floor_s": c["repeat_floor_s"],
        })
    return rows


def print_table(rows, out=sys.stdout, spread=None):
    """The throughput table and its notes; a row below its floor has its x floor marked ``!`` and a
    footnote says why; ``spread`` (``floor_spread``'s list) adds a line per model and P whose floors
    drifted apart, or says when there were too few floors to tell."""
    # Optional columns, shown only where they say something: the straggler condition when the matrix
    # has more than one, the non-stragglers' s/step when there is a straggler or an asynchronous
    # algorithm, the optimizer when a row is not SGD.
    stragglers = list(dict.fromkeys(r["straggler"] for r in rows))
    show_straggler = len(stragglers) > 1
    show_fast = any(r["straggler"] != "none" or r["asynchronous"] for r in rows)
    show_opt = any(r["optimizer"] != "sgd" for r in rows)
    hdr = (f"{'network':<9}{'P':>3} {'model':<9} " + (f"{'straggler':<10}" if show_straggler else "")
           + f"{'algorithm':<34}" + (f"{'optim':<6}" if show_opt else "") + f"{'s/step':>8}"
           + (f"{'fast':>7}" if show_fast else "")
           + f"{'samples/s':>10}{'vs DDP':>8}"
           f"{'floor':>7}{'x floor':>8}{'exposed':>8}{'hidden':>7}{'MB/step':>9}{'loss':>8}{'pred':>7}{'err':>6}")
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    def fmt(v, f):
        return format("-", f[0] + f[1:].split(".")[0].rstrip("%")) if v is None else format(v, f)

    for r in rows:
        mb = r["bytes_per_step_wire"] if r["bytes_per_step_wire"] is not None else r["bytes_per_step_counted"]
        print(f"{r['network']:<9}{r['world_size']:>3} {r['model']:<9} "
              + (f"{r['straggler'][:9]:<10}" if show_straggler else "")
              + f"{r['algorithm'][:33]:<34}" + (f"{r['optimizer']:<6}" if show_opt else "")
              + f"{r['step_s']:>8.3f}" + (fmt(r["fast_s_per_step"], ">7.3f") if show_fast else "")
              + f"{r['samples_per_s']:>10.1f}{fmt(r['speedup_vs_ddp'], '>8.2f')}{fmt(r['floor_s'], '>7.3f')}"
              f"{_x_floor(r)}{fmt(r['comm_exposed_s'], '>8.3f')}{fmt(r['hidden_share'], '>7.0%')}"
              f"{fmt(None if mb is None else mb / 1e6, '>9.2f')}"
              f"{r['final_loss']:>8.3f}{fmt(r['predicted_step_s'], '>7.3f')}{fmt(r['prediction_error'], '>6.0%')}",
              file=out)
    print("floor: the same step without any communication, measured in every repeat among the rows it divides "
          "(before each cell with floor_each_cell); a row's floor is the median of its repeats' floors; "
          "x floor: s/step over it.", file=out)
    below = [r for r in rows if r.get("below_floor")]
    if below:
        print(f"! x floor below 1 ({len(below)} row{'s' if len(below) > 1 else ''}): faster than its floor: the "
              "machine's speed moved between the floor's measurement and the row's, so that row's figures are "
              "not the algorithm's alone.", file=out)
    for line in drift_lines(spread or []):
        print(line, file=out)
    seen = {(d["model"], d["world_size"]) for d in spread or []}
    if spread is not None and any((r["model"], r["world_size"]) not in seen for r in rows):
        print("one floor measurement per model and P: a change of the machine's speed during the run cannot be "
              "told from the floors (repeats: 2 or more measures one per repeat).", file=out)
    print("MB/step: bytes this rank sent per step (network namespace counter on emulated links, bagua_lite's "
          "own counter on loopback; '-' prediction: no model). hidden: share of engine time overlapped with "
          "backward.", file=out)
    if show_fast:
        print(f"s/step: the slowest rank's; fast: the median rank other than the straggler (rank {STRAGGLER_RANK}). "
              "straggler 'half': rank 0 sleeps as long as each of its steps took. Asynchronous algorithms' "
              "samples/s add up every rank's own rate.", file=out)
    if any(r["repeats"] > 1 for r in rows):
        print("each repeat's own s/step (x its floor), in the order they ran; a row's s/step pools their steps:",
              file=out)
        for r in rows:
            if r["repeats"] > 1:
                each = " / ".join(f"{s:.3f} ({s / f:.2f}{'!' if s < f else ''})" if s and f else "-"
                                  for s, f in zip(r["repeat_step_s"], r["repeat_floor_s"]))
                print(f"  {r['network']} P={r['world_size']} {r['model']} {r['algorithm']}"
                      + (f" [{r['straggler']}]" if show_straggler else "") + f": {each}", file=out)
    if not show_straggler and stragglers != ["none"]:
        print(f"every row ran with straggler condition {stragglers[0]!r}", file=out)


def _x_floor(r):
    """The x floor cell of the table: 8 wide, ``!`` after a ratio below 1 (the row beat its floor)."""
    v = r["vs_floor"]
    if v is None:
        return f"{'-':>8}"
    return f"{v:>7.2f}" + ("!" if r.get("below_floor") else " ")


def auto_report(rows, out=sys.stdout):
    groups = {}
    for r in rows:
        groups.setdefault((r["network"], r["world_size"], r["model"], r["straggler"]), []).append(r)
    hits, total = 0, 0
    for key, rs in groups.items():
        autos = [r for r in rs if r["name"] == "auto"]
        others = [r for r in rs if r["name"] != "auto"]
        if not autos or not others:
            continue
        best = min(others, key=lambda r: r["step_s"])
        ok = autos[0]["step_s"] <= 1.1 * best["step_s"]
        hits += ok
        total += 1
        where = f"{key[0]} P={key[1]} {key[2]}" + (f" straggler={key[3]}" if key[3] != "none" else "")
        print(f"auto on {where}: picked {autos[0]['picked']}, {autos[0]['step_s']:.3f} s/step; "
              f"best measured {best['algorithm']} {best['step_s']:.3f} s/step -> {'within' if ok else 'NOT within'} 10%",
              file=out)
    if total:
        print(f"auto's pick within 10% of the best measured algorithm in {hits}/{total} cells", file=out)


def projection_report(records, world_sizes, out=sys.stdout):
    nets = {(r["network"], r["world_size"]): r for r in records if r["kind"] == "network"}
    # the compute of a projection: the median of the model's floors in the run (one per repeat, or per cell)
    floors = {key: dict(fs[0], step_s=statistics.median(f["step_s"] for f in fs))
              for key, fs in _floors(records).items()}
    algs = {}
    for r in records:
        if r["kind"] == "cell":
            algs[r["label"]] = (r["algorithm"], r["options"])
    result = []
    for (network, P, model), fl in sorted(floors.items()):
        nr = nets[(network, P)]
        # A projection is to a real cluster: links between hosts (host_local off), this rank's compute
        net = cost_model.Network(alpha=nr["alpha"], beta=nr["beta"])
        machine = cost_model.Machine(**nr["machine"])
        work = cost_model.Workload(numel=fl["numel"], compute_s=fl["step_s"], bucket_numels=fl.get("bucket_numels"))
        cands = [(n, o) for n, o in algs.values() if cost_model.predictable(n)]
        proj = cost_model.project(cands, world_sizes, work, net, machine)
        print(f"\nprojection for {model} on {network} (alpha={net.alpha * 1e6:.1f} us, "
              f"beta={1 / max(net.beta, 1e-30) * 8 / 1e9:.2f} Gbit/s, compute {fl['step_s']:.3f} s, measured at P={P}):",
              file=out)
        for p in proj:
            p.update(network=network, model=model)
            result.append(p)
        _projection_table(proj, out)
    return result


def _projection_table(proj, out):
    """Algorithms as rows, cluster sizes as columns, 's/step (speed-up over DDP)' per cell; the raw
    figures (comm, bytes, auto's pick) stay in results.json."""
    sizes = sorted({p["world_size"] for p in proj})
    rows = {}
    for p in proj:
        cell = f"{p['step_s']:.3g} ({p['speedup_vs_ddp']:.2f}x)"
        if p.get("picked"):
            cell += f" {p['picked'].split('(')[0]}"
        rows.setdefault(p["algorithm"], {})[p["world_size"]] = cell
    width = max([len(a) for a in rows] + [9])
    cols = {P: max([len(r.get(P, "")) for r in rows.values()] + [len(f"P={P}")]) for P in sizes}
    print("  " + "algorithm".ljust(width) + "".join(f"  {f'P={P}':>{cols[P]}}" for P in sizes), file=out)
    for alg, cells in rows.items():
        print("  " + alg.ljust(width) + "".join(f"  {cells.get(P, '-'):>{cols[P]}}" for P in sizes), file=out)


def _write_results(out_dir, payload, rows, fields):
    """results.json (``payload``) and results.csv (``rows``, columns ``fields``) in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(payload, f, indent=2)
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def write_outputs(rows, projections, out_dir, spread=None):
    """results.json (rows, projections and ``floor_spread``'s list), results.csv (the rows) and
    throughput.png (``throughput_figure``). Returns the plot's path, or None without matplotlib."""
    _write_results(out_dir, {"rows": rows, "projections": projections, "floor_spread": spread or []}, rows,
                   list(rows[0].keys()))
    fig = throughput_figure(rows, projections, spread)
    if fig is None:
        return None
    path = os.path.join(out_dir, "throughput.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")  # tight: whole labels, titles and legends, never cut
    pyplot().close(fig)
    return path


def _wrap(text, width=90):
    return "\n".join(textwrap.wrap(text, width))


def _hbars(ax, labels, series, value, hatch=None):
    """Horizontal grouped bars: one group per label (top to bottom, whole names on the y-axis), one bar
    per series in each; ``value(label, series)`` is a number or None (no bar). Returns {(label, series):
    (x, y)} of the bars drawn."""
    h = 0.8 / max(1, len(series))
    drawn = {}
    for i, ser in enumerate(series):
        ys, xs = [], []
        for j, lab in enumerate(labels):
            v = value(lab, ser)
            if v is not None:
                ys.append(j - 0.4 + h * (i + 0.5))
                xs.append(v)
                drawn[(lab, ser)] = (v, ys[-1])
        ax.barh(ys, xs, h, label=ser, hatch=hatch, edgecolor="white" if hatch else None)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.5, -0.5)  # the first label on top
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return drawn


def throughput_figure(rows, projections=(), spread=None):
    """The throughput plot as a matplotlib figure (None without matplotlib), one panel under the other: per
    model, the measured samples/s of every algorithm (horizontal bars, one per network, P and straggler
    condition), then, with projections (``--project``), the cost model's projected speed-up over DDP,
    hatched and titled PROJECTED. Both axes are labelled and algorithm names are whole. A model whose
    floors drifted apart (``floor_spread``) says so above its panel, and a bar whose row beat its floor
    is marked "! below its floor"."""
    plt = pyplot()
    if plt is None:
        return None

    def where(r):
        return f"{r['network']} P={r['world_size']}" + (f" straggler={r['straggler']}" if r["straggler"] != "none" else "")

    def proj_where(p):
        return f"{p['network']} P={p['world_size']} (projected)"

    panels = []  # (model, projected?, algorithms, series)
    for model in sorted({r["model"] for r in rows}):
        rs = [r for r in rows if r["model"] == model]
        panels.append((model, False, list(dict.fromkeys(r["algorithm"] for r in rs)),
                       list(dict.fromkeys(where(r) for r in rs))))
        ps = [p for p in projections or [] if p["model"] == model]
        if ps:
            panels.append((model, True, list(dict.fromkeys(p["algorithm"] for p in ps)),
                           list(dict.fromkeys(proj_where(p) for p in ps))))
    heights = [1.8 + len(algs) * max(0.3, 0.17 * len(series)) for _, _, algs, series in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (model, projected, algs, series) in zip(axes[:, 0], panels):
        if projected:
            ps = {(p["algorithm"], proj_where(p)): p for p in projections if p["model"] == model}
            drawn = _hbars(ax, algs, series, lambda a, s: ps[(a, s)]["speedup_vs_ddp"] if (a, s) in ps else None,
                           hatch="//")
            for x, y in drawn.values():
                ax.text(x, y, f" {x:.3g}x", va="center", fontsize=6)
            xs = [x for x, _ in drawn.values() if x > 0]
            log = bool(xs) and max(xs) / min(xs) > 30  # one sparse row at P=1024 would flatten the rest
            if log:
                ax.set_xscale("log")
            ax.axvline(1.0, color="grey", linewidth=1, linestyle="--")
            ax.set_xlabel("speed-up over DDP, PROJECTED by the cost model (x; 1 = DDP; higher is faster"
                          + ("; log scale)" if log else ")"))
            ax.set_ylabel("algorithm (cost model's name)")
            ax.set_title(_wrap(f"PROJECTED, not measured: {model} at the sizes of --project, by the cost model "
                               "from the floor and the link measured in this run"), fontsize=9, loc="left")
            continue
        rs = {(r["algorithm"], where(r)): r for r in rows if r["model"] == model}
        drawn = _hbars(ax, algs, series, lambda a, s: rs[(a, s)]["samples_per_s"] if (a, s) in rs else None)
        marked = [(x, y) for key, (x, y) in drawn.items() if rs[key].get("below_floor")]
        for x, y in marked:
            ax.text(x, y, " ! below its floor", va="center", fontsize=7, color="firebrick")
        if marked:  # room for the marks inside the panel
            ax.set_xlim(0, max(x for x, _ in drawn.values()) * 1.3)
        ax.set_xlabel("samples/s, measured (P x batch / s per step; higher is faster)")
        ax.set_ylabel("algorithm")
        notes = [f"! the machine's speed moved during the run: floors of {d['model']} at P={d['world_size']} "
                 f"{d['min_s']:.3f}-{d['max_s']:.3f} s ({d['ratio']:.2f}x apart): bars measured at different "
                 "times are not comparable" for d in spread or [] if d["drifted"] and d["model"] == model]
        if marked:
            notes.append(f"! {len(marked)} bar{'s' if len(marked) > 1 else ''} faster than "
                         f"{'their' if len(marked) > 1 else 'its'} compute floor: the machine's speed moved "
                         "between floor and row")
        ax.set_title(_wrap(f"throughput of {model}, measured") + "".join("\n" + _wrap(n) for n in notes),
                     fontsize=9, loc="left", color="firebrick" if notes else "black")
    fig.tight_layout()
    return fig


# ---- convergence mode -----------------------------------------------------------------------------------------
def project_records(records):
    """``project_time``: one convergence record per loopback convergence record (per seed) and throttled
    network timed, with the loopback run's steps (to target, run, the curve's steps and metrics) and the
    s/step measured on that network (``timing`` records: the median over whole cycles of the per-cycle
    mean, as in throughput mode): time to target = steps to target x s/step, each curve point's time =
    its step x s/step. Bytes per step are the timing run's (the link's counter; ours also counted). An
    algorithm with a warm-up (``warmup_steps``) was timed in both phases: its first steps count at the
    warm-up's s/step, the rest at the s/step after it, and its s/step is the mean over the steps run.
    A cell timed several times (``timing_repeats``: records of the same network, P, model and label) counts
    at the median over its repeats of each repeat's figures (per phase), listed in ``repeat_step_s``."""
    conv = [r for r in records if r["kind"] == "convergence" and r["network"] == "loopback"]
    timed = {}
    for t in (r for r in records if r["kind"] == "timing"):
        timed.setdefault((t["network"], t["world_size"], t["model"], t["label"]), []).append(t)
    out = []
    for same in timed.values():
        t = same[0]

        def figures(m):
            cyc = m.get("cycle", 1)
            counted = cycle_median(m["bytes"], cyc) if m.get("bytes") and _counted(t["algorithm"]) else None
            return cycle_median(m["times"], cyc), cycle_median(m.get("tx_bytes") or [], cyc), counted

        def over_repeats(phase=None):
            """(s/step, wire bytes, counted bytes): each the median of the repeats' own (None if none has it)."""
            each = [figures(r["phases"][phase] if phase else r) for r in same]
            return tuple(_median_present([f[i] for f in each]) for i in range(3))

        warm = t.get("warmup_steps") or 0
        if warm and t.get("phases"):
            # an algorithm with a warm-up: its first ``warm`` steps at the warm-up's s/step and bytes, the
            # rest at those after it
            (s_w, wire_w, cnt_w), (s_a, wire_a, cnt_a) = over_repeats("warmup"), over_repeats("after")
            each_s = [figures(r["phases"]["after"])[0] for r in same]
        else:
            s_w, wire_w, cnt_w = s_a, wire_a, cnt_a = over_repeats()
            each_s = [figures(r)[0] for r in same]
            warm = 0

        def seconds(n):
            return min(n, warm) * s_w + max(0, n - warm) * s_a

        def per_step(n, a, b):  # bytes per step averaged over the first n steps
            if a is None or b is None or not n:
                return None
            return (min(n, warm) * a + max(0, n - warm) * b) / n

        for c in conv:
            if (c["world_size"], c["model"], c["label"]) != (t["world_size"], t["model"], t["label"]):
                continue
            hit, n = c["steps_to_target"], c["steps_run"]
            out.append({**c, "network": t["network"], "projected": True, "projected_from": "loopback",
                        "loopback_step_s": c["step_s"], "step_s": seconds(n) / n if n else s_a,
                        "cycle": t.get("cycle", 1), "timing_steps": len(t["times"]),
                        "timing_repeats": len(same), "repeat_step_s": each_s,
                        "warmup_step_s": s_w if warm else None, "after_warmup_step_s": s_a if warm else None,
                        "time_to_target_s": seconds(hit) if hit else None, "train_s": seconds(n),
                        "curve": [[st, seconds(st), m, loss] for st, _, m, loss in c["curve"]],
                        "bytes_per_step_wire": per_step(n, wire_w, wire_a),
                        "bytes_per_step_counted": per_step(n, cnt_w, cnt_a)})
    return out


def _median_present(values):
    """The median of the values that are not None; None if all are."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _bytes(c):
    """Bytes per step per rank of a cell: the link's counter where there is one, else bagua_lite's own."""
    wire = c.get("bytes_per_step_wire")
    return wire if wire is not None else c.get("bytes_per_step_counted")


def summarize_convergence(records):
    """One row per convergence cell and seed; ``speedup_vs_ddp`` compares times to target with the plain
    DDP cell (same optimizer if measured) of the same network, P, model and seed, when both reached it.
    With ``project_time``, the throttled networks' rows are projected (``project_records``)."""
    cells = [r for r in records if r["kind"] == "convergence"]
    cells += project_records(records)
    rows = []
    for c in cells:
        ddp = _ddp_baseline([d for d in cells if d.get("seed") == c.get("seed")], c)
        ours, base = c["time_to_target_s"], ddp["time_to_target_s"] if ddp else None
        rows.append({
            "network": c["network"], "world_size": c["world_size"], "model": c["model"], "algorithm": c["label"],
            "name": c["algorithm"], "optimizer": c.get("optimizer", "sgd"), "seed": c.get("seed", 0),
            "shards": c.get("shards", 1), "ranks_per_node": c.get("ranks_per_node", 1),
            "fsdp_units": c.get("fsdp_units"), "reshard_after_forward": c.get("reshard_after_forward"),
            "metric": c["metric"], "target": c["target"], "steps_to_target": c["steps_to_target"],
            "time_to_target_s": ours, "final_metric": c["final_metric"], "final_loss": c["final_loss"],
            "step_s": c["step_s"], "steps_run": c["steps_run"], "train_s": c["train_s"], "eval_s": c["eval_s"],
            "speedup_vs_ddp": (base / ours) if ours and base else None,
            "ddp_baseline": ddp["label"] if ddp else None, "picked": c.get("picked"),
            "decision": c.get("decision"), "projected": bool(c.get("projected")),
            "projection": (f"projected: steps from {c['projected_from']}, s/step measured at {c['network']}"
                           if c.get("projected") else None),
            "loopback_step_s": c.get("loopback_step_s"), "timing_steps": c.get("timing_steps"),
            "timing_repeats": c.get("timing_repeats"), "repeat_step_s": c.get("repeat_step_s"),
            "bytes_per_step_wire": c.get("bytes_per_step_wire"),
            "bytes_per_step_counted": c.get("bytes_per_step_counted"), "bytes_per_step": _bytes(c),
            "curve": c["curve"],
        })
    return rows


def _median_or_none(values):
    """The median, where None (a target never reached) counts as infinite; None if the median is."""
    v = statistics.median(float("inf") if x is None else x for x in values)
    return None if v == float("inf") else v


def combine_seeds(rows):
    """One row per (network, P, model, algorithm) over its seeds: the median time to target (a seed that
    never reached it counts as infinite, so the median is None when at most half reached it), median steps
    to target, final metric and s/step; ``seeds`` and ``time_to_target_by_seed`` list what went in;
    ``speedup_vs_ddp`` is DDP's median time over this row's (``speedup_vs_hsdp``: native HSDP's, for sharded
    rows), ``bytes_vs_ddp`` / ``bytes_vs_hsdp`` its bytes per step over this row's. With one seed per cell,
    the rows themselves (with ``seeds`` and ``time_to_target_by_seed`` added)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["network"], r["world_size"], r["model"], r["algorithm"]), []).append(r)
    out = []
    for rs in groups.values():
        rs = sorted(rs, key=lambda r: r.get("seed", 0))
        row = dict(rs[0])
        row["seeds"] = [r.get("seed", 0) for r in rs]
        row["time_to_target_by_seed"] = [r["time_to_target_s"] for r in rs]
        picks = [r.get("picked") for r in rs if r.get("picked")]
        if len(rs) > 1:
            for key in ("time_to_target_s", "steps_to_target"):
                row[key] = _median_or_none([r[key] for r in rs])
            row.pop("seed", None)
            row["decision"] = None  # per seed, in the rows
            for key in ("final_metric", "final_loss", "step_s", "train_s", "eval_s", "bytes_per_step",
                        "bytes_per_step_wire", "bytes_per_step_counted"):
                vals = [r.get(key) for r in rs if r.get(key) is not None]
                row[key] = statistics.median(vals) if vals else None
            row["steps_run"] = max(r["steps_run"] for r in rs)
            row["picked"] = "/".join(dict.fromkeys(picks)) or None
        out.append(row)
    for row in out:
        for base, key in (("ddp", "speedup_vs_ddp"), ("ddp_fp16", "speedup_vs_ddp_fp16"),
                          ("ddp_powersgd", "speedup_vs_ddp_powersgd"), ("torchft_diloco", "speedup_vs_torchft"),
                          ("hsdp", "speedup_vs_hsdp")):
            b = _ddp_baseline(out, row, name="name", base=base)
            t = b["time_to_target_s"] if b else None
            row[key] = t / row["time_to_target_s"] if t and row["time_to_target_s"] else None
        for base, _ in REFERENCES:
            ref = _ddp_baseline(out, row, name="name", base=base)
            mine, theirs = row.get("bytes_per_step"), (ref or {}).get("bytes_per_step")
            row[f"bytes_vs_{base}"] = theirs / mine if theirs and mine else None  # x fewer bytes than the reference
    return out


def _by_time_to_target(r):
    """Reached first, by time; then the rest, best final metric first."""
    sign = -1 if r["metric"] == "accuracy" else 1
    if r["time_to_target_s"] is not None:
        return (0, r["time_to_target_s"])
    return (1, sign * r["final_metric"])


def _fmt_bytes(b):
    if b is None:
        return "-"
    return f"{b / 1e6:.3f}" if b < 1e7 else f"{b / 1e6:.1f}"


def print_convergence_table(rows, out=sys.stdout):
    """One table per (network, P, model), sorted by time to target; ``rows`` as ``combine_seeds`` returns
    them (with several seeds the figures are medians, and a last column gives each seed's time). A
    projected table (``project_time``) says so above its header. Columns ``vs torchft`` (when the group has
    a torchft_diloco row) and ``MB/step`` / ``vs DDP bytes`` (when any row has a byte count). Sharded
    rows (``shards`` > 1) are compared with native HSDP instead of DDP (``reference``), and the title
    gives the layout: replicas x shards, ranks per node."""
    groups = {}
    several = any(len(r.get("seeds") or [0]) > 1 for r in rows)
    for r in rows:
        groups.setdefault((r["network"], r["world_size"], r["model"]), []).append(r)
    for (network, P, model), rs in groups.items():
        metric, target = rs[0]["metric"], rs[0]["target"]
        seeds = rs[0].get("seeds") or [0]
        projected = any(r.get("projected") for r in rs)
        ref, ref_title = reference(rs)
        print(f"\n{model} on {network}, P={P}{_layout(rs[0])}: time to held-out {metric} "
              f"{'>=' if metric == 'accuracy' else '<='} "
              f"{target} (training wall time, evaluations excluded)"
              + (f"; medians over seeds {', '.join(map(str, seeds))}" if several else ""), file=out)
        if projected:
            repeats = max(r.get("timing_repeats") or 1 for r in rs)
            print(f"PROJECTED: steps to target from the unthrottled (loopback) run, s/step measured at {network} "
                  "over whole cycles of each algorithm" + (f" (the median of {repeats} timing repeats)" if repeats > 1
                                                           else "") + "; time to target = steps x s/step", file=out)
        show_tft = any(r["name"] == "torchft_diloco" for r in rs)
        show_bytes = any(r.get("bytes_per_step") is not None for r in rs)
        hdr = (f"{'algorithm':<40}{'time to target':>15}{'steps':>7}{'vs ' + ref_title:>8}"
               + (f"{'vs torchft':>11}" if show_tft else "") + f"{'s/step':>8}"
               + (f"{'MB/step':>9}{'x fewer B':>10}" if show_bytes else "")
               + f"{'final ' + metric:>16}{'steps run':>10}" + ("  per seed (s)" if several else ""))
        print(hdr, file=out)
        print("-" * len(hdr), file=out)
        for r in sorted(rs, key=_by_time_to_target):
            t = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f} s"
            n = "-" if r["steps_to_target"] is None else f"{r['steps_to_target']:g}"
            per_seed = ""
            if several:
                per_seed = "  " + " ".join("-" if t is None else f"{t:.2f}" for t in r["time_to_target_by_seed"])
            v = "-" if r.get(f"speedup_vs_{ref}") is None else f"{r[f'speedup_vs_{ref}']:.2f}"
            vt = "-" if r.get("speedup_vs_torchft") is None else f"{r['speedup_vs_torchft']:.2f}"
            fewer = "-" if r.get(f"bytes_vs_{ref}") is None else f"{r[f'bytes_vs_{ref}']:.1f}"
            print(f"{r['algorithm'][:39]:<40}{t:>15}{n:>7}{v:>8}" + (f"{vt:>11}" if show_tft else "")
                  + f"{r['step_s']:>8.4f}" + (f"{_fmt_bytes(r.get('bytes_per_step')):>9}{fewer:>10}" if show_bytes else "")
                  + f"{r['final_metric']:>16.4f}{r['steps_run']:>10}{per_seed}", file=out)
        if projected and repeats > 1:
            print("each timing repeat's s/step, in the order they ran: " + "; ".join(
                f"{r['algorithm']} " + " ".join(f"{v:.4f}" for v in r.get("repeat_step_s") or [])
                for r in rs if r.get("repeat_step_s")), file=out)
    print("'-': the target was not reached within the budget. vs DDP (vs torchft): DDP's (torchft DiLoCo's) time "
          "to target over this row's. MB/step: bytes a rank sent per step (the emulated link's counter; on "
          "loopback bagua_lite's own, none for the baselines); x fewer B: DDP's bytes per step over this row's. "
          "Evaluated: the average of the replicas (rank 0's model for synchronous algorithms).", file=out)
    if any(r.get("shards", 1) > 1 for r in rows):
        print("Sharded (HSDP) tables: vs HSDP and x fewer B compare with FSDP2's own HSDP (fully_shard over the "
              "(replicate, shard) mesh); MB/step is what crosses replicas (a node's link counter over its ranks; "
              "on loopback bagua_lite's own count of our cross-replica traffic), FSDP2's gathers and "
              "reduce-scatters inside a replica excluded. Evaluated: the average of the replicas' whole weights.",
              file=out)


def _layout(r):
    """`` (R replicas x S shards, N ranks per node)`` of a sharded or noded row, else empty."""
    shards, per_node = r.get("shards", 1), r.get("ranks_per_node", 1)
    parts = []
    if shards > 1:
        parts.append(f"{r['world_size'] // shards} replicas x {shards} shards")
        if r.get("fsdp_units", "blocks") != "blocks":
            parts.append(f"FSDP2 units: {r['fsdp_units']}")
        if r.get("reshard_after_forward") is False:
            parts.append("no reshard after forward")
    if per_node > 1 and r["network"] != "loopback":  # on loopback every rank shares one loopback anyway
        parts.append(f"{per_node} ranks per node")
    return f" ({', '.join(parts)})" if parts else ""


DILOCO_FAMILY = ("diloco", "local_sgd")  # ours: DiLoCo, its streaming and compressed variants, local SGD


def convergence_figures(rows, out=sys.stdout):
    """The headline comparisons of each (network, P, model) table: the row that reached the target first
    among ours, and among the DiLoCo family, against each baseline measured (DDP, DDP + fp16 hook, DDP +
    PowerSGD hook, torchft's DiLoCo, native HSDP); the bytes per step against the reference's (DDP's, or
    native HSDP's for sharded rows: ``reference``); and, when every row trained the whole budget
    (``stop_at_target: false``), each row's held-out loss at equal steps against the reference's.
    Returns the lines printed."""
    names = {"ddp": "DDP", "ddp_fp16": "DDP + fp16 hook", "ddp_powersgd": "DDP + PowerSGD hook",
             "torchft_diloco": "torchft DiLoCo", "hsdp": "native HSDP"}
    keys = {"ddp": "speedup_vs_ddp", "ddp_fp16": "speedup_vs_ddp_fp16", "ddp_powersgd": "speedup_vs_ddp_powersgd",
            "torchft_diloco": "speedup_vs_torchft", "hsdp": "speedup_vs_hsdp"}
    lines = []
    groups = {}
    for r in rows:
        groups.setdefault((r["network"], r["world_size"], r["model"]), []).append(r)
    for (network, P, model), rs in groups.items():
        head = f"{model} on {network}, P={P}" + (" (projected)" if any(r.get("projected") for r in rs) else "")
        present = [b for b in names if any(r["name"] == b for r in rs)]
        reached = [r for r in rs if r["time_to_target_s"] is not None]

        def against(r):
            got = [f"{r[keys[b]]:.2f}x sooner than {names[b]}" for b in present if r.get(keys[b]) is not None]
            missed = [names[b] for b in present if r.get(keys[b]) is None and r["name"] != b]
            return ", ".join(got + ([f"{'/'.join(missed)} did not reach it"] if missed else []))

        for title, pick in (("best of ours", lambda r: r["name"] not in BASELINES),
                            ("best of the DiLoCo family", lambda r: r["name"] in DILOCO_FAMILY)):
            cand = [r for r in reached if pick(r)]
            if cand:
                b = min(cand, key=lambda r: r["time_to_target_s"])
                vs = against(b)
                lines.append(f"{head}: {title}: {b['algorithm']} {b['time_to_target_s']:.2f} s to target"
                             + (f": {vs}" if vs else ""))
        tft = next((r for r in rs if r["name"] == "torchft_diloco"), None)
        if tft is not None:
            for r in (r for r in rs if r["name"] in DILOCO_FAMILY):
                v = r.get("speedup_vs_torchft")
                if v is not None:
                    lines.append(f"{head}: {r['algorithm']} vs torchft DiLoCo: time to target {1 / v:.2f}x "
                                 f"torchft's ({v:.2f}x sooner)")
                elif r["time_to_target_s"] is not None or tft["time_to_target_s"] is not None:
                    lines.append(f"{head}: {r['algorithm']} vs torchft DiLoCo: only "
                                 + ("this row" if r["time_to_target_s"] is not None else "torchft's") + " reached the target")
        ref, ref_title = reference(rs)
        ddp = next((r for r in rs if r["name"] == ref), None)
        if ddp and ddp.get("bytes_per_step"):
            key = f"bytes_vs_{ref}"
            ranked = sorted((r for r in rs if r.get(key) and r["name"] != ref), key=lambda r: -r[key])
            if ranked:
                lines.append(f"{head}: bytes per step per rank vs {ref_title}'s {_fmt_bytes(ddp['bytes_per_step'])} MB: "
                             + ", ".join(f"{r['algorithm']} {r[key]:.0f}x fewer" for r in ranked))
        full = [r for r in rs if r["steps_run"] == max(x["steps_run"] for x in rs)]
        if not any(r.get("projected") for r in rs) and ddp and ddp in full and len(full) == len(rs) and ddp.get("final_loss"):
            lines.append(f"{head}: held-out loss at equal steps ({ddp['steps_run']}): {ref_title} {ddp['final_loss']:.4f}; "
                         + ", ".join(f"{r['algorithm']} {r['final_loss']:.4f} "
                                     f"({(r['final_loss'] / ddp['final_loss'] - 1) * 100:+.1f}%)"
                                     for r in rs if r is not ddp))
    if lines:
        print("\nfigures:", file=out)
        for line in lines:
            print("  " + line, file=out)
    return lines


def auto_convergence_report(rows, out=sys.stdout):
    """Per (network, P, model) cell with an ``auto`` row: auto's time to target against the best measured
    other algorithm's, within 10% or not; then how many cells were within. Returns (within, cells).
    ``rows`` as ``combine_seeds`` returns them: with several seeds, medians over seeds are compared."""
    groups = {}
    for r in rows:
        groups.setdefault((r["network"], r["world_size"], r["model"]), []).append(r)
    hits, total = 0, 0
    for (network, P, model), rs in groups.items():
        autos = [r for r in rs if r["name"] == "auto"]
        others = [r for r in rs if r["name"] != "auto" and r["time_to_target_s"] is not None]
        if not autos:
            continue
        a = autos[0]
        total += 1
        mine = "not reached" if a["time_to_target_s"] is None else f"{a['time_to_target_s']:.2f} s"
        if not others:
            ok = a["time_to_target_s"] is not None
            best = "no other algorithm reached it"
        else:
            b = min(others, key=lambda r: r["time_to_target_s"])
            ok = a["time_to_target_s"] is not None and a["time_to_target_s"] <= 1.1 * b["time_to_target_s"]
            best = f"best measured {b['algorithm']} {b['time_to_target_s']:.2f} s"
        hits += ok
        print(f"auto vs best on {network} P={P} {model}: auto (picked {a.get('picked') or '?'}) {mine} to target; "
              f"{best} -> {'within' if ok else 'NOT within'} 10%", file=out)
    if total:
        print(f"auto vs best: auto's time to target within 10% of the best measured algorithm's in {hits}/{total} "
              f"cells", file=out)
    return hits, total


def write_convergence_outputs(rows, out_dir, summary=None):
    """results.json (``rows``: one per cell and seed, with every evaluation's [step, seconds, metric, loss];
    ``summary``: ``combine_seeds(rows)``, given or computed here, without curves), results.csv (the rows without the curves) and one
    ``convergence_<model>.png`` per model (the first seed's curves): the metric against training seconds, one panel
    per network and P, one line per algorithm. Returns the names of the plots written."""
    summary = [{k: v for k, v in r.items() if k != "curve"} for r in (summary or combine_seeds(rows))]
    _write_results(out_dir, {"mode": "convergence", "rows": rows, "summary": summary}, rows,
                   [k for k in rows[0] if k != "curve"])
    plt = pyplot()
    if plt is None:
        return []
    written = []
    first_seed = min(r.get("seed", 0) for r in rows)
    several = len({r.get("seed", 0) for r in rows}) > 1
    for model in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == model and r.get("seed", 0) == first_seed]
        panels = list(dict.fromkeys((r["network"], r["world_size"]) for r in rs))
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
        for ax, (network, P) in zip(axes[0], panels):
            for r in (r for r in rs if (r["network"], r["world_size"]) == (network, P)):
                ax.plot([c[1] for c in r["curve"]], [c[2] for c in r["curve"]], marker=".", label=r["algorithm"])
            ax.axhline(rs[0]["target"], color="grey", linestyle="--", linewidth=1, label="target")
            ax.set_xlabel("training wall-clock seconds (evaluation excluded)")
            ax.set_ylabel(f"held-out {rs[0]['metric']}")
            panel = [r for r in rs if (r["network"], r["world_size"]) == (network, P)]
            proj = any(r.get("projected") for r in panel)
            ax.set_title(_wrap(f"{model}, {network}, P={P}{_layout(panel[0])}" + (f" (seed {first_seed})" if several
                                                                                    else "")
                               + (" projected: loopback steps x measured s/step" if proj else ""), 70), fontsize=9)
            ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"convergence_{model}.png"
        fig.savefig(os.path.join(out_dir, name), dpi=110, bbox_inches="tight")  # whole legend labels
        plt.close(fig)
        written.append(name)
    return written
