// `torch_tpu::jax_call(Tensor[] args, str kernel) -> Tensor[]`: runs a registered foreign
// (JAX-exported) StableHLO module on tpu tensors. The tpu kernel is the generic boxed kernel
// (lowering `jax_call`, csrc/lowering/jax_call.cc), so strict eager, fused eager and compiled
// graphs all splice the module into their program; the Meta kernel answers output metadata
// from the registered result types.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <ATen/ops/empty.h>

#include <mutex>

#include "common.h"
#include "plan_call.h"
#include "lowering/jax_call.h"

namespace tpu::aten {
namespace {

std::vector<at::Tensor> jax_call_meta(at::TensorList args, c10::string_view kernel) {
  lowering::ForeignModule m = lowering::foreign_module(std::string(kernel));
  std::vector<at::Tensor> outs;
  for (const shlo::Type& t : m.out_types)
    outs.push_back(at::empty(t.shape, at::TensorOptions().device(c10::kMeta).dtype(scalar_of(t.elem))));
  return outs;
}

// Donation: the tensor's storage gives up its device buffer (PJRT keeps it alive until queued
// programs that read it finish); later reads see a fresh zero buffer.
void release_buffer(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == kTpu, "_release_buffer: expected a tpu tensor, got ", t.device());
  fused_flush();
  runtime::StorageState& st = state_of(t);
  std::lock_guard<std::mutex> lock(st.mu);
  st.buffer.reset();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_tpu, m) {
  m.def("jax_call(Tensor[] args, str kernel) -> Tensor[]");
  m.def("_release_buffer(Tensor(a!) t) -> ()");
}

TORCH_LIBRARY_IMPL(torch_tpu, Meta, m) {
  m.impl("jax_call", jax_call_meta);
}

TORCH_LIBRARY_IMPL(torch_tpu, PrivateUse1, m) {
  m.impl("_release_buffer", release_buffer);
}

}  // namespace tpu::aten
