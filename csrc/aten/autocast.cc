// Automatic mixed precision for the tpu device.
//
// 1. torch.autocast("tpu"): PyTorch registers no AutocastPrivateUse1 kernels, so without this file
//    every op under autocast fails ("Could not run ... from the 'Autocasttpu' backend"). We
//    register the same cast policy as CUDA, taken from the op lists PyTorch exports in
//    ATen/autocast_mode.h (lower_precision_fp, fp32, fp32_set_opt_dtype, fp32_append_dtype,
//    promote), plus the few ops AutocastCPU adds (cat/stack/index_copy promote,
//    cross_entropy_loss fp32). binary_cross_entropy is banned, as on CUDA. Every other op falls
//    through to the next dispatch key unchanged.
// 2. The default autocast dtype for tpu is bfloat16 (PyTorch's default for PrivateUse1 is
//    float16). PyTorch keeps it per thread: we set it for the thread that loads the extension;
//    autograd's worker threads inherit it through ThreadLocalState.
// 3. torch.amp.GradScaler("tpu"): explicit tpu kernels for _amp_foreach_non_finite_check_and_
//    unscale_ and _amp_update_scale_. Each gradient / scale update is one compiled program
//    (the in-place ops torch_tpu::amp_unscale_ / amp_update_scale_, lowered in
//    csrc/lowering/amp.cc and run by the generic boxed kernel); nothing reads back to the host.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>

namespace tpu::aten {

namespace {

// AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE spells these unqualified.
using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
using at::Tensor;

// ------------------------------------------------------------------ autocast policy
at::Tensor binary_cross_entropy_banned(const at::Tensor&, const at::Tensor&,
                                       const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast "
              "(their inputs are usually the output of a sigmoid, which saturates in low precision). "
              "Use torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, "
              "which fuse the sigmoid and are safe under autocast.");
}

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define TPU_AUTOCAST_LOWER_PRECISION(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TPU_AUTOCAST_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define TPU_AUTOCAST_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define TPU_AUTOCAST_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  // CUDA's policy.
  AT_FORALL_LOWER_PRECISION_FP(TPU_AUTOCAST_LOWER_PRECISION)
  AT_FORALL_FP32(TPU_AUTOCAST_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(TPU_AUTOCAST_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(TPU_AUTOCAST_PROMOTE)
  // AutocastCPU's additions: index_copy requires equal dtypes; cat/stack then match CPU exactly.
  KERNEL_PRIVATEUSEONE(cat, promote)
  KERNEL_PRIVATEUSEONE(stack, promote)
  KERNEL_PRIVATEUSEONE(index_copy, promote)
  KERNEL_PRIVATEUSEONE(cross_entropy_loss, fp32)
#undef TPU_AUTOCAST_LOWER_PRECISION
#undef TPU_AUTOCAST_FP32
#undef TPU_AUTOCAST_FP32_SET_OPT_DTYPE
#undef TPU_AUTOCAST_PROMOTE
  m.impl("binary_cross_entropy", TORCH_FN(binary_cross_entropy_banned));
}

// bfloat16 is the natural low-precision type of a TPU; applies to the loading thread (see top).
[[maybe_unused]] const bool default_dtype_set = [] {
  at::autocast::set_autocast_dtype(c10::DeviceType::PrivateUse1, at::kBFloat16);
  return true;
}();

// ------------------------------------------------------------------ GradScaler
TORCH_LIBRARY_FRAGMENT(torch_tpu, m) {
  m.def("amp_unscale_(Tensor(a!) grad, Tensor(b!) found_inf, Tensor inv_scale) -> (Tensor(a!), Tensor(b!))");
  m.def(
      "amp_update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor found_inf, "
      "float growth_factor, float backoff_factor, int growth_interval) -> (Tensor(a!), Tensor(b!))");
}

// Meta: both ops update their first two arguments in place, shapes and dtypes unchanged.
std::tuple<at::Tensor&, at::Tensor&> amp_unscale_meta(at::Tensor& grad, at::Tensor& found_inf,
                                                      const at::Tensor&) {
  return {grad, found_inf};
}
std::tuple<at::Tensor&, at::Tensor&> amp_update_scale_meta(at::Tensor& scale, at::Tensor& tracker,
                                                           const at::Tensor&, double, double, int64_t) {
  return {scale, tracker};
}

TORCH_LIBRARY_IMPL(torch_tpu, Meta, m) {
  m.impl("amp_unscale_", amp_unscale_meta);
  m.impl("amp_update_scale_", amp_update_scale_meta);
}

// Calls a torch_tpu:: op boxed (its tpu kernel is the generic boxed kernel); results ignored.
void call_boxed(const char* name, torch::jit::Stack stack) {
  c10::Dispatcher::singleton().findSchemaOrThrow(name, "").callBoxed(&stack);
}

void check_one_element(const at::Tensor& t, const char* what, c10::ScalarType dtype, const char* dname) {
  TORCH_CHECK(t.device().type() == c10::DeviceType::PrivateUse1, what, " must be a tpu tensor.");
  TORCH_CHECK(t.numel() == 1, what, " must be a 1-element tensor.");
  TORCH_CHECK(t.scalar_type() == dtype, what, " must be a ", dname, " tensor.");
}

void amp_foreach_non_finite_check_and_unscale(at::TensorList grads, at::Tensor& found_inf,
                                              const at::Tensor& inv_scale) {
  if (grads.empty()) return;
  check_one_element(inv_scale, "inv_scale", at::kFloat, "float");
  check_one_element(found_inf, "found_inf", at::kFloat, "float");
  TORCH_CHECK(inv_scale.device() == found_inf.device(), "inv_scale and found_inf must be on the same device.");
  c10::DeviceGuard guard(found_inf.device());
  const c10::ScalarType dtype = grads[0].scalar_type();
  for (const at::Tensor& g : grads) {
    TORCH_CHECK(g.device() == found_inf.device(), "one of scaled_grads was not on ", found_inf.device(), ".");
    TORCH_CHECK(g.layout() == at::kStrided, "one of scaled_grads was not a strided tensor.");
    TORCH_CHECK(g.scalar_type() == dtype, "scaled_grads must all have the same dtype (GradScaler groups them).");
    TORCH_CHECK(at::isFloatingType(g.scalar_type()), "scaled_grads must be floating point.");
    if (g.numel() == 0) continue;
    call_boxed("torch_tpu::amp_unscale_", {g, found_inf, inv_scale});
  }
}

at::Tensor& amp_update_scale(at::Tensor& scale, at::Tensor& growth_tracker, const at::Tensor& found_inf,
                             double growth_factor, double backoff_factor, int64_t growth_interval) {
  check_one_element(scale, "current_scale", at::kFloat, "float");
  check_one_element(growth_tracker, "growth_tracker", at::kInt, "int");
  check_one_element(found_inf, "found_inf", at::kFloat, "float");
  TORCH_CHECK(growth_tracker.device() == scale.device() && found_inf.device() == scale.device(),
              "current_scale, growth_tracker and found_inf must be on the same device.");
  c10::DeviceGuard guard(scale.device());
  call_boxed("torch_tpu::amp_update_scale_",
             {scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval});
  return scale;
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_amp_foreach_non_finite_check_and_unscale_", amp_foreach_non_finite_check_and_unscale);
  m.impl("_amp_update_scale_", amp_update_scale);
}

}  // namespace

}  // namespace tpu::aten
