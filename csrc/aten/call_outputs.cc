#include "call_outputs.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DefaultDtype.h>
#include <ATen/ops/empty_strided.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <unordered_map>

#include "allocator.h"
#include "common.h"
#include "op_info.h"

namespace tpu::aten {

namespace {

at::Tensor to_meta(const at::Tensor& t) {
  // Python scalars wrapped as 0-d CPU tensors stay as they are: Python meta kernels turn them
  // back into numbers, and promotion must still see the wrapped-number flag. Other 0-d CPU
  // tensors promote exactly like 0-d meta tensors.
  if (!t.defined() || t.unsafeGetTensorImpl()->is_wrapped_number()) return t;
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
}

c10::IValue to_meta(const c10::IValue& v) {
  if (v.isTensor()) return to_meta(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(to_meta(t));
    return out;
  }
  if (v.isList()) {
    auto l = v.toList();
    if (l.size() > 0 && (l.get(0).isTensor() || l.get(0).isNone())) {
      c10::List<std::optional<at::Tensor>> out;
      for (const c10::IValue& e : v.toListRef())
        out.push_back(e.isTensor() ? std::optional<at::Tensor>(to_meta(e.toTensor())) : std::nullopt);
      return out;
    }
  }
  if (v.isDevice() && v.toDevice().type() == kTpu) return c10::Device(c10::kMeta);
  if (v.isGenerator()) return c10::IValue();
  return v;
}

std::shared_mutex meta_mu;
std::unordered_map<std::string, std::shared_ptr<const MetaResult>>& meta_cache() {
  static auto* m = std::make_unique<std::unordered_map<std::string, std::shared_ptr<const MetaResult>>>().release();
  return *m;
}

void key_tensor(std::string& k, const at::Tensor& t) {
  if (!t.defined()) { k += "N;"; return; }
  k += static_cast<char>('A' + static_cast<int>(t.scalar_type()));
  k += t.device().is_cpu() ? (t.unsafeGetTensorImpl()->is_wrapped_number() ? 'w' : 'c') : 'd';
  for (int64_t d : t.sizes()) { k += std::to_string(d); k += ','; }
  k += '/';
  for (int64_t d : t.strides()) { k += std::to_string(d); k += ','; }
  k += ';';
}

// Signature of a call for the meta cache; false when the call must not be cached. Scalar values
// are left out (they never change the metadata of an op with tensor inputs), except for pure
// factories, whose metadata they can decide (arange's length, the default dtype for a float
// start): there the values and the default dtype are part of the key.
bool meta_key(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, std::string* key) {
  const auto& sargs = op.schema().arguments();
  std::string& k = *key;
  k.reserve(160);
  k += op.schema().name();
  k += '.';
  k += op.schema().overload_name();
  k += '|';
  bool has_input_tensor = false;
  std::string scalar_values;
  for (size_t j = 0; j < args.size(); ++j) {
    const c10::IValue& v = args[j];
    if (v.isTensor()) {
      key_tensor(k, v.toTensor());
      if (!sargs[j].is_out() && v.toTensor().defined()) has_input_tensor = true;
    } else if (v.isTensorList()) {
      k += "L";
      for (const at::Tensor& t : v.toTensorList()) key_tensor(k, t);
      has_input_tensor = true;
    } else if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList() &&
               !(v.toListRef().size() > 0 && v.toListRef()[0].isBool())) {
      k += "O";
      for (const c10::IValue& e : v.toListRef()) key_tensor(k, e.isTensor() ? e.toTensor() : at::Tensor());
      has_input_tensor = true;
    } else if (v.isScalar() && hint_of(sargs[j].type()) == NamedArg::Hint::Scalar) {
      k += v.isDouble() ? "Sf;" : v.isBool() ? "Sb;" : v.isInt() ? "Si;" : "Sc;";
      if (v.isDouble() || v.isInt() || v.isBool()) {  // exact: doubles by their bits
        int64_t bits = v.isDouble() ? 0 : v.isInt() ? v.toInt() : v.toBool();
        if (v.isDouble()) {
          double d = v.toDouble();
          std::memcpy(&bits, &d, sizeof bits);
        }
        scalar_values += std::to_string(bits);
        scalar_values += ',';
      } else {
        scalar_values += "?";  // complex, symbolic: no key for a factory
      }
    } else if (v.isGenerator()) {
      k += "G;";
    } else {
      k += v.tagKind();
      k += ':';
      std::stringstream ss;
      ss << v;
      k += ss.str();
      k += ';';
    }
  }
  if (has_input_tensor) return true;
  if (scalar_values.find('?') != std::string::npos) return false;
  k += "#factory:";
  k += scalar_values;
  k += c10::toString(c10::typeMetaToScalarType(c10::get_default_dtype()));
  return true;
}

// Whether this call writes argument j: the schema's alias annotation, unless the op's lowering
// entry declares otherwise (OpEntry::writes, OpEntry::out_overload_writes_only_out).
bool arg_written(const lowering::OpEntry& entry, const c10::FunctionSchema& schema,
                 c10::ArrayRef<c10::IValue> args, size_t j) {
  const auto& sargs = schema.arguments();
  const auto* alias = sargs[j].alias_info();
  bool written = alias && alias->isWrite();
  for (const lowering::WriteRule& rule : entry.writes) {
    if (sargs[j].name() != rule.arg) continue;
    auto idx = schema.argumentIndexWithName(rule.when);
    const c10::IValue* when = idx ? &args[*idx] : nullptr;
    written = when && ((when->isBool() && when->toBool()) || (when->isTensor() && when->toTensor().defined()));
  }
  if (entry.out_overload_writes_only_out) {
    bool has_out = std::any_of(sargs.begin(), sargs.end(), [](const c10::Argument& a) { return a.is_out(); });
    if (has_out) written = sargs[j].is_out();
  }
  return written;
}

}  // namespace

// Why a schema's returns cannot take the lowered path, or nullptr. One bool (equal) is lowered
// to a 0-d bool tensor read back on the host; one un-annotated Tensor[] is a list of fresh
// tensors (out-of-place foreach ops, jax_call); otherwise tensors or ints, no views.
const char* unsupported_returns(const std::vector<c10::Argument>& rets, bool bool_result, bool list_result) {
  if (bool_result || list_result) return nullptr;
  for (const auto& r : rets) {
    if (r.type()->kind() != c10::TypeKind::TensorType && !is_int_return(r)) return "returns a non-tensor";
    if (r.alias_info() && !r.alias_info()->isWrite()) return "returns a view";
  }
  return nullptr;
}

// Output metadata from PyTorch's meta function, cached by the call's signature (many meta
// functions are Python and cost ~100 us: arange's is). Scalar values never change output metadata
// when the op has tensor inputs; pure factories are keyed by their values too (meta_key). Ops returning nothing
// (in-place list ops) or a bool need no output metadata. Null (with `why`) when meta fails.
std::shared_ptr<const MetaResult> output_meta(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                                              bool bool_result, bool list_result, std::string* why) {
  const auto& rets = op.schema().returns();
  const size_t n = args.size();
  std::string mkey;
  std::shared_ptr<const MetaResult> mr;
  if (rets.empty() || bool_result) {
    auto res = std::make_shared<MetaResult>();
    if (bool_result) res->outs.push_back({{}, {}, c10::ScalarType::Bool});
    mr = res;
  }
  bool cacheable = !mr && meta_key(op, args, &mkey);
  if (cacheable) {
    std::shared_lock<std::shared_mutex> lock(meta_mu);
    if (auto it = meta_cache().find(mkey); it != meta_cache().end()) mr = it->second;
  }
  if (!mr) {
    if (!op.hasKernelForDispatchKey(c10::DispatchKey::Meta) &&
        !op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)) {
      *why = "no meta function";
      return nullptr;
    }
    torch::jit::Stack meta;
    meta.reserve(n);
    for (const c10::IValue& v : args) meta.push_back(to_meta(v));
    try {
      op.callBoxed(&meta);
    } catch (const std::exception& e) {
      *why = std::string("meta function failed: ") + e.what();
      return nullptr;
    }
    auto res = std::make_shared<MetaResult>();
    for (size_t i = 0; i < rets.size(); ++i) {
      if (is_int_return(rets[i])) {  // sizes only: the meta value is the real one
        const c10::IValue& iv = meta[i];
        res->outs.push_back({{}, {}, c10::ScalarType::Undefined,
                             iv.isSymInt() ? iv.toSymInt().expect_int() : iv.toInt()});
        continue;
      }
      if (list_result) {
        for (const at::Tensor& m : meta[i].toTensorList())
          res->outs.push_back({m.sizes().vec(), m.strides().vec(), m.scalar_type()});
        continue;
      }
      const at::Tensor& m = meta[i].toTensor();
      if (!m.defined()) {  // e.g. a backward op whose output_mask skips this gradient
        res->outs.push_back({{}, {}, c10::ScalarType::Undefined});
        continue;
      }
      res->outs.push_back({m.sizes().vec(), m.strides().vec(), m.scalar_type()});
    }
    mr = res;
    if (cacheable) {
      std::unique_lock<std::shared_mutex> lock(meta_mu);
      if (meta_cache().size() > 100000) meta_cache().clear();
      meta_cache().emplace(mkey, mr);
    }
  }

  return mr;
}

// Outputs: in-place/out= returns alias an argument (resized if meta resized it); functional
// returns are fresh tensors with the meta strides.
void allocate_outputs(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args, const MetaResult& meta,
                      bool list_result, int device, CallOutputs& outs) {
  const auto& sargs = schema.arguments();
  const auto& rets = schema.returns();
  const size_t n = args.size();
  for (size_t i = 0; i < meta.outs.size(); ++i) {
    const MetaOut& m = meta.outs[i];
    if (m.int_value) continue;  // not a tensor: pushed back in place below
    if (m.dtype == c10::ScalarType::Undefined) {
      outs.push_back(c10::MaybeOwned<at::Tensor>::owned(std::in_place));
      continue;
    }
    if (!list_result && rets[i].alias_info()) {
      const auto& before = rets[i].alias_info()->beforeSets();
      const at::Tensor* real = nullptr;
      for (size_t j = 0; j < n; ++j) {
        if (sargs[j].alias_info() && sargs[j].alias_info()->beforeSets() == before) {
          real = &args[j].toTensor();
          break;
        }
      }
      TORCH_INTERNAL_ASSERT(real && real->defined(), "torch_tpu: cannot find the argument aliased by ",
                            schema.name(), "'s output ", i);
      if (real->sizes() != c10::IntArrayRef(m.sizes)) real->resize_(m.sizes);
      outs.push_back(c10::MaybeOwned<at::Tensor>::borrowed(*real));
    } else {
      // What the tpu empty_strided kernel does (the caller holds the device guard), without
      // a second trip through the dispatcher.
      outs.push_back(c10::MaybeOwned<at::Tensor>::owned(at::detail::empty_strided_generic(
          m.sizes, m.strides, &TpuAllocator::get(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), m.dtype)));
    }
  }
}

std::vector<at::Tensor> owned_outputs(const CallOutputs& outs) {
  std::vector<at::Tensor> owned;
  owned.reserve(outs.size());
  for (const auto& t : outs) owned.push_back(*t);
  return owned;
}

// Arguments mutated but not returned (batch norm's running stats, the tensor lists of in-place
// list ops such as the fused optimizers: every element) become extra outputs after the
// returns, in argument order.
void append_mutated_args(const lowering::OpEntry& entry, const c10::FunctionSchema& schema,
                         c10::ArrayRef<c10::IValue> args, CallOutputs& outs) {
  const auto& sargs = schema.arguments();
  const auto& rets = schema.returns();
  const size_t n = args.size();
  for (size_t j = 0; j < n; ++j) {
    if (args[j].isTensorList()) {
      if (!arg_written(entry, schema, args, j)) continue;
      for (const c10::IValue& e : args[j].toListRef()) {
        const at::Tensor& t = e.toTensor();  // an element of the argument's list (borrowed below)
        TORCH_CHECK(t.defined() && t.device().type() == kTpu, schema.name(), ": every tensor of '",
                    sargs[j].name(), "' must be a tpu tensor");
        outs.push_back(c10::MaybeOwned<at::Tensor>::borrowed(t));
      }
      continue;
    }
    if (!args[j].isTensor() || !args[j].toTensor().defined() || !arg_written(entry, schema, args, j)) continue;
    const auto* alias = sargs[j].alias_info();
    bool returned = alias && std::any_of(rets.begin(), rets.end(), [&](const c10::Argument& r) {
      return r.alias_info() && r.alias_info()->beforeSets() == alias->beforeSets();
    });
    if (!returned) outs.push_back(c10::MaybeOwned<at::Tensor>::borrowed(args[j].toTensor()));
  }

}

}  // namespace tpu::aten
