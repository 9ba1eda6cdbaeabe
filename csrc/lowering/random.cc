// Random number generation on the device: Philox bits from the generator state operand
// (u64[2] = seed, offset; never a constant, so reseeding never recompiles), shaped into
// PyTorch's distributions. Reproducible under manual_seed; not bit-identical to the CPU.
#include <limits>
#include <cmath>
#include <string>

#include "lowering.h"

namespace tpu::lowering {

namespace {

// Uniform [0, 1) in f32 (or f64 for double outputs) from raw bits.
Value uniform01(Builder& b, const OpCall& c, ElemType t, const Shape& shape) {
  Value state = c.tensor("generator");
  if (t == ElemType::F64) {
    auto [ns, bits] = b.rng_bits(state, Type{ElemType::U64, shape});
    Value mant = b.binary("shift_right_logical", bits, b.constant_i(12, ElemType::U64, shape));
    Value one = b.or_(mant, b.constant_i(0x3FF0000000000000LL, ElemType::U64, shape));
    Value f = b.bitcast(one, Type{ElemType::F64, shape});
    return b.sub(f, b.constant_f(1.0, ElemType::F64, shape));
  }
  auto [ns, bits] = b.rng_bits(state, Type{ElemType::U32, shape});
  Value mant = b.binary("shift_right_logical", bits, b.constant_i(9, ElemType::U32, shape));
  Value one = b.or_(mant, b.constant_i(0x3F800000, ElemType::U32, shape));
  Value f = b.bitcast(one, Type{ElemType::F32, shape});
  return b.sub(f, b.constant_f(1.0, ElemType::F32, shape));
}

ElemType float_compute(ElemType out) { return out == ElemType::F64 ? ElemType::F64 : ElemType::F32; }

// Box-Muller normal(0, 1) in f32/f64.
Value std_normal(Builder& b, const OpCall& c, ElemType t, const Shape& shape) {
  Shape two = shape;
  two.insert(two.begin(), 2);
  Value u = uniform01(b, c, t, two);
  Shape start(two.size(), 0), lim = two;
  lim[0] = 1;
  Value u1 = b.reshape(b.slice(u, start, lim), shape);
  start[0] = 1;
  lim[0] = 2;
  Value u2 = b.reshape(b.slice(u, start, lim), shape);
  Value one = b.constant_f(1.0, t, shape);
  Value r = b.sqrt(b.mul(b.constant_f(-2.0, t, shape), b.log(b.sub(one, u1))));  // 1-u1 in (0,1]
  Value th = b.mul(b.constant_f(2.0 * M_PI, t, shape), u2);
  return b.mul(r, b.unary("cosine", th));
}

}  // namespace

TPU_LOWER_RANDOM(uniform) {
  const Type& o = out_type(c);
  ElemType t = float_compute(o.elem);
  Value u = uniform01(b, c, t, o.shape);
  Value lo = operand(b, c.arg("from"), t, o.shape);
  Value hi = operand(b, c.arg("to"), t, o.shape);
  Value r = b.add(lo, b.mul(u, b.sub(hi, lo)));
  if (o.elem != t) {
    // Rounding to a narrower float must not produce `to` itself.
    Value n = b.convert(r, o.elem);
    Value back = b.convert(n, t);
    return {b.select(b.compare(Cmp::GE, back, hi), b.convert(lo, o.elem), n)};
  }
  return {r};
}

TPU_LOWER_RANDOM(normal) {
  const Type& o = out_type(c);
  ElemType t = float_compute(o.elem);
  Value z = std_normal(b, c, t, o.shape);
  Value mean = c.has("mean") ? operand(b, c.arg("mean"), t, o.shape) : b.constant_f(0, t, o.shape);
  Value sd = c.has("std") ? operand(b, c.arg("std"), t, o.shape) : b.constant_f(1, t, o.shape);
  return {b.add(mean, b.mul(z, sd))};
}

TPU_LOWER_RANDOM(exponential) {
  const Type& o = out_type(c);
  ElemType t = float_compute(o.elem);
  Value u = uniform01(b, c, t, o.shape);
  Value l = operand(b, c.arg("lambd"), t, o.shape);
  Value one = b.constant_f(1.0, t, o.shape);
  return {b.div(b.neg(b.log(b.sub(one, u))), l)};
}

// cauchy_, log_normal_, geometric_: the CPU kernels' argument checks, then their inverse-CDF
// transforms (ATen's TransformationHelper.h) of device uniforms.
namespace {
void require_float_out(const Type& o, const char* what) {
  if (!shlo::is_float(o.elem))
    throw std::runtime_error(std::string(what) +
                             " distribution is a continuous probability distribution. dtype must be a floating point");
}
}  // namespace

TPU_LOWER_RANDOM(cauchy) {
  const Type& o = out_type(c);
  double median = c.double_("median", 0.0), sigma = c.double_("sigma", 1.0);
  if (!(sigma > 0.0)) throw std::runtime_error("cauchy_ expects sigma > 0.0, but found sigma=" + std::to_string(sigma));
  require_float_out(o, "Cauchy");
  ElemType t = float_compute(o.elem);
  // tan(pi * (u - 0.5)) with u clipped to [eps, 1 - eps] as on the CPU: finite at both ends.
  double eps = t == ElemType::F64 ? std::numeric_limits<double>::epsilon() : std::numeric_limits<float>::epsilon();
  Value u = b.clamp(b.constant_f(eps, t, o.shape), uniform01(b, c, t, o.shape), b.constant_f(1.0 - eps, t, o.shape));
  Value x = b.unary("tan", b.mul(b.constant_f(M_PI, t, o.shape), b.sub(u, b.constant_f(0.5, t, o.shape))));
  return {b.convert(b.add(b.constant_f(median, t, o.shape), b.mul(b.constant_f(sigma, t, o.shape), x)), o.elem)};
}

TPU_LOWER_RANDOM(log_normal) {
  const Type& o = out_type(c);
  double mean = c.double_("mean", 1.0), sd = c.double_("std", 2.0);
  if (!(sd > 0.0)) throw std::runtime_error("log_normal_ expects std > 0.0, but found std=" + std::to_string(sd));
  require_float_out(o, "LogNormal");
  ElemType t = float_compute(o.elem);
  Value z = std_normal(b, c, t, o.shape);
  return {b.convert(b.exp(b.add(b.constant_f(mean, t, o.shape), b.mul(z, b.constant_f(sd, t, o.shape)))), o.elem)};
}

TPU_LOWER_RANDOM(geometric) {
  // Number of Bernoulli(p) trials up to the first success: ceil(log(u) / log1p(-p)), u in (0, 1],
  // at least 1 (u == 1 would give 0). Integer outputs too, as on the CPU.
  const Type& o = out_type(c);
  double p = c.double_("p");
  if (!(p > 0 && p < 1)) throw std::runtime_error("geometric_ expects p to be in (0, 1), but got p=" + std::to_string(p));
  ElemType t = o.elem == ElemType::F64 || shlo::is_integral(o.elem) ? ElemType::F64 : ElemType::F32;
  Value one = b.constant_f(1.0, t, o.shape);
  Value u = b.sub(one, uniform01(b, c, t, o.shape));
  Value k = b.unary("ceil", b.div(b.log(u), b.constant_f(std::log1p(-p), t, o.shape)));
  return {b.convert(b.max(k, one), o.elem)};
}

TPU_LOWER_RANDOM(bernoulli) {
  const Type& o = out_type(c);
  Value u = uniform01(b, c, ElemType::F64, o.shape);
  Value p;
  if (c.has("p")) {
    p = operand(b, c.arg("p"), ElemType::F64, o.shape);
  } else {
    p = cast_to(b, c.tensor("self"), ElemType::F64, o.shape);  // bernoulli(self): self holds p
  }
  return {b.convert(b.compare(Cmp::LT, u, p), o.elem)};
}

TPU_LOWER_RANDOM(random) {
  // random_(): [0, 2^digits]; random_(to): [0, to); random_(from, to): [from, to).
  const Type& o = out_type(c);
  Value state = c.tensor("generator");
  auto [ns, bits] = b.rng_bits(state, Type{ElemType::U64, o.shape});
  Value lo, range;
  if (c.has("from")) {
    lo = b.convert(c.arg("from").kind == Arg::Kind::Int ? b.constant_i(c.arg("from").i, ElemType::S64)
                                                          : operand(b, c.arg("from"), ElemType::S64, {}),
                   ElemType::S64);
  } else {
    lo = b.constant_i(0, ElemType::S64);
  }
  if (c.has("to")) {
    Value hi = c.arg("to").kind == Arg::Kind::Int ? b.constant_i(c.arg("to").i, ElemType::S64)
                                                    : operand(b, c.arg("to"), ElemType::S64, {});
    range = b.sub(hi, lo);
  } else {
    int64_t digits;
    switch (o.elem) {
      case ElemType::F32: digits = 24; break;
      case ElemType::F64: digits = 53; break;
      case ElemType::F16: digits = 11; break;
      case ElemType::BF16: digits = 8; break;
      case ElemType::Pred: digits = 1; break;
      default: digits = shlo::bit_width(o.elem) - (shlo::is_unsigned(o.elem) ? 0 : 1); break;
    }
    if (digits >= 63) {
      // Full int64 range: the raw bits reinterpreted (non-negative for signed types).
      Value r = b.binary("shift_right_logical", bits, b.constant_i(1, ElemType::U64, o.shape));
      return {b.convert(b.bitcast(r, Type{ElemType::S64, o.shape}), o.elem)};
    }
    range = b.constant_i((int64_t{1} << digits) + (o.elem == ElemType::Pred ? 0 : 1), ElemType::S64);
    if (shlo::is_float(o.elem)) range = b.constant_i((int64_t{1} << digits) + 1, ElemType::S64);
  }
  Value r64 = b.bitcast(b.binary("shift_right_logical", bits, b.constant_i(1, ElemType::U64, o.shape)),
                        Type{ElemType::S64, o.shape});
  Value v = b.add(b.broadcast_to(lo, o.shape), b.rem(r64, b.broadcast_to(range, o.shape)));
  return {b.convert(v, o.elem)};
}

TPU_LOWER_RANDOM(randperm) {
  const Type& o = out_type(c);
  int64_t n = o.shape.empty() ? 1 : o.shape[0];
  Value state = c.tensor("generator");
  auto [ns, keys] = b.rng_bits(state, Type{ElemType::U32, {n}});
  Value idx = b.iota(Type{ElemType::S64, {n}}, 0);
  auto sorted = b.sort({keys, idx}, 0, [&](const std::vector<Value>& a) {
    return b.compare(Cmp::LT, a[0], a[1]);
  });
  return {b.convert(sorted[1], o.elem)};
}

// multinomial: each row of `self` holds unnormalized category weights.
// Without replacement: the exponential race (PyTorch's CPU algorithm): the num_samples largest
// w_i / E_i with E_i ~ Exp(1), by a stable descending sort; zero-weight categories sort last.
// With replacement: inverse CDF by binary search (O(log n) per sample): the first category whose
// inclusive prefix sum exceeds u * total, over prefix sums made monotone so that a zero-weight
// category is never drawn, whatever the sums' rounding.
// Invalid distributions (negative, non-finite or all-zero weights, or fewer positive weights than
// samples without replacement) are not diagnosed: PyTorch's CPU kernel raises, which would need a
// host read of the weights.
// Random but not pointwise: the runtime must not flatten [rows, n] probabilities when the
// [rows, num_samples] output happens to have the same shape.
TPU_LOWER_WITH(multinomial, .random = true, .checked = true) {
  const Type& o = out_type(c);
  Value p = c.tensor("self");
  if (p.rank() < 1 || p.rank() > 2) throw Unsupported("multinomial: self must be 1-D or 2-D");
  int64_t n = p.shape().back();
  int64_t rows = p.rank() == 1 ? 1 : p.shape()[0];
  int64_t s = o.shape.empty() ? 1 : o.shape.back();
  if (n == 0 || rows == 0 || s == 0) throw Unsupported("multinomial: empty input or output");
  if (!c.bool_("replacement") && s > n)
    throw std::runtime_error("cannot sample n_sample > prob_dist.size(-1) samples without replacement");
  ElemType t = float_compute(p.elem());
  Value w = b.reshape(b.convert(p, t), {rows, n});
  Shape rn{rows, n};
  if (b.checking()) {  // the CPU kernel's two value checks
    Value inf = b.constant_f(std::numeric_limits<double>::infinity(), t, rn);
    Value bad = b.or_(b.or_(b.compare(Cmp::LT, w, b.zeros(Type{t, rn})), b.compare(Cmp::NE, w, w)),
                      b.compare(Cmp::EQ, w, inf));
    check(b, bad, CheckKind::Runtime, "probability tensor contains either `inf`, `nan` or element < 0");
    Value sum = b.reduce(w, b.constant_f(0, t), {1}, "add");
    check(b, b.compare(Cmp::LE, sum, b.zeros(Type{t, {rows}})), CheckKind::Runtime,
          "invalid multinomial distribution (sum of probabilities <= 0)");
  }
  Value positive = b.compare(Cmp::GT, w, b.constant_f(0, t, rn));
  Value idx;
  if (!c.bool_("replacement")) {
    Value u = uniform01(b, c, t, rn);
    Value e = b.neg(b.log(b.sub(b.constant_f(1.0, t, rn), u)));  // Exp(1) in [0, inf)
    Value key = b.select(positive, b.div(w, e), b.constant_f(-1.0, t, rn));
    Value iota = b.iota(Type{ElemType::S64, rn}, 1);
    if (s == 1) {  // one draw (token sampling): the race's winner, an argmax instead of a sort
      auto r = b.reduce_multi({key, iota}, {b.constant_f(-2.0, t), b.constant_i(n, ElemType::S64)}, {1},
                              [&](const std::vector<Value>& a) {
                                Value gt = b.compare(Cmp::GT, a[0], a[2]);
                                Value tie = b.and_(b.compare(Cmp::EQ, a[0], a[2]), b.compare(Cmp::LT, a[1], a[3]));
                                Value left = b.or_(gt, tie);
                                return std::vector<Value>{b.select(left, a[0], a[2]), b.select(left, a[1], a[3])};
                              });
      return {b.convert(b.reshape(r[1], o.shape), o.elem)};
    }
    auto sorted = b.sort({key, iota}, 1, [&](const std::vector<Value>& a) {
      return b.compare(Cmp::GT, a[0], a[1]);
    });
    idx = b.slice(sorted[1], {0, 0}, {rows, s});
  } else {
    // Inclusive prefix sums along the categories (Hillis-Steele, log2(n) steps), made monotone
    // with exact plateaus at zero-weight categories: a running max over the positive
    // categories' sums (max never rounds). The first category whose value exceeds u * total then
    // always has positive weight, and a binary search finds it.
    auto scan = [&](Value x, const char* op, double pad) {
      for (int64_t k = 1; k < n; k *= 2) {
        Value shifted = b.pad(b.slice(x, {0, 0}, {rows, n - k}), b.constant_f(pad, t), {0, k}, {0, 0});
        x = b.binary(op, x, shifted);
      }
      return x;
    };
    Value cdf = scan(w, "add", 0.0);
    Value mono = scan(b.select(positive, cdf, b.constant_f(-1.0, t, rn)), "maximum", -1.0);
    Shape rs{rows, s};
    Value total = b.broadcast_in_dim(b.reshape(b.slice(mono, {0, n - 1}, {rows, n}), {rows}), rs, {0});
    Value target = b.mul(uniform01(b, c, t, rs), total);
    const ElemType I = ElemType::S64;
    Value row = b.reshape(b.iota(Type{I, rs}, 0), {rows, s, 1});
    Value lo = b.constant_i(0, I, rs), hi = b.constant_i(n, I, rs);
    for (int64_t span = n; span > 0; span /= 2) {  // ceil(log2(n + 1)) halvings
      Value active = b.compare(Cmp::LT, lo, hi);
      Value mid = b.binary("shift_right_logical", b.add(lo, hi), b.constant_i(1, I, rs));
      Value at = b.min(mid, b.constant_i(n - 1, I, rs));
      Value where = b.concatenate({row, b.reshape(at, {rows, s, 1})}, 2);
      Value v = b.gather(mono, where, {}, {0, 1}, {0, 1}, 2, {1, 1}, rs);
      Value le = b.compare(Cmp::LE, v, target);
      lo = b.select(b.and_(active, le), b.add(mid, b.constant_i(1, I, rs)), lo);
      hi = b.select(b.and_(active, b.not_(le)), mid, hi);
    }
    // u * total can round up to total: then the last positive category.
    Value last_pos = b.reduce(b.select(positive, b.iota(Type{I, rn}, 1), b.constant_i(0, I, rn)),
                              b.constant_i(0, I), {1}, "maximum");  // [rows]
    idx = b.select(b.compare(Cmp::EQ, lo, b.constant_i(n, I, rs)), b.broadcast_in_dim(last_pos, rs, {0}), lo);
  }
  return {b.convert(b.reshape(idx, o.shape), o.elem)};
}

// Eval mode (train=False) draws nothing, as on the CPU; p == 0 in training still draws.
TPU_LOWER_WITH(native_dropout, .elementwise = true, .random = true, .draws_nothing_when = {{"train", 0.0}}) {
  const Type& o = out_type(c, 0);
  Value x = c.tensor("input");
  ElemType t = opmath(o.elem);
  bool train = !c.has("train") || c.arg("train").b;
  double p = c.double_("p");
  if (!train || p == 0) {
    return {x, b.constant_i(1, ElemType::Pred, o.shape)};
  }
  Value u = uniform01(b, c, ElemType::F32, o.shape);
  Value keep = b.compare(Cmp::GE, u, b.constant_f(p, ElemType::F32, o.shape));
  Value scale = b.constant_f(p >= 1 ? 0.0 : 1.0 / (1.0 - p), t, o.shape);
  Value y = b.select(keep, b.mul(b.convert(x, t), scale), b.zeros(Type{t, o.shape}));
  return {y, keep};
}

}  // namespace tpu::lowering
