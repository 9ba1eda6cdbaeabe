// Unary pointwise lowerings (and a few pointwise activations with scalar parameters).
// Shared math helpers (erf, expm1, NaN-aware min/max, ...) live in namespace `ew`; the ones other
// files use are declared in elementwise_math.h.
#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "elementwise_math.h"
#include "lowering.h"
#include "shape_util.h"

namespace tpu::lowering::ew {

// ------------------------------------------------------------------ shared helpers
Value like_const(Builder& b, double v, const Value& like) { return b.constant_f(v, like.elem(), like.shape()); }
Value lt(Builder& b, Value x, Value y) { return b.compare(Cmp::LT, x, y); }
Value le(Builder& b, Value x, Value y) { return b.compare(Cmp::LE, x, y); }
Value gt(Builder& b, Value x, Value y) { return b.compare(Cmp::GT, x, y); }
Value ge(Builder& b, Value x, Value y) { return b.compare(Cmp::GE, x, y); }
Value eq(Builder& b, Value x, Value y) { return b.compare(Cmp::EQ, x, y); }
Value ne(Builder& b, Value x, Value y) { return b.compare(Cmp::NE, x, y); }
Value isnan(Builder& b, Value x) {
  return is_float(x.elem()) ? ne(b, x, x) : b.constant_i(0, ElemType::Pred, x.shape());
}
Value isinf(Builder& b, Value x) {
  return is_float(x.elem()) ? eq(b, b.abs(x), like_const(b, INFINITY, x))
                            : b.constant_i(0, ElemType::Pred, x.shape());
}
// maximum/minimum that propagate NaN from either side (PyTorch's maximum/minimum/clamp).
Value nan_max(Builder& b, Value x, Value y) {
  Value m = b.max(x, y);
  if (!is_float(x.elem())) return m;
  return b.select(isnan(b, x), x, b.select(isnan(b, y), y, m));
}
Value nan_min(Builder& b, Value x, Value y) {
  Value m = b.min(x, y);
  if (!is_float(x.elem())) return m;
  return b.select(isnan(b, x), x, b.select(isnan(b, y), y, m));
}
// Horner evaluation; coefficients from the highest degree down.
Value poly(Builder& b, Value x, std::initializer_list<double> cs) {
  Value p = like_const(b, *cs.begin(), x);
  for (auto it = cs.begin() + 1; it != cs.end(); ++it) p = b.add(b.mul(p, x), like_const(b, *it, x));
  return p;
}
// Compute type of a floating-point op: integer/bool inputs promote to the (default) float type
// PyTorch chose for the output.
ElemType float_type(const OpCall& c) {
  if (is_float(c.common)) return opmath(c.common);
  if (is_complex(c.common)) return c.common;  // only ops declared .complex get here
  ElemType o = out_type(c).elem;
  return is_float(o) ? opmath(o) : ElemType::F32;
}
Value input_as(Builder& b, const OpCall& c, const char* name, ElemType t) {
  return operand(b, c.arg(name), t, out_type(c).shape);
}
Value signbit(Builder& b, Value x) {
  if (!is_float(x.elem())) return is_integral(x.elem()) && !is_unsigned(x.elem())
                                      ? lt(b, x, b.zeros(x.type))
                                      : b.constant_i(0, ElemType::Pred, x.shape());
  ElemType it = bit_width(x.elem()) == 64 ? ElemType::S64
                : bit_width(x.elem()) == 32 ? ElemType::S32 : ElemType::S16;
  Value bits = b.bitcast(x, Type{it, x.shape()});
  return lt(b, bits, b.zeros(bits.type));
}
// log(1 + x). XLA:CPU emits log_plus_one as a scalar libm call per element; for f32 (also the
// compute type of f16/bf16) it is written with vectorized ops: 2 atanh(s), s = x / (2 + x), as an odd
// series in s on -0.3 < x < 0.45 (|s| < 0.19, terms to s^11: truncation < 2^-29), log(1 + x)
// elsewhere (1 + x rounds by at most 2^-24 relative to a log of magnitude >= 0.36). <= 2.7 ulp.
Value log1p(Builder& b, Value x) {
  if (x.elem() != ElemType::F32) return b.unary("log_plus_one", x);
  Value one = like_const(b, 1, x);
  Value t = b.div(b.add(x, x), b.add(x, like_const(b, 2, x)));  // 2s: no underflow for tiny x
  Value s2 = b.mul(b.mul(t, t), like_const(b, 0.25, x));
  Value small = b.add(t, b.mul(b.mul(t, s2), poly(b, s2, {1.0 / 11, 1.0 / 9, 1.0 / 7, 1.0 / 5, 1.0 / 3})));
  Value in = b.and_(gt(b, x, like_const(b, -0.3, x)), lt(b, x, like_const(b, 0.45, x)));
  return b.select(in, small, b.log(b.add(one, x)));
}
// exp(x) - 1 without cancellation. f64: for -0.25 < x < 0.5, u = exp(x) lies in [0.5, 2] so u - 1 is
// exact and (u - 1) * x / log(u) (Kahan) is accurate, with log(u) taken as log1p(u - 1) (XLA's log
// is only accurate in absolute terms near 1, and its f64 log1p is weak near -0.4, hence the
// asymmetric range). Elsewhere u - 1 loses at most a couple of bits.
// f32 (the compute type of f16/bf16 too) uses vectorized ops instead: the Taylor series to x^10 on
// |x| < 0.5 (truncation < 2^-31 relative), exp(x) - 1 elsewhere (loses < 2 bits), -0 kept.
Value expm1(Builder& b, Value x) {
  if (x.elem() == ElemType::F32) {
    Value tail = poly(b, x, {1.0 / 3628800, 1.0 / 362880, 1.0 / 40320, 1.0 / 5040, 1.0 / 720, 1.0 / 120,
                             1.0 / 24, 1.0 / 6, 0.5});
    Value small = b.add(x, b.mul(b.mul(x, x), tail));
    small = b.select(eq(b, x, like_const(b, 0, x)), x, small);
    Value big = b.sub(b.exp(x), like_const(b, 1, x));
    return b.select(lt(b, b.abs(x), like_const(b, 0.5, x)), small, big);
  }
  Value u = b.exp(x);
  Value um1 = b.sub(u, like_const(b, 1, x));
  Value small = b.mul(um1, b.div(x, log1p(b, um1)));
  small = b.select(eq(b, u, like_const(b, 1, x)), x, small);
  return b.select(b.and_(gt(b, x, like_const(b, -0.25, x)), lt(b, x, like_const(b, 0.5, x))), small, um1);
}
// exp(-x*x) with x*x split into an exact head and a small tail (Cephes expx2 idea).
Value exp_neg_sq(Builder& b, Value x) {
  bool f64 = x.elem() == ElemType::F64;
  ElemType it = f64 ? ElemType::S64 : ElemType::S32;
  int64_t mask = f64 ? ~((int64_t{1} << 27) - 1) : ~((int64_t{1} << 12) - 1);
  Value hi = b.bitcast(b.and_(b.bitcast(x, Type{it, x.shape()}), b.constant_i(mask, it, x.shape())),
                       x.type);
  Value lo = b.sub(x, hi);
  Value tail = b.mul(lo, b.add(x, hi));  // x^2 - hi^2
  return b.mul(b.exp(b.neg(b.mul(hi, hi))), b.exp(b.neg(tail)));
}

// Cephes-based erf/erfc (the same polynomials XLA uses), f32 or f64 compute types.
static Value erf_small64(Builder& b, Value x) {  // |x| < 1
  Value z = b.mul(x, x);
  return b.div(b.mul(x, poly(b, z, {9.60497373987051638749E0, 9.00260197203842689217E1,
                                    2.23200534594684319226E3, 7.00332514112805075473E3,
                                    5.55923013010394962768E4})),
               poly(b, z, {1.0, 3.35617141647503099647E1, 5.21357949780152679795E2,
                           4.59432382970980127987E3, 2.26290000613890934246E4,
                           4.92673942608635921086E4}));
}
static Value erf_small32(Builder& b, Value x) {  // |x| <= 1
  return b.mul(x, poly(b, b.mul(x, x),
                       {+7.853861353153693E-5, -8.010193625184903E-4, +5.188327685732524E-3,
                        -2.685381193529856E-2, +1.128358514861418E-1, -3.761262582423300E-1,
                        +1.128379165726710E+0}));
}
// erfc for |x| >= 1 (valid for any sign: negative x gives 2 - erfc(|x|)).
static Value erfc_large(Builder& b, Value x) {
  Value a = b.abs(x);
  Value z = exp_neg_sq(b, a);
  Value y;
  if (x.elem() == ElemType::F64) {
    Value pq = b.div(poly(b, a, {2.46196981473530512524E-10, 5.64189564831068821977E-1,
                                 7.46321056442269912687E0, 4.86371970985681366614E1,
                                 1.96520832956077098242E2, 5.26445194995477358631E2,
                                 9.34528527171957607540E2, 1.02755188689515710272E3,
                                 5.57535335369399327526E2}),
                     poly(b, a, {1.0, 1.32281951154744992508E1, 8.67072140885989742329E1,
                                 3.54937778887819891062E2, 9.75708501743205489753E2,
                                 1.82390916687909736289E3, 2.24633760818710981792E3,
                                 1.65666309194161350182E3, 5.57535340817727675546E2}));
    Value rs = b.div(poly(b, a, {5.64189583547755073984E-1, 1.27536670759978104416E0,
                                 5.01905042251180477414E0, 6.16021097993053585195E0,
                                 7.40974269950448939160E0, 2.97886665372100240670E0}),
                     poly(b, a, {1.0, 2.26052863220117276590E0, 9.39603524938001434673E0,
                                 1.20489539808096656605E1, 1.70814450747565897222E1,
                                 9.60896809063285878198E0, 3.36907645100081516050E0}));
    y = b.mul(z, b.select(lt(b, a, like_const(b, 8, a)), pq, rs));
  } else {
    Value q = b.div(like_const(b, 1, a), a);
    Value q2 = b.mul(q, q);
    Value p = poly(b, q2, {+2.326819970068386E-2, -1.387039388740657E-1, +3.687424674597105E-1,
                           -5.824733027278666E-1, +6.210004621745983E-1, -4.944515323274145E-1,
                           +3.404879937665872E-1, -2.741127028184656E-1, +5.638259427386472E-1});
    Value r = poly(b, q2, {-1.047766399936249E+1, +1.297719955372516E+1, -7.495518717768503E+0,
                           +2.921019019210786E+0, -1.015265279202700E+0, +4.218463358204948E-1,
                           -2.820767439740514E-1, +5.641895067754075E-1});
    y = b.mul(b.mul(z, q), b.select(lt(b, a, like_const(b, 2, a)), p, r));
  }
  // Far tails: exp underflowed (and the polynomials may be inf/inf).
  y = b.select(gt(b, a, like_const(b, x.elem() == ElemType::F64 ? 27.3 : 10.1, a)), like_const(b, 0, a), y);
  return b.select(lt(b, x, like_const(b, 0, x)), b.sub(like_const(b, 2, x), y), y);
}
Value erf(Builder& b, Value x) {
  Value r;
  if (x.elem() == ElemType::F64) {
    r = b.select(lt(b, b.abs(x), like_const(b, 1, x)), erf_small64(b, x), b.sub(like_const(b, 1, x), erfc_large(b, x)));
  } else {
    // XLA's f32 rational approximation, clamped where erf rounds to +-1.
    constexpr double kClamp = 3.7439211627767994;
    Value xc = b.clamp(like_const(b, -kClamp, x), x, like_const(b, kClamp, x));
    Value x2 = b.mul(xc, xc);
    Value num = b.mul(xc, poly(b, x2, {0.00022905065861350646, 0.0034082910107109506,
                                       0.050955695062380861, 0.18520832239976145,
                                       1.128379143519084}));
    Value den = poly(b, x2, {-1.1791602954361697e-7, 0.000023547966471313185,
                             0.0010179625278914885, 0.014070470171167667, 0.11098505178285362,
                             0.49746925110067538, 1.0});
    r = b.div(num, den);
  }
  return b.select(isnan(b, x), x, r);
}
Value erfc(Builder& b, Value x) {
  Value small = x.elem() == ElemType::F64 ? erf_small64(b, x) : erf_small32(b, x);
  Value r = b.select(lt(b, b.abs(x), like_const(b, 1, x)), b.sub(like_const(b, 1, x), small), erfc_large(b, x));
  return b.select(isnan(b, x), x, r);
}
// Giles' approximation (as in XLA), with w computed from (1-x)(1+x) for accuracy near +-1.
Value erfinv(Builder& b, Value x) {
  Value w = b.neg(b.log(b.mul(b.sub(like_const(b, 1, x), x), b.add(like_const(b, 1, x), x))));
  Value p;
  if (x.elem() == ElemType::F64) {
    Value lt625 = lt(b, w, like_const(b, 6.25, w)), lt16 = lt(b, w, like_const(b, 16, w));
    Value sw = b.sqrt(w);
    Value p1 = poly(b, b.sub(w, like_const(b, 3.125, w)),
                    {-3.6444120640178196996e-21, -1.685059138182016589e-19, 1.2858480715256400167e-18,
                     1.115787767802518096e-17, -1.333171662854620906e-16, 2.0972767875968561637e-17,
                     6.6376381343583238325e-15, -4.0545662729752068639e-14, -8.1519341976054721522e-14,
                     2.6335093153082322977e-12, -1.2975133253453532498e-11, -5.4154120542946279317e-11,
                     1.051212273321532285e-09, -4.1126339803469836976e-09, -2.9070369957882005086e-08,
                     4.2347877827932403518e-07, -1.3654692000834678645e-06, -1.3882523362786468719e-05,
                     0.0001867342080340571352, -0.00074070253416626697512, -0.0060336708714301490533,
                     0.24015818242558961693, 1.6536545626831027356});
    Value p2 = poly(b, b.sub(sw, like_const(b, 3.25, w)),
                    {2.2137376921775787049e-09, 9.0756561938885390979e-08, -2.7517406297064545428e-07,
                     1.8239629214389227755e-08, 1.5027403968909827627e-06, -4.013867526981545969e-06,
                     2.9234449089955446044e-06, 1.2475304481671778723e-05, -4.7318229009055733981e-05,
                     6.8284851459573175448e-05, 2.4031110387097893999e-05, -0.0003550375203628474796,
                     0.00095328937973738049703, -0.0016882755560235047313, 0.0024914420961078508066,
                     -0.0037512085075692412107, 0.005370914553590063617, 1.0052589676941592334,
                     3.0838856104922207635});
    Value p3 = poly(b, b.sub(sw, like_const(b, 5.0, w)),
                    {-2.7109920616438573243e-11, -2.5556418169965252055e-10, 1.5076572693500548083e-09,
                     -3.7894654401267369937e-09, 7.6157012080783393804e-09, -1.4960026627149240478e-08,
                     2.9147953450901080826e-08, -6.7711997758452339498e-08, 2.2900482228026654717e-07,
                     -9.9298272942317002539e-07, 4.5260625972231537039e-06, -1.9681778105531670567e-05,
                     7.5995277030017761139e-05, -0.00021503011930044477347, -0.00013871931833623122026,
                     1.0103004648645343977, 4.8499064014085844221});
    p = b.select(lt625, p1, b.select(lt16, p2, p3));
  } else {
    Value small = lt(b, w, like_const(b, 5, w));
    Value p1 = poly(b, b.sub(w, like_const(b, 2.5, w)),
                    {2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                     -0.00125372503, -0.00417768164, 0.246640727, 1.50140941});
    Value p2 = poly(b, b.sub(b.sqrt(w), like_const(b, 3, w)),
                    {-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                     -0.0076224613, 0.00943887047, 1.00167406, 2.83297682});
    p = b.select(small, p1, p2);
  }
  Value r = b.mul(p, x);
  return b.select(eq(b, b.abs(x), like_const(b, 1, x)), b.mul(x, like_const(b, INFINITY, x)), r);
}
// Threshold above which exp(|x|) overflows but exp(|x|)/2 may not.
static double exp_big(const Value& x) { return x.elem() == ElemType::F64 ? 709.0 : 88.0; }
static Value half_exp_big(Builder& b, Value a) {  // exp(a)/2 for large a without overflow
  Value e = b.exp(b.mul(a, like_const(b, 0.5, a)));
  return b.mul(b.mul(e, like_const(b, 0.5, a)), e);
}
Value sinh(Builder& b, Value x) {
  Value a = b.abs(x);
  Value em1 = expm1(b, a);
  Value r = b.mul(like_const(b, 0.5, a), b.add(em1, b.div(em1, b.add(em1, like_const(b, 1, a)))));
  r = b.select(lt(b, a, like_const(b, exp_big(x), a)), r, half_exp_big(b, a));
  return b.select(signbit(b, x), b.neg(r), r);
}
Value cosh(Builder& b, Value x) {
  Value a = b.abs(x);
  Value e = b.exp(a);
  Value r = b.mul(like_const(b, 0.5, a), b.add(e, b.div(like_const(b, 1, a), e)));
  return b.select(lt(b, a, like_const(b, exp_big(x), a)), r, half_exp_big(b, a));
}
Value tanh(Builder& b, Value x) {
  Value a = b.abs(x);
  Value r;
  if (x.elem() == ElemType::F32) {
    // f32 (and f16/bf16): an odd minimax polynomial on |x| < 0.625 (fitted for relative error,
    // 0.7 ulp), 1 - 2 / (exp(2|x|) + 1) above (no cancellation there, saturates to 1). <= 1.3 ulp,
    // all vector code (XLA's own tanh is up to 4 ulp).
    Value z = b.mul(a, a);
    Value small = b.add(a, b.mul(b.mul(a, z), poly(b, z, {-0.0057049874157099984, 0.020639087645487917,
                                                          -0.05373971521846744, 0.13331442199945523,
                                                          -0.33333281942088794})));
    Value one = like_const(b, 1, a);
    Value big = b.sub(one, b.div(like_const(b, 2, a), b.add(b.exp(b.add(a, a)), one)));
    r = b.select(lt(b, a, like_const(b, 0.625, a)), small, big);
  } else {
    // tanh(|x|) = -expm1(-2|x|) / (expm1(-2|x|) + 2): accurate everywhere, saturates to 1.
    Value e = expm1(b, b.mul(a, like_const(b, -2, a)));
    r = b.div(b.neg(e), b.add(e, like_const(b, 2, a)));
  }
  r = b.select(isnan(b, x), x, r);
  return b.select(signbit(b, x), b.neg(r), r);
}
Value sigmoid(Builder& b, Value x) {
  return b.div(like_const(b, 1, x), b.add(like_const(b, 1, x), b.exp(b.neg(x))));
}
Value trunc(Builder& b, Value x) {
  return b.select(lt(b, x, like_const(b, 0, x)), b.unary("ceil", x), b.floor(x));
}

}  // namespace tpu::lowering::ew

namespace tpu::lowering {
namespace {
using namespace ew;

constexpr double kPi = 3.14159265358979323846;
constexpr double kLn2 = 0.693147180559945309417;

Value self_f(Builder& b, const OpCall& c) { return input_as(b, c, "self", float_type(c)); }
Value self_c(Builder& b, const OpCall& c) { return input_as(b, c, "self", opmath(c.common)); }
Value scalar_arg(Builder& b, const OpCall& c, const char* n, const Value& like) {
  return operand(b, c.arg(n), like.elem(), like.shape());
}
Value asinh_impl(Builder& b, Value x) {
  Value a = b.abs(x);
  Value one = like_const(b, 1, a);
  Value a2 = b.mul(a, a);
  Value r = log1p(b, b.add(a, b.div(a2, b.add(one, b.sqrt(b.add(one, a2))))));
  double big = x.elem() == ElemType::F64 ? 268435456.0 : 4096.0;
  r = b.select(gt(b, a, like_const(b, big, a)), b.add(b.log(a), like_const(b, kLn2, a)), r);
  return b.select(signbit(b, x), b.neg(r), r);
}
Value acosh_impl(Builder& b, Value x) {
  Value t = b.sub(x, like_const(b, 1, x));
  Value r = log1p(b, b.add(t, b.sqrt(b.add(b.mul(like_const(b, 2, t), t), b.mul(t, t)))));
  double big = x.elem() == ElemType::F64 ? 268435456.0 : 4096.0;
  return b.select(gt(b, x, like_const(b, big, x)), b.add(b.log(x), like_const(b, kLn2, x)), r);
}
Value atanh_impl(Builder& b, Value x) {
  Value a = b.abs(x);
  Value r = b.mul(like_const(b, 0.5, a), log1p(b, b.div(b.mul(like_const(b, 2, a), a), b.sub(like_const(b, 1, a), a))));
  return b.select(signbit(b, x), b.neg(r), r);
}
Value one_minus_sq(Builder& b, Value x) {  // (1 - x)(1 + x), accurate near |x| = 1
  return b.mul(b.sub(like_const(b, 1, x), x), b.add(like_const(b, 1, x), x));
}
Value rounding(Builder& b, const OpCall& c, const char* op) {
  Value x = input_as(b, c, "self", is_float(c.common) ? opmath(c.common) : c.common);
  if (!is_float(x.elem())) return x;  // integral: identity
  return b.unary(op, x);
}

}  // namespace

// ---- plain float functions: x is `self` converted to the float compute type.
#define TPU_FLOAT_UNARY(opname, ...)                  \
  TPU_LOWER_ELEMENTWISE(opname) {                     \
    Value x = self_f(b, c);                           \
    return {__VA_ARGS__};                             \
  }
TPU_LOWER_ELEMENTWISE_COMPLEX(exp) { return {b.exp(self_f(b, c))}; }  // XLA's complex exp too
TPU_FLOAT_UNARY(exp2, b.pow(like_const(b, 2, x), x))
TPU_FLOAT_UNARY(expm1, expm1(b, x))
TPU_FLOAT_UNARY(log, b.log(x))
TPU_FLOAT_UNARY(log2, b.mul(b.log(x), like_const(b, 1 / kLn2, x)))
TPU_FLOAT_UNARY(log10, b.mul(b.log(x), like_const(b, 0.434294481903251827651, x)))
TPU_FLOAT_UNARY(log1p, log1p(b, x))
TPU_FLOAT_UNARY(sqrt, b.sqrt(x))
TPU_FLOAT_UNARY(rsqrt, b.div(like_const(b, 1, x), b.sqrt(x)))
TPU_FLOAT_UNARY(reciprocal, b.div(like_const(b, 1, x), x))
TPU_FLOAT_UNARY(sin, b.unary("sine", x))
TPU_FLOAT_UNARY(cos, b.unary("cosine", x))
TPU_FLOAT_UNARY(tan, b.unary("tan", x))
TPU_FLOAT_UNARY(asin, b.binary("atan2", x, b.sqrt(one_minus_sq(b, x))))
TPU_FLOAT_UNARY(acos, b.binary("atan2", b.sqrt(one_minus_sq(b, x)), x))
TPU_FLOAT_UNARY(atan, b.binary("atan2", x, like_const(b, 1, x)))
TPU_FLOAT_UNARY(sinh, sinh(b, x))
TPU_FLOAT_UNARY(cosh, cosh(b, x))
TPU_FLOAT_UNARY(tanh, tanh(b, x))
TPU_FLOAT_UNARY(asinh, asinh_impl(b, x))
TPU_FLOAT_UNARY(acosh, acosh_impl(b, x))
TPU_FLOAT_UNARY(atanh, atanh_impl(b, x))
TPU_FLOAT_UNARY(sigmoid, sigmoid(b, x))
TPU_FLOAT_UNARY(erf, erf(b, x))
TPU_FLOAT_UNARY(erfc, erfc(b, x))
TPU_FLOAT_UNARY(erfinv, erfinv(b, x))
TPU_FLOAT_UNARY(deg2rad, b.mul(x, like_const(b, kPi / 180, x)))
TPU_FLOAT_UNARY(rad2deg, b.mul(x, like_const(b, 180 / kPi, x)))
TPU_LOWER_ELEMENTWISE_COMPLEX(angle) {
  Value x = self_f(b, c);
  if (is_complex(x.elem())) return {b.binary("atan2", b.imag(x), b.real(x))};  // std::arg
  return {b.select(isnan(b, x), x, b.select(lt(b, x, like_const(b, 0, x)), like_const(b, kPi, x), like_const(b, 0, x)))};
}
TPU_FLOAT_UNARY(silu, b.div(x, b.add(like_const(b, 1, x), b.exp(b.neg(x)))))
TPU_FLOAT_UNARY(mish, b.mul(x, tanh(b, log1p(b, b.exp(x)))))
TPU_FLOAT_UNARY(hardsigmoid,
                b.div(nan_min(b, nan_max(b, b.add(x, like_const(b, 3, x)), like_const(b, 0, x)), like_const(b, 6, x)), like_const(b, 6, x)))
TPU_FLOAT_UNARY(hardswish, b.div(b.mul(x, nan_min(b, nan_max(b, b.add(x, like_const(b, 3, x)), like_const(b, 0, x)), like_const(b, 6, x))),
                                 like_const(b, 6, x)))
#undef TPU_FLOAT_UNARY

TPU_LOWER_ELEMENTWISE(gelu) {
  Value x = self_f(b, c);
  std::string mode = c.str("approximate", "none");
  if (mode == "tanh") {
    constexpr double kBeta = 0.797884560802865355879892119868763737;  // sqrt(2/pi)
    Value inner = b.mul(like_const(b, kBeta, x), b.add(x, b.mul(like_const(b, 0.044715, x), b.mul(b.mul(x, x), x))));
    return {b.mul(b.mul(like_const(b, 0.5, x), x), b.add(like_const(b, 1, x), tanh(b, inner)))};
  }
  if (mode != "none") throw Unsupported("gelu: approximate=" + mode);
  Value cdf = b.add(like_const(b, 1, x), erf(b, b.mul(x, like_const(b, 0.707106781186547524400844362104849039, x))));
  return {b.mul(b.mul(x, like_const(b, 0.5, x)), cdf)};
}

TPU_LOWER_ELEMENTWISE(softplus) {
  Value x = self_f(b, c);
  Value beta = scalar_arg(b, c, "beta", x), thr = scalar_arg(b, c, "threshold", x);
  Value xb = b.mul(x, beta);
  return {b.select(gt(b, xb, thr), x, b.div(log1p(b, b.exp(xb)), beta))};
}

TPU_LOWER_ELEMENTWISE(leaky_relu) {
  Value x = self_f(b, c);
  Value slope = scalar_arg(b, c, "negative_slope", x);
  return {b.select(gt(b, x, like_const(b, 0, x)), x, b.mul(x, slope))};
}

TPU_LOWER_ELEMENTWISE(elu) {
  Value x = self_f(b, c);
  Value alpha = scalar_arg(b, c, "alpha", x), scale = scalar_arg(b, c, "scale", x);
  Value iscale = scalar_arg(b, c, "input_scale", x);
  Value neg = b.mul(expm1(b, b.mul(x, iscale)), b.mul(alpha, scale));
  return {b.select(le(b, x, like_const(b, 0, x)), neg, b.mul(x, scale))};
}

TPU_LOWER_ELEMENTWISE(hardtanh) {
  Value x = self_c(b, c);
  Value lo = scalar_arg(b, c, "min_val", x), hi = scalar_arg(b, c, "max_val", x);
  return {nan_min(b, nan_max(b, x, lo), hi)};
}

TPU_LOWER_ELEMENTWISE(relu) {
  Value x = self_c(b, c);
  return {b.select(lt(b, x, b.zeros(x.type)), b.zeros(x.type), x)};
}

TPU_LOWER_ELEMENTWISE(logit) {
  Value x0 = self_f(b, c), x = x0;
  double eps = c.has("eps") ? c.double_("eps") : -1.0;
  if (eps >= 0) x = b.clamp(like_const(b, eps, x), x, like_const(b, 1 - eps, x));
  Value r = b.log(b.div(x, b.sub(like_const(b, 1, x), x)));
  return {eps >= 0 ? b.select(isnan(b, x0), x0, r) : r};  // clamp must not swallow NaN
}

TPU_LOWER_ELEMENTWISE(sinc) {
  Value x = self_f(b, c);
  Value px = b.mul(x, like_const(b, kPi, x));
  return {b.select(eq(b, x, like_const(b, 0, x)), like_const(b, 1, x), b.div(b.unary("sine", px), px))};
}
TPU_LOWER_ELEMENTWISE(hardshrink) {
  Value x = self_c(b, c);
  Value l = scalar_arg(b, c, "lambd", x);
  Value inside = b.and_(ge(b, x, b.neg(l)), le(b, x, l));
  return {b.select(inside, b.zeros(x.type), x)};
}
TPU_LOWER_ELEMENTWISE(softshrink) {
  Value x = self_c(b, c);
  Value l = scalar_arg(b, c, "lambd", x);
  Value mid = b.mul(x, b.zeros(x.type));  // a * 0 keeps NaN
  return {b.select(gt(b, x, l), b.sub(x, l), b.select(lt(b, x, b.neg(l)), b.add(x, l), mid))};
}
// (output, buffer): output = min(x, 0) - log1p(exp(-|x|)), buffer = exp(-|x|), as PyTorch's CPU kernel.
TPU_LOWER_ELEMENTWISE(log_sigmoid_forward) {
  Value x = self_f(b, c);
  Value z = b.exp(b.neg(b.abs(x)));
  return {b.sub(nan_min(b, x, like_const(b, 0, x)), log1p(b, z)), z};
}

// ---- sign-like and rounding ops keep integer dtypes.
static Value sign_impl(Builder& b, const OpCall& c) {
  Value x = input_as(b, c, "self", is_float(c.common) ? opmath(c.common) : c.common);
  if (x.elem() == ElemType::Pred) return x;
  Value z = b.zeros(x.type);
  return b.select(gt(b, x, z), like_const(b, 1, x), b.select(lt(b, x, z), like_const(b, -1, x), z));
}
TPU_LOWER_ELEMENTWISE(sign) { return {sign_impl(b, c)}; }
TPU_LOWER_ELEMENTWISE_COMPLEX(sgn) {
  if (!is_complex(c.common)) return {sign_impl(b, c)};
  // z / |z| part by part (c10's sgn_impl divides by the real |z|), 0 at 0.
  Value z = input_as(b, c, "self", c.common);
  Value r = b.op("abs", {z}, Type{part_type(z.elem()), z.shape()});
  Value zero = eq(b, r, b.zeros(r.type));
  Value d = b.select(zero, like_const(b, 1, r), r);
  return {b.select(zero, b.zeros(z.type), b.complex(b.div(b.real(z), d), b.div(b.imag(z), d)))};
}
TPU_LOWER_ELEMENTWISE(signbit) { return {signbit(b, input_as(b, c, "self", c.common))}; }
TPU_LOWER_ELEMENTWISE(floor) { return {rounding(b, c, "floor")}; }
TPU_LOWER_ELEMENTWISE(ceil) { return {rounding(b, c, "ceil")}; }
TPU_LOWER_ELEMENTWISE(trunc) {
  Value x = input_as(b, c, "self", is_float(c.common) ? opmath(c.common) : c.common);
  return {is_float(x.elem()) ? ew::trunc(b, x) : x};
}
TPU_LOWER_ELEMENTWISE(frac) {
  Value x = input_as(b, c, "self", is_float(c.common) ? opmath(c.common) : c.common);
  if (!is_float(x.elem())) throw Unsupported("frac of an integer tensor");
  return {b.sub(x, ew::trunc(b, x))};
}
TPU_LOWER_ELEMENTWISE(round) {
  Value x = input_as(b, c, "self", is_float(c.common) ? opmath(c.common) : c.common);
  if (!is_float(x.elem())) return {x};
  int64_t d = c.int_("decimals", 0);
  if (d == 0) return {b.unary("round_nearest_even", x)};
  Value p = like_const(b, std::pow(10.0, static_cast<double>(d < 0 ? -d : d)), x);
  if (d > 0) return {b.div(b.unary("round_nearest_even", b.mul(x, p)), p)};
  return {b.mul(b.unary("round_nearest_even", b.div(x, p)), p)};
}

// ---- integer / bool bit ops and predicates
TPU_LOWER_ELEMENTWISE_COMPLEX(abs) {
  Value x = self_c(b, c);
  if (is_complex(x.elem())) return {b.op("abs", {x}, Type{part_type(x.elem()), x.shape()})};  // |z|, real
  if (is_unsigned(x.elem()) || x.elem() == ElemType::Pred) return {x};
  return {b.abs(x)};
}
TPU_LOWER_ELEMENTWISE_COMPLEX(neg) {
  Value x = self_c(b, c);
  if (is_unsigned(x.elem())) return {b.sub(b.zeros(x.type), x)};
  if (x.elem() == ElemType::Pred) throw Unsupported("neg of bool");
  return {b.neg(x)};
}
TPU_LOWER_ELEMENTWISE(bitwise_not) {
  Value x = input_as(b, c, "self", c.common);
  if (is_float(x.elem())) throw Unsupported("bitwise_not of a float tensor");
  return {b.not_(x)};
}
TPU_LOWER_ELEMENTWISE(logical_not) { return {b.not_(input_as(b, c, "self", ElemType::Pred))}; }
TPU_LOWER_ELEMENTWISE(isnan) { return {isnan(b, input_as(b, c, "self", c.common))}; }
TPU_LOWER_ELEMENTWISE(isinf) { return {isinf(b, input_as(b, c, "self", c.common))}; }
TPU_LOWER_ELEMENTWISE(isposinf) {
  Value x = input_as(b, c, "self", c.common);
  if (!is_float(x.elem())) return {b.constant_i(0, ElemType::Pred, x.shape())};
  return {eq(b, x, like_const(b, INFINITY, x))};
}
TPU_LOWER_ELEMENTWISE(isneginf) {
  Value x = input_as(b, c, "self", c.common);
  if (!is_float(x.elem())) return {b.constant_i(0, ElemType::Pred, x.shape())};
  return {eq(b, x, like_const(b, -INFINITY, x))};
}
TPU_LOWER_ELEMENTWISE(isfinite) {
  Value x = input_as(b, c, "self", c.common);
  if (!is_float(x.elem())) return {b.constant_i(1, ElemType::Pred, x.shape())};
  return {is_finite(b, x)};
}
TPU_LOWER_ELEMENTWISE(nan_to_num) {
  Value x = input_as(b, c, "self", c.common);  // native dtype, so the finite extremes are exact
  if (!is_float(x.elem())) return {x};
  double big = x.elem() == ElemType::F64   ? std::numeric_limits<double>::max()
               : x.elem() == ElemType::F32 ? std::numeric_limits<float>::max()
               : x.elem() == ElemType::F16 ? 65504.0
                                           : 3.3895313892515355e38;  // bf16 max
  Value nanv = like_const(b, c.double_("nan", 0.0), x);
  Value pinf = like_const(b, c.has("posinf") ? c.double_("posinf") : big, x);
  Value ninf = like_const(b, c.has("neginf") ? c.double_("neginf") : -big, x);
  Value r = b.select(isnan(b, x), nanv, x);
  r = b.select(eq(b, x, like_const(b, INFINITY, x)), pinf, r);
  return {b.select(eq(b, x, like_const(b, -INFINITY, x)), ninf, r)};
}
TPU_LOWER_ELEMENTWISE(heaviside) {
  ElemType t = opmath(c.common);
  Value x = input_as(b, c, "self", t), v = input_as(b, c, "values", t);
  Value z = b.zeros(x.type);
  return {b.select(eq(b, x, z), v, b.select(gt(b, x, z), like_const(b, 1, x), z))};
}


// ---------------------------------------------------------------- digamma / polygamma
// The backward of lgamma/mvlgamma is digamma, of digamma trigamma = polygamma(1), of
// polygamma(n) polygamma(n + 1). Same algorithms as PyTorch's CPU kernels (ATen Math.h): the
// recurrence/reflection steps of the scalar loops are unrolled with selects.
namespace {

Value digamma_impl(Builder& b, Value x) {
  Value zero = like_const(b, 0, x), one = like_const(b, 1, x);
  Value neg = lt(b, x, zero);
  Value pole = b.and_(neg, eq(b, x, trunc(b, x)));  // negative integers (and -inf): NaN
  Value r = b.sub(x, trunc(b, x));                   // modf fraction, for the reflection
  Value y = b.select(neg, b.sub(one, x), x);
  Value res = zero;
  for (int i = 0; i < 10; ++i) {  // push y to >= 10 (y > 0 here)
    Value m = lt(b, y, like_const(b, 10, x));
    res = b.select(m, b.sub(res, b.div(one, y)), res);
    y = b.select(m, b.add(y, one), y);
  }
  Value z = b.div(one, b.mul(y, y));
  Value tail = b.mul(z, poly(b, z, {8.33333333333333333333E-2, -2.10927960927960927961E-2,
                                    7.57575757575757575758E-3, -4.16666666666666666667E-3,
                                    3.96825396825396825397E-3, -8.33333333333333333333E-3,
                                    8.33333333333333333333E-2}));
  tail = b.select(lt(b, y, like_const(b, 1.0e17, x)), tail, zero);
  Value asym = b.sub(b.sub(b.add(res, b.log(y)), b.div(like_const(b, 0.5, x), y)), tail);
  Value at10 = b.add(res, like_const(b, 2.25175258906672110764, x));  // PSI_10
  Value base = b.select(eq(b, y, like_const(b, 10, x)), at10, asym);
  Value pix = b.mul(like_const(b, kPi, x), r);
  Value refl = b.sub(base, b.div(like_const(b, kPi, x), b.div(b.unary("sine", pix), b.unary("cosine", pix))));
  Value out = b.select(neg, refl, base);
  out = b.select(pole, like_const(b, NAN, x), out);
  // digamma(+-0) = -+inf
  Value signed_inf = b.select(signbit(b, x), like_const(b, INFINITY, x), like_const(b, -INFINITY, x));
  return b.select(eq(b, x, zero), signed_inf, out);
}

Value trigamma_impl(Builder& b, Value x) {
  Value one = like_const(b, 1, x);
  Value refl = lt(b, x, like_const(b, 0.5, x));
  Value s = b.unary("sine", b.mul(like_const(b, kPi, x), x));
  Value res = b.select(refl, b.neg(b.div(like_const(b, kPi * kPi, x), b.mul(s, s))), like_const(b, 0, x));
  Value y = b.select(refl, b.sub(one, x), x);
  for (int i = 0; i < 6; ++i) {
    res = b.add(res, b.div(one, b.mul(y, y)));
    y = b.add(y, one);
  }
  Value ixx = b.div(one, b.mul(y, y));
  Value series = b.sub(like_const(b, 1.0 / 30, x), b.mul(ixx, like_const(b, 1.0 / 42, x)));
  series = b.sub(like_const(b, 1.0 / 6, x), b.mul(ixx, series));
  series = b.add(b.add(one, b.div(one, b.mul(like_const(b, 2, x), y))), b.mul(ixx, series));
  res = b.add(res, b.div(series, y));
  return b.select(refl, b.neg(res), res);
}

// q^-p for a positive integer p, by repeated products (std::pow's value for integer exponents,
// also for negative q).
Value pow_neg_int(Builder& b, Value q, int64_t p) {
  Value r = q;
  for (int64_t i = 1; i < p; ++i) r = b.mul(r, q);
  return b.div(like_const(b, 1, q), r);
}

// Hurwitz zeta(p, q) for an integer p >= 2 (Cephes' algorithm as in ATen's zeta, in f64).
Value zeta_int(Builder& b, int64_t p, Value q) {
  const double machep = 1.11022302462515654042E-16;
  const double xs = static_cast<double>(p);
  const ElemType I = ElemType::S64, P = ElemType::Pred;
  const Shape& sh = q.shape();
  std::vector<int64_t> all;
  for (int64_t i = 0; i < q.rank(); ++i) all.push_back(i);
  auto active = [&](const std::vector<Value>& st) {  // st: i, a, s, bt, conv
    Value i_lt = b.compare(Cmp::LT, st[0], b.constant_i(9, I));
    Value more = b.or_(b.broadcast_in_dim(i_lt, sh, {}), le(b, st[1], like_const(b, 9, q)));
    return b.and_(b.not_(st[4]), more);
  };
  // q <= 0 integer (and -inf): a pole, +inf; marked converged so the loop skips it.
  Value pole = b.and_(le(b, q, like_const(b, 0, q)), eq(b, q, b.floor(q)));
  std::vector<Value> init{b.constant_i(0, I), q, pow_neg_int(b, q, p), like_const(b, 0, q), pole};
  std::vector<Value> st = b.while_loop(
      init,
      [&](const std::vector<Value>& s) {
        return b.reduce(active(s), b.constant_i(0, P), all, "or");
      },
      [&](const std::vector<Value>& s) {
        Value act = active(s);
        Value a = b.add(s[1], like_const(b, 1, q));
        Value bt = pow_neg_int(b, a, p);
        Value sum = b.add(s[2], bt);
        Value conv = b.and_(lt(b, b.mul(like_const(b, -machep, q), sum), bt), lt(b, bt, b.mul(like_const(b, machep, q), sum)));
        return std::vector<Value>{b.add(s[0], b.constant_i(1, I)), b.select(act, a, s[1]),
                                  b.select(act, sum, s[2]), b.select(act, bt, s[3]),
                                  b.select(act, conv, s[4])};
      });
  Value a = st[1], s = st[2], bt = st[3], done = st[4];
  Value w = a;
  Value s2 = b.sub(b.add(s, b.div(b.mul(bt, w), like_const(b, xs - 1, q))), b.mul(like_const(b, 0.5, q), bt));
  s = b.select(done, s, s2);
  static const double A[] = {12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9,
                             7.47242496e10, -2.950130727918164224e12, 1.1646782814350067249e14,
                             -4.5979787224074726105e15, 1.8152105401943546773e17,
                             -7.1661652561756670113e18};
  double aa = 1, kk = 0;
  for (double ai : A) {
    aa *= xs + kk;
    bt = b.div(bt, w);
    Value t = b.div(b.mul(like_const(b, aa, q), bt), like_const(b, ai, q));
    Value s_new = b.add(s, t);
    Value small = lt(b, b.abs(b.div(t, s_new)), like_const(b, machep, q));
    s = b.select(done, s, s_new);
    done = b.or_(done, small);
    kk += 1;
    aa *= xs + kk;
    bt = b.div(bt, w);
    kk += 1;
  }
  return b.select(pole, like_const(b, INFINITY, q), s);
}

}  // namespace

TPU_LOWER_ELEMENTWISE(digamma) { return {digamma_impl(b, self_f(b, c))}; }

// lgamma: Lanczos (g = 7, 9 terms) for x >= 0.5, reflection lgamma(x) = log(pi / |sin(pi x)|) -
// lgamma(1 - x) below; +inf at the poles (0, negative integers) and at +-inf, as std::lgamma.
// Its backward (grad * digamma) is the lowering above.
TPU_LOWER_ELEMENTWISE(lgamma) {
  static const double kLanczos[] = {0.99999999999980993,     676.5203681218851,     -1259.1392167224028,
                                    771.32342877765313,      -176.61502916214059,   12.507343278686905,
                                    -0.13857109526572012,    9.9843695780195716e-6, 1.5056327351493116e-7};
  Value x = self_f(b, c);
  Value half = like_const(b, 0.5, x), one = like_const(b, 1, x);
  Value refl = lt(b, x, half);
  Value z = b.sub(b.select(refl, b.sub(one, x), x), one);  // Lanczos at y = z + 1 >= 0.5
  Value a = like_const(b, kLanczos[0], x);
  for (int i = 1; i < 9; ++i) a = b.add(a, b.div(like_const(b, kLanczos[i], x), b.add(z, like_const(b, i, x))));
  Value t = b.add(z, like_const(b, 7.5, x));
  Value lanczos = b.add(b.sub(b.add(like_const(b, 0.91893853320467274178, x), b.mul(b.add(z, half), b.log(t))), t),
                        b.log(a));
  // |sin(pi x)| = |sin(pi r)| with r = x - round(x) in [-1/2, 1/2], exact near the poles
  Value sin_pix = b.abs(b.unary("sine", b.mul(like_const(b, kPi, x), b.sub(x, b.unary("round_nearest_even", x)))));
  Value reflected = b.sub(b.sub(like_const(b, std::log(kPi), x), b.log(sin_pix)), lanczos);
  Value out = b.select(refl, reflected, lanczos);
  Value pole = b.and_(le(b, x, like_const(b, 0, x)), eq(b, x, b.floor(x)));  // also -inf
  Value inf = like_const(b, INFINITY, x);
  return {b.select(b.or_(pole, eq(b, x, inf)), inf, out)};
}

TPU_LOWER_ELEMENTWISE(polygamma) {
  int64_t n = c.int_("n");
  Value x = self_f(b, c);
  if (n == 0) return {digamma_impl(b, x)};
  if (n == 1) return {trigamma_impl(b, x)};
  if (n < 0) throw Unsupported("polygamma: n < 0");
  if (n > 60) throw Unsupported("polygamma: n > 60");
  // sign * n! * zeta(n + 1, x), in f64 as ATen's CPU kernel accumulates zeta in double
  double fact = 1;
  for (int64_t i = 2; i <= n; ++i) fact *= static_cast<double>(i);
  Value q = b.convert(x, ElemType::F64);
  Value z = zeta_int(b, n + 1, q);
  return {b.mul(like_const(b, (n % 2 ? 1.0 : -1.0) * fact, z), z)};
}

}  // namespace tpu::lowering
