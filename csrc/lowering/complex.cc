// Complex construction and decomposition (torch.complex64 / complex128 values are StableHLO
// complex<f32> / complex<f64>): complex, polar, conj_physical, and view_as_real /
// view_as_complex as value computations for whole-graph programs (eager handles those two as
// metadata views, aten/ops_runtime.cc). Ops on complex values elsewhere declare `.complex`.
#include "lowering.h"

namespace tpu::lowering {

namespace {
// Argument `name` as the real type of the output's parts, broadcast to the output's shape.
Value part_arg(Builder& b, const OpCall& c, const char* name) {
  const Type& o = out_type(c);
  return operand(b, c.arg(name), part_type(o.elem), o.shape);
}

Value conj(Builder& b, const OpCall& c) {
  const Type& o = out_type(c);
  Value x = cast_to(b, c.tensor("self"), o.elem, o.shape);
  if (!is_complex(x.elem())) return x;
  return b.complex(b.real(x), b.neg(b.imag(x)));
}
}  // namespace

TPU_LOWER_ELEMENTWISE_COMPLEX(complex) { return {b.complex(part_arg(b, c, "real"), part_arg(b, c, "imag"))}; }

TPU_LOWER_ELEMENTWISE_COMPLEX(polar) {
  Value r = part_arg(b, c, "abs"), theta = part_arg(b, c, "angle");
  return {b.complex(b.mul(r, b.unary("cosine", theta)), b.mul(r, b.unary("sine", theta)))};
}

TPU_LOWER_ELEMENTWISE_COMPLEX(conj_physical) { return {conj(b, c)}; }
TPU_LOWER_ELEMENTWISE_COMPLEX(_conj_physical) { return {conj(b, c)}; }

// [..., 2] real pairs <-> complex values, the layout a complex storage has in memory.
TPU_LOWER_GRAPH_COMPLEX(view_as_real) {
  Value x = c.tensor("self");
  Shape pair = x.shape();
  pair.push_back(1);
  return {b.concatenate({b.reshape(b.real(x), pair), b.reshape(b.imag(x), pair)}, x.rank())};
}

TPU_LOWER_GRAPH_COMPLEX(view_as_complex) {
  Value x = c.tensor("self");
  const Type& o = out_type(c);
  Shape lo(x.rank(), 0), hi = x.shape();
  hi.back() = 1;
  Value re = b.reshape(b.slice(x, lo, hi), o.shape);
  lo.back() = 1;
  hi.back() = 2;
  Value im = b.reshape(b.slice(x, lo, hi), o.shape);
  return {b.complex(re, im)};
}

}  // namespace tpu::lowering

namespace tpu::lowering {

// The lazy conjugate / negative bits as values (compiled graphs hold logical values: a resolve
// is the value itself).
TPU_LOWER_GRAPH_COMPLEX(_conj) { return {conj(b, c)}; }
TPU_LOWER_GRAPH_COMPLEX(_neg_view) { return {b.neg(c.tensor("self"))}; }
TPU_LOWER_GRAPH_COMPLEX(resolve_conj) { return {c.tensor("self")}; }
TPU_LOWER_GRAPH_COMPLEX(resolve_neg) { return {c.tensor("self")}; }

}  // namespace tpu::lowering
