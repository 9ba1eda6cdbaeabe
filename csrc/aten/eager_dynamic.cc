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

#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.h"

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

// ---- the C++ fast path: a call whose (op, arguments, input signature) was bucketed before runs
// its cached program here, without Python. Python registers a plan after each successful
// bucketed call (_dynamic_plan); a call no plan admits goes to Python as before.

// c + sum(coef * prod(values[group])) over the symbol values (sizes are small integer
// polynomials: affine in the symbols for nearly every op).
struct Poly {
  int64_t c = 0;
  std::vector<std::pair<int64_t, std::vector<int64_t>>> terms;
  int64_t eval(const std::vector<int64_t>& v) const {
    int64_t r = c;
    for (const auto& [coef, fs] : terms) {
      int64_t p = coef;
      for (int64_t g : fs) p *= v[g];
      r += p;
    }
    return r;
  }
};

struct PlanOut {
  int64_t spec = 0;      // 0: the program's output `index`, 1: program input `index`, 2: None, 3: the int `index`
  int64_t index = 0;
  int64_t kind = 2;      // 0: an int (size), 1: dynamic along `dim` (real size `size`), 2: as is
  int64_t dim = 0;
  Poly size;
  int64_t hi = -1;       // max= of the result's marks (-1: none)
};

struct Plan {
  int64_t graph = -1;     // torch_tpu::run_graph id; -1: gather the views, then run the op normally
  int64_t precision = 0;  // matmul precision it was built for
  std::vector<at::Tensor> consts;
  std::vector<int64_t> sym_group, sym_upper, sym_bucket;  // per program symbol
  std::vector<std::pair<int64_t, int64_t>> caps;          // (program symbol, capacity) per dynamic input
  std::vector<std::pair<int64_t, Poly>> guards;           // (relation, lhs - rhs)
  std::vector<std::pair<Poly, int64_t>> limits;           // real cat size <= its capacity
  std::vector<PlanOut> outs;
  bool layout_op = false;
};

// Key bytes.
template <class T>
void put(std::string& k, T v) { k.append(reinterpret_cast<const char*>(&v), sizeof v); }
void put_ints(std::string& k, c10::IntArrayRef xs) {
  put<int64_t>(k, static_cast<int64_t>(xs.size()));
  k.append(reinterpret_cast<const char*>(xs.data()), xs.size() * sizeof(int64_t));
}

// One call's tensor argument as the fast path sees it.
struct Slot {
  at::Tensor t;      // program input: the tensor, or a dynamic view extended to its capacity
  int64_t group = -1;  // dynamic: index of its real size among the call's distinct sizes
  bool input = true;   // false: None or a wrapped Python number (not a program input)
  std::string gather;  // another view of a dynamic storage: the key of its gather program
  std::vector<int64_t> padded;
};

// Gather programs (eager_dynamic._gather): a view of a dynamic storage that is no prefix view
// (`ids[:, -1:]`) is copied out with its offset as a runtime operand.
struct Gather {
  int64_t graph = -1;
  std::vector<at::Tensor> consts;
};
std::unordered_map<std::string, Gather> gathers;  // under plans_mu

std::string gather_key(const at::Tensor& t, c10::IntArrayRef padded) {
  std::string k;
  put<int8_t>(k, static_cast<int8_t>(t.scalar_type()));
  put<int8_t>(k, static_cast<int8_t>(t.device().index()));
  put_ints(k, padded);
  put_ints(k, t.sizes());
  put_ints(k, t.strides());
  return k;
}

std::shared_mutex plans_mu;
std::unordered_map<std::string, std::vector<std::shared_ptr<const Plan>>> plans;
std::atomic<int64_t> fast_calls{0};
std::atomic<bool> fast_enabled{true};
std::atomic<int64_t> fast_declines{0};
thread_local std::string pending_key;  // the missed call's key while Python runs it
constexpr size_t kMaxPlanKeys = 16384;

int64_t next_bucket(int64_t v, int64_t hi) {  // dynamic_shapes.next_bucket (BUCKET_MIN 16)
  int64_t b = 16;
  while (b < v) b <<= 1;
  return hi >= 0 ? std::max(v, std::min(b, hi)) : b;
}

// dynamic_view of eager_dynamic.py: when t reads a prefix of dim d of its padded buffer through
// one of its dims j: (j, the view with dim j extended to the buffer's capacity).
std::optional<std::pair<int64_t, at::Tensor>> dynamic_view(const at::Tensor& t, int64_t d, c10::IntArrayRef padded) {
  int64_t sd = 1;
  for (int64_t k = static_cast<int64_t>(padded.size()) - 1; k > d; --k) sd *= std::max<int64_t>(padded[k], 1);
  const int64_t cap = padded[d], outer = sd * cap;
  if ((t.storage_offset() / sd) % cap != 0) return std::nullopt;
  int64_t j = -1;
  for (int64_t k = 0; k < t.dim(); ++k) {
    const int64_t n = t.size(k), st = t.stride(k);
    if (n == 0) return std::nullopt;
    if (n == 1) continue;
    if (st == sd && j < 0) j = k;
    else if (!((st < sd && (n - 1) * st < sd) || st % outer == 0)) return std::nullopt;
  }
  if (j < 0 || t.size(j) < 2 || t.size(j) > cap) return std::nullopt;
  std::vector<int64_t> size(t.sizes().begin(), t.sizes().end());
  size[j] = cap;
  return std::make_pair(j, t.as_strided(size, t.strides(), t.storage_offset()));
}

// The key of a call (its text and the signature of its tensors) and its program inputs; false
// when the fast path cannot take it (a view read at an offset, a CPU tensor, ...).
// The op and its non-tensor arguments as key bytes, collecting the tensors in put_arg's order;
// false for an argument kind the key does not spell (the call goes to Python).
bool key_args(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, std::string& key,
              std::vector<c10::optional<at::Tensor>>& ts) {
  put<const void*>(key, &op.schema());
  for (const c10::IValue& v : args) {
    if (v.isNone()) key += 'N';
    else if (v.isTensor()) { key += 'T'; ts.emplace_back(v.toTensor()); }
    else if (v.isTensorList() || v.isList()) {
      if (v.isIntList()) { key += 'I'; put_ints(key, v.toIntVector()); continue; }
      key += 'L';
      put<int64_t>(key, static_cast<int64_t>(v.toListRef().size()));
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isNone()) key += 'N';
        else if (e.isTensor()) { key += 'T'; ts.emplace_back(e.toTensor()); }
        else if (e.isDouble()) { key += 'F'; put<double>(key, e.toDouble()); }
        else if (e.isBool()) { key += 'B'; put<bool>(key, e.toBool()); }
        else if (e.isInt()) { key += 'i'; put<int64_t>(key, e.toInt()); }
        else return false;
      }
    } else if (v.isBool()) { key += 'B'; put<bool>(key, v.toBool()); }
    else if (v.isInt()) { key += 'i'; put<int64_t>(key, v.toInt()); }
    else if (v.isDouble()) { key += 'F'; put<double>(key, v.toDouble()); }
    else if (v.isDevice()) { key += 'D'; put<int8_t>(key, static_cast<int8_t>(v.toDevice().type())); put<int8_t>(key, v.toDevice().index()); }
    else if (v.isString()) { key += 'S'; put<int64_t>(key, static_cast<int64_t>(v.toStringRef().size())); key += v.toStringRef(); }
    else return false;
  }
  key += '|';
  return true;
}

bool signature(const std::vector<c10::optional<at::Tensor>>& tensors, std::string& key,
               std::vector<Slot>& slots, std::vector<int64_t>& values) {
  std::vector<int64_t> real;  // per slot: the dynamic real size, or -1
  for (const auto& ot : tensors) {
    Slot s;
    real.push_back(-1);
    if (!ot || !ot->defined()) {
      key += 'N';
      s.input = false;
      slots.push_back(std::move(s));
      continue;
    }
    const at::Tensor& t = *ot;
    if (t.unsafeGetTensorImpl()->is_wrapped_number()) {  // a Python number: a constant of the trace
      key += 'W';
      put<int8_t>(key, static_cast<int8_t>(t.scalar_type()));
      if (t.scalar_type() == at::kDouble) put<double>(key, *t.const_data_ptr<double>());
      else if (t.scalar_type() == at::kLong) put<int64_t>(key, *t.const_data_ptr<int64_t>());
      else if (t.scalar_type() == at::kBool) put<bool>(key, *t.const_data_ptr<bool>());
      else return false;
      s.input = false;
      slots.push_back(std::move(s));
      continue;
    }
    if (t.device().type() != c10::DeviceType::PrivateUse1) return false;
    put<int8_t>(key, static_cast<int8_t>(t.scalar_type()));
    put<int8_t>(key, static_cast<int8_t>(t.device().index()));
    auto info = lookup(t);
    if (!info) {
      key += 'S';
      put_ints(key, t.sizes());
      put_ints(key, t.strides());
      s.t = t;
      slots.push_back(std::move(s));
      continue;
    }
    const int64_t d = (*info)[0];
    auto view = dynamic_view(t, d, c10::IntArrayRef(*info).slice(2));
    if (!view) {  // copied out at a runtime offset: then a plain input of the op
      s.padded.assign(info->begin() + 2, info->end());
      s.gather = gather_key(t, s.padded);
      key += 'G';
      key += s.gather;
      s.t = t;
      slots.push_back(std::move(s));
      continue;
    }
    const int64_t j = view->first;
    key += 'D';
    put<int64_t>(key, j);
    put<int64_t>(key, (*info)[1]);
    put_ints(key, view->second.sizes());  // the capacity along j, the other sizes
    put_ints(key, t.strides());
    put<int64_t>(key, t.storage_offset());
    real.back() = t.size(j);
    s.t = std::move(view->second);
    slots.push_back(std::move(s));
  }
  // One value per distinct real size, ascending (eager_dynamic._run's symbol groups).
  for (int64_t r : real)
    if (r >= 0) values.push_back(r);
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  key += '|';
  for (size_t i = 0; i < slots.size(); ++i) {
    if (real[i] < 0) continue;
    slots[i].group = std::lower_bound(values.begin(), values.end(), real[i]) - values.begin();
    put<int64_t>(key, slots[i].group);
  }
  return true;
}

bool admits(const Plan& p, const std::vector<int64_t>& values) {
  if (p.precision != static_cast<int64_t>(matmul_precision())) return false;
  for (const auto& [rel, poly] : p.guards) {
    const int64_t x = poly.eval(values);
    const bool ok = rel == 0 ? x == 0 : rel == 1 ? x != 0 : rel == 2 ? x < 0 : rel == 3 ? x <= 0 : rel == 4 ? x > 0 : x >= 0;
    if (!ok) return false;
  }
  // The bucket DynamicGraph._buckets would pick: next bucket, raised to a returning buffer's
  // capacity; a cat that would not fit (the bucket grows) is left to Python.
  std::vector<int64_t> b(p.sym_group.size());
  for (size_t s = 0; s < b.size(); ++s) b[s] = next_bucket(values[p.sym_group[s]], p.sym_upper[s]);
  for (const auto& [s, cap] : p.caps)
    if (cap > b[s] && (p.sym_upper[s] < 0 || cap <= p.sym_upper[s])) b[s] = cap;
  if (b != p.sym_bucket) return false;
  for (const auto& [real, cap] : p.limits)
    if (real.eval(values) > cap) return false;
  return true;
}

// Registers `o` (a bucket-sized result) as dynamic along d, in memory order (_mark_buffer).
void mark_buffer(const at::Tensor& o, int64_t d, int64_t hi) {
  if (o.dim() == 0 || o.storage_offset() != 0) return;
  std::vector<int64_t> perm(o.dim());
  for (int64_t k = 0; k < o.dim(); ++k) perm[k] = k;
  std::sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) {
    return o.stride(a) != o.stride(b) ? o.stride(a) > o.stride(b) : a < b;
  });
  std::vector<int64_t> shape;
  int64_t expect = 1;
  for (int64_t k = o.dim() - 1; k >= 0; --k) {
    const int64_t n = o.size(perm[k]);
    if (n != 1 && o.stride(perm[k]) != expect) return;
    expect *= n;
  }
  for (int64_t k : perm) shape.push_back(o.size(k));
  if (static_cast<size_t>(o.numel()) * o.itemsize() != o.storage().nbytes()) return;
  const int64_t at = std::find(perm.begin(), perm.end(), d) - perm.begin();
  mark(o, shape, at, hi);
}

// A size as a 0-d int64 tensor on the device, kept per value: the program's size operands are
// not uploaded on every call.
at::Tensor size_operand(int64_t v, c10::Device dev) {
  static std::mutex mu;
  static std::map<std::pair<int, int64_t>, at::Tensor> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& t = cache[{dev.index(), v}];
  if (!t.defined()) {
    if (cache.size() > 65536) {
      cache.clear();
      return at::scalar_tensor(v, at::kLong).to(dev);
    }
    t = at::scalar_tensor(v, at::kLong).to(dev);
  }
  return t;
}

const c10::TypedOperatorHandle<std::vector<at::Tensor>(int64_t, at::TensorList)>& run_graph_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("torch_tpu::run_graph", "")
                             .typed<std::vector<at::Tensor>(int64_t, at::TensorList)>();
  return op;
}

std::atomic<int64_t> fast_gathers{0};

// Copies out the views read at an offset (slot.t becomes the copy); false when a gather program
// is not known here (Python builds it).
bool run_gathers(std::vector<Slot>& slots) {
  for (Slot& s : slots) {
    if (s.gather.empty()) continue;
    Gather g;
    {
      std::shared_lock<std::shared_mutex> lock(plans_mu);
      auto it = gathers.find(s.gather);
      if (it == gathers.end()) return false;
      g = it->second;
    }
    std::vector<int64_t> strides(s.padded.size());
    int64_t acc = 1;
    for (int64_t k = static_cast<int64_t>(s.padded.size()) - 1; k >= 0; --k) {
      strides[k] = acc;
      acc *= std::max<int64_t>(s.padded[k], 1);
    }
    std::vector<at::Tensor> ins{s.t.as_strided(s.padded, strides, 0), size_operand(s.t.storage_offset(), s.t.device())};
    ins.insert(ins.end(), g.consts.begin(), g.consts.end());
    s.t = run_graph_op().call(g.graph, ins).at(0);
    fast_gathers.fetch_add(1, std::memory_order_relaxed);
  }
  return true;
}

// Puts the gathered copies in place of the views in the call's arguments (key_args' order).
void substitute(torch::jit::Stack* stack, size_t n, const std::vector<Slot>& slots) {
  size_t k = 0;
  for (size_t a = 0; a < n; ++a) {
    c10::IValue& v = (*stack)[stack->size() - n + a];
    if (v.isTensor()) {
      if (!slots[k].gather.empty()) v = slots[k].t;
      ++k;
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list = v.toTensorList();
      c10::List<at::Tensor> out;
      for (size_t e = 0; e < list.size(); ++e, ++k) out.push_back(slots[k].gather.empty() ? list.get(e) : slots[k].t);
      v = out;
    } else if (v.isList() && !v.isIntList()) {
      c10::impl::GenericList list = v.toList();
      for (size_t e = 0; e < list.size(); ++e) {
        if (!list.get(e).isTensor()) continue;
        if (!slots[k].gather.empty()) list.set(e, slots[k].t);
        ++k;
      }
    }
  }
}

// Runs the call by its plan; its results replace the arguments on the stack.
void run_plan(const Plan& p, const c10::FunctionSchema& schema, const std::vector<Slot>& slots,
              const std::vector<int64_t>& values, torch::jit::Stack* stack) {
  std::vector<at::Tensor> ins;
  ins.reserve(slots.size() + p.sym_group.size() + p.consts.size());
  for (const Slot& s : slots)
    if (s.input) ins.push_back(s.t);
  const size_t n_inputs = ins.size();
  const c10::Device dev = ins.empty() ? c10::Device(c10::DeviceType::PrivateUse1, 0) : ins.front().device();
  for (int64_t g : p.sym_group) ins.push_back(size_operand(values[g], dev));
  ins.insert(ins.end(), p.consts.begin(), p.consts.end());
  std::vector<at::Tensor> outs = run_graph_op().call(p.graph, ins);
  const size_t n = schema.arguments().size();
  torch::jit::drop(*stack, n);
  for (size_t i = 0; i < p.outs.size(); ++i) {
    const PlanOut& po = p.outs[i];
    const bool tensor_return = schema.returns()[i].type()->kind() == c10::TypeKind::TensorType;
    at::Tensor o = po.spec == 0 ? outs.at(po.index) : po.spec == 1 ? ins.at(po.index) : at::Tensor();
    TORCH_INTERNAL_ASSERT(po.spec != 1 || static_cast<size_t>(po.index) < n_inputs + p.sym_group.size());
    if (po.kind == 0 || po.spec == 3) {
      const int64_t v = po.kind == 0 ? po.size.eval(values) : po.index;
      if (tensor_return) stack->emplace_back(at::scalar_tensor(v, at::kLong));
      else stack->emplace_back(v);
    } else if (!o.defined()) {
      stack->emplace_back(at::empty({0}, at::TensorOptions().device(ins.front().device())));
    } else if (po.kind == 1) {
      at::Tensor v = o.narrow(po.dim, 0, po.size.eval(values));
      if (p.layout_op && o.is_contiguous() && !v.is_contiguous()) {
        stack->emplace_back(v.contiguous());  // clone/to promise a contiguous result
        continue;
      }
      mark_buffer(o, po.dim, po.hi);
      stack->emplace_back(std::move(v));
    } else {
      stack->emplace_back(std::move(o));
    }
  }
  fast_calls.fetch_add(1, std::memory_order_relaxed);
}

// Reads the plan Python encodes (eager_dynamic._plan_data) as a flat int list.
struct Reader {
  c10::IntArrayRef d;
  size_t i = 0;
  int64_t next() {
    TORCH_CHECK(i < d.size(), "torch_tpu eager dynamic: truncated plan");
    return d[i++];
  }
  Poly poly() {
    Poly p;
    const int64_t n = next();
    p.c = next();
    for (int64_t k = 0; k < n; ++k) {
      const int64_t coef = next(), nf = next();
      std::vector<int64_t> fs;
      for (int64_t f = 0; f < nf; ++f) fs.push_back(next());
      p.terms.emplace_back(coef, std::move(fs));
    }
    return p;
  }
};

// Attaches a plan to the call Python is running (the last miss of this thread).
void plan_op(int64_t graph, int64_t precision, at::TensorList consts, c10::IntArrayRef data) {
  if (pending_key.empty()) return;
  auto p = std::make_shared<Plan>();
  p->graph = graph;
  p->precision = precision;
  p->consts = consts.vec();
  Reader r{data};
  const int64_t nsym = r.next();
  for (int64_t s = 0; s < nsym; ++s) {
    p->sym_group.push_back(r.next());
    p->sym_upper.push_back(r.next());
    p->sym_bucket.push_back(r.next());
  }
  for (int64_t k = r.next(); k > 0; --k) {
    const int64_t s = r.next();
    p->caps.emplace_back(s, r.next());
  }
  for (int64_t k = r.next(); k > 0; --k) {
    const int64_t rel = r.next();
    p->guards.emplace_back(rel, r.poly());
  }
  for (int64_t k = r.next(); k > 0; --k) {
    Poly real = r.poly();
    p->limits.emplace_back(std::move(real), r.next());
  }
  for (int64_t k = r.next(); k > 0; --k) {
    PlanOut o;
    o.spec = r.next();
    o.index = r.next();
    o.kind = r.next();
    o.dim = r.next();
    o.size = r.poly();
    o.hi = r.next();
    p->outs.push_back(std::move(o));
  }
  p->layout_op = r.next() != 0;
  TORCH_CHECK(r.i == data.size(), "torch_tpu eager dynamic: malformed plan");
  std::unique_lock<std::shared_mutex> lock(plans_mu);
  if (plans.size() >= kMaxPlanKeys) plans.clear();
  auto& list = plans[pending_key];
  for (const auto& q : list)
    if (q->graph == p->graph && q->sym_bucket == p->sym_bucket && q->precision == p->precision) return;
  if (list.size() < 32) list.push_back(std::move(p));  // buckets (and guard variants) per key
}

// Python declined the call it is running whatever its sizes (the op mutates, draws random
// numbers, has no padded rule, ...): later calls with the same key take the normal path at once.
void decline_op() {
  if (pending_key.empty()) return;
  std::unique_lock<std::shared_mutex> lock(plans_mu);
  if (plans.size() >= kMaxPlanKeys) plans.clear();
  plans.try_emplace(pending_key);
}

// The call Python is running read only views at an offset: later calls gather here and run
// the op normally.
void passthrough_op() {
  if (pending_key.empty()) return;
  std::unique_lock<std::shared_mutex> lock(plans_mu);
  if (plans.size() >= kMaxPlanKeys) plans.clear();
  auto& list = plans[pending_key];
  if (list.empty()) list.push_back(std::make_shared<const Plan>());
}

void gather_plan_op(const at::Tensor& t, int64_t graph, at::TensorList consts) {
  auto info = lookup(t);
  if (!info) return;
  std::string k = gather_key(t, c10::IntArrayRef(*info).slice(2));
  std::unique_lock<std::shared_mutex> lock(plans_mu);
  if (gathers.size() >= kMaxPlanKeys) gathers.clear();
  gathers.insert_or_assign(std::move(k), Gather{graph, consts.vec()});
}

bool fast_enable_op(bool on) { return fast_enabled.exchange(on); }

// The fast path's counters [calls, gathers, declines], zeroed after reading when `reset`.
std::vector<int64_t> fast_stats_op(bool reset) {
  std::vector<int64_t> out;
  for (std::atomic<int64_t>* c : {&fast_calls, &fast_gathers, &fast_declines})
    out.push_back(reset ? c->exchange(0, std::memory_order_relaxed) : c->load(std::memory_order_relaxed));
  return out;
}
void clear_plans_op() {
  std::unique_lock<std::shared_mutex> lock(plans_mu);
  plans.clear();
  gathers.clear();
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
  // Ops run below (views, copies, the program launch) must not come back here.
  in_handler = true;
  struct Reset { ~Reset() { in_handler = false; pending_key.clear(); } } reset;
  if (fast_enabled.load(std::memory_order_relaxed)) {
    std::string key;
    std::vector<c10::optional<at::Tensor>> ts;
    std::vector<Slot> slots;
    std::vector<int64_t> values;
    if (key_args(op, args, key, ts) && signature(ts, key, slots, values)) {
      std::shared_ptr<const Plan> plan;
      {
        std::shared_lock<std::shared_mutex> lock(plans_mu);
        auto it = plans.find(key);
        if (it != plans.end()) {
          if (it->second.empty()) {  // Python declined this call for any sizes
            fast_declines.fetch_add(1, std::memory_order_relaxed);
            return false;
          }
          for (const auto& p : it->second)
            if (values.empty() ? p->graph < 0 : p->graph >= 0 && admits(*p, values)) { plan = p; break; }
        }
      }
      if (plan && run_gathers(slots)) {
        if (values.empty()) {  // only views read at an offset: the op runs normally on their copies
          substitute(stack, n, slots);
          return false;
        }
        run_plan(*plan, schema, slots, values, stack);
        return true;
      }
      pending_key = std::move(key);
    }
  }
  std::ostringstream call;
  call << "('" << schema.name() << "','" << (schema.overload_name().empty() ? "default" : schema.overload_name()) << "',[";
  std::vector<c10::optional<at::Tensor>> tensors;
  for (size_t i = 0; i < n; ++i) {
    if (!put_arg(call, schema.arguments()[i], args[i], tensors)) return false;
    call << ",";
  }
  call << "])";
  const std::string text = call.str();
  static const c10::OperatorHandle handler =
      c10::Dispatcher::singleton().findSchemaOrThrow("torch_tpu::_eager_dynamic", "");
  if (!handler.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)) return false;
  std::vector<at::Tensor> out = handler.typed<std::vector<at::Tensor>(std::string_view, const c10::List<c10::optional<at::Tensor>>&)>().call(
      text, c10::List<c10::optional<at::Tensor>>(tensors));
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

bool is_marked(const at::Tensor& t) {
  return marked.load(std::memory_order_relaxed) != 0 && lookup(t).has_value();
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
  m.def("_dynamic_plan(int graph, int precision, Tensor[] consts, int[] data) -> ()");
  m.def("_dynamic_fast_stats(bool reset=False) -> int[]");
  m.def("_dynamic_decline() -> ()");
  m.def("_dynamic_fast_enable(bool on) -> bool");
  m.def("_dynamic_passthrough() -> ()");
  m.def("_dynamic_gather_plan(Tensor t, int graph, Tensor[] consts) -> ()");
  m.def("_dynamic_clear_plans() -> ()");
}

TORCH_LIBRARY_IMPL(torch_tpu, CompositeExplicitAutograd, m) {
  m.impl("_dynamic_mark", &mark_op);
  m.impl("_dynamic_unmark", &unmark_op);
  m.impl("_dynamic_info", &info_op);
  m.impl("_dynamic_plan", &plan_op);
  m.impl("_dynamic_fast_stats", &fast_stats_op);
  m.impl("_dynamic_decline", &decline_op);
  m.impl("_dynamic_fast_enable", &fast_enable_op);
  m.impl("_dynamic_passthrough", &passthrough_op);
  m.impl("_dynamic_gather_plan", &gather_plan_op);
  m.impl("_dynamic_clear_plans", &clear_plans_op);
}

}  // namespace tpu::aten::eager_dynamic
