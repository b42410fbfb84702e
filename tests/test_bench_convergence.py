"""The benchmark's convergence mode (bagua_lite.bench): its tasks, its configuration checks, the replica
average it evaluates, and a short end-to-end run on real gloo ranks over loopback."""
import csv
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from bagua_lite.bench import data, zoo
from bagua_lite.bench.config import load_benchmark_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- tasks ------------------------------------------------------------------------------------------------
def test_digits_task_shards_an_epoch_without_overlap_and_replays_after_reset():
    tasks = [data.make_task(zoo.make_model("mlp_digits")[1], r, 2, 16, 512) for r in range(2)]
    per = tasks[0].per_epoch
    assert per == (1438 // 2) // 16
    for t in tasks:
        rows = torch.cat([t.batch(s)[0] for s in range(per)])
        assert len(rows) == per * 16 and len({tuple(r.tolist()) for r in rows}) == len(rows)  # no repeats in an epoch
    # the ranks' shards are disjoint, and both ranks hold out the same 359 images
    a = {tuple(r.tolist()) for r in tasks[0].x}
    assert not any(tuple(r.tolist()) in a for r in tasks[1].x)
    assert torch.equal(tasks[0].eval_x, tasks[1].eval_x) and len(tasks[0].eval_y) == 1797 // 5
    first = tasks[0].batch(0)[0].clone()
    tasks[0].batch(per)  # next epoch: reshuffled
    tasks[0].reset()
    assert torch.equal(tasks[0].batch(0)[0], first)


@pytest.mark.parametrize("model", ["mlp_small", "cnn"])
def test_teacher_task_is_a_deterministic_balanced_labelling(model):
    spec = zoo.make_model(model)[1]
    t0, t1 = data.make_task(spec, 0, 2, 8, 512), data.make_task(spec, 1, 2, 8, 512)
    assert torch.equal(t0.eval_x, t1.eval_x) and torch.equal(t0.eval_y, t1.eval_y)  # one held-out set
    assert not torch.equal(t0.batch(0)[0], t1.batch(0)[0])  # each rank its own stream
    x, y = t0.batch(1)
    assert torch.equal(t0.label(x), y) and x.shape == (8, *spec.shape)
    counts = torch.bincount(t0.eval_y, minlength=10)
    assert counts.min() >= 512 / 10 / 3 and counts.max() <= 3 * 512 / 10, counts  # no class dominates
    t0.reset()
    again = data.make_task(spec, 0, 2, 8, 512)
    assert torch.equal(t0.batch(0)[0], again.batch(0)[0])


def test_teacher_task_is_learnable_far_above_chance():
    torch.manual_seed(0)
    net, spec = zoo.make_model("mlp_small")
    task = data.make_task(spec, 0, 1, 16, 512)
    acc0, loss0 = data.evaluate(net, task)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    for s in range(600):
        x, y = task.batch(s)
        data.loss_fn(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    acc, loss = data.evaluate(net, task)
    assert acc0 < 0.2 and acc > 0.35 and loss < 0.75 * loss0, (acc0, acc, loss0, loss)


def test_markov_task_follows_its_chain_and_its_bounds():
    spec = zoo.make_model("gpt_small")[1]
    t = data.make_task(spec, 0, 1, 4, 32)
    x, y = t.batch(0)
    assert x.shape == y.shape == (4, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])  # the targets are the next tokens
    allowed = t.next[x]  # (4, 64, BRANCH): the successors of each token
    assert (allowed == y.unsqueeze(-1)).any(-1).all()
    assert 0.3 < t.entropy < 0.5 * math.log(256) and 0.3 < t.best_accuracy < 1.0


# ---- configuration ---------------------------------------------------------------------------------------------
CONV = "mode: convergence\nalgorithms: [ddp]\nmodels: [mlp_digits]\n"


@pytest.mark.parametrize("text, pattern", [
    ("mode: convergent\nalgorithms: [ddp]\n", r"unknown mode 'convergent'; allowed: throughput, convergence"),
    ("mode: convergence\nalgorithms: [ddp]\nmax_steps: 10\n", r"mode convergence needs a target"),
    (CONV + "target: 0.9\n", r"mode convergence needs max_steps"),
    (CONV + "target: 1.5\nmax_steps: 10\n", r"target must be a number > 0 and <= 1, got 1.5"),
    (CONV + "metric: loss\ntarget: -1\nmax_steps: 10\n", r"target must be a number > 0, got -1"),
    (CONV + "metric: top5\ntarget: 0.9\nmax_steps: 10\n", r"unknown metric 'top5'; allowed: accuracy, loss"),
    (CONV + "target: 0.9\nmax_steps: 10\neval_every: 0\n", r"eval_every must be an int >= 1, got 0"),
    (CONV + "target: 0.9\nmax_steps: 10.5\n", r"max_steps must be an int >= 1, got 10.5"),
    (CONV + "target: 0.9\nmax_steps: 10\ntime_budget_s: 0\n", r"time_budget_s must be a number > 0, got 0"),
    (CONV + "target: 0.9\nmax_steps: 10\nstop_at_target: 'yes'\n", r"stop_at_target must be true or false"),
    (CONV + "target: 0.9\nmax_steps: 10\nseed: -1\n", r"seed must be an int >= 0, got -1"),
    (CONV + "target: 0.9\nmax_steps: 10\nseed: 1.5\n", r"seed must be an int >= 0, got 1.5"),
    (CONV + "target: 0.9\nmax_steps: 10\nseeds: []\n", r"seeds must be a non-empty list of ints >= 0, got \[\]"),
    (CONV + "target: 0.9\nmax_steps: 10\nseeds: 3\n", r"seeds must be a non-empty list of ints >= 0, got 3"),
    (CONV + "target: 0.9\nmax_steps: 10\nseeds: [0, -2]\n", r"seeds entry must be an int >= 0, got -2"),
    (CONV + "target: 0.9\nmax_steps: 10\nseeds: [1, 1]\n", r"seeds lists a seed twice: \[1, 1\]"),
    (CONV + "target: 0.9\nmax_steps: 10\nseed: 1\nseeds: [1, 2]\n", r"give seed \(one\) or seeds \(a list\), not both"),
    (CONV + "target: 0.9\nmax_steps: 10\nlr: -0.1\n", r"lr must be a number > 0"),
    (CONV + "target: 0.9\nmax_steps: 10\nsteps: 5\n", r"'steps' is a key of mode throughput, not of mode convergence"),
    ("algorithms: [ddp]\ntarget: 0.9\n", r"'target' is a key of mode convergence, not of mode throughput"),
])
def test_bad_convergence_settings_name_the_key_and_value(tmp_path, text, pattern):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=pattern):
        load_benchmark_config(str(p))


def test_convergence_defaults():
    cfg = load_benchmark_config(os.path.join(ROOT, "configs", "benchmark_convergence.yaml"))
    assert cfg["mode"] == "convergence" and cfg["metric"] == "accuracy" and 0 < cfg["target"] <= 1
    assert {a["name"] for a in cfg["algorithms"]} >= {"ddp", "ddp_fp16", "gtopk", "topk", "decentralized", "local_sgd"}
    assert cfg["seeds"] and cfg["seed"] == cfg["seeds"][0]


def _seed_row(name, seed, t, steps=None, final=0.9, network="loopback"):
    return {"network": network, "world_size": 4, "model": "mlp_digits", "algorithm": name, "name": name,
            "optimizer": "sgd", "seed": seed, "metric": "accuracy", "target": 0.8, "time_to_target_s": t,
            "steps_to_target": steps, "final_metric": final, "final_loss": 0.3, "step_s": 0.01, "steps_run": 50,
            "train_s": 0.5, "eval_s": 0.1, "picked": None, "decision": "line", "curve": [[0, 0.0, 0.1, 2.0]]}


def test_combine_seeds_takes_medians_and_counts_a_miss_as_infinite():
    from bagua_lite.bench.report import combine_seeds
    rows = [_seed_row("ddp", 0, 1.0, 40), _seed_row("ddp", 1, 3.0, 42), _seed_row("ddp", 2, 2.0, 41),
            _seed_row("local_sgd", 2, 0.6, 30, 0.95), _seed_row("local_sgd", 0, None, None, 0.7),
            _seed_row("local_sgd", 1, 0.4, 28, 0.92),
            _seed_row("topk", 0, None, None), _seed_row("topk", 1, None, None), _seed_row("topk", 2, 0.1, 5)]
    got = {r["algorithm"]: r for r in combine_seeds(rows)}
    assert got["ddp"]["time_to_target_s"] == 2.0 and got["ddp"]["steps_to_target"] == 41
    assert got["ddp"]["seeds"] == [0, 1, 2] and got["ddp"]["time_to_target_by_seed"] == [1.0, 3.0, 2.0]
    # one miss of three: the median is the slower of the two that reached it
    assert got["local_sgd"]["time_to_target_s"] == 0.6 and got["local_sgd"]["steps_to_target"] == 30
    assert got["local_sgd"]["time_to_target_by_seed"] == [None, 0.4, 0.6]
    assert got["local_sgd"]["final_metric"] == 0.92 and got["local_sgd"]["speedup_vs_ddp"] == 2.0 / 0.6
    assert "seed" not in got["local_sgd"] and got["local_sgd"]["decision"] is None
    # two misses of three: not reached, whatever the lucky seed did
    assert got["topk"]["time_to_target_s"] is None and got["topk"]["speedup_vs_ddp"] is None
    # one seed: the row itself
    one = combine_seeds([_seed_row("ddp", 5, 1.5, 40)])[0]
    assert one["time_to_target_s"] == 1.5 and one["seed"] == 5 and one["seeds"] == [5] and one["decision"] == "line"


def test_efficiencies_from_results_compare_within_a_seed():
    from bagua_lite import cost_model
    # seed 0: dense 40 steps, topk 80 (2.0); seed 1: dense 20, topk 30 (1.5): median 1.75, never 80 / 20
    rows = [_seed_row("ddp", 0, 1.0, 40), _seed_row("topk", 0, 1.0, 80),
            _seed_row("ddp", 1, 1.0, 20), _seed_row("topk", 1, 1.0, 30)]
    assert cost_model.efficiencies_from_results(rows)["topk"] == pytest.approx(1.75)


def test_seed_changes_weights_and_data_and_repeats_them():
    def view(seed):
        net, spec = zoo.fresh_model("mlp_digits", seed)
        task = data.make_task(spec, 0, 4, 16, 64, seed)
        x, y = task.batch(0)
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()]), x, task.eval_x

    w0, x0, e0 = view(0)
    w1, x1, e1 = view(1)
    assert not torch.equal(w0, w1) and not torch.equal(x0, x1)
    w0b, x0b, e0b = view(0)
    assert torch.equal(w0, w0b) and torch.equal(x0, x0b) and torch.equal(e0, e0b)


# ---- the replica average that is evaluated ----------------------------------------------------------------------
def _r_average(rank, P):
    from bagua_lite.bench.convergence import average_replicas

    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    with torch.no_grad():
        for t in net.state_dict().values():
            if t.is_floating_point():
                t.fill_(rank + 1.0)
    net[1].num_batches_tracked.fill_(7 + rank)
    into = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    average_replicas(net, into)
    return {k: v.tolist() for k, v in into.state_dict().items()} if rank == 0 else None


def test_evaluated_model_is_the_average_of_the_replicas(clusters):
    got = clusters.get(3).run(_r_average, timeout=60)[0]
    for k, v in got.items():
        flat = torch.tensor(v, dtype=torch.float64).reshape(-1)
        if k.endswith("num_batches_tracked"):
            assert flat.tolist() == [7]  # integer buffers: rank 0's
        else:
            assert torch.allclose(flat, torch.full_like(flat, 2.0)), (k, v)  # mean of 1, 2, 3


# ---- end to end -----------------------------------------------------------------------------------------------
SMOKE = """
mode: convergence
world_sizes: [2]
networks: [loopback]
models: [mlp_digits]
batch_size: 16
bucket_size_mb: 1
lr: 0.05
target: 0.7
max_steps: 80
eval_every: 10
algorithms: [ddp, {name: gtopk, density: 0.01}, decentralized]
"""


def test_convergence_mode_end_to_end(tmp_path):
    cfg = tmp_path / "conv.yaml"
    cfg.write_text(SMOKE)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bagua_lite.bench", "--config", str(cfg), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["ddp", "gtopk", "decentralized"]
    for r in rows:
        for key in ("steps_to_target", "time_to_target_s", "final_metric", "step_s"):
            assert key in r
        curve = r["curve"]
        assert curve[0][:2] == [0, 0.0] and [c[0] for c in curve] == list(range(0, r["steps_run"] + 1, 10))
        assert all(b[1] > a[1] for a, b in zip(curve, curve[1:]))  # training time only grows
        assert r["final_metric"] == curve[-1][2] and r["step_s"] == pytest.approx(r["train_s"] / r["steps_run"])
        if r["time_to_target_s"] is None:  # budget ran out: trained to max_steps, never reached
            assert r["steps_to_target"] is None and r["steps_run"] == 80 and max(c[2] for c in curve) < 0.7
        else:  # stop_at_target (default): stopped at the first evaluation at or above the target
            hit = next(c for c in curve if c[2] >= 0.7)
            assert hit == curve[-1] and r["steps_to_target"] == hit[0] == r["steps_run"]
            assert r["time_to_target_s"] == pytest.approx(hit[1])
    ddp = rows[0]
    assert ddp["time_to_target_s"] is not None and ddp["speedup_vs_ddp"] == pytest.approx(1.0)
    # every algorithm starts from the same weights: the same accuracy before the first step
    assert len({r["curve"][0][2] for r in rows}) == 1
    # the table lists the rows by time to target, those that never reached it last
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("algorithm")) + 2
    order = [line.split()[0] for line in lines[start:start + 3]]
    key = sorted(rows, key=lambda r: (r["time_to_target_s"] is None, r["time_to_target_s"] or -r["final_metric"]))
    assert order == [r["algorithm"] for r in key]
    with open(out / "results.csv") as f:
        got = list(csv.DictReader(f))
    assert len(got) == 3 and "curve" not in got[0] and "time_to_target_s" in got[0]
    assert (out / "convergence_mlp_digits.png").stat().st_size > 1000


# ---- auto as a convergence cell --------------------------------------------------------------------------------
def _row(name, t, network="loopback", P=4, picked=None):
    return {"network": network, "world_size": P, "model": "mlp_digits", "name": name, "algorithm": name,
            "time_to_target_s": t, "picked": picked}


def test_auto_vs_best_counts_cells_within_ten_percent():
    import io

    from bagua_lite.bench.report import auto_convergence_report
    rows = [_row("ddp", 1.0), _row("local_sgd", 0.5), _row("auto", 0.54, picked="local_sgd"),   # within
            _row("ddp", 1.0, "1gbit"), _row("local_sgd", 0.5, "1gbit"), _row("auto", 0.56, "1gbit"),  # 12% over
            _row("ddp", 1.0, P=2), _row("auto", None, P=2),                                            # not reached
            _row("ddp", 2.0, "1gbit", 2)]                                                              # no auto row
    out = io.StringIO()
    assert auto_convergence_report(rows, out) == (1, 3)
    lines = out.getvalue().splitlines()
    assert lines[0] == ("auto vs best on loopback P=4 mlp_digits: auto (picked local_sgd) 0.54 s to target; "
                        "best measured local_sgd 0.50 s -> within 10%")
    assert lines[1].endswith("best measured local_sgd 0.50 s -> NOT within 10%")
    assert "auto (picked ?) not reached to target" in lines[2] and lines[2].endswith("NOT within 10%")
    assert lines[3] == ("auto vs best: auto's time to target within 10% of the best measured algorithm's "
                        "in 1/3 cells")


AUTO_SMOKE = """
mode: convergence
world_sizes: [2]
networks: [loopback]
models: [mlp_digits]
batch_size: 16
bucket_size_mb: 1
lr: 0.05
target: 0.7
max_steps: 60
eval_every: 10
algorithms: [gradient_allreduce, local_sgd, {name: auto, candidates: [gradient_allreduce, local_sgd]}]
"""


def test_auto_runs_as_a_convergence_cell_and_is_judged(tmp_path):
    cfg = tmp_path / "conv.yaml"
    cfg.write_text(AUTO_SMOKE)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bagua_lite.bench", "--config", str(cfg), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    auto = next(r for r in rows if r["name"] == "auto")
    # it probed, calibrated, decided by time to accuracy, delegated, and trained to the target
    assert auto["picked"] in ("gradient_allreduce", "local_sgd")
    assert "ranked by time to accuracy" in auto["decision"] and "x efficiency" in auto["decision"]
    assert auto["decision"] in proc.stdout
    assert auto["steps_to_target"] is not None and auto["final_metric"] >= 0.7
    lines = [line for line in proc.stdout.splitlines() if line.startswith("auto vs best")]
    assert len(lines) == 2, proc.stdout
    assert lines[0].startswith(f"auto vs best on loopback P=2 mlp_digits: auto (picked {auto['picked']}) ")
    best = min((r for r in rows if r["name"] != "auto" and r["time_to_target_s"] is not None),
               key=lambda r: r["time_to_target_s"])
    assert f"best measured {best['algorithm']} {best['time_to_target_s']:.2f} s" in lines[0]
    within = auto["time_to_target_s"] <= 1.1 * best["time_to_target_s"]
    assert lines[0].endswith("-> within 10%" if within else "-> NOT within 10%")
    assert lines[1].endswith(f"in {int(within)}/1 cells")
