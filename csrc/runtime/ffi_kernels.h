// The host kernels (lowering/host_kernels.h): typed XLA FFI handlers that aten/ffi_kernels.cc offers
// at load time and the runtime registers with the CPU PJRT plugin when the client starts.
#pragma once
#include <string>

#include "pjrt/pjrt.h"

namespace tpu::runtime {

// An XLA_FFI_Handler* for custom-call target `target` (called at static initialization).
void offer_host_kernel(const std::string& target, void* handler);
// Called once when the client starts. Registers the handlers when the platform is the CPU plugin,
// torch_tpu was built with the XLA FFI headers and TORCH_TPU_HOST_KERNELS is not 0; never throws
// (on failure the XLA paths stay in use and host_kernels_status() says why).
void register_host_kernels(const pjrt::Client& client);
// "on", "off" (disabled by the user) or "unavailable: <why>".
std::string host_kernels_status();

}  // namespace tpu::runtime
