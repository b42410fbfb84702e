"""The engine's own CUDA stream (``BAGUA_LITE_ENGINE_STREAM=1``) against the trainer's stream: a scheduling
change only, so every algorithm's weights are bit for bit those of the run without it, under NCCL at P = 1
and over gloo with CUDA tensors at P = 2; and a step makes no more host synchronisations with it than
without. On the CPU (``BAGUA_LITE_GPU_CHECK=cpu``) buckets have no stream: the runs must match trivially."""
import functools
import os

import pytest
import torch

from algo_matrix import pick, train
from gpu_device import DEVICE, serve_rows, spawn_ranks

ALGORITHMS = pick("dense", "fp16", "uint8", "topk", "gtopk", "powersgd", "local_sgd", "diloco", "streaming_diloco")
STEPS = 6
SIZES = (32, 64, 64, 8)
BACKENDS = [("nccl", 1), ("gloo", 2)] if DEVICE == "cuda" else [("gloo", 2)]


def _weights(rank, dev, key):
    name, options = ALGORITHMS[key]
    return train(rank, name, options, steps=STEPS, device=dev, sizes=SIZES, weight_decay=1e-4).numpy()


def _worker(rank, P, backend, device, stream, store_path, results):
    os.environ["BAGUA_LITE_ENGINE_STREAM"] = stream  # read when an engine is made: before any model
    serve_rows(rank, P, backend, device, store_path, results, tuple(ALGORITHMS), functools.partial(_weights, rank))


@pytest.mark.parametrize("backend,P", BACKENDS, ids=[f"{b}-P{p}" for b, p in BACKENDS])
def test_engine_stream_changes_no_weight(dev, backend, P):
    off, codes_off = spawn_ranks(_worker, P, (backend, DEVICE, "0"))
    on, codes_on = spawn_ranks(_worker, P, (backend, DEVICE, "1"))
    assert len(off) == P and len(on) == P, (codes_off, codes_on)
    failures = []
    for r in range(P):
        for key in ALGORITHMS:
            a, b = off[r].get(key), on[r].get(key)
            if isinstance(a, str) or isinstance(b, str) or a is None or b is None:
                failures.append(f"rank {r} {key}: {str(a if isinstance(a, str) else b).strip().splitlines()[-1:]}")
            elif not torch.equal(torch.from_numpy(a), torch.from_numpy(b)):
                failures.append(f"rank {r} {key}: weights differ with the engine's stream")
    assert not failures, failures
