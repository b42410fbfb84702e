// absmax4 / absmax2 on the CPU (compress.h): one pass for the scale, one that writes each wire byte whole.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

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
  BL_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == (floats.numel() + per - 1) / per,
           fn, ": `codes` must be ", (floats.numel() + per - 1) / per, " contiguous uint8 bytes for ", floats.numel(),
           " elements at ", bits, " bits, got ", codes.numel());
}

template <int kBits>
void encode(const float* x, int64_t n, float scale, uint8_t* codes) {
  constexpr int kPer = 8 / kBits;
  constexpr int kLevels = (1 << (kBits - 1)) - 1;
  const int64_t nbytes = (n + kPer - 1) / kPer;
  const bool live = scale > 0.f;  // NaN, 0: every code 0
  at::parallel_for(0, nbytes, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      uint32_t byte = 0;
      for (int j = 0; j < kPer; ++j) {
        const int64_t i = b * kPer + j;
        float q = 0.f;
        if (i < n && live) {
          q = std::nearbyint(x[i] / scale);  // round half to even, as torch.round
          q = std::isnan(q) ? 0.f : std::min(std::max(q, -float(kLevels)), float(kLevels));
        }
        if (i < n) byte |= uint32_t(static_cast<int>(q) + kLevels) << (kBits * j);
      }
      codes[b] = static_cast<uint8_t>(byte);
    }
  });
}

template <int kBits>
void decode(const uint8_t* codes, float scale, float* out, int64_t n, bool accumulate) {
  constexpr int kPer = 8 / kBits;
  constexpr int kLevels = (1 << (kBits - 1)) - 1;
  at::parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int code = (codes[i / kPer] >> (kBits * (i % kPer))) & ((1 << kBits) - 1);
      const float v = (static_cast<float>(code) - float(kLevels)) * scale;
      out[i] = accumulate ? out[i] + v : v;
    }
  });
}

}  // namespace

void absmax_encode_cpu(const at::Tensor& x, at::Tensor& header, at::Tensor& codes, int64_t bits) {
  check_codec_args(x, header, codes, bits, "absmax_encode_cpu");
  const float* xp = x.const_data_ptr<float>();
  const int64_t n = x.numel();
  // max |x|, NaN if any element is NaN (as torch's max): the codes are then all 0
  float m = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(xp[i]);
    nan |= a != a;
    m = a > m ? a : m;
  }
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
