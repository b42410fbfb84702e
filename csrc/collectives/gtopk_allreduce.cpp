// Global Top-k allreduce (Shi et al., ICDCS'19) by recursive doubling.
//
//   S <- local canonical set, trimmed to the k largest by magnitude
//   P' <- largest power of two <= P
//   fold:   rank r >= P' sends S to r - P', which merges it in
//   for i in 0 .. log2(P')-1:  swap S with rank r XOR 2^i, S <- merge_topk(S, received, k)
//   unfold: rank r < P - P' sends the final S back to r + P'
// final_union: the last doubling round keeps the whole merged set (at most 2k entries) instead of its k
// largest. Its messages are the round's inputs, so the bytes on the wire do not change (the unfold's
// message, when P is not a power of two, is laid out for 2k entries); more of what the ranks sent is applied.
//
// Message, two index codings and two value codings, fixed by (k, numel, value_bits) so both sides agree:
//   indices: k int32, padded with -1 when |S| < k; or, when numel is given and ceil(numel/8) < 4k, a bitmap
//            of numel bits (bit j of byte j/8 set iff index j is in S)
//   values:  k of the values' dtype, padded with 0; or, value_bits = 4, one float32 scale per block of 64
//            entries (in index order) then two 4-bit levels per byte: level = round(v / s) in [-7, 7] with
//            s = the block's largest magnitude / 7, decoded as level * s
// merge_topk sums equal indices and keeps the k largest (ties: lower index); it is symmetric bit-for-bit,
// and a 4-bit sender keeps the decoded values of what it sent (never its own exact values), so every rank
// ends with the same bits. Bytes per rank: one message per round, log2(P') rounds, plus one message for
// each folded pair (sent by the extra rank before, and by its partner after).
// value_bits = 4: each rank's own k entries are quantized once (what it contributes; `values` is
// overwritten with the part of that the result kept, for its error feedback); a merged set is quantized
// again before each later send, and that error is nobody's. When P is not a power of two the core ranks
// all quantize the final set, so the ranks that receive it last hold the same bits.
// exact=true: one allreduce of |S| values makes each value the exact sum of the ranks' inputs there.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <type_traits>

#include "collectives/collectives.h"
#include "kernels/sparse.h"
#include "kernels/topk.h"

namespace bagua_lite {
namespace collectives {
namespace {

// One float32 scale per block of this many entries of a 4-bit message.
constexpr int64_t kQ4Block = 64;

// A call's working sets, kept per calling thread and dtype between calls: each is a few times k entries, and
// allocating them afresh every step cost page faults and zero-filling on top of the work itself.
template <typename T>
struct Buffers {
  // The current set (canonical), a received set, merge scratch; this rank's own sent set (value_bits = 4);
  // a copy of a non-canonical input.
  std::vector<T> sv, rv, mv, ov, own_v, lv;
  std::vector<int32_t> si, ri, mi, oi, own_i, li;
  std::vector<int64_t> order;
  std::vector<uint8_t> codes;   // value_bits = 4: the encoded current set while `encoded` holds
  std::vector<uint64_t> marks, own_bits, recv_bits;  // one bit per index: membership in a set
};

template <typename T>
Buffers<T>& kept_buffers() {
  static thread_local Buffers<T> kept;
  return kept;
}

template <typename T>
struct GTopK : Buffers<T> {
  using B = Buffers<T>;
  using B::sv, B::rv, B::mv, B::ov, B::si, B::ri, B::mi, B::oi, B::order, B::codes;
  GTopK(const ProcessGroupPtr& pg, int64_t k, at::Device dev, int64_t numel, int64_t value_bits)
      : B(std::move(kept_buffers<T>())), pg(pg), k(k), cap(k), dev(dev), numel(numel), value_bits(value_bits) {}
  ~GTopK() { kept_buffers<T>() = std::move(static_cast<B&>(*this)); }
  GTopK(const GTopK&) = delete;
  GTopK& operator=(const GTopK&) = delete;

  const ProcessGroupPtr& pg;
  const int64_t k;
  int64_t cap;  // the most entries a message holds (its layout): k, or 2k for a final union handed back
  const at::Device dev;
  const int64_t numel;      // the dense length (-1: unknown; index list only)
  const int64_t value_bits;  // 0: the values' dtype; 4: 4-bit levels with a scale per block
  bool encoded = false;
  int64_t count = 0;

  // The float32 scales in front of a 4-bit message's levels.
  static int64_t scale_bytes(int64_t k) { return 4 * ((k + kQ4Block - 1) / kQ4Block); }
  bool bitmap() const { return numel >= 0 && (numel + 7) / 8 < 4 * cap; }
  int64_t index_bytes() const { return bitmap() ? (numel + 7) / 8 : 4 * cap; }
  int64_t value_bytes() const {
    return value_bits == 4 ? scale_bytes(cap) + (cap + 1) / 2 : cap * static_cast<int64_t>(sizeof(T));
  }
  int64_t msg_bytes() const { return value_bytes() + index_bytes(); }

  // value_bits = 4: encode the current set into `codes` and replace its values by their decoding.
  void quantize() {
    codes.assign(value_bytes(), 0);
    uint8_t* lv = codes.data() + scale_bytes(cap);
    float f[kQ4Block];
    int8_t q[kQ4Block];
    for (int64_t lo = 0, b = 0; lo < count; lo += kQ4Block, ++b) {
      const int64_t len = std::min(count - lo, kQ4Block);
      float amax = 0.f;
      for (int64_t i = 0; i < len; ++i) {
        f[i] = static_cast<float>(sv[lo + i]);
        amax = std::max(amax, std::fabs(f[i]));
      }
      const float s = amax / 7.f;
      std::memcpy(codes.data() + 4 * b, &s, 4);
      for (int64_t i = 0; i < len; ++i) {
        // Round half to even, as nearbyint does in the default mode, without its library call: |x| <= 7.
        const float x = s > 0.f ? f[i] / s : 0.f;
        float l = (x + 12582912.f) - 12582912.f;
        l = l > 7.f ? 7.f : (l < -7.f ? -7.f : l);
        q[i] = l == l ? static_cast<int8_t>(l) : 0;  // a non-finite block: deterministic (screened before anyway)
        sv[lo + i] = static_cast<T>(static_cast<float>(q[i]) * s);  // as decoded: a level of -0.0 is +0
      }
      for (int64_t i = 0; i < len; i += 2) {
        const int partner = i + 1 < len ? q[i + 1] : -8;  // an odd last entry's partner: a zero nibble
        lv[(lo + i) / 2] = static_cast<uint8_t>((q[i] + 8) | ((partner + 8) << 4));
      }
    }
    encoded = true;
  }

  static void decode_values(const uint8_t* p, int64_t n, int64_t k, T* out) {
    const uint8_t* lv = p + scale_bytes(k);
    for (int64_t lo = 0; lo < n; lo += kQ4Block) {
      float s;
      std::memcpy(&s, p + 4 * (lo / kQ4Block), 4);
      for (int64_t j = lo, hi = std::min(n, lo + kQ4Block); j < hi; ++j) {
        const int l = static_cast<int>((lv[j / 2] >> (4 * (j & 1))) & 0xF) - 8;
        out[j] = static_cast<T>(static_cast<float>(l) * s);
      }
    }
  }

  void pack(at::Tensor& wire) {
    if (value_bits == 4 && !encoded) quantize();
    auto host = wire.device().is_cpu() ? wire : at::empty({wire.numel()}, wire.options().device(at::kCPU));
    uint8_t* p = host.data_ptr<uint8_t>();
    if (value_bits == 4) {
      std::memcpy(p, codes.data(), codes.size());
    } else {
      std::memcpy(p, sv.data(), count * sizeof(T));
      std::memset(p + count * sizeof(T), 0, (cap - count) * sizeof(T));
    }
    uint8_t* ip = p + value_bytes();
    if (bitmap()) {
      std::memset(ip, 0, index_bytes());
      for (int64_t j = 0; j < count; ++j) ip[si[j] >> 3] |= static_cast<uint8_t>(1u << (si[j] & 7));
    } else {
      // memcpy, not int32 stores: after 4-bit values the index list need not be 4-byte aligned.
      std::memcpy(ip, si.data(), count * 4);
      std::memset(ip + 4 * count, 0xFF, 4 * (cap - count));  // -1 in every byte order
    }
    if (!wire.device().is_cpu()) wire.copy_(host);
  }

  int64_t unpack(const at::Tensor& wire) {
    auto host = wire.device().is_cpu() ? wire : wire.cpu();
    const uint8_t* p = host.const_data_ptr<uint8_t>();
    const uint8_t* ip = p + value_bytes();
    rv.resize(cap);
    ri.resize(cap);
    int64_t n = 0;
    if (bitmap()) {
      const int64_t nb = index_bytes();
      int64_t byte = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
      // Eight bytes at a time: in a little-endian word, bit j of byte b is bit 8 b + j.
      for (; byte + 8 <= nb; byte += 8) {
        uint64_t w;
        std::memcpy(&w, ip + byte, 8);
        BL_CHECK(n + __builtin_popcountll(w) <= cap, "gtopk_allreduce: a peer's bitmap holds more than the ", cap,
                 " indices its message can carry");
        for (; w; w &= w - 1) ri[n++] = static_cast<int32_t>(8 * byte + __builtin_ctzll(w));
      }
#endif
      for (; byte < nb; ++byte) {
        for (unsigned bits = ip[byte]; bits; bits &= bits - 1) {
          BL_CHECK(n < cap, "gtopk_allreduce: a peer's bitmap holds more than the ", cap, " indices its message can carry");
          ri[n++] = static_cast<int32_t>(8 * byte + __builtin_ctz(bits));
        }
      }
    } else {
      std::memcpy(ri.data(), ip, 4 * cap);
      while (n < cap && ri[n] >= 0) ++n;
    }
    if (value_bits == 4) {
      decode_values(p, n, cap, rv.data());
    } else {
      std::memcpy(rv.data(), p, n * sizeof(T));
    }
    return n;
  }

  // The set merged with a received message, of which the `keep` largest are kept (k; or every entry of
  // the union in a final union round).
  void merge(const at::Tensor& wire, int64_t keep) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (bitmap()) return merge_bitmap(wire, keep);
#endif
    merge_received(unpack(wire), keep);
  }

  // A bitmap message merges straight from the two bitmaps (this set's, built here, and the received one)
  // and the values in index order, without listing the received indices first. Where each entry's value
  // comes from follows from the bits, so no step waits on comparing two loaded indices. The same union
  // (sums at equal indices, own value + received value) and selection as merge_received.
  void merge_bitmap(const at::Tensor& wire, int64_t keep) {
    auto host = wire.device().is_cpu() ? wire : wire.cpu();
    const uint8_t* p = host.const_data_ptr<uint8_t>();
    const int64_t nbytes = index_bytes(), words = (nbytes + 7) / 8;
    auto& rb = this->recv_bits;
    auto& ob = this->own_bits;
    rb.assign(words, 0);
    std::memcpy(rb.data(), p + value_bytes(), nbytes);  // little-endian: byte b lands in bits 8 (b % 8) of word b / 8
    int64_t n = 0;
    for (int64_t w = 0; w < words; ++w) n += __builtin_popcountll(rb[w]);
    BL_CHECK(n <= cap, "gtopk_allreduce: a peer's bitmap holds ", n, " indices, more than its message's ", cap);
    const int64_t tail = numel - 64 * (words - 1);  // valid bits of the last word
    BL_CHECK(words == 0 || tail >= 64 || (rb[words - 1] >> tail) == 0,
             "gtopk_allreduce: a peer's bitmap has bits set past numel = ", numel);
    rv.resize(n + 1);  // + the padding slot (below)
    if (value_bits == 4) {
      decode_values(p, n, cap, rv.data());
    } else {
      std::memcpy(rv.data(), p, n * sizeof(T));
    }
    kernels::index_bits(ob, words, si.data(), count);
    using acc_t = at::opmath_type<T>;
    // Each entry picks its value by masks on the bits, not by branches (the compiler turns selects between
    // loaded values into branches, mispredicted half the time here). Both sets get one padding slot, so
    // the loads past an exhausted set stay inside.
    using U = std::conditional_t<sizeof(T) == 8, uint64_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>>;
    static_assert(sizeof(U) == sizeof(T), "one unsigned word per value");
    sv.push_back(T(0));
    mv.resize(count + n);
    mi.resize(count + n);
    const T* av = sv.data();
    const T* bv = rv.data();
    T* __restrict__ uv = mv.data();
    int32_t* __restrict__ ui = mi.data();
    int64_t a = 0, b = 0, m = 0;
    for (int64_t w = 0; w < words; ++w) {
      const uint64_t A = ob[w], Bw = rb[w];
      for (uint64_t u = A | Bw; u; u &= u - 1) {
        const int bit = __builtin_ctzll(u);
        const U ia = U((A >> bit) & 1), ib = U((Bw >> bit) & 1);
        const T va = av[a], vb = bv[b];
        const T sum = static_cast<T>(static_cast<acc_t>(va) + static_cast<acc_t>(vb));
        U xa, xb, xs;
        std::memcpy(&xa, &va, sizeof(U));
        std::memcpy(&xb, &vb, sizeof(U));
        std::memcpy(&xs, &sum, sizeof(U));
        const U pick = (xs & U(0 - (ia & ib))) | (xa & U(0 - (ia & (ib ^ 1)))) | (xb & U(0 - ((ia ^ 1) & ib)));
        std::memcpy(uv + m, &pick, sizeof(U));
        ui[m] = static_cast<int32_t>(64 * w + bit);
        a += ia;
        b += ib;
        ++m;
      }
    }
    sv.pop_back();
    ov.resize(std::min<int64_t>(keep, m));
    oi.resize(ov.size());
    count = kernels::keep_topk_raw<T>(mv.data(), mi.data(), m, keep, ov.data(), oi.data(), order);
    sv.swap(ov);
    si.swap(oi);
    sv.resize(count);
    si.resize(count);
    encoded = false;
  }

  void merge_received(int64_t n, int64_t keep) {
    // Merge into the spare buffers, then swap: the old set's storage becomes next round's spare.
    keep = std::min<int64_t>(keep, count + n);
    ov.resize(keep);
    oi.resize(ov.size());
    count = kernels::merge_topk_raw<T>(sv.data(), si.data(), count, rv.data(), ri.data(), n, keep, ov.data(),
                                       oi.data(), mv, mi, order);
    sv.swap(ov);
    si.swap(oi);
    sv.resize(count);
    si.resize(count);
    encoded = false;
  }
};

// TensorRounds' merge temporaries for k entries, carved from one scratch arena (Slot::kAux) that is kept across
// calls: a step allocates none of them. The kept set (kept_v, kept_i) is the next round's input, read before
// that round writes it.
struct Space {
  Space(int64_t k, at::ScalarType dtype, const at::Device& dev) {
    const int64_t m = 2 * k;
    struct Piece {
      at::Tensor* dst;
      int64_t count;
      at::ScalarType type;
    };
    const Piece pieces[] = {{&lin, k, at::kLong},         {&at_own, k, at::kLong},     {&at_recv, k, at::kLong},
                            {&idx, m, at::kInt},          {&val, m, dtype},            {&sum, m, dtype},
                            {&dead, m, at::kBool},        {&live, m, at::kBool},       {&dead_rank, m, at::kLong},
                            {&live_rank, m, at::kLong},   {&dest, m, at::kLong},       {&compact_v, m, dtype},
                            {&compact_i, m, at::kInt},    {&kept_v, k, dtype},         {&kept_at, k, at::kInt},
                            {&kept_i, k, at::kInt}};
    auto bytes = [](const Piece& p) { return p.count * static_cast<int64_t>(at::elementSize(p.type)); };
    auto aligned = [](int64_t b) { return (b + 15) / 16 * 16; };
    int64_t total = 0;
    for (const Piece& p : pieces) total += aligned(bytes(p));
    const at::Tensor arena = scratch_bytes(Slot::kAux, total, dev);
    int64_t off = 0;
    for (const Piece& p : pieces) {
      *p.dst = arena.narrow(0, off, bytes(p)).view(p.type);
      off += aligned(bytes(p));
    }
  }
  at::Tensor lin, at_own, at_recv, idx, val, sum, dead, live, dead_rank, live_rank, dest, compact_v, compact_i, kept_v,
      kept_at, kept_i;
};

// The rounds in tensor ops, for the plain message (values in their dtype, then k int32 indices) of an input
// known canonical with exactly k entries (the selection's output: not checked, which would read it). Every
// set then holds exactly k entries (a union of two k-sets has at least k distinct indices), so every size is
// fixed and nothing is read back: on a GPU no host copy and no synchronisation. The messages and the result
// are bit for bit the host path's.
class TensorRounds {
 public:
  TensorRounds(const at::Tensor& values, const at::Tensor& indices, int64_t k)
      : k_(k), dtype_(values.scalar_type()), vbytes_(k * values.element_size()), v_(values), i_(indices) {}

  int64_t msg_bytes() const { return vbytes_ + 4 * k_; }

  void pack(at::Tensor& wire) const {
    wire.narrow(0, 0, vbytes_).copy_(v_.view(at::kByte));
    wire.narrow(0, vbytes_, 4 * k_).copy_(i_.view(at::kByte));
  }

  // The set as a received message holds it (the unfold's hand-back: views of the wire, copied out before
  // anything writes it again).
  void unpack(const at::Tensor& wire) {
    v_ = typed(wire.narrow(0, 0, vbytes_), dtype_);
    i_ = typed(wire.narrow(0, vbytes_, 4 * k_), at::kInt);
  }

  // merge_topk_raw's result, from fixed-size steps: (1) the union in index order, each entry's slot its own
  // position plus the other set's entries below it (an index both hold: this set's entry first, as
  // merge_topk_raw adds them); (2) the first slot of such a pair takes the sum, the second drops out; (3) the
  // live entries compacted in index order, zeros behind them (a padding slot loses every tie to a live one,
  // which lies below it, and the union has at least k entries); (4) merge_topk_raw's own selection on that:
  // the k largest magnitudes, ties to the lower index, in index order.
  void merge(const at::Tensor& wire) {
    const int64_t m = 2 * k_;
    const at::Tensor rv = typed(wire.narrow(0, 0, vbytes_), dtype_);
    const at::Tensor ri = typed(wire.narrow(0, vbytes_, 4 * k_), at::kInt);
    Space w(k_, dtype_, v_.device());
    at::arange_out(w.lin, k_);
    at::searchsorted_out(w.at_own, ri, i_, /*out_int32=*/false, /*right=*/false).add_(w.lin);
    at::searchsorted_out(w.at_recv, i_, ri, /*out_int32=*/false, /*right=*/true).add_(w.lin);
    w.idx.index_copy_(0, w.at_own, i_).index_copy_(0, w.at_recv, ri);
    w.val.index_copy_(0, w.at_own, v_).index_copy_(0, w.at_recv, rv);
    auto pair = w.dead.narrow(0, 1, m - 1);  // slots t and t + 1 hold one index: t + 1 drops out
    at::eq_out(pair, w.idx.narrow(0, 1, m - 1), w.idx.narrow(0, 0, m - 1));
    w.dead.narrow(0, 0, 1).zero_();
    auto head = w.val.narrow(0, 0, m - 1);
    auto sum = w.sum.narrow(0, 0, m - 1);
    at::add_out(sum, head, w.val.narrow(0, 1, m - 1));
    at::where_out(head, pair, sum, head);
    // live entries to their rank among the live, dead ones to the back (where they are zeros)
    w.dead_rank.copy_(w.dead).cumsum_(0).neg_().add_(m);  // (in place: a cumsum of a bool casts to a copy)
    at::logical_not_out(w.live, w.dead);
    w.live_rank.copy_(w.live).cumsum_(0).sub_(1);
    at::where_out(w.dest, w.dead, w.dead_rank, w.live_rank);
    w.compact_v.index_copy_(0, w.dest, w.val.masked_fill_(w.dead, 0));
    w.compact_i.index_copy_(0, w.dest, w.idx);
    kernels::topk_out(w.compact_v, k_, w.kept_v, w.kept_at);
    at::index_select_out(w.kept_i, w.compact_i, 0, w.kept_at);
    v_ = w.kept_v;
    i_ = w.kept_i;
  }

  const at::Tensor& values() const { return v_; }
  const at::Tensor& indices() const { return i_; }

 private:
  static at::Tensor typed(const at::Tensor& bytes, at::ScalarType t) {
    return bytes.storage_offset() % at::elementSize(t) == 0 ? bytes.view(t) : bytes.clone().view(t);
  }

  const int64_t k_;
  const at::ScalarType dtype_;
  const int64_t vbytes_;
  at::Tensor v_, i_;
};

// gtopk_allreduce for TensorRounds: the host path's schedule (fold, recursive doubling, hand-back) and tags.
void tensor_rounds(const ProcessGroupPtr& pg, TensorRounds& set, const at::Device& dev) {
  const int64_t P = pg->getSize(), me = pg->getRank();
  int64_t core = 1;
  while (core * 2 <= P) core *= 2;
  auto send = scratch_bytes(Slot::kSend, set.msg_bytes(), dev);
  auto recv = scratch_bytes(Slot::kRecv, set.msg_bytes(), dev);
  if (me >= core) {
    set.pack(send);
    pg_send(pg, send, me - core, 0);
  } else if (me + core < P) {
    pg_recv(pg, recv, me + core, 0);
    set.merge(recv);
  }
  if (me < core) {
    int tag = 1;
    for (int64_t dist = 1; dist < core; dist *= 2, ++tag) {
      set.pack(send);
      pg_exchange(pg, send, recv, me ^ dist, tag);
      set.merge(recv);
    }
  }
  if (me >= core) {
    pg_recv(pg, recv, me - core, 1 << 20);
    set.unpack(recv);
  } else if (me + core < P) {
    set.pack(send);
    pg_send(pg, send, me + core, 1 << 20);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> gtopk_allreduce(const ProcessGroupPtr& pg, const at::Tensor& values,
                                                   const at::Tensor& indices, int64_t k, bool exact, int64_t numel,
                                                   int64_t value_bits, bool final_union,
                                                   const std::optional<at::Tensor>& out_values,
                                                   const std::optional<at::Tensor>& out_indices, bool canonical) {
  BL_CHECK(numel >= -1, "gtopk_allreduce: numel must be >= 0 (or -1: not given), got ", numel);
  // The plain message of a canonical k-set: the rounds in tensor ops where the tensors lie (nothing read back)
  const bool bitmap = numel >= 0 && (numel + 7) / 8 < 4 * k;
  if (canonical && value_bits == 0 && !exact && !final_union && !bitmap && k > 0 && values.numel() == k) {
    kernels::check_sparse_args(values, indices, numel, "gtopk_allreduce", /*contents=*/false);
    TensorRounds set(values, indices, k);
    if (pg->getSize() > 1) tensor_rounds(pg, set, values.device());
    auto out_i = result_buffer(out_indices, k, indices.options(), "gtopk_allreduce", "out_indices");
    auto out_v = result_buffer(out_values, k, values.options(), "gtopk_allreduce", "out_values");
    out_i.copy_(set.indices());
    out_v.copy_(set.values());
    return {out_v, out_i};
  }
  kernels::check_sparse_args(values, indices, numel, "gtopk_allreduce");
  BL_CHECK(k >= 0, "gtopk_allreduce: k must be >= 0, got ", k);
  BL_CHECK(value_bits == 0 || value_bits == 4, "gtopk_allreduce: value_bits must be 0 (the values' dtype) or 4, got ",
           value_bits);
  BL_CHECK(!(exact && value_bits == 4), "gtopk_allreduce: exact=True sums the ranks' exact values, so it cannot be "
           "combined with value_bits=4");
  const int64_t P = pg->getSize(), me = pg->getRank();
  const auto dev = values.device();
  at::Tensor out_v, out_i;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "gtopk_allreduce", [&] {
    using T = scalar_t;
    GTopK<T> g(pg, k, dev, numel, value_bits);
    // Local canonical set (kept whole for exact=true), then trimmed to k. A canonical input (the selection's
    // output always is) is read where it lies; any other is normalized in a copy.
    auto hv = values.cpu().contiguous();
    auto hi = indices.cpu().contiguous();
    const T* lv = hv.const_data_ptr<T>();
    const int32_t* li = hi.const_data_ptr<int32_t>();
    int64_t ln = hi.numel();
    const bool canonical = std::adjacent_find(li, li + ln, std::greater_equal<int32_t>()) == li + ln;
    if (!canonical) {
      g.lv.assign(lv, lv + ln);
      g.li.assign(li, li + ln);
      ln = kernels::normalize_raw<T>(g.lv.data(), g.li.data(), ln, g.order, g.mv, g.mi);
      lv = g.lv.data();
      li = g.li.data();
    }
    // A 4-bit contribution is handed back per input entry, which needs one entry per index.
    BL_CHECK(value_bits != 4 || ln == hi.numel(), "gtopk_allreduce: value_bits=4 needs distinct indices; ",
             hi.numel() - ln, " of the ", hi.numel(), " are repeats");
    if (ln <= k) {
      g.sv.assign(lv, lv + ln);
      g.si.assign(li, li + ln);
      g.count = ln;
    } else {
      g.sv.resize(k);
      g.si.resize(k);
      g.count = kernels::merge_topk_raw<T>(lv, li, ln, nullptr, nullptr, 0, k, g.sv.data(), g.si.data(), g.mv, g.mi,
                                           g.order);
    }
    auto& own_v = g.own_v;  // value_bits = 4: what this rank sends (decoded), at own_i
    auto& own_i = g.own_i;
    if (value_bits == 4) {
      g.quantize();
      own_v.assign(g.sv.begin(), g.sv.end());
      own_i.assign(g.si.begin(), g.si.end());
    }

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
        g.merge(recv, k);
      }
      ++tag;
      // Recursive doubling inside the core.
      if (me < core) {
        for (int64_t dist = 1; dist < core; dist *= 2, ++tag) {
          g.pack(send);
          pg_exchange(pg, send, recv, me ^ dist, tag);
          // final_union: the last round keeps the whole union of its two sets (at most 2k entries): the
          // same bytes on the wire, more of what was sent applied
          g.merge(recv, final_union && 2 * dist >= core ? 2 * k : k);
        }
      }
      // A final union's hand-back carries up to 2k entries: both of its ends lay it out so.
      if (final_union && P > core) g.cap = 2 * k;
      // Every core rank holds the same final set; a 4-bit one is quantized on all of them alike, so that
      // the extra ranks, which receive it quantized, end with the same bits.
      if (me < core && value_bits == 4 && P > core) g.quantize();
      tag = 1 << 20;
      const int64_t back = g.msg_bytes();
      // Unfold: hand the result back.
      if (me >= core) {
        if (back != msg) recv = scratch_bytes(Slot::kRecv, back, dev);
        pg_recv(pg, recv, me - core, tag);
        g.count = g.unpack(recv);
        g.sv.assign(g.rv.begin(), g.rv.begin() + g.count);
        g.si.assign(g.ri.begin(), g.ri.begin() + g.count);
      } else if (me + core < P) {
        if (back != msg) send = scratch_bytes(Slot::kSend, back, dev);
        g.pack(send);
        pg_send(pg, send, me + core, tag);
      }
    }

    if (value_bits == 4) {
      // Of what this rank sent, what the result holds: the rest is not applied anywhere and stays in the
      // sender's residual. Membership by one bit per index of the result.
      if (!own_i.empty()) {
        const int64_t top = std::max<int64_t>(own_i.back(), g.count > 0 ? g.si[g.count - 1] : 0);
        kernels::index_bits(g.marks, top / 64 + 1, g.si.data(), g.count);
        for (size_t a = 0; a < own_i.size(); ++a) {
          own_v[a] = kernels::has_index_bit(g.marks, own_i[a]) ? own_v[a] : T(0);
        }
      }
      // ... per input entry (0 for one beyond this rank's k). An input that was canonical and within k is
      // own_i itself; another one is walked (ascending) or searched.
      auto back = values.is_cpu() ? values : at::empty_like(hv);  // written in place on the CPU
      T* bp = back.data_ptr<T>();
      const int64_t n = hi.numel();
      if (canonical && n <= k) {
        std::copy(own_v.begin(), own_v.end(), bp);
      } else {
        std::fill(bp, bp + n, T(0));
        const int32_t* ip = hi.const_data_ptr<int32_t>();
        const bool ascending = std::is_sorted(ip, ip + n);
        for (int64_t j = 0, a = 0; j < n; ++j) {
          if (ascending) {
            while (a < static_cast<int64_t>(own_i.size()) && own_i[a] < ip[j]) ++a;
          } else {
            a = std::lower_bound(own_i.begin(), own_i.end(), ip[j]) - own_i.begin();
          }
          if (a < static_cast<int64_t>(own_i.size()) && own_i[a] == ip[j]) bp[j] = own_v[a];
        }
      }
      if (!values.is_cpu()) values.copy_(back);
    }

    if (exact) {
      // Each rank's own value at every selected index (0 where it had none), summed over ranks below.
      for (int64_t j = 0; j < g.count; ++j) {
        const int32_t* it = std::lower_bound(li, li + ln, g.si[j]);
        g.sv[j] = (it != li + ln && *it == g.si[j]) ? lv[it - li] : T(0);
      }
    }
    out_i = result_buffer(out_indices, g.count, indices.options().device(dev), "gtopk_allreduce", "out_indices");
    out_v = result_buffer(out_values, g.count, values.options().device(dev), "gtopk_allreduce", "out_values");
    out_i.copy_(at::from_blob(g.si.data(), {g.count}, at::TensorOptions().dtype(at::kInt)));
    out_v.copy_(at::from_blob(g.sv.data(), {g.count}, at::TensorOptions().dtype(values.scalar_type())));
    if (exact && g.count > 0) pg_allreduce_sum(pg, out_v);
  });
  return {out_v, out_i};
}

}  // namespace collectives
}  // namespace bagua_lite
