// absmax4 / absmax2 on the CPU (compress.h): one pass for the scale, one that writes each wire byte whole.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"
#include "kernels/compress.h"

namespace bagua_lite {
namespace kernels {
namespace {

constexpr int64_t kGrain = 1 << 15;

void check_codec_args(const at::Tensor& floats, const at::Tensor& header, const at::Tensor& codes, int64_t bits,
                      const char* fn) {
  BL_CHECK(bits == 2 || bits == 4, fn, ": bits must be 2 or 4, got ", bits);
  BL_CHECK(floats.device().is_cpu() && floats.scalar_type() == at::kFloat && floats.is_contiguous(), fn,
           ": expects a contiguous float32 CPU tensor, got ", floats.scalar_type(), " on ", floats.device());
  const int64_t per = 8 / bits;
  BL_CHECK(header.scalar_type() == at::kByte && header.numel() == 4 && header.is_contiguous(), fn,
           ": `header` must be 4 contiguous uint8 bytes, got ", header.numel(), " of ", header.scalar_type());
  const int64_t nbytes = (floats.numel() + per - 1) / per;
  BL_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == nbytes, fn,
           ": `codes` must be ", nbytes, " contiguous uint8 bytes for ", floats.numel(), " elements at ", bits,
           " bits, got ", codes.numel());
}

// The element loops are branch-free, so they vectorize (compress.cpp's pattern: -fno-trapping-math turns a
// float compare into a blend; GCC clones them for AVX2).

// max |x| and whether any element is NaN, in one read. The float max reduction does not auto-vectorize (GCC
// may not reorder it), so AVX2 gets intrinsics; the maximum of magnitudes is the same in any order.
void abs_max_scalar(const float* x, int64_t begin, int64_t n, float* m, bool* nan) {
  for (int64_t i = begin; i < n; ++i) {
    const float a = std::fabs(x[i]);
    *nan = *nan || a != a;
    *m = a > *m ? a : *m;
  }
}

#if defined(__GNUC__) && defined(__x86_64__)
__attribute__((target("avx2"))) void abs_max_avx2(const float* x, int64_t n, float* m_out, bool* nan_out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    m = _mm256_max_ps(a, m);  // the second operand where either is NaN: m never becomes NaN
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = 0.f;
  for (float v : lanes) best = v > best ? v : best;
  bool nan = _mm256_movemask_ps(unordered) != 0;
  abs_max_scalar(x, i, n, &best, &nan);
  *m_out = best;
  *nan_out = nan;
}
#endif

void abs_max_f32(const float* x, int64_t n, float* max_out, bool* nan_out) {
#if defined(__GNUC__) && defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return abs_max_avx2(x, n, max_out, nan_out);
#endif
  *max_out = 0.f;
  *nan_out = false;
  abs_max_scalar(x, 0, n, max_out, nan_out);
}

// Biased codes (round-half-even(x / scale), NaN -> 0, clamped to -levels..levels, plus levels) of n <= 256
// elements. The clamp to +-(levels + 1) first keeps |v| far below 2^22, where adding and subtracting
// 1.5 * 2^23 rounds to the nearest integer, ties to even, as torch.round; NaN passes both and becomes 0.
BL_MULTIVERSION void absmax_codes_f32(const float* __restrict__ x, int64_t n, float scale, float levels,
                                      uint8_t* __restrict__ codes) {
  constexpr float kMagic = 12582912.f;  // 1.5 * 2^23
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i] / scale;
    v = v < -levels - 1.f ? -levels - 1.f : v;
    v = v > levels + 1.f ? levels + 1.f : v;
    float q = (v + kMagic) - kMagic;
    q = q != q ? 0.f : q;
    q = q < -levels ? -levels : q;
    q = q > levels ? levels : q;
    codes[i] = static_cast<uint8_t>(static_cast<int>(q + levels));
  }
}

template <int kBits>
void encode(const float* x, int64_t n, float scale, uint8_t* out) {
  constexpr int kPer = 8 / kBits;
  constexpr int kLevels = (1 << (kBits - 1)) - 1;
  constexpr int64_t kBlock = 256;  // elements per stack block: a multiple of kPer
  const int64_t nbytes = (n + kPer - 1) / kPer;
  if (!(scale > 0.f)) {  // NaN, 0: every code 0, biased to kLevels
    uint8_t byte = 0;
    for (int j = 0; j < kPer; ++j) byte |= uint8_t(kLevels << (kBits * j));
    std::memset(out, byte, nbytes);
    if (n % kPer) out[nbytes - 1] &= uint8_t((1u << (kBits * (n % kPer))) - 1);  // padding fields 0
    return;
  }
  at::parallel_for(0, (n + kBlock - 1) / kBlock, kGrain / kBlock, [&](int64_t lo, int64_t hi) {
    uint8_t codes[kBlock];
    for (int64_t blk = lo; blk < hi; ++blk) {
      const int64_t start = blk * kBlock, len = std::min(kBlock, n - start);
      absmax_codes_f32(x + start, len, scale, float(kLevels), codes);
      for (int64_t i = len; i < (len + kPer - 1) / kPer * kPer; ++i) codes[i] = 0;  // padding fields 0
      uint8_t* dst = out + start / kPer;
      for (int64_t b = 0; b < (len + kPer - 1) / kPer; ++b) {
        uint32_t byte = 0;
        for (int j = 0; j < kPer; ++j) byte |= uint32_t(codes[b * kPer + j]) << (kBits * j);
        dst[b] = static_cast<uint8_t>(byte);
      }
    }
  });
}

// out[i] (+)= (code_i - levels) * scale for whole bytes: element j of byte b is out[b * kPer + j].
template <int kBits, bool kAccumulate>
BL_MULTIVERSION void absmax_decode_bytes(const uint8_t* __restrict__ codes, int64_t nbytes, float scale,
                                         float* __restrict__ out) {
  constexpr int kPer = 8 / kBits;
  constexpr int kMask = (1 << kBits) - 1;
  constexpr float kLevels = float((1 << (kBits - 1)) - 1);
  for (int64_t b = 0; b < nbytes; ++b) {
    const int byte = codes[b];
    for (int j = 0; j < kPer; ++j) {
      const float v = (static_cast<float>((byte >> (kBits * j)) & kMask) - kLevels) * scale;
      out[b * kPer + j] = kAccumulate ? out[b * kPer + j] + v : v;
    }
  }
}

template <int kBits>
void decode(const uint8_t* codes, float scale, float* out, int64_t n, bool accumulate) {
  constexpr int kPer = 8 / kBits;
  const int64_t whole = n / kPer;  // bytes whose every field is an element
  at::parallel_for(0, whole, kGrain / kPer, [&](int64_t lo, int64_t hi) {
    if (accumulate) {
      absmax_decode_bytes<kBits, true>(codes + lo, hi - lo, scale, out + lo * kPer);
    } else {
      absmax_decode_bytes<kBits, false>(codes + lo, hi - lo, scale, out + lo * kPer);
    }
  });
  constexpr int kLevels = (1 << (kBits - 1)) - 1;
  for (int64_t i = whole * kPer; i < n; ++i) {  // the last byte's elements
    const int code = (codes[i / kPer] >> (kBits * (i % kPer))) & ((1 << kBits) - 1);
    const float v = (static_cast<float>(code) - float(kLevels)) * scale;
    out[i] = accumulate ? out[i] + v : v;
  }
}

}  // namespace

void absmax_encode_cpu(const at::Tensor& x, at::Tensor& header, at::Tensor& codes, int64_t bits) {
  check_codec_args(x, header, codes, bits, "absmax_encode_cpu");
  const float* xp = x.const_data_ptr<float>();
  const int64_t n = x.numel();
  // max |x|, NaN if any element is NaN (as torch's max): the codes are then all 0
  float m = 0.f;
  bool nan = false;
  abs_max_f32(xp, n, &m, &nan);
  const int levels = (1 << (bits - 1)) - 1;
  const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : m / float(levels);
  std::memcpy(header.data_ptr<uint8_t>(), &scale, sizeof(scale));
  if (bits == 4) {
    encode<4>(xp, n, scale, codes.data_ptr<uint8_t>());
  } else {
    encode<2>(xp, n, scale, codes.data_ptr<uint8_t>());
  }
}

void absmax_decode_cpu(const at::Tensor& header, const at::Tensor& codes, at::Tensor& out, int64_t bits,
                       bool accumulate) {
  check_codec_args(out, header, codes, bits, "absmax_decode_cpu");
  float scale;
  std::memcpy(&scale, header.const_data_ptr<uint8_t>(), sizeof(scale));
  if (bits == 4) {
    decode<4>(codes.const_data_ptr<uint8_t>(), scale, out.data_ptr<float>(), out.numel(), accumulate);
  } else {
    decode<2>(codes.const_data_ptr<uint8_t>(), scale, out.data_ptr<float>(), out.numel(), accumulate);
  }
}

}  // namespace kernels
}  // namespace bagua_lite
