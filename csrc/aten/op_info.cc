#include "op_info.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

namespace tpu::aten {

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

bool is_int_return(const c10::Argument& r) {
  auto k = r.type()->kind();
  return k == c10::TypeKind::IntType || k == c10::TypeKind::SymIntType;
}

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
    info->runtime_scalar_list.push_back(info->entry && info->entry->foreach && is_scalar_list(a.type()));
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
  // Calls the dispatch cache serves: tensor (not view) or int results, nothing, or one list of
  // fresh tensors. Index moves and bool masks need no exclusion: the full path remembers a call
  // after that host work, so a call that still needs it never matches (dispatch_cache.h).
  const auto& rets = schema.returns();
  info->list_result = rets.size() == 1 && rets[0].type()->kind() == c10::TypeKind::ListType && !rets[0].alias_info();
  bool plain_returns = true;
  for (const c10::Argument& r : rets)
    plain_returns &= (r.type()->kind() == c10::TypeKind::TensorType && (!r.alias_info() || r.alias_info()->isWrite())) ||
                     is_int_return(r);
  // A factory's out= overload (arange.start_out: its only tensors are out= arguments) gets the
  // shape its scalar values decide, which the signature leaves out: never served, like the
  // pure factory itself.
  bool tensor_input = false;
  for (const c10::Argument& a : schema.arguments())
    tensor_input |= !a.is_out() && (a.type()->isSubtypeOf(*c10::TensorType::get()) ||
                                    a.type()->isSubtypeOf(*c10::OptionalType::ofTensor()) ||
                                    a.type()->isSubtypeOf(*c10::ListType::ofTensors()) ||
                                    a.type()->isSubtypeOf(*c10::ListType::ofOptionalTensors()));
  info->cacheable = info->entry && (plain_returns || info->list_result) && tensor_input;
  std::unique_lock<std::shared_mutex> lock(mu);
  auto& slot = (*infos)[&schema];
  slot = std::move(info);
  return *slot;
}

}  // namespace tpu::aten
