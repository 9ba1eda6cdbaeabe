// Registers the host kernels (aten/ffi_kernels.cc) with the CPU PJRT plugin through its FFI
// extension (pjrt/ffi.h), then proves them with one probe program before any lowering may emit them.
#include "ffi_kernels.h"

#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "lowering/host_gemm.h"
#include "lowering/host_kernels.h"
#include "pjrt/ffi.h"
#include "stablehlo/builder.h"

namespace tpu::runtime {
namespace {

std::mutex mu;
std::string status = "unavailable: the PJRT client has not started";
std::vector<std::pair<std::string, void*>>& offered() {
  static std::vector<std::pair<std::string, void*>> v;
  return v;
}

// The plugin discards registration errors and an unknown target fails only when a program using
// it compiles, so registration is confirmed by compiling and running the ragged dot's handlers and
// the GEMM's once on 2x2 operands (about 20 ms, once per process) before any lowering may emit them.
void probe(const pjrt::Client& client) {
  using shlo::ElemType;
  using shlo::Type;
  shlo::Builder b;
  shlo::Value a = b.arg(Type{ElemType::F32, {2, 2}});
  shlo::Value w = b.arg(Type{ElemType::F32, {1, 2, 2}});
  shlo::Value e = b.arg(Type{ElemType::S64, {1}});
  const std::string fwd = std::string("call_target_name = \"") + lowering::kRaggedDotTarget +
                          "\", api_version = 4 : i32, backend_config = {group_sizes = 0 : i32, rhs_col_major = 0 : i32}";
  const std::string bwd = std::string("call_target_name = \"") + lowering::kRaggedDotWgradTarget +
                          "\", api_version = 4 : i32, backend_config = {group_sizes = 0 : i32}";
  shlo::Value y = b.op("custom_call", {a, w, e}, Type{ElemType::F32, {2, 2}}, fwd);
  shlo::Value g = b.op("custom_call", {a, a, e}, Type{ElemType::F32, {1, 2, 2}}, bwd);
  const std::string gemm = std::string("call_target_name = \"") + lowering::kHostGemmTarget +
                           "\", api_version = 4 : i32, backend_config = {trans_a = 0 : i64, trans_b = 1 : i64, "
                           "has_c = 1 : i64, alpha = 2.0 : f64, beta = 0.5 : f64}";
  shlo::Value wm = b.reshape(w, {2, 2});
  shlo::Value h = b.op("custom_call", {a, wm, wm}, Type{ElemType::F32, {2, 2}}, gemm);
  auto exe = client.compile(b.module({y, g, h}), pjrt::portable_compile_options());
  PJRT_Device* dev = client.devices().at(0).device;
  const float av[4] = {1, 2, 3, 4}, wv[4] = {5, 6, 7, 8};
  const int64_t ev[1] = {1};
  auto ba = client.from_host(av, pjrt::ElementType::F32, {2, 2}, dev);
  auto bw = client.from_host(wv, pjrt::ElementType::F32, {1, 2, 2}, dev);
  auto be = client.from_host(ev, pjrt::ElementType::S64, {1}, dev);
  auto outs = exe->execute(dev, {ba->raw(), bw->raw(), be->raw()}, {}, nullptr);
  float yv[4], gv[4], hv[4];
  outs.at(0)->to_host(yv, sizeof yv);
  outs.at(1)->to_host(gv, sizeof gv);
  outs.at(2)->to_host(hv, sizeof hv);
  // Row 0 is group 0's: [1,2] x [[5,6],[7,8]]; row 1 is past the groups. out[0] = [1,2]^T [1,2].
  // GEMM: 2 * a @ w^T + 0.5 * w = 2 * [[17,23],[39,53]] + 0.5 * [[5,6],[7,8]].
  const float ye[4] = {19, 22, 0, 0}, ge[4] = {1, 2, 2, 4}, he[4] = {36.5f, 49, 81.5f, 110};
  for (int i = 0; i < 4; ++i)
    if (yv[i] != ye[i] || gv[i] != ge[i] || hv[i] != he[i])
      throw std::runtime_error("the probe call computed wrong values");
}

}  // namespace

void offer_host_kernel(const std::string& target, void* handler) {
  std::lock_guard<std::mutex> lock(mu);
  offered().emplace_back(target, handler);
}

void register_host_kernels(const pjrt::Client& client) {
  auto set = [](std::string s) {
    std::lock_guard<std::mutex> lock(mu);
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
  std::vector<std::pair<std::string, void*>> handlers;
  {
    std::lock_guard<std::mutex> lock(mu);
    handlers = offered();
  }
  if (handlers.empty()) {
    set("unavailable: torch_tpu was built without the XLA FFI headers (install jaxlib and rebuild)");
    return;
  }
  try {
    for (const auto& [target, handler] : handlers) pjrt::register_ffi_handler(client.api(), target, "Host", handler);
    probe(client);
  } catch (const std::exception& e) {
    set(std::string("unavailable: ") + e.what());
    return;
  }
  lowering::set_host_kernels_available(true);
  set("on");
}

std::string host_kernels_status() {
  std::lock_guard<std::mutex> lock(mu);
  if (status == "on" && !lowering::host_kernels_enabled()) return "off";
  if (status == "on" && lowering::host_kernels_any_size()) return "always";
  return status;
}

}  // namespace tpu::runtime
