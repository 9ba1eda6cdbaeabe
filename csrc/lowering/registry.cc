#include <algorithm>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "lowering.h"

namespace tpu::lowering {

namespace {
std::unordered_map<std::string, OpEntry>& table() {
  static std::unordered_map<std::string, OpEntry> t;
  return t;
}
}  // namespace

void register_op(const std::string& name, OpEntry entry) {
  if (!table().emplace(name, entry).second)
    throw std::logic_error("torch_tpu: lowering for '" + name + "' registered twice");
}

const OpEntry* find_op(const std::string& name) {
  auto it = table().find(name);
  return it == table().end() ? nullptr : &it->second;
}

namespace {
std::unordered_set<std::string>& host_sync_ops() {
  static std::unordered_set<std::string> s;
  return s;
}
}  // namespace

void register_host_sync_op(const std::string& name) { host_sync_ops().insert(name); }
bool is_host_sync_op(const std::string& name) { return host_sync_ops().count(name) != 0; }

int64_t rng_counters(const OpEntry& entry, const ConstantArg& constant, int64_t largest_numel) {
  if (!entry.random) return 0;
  for (const NoDrawRule& rule : entry.draws_nothing_when) {
    std::optional<double> v = constant(rule.arg);
    if (v && *v == rule.value) return 0;
  }
  return std::max<int64_t>(largest_numel, 1) + 1;
}

std::vector<std::string> registered_ops() {
  std::vector<std::string> names;
  for (const auto& [k, v] : table()) names.push_back(k);
  std::sort(names.begin(), names.end());
  return names;
}

namespace {
std::mutex check_mu;
std::unordered_map<int32_t, std::pair<CheckKind, std::string>>& check_table() {
  static auto* t = std::make_unique<std::unordered_map<int32_t, std::pair<CheckKind, std::string>>>().release();
  return *t;
}
}  // namespace

void check(Builder& b, Value bad, CheckKind kind, const std::string& msg) {
  if (!b.checking()) return;
  uint32_t h = 2166136261u;  // FNV-1a: the same code in every process (disk-cached programs)
  auto mix = [&](unsigned char ch) { h = (h ^ ch) * 16777619u; };
  mix(static_cast<unsigned char>(kind));
  for (char ch : msg) mix(static_cast<unsigned char>(ch));
  int32_t code = static_cast<int32_t>(h & 0x7fffffffu);
  if (code == 0) code = 1;
  {
    std::lock_guard<std::mutex> lock(check_mu);
    check_table().emplace(code, std::make_pair(kind, msg));
  }
  b.add_error(b.convert(bad, ElemType::Pred), code);
}

std::optional<std::pair<CheckKind, std::string>> check_message(int32_t code) {
  std::lock_guard<std::mutex> lock(check_mu);
  auto it = check_table().find(code);
  if (it == check_table().end()) return std::nullopt;
  return it->second;
}

ElemType opmath(ElemType t) {
  return (t == ElemType::F16 || t == ElemType::BF16 || shlo::is_f8(t)) ? ElemType::F32 : t;
}

Value cast_to(Builder& b, Value v, ElemType t, const Shape& shape) {
  return b.broadcast_to(b.convert(v, t), shape);
}

int64_t norm_dim(int64_t d, int64_t rank) {
  int64_t r = std::max<int64_t>(rank, 1);
  return d < 0 ? d + r : d;
}

std::vector<int64_t> reduce_dims(const OpCall& c, const std::string& arg, int64_t rank) {
  std::vector<int64_t> dims;
  const Arg* a = c.find(arg);
  if (a && a->kind == Arg::Kind::IntList && !a->ints.empty()) {
    for (int64_t d : a->ints) dims.push_back(norm_dim(d, rank));
  } else if (a && a->kind == Arg::Kind::Int) {
    dims.push_back(norm_dim(a->i, rank));
  } else {
    for (int64_t i = 0; i < rank; ++i) dims.push_back(i);
  }
  std::sort(dims.begin(), dims.end());
  dims.erase(std::unique(dims.begin(), dims.end()), dims.end());
  if (rank == 0) dims.clear();
  return dims;
}

Value operand(Builder& b, const Arg& a, ElemType t, const Shape& shape) {
  if (a.kind == Arg::Kind::Tensor) return cast_to(b, a.tensor, t, shape);
  if (a.kind == Arg::Kind::Scalar) return cast_to(b, a.scalar, t, shape);
  if (a.kind == Arg::Kind::Int || a.kind == Arg::Kind::Bool) return b.constant_i(a.kind == Arg::Kind::Bool ? a.b : a.i, t, shape);
  if (a.kind == Arg::Kind::Double) return b.constant_f(a.d, t, shape);
  throw Unsupported("operand: argument is not a tensor or scalar");
}

}  // namespace tpu::lowering
