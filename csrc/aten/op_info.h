// What the boxed kernel (aten/dispatch.cc) knows about an op, derived once per schema: its
// lowering entry and the entry's declared properties, how to read each argument, whether its
// calls may take the dispatch cache.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

#include "plan_call.h"

namespace tpu::aten {

struct OpInfo {
  c10::OperatorName name{"", ""};
  std::string base;                          // lowering table name ("add_" -> "add")
  const lowering::OpEntry* entry = nullptr;  // null: no eager lowering (graph-only or none)
  bool host_sync = false;                    // TPU_HOST_SYNC: CPU fallback, one counted read
  bool cacheable = false;                    // calls may take the dispatch cache
  bool may_write_args = true;                // arguments may be written without being returned
  bool list_result = false;                  // returns one list of fresh tensors (foreach)
  std::vector<NamedArg::Hint> hints;         // per argument (declared runtime scalars: Scalar)
  std::vector<bool> runtime_scalar_list;     // per argument: a foreach ScalarList (operands)
};
const OpInfo& op_info(const c10::OperatorHandle& op);

// The ATen base name that keys the lowering table ("aten::add_" -> "add").
std::string base_name(const std::string& qualified);
bool is_scalar_list(const c10::TypePtr& type);  // Scalar[]
NamedArg::Hint hint_of(const c10::TypePtr& type);  // how to read an argument of this type
bool is_int_return(const c10::Argument& r);     // int or SymInt

}  // namespace tpu::aten
