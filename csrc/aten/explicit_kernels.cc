// tpu kernels for two lowered ops whose output metadata PyTorch's meta functions cannot give us:
//
// - aten::_grouped_mm: the registered (Python) meta accepts bfloat16 only, while the CPU kernel
//   - whose semantics the lowering matches - also takes float32 and float16. This kernel checks
//   the arguments like the CPU kernel (dtypes, int32 offs, 16-byte aligned strides, shapes),
//   allocates the contiguous output and runs the lowering in csrc/lowering/grouped_mm.cc.
// - aten::bincount: the output length is max(self) + 1 (at least minlength), known only from the
//   data. One documented host sync reads min and max back together (min < 0 is an error like on
//   the CPU); the lowering in csrc/lowering/search.cc scatters into the sized output.
//
// - torch_tpu::ragged_dot: only to pass the rhs layout hint (below).
//
// _grouped_mm, ragged_dot and ragged_dot_weight_grad also pass "host_kernel", the state of the
// host-kernel switch (lowering/host_kernels.h: the CPU plugin's FFI GEMM), so it is part of the
// plan key and toggling it (torch_tpu::_host_kernels, below) never reuses a plan of the other path.
//
// All go through run_lowering (strict/fused eager, compile cache, explain) like every lowered
// op; a lowering that refuses (Unsupported) falls back to the CPU, counted as usual.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ops/aminmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>

#include "common.h"
#include "plan_call.h"
#include "cpu_fallback.h"
#include "lowering/host_kernels.h"
#include "runtime/context.h"
#include "runtime/ffi_kernels.h"

namespace tpu::aten {
namespace {

// Runs lowering `name` into `outs`; on Unsupported the op runs on the CPU fallback instead.
// Returns false when it fell back (the stack then holds the fallback's results).
bool run_or_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, const char* name,
                     const std::vector<NamedArg>& named, const std::vector<at::Tensor>& outs,
                     c10::ScalarType common) {
  const lowering::OpEntry* entry = lowering::find_op(name);
  std::string why = "no lowering";
  if (entry) {
    try {
      run_lowering(name, op.schema().overload_name(), *entry, named, outs, common);
      return true;
    } catch (const lowering::Unsupported& e) {
      why = std::string("lowering refused: ") + e.what();
    }
  }
  cpu_fallback(op, stack, why);
  return false;
}

c10::IValue opt(const std::optional<at::Tensor>& t) { return t ? c10::IValue(*t) : c10::IValue(); }

std::optional<at::Tensor> opt_tensor(const c10::IValue& v) {
  if (v.isNone()) return std::nullopt;
  at::Tensor t = v.toTensor();
  if (!t.defined()) return std::nullopt;
  return t;
}

// PyTorch's grouped-GEMM stride rule: the last two dims are row- or column-major with the
// leading stride a multiple of 16 bytes.
void check_strides(const at::Tensor& m, const char* name) {
  const int64_t e = m.dim() - 1;
  const int64_t align = 16 / static_cast<int64_t>(m.element_size());
  const auto st = m.strides();
  const auto sz = m.sizes();
  if (st[e - 1] == 1 && st[e] >= std::max<int64_t>(1, sz[e - 1])) {
    TORCH_CHECK(st[e] % align == 0, "_grouped_mm: expected ", name, " stride along dim ", e,
                " to be a multiple of 16 bytes, got ", st[e], ".");
  } else if (st[e] == 1 && st[e - 1] >= std::max<int64_t>(1, sz[e])) {
    TORCH_CHECK(st[e - 1] % align == 0, "_grouped_mm: expected ", name, " stride along dim ", e - 1,
                " to be a multiple of 16 bytes, got ", st[e - 1], ".");
  } else {
    TORCH_CHECK(false, "_grouped_mm: invalid strides/sizes for ", name, ": strides ", st, ", sizes ", sz, ".");
  }
}

void grouped_mm_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 5);
  const at::Tensor a = args[0].toTensor();
  const at::Tensor w = args[1].toTensor();
  const std::optional<at::Tensor> offs = opt_tensor(args[2]);
  const std::optional<at::Tensor> bias = opt_tensor(args[3]);
  const bool has_out_dtype = !args[4].isNone();

  auto is_ok_dtype = [](c10::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; };
  TORCH_CHECK(is_ok_dtype(a.scalar_type()), "_grouped_mm: expected mat_a to be Float32, BFloat16 or Float16, got ",
              a.scalar_type());
  TORCH_CHECK(w.scalar_type() == a.scalar_type(), "_grouped_mm: expected mat_b to have mat_a's dtype ",
              a.scalar_type(), ", got ", w.scalar_type());
  TORCH_CHECK((a.dim() == 2 || a.dim() == 3) && (w.dim() == 2 || w.dim() == 3),
              "_grouped_mm: multiplicands must be 2-D or 3-D, got mat_a.dim()=", a.dim(), " and mat_b.dim()=", w.dim());
  TORCH_CHECK(a.size(-1) == w.size(-2), "_grouped_mm: contraction dimension of mat_a and mat_b must match");
  TORCH_CHECK(!bias, "_grouped_mm: bias is not supported (as in PyTorch)");
  if (has_out_dtype)
    TORCH_CHECK(args[4].toScalarType() == a.scalar_type(), "_grouped_mm: output dtype must match mat_a's dtype");
  const bool a2 = a.dim() == 2, w2 = w.dim() == 2;
  TORCH_CHECK((a2 || w2) == offs.has_value(),
              "_grouped_mm: offs is required when an operand is 2-D and not allowed when both are 3-D");
  check_strides(a, "mat_a");
  check_strides(w, "mat_b");
  std::vector<int64_t> size;
  if (offs) {
    TORCH_CHECK(offs->dim() == 1, "_grouped_mm: offs must be 1-D, got ", offs->dim(), "-D");
    TORCH_CHECK(offs->scalar_type() == at::kInt, "_grouped_mm: offs must be int32, got ", offs->scalar_type());
    const int64_t g = offs->size(0);
    if (a2 && w2) {
      size = {g, a.size(0), w.size(1)};
    } else if (a2) {
      TORCH_CHECK(g == w.size(0), "_grouped_mm: matrix batch sizes have to match");
      size = {a.size(0), w.size(2)};
    } else {
      TORCH_CHECK(g == a.size(0), "_grouped_mm: matrix batch sizes have to match");
      size = {a.size(1), w.size(1)};
    }
  } else {
    TORCH_CHECK(a.size(0) == w.size(0), "_grouped_mm: batched dimension has to match");
    size = {a.size(0), a.size(1), w.size(2)};
  }
  // Inputs must all live on one tpu device; anything else takes the CPU path.
  bool on_tpu = a.device().type() == kTpu && w.device() == a.device() && (!offs || offs->device() == a.device());
  if (!on_tpu) {
    cpu_fallback(op, stack, "operands on different devices");
    return;
  }
  c10::DeviceGuard guard(a.device());
  at::Tensor out = at::empty(size, a.options());
  // Layout hint for the lowering (not a schema argument; absent in compiled graphs): mat2 is
  // column-major in its last two dims, e.g. Transformers' weight.transpose(-2, -1).
  const bool w_col_major = w.stride(-2) == 1 && w.stride(-1) != 1;
  std::vector<NamedArg> named{{"self", a},
                              {"mat2", w},
                              {"offs", opt(offs)},
                              {"bias", c10::IValue()},
                              {"out_dtype", args[4], NamedArg::Hint::DType},
                              {"mat2_col_major", w_col_major},
                              {"host_kernel", lowering::host_kernels_enabled()},
                              {"host_kernel_any_size", lowering::host_kernels_any_size()}};
  if (!run_or_fallback(op, stack, "_grouped_mm", named, {out}, a.scalar_type())) return;
  torch::jit::drop(*stack, 5);
  stack->push_back(out);
}

// torch_tpu::ragged_dot (defined in python/torch_tpu/ops, which checks the arguments first): the
// generic path plus the layout hint _grouped_mm gets, so a transposed [G,N,K] rhs (nn.Linear-layout
// experts, and the input gradient's rhs.transpose(1, 2)) is contracted in place.
void ragged_dot_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 3);
  const at::Tensor a = args[0].toTensor();
  const at::Tensor w = args[1].toTensor();
  const at::Tensor sizes = args[2].toTensor();
  TORCH_CHECK(a.dim() == 2 && w.dim() == 3 && sizes.dim() == 1 && w.size(0) == sizes.size(0) &&
                  w.size(1) == a.size(1),
              "ragged_dot: expected lhs [M, K], rhs [G, K, N] and group_sizes [G], got ", a.sizes(), ", ",
              w.sizes(), ", ", sizes.sizes());
  TORCH_CHECK(w.scalar_type() == a.scalar_type(), "ragged_dot: lhs and rhs must share one dtype");
  if (a.device().type() != kTpu || w.device() != a.device() || sizes.device() != a.device()) {
    cpu_fallback(op, stack, "operands on different devices");
    return;
  }
  c10::DeviceGuard guard(a.device());
  at::Tensor out = at::empty({a.size(0), w.size(2)}, a.options());
  const bool w_col_major = w.size(1) > 1 && w.size(2) > 1 && w.stride(1) == 1 && w.stride(2) != 1;
  std::vector<NamedArg> named{{"lhs", a}, {"rhs", w}, {"group_sizes", sizes}, {"rhs_col_major", w_col_major},
                              {"host_kernel", lowering::host_kernels_enabled()},
                              {"host_kernel_any_size", lowering::host_kernels_any_size()}};
  if (!run_or_fallback(op, stack, "ragged_dot", named, {out}, a.scalar_type())) return;
  torch::jit::drop(*stack, 3);
  stack->push_back(out);
}

// torch_tpu::ragged_dot_weight_grad: the generic path plus the host-kernel hint.
void ragged_dot_wgrad_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 3);
  const at::Tensor a = args[0].toTensor();
  const at::Tensor d = args[1].toTensor();
  const at::Tensor sizes = args[2].toTensor();
  TORCH_CHECK(a.dim() == 2 && d.dim() == 2 && sizes.dim() == 1 && a.size(0) == d.size(0),
              "ragged_dot_weight_grad: expected lhs [M, K], grad [M, N] and group_sizes [G], got ", a.sizes(),
              ", ", d.sizes(), ", ", sizes.sizes());
  TORCH_CHECK(d.scalar_type() == a.scalar_type(), "ragged_dot_weight_grad: lhs and grad must share one dtype");
  if (a.device().type() != kTpu || d.device() != a.device() || sizes.device() != a.device()) {
    cpu_fallback(op, stack, "operands on different devices");
    return;
  }
  c10::DeviceGuard guard(a.device());
  at::Tensor out = at::empty({sizes.size(0), a.size(1), d.size(1)}, a.options());
  std::vector<NamedArg> named{{"lhs", a}, {"grad", d}, {"group_sizes", sizes},
                              {"host_kernel", lowering::host_kernels_enabled()},
                              {"host_kernel_any_size", lowering::host_kernels_any_size()}};
  if (!run_or_fallback(op, stack, "ragged_dot_weight_grad", named, {out}, a.scalar_type())) return;
  torch::jit::drop(*stack, 3);
  stack->push_back(out);
}

// torch_tpu::_host_kernels(enable, kind): -1 reads; 0 / 1 / 2 switch the host kernels off / on (by
// size) / on for every size, for the lowerings that follow; returns "on", "off", "always" or
// "unavailable: <why>". With `kind` ("conv" / "gemm"), 0 / 1 switch that kind alone and the answer
// is that kind's. Starts the client, which registers them.
std::string host_kernels_op(int64_t enable, std::optional<c10::string_view> kind) {
  runtime::Context::get().client();
  if (kind) {
    const std::string k(*kind);
    TORCH_CHECK_VALUE(k == "conv" || k == "gemm", "host_kernels: kind must be 'conv' or 'gemm', got '", k, "'");
    const auto hk = k == "conv" ? lowering::HostKernel::Conv : lowering::HostKernel::Gemm;
    if (enable >= 0) lowering::set_host_kernel_enabled(hk, enable != 0);
    const std::string all = runtime::host_kernels_status();
    return all.rfind("unavailable", 0) == 0 || all == "off" || lowering::host_kernel_enabled(hk) ? all : "off";
  }
  if (enable >= 0) {
    lowering::set_host_kernels_enabled(enable != 0);
    lowering::set_host_kernels_any_size(enable == 2);
  }
  return runtime::host_kernels_status();
}

void bincount_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const bool has_out = op.schema().overload_name() == "out";
  const size_t n = has_out ? 4 : 3;
  auto args = torch::jit::last(*stack, n);
  const at::Tensor self = args[0].toTensor();
  const std::optional<at::Tensor> weights = opt_tensor(args[1]);
  const int64_t minlength = args[2].isSymInt() ? args[2].toSymInt().expect_int() : args[2].toInt();
  TORCH_CHECK(minlength >= 0, "minlength should be >= 0");
  TORCH_CHECK(self.dim() == 1 && at::isIntegralType(self.scalar_type(), /*includeBool=*/false),
              "bincount only supports 1-d non-negative integral inputs.");
  if (weights)
    TORCH_CHECK(weights->dim() == 1 && weights->size(0) == self.size(0),
                "weights should be 1-d and have the same length as input");
  if (self.device().type() != kTpu || (weights && weights->device() != self.device())) {
    cpu_fallback(op, stack, "operands on different devices");
    return;
  }
  c10::DeviceGuard guard(self.device());
  int64_t len = minlength;
  if (self.numel() > 0) {
    // The one host sync: min and max together.
    auto [mn, mx] = at::aminmax(self);
    at::Tensor host = at::stack({mn.to(at::kLong), mx.to(at::kLong)}).to(c10::kCPU);
    const int64_t lo = host[0].item<int64_t>(), hi = host[1].item<int64_t>();
    TORCH_CHECK(lo >= 0, "bincount only supports 1-d non-negative integral inputs.");
    len = std::max(len, hi + 1);
  }
  // PyTorch: float weights count in float, other weights in double, no weights in int64.
  const c10::ScalarType dt = !weights ? at::kLong : weights->scalar_type() == at::kFloat ? at::kFloat : at::kDouble;
  at::Tensor out;
  if (has_out) {
    out = args[3].toTensor();
    TORCH_CHECK(out.scalar_type() == dt, "bincount: out has dtype ", out.scalar_type(), ", expected ", dt);
    out.resize_({len});
  } else {
    out = at::empty({len}, self.options().dtype(dt));
  }
  std::vector<NamedArg> named{{"self", self}, {"weights", opt(weights)}, {"minlength", minlength}};
  if (!run_or_fallback(op, stack, "bincount", named, {out}, dt)) return;
  torch::jit::drop(*stack, n);
  stack->push_back(out);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_grouped_mm", torch::CppFunction::makeFromBoxedFunction<&grouped_mm_kernel>());
  m.impl("bincount", torch::CppFunction::makeFromBoxedFunction<&bincount_kernel>());
  m.impl("bincount.out", torch::CppFunction::makeFromBoxedFunction<&bincount_kernel>());
}

TORCH_LIBRARY_IMPL(torch_tpu, PrivateUse1, m) {
  m.impl("ragged_dot", torch::CppFunction::makeFromBoxedFunction<&ragged_dot_kernel>());
  m.impl("ragged_dot_weight_grad", torch::CppFunction::makeFromBoxedFunction<&ragged_dot_wgrad_kernel>());
}

TORCH_LIBRARY_FRAGMENT(torch_tpu, m) { m.def("_host_kernels(int enable=-1, str? kind=None) -> str", &host_kernels_op); }

}  // namespace tpu::aten
