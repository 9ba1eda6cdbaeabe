// Cholesky and Householder QR with LAPACK's algorithms, each one stablehlo.while over the columns
// (like the LU in linalg.cc), so values, signs and the failure state equal CPU's LAPACK:
// - linalg_cholesky_ex: potf2's left-looking column order. A non-positive (or NaN) pivot stops the
//   factorization with info = its 1-based column, the pivot stored on the diagonal and the
//   columns after it left as the input's, as LAPACK leaves them (CPU then zeroes the other
//   triangle). upper = the same on A^T (potf2 'U' reads the upper triangle: U = L(A^T)^T).
// - cholesky_inverse: (L L^T)^-1 = L^-T L^-1 from one triangular solve (potri's result).
// - geqrf: geqr2 with larfg's reflectors (beta = -sign(alpha) ||x||, tau = (beta - alpha) / beta,
//   tau = 0 for an already-zero column), so R's diagonal carries LAPACK's signs.
// - linalg_householder_product (orgqr), ormqr, linalg_qr: products of those reflectors.
// torch.cholesky (deprecated) raises on a non-positive-definite input: it runs as
// linalg_cholesky_ex + _linalg_check_errors in csrc/aten/linalg_kernels.cc.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "linalg_util.h"
#include "lowering.h"
#include "shape_util.h"

namespace tpu::lowering {
namespace {

constexpr ElemType I64 = ElemType::S64;

// Contractions inside a factorization always run at full precision (they are LAPACK's dot/gemv).
struct HighestPrecision {
  Builder& b;
  shlo::Precision saved;
  explicit HighestPrecision(Builder& bb) : b(bb), saved(bb.precision()) { b.set_precision(shlo::Precision::Highest); }
  ~HighestPrecision() { b.set_precision(saved); }
  HighestPrecision(const HighestPrecision&) = delete;
  HighestPrecision& operator=(const HighestPrecision&) = delete;
};

// LAPACK's types only: float16/bfloat16 calls run on the CPU, which raises its "not implemented".
ElemType lapack_type(const OpCall& c, size_t out = 0) {
  const ElemType t = out_type(c, out).elem;
  if (t != ElemType::F32 && t != ElemType::F64) throw Unsupported(c.name + ": LAPACK types are float32/float64");
  return t;
}

int64_t batch_count(const Shape& batch) {
  int64_t n = 1;
  for (int64_t d : batch) n *= d;
  return n;
}

// x [..., r, k] with the lower (or upper) triangle kept, the rest zero.
Value triangle(Builder& b, Value x, bool lower, int64_t diag = 0) {
  const Shape& s = x.shape();
  Value rows = b.iota(Type{I64, s}, x.rank() - 2), cols = b.iota(Type{I64, s}, x.rank() - 1);
  Value d = b.add(rows, b.constant_i(diag, I64, s));
  Value keep = lower ? b.compare(Cmp::LE, cols, d) : b.compare(Cmp::GE, cols, d);
  return b.select(keep, x, b.zeros(x.type));
}

Value eye_like(Builder& b, const Shape& s, ElemType t) {
  const int64_t r = static_cast<int64_t>(s.size());
  return b.convert(b.compare(Cmp::EQ, b.iota(Type{I64, s}, r - 2), b.iota(Type{I64, s}, r - 1)), t);
}

struct Chol {
  Value l;     // [..., n, n], not yet masked to the triangle
  Value info;  // [...] s32
};

// potf2 (lower), column j: d = a[j,j] - L[j,:j].L[j,:j]; d <= 0 or NaN stops with info = j + 1
// and a[j,j] = d; else L[j,j] = sqrt(d), L[j+1:, j] = (a[j+1:, j] - L[j+1:, :j] L[j, :j]) / L[j,j].
Chol cholesky_lower(Builder& b, Value a) {
  const Shape full = a.shape();
  const int64_t n = full.back();
  const Shape batch = batch_of(full);
  const int64_t B = batch_count(batch);
  const ElemType t = a.elem();
  const Shape s3{B, n, n}, s2{B, n};
  HighestPrecision hp(b);
  std::vector<Value> st = b.while_loop(
      {b.constant_i(0, I64), b.reshape(a, s3), b.zeros(Type{ElemType::S32, {B}})},
      [&](const std::vector<Value>& x) { return b.compare(Cmp::LT, x[0], b.constant_i(n, I64)); },
      [&](const std::vector<Value>& x) {
        Value j = x[0], A = x[1], info = x[2];
        Value zero = b.constant_i(0, I64);
        Value idx2 = b.iota(Type{I64, s2}, 1), j2 = b.broadcast_in_dim(j, s2, {});
        Value row = b.reshape(b.dynamic_slice(A, {zero, j, zero}, {B, 1, n}), s2);  // L[j, :]
        Value rj = b.select(b.compare(Cmp::LT, idx2, j2), row, b.zeros(Type{t, s2}));  // L[j, :j]
        Value col = b.reshape(b.dynamic_slice(A, {zero, zero, j}, {B, n, 1}), s2);  // a[:, j]
        // L[:, :j] L[j, :j]^T for every row (rows <= j are discarded below).
        Value cols3 = b.iota(Type{I64, s3}, 2);
        Value lj = b.select(b.compare(Cmp::LT, cols3, b.broadcast_in_dim(j, s3, {})), A, b.zeros(Type{t, s3}));
        Value prod = b.dot_general(lj, rj, {0}, {0}, {2}, {1}, t);  // [B, n]
        Value upd = b.sub(col, prod);
        Value jb = b.broadcast_in_dim(j, {B}, {});
        Value d = pick_along(b, upd, jb, 1);  // a[j,j] - L[j,:j].L[j,:j]
        Value ok = b.compare(Cmp::GT, d, b.zeros(Type{t, {B}}));  // false for NaN
        Value active = b.compare(Cmp::EQ, info, b.zeros(Type{ElemType::S32, {B}}));
        Value s = b.sqrt(d);
        Value below = b.compare(Cmp::GT, idx2, j2), at = b.compare(Cmp::EQ, idx2, j2);
        Value newcol = b.select(below, b.div(upd, b.broadcast_in_dim(s, s2, {0})), col);
        newcol = b.select(at, b.broadcast_in_dim(s, s2, {0}), newcol);
        // A failing pivot: only the diagonal takes d (the column below keeps a's values).
        Value failcol = b.select(at, b.broadcast_in_dim(d, s2, {0}), col);
        Value okb = b.broadcast_in_dim(ok, s2, {0}), actb = b.broadcast_in_dim(active, s2, {0});
        Value out = b.select(actb, b.select(okb, newcol, failcol), col);
        A = b.dynamic_update_slice(A, b.reshape(out, {B, n, 1}), {zero, zero, j});
        info = b.select(b.and_(active, b.not_(ok)), b.convert(b.add(jb, b.constant_i(1, I64, {B})), ElemType::S32),
                        info);
        return std::vector<Value>{b.add(j, b.constant_i(1, I64)), A, info};
      });
  return {b.reshape(st[1], full), b.reshape(st[2], batch)};
}

Value square_matrix(Builder& b, const OpCall& c, const char* name, ElemType t) {
  Value a = c.tensor(name);
  if (a.rank() < 2 || a.shape()[a.rank() - 1] != a.shape()[a.rank() - 2])
    throw Unsupported(c.name + ": square matrices only");
  return b.convert(a, t);
}

// ---- Householder reflectors (LAPACK's geqr2 / larfg / larf)
struct Qr {
  Value a;    // [B, m, n]: R on and above the diagonal, the reflectors' tails below
  Value tau;  // [B, k]
};

// H = I - tau v v^T applied from the left to c [B, m, p] (v [B, m]): c - tau v (v^T c).
Value reflect_left(Builder& b, Value c, Value v, Value tau) {
  const Shape& s = c.shape();
  Value w = b.dot_general(v, c, {0}, {0}, {1}, {1}, c.elem());  // [B, p]
  Value tv = b.mul(v, b.broadcast_in_dim(tau, v.shape(), {0}));
  return b.sub(c, b.mul(b.broadcast_in_dim(tv, s, {0, 1}), b.broadcast_in_dim(w, s, {0, 2})));
}

// From the right: c [B, p, m] -> c - (c v) tau v^T.
Value reflect_right(Builder& b, Value c, Value v, Value tau) {
  const Shape& s = c.shape();
  Value w = b.dot_general(c, v, {0}, {0}, {2}, {1}, c.elem());  // [B, p]
  Value tv = b.mul(v, b.broadcast_in_dim(tau, v.shape(), {0}));
  return b.sub(c, b.mul(b.broadcast_in_dim(w, s, {0, 1}), b.broadcast_in_dim(tv, s, {0, 2})));
}

// Reflector i of a packed factor [B, m, n]: 1 at row i, the column's tail below, zeros above.
Value reflector(Builder& b, Value a, Value i) {
  const Shape& s = a.shape();
  const int64_t B = s[0], m = s[1];
  Value zero = b.constant_i(0, I64);
  Value col = b.reshape(b.dynamic_slice(a, {zero, zero, i}, {B, m, 1}), {B, m});
  Value rows = b.iota(Type{I64, {B, m}}, 1), i2 = b.broadcast_in_dim(i, {B, m}, {});
  Value v = b.select(b.compare(Cmp::GT, rows, i2), col, b.zeros(col.type));
  return b.select(b.compare(Cmp::EQ, rows, i2), b.constant_f(1, a.elem(), {B, m}), v);
}

Qr geqrf(Builder& b, Value a) {
  const Shape& s = a.shape();
  const int64_t B = s[0], m = s[1], n = s[2], k = std::min(m, n);
  const ElemType t = a.elem();
  const Shape s2{B, m};
  HighestPrecision hp(b);
  std::vector<Value> st = b.while_loop(
      {b.constant_i(0, I64), a, b.zeros(Type{t, {B, k}})},
      [&](const std::vector<Value>& x) { return b.compare(Cmp::LT, x[0], b.constant_i(k, I64)); },
      [&](const std::vector<Value>& x) {
        Value i = x[0], A = x[1], tau = x[2];
        Value zero = b.constant_i(0, I64);
        Value rows = b.iota(Type{I64, s2}, 1), i2 = b.broadcast_in_dim(i, s2, {});
        Value col = b.reshape(b.dynamic_slice(A, {zero, zero, i}, {B, m, 1}), s2);
        Value below = b.compare(Cmp::GT, rows, i2);
        Value tail = b.select(below, col, b.zeros(Type{t, s2}));
        Value ib = b.broadcast_in_dim(i, {B}, {});
        Value alpha = pick_along(b, col, ib, 1);
        Value xnorm = b.sqrt(b.reduce(b.mul(tail, tail), b.constant_f(0, t), {1}, "add"));
        Value zb = b.zeros(Type{t, {B}});
        Value nrm = b.sqrt(b.add(b.mul(alpha, alpha), b.mul(xnorm, xnorm)));
        // larfg: beta = -sign(alpha) * hypot(alpha, xnorm) (Fortran SIGN: +0 counts as positive).
        Value beta = b.select(b.compare(Cmp::LT, alpha, zb), nrm, b.neg(nrm));
        Value trivial = b.compare(Cmp::EQ, xnorm, zb);  // H = I: tau 0, the column unchanged
        Value ti = b.select(trivial, zb, b.div(b.sub(beta, alpha), beta));
        Value scale = b.div(b.constant_f(1, t, {B}), b.sub(alpha, beta));
        Value v = b.select(b.broadcast_in_dim(trivial, s2, {0}), tail,
                           b.mul(tail, b.broadcast_in_dim(scale, s2, {0})));
        Value diag = b.select(trivial, alpha, beta);
        Value vfull = b.select(b.compare(Cmp::EQ, rows, i2), b.constant_f(1, t, s2), v);
        // Trailing columns j > i take H; column i becomes (beta, v).
        Value applied = reflect_left(b, A, vfull, ti);
        const Shape s3{B, m, n};
        Value cols3 = b.iota(Type{I64, s3}, 2), i3 = b.broadcast_in_dim(i, s3, {});
        A = b.select(b.compare(Cmp::GT, cols3, i3), applied, A);
        Value newcol = b.select(b.compare(Cmp::EQ, rows, i2), b.broadcast_in_dim(diag, s2, {0}), b.select(below, v, col));
        A = b.dynamic_update_slice(A, b.reshape(newcol, {B, m, 1}), {zero, zero, i});
        tau = b.dynamic_update_slice(tau, b.reshape(ti, {B, 1}), {zero, i});
        return std::vector<Value>{b.add(i, b.constant_i(1, I64)), A, tau};
      });
  return {st[1], st[2]};
}

// Applies reflectors 0..k-1 of `a` [B, m', k'] with `tau` [B, k] to c, in order `forward`
// (i = 0, 1, ...) or backward, from the left or the right.
Value apply_reflectors(Builder& b, Value a, Value tau, Value c, bool left, bool forward) {
  const int64_t k = tau.shape()[1];
  if (k == 0) return c;
  HighestPrecision hp(b);
  std::vector<Value> st = b.while_loop(
      {b.constant_i(0, I64), c},
      [&](const std::vector<Value>& x) { return b.compare(Cmp::LT, x[0], b.constant_i(k, I64)); },
      [&](const std::vector<Value>& x) {
        Value step = x[0], C = x[1];
        Value i = forward ? step : b.sub(b.constant_i(k - 1, I64), step);
        Value v = reflector(b, a, i);
        Value ti = b.reshape(b.dynamic_slice(tau, {b.constant_i(0, I64), i}, {tau.shape()[0], 1}), {tau.shape()[0]});
        C = left ? reflect_left(b, C, v, ti) : reflect_right(b, C, v, ti);
        return std::vector<Value>{b.add(step, b.constant_i(1, I64)), C};
      });
  return st[1];
}

// Q's first `cols` columns (orgqr): H_0 H_1 ... H_{k-1} I[:, :cols].
Value householder_q(Builder& b, Value a, Value tau, int64_t cols) {
  const Shape& s = a.shape();
  Value q = eye_like(b, {s[0], s[1], cols}, a.elem());
  return apply_reflectors(b, a, tau, q, true, false);
}

struct Flat {
  Shape batch;
  Value v;  // [B, r, k]
};
Flat flatten_batch(Builder& b, Value x) {
  const Shape& s = x.shape();
  Shape batch = batch_of(s);
  return {batch, b.reshape(x, {batch_count(batch), s[s.size() - 2], s.back()})};
}

}  // namespace

TPU_LOWER(linalg_cholesky_ex) {
  // check_errors=True raises CPU's LinAlgError from the host: that call stays on the CPU.
  if (c.bool_("check_errors")) throw Unsupported("linalg_cholesky_ex: check_errors=True");
  const ElemType t = lapack_type(c);
  Value a = square_matrix(b, c, "self", t);
  if (empty(a.shape())) return {b.zeros(Type{t, a.shape()}), b.zeros(out_type(c, 1))};
  const bool upper = c.bool_("upper");
  Chol f = cholesky_lower(b, upper ? mT(b, a) : a);
  Value l = triangle(b, f.l, true);
  return {upper ? mT(b, l) : l, f.info};
}

TPU_LOWER(cholesky_inverse) {
  const ElemType t = lapack_type(c);
  Value f = square_matrix(b, c, "self", t);
  if (empty(f.shape())) return {b.zeros(Type{t, f.shape()})};
  const bool upper = c.bool_("upper");
  // lower: (L L^T)^-1 = L^-T L^-1; upper: (U^T U)^-1 = U^-1 U^-T. Only the factor's triangle is read.
  Value inv = tri_solve(b, f, eye_like(b, f.shape(), t), true, !upper, false, false);
  HighestPrecision hp(b);
  const int64_t r = f.rank();
  std::vector<int64_t> bd;
  for (int64_t i = 0; i < r - 2; ++i) bd.push_back(i);
  Value out = upper ? b.dot_general(inv, inv, bd, bd, {r - 1}, {r - 1}, t)
                    : b.dot_general(inv, inv, bd, bd, {r - 2}, {r - 2}, t);
  return {out};
}

TPU_LOWER(geqrf) {
  const ElemType t = lapack_type(c);
  Value a = b.convert(c.tensor("self"), t);
  if (a.rank() < 2) throw Unsupported("geqrf: non-matrix input");
  if (empty(a.shape())) return {b.zeros(Type{t, a.shape()}), b.zeros(out_type(c, 1))};
  Flat f = flatten_batch(b, a);
  Qr q = geqrf(b, f.v);
  return {b.reshape(q.a, a.shape()), b.reshape(q.tau, out_type(c, 1).shape)};
}

TPU_LOWER(linalg_householder_product) {
  const ElemType t = lapack_type(c);
  const Type& o = out_type(c);
  Value a = b.convert(c.tensor("input"), t);
  Value tau = b.convert(c.tensor("tau"), t);
  if (empty(o.shape)) return {b.zeros(Type{t, o.shape})};
  Flat f = flatten_batch(b, a);
  const int64_t B = f.v.shape()[0];
  Value tb = b.reshape(tau, {B, tau.shape().back()});
  return {b.reshape(householder_q(b, f.v, tb, o.shape.back()), o.shape)};
}

TPU_LOWER(ormqr) {
  const ElemType t = lapack_type(c);
  const Type& o = out_type(c);
  Value a = b.convert(c.tensor("self"), t);
  Value tau = b.convert(c.tensor("input2"), t);
  Value other = b.convert(c.tensor("input3"), t);
  if (empty(o.shape)) return {b.zeros(Type{t, o.shape})};
  const bool left = c.bool_("left", true), transpose = c.bool_("transpose");
  // CPU's kernel (not the meta function) requires tau.shape[-1] == min(other's reflected dim,
  // input.shape[-1]) and that dim == input.shape[-2]: other calls go there to raise its error.
  const Shape &as = a.shape(), &cs = other.shape();
  if (as.size() < 2 || cs.size() < 2 || tau.rank() < 1) throw Unsupported("ormqr: CPU's argument checks");
  const int64_t rows = cs[cs.size() - (left ? 2 : 1)];
  if (rows != as[as.size() - 2] || tau.shape().back() != std::min(rows, as.back()))
    throw Unsupported("ormqr: CPU's argument checks");
  Flat fa = flatten_batch(b, a), fc = flatten_batch(b, other);
  const int64_t B = fa.v.shape()[0];
  if (fc.v.shape()[0] != B) throw Unsupported("ormqr: batch shapes differ");
  Value tb = b.reshape(tau, {B, tau.shape().back()});
  // Q = H_0 ... H_{k-1}: Q C applies H_{k-1} first; Q^T C and C Q apply H_0 first.
  const bool forward = left == transpose;
  return {b.reshape(apply_reflectors(b, fa.v, tb, fc.v, left, forward), o.shape)};
}

TPU_LOWER(linalg_qr) {
  const ElemType t = lapack_type(c);
  const std::string mode = c.str("mode", "reduced");
  const Type &qo = out_type(c, 0), &ro = out_type(c, 1);
  Value a = b.convert(c.tensor("A"), t);
  if (a.rank() < 2) throw Unsupported("linalg_qr: non-matrix input");
  const Shape& s = a.shape();
  const int64_t m = s[s.size() - 2], n = s.back();
  if (empty(s)) {
    // Empty batch or matrix: R is empty or zero; Q's columns of an m x 0 input are I's.
    Value q = empty(qo.shape) ? b.zeros(Type{t, qo.shape}) : eye_like(b, qo.shape, t);
    return {q, b.zeros(Type{t, ro.shape})};
  }
  Flat f = flatten_batch(b, a);
  Qr qr = geqrf(b, f.v);
  const int64_t B = f.v.shape()[0];
  const int64_t rrows = ro.shape[ro.rank() - 2];
  Value r = triangle(b, qr.a, false);
  if (rrows < m) r = b.slice(r, {0, 0, 0}, {B, rrows, n});
  Value rr = b.reshape(r, ro.shape);
  if (mode == "r") return {b.zeros(Type{t, qo.shape}), rr};
  Value q = householder_q(b, qr.a, qr.tau, qo.shape.back());
  return {b.reshape(q, qo.shape), rr};
}

}  // namespace tpu::lowering
