"""bagua_lite.lightning.BaguaLiteStrategy: a Lightning Trainer trains exactly as bagua_lite's plain loop.

How it runs: the 4 ranks are started once for this file by ``tests/cluster.py`` (forked, already in one
gloo group). In each rank a Trainer joins that group instead of launching processes: the strategy is
given Lightning's ``LightningEnvironment`` and ``LOCAL_RANK``/``NODE_RANK`` are set, which is how Lightning
runs under an external launcher (``_init_dist_connection`` keeps an existing group). Each task then loops
over the algorithms, one Trainer per run. One test per package launches 2 processes through Lightning's own
launcher (``Trainer(devices=2)`` re-running this file as a script that imports only that package, as a user's
script does) to check that path too.

Both Lightning packages run every comparison: the unified ``lightning`` (``lightning.pytorch``, what
``import lightning as L`` gives) and ``pytorch_lightning``; the ranks import both, so they make the strategy
with ``strategy_class(package)``, and LightningModule, Trainer, callbacks and environment come from that package.

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
Precision plugins (bf16-mixed; fp16 with a GradScaler) are compared with the plain loop under autocast.
"""
import ast
import contextlib
import importlib
import importlib.util
import os
import pickle
import subprocess
import sys
import threading
import time
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import bagua_lite
from bagua_lite.algorithm import build

# the two Lightning packages, separate class hierarchies: {package: (its Trainer side, its fabric side)}
PACKAGES = {"lightning": ("lightning.pytorch", "lightning.fabric"),
            "pytorch_lightning": ("pytorch_lightning", "lightning_fabric")}
INSTALLED = {p: importlib.util.find_spec(p) is not None for p in PACKAGES}
if not any(INSTALLED.values()):
    pytest.skip("neither lightning nor pytorch-lightning is installed", allow_module_level=True)

from bagua_lite.lightning import BaguaLiteStrategy, strategy_class  # noqa: E402  (imports no Lightning package)


def needs(package):
    return pytest.mark.skipif(not INSTALLED[package], reason=f"{package} is not installed")


def _pl(package):
    """The package's Trainer side (``pytorch_lightning`` or ``lightning.pytorch``), imported on first use: the
    launched script imports only the package it runs under."""
    return importlib.import_module(PACKAGES[package][0])


def _environment(package):
    return importlib.import_module(PACKAGES[package][1] + ".plugins.environments").LightningEnvironment()


def _strategy(package, *args, **kwargs):
    """The strategy of ``package``: the ranks of the cluster import both packages, so BaguaLiteStrategy(...)
    would refuse to guess."""
    return strategy_class(package)(*args, **kwargs)

P = 4
EPOCHS, BATCHES, BATCH = 2, 4, 8
BUCKET_MB = 0.001  # several buckets even for this small model

ALGORITHMS = {
    "gradient_allreduce": ("gradient_allreduce", {}, "sgd"),
    "fp16": ("gradient_allreduce", {"compression": "fp16"}, "sgd"),
    "topk": ("topk", {"density": 0.2}, "sgd"),
    "gtopk": ("gtopk", {"density": 0.2, "warmup_densities": [0.5], "warmup_steps_per_stage": 2}, "sgd"),
    "gtopk_mc0": ("gtopk", {"density": 0.2, "warmup_densities": [0.5], "warmup_steps_per_stage": 2,
                            "momentum_correction": 0}, "sgd"),
    "powersgd": ("powersgd", {"rank": 2, "min_compression_rate": 1.0}, "sgd"),
    "qadam": ("qadam", {"warmup_steps": 2}, "adam"),
    # a fused optimizer: Lightning's fp16 precision leaves unscaling to it (the scaler hands over its scale)
    "gtopk_fused": ("gtopk", {"density": 0.2}, "sgd_fused"),
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
    fused = kind.endswith("_fused")
    if kind.startswith("adam"):
        return torch.optim.Adam(net.parameters(), lr=1e-2, fused=fused)
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01, fused=fused)


class _LitBody:
    """The LightningModule's methods; :func:`lit_net` puts them on a package's ``LightningModule``."""

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


_LIT_CLASSES = {}


def lit_net(package, *args, **kwargs):
    """LitNet of ``package`` (a ``pytorch_lightning`` or a ``lightning.pytorch`` LightningModule)."""
    if package not in _LIT_CLASSES:
        _LIT_CLASSES[package] = types.new_class("LitNet", (_LitBody, _pl(package).LightningModule))
    return _LIT_CLASSES[package](*args, **kwargs)


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


def _plain(rank, label, accumulate=1, autocast=None, scaler=None):
    """The plain loop; ``autocast``: the forward and loss under ``torch.autocast("cpu", dtype=autocast)``;
    ``scaler``: a GradScaler, the model's ``grad_scaler`` (scaled backward, ``scaler.step``, ``update``)."""
    name, options, kind = ALGORITHMS[label]
    net = Net()
    opt = _optimizer(kind, net)
    model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=BUCKET_MB,
                                        grad_scaler=scaler)
    x, y = _batches(rank)
    try:
        for _ in range(EPOCHS):
            for i in range(BATCHES):
                xb, yb = x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
                last = (i + 1) % accumulate == 0
                with contextlib.nullcontext() if last else model.no_sync():
                    with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
                        loss = F.cross_entropy(model(xb), yb) / accumulate
                    (scaler.scale(loss) if scaler else loss).backward()
                if last:
                    if scaler:
                        scaler.step(opt)
                        scaler.update()
                    else:
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


def _trainer(package, strategy_arg, root, ckpt_dir=None, accumulate=1, epochs=EPOCHS, precision="32-true",
             **options):
    pl = _pl(package)
    strategy = _strategy(package, strategy_arg, bucket_size_mb=BUCKET_MB, cluster_environment=_environment(package),
                         **options)
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)] if ckpt_dir else []
    return pl.Trainer(accelerator="cpu", devices=P, strategy=strategy, max_epochs=epochs, logger=False,
                      enable_checkpointing=bool(ckpt_dir), callbacks=callbacks, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                      accumulate_grad_batches=accumulate, default_root_dir=root, precision=precision)


def _lightning(package, rank, label, root, manual=False, accumulate=1, ckpt_dir=None, ckpt_path=None, dropout=0.0,
               manual_accumulate=1, **trainer_options):
    name, options, kind = ALGORITHMS[label]
    lit = lit_net(package, kind, manual=manual, dropout=dropout, manual_accumulate=manual_accumulate)
    trainer = _trainer(package, build(name, **options), root, ckpt_dir=ckpt_dir, accumulate=accumulate,
                       **trainer_options)
    torch.manual_seed(1000 + rank)  # dropout masks: per rank (a resumed run continues the checkpoint's RNG)
    trainer.fit(lit, _loader(rank), ckpt_path=ckpt_path)
    strategy = trainer.strategy
    assert strategy.distributed_model is None and strategy.model is lit, "teardown did not unwrap the module"
    return _state(lit.net, trainer.optimizers[0]), trainer


def _r_matrix(rank, world_size, labels, root, package):
    with _joined(rank):
        out = {}
        for label in labels:
            res = out[label] = {}
            plain = _plain(rank, label)
            auto, trainer = _lightning(package, rank, label, root)
            res["automatic"] = _compare(auto, plain)
            res["package"] = isinstance(trainer.strategy, _pl(package).strategies.DDPStrategy) \
                and isinstance(trainer.strategy, BaguaLiteStrategy)
            manual, _ = _lightning(package, rank, label, root, manual=True)
            res["manual"] = _compare(manual, plain)
            plain_accumulated = _plain(rank, label, accumulate=2)
            accumulated, _ = _lightning(package, rank, label, root, accumulate=2)
            res["accumulate_grad_batches=2"] = _compare(accumulated, plain_accumulated)
            accumulated, _ = _lightning(package, rank, label, root, manual=True, manual_accumulate=2)
            res["manual, toggle_model(sync_grad=False)"] = _compare(accumulated, plain_accumulated)
            # checkpoint and resume, with dropout (the RNG state travels as well)
            ckpt_dir = os.path.join(root, label)
            straight, trainer = _lightning(package, rank, label, root, ckpt_dir=ckpt_dir, dropout=0.2)
            model = trainer.strategy._last_model
            res["closed"] = model._hooks == [] and model not in bagua_lite.step_hooks._LIVE
            first = os.path.join(ckpt_dir, f"epoch=0-step={BATCHES}.ckpt")
            resumed, _ = _lightning(package, rank, label, root, ckpt_path=first, dropout=0.2)
            res["resume"] = _compare(resumed, straight)
            if rank == 0:
                ckpt = torch.load(first, weights_only=False)
                res["keys"] = sorted(ckpt["state_dict"]) == sorted(lit_net(package).state_dict()) \
                    and "bagua_lite" in ckpt
                res["side_files"] = sorted(os.listdir(first + ".bagua_lite"))
    return out


EXPECTED_SIDE = [f"rank{r}.pt" for r in range(1, P)]


@pytest.fixture(scope="module")
def cluster4():
    from cluster import Cluster
    c = Cluster(P, timeout_s=120)
    yield c
    c.close()


def _check(results, labels, package):
    problems = []
    for label in labels:
        for r, res in enumerate(results):
            got = res[label]
            if not got["package"]:
                problems.append(f"{label} rank {r}: the strategy is not both a BaguaLiteStrategy and {package}'s "
                                f"DDPStrategy")
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


@pytest.mark.parametrize("package", [pytest.param(p, marks=needs(p)) for p in PACKAGES])
@pytest.mark.parametrize("labels", [
    ["gradient_allreduce", "fp16", "topk", "gtopk", "powersgd", "qadam"],
    ["local_sgd", "diloco", "decentralized", "low_precision_decentralized", "async_warmup"],
], ids=["synchronous", "local_and_async_warmup"])
def test_lightning_trains_as_the_plain_loop_for_every_algorithm(cluster4, tmp_path, labels, package):
    """Through either package: its Trainer, LightningModule, ModelCheckpoint and LightningEnvironment, and
    ``strategy_class(package)``."""
    t0 = time.time()
    results = cluster4.run(_r_matrix, labels, str(tmp_path), package, timeout=600)
    problems = _check(results, labels, package)
    assert not problems, "\n".join(problems)
    print(f"{package}: {len(labels)} algorithms x 6 Lightning runs on {P} ranks: {time.time() - t0:.1f} s")


def _r_async_and_refusals(rank, world_size, root):
    out = {}
    with _joined(rank):
        # asynchronous averaging past its warm-up: trains, and its thread is gone after fit
        before = {t.ident for t in threading.enumerate()}
        pl = "pytorch_lightning"
        lit = lit_net(pl)
        trainer = _trainer(pl, build("async_model_average", warmup_steps=2, sync_interval_ms=20), root)
        trainer.fit(lit, _loader(rank))
        time.sleep(0.2)
        left = [t.name for t in threading.enumerate() if t.ident not in before]
        out["async"] = (all(bool(torch.isfinite(p).all()) for p in lit.parameters()), left)

        # more than one optimizer
        try:
            _trainer(pl, "gradient_allreduce", root).fit(lit_net(pl, manual=True, two_optimizers=True), _loader(rank))
            out["two_optimizers"] = None
        except ValueError as e:
            out["two_optimizers"] = str(e)

        # a checkpoint of another algorithm, and one without bagua_lite's state
        ckpt_dir = os.path.join(root, "gtopk")
        trainer = _trainer(pl, build("gtopk", density=0.2), root, ckpt_dir=ckpt_dir, epochs=1)
        trainer.fit(lit_net(pl), _loader(rank))
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
                _trainer(pl, alg, root).fit(lit_net(pl), _loader(rank), ckpt_path=ckpt_path)
                out[key] = None
            except ValueError as e:
                out[key] = str(e)
        # a config path and a shipped config's name are taken too, the file's bucket size unless given
        cfg = os.path.join(root, "gtopk.yaml")
        if rank == 0:
            with open(cfg, "w") as f:
                f.write("algorithm: {name: gtopk, density: 0.2}\nbucket_size_mb: 0.002\n")
        torch.distributed.barrier()
        s = _strategy(pl, cfg)
        out["config"] = (s.bucket_size_mb, s._new_algorithm().options()["density"])
    return out


@needs("pytorch_lightning")
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


PRECISION_LABELS = ["gradient_allreduce", "gtopk", "gtopk_mc0", "gtopk_fused"]
INIT_SCALE = 2.0 ** 21


def _r_precision(rank, world_size, root, package):
    """bf16-mixed through the Trainer flag; fp16 with a GradScaler through the strategy's precision plugin."""
    mixed_precision = importlib.import_module(PACKAGES[package][0] + ".plugins.precision").MixedPrecision
    out = {}
    with _joined(rank):
        for label in PRECISION_LABELS:
            bf16, trainer = _lightning(package, rank, label, root, precision="bf16-mixed")
            plugin = trainer.strategy.precision_plugin
            out[f"bf16-mixed {label}"] = _compare(bf16, _plain(rank, label, autocast=torch.bfloat16))
            out[f"bf16-mixed {label}: plugin, and not fp32"] = (
                type(plugin) is mixed_precision and plugin.precision == "bf16-mixed" and plugin.scaler is None
                and _compare(bf16, _plain(rank, label)) != "identical")

            # a first scale that overflows fp16: the first steps are skipped on every rank, then the scale halves
            scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
            plugin = mixed_precision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))
            fp16, trainer = _lightning(package, rank, label, root, precision_plugin=plugin)
            out[f"16-mixed {label}"] = _compare(fp16, _plain(rank, label, autocast=torch.float16, scaler=scaler))
            strategy = trainer.strategy
            out[f"16-mixed {label}: the model's scaler, same scale, not fp32"] = (
                strategy.precision_plugin is plugin and strategy._last_model.grad_scaler is plugin.scaler
                and plugin.scaler.get_scale() == scaler.get_scale()
                and _compare(fp16, _plain(rank, label)) != "identical")
            out[f"16-mixed {label}: scale"] = scaler.get_scale()

        # checkpoint and resume under fp16: the scaler's state travels with Lightning's checkpoint
        ckpt_dir, scalers = os.path.join(root, "fp16"), [torch.amp.GradScaler("cpu", init_scale=INIT_SCALE / 4)
                                                         for _ in range(2)]
        straight, _ = _lightning(package, rank, "gtopk", root, ckpt_dir=ckpt_dir, dropout=0.2,
                                 precision_plugin=mixed_precision("16-mixed", "cpu", scaler=scalers[0]))
        first = os.path.join(ckpt_dir, f"epoch=0-step={BATCHES}.ckpt")
        resumed, _ = _lightning(package, rank, "gtopk", root, ckpt_path=first, dropout=0.2,
                                precision_plugin=mixed_precision("16-mixed", "cpu", scaler=scalers[1]))
        out["16-mixed resume"] = _compare(resumed, straight)
        out["16-mixed resume: same scale"] = scalers[0].get_scale() == scalers[1].get_scale()

        # the Trainer flag precision="16-mixed" on CPU: Lightning trains in bf16-mixed instead (with a warning)
        trainer = _trainer(package, "gradient_allreduce", root, precision="16-mixed")
        out["16-mixed flag on cpu"] = trainer.strategy.precision_plugin.precision
    return out


@pytest.mark.parametrize("package", [pytest.param(p, marks=needs(p)) for p in PACKAGES])
def test_precision_plugins_train_as_the_plain_loop_under_autocast(cluster4, tmp_path, package):
    """``precision="bf16-mixed"`` on CPU: bit for bit as the plain loop with its forward and loss under
    ``torch.autocast("cpu", dtype=torch.bfloat16)`` (and not as the fp32 loop). fp16 on CPU: Lightning turns the
    Trainer's ``precision="16-mixed"`` into bf16-mixed, but a ``MixedPrecision("16-mixed", "cpu", scaler=
    GradScaler("cpu"))`` given to the strategy trains with fp16 autocast and its scaler, which the strategy makes
    the DistributedModel's ``grad_scaler``: bit for bit as the plain loop with ``grad_scaler=scaler``,
    ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``, and resumed from a checkpoint. The
    first scale overflows fp16, so the first steps are skipped (on every rank) before the scale settles.
    gtopk with its default momentum correction and with ``momentum_correction: 0``."""
    res = cluster4.run(_r_precision, str(tmp_path), package, timeout=600)
    for r, out in enumerate(res):
        for key, value in out.items():
            if key == "16-mixed flag on cpu":
                assert value == "bf16-mixed", (r, value)
            elif key.endswith(": scale"):  # some steps skipped (on every rank), not all
                assert INIT_SCALE / 2 ** (EPOCHS * BATCHES) < value < INIT_SCALE, (r, key, value)
                assert value == res[0][key], (r, key, value)
            elif key.startswith(("bf16", "16")) and ":" in key:
                assert value is True, (r, key)
            else:
                assert value == "identical", (r, key, value)
    print({k: v for k, v in res[0].items() if k.endswith(": scale")})


def _python(code):
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc):
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return out


LIGHTNING_MODULES = ("[m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning', "
                     "'lightning_fabric')]")


def test_importing_bagua_lite_does_not_import_lightning_and_a_missing_lightning_is_named():
    """Neither importing bagua_lite nor bagua_lite.lightning imports a Lightning package (the strategy's package
    is the one the user's script imports); with neither installed, the ImportError says what to install."""
    code = ("import sys, bagua_lite\n"
            f"assert not {LIGHTNING_MODULES}, 'bagua_lite imported lightning'\n"
            "import bagua_lite.lightning\n"
            f"assert not {LIGHTNING_MODULES}, 'bagua_lite.lightning imported lightning'\n"
            "del sys.modules['bagua_lite.lightning']\n"
            "sys.modules['pytorch_lightning'] = sys.modules['lightning'] = None  # as if neither were installed\n"
            "try:\n"
            "    import bagua_lite.lightning\n"
            "except ImportError as e:\n"
            "    print('IMPORTERROR', e)\n")
    out = _finish(_python(code))
    assert "IMPORTERROR" in out and "pip install bagua_lite[lightning]" in out and "pip install lightning" in out \
        and "pip install pytorch-lightning" in out, out


class Mine(BaguaLiteStrategy):
    """A user's subclass: bound to the user's package as BaguaLiteStrategy is."""


def _choose():
    """What a script does after its imports: make the strategy (and a subclass's) and a Trainer with it."""
    try:
        s, mine = BaguaLiteStrategy("gtopk", bucket_size_mb=2), Mine("topk")
    except ValueError as e:
        return {"error": str(e)}
    package = s._lib.package
    trainer = _pl(package).Trainer(strategy=s, accelerator="cpu", devices=1, logger=False)
    ddp = _pl(package).strategies.DDPStrategy
    copy, mine_copy = pickle.loads(pickle.dumps(s)), pickle.loads(pickle.dumps(mine))
    return {"package": package, "imported": [p for p in PACKAGES if sys.modules.get(PACKAGES[p][0]) is not None],
            "checks": [trainer.strategy is s, isinstance(s, BaguaLiteStrategy), isinstance(s, ddp),
                       type(s) is strategy_class(package), isinstance(mine, Mine) and isinstance(mine, ddp),
                       type(copy) is type(s) and copy.bucket_size_mb == 2.0,
                       type(mine_copy) is type(mine) and mine_copy.bucket_size_mb == 25.0]}


@needs("lightning")
@needs("pytorch_lightning")
def test_the_strategy_is_of_the_package_the_script_imported(monkeypatch):
    """``BaguaLiteStrategy(...)`` (and a subclass's) is a strategy of the Lightning package imported (neither
    yet: ``lightning``), accepted by that package's Trainer, an instance of BaguaLiteStrategy and of the
    package's DDPStrategy, picklable; with both imported, a ValueError says how to choose. (The launcher test
    runs real scripts importing one package.)"""
    fresh = subprocess.run([sys.executable, os.path.abspath(__file__), "--choose"], capture_output=True, text=True,
                           timeout=120, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    got = ast.literal_eval(fresh.stdout.strip().splitlines()[-1])
    assert got == {"package": "lightning", "imported": ["lightning"], "checks": [True] * 7}, got

    _pl("lightning"), _pl("pytorch_lightning")  # both imported in this process
    error = _choose()["error"]
    assert 'strategy_class("lightning")(...)' in error and 'strategy_class("pytorch_lightning")(...)' in error, error
    for package in PACKAGES:
        other = next(p for p in PACKAGES if p != package)
        with monkeypatch.context() as m:
            m.setitem(sys.modules, PACKAGES[other][0], None)  # as if this script had not imported it
            got = _choose()
        assert got == {"package": package, "imported": [package], "checks": [True] * 7}, (package, got)
    with pytest.raises(ValueError, match="package must be one of"):
        strategy_class("lightning.pytorch")
    # algorithm= takes what DistributedModel takes, checked on the Trainer's line
    cls = strategy_class("lightning")
    with pytest.raises(ValueError, match=r"BaguaLiteStrategy: unknown algorithm 'gtopkk'; known algorithms: .*gtopk"):
        cls("gtopkk")
    assert cls("bytegrad").bucket_size_mb == bagua_lite.load_config("bytegrad").bucket_size_mb
    assert cls("bytegrad", bucket_size_mb=3).bucket_size_mb == 3.0 and cls("gtopk").bucket_size_mb == 25.0


# ---- Lightning's own launcher: `python tests/test_lightning.py --launch OUT PACKAGE`, Trainer(devices=2) --------
def _launched(out_dir, package):
    """Run by Lightning's subprocess launcher on 2 ranks, as a user's script: ``import lightning as L`` (or
    ``import pytorch_lightning as pl``) and ``BaguaLiteStrategy(...)``; fit under gtopk, then the plain loop in
    the group Lightning made; each rank writes whether they are identical."""
    if package == "lightning":
        import lightning as L  # the script's one Lightning package, as a user's script imports it
        trainer_class = L.Trainer
    else:
        import pytorch_lightning as pl  # the script's one Lightning package, as a user's script imports it
        trainer_class = pl.Trainer
    name, options, kind = ALGORITHMS["gtopk"]
    strategy = BaguaLiteStrategy(build(name, **options), bucket_size_mb=BUCKET_MB, process_group_backend="gloo")
    trainer = trainer_class(accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False)
    lit = lit_net(package, kind)
    rank = trainer.global_rank
    trainer.fit(lit, _loader(rank))
    result = _compare(_state(lit.net, trainer.optimizers[0]), _plain(rank, "gtopk"))
    only = [p for p in PACKAGES if p in sys.modules] == [package]
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{torch.distributed.get_world_size()} {result} {isinstance(trainer.strategy, BaguaLiteStrategy)} "
                f"{only}")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("package", [pytest.param(p, marks=needs(p)) for p in PACKAGES])
def test_lightnings_own_launcher(tmp_path, package):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--launch", str(tmp_path), package], env=env,
                         capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0, out.stderr[-3000:]
    for r in range(2):
        assert (tmp_path / f"rank{r}.txt").read_text() == "2 identical True True", (r, out.stderr[-2000:])


if __name__ == "__main__" and sys.argv[1:2] == ["--launch"]:
    torch.set_num_threads(1)
    _launched(sys.argv[2], sys.argv[3])
if __name__ == "__main__" and sys.argv[1:2] == ["--choose"]:
    print(repr(_choose()))
