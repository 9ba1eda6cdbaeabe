// `torch_tpu::jax_call(Tensor[] args, str kernel) -> Tensor[]`: runs a registered foreign
// (JAX-exported) StableHLO module on tpu tensors. The tpu kernel is the generic boxed kernel
// (lowering `jax_call`, csrc/lowering/jax_call.cc), so strict eager, fused eager and compiled
// graphs all splice the module into their program; the Meta kernel answers output metadata
// from the registered result types. `jax_call_out(args, kernel, out)` writes the results into
// given tensors instead (donation: a donated input is one of them, so its buffer is aliased);
// `_move_buffer` then hands that buffer to a fresh tensor, `_release_buffer` drops one.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <ATen/ops/empty.h>

#include <mutex>
#include <tuple>
#include <vector>

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

// Donation: `dst` (a fresh tensor of the same size) takes over `src`'s device buffer, which the
// kernel just wrote in place; `src` is left without one, as a donated jax.Array is deleted.
void move_buffer(const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(src.device() == dst.device() && src.device().type() == kTpu,
              "_move_buffer: both tensors must be on one tpu device");
  runtime::StorageState& s = state_of(src);
  runtime::StorageState& d = state_of(dst);
  TORCH_CHECK(&s != &d && s.nbytes == d.nbytes, "_move_buffer: needs two storages of the same size");
  fused_flush();
  std::scoped_lock lock(s.mu, d.mu);
  d.hold(std::move(s.buffer), s.elem, s.dims);
  s.buffer.reset();
}

// Tests: the dims of the tensor's storage buffer (runtime/storage.h), as PJRT reports them,
// after checking that they are the dims the storage records; (False, []) without a buffer.
std::tuple<bool, std::vector<int64_t>> storage_dims(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == kTpu, "_storage_dims: expected a tpu tensor, got ", t.device());
  fused_flush();  // the storage's pending value becomes its buffer
  runtime::StorageState& st = state_of(t);
  std::lock_guard<std::mutex> lock(st.mu);
  if (!st.buffer) return {false, {}};
  st.check_dims();
  return {true, st.buffer->dims()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_tpu, m) {
  m.def("jax_call(Tensor[] args, str kernel) -> Tensor[]");
  m.def("jax_call_out(Tensor[] args, str kernel, Tensor(a!)[] out) -> ()");
  m.def("_release_buffer(Tensor(a!) t) -> ()");
  m.def("_move_buffer(Tensor(a!) src, Tensor(b!) dst) -> ()");
  m.def("_storage_dims(Tensor t) -> (bool, int[])");
}

TORCH_LIBRARY_IMPL(torch_tpu, Meta, m) {
  m.impl("jax_call", jax_call_meta);
}

TORCH_LIBRARY_IMPL(torch_tpu, PrivateUse1, m) {
  m.impl("_release_buffer", release_buffer);
  m.impl("_move_buffer", move_buffer);
  m.impl("_storage_dims", storage_dims);
}

}  // namespace tpu::aten
