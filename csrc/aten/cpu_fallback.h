// Ops without a usable lowering run on the CPU (counted, warned once); see cpu_fallback.cc.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>

#include <map>
#include <string>

namespace tpu::aten {
void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& why);
std::map<std::string, int64_t> fallback_stats();
std::map<std::string, std::string> fallback_why();
void reset_fallback_stats();
}  // namespace tpu::aten
