"""Which device the GPU suite checks (``BAGUA_LITE_GPU_CHECK``: cuda, or cpu standing in for it)."""
import os

import pytest
import torch

DEVICE = os.environ.get("BAGUA_LITE_GPU_CHECK", "cuda")


def device():
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("BAGUA_LITE_GPU_CHECK=cuda, and no CUDA device is visible")
    return torch.device("cuda", 0) if DEVICE == "cuda" else torch.device("cpu")
