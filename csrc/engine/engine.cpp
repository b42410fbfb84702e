#include "engine/engine.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "collectives/collectives.h"
#include "kernels/compress.h"

namespace bagua_lite {
namespace engine {

void AllreduceOp::run(at::Tensor& bucket) { collectives::allreduce(pg_, bucket, average_); }

c10::intrusive_ptr<c10d::Work> AllreduceOp::start(at::Tensor& bucket) {
  auto work = collectives::allreduce_start(pg_, bucket, average_);
  if (!work) finish(bucket);  // nothing to send (P == 1): finished here
  return work;
}

void AllreduceOp::finish(at::Tensor& bucket) { collectives::allreduce_finish(pg_, bucket, average_); }

CompressedAllreduceOp::CompressedAllreduceOp(ProcessGroupPtr pg, std::string compression, bool average,
                                             std::optional<at::Tensor> residual)
    : pg_(std::move(pg)), compression_(std::move(compression)), average_(average), residual_(std::move(residual)) {
  (void)kernels::get_compressor(compression_);  // validate the name at set-up
}

void CompressedAllreduceOp::run(at::Tensor& bucket) {
  collectives::compressed_allreduce(pg_, bucket, compression_, average_, residual_);
}

namespace {
// Every engine made through the binding, weakly: an abandoned engine is never freed (its binding leaks a
// reference), so it stays here and its worker can still be waited for at process exit.
std::mutex registry_mu;
std::vector<std::weak_ptr<Engine>>& registry() {
  static auto* engines = new std::vector<std::weak_ptr<Engine>>();  // never destroyed: usable during exit
  return *engines;
}
std::atomic<int64_t> engines_created{0};
}  // namespace

namespace {
bool streams_wanted() {
  const char* v = std::getenv("BAGUA_LITE_ENGINE_STREAM");
  return v != nullptr && std::strcmp(v, "1") == 0;
}
}  // namespace

// use_streams_ is set before the worker starts: the member order puts worker_ last.
Engine::Engine() : use_streams_(streams_wanted()), worker_([this] { loop(); }) {}

std::optional<c10::Stream> Engine::stream_for(const at::Device& device) {
  for (const auto& s : streams_)
    if (s.device() == device) return s;
  c10::impl::VirtualGuardImpl impl(device.type());
  streams_.push_back(impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false));
  return streams_.back();
}

void Engine::record_done(const Task& task) {
  if (!task.ready) return;
  const auto device = task.bucket.device();
  c10::impl::VirtualGuardImpl impl(device.type());
  c10::Event done(device.type());
  done.record(impl.getStream(device));  // the engine's stream: the caller's guard is still in place
  std::lock_guard<std::mutex> lock(mu_);
  done_events_.push_back(std::move(done));
}

std::shared_ptr<Engine> Engine::track(std::shared_ptr<Engine> engine) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto& engines = registry();
  engines.erase(std::remove_if(engines.begin(), engines.end(), [](const auto& w) { return w.expired(); }),
                engines.end());
  engines.push_back(engine);
  engines_created += 1;
  return engine;
}

int64_t Engine::created() { return engines_created.load(); }

bool Engine::stop_for_exit(double seconds) {
  std::unique_lock<std::mutex> lock(mu_);
  stop_ = true;
  cancelled_ = true;
  cv_work_.notify_all();
  const bool done = cv_idle_.wait_for(lock, std::chrono::duration<double>(std::max(seconds, 0.0)),
                                      [this] { return worker_done_; });
  lock.unlock();
  if (done && worker_.joinable()) worker_.join();
  return done;
}

int Engine::stop_all_for_exit(double seconds) {
  std::vector<std::shared_ptr<Engine>> engines;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    for (auto& w : registry())
      if (auto e = w.lock()) engines.push_back(std::move(e));
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(std::max(seconds, 0.0));
  int running = 0;
  for (auto& e : engines) {
    const double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    if (e->stop_for_exit(left)) continue;
    // Still in a collective: leave the worker to the process's end, as abandon() does, so that the
    // engine's destructor never waits for it during interpreter finalization.
    ++running;
    e->abandon();
    new std::shared_ptr<Engine>(e);  // never freed: the detached worker still uses the engine
  }
  return running;  // `engines` may hold the last reference to some: they end here, their workers joined
}

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
    // A stopped engine has no worker (or one that is leaving): the task would never run and wait_all hang.
    TORCH_CHECK(!stop_, "bagua_lite engine: submit after the engine stopped (its model was closed, its peers "
                "failed, or the process is exiting)");
    std::optional<c10::Event> ready;
    if (use_streams_ && bucket.defined() && bucket.device().type() != c10::DeviceType::CPU) {
      c10::impl::VirtualGuardImpl impl(bucket.device().type());
      ready.emplace(bucket.device().type());
      ready->record(impl.getStream(bucket.device()));  // the submitting thread's current stream
    }
    queue_.push_back(Task{bucket_id, std::move(bucket), std::move(ops), std::move(ready)});
    ++in_flight_;
  }
  cv_work_.notify_one();
}

void Engine::wait_all() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_idle_.wait(lock, [this] { return in_flight_ == 0; });
  std::vector<OpPtr> finished;
  finished.swap(finished_ops_);
  std::vector<c10::Event> done;
  done.swap(done_events_);
  lock.unlock();
  finished.clear();  // on the waiting thread (see loop())
  for (const auto& e : done) {  // this thread's stream waits for the engine's work on the device, not the host
    c10::impl::VirtualGuardImpl impl(e.device_type());
    e.block(impl.getStream(c10::Device(e.device_type(), e.device_index())));
  }
  done.clear();
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

bool Engine::wait_all_for(double seconds) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_idle_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return in_flight_ == 0; }))
      return false;
  }
  wait_all();
  return true;
}

void Engine::abandon() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cancelled_ = true;
  }
  cv_work_.notify_all();
  if (worker_.joinable()) worker_.detach();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Engine::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = EngineStats{};
}

void Engine::record_error(const Task& task, const Op& op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_) {
    error_ = std::current_exception();
    // negative ids: control tasks outside the buckets (the step check, an algorithm's own collectives)
    error_where_ = (task.bucket_id >= 0 ? "bucket " + std::to_string(task.bucket_id) + ", op " : "op ") + op.name();
  }
}

std::shared_ptr<Engine::Pending> Engine::run_task(Task& task) {
  const bool skip = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<bool>(error_) || cancelled_;
  }();
  if (skip) return nullptr;  // after an error, once abandoned or stopped for exit: the queue drains, nothing runs
  std::optional<c10::StreamGuard> on_stream;
  if (task.ready) {
    auto stream = stream_for(task.bucket.device());
    task.ready->block(*stream);  // the engine's stream waits until the bucket was filled
    on_stream.emplace(*stream);
  }
  for (size_t i = 0; i < task.ops.size(); ++i) {
    auto& op = task.ops[i];
    try {
      auto work = op->start(task.bucket);
      if (!work) continue;
      if (i + 1 < task.ops.size()) {  // a later op needs the result
        wait(work);
        op->finish(task.bucket);
        continue;
      }
      auto p = std::make_shared<Pending>();
      p->work = std::move(work);
      try {
        // Completion wakes the worker; the callback may run right here if the work is already done.
        p->work->getFuture()->addCallback([this, raw = p.get()](c10::ivalue::Future&) {
          // Notify under the lock: once it is released the worker may finish and the engine be destroyed.
          std::lock_guard<std::mutex> lock(mu_);
          raw->done = true;
          cv_work_.notify_all();
        });
      } catch (const std::exception&) {
        // A backend without futures: wait here (synchronous, as before).
        wait(p->work);
        op->finish(task.bucket);
        record_done(task);
        return nullptr;
      }
      return p;
    } catch (...) {
      record_error(task, *op);
      return nullptr;
    }
  }
  record_done(task);
  return nullptr;
}

void Engine::finish_pending(Pending& p) {
  std::optional<c10::StreamGuard> on_stream;
  if (p.task.ready) on_stream.emplace(*stream_for(p.task.bucket.device()));
  auto& op = *p.task.ops.back();
  try {
    wait(p.work);  // rethrows the backend's error (a failed or timed-out peer)
    op.finish(p.task.bucket);
    record_done(p.task);
  } catch (...) {
    record_error(p.task, op);
  }
}

void Engine::task_done_locked(Task& task) {
  // Ops are released by the thread that waits (wait_all/shutdown), never here: an op may hold the
  // last reference to Python objects that own this engine, and the engine must not end on its own thread.
  task.bucket = at::Tensor();
  stats_.buckets_done += 1;
  for (auto& op : task.ops) finished_ops_.push_back(std::move(op));
  --in_flight_;
}

void Engine::loop() {
  serial_intra_op_here();
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_work_.wait(lock, [this] {
      return !queue_.empty() || (!pending_.empty() && pending_.front()->done) || (stop_ && pending_.empty());
    });
    if (!active_) {
      active_ = true;
      active_since_ = std::chrono::steady_clock::now();
    }
    if (!pending_.empty() && pending_.front()->done) {
      // Finish in-flight collectives oldest first: completion follows submission order.
      auto p = std::move(pending_.front());
      pending_.pop_front();
      lock.unlock();
      finish_pending(*p);
      lock.lock();
      task_done_locked(p->task);
    } else if (!queue_.empty()) {
      Task task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      auto p = run_task(task);
      lock.lock();
      if (p) {
        p->task = std::move(task);
        pending_.push_back(std::move(p));
      } else {
        task_done_locked(task);
      }
    } else {
      active_ = false;
      worker_done_ = true;
      cv_idle_.notify_all();  // stop_for_exit waits for this
      return;  // stop_, nothing queued and nothing in flight
    }
    if (pending_.empty() && queue_.empty()) {
      active_ = false;
      stats_.busy_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - active_since_).count();
    }
    cv_idle_.notify_all();
  }
}

}  // namespace engine
}  // namespace bagua_lite
