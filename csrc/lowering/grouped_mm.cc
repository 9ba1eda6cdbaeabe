// aten::_grouped_mm: one matrix product per group, groups given by `offs` (int32 cumulative
// group ends), without reading the offsets back to the host (PyTorch's generic kernel loops
// over groups with one .item() each).
//
// Forms (G groups; row/column/contraction index r belongs to group #{g : offs[g] <= r}):
//   2-D x 3-D  [M,K] x [G,K,N] -> [M,N]    offs over the rows of self
//   3-D x 2-D  [G,M,K] x [K,N] -> [M,N]    offs over the columns of mat2
//   2-D x 2-D  [M,K] x [K,N]  -> [G,M,N]   offs over K (weight gradients)
//   3-D x 3-D  [G,M,K] x [G,K,N] -> [G,M,N] (batched, no offs)
// Rows (columns) at or past offs[G-1] belong to no group: PyTorch leaves them uninitialised,
// we write zeros. Empty groups give zero blocks (2-D x 2-D) or simply own no rows.
//
// Strategy (chosen for XLA:CPU at MoE decode sizes, see benchmarks/bench_grouped_mm.py): every
// group's product is computed densely (G x the useful flops, one large GEMM that XLA runs
// well) and each row keeps its own group's result with a select, so a NaN/inf in one expert's
// weights never leaks into rows routed elsewhere (a masked-multiply would turn 0 * inf into NaN).
// For 2-D x 2-D both operands are masked to the group's K range before a batched GEMM.
// float16/bfloat16 inputs feed the GEMM directly with a float32 result (like mm), converted
// back by the runtime.
#include <vector>

#include "lowering.h"

namespace tpu::lowering {
namespace {

constexpr ElemType I64 = ElemType::S64;

// dot_general with both operands in one element type and a result of type `t`.
Value gdot(Builder& b, Value l, Value r, const std::vector<int64_t>& lb, const std::vector<int64_t>& rb,
           const std::vector<int64_t>& lc, const std::vector<int64_t>& rc, ElemType t) {
  if (l.elem() != r.elem() || !shlo::is_float(l.elem()) || shlo::bit_width(l.elem()) > shlo::bit_width(t)) {
    l = b.convert(l, t);
    r = b.convert(r, t);
  }
  return b.dot_general(l, r, lb, rb, lc, rc, t);
}

// Group id of each index 0..n-1 along a grouped dim: #{g : offs[g] <= i}, shape [n], s64.
// Equals G for indices past the last offset.
Value group_ids(Builder& b, Value offs, int64_t n) {
  const int64_t g = offs.shape()[0];
  Value o = b.broadcast_in_dim(b.convert(offs, I64), {n, g}, {1});
  Value i = b.iota(Type{I64, {n, g}}, 0);
  Value le = b.convert(b.compare(Cmp::LE, o, i), I64);
  return b.reduce(le, b.constant_i(0, I64), {1}, "add");
}

// mask[...] = (gid along `gid_dim` == group index along `g_dim`), for a result of `shape`.
Value group_mask(Builder& b, Value gid, const Shape& shape, int64_t gid_dim, int64_t g_dim) {
  Value gi = b.broadcast_in_dim(gid, shape, {gid_dim});
  return b.compare(Cmp::EQ, gi, b.iota(Type{I64, shape}, g_dim));
}

// Sums `all` over its group dim `g_dim`, keeping only the entries selected by `mask`.
Value select_group(Builder& b, Value all, Value mask, int64_t g_dim) {
  Value kept = b.select(mask, all, b.zeros(all.type));
  return b.reduce(kept, b.constant_i(0, all.elem()), {g_dim}, "add");
}

}  // namespace

TPU_LOWER(_grouped_mm) {
  const Type& o = out_type(c);
  if (c.has("bias")) throw Unsupported("_grouped_mm: bias (PyTorch does not support it either)");
  if (!shlo::is_float(o.elem)) throw Unsupported("_grouped_mm: non-float output");
  const ElemType t = opmath(o.elem);
  Value a = c.tensor("self"), w = c.tensor("mat2");
  const int64_t ra = a.rank(), rw = w.rank();
  if (o.numel() == 0) return {b.zeros(o)};

  if (ra == 3 && rw == 3) return {gdot(b, a, w, {0}, {0}, {2}, {1}, t)};
  if (!c.has("offs")) throw Unsupported("_grouped_mm: 2-D operand without offs");
  Value offs = c.tensor("offs");
  const int64_t g = offs.shape()[0];

  if (ra == 2 && rw == 3) {  // [M,K] x [G,K,N]: offs over rows
    const int64_t m = a.shape()[0], n = w.shape()[2];
    Value all = gdot(b, a, w, {}, {}, {1}, {1}, t);  // [M, G, N]
    Value mask = group_mask(b, group_ids(b, offs, m), {m, g, n}, 0, 1);
    return {select_group(b, all, mask, 1)};
  }
  if (ra == 3 && rw == 2) {  // [G,M,K] x [K,N]: offs over columns
    const int64_t m = a.shape()[1], n = w.shape()[1];
    Value all = gdot(b, a, w, {}, {}, {2}, {0}, t);  // [G, M, N]
    Value mask = group_mask(b, group_ids(b, offs, n), {g, m, n}, 2, 0);
    return {select_group(b, all, mask, 0)};
  }
  if (ra == 2 && rw == 2) {  // [M,K] x [K,N]: offs over K -> [G,M,N]
    const int64_t m = a.shape()[0], k = a.shape()[1], n = w.shape()[1];
    Value gid = group_ids(b, offs, k);
    Value am = group_mask(b, gid, {g, m, k}, 2, 0);
    Value wm = group_mask(b, gid, {g, k, n}, 1, 0);
    Value ae = b.broadcast_in_dim(a, {g, m, k}, {1, 2});
    Value we = b.broadcast_in_dim(w, {g, k, n}, {1, 2});
    ae = b.select(am, ae, b.zeros(ae.type));
    we = b.select(wm, we, b.zeros(we.type));
    return {gdot(b, ae, we, {0}, {0}, {2}, {1}, t)};
  }
  throw Unsupported("_grouped_mm: operands must be 2-D or 3-D");
}

}  // namespace tpu::lowering
