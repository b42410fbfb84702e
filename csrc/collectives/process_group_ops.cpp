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

namespace {

// gloo's send and recv take a tensor's address as host memory, while its collectives stage CUDA tensors
// themselves: a CUDA tensor sent over gloo makes writev fail ("Bad address") and the process abort. So the
// point-to-point traffic of a CUDA tensor over a group whose CUDA backend is gloo (several processes on one
// GPU, the GPU check's P >= 2) goes through host copies; NCCL groups send device memory as it is.
bool p2p_through_host(const ProcessGroupPtr& pg, const at::Tensor& t) {
  if (!t.is_cuda()) return false;
  try {
    return pg->getBackend(c10::DeviceType::CUDA)->getBackendName() == "gloo";
  } catch (const c10::Error&) {
    return false;  // no CUDA backend at all: the send itself raises, naming the device
  }
}

at::Tensor host_like(const at::Tensor& t) { return at::empty(t.sizes(), t.options().device(at::kCPU)); }

void allgather_direct(const ProcessGroupPtr& pg, at::Tensor& out, at::Tensor& in, int tag) {
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

}  // namespace

void pg_allgather_direct(const ProcessGroupPtr& pg, at::Tensor& out, at::Tensor& in, int tag) {
  if (!p2p_through_host(pg, in)) return allgather_direct(pg, out, in, tag);
  at::Tensor in_h = in.cpu(), out_h = host_like(out);
  allgather_direct(pg, out_h, in_h, tag);
  out.copy_(out_h);
}

void pg_exchange(const ProcessGroupPtr& pg, at::Tensor& send, at::Tensor& recv, int64_t peer, int tag) {
  const bool host = p2p_through_host(pg, send);
  std::vector<at::Tensor> s{host ? send.cpu() : send}, r{host ? host_like(recv) : recv};
  auto ws = pg->send(s, static_cast<int>(peer), tag);
  auto wr = pg->recv(r, static_cast<int>(peer), tag);
  wait(ws);
  wait(wr);
  if (host) recv.copy_(r[0]);
  count_sent(send.nbytes());
}

void pg_send(const ProcessGroupPtr& pg, at::Tensor& t, int64_t peer, int tag) {
  std::vector<at::Tensor> s{p2p_through_host(pg, t) ? t.cpu() : t};
  wait(pg->send(s, static_cast<int>(peer), tag));
  count_sent(t.nbytes());
}

void pg_recv(const ProcessGroupPtr& pg, at::Tensor& t, int64_t peer, int tag) {
  const bool host = p2p_through_host(pg, t);
  std::vector<at::Tensor> r{host ? host_like(t) : t};
  wait(pg->recv(r, static_cast<int>(peer), tag));
  if (host) t.copy_(r[0]);
}

}  // namespace collectives
}  // namespace bagua_lite
