// The per-kind host-kernel switches (host_kernels.h); the global ones live with the ragged dot
// (grouped_mm.cc).
#include <array>
#include <atomic>

#include "host_kernels.h"

namespace tpu::lowering {
namespace {
// Both kinds start on. The host GEMM (two threads since session 9) takes few-row products only
// (matmul.cc's threshold comment); with one thread, on the quiet machine, it lost to XLA's two-core
// dot at the HF models' many-row shapes (session 8: llama forward 70-99 -> 144-148 ms).
std::array<std::atomic<bool>, kHostKernelKinds> kind_on{true, true};
}  // namespace

void set_host_kernel_enabled(HostKernel kind, bool enabled) { kind_on.at(static_cast<int>(kind)) = enabled; }

bool host_kernel_enabled(HostKernel kind) {
  return host_kernels_enabled() && kind_on.at(static_cast<int>(kind)).load(std::memory_order_relaxed);
}

}  // namespace tpu::lowering
