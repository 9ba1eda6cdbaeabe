// Helpers shared by the linear-algebra lowerings (matmul.cc: triangular and LU solves,
// lu_unpack; linalg.cc: LU factorization, inverse, solve, determinants).
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "lowering.h"

namespace tpu::lowering {

// Float type a linalg op computes in (f16/bf16 -> f32; CPU LAPACK has only f32/f64 anyway).
inline ElemType linalg_type(const OpCall& c, size_t out = 0) {
  ElemType t = out_type(c, out).elem;
  if (!shlo::is_float(t)) throw Unsupported(c.name + ": non-float dtype");
  return opmath(t);
}

inline Shape batch_of(const Shape& s) { return Shape(s.begin(), s.end() - 2); }
inline Shape with_mat(Shape batch, int64_t r, int64_t k) {
  batch.push_back(r);
  batch.push_back(k);
  return batch;
}

// Swaps the last two dims.
inline Value mT(Builder& b, Value x) {
  std::vector<int64_t> perm;
  for (int64_t i = 0; i < x.rank(); ++i) perm.push_back(i);
  std::swap(perm[x.rank() - 1], perm[x.rank() - 2]);
  return b.transpose(x, perm);
}

// stablehlo.triangular_solve: op(a) x = rhs (left) or x op(a) = rhs; a [..., n, n] and rhs
// share their batch dims. Only the `lower` triangle of a (or the upper one) is read.
inline Value tri_solve(Builder& b, Value a, Value rhs, bool left, bool lower, bool unit, bool transpose) {
  std::string attrs = std::string("left_side = ") + (left ? "true" : "false") +
                      ", lower = " + (lower ? "true" : "false") +
                      ", unit_diagonal = " + (unit ? "true" : "false") +
                      ", transpose_a = #stablehlo<transpose " + (transpose ? "TRANSPOSE" : "NO_TRANSPOSE") +
                      ">";
  return b.op("triangular_solve", {a, rhs}, rhs.type, attrs);
}

inline bool empty(const Shape& s) {
  for (int64_t d : s)
    if (d == 0) return true;
  return false;
}

// The row permutation of LAPACK pivots (1-based, applied as sequential row swaps i <-> piv[i]-1
// for i < k) as an s64 vector [..., m]: perm[r] is the row of A that lands in row r of P^T A.
inline Value pivots_to_perm(Builder& b, Value piv, const Shape& batch, int64_t m) {
  int64_t k = piv.shape().back();
  if (k > 512) throw Unsupported("LU pivots: more than 512 row swaps (unrolled program too large)");
  const ElemType I = ElemType::S64;
  Shape s = batch;
  s.push_back(m);
  std::vector<int64_t> bdims;
  for (size_t i = 0; i < batch.size(); ++i) bdims.push_back(static_cast<int64_t>(i));
  Value iota = b.iota(Type{I, s}, static_cast<int64_t>(batch.size()));
  Value perm = iota;
  Shape pb = batch;
  pb.push_back(k);
  piv = b.broadcast_to(b.convert(piv, I), pb);
  const int64_t last = static_cast<int64_t>(batch.size());
  for (int64_t i = 0; i < k; ++i) {
    Shape st(pb.size(), 0), lim = pb;
    st[last] = i;
    lim[last] = i + 1;
    Value p = b.sub(b.reshape(b.slice(piv, st, lim), batch), b.constant_i(1, I, batch));  // [...]
    Value pb_ = b.broadcast_in_dim(p, s, bdims);
    Value at_p = b.compare(Cmp::EQ, iota, pb_);
    Value at_i = b.compare(Cmp::EQ, iota, b.constant_i(i, I, s));
    Value perm_p = b.reduce(b.select(at_p, perm, b.zeros(Type{I, s})), b.constant_i(0, I), {last}, "add");
    Shape ps(s.size(), 0), pl = s;
    ps[last] = i;
    pl[last] = i + 1;
    Value perm_i = b.reshape(b.slice(perm, ps, pl), batch);
    perm = b.select(at_i, b.broadcast_in_dim(perm_p, s, bdims),
                    b.select(at_p, b.broadcast_in_dim(perm_i, s, bdims), perm));
  }
  return perm;
}

// (P^T x)[r] = x[perm[r]] (inverse = false) or (P x)[perm[r]] = x[r] (inverse = true), rows of
// x [..., m, k]. Selects (not a one-hot product), so infinities and NaNs stay where they were.
inline Value permute_rows(Builder& b, Value x, Value perm, bool inverse) {
  const Shape& xs = x.shape();
  int64_t r = x.rank();
  int64_t m = xs[r - 2];
  Shape big = batch_of(xs);
  big.push_back(m);
  big.push_back(m);
  big.push_back(xs[r - 1]);
  // big[..., row, j, k]: eq = (perm[row] == j). P^T x: out[row] = sum_j eq x[j] (x on j, reduce j);
  // P x: out[j] = sum_row eq x[row] (x on row, reduce row).
  std::vector<int64_t> pd;
  for (int64_t i = 0; i < r - 2; ++i) pd.push_back(i);
  pd.push_back(r - 2);
  Value iota_j = b.iota(Type{ElemType::S64, big}, r - 1);
  Value eq = b.compare(Cmp::EQ, b.broadcast_in_dim(perm, big, pd), iota_j);
  std::vector<int64_t> xd;
  for (int64_t i = 0; i < r - 2; ++i) xd.push_back(i);
  xd.push_back(inverse ? r - 2 : r - 1);
  xd.push_back(r);
  Value xb = b.broadcast_in_dim(x, big, xd);
  Value picked = b.select(eq, xb, b.zeros(Type{x.elem(), big}));
  return b.reduce(picked, b.constant_f(0, x.elem()), {inverse ? r - 2 : r - 1}, "add");
}

}  // namespace tpu::lowering
