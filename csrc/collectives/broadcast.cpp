// Broadcast from one rank of the group (used to make replicas start identical).
#include "collectives/collectives.h"

namespace bagua_lite {
namespace collectives {

void broadcast(const ProcessGroupPtr& pg, at::Tensor& t, int64_t src) {
  const int64_t P = pg->getSize();
  check_contiguous(t, "broadcast", "t");
  BL_CHECK(src >= 0 && src < P, "broadcast: src must be a rank of the group in [0, ", P, "), got ", src);
  if (P == 1 || t.numel() == 0) return;
  std::vector<at::Tensor> v{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = src;
  wait(pg->broadcast(v, opts));
  if (pg->getRank() == src) count_sent(t.nbytes());
}

}  // namespace collectives
}  // namespace bagua_lite
