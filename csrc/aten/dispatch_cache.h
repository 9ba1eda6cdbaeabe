// The dispatch cache: the boxed kernel's fast path. A call's *signature* (the op, each tensor's
// dtype/shape/strides/offset/storage size and which arguments share a storage, the constants,
// the kinds but not the values of Python scalars and 0-d host tensors, the eager mode; the matmul
// precision only for plans with a contraction, compared on a hit) maps to
// everything the first call with that signature derived: output metadata, the plan (whose key,
// program and result type follow from the signature) and where each of the plan's storages and
// host operands comes from in the boxed call. A hit allocates the outputs, binds the plan to this
// call's storages and scalar values (and draws a random op's generator state) and launches the
// remembered program: no meta call, no key strings, no planning. Tensor lists (cat, foreach,
// index's Tensor?[]) and random ops are served too; calls needing per-call host work before
// planning (CPU index tensors, bool masks) have signatures that never match a remembered one
// (the full path remembers the call after that work). Not served (see OpInfo::cacheable): host
// syncs, bool and view returns, pure factories. The full path (aten/dispatch.cc) fills the cache.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/SmallVector.h>

#include <memory>
#include <string>
#include <vector>

#include "call_outputs.h"
#include "op_info.h"
#include "plan_call.h"

namespace tpu::aten {

// A call's signature as words; valid() is false when the call cannot take the cache.
class CallSignature {
 public:
  CallSignature(const OpInfo& info, c10::ArrayRef<c10::IValue> args);
  bool valid() const { return valid_; }
  uint64_t hash() const;
  const c10::SmallVector<int64_t, 48>& words() const { return w_; }

 private:
  void value(const OpInfo& info, const c10::IValue& v, size_t j);
  void tensor(const at::Tensor& t);
  void list(const c10::IValue& v, bool scalars);
  c10::SmallVector<int64_t, 48> w_;
  // Storages of the tpu tensors seen so far: the plan has one slot per distinct storage.
  c10::SmallVector<const c10::StorageImpl*, 8> storages_;
  bool has_input_tensor_ = false;
  bool valid_ = true;
};

struct CachedCall {
  std::vector<int64_t> words;  // the full signature (the table is keyed by its hash)
  std::shared_ptr<const MetaResult> meta;
  std::shared_ptr<const runtime::Plan> plan;
  std::weak_ptr<runtime::Program> program;  // strict: evicted programs are looked up again
  std::vector<CallSource> slot_src, host_src;
  int device = 0;
  int64_t rng_counters = 0;
  int rng_device = 0;
};

std::shared_ptr<const CachedCall> find_cached_call(const CallSignature& sig);

// Off: every call takes the full path (benchmarks compare both in one process).
void set_dispatch_cache_enabled(bool on);
bool dispatch_cache_enabled();

// Calls served from the cache, calls remembered by the full path, signatures held now.
struct DispatchCacheStats {
  int64_t hits = 0, remembered = 0, entries = 0;
};
DispatchCacheStats dispatch_cache_stats();
void remember_call(const CallSignature& sig, std::shared_ptr<const MetaResult> meta, PlannedCall planned);

}  // namespace tpu::aten
