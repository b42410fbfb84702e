"""Compute kernels of the C++ core (CPU with OpenMP; CUDA with its own kernels where the extension was built
with them, see :func:`cuda_kernels_enabled`; other devices through ATen).

All sparse sets are (values, int32 indices). A *canonical* set has strictly ascending indices.
"""
from typing import Tuple

import torch

from . import _C

__all__ = ["topk_count", "topk", "topk_out", "block_max_combine_", "compress", "decompress", "wire_bytes", "sparse_normalize",
           "merge_topk", "scatter_add_", "ef_remove_", "cuda_kernels_enabled"]


def topk_count(numel: int, density: float) -> int:
    """Entries a top-k at ``density`` keeps of ``numel`` (> 0): round(density * numel), at least 1, at most
    ``numel``. The one rule of the topk/gtopk algorithms' selections and of :mod:`bagua_lite.hooks`."""
    return max(1, min(numel, int(round(density * numel))))


def topk(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of a contiguous float tensor by magnitude, read as flat.

    Returns ``(values, int32 indices)`` in ascending index order; ties in ``|x|`` go to the lower index.
    A sampled threshold and one filtering pass over ``x`` in the common case (no sort). NaN raises.
    """
    return _C.topk(x, k)


def topk_out(x, k, values, indices, block_max=None) -> None:
    """:func:`topk` into preallocated ``values`` (x.dtype) and ``indices`` (int32) of >= k elements.

    ``block_max`` (float32 ``x`` on the CPU): an int32 tensor of ``ceil(x.numel() / 64)`` upper bounds on
    the magnitude keys (float32 bits with the sign cleared) of x's 64-element blocks, as
    :func:`block_max_combine_` leaves them after zeroing. Only the blocks that can hold the top k are then
    read. Bounds that are too large cost speed, never exactness; a bound below its block's largest key can
    lose that element, so pass bounds that cover every element written since they were zeroed.
    """
    _C.topk_out(x, k, values, indices, block_max)


def block_max_combine_(block_max, x, block_offset: int = 0):
    """Raise ``block_max``'s slots to the magnitude keys of ``x`` (float32), which holds bucket positions
    ``[block_offset, block_offset + x.numel())``; slot b covers positions ``[64 b, 64 b + 64)``."""
    _C.block_max_combine_(block_max, x, block_offset)
    return block_max


def compress(x: torch.Tensor, compression: str) -> torch.Tensor:
    """Compress ``x`` to its wire bytes (uint8) with a built-in: ``"fp16"``, ``"bf16"``, ``"minmax_uint8"``
    or ``"sign"`` (formats in :mod:`bagua_lite.compressors`)."""
    return _C.compress(x, compression)


def decompress(wire: torch.Tensor, compression: str, numel: int, dtype=torch.float32) -> torch.Tensor:
    return _C.decompress(wire, compression, numel, dtype)


def wire_bytes(compression: str, numel: int) -> int:
    return _C.wire_bytes(compression, numel)


def sparse_normalize(values, indices):
    """Sort by index and sum duplicate indices (stable): a canonical set."""
    return _C.sparse_normalize(values, indices)


def merge_topk(av, ai, bv, bi, k: int):
    """Union of two canonical sets (sum on equal indices), keeping the k largest by magnitude (a NaN above every
    magnitude, as in ``topk``; ties to the lower index), in ascending index order."""
    return _C.merge_topk(av, ai, bv, bi, k)


def scatter_add_(dense, values, indices):
    """``dense[indices[j]] += values[j]`` in order of j."""
    _C.scatter_add_(dense, values, indices)
    return dense


def ef_remove_(residual, indices, kept=None):
    """Error feedback: zero the entries of ``residual`` that were communicated. With ``kept`` (int32,
    strictly ascending, e.g. gTop-k's global set): only the entries of ``indices`` that ``kept`` holds."""
    _C.ef_remove_(residual, indices, kept)
    return residual


def cuda_kernels_enabled() -> bool:
    """Whether this build has the CUDA kernels (built when torch has CUDA and nvcc is found) and the
    environment leaves them on (``BAGUA_LITE_CUDA_KERNELS=0`` sends CUDA tensors to the ATen paths, which
    give the same results but read values back to the host). They cover top-k and every built-in codec of
    float32, float16 and bfloat16 tensors, with no host synchronisation."""
    return _C.cuda_kernels_enabled()
