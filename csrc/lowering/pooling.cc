// Pooling: max pooling with indices (2-d/3-d), average pooling (2-d/3-d), adaptive average and
// adaptive max pooling (2-d/3-d), their backward passes, and max unpooling (2-d/3-d). 1-d
// variants reach these through PyTorch's composites (unsqueeze to 2-d).
//
// Window geometry is static (shapes and pooling parameters are part of the compile key), so
// window starts/ends, divisors and flat indices are computed on the host exactly as PyTorch's CPU
// kernels do and enter the program as constants; the data work is strided slices, reshapes,
// reduce_window and one gather per spatial dim where windows are irregular (adaptive pooling with
// non-divisible sizes).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>

#include "lowering.h"
#include "pool_common.h"

namespace tpu::lowering {

// ---- helpers shared with upsample.cc (declared in pool_common.h)

// 1-d dense constant of host integers (S64/S32/Pred).
Value pool_const_ints(Builder& b, const std::vector<int64_t>& v, ElemType t) {
  std::string lit = "dense<[";
  for (size_t i = 0; i < v.size(); ++i) {
    lit += i ? ", " : "";
    lit += t == ElemType::Pred ? (v[i] ? "true" : "false") : std::to_string(v[i]);
  }
  lit += "]>";
  Type ty{t, {static_cast<int64_t>(v.size())}};
  return b.op("constant", {}, ty, "value = " + lit + " : " + ty.str());
}

// 1-d dense constant of host floats, F32 or F64, as an exact little-endian hex blob.
Value pool_const_floats(Builder& b, const std::vector<double>& v, ElemType t) {
  if (t != ElemType::F32 && t != ElemType::F64) throw Unsupported("pool_const_floats: element type");
  std::string hex = "\"0x";
  char buf[4];
  auto put = [&](const unsigned char* p, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      snprintf(buf, sizeof buf, "%02X", p[i]);
      hex += buf;
    }
  };
  for (double d : v) {
    if (t == ElemType::F64) {
      unsigned char p[8];
      std::memcpy(p, &d, 8);
      put(p, 8);
    } else {
      float f = static_cast<float>(d);
      unsigned char p[4];
      std::memcpy(p, &f, 4);
      put(p, 4);
    }
  }
  hex += "\"";
  Type ty{t, {static_cast<int64_t>(v.size())}};
  return b.op("constant", {}, ty, "value = dense<" + hex + "> : " + ty.str());
}

// x indexed along `dim` by the static positions `idx` (result: dim has idx.size() entries).
// Arithmetic progressions become (strided) slices, "each index repeated f times" a broadcast,
// anything else a gather with constant indices.
Value pool_take(Builder& b, Value x, int64_t dim, const std::vector<int64_t>& idx) {
  const int64_t n = static_cast<int64_t>(idx.size()), r = x.rank(), in = x.shape()[dim];
  if (n == 0) throw Unsupported("pool_take: empty index");
  const int64_t step = n > 1 ? idx[1] - idx[0] : 1;
  bool prog = step >= 1;
  for (int64_t i = 0; i < n && prog; ++i) prog = idx[i] == idx[0] + i * step;
  if (prog) {
    Shape st(r, 0), lim = x.shape(), str(r, 1);
    st[dim] = idx[0];
    lim[dim] = idx[0] + (n - 1) * step + 1;
    str[dim] = step;
    return b.slice(x, st, lim, str);
  }
  // idx[o] == o / f over 0..in-1: nearest-neighbour integer upscale.
  if (in > 0 && n % in == 0) {
    const int64_t f = n / in;
    bool rep = true;
    for (int64_t i = 0; i < n && rep; ++i) rep = idx[i] == i / f;
    if (rep) {
      Shape s1 = x.shape(), s2 = x.shape(), dims;
      s1.insert(s1.begin() + dim + 1, f);
      for (int64_t i = 0; i < r; ++i) dims.push_back(i <= dim ? i : i + 1);
      s2[dim] = n;
      return b.reshape(b.broadcast_in_dim(x, s1, dims), s2);
    }
  }
  Value ind = b.reshape(pool_const_ints(b, idx, ElemType::S64), {n, 1});
  std::vector<int64_t> offs;
  for (int64_t i = 0; i < r; ++i)
    if (i != dim) offs.push_back(i);
  Shape ss = x.shape(), rs = x.shape();
  ss[dim] = 1;
  rs[dim] = n;
  return b.gather(x, ind, offs, {dim}, {dim}, 1, ss, rs);
}

// out[..., q, ...] = sum_j w[q][j] * x[..., lists[q][j], ...] along `dim` (w empty: weight 1).
// Ragged lists are padded to the longest and the padding masked out; the sum runs over a new
// axis of that length (one gather + one reduce).
Value pool_ragged_sum(Builder& b, Value x, int64_t dim, const std::vector<std::vector<int64_t>>& lists,
                      const std::vector<std::vector<double>>& w) {
  const int64_t n = static_cast<int64_t>(lists.size());
  int64_t kmax = 1;
  for (const auto& l : lists) kmax = std::max<int64_t>(kmax, static_cast<int64_t>(l.size()));
  std::vector<int64_t> flat, mask;
  std::vector<double> wf;
  bool masked = false;
  for (int64_t q = 0; q < n; ++q) {
    const auto& l = lists[q];
    for (int64_t j = 0; j < kmax; ++j) {
      bool ok = j < static_cast<int64_t>(l.size());
      masked |= !ok;
      flat.push_back(ok ? l[j] : (l.empty() ? 0 : l.back()));
      mask.push_back(ok);
      if (!w.empty()) wf.push_back(ok ? w[q][j] : 0.0);
    }
  }
  Value g = pool_take(b, x, dim, flat);
  Shape s = x.shape();
  s[dim] = n;
  s.insert(s.begin() + dim + 1, kmax);
  g = b.reshape(g, s);
  if (!w.empty()) {
    Value wc = b.reshape(pool_const_floats(b, wf, g.elem() == ElemType::F64 ? ElemType::F64 : ElemType::F32),
                         {n, kmax});
    g = b.mul(g, b.broadcast_in_dim(b.convert(wc, g.elem()), s, {dim, dim + 1}));
  }
  if (masked) {
    Value m = b.reshape(pool_const_ints(b, mask, ElemType::Pred), {n, kmax});
    g = b.select(b.broadcast_in_dim(m, s, {dim, dim + 1}), g, b.zeros(Type{g.elem(), s}));
  }
  if (kmax == 1) {
    s.erase(s.begin() + dim + 1);
    return b.reshape(g, s);
  }
  return b.reduce(g, b.constant_i(0, g.elem()), {dim + 1}, "add");
}

namespace {

// An int list argument with nsp entries (one value is repeated; empty -> dflt).
std::vector<int64_t> nlist(const OpCall& c, const std::string& n, size_t nsp, std::vector<int64_t> dflt) {
  const Arg* a = c.find(n);
  std::vector<int64_t> v = a && a->kind == Arg::Kind::IntList ? a->ints : std::vector<int64_t>{};
  if (v.empty()) v = std::move(dflt);
  if (v.size() == 1) v.assign(nsp, v[0]);
  if (v.size() != nsp) throw Unsupported(c.name + ": '" + n + "' must have " + std::to_string(nsp) + " entries");
  return v;
}

// Broadcasts a host vector indexed by output position along `dim` to `shape`.
Value along(Builder& b, const std::vector<int64_t>& v, ElemType t, const Shape& shape, int64_t dim) {
  return b.broadcast_in_dim(b.convert(pool_const_ints(b, v, ElemType::S64), t), shape, {dim});
}

// NaN-aware (value, flat index) max, as PyTorch's CPU kernels scan a window:
// `if (val > maxval || isnan(val))` -> the first maximum, or the last NaN. A total order
// (NaN with larger index > NaN > numbers by value, then smaller index), so it is a valid
// commutative/associative reduction body; the init (-inf, INT64_MAX) loses every tie.
std::vector<Value> argmax_body(Builder& b, const std::vector<Value>& a) {
  Value av = a[0], ai = a[1], bv = a[2], bi = a[3];
  Value a_nan = b.compare(Cmp::NE, av, av), b_nan = b.compare(Cmp::NE, bv, bv);
  Value num = b.or_(b.compare(Cmp::GT, bv, av), b.and_(b.compare(Cmp::EQ, bv, av), b.compare(Cmp::LT, bi, ai)));
  Value take_b = b.select(b.and_(a_nan, b_nan), b.compare(Cmp::GT, bi, ai),
                          b.select(b_nan, b.not_(a_nan), b.and_(b.not_(a_nan), num)));
  return {b.select(take_b, bv, av), b.select(take_b, bi, ai)};
}

std::vector<Value> argmax_inits(Builder& b, ElemType e) {
  return {b.lowest(e), b.constant_i(std::numeric_limits<int64_t>::max(), ElemType::S64)};
}

std::vector<Value> argmax_reduce(Builder& b, Value v, Value ix, int64_t ax) {
  return b.reduce_multi({v, ix}, argmax_inits(b, v.elem()), {ax},
                        [&](const std::vector<Value>& a) { return argmax_body(b, a); });
}

// ---- max pooling with indices, nsp spatial dims: one variadic reduce_window over (values,
// flat input index) with the kernel's strides, dilations and padding (padding takes the init
// value, so it never wins against a real element).
std::vector<Value> max_pool_nd(Builder& b, const OpCall& c, size_t nsp) {
  Value x = c.tensor("self");
  if (!shlo::is_float(x.elem()) && x.elem() != ElemType::S64 && x.elem() != ElemType::S32)
    throw Unsupported(c.name + ": dtype");
  auto k = nlist(c, "kernel_size", nsp, {});
  auto s = nlist(c, "stride", nsp, k), p = nlist(c, "padding", nsp, {0}), d = nlist(c, "dilation", nsp, {1});
  const Shape& os = out_type(c, 0).shape;
  const int64_t r = x.rank(), off = r - static_cast<int64_t>(nsp);
  const Shape& xs = x.shape();
  Type it{ElemType::S64, xs};
  Value flat = b.constant_i(0, ElemType::S64, xs);
  int64_t stride = 1;
  for (int64_t i = static_cast<int64_t>(nsp) - 1; i >= 0; --i) {
    flat = b.add(flat, b.mul(b.iota(it, off + i), b.constant_i(stride, ElemType::S64, xs)));
    stride *= xs[off + i];
  }
  Shape win(r, 1), str(r, 1), dil(r, 1), rs = xs;
  std::string pad = "dense<[";
  for (int64_t i = 0; i < r; ++i) {
    int64_t lo = 0, hi = 0;
    if (i >= off) {
      const size_t j = static_cast<size_t>(i - off);
      win[i] = k[j];
      str[i] = s[j];
      dil[i] = d[j];
      lo = p[j];
      const int64_t span = (k[j] - 1) * d[j] + 1;
      hi = std::max<int64_t>(0, (os[i] - 1) * s[j] + span - xs[i] - p[j]);
      rs[i] = (xs[i] + lo + hi - span) / s[j] + 1;
    }
    pad += std::string(i ? ", " : "") + "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  }
  pad += "]> : tensor<" + std::to_string(r) + "x2xi64>";
  const ElemType e = x.elem();
  std::string reg = b.region({Type{e, {}}, Type{ElemType::S64, {}}, Type{e, {}}, Type{ElemType::S64, {}}},
                             [&](const std::vector<Value>& a) { return argmax_body(b, a); });
  auto inits = argmax_inits(b, e);
  auto res = b.op_multi("reduce_window", {x, flat, inits[0], inits[1]}, {Type{e, rs}, Type{ElemType::S64, rs}},
                        "window_dimensions = " + Builder::dense_array(win) +
                            ", window_strides = " + Builder::dense_array(str) +
                            ", window_dilations = " + Builder::dense_array(dil) + ", padding = " + pad,
                        reg);
  if (rs != os) {
    for (Value& v : res) v = b.slice(v, Shape(r, 0), os);
  }
  return {res[0], res[1]};
}

// Backward of every max pooling with indices: scatter-add grad_output into the flat input plane
// (the last nsp dims of grad_input) at `indices`.
Value max_pool_backward(Builder& b, const OpCall& c, size_t nsp) {
  Value go = c.tensor("grad_output"), idx = c.tensor("indices");
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  const int64_t r = o.rank();
  int64_t plane = 1, planes = 1;
  for (int64_t i = 0; i < r; ++i) (i < r - static_cast<int64_t>(nsp) ? planes : plane) *= o.shape[i];
  const int64_t per = go.type.numel() / std::max<int64_t>(planes, 1);
  Value g = b.reshape(b.convert(go, t), {planes, per});
  Value id = b.reshape(b.convert(idx, ElemType::S64), {planes, per, 1});
  Value pl = b.iota(Type{ElemType::S64, {planes, per, 1}}, 0);
  Value full_idx = b.concatenate({pl, id}, 2);
  Value out = b.scatter(b.zeros(Type{t, {planes, plane}}), full_idx, g, {}, {0, 1}, {0, 1}, 2, "add");
  return b.reshape(out, o.shape);
}

// ---- average pooling
struct AvgGeom {
  std::vector<int64_t> k, s, p;
  bool count_include_pad = true;
  int64_t divisor_override = 0;  // 0 = none
};

AvgGeom avg_geom(const OpCall& c, size_t nsp) {
  AvgGeom g;
  g.k = nlist(c, "kernel_size", nsp, {});
  g.s = nlist(c, "stride", nsp, g.k);
  g.p = nlist(c, "padding", nsp, {0});
  g.count_include_pad = c.bool_("count_include_pad", true);
  if (c.has("divisor_override")) {
    g.divisor_override = c.int_("divisor_override");
    if (g.divisor_override == 0) throw Unsupported(c.name + ": divisor_override 0");
  }
  return g;
}

// The divisor of every output window (shape `os`, element type t), as AvgPoolKernel.cpp: the
// window clipped to the padded input (count_include_pad) or to the input; windows that lie
// entirely in padding output 0 (their sum is 0, any nonzero divisor does).
Value avg_divisor(Builder& b, const AvgGeom& g, const Shape& in_shape, const Shape& os, size_t nsp, ElemType t) {
  const int64_t r = static_cast<int64_t>(os.size()), off = r - static_cast<int64_t>(nsp);
  if (g.divisor_override) return b.constant_i(g.divisor_override, t, os);
  Value div;
  for (size_t i = 0; i < nsp; ++i) {
    const int64_t in = in_shape[off + i], on = os[off + i];
    std::vector<int64_t> f;
    for (int64_t o = 0; o < on; ++o) {
      int64_t s0 = o * g.s[i] - g.p[i], e0 = std::min(s0 + g.k[i], in + g.p[i]);
      int64_t cnt = std::min(e0, in) - std::max<int64_t>(s0, 0);
      f.push_back(g.count_include_pad ? e0 - s0 : std::max<int64_t>(cnt, 1));
    }
    Value v = along(b, f, t, os, off + static_cast<int64_t>(i));
    div = i == 0 ? v : b.mul(div, v);
  }
  return div;
}

ElemType avg_type(const OpCall& c, ElemType e) {
  if (shlo::is_float(e)) return opmath(e);
  if (e == ElemType::S64) return e;
  throw Unsupported(c.name + ": dtype");
}

std::vector<Value> avg_pool_nd(Builder& b, const OpCall& c, size_t nsp) {
  Value x = c.tensor("self");
  const Type& o = out_type(c);
  ElemType t = avg_type(c, x.elem());
  AvgGeom g = avg_geom(c, nsp);
  const int64_t r = x.rank(), off = r - static_cast<int64_t>(nsp);
  Shape win(r, 1), str(r, 1);
  std::vector<std::pair<int64_t, int64_t>> pads(r, {0, 0});
  for (size_t i = 0; i < nsp; ++i) {
    const int64_t in = x.shape()[off + i], on = o.shape[off + i];
    win[off + i] = g.k[i];
    str[off + i] = g.s[i];
    pads[off + i] = {g.p[i], std::max<int64_t>(0, (on - 1) * g.s[i] + g.k[i] - in - g.p[i])};
  }
  Value sum = b.reduce_window(b.convert(x, t), b.constant_i(0, t), win, str, pads, "add");
  if (sum.shape() != o.shape) sum = b.slice(sum, Shape(r, 0), o.shape);
  return {b.div(sum, avg_divisor(b, g, x.shape(), o.shape, nsp, t))};
}

// Transpose of the window sum: grad_output / divisor spread back over each window (interior
// padding by stride-1, a stride-1 window sum, then the unpadded input region).
std::vector<Value> avg_pool_backward_nd(Builder& b, const OpCall& c, size_t nsp) {
  Value go = c.tensor("grad_output");
  const Type& o = out_type(c);
  ElemType t = avg_type(c, o.elem);
  AvgGeom g = avg_geom(c, nsp);
  const int64_t r = o.rank(), off = r - static_cast<int64_t>(nsp);
  Value gd = b.div(b.convert(go, t), avg_divisor(b, g, o.shape, go.shape(), nsp, t));
  Shape lo(r, 0), hi(r, 0), interior(r, 0), win(r, 1), st(r, 0), lim = o.shape;
  for (size_t i = 0; i < nsp; ++i) {
    const int64_t in = o.shape[off + i], on = go.shape()[off + i];
    lo[off + i] = g.k[i] - 1;
    interior[off + i] = g.s[i] - 1;
    hi[off + i] = std::max<int64_t>(0, g.p[i] + in - (on - 1) * g.s[i] - 1);
    win[off + i] = g.k[i];
    st[off + i] = g.p[i];
    lim[off + i] = g.p[i] + in;
  }
  Value dp = b.pad(gd, b.constant_i(0, t), lo, hi, interior);
  Value ws = b.reduce_window(dp, b.constant_i(0, t), win, Shape(r, 1), std::vector<std::pair<int64_t, int64_t>>(r, {0, 0}), "add");
  return {b.slice(ws, st, lim)};
}

// ---- adaptive pooling: window o of a dim covers [floor(o*in/out), ceil((o+1)*in/out)).
struct Adaptive {
  std::vector<int64_t> start, end;
  int64_t in = 0, out = 0, kmax = 0;
  bool uniform() const { return in % out == 0; }
};

Adaptive adaptive(int64_t in, int64_t out) {
  Adaptive a;
  a.in = in;
  a.out = out;
  if (out <= 0) throw Unsupported("adaptive pooling: empty output");
  for (int64_t o = 0; o < out; ++o) {
    int64_t s = (o / out) * in + ((o % out) * in) / out, e = 1 + ((o + 1) * in - 1) / out;
    a.start.push_back(s);
    a.end.push_back(e);
    a.kmax = std::max(a.kmax, e - s);
  }
  return a;
}

// Adaptive windows of `dim` gathered into [..., out, kmax, ...] (indices clamped to the window,
// so short windows repeat their last element).
Value adaptive_windows(Builder& b, Value x, int64_t dim, const Adaptive& a) {
  std::vector<int64_t> flat;
  for (int64_t o = 0; o < a.out; ++o)
    for (int64_t j = 0; j < a.kmax; ++j) flat.push_back(std::min(a.start[o] + j, a.end[o] - 1));
  Shape s = x.shape();
  s[dim] = a.out;
  s.insert(s.begin() + dim + 1, a.kmax);
  return b.reshape(pool_take(b, x, dim, flat), s);
}

std::vector<Value> adaptive_avg_nd(Builder& b, const OpCall& c, size_t nsp) {
  Value x = c.tensor("self");
  const Type& o = out_type(c);
  if (!shlo::is_float(x.elem())) throw Unsupported(c.name + ": dtype");
  ElemType t = opmath(x.elem());
  const int64_t r = x.rank(), off = r - static_cast<int64_t>(nsp);
  Value v = b.convert(x, t);
  std::vector<Adaptive> ad;
  for (size_t i = 0; i < nsp; ++i) ad.push_back(adaptive(x.shape()[off + i], o.shape[off + i]));
  for (size_t i = 0; i < nsp; ++i) {
    const int64_t d = off + static_cast<int64_t>(i);
    const Adaptive& a = ad[i];
    if (a.uniform()) {
      Shape s = v.shape();
      s[d] = a.out;
      s.insert(s.begin() + d + 1, a.in / a.out);
      v = b.reduce(b.reshape(v, s), b.constant_i(0, t), {d + 1}, "add");
    } else {
      std::vector<std::vector<int64_t>> lists(a.out);
      for (int64_t q = 0; q < a.out; ++q)
        for (int64_t j = a.start[q]; j < a.end[q]; ++j) lists[q].push_back(j);
      v = pool_ragged_sum(b, v, d, lists, {});
    }
  }
  // AdaptiveAvgPoolKernel.cpp: sum / kh / kw (one division per dim, outer dim first).
  for (size_t i = 0; i < nsp; ++i) {
    std::vector<int64_t> cnt;
    for (int64_t q = 0; q < ad[i].out; ++q) cnt.push_back(ad[i].end[q] - ad[i].start[q]);
    v = b.div(v, along(b, cnt, t, v.shape(), off + static_cast<int64_t>(i)));
  }
  return {v};
}

std::vector<Value> adaptive_avg_backward_nd(Builder& b, const OpCall& c, size_t nsp) {
  Value go = c.tensor("grad_output");
  const Type& o = out_type(c);
  if (!shlo::is_float(o.elem)) throw Unsupported(c.name + ": dtype");
  ElemType t = opmath(o.elem);
  const int64_t r = o.rank(), off = r - static_cast<int64_t>(nsp);
  Value v = b.convert(go, t);
  std::vector<Adaptive> ad;
  for (size_t i = 0; i < nsp; ++i) ad.push_back(adaptive(o.shape[off + i], go.shape()[off + i]));
  for (size_t i = 0; i < nsp; ++i) {
    std::vector<int64_t> cnt;
    for (int64_t q = 0; q < ad[i].out; ++q) cnt.push_back(ad[i].end[q] - ad[i].start[q]);
    v = b.div(v, along(b, cnt, t, v.shape(), off + static_cast<int64_t>(i)));
  }
  for (size_t i = 0; i < nsp; ++i) {
    const int64_t d = off + static_cast<int64_t>(i);
    const Adaptive& a = ad[i];
    // Input position q receives the gradient of every window that covers it.
    std::vector<std::vector<int64_t>> lists(a.in);
    for (int64_t w = 0; w < a.out; ++w)
      for (int64_t q = a.start[w]; q < a.end[w]; ++q) lists[q].push_back(w);
    v = pool_ragged_sum(b, v, d, lists, {});
  }
  return {v};
}

std::vector<Value> adaptive_max_nd(Builder& b, const OpCall& c, size_t nsp) {
  Value x = c.tensor("self");
  const Type& o = out_type(c);
  if (!shlo::is_float(x.elem())) throw Unsupported(c.name + ": dtype");
  const int64_t r = x.rank(), off = r - static_cast<int64_t>(nsp), n = static_cast<int64_t>(nsp);
  std::vector<Adaptive> ad;
  for (int64_t i = 0; i < n; ++i) ad.push_back(adaptive(x.shape()[off + i], o.shape[off + i]));
  // [..., O1, k1, O2, k2, ...]: last dim first keeps the positions of earlier dims.
  Value v = x;
  for (int64_t i = n - 1; i >= 0; --i) v = adaptive_windows(b, v, off + i, ad[i]);
  std::vector<int64_t> perm;
  for (int64_t i = 0; i < off; ++i) perm.push_back(i);
  for (int64_t i = 0; i < n; ++i) perm.push_back(off + 2 * i);
  for (int64_t i = 0; i < n; ++i) perm.push_back(off + 2 * i + 1);
  v = b.transpose(v, perm);
  Shape os(o.shape.begin(), o.shape.end()), ws, ks;
  int64_t K = 1;
  for (int64_t i = 0; i < n; ++i) {
    ws.push_back(ad[i].out);
    ks.push_back(ad[i].kmax);
    K *= ad[i].kmax;
  }
  Shape vs = os;
  vs.push_back(K);
  v = b.reshape(v, vs);
  // Flat input index (within the spatial plane) of every window element.
  Shape fs = ws;
  fs.insert(fs.end(), ks.begin(), ks.end());
  Value flat;
  int64_t stride = 1;
  for (int64_t i = n - 1; i >= 0; --i) {
    std::vector<int64_t> pos;
    for (int64_t q = 0; q < ad[i].out; ++q)
      for (int64_t j = 0; j < ad[i].kmax; ++j) pos.push_back(std::min(ad[i].start[q] + j, ad[i].end[q] - 1) * stride);
    Value pv = b.reshape(pool_const_ints(b, pos, ElemType::S64), {ad[i].out, ad[i].kmax});
    pv = b.broadcast_in_dim(pv, fs, {i, n + i});
    flat = i == n - 1 ? pv : b.add(flat, pv);
    stride *= ad[i].in;
  }
  Shape ps = ws;
  ps.push_back(K);
  std::vector<int64_t> bd;
  for (int64_t i = 0; i <= n; ++i) bd.push_back(off + i);
  Value ix = b.broadcast_in_dim(b.reshape(flat, ps), vs, bd);
  auto res = argmax_reduce(b, v, ix, off + n);
  return {res[0], res[1]};
}

// Inverse of max pooling: output plane position indices[i] takes self[i], zeros elsewhere. With
// repeated indices the CPU kernel's serial loop keeps the last write; a max-scatter of source
// positions finds that writer deterministically, then one gather reads it. (Out-of-range
// indices, an error on CPU, are dropped.)
std::vector<Value> max_unpool_nd(Builder& b, const OpCall& c, size_t nsp) {
  Value x = c.tensor("self"), idx = c.tensor("indices");
  const Type& o = out_type(c);
  const int64_t r = o.rank();
  int64_t plane = 1, planes = 1;
  for (int64_t i = 0; i < r; ++i) (i < r - static_cast<int64_t>(nsp) ? planes : plane) *= o.shape[i];
  if (planes == 0 || plane == 0 || x.type.numel() == 0) return {b.zeros(o)};
  const int64_t per = x.type.numel() / planes;
  Value ind = b.reshape(b.convert(idx, ElemType::S64), {planes, per, 1});
  if (b.checking()) {
    std::string vol;
    for (int64_t i = r - static_cast<int64_t>(nsp); i < r; ++i) vol += (vol.empty() ? "" : "x") + std::to_string(o.shape[i]);
    check(b, b.or_(b.compare(Cmp::LT, ind, b.zeros(ind.type)), b.compare(Cmp::GE, ind, b.constant_i(plane, ElemType::S64, ind.shape()))),
          CheckKind::Runtime, "Found an invalid max index (output volumes are of size " + vol + ")");
  }
  Value full = b.concatenate({b.iota(Type{ElemType::S64, {planes, per, 1}}, 0), ind}, 2);
  Value pos = b.iota(Type{ElemType::S64, {planes, per}}, 1);
  Value last = b.scatter(b.constant_i(-1, ElemType::S64, {planes, plane}), full, pos, {}, {0, 1}, {0, 1}, 2, "maximum");
  Value safe = b.max(last, b.zeros(Type{ElemType::S64, {planes, plane}}));
  Value gi = b.concatenate({b.iota(Type{ElemType::S64, {planes, plane, 1}}, 0), b.reshape(safe, {planes, plane, 1})}, 2);
  Value xv = b.gather(b.reshape(x, {planes, per}), gi, {}, {0, 1}, {0, 1}, 2, {1, 1}, {planes, plane});
  Value hit = b.compare(Cmp::GE, last, b.zeros(Type{ElemType::S64, {planes, plane}}));
  return {b.reshape(b.select(hit, xv, b.zeros(Type{x.elem(), {planes, plane}})), o.shape)};
}

}  // namespace

TPU_LOWER_CHECKED(max_unpool2d) { return max_unpool_nd(b, c, 2); }
TPU_LOWER_CHECKED(max_unpool3d) { return max_unpool_nd(b, c, 3); }

TPU_LOWER(max_pool2d_with_indices) { return max_pool_nd(b, c, 2); }
TPU_LOWER(max_pool3d_with_indices) { return max_pool_nd(b, c, 3); }
TPU_LOWER(max_pool2d_with_indices_backward) { return {max_pool_backward(b, c, 2)}; }
TPU_LOWER(max_pool3d_with_indices_backward) { return {max_pool_backward(b, c, 3)}; }

TPU_LOWER(avg_pool2d) { return avg_pool_nd(b, c, 2); }
TPU_LOWER(avg_pool3d) { return avg_pool_nd(b, c, 3); }
TPU_LOWER(avg_pool2d_backward) { return avg_pool_backward_nd(b, c, 2); }
TPU_LOWER(avg_pool3d_backward) { return avg_pool_backward_nd(b, c, 3); }

TPU_LOWER(_adaptive_avg_pool2d) { return adaptive_avg_nd(b, c, 2); }
TPU_LOWER(_adaptive_avg_pool3d) { return adaptive_avg_nd(b, c, 3); }
TPU_LOWER(_adaptive_avg_pool2d_backward) { return adaptive_avg_backward_nd(b, c, 2); }
TPU_LOWER(_adaptive_avg_pool3d_backward) { return adaptive_avg_backward_nd(b, c, 3); }

TPU_LOWER(adaptive_max_pool2d) { return adaptive_max_nd(b, c, 2); }
TPU_LOWER(adaptive_max_pool3d) { return adaptive_max_nd(b, c, 3); }
TPU_LOWER(adaptive_max_pool2d_backward) { return {max_pool_backward(b, c, 2)}; }
TPU_LOWER(adaptive_max_pool3d_backward) { return {max_pool_backward(b, c, 3)}; }

}  // namespace tpu::lowering
