// Order statistics: median / nanmedian (whole tensor or along a dim, with indices) and kthvalue.
// One stable sort along the dim (NaN greatest, as PyTorch orders it), then a pick per row.
// Ties: CPU's kernels use nth_element, so which of several equal values' index they return is
// unspecified (CUDA differs too); the stable sort returns the k-th in input order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "lowering.h"
#include "shape_util.h"

namespace tpu::lowering {
namespace {

constexpr ElemType I64 = ElemType::S64;

struct Rows {
  Value x;        // the input, flattened to 1-D when there is no dim argument
  int64_t dim;    // the dim reduced over
  Shape row;      // x's shape without dim
};

Rows rows_of(Builder& b, const OpCall& c, const char* op) {
  Value x = c.tensor("self");
  // Empty input: CPU raises for a reduced dim of size 0 (the fallback does it the same way).
  if (x.type.numel() == 0) throw Unsupported(std::string(op) + ": empty input");
  if (!c.has("dim") || x.rank() == 0) {
    Rows r{b.reshape(x, {x.type.numel()}), 0, {}};
    return r;
  }
  int64_t dim = norm_dim(c.int_("dim"), x.rank());
  Shape row = x.shape();
  row.erase(row.begin() + dim);
  return {x, dim, row};
}

// median (ignore_nan = false: any NaN in a row gives NaN and the index of its first NaN) and
// nanmedian (the lower median of the row's non-NaN values; NaN when all are NaN).
std::vector<Value> lower_median(Builder& b, const OpCall& c, bool ignore_nan) {
  const Value& self = c.tensor("self");
  if (self.type.numel() == 0 && is_float(self.elem())) {
    if (!c.has("dim")) return {b.constant_f(NAN, out_type(c).elem)};  // median of nothing: NaN
    if (out_type(c).numel() == 0) return {b.zeros(out_type(c, 0)), b.zeros(out_type(c, 1))};
  }
  Rows r = rows_of(b, c, ignore_nan ? "nanmedian" : "median");
  const int64_t n = r.x.shape()[r.dim];
  auto [sorted, index] = sort_with_indices(b, r.x, r.dim, false);
  Value k = b.constant_i((n - 1) / 2, I64, r.row);
  if (is_float(r.x.elem())) {
    Value nan = b.convert(b.compare(Cmp::NE, r.x, r.x), I64);
    Value finite = b.sub(b.constant_i(n, I64, r.row), sum_drop(b, nan, {r.dim}));  // non-NaN count
    if (ignore_nan) {
      // (count - 1) / 2 truncates toward zero: 0 for an all-NaN row, whose values are all NaN.
      k = b.div(b.sub(finite, b.constant_i(1, I64, r.row)), b.constant_i(2, I64, r.row));
    } else {
      // Sorted NaNs follow the numbers in input order: position `finite` holds the first NaN.
      k = b.select(b.compare(Cmp::LT, finite, b.constant_i(n, I64, r.row)), finite, k);
    }
  }
  std::vector<Value> out{fit(b, pick_along(b, sorted, k, r.dim), out_type(c, 0))};
  if (c.outs.size() > 1) out.push_back(fit(b, pick_along(b, index, k, r.dim), out_type(c, 1)));
  return out;
}

}  // namespace

TPU_LOWER(median) { return lower_median(b, c, false); }
TPU_LOWER(nanmedian) { return lower_median(b, c, true); }

// The k-th smallest (1-based) along dim, NaN greater than every number.
TPU_LOWER(kthvalue) {
  Rows r = rows_of(b, c, "kthvalue");
  const int64_t n = r.x.shape()[r.dim], k = c.int_("k");
  if (k < 1 || k > n) throw Unsupported("kthvalue: k out of range");  // CPU raises its error
  auto [sorted, index] = sort_with_indices(b, r.x, r.dim, false);
  Shape start(r.x.rank(), 0), limit = r.x.shape();
  start[r.dim] = k - 1;
  limit[r.dim] = k;
  return {fit(b, b.slice(sorted, start, limit), out_type(c, 0)), fit(b, b.slice(index, start, limit), out_type(c, 1))};
}

}  // namespace tpu::lowering
