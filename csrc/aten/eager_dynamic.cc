// Eager bounded dynamism: the registry of dynamic storages and the hook that hands ops reading
// them to Python. The handler is the op `torch_tpu::_eager_dynamic(str call, Tensor?[] tensors)
// -> Tensor[]`, implemented in Python; `call` spells the op and its non-tensor arguments as a
// Python literal (tensors become ("T", i) placeholders), so tensors flow through the dispatcher
// and the text is also the handler's cache key. An empty result list means "declined".
#include "eager_dynamic.h"

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace tpu::aten::eager_dynamic {
namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // keeps the address from being reused
  std::vector<int64_t> info;                          // {dim, max (-1: none), padded sizes...}
};

std::shared_mutex mu;
std::unordered_map<const c10::StorageImpl*, Entry> registry;
std::atomic<size_t> marked{0};
size_t sweep_at = 64;
thread_local bool in_handler = false;

std::optional<std::vector<int64_t>> lookup(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return std::nullopt;
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  std::shared_lock<std::shared_mutex> lock(mu);
  auto it = registry.find(key);
  if (it == registry.end() || it->second.storage.expired()) return std::nullopt;
  return it->second.info;
}

void mark(const at::Tensor& t, c10::IntArrayRef padded, int64_t dim, int64_t max) {
  TORCH_CHECK(t.has_storage(), "mark_dynamic: the tensor has no storage");
  std::vector<int64_t> info{dim, max};
  info.insert(info.end(), padded.begin(), padded.end());
  std::unique_lock<std::shared_mutex> lock(mu);
  if (registry.size() >= sweep_at) {  // forget storages that died since the last sweep
    for (auto it = registry.begin(); it != registry.end();) it = it->second.storage.expired() ? registry.erase(it) : ++it;
    sweep_at = 2 * registry.size() + 64;
  }
  registry.insert_or_assign(t.storage().unsafeGetStorageImpl(), Entry{t.storage().getWeakStorageImpl(), std::move(info)});
  marked.store(registry.size(), std::memory_order_relaxed);
}

void unmark(const at::Tensor& t) {
  if (!t.has_storage()) return;
  std::unique_lock<std::shared_mutex> lock(mu);
  registry.erase(t.storage().unsafeGetStorageImpl());
  marked.store(registry.size(), std::memory_order_relaxed);
}

std::vector<int64_t> info_op(const at::Tensor& t) { return lookup(t).value_or(std::vector<int64_t>{}); }
void mark_op(const at::Tensor& t, c10::IntArrayRef padded, int64_t dim, int64_t max) { mark(t, padded, dim, max); }
void unmark_op(const at::Tensor& t) { unmark(t); }
int64_t count_op() {
  std::shared_lock<std::shared_mutex> lock(mu);
  int64_t n = 0;
  for (const auto& kv : registry) n += kv.second.storage.expired() ? 0 : 1;
  return n;
}

bool is_dynamic(const c10::IValue& v) {
  if (v.isTensor()) return lookup(v.toTensor()).has_value();
  if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec())
      if (lookup(t)) return true;
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef())
      if (e.isTensor() && lookup(e.toTensor())) return true;
  }
  return false;
}

// The schema type behind an argument, optional unwrapped (ScalarType, Layout, ... travel as int).
c10::TypeKind real_kind(const c10::Argument& a) {
  c10::TypePtr t = a.real_type();
  if (auto o = t->cast<c10::OptionalType>()) t = o->getElementType();
  return t->kind();
}

void put_double(std::ostringstream& s, double d) {
  if (std::isnan(d)) s << "('f','nan')";
  else if (std::isinf(d)) s << (d > 0 ? "('f','inf')" : "('f','-inf')");
  else {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", d);
    std::string text(buf);
    if (text.find_first_of(".en") == std::string::npos) text += ".0";  // stays a float literal
    s << text;
  }
}

// One argument as a Python literal; false when the handler cannot take it (generator, ...).
bool put_arg(std::ostringstream& s, const c10::Argument& a, const c10::IValue& v, std::vector<c10::optional<at::Tensor>>& ts) {
  auto tensor = [&](const at::Tensor& t) {
    s << "('T'," << ts.size() << ")";
    ts.emplace_back(t);
  };
  if (v.isNone()) s << "None";
  else if (v.isTensor()) tensor(v.toTensor());
  else if (v.isTensorList() || (v.isList() && a.type()->str().find("Tensor") != std::string::npos)) {
    s << "('L',[";
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isNone()) s << "None,";
      else if (e.isTensor()) { tensor(e.toTensor()); s << ","; }
      else return false;
    }
    s << "])";
  } else if (v.isBool()) s << (v.toBool() ? "True" : "False");
  else if (v.isInt()) {
    switch (real_kind(a)) {
      case c10::TypeKind::ScalarTypeType: s << "('dtype','" << c10::toString(static_cast<c10::ScalarType>(v.toInt())) << "')"; break;
      case c10::TypeKind::LayoutType: s << "('layout'," << v.toInt() << ")"; break;
      case c10::TypeKind::MemoryFormatType: s << "('mf'," << v.toInt() << ")"; break;
      default: s << v.toInt();
    }
  } else if (v.isDouble()) put_double(s, v.toDouble());
  else if (v.isIntList()) {
    s << "[";
    for (int64_t i : v.toIntVector()) s << i << ",";
    s << "]";
  } else if (v.isDoubleList()) {
    s << "[";
    for (double d : v.toDoubleVector()) { put_double(s, d); s << ","; }
    s << "]";
  } else if (v.isBoolList()) {
    s << "[";
    for (bool b : v.toBoolList()) s << (b ? "True," : "False,");
    s << "]";
  } else if (v.isDevice()) s << "('dev','" << v.toDevice().str() << "')";
  else if (v.isString()) {
    const std::string& str = v.toStringRef();
    if (str.find_first_of("'\\\n") != std::string::npos) return false;
    s << "'" << str << "'";
  } else return false;
  return true;
}

}  // namespace

bool maybe_handle(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (marked.load(std::memory_order_relaxed) == 0 || in_handler) return false;
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  auto args = torch::jit::last(*stack, n);
  bool any = false;
  for (const c10::IValue& v : args) any = any || is_dynamic(v);
  if (!any) return false;
  for (const c10::Argument& r : schema.returns()) {  // tensors and ints only, none aliasing an input
    const c10::TypeKind k = r.type()->kind();
    if (r.alias_info() || (k != c10::TypeKind::TensorType && k != c10::TypeKind::SymIntType && k != c10::TypeKind::IntType))
      return false;
  }
  std::ostringstream call;
  call << "('" << schema.name() << "','" << (schema.overload_name().empty() ? "default" : schema.overload_name()) << "',[";
  std::vector<c10::optional<at::Tensor>> tensors;
  for (size_t i = 0; i < n; ++i) {
    if (!put_arg(call, schema.arguments()[i], args[i], tensors)) return false;
    call << ",";
  }
  call << "])";
  static const c10::OperatorHandle handler =
      c10::Dispatcher::singleton().findSchemaOrThrow("torch_tpu::_eager_dynamic", "");
  if (!handler.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)) return false;
  std::vector<at::Tensor> out;
  {
    in_handler = true;
    struct Reset { ~Reset() { in_handler = false; } } reset;
    out = handler.typed<std::vector<at::Tensor>(std::string_view, const c10::List<c10::optional<at::Tensor>>&)>().call(
        call.str(), c10::List<c10::optional<at::Tensor>>(tensors));
  }
  if (out.empty()) return false;  // declined
  TORCH_CHECK(out.size() == schema.returns().size(), "torch_tpu eager dynamic handler: ", out.size(),
              " results for ", schema.returns().size(), " returns of ", schema.name());
  torch::jit::drop(*stack, n);
  for (size_t i = 0; i < out.size(); ++i) {
    if (schema.returns()[i].type()->kind() == c10::TypeKind::TensorType) stack->emplace_back(std::move(out[i]));
    else stack->emplace_back(out[i].item<int64_t>());  // an int result travels as a 0-d CPU tensor
  }
  return true;
}

namespace {

// Composite ops that would drop dynamism (their kernels allocate by the exact size and copy or
// fill): clone/_to_copy/ones_like/... of a dynamic tensor stay dynamic (generate clones its
// input_ids, builds positions with ones_like(...).cumsum()); other calls take their composite
// kernel, as before.
void composite_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  if (maybe_handle(op, stack)) return;
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse2), stack);  // CompositeExplicitAutograd
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name : {"ones_like", "zeros_like", "full_like", "clone", "_to_copy"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&composite_kernel>());
}

TORCH_LIBRARY_FRAGMENT(torch_tpu, m) {
  // Implemented in Python (CompositeExplicitAutograd) by torch_tpu._internal.eager_dynamic.
  m.def("_eager_dynamic(str call, Tensor?[] tensors) -> Tensor[]");
  m.def("_dynamic_mark(Tensor t, int[] padded, int dim, int max) -> ()");
  m.def("_dynamic_unmark(Tensor t) -> ()");
  m.def("_dynamic_info(Tensor t) -> int[]");
  m.def("_dynamic_count() -> int");
}

TORCH_LIBRARY_IMPL(torch_tpu, CompositeExplicitAutograd, m) {
  m.impl("_dynamic_mark", &mark_op);
  m.impl("_dynamic_unmark", &unmark_op);
  m.impl("_dynamic_info", &info_op);
  m.impl("_dynamic_count", &count_op);
}



}  // namespace tpu::aten::eager_dynamic
