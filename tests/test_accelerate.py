"""bagua_lite under Hugging Face Accelerate, on real gloo groups (P = 3, CPU, as
`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 3` sets up).

The recipe: build the DistributedModel with your optimizer and the accelerator, then prepare as for DDP
(``accelerator.prepare`` keeps the DistributedModel as it is)::

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = bagua_lite.DistributedModel(net, optimizer, algorithm="gtopk", accelerator=accelerator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

What is checked: training through ``accelerator.backward`` / ``clip_grad_norm_`` / the prepared model,
optimizer and loader gives the same weights bit for bit as the plain bagua_lite loop on the same batches
(also without ``accelerator=``, preparing only the optimizer and loader); gradient accumulation through
``accelerator.accumulate(model)`` is bit for bit the plain ``no_sync()`` loop; ``mixed_precision="bf16"`` is
bit for bit the plain loop under ``torch.autocast`` with fp32 outputs; ``save_state``/``load_state`` resume
bit for bit (per-rank residuals and replicas included) and refuse a directory without bagua_lite's state;
the wrong orders are refused with a message that says the right one; Accelerate's unwrapping
(``unwrap_model``, ``get_state_dict``, ``save_model``) reaches the inner module and its plain keys, as for a DDP.
"""
import os

import pytest

pytest.importorskip("accelerate")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bagua_lite  # noqa: E402
from bagua_lite.algorithms import build  # noqa: E402
from cluster import Cluster  # noqa: E402

P = 3
B = 4            # per-rank batch
STEPS = 6        # optimizer steps per loop
ALGORITHMS = {
    "gradient_allreduce": {},
    "gtopk": {"density": 0.2, "momentum_correction": 0},  # clipping the averaged gradient is allowed then
    "local_sgd": {"period": 2},
}


def _env(rank):
    # what `accelerate launch --cpu --num_processes P` (or torchrun plus ACCELERATE_USE_CPU) gives each rank;
    # the group itself is the cluster's, already initialised: Accelerate uses it
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(P), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(P),
                      ACCELERATE_USE_CPU="true", HF_HUB_OFFLINE="1")


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def _dataset(n_batches):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n_batches * B, 8, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :3] * 2).argmax(1))


def _flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _accelerator(**kwargs):
    from accelerate import Accelerator
    acc = Accelerator(**kwargs)
    assert str(acc.distributed_type) == "DistributedType.MULTI_CPU" and acc.num_processes == P
    return acc


def _wrapped(name, options, accelerator=None):
    """The same net, SGD and bagua_lite model on every call (the Accelerate loop and its plain reference)."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    return net, opt, bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.001,
                                                 accelerator=accelerator)


# ---- training: Accelerate's loop == the plain loop, bit for bit ------------------------------------------------
def _r_train(rank, world, name, options, prepare_model):
    _env(rank)
    ds = _dataset(STEPS * P)
    # under Accelerate: the DDP script's prepare(model, optimizer, loader), or the optimizer and loader only
    acc = _accelerator()
    net, opt, model = _wrapped(name, options, acc if prepare_model else None)
    loader = torch.utils.data.DataLoader(ds, batch_size=B)
    if prepare_model:
        prepared, opt, loader = acc.prepare(model, opt, loader)
        assert prepared is model and acc._models == [model], "prepare did not keep the DistributedModel"
    else:
        opt, loader = acc.prepare(opt, loader)
    seen = []
    for x, y in loader:
        seen.append(x)
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        acc.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    steps_acc = model.algorithm.step
    model.close()
    # the plain bagua_lite loop on this rank's batches (Accelerate hands batch i to rank i % P)
    net2, opt2, model2 = _wrapped(name, options)
    mine = [ds[(s * P + rank) * B:(s * P + rank + 1) * B] for s in range(STEPS)]
    for x, y in mine:
        F.cross_entropy(model2(x), y).backward()
        torch.nn.utils.clip_grad_norm_(net2.parameters(), 0.5)
        opt2.step()
        opt2.zero_grad()
    model2.close()
    return {"same_data": len(seen) == STEPS and all(torch.equal(a, b[0]) for a, b in zip(seen, mine)),
            "steps": (steps_acc, model2.algorithm.step), "acc": _flat(net), "plain": _flat(net2), "init": _flat(_net())}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(P)  # its own ranks: Accelerate keeps per-process singletons (its state, the gradient state)
    yield c
    c.close()


@pytest.mark.parametrize("name,prepare_model", [(n, True) for n in ALGORITHMS] + [("gtopk", False)])
def test_training_under_accelerate_is_the_plain_loop_bit_for_bit(cluster, name, prepare_model):
    res = cluster.run(_r_train, name, ALGORITHMS[name], prepare_model, timeout=120)
    for r, o in enumerate(res):
        assert o["same_data"], f"rank {r}: Accelerate's loader did not hand this rank batches i*P+rank"
        assert o["steps"] == (STEPS, STEPS), (r, o["steps"])
        assert not torch.equal(o["acc"], o["init"]), f"rank {r}: nothing trained"
        assert torch.equal(o["acc"], o["plain"]), \
            f"{name}, rank {r}: weights differ from the plain loop by {(o['acc'] - o['plain']).abs().max():.3g}"
    if name != "local_sgd" or STEPS % ALGORITHMS["local_sgd"]["period"] == 0:  # replicas meet after an average
        assert all(torch.equal(o["acc"], res[0]["acc"]) for o in res), f"{name}: replicas differ"


# ---- gradient accumulation: accelerator.accumulate(model) == the plain no_sync() loop ------------------------------
def _r_accumulate(rank, world, name, options, gas):
    _env(rank)
    ds = _dataset(STEPS * gas * P)
    acc = _accelerator(gradient_accumulation_steps=gas)
    net, opt, model = _wrapped(name, options, acc)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(ds, batch_size=B))
    synced = []
    for x, y in loader:
        with acc.accumulate(model):  # no_sync() on the model for all but the last micro-batch of each step
            synced.append(acc.sync_gradients)
            acc.backward(F.cross_entropy(model(x), y))  # Accelerate divides the loss by gas
            opt.step()                                  # runs only on a synchronising micro-batch
            opt.zero_grad()
    steps_acc = model.algorithm.step
    model.close()
    net2, opt2, model2 = _wrapped(name, options)
    for s in range(STEPS):
        for m in range(gas):
            i = (s * gas + m) * P + rank
            x, y = ds[i * B:(i + 1) * B]
            with (model2.no_sync() if m < gas - 1 else torch.enable_grad()):
                (F.cross_entropy(model2(x), y) / gas).backward()
        opt2.step()
        opt2.zero_grad()
    model2.close()
    return {"synced": synced, "steps": (steps_acc, model2.algorithm.step), "acc": _flat(net), "plain": _flat(net2)}


@pytest.mark.parametrize("name", ["gradient_allreduce", "gtopk"])
def test_accumulate_is_the_plain_no_sync_loop(cluster, name):
    gas = 3
    options = {"density": 0.2} if name == "gtopk" else {}  # gtopk with its default momentum correction
    res = cluster.run(_r_accumulate, name, options, gas, timeout=120)
    for r, o in enumerate(res):
        assert o["synced"] == ([False] * (gas - 1) + [True]) * STEPS, o["synced"]
        assert o["steps"] == (STEPS, STEPS), (r, o["steps"])
        assert torch.equal(o["acc"], o["plain"]), \
            f"{name}, rank {r}: differs from the no_sync loop by {(o['acc'] - o['plain']).abs().max():.3g}"
    assert all(torch.equal(o["acc"], res[0]["acc"]) for o in res), f"{name}: replicas differ"


# ---- the wrong orders are refused; what unwrapping gives --------------------------------------------------------
def _r_refusals(rank, world):
    _env(rank)
    acc = _accelerator()
    out = {}
    # 1. accelerator.prepare(model): Accelerate wraps it in a DDP of its own, which would average twice
    net = _net()
    model = bagua_lite.DistributedModel(net, torch.optim.SGD(net.parameters(), lr=0.1))
    wrapped = acc.prepare(model)
    out["wrapped_in"] = type(wrapped).__name__
    try:
        wrapped(torch.randn(B, 8)).sum().backward()
        out["ddp"] = None
    except RuntimeError as e:
        out["ddp"] = str(e)
    model.close()
    # 2. an Accelerator that compiles in prepare, which keeps a DistributedModel as it is
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state()  # the dynamo backend is fixed per process state: a new one, then back
    try:
        net = _net()
        bagua_lite.DistributedModel(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                    accelerator=_accelerator(dynamo_backend="inductor")).close()
        out["dynamo"] = None
    except ValueError as e:
        out["dynamo"] = str(e)
    AcceleratorState._reset_state()
    acc = _accelerator()
    # 3. DistributedModel(net, prepared_optimizer): the AcceleratedOptimizer takes no step hooks
    net = _net()
    prepared = acc.prepare(torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        bagua_lite.DistributedModel(net, prepared).close()
        out["wrapper_opt"] = None
    except TypeError as e:
        out["wrapper_opt"] = str(e)
    return out


def test_wrong_orders_are_refused_on_every_rank(cluster):
    for o in cluster.run(_r_refusals, timeout=60):
        assert o["wrapped_in"] == "DistributedDataParallel"
        assert o["ddp"] is not None and "runs inside a DistributedDataParallel" in o["ddp"] \
            and "accelerator=accelerator" in o["ddp"], o["ddp"]
        assert o["dynamo"] is not None and "compiles the models it prepares" in o["dynamo"] \
            and "torch.compile(model)" in o["dynamo"], o["dynamo"]
        assert o["wrapper_opt"] is not None and "AcceleratedOptimizer" in o["wrapper_opt"] \
            and "accelerator=accelerator) first" in o["wrapper_opt"], o["wrapper_opt"]


def _r_unwrap(rank, world, tmp):
    _env(rank)
    import safetensors.torch
    from accelerate.utils import extract_model_from_parallel
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    acc = _accelerator()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = bagua_lite.DistributedModel(net, opt, algorithm="gtopk")
    x, y = _dataset(1).tensors
    F.cross_entropy(model(x), y).backward()
    opt.step()  # trained weights, so that a copy of the untrained net would not match
    compiled = torch.compile(model)
    plain = {k: v.clone() for k, v in net.state_dict().items()}

    def same(sd):
        return list(sd) == list(plain) and all(torch.equal(v, plain[k]) for k, v in sd.items())

    out = {
        # a DistributedModel unwraps as a DDP does: to the inner module, whose state_dict has plain keys
        "unwrap_model": acc.unwrap_model(model) is net,
        "extract": extract_model_from_parallel(model) is net,
        "compiled": acc.unwrap_model(compiled, keep_torch_compile=False) is net,
        "get_state_dict": same(acc.get_state_dict(model)),
        "dcp_state_dict": same(get_model_state_dict(model)),
        "model_module": acc.unwrap_model(model.module) is net,
        "own_state_dict": list(model.state_dict()) == ["module." + k for k in plain],  # as DDP's own
    }
    acc.save_model(model, os.path.join(tmp, "saved"))
    acc.wait_for_everyone()
    saved = safetensors.torch.load_file(os.path.join(tmp, "saved", "model.safetensors"))
    out["save_model"] = same({k: saved[k] for k in plain if k in saved}) and len(saved) == len(plain)  # file sorts keys
    # DDP's reducer switches do not exist: Accelerate's trigger_sync_in_backward is refused, naming no_sync
    try:
        with acc.trigger_sync_in_backward(model):
            pass
        out["trigger_sync"] = False
    except NotImplementedError as e:
        out["trigger_sync"] = "no_sync" in str(e) and "trigger_sync_in_backward is not supported" in str(e)
    model.close()
    return out


def test_accelerate_unwraps_a_distributed_model_as_a_ddp(cluster, tmp_path):
    for o in cluster.run(_r_unwrap, str(tmp_path), timeout=60):
        assert o == {k: True for k in o}, o


# ---- save_state / load_state: each rank's own state, resumed bit for bit --------------------------------------------
def _accelerate_loop(acc, model, opt, loader, steps, dropout_seed=None):
    done = 0
    for x, y in loader:
        if done == steps:
            break
        acc.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
        done += 1


def _r_resume(rank, world, name, options, tmp):
    _env(rank)
    ds = _dataset(2 * STEPS * P)
    acc = _accelerator()
    net, opt, model = _wrapped(name, options, acc)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(ds, batch_size=B))
    batches = list(loader)
    _accelerate_loop(acc, model, opt, batches[:STEPS], STEPS)
    acc.save_state(os.path.join(tmp, "ckpt"))
    saved_files = sorted(os.listdir(os.path.join(tmp, "ckpt")))
    at_save = _flat(net)
    _accelerate_loop(acc, model, opt, batches[STEPS:], STEPS)
    straight = _flat(net)
    model.close()
    # a fresh process state: a new Accelerator, model and optimizer, load_state, the second half again
    acc2 = _accelerator()
    net2, opt2, model2 = _wrapped(name, options, acc2)
    model2, opt2, _ = acc2.prepare(model2, opt2, torch.utils.data.DataLoader(ds, batch_size=B))
    torch.manual_seed(999)  # the RNG state must come from the checkpoint
    acc2.load_state(os.path.join(tmp, "ckpt"))
    _accelerate_loop(acc2, model2, opt2, batches[STEPS:], STEPS)
    resumed = _flat(net2)
    model2.close()
    return {"files": saved_files, "straight": straight, "resumed": resumed, "at_save": at_save,
            "own": sorted(os.listdir(os.path.join(tmp, "ckpt", "bagua_lite")))}


@pytest.mark.parametrize("name", ["gtopk", "local_sgd"])
def test_save_state_and_load_state_resume_each_rank_bit_for_bit(cluster, tmp_path, name):
    # gtopk keeps per-rank residuals; local_sgd at an odd step count keeps replicas that differ
    options = {"density": 0.2} if name == "gtopk" else {"period": 4}
    res = cluster.run(_r_resume, name, options, str(tmp_path), timeout=120)
    assert "model.safetensors" in res[0]["files"] and "bagua_lite" in res[0]["files"], res[0]["files"]
    assert res[0]["own"] == [f"rank{r}.pt" for r in range(P)], res[0]["own"]
    for r, o in enumerate(res):
        assert torch.equal(o["resumed"], o["straight"]), \
            f"{name}, rank {r}: the resumed run differs by {(o['resumed'] - o['straight']).abs().max():.3g}"
    if name == "local_sgd":  # the replicas differed at the checkpoint, so rank 0's weights alone would not do
        assert not torch.equal(res[0]["at_save"], res[1]["at_save"])


def _r_foreign_checkpoint(rank, world, tmp):
    _env(rank)
    acc = _accelerator()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ddp_like = acc.prepare(net)  # a DDP run's save_state: no bagua_lite state in it
    opt = acc.prepare(opt)
    acc.save_state(os.path.join(tmp, "ddp"))
    del ddp_like
    acc2 = _accelerator()
    net2, opt2, model = _wrapped("gtopk", {"density": 0.2}, acc2)
    acc2.prepare(model, opt2)
    try:
        acc2.load_state(os.path.join(tmp, "ddp"))
        out = None
    except FileNotFoundError as e:
        out = str(e)
    model.close()
    return out


def test_load_state_refuses_a_directory_without_bagua_lite_state(cluster, tmp_path):
    for o in cluster.run(_r_foreign_checkpoint, str(tmp_path), timeout=120):
        assert o is not None and "holds no bagua_lite/ directory" in o and "accelerator=accelerator" in o, o


# ---- mixed precision: Accelerator(mixed_precision="bf16") == the plain loop under torch.autocast ------------------
def _r_bf16(rank, world, name, options):
    _env(rank)
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state()  # mixed precision is fixed per process state: a new one for this test
    ds = _dataset(STEPS * P)
    acc = _accelerator(mixed_precision="bf16")
    net, opt, model = _wrapped(name, options, acc)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(ds, batch_size=B))
    dtypes = set()
    for x, y in loader:
        out = model(x)
        dtypes.add(out.dtype)
        acc.backward(F.cross_entropy(out, y))
        opt.step()
        opt.zero_grad()
    model.close()
    unwrapped = acc.unwrap_model(model, keep_fp32_wrapper=False)
    plain_forward = unwrapped(ds[0:B][0]).dtype  # the autocast forward taken off again
    AcceleratorState._reset_state()
    net2, opt2, model2 = _wrapped(name, options)
    for s in range(STEPS):
        i = s * P + rank
        x, y = ds[i * B:(i + 1) * B]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model2(x)
        F.cross_entropy(out.float(), y).backward()
        opt2.step()
        opt2.zero_grad()
    model2.close()
    return {"dtypes": dtypes, "acc": _flat(net), "plain": _flat(net2), "unwrapped": unwrapped is net,
            "plain_forward": plain_forward, "init": _flat(_net())}


@pytest.mark.parametrize("name", ["gradient_allreduce", "gtopk"])
def test_bf16_mixed_precision_is_the_plain_autocast_loop(cluster, name):
    options = {"density": 0.2} if name == "gtopk" else {}
    for r, o in enumerate(cluster.run(_r_bf16, name, options, timeout=120)):
        assert o["dtypes"] == {torch.float32}, f"outputs not converted back to fp32: {o['dtypes']}"
        assert o["unwrapped"] and o["plain_forward"] == torch.float32
        assert not torch.equal(o["acc"], o["init"])
        assert torch.equal(o["acc"], o["plain"]), \
            f"{name}, rank {r}: bf16 under Accelerate differs by {(o['acc'] - o['plain']).abs().max():.3g}"
