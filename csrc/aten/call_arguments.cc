#include "call_arguments.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>

#include <algorithm>
#include <functional>
#include <optional>

#include "common.h"

namespace tpu::aten {

namespace {
void visit_tensors(const c10::IValue& v, const std::function<void(const at::Tensor&)>& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) f(t);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef())
      if (e.isTensor()) f(e.toTensor());
  }
}
}  // namespace

// The call's tpu device (the first tpu tensor or device argument, else 0), or -1 when a tensor
// has a dtype tpu does not support.
int call_device(c10::ArrayRef<c10::IValue> args) {
  int device = -1;
  bool any_unsupported = false;
  for (const c10::IValue& v : args) {
    visit_tensors(v, [&](const at::Tensor& t) {
      if (!t.defined()) return;
      if (t.device().type() == kTpu && device < 0) device = t.device().index();
      if (!supported_dtype(t.scalar_type())) any_unsupported = true;
    });
    if (v.isDevice() && v.toDevice().type() == kTpu && device < 0)
      device = v.toDevice().has_index() ? v.toDevice().index() : 0;
  }
  return any_unsupported ? -1 : std::max(device, 0);
}

// Whether a foreach call fits the lowered path: non-empty, equally long lists of tpu tensors,
// tensor scalars on the tpu or 0-d on the host. Anything else (mixed devices, empty lists,
// a 1-D host scalars tensor) goes to the composite.
bool foreach_lowerable(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args) {
  std::optional<size_t> len;
  for (size_t j = 0; j < args.size(); ++j) {
    const c10::IValue& v = args[j];
    if (v.isTensorList()) {
      auto l = v.toTensorList();
      if (l.size() == 0 || (len && *len != l.size())) return false;
      len = l.size();
      for (const at::Tensor& t : l)
        if (!t.defined() || t.device().type() != kTpu) return false;
    } else if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.defined() && t.device().type() != kTpu && !(t.device().is_cpu() && t.dim() == 0)) return false;
    } else if (is_scalar_list(schema.arguments()[j].type())) {
      if (len && *len != v.toListRef().size()) return false;
    }
  }
  if (!len) return false;
  // In place, PyTorch writes element i before reading element i+1: an element written here that
  // overlaps another index's element (of any list) would read differently in one program.
  struct Span { const void* storage; int64_t lo, hi; size_t idx; bool written; };
  std::vector<Span> spans;
  bool any_written = false;
  for (size_t j = 0; j < args.size(); ++j) {
    if (!args[j].isTensorList()) continue;
    const auto* ai = schema.arguments()[j].alias_info();
    bool written = ai && ai->isWrite();
    any_written |= written;
    auto l = args[j].toTensorList();
    for (size_t i = 0; i < l.size(); ++i) {
      const at::Tensor& t = l[i];
      int64_t extent = 1;
      for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
      if (t.numel() == 0) extent = 0;
      spans.push_back({t.storage().unsafeGetStorageImpl(), t.storage_offset(), t.storage_offset() + extent, i, written});
    }
  }
  if (!any_written) return true;
  // Sorted by storage then start, only neighbours that overlap are compared (O(n log n) for
  // disjoint parameters, even when they share one flat storage).
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.storage != b.storage ? std::less<const void*>()(a.storage, b.storage) : a.lo < b.lo;
  });
  for (size_t x = 0; x < spans.size(); ++x) {
    for (size_t y = x + 1; y < spans.size() && spans[y].storage == spans[x].storage && spans[y].lo < spans[x].hi; ++y) {
      const Span &a = spans[x], &b = spans[y];
      if (a.idx != b.idx && (a.written || b.written) && a.hi > a.lo && b.hi > b.lo) return false;
    }
  }
  return true;
}

// x[bool_mask]: the mask becomes integer indices on the host (one sync), then the lowered
// integer-index gather runs on the device.
void convert_bool_indices(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& sargs = op.schema().arguments();
  auto args = torch::jit::last(*stack, sargs.size());
  for (size_t j = 0; j < sargs.size(); ++j) {
    if (sargs[j].name() != "indices" || !args[j].isList()) continue;
    c10::List<std::optional<at::Tensor>> fixed;
    bool changed = false;
    for (const c10::IValue& e : args[j].toListRef()) {
      if (e.isTensor() && (e.toTensor().scalar_type() == at::kBool || e.toTensor().scalar_type() == at::kByte)) {
        const at::Tensor& mask = e.toTensor();
        at::Tensor nz = mask.to(c10::kCPU).nonzero();  // the read is counted by the copy
        for (int64_t d = 0; d < mask.dim(); ++d)
          fixed.push_back(nz.select(1, d).to(mask.device().type() == kTpu ? mask.device() : c10::Device(kTpu, 0)));
        changed = true;
      } else {
        fixed.push_back(e.isTensor() ? std::optional<at::Tensor>(e.toTensor()) : std::nullopt);
      }
    }
    if (changed) (*stack)[stack->size() - sargs.size() + j] = fixed;
  }
}

// The named arguments the planner reads, and PyTorch's result type over tensor and scalar
// arguments (the computation dtype; the first output's dtype when there is none).
c10::ScalarType named_args(const OpInfo& info, const c10::FunctionSchema& schema,
                           c10::ArrayRef<c10::IValue> args, const std::vector<at::Tensor>& outs,
                           std::vector<NamedArg>& named) {
  const lowering::OpEntry& entry = *info.entry;
  const auto& sargs = schema.arguments();
  const size_t n = args.size();
  ResultTypeAccumulator promotion;
  named.reserve(n);
  for (size_t j = 0; j < n; ++j) {
    NamedArg a{sargs[j].name(), args[j], info.hints[j]};  // declared runtime scalars: Scalar
    // A foreach ScalarList (per-element lr / bias corrections) becomes 0-d host tensors: runtime
    // operands, not constants, so new values never recompile.
    if (entry.foreach && is_scalar_list(sargs[j].type())) {
      c10::List<at::Tensor> l;
      for (const c10::IValue& e : args[j].toListRef()) {
        const c10::Scalar sc = e.toScalar();
        l.push_back(at::scalar_tensor(sc, at::TensorOptions().dtype(sc.isFloatingPoint() ? at::kDouble
                                                                     : sc.isBoolean()      ? at::kBool
                                                                     : sc.isComplex()      ? at::kComplexDouble
                                                                                           : at::kLong)));
      }
      a.value = l;
    }
    if (!sargs[j].is_out()) {
      if (args[j].isTensor() && args[j].toTensor().defined()) promotion.tensor(args[j].toTensor());
      else if (a.hint == NamedArg::Hint::Scalar && args[j].isScalar()) promotion.scalar(args[j].toScalar());
    }
    named.push_back(std::move(a));
  }
  c10::ScalarType first_output = c10::kFloat;
  for (const auto& o : outs)
    if (o.defined()) { first_output = o.scalar_type(); break; }
  return promotion.result(first_output);
}

}  // namespace tpu::aten
