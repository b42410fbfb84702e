#include "alloc_watch.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Backtrace.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>

namespace bagua_lite {
namespace {

class WatchingAllocator final : public c10::Allocator {
 public:
  explicit WatchingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    const int64_t min = min_bytes_.load(std::memory_order_relaxed);
    if (min >= 0 && static_cast<int64_t>(n) >= min) {
      std::string where = traces_ ? c10::get_backtrace(/*frames_to_skip=*/1, /*maximum_number_of_frames=*/24) : "";
      std::lock_guard<std::mutex> lock(mu_);
      sizes_.push_back(static_cast<int64_t>(n));
      if (traces_) where_.push_back(std::move(where));
    }
    return inner_->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
  bool is_simple_data_ptr(const c10::DataPtr& p) const override { return inner_->is_simple_data_ptr(p); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner_->copy_data(dest, src, count);
  }

  void start(int64_t min_bytes, bool traces) {
    std::lock_guard<std::mutex> lock(mu_);
    sizes_.clear();
    where_.clear();
    traces_ = traces;
    min_bytes_.store(min_bytes, std::memory_order_relaxed);
  }
  void pause(bool paused) {
    std::lock_guard<std::mutex> lock(mu_);
    if (paused && min_bytes_.load() >= 0) {
      saved_ = min_bytes_.exchange(-1);
    } else if (!paused && saved_ >= 0) {
      min_bytes_.store(saved_);
      saved_ = -1;
    }
  }
  std::pair<std::vector<int64_t>, std::vector<std::string>> stop() {
    saved_ = -1;
    min_bytes_.store(-1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu_);
    return {std::move(sizes_), std::move(where_)};
  }

 private:
  c10::Allocator* inner_;
  std::atomic<int64_t> min_bytes_{-1};  // -1: not watching
  int64_t saved_ = -1;                   // min_bytes_ while paused
  std::mutex mu_;
  std::vector<int64_t> sizes_;
  std::atomic<bool> traces_{false};
  std::vector<std::string> where_;
};

std::mutex install_mu;
WatchingAllocator* installed = nullptr;  // never freed: tensors made through it may outlive any scope

WatchingAllocator* install() {
  std::lock_guard<std::mutex> lock(install_mu);
  if (installed == nullptr) {
    installed = new WatchingAllocator(c10::GetCPUAllocator());
    // The highest priority: the wrapper stays in front whatever registers later at a lower one.
    c10::SetCPUAllocator(installed, /*priority=*/UINT8_MAX);
  }
  return installed;
}

}  // namespace

void alloc_watch_start(int64_t min_bytes, bool traces) {
  TORCH_CHECK_VALUE(min_bytes >= 0, "alloc_watch_start: min_bytes must be >= 0, got ", min_bytes);
  install()->start(min_bytes, traces);
}

void alloc_watch_pause(bool paused) {
  if (installed != nullptr) installed->pause(paused);  // no watch running: nothing to pause
}

std::pair<std::vector<int64_t>, std::vector<std::string>> alloc_watch_stop() {
  TORCH_CHECK(installed != nullptr, "alloc_watch_stop: no watch was started in this process");
  return installed->stop();
}

}  // namespace bagua_lite
