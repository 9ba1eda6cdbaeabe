#include "profiler.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string_view>
#include <unordered_map>

#include "context.h"

namespace tpu::runtime::prof {

namespace {

Hooks g_hooks;

struct Pending {
  std::string name;
  int64_t enqueue_us;
  int device;
  int64_t seq;  // launch order on the device
  uint64_t correlation;
  int64_t end_us = 0;
};

struct DeviceClock {
  std::mutex mu;
  int64_t next_seq = 0;
  std::unordered_map<int, int64_t> last_end;  // per device: end of the last reported launch
  std::vector<Pending> done;                   // completed, not yet reported
  // Profiled launches whose completion callback has not run yet. PJRT releases a waiter (a d2h,
  // synchronize) and runs the ready callbacks on another thread in no set order: a flush at a
  // sync point waits briefly for them, or a loaded machine drops the last launches' device rows.
  int64_t outstanding = 0;
  std::condition_variable settled;
};

DeviceClock& clock() {
  static DeviceClock* c = std::make_unique<DeviceClock>().release();  // outlives plugin threads
  return *c;
}

int64_t next_seq() {
  auto& c = clock();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.next_seq++;
}

void on_complete(std::unique_ptr<Pending> p) {
  p->end_us = now_us();
  auto& c = clock();
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.done.size() < (1u << 20)) c.done.push_back(std::move(*p));
  if (--c.outstanding == 0) c.settled.notify_all();
}

void launch_tracked(int delta) {
  auto& c = clock();
  std::lock_guard<std::mutex> lock(c.mu);
  c.outstanding += delta;
}

// Callbacks can be delivered late and out of order; a device runs its programs in launch order,
// so a launch ended no later than any later launch's reported end (suffix minimum), and started
// no earlier than its enqueue and the previous launch's end.
std::vector<DeviceEvent> intervals(std::vector<Pending>& done, std::unordered_map<int, int64_t>& last_end) {
  std::sort(done.begin(), done.end(), [](const Pending& a, const Pending& b) {
    return a.device != b.device ? a.device < b.device : a.seq < b.seq;
  });
  for (size_t i = done.size(); i-- > 1;)
    if (done[i - 1].device == done[i].device) done[i - 1].end_us = std::min(done[i - 1].end_us, done[i].end_us);
  std::vector<DeviceEvent> out;
  out.reserve(done.size());
  for (Pending& p : done) {
    int64_t& last = last_end[p.device];
    int64_t start = std::max(p.enqueue_us, last);
    int64_t end = std::max(p.end_us, start + 1);
    last = end;
    out.push_back({start, end, std::move(p.name), p.device, p.correlation});
  }
  return out;
}

}  // namespace

void install(const Hooks& h) { g_hooks = h; }

bool active() { return g_hooks.active && g_hooks.active(); }

int64_t now_us() {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
}

Range::Range(const char* kind, const std::string& detail) {
  if (!active()) return;
  t0_ = now_us();
  flush_ = std::string_view(kind) == "d2h" || std::string_view(kind) == "synchronize";
  std::string name = std::string("tpu::") + kind;
  if (!detail.empty()) name += " " + detail;
  h_ = g_hooks.begin(name);
}

Range::~Range() {
  if (flush_) flush();
  if (h_) g_hooks.end(h_);
}

CompileScope::CompileScope(const std::string& what) {
  if (!active()) return;
  what_ = &what;
  t0_ = now_us();
}

CompileScope::~CompileScope() {
  if (!what_ || !tier_ || !active()) return;
  g_hooks.interval(t0_, std::max(now_us(), t0_ + 1), std::string("tpu::compile[") + tier_ + "] " + *what_);
}

void track_launch(const Range& launch, const std::vector<pjrt::BufferPtr>& outs, int device,
                  const std::string& what) {
  if (outs.empty() || !launch.start_us()) return;
  const PJRT_Api* api = Context::get().client().api().raw();
  PJRT_Buffer_ReadyEvent_Args r{};
  r.struct_size = PJRT_Buffer_ReadyEvent_Args_STRUCT_SIZE;
  r.buffer = outs.front()->raw();
  if (PJRT_Error* err = api->PJRT_Buffer_ReadyEvent(&r)) {  // no device time for this launch
    PJRT_Error_Destroy_Args d{};
    d.struct_size = PJRT_Error_Destroy_Args_STRUCT_SIZE;
    d.error = err;
    api->PJRT_Error_Destroy(&d);
    return;
  }
  struct Arg {
    const PJRT_Api* api;
    std::unique_ptr<Pending> p;
  };
  uint64_t corr = g_hooks.correlation ? g_hooks.correlation() : 0;
  auto arg = std::make_unique<Arg>(
      Arg{api, std::make_unique<Pending>(Pending{what, launch.start_us(), device, next_seq(), corr})});
  launch_tracked(+1);  // before registering: the callback may run at once
  PJRT_Event_OnReady_Args a{};
  a.struct_size = PJRT_Event_OnReady_Args_STRUCT_SIZE;
  a.event = r.event;
  a.user_arg = arg.release();
  a.callback = [](PJRT_Error* err, void* user) {
    std::unique_ptr<Arg> p(static_cast<Arg*>(user));
    if (err) {  // the launch's error surfaces at the next wait; here it is only freed
      PJRT_Error_Destroy_Args d{};
      d.struct_size = PJRT_Error_Destroy_Args_STRUCT_SIZE;
      d.error = err;
      p->api->PJRT_Error_Destroy(&d);
    }
    on_complete(std::move(p->p));
  };
  PJRT_Error* err = api->PJRT_Event_OnReady(&a);
  if (err) {
    std::unique_ptr<Arg> p(static_cast<Arg*>(a.user_arg));  // the callback will not run
    launch_tracked(-1);
    PJRT_Error_Destroy_Args d{};
    d.struct_size = PJRT_Error_Destroy_Args_STRUCT_SIZE;
    d.error = err;
    api->PJRT_Error_Destroy(&d);
  }
  // The registered callback keeps what it needs; the event handle itself can go.
  PJRT_Event_Destroy_Args e{};
  e.struct_size = PJRT_Event_Destroy_Args_STRUCT_SIZE;
  e.event = r.event;
  api->PJRT_Event_Destroy(&e);
}

void flush() {
  if (!g_hooks.device) return;
  std::vector<DeviceEvent> ev;
  {
    auto& c = clock();
    std::unique_lock<std::mutex> lock(c.mu);
    // Launches still running when a d2h returns (later ones) keep this wait to its bound.
    c.settled.wait_for(lock, std::chrono::milliseconds(50), [&c] { return c.outstanding <= 0; });
    if (c.done.empty()) return;
    std::vector<Pending> done;
    done.swap(c.done);
    ev = intervals(done, c.last_end);
  }
  if (!active()) return;  // finished after the profiler stopped: dropped
  g_hooks.device(ev);
}

}  // namespace tpu::runtime::prof
