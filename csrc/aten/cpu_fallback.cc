// The CPU fallback: an op without a (usable) tpu lowering runs through PyTorch's
// at::native::cpu_fallback (exact semantics for in-place, out= and views), counted per op and
// warned once, or refused under TORCH_TPU_FALLBACK=error.
#include "cpu_fallback.h"

#include <ATen/native/CPUFallback.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

namespace tpu::aten {

namespace {

std::mutex stats_mu;
std::map<std::string, int64_t>& fallback_counts() {
  static auto* m = std::make_unique<std::map<std::string, int64_t>>().release();
  return *m;
}
std::map<std::string, std::string>& fallback_reasons() {
  static auto* m = std::make_unique<std::map<std::string, std::string>>().release();
  return *m;
}
std::set<std::string>& warned() {
  static auto* s = std::make_unique<std::set<std::string>>().release();
  return *s;
}

bool fallback_is_error() {
  const char* v = std::getenv("TORCH_TPU_FALLBACK");
  return v && std::string(v) == "error";
}

}  // namespace

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& why) {
  const auto& on = op.schema().operator_name();
  std::string name = on.name + (on.overload_name.empty() ? "" : "." + on.overload_name);
  if (fallback_is_error()) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "torch_tpu: '", name, "' has no tpu lowering (", why,
                                ") and TORCH_TPU_FALLBACK=error forbids running it on the CPU. "
                                "Unset TORCH_TPU_FALLBACK to allow the CPU fallback.");
  }
  bool warn = false;
  {
    std::lock_guard<std::mutex> lock(stats_mu);
    fallback_counts()[name]++;
    fallback_reasons()[name] = why;
    warn = warned().insert(name).second;
  }
  if (warn) {
    TORCH_WARN("torch_tpu: '", name, "' runs on the CPU (", why,
               "); results are correct but each call copies its tensors to the host and back.");
  }
  at::native::cpu_fallback(op, stack, false);
}

std::map<std::string, int64_t> fallback_stats() {
  std::lock_guard<std::mutex> lock(stats_mu);
  return fallback_counts();
}

std::map<std::string, std::string> fallback_why() {
  std::lock_guard<std::mutex> lock(stats_mu);
  return fallback_reasons();
}

void reset_fallback_stats() {
  std::lock_guard<std::mutex> lock(stats_mu);
  fallback_counts().clear();
  fallback_reasons().clear();
}

}  // namespace tpu::aten
