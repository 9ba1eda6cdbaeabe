// Host convolution for the CPU PJRT plugin: a typed XLA FFI custom call (target kHostConvTarget,
// lowering/convolution.cc emits it) that runs PyTorch's own CPU convolution (oneDNN) on the
// program's buffers, which are host memory.
//
// Why: XLA:CPU lowers a convolution to Eigen's spatial convolution (im2col packing + oneDNN sgemm
// on small blocks, e.g. 248x288 x 288x48 for a 64-channel 3x3 conv) with transposes to NHWC/HWIO
// around it; per 3x3 conv of AutoencoderKL's shapes that is 1.4-2.5x PyTorch CPU's direct oneDNN
// convolution. The plugin's XNNPACK convolution thunk is never emitted by its thunk emitter and
// `xla_cpu_use_onednn` / `xla_cpu_experimental_onednn_custom_call` leave the convolution on Eigen
// (HLO dumps; docs/architecture.md, "Host kernels"), so no XLA option reaches a faster kernel.
//
// The handler computes at::convolution (stride, padding, dilation, transposed, output_padding,
// groups: every conv PyTorch has) and copies the result into the output buffer. Results equal
// PyTorch CPU's (same kernel and algorithm choice as a one-thread CPU call).
//
// Threads: one OpenMP thread (oneDNN follows OpenMP's team size), on the XLA thread that runs the
// custom call. An OpenMP team inside the program waits for its second thread behind XLA's pool
// threads and other processes, and splitting the batch between the caller and an inter-op pool
// task cost more than it gained. AutoencoderKL compiled forward, alternated processes at load
// 4.6-5.1: one thread 16.9 / 19.7 ms wall (16.6 / 15.6 ms process CPU), batch halves on two
// threads 31.4 / 28.4 ms (20.6 / 21.1); at load 9-17 one thread vs the default OpenMP team:
// 24.8 vs 38.6 ms median wall (15.5 vs 20.8 ms process CPU).
#if __has_include("xla/ffi/api/ffi.h")
#include <ATen/core/Tensor.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include "ffi_common.h"

#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "lowering/host_conv.h"
#include "runtime/ffi_kernels.h"

namespace tpu::aten {
namespace {
namespace ffi = xla::ffi;

using ffi_buffers::wrap;

std::vector<int64_t> vec(ffi::Span<const int64_t> s) { return std::vector<int64_t>(s.begin(), s.end()); }

// input [N, Cin, s...], weight [Cout, Cin/G, k...] (transposed: [Cin, Cout/G, k...]), bias [Cout]
// when has_bias (otherwise the third operand is a placeholder) -> out [N, Cout, o...].
ffi::Error host_conv(ffi::AnyBuffer input, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> stride,
                     ffi::Span<const int64_t> padding, ffi::Span<const int64_t> dilation,
                     ffi::Span<const int64_t> output_padding, int64_t transposed, int64_t groups,
                     int64_t has_bias) {
  try {
    c10::InferenceMode no_autograd;
    ffi_buffers::OmpThreads one(1);
    at::Tensor x = wrap(input), w = wrap(weight), y = wrap(*out);
    std::optional<at::Tensor> b;
    if (has_bias) b = wrap(bias);
    at::Tensor r = at::convolution(x, w, b, vec(stride), vec(padding), vec(dilation), transposed != 0,
                                   vec(output_padding), groups);
    TORCH_CHECK(r.sizes() == y.sizes(), "result ", r.sizes(), " does not match the output ", y.sizes());
    y.copy_(r);
  } catch (const std::exception& ex) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("torch_tpu.conv: ") + ex.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(torch_tpu_host_conv_handler, host_conv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("stride")
                                  .Attr<ffi::Span<const int64_t>>("padding")
                                  .Attr<ffi::Span<const int64_t>>("dilation")
                                  .Attr<ffi::Span<const int64_t>>("output_padding")
                                  .Attr<int64_t>("transposed")
                                  .Attr<int64_t>("groups")
                                  .Attr<int64_t>("has_bias"));

namespace {
const bool offered = [] {
  runtime::offer_host_kernel(lowering::kHostConvTarget, reinterpret_cast<void*>(&torch_tpu_host_conv_handler));
  return true;
}();
}  // namespace

}  // namespace tpu::aten
#endif  // xla/ffi/api/ffi.h
