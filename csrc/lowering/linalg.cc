// LU factorization with partial pivoting (LAPACK getrf's algorithm: the largest magnitude in the
// column below the diagonal becomes the pivot, the first on ties; a zero pivot leaves the column
// unscaled and sets info) as one stablehlo.while over the columns, and what stands on it:
// linalg_lu_factor_ex, linalg_inv_ex, _linalg_solve_ex. Not _linalg_det / _linalg_slogdet: for
// a contiguous real A, PyTorch factors A^T there and its backward formula relies on that, and a
// lowering does not see whether its input is contiguous (they stay on the CPU fallback).
// Solves reuse linalg_util.h (triangular solves, row permutations); their backward formulas
// call linalg_lu_solve (matmul.cc) with the LU and pivots returned here.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "linalg_util.h"
#include "lowering.h"
#include "shape_util.h"

namespace tpu::lowering {
namespace {

constexpr ElemType I64 = ElemType::S64;

struct Lu {
  Value lu;    // [..., n, n]: L below the diagonal (unit diagonal implied), U on and above
  Value piv;   // [..., n] s32, LAPACK's 1-based row swaps
  Value perm;  // [..., n] s64: row r of P^T A is row perm[r] of A
  Value info;  // [...] s32: 0, or the 1-based column of the first zero pivot
};

Lu lu_factor(Builder& b, Value a) {
  const Shape full = a.shape();
  const int64_t r = a.rank(), n = full[r - 1];
  Shape batch = batch_of(full);
  int64_t B = 1;
  for (int64_t d : batch) B *= d;
  const ElemType t = a.elem();
  const Shape s3{B, n, n}, s2{B, n};
  a = b.reshape(a, s3);
  Value z = b.constant_i(0, I64);
  std::vector<Value> st = b.while_loop(
      {z, a, b.zeros(Type{ElemType::S32, s2}), b.iota(Type{I64, s2}, 1), b.zeros(Type{ElemType::S32, {B}})},
      [&](const std::vector<Value>& x) { return b.compare(Cmp::LT, x[0], b.constant_i(n, I64)); },
      [&](const std::vector<Value>& x) {
        Value k = x[0], A = x[1], piv = x[2], perm = x[3], info = x[4];
        Value zero = b.constant_i(0, I64);
        Value rows2 = b.iota(Type{I64, s2}, 1), k2 = b.broadcast_in_dim(k, s2, {});
        // Pivot row p: the first largest |A[i, k]| for i >= k (k itself when the column is NaN).
        Value col = b.reshape(b.dynamic_slice(A, {zero, zero, k}, {B, n, 1}), s2);
        Value cand = b.select(b.compare(Cmp::GE, rows2, k2), b.abs(col), b.constant_f(-1, t, s2));
        Value best = b.reduce(cand, b.lowest(t), {1}, "maximum");
        Value p = b.reduce(b.select(b.compare(Cmp::EQ, cand, b.broadcast_in_dim(best, s2, {0})), rows2,
                                    b.constant_i(n, I64, s2)),
                           b.constant_i(n, I64), {1}, "minimum");
        Value kb = b.broadcast_in_dim(k, {B}, {});
        p = b.select(b.compare(Cmp::EQ, p, b.constant_i(n, I64, {B})), kb, p);
        piv = b.dynamic_update_slice(piv, b.reshape(b.convert(b.add(p, b.constant_i(1, I64, {B})), ElemType::S32), {B, 1}),
                                     {zero, k});
        // Swap rows k and p (of A and of the permutation).
        Value rows3 = b.iota(Type{I64, s3}, 1), cols3 = b.iota(Type{I64, s3}, 2);
        Value k3 = b.broadcast_in_dim(k, s3, {}), p3 = b.broadcast_in_dim(p, s3, {0});
        Value at_k = b.compare(Cmp::EQ, rows3, k3), at_p = b.compare(Cmp::EQ, rows3, p3);
        Value rowk = b.reshape(b.dynamic_slice(A, {zero, k, zero}, {B, 1, n}), s2);
        Value rowp = pick_along(b, A, b.broadcast_in_dim(p, s2, {0}), 1);
        auto over_rows = [&](Value v) { return b.broadcast_in_dim(v, s3, {0, 2}); };
        A = b.select(at_k, over_rows(rowp), b.select(at_p, over_rows(rowk), A));
        Value p2 = b.broadcast_in_dim(p, s2, {0});
        Value perm_k = pick_along(b, perm, kb, 1), perm_p = pick_along(b, perm, p, 1);
        perm = b.select(b.compare(Cmp::EQ, rows2, k2), b.broadcast_in_dim(perm_p, s2, {0}),
                        b.select(b.compare(Cmp::EQ, rows2, p2), b.broadcast_in_dim(perm_k, s2, {0}), perm));
        // Eliminate below the pivot (a zero pivot: the column below is zero, nothing to scale).
        Value d = pick_along(b, rowp, kb, 1);
        Value is_zero = b.compare(Cmp::EQ, d, b.zeros(Type{t, {B}}));
        info = b.select(b.and_(b.compare(Cmp::EQ, info, b.zeros(Type{ElemType::S32, {B}})), is_zero),
                        b.convert(b.add(kb, b.constant_i(1, I64, {B})), ElemType::S32), info);
        Value colk = b.reshape(b.dynamic_slice(A, {zero, zero, k}, {B, n, 1}), s2);
        Value below = b.compare(Cmp::GT, rows2, k2);
        Value scale = b.and_(below, b.not_(b.broadcast_in_dim(is_zero, s2, {0})));
        Value l = b.select(scale, b.div(colk, b.broadcast_in_dim(d, s2, {0})), colk);
        Value lcol = b.broadcast_in_dim(l, s3, {0, 1});
        Value below3 = b.compare(Cmp::GT, rows3, k3), right3 = b.compare(Cmp::GT, cols3, k3);
        A = b.select(b.and_(below3, right3), b.sub(A, b.mul(lcol, over_rows(rowp))), A);
        A = b.select(b.and_(below3, b.compare(Cmp::EQ, cols3, k3)), lcol, A);
        return std::vector<Value>{b.add(k, b.constant_i(1, I64)), A, piv, perm, info};
      });
  Shape vb = batch;
  vb.push_back(n);
  return {b.reshape(st[1], full), b.reshape(st[2], vb), b.reshape(st[3], vb), b.reshape(st[4], batch)};
}

// A^-1 B (left) or B A^-1 from A's LU.
Value lu_solve(Builder& b, const Lu& f, Value rhs, bool left) {
  if (!left) rhs = mT(b, rhs);
  Value x;
  if (left) {
    Value y = tri_solve(b, f.lu, permute_rows(b, rhs, f.perm, false), true, true, true, false);
    x = tri_solve(b, f.lu, y, true, false, false, false);
  } else {  // X A = B <=> A^T X^T = B^T, A^T = U^T L^T P^T
    Value y = tri_solve(b, f.lu, rhs, true, false, false, true);
    y = tri_solve(b, f.lu, y, true, true, true, true);
    x = mT(b, permute_rows(b, y, f.perm, true));
  }
  return x;
}

Value square_input(Builder& b, const OpCall& c, const char* name, ElemType t) {
  Value a = c.tensor(name);
  if (a.rank() < 2 || a.shape()[a.rank() - 1] != a.shape()[a.rank() - 2])
    throw Unsupported(c.name + ": square matrices only");  // CPU's error message
  return b.convert(a, t);
}

// Empty matrices or batches: every output is empty or zero (info 0), as on the CPU.
std::optional<std::vector<Value>> empty_outputs(Builder& b, const OpCall& c, const Value& a) {
  if (!empty(a.shape())) return std::nullopt;
  std::vector<Value> outs;
  for (const Type& o : c.outs) outs.push_back(b.zeros(o));
  return outs;
}

}  // namespace

TPU_LOWER(linalg_lu_factor_ex) {
  if (!c.bool_("pivot", true) || c.bool_("check_errors")) throw Unsupported("lu_factor_ex: pivot=False / check_errors");
  Value a = square_input(b, c, "A", linalg_type(c));
  if (auto e = empty_outputs(b, c, a)) return *e;
  Lu f = lu_factor(b, a);
  return {f.lu, f.piv, f.info};
}

TPU_LOWER(linalg_inv_ex) {
  if (c.bool_("check_errors")) throw Unsupported("inv_ex: check_errors");
  Value a = square_input(b, c, "A", linalg_type(c));
  if (auto e = empty_outputs(b, c, a)) return *e;
  Lu f = lu_factor(b, a);
  const Shape& s = a.shape();
  Value eye = b.convert(b.compare(Cmp::EQ, b.iota(Type{I64, s}, a.rank() - 2), b.iota(Type{I64, s}, a.rank() - 1)),
                        a.elem());
  return {lu_solve(b, f, eye, true), f.info};
}

TPU_LOWER(_linalg_solve_ex) {
  if (c.bool_("check_errors")) throw Unsupported("solve_ex: check_errors");
  const ElemType t = linalg_type(c);
  const Type &ro = out_type(c, 0), &luo = out_type(c, 1);
  Value a = c.tensor("A");
  if (a.rank() < 2) throw Unsupported("solve_ex: non-matrix input");
  if (empty(a.shape()) || empty(ro.shape)) return *empty_outputs(b, c, b.zeros(Type{t, {0}}));
  a = b.broadcast_to(b.convert(a, t), luo.shape);
  Lu f = lu_factor(b, a);
  const bool left = c.bool_("left", true);
  Value rhs = b.convert(c.tensor("B"), t);
  const bool vector = ro.rank() == luo.rank() - 1;  // B is a (batch of) vector(s): one column
  Shape rs = ro.shape, bs = rhs.shape();
  if (vector) {
    rs.push_back(1);
    bs.push_back(1);
  }
  if (batch_of(luo.shape) != batch_of(rs)) throw Unsupported("solve_ex: batch shapes");
  rhs = b.broadcast_to(b.reshape(rhs, bs), rs);
  Value x = lu_solve(b, f, rhs, left);
  return {b.reshape(x, ro.shape), f.lu, f.piv, f.info};
}

}  // namespace tpu::lowering
