#include "common.h"

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

}  // namespace bagua_lite
