// Shared by the host kernels (aten/ffi_kernels.cc: ragged dot; aten/ffi_conv.cc: convolution):
// the XLA FFI headers of the installed jaxlib, pinned to the API version the plugin runs, and an
// FFI buffer (host memory on the CPU plugin) seen as a CPU tensor without a copy. Include only
// under `#if __has_include("xla/ffi/api/ffi.h")`.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wreturn-type"
#include "xla/ffi/api/c_api.h"
// xla-cpu-pjrt 0.0.1 runs XLA FFI API 0.2 and refuses handlers that report a newer version; the
// headers of jaxlib 0.10.2 are 0.3. Minor versions only add struct fields and entry points behind
// struct_size checks, and the handlers use nothing newer than 0.2 (buffers, scalar and i64-array
// attributes, errors), so they report 0.2; the probe in register_host_kernels checks the result.
#if XLA_FFI_API_MAJOR == 0 && XLA_FFI_API_MINOR > 2
#undef XLA_FFI_API_MINOR
#define XLA_FFI_API_MINOR 2
#endif
#include "xla/ffi/api/ffi.h"
#pragma GCC diagnostic pop

namespace tpu::aten::ffi_buffers {

inline c10::ScalarType scalar_type(xla::ffi::DataType t) {
  switch (t) {
    case xla::ffi::DataType::F32: return c10::kFloat;
    case xla::ffi::DataType::BF16: return c10::kBFloat16;
    case xla::ffi::DataType::F16: return c10::kHalf;
    default: TORCH_CHECK(false, "unsupported element type ", static_cast<int>(t));
  }
}

inline at::Tensor wrap(const xla::ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return at::from_blob(b.untyped_data(), c10::IntArrayRef(d.begin(), d.size()),
                       at::TensorOptions().dtype(scalar_type(b.element_type())));
}

}  // namespace tpu::aten::ffi_buffers
