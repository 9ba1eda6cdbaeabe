// The boxed PrivateUse1 kernel (meta -> outputs -> result type -> run_lowering) and its
// registration for every overload of every lowered op.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>

namespace tpu::aten {

void tpu_boxed_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack);
void register_lowered_kernels();

}  // namespace tpu::aten
