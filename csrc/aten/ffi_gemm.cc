// Host GEMM for the CPU PJRT plugin: a typed XLA FFI custom call (target kHostGemmTarget,
// lowering/host_gemm.h; lowering/matmul.cc emits it) that runs PyTorch's own CPU mm / addmm / bmm /
// baddbmm on the program's buffers, which are host memory, writing straight into the output buffer.
//
// Why: XLA:CPU's dot is Eigen's tensor contraction; PyTorch CPU's is MKL sgemm, 1.1-1.5x faster on
// the GEMMs of the HF models (bench_gemm.py, matmul.cc's threshold comment), and those GEMMs are
// half or more of a forward. No XLA:CPU option reaches MKL for a plain dot.
//
// Threads: one (MKL and OpenMP), on the XLA thread that runs the call. An OpenMP team of two inside
// the program waits for its second thread behind XLA's pool and other processes: alternated
// processes at load ~3, ms per call wall / CPU, one thread vs two: [512,256]x[256,1024] 6.6 / 6.6 vs
// 20.4 / 14.3, [256,256]x[256,256] 0.49 / 0.49 vs 6.4 / 5.1, [32,256]x[256,256] 0.09 vs 0.76-15
// (matmul.cc's threshold comment has the XLA side). Same finding as the host convolution.
#if __has_include("xla/ffi/api/ffi.h")
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include "ffi_common.h"

#include <exception>
#include <string>

#include "lowering/host_gemm.h"
#include "runtime/ffi_kernels.h"

namespace tpu::aten {
namespace {
namespace ffi = xla::ffi;

using ffi_buffers::wrap;

ffi::Error host_gemm(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer c, ffi::Result<ffi::AnyBuffer> out,
                     int64_t trans_a, int64_t trans_b, int64_t has_c, double alpha, double beta) {
  try {
    c10::InferenceMode no_autograd;
    ffi_buffers::OmpThreads team(1);
    at::Tensor x = wrap(a), w = wrap(b), y = wrap(*out);
    if (trans_a) x = x.transpose(-2, -1);
    if (trans_b) w = w.transpose(-2, -1);
    TORCH_CHECK(x.dim() == y.dim() && w.dim() == y.dim() && (y.dim() == 2 || y.dim() == 3), "operand ranks ",
                x.dim(), ", ", w.dim(), " for a rank-", y.dim(), " result");
    if (y.dim() == 2) {
      if (has_c) at::cpu::addmm_out(y, wrap(c), x, w, beta, alpha);
      else at::cpu::mm_out(y, x, w);
    } else {
      if (has_c) at::cpu::baddbmm_out(y, wrap(c), x, w, beta, alpha);
      else at::cpu::bmm_out(y, x, w);
    }
  } catch (const std::exception& ex) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("torch_tpu.gemm: ") + ex.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(torch_tpu_host_gemm_handler, host_gemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("trans_a")
                                  .Attr<int64_t>("trans_b")
                                  .Attr<int64_t>("has_c")
                                  .Attr<double>("alpha")
                                  .Attr<double>("beta"));

namespace {
const bool offered = [] {
  runtime::offer_host_kernel(lowering::kHostGemmTarget, reinterpret_cast<void*>(&torch_tpu_host_gemm_handler));
  return true;
}();
}  // namespace

}  // namespace tpu::aten
#endif  // xla/ffi/api/ffi.h
