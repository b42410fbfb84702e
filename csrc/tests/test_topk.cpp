// Tests for bagua_lite::kernels::topk / topk_out against a brute-force reference.
// Plain executable for ctest: prints every failure and exits non-zero if any check failed.

#include "kernels/topk.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace bagua_lite {
namespace kernels {
namespace detail {
// Test hooks defined in topk.cpp (not part of the public header).
void topk_out_aten(const at::Tensor& x, int64_t k, at::Tensor& values, at::Tensor& indices);
int topk_last_path();
}  // namespace detail
}  // namespace kernels
}  // namespace bagua_lite

namespace {

namespace bk = bagua_lite::kernels;

enum Path { kTrivial = 1, kFast = 2, kFallbackFull = 3, kFallbackNarrowed = 4 };
const char* path_name(int p) {
  switch (p) {
    case kTrivial: return "trivial";
    case kFast: return "fast";
    case kFallbackFull: return "fallback-full";
    case kFallbackNarrowed: return "fallback-narrowed";
    default: return "unknown";
  }
}

int g_failures = 0;
int g_checks = 0;
std::set<std::pair<int, at::ScalarType>> g_paths_seen;

#define CHECK_MSG(cond, msg)                                                               \
  do {                                                                                     \
    ++g_checks;                                                                            \
    if (!(cond)) {                                                                         \
      ++g_failures;                                                                        \
      std::ostringstream os_;                                                              \
      os_ << msg;                                                                          \
      std::fprintf(stderr, "FAIL %s:%d: %s -- %s\n", __FILE__, __LINE__, #cond, os_.str().c_str()); \
    }                                                                                      \
  } while (0)

// Reference: indices ordered by |x| descending with ties by ascending index, first k, sorted ascending.
// Small inputs use a stable sort of the indices by |x| (ties keep index order); large ones use
// nth_element with the equivalent total order (|x| desc, index asc) to keep the test quick.
std::vector<int64_t> reference(const at::Tensor& x, int64_t k) {
  const at::Tensor xd = x.reshape({-1}).to(at::kDouble).contiguous();
  const double* v = xd.data_ptr<double>();
  const int64_t n = xd.numel();
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  if (n <= 65536) {
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return std::fabs(v[a]) > std::fabs(v[b]); });
  } else if (k > 0 && k < n) {
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), [&](int64_t a, int64_t b) {
      const double fa = std::fabs(v[a]), fb = std::fabs(v[b]);
      return fa > fb || (fa == fb && a < b);
    });
  }
  order.resize(size_t(k));
  std::sort(order.begin(), order.end());
  return order;
}

// Compares a result against the reference: indices equal exactly; values bit-identical to x[indices]
// (so the sign of -0 and every payload must be preserved).
void expect_matches(const at::Tensor& x, int64_t k, const std::vector<int64_t>& ref, const at::Tensor& values,
                    const at::Tensor& indices, const std::string& what) {
  CHECK_MSG(indices.scalar_type() == at::kInt, what << ": indices dtype " << indices.scalar_type());
  CHECK_MSG(values.scalar_type() == x.scalar_type(), what << ": values dtype " << values.scalar_type());
  CHECK_MSG(values.numel() >= k && indices.numel() >= k, what << ": output too small");
  if (g_failures > 50) return;
  const int32_t* got = indices.data_ptr<int32_t>();
  int64_t first_bad = -1;
  for (int64_t i = 0; i < k; ++i)
    if (got[i] != ref[size_t(i)]) {
      first_bad = i;
      break;
    }
  CHECK_MSG(first_bad < 0, what << ": index mismatch at output position " << first_bad << ": got "
                                << (first_bad >= 0 ? got[first_bad] : 0) << ", expected "
                                << (first_bad >= 0 ? ref[size_t(first_bad)] : 0));
  if (first_bad >= 0) return;
  const size_t es = x.element_size();
  const auto* xb = static_cast<const uint8_t*>(x.data_ptr());
  const auto* vb = static_cast<const uint8_t*>(values.data_ptr());
  int64_t bad_value = -1;
  for (int64_t i = 0; i < k; ++i)
    if (std::memcmp(vb + size_t(i) * es, xb + size_t(got[i]) * es, es) != 0) {
      bad_value = i;
      break;
    }
  CHECK_MSG(bad_value < 0, what << ": values[" << bad_value << "] is not bit-identical to x[indices[" << bad_value
                                << "]]");
}

// Runs topk and topk_out (with oversized, sentinel-filled buffers) and checks both.
void run_case(const at::Tensor& x, int64_t k, const std::string& name, int expect_path = 0) {
  std::ostringstream os;
  os << name << " [dtype=" << x.scalar_type() << " n=" << x.numel() << " k=" << k << "]";
  const std::string what = os.str();
  const std::vector<int64_t> ref = reference(x, k);
  try {
    auto [values, indices] = bk::topk(x, k);
    const int path = bk::detail::topk_last_path();
    g_paths_seen.insert({path, x.scalar_type()});
    CHECK_MSG(values.numel() == k && indices.numel() == k, what << ": output sizes " << values.numel() << ", "
                                                                << indices.numel());
    CHECK_MSG(values.dim() == 1 && indices.dim() == 1, what << ": outputs must be 1-D");
    expect_matches(x, k, ref, values, indices, what);
    if (expect_path != 0)
      CHECK_MSG(path == expect_path, what << ": expected path " << path_name(expect_path) << ", took "
                                          << path_name(path));

    // topk_out into buffers with 3 extra slots that must stay untouched.
    at::Tensor vbuf = at::full({k + 3}, 7.0, x.options());
    at::Tensor ibuf = at::full({k + 3}, -5, x.options().dtype(at::kInt));
    bk::topk_out(x, k, vbuf, ibuf);
    expect_matches(x, k, ref, vbuf, ibuf, what + " (topk_out)");
    const at::Tensor tail_i = ibuf.narrow(0, k, 3);
    const at::Tensor tail_v = vbuf.narrow(0, k, 3).to(at::kDouble);
    CHECK_MSG(tail_i.eq(-5).all().item<bool>() && tail_v.eq(7.0).all().item<bool>(),
              what << ": topk_out wrote past k");

    // The ATen implementation (used for non-CPU devices) must agree as well (it sorts everything, so
    // large inputs are checked for float32 only to keep the test fast).
    if (x.numel() > 300000 && x.scalar_type() != at::kFloat) return;
    at::Tensor va = at::empty({k}, x.options());
    at::Tensor ia = at::empty({k}, x.options().dtype(at::kInt));
    bk::detail::topk_out_aten(x, k, va, ia);
    expect_matches(x, k, ref, va, ia, what + " (aten path)");
  } catch (const c10::Error& e) {
    CHECK_MSG(false, what << ": unexpected c10::Error: " << e.what_without_backtrace());
  }
}

// Expects fn() to throw a c10::Error whose message contains every string in `needles`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles, const std::string& what) {
  bool threw = false;
  std::string msg;
  try {
    fn();
  } catch (const c10::Error& e) {
    threw = true;
    msg = e.what_without_backtrace();
  }
  CHECK_MSG(threw, what << ": expected a c10::Error, nothing was thrown");
  for (const auto& needle : needles)
    CHECK_MSG(msg.find(needle) != std::string::npos, what << ": message lacks '" << needle << "': " << msg);
}

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};

at::Tensor randn(int64_t n, at::ScalarType dt) { return at::randn({n}, at::kFloat).to(dt); }

// ---------------------------------------------------------------------------------------------------

void test_random_sizes() {
  for (auto dt : kDtypes) {
    for (int64_t n : {1, 2, 3, 17, 64, 1000, 4099}) {
      const at::Tensor x = randn(n, dt);
      std::set<int64_t> ks = {0, 1, n / 2, n - 1, n, std::min<int64_t>(n, 5)};
      for (int64_t k : ks) run_case(x, k, "random small");
    }
    // Fast-path sizes: n >= 2^16 and k <= n - n/4.
    const at::Tensor big = randn(int64_t(1) << 20, dt);
    for (int64_t k : {1, 7, 1000, 10000, (1 << 20) / 8, (1 << 20) / 4, (1 << 20) / 2, (1 << 20) - (1 << 18)})
      run_case(big, k, "random 1M", kFast);
    // k just above the fast-path limit, and close to n: fallback.
    for (int64_t k : {(1 << 20) - (1 << 18) + 1, (1 << 20) - 3}) run_case(big, k, "random 1M large k");
    // Odd size (not a multiple of any block), 2-D input read as flat.
    const at::Tensor odd = randn(1000003, dt);
    run_case(odd, 2500, "random odd n", kFast);
    run_case(randn(300 * 501, dt).reshape({300, 501}), 777, "2-D input", kFast);
  }
}

void test_ties() {
  for (auto dt : kDtypes) {
    const int64_t n = 1000000;
    // All equal (with random signs: |x| all tie).
    const at::Tensor sign = at::randint(0, 2, {n}, at::kFloat).mul(2).sub(1);
    const at::Tensor eq = sign.mul(1.5).to(dt);
    for (int64_t k : {int64_t(1), int64_t(1000), int64_t(125000), int64_t(500000), n - 1}) run_case(eq, k, "all equal |x|");
    run_case(eq, 1000, "all equal |x| (fast path overflows)", kFallbackFull);
    run_case(at::zeros({n}, dt), 4242, "all zeros");
    // Few distinct values: heavy ties at the threshold.
    const at::Tensor few = at::randint(0, 4, {n}, at::kFloat).mul(sign).to(dt);
    for (int64_t k : {1, 100, 1000, 250000, 700000}) run_case(few, k, "four distinct magnitudes");
    // Mostly zeros with a sprinkling of values.
    const at::Tensor sparse = randn(n, at::kFloat).mul(at::rand({n}).lt(0.003)).to(dt);
    for (int64_t k : {100, 2000, 3000, 5000, 20000}) run_case(sparse, k, "99.7% zeros");
    // Ties right at the threshold of an otherwise continuous distribution.
    at::Tensor cont = randn(n, at::kFloat);
    cont.narrow(0, 1000, 5000).fill_(3.0);
    run_case(cont.to(dt), 2000, "block of ties in the tail");
  }
}

void test_special_values() {
  for (auto dt : kDtypes) {
    const double inf = std::numeric_limits<double>::infinity();
    // Denormals of each dtype, +-0, +-inf, tiny normals.
    double denorm = dt == at::kHalf ? 3e-8 : dt == at::kBFloat16 ? 5e-40 : dt == at::kFloat ? 1e-40 : 4e-320;
    std::vector<double> vals = {0.0, -0.0, denorm, -denorm, 2 * denorm, inf, -inf, 1.0, -1.0, 0.0, -0.0, -inf};
    const at::Tensor small = at::tensor(vals, at::kDouble).to(dt);
    for (int64_t k = 0; k <= small.numel(); ++k) run_case(small, k, "special values");
    // Large tensor of denormals and zeros (+ a few infs) through the fast path and the fallback.
    const int64_t n = 300000;
    at::Tensor d = at::randint(0, 5, {n}, at::kDouble).mul(denorm);
    d = d.mul(at::randint(0, 2, {n}, at::kDouble).mul(2).sub(1));
    d.index_put_({at::tensor({5, 70000, 299999}, at::kLong)}, at::tensor({inf, -inf, inf}, at::kDouble));
    const at::Tensor dd = d.to(dt);
    for (int64_t k : {1, 3, 4, 1000, 37500, 200000}) run_case(dd, k, "denormals and zeros");
    // -0 versus +0 only: ties broken by index, sign preserved in values.
    const at::Tensor zz = at::zeros({n}, at::kDouble).mul(at::randint(0, 2, {n}, at::kDouble).mul(2).sub(1)).to(dt);
    run_case(zz, 1234, "+-0 only");
  }
}

void test_adversarial_layouts() {
  for (auto dt : kDtypes) {
    const int64_t n = 1 << 20;
    const at::Tensor base = randn(n, at::kFloat);
    // Sorted ascending / descending magnitudes.
    const at::Tensor asc = std::get<0>(base.abs().sort()).to(dt);
    const at::Tensor desc = asc.flip({0}).contiguous();
    for (int64_t k : {1, 1000, 100000}) {
      run_case(asc, k, "sorted ascending");
      run_case(desc, k, "sorted descending");
    }
    // All large values in the first 2%: the sample sees at most a couple of them.
    at::Tensor spike = base.mul(1e-3);
    spike.narrow(0, 0, n / 50).add_(10.0);
    for (int64_t k : {100, 5000, 30000}) run_case(spike.to(dt), k, "spike at the start");
    // Large values exactly where the sample looks (the first sample block of a 2^20 tensor with
    // k = 2000: 128 blocks of 256 centred at (2j+1)n/256): the sampled threshold is far too high, the
    // fast path finds fewer than k candidates and must fall back.
    at::Tensor trap = base.mul(1e-3);
    trap.narrow(0, n / 256 - 128, 256).add_(100.0);
    run_case(trap.to(dt), 2000, "large values only where sampled");
    // Magnitudes grouped in a narrow band with k small: the fallback can narrow early.
    at::Tensor band = base.mul(1e-3);
    band.narrow(0, n / 256 - 128, 256).add_(100.0);
    band.narrow(0, 0, 3000).fill_(50.0);
    run_case(band.to(dt), 2500, "trap plus a block of ties");
  }
}

void test_nan_rejected() {
  for (auto dt : kDtypes) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    struct Case {
      int64_t n, k, at;
      const char* name;
    };
    for (const Case& c : std::vector<Case>{{1, 1, 0, "n=1"},
                                           {1, 0, 0, "k=0"},
                                           {10, 10, 7, "k=n"},
                                           {10, 3, 9, "small"},
                                           {1 << 20, 1000, 12345, "fast path"},
                                           {1 << 20, 1000, (1 << 20) - 1, "fast path, last element"},
                                           {1 << 20, 300000, 777, "fallback"}}) {
      at::Tensor x = randn(c.n, at::kDouble);
      x[c.at] = nan;
      const at::Tensor xt = x.to(dt);
      const std::string where = "NaN at index " + std::to_string(c.at);
      expect_error([&] { bk::topk(xt, c.k); }, {"NaN", where}, std::string("NaN ") + c.name);
      at::Tensor vals = at::empty({c.k}, xt.options()), idx = at::empty({c.k}, xt.options().dtype(at::kInt));
      expect_error([&] { bk::topk_out(xt, c.k, vals, idx); }, {"NaN", where}, std::string("NaN out ") + c.name);
      expect_error([&] { bk::detail::topk_out_aten(xt, c.k, vals, idx); }, {"NaN", where},
                   std::string("NaN aten ") + c.name);
    }
    // Many NaNs (including negative NaN): the lowest index is named, on every path.
    at::Tensor x = randn(1 << 20, at::kDouble);
    x.narrow(0, 5000, 100000).fill_(-nan);
    x[4321] = nan;
    const at::Tensor xt = x.to(dt);
    for (int64_t k : {0, 10, 1000, 200000, 1 << 20})
      expect_error([&] { bk::topk(xt, k); }, {"NaN at index 4321"}, "many NaNs k=" + std::to_string(k));
    // All NaN.
    const at::Tensor all_nan = at::full({100000}, nan, at::kDouble).to(dt);
    expect_error([&] { bk::topk(all_nan, 100); }, {"NaN at index 0"}, "all NaN");
  }
}

void test_bad_arguments() {
  const at::Tensor x = at::randn({100});
  expect_error([&] { bk::topk(x, -1); }, {"k", "-1", "0 <= k <= numel = 100"}, "k < 0");
  expect_error([&] { bk::topk(x, 101); }, {"k = 101", "numel = 100"}, "k > numel");
  expect_error([&] { bk::topk(at::empty({0}), 1); }, {"k = 1", "numel = 0"}, "k > numel (empty)");
  expect_error([&] { bk::topk(at::randn({10, 20}).t(), 3); }, {"contiguous", "strides"}, "non-contiguous");
  expect_error([&] { bk::topk(at::randn({20}).slice(0, 0, 20, 2), 3); }, {"contiguous"}, "strided slice");
  expect_error([&] { bk::topk(at::ones({10}, at::kInt), 3); }, {"float32", "Int"}, "int32 input");
  expect_error([&] { bk::topk(at::ones({10}, at::kLong), 3); }, {"float32", "Long"}, "int64 input");
  expect_error([&] { bk::topk(at::ones({10}, at::kBool), 3); }, {"float32", "Bool"}, "bool input");
  expect_error([&] { bk::topk(at::ones({10}, at::kComplexFloat), 3); }, {"float32", "ComplexFloat"}, "complex");
  expect_error([&] { bk::topk(at::Tensor(), 0); }, {"undefined"}, "undefined input");

  at::Tensor v = at::empty({5}), i = at::empty({5}, at::kInt);
  expect_error([&] { bk::topk_out(x, 6, v, i); }, {"at least k = 6", "got 5"}, "out too small");
  at::Tensor v64 = at::empty({5}, at::kDouble);
  expect_error([&] { bk::topk_out(x, 3, v64, i); }, {"values", "Float", "Double"}, "values dtype");
  at::Tensor i64 = at::empty({5}, at::kLong);
  expect_error([&] { bk::topk_out(x, 3, v, i64); }, {"indices", "Int", "Long"}, "indices dtype");
  at::Tensor vnc = at::empty({10}).slice(0, 0, 10, 2);
  expect_error([&] { bk::topk_out(x, 3, vnc, i); }, {"values", "contiguous"}, "values non-contiguous");
}

void test_edge_sizes() {
  for (auto dt : kDtypes) {
    auto [v, i] = bk::topk(at::empty({0}, dt), 0);
    CHECK_MSG(v.numel() == 0 && i.numel() == 0 && v.scalar_type() == dt && i.scalar_type() == at::kInt,
              "n=0 k=0 gives empty outputs of the right dtypes");
    run_case(at::tensor({-2.5}, at::kDouble).to(dt), 1, "n=1 k=1");
    run_case(at::tensor({-2.5}, at::kDouble).to(dt), 0, "n=1 k=0");
    run_case(at::randn({1, 1, 1}).to(dt), 1, "n=1 3-D");
    // Scalar (0-dim) tensor: numel 1.
    run_case(at::scalar_tensor(-3.0, at::kDouble).to(dt), 1, "0-dim");
  }
}

void test_repeated_calls_reuse_scratch() {
  // Alternating sizes and dtypes: scratch buffers grow and are reused; results stay exact.
  for (int rep = 0; rep < 3; ++rep)
    for (int64_t n : {int64_t(1) << 17, int64_t(5000), int64_t(1) << 20})
      for (auto dt : {at::kFloat, at::kHalf}) run_case(randn(n, dt), n / 100 + rep, "repeated");
}

}  // namespace

int main() {
  at::manual_seed(1234);
  test_edge_sizes();
  test_random_sizes();
  test_ties();
  test_special_values();
  test_adversarial_layouts();
  test_nan_rejected();
  test_bad_arguments();
  test_repeated_calls_reuse_scratch();

  // Every CPU path must have been exercised for every dtype.
  for (auto dt : kDtypes)
    for (int p : {kTrivial, kFast, kFallbackFull, kFallbackNarrowed})
      CHECK_MSG(g_paths_seen.count({p, dt}) == 1,
                "path " << path_name(p) << " was never taken for dtype " << dt);

  std::printf("test_topk: %d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
