// tpu_dist::premul_factor: the factor of a PREMUL_SUM ReduceOp. The c10d ops hand our (Python)
// collective kernels a ReduceOp script object that only exposes op(); its factor lives in a
// C++ supplement that nothing else can read.
#include <ATen/ops/scalar_tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/library.h>

namespace {

at::Tensor premul_factor(const c10::intrusive_ptr<c10d::ReduceOp>& op) {
  TORCH_CHECK(op->op_ == c10d::ReduceOp::PREMUL_SUM && op->supplement_,
              "tpu_dist::premul_factor: the reduce op is not a PREMUL_SUM");
  // static_cast: PREMUL_SUM always carries this supplement (typeinfo is not exported).
  auto* sup = static_cast<c10d::PreMulSumSupplement*>(op->supplement_.get());
  TORCH_CHECK(sup != nullptr, "tpu_dist::premul_factor: PREMUL_SUM without a factor");
  if (sup->tensor_factor.defined()) return sup->tensor_factor;
  return at::scalar_tensor(sup->double_factor, at::TensorOptions().dtype(at::kDouble));
}

}  // namespace

TORCH_LIBRARY(tpu_dist, m) {
  m.def("premul_factor(__torch__.torch.classes.c10d.ReduceOp op) -> Tensor", &premul_factor);
}
