#include <algorithm>
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

std::vector<std::string> registered_ops() {
  std::vector<std::string> names;
  for (const auto& [k, v] : table()) names.push_back(k);
  std::sort(names.begin(), names.end());
  return names;
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
