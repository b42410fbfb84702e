// The communication engine: an ordered queue of ready buckets and one worker thread that runs each
// bucket's ops, so that communication overlaps with the rest of backward.
//
// Ordering is the contract that keeps collectives matched across ranks: buckets are started strictly
// in submission order, and the scheduler submits them in the bucket order fixed at set-up. No
// collective is ever posted out of order (the failure mode of callback-driven comm hooks on gloo).
//
// A bucket's last op may be asynchronous (Op::start returns the collective's work, e.g. AllreduceOp):
// the worker then goes on to the next bucket while that collective is in flight, as DDP keeps several
// buckets' allreduces in flight, so a rank that waits for a slow peer on one bucket still makes
// progress on the next. Its Op::finish (e.g. the division of an average) runs on the worker once the
// work completed, oldest first. Every other op runs to completion before the next one starts.
//
// Device buckets, opt-in (BAGUA_LITE_ENGINE_STREAM=1, until measured on a GPU): the ops run on a stream of
// the engine's own, so a bucket's copies, codecs and collectives overlap the rest of backward instead of
// queueing behind it on the trainer's stream. submit() records an event on the submitting thread's current
// stream (after the bucket was filled there); the worker's stream waits on it before the bucket's first op.
// Each bucket records an event on the engine's stream after its last op, and wait_all() makes the waiting
// thread's current stream wait on those events. Nothing waits on the host: the device orders the work.
// CPU buckets have no stream and run as before.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common.h"

namespace bagua_lite {
namespace engine {

// One step of a bucket's pipeline (e.g. "compress", "allreduce"). Ops run on the engine thread.
class Op {
 public:
  virtual ~Op() = default;
  virtual void run(at::Tensor& bucket) = 0;
  // Asynchronous form: post the op's collective and return its work without waiting; the engine calls
  // finish() after the work completed. Returning nullptr means the op already finished here (the
  // default: run() synchronously).
  virtual c10::intrusive_ptr<c10d::Work> start(at::Tensor& bucket) {
    run(bucket);
    return {};
  }
  virtual void finish(at::Tensor& /*bucket*/) {}
  virtual std::string name() const = 0;
};
using OpPtr = std::shared_ptr<Op>;

// Native ops, GIL-free from start to end.
class AllreduceOp final : public Op {
 public:
  AllreduceOp(ProcessGroupPtr pg, bool average) : pg_(std::move(pg)), average_(average) {}
  void run(at::Tensor& bucket) override;
  c10::intrusive_ptr<c10d::Work> start(at::Tensor& bucket) override;
  void finish(at::Tensor& bucket) override;
  std::string name() const override { return average_ ? "allreduce(avg)" : "allreduce(sum)"; }

 private:
  ProcessGroupPtr pg_;
  bool average_;
};

class CompressedAllreduceOp final : public Op {
 public:
  // residual: error-feedback memory of this bucket (see collectives::compressed_allreduce), or none.
  CompressedAllreduceOp(ProcessGroupPtr pg, std::string compression, bool average,
                        std::optional<at::Tensor> residual = std::nullopt);
  void run(at::Tensor& bucket) override;
  std::string name() const override { return "compressed_allreduce(" + compression_ + ")"; }

 private:
  ProcessGroupPtr pg_;
  std::string compression_;
  bool average_;
  std::optional<at::Tensor> residual_;
};

struct EngineStats {
  int64_t buckets_done = 0;
  double busy_seconds = 0;  // time the engine had work: an op running or a collective in flight
};

class Engine {
 public:
  Engine();
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queue a bucket; returns immediately. Ops start in order on the worker thread.
  void submit(int64_t bucket_id, at::Tensor bucket, std::vector<OpPtr> ops);
  // Block until every submitted bucket has finished. Rethrows the first op error (with the bucket and
  // op that raised it); after an error the queue is drained without running further ops.
  void wait_all();
  // wait_all for at most `seconds`: false if buckets are still in flight (nothing rethrown then).
  bool wait_all_for(double seconds);
  // Give up on work that will not finish (a peer failed): start no further op and detach the worker,
  // which may stay blocked in a collective until the process group's timeout. The caller must keep the
  // engine alive (the binding leaks one reference).
  void abandon();
  EngineStats stats() const;
  void reset_stats();
  // Finish queued work and join the worker. Call without holding the GIL if ops may need it.
  void shutdown();
  // For process exit: start no further op, let the worker finish the op or collective it is in, and
  // join it. Waits at most `seconds`; returns whether the worker has ended. Call without the GIL.
  bool stop_for_exit(double seconds);

  // Registers an engine (weakly) for stop_all_for_exit; the Python binding tracks every engine it makes.
  static std::shared_ptr<Engine> track(std::shared_ptr<Engine> engine);
  // stop_for_exit on every engine of the process that is still alive (an abandoned one stays alive),
  // sharing one deadline; returns how many workers are still running after it.
  static int stop_all_for_exit(double seconds);
  // How many engines this process has made.
  static int64_t created();

 private:
  struct Task {
    int64_t bucket_id;
    at::Tensor bucket;
    std::vector<OpPtr> ops;
    std::optional<c10::Event> ready;  // device buckets on the engine's stream: the bucket is filled
  };
  // A bucket whose last op's collective is in flight (that op is task.ops.back()).
  struct Pending {
    Task task;
    c10::intrusive_ptr<c10d::Work> work;
    bool done = false;  // set (under mu_) by the work's completion callback
  };
  void loop();
  // Runs a task's ops; returns the Pending of an asynchronous last op, or nullptr when all finished.
  std::shared_ptr<Pending> run_task(Task& task);
  void finish_pending(Pending& p);
  void record_error(const Task& task, const Op& op);
  // Under mu_: a bucket is done (its ops handed to the waiting thread for release).
  void task_done_locked(Task& task);
  // The engine's stream for a device (made on first use, one per device); nullopt: run on the current one.
  std::optional<c10::Stream> stream_for(const at::Device& device);
  // On the engine's stream, after a device bucket's last op: what wait_all's caller's stream waits on.
  void record_done(const Task& task);

  mutable std::mutex mu_;
  std::condition_variable cv_work_, cv_idle_;
  std::deque<Task> queue_;
  std::deque<std::shared_ptr<Pending>> pending_;  // in submission order
  bool active_ = false;  // the worker has work (running or in flight) since active_since_
  std::chrono::steady_clock::time_point active_since_;
  std::vector<OpPtr> finished_ops_;  // ops of finished buckets, released by the waiting thread
  int64_t in_flight_ = 0;
  bool stop_ = false;
  bool cancelled_ = false;     // abandoned or stopped for exit: queued tasks are dropped without running
  bool worker_done_ = false;   // loop() has returned
  std::exception_ptr error_;
  std::string error_where_;
  EngineStats stats_;
  const bool use_streams_;                // BAGUA_LITE_ENGINE_STREAM=1
  std::vector<c10::Stream> streams_;      // the worker's, one per device (worker thread only)
  std::vector<c10::Event> done_events_;   // recorded since the last wait_all (under mu_)
  std::thread worker_;
};

}  // namespace engine
}  // namespace bagua_lite
