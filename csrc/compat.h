// Every difference between the torch releases we support (2.11 and newer), in one place. The rest of the
// core calls these and never tests a torch version itself; a newer-only API used elsewhere is caught by
// CI's build against the oldest supported torch.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/headeronly/version.h>

#include <cstdint>
#include <vector>

#define BL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !BL_TORCH_AT_LEAST(2, 11)
#error "bagua_lite needs torch 2.11 or newer"
#endif

namespace bagua_lite {
namespace compat {

// One flat allgather: `out` holds every rank's `in`, in rank order. torch 2.13 renamed _allgather_base
// to all_gather_single and deprecated the old name.
inline c10::intrusive_ptr<c10d::Work> all_gather_single(c10d::ProcessGroup& pg, at::Tensor& out, at::Tensor& in) {
#if BL_TORCH_AT_LEAST(2, 13)
  return pg.all_gather_single(out, in);
#else
  return pg._allgather_base(out, in);
#endif
}

// One flat all-to-all with split sizes. torch 2.13 renamed alltoall_base to all_to_all_single.
inline c10::intrusive_ptr<c10d::Work> all_to_all_single(c10d::ProcessGroup& pg, at::Tensor& out, at::Tensor& in,
                                                        std::vector<int64_t>& out_splits,
                                                        std::vector<int64_t>& in_splits) {
#if BL_TORCH_AT_LEAST(2, 13)
  return pg.all_to_all_single(out, in, out_splits, in_splits);
#else
  return pg.alltoall_base(out, in, out_splits, in_splits);
#endif
}

}  // namespace compat
}  // namespace bagua_lite
