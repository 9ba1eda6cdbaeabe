// Device-side error checks (lowering.h check()): a checked program has one extra i32 result, its
// error status (0 = fine, else the code of a failed check). Launches append the status buffer to
// a pending list instead of reading it (no host sync per op); the next host read, synchronize()
// or - in debug eager - the launch itself reads the pending statuses and raises the first error
// with the op's name and the Python line that launched it.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "pjrt/pjrt.h"

namespace tpu::runtime {

// On unless TORCH_TPU_DEVICE_CHECKS=0; part of every checked op's signature key.
bool device_checks();
void set_device_checks(bool on);

// The Python line launching the current op ("file.py:12"); installed by the Python module.
void set_launch_site_provider(std::string (*fn)());

// Who may have set a status: the error code's op (what) and launch site.
struct CheckSource {
  int32_t code;
  std::string what, site;
};
// The check codes a checked op recorded (code list of the builder) -> sources, with the site
// captured now. Cheap: called only for checked ops.
std::vector<CheckSource> check_sources(const std::vector<int32_t>& codes, const std::string& what);

// Adds a launched program's status buffer; raises at once in debug eager (launch blocking).
void add_error_status(pjrt::BufferPtr status, std::vector<CheckSource> sources);

// kind: 1 = IndexError, 2 = RuntimeError (lowering::CheckKind).
struct DeviceCheckError : std::runtime_error {
  DeviceCheckError(int k, const std::string& m) : std::runtime_error(m), kind(k) {}
  int kind;
};
// Reads every pending status; throws DeviceCheckError for the first failed one (all pending
// statuses are consumed, so the process continues cleanly after the error).
void check_device_errors();

}  // namespace tpu::runtime
