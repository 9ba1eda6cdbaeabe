// Modified Bessel functions (i0, special_i0e, special_i1, special_i1e, special_modified_bessel_i0/_i1,
// _k0/_k1, special_scaled_modified_bessel_k0/_k1) with the scheme PyTorch's CPU kernels use (the Chebyshev
// expansions of Clenshaw, "Chebyshev Series for Mathematical Functions", 1962, in the form of
// Moshier's "Methods and Programs for Mathematical Functions", 1989):
//   |x| <= 8: e^-x I0(x) = S_A0(x/2 - 2),             e^-x I1(x) = x S_A1(x/2 - 2)
//   |x| >  8: e^-x I0(x) = S_B0(32/x - 2) / sqrt(x),  e^-x I1(x) = S_B1(32/x - 2) / sqrt(x)
// S(y) = sum' c_k T_k(y/2), summed by Clenshaw's recurrence in the input's float type, so float32
// rounds step by step as CPU's float32 kernel does (within a few ulp; float16/bfloat16 compute in
// float32 as CPU does). The same operand order as CPU's kernels: i0(inf) = inf * c / inf = NaN
// there, and here. The coefficients are this project's own: the Chebyshev coefficients of the
// four functions on their intervals, computed with mpmath at 50 digits (t in [-1, 1]):
//   A0: x = 4(t+1),  f = e^-x I0(x)          B0: x = 16/(t+1), f = e^-x sqrt(x) I0(x)
//   A1: x = 4(t+1),  f = e^-x I1(x) / x      B1: x = 16/(t+1), f = e^-x sqrt(x) I1(x)
//   c_k = 2/N sum_j f(cos(pi (j + 1/2) / N)) cos(pi k (j + 1/2) / N), N = 120,
// truncated at the lengths CPU's series use (30, 25, 29, 25 terms), c_0 listed first. The K series
// likewise: KA0: x = sqrt(2(t+1)), f = K0 + log(x/2) I0 (10 terms); KA1: f = x (K1 - log(x/2) I1)
// (11); KB0/KB1: x = 4/(t+1), f = e^x sqrt(x) K0/K1 (25 each).
#include <cmath>
#include <vector>

#include "elementwise_math.h"
#include "lowering.h"

namespace tpu::lowering {
namespace {

const std::vector<double> kA0 = {
    0.6767952744094761, -0.3046826723431984, 0.17162090152220877, -0.09490109704804764, 0.04930528423967071,
    -0.02373741480589947, 0.010546460394594998, -0.004324309995050576, 0.0016394756169413357,
    -0.0005763755745385824, 0.00018850288509584165, -5.754195010082104e-05, 1.6448448070728896e-05,
    -4.4167383584587505e-06, 1.1173875391201037e-06, -2.670793853940612e-07, 6.046995022541919e-08,
    -1.300025009986248e-08, 2.6598237246823866e-09, -5.189795601635263e-10, 9.675809035373237e-11,
    -1.726826291441556e-11, 2.95505266312964e-12, -4.856446783111929e-13, 7.676185498604936e-14,
    -1.1685332877993451e-14, 1.715391285555133e-15, -2.431279846547955e-16, 3.3307945188222384e-17,
    -4.4153416464793395e-18};
const std::vector<double> kB0 = {
    0.8044904110141088, 0.0033691164782556943, 6.889758346916825e-05, 2.8913705208347567e-06,
    2.0489185894690638e-07, 2.266668990498178e-08, 3.3962320257083865e-09, 4.94060238822497e-10,
    1.1889147107846439e-11, -3.1499165279632416e-11, -1.3215811840447713e-11, -1.7941785315068062e-12,
    7.180124451383666e-13, 3.8527783827421426e-13, 1.54008621752141e-14, -4.150569347287222e-14,
    -9.554846698828307e-15, 3.8116806693526224e-15, 1.7725601330565263e-15, -3.425485619677219e-16,
    -2.8276239805165836e-16, 3.461222867697461e-17, 4.46562142029676e-17, -4.830504485944182e-18,
    -7.233180487874754e-18};
const std::vector<double> kA1 = {
    0.25258718644363365, -0.17641651835783406, 0.1026436586898471, -0.05294598120809499, 0.024726449030626516,
    -0.010564084894626197, 0.004156422944312888, -0.0015135724506312532, 0.0005122859561685758,
    -0.00016176081582589674, 4.781565107550054e-05, -1.3273163656039436e-05, 3.4702513081376785e-06,
    -8.568720264695455e-07, 2.0032947535521353e-07, -4.445059128796328e-08, 9.381537386495773e-09,
    -1.8872497517228294e-09, 3.625590281552117e-10, -6.663489723502027e-11, 1.1736186298890901e-11,
    -1.9839743977649436e-12, 3.223793365945575e-13, -5.042185504727912e-14, 7.600684294735408e-15,
    -1.1055969477353862e-15, 1.5536319577362005e-16, -2.111421214358166e-17, 2.7779141127610464e-18};
const std::vector<double> kB1 = {
    0.7785762350182801, -0.009761097491361469, -0.00011058893876262371, -3.882564808877691e-06,
    -2.512236237870209e-07, -2.6314688468895196e-08, -3.835380385964237e-09, -5.589743462196584e-10,
    -1.8974958123505413e-11, 3.2526035830154884e-11, 1.4125807436613782e-11, 2.0356285441470896e-12,
    -7.198551776245908e-13, -4.0835511110921974e-13, -2.1015418427726643e-14, 4.272440016711951e-14,
    1.0420276984128802e-14, -3.8144030724370075e-15, -1.8803547755107825e-15, 3.3082023109209285e-16,
    2.96262899764595e-16, -3.209525921993424e-17, -4.6503053684893586e-17, 4.414348323071708e-18,
    7.517296310842105e-18};

const std::vector<double> kKA0 = {
    -0.5353273932339028, 0.3442898999246285, 0.0359799365153615, 0.001264615411446926, 2.286212103119452e-05,
    2.5347910790261494e-07, 1.904516377220209e-09, 1.0349695257633625e-11, 4.2598161427910826e-14,
    1.3744654358807508e-16};
const std::vector<double> kKB0 = {
    2.4403030820659555, -0.0314481013119645, 0.0015698838857300533, -0.00012849549581627802,
    1.39498137188765e-05, -1.8317555227191195e-06, 2.766813639445015e-07, -4.660489897687948e-08,
    8.574034017414225e-09, -1.6975345093890614e-09, 3.5773972814003283e-10, -7.957489244477396e-11,
    1.8559491149549264e-11, -4.514597883374519e-12, 1.1403405882073441e-12, -2.9800969231481784e-13,
    8.032890775068375e-14, -2.2275133267462965e-14, 6.340076476276646e-15, -1.848593377920907e-15,
    5.5120559994043335e-16, -1.6782311257549006e-16, 5.2103917776435543e-17, -1.6475805939842632e-17,
    5.3004337711773354e-18};
const std::vector<double> kKA1 = {
    1.5253002273389478, -0.3531559607765449, -0.12261118082265715, -0.006975723859639864,
    -0.0001730288957513052, -2.4334061415659684e-06, -2.213387630734726e-08, -1.4114883926335278e-10,
    -6.666901694199329e-13, -2.427449850519366e-15, -7.023863479386288e-18};
const std::vector<double> kKB1 = {
    2.7206261904844427, 0.10392373657681724, -0.002857816859622779, 0.00019521551847135162,
    -1.936197974166083e-05, 2.406484947837217e-06, -3.5019606030878126e-07, 5.7410841254500495e-08,
    -1.0345762465678097e-08, 2.0150497551970347e-09, -4.1903547593419254e-10, 9.218315187605315e-11,
    -2.129967838427791e-11, 5.139639673482343e-12, -1.2891739609498229e-12, 3.348419666052243e-13,
    -8.976705182010146e-14, 2.4771544242195988e-14, -7.0198370892147685e-15, 2.038703166239861e-15,
    -6.057047270643018e-16, 1.8380935752430455e-16, -5.689462849193648e-17, 1.7940510478863572e-17,
    -5.7567444820733025e-18};

Value cst(Builder& b, double v, const Value& like) { return ew::like_const(b, v, like); }

// sum' c_k T_k(y / 2) (c_0 halved) by Clenshaw's recurrence b_k = y b_{k+1} - b_{k+2} + c_k,
// highest order first, result (b_0 - b_2) / 2.
Value chebyshev(Builder& b, Value y, const std::vector<double>& c) {
  Value b0 = cst(b, c.back(), y), b1 = b.zeros(y.type), b2 = b1;
  for (size_t k = c.size() - 1; k-- > 0;) {
    b2 = b1;
    b1 = b0;
    b0 = b.add(b.sub(b.mul(y, b1), b2), cst(b, c[k], y));
  }
  return b.mul(cst(b, 0.5, y), b.sub(b0, b2));
}

enum class Kind { I0, I0e, I1, I1e, ModI0, ModI1 };
enum class KKind { K0, K0e, K1, K1e };

Value bessel(Builder& b, Value x0, Kind k) {
  Value x = b.abs(x0);
  const bool order1 = k == Kind::I1 || k == Kind::I1e || k == Kind::ModI1;
  const bool scaled = k == Kind::I0e || k == Kind::I1e;
  Value small_y = b.sub(b.div(x, cst(b, 2, x)), cst(b, 2, x));
  Value big_y = b.sub(b.div(cst(b, 32, x), x), cst(b, 2, x));
  Value sa = chebyshev(b, small_y, order1 ? kA1 : kA0);
  Value sb = chebyshev(b, big_y, order1 ? kB1 : kB0);
  Value e = b.exp(x);
  Value small, big = b.div(sb, b.sqrt(x));
  switch (k) {
    case Kind::I0e: small = sa; break;
    case Kind::I1e: small = b.mul(sa, x); break;
    case Kind::I0:
    case Kind::ModI0: small = b.mul(e, sa); break;
    case Kind::I1: small = b.mul(b.mul(e, x), sa); break;
    case Kind::ModI1: small = b.mul(b.mul(sa, x), e); break;
  }
  if (!scaled) big = b.div(b.mul(e, sb), b.sqrt(x));  // CPU's order: (e^x S) / sqrt(x)
  Value out = b.select(ew::le(b, x, cst(b, 8, x)), small, big);
  if (order1) out = b.select(ew::lt(b, x0, b.zeros(x0.type)), b.neg(out), out);
  return out;
}

// K0 / K1 (second kind) and their e^x-scaled forms, CPU's scheme:
//   x <= 2: K0 = S_KA0(x^2 - 2) - log(x/2) I0(x),   K1 = log(x/2) I1(x) + S_KA1(x^2 - 2) / x
//   x >  2: e^x sqrt(x) K0(x) = S_KB0(8/x - 2),      e^x sqrt(x) K1(x) = S_KB1(8/x - 2)
// inf at 0, NaN below. CPU's float32 K0 forms log(0.5 * x) in double (a double literal), so its
// small-x branch rounds once at the end; that is followed here too.
Value bessel_k(Builder& b, Value x, KKind k) {
  const bool order1 = k == KKind::K1 || k == KKind::K1e;
  const bool scaled = k == KKind::K0e || k == KKind::K1e;
  Value sa = chebyshev(b, b.sub(b.mul(x, x), cst(b, 2, x)), order1 ? kKA1 : kKA0);
  Value sb = chebyshev(b, b.sub(b.div(cst(b, 8, x), x), cst(b, 2, x)), order1 ? kKB1 : kKB0);
  Value small;
  if (order1) {
    small = b.add(b.mul(b.log(b.mul(cst(b, 0.5, x), x)), bessel(b, x, Kind::ModI1)), b.div(sa, x));
  } else if (k == KKind::K0 && x.elem() == ElemType::F32) {
    const ElemType D = ElemType::F64;
    Value xd = b.convert(x, D);
    Value lg = b.log(b.mul(cst(b, 0.5, xd), xd));
    small = b.convert(b.sub(b.convert(sa, D), b.mul(lg, b.convert(bessel(b, x, Kind::ModI0), D))), x.elem());
  } else {
    small = b.sub(sa, b.mul(b.log(b.mul(cst(b, 0.5, x), x)), bessel(b, x, Kind::ModI0)));
  }
  Value big = b.div(sb, b.sqrt(x));
  if (scaled) {
    small = b.mul(small, b.exp(x));
  } else {
    big = b.div(b.mul(b.exp(b.neg(x)), sb), b.sqrt(x));
  }
  Value out = b.select(ew::le(b, x, cst(b, 2, x)), small, big);
  Value zero = b.zeros(x.type);
  out = b.select(ew::lt(b, x, zero), cst(b, NAN, x), out);
  return b.select(ew::eq(b, x, zero), cst(b, INFINITY, x), out);
}

// The special_modified_bessel_* / scaled_* kernels exist for float32/float64 only on CPU, which
// raises NotImplementedError for float16/bfloat16: those calls go there.
ElemType f32_f64_only(const OpCall& c) {
  const ElemType t = ew::float_type(c);
  if (out_type(c).elem != t) throw Unsupported(c.name + ": CPU has no float16/bfloat16 kernel");
  return t;
}

std::vector<Value> lower_bessel_k(Builder& b, const OpCall& c, KKind k) {
  const ElemType t = f32_f64_only(c);
  Value x = ew::input_as(b, c, c.find("self") ? "self" : "x", t);  // the scaled forms name it x
  return {b.convert(bessel_k(b, x, k), out_type(c).elem)};
}

std::vector<Value> lower_bessel(Builder& b, const OpCall& c, Kind k) {
  const ElemType t = k == Kind::ModI0 || k == Kind::ModI1 ? f32_f64_only(c) : ew::float_type(c);
  Value x = ew::input_as(b, c, "self", t);
  return {b.convert(bessel(b, x, k), out_type(c).elem)};
}

}  // namespace

TPU_LOWER_ELEMENTWISE(i0) { return lower_bessel(b, c, Kind::I0); }
TPU_LOWER_ELEMENTWISE(special_i0e) { return lower_bessel(b, c, Kind::I0e); }
TPU_LOWER_ELEMENTWISE(special_i1) { return lower_bessel(b, c, Kind::I1); }
TPU_LOWER_ELEMENTWISE(special_i1e) { return lower_bessel(b, c, Kind::I1e); }
TPU_LOWER_ELEMENTWISE(special_modified_bessel_i0) { return lower_bessel(b, c, Kind::ModI0); }
TPU_LOWER_ELEMENTWISE(special_modified_bessel_i1) { return lower_bessel(b, c, Kind::ModI1); }
TPU_LOWER_ELEMENTWISE(special_modified_bessel_k0) { return lower_bessel_k(b, c, KKind::K0); }
TPU_LOWER_ELEMENTWISE(special_modified_bessel_k1) { return lower_bessel_k(b, c, KKind::K1); }
TPU_LOWER_ELEMENTWISE(special_scaled_modified_bessel_k0) { return lower_bessel_k(b, c, KKind::K0e); }
TPU_LOWER_ELEMENTWISE(special_scaled_modified_bessel_k1) { return lower_bessel_k(b, c, KKind::K1e); }

}  // namespace tpu::lowering
