// Why eager compiled a new program: the first call of an op (its signature, readable), or what
// changed since the last signature compiled for the same overload (TORCH_LOGS / compile stats).
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "plan_call.h"

namespace tpu::aten {

std::string compile_reason(const std::string& op, const std::vector<const NamedArg*>& args,
                           const std::vector<at::Tensor>& outs);

}  // namespace tpu::aten
