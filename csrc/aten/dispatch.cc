// The boxed PrivateUse1 kernel every ATen op without an explicit tpu kernel reaches. It asks
// PyTorch's meta function for output metadata (cached by call signature), allocates (or
// resizes) the outputs, computes PyTorch's result type, and hands the call to run_lowering
// (aten/plan_call.cc). Ops without a lowering go to the CPU fallback (aten/cpu_fallback.cc).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/TypeProperties.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <sstream>
#include <unordered_map>

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/scalar_tensor.h>

#include "allocator.h"
#include "common.h"
#include "plan_call.h"
#include "cpu_fallback.h"
#include "dispatch.h"
#include "dispatch_cache.h"
#include "eager_dynamic.h"
#include "cuda_compat.h"
#include "runtime/compile_cache.h"

namespace tpu::aten {

namespace {

NamedArg::Hint hint_of(const c10::TypePtr& type) {
  c10::TypePtr t = type;
  if (t->kind() == c10::TypeKind::OptionalType) t = t->containedTypes()[0];
  switch (t->kind()) {
    case c10::TypeKind::NumberType: return NamedArg::Hint::Scalar;
    case c10::TypeKind::ScalarTypeType: return NamedArg::Hint::DType;
    case c10::TypeKind::GeneratorType: return NamedArg::Hint::Generator;
    case c10::TypeKind::LayoutType:
    case c10::TypeKind::MemoryFormatType:
    case c10::TypeKind::DeviceObjType:
      return NamedArg::Hint::Ignore;
    default: return NamedArg::Hint::Auto;
  }
}

at::Tensor to_meta(const at::Tensor& t) {
  // Python scalars wrapped as 0-d CPU tensors stay as they are: Python meta kernels turn them
  // back into numbers, and promotion must still see the wrapped-number flag. Other 0-d CPU
  // tensors promote exactly like 0-d meta tensors.
  if (!t.defined() || t.unsafeGetTensorImpl()->is_wrapped_number()) return t;
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
}

c10::IValue to_meta(const c10::IValue& v) {
  if (v.isTensor()) return to_meta(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(to_meta(t));
    return out;
  }
  if (v.isList()) {
    auto l = v.toList();
    if (l.size() > 0 && (l.get(0).isTensor() || l.get(0).isNone())) {
      c10::List<std::optional<at::Tensor>> out;
      for (const c10::IValue& e : v.toListRef())
        out.push_back(e.isTensor() ? std::optional<at::Tensor>(to_meta(e.toTensor())) : std::nullopt);
      return out;
    }
  }
  if (v.isDevice() && v.toDevice().type() == kTpu) return c10::Device(c10::kMeta);
  if (v.isGenerator()) return c10::IValue();
  return v;
}

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

bool is_int_return(const c10::Argument& r) {
  auto k = r.type()->kind();
  return k == c10::TypeKind::IntType || k == c10::TypeKind::SymIntType;
}
std::shared_mutex meta_mu;
std::unordered_map<std::string, std::shared_ptr<const MetaResult>>& meta_cache() {
  static auto* m = std::make_unique<std::unordered_map<std::string, std::shared_ptr<const MetaResult>>>().release();
  return *m;
}

void key_tensor(std::string& k, const at::Tensor& t) {
  if (!t.defined()) { k += "N;"; return; }
  k += static_cast<char>('A' + static_cast<int>(t.scalar_type()));
  k += t.device().is_cpu() ? (t.unsafeGetTensorImpl()->is_wrapped_number() ? 'w' : 'c') : 'd';
  for (int64_t d : t.sizes()) { k += std::to_string(d); k += ','; }
  k += '/';
  for (int64_t d : t.strides()) { k += std::to_string(d); k += ','; }
  k += ';';
}

// Signature of a call for the meta cache; false when the call must not be cached.
bool meta_key(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, std::string* key) {
  const auto& sargs = op.schema().arguments();
  std::string& k = *key;
  k.reserve(160);
  k += op.schema().name();
  k += '.';
  k += op.schema().overload_name();
  k += '|';
  bool has_input_tensor = false;
  for (size_t j = 0; j < args.size(); ++j) {
    const c10::IValue& v = args[j];
    if (v.isTensor()) {
      key_tensor(k, v.toTensor());
      if (!sargs[j].is_out() && v.toTensor().defined()) has_input_tensor = true;
    } else if (v.isTensorList()) {
      k += "L";
      for (const at::Tensor& t : v.toTensorList()) key_tensor(k, t);
      has_input_tensor = true;
    } else if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList() &&
               !(v.toListRef().size() > 0 && v.toListRef()[0].isBool())) {
      k += "O";
      for (const c10::IValue& e : v.toListRef()) key_tensor(k, e.isTensor() ? e.toTensor() : at::Tensor());
      has_input_tensor = true;
    } else if (v.isScalar() && hint_of(sargs[j].type()) == NamedArg::Hint::Scalar) {
      k += v.isDouble() ? "Sf;" : v.isBool() ? "Sb;" : v.isInt() ? "Si;" : "Sc;";
    } else if (v.isGenerator()) {
      k += "G;";
    } else {
      k += v.tagKind();
      k += ':';
      std::stringstream ss;
      ss << v;
      k += ss.str();
      k += ';';
    }
  }
  return has_input_tensor;
}

const at::Tensor& wrapped_scalar(at::ScalarType t) {
  thread_local at::Tensor d, l, b;
  at::Tensor& slot = t == at::kDouble ? d : t == at::kLong ? l : b;
  if (!slot.defined()) {
    slot = at::scalar_tensor(0, at::TensorOptions().device(c10::kCPU).dtype(t));
    slot.unsafeGetTensorImpl()->set_wrapped_number(true);
  }
  return slot;
}

// The ATen base name that keys the lowering table: "aten::add_" -> "add" (in-place and
// functional variants share one lowering; dunder names such as __and__ keep their underscores).
std::string base_name(const std::string& qualified) {
  std::string base = qualified.substr(qualified.find("::") + 2);
  bool dunder = base.size() > 4 && base.compare(0, 2, "__") == 0;
  if (!dunder && base.size() > 1 && base.back() == '_') base.pop_back();
  return base;
}

bool is_scalar_list(const c10::TypePtr& type) {
  return type->kind() == c10::TypeKind::ListType &&
         type->containedTypes()[0]->kind() == c10::TypeKind::NumberType;
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

// Whether this call writes argument j: the schema's alias annotation, unless the op's lowering
// entry declares otherwise (OpEntry::writes, OpEntry::out_overload_writes_only_out).
bool arg_written(const lowering::OpEntry& entry, const c10::FunctionSchema& schema,
                 c10::ArrayRef<c10::IValue> args, size_t j) {
  const auto& sargs = schema.arguments();
  const auto* alias = sargs[j].alias_info();
  bool written = alias && alias->isWrite();
  for (const lowering::WriteRule& rule : entry.writes) {
    if (sargs[j].name() != rule.arg) continue;
    auto idx = schema.argumentIndexWithName(rule.when);
    const c10::IValue* when = idx ? &args[*idx] : nullptr;
    written = when && ((when->isBool() && when->toBool()) || (when->isTensor() && when->toTensor().defined()));
  }
  if (entry.out_overload_writes_only_out) {
    bool has_out = std::any_of(sargs.begin(), sargs.end(), [](const c10::Argument& a) { return a.is_out(); });
    if (has_out) written = sargs[j].is_out();
  }
  return written;
}

// Why a schema's returns cannot take the lowered path, or nullptr. One bool (equal) is lowered
// to a 0-d bool tensor read back on the host; one un-annotated Tensor[] is a list of fresh
// tensors (out-of-place foreach ops, jax_call); otherwise tensors or ints, no views.
const char* unsupported_returns(const std::vector<c10::Argument>& rets, bool bool_result, bool list_result) {
  if (bool_result || list_result) return nullptr;
  for (const auto& r : rets) {
    if (r.type()->kind() != c10::TypeKind::TensorType && !is_int_return(r)) return "returns a non-tensor";
    if (r.alias_info() && !r.alias_info()->isWrite()) return "returns a view";
  }
  return nullptr;
}

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

// Output metadata from PyTorch's meta function, cached by the call's signature (many meta
// functions are Python and cost ~100 us). Scalar values never change output metadata when the
// op has tensor inputs; pure factories (no tensor input) are not cached. Ops returning nothing
// (in-place list ops) or a bool need no output metadata. Null (with `why`) when meta fails.
std::shared_ptr<const MetaResult> output_meta(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                                              bool bool_result, bool list_result, std::string* why) {
  const auto& rets = op.schema().returns();
  const size_t n = args.size();
  std::string mkey;
  std::shared_ptr<const MetaResult> mr;
  if (rets.empty() || bool_result) {
    auto res = std::make_shared<MetaResult>();
    if (bool_result) res->outs.push_back({{}, {}, c10::ScalarType::Bool});
    mr = res;
  }
  bool cacheable = !mr && meta_key(op, args, &mkey);
  if (cacheable) {
    std::shared_lock<std::shared_mutex> lock(meta_mu);
    if (auto it = meta_cache().find(mkey); it != meta_cache().end()) mr = it->second;
  }
  if (!mr) {
    if (!op.hasKernelForDispatchKey(c10::DispatchKey::Meta) &&
        !op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)) {
      *why = "no meta function";
      return nullptr;
    }
    torch::jit::Stack meta;
    meta.reserve(n);
    for (const c10::IValue& v : args) meta.push_back(to_meta(v));
    try {
      op.callBoxed(&meta);
    } catch (const std::exception& e) {
      *why = std::string("meta function failed: ") + e.what();
      return nullptr;
    }
    auto res = std::make_shared<MetaResult>();
    for (size_t i = 0; i < rets.size(); ++i) {
      if (is_int_return(rets[i])) {  // sizes only: the meta value is the real one
        const c10::IValue& iv = meta[i];
        res->outs.push_back({{}, {}, c10::ScalarType::Undefined,
                             iv.isSymInt() ? iv.toSymInt().expect_int() : iv.toInt()});
        continue;
      }
      if (list_result) {
        for (const at::Tensor& m : meta[i].toTensorList())
          res->outs.push_back({m.sizes().vec(), m.strides().vec(), m.scalar_type()});
        continue;
      }
      const at::Tensor& m = meta[i].toTensor();
      if (!m.defined()) {  // e.g. a backward op whose output_mask skips this gradient
        res->outs.push_back({{}, {}, c10::ScalarType::Undefined});
        continue;
      }
      res->outs.push_back({m.sizes().vec(), m.strides().vec(), m.scalar_type()});
    }
    mr = res;
    if (cacheable) {
      std::unique_lock<std::shared_mutex> lock(meta_mu);
      if (meta_cache().size() > 100000) meta_cache().clear();
      meta_cache().emplace(mkey, mr);
    }
  }

  return mr;
}

// Outputs: in-place/out= returns alias an argument (resized if meta resized it); functional
// returns are fresh tensors with the meta strides.
std::vector<at::Tensor> allocate_outputs(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args,
                                         const MetaResult& meta, bool list_result, int device) {
  const auto& sargs = schema.arguments();
  const auto& rets = schema.returns();
  const size_t n = args.size();
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < meta.outs.size(); ++i) {
    const MetaOut& m = meta.outs[i];
    if (m.int_value) continue;  // not a tensor: pushed back in place below
    if (m.dtype == c10::ScalarType::Undefined) {
      outs.emplace_back();
      continue;
    }
    if (!list_result && rets[i].alias_info()) {
      const auto& before = rets[i].alias_info()->beforeSets();
      at::Tensor real;
      for (size_t j = 0; j < n; ++j) {
        if (sargs[j].alias_info() && sargs[j].alias_info()->beforeSets() == before) {
          real = args[j].toTensor();
          break;
        }
      }
      TORCH_INTERNAL_ASSERT(real.defined(), "torch_tpu: cannot find the argument aliased by ",
                            schema.name(), "'s output ", i);
      if (real.sizes() != c10::IntArrayRef(m.sizes)) real.resize_(m.sizes);
      outs.push_back(real);
    } else {
      // What the tpu empty_strided kernel does (the caller holds the device guard), without
      // a second trip through the dispatcher.
      outs.push_back(at::detail::empty_strided_generic(m.sizes, m.strides, &TpuAllocator::get(),
                                                       c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), m.dtype));
    }
  }

  return outs;
}

// Arguments mutated but not returned (batch norm's running stats, the tensor lists of in-place
// list ops such as the fused optimizers: every element) become extra outputs after the
// returns, in argument order.
void append_mutated_args(const lowering::OpEntry& entry, const c10::FunctionSchema& schema,
                         c10::ArrayRef<c10::IValue> args, std::vector<at::Tensor>& outs) {
  const auto& sargs = schema.arguments();
  const auto& rets = schema.returns();
  const size_t n = args.size();
  for (size_t j = 0; j < n; ++j) {
    if (args[j].isTensorList()) {
      if (!arg_written(entry, schema, args, j)) continue;
      for (const at::Tensor& t : args[j].toTensorList()) {
        TORCH_CHECK(t.defined() && t.device().type() == kTpu, schema.name(), ": every tensor of '",
                    sargs[j].name(), "' must be a tpu tensor");
        outs.push_back(t);
      }
      continue;
    }
    if (!args[j].isTensor() || !args[j].toTensor().defined() || !arg_written(entry, schema, args, j)) continue;
    const auto* alias = sargs[j].alias_info();
    bool returned = alias && std::any_of(rets.begin(), rets.end(), [&](const c10::Argument& r) {
      return r.alias_info() && r.alias_info()->beforeSets() == alias->beforeSets();
    });
    if (!returned) outs.push_back(args[j].toTensor());
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
  at::native::ResultTypeState rts{};
  bool any = false;
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
    bool is_out = sargs[j].is_out();
    if (!is_out && args[j].isTensor() && args[j].toTensor().defined()) {
      try {
        rts = at::native::update_result_type_state(args[j].toTensor(), rts);
        any = true;
      } catch (const c10::Error&) {  // float8 next to other floats (_scaled_mm): no promotion
      }
    } else if (!is_out && a.hint == NamedArg::Hint::Scalar && args[j].isScalar()) {
      // Only the scalar's kind matters for promotion: reuse one wrapped 0-d tensor per kind.
      const c10::Scalar sc = args[j].toScalar();
      rts = at::native::update_result_type_state(
          wrapped_scalar(sc.isFloatingPoint() ? at::kDouble : sc.isBoolean() ? at::kBool : at::kLong), rts);
      any = true;
    }
    named.push_back(std::move(a));
  }
  c10::ScalarType fallback_common = c10::kFloat;
  for (const auto& o : outs)
    if (o.defined()) { fallback_common = o.scalar_type(); break; }
  c10::ScalarType common = any ? at::native::result_type(rts) : fallback_common;
  if (!supported_dtype(common)) common = fallback_common;

  return common;
}

// Returns false (with `why`) when the op cannot take the lowered path (the caller falls back).
bool run_lowered(const c10::OperatorHandle& op, const OpInfo& info, torch::jit::Stack* stack, std::string* why) {
  const lowering::OpEntry& entry = *info.entry;
  const auto& schema = op.schema();
  const auto& rets = schema.returns();
  const bool bool_result = rets.size() == 1 && rets[0].type()->kind() == c10::TypeKind::BoolType;
  const bool list_result = rets.size() == 1 && rets[0].type()->kind() == c10::TypeKind::ListType &&
                           !rets[0].alias_info();
  if (const char* bad = unsupported_returns(rets, bool_result, list_result)) {
    *why = bad;
    return false;
  }
  const size_t n = schema.arguments().size();
  auto args = torch::jit::last(*stack, n);
  const int device = call_device(args);
  if (device < 0) {
    *why = "unsupported dtype";
    return false;
  }
  std::shared_ptr<const MetaResult> mr = output_meta(op, args, bool_result, list_result, why);
  if (!mr) return false;

  std::optional<CallSignature> sig;
  if (info.cacheable) sig.emplace(info, args);
  c10::DeviceGuard guard(c10::Device(kTpu, static_cast<c10::DeviceIndex>(device)));
  std::vector<at::Tensor> outs = allocate_outputs(schema, args, *mr, list_result, device);
  append_mutated_args(entry, schema, args, outs);
  std::vector<NamedArg> named;
  const c10::ScalarType common = named_args(info, schema, args, outs, named);
  PlannedCall planned;
  run_lowering(info.base, schema.overload_name(), entry, named, outs, common, sig && sig->valid() ? &planned : nullptr);
  if (sig && sig->valid()) remember_call(*sig, mr, std::move(planned));

  torch::jit::drop(*stack, n);
  if (bool_result) {
    stack->push_back(c10::IValue(outs[0].item<bool>()));  // the host read (a counted sync)
    return true;
  }
  if (list_result) {
    stack->push_back(c10::List<at::Tensor>(outs));
    return true;
  }
  size_t next = 0;
  for (const MetaOut& m : mr->outs) {
    if (m.int_value) stack->push_back(*m.int_value);
    else stack->push_back(std::move(outs[next++]));
  }
  return true;  // extra outputs (mutated, not returned) are not results of the schema
}

// A dispatch-cache hit (aten/dispatch_cache.h): outputs from the remembered metadata, the
// remembered plan bound to this call's storages and scalar values, launched.
void run_cached(const c10::OperatorHandle& op, const OpInfo& info, const CachedCall& cc, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  auto args = torch::jit::last(*stack, n);
  c10::DeviceGuard guard(c10::Device(kTpu, static_cast<c10::DeviceIndex>(cc.device)));
  std::vector<at::Tensor> outs = allocate_outputs(schema, args, *cc.meta, false, cc.device);
  if (info.may_write_args) append_mutated_args(*info.entry, schema, args, outs);
  runtime::Call call;
  call.plan = cc.plan;
  call.device = cc.device;
  for (const CallSource& src : cc.slot_src)
    call.st.push_back(&state_of(src.out ? outs[src.arg] : args[src.arg].toTensor()));
  for (const CallSource& src : cc.host_src) {
    const c10::IValue& v = args[src.arg];
    call.host.push_back(v.isTensor() ? host_operand(v.toTensor()) : host_operand(v.toScalar()));
  }
  runtime::ProgramPtr program = runtime::CompileCache::get().hit(cc.program);
  execute_call(call, &program, [] { return std::string("program evicted (signature seen before)"); });
  torch::jit::drop(*stack, n);
  size_t next = 0;
  for (const MetaOut& m : cc.meta->outs) {
    if (m.int_value) stack->push_back(*m.int_value);
    else stack->push_back(std::move(outs[next++]));
  }
}

}  // namespace

namespace {
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
}  // namespace

const OpInfo& op_info(const c10::OperatorHandle& op) {
  static std::shared_mutex mu;
  static auto* infos = std::make_unique<std::unordered_map<const void*, std::unique_ptr<OpInfo>>>().release();
  const c10::FunctionSchema& schema = op.schema();
  {
    std::shared_lock<std::shared_mutex> lock(mu);
    auto it = infos->find(&schema);
    // The name check guards against a re-registered op reusing a freed schema's address.
    if (it != infos->end() && it->second->name == schema.operator_name()) return *it->second;
  }
  auto info = std::make_unique<OpInfo>();
  info->name = schema.operator_name();
  info->base = base_name(schema.name());
  info->host_sync = lowering::is_host_sync_op(info->base);
  const lowering::OpEntry* entry = lowering::find_op(info->base);
  info->entry = entry && !entry->graph_only ? entry : nullptr;
  for (const c10::Argument& a : schema.arguments()) {
    NamedArg::Hint h = hint_of(a.type());
    // Declared runtime scalars (a scheduled learning rate) are operands, not constants, so the
    // program compiles once.
    if (info->entry && a.type()->kind() == c10::TypeKind::FloatType &&
        std::any_of(info->entry->runtime_scalars.begin(), info->entry->runtime_scalars.end(),
                    [&](const char* rs) { return a.name() == rs; }))
      h = NamedArg::Hint::Scalar;
    info->hints.push_back(h);
  }
  // Arguments written but not returned (extra program outputs): declared, or by the schema.
  info->may_write_args = info->entry && !info->entry->writes.empty();
  for (const c10::Argument& a : schema.arguments()) {
    if (!a.alias_info() || !a.alias_info()->isWrite()) continue;
    bool returned = std::any_of(schema.returns().begin(), schema.returns().end(), [&](const c10::Argument& r) {
      return r.alias_info() && r.alias_info()->beforeSets() == a.alias_info()->beforeSets();
    });
    info->may_write_args |= !returned || a.type()->kind() == c10::TypeKind::ListType;
  }
  // Calls the dispatch cache serves: plain tensor results, no per-call host work before planning
  // (index moves, bool masks), no RNG draws, no list-splitting foreach checks.
  bool plain_returns = !schema.returns().empty();
  for (const c10::Argument& r : schema.returns())
    plain_returns &= r.type()->kind() == c10::TypeKind::TensorType && (!r.alias_info() || r.alias_info()->isWrite());
  info->cacheable = info->entry && !info->host_sync && plain_returns && !info->entry->random &&
                    !info->entry->foreach && !info->entry->host_bool_indices && !info->entry->cpu_index_args;
  std::unique_lock<std::shared_mutex> lock(mu);
  auto& slot = (*infos)[&schema];
  slot = std::move(info);
  return *slot;
}

void tpu_boxed_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  if (eager_dynamic::maybe_handle(op, stack)) return;  // reads a mark_dynamic storage (eager_dynamic.cc)
  const OpInfo& info = op_info(op);
  std::string why = "no lowering";
  if (info.host_sync) {
    // One host sync: the CPU fallback's input copy is the read, and the copy path counts it.
    at::native::cpu_fallback(op, stack, false);
    return;
  }
  if (const lowering::OpEntry* entry = info.entry) {
    if (info.cacheable) {
      CallSignature sig(info, torch::jit::last(*stack, op.schema().arguments().size()));
      if (sig.valid()) {
        if (auto hit = find_cached_call(sig)) {
          run_cached(op, info, *hit, stack);
          return;
        }
      }
    }
    if (entry->cpu_index_args) move_cpu_index_args(op, info.base, stack);
    if (entry->host_bool_indices) convert_bool_indices(op, stack);
    const bool foreach = entry->foreach;
    try {
      if ((!foreach || foreach_lowerable(op.schema(), torch::jit::last(*stack, op.schema().arguments().size()))) &&
          run_lowered(op, info, stack, &why))
        return;
    } catch (const lowering::Unsupported& e) {
      why = std::string("lowering refused: ") + e.what();
    }
    if (foreach && op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)) {
      // PyTorch's per-tensor loop: every backend without its own kernel (PrivateUse2 here) holds it.
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse2), stack);
      return;
    }
  }
  cpu_fallback(op, stack, why);
}

void register_lowered_kernels() {
  // Route every overload of a lowered op straight to the boxed kernel. Without this, a
  // functional op with a CompositeExplicitAutogradNonFunctional kernel (add.Tensor) would
  // reach us as its out= variant, whose meta function is slow Python. Ops that decompose
  // (CompositeImplicitAutograd) keep decomposing so autograd still sees their parts.
  static auto* lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                                      c10::DispatchKey::PrivateUse1, __FILE__, __LINE__)
                         .release();
  auto& d = c10::Dispatcher::singleton();
  for (const c10::OperatorName& on : d.getAllOpNames()) {
    if (on.name.compare(0, 6, "aten::") != 0) continue;
    const lowering::OpEntry* entry = lowering::find_op(base_name(on.name));
    if (!entry || entry->graph_only) continue;
    auto op = d.findOp(on);
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
      continue;
    // Overloads returning tensor lists (functional _fused_adamw) cannot take the lowered path:
    // they keep their composite kernel, which calls the lowered in-place overload.
    bool list_return = false;
    for (const auto& r : op->schema().returns())
      list_return |= r.type()->kind() == c10::TypeKind::ListType;
    if (list_return && !(entry->foreach && op->schema().returns().size() == 1)) continue;
    std::string full = on.name.substr(6) + (on.overload_name.empty() ? "" : "." + on.overload_name);
    lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&tpu_boxed_kernel>());
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&tpu_boxed_kernel>());
}

}  // namespace tpu::aten
