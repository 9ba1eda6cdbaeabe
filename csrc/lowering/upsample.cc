// Upsampling (F.interpolate): nearest, nearest-exact, linear, bilinear, bicubic, trilinear, 1-3
// spatial dims, forward and backward.
//
// Every mode is separable: along each spatial dim, output o is a fixed set of taps
// sum_j w_j[o] * x[idx_j[o]]. Shapes, align_corners and scales are static (part of the compile
// key), so the taps are computed on the host with PyTorch's CPU formulas and types (UpSample.h:
// float index math for nearest, opmath (float, or double for float64) for weights) and enter
// the program as constants. Forward applies the taps dim by dim, last dim first, which is the
// order of PyTorch's separable CPU kernel (sum over W inside, then H, then D). Backward is the
// transpose: input position q sums w * grad over every (o, tap) that read it (one gather + one
// reduce per dim, no scatter).
#include <algorithm>
#include <cmath>
#include <optional>

#include "lowering.h"
#include "pool_common.h"

namespace tpu::lowering {

namespace {

enum class Mode { Nearest, NearestExact, Linear, Cubic, AALinear, AACubic };
using Scale = std::optional<double>;

struct Taps {  // out[o] = sum_j w[j][o] * in[idx[j][o]]; nearest modes have one tap and no w
  std::vector<std::vector<int64_t>> idx;
  std::vector<std::vector<double>> w;
};

template <typename T>
T compute_scales_value(Scale scale, int64_t in, int64_t out) {
  return (scale && *scale > 0.) ? static_cast<T>(1.0 / *scale) : (static_cast<T>(in) / out);
}

template <typename T>
T area_pixel_scale(int64_t in, int64_t out, bool align_corners, Scale scale) {
  if (align_corners) return out > 1 ? static_cast<T>(in - 1) / (out - 1) : T(0);
  return compute_scales_value<T>(scale, in, out);
}

template <typename T>
T source_index(T scale, int64_t o, bool align_corners, bool cubic) {
  if (align_corners) return scale * o;
  T src = scale * (o + static_cast<T>(0.5)) - static_cast<T>(0.5);
  return (!cubic && src < T(0)) ? T(0) : src;
}

// guard_index_and_lambda: PyTorch floors through floorf even for double.
template <typename T>
void guard(T real, int64_t in, int64_t& index, T& lambda) {
  index = std::min(static_cast<int64_t>(std::floor(static_cast<float>(real))), in - 1);
  lambda = std::min(std::max(real - index, T(0)), T(1));
}

template <typename T>
T cubic1(T x, T A) {
  return ((A + 2) * x - (A + 3)) * x * x + 1;
}
template <typename T>
T cubic2(T x, T A) {
  return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A;
}

template <typename T>
Taps interp_taps(Mode m, int64_t in, int64_t out, bool ac, Scale sc) {
  Taps t;
  if (m == Mode::Nearest || m == Mode::NearestExact) {
    t.idx.resize(1);
    const float scale = compute_scales_value<float>(sc, in, out);
    for (int64_t o = 0; o < out; ++o) {
      int64_t i;
      if (m == Mode::NearestExact) {
        i = std::min(static_cast<int64_t>(std::floor(static_cast<float>((o + 0.5) * scale))), in - 1);
      } else if (out == in) {
        i = o;
      } else if (out == 2 * in) {
        i = o >> 1;
      } else {
        i = std::min(static_cast<int64_t>(std::floor(o * scale)), in - 1);
      }
      t.idx[0].push_back(i);
    }
    return t;
  }
  const T ratio = area_pixel_scale<T>(in, out, ac, sc);
  if (m == Mode::Linear) {
    t.idx.resize(2);
    t.w.resize(2);
    for (int64_t o = 0; o < out; ++o) {
      int64_t i0 = o, i1 = o;
      T l0 = 1, l1 = 0;
      if (out != in) {
        guard(source_index<T>(ratio, o, ac, false), in, i0, l1);
        i1 = i0 + (i0 < in - 1 ? 1 : 0);
        l0 = T(1) - l1;
      }
      t.idx[0].push_back(i0);
      t.idx[1].push_back(i1);
      t.w[0].push_back(l0);
      t.w[1].push_back(l1);
    }
    return t;
  }
  t.idx.resize(4);
  t.w.resize(4);
  const T A = static_cast<T>(-0.75);
  for (int64_t o = 0; o < out; ++o) {
    int64_t i;
    T lam;
    guard(source_index<T>(ratio, o, ac, true), in, i, lam);
    T x2 = static_cast<T>(1.0 - lam);
    T co[4] = {cubic2<T>(static_cast<T>(lam + 1.0), A), cubic1<T>(lam, A), cubic1<T>(x2, A),
               cubic2<T>(static_cast<T>(x2 + 1.0), A)};
    for (int j = 0; j < 4; ++j) {
      t.idx[j].push_back(std::max<int64_t>(std::min<int64_t>(i - 1 + j, in - 1), 0));
      t.w[j].push_back(co[j]);
    }
  }
  return t;
}

// Antialiased modes (_upsample_*_aa, HelperInterpBase::_compute_indices_min_size_weights_aa):
// output o averages input [xmin, xmin + xsize) with a triangle (bilinear) or Keys cubic (a=-0.5)
// filter stretched by the downscale factor, normalized to sum 1. Ragged: lists[o], w[o].
struct Ragged {
  std::vector<std::vector<int64_t>> idx;
  std::vector<std::vector<double>> w;
};

template <typename T>
Ragged aa_taps(Mode m, int64_t in, int64_t out, bool ac, Scale sc) {
  const int interp = m == Mode::AALinear ? 2 : 4;
  auto filter = [&](T x) -> T {
    x = std::abs(x);
    if (m == Mode::AALinear) return x < 1.0 ? static_cast<T>(1.0 - x) : T(0);
    const T a = static_cast<T>(-0.5);
    if (x < 1.0) return cubic1<T>(x, a);
    if (x < 2.0) return cubic2<T>(x, a);
    return T(0);
  };
  const T scale = area_pixel_scale<T>(in, out, ac, sc);
  const T support = static_cast<T>(scale >= 1.0 ? (interp * 0.5) * scale : interp * 0.5);
  const int64_t max_interp = static_cast<int64_t>(std::ceil(support)) * 2 + 1;
  const T invscale = static_cast<T>(scale >= 1.0 ? 1.0 / scale : 1.0);
  Ragged r;
  for (int64_t i = 0; i < out; ++i) {
    const T center = static_cast<T>(scale * (i + 0.5));
    const int64_t xmin = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5), 0);
    int64_t xsize = std::min<int64_t>(static_cast<int64_t>(center + support + 0.5), in) - xmin;
    xsize = std::clamp<int64_t>(xsize, 0, max_interp);
    std::vector<T> w;
    T total = 0;
    for (int64_t j = 0; j < xsize; ++j) {
      w.push_back(filter(static_cast<T>((j + xmin - center + 0.5) * invscale)));
      total += w.back();
    }
    if (total != 0.0)
      for (T& v : w) v /= total;
    r.idx.emplace_back();
    r.w.emplace_back();
    for (int64_t j = 0; j < xsize; ++j) {
      r.idx.back().push_back(xmin + j);
      r.w.back().push_back(w[j]);
    }
  }
  return r;
}

bool antialias(Mode m) { return m == Mode::AALinear || m == Mode::AACubic; }

// Taps of a dim as ragged per-output lists (every mode).
Ragged ragged_for(Mode m, int64_t in, int64_t out, bool ac, Scale sc, ElemType compute);

Taps taps_for(Mode m, int64_t in, int64_t out, bool ac, Scale sc, ElemType compute) {
  return compute == ElemType::F64 ? interp_taps<double>(m, in, out, ac, sc) : interp_taps<float>(m, in, out, ac, sc);
}

Ragged ragged_for(Mode m, int64_t in, int64_t out, bool ac, Scale sc, ElemType compute) {
  if (antialias(m))
    return compute == ElemType::F64 ? aa_taps<double>(m, in, out, ac, sc) : aa_taps<float>(m, in, out, ac, sc);
  Taps t = taps_for(m, in, out, ac, sc, compute);
  Ragged r;
  r.idx.resize(out);
  r.w.resize(t.w.empty() ? 0 : out);
  for (int64_t o = 0; o < out; ++o)
    for (size_t j = 0; j < t.idx.size(); ++j) {
      r.idx[o].push_back(t.idx[j][o]);
      if (!t.w.empty()) r.w[o].push_back(t.w[j][o]);
    }
  return r;
}

std::vector<Scale> scales(const OpCall& c, size_t nsp) {
  static const std::vector<std::vector<std::string>> names = {
      {"scales"}, {"scales_h", "scales_w"}, {"scales_d", "scales_h", "scales_w"}};
  std::vector<Scale> s;
  for (const std::string& n : names.at(nsp - 1)) s.push_back(c.has(n) ? Scale(c.arg(n).d) : std::nullopt);
  return s;
}

bool nearest(Mode m) { return m == Mode::Nearest || m == Mode::NearestExact; }

// The dtypes PyTorch's CPU kernels implement (others raise there, so they go to the fallback).
void check_dtype(const OpCall& c, Mode m, ElemType e, bool backward) {
  if (shlo::is_float(e)) return;
  if (nearest(m) && !backward && e == ElemType::U8) return;
  // uint8 antialias / linear / cubic use PyTorch's integer-weight kernels: left to the fallback.
  throw Unsupported(c.name + ": dtype");
}

Value weights_along(Builder& b, const std::vector<double>& w, ElemType t, const Shape& shape, int64_t dim) {
  Value wc = pool_const_floats(b, w, t == ElemType::F64 ? ElemType::F64 : ElemType::F32);
  return b.broadcast_in_dim(b.convert(wc, t), shape, {dim});
}

std::vector<Value> upsample(Builder& b, const OpCall& c, Mode m, size_t nsp) {
  if (!c.find("self")) throw Unsupported(c.name + ": only the output_size/scales overloads are lowered");
  Value x = c.tensor("self");
  const Type& o = out_type(c);
  check_dtype(c, m, x.elem(), false);
  const bool ac = c.bool_("align_corners", false);
  const auto sc = scales(c, nsp);
  const ElemType t = nearest(m) ? x.elem() : opmath(x.elem());
  const int64_t r = x.rank(), off = r - static_cast<int64_t>(nsp);
  Value v = b.convert(x, t);
  for (int64_t i = static_cast<int64_t>(nsp) - 1; i >= 0; --i) {
    const int64_t d = off + i;
    if (antialias(m)) {  // the separable AA kernel skips dims whose size does not change
      if (x.shape()[d] != o.shape[d]) {
        Ragged rg = ragged_for(m, x.shape()[d], o.shape[d], ac, sc[i], t);
        v = pool_ragged_sum(b, v, d, rg.idx, rg.w);
      }
      continue;
    }
    Taps tp = taps_for(m, x.shape()[d], o.shape[d], ac, sc[i], t);
    if (nearest(m)) {
      v = pool_take(b, v, d, tp.idx[0]);
      continue;
    }
    Value acc;
    for (size_t j = 0; j < tp.idx.size(); ++j) {
      Value xj = pool_take(b, v, d, tp.idx[j]);
      Value term = b.mul(xj, weights_along(b, tp.w[j], t, xj.shape(), d));
      acc = j == 0 ? term : b.add(acc, term);
    }
    v = acc;
  }
  return {v};
}

std::vector<Value> upsample_backward(Builder& b, const OpCall& c, Mode m, size_t nsp) {
  Value g = c.tensor("grad_output");
  const Type& o = out_type(c);  // input_size
  check_dtype(c, m, o.elem, true);
  const bool ac = c.bool_("align_corners", false);
  const auto sc = scales(c, nsp);
  const ElemType t = opmath(o.elem);
  const int64_t r = o.rank(), off = r - static_cast<int64_t>(nsp);
  Value v = b.convert(g, t);
  for (int64_t i = static_cast<int64_t>(nsp) - 1; i >= 0; --i) {
    const int64_t d = off + i, in = o.shape[d], out = g.shape()[d];
    if (antialias(m) && in == out) continue;
    Ragged rg = ragged_for(m, in, out, ac, sc[i], t);
    std::vector<std::vector<int64_t>> lists(in);
    std::vector<std::vector<double>> ws(nearest(m) ? 0 : in);
    for (int64_t q = 0; q < out; ++q)
      for (size_t j = 0; j < rg.idx[q].size(); ++j) {
        lists[rg.idx[q][j]].push_back(q);
        if (!nearest(m)) ws[rg.idx[q][j]].push_back(rg.w[q][j]);
      }
    v = pool_ragged_sum(b, v, d, lists, ws);
  }
  return {v};
}

}  // namespace

TPU_LOWER(upsample_nearest1d) { return upsample(b, c, Mode::Nearest, 1); }
TPU_LOWER(upsample_nearest2d) { return upsample(b, c, Mode::Nearest, 2); }
TPU_LOWER(upsample_nearest3d) { return upsample(b, c, Mode::Nearest, 3); }
TPU_LOWER(_upsample_nearest_exact1d) { return upsample(b, c, Mode::NearestExact, 1); }
TPU_LOWER(_upsample_nearest_exact2d) { return upsample(b, c, Mode::NearestExact, 2); }
TPU_LOWER(_upsample_nearest_exact3d) { return upsample(b, c, Mode::NearestExact, 3); }
TPU_LOWER(upsample_linear1d) { return upsample(b, c, Mode::Linear, 1); }
TPU_LOWER(upsample_bilinear2d) { return upsample(b, c, Mode::Linear, 2); }
TPU_LOWER(upsample_trilinear3d) { return upsample(b, c, Mode::Linear, 3); }
TPU_LOWER(upsample_bicubic2d) { return upsample(b, c, Mode::Cubic, 2); }

TPU_LOWER(_upsample_bilinear2d_aa) { return upsample(b, c, Mode::AALinear, 2); }
TPU_LOWER(_upsample_bicubic2d_aa) { return upsample(b, c, Mode::AACubic, 2); }

TPU_LOWER(upsample_nearest1d_backward) { return upsample_backward(b, c, Mode::Nearest, 1); }
TPU_LOWER(upsample_nearest2d_backward) { return upsample_backward(b, c, Mode::Nearest, 2); }
TPU_LOWER(upsample_nearest3d_backward) { return upsample_backward(b, c, Mode::Nearest, 3); }
TPU_LOWER(_upsample_nearest_exact1d_backward) { return upsample_backward(b, c, Mode::NearestExact, 1); }
TPU_LOWER(_upsample_nearest_exact2d_backward) { return upsample_backward(b, c, Mode::NearestExact, 2); }
TPU_LOWER(_upsample_nearest_exact3d_backward) { return upsample_backward(b, c, Mode::NearestExact, 3); }
TPU_LOWER(upsample_linear1d_backward) { return upsample_backward(b, c, Mode::Linear, 1); }
TPU_LOWER(upsample_bilinear2d_backward) { return upsample_backward(b, c, Mode::Linear, 2); }
TPU_LOWER(upsample_trilinear3d_backward) { return upsample_backward(b, c, Mode::Linear, 3); }
TPU_LOWER(upsample_bicubic2d_backward) { return upsample_backward(b, c, Mode::Cubic, 2); }
TPU_LOWER(_upsample_bilinear2d_aa_backward) { return upsample_backward(b, c, Mode::AALinear, 2); }
TPU_LOWER(_upsample_bicubic2d_aa_backward) { return upsample_backward(b, c, Mode::AACubic, 2); }

}  // namespace tpu::lowering
