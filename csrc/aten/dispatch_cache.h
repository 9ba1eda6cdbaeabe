// The dispatch cache: the boxed kernel's fast path. A call's *signature* (the op, each tensor's
// dtype/shape/strides/offset/storage size and which arguments share a storage, the constants,
// the kinds but not the values of Python scalars and 0-d host tensors, the eager mode) maps to
// everything the first call with that signature derived: output metadata, the plan (whose key,
// program and result type follow from the signature) and where each of the plan's storages and
// host operands comes from in the boxed call. A hit allocates the outputs, binds the plan to this
// call's storages and scalar values and launches the remembered program: no meta call, no key
// strings, no planning. Only plain calls are cached (see OpInfo::cacheable); the rest take the
// full path in aten/dispatch.cc, which fills the cache.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/SmallVector.h>

#include <memory>
#include <string>
#include <vector>

#include "plan_call.h"

namespace tpu::aten {

// What the boxed kernel needs to know about an op, derived once per schema.
struct OpInfo {
  c10::OperatorName name{"", ""};
  std::string base;                          // lowering table name ("add_" -> "add")
  const lowering::OpEntry* entry = nullptr;  // null: no eager lowering (graph-only or none)
  bool host_sync = false;                    // TPU_HOST_SYNC: CPU fallback, one counted read
  bool cacheable = false;                    // calls may take the dispatch cache
  bool may_write_args = true;                // arguments may be written without being returned
  std::vector<NamedArg::Hint> hints;         // per argument (declared runtime scalars: Scalar)
};
const OpInfo& op_info(const c10::OperatorHandle& op);

struct MetaOut {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
  std::optional<int64_t> int_value;  // an int/SymInt return (e.g. SDPA's max_q), from meta
};
struct MetaResult {
  std::vector<MetaOut> outs;
};

// A call's signature as words; valid() is false when the call cannot take the cache.
class CallSignature {
 public:
  CallSignature(const OpInfo& info, c10::ArrayRef<c10::IValue> args);
  bool valid() const { return valid_; }
  uint64_t hash() const;
  const c10::SmallVector<int64_t, 48>& words() const { return w_; }

 private:
  void tensor(const at::Tensor& t, c10::ArrayRef<c10::IValue> args, size_t j);
  c10::SmallVector<int64_t, 48> w_;
  bool valid_ = true;
};

struct CachedCall {
  std::vector<int64_t> words;  // the full signature (the table is keyed by its hash)
  std::shared_ptr<const MetaResult> meta;
  std::shared_ptr<const runtime::Plan> plan;
  std::weak_ptr<runtime::Program> program;  // strict: evicted programs are looked up again
  std::vector<CallSource> slot_src, host_src;
  int device = 0;
};

std::shared_ptr<const CachedCall> find_cached_call(const CallSignature& sig);
void remember_call(const CallSignature& sig, std::shared_ptr<const MetaResult> meta, PlannedCall planned);

}  // namespace tpu::aten
