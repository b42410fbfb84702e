#include "engine/engine.h"

#include <ATen/Parallel.h>

#include <chrono>

#include "collectives/collectives.h"
#include "kernels/compress.h"

namespace bagua_lite {
namespace engine {

void AllreduceOp::run(at::Tensor& bucket) { collectives::allreduce(pg_, bucket, average_); }

CompressedAllreduceOp::CompressedAllreduceOp(ProcessGroupPtr pg, std::string compression, bool average)
    : pg_(std::move(pg)), compression_(std::move(compression)), average_(average) {
  (void)kernels::get_compressor(compression_);  // validate the name at set-up
}

void CompressedAllreduceOp::run(at::Tensor& bucket) {
  collectives::compressed_allreduce(pg_, bucket, compression_, average_);
}

Engine::Engine() : worker_([this] { loop(); }) {}

Engine::~Engine() { shutdown(); }

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  if (worker_.joinable()) worker_.join();
  std::vector<OpPtr> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished.swap(finished_ops_);
  }
}

void Engine::submit(int64_t bucket_id, at::Tensor bucket, std::vector<OpPtr> ops) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Task{bucket_id, std::move(bucket), std::move(ops), at::get_num_threads()});
    ++in_flight_;
  }
  cv_work_.notify_one();
}

void Engine::wait_all() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_idle_.wait(lock, [this] { return in_flight_ == 0; });
  std::vector<OpPtr> finished;
  finished.swap(finished_ops_);
  lock.unlock();
  finished.clear();  // on the waiting thread (see loop())
  lock.lock();
  if (error_) {
    auto err = error_;
    auto where = error_where_;
    error_ = nullptr;
    error_where_.clear();
    try {
      std::rethrow_exception(err);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "bagua_lite engine: ", where, " failed: ", e.what());
    }
  }
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Engine::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = EngineStats{};
}

void Engine::loop() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_work_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    const bool skip = [&] {
      std::lock_guard<std::mutex> lock(mu_);
      return static_cast<bool>(error_);
    }();
    // OpenMP thread counts are per thread: without this the worker would use the machine default
    // (all cores) even when the trainer asked for fewer, and oversubscribe the CPU.
    if (at::get_num_threads() != task.num_threads) at::set_num_threads(task.num_threads);
    const auto t0 = std::chrono::steady_clock::now();
    if (!skip) {
      for (auto& op : task.ops) {
        try {
          op->run(task.bucket);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu_);
          error_ = std::current_exception();
          error_where_ = "bucket " + std::to_string(task.bucket_id) + ", op " + op->name();
          break;
        }
      }
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Ops are released by the thread that waits (wait_all/shutdown), never here: an op may hold the
    // last reference to Python objects that own this engine, and the engine must not end on its own thread.
    task.bucket = at::Tensor();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.buckets_done += 1;
      stats_.busy_seconds += dt;
      for (auto& op : task.ops) finished_ops_.push_back(std::move(op));
      --in_flight_;
    }
    cv_idle_.notify_all();
  }
}

}  // namespace engine
}  // namespace bagua_lite
