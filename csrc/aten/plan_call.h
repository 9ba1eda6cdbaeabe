// Step "plan" of the eager pipeline (runtime/plan.h) for ATen calls: named ATen arguments +
// output tensors -> a runtime::Plan, run by the executor of the current eager mode. Eager
// dispatch, copies and factories all go through run_lowering.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <memory>
#include <string>
#include <vector>

#include "lowering/lowering.h"
#include "runtime/executor.h"
#include "runtime/storage.h"

namespace tpu::aten {

struct NamedArg {
  // How to read `value` (an int IValue can be a Scalar, an int, a dtype or a layout).
  enum class Hint { Auto, Scalar, DType, Generator, Ignore };
  std::string name;
  c10::IValue value;
  Hint hint = Hint::Auto;
};

// Where a slot's storage or a host operand's value came from in a boxed call: argument `arg`
// (element `elem` of a list argument), or output `arg` when `out`. `rng`: the generator state,
// drawn per call from the Generator argument `arg` (-1: the device's default generator).
struct CallSource {
  int16_t arg = -1;
  int16_t elem = -1;
  bool out = false;
  bool rng = false;
};

// What run_lowering planned and launched, for the dispatch cache (aten/dispatch_cache.h).
struct PlannedCall {
  std::shared_ptr<const runtime::Plan> plan;
  runtime::ProgramPtr program;  // strict eager: the program launched
  std::vector<CallSource> slot_src, host_src;
  int device = 0;
  int64_t rng_counters = 0;  // Philox counters drawn per call (the signature fixes the count)
  int rng_device = 0;        // whose default generator a call without a Generator draws from
  bool cacheable = true;     // false: the plan depends on more than the call's signature
};

// Runs lowering `name` writing its results into `outs` (tpu tensors, any views). `common` is
// PyTorch's result type for the call. Throws lowering::Unsupported when the lowering refuses.
// `record`, when given, receives the plan and where its slots and host operands came from.
void run_lowering(const std::string& name, const std::string& overload,
                  const lowering::OpEntry& entry, const std::vector<NamedArg>& args,
                  const std::vector<at::Tensor>& outs, c10::ScalarType common,
                  PlannedCall* record = nullptr);

// Launches (or records, in fused eager) a bound plan; device-check failures of debug eager
// become PyTorch's exception types.
void execute_call(const runtime::Call& call, runtime::ProgramPtr* program, const runtime::MissReason& why);

// The generator state operand (u64[2] = seed, offset) of a random op: `counters` Philox
// counters drawn from `gen` (a tpu generator), or from device `device`'s default generator.
runtime::HostOperand draw_rng_state(const std::optional<at::Generator>& gen, int device, int64_t counters);

// A Python scalar the plan bakes in as a constant (ArgPlan::scalar_const): its index in a small
// table (-2, -1, -0.5, 0, 0.5, 1, 2, 3; integral scalars -2..3 only), and the value at an index.
std::optional<int> const_scalar_index(const c10::Scalar& sc);
double const_scalar_value(int index);
// The same for a Python scalar passed to a Tensor overload (`x + 1` calls add.Tensor with a
// wrapped-number 0-d CPU tensor): nullopt for any other tensor, whose value stays an operand.
std::optional<int> const_scalar_index(const at::Tensor& t);

// Host operand values: a Python scalar (complex: a complex128 operand) or a 0-d CPU tensor.
runtime::HostOperand host_operand(const c10::Scalar& sc);
runtime::HostOperand host_operand(const at::Tensor& t);

// ATen's TensorIterator overlap checks for a written tensor (as the CPU kernels run them):
// raises when `written` has elements sharing memory, or partially overlaps one of `inputs`.
void check_write_overlap(const at::Tensor& written, const at::Tensor* inputs, size_t n);

// Makes sure the storage has a device buffer (zeros when never written) and returns it.
void materialize(const at::Tensor& t);

using runtime::fused_flush;
using runtime::fused_forget;

// Copies between any pair of devices/dtypes/strides (the `copy_` semantics).
void copy_into(const at::Tensor& dst, const at::Tensor& src);
// A failed device-side check (runtime/device_checks.h; kind 1 = index) as the exception type of
// PyTorch's CPU kernel: c10::IndexError or c10::Error.
[[noreturn]] void throw_device_check(int kind, const char* msg);

using runtime::dispatch_stats;
using runtime::DispatchStats;

}  // namespace tpu::aten
