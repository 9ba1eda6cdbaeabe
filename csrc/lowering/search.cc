// Counting and searching: histc, bincount, bucketize, searchsorted, cummax, cummin.
//
// All of these run without a host sync except bincount, whose output length depends on the data:
// its tpu kernel (csrc/aten/explicit_kernels.cc) reads min/max back once, sizes the output, and the
// lowering here only scatters into that output.
//
// - histc bins like PyTorch's CPU kernel for floats (linear interpolation in the input dtype,
//   values outside [min, max] and NaN skipped, the last edge counted in the last bin,
//   min == max -> data min/max, still equal -> +-1), and like CUDA's for integer inputs (the
//   CPU has no integer histc): exact int64 arithmetic, counts in the input dtype.
// - bucketize/searchsorted replay PyTorch's binary search step by step (same mid points and
//   comparisons, `!(mid >= v)` / `!(mid > v)`), so even NaN and unsorted inputs give the CPU's
//   answer. One gather per step, ceil(log2(L + 1)) steps.
// - cummax/cummin (the ops the tpu sees: PyTorch's _cummax_helper is only reached through
//   cummax's composite kernel, which our lowering of cummax replaces) are a log-step scan over
//   (value, index) pairs; a later element wins ties (>=) and NaN wins, like the CPU.
#include <string>
#include <vector>

#include "lowering.h"

namespace tpu::lowering {
namespace {

constexpr ElemType I64 = ElemType::S64;

Value flat(Builder& b, Value x) { return b.reshape(x, {x.type.numel()}); }

// Adds `upd` [N] into a zero vector of `n` entries at `idx` [N] (s64, all in range).
Value scatter_add_1d(Builder& b, Value idx, Value upd, int64_t n) {
  Value coords = b.reshape(idx, {idx.type.numel(), 1});
  return b.scatter(b.zeros(Type{upd.elem(), {n}}), coords, upd, {}, {0}, {0}, 1, "add");
}

Value bcast(Builder& b, Value scalar, const Shape& s) { return b.broadcast_to(scalar, s); }

// Data min/max of a 1-D value as 0-d values.
std::pair<Value, Value> data_extrema(Builder& b, Value x) {
  Value mn = b.reduce(x, b.highest(x.elem()), {0}, "minimum");
  Value mx = b.reduce(x, b.lowest(x.elem()), {0}, "maximum");
  return {mn, mx};
}

}  // namespace

// ------------------------------------------------------------------ histc
TPU_LOWER(histc) {
  const Type& o = out_type(c);
  const int64_t bins = c.int_("bins", 100);
  if (bins <= 0) throw Unsupported("histc: bins must be > 0");
  Value x = flat(b, c.tensor("self"));
  const ElemType t = x.elem();
  const int64_t n = x.type.numel();
  if (n == 0) return {b.zeros(o)};
  if (t == ElemType::Pred) throw Unsupported("histc: bool input");
  const Shape s{n};
  Value lo, hi, pos;
  Value in_range;
  if (shlo::is_float(t)) {
    // Outer edges chosen in double (PyTorch's histc_select_outer_bin_edges), then rounded to
    // the input dtype like the linspace of edges.
    Value lo_d = operand(b, c.arg("min"), ElemType::F64, {});
    Value hi_d = operand(b, c.arg("max"), ElemType::F64, {});
    auto [dmin, dmax] = data_extrema(b, x);
    Value eq = b.compare(Cmp::EQ, lo_d, hi_d);
    lo_d = b.select(eq, b.convert(dmin, ElemType::F64), lo_d);
    hi_d = b.select(eq, b.convert(dmax, ElemType::F64), hi_d);
    Value eq2 = b.compare(Cmp::EQ, lo_d, hi_d);
    Value one = b.constant_f(1.0, ElemType::F64);
    lo_d = b.select(eq2, b.sub(lo_d, one), lo_d);
    hi_d = b.select(eq2, b.add(hi_d, one), hi_d);
    lo = bcast(b, b.convert(lo_d, t), s);
    hi = bcast(b, b.convert(hi_d, t), s);
    in_range = b.and_(b.compare(Cmp::GE, x, lo), b.compare(Cmp::LE, x, hi));
    // (elt - left) * bins / (right - left), each step in the input dtype, truncated to int64.
    Value q = b.div(b.mul(b.sub(x, lo), b.constant_f(static_cast<double>(bins), t, s)), b.sub(hi, lo));
    pos = b.convert(q, I64);
  } else {
    Value xi = b.convert(x, I64);
    Value lo0 = operand(b, c.arg("min"), I64, {});
    Value hi0 = operand(b, c.arg("max"), I64, {});
    auto [dmin, dmax] = data_extrema(b, xi);
    Value eq = b.compare(Cmp::EQ, lo0, hi0);
    Value lo_i = b.select(eq, dmin, lo0), hi_i = b.select(eq, dmax, hi0);
    Value eq2 = b.compare(Cmp::EQ, lo_i, hi_i);
    Value one = b.constant_i(1, I64);
    lo_i = b.select(eq2, b.sub(lo_i, one), lo_i);
    hi_i = b.select(eq2, b.add(hi_i, one), hi_i);
    lo = bcast(b, lo_i, s);
    hi = bcast(b, hi_i, s);
    in_range = b.and_(b.compare(Cmp::GE, xi, lo), b.compare(Cmp::LE, xi, hi));
    // In range, (x - lo) >= 0 and hi > lo: integer division is the exact floor.
    Value span = b.select(in_range, b.sub(hi, lo), b.constant_i(1, I64, s));
    pos = b.div(b.mul(b.sub(xi, lo), b.constant_i(bins, I64, s)), span);
  }
  Value last = b.constant_i(bins - 1, I64, s);
  pos = b.clamp(b.constant_i(0, I64, s), pos, last);  // pos == bins -> bins - 1; excluded values anywhere
  Value ones = b.select(in_range, b.constant_i(1, I64, s), b.constant_i(0, I64, s));
  return {b.reshape(scatter_add_1d(b, pos, ones, bins), o.shape)};
}

// ------------------------------------------------------------------ bincount
// The output length (max(self) + 1, at least minlength) is decided by the tpu kernel in
// csrc/aten/explicit_kernels.cc after one host read; here it is the output's shape.
TPU_LOWER(bincount) {
  const Type& o = out_type(c);
  Value x = flat(b, c.tensor("self"));
  const int64_t n = x.type.numel();
  const int64_t len = o.numel();
  if (n == 0 || len == 0) return {b.zeros(o)};
  Value idx = b.convert(x, I64);
  Value upd = c.has("weights") ? b.convert(flat(b, c.tensor("weights")), o.elem) : b.constant_i(1, o.elem, {n});
  return {b.reshape(scatter_add_1d(b, idx, upd, len), o.shape)};
}

// ------------------------------------------------------------------ bucketize / searchsorted
namespace {

// PyTorch's cus_lower_bound / cus_upper_bound for every value at once. `seq` is [..., L]
// (1-D: shared by all values; else its leading dims are the values' leading dims), `vals` the
// values (any shape, or 0-d), `sorter` optional like `seq`. Returns s64 positions, vals' shape.
Value binary_search(Builder& b, const OpCall& c, Value seq, Value vals, const std::optional<Value>& sorter,
                    bool right) {
  ElemType ct = c.common;
  if (ct == ElemType::Pred) throw Unsupported("searchsorted: bool inputs");
  const Shape out_shape = vals.shape();
  const int64_t L = seq.rank() == 0 ? 1 : seq.shape().back();
  const int64_t m = vals.type.numel();
  if (m == 0) return b.zeros(Type{I64, out_shape});
  if (L == 0) return b.zeros(Type{I64, out_shape});
  const Shape s{m};
  Value v = b.convert(flat(b, vals), ct);
  Value sq = b.convert(flat(b, seq), ct);
  std::optional<Value> so;
  if (sorter) so = b.convert(flat(b, *sorter), I64);
  // Row base offset of each value's sequence in the flattened `seq`.
  Value base = b.constant_i(0, I64, s);
  if (seq.rank() > 1) {
    const int64_t per_row = vals.shape().empty() ? 1 : vals.shape().back();
    Value row = b.div(b.iota(Type{I64, s}, 0), b.constant_i(per_row, I64, s));
    base = b.mul(row, b.constant_i(L, I64, s));
  }
  const int64_t total = sq.type.numel();
  auto take = [&](Value table, Value idx) {
    Value coords = b.reshape(idx, {m, 1});
    return b.gather(table, coords, {}, {0}, {0}, 1, {1}, s);
  };
  Value start = b.constant_i(0, I64, s), end = b.constant_i(L, I64, s);
  Value one = b.constant_i(1, I64, s);
  Value zero = b.constant_i(0, I64, s);
  Value maxrel = b.constant_i(L - 1, I64, s);
  Value maxabs = b.constant_i(total - 1, I64, s);
  for (int64_t len = L; len > 0; len >>= 1) {
    Value active = b.compare(Cmp::LT, start, end);
    Value mid = b.add(start, b.binary("shift_right_arithmetic", b.sub(end, start), one));
    Value rel = b.clamp(zero, mid, maxrel);  // inactive lanes may sit at L
    if (so) rel = b.clamp(zero, take(*so, b.add(base, rel)), maxrel);
    Value mv = take(sq, b.clamp(zero, b.add(base, rel), maxabs));
    Value stop = b.compare(right ? Cmp::GT : Cmp::GE, mv, v);  // go right when !stop
    Value go_right = b.and_(active, b.not_(stop));
    Value go_left = b.and_(active, stop);
    start = b.select(go_right, b.add(mid, one), start);
    end = b.select(go_left, mid, end);
  }
  return b.reshape(start, out_shape);
}

bool right_of(const OpCall& c) {
  std::string side = c.str("side");
  if (!side.empty()) return side == "right";
  return c.bool_("right");
}

Value value_arg(const OpCall& c) {
  const Arg& a = c.arg("self");
  return a.kind == Arg::Kind::Scalar ? a.scalar : a.tensor;
}

}  // namespace

TPU_LOWER(searchsorted) {
  std::optional<Value> sorter;
  if (c.has("sorter")) sorter = c.tensor("sorter");
  Value r = binary_search(b, c, c.tensor("sorted_sequence"), value_arg(c), sorter, right_of(c));
  return {b.reshape(r, out_type(c).shape)};
}

TPU_LOWER(bucketize) {
  Value r = binary_search(b, c, c.tensor("boundaries"), value_arg(c), std::nullopt, c.bool_("right"));
  return {b.reshape(r, out_type(c).shape)};
}

// ------------------------------------------------------------------ cummax / cummin
namespace {

std::vector<Value> lower_cum_extreme(Builder& b, const OpCall& c, bool is_max) {
  Value x = c.tensor("self");
  const Type& ov = out_type(c, 0);
  if (x.rank() == 0) return {x, b.zeros(Type{I64, {}})};
  const int64_t dim = norm_dim(c.int_("dim"), x.rank());
  const int64_t n = x.shape()[dim];
  if (x.type.numel() == 0) return {b.zeros(ov), b.zeros(Type{I64, x.shape()})};
  const bool is_bool = x.elem() == ElemType::Pred;
  if (is_bool) x = b.convert(x, ElemType::U8);
  const bool fl = shlo::is_float(x.elem());
  const int64_t rank = x.rank();
  Value v = x;
  Value idx = b.iota(Type{I64, x.shape()}, dim);
  Value init_v = is_max ? b.lowest(x.elem()) : b.highest(x.elem());
  Value init_i = b.constant_i(0, I64);
  // Hillis-Steele: element j combines the aggregate ending at j - s (earlier, `a`) with its
  // own (later, `l`); the later one wins when it is NaN or compares >= (<=) a non-NaN earlier.
  for (int64_t s = 1; s < n; s *= 2) {
    Shape start(rank, 0), limit = x.shape();
    limit[dim] = n - s;
    Shape lo(rank, 0), hi(rank, 0);
    lo[dim] = s;
    Value av = b.pad(b.slice(v, start, limit), init_v, lo, hi);
    Value ai = b.pad(b.slice(idx, start, limit), init_i, lo, hi);
    Value take = b.compare(is_max ? Cmp::GE : Cmp::LE, v, av);
    if (fl) {
      Value l_nan = b.compare(Cmp::NE, v, v);
      Value a_nan = b.compare(Cmp::NE, av, av);
      take = b.or_(l_nan, b.and_(b.not_(a_nan), take));
    }
    v = b.select(take, v, av);
    idx = b.select(take, idx, ai);
  }
  if (is_bool) v = b.convert(v, ElemType::Pred);
  return {v, idx};
}

}  // namespace

TPU_LOWER(cummax) { return lower_cum_extreme(b, c, true); }
TPU_LOWER(cummin) { return lower_cum_extreme(b, c, false); }

// Data-dependent output shapes: one documented host sync each (see lowering.h).
TPU_HOST_SYNC(nonzero);
TPU_HOST_SYNC(nonzero_static);
TPU_HOST_SYNC(masked_select);
TPU_HOST_SYNC(_unique);
TPU_HOST_SYNC(_unique2);
TPU_HOST_SYNC(unique_dim);
TPU_HOST_SYNC(unique_consecutive);

}  // namespace tpu::lowering
