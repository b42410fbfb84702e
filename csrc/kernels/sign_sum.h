// The sign codec's scale, mean |x|, summed in one fixed order so that the CPU and the CUDA kernel write the
// same float32 bits (a float sum depends on its order, and the wire bytes must not depend on the device):
// elements in blocks of kSignBlock (the last one zero-padded); in a block, s[j] = |x[j]| + |x[j + kSignBlock
// / 2]| in double, then s[j] += s[j + h] for h = kSignBlock / 4, ..., 1; the block sums, zero-padded to a
// power of two, are halved the same way; scale = float(sum / n).
#pragma once

namespace bagua_lite {
namespace kernels {

constexpr int kSignBlock = 2048;

}  // namespace kernels
}  // namespace bagua_lite
