#include "device_checks.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "context.h"
#include "lowering/lowering.h"

namespace tpu::runtime {

namespace {
std::atomic<bool>& enabled() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("TORCH_TPU_DEVICE_CHECKS");
    return !(v && (std::string(v) == "0" || std::string(v) == "false" || std::string(v) == "off"));
  }()};
  return on;
}
std::atomic<std::string (*)()> site_provider{nullptr};

struct PendingStatus {
  pjrt::BufferPtr buf;
  std::vector<CheckSource> sources;
};
std::mutex mu;
std::vector<PendingStatus>& pending() {
  static auto* p = std::make_unique<std::vector<PendingStatus>>().release();  // see Context::get
  return *p;
}
// A long run without host reads: statuses are read (oldest first) past this many, which bounds
// the memory they hold; by then the oldest launches have long finished.
constexpr size_t kMaxPending = 1024;

[[noreturn]] void raise(int32_t code, const std::vector<CheckSource>& sources) {
  auto msg = lowering::check_message(code);
  // Sources with code 0 stand for any check of their op (strict: one op; fused: several
  // candidates, each named).
  std::vector<std::string> who;
  for (const CheckSource& s : sources) {
    if (s.code != code && s.code != 0) continue;
    std::string w = s.what + (s.site.empty() ? std::string() : ", launched at " + s.site);
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

void read_all(std::vector<PendingStatus>& list) {
  for (size_t i = 0; i < list.size(); ++i) {
    int32_t code = 0;
    list[i].buf->to_host(&code, sizeof code);
    if (code != 0) raise(code, list[i].sources);
  }
}
}  // namespace

bool device_checks() { return enabled().load(std::memory_order_relaxed); }
void set_device_checks(bool on) { enabled() = on; }
void set_launch_site_provider(std::string (*fn)()) { site_provider = fn; }

std::vector<CheckSource> check_sources(const std::vector<int32_t>& codes, const std::string& what) {
  std::vector<CheckSource> out;
  if (codes.empty()) return out;
  auto fn = site_provider.load();
  std::string site = fn ? fn() : std::string();
  for (int32_t c : codes) out.push_back({c, what, site});
  return out;
}

void add_error_status(pjrt::BufferPtr status, std::vector<CheckSource> sources) {
  if (Context::get().mode() == EagerMode::DeferNeverLaunchBlocking) {
    std::vector<PendingStatus> one{{std::move(status), std::move(sources)}};
    read_all(one);
    return;
  }
  std::vector<PendingStatus> old;
  {
    std::lock_guard<std::mutex> lock(mu);
    pending().push_back({std::move(status), std::move(sources)});
    if (pending().size() > kMaxPending) {
      auto& p = pending();
      old.assign(std::make_move_iterator(p.begin()), std::make_move_iterator(p.begin() + kMaxPending / 2));
      p.erase(p.begin(), p.begin() + kMaxPending / 2);
    }
  }
  read_all(old);
}

void check_device_errors() {
  std::vector<PendingStatus> list;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (pending().empty()) return;
    list.swap(pending());
  }
  read_all(list);
}

}  // namespace tpu::runtime
