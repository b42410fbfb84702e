// Centralized low-precision allreduce (BAGUA's ByteGrad / fp16 path), as a reduce-scatter followed by
// an allgather, both on compressed chunks:
//   1. split t into P chunks (sizes differ by at most one element) and compress each;
//   2. all-to-all: rank r receives every rank's compressed chunk r;
//   3. decompress and sum them (divide by P for the average) into chunk r;
//   4. recompress chunk r and allgather it (padded to the largest chunk's wire size);
//   5. decompress every chunk into t, including our own from its compressed bytes, so all ranks
//      end with bit-identical tensors.
// With `residual` (error feedback on the sender, as in EF-SGD / 1-bit Adam): step 1 compresses
// chunk + residual instead, and leaves in `residual` what that compression lost, to be sent next time.
// Wire bytes per rank: (P-1)/P * wire(n) in step 2 plus (P-1) * wire(ceil(n/P)) in step 4.
#include "collectives/collectives.h"
#include "kernels/compress.h"

namespace bagua_lite {
namespace collectives {

void compressed_allreduce(const ProcessGroupPtr& pg, at::Tensor& t, const std::string& compression, bool average,
                          const std::optional<at::Tensor>& residual) {
  const auto& codec = kernels::get_compressor(compression);
  check_contiguous(t, "compressed_allreduce", "t");
  check_floating(t, "compressed_allreduce", "t");
  if (residual) {
    check_contiguous(*residual, "compressed_allreduce", "residual");
    BL_CHECK(residual->numel() == t.numel() && residual->scalar_type() == t.scalar_type() &&
                 residual->device() == t.device(),
             "compressed_allreduce: `residual` must match t (", t.numel(), " x ", t.scalar_type(), " on ",
             t.device(), "), got ", residual->numel(), " x ", residual->scalar_type(), " on ", residual->device());
  }
  const int64_t P = pg->getSize(), me = pg->getRank(), n = t.numel();
  if (P == 1) return;  // nothing to exchange, so nothing to round
  auto flat = t.view(-1);
  auto chunk_begin = [&](int64_t i) { return i * (n / P) + std::min(i, n % P); };
  auto chunk_len = [&](int64_t i) { return n / P + (i < n % P ? 1 : 0); };

  // 1. Compress all chunks into one send buffer.
  std::vector<int64_t> send_splits(P), recv_splits(P, codec.wire_bytes(chunk_len(me)));
  int64_t send_total = 0;
  for (int64_t i = 0; i < P; ++i) send_total += (send_splits[i] = codec.wire_bytes(chunk_len(i)));
  auto send = scratch_bytes(Slot::kSend, send_total, t.device());
  int64_t off = 0;
  for (int64_t i = 0; i < P; ++i) {
    auto dst = send.narrow(0, off, send_splits[i]);
    auto chunk = flat.narrow(0, chunk_begin(i), chunk_len(i));
    if (residual) {
      auto r = residual->view(-1).narrow(0, chunk_begin(i), chunk_len(i));
      if (!codec.compress_with_residual(chunk, r, dst)) {  // fused where a device kernel does it
        chunk.add_(r);                                     // what we owe plus what is new
        codec.compress(chunk, dst);
        codec.decompress(dst, r, /*accumulate=*/false);   // what the receivers will read...
        at::sub_out(r, chunk, r);                          // ...and what they will not: the new residual
      }
    } else {
      codec.compress(chunk, dst);
    }
    off += send_splits[i];
  }

  // 2. All-to-all of compressed chunks.
  const int64_t piece = recv_splits[0];
  auto recv = scratch_bytes(Slot::kRecv, piece * P, t.device());
  wait(compat::all_to_all_single(*pg, recv, send, recv_splits, send_splits));
  count_sent(send_total - send_splits[me], P - 1);

  // 3. Reduce our chunk from the decompressed pieces (rank order, so deterministic).
  auto mine = flat.narrow(0, chunk_begin(me), chunk_len(me));
  for (int64_t r = 0; r < P; ++r) codec.decompress(recv.narrow(0, r * piece, piece), mine, /*accumulate=*/r > 0);
  if (average) mine.div_(P);

  // 4. Recompress and allgather (every slot padded to the largest chunk's wire size).
  const int64_t slot = codec.wire_bytes(chunk_len(0));
  auto own = scratch_bytes(Slot::kAux, slot, t.device());
  auto own_wire = own.narrow(0, 0, piece);
  codec.compress(mine, own_wire);
  auto gathered = scratch_bytes(Slot::kAux2, slot * P, t.device());
  pg_allgather(pg, gathered, own);

  // 5. Decompress every chunk, ours included.
  for (int64_t r = 0; r < P; ++r) {
    auto chunk = flat.narrow(0, chunk_begin(r), chunk_len(r));
    codec.decompress(gathered.narrow(0, r * slot, codec.wire_bytes(chunk_len(r))), chunk, /*accumulate=*/false);
  }
}

}  // namespace collectives
}  // namespace bagua_lite
