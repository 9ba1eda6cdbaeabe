// Small helpers shared by the ATen-facing files: dtype mapping and storage access.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/native/TypeProperties.h>
#include <c10/core/ScalarType.h>

#include "pjrt/pjrt.h"
#include "runtime/storage.h"
#include "stablehlo/builder.h"

namespace tpu::aten {

constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;

shlo::ElemType elem_of(c10::ScalarType t);  // throws a clear TypeError for unsupported dtypes
bool supported_dtype(c10::ScalarType t);
c10::ScalarType scalar_of(shlo::ElemType t);
using runtime::pjrt_of;
shlo::ElemType elem_from_pjrt(pjrt::ElementType t);
runtime::StorageState& state_of(const c10::Storage& s);
// Precision of float contractions planned now: torch.tpu.precision's override when set, else
// torch.set_float32_matmul_precision ("highest" -> HIGHEST, "high" -> HIGH, "medium" -> DEFAULT).
shlo::Precision matmul_precision();
// -1: follow torch.get_float32_matmul_precision(); else a shlo::Precision value.
void set_precision_override(int p);
int precision_override();
inline runtime::StorageState& state_of(const at::Tensor& t) { return state_of(t.storage()); }

// PyTorch's result type over a call's inputs (the lowering's OpCall::common), the one
// accumulator eager dispatch (aten/dispatch.cc) and compiled graphs (aten/graph.cc) feed. The
// caller decides which arguments take part (inputs, not out= or the generator).
class ResultTypeAccumulator {
 public:
  // A defined input tensor; a wrapped Python number counts as a scalar of its kind.
  void tensor(const at::Tensor& t);
  // A graph value known by type only.
  void value(c10::ScalarType dtype, bool zero_dim);
  // A Python number: only its kind (float, int, bool) matters.
  void scalar(const c10::Scalar& sc);
  void scalar_kind(c10::ScalarType kind);  // kDouble, kLong, kBool or kComplexDouble
  // The result type; `fallback` when nothing took part or the result is no tpu dtype.
  c10::ScalarType result(c10::ScalarType fallback) const;

 private:
  at::native::ResultTypeState state_{};
  bool any_ = false;
};

}  // namespace tpu::aten
