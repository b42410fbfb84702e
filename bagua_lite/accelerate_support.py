"""A DistributedModel under Hugging Face Accelerate: ``DistributedModel(net, optimizer, ..., accelerator=acc)``.

The script of a DDP port keeps its ``accelerator.prepare(model, optimizer, loader)`` line. With the
accelerator given, the DistributedModel is:

- **kept by prepare**: it is marked as prepared, so Accelerate neither wraps it in a DDP of its own (which
  would average every gradient twice) nor moves it; Accelerate still lists it among its models, so
  ``save_state`` writes ``model.safetensors`` as it does for a DDP;
- **run in Accelerate's mixed precision**: with ``mixed_precision="bf16"``/``"fp16"`` the wrapped module's
  forward runs under ``accelerator.autocast()`` and its outputs come back in fp32, as Accelerate does to the
  module inside its DDP; the accelerator's GradScaler (fp16) becomes the model's ``grad_scaler``;
- **checkpointed per rank**: ``accelerator.save_state(dir)`` also writes every rank's own weights, optimizer
  state, algorithm state (residuals, momenta, replicas that differ by rank) and RNG state to
  ``dir/bagua_lite/rank<r>.pt`` (:func:`bagua_lite.save_checkpoint`), and ``accelerator.load_state(dir)``
  puts them back after Accelerate loaded rank 0's weights and optimizer into every rank, so a resumed run
  continues bit for bit. A directory without them (saved without ``accelerator=``, or by a DDP run) is
  refused by ``load_state`` with the reason, as is one of another world size, algorithm or bucket layout.

Checked before any traffic: the accelerator runs the processes of the model's group (a one-process
Accelerator, such as ``accelerate launch --cpu`` starts, is refused with the command that starts N), and
it does not compile in ``prepare`` (``dynamo_backend``: refused, since prepare keeps this model as it is;
``torch.compile(model)`` after prepare compiles it).
"""
import functools
import os
import types

import torch.distributed as dist

from . import checkpoint

SUBDIR = "bagua_lite"  # <save_state dir>/bagua_lite/rank<r>.pt

LAUNCH_HINT = ("on CPUs, `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N train.py` "
               "(or `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N train.py`); on GPUs, "
               "`accelerate launch --multi_gpu --num_processes N train.py`")


def check(accelerator, grad_scaler):
    """Refuse what cannot work before any collective; return the grad scaler the model is to use."""
    for name in ("num_processes", "process_index", "autocast", "register_save_state_pre_hook",
                 "register_load_state_pre_hook", "register_for_checkpointing"):
        if not hasattr(accelerator, name):
            raise TypeError(f"DistributedModel: accelerator must be an accelerate.Accelerator, got "
                            f"{type(accelerator).__name__} (it has no {name!r})")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"DistributedModel: the Accelerator runs {accelerator.num_processes} process (distributed type "
            f"{accelerator.distributed_type}), so there is no process group to train over. Start several "
            f"processes: {LAUNCH_HINT}. (`accelerate launch --cpu --num_processes N` starts one.)")
    if accelerator.num_processes != dist.get_world_size() or accelerator.process_index != dist.get_rank():
        raise ValueError(
            f"DistributedModel: the Accelerator has {accelerator.num_processes} processes and this is its "
            f"process {accelerator.process_index}, but the default process group has world size "
            f"{dist.get_world_size()} and this is its rank {dist.get_rank()}; build the Accelerator in every "
            f"process of the job, before the DistributedModel")
    backend = getattr(getattr(getattr(accelerator, "state", None), "dynamo_plugin", None), "backend", None)
    if backend is not None and str(getattr(backend, "value", backend)).upper() != "NO":
        raise ValueError(
            f"DistributedModel: the Accelerator compiles the models it prepares (dynamo backend "
            f"{getattr(backend, 'value', backend)}), but prepare keeps a DistributedModel as it is, so it would "
            f"run uncompiled; build the Accelerator without dynamo_backend and compile the prepared model "
            f"yourself: model = torch.compile(model)")
    scaler = getattr(accelerator, "scaler", None)
    if grad_scaler is not None and scaler is not None and grad_scaler is not scaler:
        raise ValueError("DistributedModel: grad_scaler differs from the accelerator's GradScaler, which "
                         "accelerator.backward and the prepared optimizer use; leave grad_scaler out")
    return grad_scaler if grad_scaler is not None else scaler


def _autocast_forward(module, accelerator):
    """What Accelerate does to a module it prepares with mixed precision: the forward under
    ``accelerator.autocast()``, the outputs in fp32; ``unwrap_model(keep_fp32_wrapper=False)`` undoes it."""
    from accelerate.utils import convert_to_fp32  # Accelerate is an optional extra, here already in use

    original = module.forward
    func = getattr(original, "__func__", None)
    if func is None:  # a forward set on the instance: wrap the callable itself
        @functools.wraps(original)
        def forward(*args, **kwargs):
            with accelerator.autocast():
                out = original(*args, **kwargs)
            return convert_to_fp32(out)
        module.forward = forward
    else:  # the class's forward: wrapped as a method, so that unwrap_model finds it through __wrapped__
        @functools.wraps(func)
        def forward(self, *args, **kwargs):
            with accelerator.autocast():
                out = func(self, *args, **kwargs)
            return convert_to_fp32(out)
        module.forward = types.MethodType(forward, module)
    module._original_forward = original


class _RankState:
    """Registered with ``accelerator.register_for_checkpointing``: Accelerate loads custom objects after the
    models and optimizers, which is when each rank's own state must replace rank 0's."""

    def __init__(self, model):
        self.model = model
        self.load_dir = None  # set by the load pre-hook, which alone is told the directory

    def state_dict(self):
        m = self.model
        return {"format": checkpoint.FORMAT, "subdir": SUBDIR, "meta": checkpoint.model_meta(m)}

    def load_state_dict(self, state):
        path, self.load_dir = self.load_dir, None
        if path is None:
            raise RuntimeError("bagua_lite: accelerator.load_state did not call the DistributedModel's load hook "
                               "first; load with accelerator.load_state(dir)")
        checkpoint.load_checkpoint(path, self.model, self.model.optimizer)


def attach(model, accelerator):
    """Mark ``model`` prepared, give it Accelerate's mixed precision and checkpoint hooks."""
    if getattr(accelerator, "native_amp", False):
        _autocast_forward(model.module, accelerator)
    model._is_accelerate_prepared = True  # Accelerate's own mark: prepare(model) returns it as it is
    agent = _RankState(model)

    def save_hook(models, weights, output_dir):
        checkpoint.save_checkpoint(os.path.join(output_dir, SUBDIR), model, model.optimizer)

    def load_hook(models, input_dir):
        path = os.path.join(input_dir, SUBDIR)
        error = None if os.path.isdir(path) else FileNotFoundError(
            f"bagua_lite: {input_dir!r} holds no {SUBDIR}/ directory: it was saved without "
            f"DistributedModel(..., accelerator=accelerator) or by another kind of run, so each rank's own state "
            f"(weights, optimizer, the algorithm's residuals or replicas) cannot be resumed. To start from its "
            f"weights only, load model.safetensors into the module before wrapping it")
        if checkpoint.failed_ranks(model, error):
            raise error or RuntimeError(f"bagua_lite: {input_dir!r} lacks {SUBDIR}/ on another rank")
        agent.load_dir = path

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    accelerator.register_for_checkpointing(agent)
