// EmbeddingBag: _embedding_bag / _embedding_bag_forward_only (sum, mean, max; offsets with or
// without the trailing offset; per_sample_weights; padding_idx) and its dense and
// per-sample-weight gradients. The auxiliary outputs follow the layout PyTorch's meta function
// gives non-CPU devices (as CUDA): offset2bag [N] (the bag of each index), bag_size [offsets.size(0)] (non-padding indices per bag), max_indices
// [num_bags, D] in max mode (the weight row holding each maximum, -1 for an empty bag).
// Only these lowerings read them back. Also embedding_renorm_ (nn.Embedding's max_norm).
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "lowering.h"
#include "shape_util.h"

namespace tpu::lowering {
namespace {

constexpr ElemType I64 = ElemType::S64;
enum Mode : int64_t { kSum = 0, kMean = 1, kMax = 2 };

// Inclusive prefix sum of a 1-D s64 vector (log2(n) shifted adds).
Value prefix_sum(Builder& b, Value x) {
  const int64_t n = x.shape()[0];
  for (int64_t s = 1; s < n; s *= 2)
    x = b.add(x, b.pad(b.slice(x, {0}, {n - s}), b.constant_i(0, I64), {s}, {0}));
  return x;
}

// Rows of `table` ([R, D]) at s64 `rows` ([M]) -> [M, D].
Value gather_rows(Builder& b, Value table, Value rows) {
  const int64_t M = rows.shape()[0], D = table.shape()[1];
  return b.gather(table, b.reshape(rows, {M, 1}), {1}, {0}, {0}, 1, {1, D}, {M, D});
}

// `into` ([R, D]) combined with `updates` ([M, D]) at s64 `rows` ([M]).
Value scatter_rows(Builder& b, Value into, Value rows, Value updates, const char* combine) {
  return b.scatter(into, b.reshape(rows, {rows.shape()[0], 1}), updates, {1}, {0}, {0}, 1, combine);
}

// Elements of the 1-D `v` at s64 `at` (any shape) -> at's shape.
Value gather_elems(Builder& b, Value v, Value at) {
  const Shape s = at.shape();
  const int64_t M = at.type.numel();
  return b.reshape(b.gather(v, b.reshape(at, {M, 1}), {}, {0}, {0}, 1, {1}, {M}), s);
}

Value bcast_rows(Builder& b, Value v, int64_t D) {  // [M] -> [M, D]
  return b.broadcast_in_dim(v, {v.shape()[0], D}, {0});
}

struct Bags {
  int64_t N, B;   // indices, bags
  Value idx;      // [N] s64
  Value bag;      // [N] s64: the bag of each index, B after the last bag
  Value counted;  // [N] pred: inside a bag and not padding_idx
  Value size;     // [B] s64: counted indices per bag
};

Bags bags_of(Builder& b, const OpCall& c, int64_t num_weights) {
  Value indices = c.tensor("indices"), offsets = c.tensor("offsets");
  if (indices.rank() != 1 || offsets.rank() != 1)
    throw Unsupported("embedding_bag: 1-D indices and offsets expected");  // 2-D input is reshaped by F.embedding_bag
  Bags g;
  g.N = indices.shape()[0];
  const int64_t n_off = offsets.shape()[0];
  const bool last = c.bool_("include_last_offset");
  g.B = last ? n_off - 1 : n_off;
  g.idx = b.convert(indices, I64);
  Value off = b.convert(offsets, I64);
  if (b.checking()) {
    check(b, b.or_(b.compare(Cmp::LT, g.idx, b.constant_i(0, I64, {g.N})),
                   b.compare(Cmp::GE, g.idx, b.constant_i(num_weights, I64, {g.N}))),
          CheckKind::Runtime,
          "Index of input takes a value which is not in the valid range [0, " + std::to_string(num_weights) + ")");
    if (n_off > 0)
      check(b, b.compare(Cmp::NE, b.slice(off, {0}, {1}), b.constant_i(0, I64, {1})), CheckKind::Runtime,
            "offsets[0] has to be 0, i.e., the first sequence in the mini-batch has to start from position 0.");
  }
  // A 1 at the start of every bag after the first; the prefix sum numbers the bags.
  if (g.B > 1 && g.N > 0) {
    Value starts = b.slice(off, {1}, {g.B});
    Value in = b.compare(Cmp::LT, starts, b.constant_i(g.N, I64, {g.B - 1}));
    Value at = b.select(in, starts, b.constant_i(0, I64, {g.B - 1}));
    Value ones = b.convert(in, I64);
    Value marks = b.scatter(b.zeros(Type{I64, {g.N}}), b.reshape(at, {g.B - 1, 1}), ones, {}, {0}, {0}, 1, "add");
    g.bag = prefix_sum(b, marks);
  } else {
    g.bag = b.zeros(Type{I64, {g.N}});
  }
  // The last bag runs to the end of indices, also with include_last_offset (CPU does not read
  // the trailing offset); without bags no index is inside one.
  Value inside = b.constant_i(g.B > 0 ? 1 : 0, ElemType::Pred, {g.N});
  g.bag = b.select(inside, g.bag, b.constant_i(g.B, I64, {g.N}));
  g.counted = inside;
  const int64_t pad = c.int_("padding_idx", -1);
  if (pad >= 0) g.counted = b.and_(g.counted, b.compare(Cmp::NE, g.idx, b.constant_i(pad, I64, {g.N})));
  Value safe_bag = b.select(g.counted, g.bag, b.constant_i(0, I64, {g.N}));
  g.size = g.B == 0 ? b.zeros(Type{I64, {0}})
                    : b.scatter(b.zeros(Type{I64, {g.B}}), b.reshape(safe_bag, {g.N, 1}), b.convert(g.counted, I64),
                                {}, {0}, {0}, 1, "add");
  return g;
}

}  // namespace

static std::vector<Value> lower_embedding_bag(Builder& b, const OpCall& c) {
  Value weight = c.tensor("weight");
  if (weight.rank() != 2) throw Unsupported("embedding_bag: 2-D weight expected");
  const int64_t R = weight.shape()[0], D = weight.shape()[1];
  const int64_t mode = c.int_("mode");
  if (mode < kSum || mode > kMax) throw Unsupported("embedding_bag: mode");
  Bags g = bags_of(b, c, R);
  const ElemType t = opmath(weight.elem());
  const Type& out = out_type(c, 0);
  if (g.N == 0 || g.B == 0 || D == 0 || R == 0) {
    std::vector<Value> r{b.zeros(out)};
    for (size_t i = 1; i < 4; ++i) r.push_back(b.zeros(out_type(c, i)));
    return r;
  }
  Value safe_idx = b.select(g.counted, g.idx, b.constant_i(0, I64, {g.N}));
  Value safe_bag = b.select(g.counted, g.bag, b.constant_i(0, I64, {g.N}));
  Value rows = gather_rows(b, b.convert(weight, t), safe_idx);  // [N, D]
  Value counted = bcast_rows(b, g.counted, D);
  Value result, max_indices = b.zeros(out_type(c, 3));
  if (mode == kMax) {
    Value neg = b.lowest(t, {g.N, D});
    Value m = scatter_rows(b, b.lowest(t, {g.B, D}), safe_bag, b.select(counted, rows, neg), "maximum");
    Value empty = bcast_rows(b, b.compare(Cmp::EQ, g.size, b.zeros(Type{I64, {g.B}})), D);
    result = b.select(empty, b.zeros(Type{t, {g.B, D}}), m);
    // The first index of each bag holding the maximum (CPU keeps the first on ties).
    Value is_max = b.and_(counted, b.compare(Cmp::EQ, rows, gather_rows(b, m, safe_bag)));
    Value pos = b.iota(Type{I64, {g.N, D}}, 0);
    Value none = b.constant_i(g.N, I64, {g.N, D});
    Value first = scatter_rows(b, b.constant_i(g.N, I64, {g.B, D}), safe_bag, b.select(is_max, pos, none), "minimum");
    Value found = b.compare(Cmp::LT, first, b.constant_i(g.N, I64, {g.B, D}));
    Value at = b.select(found, first, b.zeros(Type{I64, {g.B, D}}));
    Value row_of = gather_elems(b, safe_idx, at);
    max_indices = b.convert(b.select(found, row_of, b.constant_i(-1, I64, {g.B, D})), out_type(c, 3).elem);
  } else {
    Value w = b.convert(counted, t);
    if (c.has("per_sample_weights"))
      w = b.mul(w, bcast_rows(b, b.convert(c.tensor("per_sample_weights"), t), D));
    result = scatter_rows(b, b.zeros(Type{t, {g.B, D}}), safe_bag, b.mul(rows, w), "add");
    if (mode == kMean) {
      Value n = b.convert(b.max(g.size, b.constant_i(1, I64, {g.B})), t);
      result = b.div(result, bcast_rows(b, n, D));
    }
  }
  // bag_size has one entry per offset (the trailing offset's is 0).
  Value size = g.size;
  const int64_t n_size = out_type(c, 2).numel();
  if (n_size > g.B) size = b.pad(size, b.constant_i(0, I64), {0}, {n_size - g.B});
  return {b.convert(result, out.elem), b.convert(g.bag, out_type(c, 1).elem), fit(b, b.convert(size, out_type(c, 2).elem), out_type(c, 2)),
          max_indices};
}

TPU_LOWER_CHECKED(_embedding_bag) { return lower_embedding_bag(b, c); }
TPU_LOWER_CHECKED(_embedding_bag_forward_only) { return lower_embedding_bag(b, c); }

// d weight: every counted index adds its bag's gradient (times its per-sample weight, / the bag
// size for mean, / the index's count with scale_grad_by_freq); max: each (bag, feature)'s
// gradient goes to the row that held the maximum.
static std::vector<Value> lower_dense_backward(Builder& b, const OpCall& c) {
  const Type& o = out_type(c);
  const ElemType t = opmath(o.elem);
  Value grad = b.convert(c.tensor("grad"), t);
  const int64_t R = o.shape[0], D = o.shape[1], B = grad.shape()[0];
  Value idx = b.convert(c.tensor("indices"), I64), bag = b.convert(c.tensor("offset2bag"), I64);
  const int64_t N = idx.shape()[0];
  const int64_t mode = c.int_("mode"), pad = c.int_("padding_idx", -1);
  if (N == 0 || B == 0 || R == 0 || D == 0) return {b.zeros(o)};
  Value counted = b.and_(b.compare(Cmp::LT, bag, b.constant_i(B, I64, {N})), b.compare(Cmp::GE, bag, b.constant_i(0, I64, {N})));
  if (pad >= 0) counted = b.and_(counted, b.compare(Cmp::NE, idx, b.constant_i(pad, I64, {N})));
  Value safe_idx = b.select(counted, idx, b.constant_i(0, I64, {N}));
  Value freq;  // [N] occurrences of each counted index
  const bool by_freq = c.bool_("scale_grad_by_freq");
  if (by_freq) {
    Value counts = b.scatter(b.zeros(Type{t, {R}}), b.reshape(safe_idx, {N, 1}), b.convert(counted, t), {}, {0}, {0}, 1, "add");
    freq = gather_elems(b, counts, safe_idx);
  }
  if (mode == kMax) {
    Value mi = b.convert(c.tensor("maximum_indices"), I64);  // [B, D], -1 for an empty bag
    Value ok = b.compare(Cmp::GE, mi, b.zeros(Type{I64, {B, D}}));
    Value row = b.select(ok, mi, b.zeros(Type{I64, {B, D}}));
    Value g = b.select(ok, grad, b.zeros(Type{t, {B, D}}));
    if (pad >= 0) g = b.select(b.compare(Cmp::EQ, row, b.constant_i(pad, I64, {B, D})), b.zeros(Type{t, {B, D}}), g);
    Value coords = b.concatenate({b.reshape(row, {B * D, 1}), b.reshape(b.iota(Type{I64, {B, D}}, 1), {B * D, 1})}, 1);
    Value gw = b.scatter(b.zeros(Type{t, {R, D}}), coords, b.reshape(g, {B * D}), {}, {0, 1}, {0, 1}, 1, "add");
    return {b.convert(gw, o.elem)};
  }
  Value safe_bag = b.select(counted, bag, b.constant_i(0, I64, {N}));
  Value w = b.convert(counted, t);
  if (c.has("per_sample_weights")) w = b.mul(w, b.convert(c.tensor("per_sample_weights"), t));
  if (mode == kMean) {
    Value size = b.convert(b.slice(b.convert(c.tensor("bag_size"), I64), {0}, {B}), t);
    Value n = gather_elems(b, b.max(size, b.constant_f(1, t, {B})), safe_bag);
    w = b.div(w, n);
  }
  if (by_freq) w = b.div(w, b.max(freq, b.constant_f(1, t, {N})));
  Value contrib = b.mul(gather_rows(b, grad, safe_bag), bcast_rows(b, w, D));
  return {b.convert(scatter_rows(b, b.zeros(Type{t, {R, D}}), safe_idx, contrib, "add"), o.elem)};
}

TPU_LOWER(_embedding_bag_dense_backward) { return lower_dense_backward(b, c); }
// What autograd calls (its CPU and CUDA kernels pick the dense or sparse form).
TPU_LOWER(_embedding_bag_backward) {
  if (c.bool_("sparse")) throw Unsupported("embedding_bag: sparse gradients");
  return lower_dense_backward(b, c);
}

// d per_sample_weights[i] = <grad[bag(i)], weight[indices[i]]> (0 for padding and unbagged).
TPU_LOWER(_embedding_bag_per_sample_weights_backward) {
  const Type& o = out_type(c);
  const ElemType t = opmath(o.elem);
  if (c.int_("mode") != kSum) throw Unsupported("embedding_bag: per_sample_weights need mode='sum'");
  Value grad = b.convert(c.tensor("grad"), t), weight = b.convert(c.tensor("weight"), t);
  Value idx = b.convert(c.tensor("indices"), I64), bag = b.convert(c.tensor("offset2bag"), I64);
  const int64_t N = idx.shape()[0], B = grad.shape()[0], D = grad.shape()[1];
  if (N == 0) return {b.zeros(o)};
  if (B == 0 || D == 0) return {b.zeros(o)};
  Value counted = b.and_(b.compare(Cmp::LT, bag, b.constant_i(B, I64, {N})), b.compare(Cmp::GE, bag, b.constant_i(0, I64, {N})));
  const int64_t pad = c.int_("padding_idx", -1);
  if (pad >= 0) counted = b.and_(counted, b.compare(Cmp::NE, idx, b.constant_i(pad, I64, {N})));
  Value safe_idx = b.select(counted, idx, b.constant_i(0, I64, {N}));
  Value safe_bag = b.select(counted, bag, b.constant_i(0, I64, {N}));
  Value dot = sum_drop(b, b.mul(gather_rows(b, grad, safe_bag), gather_rows(b, weight, safe_idx)), {1});
  return {b.convert(b.select(counted, dot, b.zeros(Type{t, {N}})), o.elem)};
}

// nn.Embedding(max_norm=...): every row named by `indices` whose norm_type-norm exceeds max_norm
// is scaled by max_norm / (norm + 1e-7) (CPU's kernel takes the norm in the weight's type, the
// scale in double, and multiplies in the weight's type).
TPU_LOWER_CHECKED(embedding_renorm) {
  Value self = c.tensor("self");
  const Type& o = out_type(c);
  if (self.rank() != 2 || !is_float(o.elem)) throw Unsupported("embedding_renorm_: 2-D float weight expected");
  const int64_t R = self.shape()[0], D = self.shape()[1];
  Value idx = b.reshape(b.convert(c.tensor("indices"), I64), {c.tensor("indices").type.numel()});
  const int64_t N = idx.shape()[0];
  if (N == 0 || R == 0 || D == 0) return {self};
  Value bad = b.or_(b.compare(Cmp::LT, idx, b.zeros(Type{I64, {N}})), b.compare(Cmp::GE, idx, b.constant_i(R, I64, {N})));
  if (b.checking()) check(b, bad, CheckKind::Index, "index out of range in self");
  Value safe = b.select(bad, b.zeros(Type{I64, {N}}), idx);
  Value named = b.compare(Cmp::GT, b.scatter(b.zeros(Type{I64, {R}}), b.reshape(safe, {N, 1}), b.constant_i(1, I64, {N}),
                                             {}, {0}, {0}, 1, "add"),
                          b.zeros(Type{I64, {R}}));
  const ElemType t = opmath(o.elem);
  Value x = b.convert(self, t);
  const double p = c.double_("norm_type"), max_norm = c.double_("max_norm");
  Value ax = b.abs(x), norm;
  if (std::isinf(p)) {
    norm = b.reduce(ax, b.constant_i(0, t), {1}, "maximum");
  } else if (p == 1) {
    norm = sum_drop(b, ax, {1});
  } else if (p == 2) {
    norm = b.sqrt(sum_drop(b, b.mul(x, x), {1}));
  } else {
    norm = b.pow(sum_drop(b, b.pow(ax, b.constant_f(p, t, {R, D})), {1}), b.constant_f(1.0 / p, t, {R}));
  }
  Value n64 = b.convert(norm, ElemType::F64);
  Value scale = b.div(b.constant_f(max_norm, ElemType::F64, {R}), b.add(n64, b.constant_f(1e-7, ElemType::F64, {R})));
  Value apply = b.and_(named, b.compare(Cmp::GT, n64, b.constant_f(max_norm, ElemType::F64, {R})));
  Value scaled = b.mul(x, b.broadcast_in_dim(b.convert(scale, t), {R, D}, {0}));
  Value rows = b.broadcast_in_dim(apply, {R, D}, {0});
  return {b.convert(b.select(rows, scaled, x), o.elem)};
}

}  // namespace tpu::lowering
