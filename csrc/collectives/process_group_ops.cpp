// The only file that talks to c10d::ProcessGroup directly. Traffic is counted as what this rank puts on
// the wire under the usual ring algorithms: allreduce 2(P-1)/P * bytes, allgather (P-1) * own bytes.
#include "collectives/collectives.h"

namespace bagua_lite {
namespace collectives {

c10::intrusive_ptr<c10d::Work> pg_allreduce_sum_start(const ProcessGroupPtr& pg, at::Tensor& t) {
  const int64_t P = pg->getSize();
  if (P == 1 || t.numel() == 0) return {};
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  auto work = pg->allreduce(v, opts);
  count_sent(2 * (P - 1) * t.nbytes() / P, 2 * (P - 1));
  return work;
}

void pg_allreduce_sum(const ProcessGroupPtr& pg, at::Tensor& t) {
  auto work = pg_allreduce_sum_start(pg, t);
  if (work) wait(work);
}

void pg_allgather(const ProcessGroupPtr& pg, at::Tensor& out, at::Tensor& in) {
  const int64_t P = pg->getSize();
  TORCH_INTERNAL_ASSERT(out.numel() == P * in.numel());
  if (P == 1) {
    out.copy_(in);
    return;
  }
  wait(pg->all_gather_single(out, in));
  count_sent((P - 1) * static_cast<int64_t>(in.nbytes()), P - 1);
}

void pg_exchange(const ProcessGroupPtr& pg, at::Tensor& send, at::Tensor& recv, int64_t peer, int tag) {
  std::vector<at::Tensor> s{send}, r{recv};
  auto ws = pg->send(s, static_cast<int>(peer), tag);
  auto wr = pg->recv(r, static_cast<int>(peer), tag);
  wait(ws);
  wait(wr);
  count_sent(send.nbytes());
}

void pg_send(const ProcessGroupPtr& pg, at::Tensor& t, int64_t peer, int tag) {
  std::vector<at::Tensor> s{t};
  wait(pg->send(s, static_cast<int>(peer), tag));
  count_sent(t.nbytes());
}

void pg_recv(const ProcessGroupPtr& pg, at::Tensor& t, int64_t peer, int tag) {
  std::vector<at::Tensor> r{t};
  wait(pg->recv(r, static_cast<int>(peer), tag));
}

}  // namespace collectives
}  // namespace bagua_lite
