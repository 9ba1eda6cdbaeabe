// libkineto::IActivityProfiler for the tpu, registered with REGISTER_PRIVATEUSE1_PROFILER.
// PyTorch forwards it to Kineto when a profile asks for ProfilerActivity.PrivateUse1
// (ProfilerState::KINETO_PRIVATEUSE1); Kineto then creates one session per profile, tells it the
// torch op correlation ids as ops begin and end on each thread (push/popCorrelationId), and at
// the end asks it for its activities. Each activity is a CONCURRENT_KERNEL on device row
// "TPU <n>", linked to the CPU op whose correlation id was innermost when it was launched: PyTorch
// maps such activities to DeviceType::PrivateUse1 and adds their time to that op's device time.
#ifndef USE_KINETO
#define USE_KINETO 1  // the libtorch this builds against was built with Kineto (its symbols are used)
#endif
#include "aten/profiler_kineto.h"

#include <libkineto.h>
#include <output_base.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace tpu::aten::kineto {
namespace {

using libkineto::ActivityType;

const std::set<ActivityType> kActivities{ActivityType::CONCURRENT_KERNEL};

// Correlation ids pushed on this thread by the current session (ops nest, so a stack).
struct CorrelationStack {
  uint64_t generation = 0;
  std::vector<uint64_t> ids;
};
thread_local CorrelationStack t_stack;
std::atomic<uint64_t> g_generation{0};

class TpuSession;
std::mutex g_mu;                      // guards g_session and its events
TpuSession* g_session = nullptr;      // recording session (between start() and stop())
std::atomic<bool> g_recording{false};

class TpuSession : public libkineto::IActivityProfilerSession {
 public:
  ~TpuSession() override { stop(); }

  void start() override {
    std::lock_guard<std::mutex> lock(g_mu);
    generation_ = ++g_generation;
    g_session = this;
    g_recording = true;
    status_ = libkineto::TraceStatus::RECORDING;
  }

  void stop() override {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_session == this) {
      g_session = nullptr;
      g_recording = false;
    }
    if (status_ == libkineto::TraceStatus::RECORDING) status_ = libkineto::TraceStatus::PROCESSING;
  }

  std::vector<std::string> errors() override { return {}; }

  void processTrace(libkineto::ActivityLogger& logger) override { processTrace(logger, nullptr, 0, INT64_MAX); }

  void processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback linked,
                    int64_t start_ns, int64_t end_ns) override {
    std::lock_guard<std::mutex> lock(g_mu);
    for (const auto& e : events_) {
      int64_t s = e.start_us * 1000, t = e.end_us * 1000;
      if (t < start_ns || s > end_ns) continue;
      libkineto::GenericTraceActivity a(span_, ActivityType::CONCURRENT_KERNEL, "tpu::device " + e.what);
      a.startTime = s;
      a.endTime = t;
      a.id = static_cast<int32_t>(e.correlation);
      a.device = e.device;
      a.resource = 0;  // one in-order queue per chip
      a.linked = linked && e.correlation ? linked(static_cast<int32_t>(e.correlation)) : nullptr;
      a.addMetadataQuoted("device", "tpu:" + std::to_string(e.device));
      logger.handleGenericActivity(a);  // the logger keeps a copy
    }
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    return std::make_unique<libkineto::DeviceInfo>(libkineto::DeviceInfo{0, 1 << 20, "tpu", "TPU 0"});
  }
  std::vector<libkineto::ResourceInfo> getResourceInfos() override { return {{0, 0, 0, "program queue"}}; }
  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return nullptr; }

  void pushCorrelationId(uint64_t id) override {
    CorrelationStack& s = t_stack;
    if (s.generation != generation_) {  // left over from an earlier session
      s.ids.clear();
      s.generation = generation_;
    }
    s.ids.push_back(id);
  }
  void popCorrelationId() override {
    CorrelationStack& s = t_stack;
    if (s.generation == generation_ && !s.ids.empty()) s.ids.pop_back();
  }

  void add_locked(const std::vector<runtime::prof::DeviceEvent>& ev) {
    if (events_.size() + ev.size() > (1u << 22)) return;  // bounded: a profile never grows unboundedly
    events_.insert(events_.end(), ev.begin(), ev.end());
  }
  uint64_t generation() const { return generation_; }

 private:
  libkineto::TraceSpan span_{0, 0, "tpu"};
  std::vector<runtime::prof::DeviceEvent> events_;
  uint64_t generation_ = 0;
};

class TpuActivityProfiler : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<ActivityType>& availableActivities() const override { return kActivities; }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<ActivityType>&,
                                                                 const libkineto::Config&) override {
    return std::make_unique<TpuSession>();
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t, int64_t, const std::set<ActivityType>& types,
                                                                 const libkineto::Config& config) override {
    return configure(types, config);
  }

 private:
  std::string name_{"tpu"};
};

}  // namespace

bool session_active() { return g_recording.load(std::memory_order_relaxed); }

uint64_t current_correlation() {
  if (!session_active()) return 0;
  const CorrelationStack& s = t_stack;
  return s.generation == g_generation.load() && !s.ids.empty() ? s.ids.back() : 0;
}

void add(const std::vector<runtime::prof::DeviceEvent>& events) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_session) g_session->add_locked(events);
}

REGISTER_PRIVATEUSE1_PROFILER(TpuActivityProfiler);

}  // namespace tpu::aten::kineto
