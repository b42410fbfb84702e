// The communication engine: an ordered queue of ready buckets and one worker thread that runs each
// bucket's ops, so that communication overlaps with the rest of backward.
//
// Ordering is the contract that keeps collectives matched across ranks: buckets are executed strictly
// in submission order, one at a time, and the scheduler submits them in the bucket order fixed at
// set-up. No two collectives are ever in flight out of order (the failure mode of callback-driven comm
// hooks on gloo).
#pragma once

#include <ATen/ATen.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
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
  virtual std::string name() const = 0;
};
using OpPtr = std::shared_ptr<Op>;

// Native ops, GIL-free from start to end.
class AllreduceOp final : public Op {
 public:
  AllreduceOp(ProcessGroupPtr pg, bool average) : pg_(std::move(pg)), average_(average) {}
  void run(at::Tensor& bucket) override;
  std::string name() const override { return average_ ? "allreduce(avg)" : "allreduce(sum)"; }

 private:
  ProcessGroupPtr pg_;
  bool average_;
};

class CompressedAllreduceOp final : public Op {
 public:
  CompressedAllreduceOp(ProcessGroupPtr pg, std::string compression, bool average);
  void run(at::Tensor& bucket) override;
  std::string name() const override { return "compressed_allreduce(" + compression_ + ")"; }

 private:
  ProcessGroupPtr pg_;
  std::string compression_;
  bool average_;
};

struct EngineStats {
  int64_t buckets_done = 0;
  double busy_seconds = 0;  // time the worker spent running ops
};

class Engine {
 public:
  Engine();
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queue a bucket; returns immediately. Ops run in order on the worker thread.
  void submit(int64_t bucket_id, at::Tensor bucket, std::vector<OpPtr> ops);
  // Block until every submitted bucket has finished. Rethrows the first op error (with the bucket and
  // op that raised it); after an error the queue is drained without running further ops.
  void wait_all();
  EngineStats stats() const;
  void reset_stats();
  // Finish queued work and join the worker. Call without holding the GIL if ops may need it.
  void shutdown();

 private:
  struct Task {
    int64_t bucket_id;
    at::Tensor bucket;
    std::vector<OpPtr> ops;
    int num_threads;  // the submitting thread's intra-op thread count, applied on the worker
  };
  void loop();

  mutable std::mutex mu_;
  std::condition_variable cv_work_, cv_idle_;
  std::deque<Task> queue_;
  std::vector<OpPtr> finished_ops_;  // ops of finished buckets, released by the waiting thread
  int64_t in_flight_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::string error_where_;
  EngineStats stats_;
  std::thread worker_;
};

}  // namespace engine
}  // namespace bagua_lite
