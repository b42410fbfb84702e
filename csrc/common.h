// Shared helpers for the C++ core: process-group handle, argument checks, reusable scratch buffers
// and the per-process traffic counters that benchmarks read.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace bagua_lite {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

// Forces inlining of a small helper into its caller (also into a caller built with another target, such
// as an AVX2 or FMA clone of a kernel loop, where the helper then uses the caller's instructions).
#define BL_ALWAYS_INLINE inline __attribute__((__always_inline__))

// A float32 hot loop compiled for AVX2 as well as the baseline, the copy picked at load time (GCC's function
// multiversioning), so one build runs on any x86-64 and at full width where it can.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define BL_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define BL_MULTIVERSION
#endif

// Makes ATen's intra-op work on the calling thread serial, with no OpenMP team of its own: for the threads
// bagua_lite runs beside training (the engine's, an algorithm's worker). A second team on a machine whose
// cores the trainer's team already uses puts OpenMP's idle threads to sleep instead of spinning, and every
// parallel op of the trainer then waits for its team to wake: its forward and backward ran 1.5-2x slower
// from the first op the engine parallelized on (2 intra-op threads, 2 cores). Only this thread's count
// changes (the process's, which threads started later inherit, stays the trainer's).
void serial_intra_op_here();

// ---- argument checks: every message names the function, the bad value and what is allowed ----------
#define BL_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)

inline void check_contiguous(const at::Tensor& t, const char* fn, const char* name) {
  BL_CHECK(t.is_contiguous(), fn, ": `", name, "` must be contiguous (got a non-contiguous tensor of shape ",
           t.sizes(), " and strides ", t.strides(), "); call .contiguous() first");
}

inline void check_floating(const at::Tensor& t, const char* fn, const char* name) {
  BL_CHECK(at::isFloatingType(t.scalar_type()), fn, ": `", name,
           "` must be float32, float64, float16 or bfloat16, got ", t.scalar_type());
}

inline void check_int32(const at::Tensor& t, const char* fn, const char* name) {
  BL_CHECK(t.scalar_type() == at::kInt, fn, ": `", name, "` must be int32, got ", t.scalar_type());
}

// ---- traffic accounting ------------------------------------------------------------------------------
// Bytes this process hands to the transport, per collective family. Point-to-point sends are counted
// exactly; for library collectives (ring allreduce/allgather, all-to-all) we add what a ring algorithm
// sends per rank, documented next to each call.
struct TrafficCounters {
  std::atomic<int64_t> bytes_sent{0};
  std::atomic<int64_t> messages{0};
};
TrafficCounters& traffic();
inline void count_sent(int64_t bytes, int64_t messages = 1) {
  traffic().bytes_sent.fetch_add(bytes, std::memory_order_relaxed);
  traffic().messages.fetch_add(messages, std::memory_order_relaxed);
}

// ---- reusable scratch ----------------------------------------------------------------------------------
// A grow-only byte buffer per (thread, slot, device). Collectives wait for their work before returning,
// so a slot is never in use by two calls of the same thread at once. Slots are named by the enum below
// so that two buffers live at the same time never alias.
enum class Slot : int { kSend = 0, kRecv, kAux, kAux2, kCount };
at::Tensor scratch_bytes(Slot slot, int64_t nbytes, const at::Device& device);

// The caller's buffer for a result of n elements (`out`, optional): its first n elements where it is long
// enough, else a new tensor with `opts` (a result that outgrew the buffer still comes back). `out` must be
// contiguous, on opts' device and of opts' dtype (checked, naming `fn` and `name`).
at::Tensor result_buffer(const std::optional<at::Tensor>& out, int64_t n, const at::TensorOptions& opts,
                         const char* fn, const char* name);

// Blocks until the work is done; rethrows the backend's error (e.g. a timed-out or failed peer).
inline void wait(const c10::intrusive_ptr<c10d::Work>& work) { work->wait(); }

}  // namespace bagua_lite
