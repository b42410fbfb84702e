"""The benchmark on FSDP2-sharded models (``shards`` > 1: HSDP) and in nodes (``ranks_per_node``): the config's
refusals, the evaluated average of sharded replicas, and a tiny HSDP matrix end to end on loopback (P = 4 as
2 replicas x 2 shards) with its records and the report's rows. The nodes' network (ranks of one node talk over
its loopback, not the rate-limited link) is tested in tests/test_netem.py."""
import csv
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE = """
mode: convergence
world_sizes: [4]
networks: [loopback]
models: [gpt_small]
metric: loss
target: 1.25
max_steps: 4
"""


def _load(tmp_path, text):
    from bagua_lite.bench.config import load_benchmark_config

    p = tmp_path / "c.yaml"
    p.write_text(BASE + text)
    return load_benchmark_config(str(p))


@pytest.mark.parametrize("text, pattern", [
    ("shards: 3\nalgorithms: [hsdp]", r"shards \(3\) must divide every world size; it does not divide 4"),
    ("shards: 0\nalgorithms: [hsdp]", r"shards must be an int >= 1, got 0"),
    ("ranks_per_node: 3\nalgorithms: [ddp]", r"ranks_per_node \(3\) must divide every world size"),
    ("ranks_per_node: true\nalgorithms: [ddp]", r"ranks_per_node must be an int >= 1, got True"),
    ("shards: 2\nalgorithms: [ddp]", r"ddp: ddp trains a whole model on every rank, not an FSDP2-sharded one "
                                     r"\(shards: 2\); with shards > 1 the rows allowed are hsdp and "),
    ("shards: 2\nalgorithms: [ddp_fp16]", r"ddp_fp16 trains a whole model .* gradient_allreduce with compression "
                                          r"fp16 is the fp16 hook's counterpart"),
    ("shards: 2\nalgorithms: [{name: ddp_gtopk_hook, density: 0.01}]", r"ddp_gtopk_hook trains a whole model"),
    ("shards: 2\nalgorithms: [{name: torchft_diloco, period: 10}]", r"torchft_diloco trains a whole model"),
    ("shards: 2\nalgorithms: [qadam]", r"qadam does not run on shards of an FSDP2 model \(shards: 2\)"),
    ("shards: 2\nalgorithms: [{name: gradient_allreduce, hierarchical: true}]", r"hierarchical: true is refused"),
    ("shards: 2\nalgorithms: [{name: gtopk, density: 0.01}]",
     r"gtopk\(density=0.01\) \(optimizer sgd, shards: 2\): gtopk: momentum correction .* pass momentum_correction=0"),
    ("shards: 2\nalgorithms: [{name: topk, density: 0.01, momentum_correction: 0.5}]",
     r"topk: momentum correction .* applies the update in the optimizer's place"),
    ("algorithms: [hsdp]", r"hsdp: hsdp is FSDP2's HSDP over a \(replicate, shard\) mesh; it needs shards > 1"),
    ("shards: 2\nalgorithms: [{name: hsdp, density: 1}]", r"hsdp takes no options .* got density"),
    ("shards: 2\nfsdp_units: leaves\nalgorithms: [hsdp]", r"fsdp_units must be one of blocks, root, got 'leaves'"),
    ("shards: 2\nreshard_after_forward: 1\nalgorithms: [hsdp]", r"reshard_after_forward must be true or false, got 1"),
    ("fsdp_units: root\nalgorithms: [ddp]", r"fsdp_units and reshard_after_forward shape an FSDP2-sharded model; "
                                           r"they need shards > 1"),
    ("reshard_after_forward: false\nalgorithms: [ddp]", r"they need shards > 1"),
])
def test_bad_layouts_and_rows_are_refused_naming_the_value(tmp_path, text, pattern):
    with pytest.raises(ValueError, match=pattern):
        _load(tmp_path, text)


def test_shards_need_convergence_mode(tmp_path):
    from bagua_lite.bench.config import load_benchmark_config

    p = tmp_path / "t.yaml"
    p.write_text("world_sizes: [4]\nshards: 2\nalgorithms: [hsdp]\n")
    with pytest.raises(ValueError, match=r"shards \(2\) > 1 needs mode convergence: throughput mode's compute floor"):
        load_benchmark_config(str(p))


def test_layout_defaults_and_the_rows_sharded_cells_take(tmp_path):
    cfg = _load(tmp_path, "algorithms: [ddp]")
    assert cfg["shards"] == 1 and cfg["ranks_per_node"] == 1
    cfg = _load(tmp_path, "shards: 2\nranks_per_node: 2\nalgorithms: [hsdp, {name: gradient_allreduce, compression: "
                          "fp16}, {name: gtopk, density: 0.01, momentum_correction: 0}, {name: gtopk, density: 0.01, "
                          "optimizer: adamw}, powersgd, {name: local_sgd, period: 4}, {name: diloco, period: 4}]")
    assert [a["name"] for a in cfg["algorithms"]] == ["hsdp", "gradient_allreduce", "gtopk", "gtopk", "powersgd",
                                                       "local_sgd", "diloco"]
    assert (cfg["shards"], cfg["ranks_per_node"]) == (2, 2)


def _r_layout_steps(rank, world, name, units, reshard):
    from bagua_lite.bench import zoo
    from bagua_lite.bench.cells import wrap_sharded
    from bagua_lite.bench.convergence import average_replicas

    torch.manual_seed(0)
    net, into = zoo.gpt(layers=2, d_model=64), zoo.gpt(layers=2, d_model=64)
    cell = {"name": name, "options": {"period": 2} if name == "diloco" else {}, "optimizer": "adamw"}
    cfg = {"shards": 2, "lr": None, "fsdp_units": units, "reshard_after_forward": reshard}
    model, relaxed, opt, _ = wrap_sharded(cell, cfg, net)
    units_seen = sum(1 for m in net.modules() if type(m).__name__.startswith("FSDP"))
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        x = torch.randint(0, 256, (2, 64), generator=g)
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x.roll(-1, 1).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    average_replicas(net, into)
    if relaxed is not None:
        relaxed.close()
    return losses, units_seen, torch.cat([p.detach().flatten() for p in into.parameters()])


@pytest.mark.parametrize("name", ["hsdp", "diloco"])
def test_fsdp_layout_changes_the_gathers_not_the_numbers(clusters, name):
    """fsdp_units root with reshard_after_forward false wraps one unit and keeps its weights from forward to
    backward; every loss on every rank and the evaluated weights are bit for bit those of the default layout
    (each block a unit, regathered in backward): a layout the benchmark applies to every row changes its cost,
    never its trajectory."""
    cluster = clusters.get(4)
    blocks = cluster.run(_r_layout_steps, name, "blocks", True, timeout=120)
    root = cluster.run(_r_layout_steps, name, "root", False, timeout=120)
    assert [u for _, u, _ in blocks] == [3] * 4 and [u for _, u, _ in root] == [1] * 4  # 2 blocks + the root
    for (lb, _, wb), (lr, _, wr) in zip(blocks, root):
        assert lb == lr
        assert torch.equal(wb, wr)


def test_a_rows_own_lr_is_the_benchmarks_key_and_in_its_label(tmp_path):
    from bagua_lite.bench.config import cell_lr

    cfg = _load(tmp_path, "lr: 0.002\nshards: 2\nalgorithms: [{name: gtopk, density: 0.1, optimizer: adamw, lr: 0.0005},"
                          " {name: hsdp, optimizer: adamw}]")
    gtopk, hsdp = cfg["algorithms"]
    assert gtopk["options"] == {"density": 0.1} and gtopk["label"] == "gtopk(density=0.1)[adamw, lr=0.0005]"
    assert cell_lr(gtopk, cfg) == 0.0005 and cell_lr(hsdp, cfg) == 0.002
    with pytest.raises(ValueError, match=r"algorithm 'gtopk': lr must be a number > 0 .* got -1"):
        _load(tmp_path, "algorithms: [{name: gtopk, lr: -1}]")


def test_nodes_are_consecutive_ranks():
    from bagua_lite.bench.runner import node_of

    assert [node_of(r, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [node_of(r, 1) for r in range(3)] == [(0, 0), (1, 0), (2, 0)]


# ---- the evaluated model of sharded replicas ---------------------------------------------------------------------
def _r_sharded_average(rank, world, name):
    from bagua_lite.bench.cells import wrap_sharded
    from bagua_lite.bench.convergence import average_replicas

    torch.manual_seed(0)  # 5 rows: each parameter's second shard is padded
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    into = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    cell = {"name": name, "options": {"period": 4} if name == "diloco" else {}, "optimizer": "sgd"}
    model, relaxed, _, _ = wrap_sharded(cell, {"shards": 2, "lr": None}, net)
    assert (relaxed is None) == (name == "hsdp")
    with torch.no_grad():
        for p in net.parameters():  # replica q's whole weights are q + 1 + the element's index / 100
            full = torch.arange(p.numel(), dtype=torch.float32).view(p.shape) / 100 + rank // 2 + 1
            local = p.to_local()
            rows = local.shape[0]
            start = (rank % 2) * -(-p.shape[0] // 2)
            local.copy_(full[start:start + rows])
    average_replicas(net, into)
    if relaxed is not None:
        relaxed.close()
    return {k: v.tolist() for k, v in into.state_dict().items()} if rank == 0 else None


@pytest.mark.parametrize("name", ["hsdp", "diloco"])
def test_evaluated_model_is_the_average_of_sharded_replicas(clusters, name):
    got = clusters.get(4).run(_r_sharded_average, name, timeout=120)[0]
    for k, v in got.items():
        t = torch.tensor(v)
        want = torch.arange(t.numel(), dtype=torch.float32).view(t.shape) / 100 + 1.5  # replicas 1 and 2
        assert torch.allclose(t, want), (k, v)


# ---- end to end ---------------------------------------------------------------------------------------------------
TINY = """
mode: convergence
world_sizes: [4]
shards: 2
ranks_per_node: 2
networks: [loopback]
models: [gpt_small]
batch_size: 4
metric: loss
target: 5.6
max_steps: 4
eval_every: 2
eval_samples: 16
stop_at_target: false
algorithms:
  - {name: hsdp, optimizer: adamw, label: "native HSDP"}
  - {name: gradient_allreduce, compression: fp16, optimizer: adamw, label: "HSDP + fp16"}
  - {name: gtopk, density: 0.01, optimizer: adamw, label: "HSDP + gtopk 0.01"}
  - {name: diloco, period: 4, fragments: 2, overlap: 1, alpha: 0.5, compression: absmax4, optimizer: adamw,
     label: "HSDP + streaming diloco"}
"""


def test_hsdp_matrix_end_to_end_on_loopback(tmp_path):
    cfg = tmp_path / "hsdp.yaml"
    cfg.write_text(TINY)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bagua_lite.bench", "--config", str(cfg), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    labels = ["native HSDP", "HSDP + fp16", "HSDP + gtopk 0.01", "HSDP + streaming diloco"]
    assert [r["label"] for r in records] == labels
    for r in records:
        assert r["kind"] == "convergence" and r["world_size"] == 4 and (r["shards"], r["ranks_per_node"]) == (2, 2)
        assert [c[0] for c in r["curve"]] == [0, 2, 4] and r["steps_run"] == 4
        assert all(b[1] > a[1] for a, b in zip(r["curve"], r["curve"][1:]))
        assert r["numel"] == 3_241_472  # the whole model's count, not a shard's
    hsdp, fp16, gtopk, streaming = records
    # every cell starts from the same whole weights: the same held-out loss before the first step
    assert len({r["curve"][0][2] for r in records}) == 1
    # fp16 rounding of the cross-replica average only: the same trajectory within rounding
    assert fp16["final_loss"] == pytest.approx(hsdp["final_loss"], abs=2e-3)
    # bagua_lite counts its own cross-replica bytes: each rank's half of the model in fp16 for the fp16 row
    # (an allreduce over 2 replicas sends a rank's whole shard once), far fewer for gtopk; none for FSDP2's HSDP
    shard_numel = 3_241_472 / 2
    assert hsdp["bytes_per_step_counted"] is None
    assert fp16["bytes_per_step_counted"] == pytest.approx(2 * shard_numel, rel=0.01)
    assert 0 < gtopk["bytes_per_step_counted"] < fp16["bytes_per_step_counted"] / 10
    # streaming's fragments start their background syncs at steps 2 and 4, exactly where an evaluation
    # begins: they send during it and are training traffic all the same (4 bits per entry, fragments of
    # about half the shard, one sync per fragment in 4 steps)
    assert 0.1 * shard_numel / 8 < streaming["bytes_per_step_counted"] < fp16["bytes_per_step_counted"] / 4
    # the report: one table, compared with native HSDP, titled with the layout
    text = proc.stdout
    assert "gpt_small on loopback, P=4 (2 replicas x 2 shards)" in text
    header = next(line for line in text.splitlines() if line.startswith("algorithm"))
    assert "vs HSDP" in header and "vs DDP" not in header
    assert "Sharded (HSDP) tables" in text
    rows = json.loads((out / "results.json").read_text())["summary"]
    assert [r["algorithm"] for r in rows] == labels
    by = {r["algorithm"]: r for r in rows}
    assert by["native HSDP"]["speedup_vs_hsdp"] == pytest.approx(1.0)
    for r in rows:
        assert r["shards"] == 2 and r["speedup_vs_ddp"] is None
        if r["time_to_target_s"] is not None:
            assert r["speedup_vs_hsdp"] == pytest.approx(by["native HSDP"]["time_to_target_s"] / r["time_to_target_s"])
    assert any(line.strip().startswith("gpt_small on loopback, P=4: held-out loss at equal steps (4): HSDP ")
               for line in text.splitlines())
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert (out / "convergence_gpt_small.png").stat().st_size > 1000
