// torch.profiler side of runtime/profiler.h: ranges are at::RecordFunction (USER_SCOPE), so they
// nest under record_function() and appear in key_averages() and the chrome trace; compile
// intervals (measured elsewhere) go through Kineto's backend-event entry point, which takes
// explicit start/end times. Device time from PJRT completion events goes to the tpu's Kineto
// activity profiler (aten/profiler_kineto.cc) when the profile asked for
// ProfilerActivity.PrivateUse1: real device activities, counted as the launching op's device
// time. Otherwise (a CPU-only profile) they are recorded by one helper thread running under the
// caller's thread-local state (the profiler state travels in it, as for at::launch), so they form
// their own row instead of overlapping the host ranges of the launching thread.
#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "aten/profiler_kineto.h"
#include "runtime/profiler.h"

namespace tpu::aten {
namespace {

bool active() { return torch::profiler::impl::profilerEnabled(); }

void* begin(const std::string& name) {
  auto rf = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (!rf->isActive()) return nullptr;
  rf->before(name);
  return rf.release();
}

void end(void* range) { std::unique_ptr<at::RecordFunction> rf(static_cast<at::RecordFunction*>(range)); }

void interval(int64_t start_us, int64_t end_us, const std::string& name) {
  torch::autograd::profiler::reportBackendEventToActiveKinetoProfiler(start_us, end_us, -1,
                                                                      at::RecordScope::USER_SCOPE, name, "tpu");
}

using Events = std::vector<runtime::prof::DeviceEvent>;

// The device row: one thread that records each batch under the caller's thread-local state.
// The caller waits for its batch (the state and events are borrowed).
class DeviceRow {
 public:
  void record(const Events& ev) {
    at::ThreadLocalState tls;
    std::unique_lock<std::mutex> lock(mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    cv_.wait(lock, [this] { return batch_ == nullptr; });  // another thread's batch first
    batch_ = &ev;
    tls_ = &tls;
    cv_.notify_all();
    cv_.wait(lock, [this] { return batch_ == nullptr; });
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return batch_ != nullptr; });
      try {
        at::ThreadLocalStateGuard guard(*tls_);
        for (const auto& e : *batch_) interval(e.start_us, e.end_us, "tpu::device " + e.what);
      } catch (const std::exception&) {
        // Never take the process down for a profiler row; the events are dropped.
      }
      batch_ = nullptr;
      tls_ = nullptr;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  const Events* batch_ = nullptr;
  const at::ThreadLocalState* tls_ = nullptr;
  std::thread thread_;
};

void device(const Events& ev) {
  if (kineto::session_active()) {
    kineto::add(ev);
    return;
  }
  static DeviceRow* row = std::make_unique<DeviceRow>().release();  // thread lives to exit
  row->record(ev);
}

const bool installed = [] {
  runtime::prof::install({&active, &begin, &end, &interval, &kineto::current_correlation, &device});
  return true;
}();

}  // namespace
}  // namespace tpu::aten
