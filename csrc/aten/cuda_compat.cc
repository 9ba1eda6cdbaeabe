// CUDA-compatible indexing arguments and `param.data = t` between cpu and tpu.
#include "cuda_compat.h"

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

#include <optional>

#include "common.h"
#include "lowering/lowering.h"

namespace tpu::aten {

namespace {

bool is_index_arg(const std::string& name) { return name == "index" || name == "indices"; }

std::optional<c10::Device> tpu_device_of(const torch::jit::Stack& args) {
  for (const c10::IValue& v : args)
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kTpu) return v.toTensor().device();
  return std::nullopt;
}

bool is_mask(const at::Tensor& t) { return t.scalar_type() == at::kBool || t.scalar_type() == at::kByte; }

// A CPU index tensor to move. Bool masks stay on the host for ops that turn them into integer
// indices there anyway (OpEntry::host_bool_indices: moving them would add a round trip).
bool is_cpu_index(bool host_masks, const c10::IValue& e) {
  if (!e.isTensor() || !e.toTensor().defined() || !e.toTensor().device().is_cpu()) return false;
  return !(host_masks && is_mask(e.toTensor()));
}

}  // namespace

void move_cpu_index_args(const c10::OperatorHandle& op, const std::string& base, torch::jit::Stack* stack) {
  const auto& sargs = op.schema().arguments();
  const size_t first = stack->size() - sargs.size();
  std::optional<c10::Device> dev;
  auto target = [&]() -> c10::Device {
    if (!dev) dev = tpu_device_of(torch::jit::Stack(stack->begin() + first, stack->end()));
    return dev.value_or(c10::Device(kTpu, 0));
  };
  for (size_t j = 0; j < sargs.size(); ++j) {
    if (!is_index_arg(sargs[j].name())) continue;
    c10::IValue& v = (*stack)[first + j];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.defined() && t.device().is_cpu()) v = t.to(target());
    } else if (v.isList()) {
      const lowering::OpEntry* entry = lowering::find_op(base);
      const bool host_masks = entry && entry->host_bool_indices;
      bool any = false;
      for (const c10::IValue& e : v.toListRef())
        any |= is_cpu_index(host_masks, e);
      if (!any) continue;
      c10::List<std::optional<at::Tensor>> moved;
      for (const c10::IValue& e : v.toListRef()) {
        if (!e.isTensor() || !e.toTensor().defined()) {
          moved.push_back(std::nullopt);
          continue;
        }
        moved.push_back(is_cpu_index(host_masks, e) ? e.toTensor().to(target()) : e.toTensor());
      }
      v = moved;
    }
  }
}

namespace {

// PyTorch lets `param.data = t` / `Tensor.set_data` swap the TensorImpl's storage only between
// dense tensors of backends it lists (CPU, CUDA, ...); PrivateUse1 backends opt in here, as
// CUDA is in for cuda<->cpu. nn.Module.to then moves parameters in place (identity and tying kept).
bool dense_cpu_or_tpu(const at::Tensor& t) {
  const c10::DispatchKeySet ks = t.key_set();
  return t.layout() == c10::kStrided && ks.has(c10::DispatchKey::Dense) &&
         (t.device().is_cpu() || t.device().type() == kTpu);
}

bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  if (self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set())) return true;
  return dense_cpu_or_tpu(self) && dense_cpu_or_tpu(from);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", &has_compatible_shallow_copy_type);
}

}  // namespace tpu::aten
