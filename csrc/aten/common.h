// Small helpers shared by the ATen-facing files: dtype mapping and storage access.
#pragma once
#include <ATen/core/Tensor.h>
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

}  // namespace tpu::aten
