// The eager pipeline as plain values: plan -> key -> build -> launch.
//
//   plan    (aten/plan_call.cc)  an ATen call becomes a Plan: the storages it reads and writes,
//                                the host operands it passes (Python scalars, 0-d CPU tensors,
//                                RNG state), how each lowering argument is fed, and its key;
//   key     Plan::key            the signature: equal keys mean the same program text;
//   build   build_program()      only on a key miss: prologue reads of the input views, the
//                                lowering, epilogue writes into the output storages;
//   launch  runtime/executor.h   strict and debug eager launch one program per op, fused eager
//                                records the op into one pending program instead.
// A Plan is the structure of a call (equal keys, equal plans), shared by every call with the same
// signature; a Call binds one plan to this call's storages and host operand values, so the
// aten/dispatch_cache.h fast path launches a remembered plan without planning again.
// Nothing here knows ATen: plans hold views and lowering arguments, calls hold storages.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/SmallVector.h>

#include "lowering/lowering.h"
#include "runtime/storage.h"
#include "runtime/view_io.h"

namespace tpu::runtime {

inline int64_t elem_bytes(shlo::ElemType t) {
  return t == shlo::ElemType::Pred ? 1 : shlo::bit_width(t) / 8;
}

// One storage the op touches (Call::st says which); `arg` is its program-argument index when read.
struct Slot {
  bool read = false;
  bool written = false;
  bool whole_write = false;  // some output writes every element: the storage takes its shape
  int64_t numel = 0;
  shlo::ElemType elem = shlo::ElemType::U8;
  int arg = -1;
  shlo::Shape dims;      // the storage's dims when planned (its parameter's shape when read)
  shlo::Shape out_dims;  // its dims after the op (when written; runtime/storage.h)
};

// A value the host passes to the program each launch: part of the arguments, never of the text.
// Plans hold the operand's type, calls its value.
struct HostOperand {
  shlo::ElemType elem;
  int64_t dim0 = -1;  // -1: a 0-d value; else a 1-D value of dim0 elements (RNG state: u64[2])
  alignas(8) unsigned char bytes[16];
  std::vector<int64_t> dims() const { return dim0 < 0 ? std::vector<int64_t>{} : std::vector<int64_t>{dim0}; }
};

// A tensor argument or output: a view of one slot.
struct TensorRef {
  int slot = -1;  // -1: an output the caller did not ask for
  ViewDesc view;
  std::vector<int64_t> logical;  // shape the lowering sees (the view's)
};

// How one lowering argument is fed: tensors from views or host operands, scalars from host
// operands, everything else a constant already converted into `value` (part of the key).
struct ArgPlan {
  std::string name;
  lowering::Arg value;  // kind, and the constant for DType/Bool/Int/Double/IntList/String
  std::vector<std::optional<TensorRef>> refs;  // Tensor / lists: device views
  std::vector<int> host_index;                 // Tensor / Scalar fed by a host operand
  std::vector<std::optional<int>> list_host;   // list entries that are host 0-d tensors
  // Scalar, or a Tensor that is a Python scalar (a wrapped number, `x + 1`): a value of a small
  // table (-1, 0, 1, 2, ..., aten const_scalar_index) is a program constant (part of the key)
  // rather than an operand, so XLA simplifies x ** 2, alpha = 1, ..., pow emits sqrt for
  // x ** 0.5, and the launch passes one argument less; F64 or S64 as the operand would be.
  std::optional<double> scalar_const;
  shlo::ElemType scalar_const_elem = shlo::ElemType::F64;
};

struct Plan {
  const lowering::OpEntry* entry = nullptr;
  std::string name, overload;  // base name and overload: the lowering's OpCall
  std::string what;            // "aten::name.overload", for logs and errors
  shlo::ElemType common = shlo::ElemType::F32;
  shlo::Precision precision = shlo::Precision::Highest;  // of its contractions (part of the key)
  std::vector<Slot> slots;
  std::vector<HostOperand> host;  // types (values are the Call's)
  std::vector<ArgPlan> args;
  std::vector<TensorRef> outs;
  std::string key;
  // The program records device-side checks (its entry is .checked and the lowering emitted a
  // check for these argument types): it takes and returns the device's error status while
  // device checks are on. Set when planning (aten/plan_call.cc).
  bool checked = false;
  // The program has a contraction, so its text follows `precision` (dispatch-cache hits compare
  // it with the current setting; other plans serve every precision). Set when planning.
  bool uses_precision = true;
  // Fused eager's short name for `key` in trace keys (0 until first recorded; set under the
  // pending-program lock, runtime/executor.cc).
  mutable uint64_t trace_key_id = 0;
};

// One call of a plan: the storage of each slot and the value of each host operand.
struct Call {
  std::shared_ptr<const Plan> plan;
  c10::SmallVector<StorageState*, 6> st;  // per plan slot
  c10::SmallVector<HostOperand, 3> host;  // per plan host operand
  int device = 0;
};

// Why a key missed (for explain()); called only on a miss, so a hit formats nothing.
using MissReason = std::function<std::string()>;

// Key fragments, appended while planning.
void key_tensor(std::string& key, const TensorRef& r, const Slot& s);
void key_dims(std::string& key, const shlo::Shape& dims);

// The dims a written slot holds after the op: the shape of its last output that covers it (in
// memory order for a permuted one, ViewDesc::permuted_whole), else the dims it had (a partial
// write keeps them). Call once the outputs are planned.
void plan_out_dims(Slot& s, const std::vector<TensorRef>& outs, int slot);

// Emits one op into `b`: reads its tensor arguments out of the storage values `cur`, runs the
// lowering, and writes the results back into `cur`. Strict builds one op per program, fused
// eager appends many ops to one program.
void emit_op(shlo::Builder& b, std::vector<shlo::Value>& cur, const std::vector<shlo::Value>& host_vals,
             const Plan& plan);

// The body of a strict launch's program: arguments = read slots then host operands, then the op.
// Returns the storage values after the op (`cur` of emit_op).
std::vector<shlo::Value> emit_strict_body(shlo::Builder& b, const Plan& plan);

// The whole program of a strict launch: emit_strict_body; results = written slots (donated when
// also read).
std::string build_program(const Plan& plan);

}  // namespace tpu::runtime
