// The boxed PrivateUse1 kernel every ATen op without an explicit tpu kernel reaches. A call
// whose signature was seen before takes the dispatch cache (aten/dispatch_cache.h); otherwise
// the full path asks PyTorch's meta function for output metadata and allocates the outputs
// (aten/call_outputs.h), reads the arguments and PyTorch's result type (aten/call_arguments.h)
// and hands the call to run_lowering (aten/plan_call.h), remembering it for the cache. Ops
// without a lowering go to the CPU fallback (aten/cpu_fallback.cc).
#include "dispatch.h"

#include <ATen/core/Tensor.h>
#include <ATen/native/CPUFallback.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <string>

#include "call_arguments.h"
#include "call_outputs.h"
#include "common.h"
#include "cpu_fallback.h"
#include "eager_dynamic.h"
#include "cuda_compat.h"
#include "dispatch_cache.h"
#include "op_info.h"
#include "plan_call.h"
#include "runtime/compile_cache.h"
#include "unboxed_kernels.h"

namespace tpu::aten {

namespace {

// Replaces the call's n arguments on the stack by its results: the schema's returns in order
// (ints from the metadata), or one list of fresh tensors. `results` owns its tensors: borrowed
// outputs point into the arguments dropped here.
void push_results(torch::jit::Stack* stack, size_t n, const MetaResult& meta, bool list_result,
                  std::vector<at::Tensor> results) {
  torch::jit::drop(*stack, n);
  if (list_result) {
    stack->push_back(c10::List<at::Tensor>(std::move(results)));
    return;
  }
  size_t next = 0;
  for (const MetaOut& m : meta.outs) {
    if (m.int_value) stack->push_back(*m.int_value);
    else stack->push_back(std::move(results[next++]));
  }  // extra outputs (mutated, not returned) are not results of the schema
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
  if (info.cacheable && dispatch_cache_enabled()) sig.emplace(info, args);
  c10::DeviceGuard guard(c10::Device(kTpu, static_cast<c10::DeviceIndex>(device)));
  CallOutputs call_outs;
  allocate_outputs(schema, args, *mr, list_result, device, call_outs);
  append_mutated_args(entry, schema, args, call_outs);
  std::vector<at::Tensor> outs = owned_outputs(call_outs);  // the full path: copies cost no GIL here
  std::vector<NamedArg> named;
  const c10::ScalarType common = named_args(info, schema, args, outs, named);
  PlannedCall planned;
  run_lowering(info.base, schema.overload_name(), entry, named, outs, common, sig && sig->valid() ? &planned : nullptr);
  if (sig && sig->valid()) remember_call(*sig, mr, std::move(planned));

  if (bool_result) {
    const bool value = outs[0].item<bool>();  // the host read (a counted sync)
    torch::jit::drop(*stack, n);
    stack->push_back(c10::IValue(value));
    return true;
  }
  push_results(stack, n, *mr, list_result, std::move(outs));
  return true;
}

// The IValue a CallSource names: argument `arg`, or element `elem` of that list argument.
const c10::IValue& source_value(c10::ArrayRef<c10::IValue> args, const CallSource& src) {
  const c10::IValue& v = args[src.arg];
  return src.elem < 0 ? v : v.toListRef()[src.elem];
}

// A dispatch-cache hit (aten/dispatch_cache.h): outputs from the remembered metadata, the
// remembered plan bound to this call's storages, scalar values and generator state, launched.
// Reads `args` only (they may borrow the caller's tensors, see unboxed_kernels.h).
void run_cached(const c10::OperatorHandle& op, const OpInfo& info, const CachedCall& cc,
                c10::ArrayRef<c10::IValue> args, CallOutputs& outs) {
  const auto& schema = op.schema();
  c10::DeviceGuard guard(c10::Device(kTpu, static_cast<c10::DeviceIndex>(cc.device)));
  allocate_outputs(schema, args, *cc.meta, info.list_result, cc.device, outs);
  if (info.may_write_args) append_mutated_args(*info.entry, schema, args, outs);
  runtime::Call call;
  call.plan = cc.plan;
  call.device = cc.device;
  for (const CallSource& src : cc.slot_src)
    call.st.push_back(&state_of(src.out ? *outs[src.arg] : source_value(args, src).toTensor()));
  for (const CallSource& src : cc.host_src) {
    if (src.rng) {
      std::optional<at::Generator> gen;
      if (src.arg >= 0) gen = args[src.arg].toGenerator();
      call.host.push_back(draw_rng_state(gen, cc.rng_device, cc.rng_counters));
      continue;
    }
    const c10::IValue& v = source_value(args, src);
    call.host.push_back(v.isTensor() ? host_operand(v.toTensor()) : host_operand(v.toScalar()));
  }
  runtime::ProgramPtr program = runtime::CompileCache::get().hit(cc.program);
  execute_call(call, &program, [] { return std::string("program evicted (signature seen before)"); });
}

}  // namespace

std::shared_ptr<const CachedCall> serve_from_cache(const c10::OperatorHandle& op, const OpInfo& info,
                                                   c10::ArrayRef<c10::IValue> args, CallOutputs& outs) {
  if (!info.cacheable || !dispatch_cache_enabled()) return nullptr;
  CallSignature sig(info, args);
  if (!sig.valid()) return nullptr;
  std::shared_ptr<const CachedCall> hit = find_cached_call(sig);
  if (hit) run_cached(op, info, *hit, args, outs);
  return hit;
}

void tpu_boxed_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  if (eager_dynamic::maybe_handle(op, stack)) return;  // reads a mark_dynamic storage (eager_dynamic.cc)
  const OpInfo& info = op_info(op);
  std::string why = "no lowering";
  // Data-dependent output size (TPU_HOST_SYNC): one host sync, the CPU fallback's input copy is
  // the read and the copy path counts it. An op that also has a lowering takes this path only for
  // the calls the lowering refuses (repeat_interleave without output_size).
  auto host_sync = [&] { at::native::cpu_fallback(op, stack, false); };
  if (info.host_sync && !info.entry) return host_sync();
  if (const lowering::OpEntry* entry = info.entry) {
    const size_t n = op.schema().arguments().size();
    CallOutputs outs;
    if (auto hit = serve_from_cache(op, info, torch::jit::last(*stack, n), outs)) {
      push_results(stack, n, *hit->meta, info.list_result, owned_outputs(outs));
      return;
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
    if (info.host_sync) return host_sync();
    if (foreach && op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)) {
      // PyTorch's per-tensor loop: every backend without its own kernel (PrivateUse2 here) holds it.
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse2), stack);
      return;
    }
  }
  cpu_fallback(op, stack, why);
}

void register_lowered_kernels() {
  // Route every overload of a lowered op straight to our kernel. Without this, a
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
    if (!register_unboxed_kernel(*lib, full))  // the hottest overloads: typed (aten/unboxed_kernels.h)
      lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&tpu_boxed_kernel>());
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&tpu_boxed_kernel>());
}

}  // namespace tpu::aten

