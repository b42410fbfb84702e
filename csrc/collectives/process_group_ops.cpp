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
  wait(compat::all_gather_single(*pg, out, in));
  count_sent((P - 1) * static_cast<int64_t>(in.nbytes()), P - 1);
}

void pg_allgather_direct(const ProcessGroupPtr& pg, at::Tensor& out, at::Tensor& in, int tag) {
  const int64_t P = pg->getSize(), me = pg->getRank(), n = in.numel();
  TORCH_INTERNAL_ASSERT(out.numel() == P * n);
  out.narrow(0, me * n, n).copy_(in);
  if (P == 1 || n == 0) return;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.reserve(2 * (P - 1));
  std::vector<std::vector<at::Tensor>> bufs;
  bufs.reserve(2 * (P - 1));
  // Everything posted before anything is awaited: one message latency for the whole exchange.
  for (int64_t i = 1; i < P; ++i) {
    const int64_t to = (me + i) % P, from = (me - i + P) % P;
    bufs.push_back({in});
    works.push_back(pg->send(bufs.back(), static_cast<int>(to), tag));
    bufs.push_back({out.narrow(0, from * n, n)});
    works.push_back(pg->recv(bufs.back(), static_cast<int>(from), tag));
  }
  for (auto& w : works) wait(w);
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
