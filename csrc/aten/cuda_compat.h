// Behaviours CUDA users rely on that PyTorch only grants to its in-tree backends.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>

namespace tpu::aten {
// CPU index tensors (long/int/bool, any rank) given to an indexing op of tpu tensors move to the
// op's tpu device once, before the op runs (CUDA accepts them; assisted decoding relies on it).
// CPU bool masks stay on the host for ops declared `host_bool_indices` (index): the op turns
// them into integer indices there.
void move_cpu_index_args(const c10::OperatorHandle& op, const std::string& base, torch::jit::Stack* stack);
}  // namespace tpu::aten
