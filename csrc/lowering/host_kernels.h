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
// Off by default: calls below a size threshold take the XLA path (faster there); on, every size
// takes the host kernel (tests of tiny shapes).
void set_host_kernels_any_size(bool any_size);
bool host_kernels_any_size();

// One switch per kind on top of the one above (torch_tpu.ops.host_kernels(enabled, kind=...)): the
// convolution forward (host_conv.h) and the matrix products (host_gemm.h), both on by default. The
// ragged dot follows the one above alone.
enum class HostKernel : int { Conv = 0, Gemm = 1 };
inline constexpr int kHostKernelKinds = 2;
void set_host_kernel_enabled(HostKernel kind, bool enabled);
bool host_kernel_enabled(HostKernel kind);  // available, switched on, and this kind on

}  // namespace tpu::lowering
