// The per-kind host-kernel switches (host_kernels.h); the global ones live with the ragged dot
// (grouped_mm.cc).
#include <array>
#include <atomic>

#include "host_kernels.h"

namespace tpu::lowering {
namespace {
// The host GEMM starts off: on a quiet 2-core machine its one MKL thread loses to XLA's dot on both
// cores at the HF model shapes (session 8: llama forward 70-99 -> 144-148 ms); it wins only for
// few-row products. Two threads inside the call need a split without an OpenMP team (next step).
std::array<std::atomic<bool>, kHostKernelKinds> kind_on{true, false};
}  // namespace

void set_host_kernel_enabled(HostKernel kind, bool enabled) { kind_on.at(static_cast<int>(kind)) = enabled; }

bool host_kernel_enabled(HostKernel kind) {
  return host_kernels_enabled() && kind_on.at(static_cast<int>(kind)).load(std::memory_order_relaxed);
}

}  // namespace tpu::lowering
