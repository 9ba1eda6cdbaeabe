// Matrix products: mm, _scaled_mm (float8), bmm, addmm, baddbmm, addbmm, addmv, addr, mv, dot, vdot.
// (matmul/outer/linear are CompositeImplicit in ATen and reach us as these ops.)
// Triangular and LU solves (linalg_solve_triangular, triangular_solve, _cholesky_solve_helper,
// linalg_lu_solve, lu_unpack): the backward formulas of cholesky/qr/lu/det/solve use them.
//
// Float16/bfloat16 products use dot_general with a float32 result (preferred element type)
// and the runtime converts to the output dtype; integer products accumulate in the integer
// output type. The `beta`/`alpha` Scalars are runtime operands: beta == 0 ignores `self`
// (NaN/inf included) like PyTorch, selected at runtime.
//
// On the CPU plugin, float32 mm / addmm / bmm / baddbmm from a measured size on are the host GEMM
// (host_gemm.h, aten/ffi_gemm.cc: PyTorch's CPU GEMM as an FFI custom call; see host_product()) in
// strict and fused eager and, by their own measured rule (GraphGemmScope), in compiled graphs.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "host_gemm.h"
#include "host_kernels.h"
#include "linalg_util.h"
#include "lowering.h"

namespace tpu::lowering {
namespace {

// Element type the product is computed in for an op whose output has element type `out`.
ElemType prod_type(ElemType out) {
  if (out == ElemType::Pred) throw Unsupported("matmul on bool tensors");
  return opmath(out);
}

// dot_general with operands brought to a type the result type accepts: floats keep their own
// (narrow) type with a wider result; integers are converted to the result type.
Value dot(Builder& b, Value l, Value r, const std::vector<int64_t>& lb, const std::vector<int64_t>& rb,
          const std::vector<int64_t>& lc, const std::vector<int64_t>& rc, ElemType t) {
  if (shlo::is_float(t)) {
    // Both operands must share an element type; widen the narrower one when they differ. XLA:CPU's
    // DotThunk also rejects some bf16 x bf16 = f32 products at run time (seen in bilinear's
    // backward), so narrow floats are widened to the result type too (exact).
    if (l.elem() != r.elem() || !shlo::is_float(l.elem()) || shlo::bit_width(l.elem()) < shlo::bit_width(t)) {
      l = b.convert(l, t);
      r = b.convert(r, t);
    }
    if (shlo::bit_width(l.elem()) > shlo::bit_width(t)) {  // e.g. f64 inputs, f32 result
      l = b.convert(l, t);
      r = b.convert(r, t);
    }
  } else {
    l = b.convert(l, t);
    r = b.convert(r, t);
  }
  return b.dot_general(l, r, lb, rb, lc, rc, t);
}

Value scalar_arg(Builder& b, const OpCall& c, const char* name, ElemType t, const Shape& s) {
  if (!c.has(name)) return b.constant_i(1, t, s);
  return operand(b, c.arg(name), t, s);
}

// beta * self + alpha * product, with beta == 0 ignoring self.
Value add_scaled(Builder& b, const OpCall& c, Value product) {
  const Shape& s = product.shape();
  ElemType t = product.elem();
  Value alpha = scalar_arg(b, c, "alpha", t, s);
  Value self = operand(b, c.arg("self"), t, s);
  Value scaled = b.mul(alpha, product);
  if (!c.has("beta")) return b.add(self, scaled);
  const Arg& beta_arg = c.arg("beta");
  Value beta = operand(b, beta_arg, t, s);
  Value beta_zero;
  if (beta_arg.kind == Arg::Kind::Scalar) {
    Value raw = beta_arg.scalar;
    beta_zero = b.broadcast_to(b.compare(Cmp::EQ, raw, b.zeros(Type{raw.elem(), raw.shape()})), s);
  } else {
    beta_zero = b.compare(Cmp::EQ, beta, b.zeros(Type{t, s}));
  }
  Value bs = b.select(beta_zero, b.zeros(Type{t, s}), b.mul(beta, self));
  return b.add(bs, scaled);
}

// ---- the host GEMM (host_gemm.h)

// The constant value of Scalar argument `name` (1 when absent); nullopt when it is a runtime operand.
std::optional<double> const_scalar(const OpCall& c, const char* name) {
  if (!c.has(name)) return 1.0;
  const Arg& a = c.arg(name);
  if (a.kind == Arg::Kind::Scalar) return a.scalar_value;
  if (a.kind == Arg::Kind::Double) return a.d;
  if (a.kind == Arg::Kind::Int) return static_cast<double>(a.i);
  return std::nullopt;
}

std::string f64_attr(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17e", v);
  return std::string(buf) + " : f64";
}

// op(l) op(r) [* alpha + beta * self] as the host GEMM when it is wanted for this product;
// nullopt: the XLA path. `l` [.., M, K], `r` [.., K, N] (rank 2, or rank 3 with a common batch);
// `scaled`: addmm/baddbmm (self, beta, alpha); the scalars go to the call when they are program
// constants, otherwise the product alone is the call and add_scaled applies them.
std::optional<Value> host_product(Builder& b, const OpCall& c, Value l, Value r, bool scaled) {
  const Type& o = out_type(c);
  const int64_t rank = l.rank();
  if (o.elem != ElemType::F32 || l.elem() != o.elem || r.elem() != o.elem) return std::nullopt;
  if ((rank != 2 && rank != 3) || r.rank() != rank || o.rank() != rank) return std::nullopt;
  const int64_t batch = rank == 3 ? l.shape()[0] : 1, m = l.shape()[rank - 2], k = l.shape()[rank - 1],
                n = r.shape()[rank - 1];
  if (r.shape()[rank - 2] != k || (rank == 3 && r.shape()[0] != batch)) return std::nullopt;
  if (!host_gemm_wanted(o.elem, batch, m, k, n)) return std::nullopt;
  // A transposed operand is passed as the array it transposes (no copy in the program).
  const std::vector<int64_t> swap = rank == 2 ? std::vector<int64_t>{1, 0} : std::vector<int64_t>{0, 2, 1};
  const std::optional<Value> lt = b.transposed_from(l, swap), rt = b.transposed_from(r, swap);
  Value self = l;  // placeholder operand when there is no addend
  std::optional<double> alpha = 1.0, beta = 0.0;
  bool has_c = false;
  if (scaled) {
    alpha = const_scalar(c, "alpha");
    beta = const_scalar(c, "beta");
    self = c.tensor("self");
    has_c = alpha && beta && self.elem() == o.elem && self.rank() <= rank;
    if (!has_c) alpha = 1.0, beta = 0.0, self = l;
  }
  const std::string attrs = std::string("call_target_name = \"") + kHostGemmTarget +
                            "\", api_version = 4 : i32, backend_config = {trans_a = " + (lt ? "1" : "0") +
                            " : i64, trans_b = " + (rt ? "1" : "0") + " : i64, has_c = " + (has_c ? "1" : "0") +
                            " : i64, alpha = " + f64_attr(*alpha) + ", beta = " + f64_attr(*beta) + "}";
  Value y = b.op("custom_call", {lt ? *lt : l, rt ? *rt : r, self}, o, attrs);
  if (scaled && !has_c) y = add_scaled(b, c, y);
  return y;
}

}  // namespace

// When the host GEMM beats XLA's dot. Session 9 (aten/ffi_gemm.cc on two threads from 2^22
// multiply-adds), F.linear(x, w, b) at bench_models_hf's shapes, strict eager, alternated processes
// (XLA dot / host GEMM one thread / two threads), ms wall at load 5-8, two rounds:
// few rows, the host GEMM wins at every load: [128,256]x[256,1024] 3.2-6.1 / 1.9-4.9 / 1.5-3.5,
// [128,1024]x[1024,256] 3.7-7.3 / 1.9-2.7 / 1.6-3.0, [64,256]x[256,256] 0.8-1.5 / 0.3-0.7 / 0.4-0.5,
// [16,256]x[256,1024] 1.0-2.0 / 0.5-1.0 / 0.4-1.0, bmm [16,128,64]x[16,64,128] 1.7-4.1 / 1.6-2.2 /
// 1.2-2.5. Many rows (a whole batch's tokens), mixed: [512,256]x[256,1024] 9.6-13.7 / 6.8-12.7 /
// 7.9-16.9, [580,256]x[256,1024] 9.7-13.3 / 9.3-20.8 / 8.4-17.2, [512,1024]x[1024,256] 7.0-15.7 /
// 6.7-13.9 / 8.0-17.2; on a quiet machine XLA's dot runs there on both cores (session 8:
// [512,256]x[256,1024] 2.9 ms against one MKL thread's 4.6, PyTorch's two threads 2.45). So the host
// GEMM takes products of at most kHostGemmMaxRows rows (per batch entry): a decode step's or a short
// decoder's Linears and attention products. Session 8 (one thread), load ~3, XLA / host:
// [4,256]x[256,256] 0.14-0.17 / 0.04-0.06; [8,256]x[256,1024] 0.85 / 0.16-0.17. One-row products
// (GEMVs, [1,256]x[256,1024]: 0.07-0.08 either way) stay XLA's. Below 2^18 multiply-adds a call is
// tens of microseconds either way. "always" (host_kernels_any_size) takes every product. (These were
// measured with MKL blocks; since session 10 rank-2 blocks run oneDNN at about half the CPU time,
// ffi_gemm.cc, so the 128-row cap may now be low in eager too: not re-measured.)
constexpr int64_t kHostGemmMinMacs = int64_t{1} << 18;
constexpr int64_t kHostGemmMinRows = 2;
constexpr int64_t kHostGemmMaxRows = 128;

// In compiled graphs (GraphGemmScope) the host GEMM takes products of 2..512 rows from 2^20
// multiply-adds. Session 10, its kernel being oneDNN's (aten/ffi_gemm.cc), one F.linear compiled
// alone, host / XLA dot CPU ms per call at load ~5: [128,512]x[512,1376] 0.77x, [512,512]x[512,1376]
// 0.78x, [256,1280]x[1280,1280] 0.73x, but [1024,640]x[640,2560] 1.01x, [4096,320]x[320,1280] 1.05x,
// [4096,320]x[320,320] 0.98x (XLA's dot on many rows is as good and keeps XLA's fusions); bench_compile
// prefill (all Linears [128,512]x[512,N]) 0.88x wall, 0.95x CPU. One-row products stay XLA's: its
// fused GEMV beat the call on decode's lm_head [1,512]x[512,32000] (decode CPU ms/token 10.0 vs 8.0).
// Below 2^20 multiply-adds XLA's dot fuses with its neighbours at little cost (the swapped-product
// threshold, aten/graph.cc). Batched products (bmm) stay XLA's there: the call runs them on MKL,
// about twice oneDNN's CPU time per multiply-add on this machine (ffi_gemm.cc).
constexpr int64_t kGraphGemmMinMacs = int64_t{1} << 20;
constexpr int64_t kGraphGemmMaxRows = 512;

namespace {
thread_local bool in_graph = false;
}  // namespace

GraphGemmScope::GraphGemmScope() : prev_(in_graph) { in_graph = true; }
GraphGemmScope::~GraphGemmScope() { in_graph = prev_; }

bool host_gemm_wanted(ElemType t, int64_t batch, int64_t m, int64_t k, int64_t n) {
  if (t != ElemType::F32 || batch <= 0 || m <= 0 || k <= 0 || n <= 0) return false;
  if (!host_kernel_enabled(HostKernel::Gemm)) return false;
  if (host_kernels_any_size()) return true;
  const int64_t macs = batch * m * k * n;
  if (in_graph)
    return batch == 1 && m >= kHostGemmMinRows && m <= kGraphGemmMaxRows && macs >= kGraphGemmMinMacs;
  return m >= kHostGemmMinRows && m <= kHostGemmMaxRows && macs >= kHostGemmMinMacs;
}

TPU_LOWER(mm) {
  ElemType t = prod_type(out_type(c).elem);
  if (auto y = host_product(b, c, c.tensor("self"), c.tensor("mat2"), false)) return {*y};
  return {dot(b, c.tensor("self"), c.tensor("mat2"), {}, {}, {1}, {0}, t)};
}

// float8 GEMM as PyTorch's CPU kernel computes it: (a.f32 * scale_a) @ (b.f32 * scale_b) (+ bias) in
// f32, then the output dtype; tensor-wise () / (1,) or row-wise (M,1) x (1,N) scales;
// `scale_result` is ignored as on the CPU. Other scale layouts (block-wise) take the CPU path.
TPU_LOWER(_scaled_mm) {
  const ElemType f = ElemType::F32;
  Value a = b.convert(c.tensor("self"), f), m = b.convert(c.tensor("mat2"), f);
  auto scaled = [&](Value x, const char* name) {
    Value s = c.tensor(name);
    if (s.type.numel() != 1 && s.rank() != x.rank()) throw Unsupported("_scaled_mm: block-wise scales");
    if (s.type.numel() == 1) s = b.reshape(s, {});
    return b.mul(x, cast_to(b, s, f, x.shape()));
  };
  Value r = b.dot_general(scaled(a, "scale_a"), scaled(m, "scale_b"), {}, {}, {1}, {0}, f);
  if (c.has("bias")) r = b.add(r, operand(b, c.arg("bias"), f, r.shape()));
  return {r};
}

TPU_LOWER(bmm) {
  ElemType t = prod_type(out_type(c).elem);
  if (auto y = host_product(b, c, c.tensor("self"), c.tensor("mat2"), false)) return {*y};
  return {dot(b, c.tensor("self"), c.tensor("mat2"), {0}, {0}, {2}, {1}, t)};
}

TPU_LOWER(mv) {
  ElemType t = prod_type(out_type(c).elem);
  return {dot(b, c.tensor("self"), c.tensor("vec"), {}, {}, {1}, {0}, t)};
}

TPU_LOWER(dot) {
  ElemType t = prod_type(out_type(c).elem);
  return {dot(b, c.tensor("self"), c.tensor("tensor"), {}, {}, {0}, {0}, t)};
}

TPU_LOWER(vdot) {  // conj(self) . other; reals only
  ElemType t = prod_type(out_type(c).elem);
  return {dot(b, c.tensor("self"), c.tensor("other"), {}, {}, {0}, {0}, t)};
}

TPU_LOWER(addmm) {
  ElemType t = prod_type(out_type(c).elem);
  if (auto y = host_product(b, c, c.tensor("mat1"), c.tensor("mat2"), true)) return {*y};
  return {add_scaled(b, c, dot(b, c.tensor("mat1"), c.tensor("mat2"), {}, {}, {1}, {0}, t))};
}

TPU_LOWER(baddbmm) {
  ElemType t = prod_type(out_type(c).elem);
  if (auto y = host_product(b, c, c.tensor("batch1"), c.tensor("batch2"), true)) return {*y};
  return {add_scaled(b, c, dot(b, c.tensor("batch1"), c.tensor("batch2"), {0}, {0}, {2}, {1}, t))};
}

TPU_LOWER(addbmm) {  // sum over the batch folded into the contraction
  ElemType t = prod_type(out_type(c).elem);
  return {add_scaled(b, c, dot(b, c.tensor("batch1"), c.tensor("batch2"), {}, {}, {0, 2}, {0, 1}, t))};
}

TPU_LOWER(addmv) {
  ElemType t = prod_type(out_type(c).elem);
  return {add_scaled(b, c, dot(b, c.tensor("mat"), c.tensor("vec"), {}, {}, {1}, {0}, t))};
}

TPU_LOWER(addr) {
  ElemType t = prod_type(out_type(c).elem);
  Value v1 = b.convert(c.tensor("vec1"), t);
  Value v2 = b.convert(c.tensor("vec2"), t);
  Shape s{v1.shape()[0], v2.shape()[0]};
  Value outer = b.mul(b.broadcast_in_dim(v1, s, {0}), b.broadcast_in_dim(v2, s, {1}));
  return {add_scaled(b, c, outer)};
}

// ---------------------------------------------------------------- triangular / LU solves
// (helpers in linalg_util.h)
TPU_LOWER(linalg_solve_triangular) {
  const Type& o = out_type(c);
  ElemType t = linalg_type(c);
  if (empty(o.shape)) return {b.zeros(Type{t, o.shape})};
  bool left = c.bool_("left", true), upper = c.bool_("upper");
  int64_t n = left ? o.shape[o.rank() - 2] : o.shape.back();
  Value a = b.broadcast_to(b.convert(c.tensor("self"), t), with_mat(batch_of(o.shape), n, n));
  Value rhs = b.broadcast_to(b.convert(c.tensor("B"), t), o.shape);
  return {tri_solve(b, a, rhs, left, !upper, c.bool_("unitriangular"), false)};
}

TPU_LOWER(triangular_solve) {  // solves op(A) X = self; also returns A (broadcast)
  const Type& o = out_type(c, 0);
  ElemType t = linalg_type(c);
  Value a = b.broadcast_to(b.convert(c.tensor("A"), t), out_type(c, 1).shape);
  if (empty(o.shape)) return {b.zeros(Type{t, o.shape}), a};
  int64_t n = o.shape[o.rank() - 2];
  Value a_b = b.broadcast_to(a, with_mat(batch_of(o.shape), n, n));
  Value rhs = b.broadcast_to(b.convert(c.tensor("self"), t), o.shape);
  return {tri_solve(b, a_b, rhs, true, !c.bool_("upper", true), c.bool_("unitriangular"),
                    c.bool_("transpose")),
          a};
}

TPU_LOWER(_cholesky_solve_helper) {  // A = L L^T (or U^T U): two triangular solves
  const Type& o = out_type(c);
  ElemType t = linalg_type(c);
  if (empty(o.shape)) return {b.zeros(Type{t, o.shape})};
  int64_t n = o.shape[o.rank() - 2];
  Value a = b.broadcast_to(b.convert(c.tensor("A"), t), with_mat(batch_of(o.shape), n, n));
  Value rhs = b.broadcast_to(b.convert(c.tensor("self"), t), o.shape);
  bool upper = c.bool_("upper");
  // lower: L Y = B, L^T X = Y.  upper: U^T Y = B, U X = Y.
  Value y = tri_solve(b, a, rhs, true, !upper, false, upper);
  return {tri_solve(b, a, y, true, !upper, false, !upper)};
}

TPU_LOWER(linalg_lu_solve) {
  const Type& o = out_type(c);
  ElemType t = linalg_type(c);
  if (empty(o.shape)) return {b.zeros(Type{t, o.shape})};
  bool left = c.bool_("left", true), adjoint = c.bool_("adjoint");
  Value rhs = b.broadcast_to(b.convert(c.tensor("B"), t), o.shape);
  if (!left) {  // X A = B  <=>  A^T X^T = B^T (reals)
    rhs = mT(b, rhs);
    adjoint = !adjoint;
  }
  const Shape& rs = rhs.shape();
  int64_t n = rs[rs.size() - 2];
  Shape batch = batch_of(rs);
  Value lu = b.broadcast_to(b.convert(c.tensor("LU"), t), with_mat(batch, n, n));
  Value perm = pivots_to_perm(b, c.tensor("pivots"), batch, n);
  Value x;
  if (!adjoint) {  // A = P L U: X = U^-1 L^-1 P^T B
    Value y = tri_solve(b, lu, permute_rows(b, rhs, perm, false), true, true, true, false);
    x = tri_solve(b, lu, y, true, false, false, false);
  } else {  // A^T = U^T L^T P^T: X = P L^-T U^-T B
    Value y = tri_solve(b, lu, rhs, true, false, false, true);
    y = tri_solve(b, lu, y, true, true, true, true);
    x = permute_rows(b, y, perm, true);
  }
  return {left ? x : mT(b, x)};
}

TPU_LOWER(lu_unpack) {  // (P, L, U) with A = P L U from LU data [..., m, n] and pivots [..., k]
  ElemType t = linalg_type(c);
  const Type &po = out_type(c, 0), &lo = out_type(c, 1), &uo = out_type(c, 2);
  Value lu = b.convert(c.tensor("LU_data"), t);
  const Shape& s = lu.shape();
  int64_t r = lu.rank(), m = s[r - 2], n = s[r - 1], k = std::min(m, n);
  Shape batch = batch_of(s);
  Value P = b.zeros(Type{t, po.shape}), L = b.zeros(Type{t, lo.shape}), U = b.zeros(Type{t, uo.shape});
  if (!empty(lo.shape) || !empty(uo.shape)) {
    auto rows = [&](const Shape& sh) { return b.iota(Type{ElemType::S64, sh}, r - 2); };
    auto cols = [&](const Shape& sh) { return b.iota(Type{ElemType::S64, sh}, r - 1); };
    if (!empty(lo.shape)) {
      Shape ls = with_mat(batch, m, k);
      Shape st(r, 0), lim = ls;
      Value part = b.slice(lu, st, lim);
      Value i = rows(ls), j = cols(ls);
      Value one = b.constant_f(1, t, ls);
      L = b.select(b.compare(Cmp::GT, i, j), part,
                   b.select(b.compare(Cmp::EQ, i, j), one, b.zeros(Type{t, ls})));
    }
    if (!empty(uo.shape)) {
      Shape us = with_mat(batch, k, n);
      Shape st(r, 0), lim = us;
      Value part = b.slice(lu, st, lim);
      U = b.select(b.compare(Cmp::LE, rows(us), cols(us)), part, b.zeros(Type{t, us}));
    }
  }
  if (!empty(po.shape)) {
    Value piv = c.tensor("LU_pivots");
    Shape pbatch = batch_of(po.shape);
    Value perm = pivots_to_perm(b, piv, pbatch, m);  // [..., m]
    Shape ps = with_mat(pbatch, m, m);
    std::vector<int64_t> pd;
    for (size_t i = 0; i < pbatch.size(); ++i) pd.push_back(static_cast<int64_t>(i));
    pd.push_back(static_cast<int64_t>(pbatch.size()) + 1);  // perm[r] along the column dim
    Value j = b.iota(Type{ElemType::S64, ps}, static_cast<int64_t>(pbatch.size()));
    // P[j, r] = (perm[r] == j)
    Value eq = b.compare(Cmp::EQ, b.broadcast_in_dim(perm, ps, pd), j);
    P = b.select(eq, b.constant_f(1, t, ps), b.zeros(Type{t, ps}));
  }
  return {P, L, U};
}

}  // namespace tpu::lowering
