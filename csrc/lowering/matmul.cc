// Matrix products: mm, bmm, addmm, baddbmm, addbmm, addmv, addr, mv, dot, vdot.
// (matmul/outer/linear are CompositeImplicit in ATen and reach us as these ops.)
//
// Float16/bfloat16 products use dot_general with a float32 result (preferred element type)
// and the runtime converts to the output dtype; integer products accumulate in the integer
// output type. The `beta`/`alpha` Scalars are runtime operands: beta == 0 ignores `self`
// (NaN/inf included) like PyTorch, selected at runtime.
#include <vector>

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
    // Both operands must share an element type; widen the narrower one when they differ.
    if (l.elem() != r.elem() || !shlo::is_float(l.elem())) {
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

}  // namespace

TPU_LOWER(mm) {
  ElemType t = prod_type(out_type(c).elem);
  return {dot(b, c.tensor("self"), c.tensor("mat2"), {}, {}, {1}, {0}, t)};
}

TPU_LOWER(bmm) {
  ElemType t = prod_type(out_type(c).elem);
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
  return {add_scaled(b, c, dot(b, c.tensor("mat1"), c.tensor("mat2"), {}, {}, {1}, {0}, t))};
}

TPU_LOWER(baddbmm) {
  ElemType t = prod_type(out_type(c).elem);
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

}  // namespace tpu::lowering
