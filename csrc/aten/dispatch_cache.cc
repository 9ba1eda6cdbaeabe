#include "dispatch_cache.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "common.h"
#include "runtime/context.h"
#include "runtime/device_checks.h"

namespace tpu::aten {

namespace {
// Tags keep words of different kinds apart (a None never equals an int 0).
enum Tag : int64_t {
  kNone = 1, kUndefined, kTpuTensor, kHostTensor, kScalar, kInt, kDouble, kBool, kIntList, kString, kDevice,
  kTensorList, kScalarList, kDoubleList, kBoolList, kGenerator
};
constexpr size_t kMaxEntries = 8192;  // beyond: start over (entries are cheap to rebuild)

int64_t double_bits(double d) {
  int64_t bits;
  std::memcpy(&bits, &d, 8);
  return bits;
}

// A Python scalar's word: its kind, and its value when a plan constant (const_scalar_index;
// never complex, a complex128 operand).
std::optional<int64_t> scalar_word(const c10::Scalar& sc) {
  const auto k = const_scalar_index(sc);
  return (kScalar * 16 + (sc.isFloatingPoint() ? 1 : sc.isBoolean() ? 2 : sc.isComplex() ? 4 : 3)) * 16 + (k ? *k + 1 : 0);
}
}  // namespace

CallSignature::CallSignature(const OpInfo& info, c10::ArrayRef<c10::IValue> args) {
  w_.push_back(reinterpret_cast<intptr_t>(&info));
  // Global settings that reach the plan: eager mode (flattening), device checks. The matmul
  // precision reaches only plans with a contraction: find_cached_call compares it for those.
  w_.push_back(static_cast<int64_t>(runtime::Context::get().mode()) * 2 + (runtime::device_checks() ? 1 : 0));
  for (size_t j = 0; j < args.size() && valid_; ++j) value(info, args[j], j);
  // Pure factories are not cached: their scalar values can decide the output's shape (arange).
  if (!has_input_tensor_) valid_ = false;
}

void CallSignature::value(const OpInfo& info, const c10::IValue& v, size_t j) {
  if (v.isNone()) {
    w_.push_back(kNone);
  } else if (v.isTensor()) {
    tensor(v.toTensor());
  } else if (info.hints[j] == NamedArg::Hint::Scalar && v.isScalar()) {
    // The kind; the value is an operand, except a small integral one (a plan constant).
    auto word = scalar_word(v.toScalar());
    if (word) w_.push_back(*word);
    else valid_ = false;
  } else if (v.isBool()) {
    w_.push_back(kBool * 16 + v.toBool());
  } else if (v.isInt()) {
    w_.push_back(kInt);
    w_.push_back(v.toInt());
  } else if (v.isSymInt() && !v.toSymInt().is_heap_allocated()) {
    w_.push_back(kInt);
    w_.push_back(v.toSymInt().as_int_unchecked());
  } else if (v.isDouble()) {
    w_.push_back(kDouble);
    w_.push_back(double_bits(v.toDouble()));
  } else if (v.isIntList()) {
    w_.push_back(kIntList);
    w_.push_back(static_cast<int64_t>(v.toIntList().size()));
    for (int64_t x : v.toIntList()) w_.push_back(x);
  } else if (v.isBoolList()) {
    w_.push_back(kBoolList);
    w_.push_back(static_cast<int64_t>(v.toBoolList().size()));
    for (bool x : v.toBoolList()) w_.push_back(x);
  } else if (v.isDoubleList()) {
    w_.push_back(kDoubleList);
    w_.push_back(static_cast<int64_t>(v.toDoubleList().size()));
    for (double x : v.toDoubleList()) w_.push_back(double_bits(x));
  } else if (v.isList()) {
    list(v, info.runtime_scalar_list[j]);
  } else if (v.isString()) {
    const std::string& s = v.toStringRef();
    w_.push_back(kString);
    w_.push_back(static_cast<int64_t>(s.size()));
    for (size_t i = 0; i < s.size(); i += 8) {
      int64_t x = 0;
      std::memcpy(&x, s.data() + i, std::min<size_t>(8, s.size() - i));
      w_.push_back(x);
    }
  } else if (v.isDevice()) {
    w_.push_back(kDevice);
    w_.push_back(static_cast<int64_t>(v.toDevice().type()) * 1024 + v.toDevice().index());
  } else if (v.isGenerator()) {
    // Which generator does not change the plan (its state is drawn per call); its device does.
    const at::Generator& g = v.toGenerator();
    w_.push_back(kGenerator * 64 + (g.defined() ? static_cast<int64_t>(g.device().type()) : 63));
  } else {
    valid_ = false;  // anything else: the full path
  }
}

// Tensor[] / Tensor?[] (each element's words) or a foreach ScalarList (each element's kind; the
// values are runtime operands).
void CallSignature::list(const c10::IValue& v, bool scalars) {
  const auto elems = v.toListRef();
  w_.push_back(scalars ? kScalarList : kTensorList);
  w_.push_back(static_cast<int64_t>(elems.size()));
  for (const c10::IValue& e : elems) {
    if (!valid_) return;
    if (e.isTensor()) {
      tensor(e.toTensor());
    } else if (e.isNone()) {
      w_.push_back(kNone);
    } else if (scalars && e.isScalar()) {
      auto word = scalar_word(e.toScalar());
      if (word) w_.push_back(*word);
      else valid_ = false;
    } else {
      valid_ = false;
    }
  }
}

void CallSignature::tensor(const at::Tensor& t) {
  if (!t.defined()) {
    w_.push_back(kUndefined);
    return;
  }
  const auto dtype = static_cast<int64_t>(t.scalar_type());
  if (t.device().type() != kTpu) {
    // A 0-d CPU tensor (a wrapped Python scalar or a host scalar) is a host operand, or a plan
    // constant (a wrapped scalar of const_scalar_index's table): then its value is part of the word.
    if (!t.device().is_cpu() || t.dim() != 0) {
      valid_ = false;
      return;
    }
    const auto k = const_scalar_index(t);
    w_.push_back(((kHostTensor * 256 + dtype) * 2 + (t.unsafeGetTensorImpl()->is_wrapped_number() ? 1 : 0)) * 16 +
                 (k ? *k + 1 : 0));
    return;
  }
  has_input_tensor_ = true;
  const runtime::StorageState& st = state_of(t);
  // Which earlier tensor's storage this one shares (slots are per storage), -1: a new one.
  const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  auto seen = std::find(storages_.begin(), storages_.end(), impl);
  const int64_t alias = seen == storages_.end() ? -1 : seen - storages_.begin();
  if (seen == storages_.end()) storages_.push_back(impl);
  w_.push_back(((kTpuTensor * 256 + dtype) * 64 + t.dim()) * 256 + t.device().index());
  for (int64_t d : t.sizes()) w_.push_back(d);
  for (int64_t d : t.strides()) w_.push_back(d);
  w_.push_back(t.storage_offset());
  w_.push_back(static_cast<int64_t>(st.nbytes));
  // The storage's element type decides the plan's slot type (a never-written storage: the tensor's).
  w_.push_back(st.buffer ? static_cast<int64_t>(st.elem) : -1);
  // Its buffer's dims are the type of the plan's parameter (runtime/storage.h): -2 when they are
  // the tensor's sizes (the common case: one word), else rank + dims.
  if (st.buffer) {
    if (c10::IntArrayRef(st.dims.data(), st.dims.size()) == t.sizes()) {
      w_.push_back(-2);
    } else {
      w_.push_back(static_cast<int64_t>(st.dims.size()));
      for (int64_t d : st.dims) w_.push_back(d);
    }
  }
  w_.push_back(alias);
}

// Four independent lanes: a call's ~15-40 words hash in a quarter of the multiply chain one
// lane needs (the hash is paid by every call, hit or not). Equal hashes are confirmed by words().
uint64_t CallSignature::hash() const {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  uint64_t h[4] = {0xcbf29ce484222325ull, 0x84222325cbf29ce4ull, 0x100000001b3ull, w_.size()};
  size_t i = 0;
  for (; i + 4 <= w_.size(); i += 4)
    for (int l = 0; l < 4; ++l) h[l] = (h[l] ^ static_cast<uint64_t>(w_[i + l])) * kMul;
  for (int l = 0; i < w_.size(); ++i, ++l) h[l] = (h[l] ^ static_cast<uint64_t>(w_[i])) * kMul;
  uint64_t x = h[0] ^ (h[1] << 17 | h[1] >> 47) ^ (h[2] << 31 | h[2] >> 33) ^ (h[3] << 47 | h[3] >> 17);
  x ^= x >> 32;  // the high bits (where the products mix) into the low ones the table buckets by
  x *= kMul;
  return x ^ (x >> 29);
}

namespace {
std::atomic<int64_t> hits{0}, remembered{0};
std::atomic<bool> enabled{true};
std::shared_mutex table_mu;
std::unordered_map<uint64_t, std::shared_ptr<const CachedCall>>& table() {
  static auto* t = std::make_unique<std::unordered_map<uint64_t, std::shared_ptr<const CachedCall>>>().release();
  return *t;
}
}  // namespace

std::shared_ptr<const CachedCall> find_cached_call(const CallSignature& sig) {
  std::shared_ptr<const CachedCall> hit;
  {
    std::shared_lock<std::shared_mutex> lock(table_mu);
    auto it = table().find(sig.hash());
    if (it == table().end()) return nullptr;
    hit = it->second;
  }
  const auto& w = sig.words();
  if (hit->words.size() != w.size() || !std::equal(w.begin(), w.end(), hit->words.begin())) return nullptr;
  // Planned at another precision: the full path plans again and replaces the entry.
  if (hit->plan->uses_precision && hit->plan->precision != matmul_precision()) return nullptr;
  hits.fetch_add(1, std::memory_order_relaxed);
  return hit;
}

void remember_call(const CallSignature& sig, std::shared_ptr<const MetaResult> meta, PlannedCall planned) {
  if (!planned.cacheable || !planned.plan) return;
  auto c = std::make_shared<CachedCall>();
  c->words.assign(sig.words().begin(), sig.words().end());
  c->meta = std::move(meta);
  c->plan = std::move(planned.plan);
  c->program = planned.program;
  c->slot_src = std::move(planned.slot_src);
  c->host_src = std::move(planned.host_src);
  c->device = planned.device;
  c->rng_counters = planned.rng_counters;
  c->rng_device = planned.rng_device;
  remembered.fetch_add(1, std::memory_order_relaxed);
  std::unique_lock<std::shared_mutex> lock(table_mu);
  if (table().size() >= kMaxEntries) table().clear();
  table()[sig.hash()] = std::move(c);  // a hash collision replaces the older signature
}

void set_dispatch_cache_enabled(bool on) { enabled.store(on, std::memory_order_relaxed); }
bool dispatch_cache_enabled() { return enabled.load(std::memory_order_relaxed); }

DispatchCacheStats dispatch_cache_stats() {
  DispatchCacheStats s;
  s.hits = hits.load(std::memory_order_relaxed);
  s.remembered = remembered.load(std::memory_order_relaxed);
  std::shared_lock<std::shared_mutex> lock(table_mu);
  s.entries = static_cast<int64_t>(table().size());
  return s;
}

}  // namespace tpu::aten
