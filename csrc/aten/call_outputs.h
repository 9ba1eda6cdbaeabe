// The outputs of a boxed call: their metadata from PyTorch's meta function (cached by call
// signature), their allocation (or the aliased argument, resized), and the arguments an op
// writes without returning them (extra program outputs).
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/MaybeOwned.h>
#include <c10/util/SmallVector.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lowering/lowering.h"

namespace tpu::aten {

struct MetaOut {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
  std::optional<int64_t> int_value;  // an int/SymInt return (e.g. SDPA's max_q), from meta
};
struct MetaResult {
  std::vector<MetaOut> outs;
};

// Why a schema's returns cannot take the lowered path, or nullptr.
const char* unsupported_returns(const std::vector<c10::Argument>& rets, bool bool_result, bool list_result);

// Output metadata (cached); null with `why` when the op has no usable meta function.
std::shared_ptr<const MetaResult> output_meta(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                                              bool bool_result, bool list_result, std::string* why);

// A call's output tensors: fresh ones owned, arguments (in-place/out= results, written
// arguments) borrowed from `args`, valid while `args` is. Borrowing matters: in PyTorch 2.13 a
// copy of a tensor only Python holds takes the GIL (TensorImpl::incref_pyobject), and so does
// dropping that copy.
using CallOutputs = c10::SmallVector<c10::MaybeOwned<at::Tensor>, 4>;

// Fills `outs` with the call's output tensors (the caller holds the device guard).
void allocate_outputs(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args, const MetaResult& meta,
                      bool list_result, int device, CallOutputs& outs);

// Appends the arguments the call writes but does not return to `outs`.
void append_mutated_args(const lowering::OpEntry& entry, const c10::FunctionSchema& schema,
                         c10::ArrayRef<c10::IValue> args, CallOutputs& outs);

// Owning copies of `outs` (for code that keeps them beyond the arguments).
std::vector<at::Tensor> owned_outputs(const CallOutputs& outs);

}  // namespace tpu::aten
