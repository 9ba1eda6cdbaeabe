// Losses: nll_loss (1d/2d, forward + backward, device-checked targets), mse_loss, huber /
// smooth_l1 (+ backward), binary_cross_entropy (+ backward).
//
// All math runs in opmath (f16/bf16 -> f32); the runtime converts results to the output dtypes
// PyTorch's meta functions chose.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "lowering.h"
#include "elementwise_math.h"
#include "shape_util.h"

namespace tpu::lowering {

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
    w = b.constant_f(1.0, t, L.batch);
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
  return {b.mul(b.mul(b.constant_f(norm, t, o.shape), d), g)};
}


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
  Value half_sq = b.mul(b.constant_f(0.5, t, s), b.mul(d, d));
  Value l;
  if (huber) {
    l = b.select(b.compare(Cmp::LT, ad, b.constant_f(p, t, s)), half_sq,
                 b.mul(b.constant_f(p, t, s), b.sub(ad, b.constant_f(0.5 * p, t, s))));
  } else if (p == 0) {
    l = ad;
  } else {
    l = b.select(b.compare(Cmp::LT, ad, b.constant_f(p, t, s)), b.div(half_sq, b.constant_f(p, t, s)),
                 b.sub(ad, b.constant_f(0.5 * p, t, s)));
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
    g = b.select(b.compare(Cmp::LE, ad, b.constant_f(p, t, s)), d, b.mul(b.constant_f(p, t, s), sign));
  } else if (p == 0) {
    g = sign;
  } else {
    g = b.select(b.compare(Cmp::LT, ad, b.constant_f(p, t, s)), b.div(d, b.constant_f(p, t, s)), sign);
  }
  Value go = operand(b, c.arg("grad_output"), t, s);
  return {b.mul(b.mul(g, b.constant_f(norm, t, s)), go)};
}

}  // namespace

TPU_LOWER(huber_loss) { return robust_loss(b, c, true); }
TPU_LOWER(smooth_l1_loss) { return robust_loss(b, c, false); }
TPU_LOWER(huber_loss_backward) { return robust_loss_backward(b, c, true); }
TPU_LOWER(smooth_l1_loss_backward) { return robust_loss_backward(b, c, false); }

// CPU's kernel: an input or target outside [0, 1] (or NaN) raises; each log term is clamped at
// -100 so 0 and 1 give finite losses: (t - 1) max(log1p(-x), -100) - t max(log x, -100), times w.
TPU_LOWER_CHECKED(binary_cross_entropy) {
  const Type& o = out_type(c);
  Value self = c.tensor("self");
  ElemType t = opmath(self.elem());
  const Shape& s = self.shape();
  Value x = b.convert(self, t), y = operand(b, c.arg("target"), t, s);
  if (b.checking()) {
    auto outside = [&](Value v) {
      return b.not_(b.and_(b.compare(Cmp::GE, v, b.zeros(Type{t, s})),
                           b.compare(Cmp::LE, v, b.constant_f(1, t, s))));
    };
    check(b, outside(x), CheckKind::Runtime, "all elements of input should be between 0 and 1");
    check(b, outside(y), CheckKind::Runtime, "all elements of target should be between 0 and 1");
  }
  Value floor = b.constant_f(-100, t, s);
  Value log_1mx = b.max(ew::log1p(b, b.neg(x)), floor), log_x = b.max(b.log(x), floor);
  Value loss = b.sub(b.mul(b.sub(y, b.constant_f(1, t, s)), log_1mx), b.mul(y, log_x));
  if (c.has("weight")) loss = b.mul(loss, operand(b, c.arg("weight"), t, s));
  return {reduce_loss(b, loss, c.int_("reduction", 1), o)};
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

// ------------------------------------------------------------------ multi_margin_loss
// CPU's kernel (float/double): per sample, sum over classes d != y of max(0, margin - x[y] +
// x[d])^p (p is 1 or 2) times weight[y], divided by C; a target outside [0, C) raises
// "target out of range". The backward gives each such d h = g (p = 1) or 2 g z (p = 2) times
// weight[y], and the target class minus their sum, with g = 1 / C (mean: 1 / (N C)).
namespace {
struct MarginLayout {
  Value x;       // [N, C]
  Value onehot;  // [N, C] pred: class == target
  Value z;       // [N, C] margin - x[y] + x[d]
  Value hinge;   // [N, C] pred: z > 0 and d != y
  Value wy;      // [N] weight[y] (1 without weight)
  Value p1;      // [N, C] pred: p == 1
  int64_t N, C;
};

MarginLayout margin_layout(Builder& b, const OpCall& c, ElemType t) {
  MarginLayout L;
  Value x = b.convert(c.tensor("self"), t);
  if (x.rank() <= 1) x = b.reshape(x, {1, x.rank() == 0 ? 1 : x.shape()[0]});
  L.N = x.shape()[0];
  L.C = x.shape()[1];
  const Shape full{L.N, L.C};
  Value tg = b.reshape(b.convert(c.tensor("target"), ElemType::S64), {L.N});
  if (b.checking())
    check(b, b.or_(b.compare(Cmp::LT, tg, b.constant_i(0, ElemType::S64, {L.N})),
                   b.compare(Cmp::GE, tg, b.constant_i(L.C, ElemType::S64, {L.N}))),
          CheckKind::Runtime, "target out of range");
  L.onehot = b.compare(Cmp::EQ, b.iota(Type{ElemType::S64, full}, 1), b.broadcast_in_dim(tg, full, {0}));
  auto pick = [&](Value v) {  // v[n, y_n]
    return b.reduce(b.select(L.onehot, v, b.zeros(Type{t, full})), b.constant_i(0, t), {1}, "add");
  };
  Value xy = pick(x);
  Value margin = b.broadcast_to(b.convert(operand(b, c.arg("margin"), t, {}), t), full);
  L.z = b.add(b.sub(margin, b.broadcast_in_dim(xy, full, {0})), x);
  L.hinge = b.and_(b.compare(Cmp::GT, L.z, b.zeros(Type{t, full})), b.not_(L.onehot));
  L.wy = c.has("weight") ? pick(b.broadcast_in_dim(b.convert(c.tensor("weight"), t), full, {1}))
                         : b.constant_f(1.0, t, {L.N});
  Value p = b.convert(operand(b, c.arg("p"), t, {}), t);
  L.p1 = b.broadcast_to(b.compare(Cmp::EQ, p, b.constant_f(1.0, t)), full);
  L.x = x;
  return L;
}
}  // namespace

TPU_LOWER_CHECKED(multi_margin_loss) {
  const Type& o = out_type(c);
  if (!is_float(o.elem)) throw Unsupported("multi_margin_loss: non-float output");
  const ElemType t = o.elem;
  // PyTorch's meta function gives [1] where the CPU kernel returns a 0-d loss (1-D input, 0-d
  // target, reduction none): the CPU runs that call, so the shape stays the CPU's.
  if (c.int_("reduction", 1) == 0 && c.tensor("target").rank() == 0 && o.rank() == 1)
    throw Unsupported("multi_margin_loss: the meta shape [1] differs from the CPU's 0-d loss");
  MarginLayout L = margin_layout(b, c, t);
  const Shape full{L.N, L.C};
  Value h = b.select(L.p1, L.z, b.mul(L.z, L.z));
  h = b.mul(h, b.broadcast_in_dim(L.wy, full, {0}));
  Value per = b.reduce(b.select(L.hinge, h, b.zeros(Type{t, full})), b.constant_i(0, t), {1}, "add");
  per = b.div(per, b.constant_f(static_cast<double>(L.C), t, {L.N}));
  const int64_t red = c.int_("reduction", 1);
  if (red == 0) return {fit(b, per, o)};
  Value s = b.reduce(per, b.constant_i(0, t), {0}, "add");
  if (red == 1) s = b.div(s, b.constant_f(static_cast<double>(L.N), t));
  return {fit(b, s, o)};
}

TPU_LOWER(multi_margin_loss_backward) {
  const Type& o = out_type(c);
  if (!is_float(o.elem)) throw Unsupported("multi_margin_loss_backward: non-float output");
  const ElemType t = o.elem;
  MarginLayout L = margin_layout(b, c, t);
  const Shape full{L.N, L.C};
  const int64_t red = c.int_("reduction", 1);
  const double g = red == 1 ? 1.0 / static_cast<double>(L.N * L.C) : 1.0 / static_cast<double>(L.C);
  Value gv = b.constant_f(g, t, full);
  Value h = b.select(L.p1, gv, b.mul(b.mul(b.constant_f(2.0, t, full), gv), L.z));
  h = b.mul(h, b.broadcast_in_dim(L.wy, full, {0}));
  h = b.select(L.hinge, h, b.zeros(Type{t, full}));
  Value target_grad = b.neg(b.reduce(h, b.constant_i(0, t), {1}, "add"));
  Value gi = b.select(L.onehot, b.broadcast_in_dim(target_grad, full, {0}), h);
  Value go = b.convert(c.tensor("grad_output"), t);
  if (red != 0 || go.rank() == 0) gi = b.mul(gi, b.broadcast_to(b.reshape(go, {}), full));
  else gi = b.mul(gi, b.broadcast_in_dim(b.reshape(go, {L.N}), full, {0}));
  return {fit(b, gi, o)};
}
}  // namespace tpu::lowering
