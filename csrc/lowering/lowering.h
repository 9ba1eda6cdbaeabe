// THE lowering table: ATen op (base name, e.g. "add" for add.Tensor / add_.Tensor / add.out)
// -> a function that builds the computation with the StableHLO builder. Serves strict eager,
// fused eager and torch.compile alike. Lowerings know nothing about PJRT or storages: inputs
// arrive as logical values (already read through their views), outputs are returned as values
// and written back by the caller. Output shapes/dtypes come from PyTorch's meta functions
// (OpCall::outs); a lowering only builds the math.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../stablehlo/builder.h"

namespace tpu::lowering {

using shlo::Builder;
using shlo::Cmp;
using shlo::ElemType;
using shlo::Shape;
using shlo::Type;
using shlo::Value;

// One schema argument, already converted from an IValue.
struct Arg {
  enum class Kind { None, Tensor, TensorList, OptTensorList, Scalar, Int, IntList, Double, Bool, String, DType };
  Kind kind = Kind::None;
  Value tensor;                              // Tensor
  std::vector<std::optional<Value>> tensors; // TensorList / OptTensorList (nullopt = None entry)
  Value scalar;     // Scalar: a 0-d f64/i64/i1/c128 runtime operand (a constant for -1, 0, 1, 2, ...)
  std::optional<double> scalar_value;  // Scalar: its value when `scalar` is a program constant
  int64_t i = 0;    // Int, also MemoryFormat/Layout enums
  std::vector<int64_t> ints;  // IntList / SymIntList
  double d = 0;     // Double (a plain `float` schema argument, part of the cache key)
  bool b = false;   // Bool
  std::string s;    // String (e.g. rounding_mode, approximate, reduce)
  ElemType dtype = ElemType::F32;  // DType (ScalarType argument)
  bool is_none() const { return kind == Kind::None; }
};

// Raised by a lowering that cannot handle this particular call (the op then runs on the CPU
// fallback, counted and warned like any missing op).
struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct OpCall {
  std::string name;      // base name: "add", "sum", "native_layer_norm"
  std::string overload;  // "Tensor", "dim_IntList", "out", ...
  std::vector<std::pair<std::string, Arg>> args;  // schema order, names as in the schema
  std::vector<Type> outs;  // logical type of each returned tensor (from PyTorch's meta)
  ElemType common = ElemType::F32;  // PyTorch's result_type over tensor + scalar args

  const Arg* find(const std::string& n) const {
    for (const auto& [k, v] : args)
      if (k == n) return &v;
    return nullptr;
  }
  bool has(const std::string& n) const {
    const Arg* a = find(n);
    return a && !a->is_none();
  }
  const Arg& arg(const std::string& n) const {
    const Arg* a = find(n);
    if (!a) throw Unsupported(name + ": no argument named '" + n + "'");
    return *a;
  }
  Value tensor(const std::string& n) const { return arg(n).tensor; }
  int64_t int_(const std::string& n, int64_t dflt = 0) const { return has(n) ? arg(n).i : dflt; }
  bool bool_(const std::string& n, bool dflt = false) const { return has(n) ? arg(n).b : dflt; }
  double double_(const std::string& n, double dflt = 0) const { return has(n) ? arg(n).d : dflt; }
  std::string str(const std::string& n, std::string dflt = "") const { return has(n) ? arg(n).s : dflt; }
  const std::vector<int64_t>& ints(const std::string& n) const { return arg(n).ints; }
  // The i-th positional argument (after skipping none), for ops whose names vary by overload.
  const Arg& pos(size_t i) const { return args.at(i).second; }
};

using LowerFn = std::vector<Value> (*)(Builder&, const OpCall&);

// "Argument `arg` is written iff argument `when` is set (a true bool or a defined tensor)",
// overriding the schema's alias annotation in either direction.
struct WriteRule {
  const char* arg;
  const char* when;
};

// "A call draws no random numbers when argument `arg` has the constant value `value`", as
// PyTorch's CPU kernel then leaves the generator alone (attention with dropout_p == 0,
// native_dropout with train == False).
struct NoDrawRule {
  const char* arg;
  double value;
};

// One lowering and the properties of its op that the generic dispatch path honours (declared
// here, next to the lowering, instead of name checks in the kernel).
struct OpEntry {
  LowerFn fn = nullptr;
  // Pointwise over same-shaped inputs (the overlap rule below applies to these). Programs keep
  // their operands' logical shapes: storages hold their dims (runtime/storage.h).
  bool elementwise = false;
  // CPU's kernel lets the written tensor overlap itself or its inputs: its TensorIterator skips
  // the memory-overlap check (fill_, zero_, threshold_), or the kernel checks in its own way
  // (copy_, aten/ops_runtime.cc). Other pointwise ops raise CPU's overlap error when planned
  // (aten/plan_call.cc).
  bool writes_may_overlap = false;
  // Consumes random numbers: the runtime passes the device generator's Philox state as the
  // Tensor argument "generator" (u64[2] = seed, offset) even when the schema has none, and
  // advances it by one 128-bit block per element of the largest output or tensor input.
  // Which calls draw nothing: see rng_counters().
  bool random = false;
  std::vector<NoDrawRule> draws_nothing_when;
  // A view or copy op that eager handles as metadata (or through a composite); lowered only
  // for whole-graph programs (torch.compile), where every value is a logical array.
  bool graph_only = false;
  // A `_foreach_*` list op: one program per call; ScalarList arguments become runtime operands;
  // a call the lowered path cannot take runs PyTorch's per-tensor composite (not the CPU).
  bool foreach = false;
  // Which mutable arguments are written (their values become extra program outputs after the
  // returns, in argument order), where the schema's annotation is not the whole story.
  std::vector<WriteRule> writes;
  // Overloads with out= arguments write only those (the autogenerated .out composites of
  // in-place list ops leave the other declared-mutable states as they are).
  bool out_overload_writes_only_out = false;
  // Float arguments passed as runtime operands (like Scalars) so new values never recompile
  // (e.g. a scheduled learning rate).
  std::vector<const char*> runtime_scalars;
  // Boolean/byte tensors in the argument "indices" become integer indices on the host first
  // (one counted sync), then the integer-index lowering runs on the device.
  bool host_bool_indices = false;
  // Raises on bad values in PyTorch's CPU kernel (out-of-range index, invalid probabilities):
  // the lowering records device-side checks with check(), and may record none for some argument
  // types (integer division by zero raises, float division does not). A call whose lowering
  // recorded a check has the error status as one more program result when device checks are on
  // (TORCH_TPU_DEVICE_CHECKS, default on); see runtime::Plan::checked.
  bool checked = false;
  // Index arguments ("index"/"indices") may be CPU tensors, as CUDA accepts: the boxed kernel
  // moves them to the op's tpu device once per call (CPU bool masks of `index` stay on the host).
  bool cpu_index_args = false;
  // Handles complex<f32>/<f64> values (torch.complex64/128). Any other op given a complex tensor
  // or a complex result type is refused when planned (Unsupported: the CPU fallback runs it), so
  // a lowering written for real numbers never sees complex values.
  bool complex = false;
};

void register_op(const std::string& name, OpEntry entry);
const OpEntry* find_op(const std::string& name);
std::vector<std::string> registered_ops();

// Ops whose output shape depends on the data (nonzero, unique, ...) have no lowering: they read
// their inputs back once (a counted host sync, not a fallback) and compute on the host.
void register_host_sync_op(const std::string& name);
bool is_host_sync_op(const std::string& name);

// "Which ops draw random numbers, how many": the one rule eager planning (aten/plan_call.cc)
// and compiled graphs (torch_tpu._C._rng_counters, asked by _internal/compile.py) both follow.
// Philox counters a call of `entry` consumes: 0 when it draws nothing (not random, or a
// NoDrawRule holds), else one 128-bit block per element of its largest output or tensor input
// (`largest_numel`), plus one. `constant(name)` is the value of a constant numeric or bool
// argument (nullopt when absent, None or computed).
using ConstantArg = std::function<std::optional<double>(const std::string& name)>;
int64_t rng_counters(const OpEntry& entry, const ConstantArg& constant, int64_t largest_numel);

struct Registrar {
  Registrar(const char* name, LowerFn fn, OpEntry entry) {
    entry.fn = fn;
    register_op(name, std::move(entry));
  }
};
struct HostSyncRegistrar {
  explicit HostSyncRegistrar(const char* name) { register_host_sync_op(name); }
};

// TPU_LOWER(name) { ... return {...}; }  registers a lowering for ATen base name `name`;
// TPU_LOWER_WITH(name, .field = value, ...) also declares OpEntry properties.
#define TPU_LOWERING_CAT2(a, b) a##b
#define TPU_LOWERING_CAT(a, b) TPU_LOWERING_CAT2(a, b)
#define TPU_LOWER_WITH(opname, ...)                                                           \
  static std::vector<::tpu::lowering::Value> TPU_LOWERING_CAT(lower_, opname)(             \
      ::tpu::lowering::Builder&, const ::tpu::lowering::OpCall&);                            \
  static ::tpu::lowering::Registrar TPU_LOWERING_CAT(reg_, opname)(                         \
      #opname, &TPU_LOWERING_CAT(lower_, opname), ::tpu::lowering::OpEntry{__VA_ARGS__});   \
  static std::vector<::tpu::lowering::Value> TPU_LOWERING_CAT(lower_, opname)(             \
      [[maybe_unused]] ::tpu::lowering::Builder & b,                                         \
      [[maybe_unused]] const ::tpu::lowering::OpCall& c)
#define TPU_LOWER(opname) TPU_LOWER_WITH(opname)
#define TPU_LOWER_ELEMENTWISE(opname) TPU_LOWER_WITH(opname, .elementwise = true)
#define TPU_LOWER_COMPLEX(opname) TPU_LOWER_WITH(opname, .complex = true)
#define TPU_LOWER_ELEMENTWISE_COMPLEX(opname) TPU_LOWER_WITH(opname, .elementwise = true, .complex = true)
#define TPU_LOWER_RANDOM(opname) TPU_LOWER_WITH(opname, .elementwise = true, .random = true)  // pointwise over the output
#define TPU_LOWER_GRAPH(opname) TPU_LOWER_WITH(opname, .graph_only = true)
#define TPU_LOWER_GRAPH_COMPLEX(opname) TPU_LOWER_WITH(opname, .graph_only = true, .complex = true)
#define TPU_HOST_SYNC(opname) \
  static ::tpu::lowering::HostSyncRegistrar TPU_LOWERING_CAT(host_sync_, opname)(#opname)
#define TPU_LOWER_CHECKED(opname) TPU_LOWER_WITH(opname, .checked = true)
// Indexing ops: device-side range checks + CPU index tensors accepted like CUDA.
#define TPU_LOWER_INDEXING(opname) TPU_LOWER_WITH(opname, .checked = true, .cpu_index_args = true)

// ---- device-side checks
// The Python exception PyTorch's CPU kernel raises for the bad value.
enum class CheckKind : int32_t { Index = 1, Runtime = 2 };
// Records "any element of `bad` is true -> raise `kind`(msg)" (no-op unless b.checking()). The
// flag's code is a hash of (kind, msg), so cached programs need no side table.
void check(Builder& b, Value bad, CheckKind kind, const std::string& msg);
// The (kind, message) of a code recorded by check() in this process.
std::optional<std::pair<CheckKind, std::string>> check_message(int32_t code);

// ---- helpers shared by lowering files (registry.cc)
// PyTorch computes float16/bfloat16 math in float32 ("opmath"); everything else in its own type.
ElemType opmath(ElemType t);
// Converts and broadcasts `v` to `t`'s element type and shape.
Value cast_to(Builder& b, Value v, ElemType t, const Shape& shape);
// The output logical type i of the call.
inline const Type& out_type(const OpCall& c, size_t i = 0) { return c.outs.at(i); }
// Normalizes a possibly negative dim against rank.
int64_t norm_dim(int64_t d, int64_t rank);
// Reduction dims from an optional IntList argument (none/empty = all dims).
std::vector<int64_t> reduce_dims(const OpCall& c, const std::string& arg, int64_t rank);
// Scalar or tensor argument as a value of element type t broadcast to shape.
Value operand(Builder& b, const Arg& a, ElemType t, const Shape& shape);

}  // namespace tpu::lowering
