// The built-in codecs on CUDA tensors, wire bytes identical to the CPU codecs' (kernels/compress.cpp and
// compressors.py): a header the device computes and writes itself (no value is read back), then one pass
// that writes the codes. Decoding reads the header on the device and fuses `accumulate`.
#include "kernels/cuda.h"
#include "kernels/cuda/common.cuh"
#include "kernels/sign_sum.h"

#include <ATen/Dispatch.h>
#include <cub/block/block_reduce.cuh>

#include <type_traits>

namespace bagua_lite {
namespace kernels {
namespace cuda {
namespace {

// ---- fp16 / bf16 decode into float32 (the encode is a cast: ATen's copy is already one read, one write)

template <typename H>
__global__ void half_decode_kernel(const H* __restrict__ in, float* __restrict__ out, int64_t n, bool accumulate) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = to_float(in[i]);
    out[i] = accumulate ? __fadd_rn(out[i], v) : v;
  }
}

// What an encoder reads: x itself, or x + residual (error feedback; float32), element by element. Not
// __restrict__: the error-feedback kernels write x and the residual back where they read them.
template <typename T>
struct Plain {
  const T* x;
  static constexpr bool kFloat = std::is_same<T, float>::value;
  __device__ __forceinline__ float operator()(int64_t i) const { return to_float(x[i]); }
};
struct PlusResidual {
  const float* x;
  const float* r;
  static constexpr bool kFloat = true;
  __device__ __forceinline__ float operator()(int64_t i) const { return __fadd_rn(x[i], r[i]); }
};

// fp16 / bf16 with error feedback: v = x + r, wire = v rounded, r = v - the rounded value, x = v (one pass)
template <typename H>
__global__ void half_encode_ef_kernel(float* x, float* r, H* __restrict__ wire, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = __fadd_rn(x[i], r[i]);
    const H h = static_cast<H>(v);
    wire[i] = h;
    r[i] = __fsub_rn(v, to_float(h));
    x[i] = v;
  }
}

// ---- minmax_uint8 --------------------------------------------------------------------------------------

struct MinMax {
  float lo, hi;
};
struct MinMaxOp {
  __device__ __forceinline__ MinMax operator()(const MinMax& a, const MinMax& b) const {
    return {nan_min(a.lo, b.lo), nan_max(a.hi, b.hi)};
  }
};

template <typename In>
__global__ void minmax_partial_kernel(In in, int64_t n, MinMax* __restrict__ partial) {
  MinMax m{INFINITY, -INFINITY};
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = in(i);
    m.lo = nan_min(m.lo, v);
    m.hi = nan_max(m.hi, v);
  }
  using Reduce = cub::BlockReduce<MinMax, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const MinMax r = Reduce(tmp).Reduce(m, MinMaxOp());
  if (threadIdx.x == 0) partial[blockIdx.x] = r;
}

// One block: the blocks' partials into the header [min f32][max f32]. A -0 bound is written as +0 (the CPU
// codec does the same), so the bytes do not depend on which zero a reduction order met first.
__global__ void minmax_header_kernel(const MinMax* __restrict__ partial, int blocks, uint8_t* __restrict__ wire) {
  MinMax m{INFINITY, -INFINITY};
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) m = MinMaxOp()(m, partial[b]);
  using Reduce = cub::BlockReduce<MinMax, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const MinMax r = Reduce(tmp).Reduce(m, MinMaxOp());
  if (threadIdx.x == 0) {
    store_f32_bytes(wire, __fadd_rn(r.lo, 0.f));
    store_f32_bytes(wire + 4, __fadd_rn(r.hi, 0.f));
  }
}

// MinMaxGrid of compress.cpp, with its roundings
struct Grid {
  float origin, scale, step, zero;
  __device__ __forceinline__ explicit Grid(const uint8_t* header) {
    const float lo = load_f32_bytes(header), hi = load_f32_bytes(header + 4);
    const float range = __fsub_rn(hi, lo);
    scale = range > 0.f ? __fdiv_rn(255.f, range) : 0.f;
    step = __fdiv_rn(range, 255.f);
    if (range > 0.f && lo <= 0.f && hi >= 0.f) {
      origin = 0.f;
      zero = rintf(__fmul_rn(-lo, scale));
    } else {
      origin = lo;
      zero = 0.f;
    }
  }
};

// With x_out (error feedback): x_out = v and r_out = v - the decoded value, in the same pass.
template <typename In>
__global__ void minmax_quantize_kernel(In in, int64_t n, uint8_t* __restrict__ wire, float* x_out, float* r_out) {
  const Grid g(wire);
  uint8_t* __restrict__ q = wire + 8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float x = in(i);
    float v = __fadd_rn(__fmul_rn(__fsub_rn(x, g.origin), g.scale), g.zero);
    v = v < 0.f ? 0.f : v;
    v = v > 255.f ? 255.f : v;
    const uint8_t code = static_cast<uint8_t>(static_cast<int32_t>(rintf(v)));
    q[i] = code;
    if (x_out != nullptr) {
      const float decoded = __fadd_rn(g.origin, __fmul_rn(__fsub_rn(static_cast<float>(code), g.zero), g.step));
      r_out[i] = __fsub_rn(x, decoded);
      x_out[i] = x;
    }
  }
}

template <typename T>
__global__ void minmax_decode_kernel(const uint8_t* __restrict__ wire, T* __restrict__ out, int64_t n,
                                     bool accumulate) {
  const Grid g(wire);
  const uint8_t* __restrict__ q = wire + 8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = __fadd_rn(g.origin, __fmul_rn(__fsub_rn(static_cast<float>(q[i]), g.zero), g.step));
    out[i] = static_cast<T>(accumulate ? __fadd_rn(to_float(out[i]), v) : v);
  }
}

// ---- sign: bits in the same pass as the block sums of |x| (the bits do not depend on the scale) ------

// Element i's bit: x >= 0 for float32; !(x < 0) for float16/bfloat16 -- what the CPU loops test (they
// differ only for NaN, whose scale is not finite anyway).
template <bool kFloat>
__device__ __forceinline__ bool sign_bit(float v) {
  return kFloat ? v >= 0.f : !(v < 0.f);
}

// Block b covers elements [kSignBlock * b, kSignBlock * (b + 1)) with kSignBlock / 2 threads: thread t sums
// elements t and t + kSignBlock / 2 in double, then the block halves its sums (s[t] += s[t + h]) -- the
// summation tree sign_sum.h defines, so that the CPU gets the same double. The bits: one ballot per warp
// and half gives 32 consecutive elements, i.e. 4 whole bytes of the wire.
template <typename In>
__global__ void __launch_bounds__(kSignBlock / 2) sign_bits_kernel(In in, int64_t n, uint8_t* __restrict__ bits,
                                                                   double* __restrict__ partial) {
  constexpr int kHalf = kSignBlock / 2;
  __shared__ double s[kHalf];
  const int t = threadIdx.x;
  const int64_t base = int64_t(blockIdx.x) * kSignBlock;
  const int64_t i0 = base + t, i1 = base + kHalf + t;
  const bool in0 = i0 < n, in1 = i1 < n;
  const float v0 = in0 ? in(i0) : 0.f, v1 = in1 ? in(i1) : 0.f;
  s[t] = __dadd_rn(in0 ? double(fabsf(v0)) : 0.0, in1 ? double(fabsf(v1)) : 0.0);
  const uint32_t m0 = __ballot_sync(0xffffffffu, in0 && sign_bit<In::kFloat>(v0));
  const uint32_t m1 = __ballot_sync(0xffffffffu, in1 && sign_bit<In::kFloat>(v1));
  if ((t & 31) == 0) {
    const int64_t nbytes = (n + 7) / 8;
    const int64_t b0 = (base + t) / 8, b1 = (base + kHalf + t) / 8;
    for (int j = 0; j < 4; ++j) {
      if (b0 + j < nbytes) bits[b0 + j] = (m0 >> (8 * j)) & 0xff;
      if (b1 + j < nbytes) bits[b1 + j] = (m1 >> (8 * j)) & 0xff;
    }
  }
  __syncthreads();
  for (int h = kHalf / 2; h > 0; h >>= 1) {
    if (t < h) s[t] = __dadd_rn(s[t], s[t + h]);
    __syncthreads();
  }
  if (t == 0) partial[blockIdx.x] = s[0];
}

// One block: the block sums, halved the same way (sign_sum.h), then scale = float(sum / n) into the header.
__global__ void sign_scale_kernel(double* __restrict__ partial, int64_t blocks, int64_t n, uint8_t* __restrict__ wire) {
  int64_t width = 1;
  while (width < blocks) width <<= 1;
  for (int64_t h = width / 2; h > 0; h >>= 1) {
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      if (j + h < blocks) partial[j] = __dadd_rn(partial[j], partial[j + h]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) store_f32_bytes(wire, static_cast<float>(__ddiv_rn(partial[0], double(n))));
}

// error feedback's second pass: x = v = x + r, r = v - (+-scale)
__global__ void sign_residual_kernel(float* x, float* r, const uint8_t* __restrict__ wire, int64_t n) {
  const float scale = load_f32_bytes(wire);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = __fadd_rn(x[i], r[i]);
    r[i] = __fsub_rn(v, v >= 0.f ? scale : -scale);
    x[i] = v;
  }
}

template <typename T>
__global__ void sign_decode_kernel(const uint8_t* __restrict__ wire, T* __restrict__ out, int64_t n, bool accumulate) {
  const float scale = load_f32_bytes(wire);
  const uint8_t* __restrict__ bits = wire + 4;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = ((bits[i >> 3] >> (i & 7)) & 1) ? scale : -scale;
    out[i] = static_cast<T>(accumulate ? __fadd_rn(to_float(out[i]), v) : v);
  }
}

// ---- absmax4 / absmax2 (compressors.py): scale = max|x| / levels, codes round-half-even(x / scale) ----

template <typename T>
__global__ void absmax_partial_kernel(const T* __restrict__ x, int64_t n, float* __restrict__ partial) {
  float m = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    m = nan_max(m, fabsf(to_float(x[i])));
  }
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const float r = Reduce(tmp).Reduce(m, [](float a, float b) { return nan_max(a, b); });
  if (threadIdx.x == 0) partial[blockIdx.x] = r;
}

__global__ void absmax_scale_kernel(const float* __restrict__ partial, int blocks, float levels,
                                    uint8_t* __restrict__ header) {
  float m = 0.f;
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) m = nan_max(m, partial[b]);
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const float r = Reduce(tmp).Reduce(m, [](float a, float b) { return nan_max(a, b); });
  if (threadIdx.x == 0) store_f32_bytes(header, __fdiv_rn(r, levels));
}

// torch.round(x / scale), NaN -> 0, +-inf -> +-levels, clamped; all 0 unless scale > 0 (NaN scale included)
__device__ __forceinline__ int absmax_code(float v, float scale, float levels) {
  if (!(scale > 0.f)) return 0;
  float q = rintf(__fdiv_rn(v, scale));
  if (isnan(q)) q = 0.f;
  q = q < -levels ? -levels : (q > levels ? levels : q);
  return static_cast<int>(q);
}

// One thread per wire byte: 8 / bits elements, element j of the byte at bits [bits * j, bits * (j + 1)).
template <typename T, int kBits>
__global__ void absmax_codes_kernel(const T* __restrict__ x, int64_t n, const uint8_t* __restrict__ header,
                                    uint8_t* __restrict__ codes) {
  constexpr int kPer = 8 / kBits;
  constexpr int kLevels = (1 << (kBits - 1)) - 1;
  const float scale = load_f32_bytes(header);
  const int64_t nbytes = (n + kPer - 1) / kPer;
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < nbytes; b += int64_t(gridDim.x) * blockDim.x) {
    uint32_t byte = 0;
    for (int j = 0; j < kPer; ++j) {
      const int64_t i = b * kPer + j;
      if (i < n) byte |= uint32_t(absmax_code(to_float(x[i]), scale, float(kLevels)) + kLevels) << (kBits * j);
    }
    codes[b] = static_cast<uint8_t>(byte);
  }
}

template <int kBits>
__global__ void absmax_decode_kernel(const uint8_t* __restrict__ header, const uint8_t* __restrict__ codes,
                                     float* __restrict__ out, int64_t n, bool accumulate) {
  constexpr int kPer = 8 / kBits;
  constexpr int kLevels = (1 << (kBits - 1)) - 1;
  const float scale = load_f32_bytes(header);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int code = (codes[i / kPer] >> (kBits * (i % kPer))) & ((1 << kBits) - 1);
    const float v = __fmul_rn(static_cast<float>(code) - float(kLevels), scale);
    out[i] = accumulate ? __fadd_rn(out[i], v) : v;
  }
}

// float32, float16, bfloat16 (float64 stays on ATen: cuda.h's handles_codec)
#define BL_CUDA_FLOAT_TYPES(TYPE, NAME, ...)                                                \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                 \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)              \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

}  // namespace

void half_decode(const at::Tensor& wire, at::Tensor& out, bool bf16, bool accumulate) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const void* in = wire.const_data_ptr();
  if (bf16) {
    half_decode_kernel<<<grid_for(n), kThreads, 0, stream()>>>(static_cast<const at::BFloat16*>(in),
                                                               out.data_ptr<float>(), n, accumulate);
  } else {
    half_decode_kernel<<<grid_for(n), kThreads, 0, stream()>>>(static_cast<const at::Half*>(in),
                                                               out.data_ptr<float>(), n, accumulate);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// minmax_uint8's header of what `in` reads: block partials, then one block writes [min][max] into the wire
template <typename In>
void minmax_header(In in, int64_t n, uint8_t* w, const at::TensorOptions& options) {
  const int blocks = grid_for(n);
  auto partial = at::empty({blocks * int64_t(sizeof(MinMax))}, options.dtype(at::kByte));
  MinMax* p = reinterpret_cast<MinMax*>(partial.data_ptr<uint8_t>());
  minmax_partial_kernel<<<blocks, kThreads, 0, stream()>>>(in, n, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  minmax_header_kernel<<<1, kThreads, 0, stream()>>>(p, blocks, w);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void minmax_encode(const at::Tensor& x, at::Tensor& wire) {
  const int64_t n = x.numel();
  if (n == 0) {  // the CPU codec's header for no values: [0, 0]
    wire.narrow(0, 0, 8).zero_();
    return;
  }
  uint8_t* w = wire.data_ptr<uint8_t>();
  BL_CUDA_FLOAT_TYPES(x.scalar_type(), "minmax_encode", [&] {
    const Plain<scalar_t> in{x.const_data_ptr<scalar_t>()};
    minmax_header(in, n, w, x.options());
    minmax_quantize_kernel<<<grid_for(n), kThreads, 0, stream()>>>(in, n, w, nullptr, nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void minmax_encode_ef(at::Tensor& x, at::Tensor& residual, at::Tensor& wire) {
  const int64_t n = x.numel();
  if (n == 0) {
    wire.narrow(0, 0, 8).zero_();
    return;
  }
  uint8_t* w = wire.data_ptr<uint8_t>();
  float* px = x.data_ptr<float>();
  float* pr = residual.data_ptr<float>();
  const PlusResidual in{px, pr};
  minmax_header(in, n, w, x.options());
  minmax_quantize_kernel<<<grid_for(n), kThreads, 0, stream()>>>(in, n, w, px, pr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void half_encode_ef(at::Tensor& x, at::Tensor& residual, at::Tensor& wire, bool bf16) {
  const int64_t n = x.numel();
  if (n == 0) return;
  void* w = wire.data_ptr();
  if (bf16) {
    half_encode_ef_kernel<<<grid_for(n), kThreads, 0, stream()>>>(x.data_ptr<float>(), residual.data_ptr<float>(),
                                                                  static_cast<at::BFloat16*>(w), n);
  } else {
    half_encode_ef_kernel<<<grid_for(n), kThreads, 0, stream()>>>(x.data_ptr<float>(), residual.data_ptr<float>(),
                                                                  static_cast<at::Half*>(w), n);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void minmax_decode(const at::Tensor& wire, at::Tensor& out, bool accumulate) {
  const int64_t n = out.numel();
  if (n == 0) return;
  BL_CUDA_FLOAT_TYPES(out.scalar_type(), "minmax_decode", [&] {
    minmax_decode_kernel<<<grid_for(n), kThreads, 0, stream()>>>(wire.const_data_ptr<uint8_t>(),
                                                                 out.data_ptr<scalar_t>(), n, accumulate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// sign's bits and scale of what `in` reads (n > 0), into the wire
template <typename In>
void sign_bits_and_scale(In in, int64_t n, uint8_t* w, const at::TensorOptions& options) {
  const int64_t blocks = (n + kSignBlock - 1) / kSignBlock;
  auto partial = at::empty({blocks}, options.dtype(at::kDouble));
  sign_bits_kernel<<<blocks, kSignBlock / 2, 0, stream()>>>(in, n, w + 4, partial.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sign_scale_kernel<<<1, 1024, 0, stream()>>>(partial.data_ptr<double>(), blocks, n, w);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void sign_encode(const at::Tensor& x, at::Tensor& wire) {
  const int64_t n = x.numel();
  if (n == 0) {
    wire.narrow(0, 0, 4).zero_();
    return;
  }
  BL_CUDA_FLOAT_TYPES(x.scalar_type(), "sign_encode", [&] {
    sign_bits_and_scale(Plain<scalar_t>{x.const_data_ptr<scalar_t>()}, n, wire.data_ptr<uint8_t>(), x.options());
  });
}

void sign_encode_ef(at::Tensor& x, at::Tensor& residual, at::Tensor& wire) {
  const int64_t n = x.numel();
  if (n == 0) {
    wire.narrow(0, 0, 4).zero_();
    return;
  }
  float* px = x.data_ptr<float>();
  float* pr = residual.data_ptr<float>();
  sign_bits_and_scale(PlusResidual{px, pr}, n, wire.data_ptr<uint8_t>(), x.options());
  sign_residual_kernel<<<grid_for(n), kThreads, 0, stream()>>>(px, pr, wire.data_ptr<uint8_t>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void sign_decode(const at::Tensor& wire, at::Tensor& out, bool accumulate) {
  const int64_t n = out.numel();
  if (n == 0) return;
  BL_CUDA_FLOAT_TYPES(out.scalar_type(), "sign_decode", [&] {
    sign_decode_kernel<<<grid_for(n), kThreads, 0, stream()>>>(wire.const_data_ptr<uint8_t>(), out.data_ptr<scalar_t>(),
                                                               n, accumulate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void absmax_encode(const at::Tensor& x, at::Tensor& header, at::Tensor& codes, int64_t bits) {
  TORCH_CHECK(bits == 2 || bits == 4, "absmax_encode: bits must be 2 or 4, got ", bits);
  const int64_t n = x.numel();
  if (n == 0) {  // compressors.py: a zero scale and no codes
    header.zero_();
    return;
  }
  const int blocks = grid_for(n);
  auto partial = at::empty({blocks}, x.options().dtype(at::kFloat));
  BL_CUDA_FLOAT_TYPES(x.scalar_type(), "absmax_encode", [&] {
    absmax_partial_kernel<<<blocks, kThreads, 0, stream()>>>(x.const_data_ptr<scalar_t>(), n,
                                                             partial.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    absmax_scale_kernel<<<1, kThreads, 0, stream()>>>(partial.data_ptr<float>(), blocks,
                                                      float((1 << (bits - 1)) - 1), header.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t nbytes = (n * bits + 7) / 8;
    if (bits == 4) {
      absmax_codes_kernel<scalar_t, 4><<<grid_for(nbytes), kThreads, 0, stream()>>>(
          x.const_data_ptr<scalar_t>(), n, header.const_data_ptr<uint8_t>(), codes.data_ptr<uint8_t>());
    } else {
      absmax_codes_kernel<scalar_t, 2><<<grid_for(nbytes), kThreads, 0, stream()>>>(
          x.const_data_ptr<scalar_t>(), n, header.const_data_ptr<uint8_t>(), codes.data_ptr<uint8_t>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void absmax_decode(const at::Tensor& header, const at::Tensor& codes, at::Tensor& out, int64_t bits,
                   bool accumulate) {
  TORCH_CHECK(bits == 2 || bits == 4, "absmax_decode: bits must be 2 or 4, got ", bits);
  const int64_t n = out.numel();
  if (n == 0) return;
  if (bits == 4) {
    absmax_decode_kernel<4><<<grid_for(n), kThreads, 0, stream()>>>(
        header.const_data_ptr<uint8_t>(), codes.const_data_ptr<uint8_t>(), out.data_ptr<float>(), n, accumulate);
  } else {
    absmax_decode_kernel<2><<<grid_for(n), kThreads, 0, stream()>>>(
        header.const_data_ptr<uint8_t>(), codes.const_data_ptr<uint8_t>(), out.data_ptr<float>(), n, accumulate);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace bagua_lite
