// Host kernels: native code the CPU PJRT plugin runs as XLA FFI custom calls (registered by
// runtime/ffi_kernels.cc when the client starts). The plugin's device memory is host memory, so a
// custom call can hand its buffers to a tuned CPU GEMM where XLA:CPU's own dot is 3-5x slower.
// Lowerings emit one only when it was registered for the running plugin and is enabled.
#pragma once

namespace tpu::lowering {

// Custom-call targets (typed FFI, api_version 4).
inline constexpr const char* kRaggedDotTarget = "torch_tpu.ragged_dot";       // [M,K]x[G,K,N]
inline constexpr const char* kRaggedDotWgradTarget = "torch_tpu.ragged_dot_wgrad";  // -> [G,K,N]

void set_host_kernels_available(bool available);  // by the runtime, after registration
bool host_kernels_available();
// The user's switch (torch_tpu.ops.host_kernels), on by default; lowerings use a host kernel when
// it is available and enabled.
void set_host_kernels_enabled(bool enabled);
bool host_kernels_enabled();

}  // namespace tpu::lowering
