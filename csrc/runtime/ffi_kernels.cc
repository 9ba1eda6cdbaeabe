// Host kernels for the CPU PJRT plugin as XLA FFI custom calls (see lowering/host_kernels.h).
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
// without them registration reports "unavailable" and the lowerings keep the XLA paths.
#include "ffi_kernels.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>

#include "lowering/host_kernels.h"
#include "pjrt/ffi.h"
#include "stablehlo/builder.h"

#if __has_include("xla/ffi/api/ffi.h")
#define TPU_HAVE_XLA_FFI 1
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
#endif

namespace tpu::runtime {
namespace {

std::mutex status_mu;
std::string status = "unavailable: the PJRT client has not started";

}  // namespace

#ifdef TPU_HAVE_XLA_FFI
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

// The plugin discards registration errors and an unknown target fails only when a program using
// it compiles, so registration is confirmed by compiling and running both handlers once on 2x2
// operands (about 20 ms, once per process) before any lowering may emit them.
void probe(const pjrt::Client& client) {
  using shlo::ElemType;
  using shlo::Type;
  shlo::Builder b;
  shlo::Value a = b.arg(Type{ElemType::F32, {2, 2}});
  shlo::Value w = b.arg(Type{ElemType::F32, {1, 2, 2}});
  shlo::Value e = b.arg(Type{ElemType::S64, {1}});
  const std::string fwd = std::string("call_target_name = \"") + lowering::kRaggedDotTarget +
                          "\", api_version = 4 : i32, backend_config = {rhs_col_major = 0 : i32}";
  const std::string bwd = std::string("call_target_name = \"") + lowering::kRaggedDotWgradTarget +
                          "\", api_version = 4 : i32";
  shlo::Value y = b.op("custom_call", {a, w, e}, Type{ElemType::F32, {2, 2}}, fwd);
  shlo::Value g = b.op("custom_call", {a, a, e}, Type{ElemType::F32, {1, 2, 2}}, bwd);
  auto exe = client.compile(b.module({y, g}), pjrt::portable_compile_options());
  PJRT_Device* dev = client.devices().at(0).device;
  const float av[4] = {1, 2, 3, 4}, wv[4] = {5, 6, 7, 8};
  const int64_t ev[1] = {1};
  auto ba = client.from_host(av, pjrt::ElementType::F32, {2, 2}, dev);
  auto bw = client.from_host(wv, pjrt::ElementType::F32, {1, 2, 2}, dev);
  auto be = client.from_host(ev, pjrt::ElementType::S64, {1}, dev);
  auto outs = exe->execute(dev, {ba->raw(), bw->raw(), be->raw()}, {}, nullptr);
  float yv[4], gv[4];
  outs.at(0)->to_host(yv, sizeof yv);
  outs.at(1)->to_host(gv, sizeof gv);
  // Row 0 is group 0's: [1,2] x [[5,6],[7,8]]; row 1 is past the groups. out[0] = [1,2]^T [1,2].
  const float ye[4] = {19, 22, 0, 0}, ge[4] = {1, 2, 2, 4};
  for (int i = 0; i < 4; ++i)
    if (yv[i] != ye[i] || gv[i] != ge[i]) throw std::runtime_error("the probe call computed wrong values");
}

}  // namespace
#endif  // TPU_HAVE_XLA_FFI

void register_host_kernels(const pjrt::Client& client) {
  auto set = [](std::string s) {
    std::lock_guard<std::mutex> lock(status_mu);
    status = std::move(s);
  };
  if (client.platform_name() != "cpu") {
    set("unavailable: the platform is '" + client.platform_name() + "', not the CPU plugin");
    return;
  }
  const char* env = std::getenv("TORCH_TPU_HOST_KERNELS");
  if (env && std::string(env) == "0") {
    set("unavailable: TORCH_TPU_HOST_KERNELS=0");
    return;
  }
#ifdef TPU_HAVE_XLA_FFI
  try {
    pjrt::register_ffi_handler(client.api(), lowering::kRaggedDotTarget, "Host",
                               reinterpret_cast<void*>(&torch_tpu_ragged_dot_handler));
    pjrt::register_ffi_handler(client.api(), lowering::kRaggedDotWgradTarget, "Host",
                               reinterpret_cast<void*>(&torch_tpu_ragged_dot_wgrad_handler));
    probe(client);
  } catch (const std::exception& e) {
    set(std::string("unavailable: ") + e.what());
    return;
  }
  lowering::set_host_kernels_available(true);
  set("on");
#else
  set("unavailable: torch_tpu was built without the XLA FFI headers (install jaxlib and rebuild)");
#endif
}

std::string host_kernels_status() {
  std::lock_guard<std::mutex> lock(status_mu);
  if (status == "on" && !lowering::host_kernels_enabled()) return "off";
  return status;
}

}  // namespace tpu::runtime
