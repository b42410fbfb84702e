// Dense allreduce: the baseline every relaxation is measured against.
#include "collectives/collectives.h"

namespace bagua_lite {
namespace collectives {

c10::intrusive_ptr<c10d::Work> allreduce_start(const ProcessGroupPtr& pg, at::Tensor& t, bool average) {
  check_contiguous(t, "allreduce", "t");
  if (average) check_floating(t, "allreduce(op='avg')", "t");
  return pg_allreduce_sum_start(pg, t);
}

void allreduce_finish(const ProcessGroupPtr& pg, at::Tensor& t, bool average) {
  if (average && pg->getSize() > 1) t.div_(pg->getSize());
}

void allreduce(const ProcessGroupPtr& pg, at::Tensor& t, bool average) {
  auto work = allreduce_start(pg, t, average);
  if (work) wait(work);
  allreduce_finish(pg, t, average);
}

}  // namespace collectives
}  // namespace bagua_lite
