// Exact top-k by magnitude on a CUDA device, with the CPU kernel's result (ascending indices, ties to the
// lower index) and no host synchronisation: every decision is taken on the device, and the outputs have
// the fixed size k, so nothing is read back.
//
// Each element gets a 64-bit key: the magnitude's float32 bits (sign cleared) above the complement of its
// index. Keys are distinct, larger magnitude wins, and between equal magnitudes the lower index wins: the
// top k are exactly the k largest keys, and the selection is { key >= T } for the k-th largest key T.
//
//   1. sample: one block sorts 8192 evenly spaced magnitudes and takes one a little above the expected
//      k-th largest as a threshold (a margin of a few standard deviations of the sample's count);
//   2. filter: one pass over x appends the keys of the elements at or above it to a candidate buffer;
//   3. decide: if the candidates cannot hold the top k (fewer than k, or more than the buffer), the
//      selection below reads x itself instead: slower, never wrong (adversarial inputs: all equal, ties,
//      one huge value, a pattern the sample's stride aliases);
//   4. radix select of T among the candidates: 8 passes of 8 bits, each a histogram whose last block to
//      finish picks the digit; once the digit's bucket holds exactly the keys still needed, T is known;
//   5. one ordered compaction over x (cub::DeviceSelect, stable) writes the k indices with key >= T in
//      ascending order, and their values.
// In the common case x is read twice (filter, compaction); the passes in 4 read the candidates only.
#include "kernels/cuda.h"
#include "kernels/cuda/common.cuh"

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#include <cub/block/block_radix_sort.cuh>
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/tabulate_output_iterator.h>

#include <cmath>

namespace bagua_lite {
namespace kernels {
namespace cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kSampleThreads = 512, kSampleItems = 16, kSample = kSampleThreads * kSampleItems;
// Up to this size the selection reads x directly (sampling would not save a pass).
constexpr int64_t kSmallInput = 4 * kSample;

struct State {
  unsigned long long count;   // candidates the filter found (may exceed the buffer)
  unsigned long long prefix;  // the digits of T fixed so far (lower bits zero)
  long long remaining;        // keys still to take among those matching prefix
  unsigned int sample_key;    // the filter's threshold on magnitude bits
  int use_all;                // 1: the selection reads x, not the candidates
  int done;                   // 1: T == prefix
  unsigned int blocks_done;   // blocks finished in the current pass
  unsigned int hist[256];     // the current pass's histogram
};

__device__ __forceinline__ uint32_t mag_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__device__ __forceinline__ uint64_t key_of(uint32_t mag, int64_t i) {
  return (uint64_t(mag) << 32) | uint64_t(~static_cast<uint32_t>(i));
}

template <typename T>
__global__ void __launch_bounds__(kSampleThreads) sample_kernel(const T* __restrict__ x, int64_t n, int rank,
                                                                State* st) {
  using Sort = cub::BlockRadixSort<uint32_t, kSampleThreads, kSampleItems>;
  __shared__ typename Sort::TempStorage tmp;
  uint32_t keys[kSampleItems];
  for (int j = 0; j < kSampleItems; ++j) {
    const int64_t s = int64_t(threadIdx.x) * kSampleItems + j;
    keys[j] = mag_bits(to_float(x[s * n / kSample]));
  }
  Sort(tmp).SortDescending(keys);  // blocked: thread t holds ranks [t * items, (t + 1) * items)
  const int r = rank - 1;
  if (int(threadIdx.x) == r / kSampleItems) {
    for (int j = 0; j < kSampleItems; ++j) {
      if (j == r % kSampleItems) st->sample_key = keys[j];  // a loop, so keys[] stays in registers
    }
  }
}

template <typename T>
__global__ void filter_kernel(const T* __restrict__ x, int64_t n, State* st, uint64_t* __restrict__ cand,
                              int64_t capacity) {
  const uint32_t threshold = st->sample_key;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t mag = mag_bits(to_float(x[i]));
    if (mag >= threshold) {
      // one atomic per warp: the selected lanes take consecutive slots
      cg::coalesced_group g = cg::coalesced_threads();
      unsigned long long base = 0;
      if (g.thread_rank() == 0) base = atomicAdd(&st->count, static_cast<unsigned long long>(g.size()));
      base = g.shfl(base, 0);
      const unsigned long long pos = base + g.thread_rank();
      if (pos < static_cast<unsigned long long>(capacity)) cand[pos] = key_of(mag, i);
    }
  }
}

__global__ void decide_kernel(State* st, int64_t k, int64_t capacity, int use_all) {
  const unsigned long long c = st->count;
  if (use_all || c < static_cast<unsigned long long>(k) || c > static_cast<unsigned long long>(capacity)) {
    st->use_all = 1;
  }
  st->prefix = 0;
  st->remaining = k;
  st->done = 0;
}

template <typename T>
__global__ void radix_pass_kernel(const T* __restrict__ x, int64_t n, const uint64_t* __restrict__ cand, State* st,
                                  int shift) {
  __shared__ unsigned int hist[256];
  __shared__ bool last;
  if (st->done) return;  // the same value for every thread of every block
  for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
  __syncthreads();
  const bool all = st->use_all != 0;
  const int64_t m = all ? n : static_cast<int64_t>(st->count);
  const uint64_t prefix = st->prefix;
  const uint64_t high = shift + 8 >= 64 ? 0 : (~0ull << (shift + 8));
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < m; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t key = all ? key_of(mag_bits(to_float(x[i])), i) : cand[i];
    if ((key & high) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    if (hist[b]) atomicAdd(&st->hist[b], hist[b]);
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&st->blocks_done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  // the last block: every other block's histogram is in (their fence came before their count)
  if (threadIdx.x == 0) {
    const long long need = st->remaining;
    long long above = 0;
    unsigned int in_bucket = 0;
    int d = 255;
    for (; d > 0; --d) {
      in_bucket = __ldcg(&st->hist[d]);
      if (above + in_bucket >= need) break;
      above += in_bucket;
    }
    if (d == 0) in_bucket = __ldcg(&st->hist[0]);
    st->remaining = need - above;
    st->prefix = prefix | (uint64_t(d) << shift);
    if (static_cast<long long>(in_bucket) <= need - above) st->done = 1;  // the whole bucket is taken
    st->blocks_done = 0;
  }
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += blockDim.x) st->hist[b] = 0;
}

template <typename T>
struct AtOrAbove {
  const T* x;
  const State* st;
  __device__ __forceinline__ bool operator()(int32_t i) const {
    return key_of(mag_bits(to_float(x[i])), i) >= st->prefix;
  }
};

// The compaction's output: position j gets index i and its value; never past k (the selection has exactly k
// elements; the bound keeps a wrong T from writing past the caller's buffers).
template <typename T>
struct Emit {
  const T* x;
  T* values;
  int32_t* indices;
  int64_t k;
  __device__ __forceinline__ void operator()(int64_t j, int32_t i) const {
    if (j < k) {
      indices[j] = i;
      values[j] = x[i];
    }
  }
};

}  // namespace

void topk_out(const at::Tensor& x, int64_t k, at::Tensor& values, at::Tensor& indices) {
  const int64_t n = x.numel();
  if (k == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  if (k == n) {  // everything, in index order
    indices.narrow(0, 0, k).copy_(at::arange(k, indices.options()));
    values.narrow(0, 0, k).copy_(x.reshape(-1));
    return;
  }
  auto state = at::zeros({static_cast<int64_t>(sizeof(State))}, x.options().dtype(at::kByte));
  State* st = reinterpret_cast<State*>(state.data_ptr<uint8_t>());
  // The sample's rank r: the expected count above the k-th largest, e = k * kSample / n, plus 3 standard
  // deviations and more, (sqrt(e) + 3)^2; the buffer holds n * r / kSample candidates with 5 more.
  bool use_all = n <= kSmallInput;
  int rank = 0;
  int64_t capacity = 0;
  if (!use_all) {
    const double e = double(k) * kSample / double(n);
    const double r = std::ceil((std::sqrt(e) + 3.0) * (std::sqrt(e) + 3.0));
    const double c = std::ceil(double(n) * (r + 5.0 * std::sqrt(r) + 8.0) / kSample);
    if (r > kSample / 2 || c > double(n) / 2) {
      use_all = true;
    } else {
      rank = static_cast<int>(r);
      capacity = static_cast<int64_t>(c);
    }
  }
  const cudaStream_t s = stream();
  at::Tensor cand;
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    uint64_t* c = nullptr;
    if (!use_all) {
      cand = at::empty({capacity}, x.options().dtype(at::kLong));
      c = reinterpret_cast<uint64_t*>(cand.data_ptr<int64_t>());
      sample_kernel<<<1, kSampleThreads, 0, s>>>(px, n, rank, st);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      filter_kernel<<<grid_for(n), kThreads, 0, s>>>(px, n, st, c, capacity);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    decide_kernel<<<1, 1, 0, s>>>(st, k, capacity, use_all ? 1 : 0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int grid = grid_for(use_all ? n : capacity);
    for (int shift = 56; shift >= 0; shift -= 8) {
      radix_pass_kernel<<<grid, kThreads, 0, s>>>(px, n, c, st, shift);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    thrust::counting_iterator<int32_t> in(0);
    auto out = thrust::make_tabulate_output_iterator(
        Emit<scalar_t>{px, values.data_ptr<scalar_t>(), indices.data_ptr<int32_t>(), k});
    auto selected = at::empty({1}, x.options().dtype(at::kLong));
    size_t bytes = 0;
    C10_CUDA_CHECK(cub::DeviceSelect::If(nullptr, bytes, in, out, selected.data_ptr<int64_t>(), static_cast<int>(n),
                                         AtOrAbove<scalar_t>{px, st}, s));
    auto tmp = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
    C10_CUDA_CHECK(cub::DeviceSelect::If(tmp.data_ptr(), bytes, in, out, selected.data_ptr<int64_t>(),
                                         static_cast<int>(n), AtOrAbove<scalar_t>{px, st}, s));
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(at::Half{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "bagua_lite topk (CUDA): float32, float16 or bfloat16 only, got ", x.scalar_type());
  }
}

}  // namespace cuda
}  // namespace kernels
}  // namespace bagua_lite
