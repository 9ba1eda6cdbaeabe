// Device-side error checks (lowering.h check()). Each device has one status buffer, s32[2] =
// {checked launches that passed, code of the first failed check (0 = none)}. A checked program
// takes it as its last argument, donated, and returns the updated status as its last result
// (Builder::fold_status), so a launch allocates nothing and the host reads one status per device
// at the next host read or synchronize() - not one per op. The host keeps, per device, the
// sources (op name + launching Python line, formatted only on failure) of the launches since the
// last read; the passed count picks the failed launch. Debug eager (launch blocking) reads the
// status at each checked launch, so the op itself raises.
#pragma once
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "pjrt/pjrt.h"

namespace tpu::runtime {

// On unless TORCH_TPU_DEVICE_CHECKS=0; part of every checked op's signature key.
bool device_checks();
void set_device_checks(bool on);

// The Python line that launched an op, captured cheaply (an interned code object and the
// instruction offset) and turned into "file.py:12" only when a check failed.
struct LaunchSite {
  const void* code = nullptr;  // owned by the provider (interned for the process)
  int lasti = -1;              // instruction offset in `code`
  int line = -1;               // or the line itself
  std::string str() const;     // "" when unknown
};
struct SiteProvider {
  LaunchSite (*capture)() = nullptr;
  std::string (*format)(const LaunchSite&) = nullptr;
};
void set_site_provider(SiteProvider p);  // installed by the Python module
LaunchSite capture_site();

// Who may have set a status: the error code's op (what) and launch site. code 0 = any check of
// `what` (strict: one op; fused: several candidates, each named).
struct CheckSource {
  int32_t code = 0;
  std::string what;
  LaunchSite site;
};
std::vector<CheckSource> check_sources(const std::string& what);  // one source, site captured now

// One checked launch on `device`: the device's status goes in as the program's last argument
// (donated) and comes back as its last result. The lock held from construction to done() keeps
// launch order and status order the same across threads; call done() right after the launch
// (nothing that may launch a checked program in between). If the launch throws before done(), the
// (possibly donated) status is replaced by a fresh one.
class CheckedLaunch {
 public:
  explicit CheckedLaunch(int device);
  ~CheckedLaunch();
  CheckedLaunch(const CheckedLaunch&) = delete;
  CheckedLaunch& operator=(const CheckedLaunch&) = delete;
  PJRT_Buffer* status_arg() const;
  // Stores the program's status result and releases the device's status; never raises.
  void done(pjrt::BufferPtr status, std::vector<CheckSource> sources);
  // Call once the launch's results are stored: in debug eager (launch blocking), or when many
  // launches went unread, reads the status now and raises a failure (DeviceCheckError).
  void raise_if_due();

 private:
  struct DeviceStatus* ds_;
  std::unique_lock<std::mutex> lock_;
  bool done_ = false, due_ = false;
};

// kind: 1 = IndexError, 2 = RuntimeError (lowering::CheckKind).
struct DeviceCheckError : std::runtime_error {
  DeviceCheckError(int k, const std::string& m) : std::runtime_error(m), kind(k) {}
  int kind;
};
// Reads each device's status (one small read per device with checked launches since the last
// read); throws DeviceCheckError for a failed check. A failed status is reset, so the process
// continues cleanly after the error.
void check_device_errors();

// Counters since start: checked launches and host reads of a status (benchmarks, tests).
struct DeviceCheckStats {
  uint64_t checked_launches = 0, status_reads = 0;
};
DeviceCheckStats device_check_stats();

}  // namespace tpu::runtime
