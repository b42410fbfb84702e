// Dense allreduce: the baseline every relaxation is measured against.
#include "collectives/collectives.h"

namespace bagua_lite {
namespace collectives {

void allreduce(const ProcessGroupPtr& pg, at::Tensor& t, bool average) {
  check_contiguous(t, "allreduce", "t");
  if (average) check_floating(t, "allreduce(op='avg')", "t");
  pg_allreduce_sum(pg, t);
  if (average && pg->getSize() > 1) t.div_(pg->getSize());
}

}  // namespace collectives
}  // namespace bagua_lite
