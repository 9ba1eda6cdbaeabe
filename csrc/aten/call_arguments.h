// Reading a boxed call's arguments before planning: its device, whether a foreach call fits
// the lowered path, bool index masks made integer indices, and the named arguments with
// PyTorch's result type.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

#include "op_info.h"
#include "plan_call.h"

namespace tpu::aten {

// The call's tpu device, or -1 when a tensor has a dtype tpu does not support.
int call_device(c10::ArrayRef<c10::IValue> args);
// Whether a foreach call can run as one program (else PyTorch's per-tensor composite).
bool foreach_lowerable(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args);
// Replaces bool/byte masks in the argument "indices" by integer indices (one host read each).
void convert_bool_indices(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// Fills `named` and returns PyTorch's result type of the call.
c10::ScalarType named_args(const OpInfo& info, const c10::FunctionSchema& schema,
                           c10::ArrayRef<c10::IValue> args, const std::vector<at::Tensor>& outs,
                           std::vector<NamedArg>& named);

}  // namespace tpu::aten
