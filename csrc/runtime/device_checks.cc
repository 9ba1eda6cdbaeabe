#include "device_checks.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <unordered_map>

#include "context.h"
#include "lowering/lowering.h"

namespace tpu::runtime {

struct DeviceStatus {
  std::mutex mu;
  int device = 0;
  pjrt::BufferPtr buf;                                // s32[2]; null until the first checked launch
  uint32_t passed_at_read = 0;                        // passed count at the last read
  std::vector<std::vector<CheckSource>> launches;     // sources of each launch since that read
};

namespace {
std::atomic<bool>& enabled() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("TORCH_TPU_DEVICE_CHECKS");
    return !(v && (std::string(v) == "0" || std::string(v) == "false" || std::string(v) == "off"));
  }()};
  return on;
}
std::atomic<LaunchSite (*)()> site_capture{nullptr};
std::atomic<uint64_t> n_launches{0}, n_reads{0};
std::atomic<std::string (*)(const LaunchSite&)> site_format{nullptr};

// Statuses live as long as the process (see Context::get).
std::mutex registry_mu;
std::unordered_map<int, std::unique_ptr<DeviceStatus>>& registry() {
  static auto* r = std::make_unique<std::unordered_map<int, std::unique_ptr<DeviceStatus>>>().release();
  return *r;
}
DeviceStatus& status_of(int device) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto& slot = registry()[device];
  if (!slot) {
    slot = std::make_unique<DeviceStatus>();
    slot->device = device;
  }
  return *slot;
}

// A long run without host reads reads its status once this many launches are queued: bounds the
// sources kept, at one host sync per 4096 checked launches.
constexpr size_t kMaxLaunches = 4096;

void reset_locked(DeviceStatus& ds) {
  const int32_t zeros[2] = {0, 0};
  auto& ctx = Context::get();
  ds.buf = ctx.client().from_host(zeros, pjrt::ElementType::S32, {2}, ctx.device(ds.device));
  ds.passed_at_read = 0;
  ds.launches.clear();
}

[[noreturn]] void raise(int32_t code, const std::vector<CheckSource>& sources) {
  auto msg = lowering::check_message(code);
  std::vector<std::string> who;
  for (const CheckSource& s : sources) {
    if (s.code != code && s.code != 0) continue;
    std::string site = s.site.str();
    std::string w = s.what + (site.empty() ? std::string() : ", launched at " + site);
    if (std::find(who.begin(), who.end(), w) == who.end()) who.push_back(w);
    if (s.code == code || who.size() >= 4) break;
  }
  std::string text = msg ? msg->second : "device-side check failed (code " + std::to_string(code) + ")";
  text += " (device-side check of ";
  if (who.empty()) text += "a checked op";
  for (size_t i = 0; i < who.size(); ++i) text += (i ? " or " : "") + who[i];
  text += ")";
  text += ". TPU_LAUNCH_BLOCKING=1 raises at the op itself; TORCH_TPU_DEVICE_CHECKS=0 disables the checks.";
  throw DeviceCheckError(msg ? static_cast<int>(msg->first) : 2, text);
}

struct Failure {
  int32_t code = 0;
  std::vector<CheckSource> sources;
};

// Reads the status (waits for the device's checked launches so far). A failure is returned, not
// raised: the message is formatted (taking the GIL) after the status lock is released.
Failure read_locked(DeviceStatus& ds) {
  if (ds.launches.empty() || !ds.buf) return {};
  int32_t st[2] = {0, 0};
  ds.buf->to_host(st, sizeof st);
  n_reads.fetch_add(1, std::memory_order_relaxed);
  if (st[1] == 0) {
    ds.passed_at_read = static_cast<uint32_t>(st[0]);
    ds.launches.clear();
    return {};
  }
  // The count stops at the first failure: the launches passed since the last read index it.
  uint32_t i = static_cast<uint32_t>(st[0]) - ds.passed_at_read;
  Failure f{st[1], i < ds.launches.size() ? std::move(ds.launches[i]) : std::vector<CheckSource>{}};
  reset_locked(ds);
  return f;
}

void read_and_raise(DeviceStatus& ds) {
  Failure f;
  {
    std::lock_guard<std::mutex> lock(ds.mu);
    f = read_locked(ds);
  }
  if (f.code != 0) raise(f.code, f.sources);
}
}  // namespace

bool device_checks() { return enabled().load(std::memory_order_relaxed); }
void set_device_checks(bool on) { enabled() = on; }

void set_site_provider(SiteProvider p) {
  site_format = p.format;
  site_capture = p.capture;
}

LaunchSite capture_site() {
  auto fn = site_capture.load();
  return fn ? fn() : LaunchSite{};
}

std::string LaunchSite::str() const {
  auto fn = site_format.load();
  return code && fn ? fn(*this) : std::string();
}

std::vector<CheckSource> check_sources(const std::string& what) { return {{0, what, capture_site()}}; }

CheckedLaunch::CheckedLaunch(int device) : ds_(&status_of(device)), lock_(ds_->mu) {
  if (!ds_->buf) reset_locked(*ds_);
}

CheckedLaunch::~CheckedLaunch() {
  if (done_) return;
  try {  // the launch failed: its donated status may be gone, and no source was recorded for it
    reset_locked(*ds_);
  } catch (...) {
    ds_->buf.reset();
  }
}

PJRT_Buffer* CheckedLaunch::status_arg() const { return ds_->buf->raw(); }

void CheckedLaunch::done(pjrt::BufferPtr status, std::vector<CheckSource> sources) {
  done_ = true;
  n_launches.fetch_add(1, std::memory_order_relaxed);
  ds_->buf = std::move(status);
  ds_->launches.push_back(std::move(sources));
  due_ = Context::get().mode() == EagerMode::DeferNeverLaunchBlocking || ds_->launches.size() >= kMaxLaunches;
  lock_.unlock();
}

void CheckedLaunch::raise_if_due() {
  if (!due_) return;
  due_ = false;
  read_and_raise(*ds_);
}

void check_device_errors() {
  std::vector<DeviceStatus*> all;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    for (auto& [d, ds] : registry()) all.push_back(ds.get());
  }
  for (DeviceStatus* ds : all) read_and_raise(*ds);
}

DeviceCheckStats device_check_stats() { return {n_launches.load(), n_reads.load()}; }

}  // namespace tpu::runtime
