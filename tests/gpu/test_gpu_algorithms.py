"""Every algorithm on the device against its own CPU run: NCCL at P = 1 (plain "nccl", whose control
traffic takes the gloo group bagua_lite makes beside it, and "cpu:gloo,cuda:nccl"), and several processes
on one GPU over gloo with CUDA tensors at P = 2 and 3 (one GPU cannot hold two NCCL ranks).

Per algorithm and (backend, P): the device run's final weights against the CPU run's (same data, same
seeds), as the largest difference relative to the largest weight; a second device run bit for bit the
first (``repeat``); centralized replicas bit for bit equal. Tolerances: ``SMOOTH`` where the update is
continuous in the gradient (CUDA and CPU sum in other orders: about 1e-7 per operation, grown over the
steps), ``DISCONTINUOUS`` where a rounding can flip a selection, a sign or Adam's normalised step. Both are
first guesses until a GPU run measures them; the table prints what was measured.
"""
import traceback

import pytest
import torch

from algo_matrix import CENTRALIZED, DISCONTINUOUS, pick, train
from gpu_device import DEVICE, join_group, spawn_ranks

ALGORITHMS = pick("dense", "fp16", "uint8", "sign", "hierarchical", "topk", "gtopk", "gtopk_4bit", "gtopk_4bit_union",
                  "powersgd", "qadam", "decentralized", "decentralized_all", "low_precision_decentralized", "local_sgd",
                  "diloco", "streaming_diloco", "async_model_average", "auto")
TIMED = {"async_model_average"}  # its rounds follow the clock: neither repeatable nor comparable, only finite
SMOOTH, DISCONTINUOUS_TOL = 1e-3, 5e-2
STEPS = 10
SIZES = (32, 64, 64, 8)
BACKENDS = [("nccl", 1), ("cpu:gloo,cuda:nccl", 1), ("gloo", 2), ("gloo", 3)] if DEVICE == "cuda" else \
    [("gloo", 1), ("gloo", 2), ("gloo", 3)]


def _train(rank, dev, name, options):
    return train(rank, name, options, steps=STEPS, device=dev, sizes=SIZES, weight_decay=1e-4)


def _worker(rank, P, backend, device, store_path, results):
    try:
        import torch.distributed as dist
        dev = join_group(rank, P, backend, device, store_path)
        out = {}
        for key, (name, options) in ALGORITHMS.items():
            try:
                first = _train(rank, dev, name, options)
                again = _train(rank, dev, name, options) if device != "cpu" and key not in TIMED else None
                # numpy, not a tensor: a tensor in a queue travels as a file descriptor that dies with this process
                out[key] = {"weights": first.numpy(), "repeat": None if again is None else torch.equal(first, again)}
            except Exception:  # noqa: BLE001 - a row of the table, not the end of the run
                out[key] = {"error": traceback.format_exc(limit=3)}
        dist.destroy_process_group()
        results.put((rank, out))
    except BaseException:  # noqa: BLE001
        results.put((rank, {"__fatal__": traceback.format_exc()}))


def _run(P, backend, device, timeout=240):
    return spawn_ranks(_worker, P, (backend, device), timeout)


_CPU = {}


def _cpu_reference(P):
    if P not in _CPU:
        _CPU[P] = _run(P, "gloo", "cpu")
    return _CPU[P]


@pytest.mark.parametrize("backend,P", BACKENDS, ids=[f"{b}-P{p}" for b, p in BACKENDS])
def test_every_algorithm_against_its_cpu_run(dev, record, backend, P):
    ref, _ = _cpu_reference(P)
    got, codes = _run(P, backend, DEVICE)
    failures = []
    for key in ALGORITHMS:
        rows = [got.get(r, {}) for r in range(P)]
        fatal = next((row["__fatal__"] for row in rows if "__fatal__" in row), None)
        errors = [row.get(key, {}).get("error") for row in rows if row.get(key, {}).get("error")]
        if len(got) < P or fatal or errors or any(key not in row for row in rows):
            note = (fatal or (errors[0] if errors else f"no result from every rank, exit codes {codes}")).strip()
            record(key, backend, P, False, float("nan"), note=note.splitlines()[-1][:160])
            failures.append(key)
            continue
        finals = [torch.from_numpy(row[key]["weights"]) for row in rows]
        refs = [torch.from_numpy(ref[r][key]["weights"]) for r in range(P)]
        diff = max(float((w - c).abs().max()) / float(c.abs().max()) for w, c in zip(finals, refs))
        finite = all(torch.isfinite(w).all() for w in finals)
        repeat = all(row[key]["repeat"] is not False for row in rows)  # None: not repeated (CPU, TIMED)
        replicas = all(torch.equal(finals[0], w) for w in finals) if key in CENTRALIZED else True
        if key in TIMED:
            ok = finite
        else:
            ok = finite and repeat and replicas and diff <= (DISCONTINUOUS_TOL if key in DISCONTINUOUS else SMOOTH)
        label = "n/a" if rows[0][key]["repeat"] is None else "bit-identical" if repeat else "differs"
        record(key, backend, P, ok, diff, repeat=label,
               note="" if replicas else "replicas differ")
        if not ok:
            failures.append(key)
    assert not failures, f"{backend} at P = {P}: {failures}"
