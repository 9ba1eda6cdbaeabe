// Host GEMM for the CPU PJRT plugin: a typed XLA FFI custom call (target kHostGemmTarget,
// lowering/host_gemm.h; lowering/matmul.cc emits it) that runs PyTorch's own CPU mm / addmm / bmm /
// baddbmm on the program's buffers, which are host memory, writing straight into the output buffer.
//
// Why: XLA:CPU's dot is Eigen's tensor contraction; PyTorch CPU's is MKL sgemm, 1.5-3x faster on
// products of few rows (a decode step's or a short decoder's Linears, attention blocks; matmul.cc's
// threshold comment), where matmul.cc uses it. No XLA:CPU option reaches MKL for a plain dot.
// Rank-2 blocks run oneDNN's f32 GEMM instead (PyTorch's mkldnn linear): on this machine's AMD EPYC
// MKL takes its generic kernels, twice oneDNN's CPU time (block_gemm); bmm blocks stay MKL.
//
// Threads: the product is cut into blocks of the output (batch entries, rows, or columns when the
// rows are few), each a one-thread GEMM, run by run_tasks (ffi_common.h) on the XLA thread that
// runs the call and one inter-op pool thread, without an OpenMP team: a team of two inside the
// program waits for its second thread behind XLA's pool and other processes (alternated processes
// at load ~3, [512,256]x[256,1024]: one thread 6.6 ms, an OpenMP team of two 20.4 ms), while on a
// quiet machine one thread loses to XLA's dot on both cores at the HF model shapes (session 8).
// Small products run on the caller alone (kSoloMacs). TORCH_TPU_HOST_GEMM_THREADS=n caps the
// threads (A/B measurements).
#if __has_include("xla/ffi/api/ffi.h")
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include "ffi_common.h"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <utility>

#include "lowering/host_gemm.h"
#include "runtime/ffi_kernels.h"

namespace tpu::aten {
namespace {
namespace ffi = xla::ffi;

using ffi_buffers::wrap;

// Below kSoloMacs multiply-adds (~80 us of one thread's f32 GEMM) a call runs on the caller alone:
// waking the helper costs ~40 us (ffi_kernels.cc's threshold, measured for the ragged dot).
constexpr int64_t kSoloMacs = int64_t{1} << 22;

int64_t gemm_threads(int64_t macs) {
  static const int64_t cap = [] {
    const char* env = std::getenv("TORCH_TPU_HOST_GEMM_THREADS");
    return env ? std::max<int64_t>(1, std::atoll(env)) : int64_t{1} << 30;
  }();
  if (at::in_parallel_region() || macs < kSoloMacs) return 1;
  return std::min<int64_t>(cap, at::get_num_threads());
}

// [begin, end) of part p of `parts` over `len` elements, boundaries on multiples of `align`.
std::pair<int64_t, int64_t> part_range(int64_t len, int64_t parts, int64_t p, int64_t align) {
  const int64_t step = (len + parts - 1) / parts, a = (step + align - 1) / align * align;
  return {std::min(len, p * a), p + 1 == parts ? len : std::min(len, (p + 1) * a)};
}

// PyTorch's oneDNN linear (mkldnn::_linear_pointwise: x w^T (+ bias) on dense, strided operands);
// nullptr when this torch has none or TORCH_TPU_HOST_GEMM_ONEDNN=0 (MKL for every block: A/B).
using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);
const c10::TypedOperatorHandle<LinearFn>* onednn_linear() {
  static const std::optional<c10::TypedOperatorHandle<LinearFn>> op =
      []() -> std::optional<c10::TypedOperatorHandle<LinearFn>> {
    if (!ffi_buffers::onednn_gemm_enabled()) return std::nullopt;
    try {
      auto h = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
      if (!h || !h->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return std::nullopt;
      return h->typed<LinearFn>();
    } catch (const std::exception&) {  // a torch whose schema differs: MKL
      return std::nullopt;
    }
  }();
  return op ? &*op : nullptr;
}

// y (= beta * c +) alpha * x w for one block: rank-2 or rank-3 views of the call's buffers.
void block_gemm(at::Tensor y, const at::Tensor& c, const at::Tensor& x, const at::Tensor& w, bool has_c,
                double alpha, double beta) {
  // Rank 2 through oneDNN: on this AMD EPYC MKL runs its generic sgemm kernels, about twice oneDNN's
  // CPU time per multiply-add (one thread, [128,512]x[512,1376]: MKL 2.3 ms, oneDNN 1.1 ms, JAX's
  // XLA dot 1.2 ms of CPU; strict-eager F.linear of that shape, alternated processes at load 3.5:
  // 1.0-1.2 ms vs 2.0-2.8 ms wall). A bias (beta = alpha = 1, c broadcast over rows) goes with it.
  // The op returns a new tensor: the copy into the block costs ~2% of compiled prefill's samples.
  const bool bias = has_c && alpha == 1.0 && beta == 1.0 && c.stride(0) == 0;
  // Only dense operands (row- or column-major): a column block of a wider operand is neither, and
  // oneDNN then runs its reference inner product (a training step's lm_head backward took minutes).
  auto dense = [](const at::Tensor& t) { return t.is_contiguous() || t.t().is_contiguous(); };
  if (y.dim() == 2 && (!has_c || bias) && alpha == 1.0 && dense(x) && dense(w)) {
    if (const auto* lin = onednn_linear()) {
      std::optional<at::Tensor> b;
      if (bias) b = c.select(0, 0).contiguous();
      y.copy_(lin->call(x, w.t(), b, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt));
      return;
    }
  }
  if (y.dim() == 2) {
    if (has_c) at::cpu::addmm_out(y, c, x, w, beta, alpha);
    else at::cpu::mm_out(y, x, w);
  } else {
    if (has_c) at::cpu::baddbmm_out(y, c, x, w, beta, alpha);
    else at::cpu::bmm_out(y, x, w);
  }
}

ffi::Error host_gemm(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer c, ffi::Result<ffi::AnyBuffer> out,
                     int64_t trans_a, int64_t trans_b, int64_t has_c, double alpha, double beta) {
  try {
    c10::InferenceMode no_autograd;
    at::Tensor x = wrap(a), w = wrap(b), y = wrap(*out);
    if (trans_a) x = x.transpose(-2, -1);
    if (trans_b) w = w.transpose(-2, -1);
    TORCH_CHECK(x.dim() == y.dim() && w.dim() == y.dim() && (y.dim() == 2 || y.dim() == 3), "operand ranks ",
                x.dim(), ", ", w.dim(), " for a rank-", y.dim(), " result");
    // The addend as a (stride-0 where broadcast) view of the output's shape, so a block is a slice.
    at::Tensor z = has_c ? wrap(c).expand(y.sizes()) : at::Tensor();
    const int64_t r = y.dim(), batch = r == 3 ? y.size(0) : 1, m = y.size(r - 2), n = y.size(r - 1);
    const int64_t threads = gemm_threads(batch * m * x.size(r - 1) * n);
    // Blocks: whole batch entries when there are enough, else rows; columns when the rows are few
    // (a decode step's Linear: the weight is the big operand, and each thread then reads half of it).
    // MKL keeps its small-matrix kernels for a block of >= 16 rows or columns.
    int dim = -1;
    int64_t align = 1;
    if (threads > 1 && batch >= threads) {
      dim = 0;
    } else if (threads > 1 && m >= n && m >= 16 * threads) {
      dim = r - 2, align = 8;
    } else if (threads > 1 && n >= 16 * threads) {
      dim = r - 1, align = 16;
    }
    const int64_t len = dim < 0 ? 1 : y.size(dim), parts = dim < 0 ? 1 : std::min(threads, len);
    run_tasks(parts, threads, [&](int64_t p) {
      c10::InferenceMode on_this_thread;  // the blocks are views of inference tensors (a pool thread too)
      if (dim < 0) return block_gemm(y, z, x, w, has_c, alpha, beta);
      const auto [s, e] = part_range(len, parts, p, align);
      if (s >= e) return;
      const int64_t xd = dim == r - 1 ? -1 : dim, wd = dim == r - 2 ? -1 : dim;  // -1: whole operand
      block_gemm(y.narrow(dim, s, e - s), has_c ? z.narrow(dim, s, e - s) : z,
                 xd < 0 ? x : x.narrow(xd, s, e - s), wd < 0 ? w : w.narrow(wd, s, e - s), has_c, alpha, beta);
    });
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
