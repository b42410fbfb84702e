// Shared pieces of the CUDA kernels: launch shapes and the float32 arithmetic the CPU codecs do.
//
// Bit-for-bit agreement with the CPU: nvcc contracts a * b + c into one fused multiply-add by default,
// which rounds once where the CPU rounds twice. Every product or quotient that a CPU codec rounds on its own
// is therefore written with the _rn intrinsics, which nvcc never contracts.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>

namespace bagua_lite {
namespace kernels {
namespace cuda {

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n items, `per_thread` each: enough to fill the device, no more.
inline int grid_for(int64_t n, int per_thread = 4, int threads = kThreads) {
  static const int cap = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 8;
  const int64_t want = (n + int64_t(threads) * per_thread - 1) / (int64_t(threads) * per_thread);
  return static_cast<int>(want < 1 ? 1 : (want > cap ? cap : want));
}

inline cudaStream_t stream() { return at::cuda::getCurrentCUDAStream(); }

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}

// Writes a float32 into 4 bytes of the wire, which need not be 4-byte aligned (the wire is a uint8 view).
__device__ __forceinline__ void store_f32_bytes(uint8_t* p, float v) {
  const uint32_t b = __float_as_uint(v);
  p[0] = b & 0xff;
  p[1] = (b >> 8) & 0xff;
  p[2] = (b >> 16) & 0xff;
  p[3] = b >> 24;
}

__device__ __forceinline__ float load_f32_bytes(const uint8_t* p) {
  return __uint_as_float(uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24));
}

// min / max / max-abs that keep a NaN once seen (like at::aminmax and Tensor.max), whatever the order
__device__ __forceinline__ float nan_min(float a, float b) { return (isnan(a) || a < b) ? a : b; }
__device__ __forceinline__ float nan_max(float a, float b) { return (isnan(a) || a > b) ? a : b; }

}  // namespace cuda
}  // namespace kernels
}  // namespace bagua_lite
