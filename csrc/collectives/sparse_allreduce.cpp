// TopKAllReduce (gTop-k paper, Algorithm 1's baseline): every rank contributes its own (value, index)
// pairs; one allgather moves them all; each rank scatter-sums them into a dense tensor.
// Message: [k_max values][k_max int32 indices], padded to the largest k in the group, so a rank sends
// (P-1) * k_max * (sizeof(value) + 4) bytes. A tiny allgather of (k, numel, dtype) comes first so that
// ranks may hold different k and mismatched arguments fail with a clear error on every rank.
// sparse_allgather is the same exchange returning the concatenated pairs (rank order) instead of the sum.
// Given k (the same on every rank by the caller's construction, e.g. Top-k's density times the bucket
// size), it skips the meta allgather: one exchange instead of two, so one wait for the slowest rank
// instead of two per bucket. Each block then starts with a 16-byte header (k, dtype) that every receiver
// checks (`verify`; on a GPU the check is a device-to-host read, so a caller whose exchange repeats one
// already verified, the same k and dtype on the same group, passes false); a peer sending more bytes than k
// pairs makes gloo abort the receiver (its size check).
#include <ATen/Dispatch.h>

#include <cstring>

#include "collectives/collectives.h"
#include "kernels/sparse.h"

namespace bagua_lite {
namespace collectives {

namespace {

// Point-to-point tags of the two exchanges (gtopk_allreduce uses 0.. and 1 << 20).
constexpr int kTagMeta = (1 << 21) + 1, kTagBlocks = (1 << 21) + 2;

// Bytes of a received block as dtype t. A block's values or indices do not always start at a multiple of
// the element size (float64 or 16-bit values with an odd k, a header before them): view the bytes in
// place when aligned, else from an aligned copy.
at::Tensor typed(const at::Tensor& bytes, at::ScalarType t) {
  return bytes.storage_offset() % at::elementSize(t) == 0 ? bytes.view(t) : bytes.clone().view(t);
}

// The exchange both entry points share: the meta allgather (k, numel, dtype of every rank, checked), then
// one allgather of the packed blocks. Both are direct (every pair at once, pg_allgather_direct): the
// messages are small, so the P-1 sequential hops of a ring allgather would cost P-1 latencies each.
// Calls `each(r, values_r, indices_r)` in rank order.
template <class Each>
void gather_blocks(const ProcessGroupPtr& pg, const at::Tensor& values, const at::Tensor& indices, int64_t numel,
                   const char* fn, std::vector<int64_t>& ks, Each each, int64_t fixed_k = -1,
                   bool verify = true) {
  const int64_t P = pg->getSize(), me = pg->getRank();
  const auto dev = values.device();
  const int64_t elem = values.element_size();
  const int64_t k = values.numel();
  // Sizes: told (fixed_k; each block then starts with a (k, dtype) header, checked on receipt), or the
  // meta exchange of (k, numel, dtype) of every rank.
  int64_t kmax = 0, hdr = 0;
  const int64_t head[2] = {k, static_cast<int64_t>(values.scalar_type())};
  if (fixed_k >= 0) {
    BL_CHECK(k == fixed_k, fn, ": k=", fixed_k, " but this rank (", me, ") passes ", k,
             " values; with k given, every rank sends exactly k pairs");
  }
  if (P == 1) {  // its own pairs, as they are: nothing to check against a peer, nothing to copy or read back
    ks.assign(1, k);
    if (k > 0) each(0, values, indices);
    return;
  }
  if (fixed_k >= 0) {
    ks.assign(P, fixed_k);
    kmax = fixed_k;
    hdr = sizeof(head);  // k = 0 still exchanges the headers: a peer that holds pairs is caught, not awaited
  } else {
    auto meta = at::tensor({k, numel, head[1]}, at::TensorOptions().dtype(at::kLong)).to(dev);
    auto metas = at::empty({P * 3}, meta.options());
    pg_allgather_direct(pg, metas, meta, kTagMeta);
    auto m = metas.cpu();
    const int64_t* mp = m.const_data_ptr<int64_t>();
    ks.assign(P, 0);
    for (int64_t r = 0; r < P; ++r) {
      BL_CHECK(mp[3 * r + 1] == numel, fn, ": rank ", me, " has numel=", numel, " but rank ", r, " has ",
               mp[3 * r + 1], "; all ranks must pass the same numel");
      BL_CHECK(mp[3 * r + 2] == mp[2], fn, ": rank ", r, " sends values of dtype ",
               static_cast<at::ScalarType>(mp[3 * r + 2]), " but rank 0 sends ", static_cast<at::ScalarType>(mp[2]),
               "; all ranks must use one dtype");
      ks[r] = mp[3 * r];
      kmax = std::max(kmax, ks[r]);
    }
    if (kmax == 0) return;
  }

  // Pack: [header] values then indices, padded to kmax.
  const int64_t msg = hdr + kmax * (elem + 4);
  auto send = scratch_bytes(Slot::kSend, msg, dev);
  if (hdr) {  // written by the device (a copy from host memory would wait for it on a GPU)
    auto words = send.narrow(0, 0, hdr).view(at::kLong);  // (the scratch buffer starts aligned)
    words.narrow(0, 0, 1).fill_(head[0]);
    words.narrow(0, 1, 1).fill_(head[1]);
  }
  send.narrow(0, hdr, k * elem).copy_(values.view(at::kByte));
  send.narrow(0, hdr + kmax * elem, k * 4).copy_(indices.view(at::kByte));
  auto recv = scratch_bytes(Slot::kRecv, msg * P, dev);
  pg_allgather_direct(pg, recv, send, kTagBlocks);

  if (hdr && verify) {
    auto heads = recv.view({P, msg}).narrow(1, 0, hdr).cpu().contiguous();
    const uint8_t* hp = heads.const_data_ptr<uint8_t>();
    for (int64_t r = 0; r < P; ++r) {
      int64_t h[2];
      std::memcpy(h, hp + r * hdr, hdr);
      BL_CHECK(h[0] == fixed_k && h[1] == head[1], fn, ": rank ", r, " sent k=", h[0], " pairs of dtype ",
               static_cast<at::ScalarType>(h[1]), " but this rank (", me, ") expects k=", fixed_k, " of dtype ",
               values.scalar_type(), "; with k given, every rank must send exactly k pairs of one dtype");
    }
  }
  for (int64_t r = 0; r < P; ++r) {
    const int64_t kr = ks[r];
    if (kr == 0) continue;
    auto base = recv.narrow(0, r * msg + hdr, msg - hdr);
    each(r, typed(base.narrow(0, 0, kr * elem), values.scalar_type()),
         typed(base.narrow(0, kmax * elem, kr * 4), at::kInt));
  }
}

}  // namespace

at::Tensor sparse_allreduce(const ProcessGroupPtr& pg, const at::Tensor& values, const at::Tensor& indices,
                            int64_t numel, std::optional<at::Tensor> out) {
  if (out.has_value()) {
    check_contiguous(*out, "sparse_allreduce", "out");
    check_floating(*out, "sparse_allreduce", "out");
    BL_CHECK(out->numel() == numel, "sparse_allreduce: `out` has ", out->numel(), " elements but numel=", numel);
    BL_CHECK(out->device() == values.device(), "sparse_allreduce: `out` is on ", out->device(),
             " but `values` is on ", values.device());
  }
  BL_CHECK(numel >= 0, "sparse_allreduce: numel must be >= 0, got ", numel);
  kernels::check_sparse_args(values, indices, numel, "sparse_allreduce");
  // Writing into the caller's buffer avoids a fresh numel-sized allocation (and its page faults) per call.
  at::Tensor dense = out.has_value() ? out->zero_() : at::zeros({numel}, values.options());
  std::vector<int64_t> ks;
  // Scatter-sum in rank order: the same order on every rank, so the same bits everywhere.
  gather_blocks(pg, values, indices, numel, "sparse_allreduce", ks,
                [&](int64_t, const at::Tensor& v, const at::Tensor& i) { kernels::scatter_add_(dense, v, i); });
  return dense;
}

std::tuple<at::Tensor, at::Tensor> sparse_allgather(const ProcessGroupPtr& pg, const at::Tensor& values,
                                                    const at::Tensor& indices, int64_t k,
                                                    const std::optional<at::Tensor>& out_values,
                                                    const std::optional<at::Tensor>& out_indices, bool verify) {
  kernels::check_sparse_args(values, indices, -1, "sparse_allgather");
  BL_CHECK(k >= -1, "sparse_allgather: k must be >= 0 (or -1: ranks may differ), got ", k);
  std::vector<int64_t> ks;
  std::vector<at::Tensor> vs, is;
  gather_blocks(pg, values, indices, -1, "sparse_allgather", ks, [&](int64_t, const at::Tensor& v, const at::Tensor& i) {
    vs.push_back(v);
    is.push_back(i);
  }, k, verify);
  int64_t total = 0;
  for (const auto& v : vs) total += v.numel();
  auto ov = result_buffer(out_values, total, values.options(), "sparse_allgather", "out_values");
  auto oi = result_buffer(out_indices, total, indices.options(), "sparse_allgather", "out_indices");
  if (!vs.empty()) {
    at::cat_out(ov, vs);
    at::cat_out(oi, is);
  }
  return {ov, oi};
}

}  // namespace collectives
}  // namespace bagua_lite
