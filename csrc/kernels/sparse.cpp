#include "kernels/sparse.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>

#include "common.h"
#include "kernels/cuda.h"
#include "kernels/topk.h"

namespace bagua_lite {
namespace kernels {

namespace {
template <typename T>
inline auto magnitude(T v) {
  using acc_t = at::opmath_type<T>;
  return std::abs(static_cast<acc_t>(v));
}
}  // namespace

template <typename T>
int64_t normalize_raw(T* values, int32_t* indices, int64_t n, std::vector<int64_t>& order,
                      std::vector<T>& vs, std::vector<int32_t>& is) {
  if (n == 0) return 0;
  bool canonical = true;
  for (int64_t j = 1; j < n && canonical; ++j) canonical = indices[j - 1] < indices[j];
  if (canonical) return n;
  order.resize(n);
  std::iota(order.begin(), order.end(), 0);
  // Stable: duplicates are summed in their input order, so the result is deterministic.
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return indices[a] < indices[b]; });
  vs.resize(n);
  is.resize(n);
  int64_t m = 0;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t s = order[j];
    if (m > 0 && is[m - 1] == indices[s]) {
      vs[m - 1] = static_cast<T>(static_cast<at::opmath_type<T>>(vs[m - 1]) + static_cast<at::opmath_type<T>>(values[s]));
    } else {
      vs[m] = values[s];
      is[m] = indices[s];
      ++m;
    }
  }
  std::copy(vs.begin(), vs.begin() + m, values);
  std::copy(is.begin(), is.begin() + m, indices);
  return m;
}

template <typename T>
int64_t merge_topk_raw(const T* av, const int32_t* ai, int64_t na, const T* bv, const int32_t* bi, int64_t nb,
                       int64_t k, T* ov, int32_t* oi, std::vector<T>& mv, std::vector<int32_t>& mi,
                       std::vector<int64_t>& order) {
  using acc_t = at::opmath_type<T>;
  // 1. Two-pointer union, summing equal indices. Branch-free while both sets last: at gTop-k's densities
  //    the two index streams interleave at random, and a branch per entry mispredicted about half the time
  //    (the union was most of a merge's time). Both candidates are computed, the comparisons pick one.
  mv.resize(na + nb);
  mi.resize(na + nb);
  int64_t a = 0, b = 0, m = 0;
  T* __restrict__ uv = mv.data();
  int32_t* __restrict__ ui = mi.data();
  while (a < na && b < nb) {
    const int32_t x = ai[a], y = bi[b];
    const T va = av[a], vb = bv[b];
    const T sum = static_cast<T>(static_cast<acc_t>(va) + static_cast<acc_t>(vb));
    const bool ta = x <= y, tb = y <= x;
    ui[m] = ta ? x : y;
    uv[m] = ta ? (tb ? sum : va) : vb;
    a += ta;
    b += tb;
    ++m;
  }
  std::copy(av + a, av + na, uv + m);
  std::copy(ai + a, ai + na, ui + m);
  m += na - a;
  if (nb > b) {
    std::copy(bv + b, bv + nb, uv + m);
    std::copy(bi + b, bi + nb, ui + m);
    m += nb - b;
  }
  // 2. Keep the k largest by magnitude, ties by lower index.
  return keep_topk_raw<T>(mv.data(), mi.data(), m, k, ov, oi, order);
}

template <typename T>
int64_t keep_topk_raw(T* mv, const int32_t* mi, int64_t m, int64_t k, T* ov, int32_t* oi,
                      std::vector<int64_t>& order) {
  if (m <= k) {
    std::copy(mv, mv + m, ov);
    std::copy(mi, mi + m, oi);
    return m;
  }
  bool nan = false;
  for (int64_t j = 0; j < m; ++j) nan |= magnitude(mv[j]) != magnitude(mv[j]);
  if (!nan) {
    // The top-k kernel's order is this one (position order is index order in the set), and its radix
    // select is linear in m where a comparison select and sort are not: gTop-k merges 2k entries a round.
    // It writes the values and the positions; the positions then become the set's indices.
    const auto dt = c10::CppTypeToScalarType<T>::value;
    auto x = at::from_blob(mv, {m}, at::TensorOptions().dtype(dt));
    auto vals = at::from_blob(ov, {k}, at::TensorOptions().dtype(dt));
    auto pos = at::from_blob(oi, {k}, at::TensorOptions().dtype(at::kInt));
    topk_out(x, k, vals, pos);
    for (int64_t j = 0; j < k; ++j) oi[j] = mi[oi[j]];
    return k;
  }
  order.resize(m);
  std::iota(order.begin(), order.end(), 0);
  // A strict weak order is what nth_element needs (NaN compares false with everything, which breaks it: the
  // result is undefined). NaN ranks above every magnitude, as in the top-k kernel's keys and torch.topk.
  auto better = [&](int64_t x, int64_t y) {
    const auto mx = magnitude(mv[x]), my = magnitude(mv[y]);
    const bool nx = mx != mx, ny = my != my;
    if (nx != ny) return nx;
    if (!nx && mx != my) return mx > my;
    return x < y;  // position order == index order in the set
  };
  std::nth_element(order.begin(), order.begin() + k, order.end(), better);
  std::sort(order.begin(), order.begin() + k);
  for (int64_t j = 0; j < k; ++j) {
    ov[j] = mv[order[j]];
    oi[j] = mi[order[j]];
  }
  return k;
}

#define BL_INSTANTIATE(T)                                                                                   \
  template int64_t normalize_raw<T>(T*, int32_t*, int64_t, std::vector<int64_t>&, std::vector<T>&,          \
                                    std::vector<int32_t>&);                                                 \
  template int64_t merge_topk_raw<T>(const T*, const int32_t*, int64_t, const T*, const int32_t*, int64_t,  \
                                     int64_t, T*, int32_t*, std::vector<T>&, std::vector<int32_t>&,         \
                                     std::vector<int64_t>&);                                                \
  template int64_t keep_topk_raw<T>(T*, const int32_t*, int64_t, int64_t, T*, int32_t*, std::vector<int64_t>&);
BL_INSTANTIATE(float)
BL_INSTANTIATE(double)
BL_INSTANTIATE(at::Half)
BL_INSTANTIATE(at::BFloat16)
#undef BL_INSTANTIATE

void check_sparse_args(const at::Tensor& values, const at::Tensor& indices, int64_t numel, const char* fn,
                       bool contents) {
  check_floating(values, fn, "values");
  check_int32(indices, fn, "indices");
  check_contiguous(values, fn, "values");
  check_contiguous(indices, fn, "indices");
  BL_CHECK(values.dim() == 1 && indices.dim() == 1, fn, ": `values` and `indices` must be 1-D, got shapes ",
           values.sizes(), " and ", indices.sizes());
  BL_CHECK(values.numel() == indices.numel(), fn, ": `values` has ", values.numel(), " elements but `indices` has ",
           indices.numel(), "; they must match");
  BL_CHECK(values.device() == indices.device(), fn, ": `values` is on ", values.device(), " but `indices` is on ",
           indices.device());
  // Indices are never negative (gtopk_allreduce's wire format uses -1 as its end marker); numel < 0 means
  // "no upper bound known here".
  if (contents && indices.numel() > 0) {
    auto idx = indices.device().is_cpu() ? indices : indices.cpu();
    const int32_t* p = idx.const_data_ptr<int32_t>();
    for (int64_t j = 0; j < idx.numel(); ++j) {
      if (numel >= 0) {
        BL_CHECK(p[j] >= 0 && p[j] < numel, fn, ": index ", p[j], " at position ", j, " is out of range [0, ",
                 numel, ")");
      } else {
        BL_CHECK(p[j] >= 0, fn, ": index ", p[j], " at position ", j, " is out of range: indices must be >= 0");
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> sparse_normalize(const at::Tensor& values, const at::Tensor& indices) {
  check_sparse_args(values, indices, -1, "sparse_normalize");
  auto v = values.cpu().clone();
  auto i = indices.cpu().clone();
  int64_t m = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "sparse_normalize", [&] {
    std::vector<int64_t> order;
    std::vector<scalar_t> vs;
    std::vector<int32_t> is;
    m = normalize_raw<scalar_t>(v.data_ptr<scalar_t>(), i.data_ptr<int32_t>(), v.numel(), order, vs, is);
  });
  return {v.narrow(0, 0, m).to(values.device()), i.narrow(0, 0, m).to(indices.device())};
}

static void check_canonical(const at::Tensor& idx, const char* name) {
  const int32_t* p = idx.const_data_ptr<int32_t>();
  for (int64_t j = 1; j < idx.numel(); ++j) {
    BL_CHECK(p[j - 1] < p[j], "merge_topk: `", name, "` must be strictly ascending (canonical); position ", j,
             " has ", p[j], " after ", p[j - 1], ". Use sparse_normalize first");
  }
}

std::tuple<at::Tensor, at::Tensor> merge_topk(const at::Tensor& av, const at::Tensor& ai, const at::Tensor& bv,
                                              const at::Tensor& bi, int64_t k) {
  check_sparse_args(av, ai, -1, "merge_topk");
  check_sparse_args(bv, bi, -1, "merge_topk");
  BL_CHECK(av.scalar_type() == bv.scalar_type(), "merge_topk: value dtypes differ (", av.scalar_type(), " vs ",
           bv.scalar_type(), ")");
  BL_CHECK(k >= 0, "merge_topk: k must be >= 0, got ", k);
  auto a_v = av.cpu(), a_i = ai.cpu(), b_v = bv.cpu(), b_i = bi.cpu();
  check_canonical(a_i, "ai");
  check_canonical(b_i, "bi");
  const int64_t cap = std::min<int64_t>(k, a_v.numel() + b_v.numel());
  auto ov = at::empty({cap}, a_v.options());
  auto oi = at::empty({cap}, a_i.options());
  int64_t m = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a_v.scalar_type(), "merge_topk", [&] {
    std::vector<scalar_t> mv;
    std::vector<int32_t> mi;
    std::vector<int64_t> order;
    m = merge_topk_raw<scalar_t>(a_v.const_data_ptr<scalar_t>(), a_i.const_data_ptr<int32_t>(), a_v.numel(),
                                 b_v.const_data_ptr<scalar_t>(), b_i.const_data_ptr<int32_t>(), b_v.numel(), k,
                                 ov.data_ptr<scalar_t>(), oi.data_ptr<int32_t>(), mv, mi, order);
  });
  return {ov.narrow(0, 0, m).to(av.device()), oi.narrow(0, 0, m).to(ai.device())};
}

void scatter_add_(at::Tensor& dense, const at::Tensor& values, const at::Tensor& indices) {
  check_contiguous(dense, "scatter_add_", "dense");
  check_floating(dense, "scatter_add_", "dense");
  BL_CHECK(dense.device() == values.device(), "scatter_add_: `dense` is on ", dense.device(), " but `values` is on ",
           values.device());
#ifdef BAGUA_LITE_WITH_CUDA
  if (dense.is_cuda() && cuda::enabled()) {
    // the indices' range is not read back (that would wait for the device): the kernel skips a bad one
    check_sparse_args(values, indices, dense.numel(), "scatter_add_", /*contents=*/false);
    cuda::scatter_add(dense, values, indices);
    return;
  }
#endif
  check_sparse_args(values, indices, dense.numel(), "scatter_add_");
  if (!dense.device().is_cpu()) {
    // Without the CUDA kernels (BAGUA_LITE_CUDA_KERNELS=0): the CPU loop on host copies, for the same order
    // of j (index_add_ sums duplicate indices with atomics, in no fixed order).
    auto d = dense.cpu();
    scatter_add_(d, values.cpu(), indices.cpu());
    dense.copy_(d);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dense.scalar_type(), "scatter_add_", [&] {
    using dense_t = scalar_t;
    dense_t* d = dense.data_ptr<dense_t>();
    const int32_t* ip = indices.const_data_ptr<int32_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "scatter_add_values", [&] {
      const scalar_t* vp = values.const_data_ptr<scalar_t>();
      for (int64_t j = 0; j < values.numel(); ++j) {
        d[ip[j]] = static_cast<dense_t>(static_cast<at::opmath_type<dense_t>>(d[ip[j]]) +
                                        static_cast<at::opmath_type<dense_t>>(vp[j]));
      }
    });
  });
}

void ef_remove_(at::Tensor& residual, const at::Tensor& indices, const at::Tensor& kept) {
  check_contiguous(residual, "ef_remove_", "residual");
  check_int32(indices, "ef_remove_", "indices");
  if (kept.defined()) {
    check_int32(kept, "ef_remove_", "kept");
    check_contiguous(kept, "ef_remove_", "kept");
    BL_CHECK(kept.device() == indices.device(), "ef_remove_: `kept` is on ", kept.device(), " but `indices` is on ",
             indices.device());
  }
  if (!residual.device().is_cpu()) {
    // A mask over the k entries, not a boolean index: that would read its count back from the device.
    auto idx = indices.to(at::kLong);
    auto flat = residual.view(-1);
    if (kept.defined()) {
      flat.index_copy_(0, idx, flat.index_select(0, idx).masked_fill_(at::isin(indices, kept), 0));
    } else {
      flat.index_fill_(0, idx, 0);
    }
    return;
  }
  const int64_t n = residual.numel();
  const int32_t* ip = indices.const_data_ptr<int32_t>();
  const int64_t m = indices.numel();
  for (int64_t j = 0; j < m; ++j) {
    BL_CHECK(ip[j] >= 0 && ip[j] < n, "ef_remove_: index ", ip[j], " out of range [0, ", n, ")");
  }
  // `kept` as one bit per position of the residual (kept per thread between calls): a membership test per
  // index, where torch.isin sorts both lists (100 ms for 400K against 400K).
  static thread_local std::vector<uint64_t> bits;
  const bool only_kept = kept.defined();  // (an empty tensor's data pointer may be null)
  if (only_kept) {
    const int32_t* kp = kept.const_data_ptr<int32_t>();
    const int64_t nk = kept.numel();
    for (int64_t j = 0; j < nk; ++j) {
      BL_CHECK(kp[j] >= 0 && kp[j] < n, "ef_remove_: kept index ", kp[j], " out of range [0, ", n, ")");
      BL_CHECK(j == 0 || kp[j - 1] < kp[j], "ef_remove_: `kept` must be strictly ascending; position ", j, " has ",
               kp[j], " after ", kp[j - 1]);
    }
    index_bits(bits, (n + 63) / 64, kp, nk);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, residual.scalar_type(), "ef_remove_", [&] {
    scalar_t* r = residual.data_ptr<scalar_t>();
    for (int64_t j = 0; j < m; ++j) {
      if (!only_kept || has_index_bit(bits, ip[j])) r[ip[j]] = scalar_t(0);
    }
  });
}

namespace {
// inf and NaN are the floats whose exponent bits are all ones. An OR of per-element compare masks is
// a reduction the compiler vectorises with plain SSE2 (a float sum would not be, without fast-math).
inline uint32_t f32_nonfinite_mask(uint32_t bits) {
  return 0u - static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
}
inline bool f32_block_finite(const float* x, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, 4);
    bad |= f32_nonfinite_mask(bits);
  }
  return bad == 0;
}
constexpr int64_t kBlock = 1 << 16;

bool fast_f32(const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(); }
}  // namespace

bool all_finite(const at::Tensor& x) {
  if (!fast_f32(x)) return at::isfinite(x).all().item<bool>();
  const float* p = x.const_data_ptr<float>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; i += kBlock)  // blocks: stop early at the first non-finite block
    if (!f32_block_finite(p + i, std::min(kBlock, n - i))) return false;
  return true;
}

namespace {
// dst = src * scale with ATen ops (any dtypes and devices; src may be dst).
void scale_into(at::Tensor& dst, const at::Tensor& src, double scale) {
  if (src.data_ptr() == dst.data_ptr()) {
    if (scale != 1.0) dst.mul_(scale);
  } else if (scale != 1.0) {
    at::mul_out(dst, src.view_as(dst), scale);
  } else {
    dst.copy_(src.view_as(dst));
  }
}
}  // namespace

bool scale_checked(at::Tensor& dst, const at::Tensor& src, double scale) {
  if (!src.defined()) {
    dst.zero_();
    return true;
  }
  if (!fast_f32(dst) || !fast_f32(src)) {
    bool ok = all_finite(src);
    scale_into(dst, src, scale);
    return ok;
  }
  TORCH_CHECK(dst.numel() == src.numel(), "scale_checked: dst has ", dst.numel(), " elements, src ", src.numel());
  const float* s = src.const_data_ptr<float>();
  float* d = dst.data_ptr<float>();
  const float f = static_cast<float>(scale);
  const int64_t n = dst.numel();
  // One loop: scale and fold the exponent bits of the source into an unsigned max (vectorised).
  if (s == d && f == 1.0f) return all_finite(src);
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, s + i, 4);
    bad |= f32_nonfinite_mask(bits);
    d[i] = s[i] * f;
  }
  return bad == 0;
}

namespace {
void check_flag(const at::Tensor& flag, const at::Tensor& out, const char* fn) {
  BL_CHECK(flag.scalar_type() == at::kInt && flag.numel() == 1 && flag.device() == out.device(), fn,
           ": `flag` must be one int32 on ", out.device(), ", got ", flag.numel(), " ", flag.scalar_type(), " on ",
           flag.device());
}

// g's verdict folded into the flag on the device; the 0-d bool it returns chooses the outputs there.
at::Tensor fold_nonfinite(const at::Tensor& g, at::Tensor& flag) {
  at::Tensor bad = at::logical_not(at::isfinite(g).all());
  flag.copy_(at::maximum(flag, bad.to(at::kInt)));
  return bad;
}
}  // namespace

void scale_flagged_(at::Tensor& dst, const at::Tensor& src, double scale, at::Tensor& flag) {
  check_flag(flag, dst, "scale_flagged_");
  if (!src.defined()) {
    dst.zero_();
    return;
  }
  if (dst.is_cpu()) {
    if (!scale_checked(dst, src, scale)) flag.fill_(1);
    return;
  }
  BL_CHECK(dst.numel() == src.numel() && src.device() == dst.device(), "scale_flagged_: dst has ", dst.numel(),
           " elements on ", dst.device(), ", src ", src.numel(), " on ", src.device());
#ifdef BAGUA_LITE_WITH_CUDA
  if (dst.is_cuda() && cuda::enabled() && dst.scalar_type() == at::kFloat && src.scalar_type() == at::kFloat &&
      dst.is_contiguous() && src.is_contiguous()) {
    cuda::scale_flagged(dst, src, scale, flag);
    return;
  }
#endif
  // Other dtypes or devices: ATen ops, in scale_checked's arithmetic, the answer folded into the flag there.
  fold_nonfinite(src, flag);
  scale_into(dst, src, scale);
}

void copy_flagged_(at::Tensor& dst, const at::Tensor& src, const at::Tensor& flags) {
  BL_CHECK(flags.scalar_type() == at::kInt && flags.device() == dst.device() && flags.is_contiguous(),
           "copy_flagged_: `flags` must be contiguous int32 on ", dst.device(), ", got ", flags.scalar_type(), " on ",
           flags.device());
  BL_CHECK(src.scalar_type() == dst.scalar_type() && src.numel() == dst.numel() && src.device() == dst.device() &&
               src.is_contiguous() && dst.is_contiguous(),
           "copy_flagged_: dst and src must be contiguous, of one dtype, size and device; got ", dst.numel(), " ",
           dst.scalar_type(), " on ", dst.device(), " and ", src.numel(), " ", src.scalar_type(), " on ", src.device());
  if (dst.is_cpu()) {  // the flags are host memory: no wait
    const int32_t* f = flags.const_data_ptr<int32_t>();
    if (std::any_of(f, f + flags.numel(), [](int32_t v) { return v != 0; })) dst.copy_(src);
    return;
  }
#ifdef BAGUA_LITE_WITH_CUDA
  if (dst.is_cuda() && cuda::enabled()) {
    cuda::copy_flagged(dst, src, flags);
    return;
  }
#endif
  dst.copy_(at::where(flags.ne(0).any(), src, dst));  // other devices: chosen on the device, a whole pass
}

namespace {
// Block maxima (see sparse.h): block b of a bucket is its elements [64 b, 64 b + 64).
BL_ALWAYS_INLINE uint32_t f32_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return bits;
}
BL_ALWAYS_INLINE uint32_t f32_key(float v) { return f32_bits(v) & 0x7FFFFFFFu; }
// A block's bound from the float max of its |a| and an OR of its non-finite masks: the loops take a float
// max (SSE2 has one; an unsigned integer max needs SSE4.1, and the build targets the baseline ISA). An
// inf/NaN gives the largest key, so topk still sees (and rejects) a NaN.
BL_ALWAYS_INLINE uint32_t bound_key(float max_abs, uint32_t nonfinite) {
  return nonfinite ? 0x7FFFFFFFu : f32_key(max_abs);
}

struct BlockMax {
  int32_t* bm = nullptr;  // null: no block maxima wanted
  int64_t lo = 0;         // the slice's first element, as a bucket position
};

BlockMax check_block_max(const at::Tensor& bm, int64_t lo, const at::Tensor& out, const char* fn) {
  if (!bm.defined()) return {};
  TORCH_CHECK(bm.device().is_cpu() && bm.scalar_type() == at::kInt && bm.is_contiguous(), fn,
              ": block_max must be a contiguous CPU int32 tensor, got ", bm.scalar_type(), " on ", bm.device());
  TORCH_CHECK(fast_f32(out), fn, ": block_max needs a contiguous CPU float32 output, got ", out.scalar_type(), " on ",
              out.device());
  TORCH_CHECK(lo >= 0, fn, ": block_offset must be >= 0, got ", lo);
  const int64_t need = (lo + out.numel() + kBlockMaxElems - 1) / kBlockMaxElems;
  TORCH_CHECK(bm.numel() >= need, fn, ": block_max has ", bm.numel(), " blocks; elements [", lo, ", ",
              lo + out.numel(), ") of the bucket need ", need, " (one per ", kBlockMaxElems, " elements)");
  return {bm.data_ptr<int32_t>(), lo};
}

// Runs body(i0, len) over [0, n) in pieces that never cross a 64-element block of the bucket; body writes
// elements [i0, i0 + len) and returns the bound of what it wrote (bound_key), which is max-combined into
// the block's slot (a block shared with a neighbouring slice keeps both slices' maxima). A whole block gets
// len as a compile-time constant (std::integral_constant): its loop becomes straight vector code without a
// remainder. One loop over n with the max reduction in it took twice as long (momentum_add_checked over
// 6.25M elements, cold: 11 ms, against 5.5 ms in blocks and 5.8 ms for the loop before bounds existed).
// Without block maxima the pieces are the same and the bounds are dropped.
using WholeBlock = std::integral_constant<int64_t, kBlockMaxElems>;
template <class F>
BL_ALWAYS_INLINE void blocked_pass(int64_t n, const BlockMax& out, F&& body) {
  int32_t sink = 0;
  int32_t* slot = out.bm ? out.bm + out.lo / kBlockMaxElems : &sink;
  const int64_t step = out.bm ? 1 : 0;
  auto put = [&](uint32_t bound) {
    *slot = std::max(*slot, int32_t(bound));
    slot += step;
  };
  int64_t i = 0;
  const int64_t head = std::min(n, (kBlockMaxElems - out.lo % kBlockMaxElems) % kBlockMaxElems);
  if (head > 0) {
    put(body(i, head));
    i = head;
  }
  for (; i + kBlockMaxElems <= n; i += kBlockMaxElems) put(body(i, WholeBlock{}));
  if (i < n) put(body(i, n - i));
}

void combine_f32(const BlockMax& out, const float* p, int64_t n) {
  blocked_pass(n, out, [&](int64_t i0, auto len) {
    float mx = 0.0f;
    uint32_t nf = 0;
#pragma omp simd reduction(max : mx) reduction(| : nf)
    for (int64_t i = i0; i < i0 + int64_t(len); ++i) {
      mx = std::max(mx, std::fabs(p[i]));
      nf |= f32_nonfinite_mask(f32_bits(p[i]));
    }
    return bound_key(mx, nf);
  });
}
}  // namespace

void block_max_combine_(at::Tensor& bm, const at::Tensor& x, int64_t lo) {
  combine_f32(check_block_max(bm, lo, x, "block_max_combine_"), x.const_data_ptr<float>(), x.numel());
}

bool add_checked(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& block_max,
                 int64_t block_offset) {
  TORCH_CHECK(out.numel() == a.numel() && a.numel() == b.numel(), "add_checked: sizes differ (out ", out.numel(),
              ", a ", a.numel(), ", b ", b.numel(), ")");
  const BlockMax bmo = check_block_max(block_max, block_offset, out, "add_checked");
  if (fast_f32(out) && fast_f32(a) && fast_f32(b) && out.data_ptr() != a.data_ptr()) {
    // One pass: add and fold b's exponent bits into the check; on inf/NaN, out is redone as a copy of a.
    const float* x = a.const_data_ptr<float>();
    const float* y = b.const_data_ptr<float>();
    float* o = out.data_ptr<float>();
    uint32_t bad = 0;
    blocked_pass(out.numel(), bmo, [&](int64_t i0, auto len) {
      uint32_t bd = 0, nf = 0;
      float mx = 0.0f;
#pragma omp simd reduction(| : bd, nf) reduction(max : mx)
      for (int64_t i = i0; i < i0 + int64_t(len); ++i) {
        uint32_t bits;
        std::memcpy(&bits, y + i, 4);
        bd |= f32_nonfinite_mask(bits);
        const float v = x[i] + y[i];
        o[i] = v;
        mx = std::max(mx, std::fabs(v));
        nf |= f32_nonfinite_mask(f32_bits(v));
      }
      bad |= bd;
      return bound_key(mx, nf);
    });
    if (bad == 0) return true;
    out.copy_(a.view_as(out));  // combined below too: a slot may now hold a key above a + b's
    if (bmo.bm) combine_f32(bmo, o, out.numel());
    return false;
  }
  bool ok = true;
  if (!all_finite(b)) {  // out may be a itself: check before writing
    if (out.data_ptr() != a.data_ptr()) out.copy_(a.view_as(out));
    ok = false;
  } else {
    at::add_out(out, a.view_as(out), b.view_as(out));
  }
  if (bmo.bm) combine_f32(bmo, out.const_data_ptr<float>(), out.numel());
  return ok;
}

bool momentum_add_checked(at::Tensor& u_out, at::Tensor& acc_out, const at::Tensor& u, const at::Tensor& residual,
                          const at::Tensor& g, double m, const at::Tensor& w, double wd, const at::Tensor& block_max,
                          int64_t block_offset) {
  const int64_t n = u_out.numel();
  TORCH_CHECK(acc_out.numel() == n && u.numel() == n && residual.numel() == n && (!g.defined() || g.numel() == n) &&
                  (!w.defined() || w.numel() == n),
              "momentum_add_checked: sizes differ (u_out ", n, ", acc_out ", acc_out.numel(), ", u ", u.numel(),
              ", residual ", residual.numel(), ")");
  const BlockMax bmo = check_block_max(block_max, block_offset, acc_out, "momentum_add_checked");
  const bool with_w = w.defined() && wd != 0.0;
  const bool fast = fast_f32(u_out) && fast_f32(acc_out) && fast_f32(u) && fast_f32(residual) &&
                    (!g.defined() || fast_f32(g)) && (!with_w || fast_f32(w)) && u_out.data_ptr() != u.data_ptr() &&
                    acc_out.data_ptr() != residual.data_ptr();
  if (!fast) {
    const bool ok = !g.defined() || all_finite(g);
    at::mul_out(u_out, u.view_as(u_out), m);
    if (ok && g.defined()) u_out.add_(g.view_as(u_out));
    if (ok && g.defined() && with_w) u_out.add_(w.view_as(u_out), wd);
    at::add_out(acc_out, residual.view_as(acc_out), u_out);
    if (bmo.bm) combine_f32(bmo, acc_out.const_data_ptr<float>(), n);
    return ok;
  }
  const float mf = static_cast<float>(m), wf = static_cast<float>(wd);
  const float* up = u.const_data_ptr<float>();
  const float* rp = residual.const_data_ptr<float>();
  float* uo = u_out.data_ptr<float>();
  float* ao = acc_out.data_ptr<float>();
  if (g.defined()) {
    // One pass: u' = m u + g (+ wd w), acc = residual + u', folding g's exponent bits into the check and
    // acc's magnitudes into the block maxima.
    const float* gp = g.const_data_ptr<float>();
    const float* wp = with_w ? w.const_data_ptr<float>() : nullptr;
    uint32_t bad = 0;
    blocked_pass(n, bmo, [&](int64_t i0, auto len) {
      uint32_t bd = 0, nf = 0;
      float mx = 0.0f;
      if (wp) {
#pragma omp simd reduction(| : bd, nf) reduction(max : mx)
        for (int64_t i = i0; i < i0 + int64_t(len); ++i) {
          uint32_t bits;
          std::memcpy(&bits, gp + i, 4);
          bd |= f32_nonfinite_mask(bits);
          const float v = mf * up[i] + gp[i] + wf * wp[i];
          uo[i] = v;
          const float a = rp[i] + v;
          ao[i] = a;
          mx = std::max(mx, std::fabs(a));
          nf |= f32_nonfinite_mask(f32_bits(a));
        }
      } else {
#pragma omp simd reduction(| : bd, nf) reduction(max : mx)
        for (int64_t i = i0; i < i0 + int64_t(len); ++i) {
          uint32_t bits;
          std::memcpy(&bits, gp + i, 4);
          bd |= f32_nonfinite_mask(bits);
          const float v = mf * up[i] + gp[i];
          uo[i] = v;
          const float a = rp[i] + v;
          ao[i] = a;
          mx = std::max(mx, std::fabs(a));
          nf |= f32_nonfinite_mask(f32_bits(a));
        }
      }
      bad |= bd;
      return bound_key(mx, nf);
    });
    if (bad == 0) return true;
  }
  // No gradient, or a non-finite one: the momentum decays, nothing is added (maxima from a first pass over
  // a non-finite g only make the bounds larger, which keeps them upper bounds).
  blocked_pass(n, bmo, [&](int64_t i0, auto len) {
    float mx = 0.0f;
    uint32_t nf = 0;
#pragma omp simd reduction(max : mx) reduction(| : nf)
    for (int64_t i = i0; i < i0 + int64_t(len); ++i) {
      const float v = mf * up[i];
      uo[i] = v;
      const float a = rp[i] + v;
      ao[i] = a;
      mx = std::max(mx, std::fabs(a));
      nf |= f32_nonfinite_mask(f32_bits(a));
    }
    return bound_key(mx, nf);
  });
  return !g.defined();
}

void add_flagged_(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& block_max,
                  int64_t block_offset, at::Tensor& flag) {
  check_flag(flag, out, "add_flagged_");
  if (out.is_cpu()) {
    if (!add_checked(out, a, b, block_max, block_offset)) flag.fill_(1);
    return;
  }
  TORCH_CHECK(!block_max.defined(), "add_flagged_: block maxima are CPU-only, got a ", out.device(), " output");
  TORCH_CHECK(out.numel() == a.numel() && a.numel() == b.numel(), "add_flagged_: sizes differ (out ", out.numel(),
              ", a ", a.numel(), ", b ", b.numel(), ")");
  const at::Tensor bad = fold_nonfinite(b, flag);
  const at::Tensor av = a.view_as(out);
  out.copy_(at::where(bad, av, av + b.view_as(out)));  // a temporary sum: out may alias a
}

void momentum_add_flagged_(at::Tensor& u_out, at::Tensor& acc_out, const at::Tensor& u, const at::Tensor& residual,
                           const at::Tensor& g, double m, const at::Tensor& w, double wd,
                           const at::Tensor& block_max, int64_t block_offset, at::Tensor& flag) {
  check_flag(flag, acc_out, "momentum_add_flagged_");
  if (acc_out.is_cpu()) {
    if (!momentum_add_checked(u_out, acc_out, u, residual, g, m, w, wd, block_max, block_offset)) flag.fill_(1);
    return;
  }
  TORCH_CHECK(!block_max.defined(), "momentum_add_flagged_: block maxima are CPU-only, got a ", acc_out.device(),
              " output");
  const int64_t n = u_out.numel();
  TORCH_CHECK(acc_out.numel() == n && u.numel() == n && residual.numel() == n && (!g.defined() || g.numel() == n) &&
                  (!w.defined() || w.numel() == n),
              "momentum_add_flagged_: sizes differ (u_out ", n, ", acc_out ", acc_out.numel(), ", u ", u.numel(),
              ", residual ", residual.numel(), ")");
  at::Tensor next = u.view_as(u_out) * m;  // the CPU kernel's order: (m u + g) + wd w
  if (g.defined()) {
    const at::Tensor bad = fold_nonfinite(g, flag);
    at::Tensor with_g = next + g.view_as(u_out);
    if (w.defined() && wd != 0.0) with_g = with_g + w.view_as(u_out) * wd;
    next = at::where(bad, next, with_g);
  }
  u_out.copy_(next);
  at::add_out(acc_out, residual.view_as(acc_out), u_out);
}

namespace {
BL_ALWAYS_INLINE float fused_madd(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
BL_ALWAYS_INLINE double fused_madd(double a, double b, double c) { return __builtin_fma(a, b, c); }

bool cpu_has_fma() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("fma") != 0;
  }();
  return has;
}

template <class scalar_t>
struct SgdSlots {
  const scalar_t* g;
  scalar_t* const* w;
  const int64_t* offsets;
  const int64_t* numels;
  const double* lrs;
  size_t np;
  const int32_t* ip;
  int64_t k;
  uint64_t* seen;
};

// sparse_sgd_step_'s update loop. Built twice: with the FMA instruction, and for CPUs without it (where
// the compiler calls fmaf). The call kept a miss on w from overlapping the next ones (60 ns an index,
// against 2-9 ns for scatter_add_); the prefetch of the next indices halves what is left.
template <class scalar_t>
BL_ALWAYS_INLINE void sgd_at_indices(const SgdSlots<scalar_t>& a) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t kAhead = 16;  // indices prefetched ahead: the accesses are random, mostly cache misses
  for (int64_t j = 0; j < a.k; ++j) {
    if (j + kAhead < a.k) {
      const int64_t f = a.ip[j + kAhead];
      __builtin_prefetch(a.g + f);
      __builtin_prefetch(a.seen + (f >> 6), 1);
      const size_t q = std::upper_bound(a.offsets, a.offsets + a.np, f) - a.offsets;
      if (q > 0 && f - a.offsets[q - 1] < a.numels[q - 1]) __builtin_prefetch(a.w[q - 1] + (f - a.offsets[q - 1]), 1);
    }
    const int64_t i = a.ip[j];
    uint64_t& word = a.seen[i >> 6];
    const uint64_t bit = uint64_t(1) << (i & 63);
    if (word & bit) continue;
    word |= bit;
    // the parameter holding bucket position i: the last one starting at or before it
    const size_t p = std::upper_bound(a.offsets, a.offsets + a.np, i) - a.offsets;
    if (p == 0) continue;
    const int64_t at_p = i - a.offsets[p - 1];
    if (at_p >= a.numels[p - 1]) continue;  // a slot not handed in (another optimizer's)
    // SGD's update, as torch's add_(grad, alpha=-lr) computes it (a fused multiply-add)
    scalar_t* w = a.w[p - 1] + at_p;
    const acc_t wv = static_cast<acc_t>(*w), gv = static_cast<acc_t>(a.g[i]);
    *w = static_cast<scalar_t>(fused_madd(static_cast<acc_t>(-a.lrs[p - 1]), gv, wv));
  }
}
template <class scalar_t>
void sgd_at_indices_default(const SgdSlots<scalar_t>& a) {
  sgd_at_indices(a);
}
template <class scalar_t>
__attribute__((target("fma"))) void sgd_at_indices_fma(const SgdSlots<scalar_t>& a) {
  sgd_at_indices(a);
}
}  // namespace

void sparse_sgd_step_(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
                      const at::Tensor& flat, const at::Tensor& indices, const std::vector<double>& lrs) {
  const size_t np = params.size();
  BL_CHECK(offsets.size() == np && lrs.size() == np, "sparse_sgd_step_: ", np, " params, ", offsets.size(),
           " offsets, ", lrs.size(), " learning rates (one each)");
  check_contiguous(flat, "sparse_sgd_step_", "flat");
  check_int32(indices, "sparse_sgd_step_", "indices");
  BL_CHECK(flat.device().is_cpu(), "sparse_sgd_step_: CPU tensors only");
  const int64_t n = flat.numel();
  for (size_t p = 0; p < np; ++p) {
    BL_CHECK(params[p].is_contiguous() && params[p].scalar_type() == flat.scalar_type() &&
                 params[p].device() == flat.device(),
             "sparse_sgd_step_: param ", p, " must be contiguous, of flat's dtype and device");
    BL_CHECK(offsets[p] >= 0 && offsets[p] + params[p].numel() <= n &&
                 (p == 0 || offsets[p] >= offsets[p - 1] + params[p - 1].numel()),
             "sparse_sgd_step_: param ", p, " at offset ", offsets[p],
             " is not an ascending, non-overlapping slot of the ", n, "-element bucket");
  }
  const int32_t* ip = indices.const_data_ptr<int32_t>();
  const int64_t k = indices.numel();
  for (int64_t j = 0; j < k; ++j)  // all checked before any weight changes
    BL_CHECK(ip[j] >= 0 && ip[j] < n, "sparse_sgd_step_: index ", ip[j], " out of range [0, ", n, ")");
  if (np == 0 || k == 0) return;
  // Each distinct index once: a bitmap over the bucket (kept per thread, grown as needed, and cleared
  // afterwards word by word at the indices visited, so a call costs O(k), not O(n)).
  thread_local std::vector<uint64_t> seen;
  if (seen.size() < static_cast<size_t>((n + 63) / 64)) seen.resize((n + 63) / 64, 0);
  std::vector<int64_t> numels(np);
  for (size_t p = 0; p < np; ++p) numels[p] = params[p].numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "sparse_sgd_step_", [&] {
    std::vector<scalar_t*> w(np);
    for (size_t p = 0; p < np; ++p) w[p] = params[p].data_ptr<scalar_t>();
    const SgdSlots<scalar_t> a{flat.const_data_ptr<scalar_t>(), w.data(), offsets.data(), numels.data(), lrs.data(),
                               np, ip, k, seen.data()};
    if (cpu_has_fma())
      sgd_at_indices_fma(a);
    else
      sgd_at_indices_default(a);
  });
  for (int64_t j = 0; j < k; ++j) seen[ip[j] >> 6] = 0;
}

}  // namespace kernels
}  // namespace bagua_lite
