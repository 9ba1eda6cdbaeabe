// Pointwise math helpers shared by the elementwise and nn lowerings (defined in
// elementwise_unary.cc): comparisons, NaN-propagating max/min, and the accurate float kernels
// (erf, tanh, log1p, sigmoid) PyTorch's CPU results are matched against.
#pragma once
#include "lowering.h"

namespace tpu::lowering::ew {

Value like_const(Builder& b, double v, const Value& like);  // v broadcast to like's type
Value lt(Builder& b, Value x, Value y);
Value le(Builder& b, Value x, Value y);
Value gt(Builder& b, Value x, Value y);
Value ge(Builder& b, Value x, Value y);
Value eq(Builder& b, Value x, Value y);
Value ne(Builder& b, Value x, Value y);
Value isnan(Builder& b, Value x);
Value isinf(Builder& b, Value x);
Value nan_max(Builder& b, Value x, Value y);  // NaN if either is NaN (PyTorch's maximum)
Value nan_min(Builder& b, Value x, Value y);
ElemType float_type(const OpCall& c);  // the float type unary math computes in
Value input_as(Builder& b, const OpCall& c, const char* name, ElemType t);  // argument `name` as t
Value signbit(Builder& b, Value x);
Value erf(Builder& b, Value x);
Value tanh(Builder& b, Value x);
Value log1p(Builder& b, Value x);
Value sigmoid(Builder& b, Value x);
Value trunc(Builder& b, Value x);

}  // namespace tpu::lowering::ew
