// 2-d max pooling with indices (+ backward). Each of the kh*kw window offsets is one strided
// slice of the (-inf padded) input; a variadic reduce over that stacked axis gives the max and
// the flat input index of its first occurrence (NaN wins, as on CPU). Backward scatter-adds.
#include <limits>

#include "lowering.h"

namespace tpu::lowering {

namespace {

struct Pool2d {
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
};

Pool2d pool_params(const OpCall& c) {
  auto two = [&](const std::string& n, int64_t dflt0, bool from_kernel) {
    const Arg* a = c.find(n);
    std::vector<int64_t> v = a && a->kind == Arg::Kind::IntList ? a->ints : std::vector<int64_t>{};
    if (v.empty() && from_kernel) v = c.ints("kernel_size");
    if (v.empty()) v = {dflt0};
    if (v.size() == 1) v.push_back(v[0]);
    return v;
  };
  auto k = two("kernel_size", 1, false), s = two("stride", 1, true), p = two("padding", 0, false),
       d = two("dilation", 1, false);
  return {k[0], k[1], s[0], s[1], p[0], p[1], d[0], d[1]};
}

}  // namespace

TPU_LOWER(max_pool2d_with_indices) {
  Value x = c.tensor("self");
  if (!shlo::is_float(x.elem()) && x.elem() != ElemType::S64 && x.elem() != ElemType::S32)
    throw Unsupported("max_pool2d: dtype");
  Pool2d p = pool_params(c);
  const Shape& os = out_type(c, 0).shape;  // [..., OH, OW]
  int64_t r = x.rank(), H = x.shape()[r - 2], W = x.shape()[r - 1];
  int64_t OH = os[r - 2], OW = os[r - 1];
  // Pad so every window of the (possibly ceil_mode) output is in bounds.
  int64_t need_h = (OH - 1) * p.sh + (p.kh - 1) * p.dh + 1, need_w = (OW - 1) * p.sw + (p.kw - 1) * p.dw + 1;
  Shape lo(r, 0), hi(r, 0);
  lo[r - 2] = p.ph;
  lo[r - 1] = p.pw;
  hi[r - 2] = std::max<int64_t>(0, need_h - H - p.ph);
  hi[r - 1] = std::max<int64_t>(0, need_w - W - p.pw);
  Value xp = b.pad(x, b.lowest(x.elem()), lo, hi);
  // Flat input index of every padded position (padding positions are never the max unless the
  // whole window is padding, which PyTorch forbids).
  Shape ps = xp.shape();
  Type it{ElemType::S64, ps};
  Value row = b.sub(b.iota(it, r - 2), b.constant_i(p.ph, ElemType::S64, ps));
  Value col = b.sub(b.iota(it, r - 1), b.constant_i(p.pw, ElemType::S64, ps));
  Value flat = b.add(b.mul(row, b.constant_i(W, ElemType::S64, ps)), col);
  std::vector<Value> vals, idxs;
  Shape win = os;
  for (int64_t i = 0; i < p.kh; ++i) {
    for (int64_t j = 0; j < p.kw; ++j) {
      Shape st(r, 0), lim = ps, strides(r, 1);
      st[r - 2] = i * p.dh;
      st[r - 1] = j * p.dw;
      lim[r - 2] = st[r - 2] + (OH - 1) * p.sh + 1;
      lim[r - 1] = st[r - 1] + (OW - 1) * p.sw + 1;
      strides[r - 2] = p.sh;
      strides[r - 1] = p.sw;
      Shape one = os;
      one.push_back(1);
      vals.push_back(b.reshape(b.slice(xp, st, lim, strides), one));
      idxs.push_back(b.reshape(b.slice(flat, st, lim, strides), one));
    }
  }
  Value v = b.concatenate(vals, r), ix = b.concatenate(idxs, r);
  ElemType e = x.elem();
  auto res = b.reduce_multi({v, ix}, {b.lowest(e), b.constant_i(std::numeric_limits<int64_t>::max(), ElemType::S64)}, {r},
                            [&](const std::vector<Value>& a) {
                              // (a0, a1) accumulated, (a2, a3) incoming: larger value wins, NaN wins,
                              // ties keep the smaller (earlier) index.
                              Value av = a[0], ai = a[1], bv = a[2], bi = a[3];
                              Value a_nan = b.compare(Cmp::NE, av, av), b_nan = b.compare(Cmp::NE, bv, bv);
                              Value gt = b.or_(b.compare(Cmp::GT, bv, av), b.and_(b_nan, b.not_(a_nan)));
                              Value eq = b.or_(b.compare(Cmp::EQ, bv, av), b.and_(a_nan, b_nan));
                              Value take_b = b.or_(gt, b.and_(eq, b.compare(Cmp::LT, bi, ai)));
                              return std::vector<Value>{b.select(take_b, bv, av), b.select(take_b, bi, ai)};
                            });
  return {res[0], res[1]};
}

TPU_LOWER(max_pool2d_with_indices_backward) {
  Value go = c.tensor("grad_output"), idx = c.tensor("indices");
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  int64_t r = o.rank();
  int64_t HW = o.shape[r - 2] * o.shape[r - 1];
  int64_t planes = 1;
  for (int64_t i = 0; i < r - 2; ++i) planes *= o.shape[i];
  int64_t per = go.type.numel() / std::max<int64_t>(planes, 1);
  // Flatten to [planes, HW] and [planes, per]; scatter-add along axis 1 with (plane, index) pairs.
  Value g = b.reshape(b.convert(go, t), {planes, per});
  Value id = b.reshape(idx, {planes, per, 1});
  Value plane = b.iota(Type{ElemType::S64, {planes, per, 1}}, 0);
  Value full_idx = b.concatenate({plane, b.convert(id, ElemType::S64)}, 2);
  Value zeros = b.zeros(Type{t, {planes, HW}});
  Value out = b.scatter(zeros, full_idx, g, {}, {0, 1}, {0, 1}, 2, "add");
  return {b.reshape(out, o.shape)};
}

}  // namespace tpu::lowering
