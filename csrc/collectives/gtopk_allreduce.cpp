// Global Top-k allreduce (Shi et al., ICDCS'19) by recursive doubling.
//
//   S <- local canonical set, trimmed to the k largest by magnitude
//   P' <- largest power of two <= P
//   fold:   rank r >= P' sends S to r - P', which merges it in
//   for i in 0 .. log2(P')-1:  swap S with rank r XOR 2^i, S <- merge_topk(S, received, k)
//   unfold: rank r < P - P' sends the final S back to r + P'
//
// Message: [k values][k int32 indices], indices padded with -1 when |S| < k. merge_topk sums equal
// indices and keeps the k largest (ties: lower index); it is symmetric bit-for-bit, so every rank ends
// with the same bits. Bytes per rank: k*(sizeof(value)+4) per round, log2(P') rounds, plus one message
// for each folded pair (sent by the extra rank before, and by its partner after).
// exact=true: one allreduce of |S| values makes each value the exact sum of the ranks' inputs there.
#include <ATen/Dispatch.h>

#include <algorithm>
#include <cstring>

#include "collectives/collectives.h"
#include "kernels/sparse.h"

namespace bagua_lite {
namespace collectives {
namespace {

template <typename T>
struct GTopK {
  const ProcessGroupPtr& pg;
  const int64_t k;
  const at::Device dev;
  // The current set (canonical), a received set, and merge scratch; all reused across rounds.
  std::vector<T> sv, rv, mv, ov;
  std::vector<int32_t> si, ri, mi, oi;
  std::vector<int64_t> order;
  int64_t count = 0;

  int64_t msg_bytes() const { return k * static_cast<int64_t>(sizeof(T) + 4); }

  void pack(at::Tensor& wire) {
    auto host = wire.device().is_cpu() ? wire : at::empty({wire.numel()}, wire.options().device(at::kCPU));
    uint8_t* p = host.data_ptr<uint8_t>();
    std::memcpy(p, sv.data(), count * sizeof(T));
    std::memset(p + count * sizeof(T), 0, (k - count) * sizeof(T));
    int32_t* ip = reinterpret_cast<int32_t*>(p + k * sizeof(T));
    std::memcpy(ip, si.data(), count * 4);
    std::fill(ip + count, ip + k, -1);
    if (!wire.device().is_cpu()) wire.copy_(host);
  }

  int64_t unpack(const at::Tensor& wire) {
    auto host = wire.device().is_cpu() ? wire : wire.cpu();
    const uint8_t* p = host.const_data_ptr<uint8_t>();
    const int32_t* ip = reinterpret_cast<const int32_t*>(p + k * sizeof(T));
    int64_t n = 0;
    while (n < k && ip[n] >= 0) ++n;
    rv.resize(k);
    ri.resize(k);
    std::memcpy(rv.data(), p, n * sizeof(T));
    std::memcpy(ri.data(), ip, n * 4);
    return n;
  }

  void merge_received(int64_t n) {
    // Merge into the spare buffers, then swap: the old set's storage becomes next round's spare.
    ov.resize(std::min<int64_t>(k, count + n));
    oi.resize(ov.size());
    count = kernels::merge_topk_raw<T>(sv.data(), si.data(), count, rv.data(), ri.data(), n, k, ov.data(),
                                       oi.data(), mv, mi, order);
    sv.swap(ov);
    si.swap(oi);
    sv.resize(count);
    si.resize(count);
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> gtopk_allreduce(const ProcessGroupPtr& pg, const at::Tensor& values,
                                                   const at::Tensor& indices, int64_t k, bool exact) {
  kernels::check_sparse_args(values, indices, -1, "gtopk_allreduce");
  BL_CHECK(k >= 0, "gtopk_allreduce: k must be >= 0, got ", k);
  const int64_t P = pg->getSize(), me = pg->getRank();
  const auto dev = values.device();
  at::Tensor out_v, out_i;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "gtopk_allreduce", [&] {
    using T = scalar_t;
    GTopK<T> g{pg, k, dev};
    // Local canonical set (kept whole for exact=true), then trimmed to k.
    auto hv = values.cpu().contiguous();
    auto hi = indices.cpu().contiguous();
    std::vector<T> lv(hv.const_data_ptr<T>(), hv.const_data_ptr<T>() + hv.numel());
    std::vector<int32_t> li(hi.const_data_ptr<int32_t>(), hi.const_data_ptr<int32_t>() + hi.numel());
    std::vector<T> vs;
    std::vector<int32_t> is;
    const int64_t ln = kernels::normalize_raw<T>(lv.data(), li.data(), lv.size(), g.order, vs, is);
    g.sv.resize(std::min<int64_t>(k, ln));
    g.si.resize(g.sv.size());
    g.count = kernels::merge_topk_raw<T>(lv.data(), li.data(), ln, nullptr, nullptr, 0, k, g.sv.data(), g.si.data(),
                                         g.mv, g.mi, g.order);

    if (P > 1 && k > 0) {
      int64_t core = 1;
      while (core * 2 <= P) core *= 2;
      const int64_t msg = g.msg_bytes();
      auto send = scratch_bytes(Slot::kSend, msg, dev);
      auto recv = scratch_bytes(Slot::kRecv, msg, dev);
      int tag = 0;
      // Fold the extra ranks into the core.
      if (me >= core) {
        g.pack(send);
        pg_send(pg, send, me - core, tag);
      } else if (me + core < P) {
        pg_recv(pg, recv, me + core, tag);
        g.merge_received(g.unpack(recv));
      }
      ++tag;
      // Recursive doubling inside the core.
      if (me < core) {
        for (int64_t dist = 1; dist < core; dist *= 2, ++tag) {
          g.pack(send);
          pg_exchange(pg, send, recv, me ^ dist, tag);
          g.merge_received(g.unpack(recv));
        }
      }
      tag = 1 << 20;
      // Unfold: hand the result back.
      if (me >= core) {
        pg_recv(pg, recv, me - core, tag);
        g.count = g.unpack(recv);
        g.sv.assign(g.rv.begin(), g.rv.begin() + g.count);
        g.si.assign(g.ri.begin(), g.ri.begin() + g.count);
      } else if (me + core < P) {
        g.pack(send);
        pg_send(pg, send, me + core, tag);
      }
    }

    out_i = at::from_blob(g.si.data(), {g.count}, at::TensorOptions().dtype(at::kInt)).clone();
    out_v = at::from_blob(g.sv.data(), {g.count}, at::TensorOptions().dtype(values.scalar_type())).clone();
    if (exact && g.count > 0) {
      // Each rank's own value at every selected index (0 where it had none), summed over ranks.
      T* ov = out_v.data_ptr<T>();
      for (int64_t j = 0; j < g.count; ++j) {
        auto it = std::lower_bound(li.begin(), li.begin() + ln, g.si[j]);
        ov[j] = (it != li.begin() + ln && *it == g.si[j]) ? lv[it - li.begin()] : T(0);
      }
      out_v = out_v.to(dev);
      pg_allreduce_sum(pg, out_v);
    }
  });
  return {out_v.to(dev), out_i.to(dev)};
}

}  // namespace collectives
}  // namespace bagua_lite
