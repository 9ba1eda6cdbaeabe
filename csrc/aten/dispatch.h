// The PrivateUse1 kernels of lowered ops: the boxed kernel (meta -> outputs -> result type ->
// run_lowering, or the dispatch cache), typed entries for the hottest overloads
// (aten/unboxed_kernels.h) and their registration for every overload of every lowered op.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>

#include <memory>

#include "call_outputs.h"
#include "dispatch_cache.h"
#include "op_info.h"

namespace tpu::aten {

void tpu_boxed_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack);
void register_lowered_kernels();

// The dispatch cache's fast path for a call of `op` with these arguments (boxed, or borrowing
// the caller's tensors): the remembered call when one matched and was launched, its outputs in
// `outs`; null on a miss (nothing done). Callers have ruled out mark_dynamic arguments
// (eager_dynamic.h).
std::shared_ptr<const CachedCall> serve_from_cache(const c10::OperatorHandle& op, const OpInfo& info,
                                                   c10::ArrayRef<c10::IValue> args, CallOutputs& outs);

}  // namespace tpu::aten
