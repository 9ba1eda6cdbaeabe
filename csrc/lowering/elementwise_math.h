// Pointwise math helpers shared by the elementwise lowerings (defined in elementwise_unary.cc):
// comparisons, NaN-aware min/max, and accurate erf/tanh/log1p/... built from StableHLO ops.
#pragma once

#include "lowering.h"

namespace tpu::lowering::ew {

// A constant of `like`'s element type and shape.
Value constant_like(Builder& b, double v, const Value& like);
Value lt(Builder& b, Value x, Value y);
Value le(Builder& b, Value x, Value y);
Value gt(Builder& b, Value x, Value y);
Value ge(Builder& b, Value x, Value y);
Value eq(Builder& b, Value x, Value y);
Value ne(Builder& b, Value x, Value y);
Value isnan(Builder& b, Value x);
Value isinf(Builder& b, Value x);
// maximum/minimum that propagate NaN from either side (PyTorch's maximum/minimum/clamp).
Value nan_max(Builder& b, Value x, Value y);
Value nan_min(Builder& b, Value x, Value y);
// Compute type of a floating-point op: integer/bool inputs promote to the float type PyTorch
// chose for the output; f16/bf16 compute in f32.
ElemType float_type(const OpCall& c);
// Argument `name` converted to `t` and broadcast to the output's shape.
Value arg_operand(Builder& b, const OpCall& c, const char* name, ElemType t);
Value signbit(Builder& b, Value x);
Value erf(Builder& b, Value x);
Value tanh(Builder& b, Value x);
Value log1p(Builder& b, Value x);
Value sigmoid(Builder& b, Value x);
Value trunc(Builder& b, Value x);

}  // namespace tpu::lowering::ew
