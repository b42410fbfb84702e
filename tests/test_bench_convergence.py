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


def test_digits_are_scikit_learns_load_digits():
    """The task reads scikit-learn's digits file itself (importing scikit-learn costs every rank 2 s)."""
    from sklearn.datasets import load_digits

    x, y = data._load_digits()
    want_x, want_y = load_digits(return_X_y=True)
    assert x.dtype == want_x.dtype and y.dtype == want_y.dtype
    assert (x == want_x).all() and (y == want_y).all() and x.shape == (1797, 64)


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


# ---- project_time, torchft's DiLoCo, hf_gpt2, progress (issue 24) ------------------------------------------------
def _torchft_installed():
    from bagua_lite.bench.config import torchft_available
    return torchft_available()[0]


@pytest.mark.parametrize("text, pattern", [
    (CONV + "target: 0.9\nmax_steps: 10\nproject_time: 1\n", r"project_time must be true or false, got 1"),
    (CONV + "target: 0.9\nmax_steps: 10\ntiming_steps: 4\n",
     r"timing_steps sets the timing runs of project_time: true"),
    (CONV + "target: 0.9\nmax_steps: 10\nproject_time: true\ntiming_steps: 0\n", r"timing_steps must be an int >= 1, got 0"),
    (CONV + "target: 0.9\nmax_steps: 10\nproject_time: true\ntiming_warmup_steps: -1\n",
     r"timing_warmup_steps must be an int >= 0, got -1"),
    (CONV + "target: 0.9\nmax_steps: 10\nproject_time: true\ntiming_repeats: 0\n", r"timing_repeats must be an int >= 1, got 0"),
    (CONV + "target: 0.9\nmax_steps: 10\ntiming_repeats: 3\n", r"timing_repeats sets the timing runs of project_time: true"),
    ("mode: convergence\nmodels: [mlp_digits]\ntarget: 0.9\nmax_steps: 10\nproject_time: true\n"
     "algorithms: [ddp, {name: async_model_average, sync_interval_ms: 50}]\n",
     r"project_time cannot project async_model_average\(sync_interval_ms=50\): it is asynchronous"),
    ("mode: convergence\nmodels: [mlp_digits]\ntarget: 0.9\nmax_steps: 10\nproject_time: true\n"
     "algorithms: [ddp, auto]\n", r"project_time cannot project auto: its pick depends on the network"),
    ("mode: convergence\nmodels: [mlp_digits]\ntarget: 0.9\nmax_steps: 10\nproject_time: true\nalgorithms: [ddp, "
     "{name: topk, density: 0.01, warmup_densities: [0.1], warmup_steps_per_stage: 5}]\n",
     r"project_time cannot project topk.*density schedule"),
    (CONV.replace("[ddp]", "[ddp, {name: torchft_diloco, sync_every: 5}]") + "target: 0.9\nmax_steps: 10\n",
     r"torchft_diloco has no option 'sync_every'; allowed: period, outer_optimizer"),
    (CONV.replace("[ddp]", "[ddp, {name: torchft_diloco, period: 10, fragments: 3}]") + "target: 0.9\nmax_steps: 10\n",
     r"torchft_diloco: period \(10\) must be a multiple of fragments \(3\)"),
    (CONV.replace("[ddp]", "[ddp, {name: torchft_diloco, period: 8, fragments: 2, fragment_sync_delay: 4}]")
     + "target: 0.9\nmax_steps: 10\n", r"fragment_sync_delay \(4\) must be < period / fragments \(4\)"),
    (CONV.replace("[ddp]", "[ddp, {name: torchft_diloco, fragment_update_alpha: 2}]") + "target: 0.9\nmax_steps: 10\n",
     r"fragment_update_alpha must be in \[0, 1\], got 2"),
    (CONV.replace("[ddp]", "[ddp, {name: torchft_diloco, outer_optimizer: {name: nope}}]") + "target: 0.9\nmax_steps: 10\n",
     r"torchft_diloco: outer_optimizer name 'nope' is not a torch.optim optimizer"),
])
def test_bad_projection_and_torchft_settings_name_the_key_and_value(tmp_path, text, pattern):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=pattern):
        load_benchmark_config(str(p))


def test_project_time_defaults_and_warmup_is_allowed(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("mode: convergence\nmodels: [mlp_digits]\ntarget: 0.9\nmax_steps: 10\nproject_time: true\n"
                 "algorithms: [ddp, {name: local_sgd, period: 4, warmup_steps: 6}]\n")
    cfg = load_benchmark_config(str(p))
    assert cfg["project_time"] is True and (cfg["timing_steps"], cfg["timing_warmup_steps"]) == (6, 2)
    assert cfg["timing_repeats"] == 1
    assert cfg["skipped"] == []
    p.write_text(CONV + "target: 0.9\nmax_steps: 10\n")
    assert load_benchmark_config(str(p))["project_time"] is False


def test_torchft_row_and_hf_model_are_skipped_with_a_note_when_not_installed(tmp_path, monkeypatch):
    from bagua_lite.bench import config
    monkeypatch.setattr(config, "torchft_available", lambda: (False, "ModuleNotFoundError: No module named 'torchft'"))
    monkeypatch.setattr(zoo, "optional_model_missing", lambda m: "transformers is not installed (pip ...)"
                        if m == "hf_gpt2" else None)
    p = tmp_path / "c.yaml"
    p.write_text("mode: convergence\nmodels: [gpt_small, hf_gpt2]\nmetric: loss\ntarget: 2\nmax_steps: 10\n"
                 "algorithms: [ddp, {name: torchft_diloco, period: 5, label: torchft}]\n")
    cfg = load_benchmark_config(str(p))
    assert [a["name"] for a in cfg["algorithms"]] == ["ddp"] and cfg["models"] == ["gpt_small"]
    assert cfg["skipped"][0] == "model hf_gpt2 skipped: transformers is not installed (pip ...)"
    assert cfg["skipped"][1].startswith("torchft skipped: torchft is not installed (ModuleNotFoundError")
    assert len(cfg["skipped"]) == 2 and all("\n" not in s for s in cfg["skipped"])
    p.write_text("mode: convergence\nmodels: [hf_gpt2]\nmetric: loss\ntarget: 2\nmax_steps: 10\nalgorithms: [ddp]\n")
    with pytest.raises(ValueError, match=r"no model left to run \(model hf_gpt2 skipped: transformers"):
        load_benchmark_config(str(p))


SKIP_SMOKE = """
mode: convergence
world_sizes: [2]
networks: [loopback]
models: [mlp_digits]
batch_size: 16
bucket_size_mb: 1
lr: 0.05
target: 0.5
max_steps: 10
eval_every: 5
algorithms: [ddp, {name: torchft_diloco, period: 5}]
"""


def test_torchft_row_is_skipped_in_one_line_when_torchft_does_not_import(tmp_path):
    """A run where ``import torchft`` fails (a stand-in module that raises, first on the path): one line on
    stderr says the row is skipped and why, and the rest of the run goes on."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "torchft.py").write_text("raise ImportError('torchft hidden by the test')\n")
    cfg = tmp_path / "skip.yaml"
    cfg.write_text(SKIP_SMOKE)
    env = dict(os.environ, PYTHONPATH=str(shim) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "bagua_lite.bench", "--config", str(cfg), "--out", str(tmp_path / "o")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if "skipped" in line]
    assert notes == ["benchmark: torchft_diloco(period=5) skipped: torchft is not installed (ImportError: torchft "
                     "hidden by the test; pip install torchft==0.2.0 --no-deps and opentelemetry-sdk "
                     "opentelemetry-exporter-otlp-proto-http, or the bagua_lite[torchft] extra)"], proc.stderr
    rows = json.loads((tmp_path / "o" / "results.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["ddp"]


def _timing(label, times, cycle, tx=None, name="diloco", warmup_steps=0, phases=None, network="100mbit"):
    return {"kind": "timing", "network": network, "world_size": 2, "model": "mlp_digits", "algorithm": name,
            "label": label, "times": times, "cycle": cycle, "bytes": [0] * len(times), "tx_bytes": tx or [None] * len(times),
            "warmup_steps": warmup_steps, "phases": phases}


def _conv(label, name, hit, steps_run=40):
    return {"kind": "convergence", "network": "loopback", "world_size": 2, "model": "mlp_digits", "algorithm": name,
            "label": label, "options": {}, "optimizer": "sgd", "seed": 0, "metric": "accuracy", "target": 0.7,
            "curve": [[0, 0.0, 0.1, 2.0], [20, 0.2, 0.5, 1.0], [40, 0.4, 0.8, 0.5]], "steps_to_target": hit,
            "time_to_target_s": 0.4 if hit else None, "final_metric": 0.8, "final_loss": 0.5, "train_loss": 0.5,
            "steps_run": steps_run, "train_s": 0.4, "eval_s": 0.1, "step_s": 0.01, "picked": None, "decision": None,
            "bytes_per_step_counted": None, "bytes_per_step_wire": None}


def test_projection_arithmetic_steps_from_loopback_times_measured_step():
    from bagua_lite.bench.report import combine_seeds, project_records, summarize_convergence
    records = [_conv("ddp", "ddp", 40), _conv("diloco", "diloco", 20),
               # DDP: 1 s/step (median), 1e6 B/step on the link; diloco period 2: cycles (0.1+0.5)/2, (0.1+0.7)/2
               _timing("ddp", [1.0, 1.2, 0.9], 1, tx=[1e6] * 3, name="ddp"),
               _timing("diloco", [0.1, 0.5, 0.1, 0.7, 0.1, 0.9], 2, tx=[0, 2e5, 0, 2e5, 0, 2e5])]
    proj = {r["label"]: r for r in project_records(records)}
    assert proj["ddp"]["step_s"] == pytest.approx(1.0) and proj["ddp"]["time_to_target_s"] == pytest.approx(40.0)
    assert proj["diloco"]["step_s"] == pytest.approx(0.4)  # median of the per-cycle means 0.3, 0.4, 0.5
    assert proj["diloco"]["time_to_target_s"] == pytest.approx(20 * 0.4) and proj["diloco"]["train_s"] == pytest.approx(16)
    assert [c[1] for c in proj["diloco"]["curve"]] == pytest.approx([0.0, 8.0, 16.0])
    assert proj["diloco"]["bytes_per_step_wire"] == pytest.approx(1e5) and proj["diloco"]["projected"]
    rows = combine_seeds(summarize_convergence(records))
    by = {(r["network"], r["algorithm"]): r for r in rows}
    assert by["100mbit", "diloco"]["speedup_vs_ddp"] == pytest.approx(40 / 8)
    assert by["100mbit", "diloco"]["bytes_vs_ddp"] == pytest.approx(10)
    assert by["100mbit", "diloco"]["projection"] == "projected: steps from loopback, s/step measured at 100mbit"
    assert by["loopback", "diloco"]["projection"] is None and by["loopback", "diloco"]["time_to_target_s"] == 0.4
    # a warm-up: the first 10 steps at the warm-up's 1 s/step, the rest at 0.2
    warm = _timing("post", [0.2] * 4, 1, name="local_sgd", warmup_steps=10,
                   phases={"warmup": {"times": [1.0] * 4, "cycle": 1}, "after": {"times": [0.2] * 4, "cycle": 1}})
    (p,) = project_records([_conv("post", "local_sgd", 20), warm])
    assert p["time_to_target_s"] == pytest.approx(10 * 1.0 + 10 * 0.2)
    assert p["train_s"] == pytest.approx(10 + 30 * 0.2) and p["step_s"] == pytest.approx(16 / 40)
    assert [c[1] for c in p["curve"]] == pytest.approx([0.0, 12.0, 16.0])


def test_timing_repeats_project_at_the_median_of_each_repeats_figures():
    import io

    from bagua_lite.bench.report import combine_seeds, print_convergence_table, project_records, summarize_convergence
    from bagua_lite.bench.runner import plan_cells
    # diloco period 2, timed three times: per-cycle means 0.2 / 0.5 / 0.3 s/step (repeat 2 had a slow minute),
    # link bytes per step 1e5 / 2e5 / 0.5e5
    reps = [_timing("diloco", ts, 2, tx=[0, b] * 2) for ts, b in (([0.1, 0.3] * 2, 2e5), ([0.1, 0.9] * 2, 4e5),
                                                                  ([0.2, 0.4] * 2, 1e5))]
    for i, r in enumerate(reps):
        r["repeat"] = i
    (p,) = project_records([_conv("diloco", "diloco", 20)] + reps)
    assert p["step_s"] == pytest.approx(0.3) and p["time_to_target_s"] == pytest.approx(20 * 0.3)
    assert p["repeat_step_s"] == pytest.approx([0.2, 0.5, 0.3]) and p["timing_repeats"] == 3
    assert p["bytes_per_step_wire"] == pytest.approx(1e5) and p["train_s"] == pytest.approx(40 * 0.3)
    # pooling every cycle instead would give the median of 0.2, 0.2, 0.5, 0.5, 0.3, 0.3 = 0.3 here but not in
    # general: two repeats of 0.2 and one of 1.0 (one cycle each) -> median 0.2 (a pooled mean would be 0.47)
    reps = [_timing("ddp", [t], 1, name="ddp") for t in (0.2, 1.0, 0.2)]
    (d,) = project_records([_conv("ddp", "ddp", 40)] + reps)
    assert d["step_s"] == pytest.approx(0.2) and d["time_to_target_s"] == pytest.approx(8.0)
    # a warm-up: each phase at the median of its own repeats (warm-up 1, 3, 2 -> 2; after 0.2, 0.1, 0.4 -> 0.2)
    warm = [_timing("post", [0.2] * 4, 1, name="local_sgd", warmup_steps=10,
                    phases={"warmup": {"times": [w] * 4, "cycle": 1}, "after": {"times": [a] * 4, "cycle": 1}})
            for w, a in ((1.0, 0.2), (3.0, 0.1), (2.0, 0.4))]
    (w,) = project_records([_conv("post", "local_sgd", 20)] + warm)
    assert w["time_to_target_s"] == pytest.approx(10 * 2.0 + 10 * 0.2) and w["repeat_step_s"] == pytest.approx([0.2, 0.1, 0.4])
    rows = combine_seeds(summarize_convergence([_conv("diloco", "diloco", 20)] + [
        dict(r, repeat=i) for i, r in enumerate(_timing("diloco", [t, t], 2) for t in (0.3, 0.1, 0.2))]))
    buf = io.StringIO()
    print_convergence_table(rows, buf)
    text = buf.getvalue()
    assert "s/step measured at 100mbit over whole cycles of each algorithm (the median of 3 timing repeats)" in text
    assert "each timing repeat's s/step, in the order they ran: diloco 0.3000 0.1000 0.2000" in text
    # the progress plan counts every repeat's timing cells
    cfg = {"mode": "convergence", "project_time": True, "timing_repeats": 3, "world_sizes": [2], "seeds": [0],
           "models": ["gpt_small"], "algorithms": [{"label": "ddp"}, {"label": "diloco"}]}
    plan = plan_cells(cfg, ["loopback", "100mbit"])
    assert [c[0] for c in plan].count("train") == 2 and [c[4] for c in plan if c[0] == "timing"] == ["ddp", "diloco"] * 3


def test_projected_table_says_so_and_figures_compare_with_each_baseline():
    import io

    from bagua_lite.bench.report import (combine_seeds, convergence_figures, print_convergence_table,
                                         summarize_convergence)
    records = [_conv("ddp", "ddp", 40), _conv("diloco", "diloco", 20), _conv("torchft", "torchft_diloco", 20),
               _timing("ddp", [1.0] * 3, 1, tx=[1e6] * 3, name="ddp"),
               _timing("diloco", [0.25] * 4, 2, tx=[1e4] * 4),
               _timing("torchft", [0.5] * 4, 2, tx=[2e4] * 4, name="torchft_diloco")]
    rows = combine_seeds(summarize_convergence(records))
    buf = io.StringIO()
    print_convergence_table(rows, buf)
    text = buf.getvalue()
    assert "PROJECTED: steps to target from the unthrottled (loopback) run, s/step measured at 100mbit" in text
    assert text.count("PROJECTED") == 1 and "vs torchft" in text and "x fewer B" in text
    buf = io.StringIO()
    lines = convergence_figures(rows, buf)
    assert ("mlp_digits on 100mbit, P=2 (projected): best of ours: diloco 5.00 s to target: 8.00x sooner than DDP, "
            "2.00x sooner than torchft DiLoCo") in lines
    assert ("mlp_digits on 100mbit, P=2 (projected): diloco vs torchft DiLoCo: time to target 0.50x torchft's "
            "(2.00x sooner)") in lines
    assert ("mlp_digits on 100mbit, P=2 (projected): bytes per step per rank vs DDP's 1.000 MB: diloco 100x fewer, "
            "torchft 50x fewer") in lines
    # every row trained the whole budget: the held-out loss at equal steps (loopback, not repeated per projection)
    eq = [line for line in lines if "equal steps" in line]
    assert eq == ["mlp_digits on loopback, P=2: held-out loss at equal steps (40): DDP 0.5000; diloco 0.5000 "
                  "(+0.0%), torchft 0.5000 (+0.0%)"]


def test_eta_formatting_and_progress_line():
    import io

    from bagua_lite.bench.runner import Progress, format_eta
    assert [format_eta(s) for s in (0, 42.4, 60, 245, 3600, 3725, -3)] == [
        "0 s", "42 s", "1 min 00 s", "4 min 05 s", "1 h 00 min", "1 h 02 min", "0 s"]
    now = [100.0]
    plan = [("train", "loopback", 2, "gpt_small", "ddp", 0), ("train", "loopback", 2, "gpt_small", "diloco", 0),
            ("timing", "100mbit", 2, "gpt_small", "ddp", None), ("timing", "100mbit", 2, "gpt_small", "diloco", None)]
    out = io.StringIO()
    prog = Progress(plan, out=out, clock=lambda: now[0])
    prog.update(0)
    assert out.getvalue().splitlines()[-1].endswith(
        "cell 1/4: ddp on loopback P=2 gpt_small seed 0 [training] | 0 s elapsed, time left: estimated after the first cell")
    now[0] = 130.0
    prog.update(1)  # the first cell took 30 s: 3 more cells of no other known kind, 90 s
    assert out.getvalue().splitlines()[-1].endswith(
        "cell 2/4: diloco on loopback P=2 gpt_small seed 0 [training] | 30 s elapsed, about 1 min 30 s left")
    now[0] = 140.0
    prog.update(2)  # training cells: 30 and 10 s (mean 20); timing cells: none yet, the mean of all (20)
    assert "cell 3/4: ddp on 100mbit P=2 gpt_small [timing (s/step)] | 40 s elapsed, about 40 s left" in out.getvalue()
    now[0] = 145.0
    prog.update(3)  # timing cells took 5 s: one left
    assert out.getvalue().splitlines()[-1].endswith("about 5 s left")
    prog.update(3)  # nothing new, not a terminal: no new line within every_s
    assert len(out.getvalue().splitlines()) == 4
    now[0] = 150.0
    prog.update(4)
    assert out.getvalue().splitlines()[-1].endswith("4/4 cells done in 50 s")


PROJECT_SMOKE = """
mode: convergence
world_sizes: [2]
networks: [loopback, 100mbit]
models: [mlp_digits]
batch_size: 16
bucket_size_mb: 1
lr: 0.05
target: 0.6
max_steps: 30
eval_every: 10
stop_at_target: false
project_time: true
timing_steps: 4
algorithms: [ddp, {name: diloco, period: 5}, {name: torchft_diloco, period: 5}]
"""


def test_project_time_end_to_end_and_torchft_follows_our_diloco(tmp_path):
    """P = 2: every cell trains on loopback, then is timed on an emulated 100 Mbit/s link (loopback only,
    labelled so, where emulation is not available); the projected rows are steps x s/step. torchft's DiLoCo
    (when installed) and ours, same H, inner and outer optimizer, follow the same trajectory."""
    from bagua_lite.bench import netem
    cfg = tmp_path / "proj.yaml"
    emulated = netem.available()[0]
    cfg.write_text(PROJECT_SMOKE)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bagua_lite.bench", "--config", str(cfg), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    tft = _torchft_installed()
    names = ["ddp", "diloco"] + (["torchft_diloco"] if tft else [])
    assert [r["name"] for r in rows if r["network"] == "loopback"] == names
    assert "cell 1/" in proc.stderr and "left" in proc.stderr
    if not emulated:
        assert not any(r["projected"] for r in rows)
        return
    proj = [r for r in rows if r["network"] == "100mbit"]
    assert [r["name"] for r in proj] == names and all(r["projected"] for r in proj)
    assert "PROJECTED" in proc.stdout
    for r in proj:
        src = next(x for x in rows if x["network"] == "loopback" and x["algorithm"] == r["algorithm"])
        assert r["steps_run"] == src["steps_run"] == 30 and r["final_metric"] == src["final_metric"]
        assert r["train_s"] == pytest.approx(30 * r["step_s"])
        if r["steps_to_target"] is not None:
            assert r["time_to_target_s"] == pytest.approx(r["steps_to_target"] * r["step_s"])
        assert r["bytes_per_step_wire"] > 0
    ddp, diloco = proj[0], proj[1]
    assert ddp["bytes_per_step_wire"] > 3 * diloco["bytes_per_step_wire"]  # period 5: about 5x fewer
    if tft:
        ours = next(r for r in rows if r["network"] == "loopback" and r["name"] == "diloco")["curve"]
        theirs = next(r for r in rows if r["network"] == "loopback" and r["name"] == "torchft_diloco")["curve"]
        assert [c[0] for c in ours] == [c[0] for c in theirs]
        assert [c[3] for c in ours] == pytest.approx([c[3] for c in theirs], rel=1e-5)


@pytest.mark.skipif(zoo.optional_model_missing("hf_gpt2") is not None, reason="transformers not installed")
def test_hf_gpt2_is_gpt_small_sized_and_eats_the_markov_task():
    net, spec = zoo.make_model("hf_gpt2")
    assert zoo.count_parameters(net) == zoo.gpt_parameters(256, 64, 256, 4) == 3_241_472
    assert spec.task == "markov" and spec.vocab == 256
    task = data.make_task(spec, 0, 1, 2, 8)
    x, y = task.batch(0)
    out = net(x)
    assert out.shape == (2, 64, 256) and torch.isfinite(data.loss_fn(out, y))
