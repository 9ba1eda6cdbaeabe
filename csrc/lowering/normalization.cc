// Normalizations: softmax / log_softmax (+ backward), layer norm (+ backward), group norm
// (+ backward), fused RMS norm (+ backward), weight norm (+ backward); and embedding_dense_backward.
//
// All math runs in opmath (f16/bf16 -> f32); the runtime converts results to the output dtypes
// PyTorch's meta functions chose.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "lowering.h"
#include "shape_util.h"

namespace tpu::lowering {
namespace {

Shape keep_shape(const Shape& s, const std::vector<int64_t>& dims) {
  Shape r = s;
  for (int64_t d : dims) r[d] = 1;
  return r;
}

int64_t numel_of(const Shape& s, const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= s[d];
  return n;
}

Value max_keep(Builder& b, Value x, const std::vector<int64_t>& dims) {
  if (dims.empty()) return x;
  Value r = b.reduce(x, b.lowest(x.elem()), dims, "maximum");
  return b.broadcast_to(b.reshape(r, keep_shape(x.shape(), dims)), x.shape());
}

Value const_f(Builder& b, double v, ElemType t, const Shape& s) { return b.constant_f(v, t, s); }

// Sum over dims with the plain reduce, result broadcast back to x's shape (keepdim + expand):
// group norm's statistics (the GEMV form of row_sum_keep measured slower there).
Value sum_keep(Builder& b, Value x, const std::vector<int64_t>& dims) {
  if (dims.empty()) return x;
  Value r = b.reduce(x, b.constant_i(0, x.elem()), dims, "add");
  return b.broadcast_to(b.reshape(r, keep_shape(x.shape(), dims)), x.shape());
}

// Sum over dims, result broadcast back to x's shape (keepdim + expand). Through row_sum
// (shape_util.h): over trailing dims of short f32/f64 rows (softmax's last dim, a norm's rows)
// one GEMV on XLA:CPU instead of a reduce-window and a reduce; otherwise the plain reduce.
Value row_sum_keep(Builder& b, Value x, const std::vector<int64_t>& dims) {
  if (dims.empty()) return x;
  return b.broadcast_to(b.reshape(row_sum(b, x, dims), keep_shape(x.shape(), dims)), x.shape());
}

// A value of shape `s` taking `v`'s elements (any layout with the same count, e.g. mean/rstd
// as [M] or [M,1,1]) and broadcasting along the trailing normalized dims.
Value stat_expand(Builder& b, Value v, const Shape& s, int64_t axis) {
  Shape ks(s.begin(), s.begin() + axis);
  for (size_t i = axis; i < s.size(); ++i) ks.push_back(1);
  return b.broadcast_to(b.reshape(v, ks), s);
}

std::vector<bool> output_mask(const OpCall& c, size_t n) {
  std::vector<bool> m(n, true);
  const Arg* a = c.find("output_mask");
  if (a && a->kind == Arg::Kind::IntList)
    for (size_t i = 0; i < n && i < a->ints.size(); ++i) m[i] = a->ints[i] != 0;
  return m;
}

// Placeholder for a masked-out (undefined) output.
Value undefined_out(Builder& b, const OpCall& c, size_t i) {
  if (i < c.outs.size()) return b.zeros(c.outs[i]);
  return b.constant_i(0, ElemType::F32);
}

std::vector<int64_t> softmax_dims(const Value& x, int64_t dim) {
  if (x.rank() == 0) return {};
  return {norm_dim(dim, x.rank())};
}

// What layer-norm and RMS-norm forward and backward share: input and upstream gradient in opmath
// (the forwards have no gradient: `go` is the input there), the normalized (inner) and batch
// (outer) dims, and the normalized element count.
struct NormOperands {
  NormOperands(Builder& b, const OpCall& c)
      : t(opmath(c.tensor("input").elem())),
        x(b.convert(c.tensor("input"), t)),
        go(c.has("grad_out") ? b.convert(c.tensor("grad_out"), t) : x),
        s(x.shape()),
        axis(x.rank() - static_cast<int64_t>(c.ints("normalized_shape").size())) {
    for (int64_t i = 0; i < x.rank(); ++i) (i >= axis ? inner : outer).push_back(i);
    n = numel_of(s, inner);
  }
  // grad_out scaled by the affine weight when there is one.
  Value weighted_grad(Builder& b, const OpCall& c) const {
    return c.has("weight") ? b.mul(go, b.broadcast_to(b.convert(c.tensor("weight"), t), s)) : go;
  }
  ElemType t;
  Value x, go;
  Shape s;
  int64_t axis;
  std::vector<int64_t> inner, outer;
  int64_t n = 0;
};
}  // namespace

// ------------------------------------------------------------------ softmax
TPU_LOWER(_softmax) {
  Value x0 = c.tensor("self");
  ElemType t = opmath(x0.elem());
  Value x = b.convert(x0, t);
  auto dims = softmax_dims(x, c.int_("dim"));
  Value e = b.exp(b.sub(x, max_keep(b, x, dims)));
  return {b.div(e, row_sum_keep(b, e, dims))};
}

TPU_LOWER(_log_softmax) {
  Value x0 = c.tensor("self");
  ElemType t = opmath(x0.elem());
  Value x = b.convert(x0, t);
  auto dims = softmax_dims(x, c.int_("dim"));
  Value sh = b.sub(x, max_keep(b, x, dims));
  return {b.sub(sh, b.log(row_sum_keep(b, b.exp(sh), dims)))};
}

TPU_LOWER(_softmax_backward_data) {
  Value g0 = c.tensor("grad_output"), y0 = c.tensor("output");
  ElemType t = opmath(out_type(c).elem);
  Value g = b.convert(g0, t), y = b.convert(y0, t);
  auto dims = softmax_dims(y, c.int_("dim"));
  Value gy = b.mul(g, y);
  return {b.sub(gy, b.mul(y, row_sum_keep(b, gy, dims)))};
}

TPU_LOWER(_log_softmax_backward_data) {
  Value g0 = c.tensor("grad_output"), y0 = c.tensor("output");
  ElemType t = opmath(out_type(c).elem);
  Value g = b.convert(g0, t), y = b.convert(y0, t);
  auto dims = softmax_dims(y, c.int_("dim"));
  return {b.sub(g, b.mul(b.exp(y), row_sum_keep(b, g, dims)))};
}

// ------------------------------------------------------------------ layer norm
TPU_LOWER(native_layer_norm) {
  const NormOperands no(b, c);
  const auto& [t, x, go, s, axis, dims, outer, n] = no;
  double eps = c.double_("eps");
  Value mean = b.broadcast_to(b.reshape(row_mean(b, x, dims, n), keep_shape(s, dims)), s);
  Value d = b.sub(x, mean);
  Value var = b.div(row_sum_keep(b, b.mul(d, d), dims), const_f(b, static_cast<double>(n), t, s));
  Value rstd = b.rsqrt(b.add(var, const_f(b, eps, t, s)));
  Value y = b.mul(d, rstd);
  if (c.has("weight")) y = b.mul(y, b.broadcast_to(b.convert(c.tensor("weight"), t), s));
  if (c.has("bias")) y = b.add(y, b.broadcast_to(b.convert(c.tensor("bias"), t), s));
  // mean / rstd in the [batch..., 1...] layout.
  Shape start(s.size(), 0), limit = keep_shape(s, dims);
  Value m1 = b.slice(mean, start, limit);
  Value r1 = b.slice(rstd, start, limit);
  return {y, fit(b, m1, out_type(c, 1)), fit(b, r1, out_type(c, 2))};
}

TPU_LOWER(native_layer_norm_backward) {
  const NormOperands nb(b, c);
  const auto& [t, x, go, s, axis, inner, outer, n] = nb;
  auto mask = output_mask(c, 3);
  Value mean = stat_expand(b, b.convert(c.tensor("mean"), t), s, axis);
  Value rstd = stat_expand(b, b.convert(c.tensor("rstd"), t), s, axis);
  Value xhat = b.mul(b.sub(x, mean), rstd);
  std::vector<Value> res;
  if (mask[0]) {
    Value g = nb.weighted_grad(b, c);
    Value a = b.mul(const_f(b, static_cast<double>(n), t, s), g);
    Value s1 = row_sum_keep(b, g, inner);
    Value s2 = b.mul(xhat, row_sum_keep(b, b.mul(g, xhat), inner));
    Value scale = b.div(rstd, const_f(b, static_cast<double>(n), t, s));
    res.push_back(b.mul(scale, b.sub(b.sub(a, s1), s2)));
  } else {
    res.push_back(undefined_out(b, c, 0));
  }
  // grad_weight / grad_bias when requested and the output has the normalized shape's size.
  auto wanted = [&](size_t i) { return mask[i] && i < c.outs.size() && c.outs[i].numel() == n; };
  if (wanted(1)) res.push_back(fit(b, sum_drop(b, b.mul(go, xhat), outer), out_type(c, 1)));
  else res.push_back(undefined_out(b, c, 1));
  if (wanted(2)) res.push_back(fit(b, sum_drop(b, go, outer), out_type(c, 2)));
  else res.push_back(undefined_out(b, c, 2));
  return res;
}

// ------------------------------------------------------------------ group norm
TPU_LOWER(native_group_norm) {
  Value x0 = c.tensor("input");
  ElemType t = opmath(x0.elem());
  int64_t N = c.int_("N"), C = c.int_("C"), HxW = c.int_("HxW"), G = c.int_("group");
  if (G <= 0 || C % G != 0) throw Unsupported("native_group_norm: C not divisible by group");
  int64_t D = C / G * HxW;
  double eps = c.double_("eps");
  Value x = b.reshape(b.convert(x0, t), {N, G, D});
  Shape gs{N, G, D};
  Value mean = b.div(sum_keep(b, x, {2}), const_f(b, static_cast<double>(D), t, gs));
  Value d = b.sub(x, mean);
  Value var = b.div(sum_keep(b, b.mul(d, d), {2}), const_f(b, static_cast<double>(D), t, gs));
  Value rstd = b.rsqrt(b.add(var, const_f(b, eps, t, gs)));
  Value y = b.reshape(b.mul(d, rstd), {N, C, HxW});
  Shape cs{N, C, HxW};
  if (c.has("weight")) y = b.mul(y, b.broadcast_in_dim(b.convert(c.tensor("weight"), t), cs, {1}));
  if (c.has("bias")) y = b.add(y, b.broadcast_in_dim(b.convert(c.tensor("bias"), t), cs, {1}));
  Value m1 = b.reshape(b.slice(mean, {0, 0, 0}, {N, G, 1}), {N, G});
  Value r1 = b.reshape(b.slice(rstd, {0, 0, 0}, {N, G, 1}), {N, G});
  return {fit(b, y, out_type(c, 0)), fit(b, m1, out_type(c, 1)), fit(b, r1, out_type(c, 2))};
}

TPU_LOWER(native_group_norm_backward) {
  Value x0 = c.tensor("input");
  ElemType t = opmath(x0.elem());
  int64_t N = c.int_("N"), C = c.int_("C"), HxW = c.int_("HxW"), G = c.int_("group");
  if (G <= 0 || C % G != 0) throw Unsupported("native_group_norm_backward: C not divisible by group");
  int64_t D = C / G * HxW;
  auto mask = output_mask(c, 3);
  Shape gs{N, G, D}, cs{N, C, HxW};
  Value x = b.reshape(b.convert(x0, t), gs);
  Value go = b.reshape(b.convert(c.tensor("grad_out"), t), cs);
  Value mean = b.broadcast_in_dim(b.reshape(b.convert(c.tensor("mean"), t), {N, G}), gs, {0, 1});
  Value rstd = b.broadcast_in_dim(b.reshape(b.convert(c.tensor("rstd"), t), {N, G}), gs, {0, 1});
  Value xhat = b.mul(b.sub(x, mean), rstd);
  std::vector<Value> res;
  if (mask[0]) {
    Value g = go;
    if (c.has("weight")) g = b.mul(g, b.broadcast_in_dim(b.convert(c.tensor("weight"), t), cs, {1}));
    g = b.reshape(g, gs);
    Value a = b.mul(const_f(b, static_cast<double>(D), t, gs), g);
    Value s1 = sum_keep(b, g, {2});
    Value s2 = b.mul(xhat, sum_keep(b, b.mul(g, xhat), {2}));
    Value scale = b.div(rstd, const_f(b, static_cast<double>(D), t, gs));
    res.push_back(fit(b, b.mul(scale, b.sub(b.sub(a, s1), s2)), out_type(c, 0)));
  } else {
    res.push_back(undefined_out(b, c, 0));
  }
  Value xhat_c = b.reshape(xhat, cs);
  if (mask[1]) res.push_back(fit(b, sum_drop(b, b.mul(go, xhat_c), {0, 2}), out_type(c, 1)));
  else res.push_back(undefined_out(b, c, 1));
  if (mask[2]) res.push_back(fit(b, sum_drop(b, go, {0, 2}), out_type(c, 2)));
  else res.push_back(undefined_out(b, c, 2));
  return res;
}

// ------------------------------------------------------------------ RMS norm
TPU_LOWER(_fused_rms_norm) {
  const NormOperands no(b, c);
  const auto& [t, x, go, s, axis, dims, outer, n] = no;
  double eps = c.has("eps") ? c.double_("eps")
                            : (t == ElemType::F64 ? std::numeric_limits<double>::epsilon()
                                                  : std::numeric_limits<float>::epsilon());
  Value ms = b.div(row_sum_keep(b, b.mul(x, x), dims), const_f(b, static_cast<double>(n), t, s));
  Value rstd = b.rsqrt(b.add(ms, const_f(b, eps, t, s)));
  Value y = b.mul(x, rstd);
  if (c.has("weight")) y = b.mul(y, b.broadcast_to(b.convert(c.tensor("weight"), t), s));
  Shape start(s.size(), 0);
  Value r1 = b.slice(rstd, start, keep_shape(s, dims));
  return {y, fit(b, r1, out_type(c, 1))};
}

TPU_LOWER(_fused_rms_norm_backward) {
  const NormOperands nb(b, c);
  const auto& [t, x, go, s, axis, inner, outer, n] = nb;
  auto mask = output_mask(c, 2);
  Value rstd = stat_expand(b, b.convert(c.tensor("rstd"), t), s, axis);
  Value xhat = b.mul(x, rstd);
  std::vector<Value> res;
  if (mask[0]) {
    Value g = nb.weighted_grad(b, c);
    Value sv = row_sum_keep(b, b.mul(xhat, g), inner);
    Value d = b.mul(b.sub(g, b.mul(b.div(xhat, const_f(b, static_cast<double>(n), t, s)), sv)), rstd);
    res.push_back(d);
  } else {
    res.push_back(undefined_out(b, c, 0));
  }
  if (mask[1] && c.outs.size() > 1 && c.outs[1].numel() == n)
    res.push_back(fit(b, sum_drop(b, b.mul(go, xhat), outer), out_type(c, 1)));
  else res.push_back(undefined_out(b, c, 1));
  return res;
}

// ------------------------------------------------------------------ weight norm
// w = v * (g / ||v||), the norm over every dim but `dim` (torch.nn.utils.weight_norm: wav2vec2's
// positional conv, HiFi-GAN vocoders). ATen's fused CPU kernels take the first or last dim only and
// raise otherwise: other dims stay with the CPU fallback, which raises the same error.
namespace {
struct WeightNormOperands {
  WeightNormOperands(Builder& b, const OpCall& c, const char* v_name, const char* g_name)
      : t(opmath(c.tensor(v_name).elem())), v(b.convert(c.tensor(v_name), t)), g(b.convert(c.tensor(g_name), t)) {
    const int64_t rank = v.rank(), dim = c.int_("dim");
    if (rank == 0 || (dim != 0 && dim != rank - 1)) throw Unsupported("weight norm over a middle dim");
    for (int64_t i = 0; i < rank; ++i)
      if (i != dim) others.push_back(i);
    kept = keep_shape(v.shape(), others);
    g = b.reshape(g, kept);  // g holds one value per slice of `dim` (the same count as kept)
  }
  // A per-slice value (shape `kept`) broadcast over v.
  Value spread(Builder& b, Value x) const { return b.broadcast_to(x, v.shape()); }
  Value sum_kept(Builder& b, Value x) const { return b.reshape(sum_drop(b, x, others), kept); }
  ElemType t;
  Value v, g;
  std::vector<int64_t> others;
  Shape kept;
};
}  // namespace

TPU_LOWER(_weight_norm_interface) {
  const WeightNormOperands o(b, c, "v", "g");
  Value norm = b.sqrt(o.sum_kept(b, b.mul(o.v, o.v)));
  Value w = b.mul(o.v, o.spread(b, b.div(o.g, norm)));
  return {w, fit(b, norm, out_type(c, 1))};
}

// grad_v = (g/n) grad_w - (g/n) (sum(grad_w v) / n^2) v, grad_g = sum(grad_w v) / n, the sums per
// slice of `dim`, as ATen's CPU kernel.
TPU_LOWER(_weight_norm_interface_backward) {
  const WeightNormOperands o(b, c, "saved_v", "saved_g");
  Value gw = b.convert(c.tensor("grad_w"), o.t);
  Value norm = b.reshape(b.convert(c.tensor("saved_norms"), o.t), o.kept);
  Value dot = o.sum_kept(b, b.mul(gw, o.v));
  Value a = b.div(o.g, norm);
  Value coef = b.div(b.mul(a, dot), b.mul(norm, norm));
  Value grad_v = b.sub(b.mul(o.spread(b, a), gw), b.mul(o.spread(b, coef), o.v));
  return {grad_v, fit(b, b.div(dot, norm), out_type(c, 1))};
}

// ------------------------------------------------------------------ embedding backward
TPU_LOWER(embedding_dense_backward) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  Value grad = b.convert(c.tensor("grad_output"), t);
  Value idx0 = c.tensor("indices");
  int64_t num_weights = c.int_("num_weights");
  int64_t padding_idx = c.int_("padding_idx");
  int64_t K = idx0.type.numel();
  int64_t D = o.shape.size() == 2 ? o.shape[1] : 1;
  Value idx = b.reshape(b.convert(idx0, ElemType::S64), {K});
  Value g = b.reshape(grad, {K, D});
  Value keep = b.compare(Cmp::NE, idx, b.constant_i(padding_idx, ElemType::S64, {K}));
  g = b.select(b.broadcast_in_dim(keep, {K, D}, {0}), g, b.zeros(Type{t, {K, D}}));
  Value idx2 = b.reshape(idx, {K, 1});
  if (c.bool_("scale_grad_by_freq")) {
    Value counts = b.scatter(b.zeros(Type{t, {num_weights}}), idx2, const_f(b, 1.0, t, {K}), {}, {0}, {0},
                             1, "add");
    Value per = b.gather(counts, idx2, {}, {0}, {0}, 1, {1}, {K});
    g = b.div(g, b.broadcast_in_dim(per, {K, D}, {0}));
  }
  Value out = b.scatter(b.zeros(Type{t, {num_weights, D}}), idx2, g, {1}, {0}, {0}, 1, "add");
  return {fit(b, out, o)};
}

}  // namespace tpu::lowering
