// Meta kernels for aten::convolution_overrideable / convolution_backward_overrideable.
// PyTorch routes convolutions on PrivateUse1 to these ops, whose only kernel
// (CompositeExplicitAutograd) throws, also on meta tensors; the runtime needs their output
// metadata to run the lowerings in csrc/lowering/convolution.cc.
#include <ATen/ATen.h>
#include <ATen/native/ConvUtils.h>
#include <torch/library.h>

#include <array>
#include <vector>

namespace tpu::aten {
namespace {

// One value per spatial dim: a single value stands for all of them, an empty list for `dflt`.
std::vector<int64_t> per_dim(c10::SymIntArrayRef v, size_t n, int64_t dflt) {
  std::vector<int64_t> r(n, dflt);
  for (size_t i = 0; i < n && !v.empty(); ++i) r[i] = (v.size() == 1 ? v[0] : v.at(i)).expect_int();
  return r;
}

at::Tensor convolution_overrideable_meta(const at::Tensor& input, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& /*bias*/,
                                         c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
                                         c10::SymIntArrayRef dilation, bool transposed,
                                         c10::SymIntArrayRef output_padding, c10::SymInt groups) {
  TORCH_CHECK(input.dim() >= 3 && weight.dim() == input.dim(),
              "convolution_overrideable: expected batched input and weight of the same rank");
  const size_t n = static_cast<size_t>(input.dim() - 2);
  const auto s = per_dim(stride, n, 1), p = per_dim(padding, n, 0), d = per_dim(dilation, n, 1);
  // PyTorch's own size rules (a transposed convolution's output is its input-size rule).
  const std::vector<int64_t> out =
      transposed ? at::native::conv_input_size(input.sizes(), weight.sizes(), p, per_dim(output_padding, n, 0), s, d,
                                               groups.expect_int())
                 : at::native::conv_output_size(input.sizes(), weight.sizes(), p, s, d);
  return at::empty(out, input.options().device(c10::kMeta));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable_meta(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::SymIntArrayRef, c10::SymIntArrayRef, c10::SymIntArrayRef, bool transposed,
    c10::SymIntArrayRef, c10::SymInt groups, std::array<bool, 3> mask) {
  const int64_t g = groups.expect_int();
  at::Tensor gi, gw, gb;
  if (mask[0]) gi = at::empty(input.sizes(), input.options().device(c10::kMeta));
  if (mask[1]) gw = at::empty(weight.sizes(), weight.options().device(c10::kMeta));
  if (mask[2]) {
    int64_t c = transposed ? weight.size(1) * g : weight.size(0);
    gb = at::empty({c}, grad_output.options().device(c10::kMeta));
  }
  return {gi, gw, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  m.impl("convolution_overrideable", convolution_overrideable_meta);
  m.impl("convolution_backward_overrideable", convolution_backward_overrideable_meta);
}

}  // namespace tpu::aten
