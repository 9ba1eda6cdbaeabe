// Meta kernels for aten::convolution_overrideable / convolution_backward_overrideable.
// PyTorch routes convolutions on PrivateUse1 to these ops, whose only kernel
// (CompositeExplicitAutograd) throws, also on meta tensors; the runtime needs their output
// metadata to run the lowerings in csrc/lowering/convolution.cc.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <vector>

namespace tpu::aten {
namespace {

int64_t at_or_first(c10::SymIntArrayRef v, size_t i, int64_t dflt) {
  if (v.empty()) return dflt;
  return (v.size() == 1 ? v[0] : v.at(i)).expect_int();
}

at::Tensor convolution_overrideable_meta(const at::Tensor& input, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& /*bias*/,
                                         c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
                                         c10::SymIntArrayRef dilation, bool transposed,
                                         c10::SymIntArrayRef output_padding, c10::SymInt groups) {
  TORCH_CHECK(input.dim() >= 3 && weight.dim() == input.dim(),
              "convolution_overrideable: expected batched input and weight of the same rank");
  const int64_t g = groups.expect_int();
  std::vector<int64_t> out{input.size(0), transposed ? weight.size(1) * g : weight.size(0)};
  for (int64_t i = 2; i < input.dim(); ++i) {
    const size_t j = static_cast<size_t>(i - 2);
    int64_t in = input.size(i), k = weight.size(i);
    int64_t s = at_or_first(stride, j, 1), p = at_or_first(padding, j, 0),
            d = at_or_first(dilation, j, 1);
    if (transposed) {
      int64_t op = at_or_first(output_padding, j, 0);
      out.push_back((in - 1) * s - 2 * p + d * (k - 1) + op + 1);
    } else {
      out.push_back((in + 2 * p - d * (k - 1) - 1) / s + 1);
    }
  }
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
