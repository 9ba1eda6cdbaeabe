#include "execute.h"

#include <ATen/core/List.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <unordered_map>

#include <ATen/ops/empty.h>

#include "common.h"
#include "generator.h"
#include "runtime/compile_cache.h"
#include "runtime/context.h"
#include "runtime/executor.h"
#include "runtime/view_io.h"

namespace tpu::aten {

using lowering::Arg;
using runtime::StorageState;
using runtime::ViewDesc;
using shlo::ElemType;
using shlo::Type;
using shlo::Value;

DispatchStats& dispatch_stats() {
  static DispatchStats s;
  return s;
}

namespace {

int64_t elem_bytes(ElemType t) { return t == ElemType::Pred ? 1 : shlo::bit_width(t) / 8; }

struct Slot {
  StorageState* st;
  bool read = false;
  bool written = false;
  int64_t numel = 0;
  ElemType elem = ElemType::U8;
  int arg = -1;
};

// A value the host passes to the program each launch (Python scalars, 0-d CPU tensors, RNG
// state): part of the arguments, never of the program text.
struct HostOperand {
  ElemType elem;
  std::vector<int64_t> dims;
  alignas(8) unsigned char bytes[16];
};

struct TensorRef {
  int slot;
  ViewDesc view;
  std::vector<int64_t> logical;  // shape the lowering sees (the view's, or [numel] if flattened)
};

// Everything needed to launch, derived from the call each time (cheap), so a cache hit builds
// no program text.
struct Plan {
  std::vector<Slot> slots;
  std::vector<HostOperand> host;
  std::string key;
  int device = -1;
};

// A storage filled by an untyped byte copy (torch.load restores UntypedStorage bytes) holds a u8
// buffer. The first op reading it as another width reinterprets the bytes once on the device
// (bitcast; bytes stay in memory order) and retypes the storage, instead of falling back.
void retype_storage(StorageState& st, ElemType to) {
  fused_flush();  // a pending fused value of this storage has the old type
  std::lock_guard<std::mutex> lock(st.mu);
  ElemType from = st.elem;
  int64_t fb = elem_bytes(from), tb = elem_bytes(to);
  if (from == ElemType::Pred || to == ElemType::Pred || static_cast<int64_t>(st.nbytes) % tb != 0 ||
      static_cast<int64_t>(st.nbytes) % fb != 0)
    throw lowering::Unsupported("tensor dtype differs in width from its storage's element type");
  int64_t n_from = static_cast<int64_t>(st.nbytes) / fb, n_to = static_cast<int64_t>(st.nbytes) / tb;
  shlo::Builder b;
  Value x = b.arg(Type{from, {n_from}});
  Value y = fb < tb   ? b.bitcast(b.reshape(x, {n_to, tb / fb}), Type{to, {n_to}})
            : fb > tb ? b.reshape(b.bitcast(x, Type{to, {n_from, fb / tb}}), {n_to})
                      : b.bitcast(x, Type{to, {n_to}});
  auto exe = runtime::CompileCache::get().get_or_compile(b.module({y}), "retype storage",
                                                         std::string("storage bytes read as ") + shlo::mlir_name(to));
  auto outs = runtime::Executor::get().launch(*exe, st.device, {st.buffer->raw()}, {}, "retype storage");
  st.buffer = outs[0];
  st.elem = to;
}

bool same_width(ElemType a, ElemType b) {
  return shlo::bit_width(a) == shlo::bit_width(b) && (a == ElemType::Pred) == (b == ElemType::Pred);
}

class Planner {
 public:
  Planner(Plan& p, bool flatten) : p_(p), flatten_(flatten) {}

  int slot_of(const at::Tensor& t) {
    StorageState* st = &state_of(t);
    for (size_t i = 0; i < p_.slots.size(); ++i)
      if (p_.slots[i].st == st) return static_cast<int>(i);
    Slot s{st};
    ElemType e = elem_of(t.scalar_type());
    if (st->buffer) {
      if (!same_width(st->elem, e)) retype_storage(*st, e);
      s.elem = st->elem;
    } else {
      s.elem = e;
    }
    s.numel = static_cast<int64_t>(st->nbytes) / elem_bytes(s.elem);
    p_.slots.push_back(s);
    return static_cast<int>(p_.slots.size() - 1);
  }

  TensorRef ref(const at::Tensor& t) {
    int dev = t.device().index();
    if (p_.device < 0) {
      p_.device = dev;
    } else if (p_.device != dev) {
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
                  "devices, tpu:", p_.device, " and tpu:", dev, "!");
    }
    TensorRef r;
    r.slot = slot_of(t);
    ElemType e = elem_of(t.scalar_type());
    const Slot& s = p_.slots[r.slot];
    if (shlo::bit_width(s.elem) != shlo::bit_width(e) || (s.elem == ElemType::Pred) != (e == ElemType::Pred))
      throw lowering::Unsupported("tensor dtype differs in width from its storage's element type");
    r.view.elem = e;
    r.view.sizes = t.sizes().vec();
    r.view.strides = t.strides().vec();
    r.view.offset = t.storage_offset();
    if (flatten_ && t.dim() > 0) {
      r.view.sizes = {t.numel()};
      r.view.strides = {1};
    }
    r.logical = r.view.sizes;
    key_tensor(r);
    return r;
  }

  void key_tensor(const TensorRef& r) {
    auto& k = p_.key;
    k += 'T';
    k += shlo::mlir_name(r.view.elem);
    k += '[';
    for (int64_t d : r.view.sizes) { k += std::to_string(d); k += ','; }
    k += "][";
    for (int64_t d : r.view.strides) { k += std::to_string(d); k += ','; }
    k += "]@";
    k += std::to_string(r.view.offset);
    k += 's';
    k += std::to_string(r.slot);
    k += ':';
    const Slot& s = p_.slots[r.slot];
    k += std::to_string(s.numel);
    k += shlo::mlir_name(s.elem);
    k += ';';
  }

  void host_scalar(const c10::Scalar& sc) {
    HostOperand h{};
    if (sc.isFloatingPoint()) {
      h.elem = ElemType::F64;
      double v = sc.toDouble();
      std::memcpy(h.bytes, &v, 8);
      p_.key += "Sf;";
    } else if (sc.isBoolean()) {
      h.elem = ElemType::Pred;
      h.bytes[0] = sc.toBool() ? 1 : 0;
      p_.key += "Sb;";
    } else if (sc.isIntegral(false)) {
      h.elem = ElemType::S64;
      int64_t v = sc.toLong();
      std::memcpy(h.bytes, &v, 8);
      p_.key += "Si;";
    } else {
      throw lowering::Unsupported("complex scalars are not supported on tpu");
    }
    p_.host.push_back(h);
  }

  void host_tensor(const at::Tensor& t) {  // a 0-d CPU tensor
    HostOperand h{};
    h.elem = elem_of(t.scalar_type());
    std::memcpy(h.bytes, t.data_ptr(), t.element_size());
    p_.key += "H";
    p_.key += shlo::mlir_name(h.elem);
    p_.key += ';';
    p_.host.push_back(h);
  }

  void host_rng(uint64_t seed, uint64_t offset) {
    HostOperand h{};
    h.elem = ElemType::U64;
    h.dims = {2};
    std::memcpy(h.bytes, &seed, 8);
    std::memcpy(h.bytes + 8, &offset, 8);
    p_.key += "G;";
    p_.host.push_back(h);
  }

 private:
  Plan& p_;
  bool flatten_;
};

// Per-argument data recorded while planning, consumed when building the program on a miss.
struct ArgPlan {
  const NamedArg* src;
  Arg::Kind kind = Arg::Kind::None;
  std::vector<std::optional<TensorRef>> refs;  // Tensor / lists
  std::vector<int> host_index;                 // which host operand(s) feed this argument
  std::vector<std::optional<int>> list_host;   // list entries that are host 0-d tensors
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

int64_t numel_of(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

// Human-readable signature of a call, one entry per argument, for explaining compiles.
std::vector<std::pair<std::string, std::string>> describe_call(const std::vector<const NamedArg*>& args,
                                                               const std::vector<at::Tensor>& outs) {
  auto tensor_desc = [](const at::Tensor& t) {
    if (!t.defined()) return std::string("None");
    std::string d = std::string(shlo::mlir_name(elem_of(t.scalar_type()))) + "[";
    for (int64_t i = 0; i < t.dim(); ++i) d += (i ? ", " : "") + std::to_string(t.size(i));
    d += "]";
    if (!t.is_contiguous() || t.storage_offset() != 0) {
      d += " strides (";
      for (int64_t i = 0; i < t.dim(); ++i) d += (i ? ", " : "") + std::to_string(t.stride(i));
      d += ") offset " + std::to_string(t.storage_offset());
    }
    if (t.device().is_cpu()) d += " (cpu scalar)";
    return d;
  };
  std::vector<std::pair<std::string, std::string>> out;
  for (const NamedArg* a : args) {
    const c10::IValue& v = a->value;
    std::string d;
    if (a->hint == NamedArg::Hint::Generator) d = "generator";
    else if (v.isTensor()) d = tensor_desc(v.toTensor());
    else if (v.isTensorList()) {
      d = "[";
      for (const at::Tensor& t : v.toTensorList()) d += tensor_desc(t) + "; ";
      d += "]";
    } else if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
      // Tensor?[] (e.g. index's indices): describe by metadata; printing the IValue would read
      // every tensor's values back to the host (a hidden sync per index tensor per compile).
      d = "[";
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) d += tensor_desc(e.toTensor());
        else if (e.isNone()) d += "None";
        else {
          std::stringstream ss;
          ss << e;
          d += ss.str();
        }
        d += "; ";
      }
      d += "]";
    } else if (a->hint == NamedArg::Hint::Scalar && v.isScalar()) {
      d = v.isDouble() ? "float scalar" : v.isBool() ? "bool scalar" : "int scalar";
    } else {
      std::stringstream ss;
      ss << v;
      d = ss.str();
    }
    out.emplace_back(a->name, d);
  }
  for (size_t i = 0; i < outs.size(); ++i) out.emplace_back("out" + std::to_string(i), tensor_desc(outs[i]));
  return out;
}

// Why an op signature missed the dispatch cache: the first call, or what changed since the last
// signature compiled for the same overload.
std::string compile_reason(const std::string& op, std::vector<std::pair<std::string, std::string>> sig,
                           bool flattened) {
  static std::mutex mu;
  static auto* last = std::make_unique<std::unordered_map<std::string, std::vector<std::pair<std::string, std::string>>>>().release();
  std::lock_guard<std::mutex> lock(mu);
  auto it = last->find(op);
  std::string why;
  if (it == last->end()) {
    why = "first call of " + op + " (";
    for (size_t i = 0; i < sig.size(); ++i) why += (i ? ", " : "") + sig[i].first + "=" + sig[i].second;
    why += ")";
  } else {
    for (size_t i = 0; i < sig.size() && i < it->second.size(); ++i) {
      if (sig[i] == it->second[i]) continue;
      bool dtype_change = sig[i].second.substr(0, sig[i].second.find('[')) !=
                          it->second[i].second.substr(0, it->second[i].second.find('['));
      why += std::string(why.empty() ? "" : "; ") + (dtype_change ? "new dtype" : "new shape") + " for '" +
             sig[i].first + "': " + it->second[i].second + " -> " + sig[i].second;
    }
    if (why.empty()) why = "new signature (storage layout or aliasing changed)";
    if (flattened) why += " [pointwise: keyed by element count]";
  }
  (*last)[op] = std::move(sig);
  return why;
}

bool is_host_scalar_tensor(const at::Tensor& t) {
  return t.device().is_cpu() && t.dim() == 0;
}

// Host operands repeat (the same learning rate, the same `+ 1`): keep their device copies.
// They are never donated, so sharing one buffer between launches is safe.
pjrt::BufferPtr upload_host(const HostOperand& h, int device) {
  static std::mutex mu;
  static auto* cache = std::make_unique<std::unordered_map<std::string, pjrt::BufferPtr>>().release();
  std::string key(reinterpret_cast<const char*>(h.bytes), sizeof h.bytes);
  key += static_cast<char>(h.elem);
  key += static_cast<char>(device);
  key += static_cast<char>(h.dims.size());
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache->find(key); it != cache->end()) return it->second;
  }
  auto& ctx = runtime::Context::get();
  auto buf = ctx.client().from_host(h.bytes, pjrt_of(h.elem), h.dims, ctx.device(device));
  std::lock_guard<std::mutex> lock(mu);
  if (cache->size() > 4096) cache->clear();
  cache->emplace(key, buf);
  return buf;
}

// Emits one op into `b`: reads its tensor arguments out of the storage values `cur`, runs the
// lowering, and writes the results back into `cur`. Shared by strict (one op per program) and
// fused (many ops per program) execution.
void emit_op(shlo::Builder& b, std::vector<Value>& cur, const std::vector<Value>& host_vals, const Plan& plan,
           const std::vector<ArgPlan>& aps, const std::vector<TensorRef>& out_refs,
           const lowering::OpEntry& entry, const std::string& name, const std::string& overload,
           c10::ScalarType common, const std::vector<at::Tensor>& outs) {
  auto read = [&](const TensorRef& r) {
    Value v = runtime::read_view(b, cur[r.slot], r.view);
    return b.reshape(v, r.logical);
  };
  lowering::OpCall call;
  call.name = name;
  call.overload = overload;
  call.common = elem_of(common);
  for (const auto& ap : aps) {
    Arg a;
    a.kind = ap.kind;
    const c10::IValue& v = ap.src->value;
    switch (ap.kind) {
      case Arg::Kind::Tensor:
        a.tensor = ap.refs.empty() ? host_vals[ap.host_index[0]] : read(*ap.refs[0]);
        break;
      case Arg::Kind::TensorList:
      case Arg::Kind::OptTensorList:
        for (size_t i = 0; i < ap.refs.size(); ++i) {
          if (ap.refs[i]) a.tensors.push_back(read(*ap.refs[i]));
          else if (ap.list_host[i]) a.tensors.push_back(host_vals[*ap.list_host[i]]);
          else a.tensors.push_back(std::nullopt);
        }
        break;
      case Arg::Kind::Scalar: a.scalar = host_vals[ap.host_index[0]]; break;
      case Arg::Kind::DType: a.dtype = elem_of(static_cast<c10::ScalarType>(v.toInt())); break;
      case Arg::Kind::Bool: a.b = v.toBool(); break;
      case Arg::Kind::Int: a.i = v.isInt() ? v.toInt() : v.toSymInt().expect_int(); break;
      case Arg::Kind::Double: a.d = v.toDouble(); break;
      case Arg::Kind::IntList:
        a.ints = int_list(v);
        break;
      case Arg::Kind::String: a.s = v.toStringRef(); break;
      case Arg::Kind::None: break;
    }
    call.args.emplace_back(ap.src->name, std::move(a));
  }
  for (const auto& r : out_refs) call.outs.push_back(Type{r.view.elem, r.logical});  // undefined: empty
  std::vector<Value> res = entry.fn(b, call);
  TORCH_INTERNAL_ASSERT(res.size() >= outs.size(), "torch_tpu: lowering of ", name, " returned ",
                        res.size(), " values for ", outs.size(), " outputs");
  for (size_t i = 0; i < outs.size(); ++i) {
    const TensorRef& r = out_refs[i];
    if (r.slot < 0) continue;
    Value v = b.convert(res[i], r.view.elem);
    if (v.shape() != r.view.sizes) {
      TORCH_INTERNAL_ASSERT(v.type.numel() == numel_of(r.view.sizes),
                            "torch_tpu: lowering of ", name, " produced shape ", v.type.str(),
                            " for an output of ", r.view.sizes.size(), " dims");
      v = b.reshape(v, r.view.sizes);
    }
    const Slot& s = plan.slots[r.slot];
    cur[r.slot] = runtime::write_view(b, cur[r.slot], v, r.view, s.numel, s.elem);
  }
}

// ---------------------------------------------------------------- fused eager
// DEFER_AND_FUSE: ops are emitted into one pending program instead of launching. Each storage
// touched holds its *pending value*; the program is launched at sync points (host reads,
// synchronize, data-dependent ops, direct buffer access, size limit) and its text - which
// depends only on the recorded structure, never on scalar values - is the compile-cache key,
// so a repeated loop body compiles once.
struct Pending {
  std::recursive_mutex mu;
  std::unique_ptr<shlo::Builder> b;
  int device = -1;
  int ops = 0;
  std::unordered_map<StorageState*, Value> cur;
  std::unordered_map<StorageState*, int> arg_of;
  std::vector<pjrt::BufferPtr> arg_bufs;  // in program-argument order
  std::vector<StorageState*> written;     // first-write order (deterministic program text)
};
constexpr int kMaxFusedOps = 512;

Pending& pending() {
  static auto* p = std::make_unique<Pending>().release();
  return *p;
}

void flush_locked(Pending& p) {
  if (p.ops == 0) return;
  std::vector<Value> results;
  std::vector<StorageState*> targets;
  for (StorageState* st : p.written) {
    auto it = p.cur.find(st);
    if (it == p.cur.end()) continue;  // storage died before the flush
    if (auto a = p.arg_of.find(st); a != p.arg_of.end()) p.b->alias(a->second, static_cast<int>(results.size()));
    results.push_back(it->second);
    targets.push_back(st);
  }
  int ops = p.ops;
  int device = p.device;
  std::vector<pjrt::BufferPtr> bufs = std::move(p.arg_bufs);
  std::string mlir = results.empty() ? std::string() : p.b->module(results);
  p.b.reset();
  p.cur.clear();
  p.arg_of.clear();
  p.arg_bufs.clear();
  p.written.clear();
  p.ops = 0;
  p.device = -1;
  if (results.empty()) return;
  auto exe = runtime::CompileCache::get().get_or_compile(
      mlir, "fused graph (" + std::to_string(ops) + " ops)", "new fused graph structure");
  std::vector<PJRT_Buffer*> raw;
  for (const auto& bptr : bufs) raw.push_back(bptr->raw());
  auto outs = runtime::Executor::get().launch(*exe, device, raw, {}, "fused graph");
  for (size_t i = 0; i < targets.size(); ++i) {
    std::lock_guard<std::mutex> lock(targets[i]->mu);
    targets[i]->buffer = outs[i];
    targets[i]->elem = results[i].elem();
  }
}

void fused_record(const Plan& plan, const std::vector<ArgPlan>& aps, const std::vector<TensorRef>& out_refs,
                  const lowering::OpEntry& entry, const std::string& name, const std::string& overload,
                  c10::ScalarType common, const std::vector<at::Tensor>& outs) {
  Pending& p = pending();
  std::lock_guard<std::recursive_mutex> lock(p.mu);
  if (p.ops > 0 && p.device != plan.device) flush_locked(p);
  if (!p.b) {
    p.b = std::make_unique<shlo::Builder>();
    p.device = plan.device;
  }
  shlo::Builder& b = *p.b;
  std::vector<Value> cur(plan.slots.size());
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    const Slot& s = plan.slots[i];
    if (!s.read) continue;
    if (auto it = p.cur.find(s.st); it != p.cur.end()) {
      cur[i] = it->second;
      continue;
    }
    if (!s.st->buffer) {  // never written: zeros, as in strict mode
      std::vector<unsigned char> zeros(static_cast<size_t>(s.numel * elem_bytes(s.elem)), 0);
      auto& ctx = runtime::Context::get();
      s.st->buffer = ctx.client().from_host(zeros.data(), pjrt_of(s.elem), {s.numel}, ctx.device(s.st->device));
      s.st->elem = s.elem;
    }
    int64_t n = static_cast<int64_t>(s.st->nbytes) / elem_bytes(s.st->elem);
    Value v = b.arg(Type{s.st->elem, {n}});
    p.arg_of[s.st] = b.num_args() - 1;
    p.arg_bufs.push_back(s.st->buffer);
    p.cur[s.st] = v;
    cur[i] = v;
  }
  std::vector<Value> host_vals;
  for (const auto& h : plan.host) {
    p.arg_bufs.push_back(upload_host(h, plan.device));
    host_vals.push_back(b.arg(Type{h.elem, h.dims}));
  }
  emit_op(b, cur, host_vals, plan, aps, out_refs, entry, name, overload, common, outs);
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    const Slot& s = plan.slots[i];
    if (!s.written) continue;
    // A storage address can come back (freed, then reallocated): list each address once.
    if (std::find(p.written.begin(), p.written.end(), s.st) == p.written.end()) p.written.push_back(s.st);
    p.cur[s.st] = cur[i];
  }
  dispatch_stats().ops++;
  if (++p.ops >= kMaxFusedOps) flush_locked(p);
}

}  // namespace

void fused_flush() {
  Pending& p = pending();
  std::lock_guard<std::recursive_mutex> lock(p.mu);
  flush_locked(p);
}

void fused_forget(runtime::StorageState* st) {
  Pending& p = pending();
  std::lock_guard<std::recursive_mutex> lock(p.mu);
  if (p.ops == 0) return;
  p.cur.erase(st);
  p.arg_of.erase(st);
}

void materialize(const at::Tensor& t) {
  fused_flush();
  StorageState& st = state_of(t);
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.buffer) return;
  ElemType e = elem_of(t.scalar_type());
  int64_t n = static_cast<int64_t>(st.nbytes) / elem_bytes(e);
  std::vector<unsigned char> zeros(static_cast<size_t>(n * elem_bytes(e)), 0);
  auto& ctx = runtime::Context::get();
  st.buffer = ctx.client().from_host(zeros.data(), pjrt_of(e), {n}, ctx.device(st.device));
  st.elem = e;
}

void run_lowering(const std::string& name, const std::string& overload,
                  const lowering::OpEntry& entry, const std::vector<NamedArg>& args,
                  const std::vector<at::Tensor>& outs, c10::ScalarType common) {
  // Flatten pointwise ops over contiguous same-shaped operands: one program per element count.
  // Fused programs keep logical shapes: XLA fuses better without 1-D reshapes between ops.
  bool flatten = entry.elementwise && runtime::Context::get().mode() != runtime::EagerMode::DeferAndFuse;
  if (flatten) {
    c10::IntArrayRef shape;
    bool have = false;
    auto check = [&](const at::Tensor& t) {
      if (!t.defined() || t.dim() == 0) return;
      if (!t.is_contiguous()) { flatten = false; return; }
      if (!have) { shape = t.sizes(); have = true; }
      else if (t.sizes() != shape) flatten = false;
    };
    for (const auto& a : args) {
      if (a.value.isTensor()) check(a.value.toTensor());
      else if (a.value.isTensorList()) flatten = false;
    }
    for (const auto& o : outs) check(o);
  }

  Plan plan;
  plan.key.reserve(256);
  plan.key += name;
  plan.key += '.';
  plan.key += overload;
  plan.key += flatten ? "|F|" : "|";
  Planner pl(plan, flatten);
  std::vector<ArgPlan> aps;
  aps.reserve(args.size());
  // Random ops reserve Philox counters for the larger of their outputs and tensor inputs
  // (multinomial draws one number per category), one 128-bit block (4 x u32 = 2 x u64) per
  // element: enough for two 32-bit uniforms (Box-Muller) or 64-bit draws, so consecutive ops
  // never reuse counters.
  int64_t rng_numel = 1;
  for (const auto& o : outs)
    if (o.defined()) rng_numel = std::max<int64_t>(rng_numel, o.numel());
  if (entry.random) {
    for (const auto& a : args) {
      if (a.value.isTensor() && a.value.toTensor().defined())
        rng_numel = std::max<int64_t>(rng_numel, a.value.toTensor().numel());
    }
  }

  // Random ops without a Generator argument (native_dropout) still draw from the device's.
  std::vector<NamedArg> extra;
  if (entry.random) {
    bool has_gen = false;
    for (const auto& a : args) has_gen |= a.hint == NamedArg::Hint::Generator;
    if (!has_gen) extra.push_back({"generator", c10::IValue(), NamedArg::Hint::Generator});
  }
  std::vector<const NamedArg*> all_args;
  for (const auto& a : args) all_args.push_back(&a);
  for (const auto& a : extra) all_args.push_back(&a);

  for (const NamedArg* ap_src : all_args) {
    const NamedArg& a = *ap_src;
    ArgPlan ap{&a};
    const c10::IValue& v = a.value;
    if (a.hint == NamedArg::Hint::Ignore) {
      ap.kind = Arg::Kind::None;
    } else if (a.hint == NamedArg::Hint::Generator) {
      c10::optional<at::Generator> g;
      if (v.isGenerator()) g = v.toGenerator();
      int dev = std::max(plan.device, 0);
      for (const auto& o : outs)
        if (o.defined()) { dev = o.device().index(); break; }
      at::Generator gen = g.has_value() && g->defined() ? *g : default_generator(dev);
      TORCH_CHECK(gen.device().type() == kTpu, "Expected a 'tpu' device type for generator but found '",
                  gen.device().str(), "'");
      auto* impl = gen.get<TpuGenerator>();
      std::lock_guard<std::mutex> lock(gen.mutex());
      auto [seed, offset] = impl->next(static_cast<uint64_t>(rng_numel + 1));
      ap.kind = Arg::Kind::Tensor;
      ap.host_index.push_back(static_cast<int>(plan.host.size()));
      pl.host_rng(seed, offset);
    } else if (v.isNone()) {
      ap.kind = Arg::Kind::None;
      plan.key += "N;";
    } else if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        ap.kind = Arg::Kind::None;
        plan.key += "N;";
      } else if (t.device().type() == kTpu) {
        ap.kind = Arg::Kind::Tensor;
        ap.refs.push_back(pl.ref(t));
      } else if (is_host_scalar_tensor(t)) {
        ap.kind = Arg::Kind::Tensor;
        ap.host_index.push_back(static_cast<int>(plan.host.size()));
        pl.host_tensor(t);
      } else {
        int dev = plan.device >= 0 ? plan.device : 0;
        TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
                    "devices, tpu:", dev, " and ", t.device().str(), "!");
      }
    } else if (v.isTensorList() || (v.isList() && !v.isIntList() && !v.isDoubleList() && !is_bool_list(v))) {
      ap.kind = v.isTensorList() ? Arg::Kind::TensorList : Arg::Kind::OptTensorList;
      plan.key += "L[";
      auto add_one = [&](const at::Tensor& t) {
        if (!t.defined()) {
          ap.refs.push_back(std::nullopt);
          ap.list_host.push_back(std::nullopt);
          plan.key += "N;";
        } else if (t.device().type() == kTpu) {
          ap.refs.push_back(pl.ref(t));
          ap.list_host.push_back(std::nullopt);
        } else if (is_host_scalar_tensor(t)) {
          ap.refs.push_back(std::nullopt);
          ap.list_host.push_back(static_cast<int>(plan.host.size()));
          pl.host_tensor(t);
        } else {
          TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least "
                      "two devices, tpu:", std::max(plan.device, 0), " and ", t.device().str(), "!");
        }
      };
      if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) add_one(t);
      } else {
        for (const c10::IValue& e : v.toListRef()) add_one(e.isTensor() ? e.toTensor() : at::Tensor());
      }
      plan.key += "];";
    } else if (a.hint == NamedArg::Hint::Scalar || v.isScalar() && a.hint == NamedArg::Hint::Scalar) {
      ap.kind = Arg::Kind::Scalar;
      ap.host_index.push_back(static_cast<int>(plan.host.size()));
      pl.host_scalar(v.toScalar());
    } else if (a.hint == NamedArg::Hint::DType) {
      ap.kind = Arg::Kind::DType;
      plan.key += "D" + std::to_string(v.toInt()) + ";";
    } else if (v.isBool()) {
      ap.kind = Arg::Kind::Bool;
      plan.key += v.toBool() ? "b1;" : "b0;";
    } else if (v.isInt() || v.isSymInt()) {
      ap.kind = Arg::Kind::Int;
      plan.key += "i" + std::to_string(v.isInt() ? v.toInt() : v.toSymInt().expect_int()) + ";";
    } else if (v.isDouble()) {
      ap.kind = Arg::Kind::Double;
      plan.key += "d" + std::to_string(v.toDouble()) + ";";
    } else if (v.isIntList() || v.isSymIntList() || is_bool_list(v)) {
      ap.kind = Arg::Kind::IntList;
      plan.key += "l";
      for (int64_t x : int_list(v))
        plan.key += std::to_string(x) + ",";
      plan.key += ";";
    } else if (v.isString()) {
      ap.kind = Arg::Kind::String;
      plan.key += "s" + v.toStringRef() + ";";
    } else if (v.isDevice()) {
      ap.kind = Arg::Kind::None;
    } else {
      throw lowering::Unsupported("argument '" + a.name + "' of type " + v.tagKind() +
                                  " is not supported by the tpu lowering");
    }
    aps.push_back(std::move(ap));
  }

  // Outputs: written slots; a partial write must read the old storage first.
  std::vector<TensorRef> out_refs;
  plan.key += "->";
  for (const auto& o : outs) {
    if (!o.defined()) {  // an output the caller did not ask for
      out_refs.push_back(TensorRef{-1});
      plan.key += "U;";
      continue;
    }
    TensorRef r = pl.ref(o);
    Slot& s = plan.slots[r.slot];
    s.written = true;
    if (!r.view.covers(s.numel)) s.read = true;
    out_refs.push_back(r);
  }
  plan.key += "|c";
  plan.key += std::to_string(static_cast<int>(common));
  if (plan.device < 0) plan.device = 0;
  // Input slots are read.
  for (const auto& ap : aps)
    for (const auto& r : ap.refs)
      if (r) plan.slots[r->slot].read = true;
  int nargs = 0;
  for (auto& s : plan.slots) {
    if (s.read) s.arg = nargs++;
    plan.key += s.read ? 'r' : '-';
    plan.key += s.written ? 'w' : '-';
  }

  if (runtime::Context::get().mode() == runtime::EagerMode::DeferAndFuse) {
    fused_record(plan, aps, out_refs, entry, name, overload, common, outs);
    return;
  }

  // Storages read for the first time hold "uninitialized" memory: give them zeros.
  for (const auto& s : plan.slots) {
    if (s.read && !s.st->buffer) {
      std::lock_guard<std::mutex> lock(s.st->mu);
      if (!s.st->buffer) {
        std::vector<unsigned char> zeros(static_cast<size_t>(s.numel * elem_bytes(s.elem)), 0);
        auto& ctx = runtime::Context::get();
        s.st->buffer = ctx.client().from_host(zeros.data(), pjrt_of(s.elem), {s.numel}, ctx.device(s.st->device));
        s.st->elem = s.elem;
      }
    }
  }

  auto& cache = runtime::CompileCache::get();
  runtime::ProgramPtr program = cache.find_signature(plan.key);
  if (!program) {
    shlo::Builder b;
    std::vector<Value> cur(plan.slots.size());
    for (size_t i = 0; i < plan.slots.size(); ++i)
      if (plan.slots[i].read) cur[i] = b.arg(Type{plan.slots[i].elem, {plan.slots[i].numel}});
    std::vector<Value> host_vals;
    for (const auto& h : plan.host) host_vals.push_back(b.arg(Type{h.elem, h.dims}));
    emit_op(b, cur, host_vals, plan, aps, out_refs, entry, name, overload, common, outs);
    std::vector<Value> results;
    for (size_t i = 0; i < plan.slots.size(); ++i) {
      if (!plan.slots[i].written) continue;
      if (plan.slots[i].read) b.alias(plan.slots[i].arg, static_cast<int>(results.size()));
      results.push_back(cur[i]);
    }
    std::string mlir = b.module(results);
    std::string op_name = "aten::" + name + (overload.empty() ? "" : "." + overload);
    program = cache.get_or_compile_program(mlir, op_name,
                                           compile_reason(op_name, describe_call(all_args, outs), flatten));
    cache.remember_signature(plan.key, program);
  }

  // Launch.
  std::vector<pjrt::BufferPtr> keep;  // host operand buffers live until the launch is queued
  std::vector<PJRT_Buffer*> arg_bufs;
  for (const auto& s : plan.slots)
    if (s.read) arg_bufs.push_back(s.st->buffer->raw());
  for (const auto& h : plan.host) {
    keep.push_back(upload_host(h, plan.device));
    arg_bufs.push_back(keep.back()->raw());
  }
  auto results = runtime::Executor::get().launch(*program->exe, plan.device, arg_bufs, {},
                                                 "aten::" + name + "." + overload);
  size_t ri = 0;
  for (auto& s : plan.slots) {
    if (!s.written) continue;
    std::lock_guard<std::mutex> lock(s.st->mu);
    s.st->buffer = results[ri++];
    s.st->elem = s.elem;
  }
  dispatch_stats().ops++;
}

}  // namespace tpu::aten
