// Reductions: sum, mean, prod, amax/amin, max/min, argmax/argmin, var/std(+_mean), norms,
// all/any, logsumexp, cumsum/cumprod, count_nonzero, aminmax.
//
// Conventions: float16/bfloat16 accumulate in float32 (opmath) and the runtime converts the
// result to the output dtype; integer reductions accumulate in the output dtype that PyTorch's
// meta chose (int32/bool sums promote to int64). Reduced values are returned in the keepdim=False
// layout and reshaped here to the exact output shape (the runtime would do it too).
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "elementwise_math.h"
#include "lowering.h"
#include "shape_util.h"

namespace tpu::lowering {
namespace {

// `x`'s shape with `dims` removed (keep=false) or set to 1 (keep=true).
Shape reduced_shape(const Shape& s, const std::vector<int64_t>& dims, bool keep) {
  Shape r;
  for (int64_t i = 0; i < static_cast<int64_t>(s.size()); ++i) {
    if (!contains(dims, i)) r.push_back(s[i]);
    else if (keep) r.push_back(1);
  }
  return r;
}

int64_t reduced_numel(const Shape& s, const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= s[d];
  return n;
}

// A reduced value (keepdim=False layout) broadcast back against the input shape.
Value expand_back(Builder& b, Value r, const Shape& in, const std::vector<int64_t>& dims) {
  return b.broadcast_to(b.reshape(r, reduced_shape(in, dims, true)), in);
}

Value rsum(Builder& b, Value x, const std::vector<int64_t>& dims) {
  return b.reduce(x, b.constant_i(0, x.elem()), dims, "add");
}
// XLA:CPU's vectorized reduce with a plain maximum/minimum body drops NaNs; PyTorch propagates
// them, so float bodies pick a NaN operand explicitly.
Value nan_reduce(Builder& b, Value x, Value init, const std::vector<int64_t>& dims, const char* op) {
  if (dims.empty()) return x;
  return b.reduce_multi({x}, {init}, dims, [&](const std::vector<Value>& a) {
    Value l = a[0], r = a[1];
    Value m = b.binary(op, l, r);
    m = b.select(b.compare(Cmp::NE, r, r), r, m);
    return std::vector<Value>{b.select(b.compare(Cmp::NE, l, l), l, m)};
  })[0];
}
Value rmax(Builder& b, Value x, const std::vector<int64_t>& dims) {
  if (x.elem() == ElemType::Pred) return b.reduce(x, b.constant_i(0, x.elem()), dims, "or");
  if (shlo::is_float(x.elem())) return nan_reduce(b, x, b.lowest(x.elem()), dims, "maximum");
  return b.reduce(x, b.lowest(x.elem()), dims, "maximum");
}
Value rmin(Builder& b, Value x, const std::vector<int64_t>& dims) {
  if (x.elem() == ElemType::Pred) return b.reduce(x, b.constant_i(1, x.elem()), dims, "and");
  if (shlo::is_float(x.elem())) return nan_reduce(b, x, b.highest(x.elem()), dims, "minimum");
  return b.reduce(x, b.highest(x.elem()), dims, "minimum");
}

Value pred_bcast(Builder& b, Value p, const Shape& s) { return b.broadcast_to(p, s); }

// Accumulation type for a reduction whose result has element type `out`.
ElemType acc_type(ElemType out) { return opmath(out); }

// Input converted to the output dtype first (PyTorch casts the input to `dtype=`), then to the
// accumulation type.
Value input_as(Builder& b, Value x, ElemType out) {
  return b.convert(b.convert(x, out), acc_type(out));
}

// (value, index) reduction along one dim; first occurrence wins ties; NaN wins for floats.
std::pair<Value, Value> arg_reduce(Builder& b, Value x, int64_t dim, bool is_max, ElemType idx_t) {
  Value idx = b.iota(Type{idx_t, x.shape()}, dim);
  Value init_v = is_max ? b.lowest(x.elem()) : b.highest(x.elem());
  Value init_i = b.highest(idx_t);
  const bool fl = shlo::is_float(x.elem());
  auto r = b.reduce_multi({x, idx}, {init_v, init_i}, {dim}, [&](const std::vector<Value>& a) {
    Value lv = a[0], li = a[1], rv = a[2], ri = a[3];
    Value better = b.compare(is_max ? Cmp::GT : Cmp::LT, lv, rv);
    Value eq = b.compare(Cmp::EQ, lv, rv);
    if (fl) {
      Value lnan = b.compare(Cmp::NE, lv, lv);
      Value rnan = b.compare(Cmp::NE, rv, rv);
      better = b.or_(better, b.and_(lnan, b.not_(rnan)));
      eq = b.or_(eq, b.and_(lnan, rnan));
    }
    Value pick_l = b.or_(better, b.and_(eq, b.compare(Cmp::LT, li, ri)));
    return std::vector<Value>{b.select(pick_l, lv, rv), b.select(pick_l, li, ri)};
  });
  return {r[0], r[1]};
}

// Prefix scan along `dim` with a log-step (Hillis-Steele) schedule.
Value scan(Builder& b, Value x, int64_t dim, const std::string& op, Value init) {
  int64_t n = x.shape()[dim];
  int64_t rank = x.rank();
  for (int64_t s = 1; s < n; s *= 2) {
    Shape start(rank, 0), limit = x.shape();
    limit[dim] = n - s;
    Value sl = b.slice(x, start, limit);
    Shape lo(rank, 0), hi(rank, 0);
    lo[dim] = s;
    x = b.binary(op, x, b.pad(sl, init, lo, hi));
  }
  return x;
}

// Reduction dims for all/any: an explicitly empty `dim` list reduces nothing (all.dims).
std::vector<int64_t> bool_reduce_dims(const OpCall& c, int64_t rank) {
  const Arg* a = c.find("dim");
  if (a && a->kind == Arg::Kind::IntList && a->ints.empty()) return {};
  return reduce_dims(c, "dim", rank);
}

}  // namespace

// ------------------------------------------------------------------ sum / mean / prod
// Complex sum / mean: the real and imaginary parts reduce separately (the float paths).
TPU_LOWER_COMPLEX(sum) {
  const Type& o = out_type(c);
  Value x = c.tensor("self");
  auto dims = reduce_dims(c, "dim", x.rank());
  if (is_complex(o.elem)) {
    Value xc = b.convert(x, o.elem);
    Type po{part_type(o.elem), o.shape};
    return {b.complex(fit(b, row_sum(b, b.real(xc), dims), po), fit(b, row_sum(b, b.imag(xc), dims), po))};
  }
  return {fit(b, row_sum(b, input_as(b, x, o.elem), dims), o)};
}

TPU_LOWER_COMPLEX(mean) {
  const Type& o = out_type(c);
  Value x = c.tensor("self");
  auto dims = reduce_dims(c, "dim", x.rank());
  if (is_complex(o.elem)) {
    Value xc = b.convert(x, o.elem);
    Type po{part_type(o.elem), o.shape};
    const int64_t n = reduced_numel(x.shape(), dims);
    return {b.complex(fit(b, row_mean(b, b.real(xc), dims, n), po), fit(b, row_mean(b, b.imag(xc), dims, n), po))};
  }
  if (!shlo::is_float(o.elem)) throw Unsupported("mean: non-float output");
  return {fit(b, row_mean(b, input_as(b, x, o.elem), dims, reduced_numel(x.shape(), dims)), o)};
}

TPU_LOWER(prod) {
  const Type& o = out_type(c);
  Value x = c.tensor("self");
  auto dims = reduce_dims(c, "dim", x.rank());
  Value xi = input_as(b, x, o.elem);
  if (xi.elem() == ElemType::Pred)
    return {fit(b, b.reduce(xi, b.constant_i(1, xi.elem()), dims, "and"), o)};
  return {fit(b, b.reduce(xi, b.constant_i(1, xi.elem()), dims, "multiply"), o)};
}

// ------------------------------------------------------------------ amax / amin / max / min
TPU_LOWER(amax) {
  const Type& o = out_type(c);
  Value x = c.tensor("self");
  return {fit(b, rmax(b, x, reduce_dims(c, "dim", x.rank())), o)};
}

TPU_LOWER(amin) {
  const Type& o = out_type(c);
  Value x = c.tensor("self");
  return {fit(b, rmin(b, x, reduce_dims(c, "dim", x.rank())), o)};
}

static std::vector<Value> lower_max_min(Builder& b, const OpCall& c, bool is_max) {
  const Type& o = out_type(c);
  Value x = c.tensor("self");
  if (c.has("other")) {  // max.other / max.out: elementwise, NaN-propagating
    ElemType t = c.common;
    Value l = operand(b, c.arg("self"), t, o.shape);
    Value r = operand(b, c.arg("other"), t, o.shape);
    if (t == ElemType::Pred) return {is_max ? b.or_(l, r) : b.and_(l, r)};
    return {is_max ? b.max(l, r) : b.min(l, r)};
  }
  if (!c.has("dim")) {  // full reduction
    std::vector<int64_t> dims;
    for (int64_t i = 0; i < x.rank(); ++i) dims.push_back(i);
    return {fit(b, is_max ? rmax(b, x, dims) : rmin(b, x, dims), o)};
  }
  const Type& oi = out_type(c, 1);
  if (x.rank() == 0) return {x, b.constant_i(0, oi.elem)};
  int64_t dim = norm_dim(c.int_("dim"), x.rank());
  auto [v, i] = arg_reduce(b, x, dim, is_max, oi.elem);
  return {fit(b, v, o), fit(b, i, oi)};
}

TPU_LOWER(max) { return lower_max_min(b, c, true); }
TPU_LOWER(min) { return lower_max_min(b, c, false); }

static std::vector<Value> lower_argmaxmin(Builder& b, const OpCall& c, bool is_max) {
  const Type& o = out_type(c);
  Value x = c.tensor("self");
  if (x.rank() == 0) return {b.constant_i(0, o.elem)};
  int64_t dim;
  if (!c.has("dim")) {
    x = b.reshape(x, {x.type.numel()});
    dim = 0;
  } else {
    dim = norm_dim(c.int_("dim"), x.rank());
  }
  return {fit(b, arg_reduce(b, x, dim, is_max, o.elem).second, o)};
}

TPU_LOWER(argmax) { return lower_argmaxmin(b, c, true); }
TPU_LOWER(argmin) { return lower_argmaxmin(b, c, false); }

TPU_LOWER(aminmax) {
  Value x = c.tensor("self");
  auto dims = reduce_dims(c, "dim", x.rank());
  return {fit(b, rmin(b, x, dims), out_type(c, 0)), fit(b, rmax(b, x, dims), out_type(c, 1))};
}

// ------------------------------------------------------------------ var / std
// Returns (var, mean) in the accumulation type, keepdim=False layout.
static std::pair<Value, Value> var_mean_impl(Builder& b, const OpCall& c, ElemType out) {
  Value x0 = c.tensor("self");
  if (!shlo::is_float(out)) throw Unsupported(c.name + ": non-float output");
  ElemType t = acc_type(out);
  Value x = input_as(b, x0, out);
  auto dims = reduce_dims(c, "dim", x.rank());
  int64_t n = reduced_numel(x.shape(), dims);
  // row_sum: one GEMV when dims are the trailing dims of short f32/f64 rows (shape_util.h).
  Value mean = row_mean(b, x, dims, n);
  Value d = b.sub(x, expand_back(b, mean, x.shape(), dims));
  Value ss = row_sum(b, b.mul(d, d), dims);
  Value corr;
  if (c.has("correction")) corr = operand(b, c.arg("correction"), t, {});
  else if (c.has("unbiased")) corr = b.constant_f(c.bool_("unbiased") ? 1.0 : 0.0, t);
  else corr = b.constant_f(1.0, t);
  Value denom = b.max(b.sub(b.constant_f(static_cast<double>(n), t), corr), b.constant_f(0.0, t));
  Value var = b.div(ss, b.broadcast_to(denom, ss.shape()));
  // ATen's Welford update makes the mean of a row holding inf nan (inf - inf); the squares'
  // sum is nan exactly for those rows and rows holding nan.
  mean = b.select(b.compare(Cmp::NE, ss, ss), ss, mean);
  return {var, mean};
}

TPU_LOWER(var) {
  auto [v, m] = var_mean_impl(b, c, out_type(c).elem);
  return {fit(b, v, out_type(c))};
}
TPU_LOWER(std) {
  auto [v, m] = var_mean_impl(b, c, out_type(c).elem);
  return {fit(b, b.sqrt(v), out_type(c))};
}
TPU_LOWER(var_mean) {
  auto [v, m] = var_mean_impl(b, c, out_type(c).elem);
  return {fit(b, v, out_type(c, 0)), fit(b, m, out_type(c, 1))};
}
TPU_LOWER(std_mean) {
  auto [v, m] = var_mean_impl(b, c, out_type(c).elem);
  return {fit(b, b.sqrt(v), out_type(c, 0)), fit(b, m, out_type(c, 1))};
}

// ------------------------------------------------------------------ norms
// Vector p-norm of `x` (already in the accumulation type) over dims. `p` may be a compile-time
// constant (None => 2, Int, Double) or a runtime Scalar operand (then every case is computed
// and the right one selected).
static Value vector_norm(Builder& b, Value x, const std::vector<int64_t>& dims, const Arg* p) {
  ElemType t = x.elem();
  Value a = b.abs(x);
  Shape rs = reduced_shape(x.shape(), dims, false);
  const double inf = std::numeric_limits<double>::infinity();
  bool is_const = !p || p->is_none() || p->kind == Arg::Kind::Int || p->kind == Arg::Kind::Double;
  if (is_const) {
    double pv = (!p || p->is_none()) ? 2.0 : (p->kind == Arg::Kind::Int ? static_cast<double>(p->i) : p->d);
    if (pv == inf) return rmax(b, a, dims);
    if (pv == -inf) return rmin(b, a, dims);
    if (pv == 0) return rsum(b, b.convert(b.convert(a, ElemType::Pred), t), dims);
    if (pv == 1) return rsum(b, a, dims);
    if (pv == 2) return b.sqrt(rsum(b, b.mul(a, a), dims));
    Value s = rsum(b, b.pow(a, b.constant_f(pv, t, a.shape())), dims);
    return b.pow(s, b.constant_f(1.0 / pv, t, s.shape()));
  }
  if (p->kind != Arg::Kind::Scalar) throw Unsupported("norm: unexpected p argument kind");
  Value pv = b.convert(p->scalar, t);
  auto is = [&](double v, const Shape& s) {
    return pred_bcast(b, b.compare(Cmp::EQ, pv, b.constant_f(v, t)), s);
  };
  const Shape& xs = a.shape();
  Value pvx = b.broadcast_to(pv, xs);
  Value nz = b.convert(b.convert(a, ElemType::Pred), t);
  Value term = b.select(is(0, xs), nz,
                        b.select(is(1, xs), a, b.select(is(2, xs), b.mul(a, a), b.pow(a, pvx))));
  Value s = rsum(b, term, dims);
  Value inv_p = b.div(b.constant_f(1.0, t, rs), b.broadcast_to(pv, rs));
  Value root = b.select(b.or_(is(0, rs), is(1, rs)), s,
                        b.select(is(2, rs), b.sqrt(s), b.pow(s, inv_p)));
  Value mx = rmax(b, a, dims);
  Value mn = rmin(b, a, dims);
  return b.select(is(inf, rs), mx, b.select(is(-inf, rs), mn, root));
}

TPU_LOWER(linalg_vector_norm) {
  const Type& o = out_type(c);
  if (!shlo::is_float(o.elem)) throw Unsupported("linalg_vector_norm: non-float output");
  Value x = input_as(b, c.tensor("self"), o.elem);
  auto dims = reduce_dims(c, "dim", x.rank());
  return {fit(b, vector_norm(b, x, dims, c.find("ord")), o)};
}

TPU_LOWER(norm) {
  const Type& o = out_type(c);
  if (!shlo::is_float(o.elem)) throw Unsupported("norm: non-float output");
  Value x = input_as(b, c.tensor("self"), o.elem);
  auto dims = reduce_dims(c, "dim", x.rank());
  return {fit(b, vector_norm(b, x, dims, c.find("p")), o)};
}

// ------------------------------------------------------------------ all / any / count_nonzero
TPU_LOWER(all) {
  const Type& o = out_type(c);
  Value x = c.tensor("self");
  Value p = b.convert(x, ElemType::Pred);
  return {fit(b, b.reduce(p, b.constant_i(1, ElemType::Pred), bool_reduce_dims(c, x.rank()), "and"), o)};
}

TPU_LOWER(any) {
  const Type& o = out_type(c);
  Value x = c.tensor("self");
  Value p = b.convert(x, ElemType::Pred);
  return {fit(b, b.reduce(p, b.constant_i(0, ElemType::Pred), bool_reduce_dims(c, x.rank()), "or"), o)};
}

TPU_LOWER(count_nonzero) {
  const Type& o = out_type(c);
  Value x = c.tensor("self");
  auto dims = reduce_dims(c, "dim", x.rank());
  Value nz = b.convert(b.convert(x, ElemType::Pred), o.elem);
  return {fit(b, rsum(b, nz, dims), o)};
}

// ------------------------------------------------------------------ logsumexp
TPU_LOWER(logsumexp) {
  const Type& o = out_type(c);
  if (!shlo::is_float(o.elem)) throw Unsupported("logsumexp: non-float output");
  Value x = input_as(b, c.tensor("self"), o.elem);
  ElemType t = x.elem();
  auto dims = reduce_dims(c, "dim", x.rank());
  Value m = rmax(b, x, dims);
  // PyTorch: maxes.masked_fill_(maxes.abs() == inf, 0)
  Value is_inf = b.compare(Cmp::EQ, b.abs(m), b.constant_f(std::numeric_limits<double>::infinity(), t, m.shape()));
  Value ms = b.select(is_inf, b.constant_f(0.0, t, m.shape()), m);
  Value s = rsum(b, b.exp(b.sub(x, expand_back(b, ms, x.shape(), dims))), dims);
  return {fit(b, b.add(b.log(s), ms), o)};
}

// ------------------------------------------------------------------ cumsum / cumprod
static std::vector<Value> lower_cum(Builder& b, const OpCall& c, bool is_sum) {
  const Type& o = out_type(c);
  Value x = input_as(b, c.tensor("self"), o.elem);
  if (x.rank() == 0) return {x};
  int64_t dim = norm_dim(c.int_("dim"), x.rank());
  if (x.elem() == ElemType::Pred)  // only reachable with dtype=bool
    return {scan(b, x, dim, is_sum ? "or" : "and", b.constant_i(is_sum ? 0 : 1, ElemType::Pred))};
  return {scan(b, x, dim, is_sum ? "add" : "multiply", b.constant_i(is_sum ? 0 : 1, x.elem()))};
}

TPU_LOWER(cumsum) { return lower_cum(b, c, true); }
TPU_LOWER(cumprod) { return lower_cum(b, c, false); }

// ------------------------------------------------------------------ logcumsumexp
// CPU's _log_add_exp_helper: max + log1p(exp(min - max)), except that equal infinities (both
// -inf, both +inf) give that infinity instead of NaN; a NaN operand gives NaN. Its identity is
// -inf, so the log-step scan pads with it (the order of additions differs from CPU's sequential
// loop; in double for float, as CPU, that stays below float rounding). The backward (logcumsumexp_backward) decomposes into
// lowered ops.
TPU_LOWER(_logcumsumexp) {
  const Type& o = out_type(c);
  if (!shlo::is_float(o.elem)) throw Unsupported("logcumsumexp: non-float output");
  // CPU accumulates in at::acc_type<scalar_t, /*is_cuda=*/false>: double for float.
  const ElemType t = o.elem == ElemType::F32 ? ElemType::F64 : opmath(o.elem);
  Value x = b.convert(b.convert(c.tensor("self"), o.elem), t);
  if (x.rank() == 0) return {fit(b, x, o)};
  const int64_t dim = norm_dim(c.int_("dim"), x.rank());
  const int64_t n = x.shape()[dim];
  const int64_t rank = x.rank();
  Value neg_inf = b.constant_f(-std::numeric_limits<double>::infinity(), t);
  for (int64_t s = 1; s < n; s *= 2) {  // Hillis-Steele, as scan() above
    Shape start(rank, 0), limit = x.shape();
    limit[dim] = n - s;
    Shape lo(rank, 0), hi(rank, 0);
    lo[dim] = s;
    Value y = b.pad(b.slice(x, start, limit), neg_inf, lo, hi);
    Value mn = ew::nan_min(b, x, y), mx = ew::nan_max(b, x, y);
    Value r = b.add(mx, ew::log1p(b, b.exp(b.sub(mn, mx))));
    Value finite = is_finite(b, mn);
    Value equal_infs = b.and_(ew::eq(b, mn, mx), b.not_(finite));
    x = b.select(equal_infs, x, r);
  }
  return {fit(b, x, o)};
}

// ------------------------------------------------------------------ trace
// The sum of the main diagonal, accumulated like sum (integers promote to int64).
TPU_LOWER(trace) {
  const Type& o = out_type(c);
  Value x = c.tensor("self");
  if (x.rank() != 2) throw Unsupported("trace: input is not 2-D");
  Value xi = input_as(b, x, o.elem);
  Value on_diag = b.compare(Cmp::EQ, b.iota(Type{ElemType::S64, x.shape()}, 0), b.iota(Type{ElemType::S64, x.shape()}, 1));
  Value d = b.select(on_diag, xi, b.constant_i(0, xi.elem(), x.shape()));
  return {fit(b, rsum(b, d, {0, 1}), o)};
}

// ------------------------------------------------------------------ renorm
// Each slice along `dim` whose p-norm (over the other dims, accumulated in float32 for
// half/bfloat16) exceeds maxnorm is scaled by maxnorm / (norm + 1e-7), as CPU's renorm_out.
TPU_LOWER(renorm) {
  const Type& o = out_type(c);
  if (!shlo::is_float(o.elem)) throw Unsupported("renorm: non-float output");
  Value x = c.tensor("self");
  if (x.rank() == 0) throw Unsupported("renorm: 0-d input");
  const int64_t dim = norm_dim(c.int_("dim"), x.rank());
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < x.rank(); ++i)
    if (i != dim) dims.push_back(i);
  Value xa = input_as(b, x, o.elem);
  const ElemType t = xa.elem();
  Value norm = vector_norm(b, xa, dims, c.find("p"));  // [size(dim)]
  Value maxnorm = b.broadcast_to(b.convert(operand(b, c.arg("maxnorm"), t, {}), t), norm.shape());
  Value scaled = b.div(maxnorm, b.add(norm, b.constant_f(1e-7, t, norm.shape())));
  Value factor = b.select(b.compare(Cmp::GT, norm, maxnorm), scaled, b.constant_f(1.0, t, norm.shape()));
  factor = b.broadcast_in_dim(b.convert(factor, o.elem), x.shape(), {dim});
  return {b.mul(b.convert(x, o.elem), factor)};
}

// ------------------------------------------------------------------ equal
// torch.equal: same sizes and every element equal after type promotion (NaN != NaN). The
// runtime reads the 0-d bool result back to the host.
TPU_LOWER(equal) {
  Value x = c.tensor("self"), y = c.tensor("other");
  if (x.shape() != y.shape()) return {b.constant_i(0, ElemType::Pred)};
  Value eq = b.compare(Cmp::EQ, b.convert(x, c.common), b.convert(y, c.common));
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < x.rank(); ++d) dims.push_back(d);
  if (dims.empty()) return {eq};
  return {b.reduce(eq, b.constant_i(1, ElemType::Pred), dims, "and")};
}

// Sum treating NaN as zero.
TPU_LOWER(nansum) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  Value x = b.convert(c.tensor("self"), t);
  if (shlo::is_float(t)) x = b.select(b.compare(Cmp::NE, x, x), b.zeros(x.type), x);
  Value r = b.reduce(x, b.zeros(Type{t, {}}), reduce_dims(c, "dim", x.rank()), "add");
  return {b.reshape(r, o.shape)};
}

}  // namespace tpu::lowering
