// The CUDA kernels (kernels/cuda/*.cu): built into the extension when torch has CUDA and nvcc is found
// (setup.py defines BAGUA_LITE_WITH_CUDA then). The device-generic entry points (kernels/topk.h,
// compress.h) call these for CUDA tensors; without them, or with BAGUA_LITE_CUDA_KERNELS=0 in the
// environment, CUDA tensors take the ATen paths, which give the same results but synchronise with the host.
//
// Every function here is stream-ordered on the current CUDA stream and never waits for the device: no
// device-to-host copy, no result read back, so a step that calls them can run ahead of the GPU. What the
// CPU versions check by reading values (NaN in top-k, a non-finite codec input) is therefore not raised
// here; it travels instead (a NaN is the largest magnitude of a top-k; a non-finite header decodes to
// non-finite values), where the step's own non-finite check sees it.
#pragma once

#include <ATen/ATen.h>

namespace bagua_lite {
namespace kernels {
namespace cuda {

// True when the extension has the CUDA kernels and BAGUA_LITE_CUDA_KERNELS is not "0" (read once).
bool enabled();
// Whether the CUDA kernels handle top-k / a codec of this tensor (a CUDA tensor of a dtype they cover).
bool handles_topk(const at::Tensor& x);
bool handles_codec(const at::Tensor& values);

#ifdef BAGUA_LITE_WITH_CUDA
// Exact top-k by magnitude with the CPU kernel's order (ascending indices, ties to the lower index) into
// values[0:k] and indices[0:k]; x is float32, float16 or bfloat16, contiguous, on the device.
void topk_out(const at::Tensor& x, int64_t k, at::Tensor& values, at::Tensor& indices);

// Codecs, wire formats as in compress.h / compressors.py, byte for byte the CPU codec's.
void half_decode(const at::Tensor& wire, at::Tensor& out, bool bf16, bool accumulate);  // out: float32
void minmax_encode(const at::Tensor& x, at::Tensor& wire);
void minmax_decode(const at::Tensor& wire, at::Tensor& out, bool accumulate);
void sign_encode(const at::Tensor& x, at::Tensor& wire);
void sign_decode(const at::Tensor& wire, at::Tensor& out, bool accumulate);
// Error feedback fused (compress.h's compress_with_residual), float32 x and residual: x += residual, encode
// x into the wire, residual = x - decode(wire), in two passes (one for fp16/bf16).
void half_encode_ef(at::Tensor& x, at::Tensor& residual, at::Tensor& wire, bool bf16);
void minmax_encode_ef(at::Tensor& x, at::Tensor& residual, at::Tensor& wire);
void sign_encode_ef(at::Tensor& x, at::Tensor& residual, at::Tensor& wire);
// absmax4 (levels 7, 4-bit fields) and absmax2 (levels 1, 2-bit fields): scale (4 bytes) into `header`,
// biased codes into `codes` (ceil(n * bits / 8) bytes); out of decode: float32.
void absmax_encode(const at::Tensor& x, at::Tensor& header, at::Tensor& codes, int64_t bits);
void absmax_decode(const at::Tensor& header, const at::Tensor& codes, at::Tensor& out, int64_t bits,
                   bool accumulate);
// dense[indices[j]] += values[j] in order of j, as the CPU kernel (any floating dtypes): duplicates summed in
// that order, bit for bit. An index outside [0, dense.numel()) is skipped (it cannot be raised unread).
void scatter_add(at::Tensor& dense, const at::Tensor& values, const at::Tensor& indices);
// dst = src * scale (float32, contiguous; src may be dst) in one pass, and flag (one int32) = 1 if src held
// inf/NaN (sparse.h's scale_flagged_).
void scale_flagged(at::Tensor& dst, const at::Tensor& src, double scale, at::Tensor& flag);
// dst = src (contiguous, same bytes) only if any of `flags` (int32) is nonzero (sparse.h's copy_flagged_).
void copy_flagged(at::Tensor& dst, const at::Tensor& src, const at::Tensor& flags);
#endif

}  // namespace cuda
}  // namespace kernels
}  // namespace bagua_lite
