// Neural-network ops: softmax / log_softmax (+ backward), layer norm (+ backward), group norm
// (+ backward), fused RMS norm (+ backward), embedding_dense_backward, nll_loss (1d/2d,
// forward + backward), mse_loss (+ backward).
//
// All math runs in opmath (f16/bf16 -> f32); the runtime converts results to the output dtypes
// PyTorch's meta functions chose.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "lowering.h"

namespace tpu::lowering {
namespace {

bool contains(const std::vector<int64_t>& v, int64_t x) {
  for (int64_t d : v)
    if (d == x) return true;
  return false;
}

Shape keep_shape(const Shape& s, const std::vector<int64_t>& dims) {
  Shape r = s;
  for (int64_t d : dims) r[d] = 1;
  return r;
}

Shape drop_shape(const Shape& s, const std::vector<int64_t>& dims) {
  Shape r;
  for (int64_t i = 0; i < static_cast<int64_t>(s.size()); ++i)
    if (!contains(dims, i)) r.push_back(s[i]);
  return r;
}

int64_t numel_of(const Shape& s, const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= s[d];
  return n;
}

// Sum over dims, result broadcast back to x's shape (keepdim + expand).
Value sum_keep(Builder& b, Value x, const std::vector<int64_t>& dims) {
  if (dims.empty()) return x;
  Value r = b.reduce(x, b.constant_i(0, x.elem()), dims, "add");
  return b.broadcast_to(b.reshape(r, keep_shape(x.shape(), dims)), x.shape());
}
Value max_keep(Builder& b, Value x, const std::vector<int64_t>& dims) {
  if (dims.empty()) return x;
  Value r = b.reduce(x, b.lowest(x.elem()), dims, "maximum");
  return b.broadcast_to(b.reshape(r, keep_shape(x.shape(), dims)), x.shape());
}
Value sum_drop(Builder& b, Value x, const std::vector<int64_t>& dims) {
  return b.reduce(x, b.constant_i(0, x.elem()), dims, "add");
}

Value fit(Builder& b, Value v, const Type& o) {
  if (v.type.numel() == o.numel()) return b.reshape(v, o.shape);
  return v;
}

Value cf(Builder& b, double v, ElemType t, const Shape& s) { return b.constant_f(v, t, s); }

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

Shape bcast_shape(const Shape& a, const Shape& b2) {
  size_t n = std::max(a.size(), b2.size());
  Shape r(n, 1);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b2.size() ? 1 : b2[i - (n - b2.size())];
    r[i] = da == 1 ? db : da;
  }
  return r;
}

std::vector<int64_t> all_dims(int64_t rank) {
  std::vector<int64_t> d;
  for (int64_t i = 0; i < rank; ++i) d.push_back(i);
  return d;
}

}  // namespace

// ------------------------------------------------------------------ softmax
TPU_LOWER(_softmax) {
  Value x0 = c.tensor("self");
  ElemType t = opmath(x0.elem());
  Value x = b.convert(x0, t);
  auto dims = softmax_dims(x, c.int_("dim"));
  Value e = b.exp(b.sub(x, max_keep(b, x, dims)));
  return {b.div(e, sum_keep(b, e, dims))};
}

TPU_LOWER(_log_softmax) {
  Value x0 = c.tensor("self");
  ElemType t = opmath(x0.elem());
  Value x = b.convert(x0, t);
  auto dims = softmax_dims(x, c.int_("dim"));
  Value sh = b.sub(x, max_keep(b, x, dims));
  return {b.sub(sh, b.log(sum_keep(b, b.exp(sh), dims)))};
}

TPU_LOWER(_softmax_backward_data) {
  Value g0 = c.tensor("grad_output"), y0 = c.tensor("output");
  ElemType t = opmath(out_type(c).elem);
  Value g = b.convert(g0, t), y = b.convert(y0, t);
  auto dims = softmax_dims(y, c.int_("dim"));
  Value gy = b.mul(g, y);
  return {b.sub(gy, b.mul(y, sum_keep(b, gy, dims)))};
}

TPU_LOWER(_log_softmax_backward_data) {
  Value g0 = c.tensor("grad_output"), y0 = c.tensor("output");
  ElemType t = opmath(out_type(c).elem);
  Value g = b.convert(g0, t), y = b.convert(y0, t);
  auto dims = softmax_dims(y, c.int_("dim"));
  return {b.sub(g, b.mul(b.exp(y), sum_keep(b, g, dims)))};
}

// ------------------------------------------------------------------ layer norm
TPU_LOWER(native_layer_norm) {
  Value x0 = c.tensor("input");
  ElemType t = opmath(x0.elem());
  Value x = b.convert(x0, t);
  const Shape& s = x.shape();
  int64_t axis = x.rank() - static_cast<int64_t>(c.ints("normalized_shape").size());
  std::vector<int64_t> dims;
  for (int64_t i = axis; i < x.rank(); ++i) dims.push_back(i);
  int64_t n = numel_of(s, dims);
  double eps = c.double_("eps");
  Value mean = b.div(sum_keep(b, x, dims), cf(b, static_cast<double>(n), t, s));
  Value d = b.sub(x, mean);
  Value var = b.div(sum_keep(b, b.mul(d, d), dims), cf(b, static_cast<double>(n), t, s));
  Value rstd = b.rsqrt(b.add(var, cf(b, eps, t, s)));
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
  Value x0 = c.tensor("input");
  ElemType t = opmath(x0.elem());
  Value x = b.convert(x0, t);
  Value go = b.convert(c.tensor("grad_out"), t);
  const Shape& s = x.shape();
  int64_t axis = x.rank() - static_cast<int64_t>(c.ints("normalized_shape").size());
  std::vector<int64_t> inner, outer;
  for (int64_t i = 0; i < x.rank(); ++i) (i >= axis ? inner : outer).push_back(i);
  int64_t n = numel_of(s, inner);
  auto mask = output_mask(c, 3);
  Value mean = stat_expand(b, b.convert(c.tensor("mean"), t), s, axis);
  Value rstd = stat_expand(b, b.convert(c.tensor("rstd"), t), s, axis);
  Value xhat = b.mul(b.sub(x, mean), rstd);
  std::vector<Value> res;
  if (mask[0]) {
    Value g = go;
    if (c.has("weight")) g = b.mul(g, b.broadcast_to(b.convert(c.tensor("weight"), t), s));
    Value a = b.mul(cf(b, static_cast<double>(n), t, s), g);
    Value s1 = sum_keep(b, g, inner);
    Value s2 = b.mul(xhat, sum_keep(b, b.mul(g, xhat), inner));
    Value scale = b.div(rstd, cf(b, static_cast<double>(n), t, s));
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
  Value mean = b.div(sum_keep(b, x, {2}), cf(b, static_cast<double>(D), t, gs));
  Value d = b.sub(x, mean);
  Value var = b.div(sum_keep(b, b.mul(d, d), {2}), cf(b, static_cast<double>(D), t, gs));
  Value rstd = b.rsqrt(b.add(var, cf(b, eps, t, gs)));
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
    Value a = b.mul(cf(b, static_cast<double>(D), t, gs), g);
    Value s1 = sum_keep(b, g, {2});
    Value s2 = b.mul(xhat, sum_keep(b, b.mul(g, xhat), {2}));
    Value scale = b.div(rstd, cf(b, static_cast<double>(D), t, gs));
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
  Value x0 = c.tensor("input");
  ElemType t = opmath(x0.elem());
  Value x = b.convert(x0, t);
  const Shape& s = x.shape();
  int64_t axis = x.rank() - static_cast<int64_t>(c.ints("normalized_shape").size());
  std::vector<int64_t> dims;
  for (int64_t i = axis; i < x.rank(); ++i) dims.push_back(i);
  int64_t n = numel_of(s, dims);
  double eps = c.has("eps") ? c.double_("eps")
                            : (t == ElemType::F64 ? std::numeric_limits<double>::epsilon()
                                                  : std::numeric_limits<float>::epsilon());
  Value ms = b.div(sum_keep(b, b.mul(x, x), dims), cf(b, static_cast<double>(n), t, s));
  Value rstd = b.rsqrt(b.add(ms, cf(b, eps, t, s)));
  Value y = b.mul(x, rstd);
  if (c.has("weight")) y = b.mul(y, b.broadcast_to(b.convert(c.tensor("weight"), t), s));
  Shape start(s.size(), 0);
  Value r1 = b.slice(rstd, start, keep_shape(s, dims));
  return {y, fit(b, r1, out_type(c, 1))};
}

TPU_LOWER(_fused_rms_norm_backward) {
  Value x0 = c.tensor("input");
  ElemType t = opmath(x0.elem());
  Value x = b.convert(x0, t);
  Value go = b.convert(c.tensor("grad_out"), t);
  const Shape& s = x.shape();
  int64_t axis = x.rank() - static_cast<int64_t>(c.ints("normalized_shape").size());
  std::vector<int64_t> inner, outer;
  for (int64_t i = 0; i < x.rank(); ++i) (i >= axis ? inner : outer).push_back(i);
  int64_t n = numel_of(s, inner);
  auto mask = output_mask(c, 2);
  Value rstd = stat_expand(b, b.convert(c.tensor("rstd"), t), s, axis);
  Value xhat = b.mul(x, rstd);
  std::vector<Value> res;
  if (mask[0]) {
    Value g = go;
    if (c.has("weight")) g = b.mul(g, b.broadcast_to(b.convert(c.tensor("weight"), t), s));
    Value sv = sum_keep(b, b.mul(xhat, g), inner);
    Value d = b.mul(b.sub(g, b.mul(b.div(xhat, cf(b, static_cast<double>(n), t, s)), sv)), rstd);
    res.push_back(d);
  } else {
    res.push_back(undefined_out(b, c, 0));
  }
  if (mask[1] && c.outs.size() > 1 && c.outs[1].numel() == n)
    res.push_back(fit(b, sum_drop(b, b.mul(go, xhat), outer), out_type(c, 1)));
  else res.push_back(undefined_out(b, c, 1));
  return res;
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
    Value counts = b.scatter(b.zeros(Type{t, {num_weights}}), idx2, cf(b, 1.0, t, {K}), {}, {0}, {0},
                             1, "add");
    Value per = b.gather(counts, idx2, {}, {0}, {0}, 1, {1}, {K});
    g = b.div(g, b.broadcast_in_dim(per, {K, D}, {0}));
  }
  Value out = b.scatter(b.zeros(Type{t, {num_weights, D}}), idx2, g, {1}, {0}, {0}, 1, "add");
  return {fit(b, out, o)};
}

// ------------------------------------------------------------------ nll_loss
namespace {
// Moves the class dim (1, or 0 for 1-D input) last: (N, C, d...) -> (N, d..., C); a 1-D input
// becomes (1, C). Returns the permuted value and the target reshaped to the batch shape.
struct NllLayout {
  Value x;       // (B..., C) in t
  Value target;  // (B...) s64
  Value onehot;  // (B..., C) pred: class == target
  Value wt;      // (B...) weight[target], 0 where target == ignore_index
  Shape batch;
  int64_t C;
  bool one_d;
};

NllLayout nll_layout(Builder& b, const OpCall& c, ElemType t) {
  NllLayout L;
  Value x = b.convert(c.tensor("self"), t);
  Value tg = b.convert(c.tensor("target"), ElemType::S64);
  L.one_d = x.rank() == 1;
  if (L.one_d) x = b.reshape(x, {1, x.shape()[0]});
  L.C = x.shape()[1];
  std::vector<int64_t> perm{0};
  for (int64_t i = 2; i < x.rank(); ++i) perm.push_back(i);
  perm.push_back(1);
  x = b.transpose(x, perm);
  L.batch = Shape(x.shape().begin(), x.shape().end() - 1);
  tg = b.reshape(tg, L.batch);
  Shape full = x.shape();
  int64_t last = static_cast<int64_t>(full.size()) - 1;
  std::vector<int64_t> bdims;
  for (int64_t i = 0; i < last; ++i) bdims.push_back(i);
  L.onehot = b.compare(Cmp::EQ, b.iota(Type{ElemType::S64, full}, last), b.broadcast_in_dim(tg, full, bdims));
  Value valid = b.compare(Cmp::NE, tg, b.constant_i(c.int_("ignore_index"), ElemType::S64, L.batch));
  if (b.checking()) {  // forward only (.checked): a target outside [0, C) that is not ignore_index
    Value out = b.or_(b.compare(Cmp::LT, tg, b.constant_i(0, ElemType::S64, L.batch)),
                      b.compare(Cmp::GE, tg, b.constant_i(L.C, ElemType::S64, L.batch)));
    check(b, b.and_(valid, out), CheckKind::Index,
          "Target is out of bounds (not in [0, " + std::to_string(L.C) + ") and not ignore_index).");
  }
  Value w;
  if (c.has("weight")) {
    Value wf = b.broadcast_in_dim(b.convert(c.tensor("weight"), t), full, {last});
    w = b.reduce(b.select(L.onehot, wf, b.zeros(Type{t, full})), b.constant_i(0, t), {last}, "add");
  } else {
    w = cf(b, 1.0, t, L.batch);
  }
  L.wt = b.select(valid, w, b.zeros(Type{t, L.batch}));
  L.x = x;
  L.target = tg;
  return L;
}
}  // namespace

static std::vector<Value> lower_nll_forward(Builder& b, const OpCall& c) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  NllLayout L = nll_layout(b, c, t);
  Shape full = L.x.shape();
  int64_t last = static_cast<int64_t>(full.size()) - 1;
  Value picked = b.reduce(b.select(L.onehot, L.x, b.zeros(Type{t, full})), b.constant_i(0, t), {last}, "add");
  Value loss = b.neg(b.mul(picked, L.wt));
  int64_t red = c.int_("reduction");
  auto bd = all_dims(static_cast<int64_t>(L.batch.size()));
  Value total = sum_drop(b, L.wt, bd);
  if (red == 0) return {fit(b, loss, o), b.constant_i(0, t)};
  Value s = sum_drop(b, loss, bd);
  if (red == 1) s = b.div(s, total);
  return {fit(b, s, o), fit(b, total, out_type(c, 1))};
}

static std::vector<Value> lower_nll_backward(Builder& b, const OpCall& c) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  NllLayout L = nll_layout(b, c, t);
  Shape full = L.x.shape();
  int64_t last = static_cast<int64_t>(full.size()) - 1;
  int64_t red = c.int_("reduction");
  Value go = b.convert(c.tensor("grad_output"), t);
  Value g;
  if (red == 0) {
    g = b.reshape(go, L.batch);
  } else {
    Value s = b.reshape(go, {});
    if (red == 1) s = b.div(s, b.reshape(b.convert(c.tensor("total_weight"), t), {}));
    g = b.broadcast_to(s, L.batch);
  }
  std::vector<int64_t> bdims;
  for (int64_t i = 0; i < last; ++i) bdims.push_back(i);
  Value v = b.broadcast_in_dim(b.neg(b.mul(L.wt, g)), full, bdims);
  Value gi = b.select(L.onehot, v, b.zeros(Type{t, full}));
  // Back to (N, C, d...).
  std::vector<int64_t> inv{0, last};
  for (int64_t i = 1; i < last; ++i) inv.push_back(i);
  gi = b.transpose(gi, inv);
  return {fit(b, gi, o)};
}

TPU_LOWER_CHECKED(nll_loss_forward) { return lower_nll_forward(b, c); }
TPU_LOWER_CHECKED(nll_loss2d_forward) { return lower_nll_forward(b, c); }
TPU_LOWER(nll_loss_backward) { return lower_nll_backward(b, c); }
TPU_LOWER(nll_loss2d_backward) { return lower_nll_backward(b, c); }

// ------------------------------------------------------------------ mse_loss
// PyTorch's loss reduction: 0 none, 1 mean, 2 sum (over every element of the pointwise loss).
Value reduce_loss(Builder& b, Value l, int64_t reduction, const Type& o) {
  if (reduction == 0) return l;
  Value r = sum_drop(b, l, all_dims(l.rank()));
  if (reduction == 1) r = b.div(r, b.constant_f(static_cast<double>(l.type.numel()), l.elem()));
  return fit(b, r, o);
}

TPU_LOWER(mse_loss) {
  const Type& o = out_type(c);
  ElemType t = opmath(c.common);
  Shape s = bcast_shape(c.tensor("self").shape(), c.tensor("target").shape());
  Value d = b.sub(operand(b, c.arg("self"), t, s), operand(b, c.arg("target"), t, s));
  Value sq = b.mul(d, d);
  return {reduce_loss(b, sq, c.int_("reduction", 1), o)};
}

TPU_LOWER(mse_loss_backward) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  Value self = c.tensor("self");
  int64_t red = c.int_("reduction");
  double norm = red == 1 ? 2.0 / static_cast<double>(self.type.numel()) : 2.0;
  Value d = b.sub(operand(b, c.arg("self"), t, o.shape), operand(b, c.arg("target"), t, o.shape));
  Value g = operand(b, c.arg("grad_output"), t, o.shape);
  return {b.mul(b.mul(cf(b, norm, t, o.shape), d), g)};
}

}  // namespace tpu::lowering

namespace tpu::lowering {

// ------------------------------------------------------------------ huber / smooth_l1
namespace {

// d = self - target broadcast; the loss per element, then PyTorch's reduction (0 none, 1 mean, 2 sum).
std::vector<Value> robust_loss(Builder& b, const OpCall& c, bool huber) {
  const Type& o = out_type(c);
  ElemType t = opmath(c.common);
  Shape s = bcast_shape(c.tensor("self").shape(), c.tensor("target").shape());
  Value d = b.sub(operand(b, c.arg("self"), t, s), operand(b, c.arg("target"), t, s));
  Value ad = b.abs(d);
  double p = huber ? c.double_("delta", 1.0) : c.double_("beta", 1.0);
  Value half_sq = b.mul(cf(b, 0.5, t, s), b.mul(d, d));
  Value l;
  if (huber) {
    l = b.select(b.compare(Cmp::LT, ad, cf(b, p, t, s)), half_sq,
                 b.mul(cf(b, p, t, s), b.sub(ad, cf(b, 0.5 * p, t, s))));
  } else if (p == 0) {
    l = ad;
  } else {
    l = b.select(b.compare(Cmp::LT, ad, cf(b, p, t, s)), b.div(half_sq, cf(b, p, t, s)),
                 b.sub(ad, cf(b, 0.5 * p, t, s)));
  }
  return {reduce_loss(b, l, c.int_("reduction", 1), o)};
}

std::vector<Value> robust_loss_backward(Builder& b, const OpCall& c, bool huber) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  const Shape& s = o.shape;
  Value d = b.sub(operand(b, c.arg("self"), t, s), operand(b, c.arg("target"), t, s));
  Value ad = b.abs(d);
  Value sign = b.unary("sign", d);
  double p = huber ? c.double_("delta", 1.0) : c.double_("beta", 1.0);
  int64_t red = c.int_("reduction");
  double norm = red == 1 ? 1.0 / static_cast<double>(c.tensor("self").type.numel()) : 1.0;
  Value g;
  if (huber) {
    g = b.select(b.compare(Cmp::LE, ad, cf(b, p, t, s)), d, b.mul(cf(b, p, t, s), sign));
  } else if (p == 0) {
    g = sign;
  } else {
    g = b.select(b.compare(Cmp::LT, ad, cf(b, p, t, s)), b.div(d, cf(b, p, t, s)), sign);
  }
  Value go = operand(b, c.arg("grad_output"), t, s);
  return {b.mul(b.mul(g, cf(b, norm, t, s)), go)};
}

}  // namespace

TPU_LOWER(huber_loss) { return robust_loss(b, c, true); }
TPU_LOWER(smooth_l1_loss) { return robust_loss(b, c, false); }
TPU_LOWER(huber_loss_backward) { return robust_loss_backward(b, c, true); }
TPU_LOWER(smooth_l1_loss_backward) { return robust_loss_backward(b, c, false); }

// ------------------------------------------------------------------ nansum, dropout backward
TPU_LOWER(nansum) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  Value x = b.convert(c.tensor("self"), t);
  if (shlo::is_float(t)) x = b.select(b.compare(Cmp::NE, x, x), b.zeros(x.type), x);
  Value r = b.reduce(x, b.zeros(Type{t, {}}), reduce_dims(c, "dim", x.rank()), "add");
  return {b.reshape(r, o.shape)};
}

TPU_LOWER_ELEMENTWISE(native_dropout_backward) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  Value g = operand(b, c.arg("grad_output"), t, o.shape);
  Value m = operand(b, c.arg("mask"), t, o.shape);
  return {b.mul(b.mul(g, m), b.constant_f(c.double_("scale"), t, o.shape))};
}

}  // namespace tpu::lowering

// ------------------------------------------------------------------ activation / loss backwards
namespace tpu::lowering::ew {  // defined in elementwise_unary.cc
Value sigmoid(Builder& b, Value x);
}  // namespace tpu::lowering::ew

namespace tpu::lowering {

// glu(x) = a * sigmoid(b) with (a, b) the halves of x along dim; as ATen's CPU kernel:
// grad_a = sigmoid(b) * g, grad_b = (1 - sigmoid(b)) * sigmoid(b) * a * g.
TPU_LOWER(glu_backward) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  Value x = b.convert(c.tensor("self"), t);
  int64_t d = norm_dim(c.int_("dim"), x.rank());
  int64_t h = x.shape()[d] / 2;
  if (o.numel() == 0) return {b.zeros(Type{t, o.shape})};
  Shape st(x.rank(), 0), mid = x.shape(), st2(x.rank(), 0);
  mid[d] = h;
  st2[d] = h;
  Value first = b.slice(x, st, mid), second = b.slice(x, st2, x.shape());
  Value g = b.broadcast_to(b.convert(c.tensor("grad_output"), t), first.shape());
  Value sig = ew::sigmoid(b, second);
  Value one = b.constant_f(1, t, sig.shape());
  Value ga = b.mul(sig, g);
  Value gb = b.mul(b.mul(b.mul(b.sub(one, sig), sig), first), g);
  return {b.concatenate({ga, gb}, d)};
}

// prelu: y = x > 0 ? x : w * x. (grad_self, grad_weight) elementwise over the broadcast shape.
TPU_LOWER(_prelu_kernel_backward) {
  const Type& o = out_type(c, 0);
  ElemType t = opmath(o.elem);
  Value x = operand(b, c.arg("self"), t, o.shape), w = operand(b, c.arg("weight"), t, o.shape);
  Value g = operand(b, c.arg("grad_output"), t, o.shape);
  Value pos = b.compare(Cmp::GT, x, b.zeros(x.type));
  return {b.select(pos, g, b.mul(w, g)), b.select(pos, b.zeros(x.type), b.mul(x, g))};
}

// d/dx of -w (t log x + (1 - t) log(1 - x)): w g (x - t) / max((1 - x) x, 1e-12), / numel for mean.
TPU_LOWER(binary_cross_entropy_backward) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  Value x = operand(b, c.arg("self"), t, o.shape), y = operand(b, c.arg("target"), t, o.shape);
  Value g = operand(b, c.arg("grad_output"), t, o.shape);
  Value one = b.constant_f(1, t, o.shape);
  Value prod = b.mul(b.sub(one, x), x), eps = b.constant_f(1e-12, t, o.shape);
  Value denom = b.select(b.compare(Cmp::LT, prod, eps), eps, prod);  // std::max: NaN stays
  Value r = b.div(b.mul(g, b.sub(x, y)), denom);
  if (c.has("weight")) r = b.mul(r, operand(b, c.arg("weight"), t, o.shape));
  if (c.int_("reduction", 1) == 1)
    r = b.div(r, b.constant_f(static_cast<double>(c.tensor("self").type.numel()), t, o.shape));
  return {r};
}

}  // namespace tpu::lowering
