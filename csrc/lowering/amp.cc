// Gradient-scaler (torch.amp.GradScaler) steps as single programs. They serve the explicit tpu
// kernels of aten::_amp_foreach_non_finite_check_and_unscale_ and aten::_amp_update_scale_
// (csrc/aten/autocast.cc), which call the in-place ops torch_tpu::amp_unscale_ (one gradient)
// and torch_tpu::amp_update_scale_ (one scale + growth tracker). The aten schemas themselves do
// not fit the generic path: the first returns () and mutates a TensorList, the second mutates
// growth_tracker without returning it. Semantics follow PyTorch's CPU kernels exactly.
#include "lowering.h"
#include "shape_util.h"

namespace tpu::lowering {

namespace {
// A 1-element tensor as a 0-d value of element type t.
Value scalar_of(Builder& b, Value v, ElemType t) {
  if (v.type.numel() != 1) throw Unsupported("amp: expected a 1-element tensor");
  return b.convert(b.reshape(v, {}), t);
}
}  // namespace

// amp_unscale_(Tensor(a!) grad, Tensor(b!) found_inf, Tensor inv_scale) -> (grad, found_inf)
//   grad      <- grad * inv_scale          (in the grad's opmath type, like the CPU kernel)
//   found_inf <- 1.0 if grad has an inf/NaN (checked before scaling), else unchanged
TPU_LOWER(amp_unscale) {
  Value g = c.tensor("grad");
  if (!shlo::is_float(g.elem())) throw Unsupported("amp_unscale: non-float gradient");
  ElemType t = opmath(g.elem());
  Value gt = b.convert(g, t);
  Value inv = b.broadcast_to(scalar_of(b, c.tensor("inv_scale"), t), g.shape());
  Value scaled = b.mul(gt, inv);

  std::vector<int64_t> all_dims;
  for (int64_t d = 0; d < g.rank(); ++d) all_dims.push_back(d);
  Value finite = is_finite(b, g);
  Value all_finite = g.rank() == 0 ? finite : b.reduce(finite, b.constant_i(1, ElemType::Pred), all_dims, "and");
  Value found = scalar_of(b, c.tensor("found_inf"), ElemType::F32);
  Value found_new = b.select(all_finite, found, b.constant_f(1.0, ElemType::F32));
  return {scaled, found_new};
}

// amp_update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor found_inf,
//                   float growth_factor, float backoff_factor, int growth_interval)
//   -> (scale, growth_tracker)
// found_inf != 0: scale *= backoff_factor, tracker = 0.
// otherwise:      tracker + 1 == growth_interval ? (scale *= growth_factor unless that overflows
//                 float32; tracker = 0) : tracker += 1.
// The products are taken in float64 and rounded to float32, as the CPU kernel does.
TPU_LOWER(amp_update_scale) {
  Value scale = scalar_of(b, c.tensor("scale"), ElemType::F32);
  Value tracker = scalar_of(b, c.tensor("growth_tracker"), ElemType::S64);
  Value found_inf = scalar_of(b, c.tensor("found_inf"), ElemType::F32);
  double growth = c.double_("growth_factor");
  double backoff = c.double_("backoff_factor");
  int64_t interval = c.int_("growth_interval");

  Value found = b.compare(Cmp::NE, found_inf, b.constant_f(0.0, ElemType::F32));
  Value s64 = b.convert(scale, ElemType::F64);
  Value backed = b.convert(b.mul(s64, b.constant_f(backoff, ElemType::F64)), ElemType::F32);
  Value grown = b.convert(b.mul(s64, b.constant_f(growth, ElemType::F64)), ElemType::F32);
  Value successful = b.add(tracker, b.constant_i(1, ElemType::S64));
  Value at_interval = b.compare(Cmp::EQ, successful, b.constant_i(interval, ElemType::S64));
  Value grow_ok = b.and_(at_interval, is_finite(b, grown));

  Value kept = b.select(grow_ok, grown, scale);
  Value scale_new = b.select(found, backed, kept);
  Value zero = b.constant_i(0, ElemType::S64);
  Value tracker_new = b.select(found, zero, b.select(at_interval, zero, successful));
  return {scale_new, tracker_new};
}

}  // namespace tpu::lowering
