#include "plan_call.h"

#include <ATen/core/List.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstring>
#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <unordered_map>

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>

#include "common.h"
#include "compile_reason.h"
#include "runtime/compile_cache.h"
#include "runtime/context.h"
#include "runtime/device_checks.h"
#include "runtime/executor.h"
#include "runtime/plan.h"

namespace tpu::aten {

using lowering::Arg;
using runtime::StorageState;
using runtime::ViewDesc;
using shlo::ElemType;
using shlo::Type;
using shlo::Value;

namespace {

using runtime::ArgPlan;
using runtime::elem_bytes;
using runtime::HostOperand;
using runtime::Plan;
using runtime::Slot;
using runtime::TensorRef;

// Same width and both or neither bool / complex: programs reinterpret such storages in place.
bool same_width(ElemType a, ElemType b) {
  return shlo::bit_width(a) == shlo::bit_width(b) && (a == ElemType::Pred) == (b == ElemType::Pred) &&
         shlo::is_complex(a) == shlo::is_complex(b);
}

// A storage filled by an untyped byte copy (torch.load restores UntypedStorage bytes) holds a u8
// buffer. The first op reading it as another width reinterprets the bytes once on the device
// (bitcast; bytes stay in memory order) and retypes the storage, instead of falling back.
void retype_storage(StorageState& st, ElemType to) {
  fused_flush();  // a pending fused value of this storage has the old type
  std::lock_guard<std::mutex> lock(st.mu);
  ElemType from = st.elem;
  if (same_width(from, to)) return;  // the flushed pending value has the type already
  int64_t fb = elem_bytes(from), tb = elem_bytes(to);
  if (from == ElemType::Pred || to == ElemType::Pred || static_cast<int64_t>(st.nbytes) % tb != 0 ||
      static_cast<int64_t>(st.nbytes) % fb != 0)
    throw lowering::Unsupported("tensor dtype differs in width from its storage's element type");
  int64_t n_from = static_cast<int64_t>(st.nbytes) / fb, n_to = static_cast<int64_t>(st.nbytes) / tb;
  shlo::Builder b;
  Value x = b.reshape(b.arg(Type{from, shlo::Shape(st.dims.begin(), st.dims.end())}), {n_from});
  // bitcast_convert excludes complex: a complex storage is its (re, im) part pairs in memory
  // order (view_as_real), split or joined with real/imag/complex around the bitcast.
  if (shlo::is_complex(from)) {
    shlo::Shape pair{n_from, 1};
    x = b.reshape(b.concatenate({b.reshape(b.real(x), pair), b.reshape(b.imag(x), pair)}, 1), {2 * n_from});
    from = shlo::part_type(from);
    fb /= 2;
    n_from *= 2;
  }
  const ElemType to_bits = shlo::part_type(to);
  const int64_t tbits = elem_bytes(to_bits), n_bits = static_cast<int64_t>(st.nbytes) / tbits;
  Value y = x.elem() == to_bits ? x
            : fb < tbits ? b.bitcast(b.reshape(x, {n_bits, tbits / fb}), Type{to_bits, {n_bits}})
            : fb > tbits ? b.reshape(b.bitcast(x, Type{to_bits, {n_from, fb / tbits}}), {n_bits})
                         : b.bitcast(x, Type{to_bits, {n_bits}});
  if (shlo::is_complex(to)) {
    y = b.reshape(y, {n_to, 2});
    y = b.complex(b.reshape(b.slice(y, {0, 0}, {n_to, 1}), {n_to}), b.reshape(b.slice(y, {0, 1}, {n_to, 2}), {n_to}));
  }
  auto exe = runtime::CompileCache::get().get_or_compile(b.module({y}), "retype storage",
                                                         std::string("storage bytes read as ") + shlo::mlir_name(to));
  auto outs = runtime::Executor::get().launch(*exe, st.device, {st.buffer->raw()}, {}, "retype storage");
  st.hold(outs[0], to, {n_to});
}


// Builds a Plan and its first Call together: tensors become slots (deduplicated by storage) and
// views, host values become operands; every slot and operand remembers where in the boxed call
// it came from (PlannedCall), so the dispatch cache can bind the plan to later calls.
class Planner {
 public:
  Planner(Plan& p, runtime::Call& c, PlannedCall* rec) : p_(p), c_(c), rec_(rec) {}

  int device() const { return device_; }

  TensorRef ref(const at::Tensor& t, CallSource src) {
    int dev = t.device().index();
    if (device_ < 0) {
      device_ = dev;
    } else if (device_ != dev) {
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
                  "devices, tpu:", device_, " and tpu:", dev, "!");
    }
    TensorRef r;
    r.slot = slot_of(t, src);
    ElemType e = elem_of(t.scalar_type());
    const Slot& s = p_.slots[r.slot];
    if (!same_width(s.elem, e))
      throw lowering::Unsupported("tensor dtype differs in width from its storage's element type");
    r.view.elem = e;
    r.view.sizes = t.sizes().vec();
    r.view.strides = t.strides().vec();
    r.view.offset = t.storage_offset();
    r.logical = r.view.sizes;
    runtime::key_tensor(p_.key, r, p_.slots[r.slot]);
    return r;
  }

  void host_scalar(const c10::Scalar& sc, CallSource src) {
    HostOperand h = host_operand(sc);
    p_.key += h.elem == ElemType::F64 ? "Sf;" : h.elem == ElemType::Pred ? "Sb;" : h.elem == ElemType::C128 ? "Sc;" : "Si;";
    add_host(h, src);
  }

  void host_tensor(const at::Tensor& t, CallSource src) {  // a 0-d CPU tensor
    HostOperand h = host_operand(t);
    p_.key += "H";
    p_.key += shlo::mlir_name(h.elem);
    p_.key += ';';
    add_host(h, src);
  }

  // The generator state: drawn again by each call that reuses the plan (CallSource::rng).
  void host_rng(const HostOperand& state, CallSource src, int device, int64_t counters) {
    p_.key += "G;";
    add_host(state, src);
    if (rec_) {
      rec_->rng_counters = counters;
      rec_->rng_device = device;
    }
  }

  int num_host() const { return static_cast<int>(c_.host.size()); }

 private:
  int slot_of(const at::Tensor& t, CallSource src) {
    StorageState* st = &state_of(t);
    for (size_t i = 0; i < c_.st.size(); ++i)
      if (c_.st[i] == st) return static_cast<int>(i);
    Slot s;
    ElemType e = elem_of(t.scalar_type());
    if (st->buffer) {
      if (!same_width(st->elem, e)) {
        retype_storage(*st, e);
        if (rec_) rec_->cacheable = false;  // the signature saw the storage's old type
      }
      s.elem = st->elem;
    } else {
      s.elem = e;
    }
    s.numel = static_cast<int64_t>(st->nbytes) / elem_bytes(s.elem);
    // Its buffer's dims (a storage without one gets zeros of [numel], runtime::ensure_buffer).
    if (st->buffer) s.dims.assign(st->dims.begin(), st->dims.end());
    else s.dims = {s.numel};
    p_.slots.push_back(s);
    c_.st.push_back(st);
    if (rec_) rec_->slot_src.push_back(src);
    return static_cast<int>(p_.slots.size() - 1);
  }

  void add_host(const HostOperand& h, CallSource src) {
    p_.host.push_back(h);
    c_.host.push_back(h);
    if (rec_) {
      rec_->host_src.push_back(src);
      if (src.arg < 0 && !src.rng) rec_->cacheable = false;
    }
  }

  Plan& p_;
  runtime::Call& c_;
  PlannedCall* rec_;
  int device_ = -1;
};

// bool[N] arguments (output_mask) may arrive as generic lists of bools.
bool is_bool_list(const c10::IValue& v) {
  if (v.isBoolList()) return true;
  if (!v.isList()) return false;
  auto l = v.toListRef();
  return !l.empty() && l[0].isBool();
}

std::vector<int64_t> int_list(const c10::IValue& v) {
  if (v.isIntList()) return v.toIntVector();
  if (is_bool_list(v)) {
    std::vector<int64_t> out;
    for (const c10::IValue& e : v.toListRef()) out.push_back(e.toBool() ? 1 : 0);
    return out;
  }
  std::vector<int64_t> out;
  for (const c10::SymInt& x : v.toSymIntList()) out.push_back(x.expect_int());
  return out;
}

bool is_host_scalar_tensor(const at::Tensor& t) {
  return t.device().is_cpu() && t.dim() == 0;
}

// What a call's program text depends on beyond its key's structure, learned by emitting the op
// once per plan key (10-100 us; a remembered answer ~0.2 us; planning path only, the dispatch
// cache keeps the plan):
// - checks: whether it records device checks. An entry declared .checked may record none for
//   some argument types (integer division checks its divisor, float division raises nothing: the
//   lowering guards each check by the element type). A call without checks has no status argument
//   or result and takes no status lock.
// - precision: whether it has a contraction (dot_general / convolution carry precision_config).
//   Only then does torch.set_float32_matmul_precision change the program, so only then does a
//   dispatch-cache hit compare the precision (aten/dispatch_cache.cc): the other ops skip
//   at::Context's precision lookup per call.
struct ProgramTraits {
  bool checks = false;
  bool precision = true;
};

ProgramTraits program_traits(const Plan& plan) {
  const bool checking = plan.entry->checked && runtime::device_checks();
  // A pointwise lowering never contracts: nothing to learn unless it may record checks.
  if (plan.entry->elementwise && !checking) return {false, false};
  static std::mutex mu;
  static auto* known = std::make_unique<std::unordered_map<std::string, ProgramTraits>>().release();
  std::string key = plan.key;
  key += checking ? "#c" : "#-";  // emitted with and without checks: different texts
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = known->find(key); it != known->end()) return it->second;
  }
  shlo::Builder b;
  std::vector<Value> cur = runtime::emit_strict_body(b, plan);  // plan.checked is still the entry's
  std::vector<Value> results;
  for (size_t i = 0; i < plan.slots.size(); ++i)
    if (plan.slots[i].written) results.push_back(cur[i]);
  ProgramTraits t;
  t.checks = b.has_errors();
  t.precision = b.module(results).find("#stablehlo<precision") != std::string::npos;
  std::lock_guard<std::mutex> lock(mu);
  if (known->size() >= 4096) known->clear();  // bounded; a forgotten key is emitted again
  known->emplace(std::move(key), t);
  return t;
}

// TensorIterator's memory-overlap rule, for the lowered ops whose CPU kernel is a TensorIterator
// that checks. Runs on the planning path only: a call that raises is never remembered by the
// dispatch cache, and the cache's signature (strides, offsets, shared storages) fixes the
// overlap, so cache hits (typed kernels included) need no check.
void check_call_overlap(const std::vector<NamedArg>& args, const std::vector<at::Tensor>& outs) {
  std::vector<at::Tensor> inputs;
  for (const auto& a : args) {
    if (a.value.isTensor()) inputs.push_back(a.value.toTensor());
    else if (a.value.isTensorList())
      for (const at::Tensor& t : a.value.toTensorList()) inputs.push_back(t);
  }
  for (const at::Tensor& o : outs) check_write_overlap(o, inputs.data(), inputs.size());
}

// Philox counters the call consumes (lowering::rng_counters: 0 when it draws nothing). The
// element count is the larger of its outputs and tensor inputs (multinomial draws one number
// per category).
int64_t rng_counters(const lowering::OpEntry& entry, const std::vector<NamedArg>& args,
                     const std::vector<at::Tensor>& outs) {
  if (!entry.random) return 0;
  int64_t largest = 1;
  for (const auto& o : outs)
    if (o.defined()) largest = std::max<int64_t>(largest, o.numel());
  for (const auto& a : args)
    if (a.value.isTensor() && a.value.toTensor().defined()) largest = std::max<int64_t>(largest, a.value.toTensor().numel());
  auto constant = [&](const std::string& name) -> std::optional<double> {
    for (const auto& a : args) {
      if (a.name != name) continue;
      if (a.value.isDouble() || a.value.isInt() || a.value.isBool()) return a.value.toScalar().toDouble();
      return std::nullopt;
    }
    return std::nullopt;
  };
  return lowering::rng_counters(entry, constant, largest);
}

[[noreturn]] void other_device(const Planner& pl, const at::Tensor& t) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, tpu:",
              std::max(pl.device(), 0), " and ", t.device().str(), "!");
}

// The generator state (a host operand): drawn from the given generator, or from the device
// default one of the call's device (its first output's, else its tensors').
void plan_generator(Planner& pl, ArgPlan& ap, const c10::IValue& v, int16_t src, int64_t rng_counters,
                    const std::vector<at::Tensor>& outs) {
  std::optional<at::Generator> g;
  if (v.isGenerator() && v.toGenerator().defined()) g = v.toGenerator();
  int dev = std::max(pl.device(), 0);
  for (const auto& o : outs)
    if (o.defined()) { dev = o.device().index(); break; }
  ap.value.kind = Arg::Kind::Tensor;
  ap.host_index.push_back(pl.num_host());
  pl.host_rng(draw_rng_state(g, dev, rng_counters), CallSource{static_cast<int16_t>(g ? src : -1), -1, false, true},
              dev, rng_counters);
}

// A tensor: a view of a slot (tpu), a host operand (0-d CPU), or None (undefined).
void plan_tensor(Planner& pl, Plan& plan, ArgPlan& ap, const at::Tensor& t, int16_t src) {
  if (!t.defined()) {
    ap.value.kind = Arg::Kind::None;
    plan.key += "N;";
  } else if (t.device().type() == kTpu) {
    ap.value.kind = Arg::Kind::Tensor;
    ap.refs.push_back(pl.ref(t, {src}));
  } else if (auto k = const_scalar_index(t)) {  // a Python scalar of the table: a constant, as in plan_scalar
    ap.value.kind = Arg::Kind::Tensor;
    ap.scalar_const = const_scalar_value(*k);
    ap.scalar_const_elem = elem_of(t.scalar_type());
    plan.key += "H";
    plan.key += shlo::mlir_name(ap.scalar_const_elem);
    plan.key += "=" + std::to_string(*k) + ";";
  } else if (is_host_scalar_tensor(t)) {
    ap.value.kind = Arg::Kind::Tensor;
    ap.host_index.push_back(pl.num_host());
    pl.host_tensor(t, {src});
  } else {
    other_device(pl, t);
  }
}

// Tensor[] / Tensor?[]: per element a view, a host operand (0-d CPU) or None.
void plan_tensor_list(Planner& pl, Plan& plan, ArgPlan& ap, const c10::IValue& v, int16_t src) {
  ap.value.kind = v.isTensorList() ? Arg::Kind::TensorList : Arg::Kind::OptTensorList;
  plan.key += "L[";
  int16_t elem = 0;
  for (const c10::IValue& e : v.toListRef()) {
    const at::Tensor t = e.isTensor() ? e.toTensor() : at::Tensor();
    const CallSource esrc{src, elem++};
    if (!t.defined()) {
      ap.refs.push_back(std::nullopt);
      ap.list_host.push_back(std::nullopt);
      plan.key += "N;";
    } else if (t.device().type() == kTpu) {
      ap.refs.push_back(pl.ref(t, esrc));
      ap.list_host.push_back(std::nullopt);
    } else if (is_host_scalar_tensor(t)) {
      ap.refs.push_back(std::nullopt);
      ap.list_host.push_back(pl.num_host());
      pl.host_tensor(t, esrc);
    } else {
      other_device(pl, t);
    }
  }
  plan.key += "];";
}

// A Python scalar: a constant in the key when in const_scalar_index's table, else a host operand.
void plan_scalar(Planner& pl, Plan& plan, ArgPlan& ap, const c10::Scalar& sc, int16_t src) {
  ap.value.kind = Arg::Kind::Scalar;
  if (auto k = const_scalar_index(sc)) {
    ap.scalar_const = const_scalar_value(*k);
    ap.value.scalar_value = ap.scalar_const;
    ap.scalar_const_elem = sc.isFloatingPoint() ? ElemType::F64 : ElemType::S64;
    plan.key += (sc.isFloatingPoint() ? "Sf=" : "Si=") + std::to_string(*k) + ";";
  } else {
    ap.host_index.push_back(pl.num_host());
    pl.host_scalar(sc, {src});
  }
}

// Any other argument is a constant of the program: part of the key.
void plan_constant(Plan& plan, ArgPlan& ap, const NamedArg& a) {
  Arg& av = ap.value;
  const c10::IValue& v = a.value;
  if (a.hint == NamedArg::Hint::DType) {
    av.kind = Arg::Kind::DType;
    av.dtype = elem_of(static_cast<c10::ScalarType>(v.toInt()));
    plan.key += "D" + std::to_string(v.toInt()) + ";";
  } else if (v.isBool()) {
    av.kind = Arg::Kind::Bool;
    av.b = v.toBool();
    plan.key += av.b ? "b1;" : "b0;";
  } else if (v.isInt() || v.isSymInt()) {
    av.kind = Arg::Kind::Int;
    av.i = v.isInt() ? v.toInt() : v.toSymInt().expect_int();
    plan.key += "i" + std::to_string(av.i) + ";";
  } else if (v.isDouble()) {
    av.kind = Arg::Kind::Double;
    av.d = v.toDouble();
    plan.key += "d" + std::to_string(av.d) + ";";
  } else if (v.isIntList() || v.isSymIntList() || is_bool_list(v)) {
    av.kind = Arg::Kind::IntList;
    av.ints = int_list(v);
    plan.key += "l";
    for (int64_t x : av.ints) plan.key += std::to_string(x) + ",";
    plan.key += ";";
  } else if (v.isString()) {
    av.kind = Arg::Kind::String;
    av.s = v.toStringRef();
    plan.key += "s" + av.s + ";";
  } else if (v.isDevice()) {
    av.kind = Arg::Kind::None;
  } else {
    throw lowering::Unsupported("argument '" + a.name + "' of type " + v.tagKind() +
                                " is not supported by the tpu lowering");
  }
}

// One lowering argument: a device view, a host operand (Python scalar, 0-d CPU tensor, RNG
// state) or a constant that is part of the key.
ArgPlan plan_argument(Planner& pl, Plan& plan, const NamedArg& a, int arg_index, int64_t rng_counters,
                      const std::vector<at::Tensor>& outs) {
  const auto src = static_cast<int16_t>(arg_index);
  ArgPlan ap;
  ap.name = a.name;
  const c10::IValue& v = a.value;
  if (a.hint == NamedArg::Hint::Ignore || (a.hint == NamedArg::Hint::Generator && rng_counters == 0)) {
    ap.value.kind = Arg::Kind::None;  // (a call that draws nothing leaves its generator alone)
  } else if (a.hint == NamedArg::Hint::Generator) {
    plan_generator(pl, ap, v, src, rng_counters, outs);
  } else if (v.isNone()) {
    ap.value.kind = Arg::Kind::None;
    plan.key += "N;";
  } else if (v.isTensor()) {
    plan_tensor(pl, plan, ap, v.toTensor(), src);
  } else if (v.isTensorList() || (v.isList() && !v.isIntList() && !v.isDoubleList() && !is_bool_list(v))) {
    plan_tensor_list(pl, plan, ap, v, src);
  } else if (a.hint == NamedArg::Hint::Scalar) {
    plan_scalar(pl, plan, ap, v.toScalar(), src);
  } else {
    plan_constant(plan, ap, a);
  }
  return ap;
}

// Outputs are written slots (a partial write reads the old storage first), inputs are read;
// read slots become program arguments in slot order.
void plan_outputs(Planner& pl, Plan& plan, const std::vector<at::Tensor>& outs, c10::ScalarType common) {
  std::vector<TensorRef>& out_refs = plan.outs;
  plan.key += "->";
  for (size_t i = 0; i < outs.size(); ++i) {
    const at::Tensor& o = outs[i];
    if (!o.defined()) {  // an output the caller did not ask for
      out_refs.push_back(TensorRef{-1});
      plan.key += "U;";
      continue;
    }
    TensorRef r = pl.ref(o, CallSource{static_cast<int16_t>(i), -1, true});
    Slot& s = plan.slots[r.slot];
    s.written = true;
    if (!r.view.covers(s.numel) && !r.view.permuted_whole(s.numel)) s.read = true;  // a partial write
    out_refs.push_back(r);
  }
  for (size_t i = 0; i < plan.slots.size(); ++i)
    if (plan.slots[i].written) runtime::plan_out_dims(plan.slots[i], out_refs, static_cast<int>(i));
  plan.key += "|c";
  plan.key += std::to_string(static_cast<int>(common));
  // Input slots are read.
  for (const auto& ap : plan.args)
    for (const auto& r : ap.refs)
      if (r) plan.slots[r->slot].read = true;
  int nargs = 0;
  for (auto& s : plan.slots) {
    if (s.read) s.arg = nargs++;
    plan.key += s.read ? 'r' : '-';
    plan.key += s.written ? 'w' : '-';
    if (s.read) runtime::key_dims(plan.key, s.dims);  // the parameter's type
  }

}

}  // namespace

void check_write_overlap(const at::Tensor& written, const at::Tensor* inputs, size_t n) {
  if (!written.defined()) return;
  if (!written.is_non_overlapping_and_dense()) at::assert_no_internal_overlap(written);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& in = inputs[i];
    if (in.defined() && !in.is_same(written) && in.is_alias_of(written))
      at::assert_no_partial_overlap(written, in);
  }
}

void materialize(const at::Tensor& t) {
  fused_flush();
  StorageState& st = state_of(t);
  ElemType e = elem_of(t.scalar_type());
  const int64_t n = static_cast<int64_t>(st.nbytes) / elem_bytes(e);
  // A whole contiguous tensor gets zeros of its shape (runtime/storage.h), anything else [n].
  const bool whole = t.is_contiguous() && t.storage_offset() == 0 && t.numel() == n;
  runtime::ensure_buffer(st, e, whole ? t.sizes().vec() : shlo::Shape{n});
}

void run_lowering(const std::string& name, const std::string& overload,
                  const lowering::OpEntry& entry, const std::vector<NamedArg>& args,
                  const std::vector<at::Tensor>& outs, c10::ScalarType common, PlannedCall* record) {
  // Lowerings written for real numbers never see complex values (OpEntry::complex): such a call
  // runs on the CPU fallback.
  if (!entry.complex) {
    auto cplx = [](const at::Tensor& t) { return t.defined() && c10::isComplexType(t.scalar_type()); };
    bool any = c10::isComplexType(common) || std::any_of(outs.begin(), outs.end(), cplx);
    for (const NamedArg& a : args) {
      const c10::IValue& v = a.value;
      if (v.isTensor()) any |= cplx(v.toTensor());
      else if (v.isList())
        for (const c10::IValue& e : v.toListRef()) any |= e.isTensor() && cplx(e.toTensor());
    }
    if (any) throw lowering::Unsupported("aten::" + name + " has no complex lowering");
  }
  // TensorIterator's memory-overlap rule for pointwise ops (OpEntry::writes_may_overlap).
  if (entry.elementwise && !entry.writes_may_overlap) check_call_overlap(args, outs);
  auto plan_ptr = std::make_shared<Plan>();
  Plan& plan = *plan_ptr;
  plan.entry = &entry;
  plan.checked = entry.checked;
  plan.name = name;
  plan.overload = overload;
  plan.what = "aten::" + name + (overload.empty() ? "" : "." + overload);
  plan.common = elem_of(common);
  plan.precision = matmul_precision();
  plan.key.reserve(256);
  plan.key += name;
  plan.key += '.';
  plan.key += overload;
  plan.key += '|';
  plan.key += static_cast<char>('0' + static_cast<int>(plan.precision));
  plan.key += '|';
  runtime::Call call;
  Planner pl(plan, call, record);

  // Random ops without a Generator argument (native_dropout) still draw from the device's.
  const int64_t counters = rng_counters(entry, args, outs);
  std::vector<const NamedArg*> all_args;
  for (const auto& a : args) all_args.push_back(&a);
  const NamedArg device_generator{"generator", c10::IValue(), NamedArg::Hint::Generator};
  if (counters > 0 && std::none_of(args.begin(), args.end(), [](const NamedArg& a) {
        return a.hint == NamedArg::Hint::Generator;
      }))
    all_args.push_back(&device_generator);

  plan.args.reserve(all_args.size());
  for (size_t j = 0; j < all_args.size(); ++j)
    plan.args.push_back(plan_argument(pl, plan, *all_args[j], static_cast<int>(j), counters, outs));
  plan_outputs(pl, plan, outs, common);
  const ProgramTraits traits = program_traits(plan);
  // Checks off: the runtime adds no status whatever the lowering records.
  plan.checked = entry.checked && (!runtime::device_checks() || traits.checks);
  plan.uses_precision = traits.precision;
  call.device = std::max(pl.device(), 0);
  call.plan = plan_ptr;
  runtime::ProgramPtr program;
  execute_call(call, &program, [&] { return compile_reason(plan.what, all_args, outs); });
  if (record) {
    record->plan = std::move(plan_ptr);
    record->program = std::move(program);
    record->device = call.device;
  }
}

void execute_call(const runtime::Call& call, runtime::ProgramPtr* program, const runtime::MissReason& why) {
  try {
    runtime::execute(call, program, why);
  } catch (const runtime::DeviceCheckError& e) {  // debug eager raises at the op
    throw_device_check(e.kind, e.what());
  }
}

}  // namespace tpu::aten
