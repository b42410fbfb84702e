#include "kernels/compress.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <c10/util/Half.h>
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"
#include "kernels/cuda.h"
#include "kernels/sign_sum.h"

namespace bagua_lite {
namespace kernels {
namespace {

void check_wire(const at::Tensor& wire, int64_t need, const char* fn, const at::Tensor& data) {
  BL_CHECK(wire.scalar_type() == at::kByte, fn, ": wire buffer must be uint8, got ", wire.scalar_type());
  // One device for both: the CPU loops read raw pointers, and a pointer into device memory would crash.
  BL_CHECK(wire.device() == data.device(), fn, ": the wire buffer is on ", wire.device(), " but the values are on ",
           data.device(), "; both must be on the same device");
  BL_CHECK(wire.is_contiguous(), fn, ": wire buffer must be contiguous");
  BL_CHECK(wire.numel() == need, fn, ": wire buffer has ", wire.numel(), " bytes, expected ", need);
}

// Whether the fused error-feedback kernels take these tensors (float32, contiguous, CUDA, kernels on).
[[maybe_unused]] bool fused_ef(const at::Tensor& x, const at::Tensor& residual) {
  return x.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat && x.is_contiguous() &&
         residual.is_contiguous() && residual.numel() == x.numel() && residual.device() == x.device() &&
         cuda::handles_codec(x);
}

// The float32 hot loops, compiled for AVX2 as well as the baseline and picked at load time (GCC's function
// multiversioning), so one build runs on any x86-64 and at full width where it can. They vectorize
// because they are branch-free (the extension builds with -fno-trapping-math, which lets a float compare
// become a blend) and alias-free (a uint8 store may alias anything: without locals and __restrict__ the
// grid would be reloaded every element). Rounding adds and subtracts 1.5 * 2^23: round to nearest even in
// the FPU's default mode, like nearbyint, without a library call.
BL_MULTIVERSION void quantize_f32(const float* __restrict__ src, uint8_t* __restrict__ dst, int64_t n,
                                  float origin, float scale, float zero) {
  for (int64_t i = 0; i < n; ++i) {
    float v = (src[i] - origin) * scale + zero;
    v = v < 0.f ? 0.f : v;
    v = v > 255.f ? 255.f : v;
    v = (v + 12582912.f) - 12582912.f;
    dst[i] = static_cast<uint8_t>(static_cast<int32_t>(v));
  }
}

BL_MULTIVERSION void dequantize_f32(const uint8_t* __restrict__ q, float* __restrict__ dst, int64_t n, float origin,
                                    float step, float zero, bool accumulate) {
  if (accumulate) {
    for (int64_t i = 0; i < n; ++i) dst[i] += origin + (static_cast<float>(q[i]) - zero) * step;
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = origin + (static_cast<float>(q[i]) - zero) * step;
  }
}

BL_MULTIVERSION void axpby_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
                               int64_t n, float beta) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + beta * b[i];  // out = a + beta * b
}

// 16-bit floats to float32 (overwriting or added into out). bf16 is float32's upper half: a shift, which
// vectorizes anywhere. fp16 needs F16C's vcvtph2ps (every x86-64 CPU since 2012), picked at run time;
// without it, c10's portable conversion.
BL_MULTIVERSION void bf16_to_f32(const uint16_t* __restrict__ in, float* __restrict__ out, int64_t n,
                                 bool accumulate) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof v);
    out[i] = accumulate ? out[i] + v : v;
  }
}

#if defined(__GNUC__) && defined(__x86_64__)
__attribute__((target("avx,f16c"))) void fp16_to_f32_f16c(const uint16_t* __restrict__ in, float* __restrict__ out,
                                                          int64_t n, bool accumulate) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(out + i));
    _mm256_storeu_ps(out + i, v);
  }
  for (; i < n; ++i) {
    const float v = c10::detail::fp16_ieee_to_fp32_value(in[i]);
    out[i] = accumulate ? out[i] + v : v;
  }
}
#endif

void fp16_to_f32(const uint16_t* in, float* out, int64_t n, bool accumulate) {
#if defined(__GNUC__) && defined(__x86_64__)
  static const bool f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  if (f16c) return fp16_to_f32_f16c(in, out, n, accumulate);
#endif
  for (int64_t i = 0; i < n; ++i) {
    const float v = c10::detail::fp16_ieee_to_fp32_value(in[i]);
    out[i] = accumulate ? out[i] + v : v;
  }
}

// sign's bit packing for float32: byte j holds elements 8j..8j+7, bit k set iff x >= 0 (NaN: clear), and its
// inverse (+-scale, overwriting or added). Whole bytes only; the caller does a partial last byte.
BL_MULTIVERSION void sign_pack_f32(const float* __restrict__ x, uint8_t* __restrict__ bits, int64_t nbytes) {
  for (int64_t j = 0; j < nbytes; ++j) {
    const float* v = x + 8 * j;
    uint32_t byte = 0;
    for (int k = 0; k < 8; ++k) byte |= static_cast<uint32_t>(v[k] >= 0.f) << k;
    bits[j] = static_cast<uint8_t>(byte);
  }
}

// table: 256 rows of the 8 values (+-scale) a byte stands for, so a byte costs one 8-float row copy or add
BL_MULTIVERSION void sign_unpack_f32(const uint8_t* __restrict__ bits, float* __restrict__ out, int64_t nbytes,
                                     const float* __restrict__ table, bool accumulate) {
  if (accumulate) {
    for (int64_t j = 0; j < nbytes; ++j) {
      const float* t = table + 8 * bits[j];
      float* o = out + 8 * j;
      for (int k = 0; k < 8; ++k) o[k] += t[k];
    }
  } else {
    for (int64_t j = 0; j < nbytes; ++j) std::memcpy(out + 8 * j, table + 8 * bits[j], 8 * sizeof(float));
  }
}

// sum |x| of one whole block of kSignBlock float32 values in sign_sum.h's order
BL_MULTIVERSION double abs_sum_block_f32(const float* __restrict__ q) {
  constexpr int kHalf = kSignBlock / 2;
  double s[kHalf];
  for (int j = 0; j < kHalf; ++j) s[j] = static_cast<double>(std::fabs(q[j])) + static_cast<double>(std::fabs(q[j + kHalf]));
  for (int h = kHalf / 2; h > 0; h >>= 1) {
    for (int j = 0; j < h; ++j) s[j] += s[j + h];
  }
  return s[0];
}

// sum |x| of a contiguous CPU tensor in sign_sum.h's order, which the CUDA kernel follows: the same double
double abs_sum_fixed_order(const at::Tensor& x) {
  constexpr int kHalf = kSignBlock / 2;
  const int64_t n = x.numel();
  const int64_t blocks = (n + kSignBlock - 1) / kSignBlock;
  std::vector<double> part(blocks);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sign_abs_sum", [&] {
    const scalar_t* p = x.const_data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        const scalar_t* q = p + b * kSignBlock;
        const int64_t m = std::min<int64_t>(kSignBlock, n - b * kSignBlock);
        if constexpr (std::is_same_v<scalar_t, float>) {
          if (m == kSignBlock) {
            part[b] = abs_sum_block_f32(reinterpret_cast<const float*>(q));  // scalar_t is float here
            continue;
          }
        }
        double s[kHalf];
        for (int j = 0; j < kHalf; ++j) {
          const double a = j < m ? std::fabs(static_cast<double>(q[j])) : 0.0;
          const double c = j + kHalf < m ? std::fabs(static_cast<double>(q[j + kHalf])) : 0.0;
          s[j] = a + c;
        }
        for (int h = kHalf / 2; h > 0; h >>= 1) {
          for (int j = 0; j < h; ++j) s[j] += s[j + h];
        }
        part[b] = s[0];
      }
    });
  });
  int64_t width = 1;
  while (width < blocks) width <<= 1;
  for (int64_t h = width / 2; h > 0; h >>= 1) {
    for (int64_t j = 0; j < h && j + h < blocks; ++j) part[j] += part[j + h];
  }
  return part[0];
}

// fp16 and bf16: a cast to a 16-bit float type on the way out, and back (or added) on the way in.
template <at::ScalarType kWire>
class HalfCompressor final : public Compressor {
 public:
  explicit HalfCompressor(const char* name) : name_(name) {}
  const char* name() const override { return name_; }
  int64_t wire_bytes(int64_t n) const override { return 2 * n; }
  void compress(const at::Tensor& x, at::Tensor& out) const override {
    check_wire(out, wire_bytes(x.numel()), name_, x);
    if (x.numel() == 0) return;
    out.view(kWire).copy_(x.reshape(-1));
  }
  void decompress(const at::Tensor& in, at::Tensor& out, bool accumulate) const override {
    check_wire(in, wire_bytes(out.numel()), name_, out);
    if (out.numel() == 0) return;
#ifdef BAGUA_LITE_WITH_CUDA
    if (out.scalar_type() == at::kFloat && cuda::handles_codec(out)) {
      return cuda::half_decode(in, out, kWire == at::kBFloat16, accumulate);
    }
#endif
    if (out.device().is_cpu() && out.scalar_type() == at::kFloat) {
      // ATen's mixed-dtype add (float32 += half) runs about 8x slower than this conversion loop
      const uint16_t* q = reinterpret_cast<const uint16_t*>(in.const_data_ptr<uint8_t>());
      float* p = out.data_ptr<float>();
      at::parallel_for(0, out.numel(), 1 << 16, [&](int64_t b, int64_t e) {
        (kWire == at::kHalf ? fp16_to_f32 : bf16_to_f32)(q + b, p + b, e - b, accumulate);
      });
      return;
    }
    auto flat = out.view(-1);
    if (accumulate) flat.add_(in.view(kWire)); else flat.copy_(in.view(kWire));
  }
  bool compress_with_residual(at::Tensor& x, at::Tensor& residual, at::Tensor& out) const override {
#ifdef BAGUA_LITE_WITH_CUDA
    if (fused_ef(x, residual)) {
      check_wire(out, wire_bytes(x.numel()), name_, x);
      cuda::half_encode_ef(x, residual, out, kWire == at::kBFloat16);
      return true;
    }
#endif
    return Compressor::compress_with_residual(x, residual, out);
  }

 private:
  const char* name_;
};

// Scaled sign (signSGD with a magnitude, as in EF-SignSGD, Karimireddy et al. 2019): one bit per element
// (1: x >= 0) and one float32 scale, the mean |x|, so x ~= scale * sign(x). Loses most of the
// information: use it with error feedback. Wire: [scale f32][ceil(n / 8) bytes, element i in bit i % 8
// of byte i / 8].
class SignCompressor final : public Compressor {
 public:
  static constexpr int64_t kHeader = sizeof(float);
  const char* name() const override { return "sign"; }
  int64_t wire_bytes(int64_t n) const override { return kHeader + (n + 7) / 8; }

  void compress(const at::Tensor& x, at::Tensor& out) const override {
    const int64_t n = x.numel();
    check_wire(out, wire_bytes(n), "sign compress", x);
#ifdef BAGUA_LITE_WITH_CUDA
    if (cuda::handles_codec(x)) return cuda::sign_encode(x, out);
#endif
    float scale = 0.f;
    if (n > 0) {
      auto xf = x.reshape(-1);
      // the CPU sums in the CUDA kernel's order (sign_sum.h); other devices without the kernels use ATen's
      double mean_abs = (x.device().is_cpu() ? abs_sum_fixed_order(x) : xf.norm(1).item<double>()) /
                        static_cast<double>(n);
      BL_CHECK(std::isfinite(mean_abs), "sign compress: input must be finite (mean |x| = ", mean_abs, ")");
      scale = static_cast<float>(mean_abs);
      auto bits = out.narrow(0, kHeader, (n + 7) / 8);
      if (!x.device().is_cpu()) {
        auto pad = at::zeros({(n + 7) / 8 * 8}, xf.options().dtype(at::kByte));
        pad.narrow(0, 0, n).copy_(xf.ge(0));
        auto weights = at::pow(2, at::arange(8, pad.options().dtype(at::kInt))).to(at::kByte);
        bits.copy_((pad.view({-1, 8}) * weights).sum(1).to(at::kByte));
      } else {
        uint8_t* b = bits.data_ptr<uint8_t>();
        if (x.scalar_type() == at::kFloat) {
          const float* p = x.const_data_ptr<float>();
          at::parallel_for(0, n / 8, 1 << 14, [&](int64_t lo, int64_t hi) { sign_pack_f32(p + 8 * lo, b + lo, hi - lo); });
          if (n % 8) {
            uint8_t byte = 0;
            for (int64_t i = n / 8 * 8; i < n; ++i) byte |= static_cast<uint8_t>(p[i] >= 0.f) << (i & 7);
            b[n / 8] = byte;
          }
        } else AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sign_compress", [&] {
          const scalar_t* p = x.const_data_ptr<scalar_t>();
          at::parallel_for(0, (n + 7) / 8, 1 << 14, [&](int64_t lo, int64_t hi) {
            for (int64_t j = lo; j < hi; ++j) {
              uint8_t byte = 0;
              const int64_t end = std::min<int64_t>(8, n - 8 * j);
              for (int64_t k = 0; k < end; ++k) byte |= static_cast<uint8_t>(!(p[8 * j + k] < scalar_t(0))) << k;
              b[j] = byte;
            }
          });
        });
      }
    }
    if (out.device().is_cpu()) {
      std::memcpy(out.data_ptr<uint8_t>(), &scale, kHeader);
    } else {  // a device buffer: no host pointer into it
      out.narrow(0, 0, kHeader).copy_(at::from_blob(&scale, {kHeader}, at::TensorOptions().dtype(at::kByte)));
    }
  }

  bool compress_with_residual(at::Tensor& x, at::Tensor& residual, at::Tensor& out) const override {
#ifdef BAGUA_LITE_WITH_CUDA
    if (fused_ef(x, residual)) {
      check_wire(out, wire_bytes(x.numel()), "sign compress", x);
      cuda::sign_encode_ef(x, residual, out);
      return true;
    }
#endif
    return Compressor::compress_with_residual(x, residual, out);
  }

  void decompress(const at::Tensor& in, at::Tensor& out, bool accumulate) const override {
    const int64_t n = out.numel();
    check_wire(in, wire_bytes(n), "sign decompress", out);
    if (n == 0) return;
#ifdef BAGUA_LITE_WITH_CUDA
    if (cuda::handles_codec(out)) return cuda::sign_decode(in, out, accumulate);
#endif
    float scale;
    auto header = in.device().is_cpu() ? in.narrow(0, 0, kHeader) : in.narrow(0, 0, kHeader).cpu();
    std::memcpy(&scale, header.const_data_ptr<uint8_t>(), kHeader);
    auto bits = in.narrow(0, kHeader, (n + 7) / 8);
    if (!out.device().is_cpu()) {
      auto shifts = at::arange(8, bits.options().dtype(at::kInt));
      auto set = bits.to(at::kInt).unsqueeze(1).bitwise_right_shift(shifts).bitwise_and(1).view(-1).narrow(0, 0, n);
      auto v = (set.to(at::kFloat) * 2 - 1) * scale;
      auto flat = out.view(-1);
      if (accumulate) flat.add_(v); else flat.copy_(v);
      return;
    }
    const uint8_t* b = bits.const_data_ptr<uint8_t>();
    if (out.scalar_type() == at::kFloat) {
      float* p = out.data_ptr<float>();
      float table[256 * 8];
      for (int byte = 0; byte < 256; ++byte) {
        for (int k = 0; k < 8; ++k) table[8 * byte + k] = ((byte >> k) & 1) ? scale : -scale;
      }
      at::parallel_for(0, n / 8, 1 << 13, [&](int64_t lo, int64_t hi) {
        sign_unpack_f32(b + lo, p + 8 * lo, hi - lo, table, accumulate);
      });
      for (int64_t i = n / 8 * 8; i < n; ++i) {
        const float v = ((b[i >> 3] >> (i & 7)) & 1) ? scale : -scale;
        p[i] = accumulate ? p[i] + v : v;
      }
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "sign_decompress", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      scalar_t* p = out.data_ptr<scalar_t>();
      at::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          const acc_t v = ((b[i >> 3] >> (i & 7)) & 1) ? acc_t(scale) : -acc_t(scale);
          p[i] = static_cast<scalar_t>(accumulate ? static_cast<acc_t>(p[i]) + v : v);
        }
      });
    });
  }
};

// Quantize n values to uint8 over [min, max]. Header holds min and max as float32 so that every
// receiver reconstructs exactly the same values from the same bytes.
// The uint8 grid of a [lo, hi] header: q = round((x - origin) * scale + zero), x ~= origin + (q - zero) * step.
// When [lo, hi] contains 0 the grid is anchored at 0 (origin 0, zero = round(-lo * scale)), so 0 is a level
// and decodes to exactly 0: coordinates that are exactly 0 (never-touched parameters, sparse gradients)
// stay exactly 0 through compression. Otherwise it is anchored at lo (origin lo, zero 0), which keeps
// full precision for a range far from 0. Error <= step / 2 either way (the 0-anchored grid shifts the
// levels by less than half a step, and hi * scale + zero <= 255.5 rounds into the range).
struct MinMaxGrid {
  float origin, scale, step, zero;
  MinMaxGrid(float lo, float hi) {
    const float range = hi - lo;
    scale = range > 0.f ? 255.f / range : 0.f;
    step = range / 255.f;
    if (range > 0.f && lo <= 0.f && hi >= 0.f) {
      origin = 0.f;
      zero = std::nearbyint(-lo * scale);
    } else {
      origin = lo;
      zero = 0.f;
    }
  }
};

class MinMaxUInt8Compressor final : public Compressor {
 public:
  static constexpr int64_t kHeader = 2 * sizeof(float);
  const char* name() const override { return "minmax_uint8"; }
  int64_t wire_bytes(int64_t n) const override { return kHeader + n; }

  void compress(const at::Tensor& x, at::Tensor& out) const override {
    const int64_t n = x.numel();
    check_wire(out, wire_bytes(n), "minmax_uint8 compress", x);
#ifdef BAGUA_LITE_WITH_CUDA
    if (cuda::handles_codec(x)) return cuda::minmax_encode(x, out);
#endif
    if (!x.device().is_cpu()) return compress_aten(x, out);
    float header[2] = {0.f, 0.f};
    uint8_t* q = out.data_ptr<uint8_t>() + kHeader;
    if (n > 0) {
      // ATen's vectorized min/max in one pass; a NaN propagates into it, so the check below rejects it.
      auto mm = at::aminmax(x.reshape(-1));
      // + 0: a -0 bound is written as +0, so the bytes do not depend on which zero the reduction met first
      header[0] = std::get<0>(mm).item<float>() + 0.f;
      header[1] = std::get<1>(mm).item<float>() + 0.f;
      BL_CHECK(std::isfinite(header[0]) && std::isfinite(header[1]),
               "minmax_uint8 compress: input must be finite (min=", header[0], ", max=", header[1], ")");
    }
    const MinMaxGrid grid(header[0], header[1]);
    if (x.scalar_type() == at::kFloat) {
      const float* p = x.const_data_ptr<float>();
      at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
        quantize_f32(p + b, q + b, e - b, grid.origin, grid.scale, grid.zero);
      });
    } else {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "minmax_uint8_compress", [&] {
        const scalar_t* p = x.const_data_ptr<scalar_t>();
        at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
          const float origin = grid.origin, scale = grid.scale, zero = grid.zero;
          const scalar_t* __restrict__ src = p;
          uint8_t* __restrict__ dst = q;
          for (int64_t i = b; i < e; ++i) {  // the float32 loop's arithmetic, on other input types
            float v = (static_cast<float>(src[i]) - origin) * scale + zero;
            v = v < 0.f ? 0.f : v;
            v = v > 255.f ? 255.f : v;
            v = (v + 12582912.f) - 12582912.f;
            dst[i] = static_cast<uint8_t>(static_cast<int32_t>(v));
          }
        });
      });
    }
    std::memcpy(out.data_ptr<uint8_t>(), header, kHeader);
  }

  bool compress_with_residual(at::Tensor& x, at::Tensor& residual, at::Tensor& out) const override {
#ifdef BAGUA_LITE_WITH_CUDA
    if (fused_ef(x, residual)) {
      check_wire(out, wire_bytes(x.numel()), "minmax_uint8 compress", x);
      cuda::minmax_encode_ef(x, residual, out);
      return true;
    }
#endif
    return Compressor::compress_with_residual(x, residual, out);
  }

  void decompress(const at::Tensor& in, at::Tensor& out, bool accumulate) const override {
    const int64_t n = out.numel();
    check_wire(in, wire_bytes(n), "minmax_uint8 decompress", out);
#ifdef BAGUA_LITE_WITH_CUDA
    if (cuda::handles_codec(out)) return cuda::minmax_decode(in, out, accumulate);
#endif
    if (!out.device().is_cpu()) return decompress_aten(in, out, accumulate);
    float header[2];
    std::memcpy(header, in.const_data_ptr<uint8_t>(), kHeader);
    const MinMaxGrid grid(header[0], header[1]);
    const float origin = grid.origin, step = grid.step, zero = grid.zero;
    const uint8_t* q = in.const_data_ptr<uint8_t>() + kHeader;
    if (out.scalar_type() == at::kFloat) {
      float* p = out.data_ptr<float>();
      at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
        dequantize_f32(q + b, p + b, e - b, origin, step, zero, accumulate);
      });
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "minmax_uint8_decompress", [&] {
      // Accumulate in the output's op-math type (double for float64), like an add of the decoded values.
      using acc_t = at::opmath_type<scalar_t>;
      scalar_t* p = out.data_ptr<scalar_t>();
      at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
        if (accumulate) {
          for (int64_t i = b; i < e; ++i) {
            p[i] = static_cast<scalar_t>(static_cast<acc_t>(p[i]) + static_cast<acc_t>(origin + (q[i] - zero) * step));
          }
        } else {
          for (int64_t i = b; i < e; ++i) p[i] = static_cast<scalar_t>(origin + (q[i] - zero) * step);
        }
      });
    });
  }

 private:
  // Device-agnostic path (CUDA tensors in builds without the .cu kernels): same formula via ATen.
  void compress_aten(const at::Tensor& x, at::Tensor& out) const {
    auto xf = x.reshape(-1).to(at::kFloat);
    float lo = 0.f, hi = 0.f;
    if (xf.numel()) {
      auto mm = at::aminmax(xf);
      lo = std::get<0>(mm).item<float>() + 0.f;
      hi = std::get<1>(mm).item<float>() + 0.f;
      BL_CHECK(std::isfinite(lo) && std::isfinite(hi), "minmax_uint8 compress: input must be finite (min=", lo,
               ", max=", hi, ")");
    }
    const MinMaxGrid grid(lo, hi);
    float header[2] = {lo, hi};
    out.narrow(0, 0, kHeader).copy_(at::from_blob(header, {kHeader}, at::kByte));
    out.narrow(0, kHeader, xf.numel())
        .copy_(((xf - grid.origin) * grid.scale + grid.zero).clamp(0, 255).round().to(at::kByte));
  }
  void decompress_aten(const at::Tensor& in, at::Tensor& out, bool accumulate) const {
    float header[2];
    auto h = in.narrow(0, 0, kHeader).cpu();
    std::memcpy(header, h.const_data_ptr<uint8_t>(), kHeader);
    const MinMaxGrid grid(header[0], header[1]);
    auto v = (in.narrow(0, kHeader, out.numel()).to(at::kFloat) - grid.zero) * grid.step + grid.origin;
    auto flat = out.view(-1);
    if (accumulate) flat.add_(v); else flat.copy_(v);
  }
};

}  // namespace

bool gossip_fold(const std::string& compression, const at::Tensor& own, const std::vector<at::Tensor>& received,
                 at::Tensor& x_hat, at::Tensor& nbr_sum, at::Tensor& delta, double degree) {
  const int64_t n = x_hat.numel();
  if (compression != "minmax_uint8") return false;
  for (const auto* t : {&x_hat, &nbr_sum, &delta}) {
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || !t->is_contiguous() || t->numel() != n) return false;
  }
  const int64_t need = MinMaxUInt8Compressor::kHeader + n;
  check_wire(own, need, "gossip_fold (own)", x_hat);
  for (const auto& w : received) check_wire(w, need, "gossip_fold (received)", x_hat);
  auto grid_of = [](const at::Tensor& w) {
    float h[2];
    std::memcpy(h, w.const_data_ptr<uint8_t>(), sizeof h);
    return MinMaxGrid(h[0], h[1]);
  };
  const MinMaxGrid g_own = grid_of(own);
  std::vector<MinMaxGrid> grids;
  std::vector<const uint8_t*> qs;
  for (const auto& w : received) {
    grids.push_back(grid_of(w));
    qs.push_back(w.const_data_ptr<uint8_t>() + MinMaxUInt8Compressor::kHeader);
  }
  const uint8_t* q_own = own.const_data_ptr<uint8_t>() + MinMaxUInt8Compressor::kHeader;
  float* xh = x_hat.data_ptr<float>();
  float* ns = nbr_sum.data_ptr<float>();
  float* d = delta.data_ptr<float>();
  const float deg = static_cast<float>(degree);
  // Block by block (4096 floats stay in L1): the neighbours' copies into nbr_sum, ours into x_hat, then
  // delta = nbr_sum - degree * x_hat: one pass over memory instead of one per decompression plus one.
  at::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; b += 4096) {
      const int64_t m = std::min<int64_t>(4096, hi - b);
      for (size_t j = 0; j < qs.size(); ++j) {
        dequantize_f32(qs[j] + b, ns + b, m, grids[j].origin, grids[j].step, grids[j].zero, true);
      }
      dequantize_f32(q_own + b, xh + b, m, g_own.origin, g_own.step, g_own.zero, true);
      axpby_f32(ns + b, xh + b, d + b, m, -deg);
    }
  });
  return true;
}

const Compressor& get_compressor(const std::string& name) {
  static const HalfCompressor<at::kHalf> fp16("fp16");
  static const HalfCompressor<at::kBFloat16> bf16("bf16");
  static const MinMaxUInt8Compressor minmax;
  static const SignCompressor sign;
  if (name == "fp16") return fp16;
  if (name == "bf16") return bf16;
  if (name == "minmax_uint8") return minmax;
  if (name == "sign") return sign;
  BL_CHECK(false, "unknown compression '", name, "'; allowed: 'fp16', 'bf16', 'minmax_uint8', 'sign'");
  return fp16;  // unreachable
}

at::Tensor compress(const at::Tensor& x, const std::string& name) {
  check_floating(x, "compress", "x");
  check_contiguous(x, "compress", "x");
  const auto& c = get_compressor(name);
  auto out = at::empty({c.wire_bytes(x.numel())}, x.options().dtype(at::kByte));
  c.compress(x, out);
  return out;
}

at::Tensor decompress(const at::Tensor& wire, const std::string& name, int64_t numel, at::ScalarType dtype) {
  BL_CHECK(numel >= 0, "decompress: numel must be >= 0, got ", numel);
  BL_CHECK(at::isFloatingType(dtype), "decompress: dtype must be floating, got ", dtype);
  const auto& c = get_compressor(name);
  auto out = at::empty({numel}, wire.options().dtype(dtype));
  c.decompress(wire, out, /*accumulate=*/false);
  return out;
}

}  // namespace kernels
}  // namespace bagua_lite
