// Pluggable compressors: what travels on the wire for a chunk of a dense tensor.
// A compressor turns n elements into wire_bytes(n) bytes and back. Wire formats (little endian):
//   fp16          n * 2 bytes of IEEE half.
//   bf16          n * 2 bytes of bfloat16 (float32's exponent range: no overflow where fp16 would).
//   minmax_uint8  [min: f32][max: f32][n bytes q], step = (max - min) / 255  (BAGUA's ByteGrad). If
//                 min <= 0 <= max: x ~= (q - z) * step with z = round(-min / step), so 0 is exactly a
//                 level; otherwise x ~= min + q * step.
//   sign          [scale: f32][ceil(n/8) bytes], bit i%8 of byte i/8 set iff x_i >= 0; x ~= +-scale,
//                 scale = mean |x| (1 bit per element; meant to be used with error feedback).
#pragma once

#include <ATen/ATen.h>
#include <memory>
#include <string>
#include <vector>

namespace bagua_lite {
namespace kernels {

class Compressor {
 public:
  virtual ~Compressor() = default;
  virtual const char* name() const = 0;
  virtual int64_t wire_bytes(int64_t n) const = 0;
  // x: contiguous floating tensor of n elements; out: uint8 tensor of wire_bytes(n) bytes.
  virtual void compress(const at::Tensor& x, at::Tensor& out) const = 0;
  // in: uint8 wire bytes of n elements; out: contiguous floating tensor of n elements.
  // accumulate=false overwrites out, accumulate=true adds into it.
  virtual void decompress(const at::Tensor& in, at::Tensor& out, bool accumulate) const = 0;
  // Error feedback in one go: x += residual, compress x into out, residual = x - what out decodes to; the same
  // values as those three steps, in two passes over memory. Returns false, touching nothing, where there is
  // no fused path (the CUDA kernels take float32 CUDA tensors); the caller then does the three steps.
  virtual bool compress_with_residual(at::Tensor& x, at::Tensor& residual, at::Tensor& out) const {
    (void)x, (void)residual, (void)out;
    return false;
  }
};

// absmax4 / absmax2 (compressors.py's codecs for the DiLoCo family) on the CPU, float32 and contiguous:
// scale = max|x| / levels into `header` (4 bytes), codes round-half-even(x / scale) clamped to -levels..levels
// (NaN -> 0, all 0 unless scale > 0), biased by levels, `8 / bits` to a byte, element j at bit bits * j.
// The Python codec's bytes, without its temporaries; the CUDA kernels' twins (cuda.h).
void absmax_encode_cpu(const at::Tensor& x, at::Tensor& header, at::Tensor& codes, int64_t bits);
// out = (code - levels) * scale, or out += that with `accumulate` (float32, contiguous).
void absmax_decode_cpu(const at::Tensor& header, const at::Tensor& codes, at::Tensor& out, int64_t bits,
                       bool accumulate);

// "fp16", "bf16", "minmax_uint8" or "sign"; anything else raises a ValueError listing the allowed names.
const Compressor& get_compressor(const std::string& name);

// Decentralized SGD's compressed exchange, folded in one pass (CHOCO, see algorithms/decentralized.py):
// nbr_sum += sum_j D(received_j); x_hat += D(own); delta = nbr_sum - degree * x_hat. Returns false (and
// touches nothing) when there is no fused path for this compression or these tensors (then the caller
// decompresses one by one); the fused path: minmax_uint8 into contiguous float32 CPU tensors.
bool gossip_fold(const std::string& compression, const at::Tensor& own, const std::vector<at::Tensor>& received,
                 at::Tensor& x_hat, at::Tensor& nbr_sum, at::Tensor& delta, double degree);

// Convenience wrappers for the Python kernels module.
at::Tensor compress(const at::Tensor& x, const std::string& name);
at::Tensor decompress(const at::Tensor& wire, const std::string& name, int64_t numel, at::ScalarType dtype);

}  // namespace kernels
}  // namespace bagua_lite
