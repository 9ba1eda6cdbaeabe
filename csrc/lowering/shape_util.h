// Small shape helpers shared by the reduction, normalization, loss and ordering lowerings.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "lowering.h"

namespace tpu::lowering {

inline bool contains(const std::vector<int64_t>& dims, int64_t d) {
  return std::find(dims.begin(), dims.end(), d) != dims.end();
}

// A result reshaped to the output's shape when the element counts match (they always should).
inline Value fit(Builder& b, Value v, const Type& o) {
  if (v.type.numel() == o.numel()) return b.reshape(v, o.shape);
  return v;
}

// stablehlo.is_finite: true where x is neither inf nor nan.
inline Value is_finite(Builder& b, Value x) { return b.op("is_finite", {x}, Type{ElemType::Pred, x.shape()}); }

// Sum over `dims`, which are dropped from the shape.
inline Value sum_drop(Builder& b, Value x, const std::vector<int64_t>& dims) {
  return b.reduce(x, b.constant_i(0, x.elem()), dims, "add");
}

// Rows up to this many elements take row_sum's product with ones. Measured against float64 on
// rows of mean 100 (cancellation-prone): up to 2048 its f32 error is at or below the reduce's
// and ATen's; at 4096 it was 3x theirs (each vector lane sums a long run sequentially).
inline constexpr int64_t kRowSumDotMax = 2048;
// Longer rows are first folded kRowSumFold at a time, down to kRowSumFoldTo elements. The last
// level's additions round at the magnitude of the whole row's sum, so it stays short: folding
// only down to 64 left the var of 2560-element rows 2.5x less accurate than the reduce.
inline constexpr int64_t kRowSumFold = 8;
inline constexpr int64_t kRowSumFoldTo = 8;

// Sum over `dims`, dropped from the shape, as sum_drop; when they are x's trailing dims (the
// rows of a normalization, the dim of mean(-1)) of f32/f64, as the product of the [M, n] rows
// with a column of ones. XLA:CPU splits a reduce into a reduce-window and a reduce, two kernels
// of scalar index math; the product is one GEMV: [512, 256..4096] f32 rows summed 1.5-1.8x
// faster (measured alternated in one process). Precision Highest whatever the matmul precision:
// a sum must never take reduced-precision passes.
// Rows over kRowSumDotMax (divisible by 8) are first folded: [M, 8, n/8] summed over the 8, down
// to <= 8 elements, then the product. A reduce over a major dim keeps the minor one, so XLA:CPU
// vectorizes it across the row (independent lanes) and fuses the whole chain with its producer
// into one pass; the minor-dim reduce it replaces became a reduce-window of 32 scalar adds in a
// dependent chain plus a loop writing its input (43% of the kernel time of the 64x4096
// GELU + mean block, perf). Levels of 8 instead of the reduce-window's 32, 32, 4: f32 sums of
// rows of mean 100 (2560..8192) as accurate as ATen's, var/std as before.
inline Value row_sum(Builder& b, Value x, const std::vector<int64_t>& dims) {
  const int64_t r = x.rank(), k = static_cast<int64_t>(dims.size());
  bool trailing = k > 0 && k <= r && (x.elem() == ElemType::F32 || x.elem() == ElemType::F64);
  int64_t n = 1;
  for (int64_t i = 0; trailing && i < k; ++i) {
    trailing = contains(dims, r - k + i);
    n *= x.shape()[r - k + i];
  }
  bool fold = n > kRowSumDotMax && n % kRowSumFold == 0;
  if (!trailing || n <= 1 || (n > kRowSumDotMax && !fold) || x.type.numel() == 0) return sum_drop(b, x, dims);
  Shape outer(x.shape().begin(), x.shape().end() - k);
  int64_t m = x.type.numel() / n;
  Value rows = b.reshape(x, {m, n});
  while (fold && n > kRowSumFoldTo && n % kRowSumFold == 0) {
    n /= kRowSumFold;
    rows = sum_drop(b, b.reshape(rows, {m, kRowSumFold, n}), {1});
  }
  if (n > kRowSumDotMax) return b.reshape(sum_drop(b, rows, {1}), outer);
  struct Highest {  // restores the op's precision on every exit
    Builder& b;
    shlo::Precision saved;
    explicit Highest(Builder& bb) : b(bb), saved(bb.precision()) { b.set_precision(shlo::Precision::Highest); }
    ~Highest() { b.set_precision(saved); }
  } highest(b);
  Value s = b.dot_general(rows, b.constant_f(1.0, x.elem(), {n, 1}), {}, {}, {1}, {0}, x.elem());
  return b.reshape(s, outer);
}

// Mean over `dims` (dropped from the shape) through row_sum, of the rows shifted by their first
// element: the terms x - x0 are small, so the f32 sum's rounding no longer grows with |mean| (a
// GEMV lane sums a long run sequentially; rows of mean 100 gave layer norm 2.3x ATen's error on
// an AVX2 EPYC without the shift, 0.5 ulp of the mean with it). A non-finite first element shifts
// by 0 so that inf/nan rows keep the plain sum's result.
inline Value row_mean(Builder& b, Value x, const std::vector<int64_t>& dims, int64_t n) {
  Shape kept = x.shape(), dropped;
  for (int64_t i = 0; i < x.rank(); ++i) {
    if (contains(dims, i)) kept[i] = 1;
    else dropped.push_back(x.shape()[i]);
  }
  Value count = b.constant_f(static_cast<double>(n), x.elem(), dropped);
  if (x.rank() == 0 || x.type.numel() == 0 || dims.empty()) return b.div(row_sum(b, x, dims), count);
  Value first = b.slice(x, Shape(x.shape().size(), 0), kept);
  Value finite = is_finite(b, first);
  Value shift = b.select(finite, first, b.constant_f(0.0, x.elem(), kept));
  Value rest = b.div(row_sum(b, b.sub(x, b.broadcast_to(shift, x.shape())), dims), count);
  return b.add(b.reshape(shift, dropped), rest);
}

inline std::vector<int64_t> all_dims(int64_t rank) {
  std::vector<int64_t> d;
  for (int64_t i = 0; i < rank; ++i) d.push_back(i);
  return d;
}

// The broadcast of two shapes (numpy rules; the shapes are known to be compatible).
inline Shape bcast_shape(const Shape& a, const Shape& b) {
  size_t n = std::max(a.size(), b.size());
  Shape r(n, 1);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    r[i] = da == 1 ? db : da;
  }
  return r;
}

// Sorts x along dim; returns (values, s64 indices). Stable; NaN is greater than everything, as
// PyTorch orders it (sort, topk, median, kthvalue).
inline std::pair<Value, Value> sort_with_indices(Builder& b, Value x, int64_t dim, bool descending) {
  Value idx = b.iota(Type{ElemType::S64, x.shape()}, dim);
  bool fl = is_float(x.elem());
  auto r = b.sort({x, idx}, dim, [&](const std::vector<Value>& a) {
    Value l = a[0], r = a[1];
    Value lt = b.compare(descending ? Cmp::GT : Cmp::LT, l, r);
    if (!fl) return lt;
    Value ln = b.compare(Cmp::NE, l, l), rn = b.compare(Cmp::NE, r, r);
    // ascending: l < r or (!isnan(l) and isnan(r)); descending: l > r or (isnan(l) and !isnan(r))
    Value nan_order = descending ? b.and_(ln, b.not_(rn)) : b.and_(b.not_(ln), rn);
    return b.or_(lt, nan_order);
  });
  return {r[0], r[1]};
}

// x's element at position k[row] along `dim`, k holding one s64 per row (x's shape without dim):
// a select-sum, so the picked value is exact (NaN stays NaN, -0.0 keeps its sign).
inline Value pick_along(Builder& b, Value x, Value k, int64_t dim) {
  const Shape& s = x.shape();
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < x.rank(); ++i)
    if (i != dim) rows.push_back(i);
  Value hit = b.compare(Cmp::EQ, b.iota(Type{ElemType::S64, s}, dim), b.broadcast_in_dim(k, s, rows));
  // Unpicked slots add -0.0, which leaves every value (and the sign of a picked -0.0) as it is.
  bool fl = is_float(x.elem());
  Value none = fl ? b.constant_f(-0.0, x.elem(), s) : b.zeros(Type{x.elem(), s});
  Value init = fl ? b.constant_f(-0.0, x.elem()) : b.constant_i(0, x.elem());
  return b.reduce(b.select(hit, x, none), init, {dim}, "add");
}

}  // namespace tpu::lowering
