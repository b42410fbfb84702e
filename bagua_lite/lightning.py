"""Lightning strategy: a Lightning ``Trainer`` trains through a bagua_lite :class:`DistributedModel`.

Install the extra (``pip install bagua_lite[lightning]``, i.e. the ``lightning>=2.1`` package; the older
``pytorch-lightning`` package works as well) and pass the strategy to the Trainer; the LightningModule stays
as it is::

    import lightning as L, torch, torch.nn.functional as F   # or: import pytorch_lightning as L
    from bagua_lite.lightning import BaguaLiteStrategy

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    torch.manual_seed(0)                 # the same data set in every process; Lightning's sampler shards it
    x = torch.randn(512, 20)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].argmax(1)), batch_size=32)
    trainer = L.Trainer(accelerator="cpu", devices=4, max_epochs=2,
                        strategy=BaguaLiteStrategy(algorithm="gtopk", bucket_size_mb=25))
    trainer.fit(Classifier(), data)      # Lightning launches the 4 processes (or run it under torchrun)

Lightning comes as two packages, ``lightning`` (``lightning.pytorch``, ``lightning.fabric``) and
``pytorch_lightning`` (with ``lightning_fabric``), whose classes do not mix: a Trainer takes only its own
package's strategies. ``BaguaLiteStrategy(...)`` is made for the package the script imported (neither yet:
the installed one, ``lightning`` first), a subclass of that package's ``DDPStrategy``, and
``isinstance(trainer.strategy, BaguaLiteStrategy)`` holds for both; a subclass of BaguaLiteStrategy is made
the same way. A process that imported both says which: ``strategy_class("lightning")(...)`` or
``strategy_class("pytorch_lightning")(...)`` (``BaguaLiteStrategy(...)`` refuses to guess).

``algorithm`` is a registered name (``"gtopk"``), a YAML config (a path, or a shipped config's name such
as ``"bytegrad"``: its ``bucket_size_mb`` is used unless you pass one) or an :class:`~bagua_lite.Algorithm`
instance. What happens, against a Lightning DDP run:

- The process group is set up as Lightning's DDP strategy sets it up (this class is a ``DDPStrategy``:
  its launchers, ``torchrun``/SLURM environments, gloo on CPU and NCCL on GPU, samplers, ``barrier``,
  ``reduce``). A group that already exists is joined, and must have Lightning's world size and rank.
- After Lightning made the optimizer, the LightningModule is wrapped in
  ``DistributedModel(module, optimizer, algorithm, bucket_size_mb)``. Exactly one optimizer is supported
  (several param groups are fine): a second optimizer over the module's parameters would step gradients
  no algorithm saw, so it is refused when the Trainer sets up.
- Automatic optimization (``optimizer.step(closure)``), manual optimization (``manual_backward``,
  ``opt.step()``) and ``accumulate_grad_batches`` (the accumulating micro-batches run under
  ``DistributedModel.no_sync()``, through :meth:`block_backward_sync`; so does
  ``LightningOptimizer.toggle_model(sync_grad=False)``) train exactly as bagua_lite's plain loop:
  ``tests/test_lightning.py`` compares final weights and optimizer state bit for bit for every built-in
  algorithm at 4 processes, through either package. Gradient clipping and LR schedulers act where they act
  in a plain loop (clipping between backward and step); clipping a ``.grad`` that holds more than a gradient
  (topk/gtopk momentum correction, qadam) is refused by the DistributedModel, as without Lightning.
- Precision plugins: ``precision="bf16-mixed"`` runs the training step under ``torch.autocast``: as the
  plain loop with its forward and loss under ``torch.autocast(device, dtype=torch.bfloat16)``. ``"16-mixed"``:
  the plugin's GradScaler becomes the DistributedModel's ``grad_scaler``: as the plain loop with
  ``DistributedModel(..., grad_scaler=scaler)``, ``scaler.scale(loss).backward()``, ``scaler.step(opt)``,
  ``scaler.update()`` (an overflow skips the step on every rank; the scaler's state is in the checkpoint).
  Both are compared bit for bit on CPU by the tests. On CPU, Lightning turns ``Trainer(precision="16-mixed")``
  into bf16-mixed (with a warning); for fp16 there, give the strategy ``precision_plugin=MixedPrecision(
  "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))`` (``MixedPrecision`` from ``lightning.pytorch.plugins``).
- Checkpoints: the Lightning checkpoint (written by rank 0, keys of the LightningModule's own
  ``state_dict``, no ``module.`` prefix) also carries rank 0's algorithm state (residuals, momenta, copies,
  step count) and RNG state under ``"bagua_lite"``; every other rank r writes its own weights, optimizer
  state, algorithm state and RNG state to ``<checkpoint>.bagua_lite/rank<r>.pt`` beside it (relaxations
  such as decentralized or local SGD keep replicas that differ). ``trainer.fit(ckpt_path=...)`` loads each
  rank's own state and resumes bit for bit. The directory must be visible to every rank (a shared file
  system, or each node's ranks' files at the same path). A checkpoint without bagua_lite's state, or one
  written with another world size, algorithm, options or bucket layout, is refused on every rank (an
  algorithm without per-rank tensors, such as plain gradient averaging, may change world size).
- ``teardown`` closes the DistributedModel (algorithm threads stopped) and unwraps the module.

Not supported, refused with an error naming it: more than one optimizer; an existing process group whose
size or rank differs from the Trainer's; resuming from a checkpoint written without this strategy.
Under manual optimization the algorithm's ``before_forward`` runs once per ``training_step`` (the step is
the wrapped forward), as for a plain loop with one forward per step.
"""
import importlib
import importlib.util
import os
import sys
import threading
import types
import warnings
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout  # Lightning's DDPStrategy default, from torch

from . import checkpoint as _ckpt
from .algorithm import Algorithm
from .config import algorithm_from
from .distributed import DistributedModel

__all__ = ["BaguaLiteStrategy", "strategy_class"]

# each Lightning package: (its trainer side, its fabric side); two class hierarchies that do not mix
PACKAGES = {"lightning": ("lightning.pytorch", "lightning.fabric"),
            "pytorch_lightning": ("pytorch_lightning", "lightning_fabric")}
if not any(importlib.util.find_spec(p) is not None for p in PACKAGES):
    raise ImportError("bagua_lite.lightning needs Lightning (>= 2.1): pip install bagua_lite[lightning]  "
                      "(or: pip install lightning, or pip install pytorch-lightning)")

SIDE_SUFFIX = ".bagua_lite"  # <checkpoint>.bagua_lite/rank<r>.pt holds rank r's own state (r >= 1)


def _side_dir(filepath) -> str:
    path = os.fspath(filepath)
    if "://" not in path:
        path = os.path.realpath(path)  # last.ckpt may be a link to the real checkpoint
    return path + SIDE_SUFFIX


def _side_file(filepath, rank: int) -> str:
    return os.path.join(_side_dir(filepath), f"rank{rank}.pt")


def _library(package: str) -> types.SimpleNamespace:
    """What the strategy takes from one Lightning package."""
    trainer_side, fabric_side = PACKAGES[package]
    mod = importlib.import_module  # imported here: the package is the user's, known when a strategy is made
    strategy = mod(f"{trainer_side}.strategies.strategy")
    return types.SimpleNamespace(
        package=package, DDPStrategy=mod(f"{trainer_side}.strategies").DDPStrategy, Strategy=strategy.Strategy,
        ForwardRedirection=strategy._ForwardRedirection, TrainerFn=mod(f"{trainer_side}.trainer.states").TrainerFn,
        sync_module_states=mod(f"{trainer_side}.overrides.distributed")._sync_module_states,
        optimizers_to_device=mod(f"{fabric_side}.utilities.optimizer")._optimizers_to_device)


_BOUND, _BOUND_LOCK = {}, threading.Lock()


def _bind(cls, package: str) -> type:
    """``cls`` (BaguaLiteStrategy or a subclass of it) over ``package``'s DDPStrategy; one class per pair."""
    with _BOUND_LOCK:
        if (cls, package) not in _BOUND:
            lib = _library(package)
            attrs = dict(_lib=lib, _origin=(cls, package), __module__=cls.__module__, __doc__=cls.__doc__,
                         __qualname__=f"{cls.__qualname__}[{package}]")  # its repr names the package
            _BOUND[cls, package] = types.new_class(cls.__name__, (cls, lib.DDPStrategy),
                                                   exec_body=lambda ns: ns.update(attrs))
        return _BOUND[cls, package]


def _restore(cls, package: str):
    """Unpickling a strategy of a class made by :func:`_bind` (its state follows)."""
    return object.__new__(_bind(cls, package))


def _user_package() -> str:
    """The Lightning package a ``BaguaLiteStrategy(...)`` is made for: the one this process imported, else the
    installed one (``lightning`` first). Both imported: ambiguous, so refused."""
    imported = [p for p, (trainer_side, _) in PACKAGES.items() if sys.modules.get(trainer_side) is not None]
    if len(imported) > 1:
        raise ValueError(
            "BaguaLiteStrategy: this process imported both Lightning packages (lightning.pytorch and "
            "pytorch_lightning), whose Trainers accept only their own strategies; say which one the Trainer is "
            "from: bagua_lite.lightning.strategy_class(\"lightning\")(...) for lightning.Trainer / "
            "lightning.pytorch.Trainer, or strategy_class(\"pytorch_lightning\")(...) for pytorch_lightning.Trainer")
    return imported[0] if imported else next(p for p in PACKAGES if importlib.util.find_spec(p) is not None)


def strategy_class(package: str = "lightning") -> type:
    """The :class:`BaguaLiteStrategy` class of one Lightning package: ``"lightning"`` (a subclass of
    ``lightning.pytorch.strategies.DDPStrategy``) or ``"pytorch_lightning"`` (of
    ``pytorch_lightning.strategies.DDPStrategy``). The same class on every call; a subclass of BaguaLiteStrategy."""
    if package not in PACKAGES:
        raise ValueError(f"strategy_class: package must be one of {sorted(PACKAGES)}, got {package!r}")
    return _bind(BaguaLiteStrategy, package)


class BaguaLiteStrategy:
    """Train with a bagua_lite relaxation under a Lightning ``Trainer`` (see the module docstring). An instance
    is one of ``strategy_class(package)`` for the Lightning package this process imported.

    Args:
        algorithm: a registered name (``"gtopk"``), a YAML config (path or shipped name) or an
            :class:`~bagua_lite.Algorithm` instance (used by the first ``fit``; a later ``fit`` with the same
            strategy gets a new instance with the same options).
        bucket_size_mb: gradient bucket cap (default: the config's, else 25).
        broadcast_buffers: rank 0's buffers before every training forward, as DDP (default True).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``.

    Example::

        trainer = L.Trainer(accelerator="cpu", devices=4, accumulate_grad_batches=2,
                            strategy=BaguaLiteStrategy("streaming_diloco"))  # a shipped config, by name
        trainer.fit(model, loader)
        trainer.fit(model, loader, ckpt_path="lightning_logs/version_0/checkpoints/last.ckpt")  # resumes
    """

    strategy_name = "bagua_lite"
    _lib: Optional[types.SimpleNamespace] = None  # the Lightning package's names, set on the bound classes

    def __new__(cls, *args, **kwargs):
        if cls._lib is None:  # BaguaLiteStrategy or a subclass of it: over the DDPStrategy of the user's package
            cls = _bind(cls, _user_package())
        return object.__new__(cls)

    def __reduce_ex__(self, protocol):
        origin = type(self).__dict__.get("_origin")
        if origin is None:  # a class bound in the user's own source: pickled by name, as usual
            return super().__reduce_ex__(protocol)
        return _restore, origin, self.__getstate__()  # Lightning's __getstate__, then its __setstate__

    def __init__(self, algorithm: Union[str, os.PathLike, Algorithm] = "gradient_allreduce",
                 bucket_size_mb: Optional[float] = None, broadcast_buffers: bool = True,
                 accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin=None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, start_method: str = "popen"):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        # validated here, on the Trainer's line, before any process starts; used by the first fit
        self._first, config_bucket = algorithm_from(algorithm, "BaguaLiteStrategy")
        self._algorithm_arg = algorithm
        self.bucket_size_mb = float(bucket_size_mb if bucket_size_mb is not None else
                                    config_bucket if config_bucket is not None else 25.0)
        self.broadcast_buffers = bool(broadcast_buffers)
        self._distributed_model: Optional[DistributedModel] = None
        self._last_model: Optional[DistributedModel] = None  # closed at teardown; still checkpointable
        self._pending_state = None  # this rank's bagua_lite state read by load_checkpoint, applied after the optimizer
        # DistributedModel is a DDP in type only: DDPStrategy's redirection and backward hooks would reach for DDP's
        # reducer flags, which it does not have (no_sync is the one switch, and block_backward_sync uses it)
        self._forward_redirection = self._lib.ForwardRedirection()

    # ---- set-up ------------------------------------------------------------------------------------------
    @property
    def distributed_model(self) -> Optional[DistributedModel]:
        """The :class:`~bagua_lite.DistributedModel` wrapping the LightningModule while fitting, else None."""
        return self._distributed_model

    def _new_algorithm(self) -> Algorithm:
        first, self._first = self._first, None
        if first is not None:
            return first
        arg = self._algorithm_arg  # a later fit: a fresh instance with the same options
        return type(arg)(**arg.options()) if isinstance(arg, Algorithm) else algorithm_from(arg, "BaguaLiteStrategy")[0]

    def setup_distributed(self) -> None:
        super().setup_distributed()  # joins an existing default group instead of making one
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.global_rank:
            raise RuntimeError(
                f"BaguaLiteStrategy: the existing process group has world size {dist.get_world_size()} and this "
                f"process is its rank {dist.get_rank()}, but the Trainer expects world size {self.world_size} and "
                f"rank {self.global_rank} (devices x num_nodes, and LOCAL_RANK/NODE_RANK); make them agree")

    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == self._lib.TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            # the optimizer first: DistributedModel takes it (some relaxations act around its step)
            self.setup_optimizers(trainer)
            self._wrap()
        else:
            self._lib.sync_module_states(self.model)  # evaluation only: every rank runs rank 0's weights, as DDP
        self.setup_precision_plugin()
        if fitting:
            self._lib.optimizers_to_device(self.optimizers, self.root_device)

    def _wrap(self) -> None:
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        if len(optimizers) != 1:
            raise ValueError(
                f"BaguaLiteStrategy: configure_optimizers returned {len(optimizers)} optimizers; a bagua_lite "
                f"DistributedModel takes exactly one optimizer for all of the module's parameters (its step "
                f"accounting and the algorithm's hooks ride on it). Use one optimizer with several param groups")
        self._last_model = None
        self._distributed_model = DistributedModel(
            self.model, optimizers[0], algorithm=self._new_algorithm(), bucket_size_mb=self.bucket_size_mb,
            broadcast_buffers=self.broadcast_buffers,
            grad_scaler=getattr(self.precision_plugin, "scaler", None))  # "16-mixed": the plugin's GradScaler
        self.model = self._distributed_model

    # ---- the loop ----------------------------------------------------------------------------------------
    @contextmanager
    def block_backward_sync(self):
        """Lightning's accumulating micro-batches (and ``toggle_model(sync_grad=False)``): forward and
        backward under ``DistributedModel.no_sync()``, so gradients accumulate locally until the last one."""
        if self._distributed_model is not None:
            with self._distributed_model.no_sync():
                yield None
        else:
            yield None

    def pre_backward(self, closure_loss) -> None:
        self._lib.Strategy.pre_backward(self, closure_loss)  # not DDPStrategy's: there is no DDP reducer to prepare

    def post_backward(self, closure_loss) -> None:
        self._lib.Strategy.post_backward(self, closure_loss)

    # ---- checkpoints -------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # weights go in after wrapping, so that each rank's own replica replaces what set-up broadcast
        return True

    def _rank_state(self, model: DistributedModel, checkpoint: dict) -> dict:
        state = {"format": _ckpt.FORMAT, "rank": model.rank, "meta": _ckpt.model_meta(model),
                 "algorithm": model.algorithm_state_dict(), "rng": torch.get_rng_state()}
        if self.root_device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.root_device)
        if model.rank != 0:  # rank 0's weights and optimizer state are the Lightning checkpoint's own
            state["state_dict"] = checkpoint["state_dict"]
            state["optimizer_states"] = checkpoint["optimizer_states"]
        return state

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Optional[Any] = None) -> None:
        """Collective (every rank calls it, as ``Trainer.save_checkpoint`` requires): rank 0 writes the
        Lightning checkpoint with its bagua_lite state, every other rank its own state beside it."""
        model = self._distributed_model or self._last_model
        if model is None or "optimizer_states" not in checkpoint:  # not fitted, or weights only
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        error = None
        try:
            mine = self._rank_state(model, checkpoint)
            if model.rank == 0:
                super().save_checkpoint(dict(checkpoint, bagua_lite=mine), filepath, storage_options=storage_options)
            else:
                self.checkpoint_io.save_checkpoint(mine, _side_file(filepath, model.rank),
                                                   storage_options=storage_options)
        except Exception as e:  # noqa: BLE001  (reported on every rank below)
            error = e
        failed = _ckpt.failed_ranks(model, error)
        if failed:
            raise RuntimeError(f"BaguaLiteStrategy.save_checkpoint({os.fspath(filepath)!r}): failed on rank(s) "
                               f"{failed}" + (f"; here: {type(error).__name__}: {error}" if error else "")) from error

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            path = os.fspath(filepath)
            # a link (ModelCheckpoint's last.ckpt) leaves its target's side files alone
            side = None if "://" not in path and os.path.islink(path) else _side_dir(path)
            super().remove_checkpoint(filepath)
            if side is not None:
                self.checkpoint_io.remove_checkpoint(side)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        model = self._distributed_model
        if model is None:  # validate/test/predict: rank 0's weights on every rank
            return checkpoint
        error, own = None, None
        try:
            saved = checkpoint.get("bagua_lite")
            if saved is None:
                raise ValueError(
                    f"BaguaLiteStrategy: {os.fspath(checkpoint_path)!r} holds no bagua_lite state (it was written by "
                    f"another strategy, or as weights only), so the algorithm's per-rank state (residuals, "
                    f"momenta, replicas) cannot be resumed. To start from its weights, load them into the "
                    f"LightningModule (load_state_dict / load_from_checkpoint) and fit without ckpt_path")
            now = _ckpt.model_meta(model)
            diffs = _ckpt.meta_differences(saved["meta"], now)
            if diffs and all(d.startswith("world size") for d in diffs) and not _ckpt.has_tensors(saved["algorithm"]):
                warnings.warn(f"BaguaLiteStrategy: {diffs[0]}; {saved['meta']['algorithm']} keeps no per-rank "
                              f"state, so every rank resumes from rank 0's", stacklevel=2)
                own = saved
            elif diffs:
                raise ValueError(f"BaguaLiteStrategy: the checkpoint {os.fspath(checkpoint_path)!r} does not fit "
                                 f"this model: " + "; ".join(diffs))
            elif model.rank == 0:
                own = saved
            else:
                side = _side_file(checkpoint_path, model.rank)
                own = self.checkpoint_io.load_checkpoint(side, weights_only=weights_only)
                if own.get("rank") != model.rank or _ckpt.meta_differences(own["meta"], now):
                    raise ValueError(f"BaguaLiteStrategy: {side} is not rank {model.rank}'s state for this model")
        except Exception as e:  # noqa: BLE001
            error = e
        failed = _ckpt.failed_ranks(model, error)
        if failed:
            if isinstance(error, ValueError):
                raise error
            raise RuntimeError(f"BaguaLiteStrategy: loading {os.fspath(checkpoint_path)!r} failed on rank(s) "
                               f"{failed}" + (f"; here: {type(error).__name__}: {error}" if error else "")) from error
        if "state_dict" in own:  # this rank's own replica and optimizer state
            checkpoint = dict(checkpoint, state_dict=own["state_dict"], optimizer_states=own["optimizer_states"])
        self._pending_state = own
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        super().load_optimizer_state_dict(checkpoint)
        own, self._pending_state = self._pending_state, None
        if own is not None and self._distributed_model is not None:
            # the order of bagua_lite.load_checkpoint: module, optimizer, then the algorithm and the RNG
            self._distributed_model.load_algorithm_state_dict(own["algorithm"])
            torch.set_rng_state(own["rng"])
            if "cuda_rng" in own and self.root_device.type == "cuda":
                torch.cuda.set_rng_state(own["cuda_rng"], self.root_device)

    # ---- the end -----------------------------------------------------------------------------------------
    def teardown(self) -> None:
        model, self._distributed_model = self._distributed_model, None
        self._pending_state = None
        if model is not None:
            self.model = self.lightning_module  # unwrapped: Lightning and the user see their module again
            self._last_model = model  # closed, but a checkpoint after fit still carries its state
            model.close()
        super().teardown()
