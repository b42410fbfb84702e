// The sparse and gradient-slot kernels on the device. scatter_add, in the CPU kernel's order: dense[indices[j]] += values[j] for j = 0, 1, ...,
// rounding to dense's dtype after every addition, so duplicate indices are summed exactly as the CPU sums
// them. (index_add_ sums duplicates with atomics, in whatever order the threads arrive: a different last
// bit from run to run and from rank to rank, which breaks the replicas' bit-for-bit equality.)
//
// A stable sort by index brings each index's values together, still in order of j; then the thread at the
// start of each run adds the run's values one by one. Runs are short (an index appears once per rank's set),
// and nothing is read back to the host.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include "kernels/cuda.h"
#include "kernels/cuda/common.cuh"

namespace bagua_lite {
namespace kernels {
namespace cuda {

namespace {

template <typename D, typename V>
__global__ void add_runs(D* dense, int64_t numel, const V* values, const int32_t* sorted_idx, int64_t n) {
  using acc_t = at::opmath_type<D>;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < n; t += int64_t(gridDim.x) * blockDim.x) {
    const int32_t i = sorted_idx[t];
    if (t > 0 && sorted_idx[t - 1] == i) continue;  // not the start of its run
    // Out of range: skipped rather than written out of bounds. The host cannot be told without waiting for
    // the device; the indices reaching here come from this library's own top-k and wire formats.
    if (i < 0 || i >= numel) continue;
    D d = dense[i];
    for (int64_t u = t; u < n && sorted_idx[u] == i; ++u) {
      d = static_cast<D>(static_cast<acc_t>(d) + static_cast<acc_t>(values[u]));
    }
    dense[i] = d;
  }
}

// One pass: d = s * f rounded once (the CPU's float product), and an OR of the non-finite tests of s. inf
// and NaN are the floats whose exponent bits are all ones. `write` is false when d is s and f is 1.
__global__ void scale_flag_f32(float* d, const float* s, float f, int64_t n, bool write, int32_t* flag) {
  int bad = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = s[i];
    bad |= (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
    if (write) d[i] = __fmul_rn(v, f);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;  // every writer writes 1: no race to lose
}

// dst = src, byte for byte (16-byte chunks where both are 16-byte aligned, then the tail), only where one of
// the `nflags` flags is set: every block reads them first and returns at once when none is.
__global__ void copy_if_flagged(uint8_t* d, const uint8_t* s, int64_t nbytes, const int32_t* flags, int nflags) {
  int set = 0;
  for (int i = 0; i < nflags; ++i) set |= flags[i];
  if (!set) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s)) & 15) == 0) {
    const int64_t n16 = nbytes / 16;
    for (int64_t i = t; i < n16; i += stride) reinterpret_cast<uint4*>(d)[i] = reinterpret_cast<const uint4*>(s)[i];
    done = n16 * 16;
  }
  for (int64_t i = done + t; i < nbytes; i += stride) d[i] = s[i];
}

}  // namespace

void copy_flagged(at::Tensor& dst, const at::Tensor& src, const at::Tensor& flags) {
  const int64_t nbytes = dst.numel() * static_cast<int64_t>(dst.element_size());
  if (nbytes == 0 || flags.numel() == 0) return;
  copy_if_flagged<<<grid_for(nbytes / 16 + 1), kThreads, 0, stream()>>>(
      static_cast<uint8_t*>(dst.data_ptr()), static_cast<const uint8_t*>(src.const_data_ptr()), nbytes,
      flags.const_data_ptr<int32_t>(), static_cast<int>(flags.numel()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void scale_flagged(at::Tensor& dst, const at::Tensor& src, double scale, at::Tensor& flag) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  const float f = static_cast<float>(scale);
  const bool write = !(src.data_ptr() == dst.data_ptr() && f == 1.0f);
  scale_flag_f32<<<grid_for(n), kThreads, 0, stream()>>>(dst.data_ptr<float>(), src.const_data_ptr<float>(), f, n,
                                                         write, flag.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void scatter_add(at::Tensor& dense, const at::Tensor& values, const at::Tensor& indices) {
  const int64_t n = indices.numel();
  if (n == 0) return;
  // stable: equal indices keep their order of j
  auto sorted = at::sort(indices, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor& sorted_idx = std::get<0>(sorted);
  const at::Tensor sorted_values = values.index_select(0, std::get<1>(sorted));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dense.scalar_type(), "scatter_add_cuda", [&] {
    using dense_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "scatter_add_cuda_v", [&] {
      add_runs<dense_t, scalar_t><<<grid_for(n, 1), kThreads, 0, stream()>>>(
          dense.data_ptr<dense_t>(), dense.numel(), sorted_values.const_data_ptr<scalar_t>(),
          sorted_idx.const_data_ptr<int32_t>(), n);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace bagua_lite
