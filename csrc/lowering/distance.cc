// torch.cdist's direct path (aten::_cdist_forward / _cdist_backward): p-norm distances between
// the rows of x1 [..., R1, M] and x2 [..., R2, M] (batch dims broadcast), as PyTorch's CPU
// kernels compute them (aten/native/Distance.cpp): p = 0 counts differing coordinates, 1 / 2 / inf
// are the usual norms, other p are (sum |d|^p)^(1/p). cdist takes the matmul form
// (_euclidean_dist, ordinary lowered ops) for p = 2 with more than 25 rows; this is the rest.
// The backward is the gradient for x1 (autograd swaps the operands for x2), with the CPU kernel's
// conventions: zero where the distance is zero, and for p < 1 where a coordinate difference is.
// torch.pdist (_pdist_forward / _pdist_backward) shares the norms and their gradients.
#include <cmath>
#include <utility>
#include <vector>

#include "lowering.h"
#include "shape_util.h"

namespace tpu::lowering {

namespace {

struct Pairwise {
  Value diff;  // [*batch, R1, R2, M]: x1 row i minus x2 row j
  Shape batch;
};

// x1 [..., R1, M] and x2 [..., R2, M] as [*batch, R1, R2, M] differences; `batch` = the leading
// dims of `out_shape` ([*batch, R1, R2], the distances' shape).
Pairwise pairwise(Builder& b, Value x1, Value x2, const Shape& out_shape, ElemType t) {
  const int64_t rank = static_cast<int64_t>(out_shape.size());
  if (x1.rank() < 2 || x2.rank() < 2) throw Unsupported("cdist: operands must be at least 2-D");
  Shape batch(out_shape.begin(), out_shape.end() - 2);
  const int64_t r1 = x1.shape()[x1.rank() - 2], r2 = x2.shape()[x2.rank() - 2], m = x1.shape().back();
  if (x2.shape().back() != m) throw Unsupported("cdist: operands differ in their last dim");
  Shape full = batch;
  full.insert(full.end(), {r1, r2, m});
  auto spread = [&](Value x, int64_t row_dim) {
    // x's dims map to the trailing dims of full, skipping the other operand's row dim.
    std::vector<int64_t> dims;
    const int64_t xb = x.rank() - 2;
    for (int64_t i = 0; i < xb; ++i) dims.push_back(rank - 2 - xb + i);
    dims.push_back(row_dim);
    dims.push_back(rank);  // M (full has rank + 1 dims); size-1 batch dims broadcast
    return b.broadcast_in_dim(b.convert(x, t), full, dims);
  };
  return {b.sub(spread(x1, rank - 2), spread(x2, rank - 1)), batch};
}

Value sign(Builder& b, Value x) { return b.unary("sign", x); }

// The p-norm of diff over its last dim (dropped), as CPU's Dists structs (Distance.cpp).
Value pnorm_last(Builder& b, Value d, double p, ElemType t) {
  const int64_t last = d.rank() - 1;
  Value a = b.abs(d);
  if (p == 0) return sum_drop(b, b.convert(b.compare(Cmp::NE, d, b.zeros(d.type)), t), {last});
  if (p == 1) return sum_drop(b, a, {last});
  if (p == 2) return b.sqrt(sum_drop(b, b.mul(d, d), {last}));
  if (std::isinf(p)) return b.reduce(a, b.constant_f(0, t), {last}, "maximum");
  Value s = sum_drop(b, b.pow(a, b.constant_f(p, t, a.shape())), {last});
  return b.pow(s, b.constant_f(1.0 / p, t, s.shape()));
}

// d dist / d diff times grad, per coordinate: diff [..., M], dist and grad [...] (CPU's
// conventions: zero where the distance is zero, and for p < 1 where a coordinate difference is).
Value pnorm_grad(Builder& b, Value diff, Value dist, Value grad, double p, ElemType t) {
  std::vector<int64_t> keep;
  for (int64_t i = 0; i + 1 < diff.rank(); ++i) keep.push_back(i);
  grad = b.broadcast_in_dim(grad, diff.shape(), keep);
  Value dd = b.broadcast_in_dim(dist, diff.shape(), keep);
  Value zero = b.zeros(diff.type);
  Value a = b.abs(diff);
  Value g;
  if (p == 0) {
    g = zero;
  } else if (p == 1) {
    g = b.mul(grad, sign(b, diff));
  } else if (p == 2) {
    g = b.div(b.mul(grad, diff), dd);
  } else if (std::isinf(p)) {
    // only the coordinates where |d| equals the distance
    g = b.select(b.compare(Cmp::EQ, a, dd), b.mul(grad, sign(b, diff)), zero);
  } else if (p < 2) {
    Value pm1 = b.constant_f(p - 1, t, diff.shape());
    g = b.div(b.mul(b.mul(sign(b, diff), b.pow(a, pm1)), grad), b.pow(dd, pm1));
    if (p < 1) g = b.select(b.compare(Cmp::EQ, diff, zero), zero, g);
  } else {
    Value pm2 = b.constant_f(p - 2, t, diff.shape()), pm1 = b.constant_f(p - 1, t, diff.shape());
    g = b.div(b.mul(b.mul(diff, b.pow(a, pm2)), grad), b.pow(dd, pm1));
  }
  if (p != 0) g = b.select(b.compare(Cmp::EQ, dd, zero), zero, g);
  return g;
}

// pdist's pairs (i, j), i < j, in row-major order: k = i (2N - i - 1) / 2 + j - i - 1. Row i from
// the closed-form root in f64, corrected by one step either way against rounding.
std::pair<Value, Value> pdist_pairs(Builder& b, int64_t n, int64_t pairs) {
  const ElemType F = ElemType::F64, I = ElemType::S64;
  const Shape s{pairs};
  Value k = b.iota(Type{I, s}, 0);
  auto ci = [&](int64_t v) { return b.constant_i(v, I, s); };
  const double w = 2.0 * static_cast<double>(n) - 1.0;
  Value disc = b.sub(b.constant_f(w * w, F, s), b.mul(b.constant_f(8, F, s), b.convert(k, F)));
  Value i = b.convert(b.floor(b.mul(b.sub(b.constant_f(w, F, s), b.sqrt(b.max(disc, b.zeros(Type{F, s})))),
                                    b.constant_f(0.5, F, s))),
                      I);
  auto start = [&](Value r) {  // first k of row r
    return b.div(b.mul(r, b.sub(ci(2 * n - 1), r)), ci(2));
  };
  i = b.clamp(ci(0), i, ci(n - 2));
  i = b.select(b.compare(Cmp::GT, start(i), k), b.sub(i, ci(1)), i);
  Value i1 = b.add(i, ci(1));
  i = b.select(b.and_(b.compare(Cmp::LT, i1, ci(n - 1)), b.compare(Cmp::LE, start(i1), k)), i1, i);
  Value j = b.add(b.sub(k, start(i)), b.add(i, ci(1)));
  return {i, j};
}

Value rows_of(Builder& b, Value x, Value idx) {
  const int64_t p = idx.shape()[0], m = x.shape()[1];
  return b.gather(x, b.reshape(idx, {p, 1}), {1}, {0}, {0}, 1, {1, m}, {p, m});
}

}  // namespace

TPU_LOWER(_cdist_forward) {
  const Type& o = out_type(c);
  const ElemType t = opmath(o.elem);
  const double p = c.double_("p");
  if (p < 0) throw Unsupported("cdist: p must be non-negative");
  Value d = pairwise(b, c.tensor("x1"), c.tensor("x2"), o.shape, t).diff;
  return {b.convert(fit(b, pnorm_last(b, d, p, t), o), o.elem)};
}

TPU_LOWER(_cdist_backward) {
  const Type& o = out_type(c);  // x1's shape
  const ElemType t = opmath(o.elem);
  const double p = c.double_("p");
  Value dist = b.convert(c.tensor("cdist"), t);  // [*batch, R1, R2]
  const Shape& ds = dist.shape();
  Value diff = pairwise(b, c.tensor("x1"), c.tensor("x2"), ds, t).diff;
  const int64_t rank = static_cast<int64_t>(ds.size());
  Value g = pnorm_grad(b, diff, dist, b.convert(c.tensor("grad"), t), p, t);
  // Sum over x2's rows: [*batch, R1, M], then x1's own (possibly broadcast) batch shape.
  Value r = sum_drop(b, g, {rank - 1});
  const int64_t extra = r.rank() - static_cast<int64_t>(o.shape.size());
  if (extra > 0) {
    std::vector<int64_t> lead;
    for (int64_t i = 0; i < extra; ++i) lead.push_back(i);
    r = sum_drop(b, r, lead);
  }
  std::vector<int64_t> ones;  // batch dims x1 had as size 1
  for (int64_t i = 0; i + 2 < static_cast<int64_t>(o.shape.size()); ++i)
    if (o.shape[i] == 1 && r.shape()[i] != 1) ones.push_back(i);
  if (!ones.empty()) r = b.reshape(sum_drop(b, r, ones), o.shape);
  return {b.convert(fit(b, r, o), o.elem)};
}

// torch.pdist: the distances of row pairs i < j of self [N, M], packed row by row as CPU's
// kernel writes them.
TPU_LOWER(_pdist_forward) {
  const Type& o = out_type(c);
  const ElemType t = opmath(o.elem);
  const double p = c.double_("p", 2);
  Value x = c.tensor("self");
  if (x.rank() != 2 || p < 0) throw Unsupported("pdist: 2-D input and p >= 0 only");
  const int64_t n = x.shape()[0], pairs = o.shape.at(0);
  if (pairs == 0 || x.shape()[1] == 0) return {b.zeros(o)};
  x = b.convert(x, t);
  auto [i, j] = pdist_pairs(b, n, pairs);
  Value d = b.sub(rows_of(b, x, i), rows_of(b, x, j));
  return {b.convert(pnorm_last(b, d, p, t), o.elem)};
}

// Row i gains each pair's gradient, row j loses it (the distance is odd in the difference).
TPU_LOWER(_pdist_backward) {
  const Type& o = out_type(c);  // self's shape [N, M]
  const ElemType t = opmath(o.elem);
  const double p = c.double_("p", 2);
  Value x = c.tensor("self");
  const int64_t n = o.shape.at(0), m = o.shape.at(1);
  Value dist = c.tensor("pdist");
  const int64_t pairs = dist.shape().at(0);
  if (pairs == 0 || m == 0) return {b.zeros(o)};
  x = b.convert(x, t);
  auto [i, j] = pdist_pairs(b, n, pairs);
  Value d = b.sub(rows_of(b, x, i), rows_of(b, x, j));
  Value g = pnorm_grad(b, d, b.convert(dist, t), b.convert(c.tensor("grad"), t), p, t);
  Value idx = b.reshape(b.concatenate({i, j}, 0), {2 * pairs, 1});
  Value upd = b.concatenate({g, b.neg(g)}, 0);
  Value r = b.scatter(b.zeros(Type{t, {n, m}}), idx, upd, {1}, {0}, {0}, 1, "add");
  return {b.convert(r, o.elem)};
}


}  // namespace tpu::lowering
