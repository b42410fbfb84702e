"""The benchmark end to end on a tiny matrix (loopback, 2 ranks): outputs exist and say something true."""
import csv
import io
import json
import os
import statistics
import subprocess
import sys
import time

import pytest

import bagua_lite

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Test-only asynchronous relaxation (async_model_average's place in these tests): every rank trains on its
# own and never waits for another, so its ranks' step times are independent. Registered on import, in
# this process and in the cluster's ranks (unpickling a task imports this module, as here).
@bagua_lite.algorithms.register("async_local_test")
class AsyncLocalTest(bagua_lite.Algorithm):
    """Gradient-free local training; ``step_sleep_s`` adds a fixed amount of work to every step, and
    ``expect_optimizer`` makes set-up fail unless the model's optimizer is that one (as qadam's does)."""

    asynchronous = True
    #: per instance (one per cell) in this process: the monotonic clock at the end of each step
    step_ends = []

    def __init__(self, step_sleep_s: float = 0.0, expect_optimizer: str = ""):
        super().__init__()
        self.step_sleep_s, self.expect_optimizer = float(step_sleep_s), expect_optimizer

    def init(self, model):
        got = type(model.optimizer).__name__.lower()
        if self.expect_optimizer and got != self.expect_optimizer:
            raise TypeError(f"async_local_test: expected optimizer {self.expect_optimizer}, got {got}")
        self.ends = []
        AsyncLocalTest.step_ends.append(self.ends)

    def sync_gradients(self):
        return False

    def before_forward(self):
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)

    def after_step(self):
        self.ends.append(time.monotonic())


def test_quick_benchmark_writes_table_json_csv_png(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "bagua_lite.bench", "--config", "configs/benchmark_quick.yaml",
                           "--out", str(out), "--project", "16,1024"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "s/step" in text and "vs DDP" in text
    rows = json.loads((out / "results.json").read_text())["rows"]
    names = ["ddp", "ddp", "ddp_fp16", "ddp_powersgd", "gradient_allreduce", "gtopk", "topk", "local_sgd"]
    assert [r["name"] for r in rows] == names * 2
    assert [r["straggler"] for r in rows] == ["none"] * len(names) + ["half"] * len(names)
    header = next(line for line in text.splitlines() if "s/step" in line and "samples/s" in line)
    assert "straggler" in header and "fast" in header  # the axis has two values
    ddp = rows[0]
    assert ddp["speedup_vs_ddp"] == pytest.approx(1.0)
    for r in rows:
        assert r["step_s"] > 0 and r["samples_per_s"] == pytest.approx(2 * 16 / r["step_s"])
        # min_cell_s (2 s) is far more than 6 steps of this model take: every cell measured max_steps
        assert r["steps_measured"] == 6, (r["name"], r["steps_measured"])
        assert r["final_loss"] == r["final_loss"]  # not NaN
        # every rank's own median; the slowest rank's figure is at least the fast ranks' median
        assert len(r["rank_s_per_step"]) == 2 and all(t > 0 for t in r["rank_s_per_step"])
        assert 0 < r["fast_s_per_step"] <= r["step_s"] * 1.000001
        if r["straggler"] == "half":
            assert r["fast_s_per_step"] == pytest.approx(r["rank_s_per_step"][1])
            assert r["predicted_step_s"] is None and r["comm_exposed_s"] is None
        # compared with the DDP row of the same straggler condition and optimizer
        base = next(b for b in rows if b["algorithm"] == r["ddp_baseline"] and b["straggler"] == r["straggler"])
        assert base["name"] == "ddp" and base["optimizer"] == r["optimizer"]
        assert r["speedup_vs_ddp"] == pytest.approx(base["step_s"] / r["step_s"])
    # the optimizer column: the adam DDP row says so, and is its own baseline
    adam = [r for r in rows if r["optimizer"] == "adam"]
    assert [r["algorithm"] for r in adam] == ["DDP (adam)"] * 2
    assert all(r["ddp_baseline"] == "DDP (adam)" and r["speedup_vs_ddp"] == pytest.approx(1.0) for r in adam)
    assert "optim" in text and any("DDP (adam)" in line and " adam " in line for line in text.splitlines())
    assert {r["optimizer"] for r in rows if r["algorithm"] != "DDP (adam)"} == {"sgd"}
    # with a straggler, DDP's fast rank waits for rank 0 inside its own step (the sleep comes before the
    # collectives, not in the untimed barrier)
    half_ddp = rows[len(names)]
    assert half_ddp["name"] == "ddp" and half_ddp["fast_s_per_step"] > 0.7 * half_ddp["step_s"]
    # one value of the axis only: no straggler column
    from bagua_lite.bench.report import print_table

    buf = io.StringIO()
    print_table([r for r in rows if r["straggler"] == "none"], out=buf)
    assert "straggler" not in buf.getvalue().splitlines()[0]
    # our algorithms count their own bytes: dense = ring allreduce of the whole model, gtopk far less
    dense = next(r for r in rows if r["name"] == "gradient_allreduce")
    gtopk = next(r for r in rows if r["name"] == "gtopk")
    numel = 256 * 512 + 512 + 512 * 10 + 10
    assert dense["bytes_per_step_counted"] == pytest.approx(2 * (2 - 1) * numel * 4 / 2, rel=1e-6)
    assert 0 < gtopk["bytes_per_step_counted"] < dense["bytes_per_step_counted"] / 10
    # local SGD averages the weights every 2nd step: timed over whole periods, so its figure per step
    # is half a dense allreduce (a per-step median would have hidden the averaging step and said 0)
    local = next(r for r in rows if r["name"] == "local_sgd")
    assert local["bytes_per_step_counted"] == pytest.approx(dense["bytes_per_step_counted"] / 2, rel=1e-6)
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (out / "throughput.png").stat().st_size > 1000
    # one repeat on one network: one floor for the model, so the table says a drift cannot be told
    assert json.loads((out / "results.json").read_text())["floor_spread"] == []
    assert "cannot be told from the floors" in text
    assert all(r["below_floor"] is (r["vs_floor"] < 1) for r in rows)
    # the projection covers the requested sizes
    projections = json.loads((out / "results.json").read_text())["projections"]
    assert {p["world_size"] for p in projections} == {16, 1024}


def test_bad_benchmark_config_is_rejected_before_launch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("world_sizes: [2]\nnetwork: [loopback]\nalgorithms: [ddp]\n")
    proc = subprocess.run([sys.executable, "-m", "bagua_lite.bench", "--config", str(bad), "--out",
                           str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "unknown key 'network'" in proc.stderr and "did you mean 'networks'" in proc.stderr


@pytest.mark.parametrize("extra, pattern", [
    ("max_steps: 3", r"max_steps must be an int >= steps \(5\), got 3"),
    ("min_cell_s: -1", r"min_cell_s must be a number of seconds >= 0, got -1"),
    ("steps: 0", r"steps must be an int >= 1, got 0"),
    ("floor_each_cell: 1", r"floor_each_cell must be true or false, got 1"),
    ("repeats: 0", r"repeats must be an int >= 1, got 0"),
])
def test_bad_step_settings_name_the_value(tmp_path, extra, pattern):
    from bagua_lite.bench.config import load_benchmark_config

    p = tmp_path / "c.yaml"
    p.write_text("steps: 5\nalgorithms: [ddp]\n" + extra + "\n" if not extra.startswith("steps") else
                 "algorithms: [ddp]\n" + extra + "\n")
    with pytest.raises(ValueError, match=pattern):
        load_benchmark_config(str(p))


def test_every_shipped_benchmark_config_validates():
    import glob

    from bagua_lite.bench.config import load_benchmark_config

    from bagua_lite.bench.zoo import optional_model_missing

    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "benchmark*.yaml")))
    assert len(paths) >= 3
    for p in paths:
        try:
            cfg = load_benchmark_config(p)
        except ValueError as e:  # a config of optional models only (hf_gpt2) where their package is missing
            if "no model left to run" in str(e) and optional_model_missing("hf_gpt2"):
                continue
            raise
        if cfg["mode"] == "step":  # gpu_step's rows: the plain loop and DDP measured beside ours
            assert {"plain", "ddp"} <= set(cfg["rows"]), p
            continue
        names = [a["name"] for a in cfg["algorithms"]]
        # the data-parallel reference in the same run: DDP, or FSDP2's own HSDP for sharded models
        reference = "hsdp" if cfg["shards"] > 1 else "ddp"
        assert reference in names, f"{p}: every benchmark measures {reference} in the same run"


def test_cycle_median_counts_the_periodic_step():
    from bagua_lite.bench.report import cycle_median
    # period 4: one expensive averaging step per cycle must show in the per-step figure
    times = [0.2, 2.2, 0.2, 0.2, 0.2, 1.8, 0.2, 0.2]
    assert cycle_median(times, 4) == pytest.approx((0.6 + 2.2 + 0.6 + 1.8) / 8)
    assert cycle_median(times, 1) == pytest.approx(0.2)  # the plain median drops it
    assert cycle_median([1.0, 3.0], 4) == pytest.approx(2.0)  # shorter than a cycle: the mean
    assert cycle_median([None, 1.0, 2.0, 9.0]) == 2.0 and cycle_median([]) is None


@pytest.mark.parametrize("algorithms, extra, pattern", [
    ("[{name: ddp, optimizer: Adam}]", "", r"algorithm 'ddp': unknown optimizer 'Adam'; allowed: sgd, adam, adamw"),
    ("[{name: gtopk, density: 0.01, optimizer: lamb}]", "",
     r"algorithm 'gtopk': unknown optimizer 'lamb'; allowed: sgd, adam, adamw"),
    ("[ddp]", "stragglers: [none, slow]", r"unknown straggler condition 'slow' in stragglers; allowed: none, half"),
    ("[ddp]", "stragglers: half", r"stragglers must be a non-empty list of none, half, got 'half'"),
    ("[ddp]", "stragglers: []", r"stragglers must be a non-empty list"),
    ("[ddp]", "stragglers: [half, half]", r"stragglers lists a condition twice"),
])
def test_bad_optimizer_or_straggler_names_the_value(tmp_path, algorithms, extra, pattern):
    from bagua_lite.bench.config import load_benchmark_config

    p = tmp_path / "c.yaml"
    p.write_text(f"algorithms: {algorithms}\n{extra}\n")
    with pytest.raises(ValueError, match=pattern):
        load_benchmark_config(str(p))


def test_optimizer_is_the_benchmarks_key_not_the_algorithms(tmp_path):
    from bagua_lite.bench.config import load_benchmark_config

    p = tmp_path / "c.yaml"
    # gtopk has no option 'optimizer': building it with one would raise
    p.write_text("algorithms: [ddp, {name: ddp, optimizer: adam}, {name: gtopk, density: 0.01, optimizer: adamw},\n"
                 "             {name: ddp, optimizer: adam, label: DDP (adam)}]\n")
    cfg = load_benchmark_config(str(p))
    assert cfg["stragglers"] == ["none"]
    assert [(a["name"], a["optimizer"], a["options"], a["label"]) for a in cfg["algorithms"]] == [
        ("ddp", "sgd", {}, "ddp"), ("ddp", "adam", {}, "ddp[adam]"),
        ("gtopk", "adamw", {"density": 0.01}, "gtopk(density=0.01)[adamw]"), ("ddp", "adam", {}, "DDP (adam)")]


def _r_bench_matrix(rank, P, cfg, path):
    from bagua_lite.bench import runner as benchmark

    AsyncLocalTest.step_ends.clear()
    benchmark.worker_main(cfg, "loopback", path)  # in this cluster's group, which it leaves alone
    return AsyncLocalTest.step_ends  # this rank's step end times, per async_local_test cell


ASYNC_YAML = """
world_sizes: [2]
models: [mlp_small]
steps: 2          # DDP measures 2 steps (min_cell_s 0)...
max_steps: 5      # ...an asynchronous algorithm always max_steps, with no per-step collective
warmup_steps: 1
batch_size: 64
bucket_size_mb: 1
stragglers: [none, half]
algorithms:
  - ddp
  - {name: async_local_test, step_sleep_s: 0.02, optimizer: adamw, expect_optimizer: adamw}
"""


FLOOR_YAML = """
world_sizes: [2]
models: [mlp_small]
steps: 2
warmup_steps: 1
batch_size: 32
bucket_size_mb: 1
algorithms: [ddp, gradient_allreduce, {name: topk, density: 0.1}]
"""


def test_floor_is_measured_in_each_repeat_or_before_each_cell(tmp_path, clusters):
    """By default one floor per repeat, in the middle of the repeat's rotation (A FLOOR B C A FLOOR B C),
    and a row's repeat r divides by repeat r's floor, its floor the median of its repeats'; with
    floor_each_cell a floor right before every cell, and that cell divides by it. The cost model's
    prediction is made with the row's floor."""
    from bagua_lite import cost_model
    from bagua_lite.bench.config import load_benchmark_config
    from bagua_lite.bench.report import cycle_median, floor_spread, print_table, summarize
    from bagua_lite.bench.runner import _read

    names = ["ddp", "gradient_allreduce", "topk"]
    for each, repeats in ((False, 2), (True, 1)):
        cfg_path = tmp_path / f"floor_{each}.yaml"
        cfg_path.write_text(FLOOR_YAML + f"floor_each_cell: {str(each).lower()}\nrepeats: {repeats}\n")
        cfg = load_benchmark_config(str(cfg_path))
        assert cfg["floor_each_cell"] is each and cfg["repeats"] == repeats
        path = str(tmp_path / f"records_{each}.jsonl")
        clusters.get(2).run(_r_bench_matrix, cfg, path, timeout=180)
        records = _read(path)
        order = [r["kind"] if r["kind"] == "floor" else r.get("algorithm") for r in records
                 if r["kind"] in ("floor", "cell")]
        floors = [r for r in records if r["kind"] == "floor"]
        cells = [r for r in records if r["kind"] == "cell"]
        assert [c["repeat"] for c in cells] == [r for r in range(repeats) for _ in names]
        assert all(f["step_s"] > 0 for f in floors)
        if each:
            assert order == [x for n in names for x in ("floor", n)]
            assert [f["before"] for f in floors] == [c["label"] for c in cells]
            assert [c["floor_s"] for c in cells] == [f["step_s"] for f in floors]
            mine = {i: [floors[i]["step_s"]] for i in range(3)}
        else:  # one floor per repeat per model, next in time to the rows it divides
            assert order == ["ddp", "floor", "gradient_allreduce", "topk"] * 2
            assert [f["repeat"] for f in floors] == [0, 1] and all("before" not in f for f in floors)
            assert all(c["floor_s"] is None for c in cells)  # the report joins each cell to its repeat's
            mine = {i: [f["step_s"] for f in floors] for i in range(3)}
        rows = summarize(records)
        assert [r["name"] for r in rows] == names  # one row per cell of the matrix
        net = next(r for r in records if r["kind"] == "network")
        for i, r in enumerate(rows):
            mine_cells = cells[i::len(names)]
            assert r["repeats"] == repeats and r["steps_measured"] == sum(len(c["times"]) for c in mine_cells)
            assert r["repeat_step_s"] == [cycle_median(c["times"]) for c in mine_cells]
            assert r["repeat_floor_s"] == mine[i]  # each repeat's own floor
            assert r["floor_s"] == pytest.approx(statistics.median(mine[i]))
            assert r["step_s"] == pytest.approx(statistics.median([t for c in mine_cells for t in c["times"]]))
            assert r["vs_floor"] == pytest.approx(r["step_s"] / r["floor_s"])
            assert r["below_floor"] is (r["step_s"] < r["floor_s"])
            work = cost_model.Workload(numel=cells[0]["numel"], compute_s=r["floor_s"],
                                       bucket_numels=floors[0]["bucket_numels"])
            expect = cost_model.predict(r["name"], mine_cells[0]["options"], 2, work,
                                        cost_model.Network(net["alpha"], net["beta"], net["host_local"]),
                                        cost_model.Machine(**net["machine"]))
            assert r["predicted_step_s"] == pytest.approx(expect["step_s"])
        spread = floor_spread(records)
        assert [(d["model"], d["world_size"], d["measurements"]) for d in spread] == [
            ("mlp_small", 2, len(floors))]
        buf = io.StringIO()
        print_table(rows, out=buf, spread=spread)
        lines = buf.getvalue().splitlines()
        assert "x floor" in lines[0] and f"{rows[2]['vs_floor']:.2f}" in lines[4]
        listed = [line for line in lines if line.startswith("  loopback P=2 mlp_small topk")]
        if repeats > 1:
            s1, s2 = rows[2]["repeat_step_s"]
            f1, f2 = rows[2]["repeat_floor_s"]
            assert listed == [f"  loopback P=2 mlp_small {rows[2]['algorithm']}: {s1:.3f} ({s1 / f1:.2f}"
                              f"{'!' if s1 < f1 else ''}) / {s2:.3f} ({s2 / f2:.2f}{'!' if s2 < f2 else ''})"], lines
        else:
            assert listed == []


# Hand-made records of a run whose machine slowed down between two repeats: the floors of mlp_small at
# P=2 are 0.1 s (repeat 1, and on 1gbit) and 0.3 s (repeat 2): 3x apart.
MACHINE = {"topk_s_per_elem": 1e-9, "quantize_s_per_elem": 1e-9, "fp16_s_per_elem": 1e-9, "add_s_per_elem": 1e-9}
LONG = "gradient_allreduce(compression=minmax_uint8,hierarchical=false)"  # a name the plot must not cut


def _cell(network, name, label, repeat, step_s, straggler="none"):
    return {"kind": "cell", "network": network, "world_size": 2, "model": "mlp_small", "algorithm": name,
            "label": label, "options": {}, "optimizer": "sgd", "straggler": straggler, "floor_s": None,
            "repeat": repeat, "numel": 1000, "batch_size": 16, "times": [step_s] * 4, "waits": [0.0] * 4,
            "busy": [0.0] * 4, "bytes": [], "tx_bytes": [], "rank_times": [[step_s] * 4, [step_s] * 4],
            "cycle": 1, "loss": 2.0}


def _drift_records(floors=((0.1, 0.3), (0.1,))):
    """loopback: repeats with floors ``floors[0]``; 1gbit: ``floors[1]``. Every cell takes 0.2 s a step, on
    both links: below a 0.3 s floor."""
    out = []
    for network, fs in zip(("loopback", "1gbit"), floors):
        out.append({"kind": "network", "network": network, "world_size": 2, "alpha": 1e-5, "beta": 1e-9,
                    "host_local": network == "loopback", "machine": MACHINE})
        for repeat, f in enumerate(fs):
            out.append(_cell(network, "ddp", "ddp", repeat, 0.2))
            out.append({"kind": "floor", "network": network, "world_size": 2, "model": "mlp_small",
                        "numel": 1000, "step_s": f, "bucket_numels": [1000], "repeat": repeat})
            out.append(_cell(network, "gradient_allreduce", LONG, repeat, 0.2))
    return out


def test_drifting_floors_print_a_drift_line_and_flag_rows_below_their_floor():
    from bagua_lite.bench.report import DRIFT_LIMIT, floor_spread, print_table, summarize

    records = _drift_records()
    rows = summarize(records)
    lo = [r for r in rows if r["network"] == "loopback"]
    # each repeat divides by its own floor; the row's floor is the median of them
    assert [r["repeat_floor_s"] for r in lo] == [[0.1, 0.3]] * 2
    assert all(r["floor_s"] == pytest.approx(0.2) and not r["below_floor"] for r in lo)
    gb = [r for r in rows if r["network"] == "1gbit"]
    assert all(r["floor_s"] == 0.1 and r["vs_floor"] == pytest.approx(2.0) for r in gb)
    spread = floor_spread(records)
    assert len(spread) == 1 and spread[0]["measurements"] == 3 and spread[0]["drifted"]
    assert spread[0]["ratio"] == pytest.approx(3.0) and spread[0]["slowest"] == "loopback, repeat 2"
    buf = io.StringIO()
    print_table(rows, out=buf, spread=spread)
    text = buf.getvalue()
    assert "the machine's speed moved during the run" in text and "3.00x apart" in text, text
    assert f"more than {DRIFT_LIMIT:.2f}x" in text
    assert "0.20 (0.67!)" not in text and "0.200 (0.67!)" in text  # the repeat below its floor is marked
    assert "!" not in "".join(line for line in text.splitlines()[2:6] if "x floor" not in line)  # no row below

    # a row whose floor is above its s/step: marked in the table, with a footnote saying why
    rows = summarize(_drift_records(floors=((0.3,), (0.3,))))
    assert all(r["below_floor"] and r["vs_floor"] == pytest.approx(2 / 3) for r in rows)
    spread = floor_spread(_drift_records(floors=((0.3,), (0.3,))))
    assert not spread[0]["drifted"]
    buf = io.StringIO()
    print_table(rows, out=buf, spread=spread)
    lines = buf.getvalue().splitlines()
    assert all("0.67!" in line for line in lines[2:6]), lines
    assert any(line.startswith("! x floor below 1 (4 rows): faster than its floor: the machine's speed moved")
               for line in lines)
    assert not any("speed moved during the run" in line for line in lines)
    # one floor per model and P: the table says drift cannot be told
    one = [r for r in _drift_records(floors=((0.1,), ())) if r["network"] == "loopback"]
    buf = io.StringIO()
    print_table(summarize(one), out=buf, spread=floor_spread(one))
    assert "cannot be told from the floors" in buf.getvalue()


def test_plot_labels_its_axes_shows_whole_names_and_says_projected_and_drift(tmp_path):
    pytest.importorskip("matplotlib")
    from bagua_lite.bench.report import floor_spread, summarize, throughput_figure, write_outputs

    records = _drift_records(floors=((0.1, 0.3), (0.3,)))
    rows, spread = summarize(records), floor_spread(records)
    projections = [{"network": "1gbit", "model": "mlp_small", "world_size": P, "algorithm": a,
                    "step_s": 1.0, "speedup_vs_ddp": v} for P in (16, 1024) for a, v in (("ddp", 1.0), (LONG, 3.0))]
    fig = throughput_figure(rows, projections, spread)
    measured, projected = fig.axes
    assert measured.get_xlabel().startswith("samples/s") and measured.get_ylabel() == "algorithm"
    assert [t.get_text() for t in measured.get_yticklabels()] == ["ddp", LONG]  # whole, not cut
    assert "speed moved during the run" in measured.get_title(loc="left")
    assert "faster than their compute floor" in measured.get_title(loc="left")
    assert "below its floor" in " ".join(t.get_text() for t in measured.texts)
    assert "PROJECTED" in projected.get_xlabel() and "PROJECTED" in projected.get_title(loc="left")
    assert projected.get_ylabel() and [t.get_text() for t in projected.get_yticklabels()] == ["ddp", LONG]
    assert [t.get_text() for t in projected.get_legend().get_texts()] == ["1gbit P=16 (projected)",
                                                                          "1gbit P=1024 (projected)"]
    assert "projected" not in measured.get_legend().get_texts()[0].get_text()
    path = write_outputs(rows, projections, str(tmp_path), spread)
    assert path == str(tmp_path / "throughput.png") and os.path.getsize(path) > 1000
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["floor_spread"][0]["drifted"] and [r["below_floor"] for r in saved["rows"]] == [
        False, False, True, True]
    # without projections: one panel per model, no projected note
    fig = throughput_figure(rows, [], spread)
    assert len(fig.axes) == 1 and "PROJECTED" not in fig.axes[0].get_title(loc="left")


def test_asynchronous_algorithm_is_timed_per_rank_without_per_step_sync(tmp_path, clusters):
    """A test-only asynchronous algorithm (rank-local training plus 20 ms of fixed work per step) under
    a straggler: the fast rank must keep its own pace (the benchmark does not synchronise it per step),
    every rank must finish the cell, and the speed-up must be against the DDP row of the same condition."""
    from bagua_lite.bench.config import load_benchmark_config
    from bagua_lite.bench.report import summarize
    from bagua_lite.bench.runner import _read

    cfg_path = tmp_path / "async.yaml"
    cfg_path.write_text(ASYNC_YAML)
    cfg = load_benchmark_config(str(cfg_path))
    path = str(tmp_path / "records.jsonl")
    ends = clusters.get(2).run(_r_bench_matrix, cfg, path, timeout=120)  # every rank got through
    assert [len(e) for e in ends] == [2, 2] and all(len(cell) == 1 + 5 for e in ends for cell in e)
    rows = summarize(_read(path))
    assert [(r["name"], r["straggler"], r["asynchronous"]) for r in rows] == [
        ("ddp", "none", False), ("async_local_test", "none", True),
        ("ddp", "half", False), ("async_local_test", "half", True)]
    for r in rows:
        assert r["steps_measured"] == (5 if r["asynchronous"] else 2), r
        assert len(r["rank_s_per_step"]) == 2
        assert r["step_s"] == pytest.approx(max(r["rank_s_per_step"]) if r["asynchronous"] else r["step_s"])
        base = next(b for b in rows if b["name"] == "ddp" and b["straggler"] == r["straggler"])
        assert r["ddp_baseline"] == "ddp"
        assert r["speedup_vs_ddp"] == pytest.approx(r["samples_per_s"] / base["samples_per_s"])
    assert rows[1]["optimizer"] == "adamw" and rows[1]["algorithm"].endswith("[adamw]")
    calm, slow = rows[1], rows[3]
    # no straggler: both ranks at the same pace, about the fixed work per step
    assert all(t >= 0.02 for t in calm["rank_s_per_step"])
    assert calm["samples_per_s"] == pytest.approx(64 / calm["rank_s_per_step"][0] + 64 / calm["rank_s_per_step"][1])
    # half: rank 0 takes about twice as long per step; rank 1 does not wait for it
    r0, r1 = slow["rank_s_per_step"]
    assert r0 > 1.5 * r1, slow["rank_s_per_step"]
    assert slow["fast_s_per_step"] == pytest.approx(r1) and slow["step_s"] == pytest.approx(r0)
    # ...not even outside the timed steps: rank 1 ran its steps in well under rank 0's wall time (a
    # barrier or any collective per step would have held it to rank 0's pace there)
    span = [e[1][-1] - e[1][0] for e in ends]
    assert span[1] < 0.7 * span[0], span
    # whereas DDP's fast rank is held to the straggler's pace
    ddp_slow = rows[2]
    assert ddp_slow["fast_s_per_step"] > 0.7 * ddp_slow["step_s"]
    # what asynchrony buys shows in the throughput: rank 1 runs at its own rate
    assert slow["samples_per_s"] == pytest.approx(64 / r0 + 64 / r1)
