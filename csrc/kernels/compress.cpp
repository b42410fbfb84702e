#include "kernels/compress.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common.h"

namespace bagua_lite {
namespace kernels {
namespace {

void check_wire(const at::Tensor& wire, int64_t need, const char* fn) {
  BL_CHECK(wire.scalar_type() == at::kByte, fn, ": wire buffer must be uint8, got ", wire.scalar_type());
  BL_CHECK(wire.is_contiguous(), fn, ": wire buffer must be contiguous");
  BL_CHECK(wire.numel() == need, fn, ": wire buffer has ", wire.numel(), " bytes, expected ", need);
}

class Fp16Compressor final : public Compressor {
 public:
  const char* name() const override { return "fp16"; }
  int64_t wire_bytes(int64_t n) const override { return 2 * n; }
  void compress(const at::Tensor& x, at::Tensor& out) const override {
    check_wire(out, wire_bytes(x.numel()), "fp16 compress");
    if (x.numel() == 0) return;
    out.view(at::kHalf).copy_(x.reshape(-1));
  }
  void decompress(const at::Tensor& in, at::Tensor& out, bool accumulate) const override {
    check_wire(in, wire_bytes(out.numel()), "fp16 decompress");
    if (out.numel() == 0) return;
    auto flat = out.view(-1);
    if (accumulate) flat.add_(in.view(at::kHalf)); else flat.copy_(in.view(at::kHalf));
  }
};

// Quantize n values to uint8 over [min, max]. Header holds min and max as float32 so that every
// receiver reconstructs exactly the same values from the same bytes.
class MinMaxUInt8Compressor final : public Compressor {
 public:
  static constexpr int64_t kHeader = 2 * sizeof(float);
  const char* name() const override { return "minmax_uint8"; }
  int64_t wire_bytes(int64_t n) const override { return kHeader + n; }

  void compress(const at::Tensor& x, at::Tensor& out) const override {
    const int64_t n = x.numel();
    check_wire(out, wire_bytes(n), "minmax_uint8 compress");
    if (!x.device().is_cpu()) return compress_aten(x, out);
    float header[2] = {0.f, 0.f};
    uint8_t* q = out.data_ptr<uint8_t>() + kHeader;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "minmax_uint8_compress", [&] {
      const scalar_t* p = x.const_data_ptr<scalar_t>();
      float lo = std::numeric_limits<float>::infinity(), hi = -lo;
      if (n > 0) {
        // Parallel min/max, then one quantization pass. A NaN must survive the reduction (std::min and
        // std::max drop it) so that the finiteness check below rejects it.
        auto nan_min = [](float a, float b) { return (b < a || b != b) ? b : a; };
        auto nan_max = [](float a, float b) { return (b > a || b != b) ? b : a; };
        std::tie(lo, hi) = at::parallel_reduce(
            0, n, 1 << 16, std::make_pair(lo, hi),
            [&](int64_t b, int64_t e, std::pair<float, float> acc) {
              float l = acc.first, h = acc.second;
              for (int64_t i = b; i < e; ++i) {
                float v = static_cast<float>(p[i]);
                l = nan_min(l, v);
                h = nan_max(h, v);
              }
              return std::make_pair(l, h);
            },
            [&](std::pair<float, float> a, std::pair<float, float> b) {
              return std::make_pair(nan_min(a.first, b.first), nan_max(a.second, b.second));
            });
        BL_CHECK(std::isfinite(lo) && std::isfinite(hi),
                 "minmax_uint8 compress: input must be finite (min=", lo, ", max=", hi, ")");
      } else {
        lo = hi = 0.f;
      }
      const float range = hi - lo;
      const float scale = range > 0.f ? 255.f / range : 0.f;
      at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          float v = (static_cast<float>(p[i]) - lo) * scale;
          v = std::min(std::max(v, 0.f), 255.f);
          q[i] = static_cast<uint8_t>(std::nearbyint(v));
        }
      });
      header[0] = lo;
      header[1] = hi;
    });
    std::memcpy(out.data_ptr<uint8_t>(), header, kHeader);
  }

  void decompress(const at::Tensor& in, at::Tensor& out, bool accumulate) const override {
    const int64_t n = out.numel();
    check_wire(in, wire_bytes(n), "minmax_uint8 decompress");
    if (!out.device().is_cpu()) return decompress_aten(in, out, accumulate);
    float header[2];
    std::memcpy(header, in.const_data_ptr<uint8_t>(), kHeader);
    const float lo = header[0], step = (header[1] - header[0]) / 255.f;
    const uint8_t* q = in.const_data_ptr<uint8_t>() + kHeader;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "minmax_uint8_decompress", [&] {
      // Accumulate in the output's op-math type (double for float64), like an add of the decoded values.
      using acc_t = at::opmath_type<scalar_t>;
      scalar_t* p = out.data_ptr<scalar_t>();
      at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
        if (accumulate) {
          for (int64_t i = b; i < e; ++i) {
            p[i] = static_cast<scalar_t>(static_cast<acc_t>(p[i]) + static_cast<acc_t>(lo + q[i] * step));
          }
        } else {
          for (int64_t i = b; i < e; ++i) p[i] = static_cast<scalar_t>(lo + q[i] * step);
        }
      });
    });
  }

 private:
  // Device-agnostic path (CUDA tensors in builds without the .cu kernels): same formula via ATen.
  void compress_aten(const at::Tensor& x, at::Tensor& out) const {
    auto xf = x.reshape(-1).to(at::kFloat);
    auto lo = xf.numel() ? xf.min() : at::zeros({}, xf.options());
    auto hi = xf.numel() ? xf.max() : at::zeros({}, xf.options());
    auto range = hi - lo;
    auto scale = at::where(range > 0, 255.f / range, at::zeros_like(range));
    out.narrow(0, 0, kHeader).view(at::kFloat).copy_(at::stack({lo, hi}));
    out.narrow(0, kHeader, xf.numel()).copy_(((xf - lo) * scale).clamp(0, 255).round().to(at::kByte));
  }
  void decompress_aten(const at::Tensor& in, at::Tensor& out, bool accumulate) const {
    auto header = in.narrow(0, 0, kHeader).view(at::kFloat);
    auto lo = header[0], step = (header[1] - header[0]) / 255.f;
    auto v = in.narrow(0, kHeader, out.numel()).to(at::kFloat) * step + lo;
    auto flat = out.view(-1);
    if (accumulate) flat.add_(v); else flat.copy_(v);
  }
};

}  // namespace

const Compressor& get_compressor(const std::string& name) {
  static const Fp16Compressor fp16;
  static const MinMaxUInt8Compressor minmax;
  if (name == "fp16") return fp16;
  if (name == "minmax_uint8") return minmax;
  BL_CHECK(false, "unknown compression '", name, "'; allowed: 'fp16', 'minmax_uint8'");
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
