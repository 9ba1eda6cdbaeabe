// Eager bounded dynamism (torch_tpu.mark_dynamic): storages marked dynamic hold a tensor padded
// to a size bucket along one dim. Any op reading one is handed to the Python handler
// (python/torch_tpu/_internal/eager_dynamic.py), which runs it as a bucketed program or declines.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>

namespace tpu::aten::eager_dynamic {

// True when the op was run by the handler (its results replace the arguments on the stack);
// false when the call has no dynamic input or the handler declined (the normal path runs it).
// One relaxed atomic load when nothing is marked.
bool maybe_handle(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Whether t's storage is marked dynamic (a bucket-sized buffer read through a prefix view).
bool is_marked(const at::Tensor& t);

}  // namespace tpu::aten::eager_dynamic
