#include "kernels/cuda.h"

#include <cstdlib>
#include <cstring>

namespace bagua_lite {
namespace kernels {
namespace cuda {

bool enabled() {
#ifdef BAGUA_LITE_WITH_CUDA
  static const bool on = [] {
    const char* v = std::getenv("BAGUA_LITE_CUDA_KERNELS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
#else
  return false;
#endif
}

namespace {
bool float_like(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }
}  // namespace

bool handles_topk(const at::Tensor& x) { return x.is_cuda() && float_like(x.scalar_type()) && enabled(); }

// float64 stays on ATen: the kernels compute in float32, which is what the CPU codecs do for float32,
// float16 and bfloat16 inputs only.
bool handles_codec(const at::Tensor& values) {
  return values.is_cuda() && float_like(values.scalar_type()) && enabled();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace bagua_lite
