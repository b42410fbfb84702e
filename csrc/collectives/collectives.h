// Primitive collectives over a c10d::ProcessGroup (gloo on CPU, NCCL on GPU). Each is synchronous:
// it returns when its result is in place, so a caller that issues them in one order on every rank can
// never have two of them in flight out of order. Each is implemented in its own file. The one
// exception is allreduce_start/allreduce_finish, which the engine uses to keep several buckets'
// allreduces in flight; it still posts them in bucket order, which is all gloo and NCCL need to match.
#pragma once

#include <ATen/ATen.h>
#include <string>
#include <tuple>

#include "common.h"
#include "compat.h"

namespace bagua_lite {
namespace collectives {

// Dense allreduce in place; average=true divides by the group size.
void allreduce(const ProcessGroupPtr& pg, at::Tensor& t, bool average);

// The same in two halves, for the engine: start the sum (returns its work, or nullptr when there is
// nothing to send: P == 1 or an empty tensor) and, once that work completed, finish (the average).
c10::intrusive_ptr<c10d::Work> allreduce_start(const ProcessGroupPtr& pg, at::Tensor& t, bool average);
void allreduce_finish(const ProcessGroupPtr& pg, at::Tensor& t, bool average);

// Broadcast in place from `src` (a rank of `pg`).
void broadcast(const ProcessGroupPtr& pg, at::Tensor& t, int64_t src);

// BAGUA's centralized low-precision allreduce: compress P chunks, all-to-all, decompress and reduce the
// own chunk, recompress, allgather, decompress. Identical result on every rank. With `residual` (same
// shape as t) the sender compresses t + residual and keeps what compression lost in `residual`.
void compressed_allreduce(const ProcessGroupPtr& pg, at::Tensor& t, const std::string& compression, bool average,
                          const std::optional<at::Tensor>& residual = std::nullopt);

// TopKAllReduce: allgather of packed (k values, k int32 indices) buffers, scatter-summed into a dense
// tensor of `numel` elements (written into `out` when given). Ranks may hold different k.
at::Tensor sparse_allreduce(const ProcessGroupPtr& pg, const at::Tensor& values, const at::Tensor& indices,
                            int64_t numel, std::optional<at::Tensor> out = std::nullopt);

// The same exchange without the sum: every rank's pairs concatenated in rank order (sum of the ks long).
// A caller that keeps its dense result between calls scatters these itself and later clears only them.
// `out_values` / `out_indices` (optional): buffers the caller keeps across calls; the result is written into
// their first elements where they are long enough (common.h's result_buffer), so a step allocates nothing.
std::tuple<at::Tensor, at::Tensor> sparse_allgather(const ProcessGroupPtr& pg, const at::Tensor& values,
                                                    const at::Tensor& indices, int64_t k = -1,
                                                    const std::optional<at::Tensor>& out_values = std::nullopt,
                                                    const std::optional<at::Tensor>& out_indices = std::nullopt,
                                                    bool verify = true);

// Global Top-k by recursive doubling (sum semantics). Returns a canonical set (ascending indices) of at
// most k entries, bit-identical on all ranks. exact=true replaces each value by the exact sum over ranks.
// numel (>= 0: the dense length) lets the indices travel as a bitmap where that is smaller; value_bits = 4
// sends 4-bit values (a scale per 64) and overwrites `values` with what of this rank's contribution the
// result kept. out_values / out_indices: as sparse_allgather's. canonical: the caller guarantees that the
// input is a canonical set of exactly k entries (unchecked); for the plain message (value_bits 0, an index
// list, not exact, no final union) the rounds then run in tensor ops where the tensors lie, reading nothing
// back (a GPU's: no host copy), with the same messages and result as otherwise.
std::tuple<at::Tensor, at::Tensor> gtopk_allreduce(const ProcessGroupPtr& pg, const at::Tensor& values,
                                                   const at::Tensor& indices, int64_t k, bool exact,
                                                   int64_t numel = -1, int64_t value_bits = 0,
                                                   bool final_union = false,
                                                   const std::optional<at::Tensor>& out_values = std::nullopt,
                                                   const std::optional<at::Tensor>& out_indices = std::nullopt,
                                                   bool canonical = false);

// The partner of `rank` at `step` in the shift_one schedule (one partner that rotates with `step`; a
// round-robin schedule, one rank idle per step when P is odd), or -1 if it sits this step out.
int64_t shift_one_partner(int64_t rank, int64_t size, int64_t step);

// ---- thin wrappers around the process group that also count traffic -----------------------------------
void pg_allreduce_sum(const ProcessGroupPtr& pg, at::Tensor& t);
// Posts the sum and returns its work without waiting (nullptr: nothing to do).
c10::intrusive_ptr<c10d::Work> pg_allreduce_sum_start(const ProcessGroupPtr& pg, at::Tensor& t);
// out has P * in.numel() elements; rank r's input lands at out[r*n:(r+1)*n].
void pg_allgather(const ProcessGroupPtr& pg, at::Tensor& out, at::Tensor& in);
// The same result from P-1 sends and P-1 receives all posted at once (same bytes as the ring, one message
// latency instead of P-1): for the small messages of sparse collectives. `tag`: a point-to-point tag.
void pg_allgather_direct(const ProcessGroupPtr& pg, at::Tensor& out, at::Tensor& in, int tag);
// Send `send` to `peer` and receive `recv` from `peer` at the same time (both posted before waiting).
void pg_exchange(const ProcessGroupPtr& pg, at::Tensor& send, at::Tensor& recv, int64_t peer, int tag);
void pg_send(const ProcessGroupPtr& pg, at::Tensor& t, int64_t peer, int tag);
void pg_recv(const ProcessGroupPtr& pg, at::Tensor& t, int64_t peer, int tag);

}  // namespace collectives
}  // namespace bagua_lite
