// frexp, nextafter and mode: ops that used to run on the CPU fallback, lowered with the CPU
// kernels' exact rules. frexp and nextafter work on the IEEE bit patterns (integer ops only), so
// subnormals are handled exactly even where the hardware flushes them in float arithmetic.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "lowering.h"

namespace tpu::lowering {

namespace {

// Bit layout of a float type: the same-width unsigned/signed integer types, mantissa bits, bias.
struct FloatBits {
  ElemType u, s;
  int width, mant, bias;
};

FloatBits float_bits(ElemType t) {
  switch (t) {
    case ElemType::F16: return {ElemType::U16, ElemType::S16, 16, 10, 15};
    case ElemType::BF16: return {ElemType::U16, ElemType::S16, 16, 7, 127};
    case ElemType::F32: return {ElemType::U32, ElemType::S32, 32, 23, 127};
    case ElemType::F64: return {ElemType::U64, ElemType::S64, 64, 52, 1023};
    default: throw Unsupported("float bit layout: not a 16/32/64-bit float type");
  }
}

}  // namespace

// std::frexp per element: x = mantissa * 2^exponent, |mantissa| in [0.5, 1) with x's sign;
// +-0 -> (+-0, 0); inf and NaN -> (x, 0); subnormals normalised by their leading zero count.
TPU_LOWER_WITH(frexp, .elementwise = true) {
  const Type& mo = out_type(c, 0);
  const Type& eo = out_type(c, 1);
  Value self = c.tensor("self");
  if (!shlo::is_float(self.elem()))
    throw std::runtime_error("torch.frexp() only supports floating-point dtypes");
  // frexp.Tensor_out: the CPU kernel's dtype checks of the out tensors (never a cast).
  const Arg* mant_out = c.find("mantissa");
  const Arg* exp_out = c.find("exponent");
  if (mant_out && mant_out->kind == Arg::Kind::Tensor && mant_out->tensor.elem() != self.elem())
    throw std::runtime_error(std::string("torch.frexp() expects mantissa to have dtype ") +
                             shlo::mlir_name(self.elem()) + " but got " + shlo::mlir_name(mant_out->tensor.elem()));
  if (exp_out && exp_out->kind == Arg::Kind::Tensor && exp_out->tensor.elem() != ElemType::S32)
    throw std::runtime_error(std::string("torch.frexp() expects exponent to have int dtype but got ") +
                             shlo::mlir_name(exp_out->tensor.elem()));
  const ElemType t = mo.elem;
  const FloatBits f = float_bits(t);
  const Shape& sh = mo.shape;
  const ElemType U = f.u;
  auto ku = [&](uint64_t v) { return b.constant_i(static_cast<int64_t>(v), U, sh); };
  const uint64_t sign_bit = uint64_t{1} << (f.width - 1);
  const uint64_t mant_mask = (uint64_t{1} << f.mant) - 1;
  const uint64_t exp_max = (uint64_t{1} << (f.width - 1 - f.mant)) - 1;
  const uint64_t half_exp = static_cast<uint64_t>(f.bias - 1) << f.mant;  // exponent field of [0.5, 1)

  Value x = operand(b, c.arg("self"), t, sh);
  Value bits = b.bitcast(x, Type{U, sh});
  Value sign = b.and_(bits, ku(sign_bit));
  Value ef = b.and_(b.binary("shift_right_logical", bits, ku(f.mant)), ku(exp_max));
  Value mf = b.and_(bits, ku(mant_mask));
  // Normal numbers: keep sign and fraction, set the exponent field to bias - 1.
  Value norm_m = b.or_(b.or_(sign, mf), ku(half_exp));
  Value norm_e = b.sub(b.convert(ef, ElemType::S32), b.constant_i(f.bias - 1, ElemType::S32, sh));
  // Subnormals: value = mf * 2^(1 - bias - mant); w = bit length of mf.
  Value w = b.sub(ku(f.width), b.unary("count_leading_zeros", mf));
  Value shifted = b.binary("shift_left", mf, b.sub(ku(f.mant + 1), w));
  Value sub_m = b.or_(b.or_(sign, b.and_(shifted, ku(mant_mask))), ku(half_exp));
  Value sub_e = b.sub(b.convert(w, ElemType::S32), b.constant_i(f.bias + f.mant - 1, ElemType::S32, sh));

  Value is_sub = b.and_(b.compare(Cmp::EQ, ef, ku(0)), b.compare(Cmp::NE, mf, ku(0)));
  Value passthrough = b.or_(b.compare(Cmp::EQ, ef, ku(exp_max)),  // inf, NaN
                            b.compare(Cmp::EQ, b.and_(bits, ku(sign_bit - 1)), ku(0)));
  Value m = b.select(is_sub, sub_m, norm_m);
  Value e = b.select(is_sub, sub_e, norm_e);
  m = b.select(passthrough, bits, m);
  e = b.select(passthrough, b.constant_i(0, ElemType::S32, sh), e);
  return {b.bitcast(m, Type{t, sh}), b.convert(e, eo.elem)};
}

// std::nextafter: the next representable value after x toward y, by stepping the bit pattern.
// NaN in either -> NaN; x == y -> y; +-0 -> the smallest subnormal with y's sign. Comparisons use
// the integer total order of the bit patterns (exact for subnormals whatever the hardware's FTZ).
TPU_LOWER_ELEMENTWISE(nextafter) {
  const Type& o = out_type(c);
  if (!shlo::is_float(o.elem)) throw Unsupported("nextafter: integer inputs (the CPU kernel raises)");
  const ElemType t = o.elem;
  const FloatBits f = float_bits(t);
  const Shape& sh = o.shape;
  const ElemType U = f.u, S = f.s;
  auto ku = [&](uint64_t v) { return b.constant_i(static_cast<int64_t>(v), U, sh); };
  const uint64_t sign_bit = uint64_t{1} << (f.width - 1);
  const uint64_t inf_bits = ((uint64_t{1} << (f.width - 1 - f.mant)) - 1) << f.mant;

  Value x = operand(b, c.arg("self"), t, sh), y = operand(b, c.arg("other"), t, sh);
  Value xb = b.bitcast(x, Type{U, sh}), yb = b.bitcast(y, Type{U, sh});
  Value xmag = b.and_(xb, ku(sign_bit - 1)), ymag = b.and_(yb, ku(sign_bit - 1));
  Value nan = b.or_(b.compare(Cmp::GT, xmag, ku(inf_bits)), b.compare(Cmp::GT, ymag, ku(inf_bits)));
  // Signed keys ordered like the values (-0 and +0 both 0).
  auto key = [&](Value bits, Value mag) {
    Value m = b.bitcast(mag, Type{S, sh});
    return b.select(b.compare(Cmp::NE, b.and_(bits, ku(sign_bit)), ku(0)), b.neg(m), m);
  };
  Value kx = key(xb, xmag), ky = key(yb, ymag);
  Value zero_s = b.constant_i(0, S, sh);
  // The magnitude grows when moving away from zero: (x < y) == (x > 0).
  Value grow = b.not_(b.xor_(b.compare(Cmp::LT, kx, ky), b.compare(Cmp::GT, kx, zero_s)));
  Value stepped = b.select(grow, b.add(xb, ku(1)), b.sub(xb, ku(1)));
  Value tiny = b.or_(b.and_(yb, ku(sign_bit)), ku(1));
  Value r = b.select(b.compare(Cmp::EQ, xmag, ku(0)), tiny, stepped);
  r = b.select(b.compare(Cmp::EQ, kx, ky), yb, r);
  Value out = b.bitcast(r, Type{t, sh});
  return {b.select(nan, b.add(x, y), out)};
}

// mode(dim): the most frequent value along dim and an index of it, as the CPU kernel: it sorts
// (value, index) pairs by value and scans the runs of equal values (NaN != NaN: each NaN is its
// own run); the first longest run (the smallest value) wins with its last element's index. The
// CPU's std::sort is not stable: on slices of <= 16 elements it is an insertion sort (stable;
// replayed exactly for floats, NaNs included), on longer ones an introsort whose order among equal
// values is its own; there the index is the last occurrence and NaNs sort last.
TPU_LOWER(mode) {
  const Type& vo = out_type(c, 0);
  const Type& io = out_type(c, 1);
  Value x = c.tensor("self");
  const int64_t r = x.rank();
  if (r == 0) return {x, b.zeros(Type{io.elem, io.shape})};
  int64_t dim = c.int_("dim", -1);
  if (dim < -r || dim >= r) throw Unsupported("mode: dim out of range");
  if (dim < 0) dim += r;
  const int64_t n = x.shape()[dim];
  if (n == 0)
    throw std::runtime_error("mode(): Expected reduction dim " + std::to_string(dim) + " to have non-zero size.");
  std::vector<int64_t> perm;
  int64_t rows = 1;
  for (int64_t d = 0; d < r; ++d)
    if (d != dim) {
      perm.push_back(d);
      rows *= x.shape()[d];
    }
  perm.push_back(dim);
  const ElemType et = x.elem() == ElemType::Pred ? ElemType::U8 : x.elem();
  Value v = b.reshape(b.transpose(b.convert(x, et), perm), {rows, n});
  const Shape rn{rows, n};
  const ElemType I = ElemType::S64;
  Value pos = b.iota(Type{I, rn}, 1);  // position along the slice: also the initial indices
  const bool fl = shlo::is_float(et);
  Value sv, si;
  if (fl && n <= 16) {
    // libstdc++'s std::sort is an insertion sort on <= 16 elements; replayed step by step so that
    // NaNs (never `<` anything) stop the insertions exactly where they stop on the CPU.
    sv = v;
    si = pos;
    auto column = [&](Value a, int64_t j) {
      return b.broadcast_in_dim(b.reshape(b.slice(a, {0, j}, {rows, j + 1}), {rows}), rn, {0});
    };
    for (int64_t i = 1; i < n; ++i) {
      Value val = column(sv, i), vid = column(si, i);
      Value less = b.compare(Cmp::LT, val, sv);  // val < arr[j]
      Value stop = b.and_(b.not_(less), b.compare(Cmp::LT, pos, b.constant_i(i, I, rn)));
      Value last = b.reduce(b.select(stop, pos, b.constant_i(-1, I, rn)), b.constant_i(-1, I), {1}, "maximum");
      // val < arr[0]: to the front; else after the nearest j < i with !(val < arr[j]).
      Value to_front = b.reshape(b.slice(less, {0, 0}, {rows, 1}), {rows});
      Value p = b.select(to_front, b.constant_i(0, I, {rows}), b.add(last, b.constant_i(1, I, {rows})));
      Value P = b.broadcast_in_dim(p, rn, {0});
      Value shift = b.and_(b.compare(Cmp::GT, pos, P), b.compare(Cmp::LE, pos, b.constant_i(i, I, rn)));
      Value at = b.compare(Cmp::EQ, pos, P);
      auto insert = [&](Value a, Value x) {
        Value prev = b.pad(b.slice(a, {0, 0}, {rows, n - 1}), b.zeros(Type{a.elem(), {}}), {0, 1}, {0, 0});
        return b.select(at, x, b.select(shift, prev, a));
      };
      sv = insert(sv, val);
      si = insert(si, vid);
    }
  } else {
    auto sorted = b.sort({v, pos}, 1, [&](const std::vector<Value>& a) {
      Value lt = b.compare(Cmp::LT, a[0], a[1]);
      Value eq = b.compare(Cmp::EQ, a[0], a[1]);
      if (fl) {  // NaN last; NaNs among themselves by index
        Value ln = b.compare(Cmp::NE, a[0], a[0]), rn_ = b.compare(Cmp::NE, a[1], a[1]);
        lt = b.or_(lt, b.and_(b.not_(ln), rn_));
        eq = b.or_(eq, b.and_(ln, rn_));
      }
      return b.or_(lt, b.and_(eq, b.compare(Cmp::LT, a[2], a[3])));
    });
    sv = sorted[0];
    si = sorted[1];
  }
  Value freq;
  if (n == 1) {
    freq = b.constant_i(1, I, rn);
  } else {
    Value boundary = b.compare(Cmp::NE, b.slice(sv, {0, 0}, {rows, n - 1}), b.slice(sv, {0, 1}, {rows, n}));
    Value yes = b.constant_i(1, ElemType::Pred);
    Value start = b.pad(boundary, yes, {0, 1}, {0, 0});
    Value end = b.pad(boundary, yes, {0, 0}, {0, 1});
    // Start of each element's run: a running max of the start positions (log2(n) steps).
    Value sp = b.select(start, pos, b.constant_i(0, I, rn));
    for (int64_t k = 1; k < n; k *= 2) {
      Value sh = b.pad(b.slice(sp, {0, 0}, {rows, n - k}), b.constant_i(0, I), {0, k}, {0, 0});
      sp = b.max(sp, sh);
    }
    freq = b.select(end, b.add(b.sub(pos, sp), b.constant_i(1, I, rn)), b.constant_i(0, I, rn));
  }
  auto best = b.reduce_multi({freq, pos, sv, si},
                             {b.constant_i(-1, I), b.constant_i(n, I), b.zeros(Type{et, {}}), b.constant_i(0, I)},
                             {1}, [&](const std::vector<Value>& a) {
                               Value gt = b.compare(Cmp::GT, a[0], a[4]);
                               Value tie = b.and_(b.compare(Cmp::EQ, a[0], a[4]), b.compare(Cmp::LT, a[1], a[5]));
                               Value left = b.or_(gt, tie);
                               std::vector<Value> out;
                               for (int i = 0; i < 4; ++i) out.push_back(b.select(left, a[i], a[i + 4]));
                               return out;
                             });
  return {b.convert(b.reshape(best[2], vo.shape), vo.elem), b.convert(b.reshape(best[3], io.shape), io.elem)};
}

}  // namespace tpu::lowering
