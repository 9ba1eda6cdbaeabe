// Fused scaled-dot-product attention: _scaled_dot_product_fused_attention_overrideable and its
// backward, the ops PyTorch routes SDPA to when our _fused_sdp_choice answers "overrideable"
// (csrc/aten/ops_runtime.cc decides which calls qualify; everything else takes the math path).
//
// Semantics follow PyTorch's math path (_scaled_dot_product_attention_math):
//  - f16/bf16 inputs are computed in f32 (scores, softmax, products), the result rounded once;
//  - attn_bias is added (float) or masks (bool: false -> -inf); is_causal keeps j <= i
//    (top-left aligned, tril of ones(L, S), also when L != S);
//  - fully masked rows give zeros (_safe_softmax), and logsumexp -inf there;
//  - grouped-query attention without repeating K/V: Q's Hq heads are viewed as [Hkv, G] (q head
//    h uses kv head h / G, as repeat_interleave does), and each group's G*L query rows attend to
//    their kv head as one matrix: every product is a canonical batched matmul over N = B*Hkv
//    ([N, G*L, E] x [N, S, E]), and the backward's sum over each group is part of the dK/dV
//    contraction over G*L.
// The forward normalizes after the product with V, whose extra column of ones gives the row sums.
// Without dropout and bias the softmax shift is an upper bound of each row's maximum from the
// keys' per-dimension extremes (no pass over the scores; rows whose sums show it was too loose
// are recomputed with the exact maxima). Without dropout, scores over 4 MiB are not materialized
// at once but computed per block of query rows in a stablehlo.while (XLA:CPU would otherwise
// stream them through memory several times: 5 self-attentions of a small SD UNet at 32x32
// latents were ~80% of its compiled forward).
// Dropout draws Philox bits keyed by the generator state (seed, offset) this call received; the
// forward returns that state as philox_seed/philox_offset, so the backward regenerates the
// identical keep-mask from them.
#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "lowering.h"

namespace tpu::lowering {
namespace {

struct Dims {
  int64_t B = 1, Hq = 1, Hk = 1, G = 1, L = 0, S = 0, E = 0, Ev = 0;
  bool three_d = false;  // [H, L, E] inputs (no batch dimension)
  int64_t N() const { return B * Hk; }  // batch of the products
  int64_t M() const { return G * L; }   // query rows per kv head
  Shape scores() const { return {N(), M(), S}; }
  Shape rows() const { return {N(), M()}; }
};

Dims dims_of(const Value& q, const Value& k, const Value& v) {
  if (q.rank() != k.rank() || q.rank() != v.rank() || (q.rank() != 3 && q.rank() != 4))
    throw Unsupported("fused attention takes 3-d or 4-d query/key/value of equal rank");
  Dims d;
  d.three_d = q.rank() == 3;
  int64_t o = d.three_d ? 0 : 1;
  if (!d.three_d) {
    d.B = q.shape()[0];
    if (k.shape()[0] != d.B || v.shape()[0] != d.B) throw Unsupported("batch sizes differ");
  }
  d.Hq = q.shape()[o];
  d.Hk = k.shape()[o];
  d.L = q.shape()[o + 1];
  d.S = k.shape()[o + 1];
  d.E = q.shape()[o + 2];
  d.Ev = v.shape()[o + 2];
  if (v.shape()[o] != d.Hk || v.shape()[o + 1] != d.S || k.shape()[o + 2] != d.E)
    throw Unsupported("key/value shapes do not match");
  if (d.Hk == 0 || d.Hq % d.Hk != 0) throw Unsupported("query heads are not a multiple of key heads");
  d.G = d.Hq / d.Hk;
  return d;
}

// Compute type: f16/bf16 -> f32 (PyTorch's math path upcasts), else the input's own.
ElemType compute_type(const Value& q) {
  if (!shlo::is_float(q.elem())) throw Unsupported("fused attention needs floating-point inputs");
  return opmath(q.elem());
}

// [.., Hq, L, X] -> [B*Hk, G*L, X] in compute type t.
Value grouped_q(Builder& b, Value x, const Dims& d, int64_t X, ElemType t) {
  return b.reshape(b.convert(x, t), {d.N(), d.M(), X});
}
// [.., Hk, S, X] -> [B*Hk, S, X] in compute type t.
Value kv3(Builder& b, Value x, const Dims& d, int64_t X, ElemType t) {
  return b.reshape(b.convert(x, t), {d.N(), d.S, X});
}
// Broadcasts a per-row value [N, M] along S.
Value along_s(Builder& b, Value x, const Dims& d) { return b.broadcast_in_dim(x, d.scores(), {0, 1}); }

double scale_of(const OpCall& c, const Dims& d) {
  if (c.has("scale")) return c.double_("scale");
  return 1.0 / std::sqrt(static_cast<double>(d.E));
}

// The logical shape [.., Hq, L, S] the bias broadcasts against.
Shape bias_target(const Dims& d) {
  return d.three_d ? Shape{d.Hq, d.L, d.S} : Shape{d.B, d.Hq, d.L, d.S};
}

// The attn_bias broadcast to the scores' logical shape, viewed as [N, M, S] (float or bool).
std::optional<Value> bias_scores(Builder& b, const OpCall& c, const Dims& d) {
  if (!c.has("attn_bias")) return std::nullopt;
  Value bias = c.tensor("attn_bias");
  Shape target = bias_target(d);
  if (bias.rank() > static_cast<int64_t>(target.size()))
    throw Unsupported("attn_bias has more dims than the attention scores");
  for (int64_t i = 0; i < bias.rank(); ++i) {
    int64_t bd = bias.shape()[bias.rank() - 1 - i], td = target[target.size() - 1 - i];
    if (bd != 1 && bd != td) throw Unsupported("attn_bias does not broadcast to the scores");
  }
  return b.reshape(b.broadcast_to(bias, target), d.scores());
}

// In the blocked forward, head dims up to this get their scores as E broadcast multiply-adds
// instead of a dot: XLA fuses them with the consumer's exp (one pass over the scores fewer), and
// Eigen's batched product with a contraction of 4 is mostly packing (prototype, alternated: a
// [16, 1024, 1024] E=4 self-attention of the diffusers UNet 20.8 -> 17.6 ms process CPU; E=8 and
// 16 measured no better). The keys are transposed to [N, E, S] once, outside the loop: a
// transpose fused into the exp's loop reads them strided and was slower than the dot.
constexpr int64_t kElementwiseScoresMaxE = 4;

// qs [N, R, E] . keys over E -> [N, R, S], as sum_e qs[:, :, e] * kt[:, e, :] from the keys
// transposed, kt [N, E, S]: every term runs along the scores' contiguous S.
Value elementwise_scores(Builder& b, Value qs, Value kt) {
  const int64_t N = qs.shape()[0], R = qs.shape()[1], E = qs.shape()[2], S = kt.shape()[2];
  const Shape s3{N, R, S};
  auto term = [&](int64_t e) {
    Value qe = b.reshape(b.slice(qs, {0, 0, e}, {N, R, e + 1}), {N, R});
    Value ke = b.reshape(b.slice(kt, {0, e, 0}, {N, e + 1, S}), {N, S});
    return b.mul(b.broadcast_in_dim(qe, s3, {0, 1}), b.broadcast_in_dim(ke, s3, {0, 2}));
  };
  Value s = term(0);
  for (int64_t e = 1; e < E; ++e) s = b.add(s, term(e));
  return s;
}

// Scaled scores plus bias/causal mask of the query rows qr [N, R, E], rows r0.. (s64 scalar) of
// the M rows; `bias` is those rows' [N, R, S] bias. -> [N, R, S] in type t.
Value scores_rows(Builder& b, Value qr, Value k3, const std::optional<Value>& bias, bool causal, Value r0,
                  const Dims& d, ElemType t, double scale, const std::optional<Value>& kt = std::nullopt) {
  // The scale goes on the query rows ([N, R, E]) rather than on the [N, R, S] scores: one pass
  // over the scores fewer (PyTorch's math path scales the inputs as well).
  Value qs = b.mul(qr, b.constant_f(scale, t, qr.shape()));
  Value s = kt ? elementwise_scores(b, qs, *kt) : b.dot_general(qs, k3, {0}, {0}, {2}, {2}, t);
  const Shape s3 = s.shape();
  if (bias) {
    s = bias->elem() == ElemType::Pred ? b.select(*bias, s, b.lowest(t, s3)) : b.add(s, b.convert(*bias, t));
  }
  if (causal) {
    // Row m of the M = G*L rows is query position m % L (GQA groups are stacked as rows).
    const Shape rs{s3[1], d.S};
    Value row = b.add(b.iota(Type{ElemType::S64, rs}, 0), b.broadcast_in_dim(r0, rs, {}));
    if (d.G > 1) row = b.rem(row, b.constant_i(d.L, ElemType::S64, rs));
    Value keep = b.compare(Cmp::LE, b.iota(Type{ElemType::S64, rs}, 1), row);
    s = b.select(b.broadcast_in_dim(keep, s3, {1, 2}), s, b.lowest(t, s3));
  }
  return s;
}

// Scaled scores plus bias/causal mask, [N, M, S] in type t.
Value scores(Builder& b, const OpCall& c, Value q3, Value k3, const Dims& d, ElemType t, double scale) {
  return scores_rows(b, q3, k3, bias_scores(b, c, d), c.bool_("is_causal"), b.constant_i(0, ElemType::S64), d,
                     t, scale);
}

// Keep-mask (pred [N, M, S]) of dropout with probability p from generator state (u64[2]).
// The state is hashed into a fresh Philox key (splitmix64 of seed and offset) with counter 0: the
// runtime advances the generator by the output size only, and the mask (L*S per head) may need
// more counters than that, so reusing the shared counter space could overlap the next call's.
Value keep_mask(Builder& b, Value state, const Dims& d, double p) {
  const Shape s3 = d.scores();
  auto u64c = [&](uint64_t v) { return b.constant_i(static_cast<int64_t>(v), ElemType::U64, {}); };
  auto shr = [&](Value x, int n) {
    return b.binary("shift_right_logical", x, u64c(static_cast<uint64_t>(n)));
  };
  Value seed = b.reshape(b.slice(state, {0}, {1}), {});
  Value offset = b.reshape(b.slice(state, {1}, {2}), {});
  Value z = b.xor_(seed, b.mul(b.add(offset, u64c(1)), u64c(0x9E3779B97F4A7C15ULL)));
  z = b.mul(b.xor_(z, shr(z, 30)), u64c(0xBF58476D1CE4E5B9ULL));
  z = b.mul(b.xor_(z, shr(z, 27)), u64c(0x94D049BB133111EBULL));
  z = b.xor_(z, shr(z, 31));
  Value key_state = b.concatenate({b.reshape(z, {1}), b.constant_i(0, ElemType::U64, {1})}, 0);
  auto [ns, bits] = b.rng_bits(key_state, Type{ElemType::U32, s3});
  // Uniform [0, 1) in f32 from the top 23 bits, as the other random ops draw it.
  Value mant = b.binary("shift_right_logical", bits, b.constant_i(9, ElemType::U32, s3));
  Value one = b.or_(mant, b.constant_i(0x3F800000, ElemType::U32, s3));
  Value u = b.sub(b.bitcast(one, Type{ElemType::F32, s3}), b.constant_f(1.0, ElemType::F32, s3));
  return b.compare(Cmp::GE, u, b.constant_f(p, ElemType::F32, s3));
}

// Applies dropout's keep-mask and 1/(1-p) scaling to x (same shape as the mask).
Value apply_dropout(Builder& b, Value x, Value keep, double p) {
  const Shape& s = x.shape();
  Value scaled = b.mul(x, b.constant_f(1.0 / (1.0 - p), x.elem(), s));
  return b.select(keep, scaled, b.zeros(Type{x.elem(), s}));
}

Value state_from(Builder& b, Value seed, Value offset) {
  auto u = [&](Value x) { return b.reshape(b.bitcast(b.convert(x, ElemType::S64), Type{ElemType::U64, {}}), {1}); };
  return b.concatenate({u(seed), u(offset)}, 0);
}

double dropout_of(const OpCall& c) {
  double p = c.double_("dropout_p");
  if (p < 0 || p >= 1) throw Unsupported("dropout_p outside [0, 1)");
  return p;
}

struct Rows {
  Value out;  // [N, R, Ev]
  Value lse;  // [N, R]
  Value sum;  // [N, R]: the row sums of exp(s - shift) (0 for a fully masked row)
};

// Output and logsumexp from the product [N, R, Ev] of the unnormalized exp(s - shift) with V and
// the row sums: the product is divided by the row sums afterwards, as PyTorch's CPU flash kernel
// does (one pass over the [N, R, S] scores fewer than normalizing them). A row whose scores are
// all -inf (sum 0) gives zeros and lse -inf, like _safe_softmax.
Rows normalize(Builder& b, Value pv, Value sum, Value shift, ElemType t) {
  const Shape s2 = sum.shape();
  Value dead = b.compare(Cmp::EQ, sum, b.zeros(Type{t, s2}));
  Value inv = b.select(dead, b.zeros(Type{t, s2}), b.div(b.constant_f(1.0, t, s2), sum));
  Value out = b.mul(pv, b.broadcast_in_dim(inv, pv.shape(), {0, 1}));
  return {out, b.add(shift, b.log(sum)), sum};  // log(0) = -inf for dead rows
}

// The product of exp(s - shift) [N, R, S] with v1 = [V, 1] ([N, S, Ev + 1]): the last column of
// the product is the row sums, so no separate pass over the scores sums them.
Rows product_with_sums(Builder& b, Value e, Value v1, Value shift, ElemType t) {
  Value pv1 = b.dot_general(e, v1, {0}, {0}, {2}, {1}, t);  // [N, R, Ev + 1]
  const Shape s = pv1.shape();
  const int64_t ev = s[2] - 1;
  Value pv = b.slice(pv1, {0, 0, 0}, {s[0], s[1], ev});
  Value sum = b.reshape(b.slice(pv1, {0, 0, ev}, s), {s[0], s[1]});
  return normalize(b, pv, sum, shift, t);
}

// V with a column of ones appended, [N, S, Ev + 1] (see product_with_sums).
Value with_ones(Builder& b, Value v3, ElemType t) {
  const Shape& s = v3.shape();
  return b.concatenate({v3, b.constant_f(1.0, t, {s[0], s[1], 1})}, 2);
}

// Softmax attention of the query rows qr [N, R, E] (rows r0.. of M; `bias` their [N, R, S] bias)
// with dropout's keep-mask `keep` [N, R, S] (mask and 1/(1-p) are per element, so they commute
// with the per-row division; the row sums are taken before dropout).
Rows attend_dropout(Builder& b, Value qr, Value k3, Value v3, const std::optional<Value>& bias, bool causal,
                    Value r0, const Dims& d, ElemType t, double scale, Value keep, double p) {
  Value s = scores_rows(b, qr, k3, bias, causal, r0, d, t, scale);
  const Shape s3 = s.shape(), s2{s3[0], s3[1]};
  Value m = b.reduce(s, b.lowest(t), {2}, "maximum");
  Value m_safe = b.select(b.compare(Cmp::EQ, m, b.lowest(t, s2)), b.zeros(Type{t, s2}), m);
  Value e = b.exp(b.sub(s, b.broadcast_in_dim(m_safe, s3, {0, 1})));
  Value sum = b.reduce(e, b.zeros(Type{t, {}}), {2}, "add");
  Value pv = b.dot_general(apply_dropout(b, e, keep, p), v3, {0}, {0}, {2}, {1}, t);  // [N, R, Ev]
  return normalize(b, pv, sum, m_safe, t);
}

// Softmax attention of the query rows qr without dropout, shifted by the exact row maxima.
Rows attend_exact(Builder& b, Value qr, Value k3, Value v1, const std::optional<Value>& bias, bool causal,
                  Value r0, const Dims& d, ElemType t, double scale) {
  Value s = scores_rows(b, qr, k3, bias, causal, r0, d, t, scale);
  const Shape s3 = s.shape(), s2{s3[0], s3[1]};
  Value m = b.reduce(s, b.lowest(t), {2}, "maximum");
  Value m_safe = b.select(b.compare(Cmp::EQ, m, b.lowest(t, s2)), b.zeros(Type{t, s2}), m);
  return product_with_sums(b, b.exp(b.sub(s, b.broadcast_in_dim(m_safe, s3, {0, 1}))), v1, m_safe, t);
}

// Per-dimension extremes of the keys, [N, E] each: the shift bound of attend_bounded.
struct KeyRange {
  Value max, min;
};
KeyRange key_range(Builder& b, Value k3, ElemType t) {
  return {b.reduce(k3, b.lowest(t), {1}, "maximum"), b.reduce(k3, b.highest(t), {1}, "minimum")};
}

// A row sum of exp(s - bound) below this means the bound may sit so far above the row's maximum
// that its terms lost precision (the largest term is at least sum / S, normal in f32 for any S
// below e^37): such rows are computed again with the exact maxima.
constexpr double kMinBoundedSum = 1.9287498479639178e-22;  // e^-50

// Without a bias (causal allowed), the shift needs no pass over the scores: the per-row bound
// sum_e max(q_e * max_j k_je, q_e * min_j k_je) >= max_j q.k_j (exp(s - bound) <= 1, no overflow;
// softmax is shift-invariant). If any row's sum shows the bound was too loose, the rows are
// computed again with the exact maxima (a stablehlo.while of 0 or 1 iteration).
Rows attend_bounded(Builder& b, Value qr, Value k3, Value v1, const KeyRange& kr, bool causal, Value r0,
                    const Dims& d, ElemType t, double scale, const std::optional<Value>& kt) {
  Value s = scores_rows(b, qr, k3, std::nullopt, causal, r0, d, t, scale, kt);
  const Shape s3 = s.shape(), q3 = qr.shape();
  Value qs = b.mul(qr, b.constant_f(scale, t, q3));
  auto per_row = [&](Value k) { return b.mul(qs, b.broadcast_in_dim(k, q3, {0, 2})); };
  Value bound = b.reduce(b.max(per_row(kr.max), per_row(kr.min)), b.zeros(Type{t, {}}), {2}, "add");
  Value e = b.exp(b.sub(s, b.broadcast_in_dim(bound, s3, {0, 1})));
  Rows r = product_with_sums(b, e, v1, bound, t);
  Value smallest = b.reduce(r.sum, b.highest(t), {0, 1}, "minimum");
  Value redo = b.compare(Cmp::LT, smallest, b.constant_f(kMinBoundedSum, t));
  std::vector<Value> st = b.while_loop(
      {redo, r.out, r.lse, r.sum, qr, k3, v1, r0}, [&](const std::vector<Value>& x) { return x[0]; },
      [&](const std::vector<Value>& x) {
        Rows exact = attend_exact(b, x[4], x[5], x[6], std::nullopt, causal, x[7], d, t, scale);
        std::vector<Value> next = x;
        next[0] = b.constant_i(0, ElemType::Pred);
        next[1] = exact.out;
        next[2] = exact.lse;
        next[3] = exact.sum;
        return next;
      });
  return {st[1], st[2], st[3]};
}

// Forward rows without dropout: the bounded shift when there is no bias, else the exact maxima.
// `kt`: the keys transposed [N, E, S] for elementwise scores (bounded shift only).
Rows attend_rows(Builder& b, Value qr, Value k3, Value v1, const std::optional<Value>& bias,
                 const std::optional<KeyRange>& kr, bool causal, Value r0, const Dims& d, ElemType t, double scale,
                 const std::optional<Value>& kt = std::nullopt) {
  if (kr && !bias) return attend_bounded(b, qr, k3, v1, *kr, causal, r0, d, t, scale, kt);
  return attend_exact(b, qr, k3, v1, bias, causal, r0, d, t, scale);
}

// Scores of one block of query rows stay near this size in the blocked forward (alternated A/B on
// the UNet's [16, 1024, 1024] scores: 4 MiB blocks beat 1 MiB ones, whose many small products
// and loop steps cost more than the cache misses they save).
constexpr int64_t kBlockBytes = 4 << 20;
// Above this size the [N, M, S] scores are not materialized at once: XLA:CPU would write and
// re-read them from memory several times (max, exp, product), page-faulting fresh buffers.
constexpr int64_t kBlockedAboveBytes = 4 << 20;

// Query rows per block for the forward, or 0 when the scores are small enough for one pass.
int64_t block_rows(const Dims& d, ElemType t) {
  const int64_t row_bytes = d.N() * d.S * (shlo::bit_width(t) / 8);
  if (row_bytes * d.M() <= kBlockedAboveBytes) return 0;
  const int64_t rows = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(1, row_bytes));
  return rows * 2 <= d.M() ? rows : 0;
}

// The forward over blocks of R query rows in a stablehlo.while (a static tail block for M % R
// rows): each block's scores live only inside the loop body.
Rows attend_blocked(Builder& b, Value q3, Value k3, Value v1, const std::optional<Value>& bias3,
                    const std::optional<KeyRange>& kr, bool causal, const Dims& d, ElemType t, double scale,
                    int64_t R) {
  const ElemType I = ElemType::S64;
  const int64_t nb = d.M() / R, tail_start = nb * R;
  std::vector<Value> init{b.constant_i(0, I), b.zeros(Type{t, {d.N(), d.M(), d.Ev}}), b.zeros(Type{t, d.rows()}),
                          q3, k3, v1};
  // Optional state after the fixed six: the bias, the key range.
  const size_t bias_at = init.size();
  if (bias3) init.push_back(*bias3);
  const size_t kr_at = init.size();
  if (kr) {
    init.push_back(kr->max);
    init.push_back(kr->min);
  }
  // The keys transposed for elementwise scores: loop state, so they are materialized once.
  const size_t kt_at = init.size();
  const bool small_e = kr && !bias3 && d.E >= 1 && d.E <= kElementwiseScoresMaxE;
  if (small_e) init.push_back(b.transpose(k3, {0, 2, 1}));
  std::vector<Value> st = b.while_loop(
      init, [&](const std::vector<Value>& s) { return b.compare(Cmp::LT, s[0], b.constant_i(nb, I)); },
      [&](const std::vector<Value>& s) {
        Value z = b.constant_i(0, I), r0 = b.mul(s[0], b.constant_i(R, I));
        std::optional<Value> bias;
        if (bias3) bias = b.dynamic_slice(s[bias_at], {z, r0, z}, {d.N(), R, d.S});
        std::optional<KeyRange> krs;
        if (kr) krs = KeyRange{s[kr_at], s[kr_at + 1]};
        std::optional<Value> kt;
        if (small_e) kt = s[kt_at];
        Rows r = attend_rows(b, b.dynamic_slice(s[3], {z, r0, z}, {d.N(), R, d.E}), s[4], s[5], bias, krs, causal,
                             r0, d, t, scale, kt);
        std::vector<Value> next = s;
        next[0] = b.add(s[0], b.constant_i(1, I));
        next[1] = b.dynamic_update_slice(s[1], r.out, {z, r0, z});
        next[2] = b.dynamic_update_slice(s[2], r.lse, {z, r0});
        return next;
      });
  Rows all{st[1], st[2], st[2]};
  if (tail_start < d.M()) {
    std::optional<Value> bias;
    if (bias3) bias = b.slice(*bias3, {0, tail_start, 0}, {d.N(), d.M(), d.S});
    Value z = b.constant_i(0, I), r0 = b.constant_i(tail_start, I);
    Rows r = attend_rows(b, b.slice(q3, {0, tail_start, 0}, {d.N(), d.M(), d.E}), k3, v1, bias, kr, causal, r0, d,
                         t, scale);
    all.out = b.dynamic_update_slice(all.out, r.out, {z, r0, z});
    all.lse = b.dynamic_update_slice(all.lse, r.lse, {z, r0});
  }
  return all;
}

// Gradients of one block of query rows qr [N, R, E] (rows r0.. of M) without dropout or float
// bias: P = exp(s - lse) rebuilt from the saved logsumexp (0 on fully masked rows, lse -inf),
// dS = P * (dP - D) with D = rowsum(dO * O) (= rowsum(P * dP), FlashAttention's identity).
// -> dQ rows [N, R, E] and the block's contributions to dK [N, S, E] and dV [N, S, Ev].
struct BlockGrads {
  Value dq, dk, dv;
};
BlockGrads grads_rows(Builder& b, Value qr, Value k3, Value v3, Value dout, Value lse, Value D,
                      const std::optional<Value>& mask, bool causal, Value r0, const Dims& d, ElemType t,
                      double scale) {
  Value s = scores_rows(b, qr, k3, mask, causal, r0, d, t, scale);
  const Shape s3 = s.shape(), s2{s3[0], s3[1]};
  Value dead = b.compare(Cmp::EQ, lse, b.lowest(t, s2));
  Value lse_safe = b.select(dead, b.zeros(Type{t, s2}), lse);
  Value probs = b.exp(b.sub(s, b.broadcast_in_dim(lse_safe, s3, {0, 1})));
  probs = b.select(b.broadcast_in_dim(dead, s3, {0, 1}), b.zeros(Type{t, s3}), probs);
  Value dv = b.dot_general(probs, dout, {0}, {0}, {1}, {1}, t);  // [N, S, Ev]
  Value dp = b.dot_general(dout, v3, {0}, {0}, {2}, {2}, t);     // [N, R, S]
  Value dss = b.mul(b.mul(probs, b.sub(dp, b.broadcast_in_dim(D, s3, {0, 1}))), b.constant_f(scale, t, s3));
  Value dq = b.dot_general(dss, k3, {0}, {0}, {2}, {1}, t);  // [N, R, E]
  Value dk = b.dot_general(dss, qr, {0}, {0}, {1}, {1}, t);  // [N, S, E]
  return {dq, dk, dv};
}

// The backward over blocks of R query rows in a stablehlo.while (a static tail block for M % R
// rows), dK and dV accumulated in the loop state: no [N, M, S] tensor is materialized.
std::vector<Value> grads_blocked(Builder& b, Value q3, Value k3, Value v3, Value dout, Value lse, Value D,
                                 const std::optional<Value>& mask3, bool causal, const Dims& d, ElemType t,
                                 double scale, int64_t R) {
  const ElemType I = ElemType::S64;
  const int64_t nb = d.M() / R, tail_start = nb * R;
  std::vector<Value> init{b.constant_i(0, I),
                          b.zeros(Type{t, {d.N(), d.M(), d.E}}),
                          b.zeros(Type{t, {d.N(), d.S, d.E}}),
                          b.zeros(Type{t, {d.N(), d.S, d.Ev}}),
                          q3, k3, v3, dout, lse, D};
  if (mask3) init.push_back(*mask3);
  std::vector<Value> st = b.while_loop(
      init, [&](const std::vector<Value>& s) { return b.compare(Cmp::LT, s[0], b.constant_i(nb, I)); },
      [&](const std::vector<Value>& s) {
        Value z = b.constant_i(0, I), r0 = b.mul(s[0], b.constant_i(R, I));
        std::optional<Value> mask;
        if (mask3) mask = b.dynamic_slice(s[10], {z, r0, z}, {d.N(), R, d.S});
        auto rows = [&](Value x, int64_t w) { return b.dynamic_slice(x, {z, r0, z}, {d.N(), R, w}); };
        Value lse_r = b.dynamic_slice(s[8], {z, r0}, {d.N(), R}), D_r = b.dynamic_slice(s[9], {z, r0}, {d.N(), R});
        BlockGrads g = grads_rows(b, rows(s[4], d.E), s[5], s[6], rows(s[7], d.Ev), lse_r, D_r, mask, causal, r0, d,
                                  t, scale);
        std::vector<Value> next = s;
        next[0] = b.add(s[0], b.constant_i(1, I));
        next[1] = b.dynamic_update_slice(s[1], g.dq, {z, r0, z});
        next[2] = b.add(s[2], g.dk);
        next[3] = b.add(s[3], g.dv);
        return next;
      });
  Value dq = st[1], dk = st[2], dv = st[3];
  if (tail_start < d.M()) {
    auto rows = [&](Value x, int64_t w) { return b.slice(x, {0, tail_start, 0}, {d.N(), d.M(), w}); };
    std::optional<Value> mask;
    if (mask3) mask = rows(*mask3, d.S);
    BlockGrads g = grads_rows(b, rows(q3, d.E), k3, v3, rows(dout, d.Ev), b.slice(lse, {0, tail_start}, d.rows()),
                              b.slice(D, {0, tail_start}, d.rows()), mask, causal, b.constant_i(tail_start, I), d, t,
                              scale);
    dq = b.dynamic_update_slice(dq, g.dq, {b.constant_i(0, I), b.constant_i(tail_start, I), b.constant_i(0, I)});
    dk = b.add(dk, g.dk);
    dv = b.add(dv, g.dv);
  }
  return {dq, dk, dv};
}

}  // namespace

// -> (output, logsumexp, cum_seq_q, cum_seq_k, philox_seed, philox_offset, debug_attn_mask);
// the SymInt returns max_q/max_k come from the meta function.
TPU_LOWER_WITH(_scaled_dot_product_fused_attention_overrideable, .random = true,
               .draws_nothing_when = {{"dropout_p", 0.0}}) {
  if (c.bool_("return_debug_mask")) throw Unsupported("return_debug_mask");
  Value q = c.tensor("query"), k = c.tensor("key"), v = c.tensor("value");
  Dims d = dims_of(q, k, v);
  ElemType t = compute_type(q);
  double p = dropout_of(c);
  Value q3 = grouped_q(b, q, d, d.E, t), k3 = kv3(b, k, d, d.E, t), v3 = kv3(b, v, d, d.Ev, t);
  const std::optional<Value> bias3 = bias_scores(b, c, d);
  const bool causal = c.bool_("is_causal");
  const double scale = scale_of(c, d);
  Value seed_out = b.constant_i(0, ElemType::S64), offset_out = b.constant_i(0, ElemType::S64);
  Rows r;
  if (p > 0) {
    Value state = c.tensor("generator");
    r = attend_dropout(b, q3, k3, v3, bias3, causal, b.constant_i(0, ElemType::S64), d, t, scale,
                       keep_mask(b, state, d, p), p);
    seed_out = b.bitcast(b.reshape(b.slice(state, {0}, {1}), {}), Type{ElemType::S64, {}});
    offset_out = b.bitcast(b.reshape(b.slice(state, {1}, {2}), {}), Type{ElemType::S64, {}});
  } else {
    Value v1 = with_ones(b, v3, t);
    std::optional<KeyRange> kr;
    if (!bias3) kr = key_range(b, k3, t);
    if (int64_t rows = block_rows(d, t)) {
      r = attend_blocked(b, q3, k3, v1, bias3, kr, causal, d, t, scale, rows);
    } else {
      r = attend_rows(b, q3, k3, v1, bias3, kr, causal, b.constant_i(0, ElemType::S64), d, t, scale);
    }
  }
  Value out = r.out, lse = r.lse;
  Value none = b.zeros(Type{ElemType::S64, {}});  // undefined outputs (cum_seq_*, debug mask)
  return {out, b.convert(lse, ElemType::F32), none, none, seed_out, offset_out, none};
}

// Whether the backward must return the float attn_bias's gradient (a bool mask has none; an
// unrequested one is an undefined output, not of the bias's rank).
static bool bias_grad_wanted(const OpCall& c) {
  if (!c.has("attn_bias") || c.tensor("attn_bias").elem() == ElemType::Pred) return false;
  const Arg* m = c.find("grad_input_mask");
  if (m && m->kind == Arg::Kind::IntList && m->ints.size() == 4 && m->ints[3] == 0) return false;
  return out_type(c, 3).shape.size() == static_cast<size_t>(c.tensor("attn_bias").rank());
}

// -> (grad_query, grad_key, grad_value, grad_attn_bias), from the saved logsumexp.
TPU_LOWER(_scaled_dot_product_fused_attention_overrideable_backward) {
  Value q = c.tensor("query"), k = c.tensor("key"), v = c.tensor("value");
  Dims d = dims_of(q, k, v);
  ElemType t = compute_type(q);
  double p = dropout_of(c);
  double scale = scale_of(c, d);
  const Shape s3 = d.scores(), s2 = d.rows();
  Value q3 = grouped_q(b, q, d, d.E, t);
  Value k3 = kv3(b, k, d, d.E, t), v3 = kv3(b, v, d, d.Ev, t);
  Value dout = grouped_q(b, c.tensor("grad_out"), d, d.Ev, t);
  if (int64_t rows = p > 0 || bias_grad_wanted(c) ? 0 : block_rows(d, t)) {
    // Without dropout or a bias gradient (which is dS itself), large scores take the loop.
    Value lse = b.reshape(b.convert(c.tensor("logsumexp"), t), s2);
    Value D = b.reduce(b.mul(dout, grouped_q(b, c.tensor("out"), d, d.Ev, t)), b.zeros(Type{t, {}}), {2}, "add");
    std::vector<Value> g = grads_blocked(b, q3, k3, v3, dout, lse, D, bias_scores(b, c, d), c.bool_("is_causal"), d,
                                         t, scale, rows);
    return {g[0], g[1], g[2], b.zeros(Type{t, out_type(c, 3).shape})};
  }
  Value s = scores(b, c, q3, k3, d, t, scale);

  // P = exp(s - lse); rows whose lse is -inf were fully masked: P = 0 there.
  Value lse = b.reshape(b.convert(c.tensor("logsumexp"), t), s2);
  Value dead = b.compare(Cmp::EQ, lse, b.lowest(t, s2));
  Value lse_safe = b.select(dead, b.zeros(Type{t, s2}), lse);
  Value probs = b.exp(b.sub(s, along_s(b, lse_safe, d)));
  probs = b.select(along_s(b, dead, d), b.zeros(Type{t, s3}), probs);

  Value dropped = probs;
  Value keep;
  if (p > 0) {
    Value state = state_from(b, c.tensor("philox_seed"), c.tensor("philox_offset"));
    keep = keep_mask(b, state, d, p);
    dropped = apply_dropout(b, probs, keep, p);
  }
  // dV = P_drop^T dO, contracting the group's G*L rows (the sum over the group).
  Value dv = b.dot_general(dropped, dout, {0}, {0}, {1}, {1}, t);  // [N, S, Ev]
  Value dp = b.dot_general(dout, v3, {0}, {0}, {2}, {2}, t);       // [N, M, S]
  if (p > 0) dp = apply_dropout(b, dp, keep, p);
  // Softmax backward: dS = P * (dP - rowsum(P * dP)).
  Value rows = b.reduce(b.mul(probs, dp), b.zeros(Type{t, {}}), {2}, "add");
  Value ds = b.mul(probs, b.sub(dp, along_s(b, rows, d)));
  Value dss = b.mul(ds, b.constant_f(scale, t, s3));
  Value dq = b.dot_general(dss, k3, {0}, {0}, {2}, {1}, t);  // [N, M, E]
  Value dk = b.dot_general(dss, q3, {0}, {0}, {1}, {1}, t);  // [N, S, E]

  // (A bool mask has no gradient; an undefined grad_attn_bias output ignores the value.)
  Value dbias = b.zeros(Type{t, out_type(c, 3).shape});
  if (bias_grad_wanted(c)) {
    // The bias gradient is dS summed over the dims the bias was broadcast along.
    Shape target = bias_target(d);
    const Shape bs = c.tensor("attn_bias").shape();
    Value full = b.reshape(ds, target);
    int64_t lead = static_cast<int64_t>(target.size()) - static_cast<int64_t>(bs.size());
    std::vector<int64_t> red;
    for (int64_t i = 0; i < static_cast<int64_t>(target.size()); ++i) {
      if (i < lead || (bs[i - lead] == 1 && target[i] != 1)) red.push_back(i);
    }
    dbias = red.empty() ? full : b.reduce(full, b.zeros(Type{t, {}}), red, "add");
    dbias = b.reshape(dbias, bs);
  }
  return {dq, dk, dv, dbias};
}

}  // namespace tpu::lowering
