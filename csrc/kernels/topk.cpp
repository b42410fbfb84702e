// Exact top-k by magnitude. See topk.h for the contract.
//
// CPU algorithm
// -------------
// Every element is mapped to an unsigned integer key: its IEEE bit pattern with the sign bit cleared.
// For non-negative IEEE values integer order equals magnitude order (denormals and +-0 included),
// +inf has key kInf, and every NaN has a key > kInf, so "is NaN" is one integer comparison.
//
//  1. Estimate a threshold t from a small deterministic sample (evenly spread contiguous blocks),
//     picking a sample rank with a safety margin so that, for data without strong positional
//     structure, count(key >= t) is >= k with high probability but only a small multiple of k.
//  2. One parallel filter pass: every part (a contiguous index range, one per thread) appends the
//     (raw bits, index) pairs with key >= t to its own buffer, so candidates stay in index order.
//     A 256-byte block without candidates (the common case) costs one vectorized OR-reduction; the
//     loop prefetches ahead in software and has an AVX2 build selected at run time on x86-64.
//  3. If the candidates are at least k and nothing overflowed: radix select among the candidates for
//     the k-th largest key K (on the calling thread, starting below the bits all candidates share
//     and compacting the active bucket), then emit keys > K and the lowest-index keys == K, in
//     index order. Values come from the stored raw bits, so x is not read a second time.
//  4. Otherwise: exact fallback, a histogram radix select over the whole tensor (11-bit digits,
//     per-part histograms). As soon as the keys at or above the current bucket are few enough it
//     switches to "filter with that exact bound, then select among candidates".
//
//  0. With block maxima (float32, topk_out's block_max: upper bounds on each 64-element block's keys, left
//     by the pass that wrote x): t is the k-th largest bound, only blocks with a bound >= t are read, and
//     step 3 runs on what they hold. If fewer than k keys are >= t (the bounds were loose), steps 1-4.
//
// Correctness never depends on the sample: the sample only decides which exact path runs.
// The threshold is clamped to kInf + 1, so every NaN is always a candidate (or is seen by the first
// histogram pass of the fallback); the NaN check is therefore free on every path.

#include "kernels/topk.h"

#include "kernels/cuda.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "common.h"
#include "kernels/sparse.h"

namespace bagua_lite {
namespace kernels {

namespace detail {
// Test hooks, not part of the public interface (the C++ tests declare them themselves):
//  * topk_out_aten: the implementation used for non-CPU tensors, exercised by the tests on CPU.
//  * topk_last_path: which CPU path the calling thread's last topk call took (see TopkPath).
enum TopkPath : int {
  kPathTrivial = 1,
  kPathFast = 2,
  kPathFallbackFull = 3,
  kPathFallbackNarrowed = 4,
  kPathBlockMax = 5
};
void topk_out_aten(const at::Tensor& x, int64_t k, at::Tensor& values, at::Tensor& indices);
int topk_last_path();
static thread_local int g_last_path = 0;
int topk_last_path() { return g_last_path; }
}  // namespace detail

namespace {

constexpr const char* kFn = "bagua_lite.kernels.topk";

// ---------------------------------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------------------------------

// The input was written as floating point and is read as integers through this wrapper, whose
// may_alias attribute (part of the type, so it survives template deduction) makes that well defined.
template <class U>
struct __attribute__((__may_alias__)) RawBits {
  U bits;
};

template <class scalar_t>
struct KeyTraits;
template <>
struct KeyTraits<float> {
  using Key = uint32_t;
  using Raw = RawBits<uint32_t>;
  static constexpr Key kInf = 0x7F800000u;
};
template <>
struct KeyTraits<double> {
  using Key = uint64_t;
  using Raw = RawBits<uint64_t>;
  static constexpr Key kInf = 0x7FF0000000000000ull;
};
template <>
struct KeyTraits<c10::Half> {
  using Key = uint16_t;
  using Raw = RawBits<uint16_t>;
  static constexpr Key kInf = 0x7C00u;
};
template <>
struct KeyTraits<c10::BFloat16> {
  using Key = uint16_t;
  using Raw = RawBits<uint16_t>;
  static constexpr Key kInf = 0x7F80u;
};

template <class Key>
constexpr int kKeyBits = int(8 * sizeof(Key));
template <class Key>
constexpr Key kTopBit = Key(Key(1) << (kKeyBits<Key> - 1));
template <class Key>
constexpr Key kMagMask = Key(~kTopBit<Key>);

template <class Key>
BL_ALWAYS_INLINE Key key_of(RawBits<Key> raw) {
  return Key(raw.bits & kMagMask<Key>);
}

// Filter granularity: a block is 256 bytes (4 cache lines), tested with one vector reduction; a block
// with a hit is re-tested in 4 sub-blocks, and only sub-blocks with a hit are scanned element-wise.
template <class Key>
constexpr int kBlock = int(256 / sizeof(Key));
template <class Key>
constexpr int kSubBlock = kBlock<Key> / 4;
// Software prefetch distance for streaming passes, in elements (8 KiB ahead). On the target VM the
// hardware prefetcher alone leaves a single stream at well under half the memory bandwidth.
template <class Key>
constexpr int64_t kPrefetchAhead = int64_t(8192 / sizeof(Key));

// "Does any key in raw[0, N) satisfy key >= t", written as an OR-reduction of (t - 1 - key): both
// operands are < 2^(bits-1), so the difference has its top bit set exactly when key >= t (t == 0
// wraps t - 1 to all-ones, which also works). Only and/sub/or: vectorizes with any SIMD ISA.
template <int N, class Key>
BL_ALWAYS_INLINE bool any_ge(const RawBits<Key>* __restrict__ raw, Key tm1) {
  Key acc = 0;
#pragma omp simd reduction(| : acc)
  for (int j = 0; j < N; ++j) acc |= Key(tm1 - key_of<Key>(raw[j]));
  return (acc & kTopBit<Key>) != 0;
}

// ---------------------------------------------------------------------------------------------------
// Scratch: grow-only, per calling thread, so repeated calls do not allocate.
// ---------------------------------------------------------------------------------------------------

template <class T>
struct Buf {
  std::unique_ptr<T[]> ptr;
  size_t cap = 0;
  T* get(size_t n) {
    if (n > cap) {
      ptr.reset();
      ptr.reset(new T[n]);  // uninitialized on purpose
      cap = n;
    }
    return ptr.get();
  }
  size_t bytes() const { return cap * sizeof(T); }
  void release() {
    ptr.reset();
    cap = 0;
  }
};

struct Scratch {
  Buf<uint16_t> keys16, sample16;
  Buf<uint32_t> keys32, sample32;
  Buf<uint64_t> keys64, sample64;
  Buf<int32_t> idx, blocks;
  Buf<uint32_t> hist;

  template <class Key>
  Buf<Key>& keys() {
    if constexpr (sizeof(Key) == 2) return keys16;
    else if constexpr (sizeof(Key) == 4) return keys32;
    else return keys64;
  }
  template <class Key>
  Buf<Key>& sample() {
    if constexpr (sizeof(Key) == 2) return sample16;
    else if constexpr (sizeof(Key) == 4) return sample32;
    else return sample64;
  }
  // Buffers above this size are not kept between calls (a huge k should not pin memory forever).
  static constexpr size_t kKeepBytes = size_t(64) << 20;
  void trim() {
    if (keys16.bytes() > kKeepBytes) keys16.release();
    if (keys32.bytes() > kKeepBytes) keys32.release();
    if (keys64.bytes() > kKeepBytes) keys64.release();
    if (idx.bytes() > kKeepBytes) idx.release();
    if (blocks.bytes() > kKeepBytes) blocks.release();
  }
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

struct TrimGuard {
  Scratch& s;
  ~TrimGuard() { s.trim(); }
};

// ---------------------------------------------------------------------------------------------------
// Partition into parts: contiguous index ranges, one per thread, boundaries on block multiples.
// ---------------------------------------------------------------------------------------------------

constexpr int64_t kMinPartElems = int64_t(1) << 15;
// Passes over fewer keys than this (e.g. the candidates of the fast path) run on the calling thread.
constexpr int64_t kParallelMinWork = int64_t(1) << 18;
constexpr int kMaxParts = 256;

struct Parts {
  int64_t count = 1;
  int64_t bounds[kMaxParts + 1];  // part p covers [bounds[p], bounds[p+1])
  int64_t begin(int64_t p) const { return bounds[p]; }
  int64_t size(int64_t p) const { return bounds[p + 1] - bounds[p]; }
};

Parts make_parts(int64_t n, int64_t align) {
  Parts parts;
  int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, kMaxParts));
  parts.count = std::max<int64_t>(1, std::min<int64_t>(threads, n / kMinPartElems));
  for (int64_t p = 0; p < parts.count; ++p) parts.bounds[p] = (n * p / parts.count) / align * align;
  parts.bounds[parts.count] = n;
  return parts;
}

// ---------------------------------------------------------------------------------------------------
// Key sources for the radix select: the tensor itself, or per-part candidate buffers.
// ---------------------------------------------------------------------------------------------------

template <class Key, class Raw>
struct TensorSource {
  const Raw* raw;
  const Parts* parts;
  int64_t size(int64_t p) const { return parts->size(p); }
  Key key(int64_t p, int64_t i) const { return key_of<Key>(raw[parts->begin(p) + i]); }
  int64_t index(int64_t p, int64_t i) const { return parts->begin(p) + i; }
};

// Candidates: the raw bits (sign included, so values need no second read of x) and flat indices.
template <class Key>
struct CandidateSource {
  const Key* bits;
  const int32_t* idx;
  const int64_t* offset;  // part p's candidates are [offset[p], offset[p] + count[p])
  const int64_t* count;
  int64_t size(int64_t p) const { return count[p]; }
  Key key(int64_t p, int64_t i) const { return Key(bits[offset[p] + i] & kMagMask<Key>); }
  int64_t index(int64_t p, int64_t i) const { return idx[offset[p] + i]; }
};

// Keys only, per-part slices of one array: the compacted active keys of a serial radix select.
template <class Key>
struct KeyArraySource {
  const Key* keys;
  const int64_t* offset;
  const int64_t* count;
  int64_t size(int64_t p) const { return count[p]; }
  Key key(int64_t p, int64_t i) const { return keys[offset[p] + i]; }
};

// Throws the NaN error naming the lowest flat index holding a NaN among the source's elements.
template <class Key, class Src>
[[noreturn]] void throw_nan(const Src& src, int64_t parts, Key inf, int64_t numel) {
  int64_t where = -1;
  for (int64_t p = 0; p < parts && where < 0; ++p)
    for (int64_t i = 0; i < src.size(p); ++i)
      if (src.key(p, i) > inf) {
        where = src.index(p, i);
        break;
      }
  TORCH_CHECK(false, kFn, ": input contains NaN at index ", where, " (flat index; numel ", numel,
              "). NaN has no magnitude order, so only finite values and +-inf are allowed; "
              "replace NaNs first (e.g. torch.nan_to_num) or fix whatever produced them");
}

// ---------------------------------------------------------------------------------------------------
// Radix select
// ---------------------------------------------------------------------------------------------------

constexpr int kDigitBits = 11;
constexpr int64_t kHistStride = (int64_t(1) << kDigitBits) + 16;  // +16: keep parts off shared lines

// Describes the selection: every key > hi is selected; keys in [lo, hi] are selected in index order
// until `need` of them are taken. above[p] / inrange[p] count those keys per part.
template <class Key>
struct Selection {
  Key lo = 0, hi = 0;
  int64_t need = 0;
  bool narrowed = false;  // stopped early because count(key >= lo) <= collect_cap; need is not final
  int64_t above[kMaxParts];
  int64_t inrange[kMaxParts];
};

// Finds the bucket [lo, hi] holding the k-th largest key of the source (1 <= k <= source size),
// refining 11-bit digits from the top until the bucket is a single key or is taken whole.
// The first pass also checks for NaN (keys > inf). If collect_cap > 0, it returns early (narrowed)
// once count(key >= lo) <= collect_cap, so the caller can gather those few keys instead.
// Small sources run on the calling thread and, once the active bucket is much smaller than the
// source, continue on a compacted copy of the active keys (compact_buf).
template <class Key, class Src>
void radix_select(const Src& src, const Parts& parts, int64_t k, Key inf, int64_t numel, int64_t collect_cap,
                  uint32_t* hist, Buf<Key>& compact_buf, Selection<Key>& sel) {
  const int64_t P = parts.count;
  Key prefix = 0, prefix_mask = 0;
  int shift = kKeyBits<Key> - 1;  // the top (sign) bit of every key is zero
  int64_t need = k;
  int64_t total_size = 0;
  for (int64_t p = 0; p < P; ++p) {
    sel.above[p] = 0;
    total_size += src.size(p);
  }
  // Few keys (the usual candidate set): one thread is faster than waking the team for each level.
  const bool parallel = P > 1 && total_size >= kParallelMinWork;
  if (!parallel && total_size > 0) {
    // Skip the leading bits that all keys share (candidates above a threshold share many): start the
    // digits just below them, so the first level already splits the keys finely.
    int64_t first_part = 0;
    while (src.size(first_part) == 0) ++first_part;
    const Key first_key = src.key(first_part, 0);
    Key diff = 0;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t m = src.size(p);
      Key d = 0;
#pragma omp simd reduction(| : d)
      for (int64_t i = 0; i < m; ++i) d |= Key(src.key(p, i) ^ first_key);
      diff |= d;
    }
    int top = 0;  // number of low bits in which keys differ (at least 1)
    while (top < kKeyBits<Key> - 1 && (diff >> top) != 0) ++top;
    shift = std::max(top, 1);
    prefix_mask = Key(~Key((Key(1) << shift) - 1));
    prefix = Key(first_key & prefix_mask);
  }

  // One level: histogram the next digit of the active keys (those matching prefix/prefix_mask),
  // pick the bucket holding the need-th largest, update the selection. Returns true when finished.
  int64_t in_bucket = 0;
  auto level = [&](const auto& s, bool first) -> bool {
    const int width = std::min(kDigitBits, shift);
    shift -= width;
    const int64_t bins = int64_t(1) << width;
    const Key digit_mask = Key((Key(1) << width) - 1);
    bool nan_in_part[kMaxParts] = {};
#pragma omp parallel for num_threads(P) schedule(static, 1) if (parallel)
    for (int64_t p = 0; p < P; ++p) {
      uint32_t* h = hist + p * kHistStride;
      std::fill(h, h + bins, 0u);
      const int64_t m = s.size(p);
      if (first) {
        bool nan = false;
        for (int64_t i = 0; i < m; ++i) {
          const Key key = s.key(p, i);
          nan |= key > inf;
          ++h[(key >> shift) & digit_mask];
        }
        nan_in_part[p] = nan;
      } else {
        for (int64_t i = 0; i < m; ++i) {
          const Key key = s.key(p, i);
          if ((key & prefix_mask) == prefix) ++h[(key >> shift) & digit_mask];
        }
      }
    }
    if (first)
      for (int64_t p = 0; p < P; ++p)
        if (nan_in_part[p]) throw_nan<Key>(src, P, inf, numel);

    // Walk the digit buckets from the top until the need-th largest active key is reached.
    int64_t cum = 0, b = bins - 1;
    for (; b >= 0; --b) {
      in_bucket = 0;
      for (int64_t p = 0; p < P; ++p) in_bucket += hist[p * kHistStride + b];
      if (cum + in_bucket >= need) break;
      cum += in_bucket;
    }
    TORCH_INTERNAL_ASSERT(b >= 0, kFn, ": radix select lost the k-th key");
    int64_t total_above = 0;
    for (int64_t p = 0; p < P; ++p) {
      const uint32_t* h = hist + p * kHistStride;
      int64_t above = 0;
      for (int64_t c = b + 1; c < bins; ++c) above += h[c];
      sel.above[p] += above;
      sel.inrange[p] = h[b];
      total_above += sel.above[p];
    }
    need -= cum;
    prefix = Key(prefix | (Key(b) << shift));
    prefix_mask = Key(prefix_mask | (digit_mask << shift));
    sel.lo = prefix;
    sel.hi = Key(prefix | Key((Key(1) << shift) - 1));
    sel.need = need;
    sel.narrowed = false;
    if (in_bucket == need || shift == 0) return true;
    if (collect_cap > 0 && total_above + in_bucket <= collect_cap) {
      sel.narrowed = true;
      return true;
    }
    return false;
  };

  if (level(src, true)) return;
  if (parallel || in_bucket * 4 > total_size) {
    while (!level(src, false)) {
    }
    return;
  }
  // Serial and the active bucket is small: copy its keys (per part, in order) and go on with those.
  int64_t offset[kMaxParts], count[kMaxParts], off = 0;
  for (int64_t p = 0; p < P; ++p) {
    offset[p] = off;
    count[p] = sel.inrange[p];
    off += count[p];
  }
  Key* keys = compact_buf.get(size_t(off + 1));  // +1: the branchless copy may write one slot past
  for (int64_t p = 0; p < P; ++p) {
    Key* out = keys + offset[p];
    const int64_t m = src.size(p);
    for (int64_t i = 0; i < m; ++i) {
      const Key key = src.key(p, i);
      *out = key;
      out += (key & prefix_mask) == prefix;
    }
  }
  const KeyArraySource<Key> active{keys, offset, count};
  while (!level(active, false)) {
  }
}

// Writes the selected elements of a candidate source to the outputs, in index order.
template <class Key>
void collect_candidates(const CandidateSource<Key>& src, const Parts& parts, const Selection<Key>& sel,
                        RawBits<Key>* out_v, int32_t* out_i) {
  const int64_t P = parts.count;
  int64_t take[kMaxParts], offset[kMaxParts];
  int64_t eq_left = sel.need, off = 0;
  for (int64_t p = 0; p < P; ++p) {
    take[p] = std::min(eq_left, sel.inrange[p]);
    eq_left -= take[p];
    offset[p] = off;
    off += sel.above[p] + take[p];
  }
  int64_t total_size = 0;
  for (int64_t p = 0; p < P; ++p) total_size += src.size(p);
#pragma omp parallel for num_threads(P) schedule(static, 1) if (P > 1 && total_size >= kParallelMinWork)
  for (int64_t p = 0; p < P; ++p) {
    // Branchless: every candidate is written at slot o, which only advances when it is picked. A
    // non-picked write is overwritten by the next pick, and the loop stops once the part's `end`
    // slots are filled, so nothing is written outside this part's output range.
    int64_t o = offset[p], eq = take[p];
    const int64_t end = offset[p] + sel.above[p] + take[p];
    const int64_t m = src.size(p);
    const Key* bits = src.bits + src.offset[p];
    const int32_t* idx = src.idx + src.offset[p];
    for (int64_t i = 0; i < m && o < end; ++i) {
      const Key key = Key(bits[i] & kMagMask<Key>);
      const bool above = key > sel.hi;
      const bool tie = !above & (key >= sel.lo) & (eq > 0);
      out_v[o].bits = bits[i];
      out_i[o] = idx[i];
      o += above | tie;
      eq -= tie;
    }
  }
}

// Same for the whole tensor; blocks holding no key >= lo are skipped with the vectorized test.
template <class Key, class Raw, class scalar_t>
void collect_tensor(const Raw* raw, const Parts& parts, const Selection<Key>& sel, const scalar_t* x,
                    scalar_t* out_v, int32_t* out_i) {
  constexpr int B = kBlock<Key>;
  const int64_t P = parts.count;
  int64_t take[kMaxParts], offset[kMaxParts];
  int64_t eq_left = sel.need, off = 0;
  for (int64_t p = 0; p < P; ++p) {
    take[p] = std::min(eq_left, sel.inrange[p]);
    eq_left -= take[p];
    offset[p] = off;
    off += sel.above[p] + take[p];
  }
  const Key lo_m1 = Key(sel.lo - 1);
#pragma omp parallel for num_threads(P) schedule(static, 1) if (P > 1)
  for (int64_t p = 0; p < P; ++p) {
    int64_t o = offset[p], eq = take[p];
    const int64_t end = offset[p] + sel.above[p] + take[p];
    auto visit = [&](int64_t i) {
      const Key key = key_of<Key>(raw[i]);
      bool pick = key > sel.hi;
      if (!pick && key >= sel.lo && eq > 0) {
        pick = true;
        --eq;
      }
      if (pick) {
        out_v[o] = x[i];
        out_i[o] = int32_t(i);
        ++o;
      }
    };
    int64_t i = parts.begin(p);
    const int64_t stop = parts.begin(p + 1);
    for (; i + B <= stop && o < end; i += B) {
      __builtin_prefetch(raw + i + kPrefetchAhead<Key>);
      if (any_ge<B>(raw + i, lo_m1))
        for (int j = 0; j < B; ++j) visit(i + j);
    }
    for (; i < stop && o < end; ++i) visit(i);
  }
}

// ---------------------------------------------------------------------------------------------------
// Filter pass
// ---------------------------------------------------------------------------------------------------

// Appends (raw bits, index) for every element of raw[begin, end) with key >= t, in index order.
// Returns the count, or -1 if more than `cap` slots would be needed or another part already gave up.
// Inside a sub-block with a hit the writes are branchless (slots past the count are scratch), so a
// block is only entered when kBlock slots are free.
template <class Key>
BL_ALWAYS_INLINE int64_t filter_range_impl(const RawBits<Key>* __restrict__ raw, int64_t begin, int64_t end, Key t,
                                           Key* __restrict__ keys, int32_t* __restrict__ idx, int64_t cap,
                                           std::atomic<bool>* give_up) {
  constexpr int B = kBlock<Key>, SB = kSubBlock<Key>;
  const Key tm1 = Key(t - 1);
  int64_t cnt = 0, i = begin;
  for (; i + B <= end; i += B) {
    __builtin_prefetch(raw + i + kPrefetchAhead<Key>);  // never faults, even past the end
    if (!any_ge<B>(raw + i, tm1)) continue;  // the common case: nothing to keep in 256 bytes
    if (cnt + B > cap || (give_up && give_up->load(std::memory_order_relaxed))) {
      if (give_up) give_up->store(true, std::memory_order_relaxed);
      return -1;
    }
    for (int64_t s = i; s < i + B; s += SB) {
      if (!any_ge<SB>(raw + s, tm1)) continue;
      for (int j = 0; j < SB; ++j) {
        const Key bits = raw[s + j].bits;
        keys[cnt] = bits;
        idx[cnt] = int32_t(s + j);
        cnt += Key(bits & kMagMask<Key>) >= t;
      }
    }
  }
  for (; i < end; ++i) {
    const Key key = key_of<Key>(raw[i]);
    if (key < t) continue;
    if (cnt >= cap) {
      if (give_up) give_up->store(true, std::memory_order_relaxed);
      return -1;
    }
    keys[cnt] = raw[i].bits;
    idx[cnt] = int32_t(i);
    ++cnt;
  }
  return cnt;
}

// The filter pass is the one loop that touches every element on the fast path, so it is compiled
// twice: for the baseline ISA (the build uses no -march flags) and, on x86-64, for AVX2 (8 keys per
// instruction, non-destructive 3-operand forms), chosen at run time from CPUID.
template <class Key>
int64_t filter_range_baseline(const RawBits<Key>* raw, int64_t begin, int64_t end, Key t, Key* keys, int32_t* idx,
                              int64_t cap, std::atomic<bool>* give_up) {
  return filter_range_impl<Key>(raw, begin, end, t, keys, idx, cap, give_up);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define BL_TOPK_HAVE_AVX2_VARIANT 1
template <class Key>
__attribute__((target("avx2"))) int64_t filter_range_avx2(const RawBits<Key>* raw, int64_t begin, int64_t end, Key t,
                                                          Key* keys, int32_t* idx, int64_t cap,
                                                          std::atomic<bool>* give_up) {
  return filter_range_impl<Key>(raw, begin, end, t, keys, idx, cap, give_up);
}

bool cpu_has_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
}
#endif

template <class Key>
int64_t filter_range(const RawBits<Key>* raw, int64_t begin, int64_t end, Key t, Key* keys, int32_t* idx, int64_t cap,
                     std::atomic<bool>* give_up) {
#ifdef BL_TOPK_HAVE_AVX2_VARIANT
  if (cpu_has_avx2()) return filter_range_avx2<Key>(raw, begin, end, t, keys, idx, cap, give_up);
#endif
  return filter_range_baseline<Key>(raw, begin, end, t, keys, idx, cap, give_up);
}

// ---------------------------------------------------------------------------------------------------
// Threshold estimate
// ---------------------------------------------------------------------------------------------------

// Deterministic sample: nb contiguous blocks of kSampleBlock keys spread evenly over the tensor.
// Returns a key t such that count(key >= t) >= k with high probability for data whose large values
// are not concentrated in a few places: t is the r-th largest sample key, where r exceeds the
// expected sample count above the true k-th key (k*m/n) by 4 standard deviations plus 8.
constexpr int64_t kSampleBlock = 256;

template <class Key>
struct Threshold {
  Key t;
  double expected_count;  // estimate of count(key >= t) over the whole tensor: r * n / m
};

template <class Key, class Raw>
Threshold<Key> sample_threshold(const Raw* raw, int64_t n, int64_t k, Buf<Key>& buf) {
  const int64_t m_target = std::clamp<int64_t>(64 * n / k, 8192, 32768);
  const int64_t nb = std::clamp<int64_t>(m_target / kSampleBlock, 1, n / (8 * kSampleBlock));
  const int64_t m = nb * kSampleBlock;
  Key* s = buf.get(size_t(m));
  for (int64_t j = 0; j < nb; ++j) {
    const int64_t start = std::clamp<int64_t>((2 * j + 1) * n / (2 * nb) - kSampleBlock / 2, 0, n - kSampleBlock);
    for (int64_t i = 0; i < kSampleBlock; ++i) s[j * kSampleBlock + i] = key_of<Key>(raw[start + i]);
  }
  const double expected = double(k) * double(m) / double(n);
  int64_t r = int64_t(std::ceil(expected + 4.0 * std::sqrt(expected) + 8.0));
  r = std::clamp<int64_t>(r, 1, m);
  // Heap selection: r is small next to m, so this is mostly one comparison per sample key.
  std::partial_sort(s, s + r, s + m, std::greater<Key>());
  return {s[r - 1], double(r) * double(n) / double(m)};
}

// Any key > inf (a NaN) in the tensor?
template <class Key, class Raw>
bool tensor_has_nan(const Raw* raw, const Parts& parts, Key inf) {
  bool found[kMaxParts] = {};
  const int64_t P = parts.count;
#pragma omp parallel for num_threads(P) schedule(static, 1) if (P > 1)
  for (int64_t p = 0; p < P; ++p) {
    constexpr int B = kBlock<Key>;
    const Raw* r = raw + parts.begin(p);
    const int64_t m = parts.size(p);
    bool nan = false;
    int64_t i = 0;
    for (; i + B <= m && !nan; i += B) {
      __builtin_prefetch(r + i + kPrefetchAhead<Key>);
      nan = any_ge<B>(r + i, inf);  // any key >= inf + 1
    }
    for (; i < m; ++i) nan |= key_of<Key>(r[i]) > inf;
    found[p] = nan;
  }
  for (int64_t p = 0; p < P; ++p)
    if (found[p]) return true;
  return false;
}

// ---------------------------------------------------------------------------------------------------
// Driver
// ---------------------------------------------------------------------------------------------------

constexpr int64_t kFastPathMinN = int64_t(1) << 16;

// Block-maxima path: bm[b] >= the largest key of elements [64 b, 64 b + 64) (an upper bound, as the
// writers in sparse.h leave it). With t the k-th largest bound, every element of the top k lies in a block
// whose bound is >= t, or else count(key >= t) < k, which is checked. So only the blocks with bound >= t
// (about k of them) are read: for a density of 0.001 about 6% of x, instead of all of it. Returns false
// (nothing written) where that does not pay or the bounds were loose (count(key >= t) < k).
bool topk_block_max(const float* xv, int64_t n, int64_t k, const int32_t* bm, float* out_v, int32_t* out_i,
                    Scratch& s) {
  using Key = uint32_t;
  using Raw = RawBits<Key>;
  constexpr int64_t B = kBlockMaxElems, SB = kSubBlock<Key>;
  static_assert(kBlockMaxElems == kBlock<Key>, "a block of bounds is a filter block");
  constexpr Key kInf = KeyTraits<float>::kInf;
  const int64_t nb = (n + B - 1) / B;
  if (k * 4 > nb) return false;  // many blocks would qualify: the plain filter pass streams them faster
  // t: the k-th largest bound (its radix bucket's floor), found by the same radix select as the keys.
  Parts one;
  one.count = 1;
  one.bounds[0] = 0;
  one.bounds[1] = nb;
  const auto* bounds = reinterpret_cast<const Raw*>(bm);  // non-negative int32: the same order as uint32
  uint32_t* hist = s.hist.get(size_t(kHistStride));
  Selection<Key> sel;
  radix_select<Key>(TensorSource<Key, Raw>{bounds, &one}, one, k, Key(0x7FFFFFFFu), nb, 0, hist, s.sample<Key>(), sel);
  const Key t = std::min<Key>(sel.lo, Key(kInf + 1));  // every NaN stays a candidate
  if (t == 0) return false;  // fewer than k non-zero blocks: a bound of 0 selects everything
  // The blocks to read, in index order.
  int32_t* blocks = s.blocks.get(size_t(nb));
  int64_t nsel = 0;
  for (int64_t b = 0; b < nb; ++b) {
    blocks[nsel] = int32_t(b);
    nsel += bounds[b].bits >= t;
  }
  // This path runs on the calling thread; the plain filter pass splits x over the threads. Go on only if
  // its serial work (the bounds, the blocks to read) is below one thread's share of the plain pass: not
  // for ties over most blocks (all-equal input: every block qualifies), nor with many threads.
  const int64_t threads = at::in_parallel_region() ? 1 : std::max<int64_t>(1, at::get_num_threads());
  if ((nb + nsel * B) * threads > n) return false;
  // Candidates beyond this mean t fell far below the k-th key (many large entries per block, e.g. sorted
  // input): stop and let the plain paths decide.
  const int64_t cap = std::min(nsel * B, 8 * k + 4096);
  Key* keys = s.keys<Key>().get(size_t(cap + B));
  int32_t* idx = s.idx.get(size_t(cap + B));
  const auto* raw = reinterpret_cast<const Raw*>(xv);
  const Key tm1 = Key(t - 1);
  int64_t cnt = 0;
  for (int64_t j = 0; j < nsel; ++j) {
    if (j + 8 < nsel) {  // the blocks are scattered: fetch the one 8 ahead (4 cache lines)
      const char* ahead = reinterpret_cast<const char*>(raw + int64_t(blocks[j + 8]) * B);
      for (int l = 0; l < 4; ++l) __builtin_prefetch(ahead + 64 * l);
    }
    if (cnt > cap) return false;
    const int64_t lo = int64_t(blocks[j]) * B;
    // filter_range over one block does the same, but its streaming prefetch (8 KiB ahead) is wasted on
    // scattered blocks: calling it here measured 10% slower (6.25M entries, k = 6,250, one thread).
    if (lo + B <= n) {  // a sub-block without a hit (most of them) costs one vector test
      for (int64_t sb = lo; sb < lo + B; sb += SB) {
        if (!any_ge<SB>(raw + sb, tm1)) continue;
        for (int64_t i = sb; i < sb + SB; ++i) {  // branchless append: slots past cnt are scratch
          const Key bits = raw[i].bits;
          keys[cnt] = bits;
          idx[cnt] = int32_t(i);
          cnt += Key(bits & kMagMask<Key>) >= t;
        }
      }
    } else {
      for (int64_t i = lo; i < n; ++i) {
        const Key bits = raw[i].bits;
        keys[cnt] = bits;
        idx[cnt] = int32_t(i);
        cnt += Key(bits & kMagMask<Key>) >= t;
      }
    }
  }
  if (cnt < k || cnt > cap) return false;  // loose bounds (stale slots), or too many: the exact paths decide
  one.bounds[1] = n;
  int64_t offset[1] = {0}, count[1] = {cnt};
  CandidateSource<Key> cand{keys, idx, offset, count};
  radix_select<Key>(cand, one, k, kInf, n, 0, hist, s.sample<Key>(), sel);
  collect_candidates<Key>(cand, one, sel, reinterpret_cast<RawBits<Key>*>(out_v), out_i);
  detail::g_last_path = detail::kPathBlockMax;
  return true;
}

template <class scalar_t>
void topk_cpu(const at::Tensor& x, int64_t k, scalar_t* out_v, int32_t* out_i, const int32_t* block_max) {
  using Tr = KeyTraits<scalar_t>;
  using Key = typename Tr::Key;
  using Raw = typename Tr::Raw;
  static_assert(sizeof(Key) == sizeof(scalar_t), "key width must match the element width");
  constexpr int B = kBlock<Key>;
  constexpr Key kInf = Tr::kInf;

  const int64_t n = x.numel();
  if (n == 0) {  // k == 0 here (checked by the caller)
    detail::g_last_path = detail::kPathTrivial;
    return;
  }
  const scalar_t* xv = x.const_data_ptr<scalar_t>();
  const Raw* raw = reinterpret_cast<const Raw*>(xv);
  const Parts parts = make_parts(n, B);
  const int64_t P = parts.count;
  Scratch& s = scratch();
  TrimGuard trim{s};
  TensorSource<Key, Raw> tensor{raw, &parts};

  // k == 0 or k == numel: no selection, but NaN is still rejected.
  if (k == 0 || k == n) {
    detail::g_last_path = detail::kPathTrivial;
    if (tensor_has_nan<Key>(raw, parts, kInf)) throw_nan<Key>(tensor, P, kInf, n);
    if (k == n) {
#pragma omp parallel for num_threads(P) schedule(static, 1) if (P > 1)
      for (int64_t p = 0; p < P; ++p) {
        const int64_t b = parts.begin(p), m = parts.size(p);
        std::memcpy(out_v + b, xv + b, size_t(m) * sizeof(scalar_t));
        for (int64_t i = 0; i < m; ++i) out_i[b + i] = int32_t(b + i);
      }
    }
    return;
  }

  if constexpr (std::is_same_v<scalar_t, float>) {
    if (block_max != nullptr && topk_block_max(xv, n, k, block_max, out_v, out_i, s)) return;
  }

  uint32_t* hist = s.hist.get(size_t(P * kHistStride));
  Selection<Key> sel;
  int64_t offset[kMaxParts], count[kMaxParts];

  // Fast path: sampled threshold + one filter pass + select among the candidates. Up to a density of 3/4:
  // gTop-k selects and merges at 1/4 to 1/2, where this is 1.2-1.5x faster than the histogram fallback's
  // extra passes over the whole tensor (1.6M floats, k = 400K: 5.6 ms against 8.6 here).
  if (n >= kFastPathMinN && k <= n - n / 4) {
    const Threshold<Key> th = sample_threshold<Key>(raw, n, k, s.sample<Key>());
    const Key t = std::min<Key>(th.t, Key(kInf + 1));  // every NaN stays a candidate
    int64_t max_part = 0;
    for (int64_t p = 0; p < P; ++p) max_part = std::max(max_part, parts.size(p));
    // Candidate slots per part: the part's share of a generous total (4x the expected count + 8k),
    // plus the whole expected count so one part may hold far more than its share (skewed data).
    const double expected = th.expected_count;
    const int64_t cap =
        std::min<int64_t>(int64_t((4.0 * expected + 8.0 * double(k)) / double(P) + expected) + 4096, max_part) + B;
    Key* keys = s.keys<Key>().get(size_t(P * cap));
    int32_t* idx = s.idx.get(size_t(P * cap));
    std::atomic<bool> give_up{false};
#pragma omp parallel for num_threads(P) schedule(static, 1) if (P > 1)
    for (int64_t p = 0; p < P; ++p) {
      offset[p] = p * cap;
      count[p] = filter_range<Key>(raw, parts.begin(p), parts.begin(p + 1), t, keys + offset[p], idx + offset[p], cap,
                                   &give_up);
    }
    int64_t total = 0;
    bool ok = !give_up.load();
    for (int64_t p = 0; p < P && ok; ++p) {
      ok = count[p] >= 0;
      total += count[p];
    }
    if (ok && total >= k) {
      CandidateSource<Key> cand{keys, idx, offset, count};
      detail::g_last_path = detail::kPathFast;
      radix_select<Key>(cand, parts, k, kInf, n, 0, hist, s.sample<Key>(), sel);
      collect_candidates<Key>(cand, parts, sel, reinterpret_cast<RawBits<Key>*>(out_v), out_i);
      return;
    }
  }

  // Exact fallback: radix select over the whole tensor.
  const int64_t collect_cap = 2 * k + 65536;
  radix_select<Key>(tensor, parts, k, kInf, n, collect_cap, hist, s.sample<Key>(), sel);
  if (!sel.narrowed) {
    detail::g_last_path = detail::kPathFallbackFull;
    collect_tensor<Key>(raw, parts, sel, xv, out_v, out_i);
    return;
  }
  // Few keys are >= sel.lo and each part knows exactly how many: gather them, then select exactly.
  int64_t off = 0;
  for (int64_t p = 0; p < P; ++p) {
    offset[p] = off;
    off += sel.above[p] + sel.inrange[p] + B;
  }
  Key* keys = s.keys<Key>().get(size_t(off));
  int32_t* idx = s.idx.get(size_t(off));
  const Key lo = sel.lo;
#pragma omp parallel for num_threads(P) schedule(static, 1) if (P > 1)
  for (int64_t p = 0; p < P; ++p)
    count[p] = filter_range<Key>(raw, parts.begin(p), parts.begin(p + 1), lo, keys + offset[p], idx + offset[p],
                                 sel.above[p] + sel.inrange[p] + B, nullptr);
  for (int64_t p = 0; p < P; ++p)
    TORCH_INTERNAL_ASSERT(count[p] == sel.above[p] + sel.inrange[p], kFn, ": candidate count mismatch");
  CandidateSource<Key> cand{keys, idx, offset, count};
  detail::g_last_path = detail::kPathFallbackNarrowed;
  radix_select<Key>(cand, parts, k, kInf, n, 0, hist, s.sample<Key>(), sel);
  collect_candidates<Key>(cand, parts, sel, reinterpret_cast<RawBits<Key>*>(out_v), out_i);
}

// ---------------------------------------------------------------------------------------------------
// Argument checks
// ---------------------------------------------------------------------------------------------------

bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

void check_input(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.defined(), kFn, ": x is an undefined tensor");
  TORCH_CHECK(x.layout() == at::kStrided, kFn, ": x must be a dense (strided) tensor, got layout ", x.layout());
  TORCH_CHECK(supported_dtype(x.scalar_type()), kFn, ": x must be float32, float16, bfloat16 or float64, got ",
              x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), kFn, ": x must be contiguous (got sizes ", x.sizes(), " and strides ", x.strides(),
              "); call .contiguous() first");
  const int64_t n = x.numel();
  TORCH_CHECK(n < (int64_t(1) << 31), kFn, ": x has ", n,
              " elements; at most 2^31 - 1 are allowed because indices are int32");
  TORCH_CHECK(k >= 0 && k <= n, kFn, ": k must satisfy 0 <= k <= numel = ", n, ", got k = ", k);
}

void check_output(const at::Tensor& x, int64_t k, const at::Tensor& out, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(out.defined(), kFn, ": `", name, "` is an undefined tensor");
  TORCH_CHECK(out.scalar_type() == dtype, kFn, ": `", name, "` must have dtype ", dtype, ", got ",
              out.scalar_type());
  TORCH_CHECK(out.device() == x.device(), kFn, ": `", name, "` must be on ", x.device(), " like x, got ",
              out.device());
  TORCH_CHECK(out.layout() == at::kStrided && out.is_contiguous(), kFn, ": `", name,
              "` must be a contiguous dense tensor (got sizes ", out.sizes(), " and strides ", out.strides(), ")");
  TORCH_CHECK(out.numel() >= k, kFn, ": `", name, "` must hold at least k = ", k, " elements, got ", out.numel());
}

}  // namespace

namespace detail {

void topk_out_aten(const at::Tensor& x, int64_t k, at::Tensor& values, at::Tensor& indices) {
  c10::AutoGradMode no_grad(false);
  const at::Tensor flat = x.reshape({-1});
  const at::Tensor nan = at::isnan(flat);
  if (nan.any().item<bool>()) {
    const int64_t where = at::nonzero(nan).select(1, 0).min().item<int64_t>();
    TORCH_CHECK(false, kFn, ": input contains NaN at index ", where, " (flat index; numel ", flat.numel(),
                "). NaN has no magnitude order, so only finite values and +-inf are allowed; "
                "replace NaNs first (e.g. torch.nan_to_num) or fix whatever produced them");
  }
  if (k == 0) return;
  // A stable descending sort keeps equal magnitudes in index order, which is the tie rule.
  const at::Tensor order = std::get<1>(at::sort(flat.abs(), /*stable=*/true, /*dim=*/0, /*descending=*/true));
  const at::Tensor chosen = std::get<0>(at::sort(order.narrow(0, 0, k)));
  values.narrow(0, 0, k).copy_(flat.index_select(0, chosen));
  indices.narrow(0, 0, k).copy_(chosen);
}

}  // namespace detail

void topk_out(const at::Tensor& x, int64_t k, at::Tensor& values, at::Tensor& indices, const at::Tensor& block_max) {
  check_input(x, k);
  check_output(x, k, values, x.scalar_type(), "values");
  check_output(x, k, indices, at::kInt, "indices");
  const int32_t* bm = nullptr;
  if (block_max.defined()) {
    const int64_t nb = (x.numel() + kBlockMaxElems - 1) / kBlockMaxElems;
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, kFn,
                ": block_max is for float32 tensors on the CPU, got x of ", x.scalar_type(), " on ", x.device());
    TORCH_CHECK(block_max.device().is_cpu() && block_max.scalar_type() == at::kInt && block_max.is_contiguous() &&
                    block_max.numel() == nb,
                kFn, ": block_max must be a contiguous CPU int32 tensor of ceil(numel / ", kBlockMaxElems, ") = ", nb,
                " slots, got ", block_max.scalar_type(), " on ", block_max.device(), " with ", block_max.numel());
    bm = block_max.const_data_ptr<int32_t>();
  }
  if (!x.device().is_cpu()) {
#ifdef BAGUA_LITE_WITH_CUDA
    if (cuda::handles_topk(x)) return cuda::topk_out(x, k, values, indices);
#endif
    detail::topk_out_aten(x, k, values, indices);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bagua_lite_topk", [&] {
    topk_cpu<scalar_t>(x, k, values.data_ptr<scalar_t>(), indices.data_ptr<int32_t>(), bm);
  });
}

std::tuple<at::Tensor, at::Tensor> topk(const at::Tensor& x, int64_t k) {
  check_input(x, k);
  at::Tensor values = at::empty({k}, x.options());
  at::Tensor indices = at::empty({k}, x.options().dtype(at::kInt));
  topk_out(x, k, values, indices);
  return {values, indices};
}

}  // namespace kernels
}  // namespace bagua_lite
