// grid_sampler_2d (F.grid_sample on 4-D input): bilinear, nearest and bicubic interpolation with
// zeros, border and reflection padding, following PyTorch's CPU kernel (GridSampler.h,
// cpu/GridSamplerKernel.cpp): grid coordinates in [-1, 1] are unnormalized to pixel space
// ((x + 1) * size / 2 - 0.5, or (x + 1) * (size - 1) / 2 with align_corners), padded, and each
// tap reads one [C] row of the input; a tap outside the image reads 0 (zeros padding).
// Taps are one gather per tap from the input laid out as [N * H * W, C]. Math runs in the input's
// own type: float/double take CPU's vectorized formulas, half types CPU's scalar kernel
// (grid_sampler_2d_cpu_fallback), whose every step rounds to the half type.
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "lowering.h"
#include "shape_util.h"

namespace tpu::lowering {
namespace {

constexpr ElemType I64 = ElemType::S64;
enum Interp : int64_t { kBilinear = 0, kNearest = 1, kBicubic = 2 };
enum Padding : int64_t { kZeros = 0, kBorder = 1, kReflection = 2 };

struct Sampler {
  Builder& b;
  ElemType t;             // compute type: the input's
  bool scalar_kernel;     // half types: CPU's scalar formulas
  int64_t N, C, H, W, P;  // P = output pixels per image (Ho * Wo)
  int64_t padding;
  bool align;
  Value table;            // input as [N * H * W, C]
  Value base;             // [N, P] s64: n * H * W

  Shape ps() const { return {N, P}; }
  Value k(double v) const { return b.constant_f(v, t, ps()); }

  Value unnormalize(Value x, int64_t size) const {
    if (scalar_kernel) {  // ((x + 1) / 2) * (size - 1), or ((x + 1) * size - 1) / 2
      if (align) return b.mul(b.div(b.add(x, k(1)), k(2)), k(static_cast<double>(size - 1)));
      return b.div(b.sub(b.mul(b.add(x, k(1)), k(static_cast<double>(size))), k(1)), k(2));
    }
    if (align) return b.mul(b.add(x, k(1)), k((size - 1) / 2.0));
    return b.sub(b.mul(b.add(x, k(1)), k(size / 2.0)), k(0.5));
  }
  Value clip(Value x, int64_t size) const { return b.min(k(static_cast<double>(size - 1)), b.max(x, k(0))); }
  // PyTorch's reflect_coordinates over [twice_low / 2, twice_high / 2].
  Value reflect(Value x, int64_t twice_low, int64_t twice_high) const {
    if (twice_low == twice_high) return k(0);
    double lo = twice_low / 2.0, span = (twice_high - twice_low) / 2.0;
    Value in = b.abs(b.sub(x, k(lo)));
    Value extra = b.rem(in, k(span));  // fmod
    Value flips = b.floor(b.div(in, k(span)));
    Value even = b.compare(Cmp::EQ, b.rem(flips, k(2)), k(0));
    return b.select(even, b.add(extra, k(lo)), b.add(b.sub(k(span), extra), k(lo)));
  }
  // compute_coordinates: border clips, reflection reflects then clips, zeros leaves as is.
  Value pad(Value x, int64_t size) const {
    if (padding == kBorder) return clip(x, size);
    if (padding == kReflection)
      return clip(align ? reflect(x, 0, 2 * (size - 1)) : reflect(x, -1, 2 * size - 1), size);
    return x;
  }
  // (pad(x), d pad(x) / dx): compute_coordinates_set_grad. Clipping passes gradient only
  // strictly inside (0, size - 1); reflection flips its sign on odd reflections.
  std::pair<Value, Value> clip_with_grad(Value x, int64_t size) const {
    Value edge = b.or_(b.compare(Cmp::LE, x, k(0)), b.compare(Cmp::GE, x, k(static_cast<double>(size - 1))));
    return {clip(x, size), b.select(edge, k(0), k(1))};
  }
  std::pair<Value, Value> reflect_with_grad(Value x, int64_t twice_low, int64_t twice_high) const {
    if (twice_low == twice_high) return {k(0), k(0)};
    double lo = twice_low / 2.0, span = (twice_high - twice_low) / 2.0;
    Value d = b.sub(x, k(lo));
    Value sign = b.select(b.compare(Cmp::LT, d, k(0)), k(-1), k(1));
    Value in = b.abs(d);
    Value extra = b.rem(in, k(span));
    Value even = b.compare(Cmp::EQ, b.rem(b.floor(b.div(in, k(span))), k(2)), k(0));
    return {b.select(even, b.add(extra, k(lo)), b.add(b.sub(k(span), extra), k(lo))),
            b.select(even, sign, b.neg(sign))};
  }
  std::pair<Value, Value> pad_with_grad(Value x, int64_t size) const {
    if (padding == kBorder) return clip_with_grad(x, size);
    if (padding == kReflection) {
      auto [r, gr] = align ? reflect_with_grad(x, 0, 2 * (size - 1)) : reflect_with_grad(x, -1, 2 * size - 1);
      auto [v, gc] = clip_with_grad(r, size);
      return {v, b.mul(gr, gc)};
    }
    return {x, k(1)};
  }
  // d unnormalize(x) / dx
  double unnormalize_grad(int64_t size) const { return align ? (size - 1) / 2.0 : size / 2.0; }

  // The table row of integer-valued float coordinates (x, y) as [N * P, 1] s64 (row 0 of the
  // image outside it), and whether they are inside the image ([N, P, C] pred).
  std::pair<Value, Value> locate(Value x, Value y) const {
    Value inside = b.and_(b.and_(b.compare(Cmp::GE, x, k(0)), b.compare(Cmp::LE, x, k(static_cast<double>(W - 1)))),
                          b.and_(b.compare(Cmp::GE, y, k(0)), b.compare(Cmp::LE, y, k(static_cast<double>(H - 1)))));
    Value xi = b.convert(b.select(inside, x, k(0)), I64), yi = b.convert(b.select(inside, y, k(0)), I64);
    Value row = b.add(base, b.add(b.mul(yi, b.constant_i(W, I64, ps())), xi));
    return {b.reshape(row, {N * P, 1}), b.broadcast_in_dim(inside, {N, P, C}, {0, 1})};
  }
  // The input rows at integer-valued float coordinates (x, y) as [N, P, C]; 0 outside the image.
  Value tap(Value x, Value y) const {
    auto [row, inside] = locate(x, y);
    Value v = b.reshape(b.gather(table, row, {1}, {0}, {0}, 1, {1, C}, {N * P, C}), {N, P, C});
    return b.select(inside, v, b.zeros(Type{t, {N, P, C}}));
  }
  // grad_input += `g` ([N, P, C]) at the taps (x, y) inside the image.
  Value scatter_tap(Value grad_input, Value x, Value y, Value g) const {
    auto [row, inside] = locate(x, y);
    Value upd = b.reshape(b.select(inside, g, b.zeros(Type{t, {N, P, C}})), {N * P, C});
    return b.scatter(grad_input, row, upd, {1}, {0}, {0}, 1, "add");
  }
  Value weighted(Value v, Value w) const { return b.mul(v, b.broadcast_in_dim(w, {N, P, C}, {0, 1})); }
};

// PyTorch's cubic convolution coefficients (A = -0.75) for the 4 taps around a fraction t.
std::vector<Value> cubic_coeffs(const Sampler& s, Value t) {
  Builder& b = s.b;
  const double A = -0.75;
  auto cc1 = [&](Value x) {  // ((A + 2) x - (A + 3)) x x + 1, |x| <= 1
    return b.add(b.mul(b.mul(b.sub(b.mul(s.k(A + 2), x), s.k(A + 3)), x), x), s.k(1));
  };
  auto cc2 = [&](Value x) {  // ((A x - 5 A) x + 8 A) x - 4 A, 1 < |x| < 2
    return b.sub(b.mul(b.add(b.mul(b.sub(b.mul(s.k(A), x), s.k(5 * A)), x), s.k(8 * A)), x), s.k(4 * A));
  };
  Value one = s.k(1);
  if (s.scalar_kernel) {  // x2 = 1 - t rounded first; the last tap is cc2(x2 + 1)
    Value x2 = b.sub(one, t);
    return {cc2(b.add(t, one)), cc1(t), cc1(x2), cc2(b.add(x2, one))};
  }
  return {cc2(b.add(t, one)), cc1(t), cc1(b.sub(one, t)), cc2(b.sub(s.k(2), t))};
}

}  // namespace

TPU_LOWER(grid_sampler_2d) {
  const Type& o = out_type(c);
  Value input = c.tensor("input"), grid = c.tensor("grid");
  if (input.rank() != 4 || grid.rank() != 4) throw Unsupported("grid_sampler_2d: expects 4-D input and grid");
  const int64_t interp = c.int_("interpolation_mode"), padding = c.int_("padding_mode");
  if (interp < 0 || interp > 2 || padding < 0 || padding > 2) throw Unsupported("grid_sampler_2d: mode");
  const ElemType t = o.elem;
  if (!is_float(t)) throw Unsupported("grid_sampler_2d: non-float input");
  const int64_t N = input.shape()[0], C = input.shape()[1], H = input.shape()[2], W = input.shape()[3];
  const int64_t Ho = grid.shape()[1], Wo = grid.shape()[2], P = Ho * Wo;
  if (o.numel() == 0) return {b.zeros(o)};
  if (H * W == 0) return {b.zeros(o)};  // every tap is outside an empty image
  Value table = b.reshape(b.transpose(b.convert(input, t), {0, 2, 3, 1}), {N * H * W, C});
  Value base = b.mul(b.iota(Type{I64, {N, P}}, 0), b.constant_i(H * W, I64, {N, P}));
  const bool scalar_kernel = t != ElemType::F32 && t != ElemType::F64;
  Sampler s{b, t, scalar_kernel, N, C, H, W, P, padding, c.bool_("align_corners"), table, base};
  Value g = b.reshape(b.convert(grid, t), {N, P, 2});
  Value gx = b.reshape(b.slice(g, {0, 0, 0}, {N, P, 1}), {N, P});
  Value gy = b.reshape(b.slice(g, {0, 0, 1}, {N, P, 2}), {N, P});
  Value x = s.unnormalize(gx, W), y = s.unnormalize(gy, H);
  Value out;
  if (interp == kBicubic) {
    // Taps around the unpadded coordinate; padding applies to each tap's own coordinate.
    Value x0 = b.floor(x), y0 = b.floor(y);
    std::vector<Value> cx = cubic_coeffs(s, b.sub(x, x0)), cy = cubic_coeffs(s, b.sub(y, y0));
    for (int j = 0; j < 4; ++j) {
      Value row;
      Value yj = s.pad(b.add(y0, s.k(j - 1)), H);
      for (int i = 0; i < 4; ++i) {
        Value v = s.weighted(s.tap(s.pad(b.add(x0, s.k(i - 1)), W), yj), cx[i]);
        row = i == 0 ? v : b.add(row, v);
      }
      Value v = s.weighted(row, cy[j]);
      out = j == 0 ? v : b.add(out, v);
    }
  } else {
    x = s.pad(x, W);
    y = s.pad(y, H);
    if (interp == kNearest) {
      out = s.tap(b.unary("round_nearest_even", x), b.unary("round_nearest_even", y));
    } else {
      Value xw = b.floor(x), yn = b.floor(y), xe = b.add(xw, s.k(1)), ys = b.add(yn, s.k(1));
      Value fe, fw, fs, fn;  // weights toward east, west, south, north
      if (scalar_kernel) {   // (ix_se - ix) * (iy_se - iy), ...
        fe = b.sub(x, xw), fw = b.sub(xe, x), fs = b.sub(y, yn), fn = b.sub(ys, y);
      } else {               // w = x - floor(x), e = 1 - w, ...
        fe = b.sub(x, xw), fw = b.sub(s.k(1), fe), fs = b.sub(y, yn), fn = b.sub(s.k(1), fs);
      }
      out = b.add(b.add(b.add(s.weighted(s.tap(xw, yn), b.mul(fn, fw)), s.weighted(s.tap(xe, yn), b.mul(fn, fe))),
                        s.weighted(s.tap(xw, ys), b.mul(fs, fw))),
                  s.weighted(s.tap(xe, ys), b.mul(fs, fe)));
    }
  }
  out = b.transpose(b.reshape(out, {N, Ho, Wo, C}), {0, 3, 1, 2});
  return {b.convert(out, o.elem)};
}

// Gradients of grid_sampler_2d for bilinear and nearest interpolation (bicubic runs on the CPU
// fallback), following CPU's kernel: grad_input scatter-adds grad_output times each tap's
// weight; grad_grid is the derivative of the bilinear weights times the tap values, summed over
// channels, times the derivative of unnormalize and padding (nearest: zero).
TPU_LOWER(grid_sampler_2d_backward) {
  Value go = c.tensor("grad_output"), input = c.tensor("input"), grid = c.tensor("grid");
  const int64_t interp = c.int_("interpolation_mode"), padding = c.int_("padding_mode");
  if (input.rank() != 4 || grid.rank() != 4 || interp == kBicubic || interp < 0 || interp > 2 || padding < 0 ||
      padding > 2)
    throw Unsupported("grid_sampler_2d_backward: bicubic or unknown mode");
  std::vector<int64_t> mask = c.has("output_mask") ? c.ints("output_mask") : std::vector<int64_t>{};
  mask.resize(2, 1);
  const ElemType t = opmath(input.elem());
  const int64_t N = input.shape()[0], C = input.shape()[1], H = input.shape()[2], W = input.shape()[3];
  const int64_t Ho = grid.shape()[1], Wo = grid.shape()[2], P = Ho * Wo;
  auto fit_out = [&](Value v, size_t i) {  // an output not asked for (output_mask) is not [..]
    const Type& ot = out_type(c, i);
    return ot.numel() == v.type.numel() ? b.convert(b.reshape(v, ot.shape), ot.elem) : b.zeros(ot);
  };
  if (N * C * H * W == 0 || P == 0)
    return {fit_out(b.zeros(Type{t, input.shape()}), 0), fit_out(b.zeros(Type{t, grid.shape()}), 1)};
  Value table = b.reshape(b.transpose(b.convert(input, t), {0, 2, 3, 1}), {N * H * W, C});
  Value base = b.mul(b.iota(Type{I64, {N, P}}, 0), b.constant_i(H * W, I64, {N, P}));
  Sampler s{b, t, false, N, C, H, W, P, padding, c.bool_("align_corners"), table, base};
  Value g = b.reshape(b.transpose(b.convert(go, t), {0, 2, 3, 1}), {N, P, C});
  Value gr = b.reshape(b.convert(grid, t), {N, P, 2});
  Value gx = b.reshape(b.slice(gr, {0, 0, 0}, {N, P, 1}), {N, P});
  Value gy = b.reshape(b.slice(gr, {0, 0, 1}, {N, P, 2}), {N, P});
  auto [x, dx] = s.pad_with_grad(s.unnormalize(gx, W), W);
  auto [y, dy] = s.pad_with_grad(s.unnormalize(gy, H), H);
  Value gi = b.zeros(Type{t, {N * H * W, C}});
  Value ggrid = b.zeros(Type{t, {N, P, 2}});
  if (interp == kNearest) {
    if (mask[0]) gi = s.scatter_tap(gi, b.unary("round_nearest_even", x), b.unary("round_nearest_even", y), g);
  } else {
    Value xw = b.floor(x), yn = b.floor(y), xe = b.add(xw, s.k(1)), ys = b.add(yn, s.k(1));
    Value fe = b.sub(x, xw), fw = b.sub(s.k(1), fe), fs = b.sub(y, yn), fn = b.sub(s.k(1), fs);
    auto wg = [&](Value w) { return s.weighted(g, w); };
    if (mask[0]) {
      gi = s.scatter_tap(gi, xw, yn, wg(b.mul(fn, fw)));
      gi = s.scatter_tap(gi, xe, yn, wg(b.mul(fn, fe)));
      gi = s.scatter_tap(gi, xw, ys, wg(b.mul(fs, fw)));
      gi = s.scatter_tap(gi, xe, ys, wg(b.mul(fs, fe)));
    }
    if (mask[1]) {
      Value nw = s.tap(xw, yn), ne = s.tap(xe, yn), sw = s.tap(xw, ys), se = s.tap(xe, ys);
      // d/dx: east taps minus west taps, weighted by the y weights; d/dy likewise.
      Value ddx = b.add(s.weighted(b.sub(ne, nw), fn), s.weighted(b.sub(se, sw), fs));
      Value ddy = b.add(s.weighted(b.sub(sw, nw), fw), s.weighted(b.sub(se, ne), fe));
      Value gix = b.mul(sum_drop(b, b.mul(ddx, g), {2}), b.mul(dx, s.k(s.unnormalize_grad(W))));
      Value giy = b.mul(sum_drop(b, b.mul(ddy, g), {2}), b.mul(dy, s.k(s.unnormalize_grad(H))));
      ggrid = b.concatenate({b.reshape(gix, {N, P, 1}), b.reshape(giy, {N, P, 1})}, 2);
    }
  }
  Value grad_input = b.transpose(b.reshape(gi, {N, H, W, C}), {0, 3, 1, 2});
  return {fit_out(grad_input, 0), fit_out(b.reshape(ggrid, {N, Ho, Wo, 2}), 1)};
}

}  // namespace tpu::lowering
