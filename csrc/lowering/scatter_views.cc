// The functional inverses of views (slice_scatter, select_scatter): functionalized graphs
// express in-place writes through views with them.
#include "lowering.h"

namespace tpu::lowering {

namespace {

// Writes `src` into `self` at positions start, start+step, ... along `dim` (src has the strided
// length along dim). Interior padding places src and a mask; a select merges them.
Value strided_insert(Builder& b, Value self, Value src, int64_t dim, int64_t start, int64_t step) {
  src = b.convert(src, self.elem());
  int64_t n = self.shape()[dim], len = src.shape()[dim];
  if (len == 0) return self;
  int64_t rank = self.rank();
  Shape lo(rank, 0), hi(rank, 0), interior(rank, 0);
  lo[dim] = start;
  interior[dim] = step - 1;
  hi[dim] = n - (start + (len - 1) * step + 1);
  Value placed = b.pad(src, b.zeros(Type{self.elem(), {}}), lo, hi, interior);
  Value ones = b.constant_i(1, ElemType::Pred, src.shape());
  Value mask = b.pad(ones, b.constant_i(0, ElemType::Pred), lo, hi, interior);
  return b.select(mask, placed, self);
}

}  // namespace

TPU_LOWER(slice_scatter) {
  Value self = c.tensor("self"), src = c.tensor("src");
  int64_t dim = norm_dim(c.int_("dim", 0), self.rank());
  int64_t n = self.shape()[dim];
  int64_t start = c.has("start") ? c.arg("start").i : 0;
  if (start < 0) start += n;
  start = std::max<int64_t>(0, std::min(start, n));
  return {strided_insert(b, self, src, dim, start, c.int_("step", 1))};
}

TPU_LOWER(select_scatter) {
  Value self = c.tensor("self"), src = c.tensor("src");
  int64_t dim = norm_dim(c.int_("dim"), self.rank());
  int64_t idx = c.int_("index");
  if (idx < 0) idx += self.shape()[dim];
  Shape s = self.shape();
  s[dim] = 1;
  return {strided_insert(b, self, b.reshape(src, s), dim, idx, 1)};
}

}  // namespace tpu::lowering

namespace tpu::lowering {

// isin: every element compared with every test element (fine for the small test sets that
// generation and masking use), then reduced with `or`.
TPU_LOWER(isin) {
  const Type& o = out_type(c);
  ElemType t = c.common;
  Value elems = c.has("elements") ? (c.arg("elements").kind == Arg::Kind::Tensor
                                         ? c.tensor("elements")
                                         : c.arg("elements").scalar)
                                  : c.arg("element").scalar;
  Value tests = c.has("test_elements") ? (c.arg("test_elements").kind == Arg::Kind::Tensor
                                              ? c.tensor("test_elements")
                                              : c.arg("test_elements").scalar)
                                       : c.arg("test_element").scalar;
  Value e = b.reshape(b.convert(elems, t), {elems.type.numel()});
  Value s = b.reshape(b.convert(tests, t), {tests.type.numel()});
  int64_t n = e.shape()[0], m = s.shape()[0];
  Value eq = b.compare(Cmp::EQ, b.broadcast_in_dim(e, {n, m}, {0}), b.broadcast_in_dim(s, {n, m}, {1}));
  Value any = b.reduce(eq, b.constant_i(0, ElemType::Pred), {1}, "or");
  if (c.bool_("invert")) any = b.not_(any);
  return {b.reshape(any, o.shape)};
}

}  // namespace tpu::lowering
