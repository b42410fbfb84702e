"""bagua_lite.lightning.BaguaLiteStrategy: a Lightning Trainer trains exactly as bagua_lite's plain loop.

How it runs: the 4 ranks are started once for this file by ``tests/cluster.py`` (forked, already in one
gloo group). In each rank a Trainer joins that group instead of launching processes: the strategy is
given Lightning's ``LightningEnvironment`` and ``LOCAL_RANK``/``NODE_RANK`` are set, which is how Lightning
runs under an external launcher (``_init_dist_connection`` keeps an existing group). Each task then loops
over the algorithms, one Trainer per run. One test launches 2 processes through Lightning's own launcher
(``Trainer(devices=2)`` re-running this file as a script) to check that path too.

Per algorithm, each rank trains the same model (same seed, same per-rank batches, same optimizer) with:
- the plain loop: ``DistributedModel``; ``loss.backward(); opt.step(); opt.zero_grad()``;
- Lightning, automatic optimization (``opt.step(closure)``), with a checkpoint after every epoch;
- Lightning, manual optimization (``manual_backward``, ``opt.step()``);
- Lightning with ``accumulate_grad_batches=2``, and manual optimization accumulating two micro-batches
  under ``LightningOptimizer.toggle_model(sync_grad=False)``, against the plain loop with the first
  micro-batch's backward under ``no_sync()`` and each loss halved;
- Lightning resumed with ``fit(ckpt_path=<epoch 0's checkpoint>)`` in a fresh Trainer and model (with
  dropout, so the RNG state must travel too) against the uninterrupted Lightning run;
and the final weights and optimizer state must be identical to the bit on every rank. The asynchronous
algorithm is compared during its synchronous warm-up (its averaging thread's timing makes later steps
differ run to run by design); past its warm-up it is checked to train and to stop its thread at teardown.
"""
import contextlib
import os
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("pytorch_lightning")

import bagua_lite  # noqa: E402
from bagua_lite.algorithm import build  # noqa: E402

P = 4
EPOCHS, BATCHES, BATCH = 2, 4, 8
BUCKET_MB = 0.001  # several buckets even for this small model

ALGORITHMS = {
    "gradient_allreduce": ("gradient_allreduce", {}, "sgd"),
    "fp16": ("gradient_allreduce", {"compression": "fp16"}, "sgd"),
    "topk": ("topk", {"density": 0.2}, "sgd"),
    "gtopk": ("gtopk", {"density": 0.2, "warmup_densities": [0.5], "warmup_steps_per_stage": 2}, "sgd"),
    "powersgd": ("powersgd", {"rank": 2, "min_compression_rate": 1.0}, "sgd"),
    "qadam": ("qadam", {"warmup_steps": 2}, "adam"),
    "local_sgd": ("local_sgd", {"period": 3}, "sgd"),
    "diloco": ("diloco", {"period": 3}, "sgd"),
    "decentralized": ("decentralized", {}, "sgd"),
    "low_precision_decentralized": ("low_precision_decentralized", {}, "sgd"),
    "async_warmup": ("async_model_average", {"warmup_steps": 100, "sync_interval_ms": 50}, "sgd"),
}


class Net(torch.nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                                        torch.nn.Linear(24, 24), torch.nn.ReLU())
        self.head = torch.nn.Linear(24, 5)

    def forward(self, x):
        return self.head(self.body(x))


def _optimizer(kind, net):
    if kind == "adam":
        return torch.optim.Adam(net.parameters(), lr=1e-2)
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


class LitNet(pl.LightningModule):
    def __init__(self, kind="sgd", manual=False, dropout=0.0, two_optimizers=False, manual_accumulate=1):
        super().__init__()
        self.net = Net(dropout)
        self.kind, self.two_optimizers, self.manual_accumulate = kind, two_optimizers, manual_accumulate
        self.automatic_optimization = not manual

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        if self.manual_accumulate == 1:
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return
        # accumulation by hand: the micro-batches before the last one's backward without synchronisation
        last = (batch_idx + 1) % self.manual_accumulate == 0
        with opt.toggle_model(sync_grad=last):
            self.manual_backward(loss / self.manual_accumulate)
        if last:
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        if self.two_optimizers:
            return [torch.optim.SGD(self.net.body.parameters(), lr=0.1),
                    torch.optim.SGD(self.net.head.parameters(), lr=0.1)]
        return _optimizer(self.kind, self.net)


def _batches(rank):
    """This rank's shard: BATCHES batches of BATCH samples, the same every epoch."""
    g = torch.Generator().manual_seed(rank * 7919 + 3)
    x = torch.randn(BATCHES * BATCH, 12, generator=g)
    return x, (x[:, :5] * 3).argmax(1)


def _loader(rank):
    x, y = _batches(rank)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def _state(net, opt):
    weights = [p.detach().clone() for p in net.parameters()]
    buffers = [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return weights, buffers


def _compare(a, b):
    """'identical', or the largest difference of a weight or optimizer buffer."""
    if len(a[0]) != len(b[0]) or len(a[1]) != len(b[1]):
        return "different layout"
    if all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1])):
        return "identical"
    return max(float((x - y).abs().max()) for x, y in zip(a[0] + a[1], b[0] + b[1]))


def _plain(rank, label, accumulate=1):
    name, options, kind = ALGORITHMS[label]
    net = Net()
    opt = _optimizer(kind, net)
    model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=BUCKET_MB)
    x, y = _batches(rank)
    try:
        for _ in range(EPOCHS):
            for i in range(BATCHES):
                xb, yb = x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
                last = (i + 1) % accumulate == 0
                with contextlib.nullcontext() if last else model.no_sync():
                    (F.cross_entropy(model(xb), yb) / accumulate).backward()
                if last:
                    opt.step()
                    opt.zero_grad()
    finally:
        model.close()
    return _state(net, opt)


@contextlib.contextmanager
def _joined(rank):
    """Environment under which a Trainer in this (already grouped) process joins the group: LightningEnvironment
    takes LOCAL_RANK/NODE_RANK from the environment and, seeing LOCAL_RANK, launches nothing."""
    old = {k: os.environ.get(k) for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice (dataloader workers, logging) is not under test
            yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _trainer(strategy_arg, root, ckpt_dir=None, accumulate=1, epochs=EPOCHS, **options):
    from lightning_fabric.plugins.environments import LightningEnvironment
    from bagua_lite.lightning import BaguaLiteStrategy

    strategy = BaguaLiteStrategy(strategy_arg, bucket_size_mb=BUCKET_MB, cluster_environment=LightningEnvironment(),
                                 **options)
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)] if ckpt_dir else []
    return pl.Trainer(accelerator="cpu", devices=P, strategy=strategy, max_epochs=epochs, logger=False,
                      enable_checkpointing=bool(ckpt_dir), callbacks=callbacks, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                      accumulate_grad_batches=accumulate, default_root_dir=root)


def _lightning(rank, label, root, manual=False, accumulate=1, ckpt_dir=None, ckpt_path=None, dropout=0.0,
               manual_accumulate=1):
    name, options, kind = ALGORITHMS[label]
    lit = LitNet(kind, manual=manual, dropout=dropout, manual_accumulate=manual_accumulate)
    trainer = _trainer(build(name, **options), root, ckpt_dir=ckpt_dir, accumulate=accumulate)
    torch.manual_seed(1000 + rank)  # dropout masks: per rank (a resumed run continues the checkpoint's RNG)
    trainer.fit(lit, _loader(rank), ckpt_path=ckpt_path)
    strategy = trainer.strategy
    assert strategy.distributed_model is None and strategy.model is lit, "teardown did not unwrap the module"
    return _state(lit.net, trainer.optimizers[0]), trainer


def _r_matrix(rank, world_size, labels, root):
    with _joined(rank):
        out = {}
        for label in labels:
            res = out[label] = {}
            plain = _plain(rank, label)
            auto, _ = _lightning(rank, label, root)
            res["automatic"] = _compare(auto, plain)
            manual, _ = _lightning(rank, label, root, manual=True)
            res["manual"] = _compare(manual, plain)
            plain_accumulated = _plain(rank, label, accumulate=2)
            accumulated, _ = _lightning(rank, label, root, accumulate=2)
            res["accumulate_grad_batches=2"] = _compare(accumulated, plain_accumulated)
            accumulated, _ = _lightning(rank, label, root, manual=True, manual_accumulate=2)
            res["manual, toggle_model(sync_grad=False)"] = _compare(accumulated, plain_accumulated)
            # checkpoint and resume, with dropout (the RNG state travels as well)
            ckpt_dir = os.path.join(root, label)
            straight, trainer = _lightning(rank, label, root, ckpt_dir=ckpt_dir, dropout=0.2)
            model = trainer.strategy._last_model
            res["closed"] = model._hooks == [] and model not in bagua_lite.step_hooks._LIVE
            first = os.path.join(ckpt_dir, f"epoch=0-step={BATCHES}.ckpt")
            resumed, _ = _lightning(rank, label, root, ckpt_path=first, dropout=0.2)
            res["resume"] = _compare(resumed, straight)
            if rank == 0:
                ckpt = torch.load(first, weights_only=False)
                res["keys"] = sorted(ckpt["state_dict"]) == sorted(LitNet().state_dict()) and "bagua_lite" in ckpt
                res["side_files"] = sorted(os.listdir(first + ".bagua_lite"))
    return out


EXPECTED_SIDE = [f"rank{r}.pt" for r in range(1, P)]


@pytest.fixture(scope="module")
def cluster4():
    from cluster import Cluster
    c = Cluster(P, timeout_s=120)
    yield c
    c.close()


def _check(results, labels):
    problems = []
    for label in labels:
        for r, res in enumerate(results):
            got = res[label]
            for what in ("automatic", "manual", "accumulate_grad_batches=2", "manual, toggle_model(sync_grad=False)",
                         "resume"):
                if got[what] != "identical":
                    problems.append(f"{label} rank {r} {what}: {got[what]}")
            if not got["closed"]:
                problems.append(f"{label} rank {r}: the DistributedModel was not closed at teardown")
            if r == 0 and (not got["keys"] or got["side_files"] != EXPECTED_SIDE):
                problems.append(f"{label}: checkpoint keys plain and with bagua_lite state: {got['keys']}, "
                                f"side files {got['side_files']}")
    return problems


@pytest.mark.parametrize("labels", [
    ["gradient_allreduce", "fp16", "topk", "gtopk", "powersgd", "qadam"],
    ["local_sgd", "diloco", "decentralized", "low_precision_decentralized", "async_warmup"],
], ids=["synchronous", "local_and_async_warmup"])
def test_lightning_trains_as_the_plain_loop_for_every_algorithm(cluster4, tmp_path, labels):
    t0 = time.time()
    results = cluster4.run(_r_matrix, labels, str(tmp_path), timeout=600)
    problems = _check(results, labels)
    assert not problems, "\n".join(problems)
    print(f"{len(labels)} algorithms x 6 Lightning runs on {P} ranks: {time.time() - t0:.1f} s")


def _r_async_and_refusals(rank, world_size, root):
    out = {}
    with _joined(rank):
        # asynchronous averaging past its warm-up: trains, and its thread is gone after fit
        before = {t.ident for t in threading.enumerate()}
        lit = LitNet()
        trainer = _trainer(build("async_model_average", warmup_steps=2, sync_interval_ms=20), root)
        trainer.fit(lit, _loader(rank))
        time.sleep(0.2)
        left = [t.name for t in threading.enumerate() if t.ident not in before]
        out["async"] = (all(bool(torch.isfinite(p).all()) for p in lit.parameters()), left)

        # more than one optimizer
        try:
            _trainer("gradient_allreduce", root).fit(LitNet(manual=True, two_optimizers=True), _loader(rank))
            out["two_optimizers"] = None
        except ValueError as e:
            out["two_optimizers"] = str(e)

        # a checkpoint of another algorithm, and one without bagua_lite's state
        ckpt_dir = os.path.join(root, "gtopk")
        trainer = _trainer(build("gtopk", density=0.2), root, ckpt_dir=ckpt_dir, epochs=1)
        trainer.fit(LitNet(), _loader(rank))
        path = os.path.join(ckpt_dir, f"epoch=0-step={BATCHES}.ckpt")
        # trainer.save_checkpoint after fit (the model is closed) writes the same state as the last one in fit
        after = os.path.join(root, "after_fit.ckpt")
        trainer.save_checkpoint(after)
        read = (lambda f: torch.load(f, weights_only=False)["bagua_lite"]) if rank == 0 else \
            (lambda f: torch.load(f"{f}.bagua_lite/rank{rank}.pt", weights_only=False))
        a, b = read(path)["algorithm"], read(after)["algorithm"]
        out["save_after_fit"] = a.keys() == b.keys() and a["step"] == b["step"] == BATCHES and all(
            all(torch.equal(x, y) for x, y in zip(a[k], b[k])) for k in a if k != "step")
        foreign = os.path.join(root, "foreign.ckpt")
        if rank == 0:
            ckpt = torch.load(path, weights_only=False)
            del ckpt["bagua_lite"]
            torch.save(ckpt, foreign)
        torch.distributed.barrier()
        for key, alg, ckpt_path in (("other_algorithm", build("topk", density=0.2), path),
                                    ("foreign", build("gtopk", density=0.2), foreign)):
            try:
                _trainer(alg, root).fit(LitNet(), _loader(rank), ckpt_path=ckpt_path)
                out[key] = None
            except ValueError as e:
                out[key] = str(e)
        # a config path and a shipped config's name are taken too, the file's bucket size unless given
        from bagua_lite.lightning import BaguaLiteStrategy
        cfg = os.path.join(root, "gtopk.yaml")
        if rank == 0:
            with open(cfg, "w") as f:
                f.write("algorithm: {name: gtopk, density: 0.2}\nbucket_size_mb: 0.002\n")
        torch.distributed.barrier()
        s = BaguaLiteStrategy(cfg)
        out["config"] = (s.bucket_size_mb, s._new_algorithm().options()["density"])
    return out


def test_async_past_warmup_trains_and_stops_its_thread_and_refusals(cluster4, tmp_path):
    res = cluster4.run(_r_async_and_refusals, str(tmp_path), timeout=300)
    for r, out in enumerate(res):
        finite, left = out["async"]
        assert finite and not left, (r, out["async"])
        assert out["two_optimizers"] and "2 optimizers" in out["two_optimizers"] \
            and "exactly one optimizer" in out["two_optimizers"], (r, out["two_optimizers"])
        assert out["other_algorithm"] and "does not fit" in out["other_algorithm"] \
            and "algorithm: checkpoint gtopk, now topk" in out["other_algorithm"], (r, out["other_algorithm"])
        assert out["foreign"] and "holds no bagua_lite state" in out["foreign"], (r, out["foreign"])
        assert out["config"] == (0.002, 0.2), out["config"]
        assert out["save_after_fit"], r


def test_importing_bagua_lite_does_not_import_lightning_and_a_missing_lightning_is_named():
    code = ("import sys, bagua_lite\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning', "
            "'lightning_fabric')], 'bagua_lite imported lightning'\n"
            "sys.modules['pytorch_lightning'] = None  # as if it were not installed\n"
            "try:\n"
            "    import bagua_lite.lightning\n"
            "except ImportError as e:\n"
            "    print('IMPORTERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "IMPORTERROR" in out.stdout and "pip install bagua_lite[lightning]" in out.stdout, out.stdout


# ---- Lightning's own launcher: `python tests/test_lightning.py --launch OUT` with Trainer(devices=2) ----------
def _launched(out_dir):
    """Run by Lightning's subprocess launcher on 2 ranks: fit under gtopk, then the plain loop in the group
    Lightning made; each rank writes whether they are identical."""
    from bagua_lite.lightning import BaguaLiteStrategy
    name, options, kind = ALGORITHMS["gtopk"]
    strategy = BaguaLiteStrategy(build(name, **options), bucket_size_mb=BUCKET_MB, process_group_backend="gloo")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    lit = LitNet(kind)
    rank = trainer.global_rank
    trainer.fit(lit, _loader(rank))
    result = _compare(_state(lit.net, trainer.optimizers[0]), _plain(rank, "gtopk"))
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{torch.distributed.get_world_size()} {result}")
    torch.distributed.destroy_process_group()


def test_lightnings_own_launcher(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--launch", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0, out.stderr[-3000:]
    for r in range(2):
        assert (tmp_path / f"rank{r}.txt").read_text() == "2 identical", (r, out.stderr[-2000:])


if __name__ == "__main__" and sys.argv[1:2] == ["--launch"]:
    torch.set_num_threads(1)
    _launched(sys.argv[2])
