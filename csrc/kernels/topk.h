// Exact top-k by magnitude (|x|) for gradient sparsification.
//
// CPU: a sample-estimated threshold plus one parallel filter pass over the data (the common case reads
// the input about once), an exact radix select among the few surviving candidates, and an exact
// histogram radix-select fallback over the whole tensor whenever the estimate does not work out.
// Other devices: ATen ops (stable descending sort of |x|) with the same tie rule.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace bagua_lite {
namespace kernels {

// Exact top-k by magnitude of a contiguous floating tensor, read as flat.
// Returns (values: [k], same dtype/device as x; indices: [k] int32), ordered by ascending index.
// Ties in |x| are broken by lower index. Rejects NaN, k<0, k>numel, non-contiguous, non-floating dtypes,
// numel >= 2^31 with a clear c10::Error (TORCH_CHECK) that names the bad value and what is allowed.
std::tuple<at::Tensor, at::Tensor> topk(const at::Tensor& x, int64_t k);

namespace detail {
int topk_last_path();  // test hook: the CPU path of this thread's last call (topk.cpp's TopkPath)
}

// Same, writing into caller-provided buffers (values: x.dtype, indices: int32, each with >= k elements,
// contiguous); returns nothing; used on the hot path to avoid allocations.
// block_max (optional, float32 x on the CPU): int32 upper bounds, one per 64 elements, on the magnitude keys
// of x's blocks (kernels/sparse.h: the error-feedback writers produce them in the pass that writes x). Then
// only the blocks that can hold the top k are read. Bounds that are too large cost speed, never exactness;
// a bound below its block's largest key can lose that element from the result.
void topk_out(const at::Tensor& x, int64_t k, at::Tensor& values, at::Tensor& indices,
              const at::Tensor& block_max = {});

}  // namespace kernels
}  // namespace bagua_lite
