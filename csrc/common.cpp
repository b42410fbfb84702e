#include "common.h"

#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <array>
#include <map>

namespace bagua_lite {

TrafficCounters& traffic() {
  static TrafficCounters counters;
  return counters;
}

at::Tensor scratch_bytes(Slot slot, int64_t nbytes, const at::Device& device) {
  // One small map per thread: device -> array of slots. Grow-only, so steady-state steps allocate nothing.
  thread_local std::map<std::string, std::array<at::Tensor, static_cast<int>(Slot::kCount)>> pools;
  auto& pool = pools[device.str()];
  at::Tensor& buf = pool[static_cast<int>(slot)];
  if (!buf.defined() || buf.numel() < nbytes) {
    int64_t grow = std::max<int64_t>(nbytes, buf.defined() ? buf.numel() + buf.numel() / 2 : 0);
    buf = at::empty({grow}, at::TensorOptions().dtype(at::kByte).device(device));
  }
  return buf.narrow(0, 0, nbytes);
}

at::Tensor result_buffer(const std::optional<at::Tensor>& out, int64_t n, const at::TensorOptions& opts,
                         const char* fn, const char* name) {
  if (!out.has_value()) return at::empty({n}, opts);
  const at::Tensor& o = *out;
  check_contiguous(o, fn, name);
  BL_CHECK(o.scalar_type() == opts.dtype().toScalarType() && o.device() == opts.device(), fn, ": `", name,
           "` must be a ", opts.dtype(), " tensor on ", opts.device(), " (the result's), got ", o.scalar_type(),
           " on ", o.device());
  return o.numel() >= n ? o.view(-1).narrow(0, 0, n) : at::empty({n}, opts);
}

void serial_intra_op_here() {
  at::get_num_threads();  // ATen's own set-up of this thread first: it would set the count back later
#ifdef _OPENMP
  omp_set_num_threads(1);  // this thread's count only; at::set_num_threads would also change the process's
#endif
}

}  // namespace bagua_lite
