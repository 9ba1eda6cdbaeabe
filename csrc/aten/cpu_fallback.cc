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

// `why` without the Python traceback a failing Python meta function appends ("\n\nAt:\n ...").
std::string short_reason(const std::string& why) {
  auto at = why.find("\n\nAt:");
  return at == std::string::npos ? why : why.substr(0, at);
}

}  // namespace

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& why) {
  const auto& on = op.schema().operator_name();
  std::string name = on.name + (on.overload_name.empty() ? "" : "." + on.overload_name);
  const std::string reason = short_reason(why);
  if (fallback_is_error()) {
    // A failed meta function is almost always the caller's mistake (mismatched shapes): say that,
    // not "no tpu lowering".
    const std::string meta_failed = "meta function failed: ";
    TORCH_CHECK(reason.rfind(meta_failed, 0) != 0, "torch_tpu: '", name, "' refused its arguments: ",
                reason.substr(meta_failed.size()), " (PyTorch's shape check; TORCH_TPU_FALLBACK=error keeps "
                "the call off the CPU)");
    TORCH_CHECK_NOT_IMPLEMENTED(false, "torch_tpu: '", name, "' has no tpu lowering (", reason,
                                ") and TORCH_TPU_FALLBACK=error forbids running it on the CPU. "
                                "Unset TORCH_TPU_FALLBACK to allow the CPU fallback.");
  }
  // Run first: a call the CPU refuses too (mismatched shapes or devices, a bad argument) raises
  // PyTorch's own error and is neither counted nor warned about as a fallback.
  at::native::cpu_fallback(op, stack, false);
  bool warn = false;
  {
    std::lock_guard<std::mutex> lock(stats_mu);
    fallback_counts()[name]++;
    fallback_reasons()[name] = reason;
    // Once per op, as TORCH_WARN_ONCE; every time under torch.set_warn_always(True), as it.
    warn = warned().insert(name).second || c10::WarningUtils::get_warnAlways();
  }
  if (warn) {
    TORCH_WARN("torch_tpu: '", name, "' runs on the CPU (", reason,
               "); results are correct but each call copies its tensors to the host and back.");
  }
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
