// Host kernels for the CPU PJRT plugin as XLA FFI custom calls (lowering/host_kernels.h says when
// the lowerings emit them; runtime/ffi_kernels.cc registers them with the plugin).
//
// The ragged dot at MoE decode sizes is bound by the GEMM, and XLA:CPU's dot is 2.7-5x slower
// than oneDNN/MKL there (no XLA flag changes that; measured in benchmarks/bench_grouped_mm.py).
// These handlers run inside the program, on the plugin's buffers, which are host memory: each
// group is one at::mm into its rows of the output (ATen's CPU GEMM: MKL/oneDNN, AMX for bf16),
// wrapped with from_blob (no copy). They read the group ends from a device buffer that is ready
// when the call runs, so nothing syncs with the host and the op stays one node of whatever
// program (strict, fused or compiled) contains it.
//
// Built only when the XLA FFI headers of the installed jaxlib are on the include path (setup.py);
// without them no handler is offered and the lowerings keep the XLA paths.
#if __has_include("xla/ffi/api/ffi.h")
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/util/Exception.h>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wreturn-type"
#include "xla/ffi/api/c_api.h"
// xla-cpu-pjrt 0.0.1 runs XLA FFI API 0.2 and refuses handlers that report a newer version; the
// headers of jaxlib 0.10.2 are 0.3. Minor versions only add struct fields and entry points behind
// struct_size checks, and the handlers below use nothing newer than 0.2 (buffers, one scalar
// attribute, errors), so they report 0.2; the probe in register_host_kernels checks the result.
#if XLA_FFI_API_MAJOR == 0 && XLA_FFI_API_MINOR > 2
#undef XLA_FFI_API_MINOR
#define XLA_FFI_API_MINOR 2
#endif
#include "xla/ffi/api/ffi.h"
#pragma GCC diagnostic pop

#include <algorithm>
#include <string>

#include "lowering/host_kernels.h"
#include "runtime/ffi_kernels.h"

namespace tpu::aten {
namespace {
namespace ffi = xla::ffi;

c10::ScalarType scalar_type(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return c10::kFloat;
    case ffi::DataType::BF16: return c10::kBFloat16;
    case ffi::DataType::F16: return c10::kHalf;
    default: TORCH_CHECK(false, "unsupported element type ", static_cast<int>(t));
  }
}

at::Tensor wrap(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return at::from_blob(b.untyped_data(), c10::IntArrayRef(d.begin(), d.size()),
                       at::TensorOptions().dtype(scalar_type(b.element_type())));
}

// [M,K] x [G,K,N] -> [M,N]: group g owns rows [ends[g-1], ends[g]) (clamped, sorted); rows past the
// last group are zero. rhs arrives as [G,N,K] when `rhs_col_major` (nn.Linear-layout experts),
// multiplied through a transposed view (the GEMM's transpose flag, no copy).
ffi::Error ragged_dot(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S64> ends,
                      ffi::Result<ffi::AnyBuffer> out, int32_t rhs_col_major) {
  try {
    at::Tensor a = wrap(lhs), w = wrap(rhs), y = wrap(*out);
    TORCH_CHECK(a.dim() == 2 && w.dim() == 3 && y.dim() == 2, "bad operand ranks");
    const int64_t m = a.size(0), g = w.size(0);
    TORCH_CHECK(static_cast<int64_t>(ends.element_count()) == g, "group count mismatch");
    const int64_t* e = ends.typed_data();
    int64_t start = 0;
    for (int64_t i = 0; i < g; ++i) {
      const int64_t end = std::min(std::max(e[i], start), m);
      if (end > start) {
        at::Tensor wi = w.select(0, i);
        at::Tensor yi = y.narrow(0, start, end - start);
        at::cpu::mm_out(yi, a.narrow(0, start, end - start), rhs_col_major ? wi.t() : wi);
      }
      start = end;
    }
    if (start < m) y.narrow(0, start, m - start).zero_();
  } catch (const std::exception& ex) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("torch_tpu.ragged_dot: ") + ex.what());
  }
  return ffi::Error::Success();
}

// [M,K], [M,N] -> [G,K,N]: out[g] = lhs[rows_g]^T grad[rows_g], zero for empty groups.
ffi::Error ragged_dot_wgrad(ffi::AnyBuffer lhs, ffi::AnyBuffer grad, ffi::Buffer<ffi::S64> ends,
                            ffi::Result<ffi::AnyBuffer> out) {
  try {
    at::Tensor a = wrap(lhs), d = wrap(grad), y = wrap(*out);
    TORCH_CHECK(a.dim() == 2 && d.dim() == 2 && y.dim() == 3, "bad operand ranks");
    const int64_t m = a.size(0), g = y.size(0);
    TORCH_CHECK(static_cast<int64_t>(ends.element_count()) == g, "group count mismatch");
    const int64_t* e = ends.typed_data();
    int64_t start = 0;
    for (int64_t i = 0; i < g; ++i) {
      const int64_t end = std::min(std::max(e[i], start), m);
      at::Tensor yi = y.select(0, i);
      if (end > start) {
        at::cpu::mm_out(yi, a.narrow(0, start, end - start).t(), d.narrow(0, start, end - start));
      } else {
        yi.zero_();
      }
      start = end;
    }
  } catch (const std::exception& ex) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("torch_tpu.ragged_dot_wgrad: ") + ex.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(torch_tpu_ragged_dot_handler, ragged_dot,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S64>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("rhs_col_major"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(torch_tpu_ragged_dot_wgrad_handler, ragged_dot_wgrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S64>>()
                                  .Ret<ffi::AnyBuffer>());

namespace {
// Offered to the runtime at load time; it registers them when the client starts.
const bool offered = [] {
  runtime::offer_host_kernel(lowering::kRaggedDotTarget, reinterpret_cast<void*>(&torch_tpu_ragged_dot_handler));
  runtime::offer_host_kernel(lowering::kRaggedDotWgradTarget,
                             reinterpret_cast<void*>(&torch_tpu_ragged_dot_wgrad_handler));
  return true;
}();

}  // namespace

}  // namespace tpu::aten
#endif  // xla/ffi/api/ffi.h
