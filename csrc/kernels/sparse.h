// Sparse (value, int32 index) sets and the operations gTop-k and error feedback need.
// A *canonical* sparse set has strictly ascending indices (no duplicates); its values may be any
// floating dtype. Merging two canonical sets sums values on equal indices and keeps the k entries of
// largest magnitude, ties broken by lower index, and returns them canonical. The merge is symmetric
// bit-for-bit (a + b == b + a in IEEE arithmetic), which is what makes every gTop-k rank end with the
// identical set.
#pragma once

#include <ATen/ATen.h>
#include <cstdint>
#include <tuple>
#include <vector>

namespace bagua_lite {
namespace kernels {

// Raw-pointer forms used inside collectives (no allocation beyond the caller's scratch).
template <typename T>
int64_t normalize_raw(T* values, int32_t* indices, int64_t n, std::vector<int64_t>& order_scratch,
                      std::vector<T>& vscratch, std::vector<int32_t>& iscratch);
template <typename T>
int64_t merge_topk_raw(const T* av, const int32_t* ai, int64_t na, const T* bv, const int32_t* bi, int64_t nb,
                       int64_t k, T* ov, int32_t* oi, std::vector<T>& mv, std::vector<int32_t>& mi,
                       std::vector<int64_t>& order_scratch);
// Step 2 of merge_topk_raw: of a canonical set (mv, mi) of m entries, the k largest by magnitude (ties: lower
// index) into (ov, oi), canonical; returns their count.
template <typename T>
int64_t keep_topk_raw(T* mv, const int32_t* mi, int64_t m, int64_t k, T* ov, int32_t* oi,
                      std::vector<int64_t>& order_scratch);

// A set of indices as one bit per position: bit i % 64 of bits[i / 64] for each of idx[0, n), all in
// [0, 64 words). A membership test per index, where a walk over two sorted lists mispredicts its branches.
inline void index_bits(std::vector<uint64_t>& bits, int64_t words, const int32_t* idx, int64_t n) {
  bits.assign(words, 0);
  for (int64_t j = 0; j < n; ++j) bits[idx[j] >> 6] |= uint64_t(1) << (idx[j] & 63);
}
inline bool has_index_bit(const std::vector<uint64_t>& bits, int32_t i) { return (bits[i >> 6] >> (i & 63)) & 1; }

// Tensor forms (Python `bagua_lite.kernels`).
// Sort by index and sum duplicates: returns a canonical set.
std::tuple<at::Tensor, at::Tensor> sparse_normalize(const at::Tensor& values, const at::Tensor& indices);
// Merge two canonical sets, keep the top k by magnitude (ties: lower index). Returns a canonical set.
std::tuple<at::Tensor, at::Tensor> merge_topk(const at::Tensor& av, const at::Tensor& ai, const at::Tensor& bv,
                                              const at::Tensor& bi, int64_t k);
// dense[indices[j]] += values[j], in order of j (deterministic). Indices must lie in [0, dense.numel()).
void scatter_add_(at::Tensor& dense, const at::Tensor& values, const at::Tensor& indices);
// Error feedback: residual already holds (gradient + old residual); remove the entries that were sent.
// With `kept` (int32, strictly ascending: gTop-k's global set), only the entries of `indices` that `kept` also
// holds are zeroed: what this rank sent and the global result kept.
void ef_remove_(at::Tensor& residual, const at::Tensor& indices, const at::Tensor& kept = {});

// Non-finite detection without a tensor-sized temporary (float32 CPU: one vectorised pass over the
// exponent bits; other dtypes/devices fall back to ATen).
// all_finite(x): no inf and no NaN in x.
bool all_finite(const at::Tensor& x);
// dst = src * scale in one pass (src may be dst itself; src undefined: dst = 0) and whether src was all
// finite. Used where a gradient goes into its bucket slot anyway, so the check costs no extra pass.
bool scale_checked(at::Tensor& dst, const at::Tensor& src, double scale);
// scale_checked whose answer stays on dst's device: `flag` (one int32 on that device) is set to 1 if src held
// inf/NaN and left as it is otherwise. Nothing is read back, so on a GPU the hook that calls it does not
// wait for the device; the flag is read once per round, at the agreement.
void scale_flagged_(at::Tensor& dst, const at::Tensor& src, double scale, at::Tensor& flag);
// dst = src (same dtype, numel and device, both contiguous) only if any of `flags` (int32 on that device) is
// nonzero; otherwise nothing. Nothing is read back: on a GPU every block reads the flags and returns at once
// when none is set, so a round whose agreed verdict is clear pays one launch (the state a discarded round
// put back, bagua_lite/verdict.py).
void copy_flagged_(at::Tensor& dst, const at::Tensor& src, const at::Tensor& flags);
// Block maxima, for kernels::topk_out's block_max: an int32 tensor with one slot per 64 elements of a bucket
// (slot b covers bucket positions [64 b, 64 b + 64)). Writers given one (block_max and block_offset, the
// position of their output's first element in the bucket) max-combine the magnitude key of every element
// they write (its float32 bits with the sign cleared) into the slots: after zeroing the slots and writing
// every element of a bucket, each slot holds its block's largest key (0x7FFFFFFF, above every key, for a
// block holding an inf or NaN). A writer whose first pass is redone (a non-finite g) may leave a slot
// higher than that, never lower: the slots stay upper bounds.
constexpr int64_t kBlockMaxElems = 64;
// Max-combines the keys of x (contiguous float32, bucket positions [lo, lo + numel)) into bm.
void block_max_combine_(at::Tensor& bm, const at::Tensor& x, int64_t lo);

// out = a + b when b is all finite (returns true); otherwise out = a and returns false. out may alias a.
// With block_max, out's keys are combined into it (out must then be contiguous float32).
bool add_checked(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& block_max = {},
                 int64_t block_offset = 0);
// Momentum correction and error feedback in one pass: u_out = m u + g (+ wd w), acc_out = residual + u_out,
// and whether g was all finite. g undefined or non-finite: u_out = m u, acc_out = residual + u_out (g is
// left out; returns false if g was given). u_out must not alias u, nor acc_out residual (double buffers).
// With block_max, acc_out's keys are combined into it in the same pass.
bool momentum_add_checked(at::Tensor& u_out, at::Tensor& acc_out, const at::Tensor& u, const at::Tensor& residual,
                          const at::Tensor& g, double m, const at::Tensor& w, double wd,
                          const at::Tensor& block_max = {}, int64_t block_offset = 0);

// add_checked and momentum_add_checked whose answer stays on the device, as scale_flagged_'s: `flag` (one
// int32 on out's device) is set to 1 where they would return false, and the outputs are theirs (a
// non-finite g is left out). On a CPU tensor they run the checked kernels; on a device, ATen ops that
// choose on the device (no block maxima there: those are CPU-only).
void add_flagged_(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& block_max,
                  int64_t block_offset, at::Tensor& flag);
void momentum_add_flagged_(at::Tensor& u_out, at::Tensor& acc_out, const at::Tensor& u, const at::Tensor& residual,
                           const at::Tensor& g, double m, const at::Tensor& w, double wd,
                           const at::Tensor& block_max, int64_t block_offset, at::Tensor& flag);

// SGD's plain update (no momentum, no decay: the caller applied those) at the entries a sparse result
// wrote, instead of a pass over every weight: for each distinct i in indices (int32 bucket positions,
// duplicates applied once), the parameter p whose slot [offsets[p], offsets[p] + numel) holds i gets
// w[i - offsets[p]] -= lrs[p] * flat[i]. Positions outside every slot handed in are left alone; offsets
// ascend and the slots do not overlap.
void sparse_sgd_step_(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
                      const at::Tensor& flat, const at::Tensor& indices, const std::vector<double>& lrs);

// Check values/indices form a valid sparse argument for a tensor of `numel` elements (clear errors).
// contents = false: shapes, dtypes and devices only (the indices' range is left unread, so a device tensor is
// not read back to the host).
void check_sparse_args(const at::Tensor& values, const at::Tensor& indices, int64_t numel, const char* fn,
                       bool contents = true);

}  // namespace kernels
}  // namespace bagua_lite
