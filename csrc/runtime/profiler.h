// Profiler hooks of the runtime: tpu launches, compiles (with the cache tier), host<->device
// transfers and host syncs as rows of torch.profiler. The runtime includes no torch headers, so
// the recording itself lives in aten/profiler_hooks.cc, which installs `Hooks` at load time.
// With no profiler active every hook costs one indirect call returning false.
#pragma once
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "pjrt/pjrt.h"

namespace tpu::runtime::prof {

// Device time of one launch (wall clock, microseconds since the Unix epoch).
struct DeviceEvent {
  int64_t start_us, end_us;
  std::string what;          // "aten::mm", "fused graph", "graph graph5"
  int device;
  uint64_t correlation;      // the torch op that launched it (profiler correlation id), 0 = none
};

struct Hooks {
  bool (*active)() = nullptr;                      // a torch.profiler is recording on this thread
  void* (*begin)(const std::string& name) = nullptr;  // opens a RecordFunction range
  void (*end)(void* range) = nullptr;
  // A range with explicit wall-clock times (microseconds since the Unix epoch), on this thread.
  void (*interval)(int64_t start_us, int64_t end_us, const std::string& name) = nullptr;
  // The innermost torch op being recorded on this thread (its correlation id), 0 if none.
  uint64_t (*correlation)() = nullptr;
  // Completed device intervals: device activities of the Kineto session (key_averages' device
  // time of the op that launched them), or without one a "tpu device" thread row.
  void (*device)(const std::vector<DeviceEvent>& events) = nullptr;
};
void install(const Hooks& h);
bool active();
int64_t now_us();  // wall clock, the profiler's time base

// RAII range "tpu::<kind> <detail>"; nothing happens when no profiler is active. Ranges that
// wait for the device (kind "d2h", "synchronize") report completed device time when they end.
class Range {
 public:
  Range(const char* kind, const std::string& detail);
  explicit Range(const char* kind) : Range(kind, std::string()) {}
  ~Range();
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;
  int64_t start_us() const { return t0_; }  // 0 when inactive

 private:
  void* h_ = nullptr;
  int64_t t0_ = 0;
  bool flush_ = false;
};

// A program compile request: reports "tpu::compile[<tier>] <what>" (tier: memory, disk, xla)
// when the tier is set and the scope ends.
class CompileScope {
 public:
  explicit CompileScope(const std::string& what);
  ~CompileScope();
  void tier(const char* t) { tier_ = t; }

 private:
  const std::string* what_ = nullptr;
  const char* tier_ = nullptr;
  int64_t t0_ = 0;
};

// Device time of one launch: when profiling, the ready event of the launch's first output (PJRT
// completes a program's outputs together) stamps the end in its OnReady callback; the start is the later of the enqueue time and the previous completion on that device
// (PJRT runs one device's programs in order). Reported as "tpu::device <what>" by flush().
void track_launch(const Range& launch, const std::vector<pjrt::BufferPtr>& outs, int device,
                  const std::string& what);
// Hands completed device intervals to the profiler (it records per thread, so this runs on the
// launching thread: after host syncs and synchronize()).
void flush();

}  // namespace tpu::runtime::prof
