// torch.cholesky (deprecated) on tpu, composed as PyTorch's CPU kernel is: the lowered
// linalg_cholesky_ex (csrc/lowering/cholesky_qr.cc) and _linalg_check_errors, which reads info
// back (one host sync) and raises CPU's LinAlgError ("cholesky: ... the leading minor of order k
// is not positive-definite"). A lowering alone could not raise that error with its order in the
// message. Autograd stays cholesky's own formula (this kernel runs below it).
// Also geqrf's meta function, which PyTorch lacks (below).
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include <ATen/ops/_linalg_check_errors.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/linalg_cholesky_ex.h>

namespace tpu::aten {
namespace {

bool lapack_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kComplexFloat || t == at::kComplexDouble;
}

at::Tensor cholesky_kernel(const at::Tensor& self, bool upper) {
  TORCH_WARN_ONCE(
      "torch.cholesky is deprecated in favor of torch.linalg.cholesky and will be ",
      "removed in a future PyTorch release.\n",
      "L = torch.cholesky(A)\n",
      "should be replaced with\n",
      "L = torch.linalg.cholesky(A)\n",
      "and\n"
      "U = torch.cholesky(A, upper=True)\n",
      "should be replaced with\n",
      "U = torch.linalg.cholesky(A).mH\n"
      "This transform will produce equivalent results for all valid (symmetric positive definite) inputs.");
  // CPU's order of checks: empty input first, then shape, then dtype.
  if (self.numel() == 0) return at::empty_like(self, at::MemoryFormat::Contiguous);
  TORCH_CHECK(self.dim() >= 2, "cholesky: The input tensor A must have at least 2 dimensions.");
  TORCH_CHECK(self.size(-1) == self.size(-2), "cholesky: A must be batches of square matrices, but they are ",
              self.size(-2), " by ", self.size(-1), " matrices");
  TORCH_CHECK_NOT_IMPLEMENTED(lapack_dtype(self.scalar_type()), "\"cholesky_cpu\" not implemented for '",
                              c10::toString(self.scalar_type()), "'");
  auto [L, info] = at::linalg_cholesky_ex(self, upper, /*check_errors=*/false);
  at::_linalg_check_errors(info, "cholesky", self.dim() == 2);
  return L;
}

// geqrf has no meta function in PyTorch, so the generic tpu kernel could not size its outputs and
// fell back to the CPU. CPU's checks and layout: `a` batched column-major, tau [..., min(m, n)].
std::tuple<at::Tensor, at::Tensor> geqrf_meta(const at::Tensor& self) {
  TORCH_CHECK(self.dim() >= 2, "torch.geqrf: input must have at least 2 dimensions.");
  TORCH_CHECK_NOT_IMPLEMENTED(lapack_dtype(self.scalar_type()), "\"geqrf_cpu\" not implemented for '",
                              c10::toString(self.scalar_type()), "'");
  const int64_t m = self.size(-2), n = self.size(-1);
  std::vector<int64_t> strides(self.dim());
  strides[self.dim() - 2] = 1;
  strides[self.dim() - 1] = std::max<int64_t>(m, 1);
  int64_t step = std::max<int64_t>(m * n, 1);
  for (int64_t i = self.dim() - 3; i >= 0; --i) {
    strides[i] = step;
    step *= std::max<int64_t>(self.size(i), 1);
  }
  std::vector<int64_t> tau_shape(self.sizes().begin(), self.sizes().end() - 2);
  tau_shape.push_back(std::min(m, n));
  return {at::empty_strided(self.sizes(), strides, self.options()), at::empty(tau_shape, self.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) { m.impl("cholesky", &cholesky_kernel); }
TORCH_LIBRARY_IMPL(aten, Meta, m) { m.impl("geqrf", &geqrf_meta); }

}  // namespace tpu::aten
