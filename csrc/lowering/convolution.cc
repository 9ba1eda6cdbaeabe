// Convolutions: convolution_overrideable and convolution_backward_overrideable (what PyTorch
// dispatches conv1d/2d/3d and conv_transpose1d/2d/3d to on a PrivateUse1 device).
//
// On the CPU plugin a float forward is the host convolution (host_conv.h, aten/ffi_conv.cc:
// PyTorch's CPU convolution as an FFI custom call; see host_conv() below). Everything else is
// a stablehlo.convolution in PyTorch's own layouts (no physical transposes for
// the forward pass): input [N, C, spatial...], weight [Cout, Cin/G, k...].
//  - forward:            conv(x, w; stride s, pad p, rhs_dilation d, feature groups G)
//  - transposed forward: conv(x, w'; lhs_dilation s, pad d*(k-1)-p / d*(k-1)-p+op, rhs_dilation d)
//                        with w' the spatially flipped weight with in/out channels swapped per
//                        group ([Cin, Cout/G, k] -> [Cout, Cin/G, k]).
//  - grad_input of a conv is the transposed conv of grad_output (sized to the input), and
//    grad_input of a transposed conv is the plain conv of grad_output.
//  - grad_weight of a conv: conv of the input (batch and feature roles swapped) with
//    grad_output as the window (rhs_dilation = stride, window_strides = dilation), groups via
//    batch_group_count; for a transposed conv the same with input and grad_output swapped.
// float16/bfloat16 compute in float32 (the runtime converts the result); float64 stays float64;
// integer convolutions accumulate in their own type (wrapping, like the CPU kernels).
// Negative paddings (padding > dilation*(k-1), or unused trailing input) are applied with an
// explicit stablehlo.pad (which accepts negative edges) before a zero-padded convolution.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "host_conv.h"
#include "host_kernels.h"
#include "lowering.h"

namespace tpu::lowering {
namespace {

using Labels = std::vector<std::string>;  // per-dim role: "b"/"f" (or "o"/"i"), "0", "1", ...

int64_t find_label(const Labels& l, const std::string& s) {
  for (size_t i = 0; i < l.size(); ++i)
    if (l[i] == s) return static_cast<int64_t>(i);
  throw Unsupported("convolution: bad dimension label " + s);
}

std::string label_str(const Labels& l) {
  std::string r = "[";
  for (size_t i = 0; i < l.size(); ++i) r += (i ? ", " : "") + l[i];
  return r + "]";
}

// Labels for PyTorch's layout with `n` spatial dims: {first, second, "0", "1", ...}.
Labels std_labels(const char* first, const char* second, int64_t n) {
  Labels l{first, second};
  for (int64_t i = 0; i < n; ++i) l.push_back(std::to_string(i));
  return l;
}

struct Window {
  std::vector<int64_t> strides, lo, hi, lhs_dil, rhs_dil;
};

// A general stablehlo.convolution; computes the result shape. Negative paddings are applied
// to the lhs with stablehlo.pad first (together with the lhs dilation).
Value conv_general(Builder& b, Value lhs, Value rhs, const Labels& ld, const Labels& rd,
                   const Labels& od, Window w, int64_t fgc, int64_t bgc) {
  const int64_t n = static_cast<int64_t>(w.strides.size());
  bool negative = false;
  for (int64_t i = 0; i < n; ++i) negative = negative || w.lo[i] < 0 || w.hi[i] < 0;
  if (negative) {
    Shape lo(lhs.rank(), 0), hi(lhs.rank(), 0), interior(lhs.rank(), 0);
    for (int64_t i = 0; i < n; ++i) {
      int64_t d = find_label(ld, std::to_string(i));
      lo[d] = w.lo[i];
      hi[d] = w.hi[i];
      interior[d] = w.lhs_dil[i] - 1;
      w.lo[i] = w.hi[i] = 0;
      w.lhs_dil[i] = 1;
    }
    lhs = b.pad(lhs, b.zeros(Type{lhs.elem(), {}}), lo, hi, interior);
  }
  Shape out(od.size(), 0);
  out[find_label(od, "b")] = lhs.shape()[find_label(ld, "b")] / bgc;
  out[find_label(od, "f")] = rhs.shape()[find_label(rd, "o")];
  for (int64_t i = 0; i < n; ++i) {
    std::string s = std::to_string(i);
    int64_t in = lhs.shape()[find_label(ld, s)];
    int64_t k = rhs.shape()[find_label(rd, s)];
    int64_t dil_in = in == 0 ? 0 : (in - 1) * w.lhs_dil[i] + 1;
    int64_t padded = dil_in + w.lo[i] + w.hi[i];
    int64_t win = k == 0 ? 0 : (k - 1) * w.rhs_dil[i] + 1;
    int64_t o = padded < win ? 0 : (padded - win) / w.strides[i] + 1;
    out[find_label(od, s)] = o;
  }
  std::string pad = "dense<[";
  for (int64_t i = 0; i < n; ++i)
    pad += std::string(i ? ", " : "") + "[" + std::to_string(w.lo[i]) + ", " + std::to_string(w.hi[i]) + "]";
  pad += "]> : tensor<" + std::to_string(n) + "x2xi64>";
  if (n == 0) pad = "dense<> : tensor<0x2xi64>";
  std::string attrs = "window_strides = " + Builder::dense_array(w.strides) + ", padding = " + pad +
                      ", lhs_dilation = " + Builder::dense_array(w.lhs_dil) +
                      ", rhs_dilation = " + Builder::dense_array(w.rhs_dil) +
                      ", dimension_numbers = #stablehlo.conv<" + label_str(ld) + "x" + label_str(rd) +
                      "->" + label_str(od) + ">, feature_group_count = " + std::to_string(fgc) +
                      " : i64, batch_group_count = " + std::to_string(bgc) + " : i64, " + b.precision_config();
  return b.op("convolution", {lhs, rhs}, Type{lhs.elem(), out}, attrs);
}

// Computation element type for a convolution whose tensors have element type `t`.
ElemType conv_type(ElemType t) {
  if (t == ElemType::Pred) throw Unsupported("convolution on bool tensors");
  return opmath(t);  // integers: in their own type, wrapping like PyTorch's CPU kernels
}

struct Params {
  std::vector<int64_t> stride, padding, dilation, output_padding;
  bool transposed = false;
  int64_t groups = 1;
  int64_t n = 0;  // spatial dims
};

std::vector<int64_t> expand(const std::vector<int64_t>& v, int64_t n, const char* what) {
  if (static_cast<int64_t>(v.size()) == n) return v;
  if (v.size() == 1) return std::vector<int64_t>(n, v[0]);
  throw Unsupported(std::string("convolution: bad ") + what + " length");
}

Params params(const OpCall& c, int64_t rank) {
  Params p;
  p.n = rank - 2;
  if (p.n < 1) throw Unsupported("convolution: input of rank < 3");
  p.stride = expand(c.ints("stride"), p.n, "stride");
  p.padding = expand(c.ints("padding"), p.n, "padding");
  p.dilation = expand(c.ints("dilation"), p.n, "dilation");
  p.transposed = c.bool_("transposed");
  p.output_padding = p.transposed ? expand(c.ints("output_padding"), p.n, "output_padding")
                                  : std::vector<int64_t>(p.n, 0);
  p.groups = c.int_("groups", 1);
  if (p.groups < 1) throw Unsupported("convolution: groups < 1");
  return p;
}

// Plain convolution: x [N, Cin, s...], w [Cout, Cin/G, k...] -> [N, Cout, o...].
Value conv_forward(Builder& b, Value x, Value w, const Params& p) {
  Window win{p.stride, p.padding, p.padding, std::vector<int64_t>(p.n, 1), p.dilation};
  return conv_general(b, x, w, std_labels("b", "f", p.n), std_labels("o", "i", p.n),
                      std_labels("b", "f", p.n), win, p.groups, 1);
}

// Transposed convolution of x [N, Cin, s...] with w [Cin, Cout/G, k...] -> [N, Cout, target...]
// where target = (s-1)*stride - 2*pad + dil*(k-1) + 1 + output_padding for the forward op.
Value conv_transposed(Builder& b, Value x, Value w, const Params& p, const Shape& target) {
  const int64_t n = p.n, G = p.groups;
  const int64_t cin = w.shape()[0], cout_g = w.shape()[1];
  if (cin % G) throw Unsupported("conv_transpose: channels not divisible by groups");
  Shape ks(w.shape().begin() + 2, w.shape().end());
  // [Cin, Cout/G, k] -> [G, Cin/G, Cout/G, k] -> [G, Cout/G, Cin/G, k] -> [Cout, Cin/G, k]
  Shape s1{G, cin / G, cout_g};
  s1.insert(s1.end(), ks.begin(), ks.end());
  std::vector<int64_t> perm{0, 2, 1};
  for (int64_t i = 0; i < n; ++i) perm.push_back(3 + i);
  Shape s2{G * cout_g, cin / G};
  s2.insert(s2.end(), ks.begin(), ks.end());
  std::vector<int64_t> spatial;
  for (int64_t i = 0; i < n; ++i) spatial.push_back(2 + i);
  Value wt = b.reverse(w, spatial);
  if (G == 1) {
    wt = b.transpose(wt, [&] {
      std::vector<int64_t> q{1, 0};
      for (int64_t i = 0; i < n; ++i) q.push_back(2 + i);
      return q;
    }());
  } else {
    wt = b.reshape(b.transpose(b.reshape(wt, s1), perm), s2);
  }
  Window win;
  win.strides.assign(n, 1);
  win.lhs_dil = p.stride;
  win.rhs_dil = p.dilation;
  for (int64_t i = 0; i < n; ++i) {
    int64_t in = x.shape()[2 + i];
    int64_t eff_k = p.dilation[i] * (ks[i] - 1);
    int64_t lo = eff_k - p.padding[i];
    int64_t dil_in = in == 0 ? 0 : (in - 1) * p.stride[i] + 1;
    // dil_in + lo + hi - eff_k == target
    int64_t hi = target[i] + eff_k - dil_in - lo;
    win.lo.push_back(lo);
    win.hi.push_back(hi);
  }
  return conv_general(b, x, wt, std_labels("b", "f", n), std_labels("o", "i", n),
                      std_labels("b", "f", n), win, G, 1);
}

// Gradient of the plain convolution y = conv(x, w) (x [N, Cin, s...], y [N, Cout, o...]) with
// respect to w [Cout, Cin/G, k...], given dy.
Value conv_weight_grad(Builder& b, Value x, Value dy, const Params& p, const Shape& ks) {
  const int64_t n = p.n;
  Window win;
  win.strides = p.dilation;
  win.rhs_dil = p.stride;
  win.lhs_dil.assign(n, 1);
  for (int64_t i = 0; i < n; ++i) {
    int64_t in = x.shape()[2 + i], out = dy.shape()[2 + i];
    win.lo.push_back(p.padding[i]);
    win.hi.push_back((ks[i] - 1) * p.dilation[i] + (out - 1) * p.stride[i] + 1 - in - p.padding[i]);
  }
  // lhs: x with N as the feature dim and C as the batch dim; rhs: dy with N as the input
  // feature and Cout as the output feature; result [Cout (f), Cin/G (b), k...].
  return conv_general(b, x, dy, std_labels("f", "b", n), std_labels("i", "o", n),
                      std_labels("f", "b", n), win, 1, p.groups);
}

// Brings v [N, C, s...] to spatial sizes `target` (cropping or zero padding at the end).
Value fit_spatial(Builder& b, Value v, const Shape& target) {
  bool same = true;
  for (size_t i = 0; i < target.size(); ++i) same = same && v.shape()[2 + i] == target[i];
  if (same) return v;
  Shape lo(v.rank(), 0), hi(v.rank(), 0);
  for (size_t i = 0; i < target.size(); ++i) hi[2 + i] = target[i] - v.shape()[2 + i];
  return b.pad(v, b.zeros(Type{v.elem(), {}}), lo, hi);
}

Value bias_grad(Builder& b, Value dy) {
  std::vector<int64_t> dims{0};
  for (int64_t i = 2; i < dy.rank(); ++i) dims.push_back(i);
  return b.reduce(dy, b.zeros(Type{dy.elem(), {}}), dims, "add");
}

// The output shape PyTorch gives conv(x, w; p), or nullopt when the operands do not fit together
// (channels, groups, a window larger than the padded input): such calls keep the XLA path, which
// reports them at compile time instead of inside a running program.
std::optional<Shape> torch_conv_shape(const Shape& x, const Shape& w, const Params& p) {
  const int64_t G = p.groups;
  if (x.size() != w.size() || x.size() < 3 || w[0] <= 0 || w[1] <= 0) return std::nullopt;
  const int64_t cout = p.transposed ? w[1] * G : w[0];
  if (p.transposed ? (x[1] != w[0] || w[0] % G) : (x[1] != w[1] * G || w[0] % G)) return std::nullopt;
  Shape out{x[0], cout};
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t in = x[2 + i], k = w[2 + i], s = p.stride[i], d = p.dilation[i], pad = p.padding[i];
    if (s <= 0 || d <= 0 || pad < 0 || in <= 0 || k <= 0) return std::nullopt;
    int64_t o = p.transposed ? (in - 1) * s - 2 * pad + d * (k - 1) + p.output_padding[i] + 1
                             : (in + 2 * pad - d * (k - 1) - 1) / s + 1;
    if (p.transposed && (p.output_padding[i] < 0 || p.output_padding[i] >= std::max(s, d))) return std::nullopt;
    if (!p.transposed && in + 2 * pad < d * (k - 1) + 1) return std::nullopt;
    if (o <= 0) return std::nullopt;
    out.push_back(o);
  }
  return out;
}

// The forward convolution on the host kernel (host_conv.h) when the CPU plugin offers it: PyTorch's
// own CPU convolution on the program's buffers, in the tensors' dtype (float32/bfloat16/float16)
// and layout, so no transposes to XLA's NHWC/HWIO either. nullopt: take the XLA path.
std::optional<Value> host_conv(Builder& b, const OpCall& c, Value x, Value w, const Params& p, const Type& o) {
  if (!host_kernel_enabled(HostKernel::Conv)) return std::nullopt;
  const ElemType t = o.elem;
  if (t != ElemType::F32 && t != ElemType::BF16 && t != ElemType::F16) return std::nullopt;
  if (x.elem() != t || w.elem() != t) return std::nullopt;
  const bool has_bias = c.has("bias");
  Value bias = w;  // placeholder operand when there is no bias
  if (has_bias) {
    bias = c.tensor("bias");
    if (bias.elem() != t || bias.rank() != 1) return std::nullopt;
  }
  const std::optional<Shape> shape = torch_conv_shape(x.shape(), w.shape(), p);
  if (!shape || *shape != o.shape || (has_bias && bias.shape()[0] != o.shape[1])) return std::nullopt;
  for (int64_t d : x.shape())
    if (d == 0) return std::nullopt;
  auto arr = [](const std::vector<int64_t>& v) {
    std::string r = "array<i64";
    for (size_t i = 0; i < v.size(); ++i) r += (i ? ", " : ": ") + std::to_string(v[i]);
    return r + ">";
  };
  const std::string attrs = std::string("call_target_name = \"") + kHostConvTarget +
                            "\", api_version = 4 : i32, backend_config = {stride = " + arr(p.stride) +
                            ", padding = " + arr(p.padding) + ", dilation = " + arr(p.dilation) +
                            ", output_padding = " + arr(p.output_padding) +
                            ", transposed = " + (p.transposed ? "1" : "0") + " : i64, groups = " +
                            std::to_string(p.groups) + " : i64, has_bias = " + (has_bias ? "1" : "0") + " : i64}";
  return b.op("custom_call", {x, w, bias}, o, attrs);
}

std::vector<Value> lower_conv(Builder& b, const OpCall& c) {
  const Type& o = out_type(c);
  Value x = c.tensor("input");
  Value w = c.tensor("weight");
  ElemType t = conv_type(o.elem);
  Params p = params(c, x.rank());
  if (w.rank() != x.rank()) throw Unsupported("convolution: weight rank differs from input rank");
  if (std::optional<Value> y = host_conv(b, c, x, w, p, o)) return {*y};
  x = b.convert(x, t);
  w = b.convert(w, t);
  Shape target(o.shape.begin() + 2, o.shape.end());
  Value y = p.transposed ? conv_transposed(b, x, w, p, target) : conv_forward(b, x, w, p);
  y = fit_spatial(b, y, target);
  if (c.has("bias")) {
    Value bias = b.convert(c.tensor("bias"), t);
    y = b.add(y, b.broadcast_in_dim(bias, y.shape(), {1}));
  }
  return {y};
}

std::vector<Value> lower_conv_backward(Builder& b, const OpCall& c) {
  Value dy = c.tensor("grad_output");
  Value x = c.tensor("input");
  Value w = c.tensor("weight");
  std::vector<int64_t> mask = c.ints("output_mask");
  mask.resize(3, 1);
  ElemType t = conv_type(dy.elem());
  Params p = params(c, x.rank());
  dy = b.convert(dy, t);
  x = b.convert(x, t);
  w = b.convert(w, t);
  Shape xs(x.shape().begin() + 2, x.shape().end());
  Shape ys(dy.shape().begin() + 2, dy.shape().end());
  Shape ks(w.shape().begin() + 2, w.shape().end());
  std::vector<Value> res;
  // grad_input
  if (mask[0]) {
    Value gi = p.transposed ? conv_forward(b, dy, w, p) : conv_transposed(b, dy, w, p, xs);
    res.push_back(fit_spatial(b, gi, xs));
  } else {
    res.push_back(b.zeros(Type{t, {}}));
  }
  // grad_weight
  if (mask[1]) {
    Value gw = p.transposed ? conv_weight_grad(b, dy, x, p, ks) : conv_weight_grad(b, x, dy, p, ks);
    res.push_back(gw);
  } else {
    res.push_back(b.zeros(Type{t, {}}));
  }
  // grad_bias
  res.push_back(mask[2] ? bias_grad(b, dy) : b.zeros(Type{t, {}}));
  return res;
}

}  // namespace

// Eager: what conv*d / conv_transpose*d dispatch to on PrivateUse1 (meta kernels in
// csrc/aten/convolution_meta.cc).
TPU_LOWER(convolution_overrideable) { return lower_conv(b, c); }
TPU_LOWER(convolution_backward_overrideable) { return lower_conv_backward(b, c); }
// Whole graphs (torch.compile) carry aten.convolution / aten.convolution_backward, with the
// same argument names (convolution_backward also has bias_sizes, which we do not need).
TPU_LOWER_GRAPH(convolution) { return lower_conv(b, c); }
TPU_LOWER_GRAPH(convolution_backward) { return lower_conv_backward(b, c); }

}  // namespace tpu::lowering
