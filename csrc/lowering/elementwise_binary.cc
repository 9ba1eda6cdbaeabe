// Binary / ternary pointwise lowerings: arithmetic, comparisons, logical and bit ops, clamp,
// where, lerp/addcmul/addcdiv and the pointwise activation backwards.
#include <cmath>
#include <vector>

#include "elementwise_math.h"
#include "lowering.h"


namespace tpu::lowering {
namespace {
using namespace ew;

// Computation type for arithmetic: PyTorch's common dtype, f16/bf16 widened to f32.
ElemType arith(const OpCall& c) { return opmath(c.common); }
Value zero(Builder& b, const Value& like) { return b.zeros(like.type); }

// a + alpha * y (alpha optional), bool arithmetic as logical or/and.
Value add_scaled(Builder& b, const OpCall& c, Value x, Value y) {
  ElemType t = x.elem();
  if (c.has("alpha")) {
    Value alpha = input_as(b, c, "alpha", t);
    y = t == ElemType::Pred ? b.and_(y, alpha) : b.mul(y, alpha);
  }
  return t == ElemType::Pred ? b.or_(x, y) : b.add(x, y);
}
Value sub_scaled(Builder& b, const OpCall& c, Value x, Value y) {
  if (x.elem() == ElemType::Pred) throw Unsupported("subtraction of bool tensors");
  if (c.has("alpha")) y = b.mul(y, input_as(b, c, "alpha", x.elem()));
  return b.sub(x, y);
}

// Python-style floor division (PyTorch div_floor_floating / div_floor_integer).
Value floor_div(Builder& b, Value a, Value d) {
  if (!is_float(a.elem())) {
    Value q = b.div(a, d);
    if (is_unsigned(a.elem())) return q;
    Value r = b.rem(a, d);
    Value z = zero(b, a);
    Value adjust = b.and_(ne(b, r, z), ne(b, lt(b, r, z), lt(b, d, z)));
    return b.select(adjust, b.sub(q, like_const(b, 1, q)), q);
  }
  Value mod = b.rem(a, d);
  Value z = zero(b, a);
  Value div = b.div(b.sub(a, mod), d);
  Value adjust = b.and_(ne(b, mod, z), ne(b, lt(b, d, z), lt(b, mod, z)));
  div = b.select(adjust, b.sub(div, like_const(b, 1, div)), div);
  Value fl = b.floor(div);
  fl = b.select(gt(b, b.sub(div, fl), like_const(b, 0.5, div)), b.add(fl, like_const(b, 1, fl)), fl);
  Value q = b.div(a, d);
  // div == 0: copysign(0, a / b)
  Value signed_zero = b.select(signbit(b, q), like_const(b, -0.0, q), z);
  Value r = b.select(eq(b, div, z), signed_zero, fl);
  return b.select(eq(b, d, z), q, r);
}
// Python-style remainder: result has the sign of the divisor.
Value py_rem(Builder& b, Value a, Value d) {
  Value m = b.rem(a, d);
  if (is_unsigned(a.elem())) return m;
  Value z = zero(b, a);
  Value adjust = b.and_(ne(b, m, z), ne(b, lt(b, m, z), lt(b, d, z)));
  return b.select(adjust, b.add(m, d), m);
}

std::vector<Value> compare_op(Builder& b, const OpCall& c, Cmp dir) {
  // Compare in the common dtype (a Python scalar is rounded to it first, like PyTorch).
  Value x = input_as(b, c, "self", c.common), y = input_as(b, c, "other", c.common);
  return {b.compare(dir, x, y)};
}
std::vector<Value> logical_op(Builder& b, const OpCall& c, const char* op) {
  Value x = input_as(b, c, "self", ElemType::Pred), y = input_as(b, c, "other", ElemType::Pred);
  return {b.binary(op, x, y)};
}
std::vector<Value> bitwise_op(Builder& b, const OpCall& c, const char* op) {
  if (is_float(c.common)) throw Unsupported("bitwise op on a float tensor");
  Value x = input_as(b, c, "self", c.common), y = input_as(b, c, "other", c.common);
  return {b.binary(op, x, y)};
}
std::vector<Value> shift_op(Builder& b, const OpCall& c, bool left) {
  if (!is_integral(c.common)) throw Unsupported("shift of a non-integer tensor");
  Value x = input_as(b, c, "self", c.common), y = input_as(b, c, "other", c.common);
  int bits = bit_width(c.common);
  bool uns = is_unsigned(c.common);
  Value out_of_range = b.or_(lt(b, y, zero(b, y)), ge(b, y, like_const(b, bits, y)));
  if (left) return {b.select(out_of_range, zero(b, x), b.binary("shift_left", x, y))};
  if (uns) return {b.select(out_of_range, zero(b, x), b.binary("shift_right_logical", x, y))};
  Value amt = b.select(out_of_range, like_const(b, bits - 1, y), y);
  return {b.binary("shift_right_arithmetic", x, amt)};
}
// Integer power via stablehlo.power, with PyTorch's results for negative exponents.
Value int_pow(Builder& b, Value x, Value y) {
  Value r = b.pow(x, y);
  if (is_unsigned(x.elem())) return r;
  Value one = like_const(b, 1, x), z = zero(b, x);
  Value odd = ne(b, b.and_(y, one), z);
  Value neg_result = b.select(eq(b, x, one), one,
                              b.select(eq(b, x, like_const(b, -1, x)), b.select(odd, like_const(b, -1, x), one), z));
  return b.select(lt(b, y, z), neg_result, r);
}
std::vector<Value> clamp_impl(Builder& b, const OpCall& c, const char* lo, const char* hi) {
  Value x = input_as(b, c, "self", arith(c));
  if (lo && c.has(lo)) x = nan_max(b, x, input_as(b, c, lo, x.elem()));
  if (hi && c.has(hi)) x = nan_min(b, x, input_as(b, c, hi, x.elem()));
  return {x};
}

}  // namespace

// ------------------------------------------------------------------ arithmetic
TPU_LOWER_ELEMENTWISE_COMPLEX(add) {
  ElemType t = arith(c);
  return {add_scaled(b, c, input_as(b, c, "self", t), input_as(b, c, "other", t))};
}
TPU_LOWER_ELEMENTWISE_COMPLEX(sub) {
  ElemType t = arith(c);
  return {sub_scaled(b, c, input_as(b, c, "self", t), input_as(b, c, "other", t))};
}
TPU_LOWER_ELEMENTWISE_COMPLEX(rsub) {
  ElemType t = arith(c);
  return {sub_scaled(b, c, input_as(b, c, "other", t), input_as(b, c, "self", t))};
}
TPU_LOWER_ELEMENTWISE_COMPLEX(mul) {
  ElemType t = arith(c);
  Value x = input_as(b, c, "self", t), y = input_as(b, c, "other", t);
  return {t == ElemType::Pred ? b.and_(x, y) : b.mul(x, y)};
}
// The CPU kernels' value checks of integer division ("ZeroDivisionError", a RuntimeError). A float
// call records no check, so its program has no status (aten/plan_call.cc records_checks).
void check_divisor(Builder& b, Value d) {
  if (b.checking() && is_integral(d.elem())) check(b, eq(b, d, zero(b, d)), CheckKind::Runtime, "ZeroDivisionError");
}

TPU_LOWER_WITH(div, .elementwise = true, .checked = true, .complex = true) {
  std::string mode = c.str("rounding_mode", "");
  if (is_complex(c.common) && !mode.empty()) throw Unsupported("div: rounding_mode on complex");
  if (mode.empty()) {
    ElemType t = float_type(c);
    return {b.div(input_as(b, c, "self", t), input_as(b, c, "other", t))};
  }
  ElemType t = arith(c);
  if (t == ElemType::Pred) throw Unsupported("div with rounding_mode on bool");
  Value x = input_as(b, c, "self", t), y = input_as(b, c, "other", t);
  check_divisor(b, y);
  if (mode == "floor") return {floor_div(b, x, y)};
  if (mode != "trunc") throw Unsupported("div: rounding_mode=" + mode);
  return {is_float(t) ? ew::trunc(b, b.div(x, y)) : b.div(x, y)};
}
TPU_LOWER_WITH(floor_divide, .elementwise = true, .checked = true) {
  ElemType t = arith(c);
  if (t == ElemType::Pred) throw Unsupported("floor_divide on bool");
  Value y = input_as(b, c, "other", t);
  check_divisor(b, y);
  return {floor_div(b, input_as(b, c, "self", t), y)};
}
TPU_LOWER_WITH(remainder, .elementwise = true, .checked = true) {
  ElemType t = arith(c);
  if (t == ElemType::Pred) throw Unsupported("remainder on bool");
  Value y = input_as(b, c, "other", t);
  check_divisor(b, y);
  return {py_rem(b, input_as(b, c, "self", t), y)};
}
TPU_LOWER_WITH(fmod, .elementwise = true, .checked = true) {
  ElemType t = arith(c);
  if (t == ElemType::Pred) throw Unsupported("fmod on bool");
  Value y = input_as(b, c, "other", t);
  check_divisor(b, y);
  return {b.rem(input_as(b, c, "self", t), y)};
}
TPU_LOWER_WITH(pow, .elementwise = true, .checked = true) {
  ElemType t = arith(c);
  if (t == ElemType::Pred) throw Unsupported("pow on bool");
  Value x = input_as(b, c, "self", t), y = input_as(b, c, "exponent", t);
  // pow(int tensor, Python int < 0) raises in PyTorch's meta function; a dispatch-cache hit (the
  // scalar's value is no part of the signature) skips that, so the value is checked here too.
  if (b.checking() && !is_float(t) && c.overload == "Tensor_Scalar")
    check(b, b.compare(Cmp::LT, y, zero(b, y)), CheckKind::Runtime, "Integers to negative integer powers are not allowed.");
  // ATen's CPU kernel special-cases these exponents (PowKernel.cpp): sqrt, 1/sqrt, 1/x for
  // f32/f64/bf16 and 1/(x*x) for f32/f64; the same forms give its bits (sqrt(-0) = -0,
  // sqrt(-inf) = nan), and run far faster than XLA:CPU's per-element pow.
  const Arg& e = c.arg("exponent");
  const ElemType r = c.common;  // t is its opmath: f32 for bf16 and f16
  if (e.scalar_value && (r == ElemType::F32 || r == ElemType::F64 || r == ElemType::BF16)) {
    const double p = *e.scalar_value;
    if (p == 0.5) return {b.sqrt(x)};
    if (p == -0.5) return {b.div(like_const(b, 1, x), b.sqrt(x))};
    if (p == -1.0) return {b.div(like_const(b, 1, x), x)};
    if (p == -2.0 && r != ElemType::BF16) return {b.div(like_const(b, 1, x), b.mul(x, x))};
  }
  if (e.scalar_value && r == ElemType::F16 && (*e.scalar_value == 0.5 || *e.scalar_value == -0.5)) {
    // CPU's f16 kernel is pow itself, but XLA rewrites pow by a constant +-0.5 to sqrt/rsqrt, which
    // differ from pow at -0 and -inf only: those take |x| (pow's value there).
    Value fix = b.or_(b.compare(Cmp::EQ, x, like_const(b, 0, x)), b.compare(Cmp::EQ, x, like_const(b, -INFINITY, x)));
    x = b.select(fix, b.abs(x), x);
  }
  return {is_float(t) ? b.pow(x, y) : int_pow(b, x, y)};
}
TPU_LOWER_ELEMENTWISE(atan2) {
  ElemType t = float_type(c);
  return {b.binary("atan2", input_as(b, c, "self", t), input_as(b, c, "other", t))};
}
TPU_LOWER_ELEMENTWISE(hypot) {
  ElemType t = float_type(c);
  Value x = b.abs(input_as(b, c, "self", t)), y = b.abs(input_as(b, c, "other", t));
  Value m = b.max(x, y), n = b.min(x, y);
  Value r = b.div(n, m);
  Value h = b.mul(m, b.sqrt(b.add(like_const(b, 1, r), b.mul(r, r))));
  h = b.select(eq(b, m, zero(b, m)), zero(b, m), h);
  h = b.select(b.or_(isnan(b, x), isnan(b, y)), like_const(b, NAN, h), h);
  return {b.select(b.or_(isinf(b, x), isinf(b, y)), like_const(b, INFINITY, h), h)};
}
TPU_LOWER_ELEMENTWISE(copysign) {
  ElemType t = float_type(c);
  Value x = b.abs(input_as(b, c, "self", t)), y = input_as(b, c, "other", t);
  return {b.select(signbit(b, y), b.neg(x), x)};
}
TPU_LOWER_ELEMENTWISE(xlogy) {
  ElemType t = float_type(c);
  Value x = input_as(b, c, "self", t), y = input_as(b, c, "other", t);
  Value r = b.select(eq(b, x, zero(b, x)), zero(b, x), b.mul(x, b.log(y)));
  return {b.select(isnan(b, y), y, r)};
}
TPU_LOWER_ELEMENTWISE(maximum) {
  ElemType t = arith(c);
  return {nan_max(b, input_as(b, c, "self", t), input_as(b, c, "other", t))};
}
TPU_LOWER_ELEMENTWISE(minimum) {
  ElemType t = arith(c);
  return {nan_min(b, input_as(b, c, "self", t), input_as(b, c, "other", t))};
}
TPU_LOWER_ELEMENTWISE(fmax) {
  ElemType t = arith(c);
  Value x = input_as(b, c, "self", t), y = input_as(b, c, "other", t);
  return {b.select(isnan(b, x), y, b.select(isnan(b, y), x, b.max(x, y)))};
}
TPU_LOWER_ELEMENTWISE(fmin) {
  ElemType t = arith(c);
  Value x = input_as(b, c, "self", t), y = input_as(b, c, "other", t);
  return {b.select(isnan(b, x), y, b.select(isnan(b, y), x, b.min(x, y)))};
}
TPU_LOWER_ELEMENTWISE(lerp) {
  ElemType t = arith(c);
  Value s = input_as(b, c, "self", t), e = input_as(b, c, "end", t), w = input_as(b, c, "weight", t);
  Value d = b.sub(e, s);
  Value small = b.add(s, b.mul(w, d));
  Value large = b.sub(e, b.mul(d, b.sub(like_const(b, 1, w), w)));
  return {b.select(lt(b, b.abs(w), like_const(b, 0.5, w)), small, large)};
}
TPU_LOWER_ELEMENTWISE(addcmul) {
  ElemType t = arith(c);
  Value v = input_as(b, c, "value", t);
  Value p = t == ElemType::Pred
                ? b.and_(b.and_(v, input_as(b, c, "tensor1", t)), input_as(b, c, "tensor2", t))
                : b.mul(b.mul(v, input_as(b, c, "tensor1", t)), input_as(b, c, "tensor2", t));
  Value s = input_as(b, c, "self", t);
  return {t == ElemType::Pred ? b.or_(s, p) : b.add(s, p)};
}
TPU_LOWER_ELEMENTWISE(addcdiv) {
  ElemType t = arith(c);
  if (!is_float(t)) throw Unsupported("addcdiv on integer tensors");
  Value q = b.div(b.mul(input_as(b, c, "value", t), input_as(b, c, "tensor1", t)), input_as(b, c, "tensor2", t));
  return {b.add(input_as(b, c, "self", t), q)};
}
TPU_LOWER_ELEMENTWISE_COMPLEX(where) {
  if (!c.has("self")) throw Unsupported("where(condition) is not pointwise");
  ElemType t = c.common;
  Value cond = input_as(b, c, "condition", ElemType::Pred);
  return {b.select(cond, input_as(b, c, "self", t), input_as(b, c, "other", t))};
}
TPU_LOWER_ELEMENTWISE(clamp) { return clamp_impl(b, c, "min", "max"); }
TPU_LOWER_ELEMENTWISE(clamp_min) { return clamp_impl(b, c, "min", nullptr); }
TPU_LOWER_ELEMENTWISE(clamp_max) { return clamp_impl(b, c, nullptr, "max"); }

static Value logaddexp_impl(Builder& b, const OpCall& c, bool base2) {
  ElemType t = float_type(c);
  Value x = input_as(b, c, "self", t), y = input_as(b, c, "other", t);
  Value m = b.max(x, y);
  Value d = b.neg(b.abs(b.sub(x, y)));
  Value r = base2 ? b.add(m, b.mul(log1p(b, b.pow(like_const(b, 2, d), d)), like_const(b, 1.0 / M_LN2, d)))
                  : b.add(m, log1p(b, b.exp(d)));
  return b.select(b.and_(isinf(b, x), eq(b, x, y)), x, r);
}
TPU_LOWER_ELEMENTWISE(logaddexp) { return {logaddexp_impl(b, c, false)}; }
TPU_LOWER_ELEMENTWISE(logaddexp2) { return {logaddexp_impl(b, c, true)}; }

// ------------------------------------------------------------------ comparisons, logic, bits
TPU_LOWER_ELEMENTWISE_COMPLEX(eq) { return compare_op(b, c, Cmp::EQ); }
TPU_LOWER_ELEMENTWISE_COMPLEX(ne) { return compare_op(b, c, Cmp::NE); }
TPU_LOWER_ELEMENTWISE(lt) { return compare_op(b, c, Cmp::LT); }
TPU_LOWER_ELEMENTWISE(le) { return compare_op(b, c, Cmp::LE); }
TPU_LOWER_ELEMENTWISE(gt) { return compare_op(b, c, Cmp::GT); }
TPU_LOWER_ELEMENTWISE(ge) { return compare_op(b, c, Cmp::GE); }
TPU_LOWER_ELEMENTWISE(logical_and) { return logical_op(b, c, "and"); }
TPU_LOWER_ELEMENTWISE(logical_or) { return logical_op(b, c, "or"); }
TPU_LOWER_ELEMENTWISE(logical_xor) { return logical_op(b, c, "xor"); }
TPU_LOWER_ELEMENTWISE(bitwise_and) { return bitwise_op(b, c, "and"); }
TPU_LOWER_ELEMENTWISE(bitwise_or) { return bitwise_op(b, c, "or"); }
TPU_LOWER_ELEMENTWISE(bitwise_xor) { return bitwise_op(b, c, "xor"); }
TPU_LOWER_ELEMENTWISE(bitwise_left_shift) { return shift_op(b, c, true); }
TPU_LOWER_ELEMENTWISE(bitwise_right_shift) { return shift_op(b, c, false); }
TPU_LOWER_ELEMENTWISE(__lshift__) { return shift_op(b, c, true); }
TPU_LOWER_ELEMENTWISE(__rshift__) { return shift_op(b, c, false); }

// ------------------------------------------------------------------ activations with scalars
TPU_LOWER_WITH(threshold, .elementwise = true, .writes_may_overlap = true) {
  ElemType t = arith(c);
  Value x = input_as(b, c, "self", t);
  return {b.select(le(b, x, input_as(b, c, "threshold", t)), input_as(b, c, "value", t), x)};
}

// ------------------------------------------------------------------ backwards
TPU_LOWER_ELEMENTWISE(threshold_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), x = input_as(b, c, "self", t);
  return {b.select(le(b, x, input_as(b, c, "threshold", t)), zero(b, g), g)};
}
TPU_LOWER_ELEMENTWISE(sigmoid_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), y = input_as(b, c, "output", t);
  return {b.mul(b.mul(g, b.sub(like_const(b, 1, y), y)), y)};
}
TPU_LOWER_ELEMENTWISE(tanh_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), y = input_as(b, c, "output", t);
  return {b.mul(g, b.sub(like_const(b, 1, y), b.mul(y, y)))};
}
TPU_LOWER_ELEMENTWISE(gelu_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), x = input_as(b, c, "self", t);
  std::string mode = c.str("approximate", "none");
  if (mode == "tanh") {
    constexpr double kBeta = 0.797884560802865355879892119868763737;  // sqrt(2/pi)
    constexpr double kKappa = 0.044715;
    Value x2 = b.mul(x, x);
    Value inner = b.mul(like_const(b, kBeta, x), b.add(x, b.mul(like_const(b, kKappa, x), b.mul(x2, x))));
    Value th = tanh(b, inner);
    Value left = b.mul(like_const(b, 0.5, x), x);
    Value left_d = b.mul(like_const(b, 0.5, x), b.add(like_const(b, 1, x), th));
    Value tanh_d = b.sub(like_const(b, 1, x), b.mul(th, th));
    Value inner_d = b.mul(like_const(b, kBeta, x), b.add(like_const(b, 1, x), b.mul(like_const(b, 3 * kKappa, x), x2)));
    return {b.mul(g, b.add(left_d, b.mul(b.mul(left, tanh_d), inner_d)))};
  }
  if (mode != "none") throw Unsupported("gelu_backward: approximate=" + mode);
  constexpr double kAlpha = 0.707106781186547524400844362104849039;  // 1/sqrt(2)
  constexpr double kBeta = 0.398942280401432677939946059934381868;   // 1/sqrt(2 pi)
  Value cdf = b.mul(like_const(b, 0.5, x), b.add(like_const(b, 1, x), erf(b, b.mul(x, like_const(b, kAlpha, x)))));
  Value pdf = b.mul(b.exp(b.mul(like_const(b, -0.5, x), b.mul(x, x))), like_const(b, kBeta, x));
  return {b.mul(g, b.add(cdf, b.mul(x, pdf)))};
}
TPU_LOWER_ELEMENTWISE(silu_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), x = input_as(b, c, "self", t);
  Value s = sigmoid(b, x);
  return {b.mul(b.mul(g, s), b.add(like_const(b, 1, x), b.mul(x, b.sub(like_const(b, 1, s), s))))};
}
TPU_LOWER_ELEMENTWISE(hardtanh_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), x = input_as(b, c, "self", t);
  Value out = b.or_(le(b, x, input_as(b, c, "min_val", t)), ge(b, x, input_as(b, c, "max_val", t)));
  return {b.select(out, zero(b, g), g)};
}
TPU_LOWER_ELEMENTWISE(leaky_relu_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), x = input_as(b, c, "self", t);
  return {b.select(gt(b, x, zero(b, x)), g, b.mul(g, input_as(b, c, "negative_slope", t)))};
}
TPU_LOWER_ELEMENTWISE(elu_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), y = input_as(b, c, "self_or_result", t);
  Value negcoef = b.mul(input_as(b, c, "alpha", t), input_as(b, c, "scale", t));
  Value poscoef = input_as(b, c, "scale", t), negip = input_as(b, c, "input_scale", t);
  Value neg = c.bool_("is_result")
                  ? b.mul(b.mul(g, negip), b.add(y, negcoef))
                  : b.mul(b.mul(b.mul(g, negip), negcoef), b.exp(b.mul(y, negip)));
  return {b.select(le(b, y, zero(b, y)), neg, b.mul(g, poscoef))};
}
TPU_LOWER_ELEMENTWISE(softplus_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), x = input_as(b, c, "self", t);
  Value xb = b.mul(x, input_as(b, c, "beta", t));
  Value z = b.exp(xb);
  return {b.select(gt(b, xb, input_as(b, c, "threshold", t)), g, b.div(b.mul(g, z), b.add(z, like_const(b, 1, z))))};
}
TPU_LOWER_ELEMENTWISE(hardsigmoid_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), x = input_as(b, c, "self", t);
  Value inside = b.and_(gt(b, x, like_const(b, -3, x)), lt(b, x, like_const(b, 3, x)));
  // PyTorch multiplies by 1.0f / 6.0f (a float constant) for every dtype.
  return {b.select(inside, b.mul(g, like_const(b, static_cast<double>(1.0f / 6.0f), g)), zero(b, g))};
}
TPU_LOWER_ELEMENTWISE(hardswish_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), x = input_as(b, c, "self", t);
  Value mid = b.mul(g, b.add(b.div(x, like_const(b, 3, x)), like_const(b, 0.5, x)));
  return {b.select(lt(b, x, like_const(b, -3, x)), zero(b, g), b.select(le(b, x, like_const(b, 3, x)), mid, g))};
}
TPU_LOWER_ELEMENTWISE(mish_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), x = input_as(b, c, "self", t);
  Value s = sigmoid(b, x);
  Value ts = tanh(b, log1p(b, b.exp(x)));
  return {b.mul(g, b.add(ts, b.mul(b.mul(x, s), b.sub(like_const(b, 1, ts), b.mul(ts, ts)))))};
}
static std::vector<Value> shrink_backward(Builder& b, const OpCall& c, const char* grad) {
  ElemType t = arith(c);
  Value g = input_as(b, c, grad, t), x = input_as(b, c, "self", t), l = input_as(b, c, "lambd", t);
  Value inside = b.and_(ge(b, x, b.neg(l)), le(b, x, l));
  return {b.select(inside, zero(b, g), g)};
}
TPU_LOWER_ELEMENTWISE(hardshrink_backward) { return shrink_backward(b, c, "grad_out"); }
TPU_LOWER_ELEMENTWISE(softshrink_backward) { return shrink_backward(b, c, "grad_output"); }
TPU_LOWER_ELEMENTWISE(log_sigmoid_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), x = input_as(b, c, "self", t), z = input_as(b, c, "buffer", t);
  Value neg = lt(b, x, zero(b, x));
  Value max_deriv = b.select(neg, like_const(b, 1, x), zero(b, x));
  Value sign = b.select(neg, like_const(b, 1, x), like_const(b, -1, x));
  return {b.mul(b.sub(max_deriv, b.mul(sign, b.div(z, b.add(like_const(b, 1, z), z)))), g)};
}
TPU_LOWER_ELEMENTWISE(logit_backward) {
  ElemType t = arith(c);
  Value g = input_as(b, c, "grad_output", t), x = input_as(b, c, "self", t);
  Value r = b.div(g, b.mul(x, b.sub(like_const(b, 1, x), x)));
  double eps = c.has("eps") ? c.double_("eps") : -1.0;
  if (eps < 0) {
    Value out = b.or_(lt(b, x, zero(b, x)), gt(b, x, like_const(b, 1, x)));
    return {b.select(out, like_const(b, NAN, r), r)};
  }
  Value out = b.or_(lt(b, x, like_const(b, eps, x)), gt(b, x, like_const(b, 1 - eps, x)));
  return {b.select(out, zero(b, r), r)};
}

// Cross product of 3-vectors along `dim` (self and other broadcast to the output shape).
TPU_LOWER(linalg_cross) {
  const Type& o = out_type(c);
  if (o.numel() == 0) return {b.zeros(o)};
  ElemType t = opmath(c.common);
  int64_t d = norm_dim(c.int_("dim", -1), o.rank());
  if (o.shape[d] != 3) throw Unsupported("linalg_cross: dim of size != 3");
  Value x = operand(b, c.arg("self"), t, o.shape), y = operand(b, c.arg("other"), t, o.shape);
  auto comp = [&](Value v, int64_t i) {
    Shape st(o.rank(), 0), li = o.shape;
    st[d] = i;
    li[d] = i + 1;
    return b.slice(v, st, li);
  };
  std::vector<Value> parts;
  for (int64_t i = 0; i < 3; ++i) {
    int64_t j = (i + 1) % 3, l = (i + 2) % 3;
    parts.push_back(b.sub(b.mul(comp(x, j), comp(y, l)), b.mul(comp(x, l), comp(y, j))));
  }
  return {b.concatenate(parts, d)};
}

// ------------------------------------------------------------------ dropout / glu / prelu backwards
TPU_LOWER_ELEMENTWISE(native_dropout_backward) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  Value g = operand(b, c.arg("grad_output"), t, o.shape);
  Value m = operand(b, c.arg("mask"), t, o.shape);
  return {b.mul(b.mul(g, m), b.constant_f(c.double_("scale"), t, o.shape))};
}

// glu(x) = a * sigmoid(b) with (a, b) the halves of x along dim (nn.GLU; was a CPU fallback).
TPU_LOWER(glu) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  Value x = b.convert(c.tensor("self"), t);
  if (o.numel() == 0) return {b.zeros(o)};
  int64_t d = norm_dim(c.int_("dim"), x.rank());
  Shape st(x.rank(), 0), mid = x.shape(), st2(x.rank(), 0);
  mid[d] = x.shape()[d] / 2;
  st2[d] = mid[d];
  return {b.mul(b.slice(x, st, mid), ew::sigmoid(b, b.slice(x, st2, x.shape())))};
}

// As ATen's CPU kernel:
// grad_a = sigmoid(b) * g, grad_b = (1 - sigmoid(b)) * sigmoid(b) * a * g.
TPU_LOWER(glu_backward) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  Value x = b.convert(c.tensor("self"), t);
  int64_t d = norm_dim(c.int_("dim"), x.rank());
  int64_t h = x.shape()[d] / 2;
  if (o.numel() == 0) return {b.zeros(Type{t, o.shape})};
  Shape st(x.rank(), 0), mid = x.shape(), st2(x.rank(), 0);
  mid[d] = h;
  st2[d] = h;
  Value first = b.slice(x, st, mid), second = b.slice(x, st2, x.shape());
  Value g = b.broadcast_to(b.convert(c.tensor("grad_output"), t), first.shape());
  Value sig = ew::sigmoid(b, second);
  Value one = b.constant_f(1, t, sig.shape());
  Value ga = b.mul(sig, g);
  Value gb = b.mul(b.mul(b.mul(b.sub(one, sig), sig), first), g);
  return {b.concatenate({ga, gb}, d)};
}

// prelu: y = x > 0 ? x : w * x (w already shaped to broadcast by the prelu composite).
TPU_LOWER(_prelu_kernel) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  Value x = operand(b, c.arg("self"), t, o.shape), w = operand(b, c.arg("weight"), t, o.shape);
  return {b.select(b.compare(Cmp::GT, x, b.zeros(x.type)), x, b.mul(w, x))};
}

// (grad_self, grad_weight) elementwise over the broadcast shape.
TPU_LOWER(_prelu_kernel_backward) {
  const Type& o = out_type(c, 0);
  ElemType t = opmath(o.elem);
  Value x = operand(b, c.arg("self"), t, o.shape), w = operand(b, c.arg("weight"), t, o.shape);
  Value g = operand(b, c.arg("grad_output"), t, o.shape);
  Value pos = b.compare(Cmp::GT, x, b.zeros(x.type));
  return {b.select(pos, g, b.mul(w, g)), b.select(pos, b.zeros(x.type), b.mul(x, g))};
}

}  // namespace tpu::lowering
