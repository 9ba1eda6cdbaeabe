// The host convolution (aten/ffi_conv.cc): PyTorch's CPU convolution as a typed XLA FFI custom call
// on the CPU plugin; lowering/convolution.cc emits it for forward convolutions when the host kernels
// are available and enabled (lowering/host_kernels.h).
#pragma once

namespace tpu::lowering {

inline constexpr const char* kHostConvTarget = "torch_tpu.conv";

}  // namespace tpu::lowering
