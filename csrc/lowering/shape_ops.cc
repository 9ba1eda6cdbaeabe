// Joining, padding, reordering and creation ops that produce new tensors (cat/stack, flip,
// roll, repeat, tril/triu, constant/reflection/replication padding, sort/topk, diag_embed,
// arange/linspace/eye/fill/zero), im2col/col2im, and the gradients of edge padding and
// Tensor.unfold. Pure views are handled by the runtime as metadata.
#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

#include "lowering.h"
#include "shape_util.h"

namespace tpu::lowering {
namespace {

constexpr ElemType I64 = ElemType::S64;

Shape insert_unit(const Shape& s, int64_t at) {
  Shape r = s;
  r.insert(r.begin() + at, 1);
  return r;
}

// x rolled by `shift` along `dim` (result[i] = x[(i - shift) mod n]).
Value roll_dim(Builder& b, Value x, int64_t shift, int64_t dim) {
  int64_t n = x.shape()[dim];
  if (n == 0) return x;
  int64_t s = ((shift % n) + n) % n;
  if (s == 0) return x;
  Shape start(x.rank(), 0), limit = x.shape();
  // tail: [n - s, n), head: [0, n - s)
  Shape tail_start = start;
  tail_start[dim] = n - s;
  Shape head_limit = limit;
  head_limit[dim] = n - s;
  Value tail = b.slice(x, tail_start, limit);
  Value head = b.slice(x, start, head_limit);
  return b.concatenate({tail, head}, dim);
}

// Padding for the last k dims from a PyTorch pad list (last dim first).
void pads_from_list(const std::vector<int64_t>& pad, int64_t rank, Shape& lo, Shape& hi) {
  lo.assign(rank, 0);
  hi.assign(rank, 0);
  int64_t k = static_cast<int64_t>(pad.size()) / 2;
  if (k > rank) throw Unsupported("pad: padding length too large");
  for (int64_t i = 0; i < k; ++i) {
    lo[rank - 1 - i] = pad[2 * i];
    hi[rank - 1 - i] = pad[2 * i + 1];
  }
}

// Reflection (reflect=true) or replication padding of the last pad.size()/2 dims.
Value edge_pad(Builder& b, Value x, const std::vector<int64_t>& pad, bool reflect) {
  Shape lo, hi;
  pads_from_list(pad, x.rank(), lo, hi);
  for (int64_t d = 0; d < x.rank(); ++d) {
    if (lo[d] == 0 && hi[d] == 0) continue;
    if (lo[d] < 0 || hi[d] < 0) {
      // Replication with a negative side crops that side first (out[j] = x[clamp(j - lo, 0, n-1)]).
      if (reflect) throw Unsupported("reflection pad: negative padding");
      int64_t keep = x.shape()[d] + std::min<int64_t>(lo[d], 0) + std::min<int64_t>(hi[d], 0);
      if (keep <= 0) {
        // One side crops the whole dim: every out[j] = x[clamp(j - lo, 0, n-1)] is the same edge
        // element (the last when the left side crops, else the first), repeated n + lo + hi times.
        int64_t out = x.shape()[d] + lo[d] + hi[d];
        if (out <= 0) throw Unsupported("replication pad: output size is not positive");
        Shape st(x.rank(), 0), li = x.shape(), s = x.shape();
        st[d] = lo[d] < 0 ? x.shape()[d] - 1 : 0;
        li[d] = st[d] + 1;
        s[d] = out;
        x = b.broadcast_to(b.slice(x, st, li), s);
        continue;
      }
      Shape st(x.rank(), 0), li = x.shape();
      st[d] = -std::min<int64_t>(lo[d], 0);
      li[d] = st[d] + keep;
      x = b.slice(x, st, li);
      lo[d] = std::max<int64_t>(lo[d], 0);
      hi[d] = std::max<int64_t>(hi[d], 0);
      if (lo[d] == 0 && hi[d] == 0) continue;
    }
    int64_t n = x.shape()[d];
    if (n == 0) throw Unsupported("reflection/replication pad: empty dim");
    if (reflect && (lo[d] >= n || hi[d] >= n)) throw Unsupported("reflection pad: pad >= size");
    Shape start(x.rank(), 0), limit = x.shape();
    auto part = [&](int64_t s, int64_t e) {
      Shape st = start, li = limit;
      st[d] = s;
      li[d] = e;
      return b.slice(x, st, li);
    };
    std::vector<Value> pieces;
    if (lo[d] > 0) {
      if (reflect) {
        pieces.push_back(b.reverse(part(1, lo[d] + 1), {d}));
      } else {
        Value edge = part(0, 1);
        Shape s = edge.shape();
        s[d] = lo[d];
        pieces.push_back(b.broadcast_to(edge, s));
      }
    }
    pieces.push_back(x);
    if (hi[d] > 0) {
      if (reflect) {
        pieces.push_back(b.reverse(part(n - 1 - hi[d], n - 1), {d}));
      } else {
        Value edge = part(n - 1, n);
        Shape s = edge.shape();
        s[d] = hi[d];
        pieces.push_back(b.broadcast_to(edge, s));
      }
    }
    x = b.concatenate(pieces, d);
  }
  return x;
}

// 0-d value of an arg that is a Scalar or a 0-d Tensor.
Value scalar_value(Builder& b, const Arg& a, ElemType t) { return operand(b, a, t, {}); }

}  // namespace

// ---------------------------------------------------------------- cat / stack
TPU_LOWER_COMPLEX(cat) {
  const Type& o = out_type(c);
  std::vector<Value> xs;
  for (const auto& t : c.arg("tensors").tensors) {
    if (!t) continue;
    // Legacy behaviour: 1-D empty tensors are skipped whatever the other ranks.
    if (t->rank() == 1 && t->shape()[0] == 0) continue;
    xs.push_back(*t);
  }
  if (xs.empty() || o.numel() == 0) return {b.zeros(o)};
  int64_t dim = norm_dim(c.int_("dim"), xs[0].rank());
  std::vector<Value> parts;
  for (Value& x : xs) {
    if (x.type.numel() == 0) continue;
    parts.push_back(b.convert(x, o.elem));
  }
  if (parts.empty()) return {b.zeros(o)};
  return {b.concatenate(parts, dim)};
}

TPU_LOWER_COMPLEX(stack) {
  const Type& o = out_type(c);
  const auto& ts = c.arg("tensors").tensors;
  if (ts.empty() || !ts[0]) throw Unsupported("stack: empty list");
  int64_t dim = norm_dim(c.int_("dim"), ts[0]->rank() + 1);
  if (o.numel() == 0) return {b.zeros(o)};
  std::vector<Value> parts;
  for (const auto& t : ts) parts.push_back(b.reshape(b.convert(*t, o.elem), insert_unit(t->shape(), dim)));
  return {b.concatenate(parts, dim)};
}

// ---------------------------------------------------------------- reorderings
TPU_LOWER(flip) {
  Value x = c.tensor("self");
  std::vector<int64_t> dims;
  for (int64_t d : c.ints("dims")) dims.push_back(norm_dim(d, x.rank()));
  std::sort(dims.begin(), dims.end());
  dims.erase(std::unique(dims.begin(), dims.end()), dims.end());
  if (x.rank() == 0) return {x};
  return {b.reverse(x, dims)};
}

TPU_LOWER_COMPLEX(roll) {  // slices + concatenate: complex values move like any other (fftshift)
  Value x = c.tensor("self");
  const auto& shifts = c.ints("shifts");
  std::vector<int64_t> dims = c.has("dims") ? c.ints("dims") : std::vector<int64_t>{};
  if (x.type.numel() == 0) return {x};
  if (dims.empty()) {
    if (shifts.size() != 1) throw Unsupported("roll: shifts without dims");
    Shape s = x.shape();
    Value flat = b.reshape(x, {x.type.numel()});
    return {b.reshape(roll_dim(b, flat, shifts[0], 0), s)};
  }
  if (dims.size() != shifts.size()) throw Unsupported("roll: shifts/dims length mismatch");
  for (size_t i = 0; i < dims.size(); ++i) x = roll_dim(b, x, shifts[i], norm_dim(dims[i], x.rank()));
  return {x};
}

TPU_LOWER(repeat) {
  Value x = c.tensor("self");
  const auto& reps = c.ints("repeats");
  const Type& o = out_type(c);
  int64_t k = static_cast<int64_t>(reps.size());
  if (k < x.rank()) throw Unsupported("repeat: fewer repeats than dims");
  if (o.numel() == 0) return {b.zeros(o)};
  Shape xs(k - x.rank(), 1);
  xs.insert(xs.end(), x.shape().begin(), x.shape().end());
  x = b.reshape(x, xs);
  Shape big;
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < k; ++i) {
    big.push_back(reps[i]);
    big.push_back(xs[i]);
    dims.push_back(2 * i + 1);
  }
  return {b.reshape(b.broadcast_in_dim(x, big, dims), o.shape)};
}

// ---------------------------------------------------------------- triangular
namespace {
Value tri(Builder& b, const OpCall& c, bool lower) {
  Value x = c.tensor("self");
  if (x.rank() < 2) throw Unsupported("tril/triu: input has fewer than 2 dims");
  int64_t diag = c.int_("diagonal");
  int64_t r = x.rank();
  Shape s = x.shape();
  Value row = b.iota(Type{I64, s}, r - 2);
  Value col = b.iota(Type{I64, s}, r - 1);
  Value diff = b.sub(col, row);
  Value dv = b.constant_i(diag, I64, s);
  Value keep = b.compare(lower ? Cmp::LE : Cmp::GE, diff, dv);
  return b.select(keep, x, b.zeros(x.type));
}
}  // namespace
TPU_LOWER(tril) { return {tri(b, c, true)}; }
TPU_LOWER(triu) { return {tri(b, c, false)}; }

TPU_LOWER(diag_embed) {
  Value x = c.tensor("self");
  const Type& o = out_type(c);
  int64_t r = o.rank();
  int64_t offset = c.int_("offset");
  int64_t d1 = norm_dim(c.int_("dim1", -2), r);
  int64_t d2 = norm_dim(c.int_("dim2", -1), r);
  if (d1 == d2) throw Unsupported("diag_embed: dim1 == dim2");
  if (x.rank() == 0) throw Unsupported("diag_embed: 0-d input");
  if (o.numel() == 0) return {b.zeros(o)};
  int64_t a = offset < 0 ? -offset : offset;
  Shape lo(x.rank(), 0), hi(x.rank(), 0);
  hi.back() = a;
  Value padded = a ? b.pad(x, b.constant_i(0, x.elem()), lo, hi) : x;
  // Map batch dims to the out dims other than d1/d2, and the diagonal to d1 (offset >= 0: the
  // row index picks the element) or d2 (offset < 0: the column index does).
  std::vector<int64_t> map;
  for (int64_t d = 0; d < r; ++d)
    if (d != d1 && d != d2) map.push_back(d);
  map.push_back(offset >= 0 ? d1 : d2);
  // XLA wants increasing broadcast dims: transpose the operand into the order of `map`.
  std::vector<int64_t> perm(map.size());
  std::iota(perm.begin(), perm.end(), 0);
  std::sort(perm.begin(), perm.end(), [&](int64_t p, int64_t q) { return map[p] < map[q]; });
  std::vector<int64_t> sorted_map;
  for (int64_t p : perm) sorted_map.push_back(map[p]);
  Value big = b.broadcast_in_dim(b.transpose(padded, perm), o.shape, sorted_map);
  Value row = b.iota(Type{I64, o.shape}, d1);
  Value col = b.iota(Type{I64, o.shape}, d2);
  Value keep = b.compare(Cmp::EQ, b.sub(col, row), b.constant_i(offset, I64, o.shape));
  return {b.select(keep, big, b.zeros(big.type))};
}

// ---------------------------------------------------------------- padding
TPU_LOWER_COMPLEX(constant_pad_nd) {  // complex too: fftn(s=...) pads its input
  Value x = c.tensor("self");
  const auto& pad = c.ints("pad");
  if (pad.size() % 2) throw Unsupported("constant_pad_nd: odd pad length");
  Shape lo, hi;
  pads_from_list(pad, x.rank(), lo, hi);
  Value v = c.has("value") ? scalar_value(b, c.arg("value"), x.elem()) : b.constant_i(0, x.elem());
  const Type& o = out_type(c);
  if (o.numel() == 0) return {b.zeros(o)};
  // StableHLO pad accepts negative edge padding (cropping), but crop first so that padding a
  // dim cropped below zero cannot produce a negative intermediate.
  Shape start(x.rank(), 0), limit = x.shape();
  bool crop = false;
  for (int64_t d = 0; d < x.rank(); ++d) {
    if (lo[d] < 0) { start[d] = -lo[d]; lo[d] = 0; crop = true; }
    if (hi[d] < 0) { limit[d] += hi[d]; hi[d] = 0; crop = true; }
  }
  if (crop) x = b.slice(x, start, limit);
  return {b.pad(x, v, lo, hi)};
}

#define TPU_EDGE_PAD(name, reflect) \
  TPU_LOWER(name) { return {edge_pad(b, c.tensor("self"), c.ints("padding"), reflect)}; }
TPU_EDGE_PAD(reflection_pad1d, true)
TPU_EDGE_PAD(reflection_pad2d, true)
TPU_EDGE_PAD(reflection_pad3d, true)
TPU_EDGE_PAD(replication_pad1d, false)
TPU_EDGE_PAD(replication_pad2d, false)
TPU_EDGE_PAD(replication_pad3d, false)
#undef TPU_EDGE_PAD

namespace {
// Gradient of edge_pad: the centre of grad_output, plus each padded slab added back onto the
// input rows it copied (reflection: mirrored rows 1..pad; replication: the edge row).
Value edge_pad_backward(Builder& b, Value g, const Shape& in_shape, const std::vector<int64_t>& pad,
                        bool reflect) {
  int64_t r = static_cast<int64_t>(in_shape.size());
  Shape lo, hi;
  pads_from_list(pad, r, lo, hi);
  g = b.convert(g, opmath(g.elem()));
  Value zero = b.constant_f(0, g.elem());
  for (int64_t d = 0; d < r; ++d) {
    if (lo[d] == 0 && hi[d] == 0) continue;
    // Replication with a negative side: the gradient of the cropped input, zero-padded back.
    int64_t crop_lo = -std::min<int64_t>(lo[d], 0), crop_hi = -std::min<int64_t>(hi[d], 0);
    if ((crop_lo || crop_hi) && reflect) throw Unsupported("reflection pad backward: negative padding");
    lo[d] = std::max<int64_t>(lo[d], 0);
    hi[d] = std::max<int64_t>(hi[d], 0);
    int64_t n = in_shape[d] - crop_lo - crop_hi;
    if (n <= 0 && (crop_lo || crop_hi)) {
      // The forward repeated one edge element (see edge_pad): its gradient is the sum over the dim.
      if (g.shape()[d] <= 0) throw Unsupported("replication pad backward: output size is not positive");
      const int64_t at = crop_lo ? in_shape[d] - 1 : 0;
      Shape l(r, 0), h(r, 0), ks = g.shape();
      l[d] = at;
      h[d] = in_shape[d] - 1 - at;
      ks[d] = 1;
      g = b.pad(b.reshape(b.reduce(g, zero, {d}, "add"), ks), zero, l, h);
      continue;
    }
    if (n == 0) throw Unsupported("reflection/replication pad backward: empty dim");
    if (reflect && (lo[d] >= n || hi[d] >= n)) throw Unsupported("reflection pad backward: pad >= size");
    auto part = [&](int64_t s, int64_t e) {
      Shape st(r, 0), li = g.shape();
      st[d] = s;
      li[d] = e;
      return b.slice(g, st, li);
    };
    auto pad_d = [&](Value x, int64_t before, int64_t after) {
      Shape l(r, 0), h(r, 0);
      l[d] = before;
      h[d] = after;
      return b.pad(x, zero, l, h);
    };
    auto sum_d = [&](Value x) {
      Shape ks = x.shape();
      ks[d] = 1;
      return b.reshape(b.reduce(x, zero, {d}, "add"), ks);
    };
    Value acc = part(lo[d], lo[d] + n);
    if (lo[d] > 0) {
      Value slab = part(0, lo[d]);
      acc = b.add(acc, reflect ? pad_d(b.reverse(slab, {d}), 1, n - 1 - lo[d]) : pad_d(sum_d(slab), 0, n - 1));
    }
    if (hi[d] > 0) {
      Value slab = part(lo[d] + n, lo[d] + n + hi[d]);
      acc = b.add(acc, reflect ? pad_d(b.reverse(slab, {d}), n - 1 - hi[d], 1) : pad_d(sum_d(slab), n - 1, 0));
    }
    g = crop_lo || crop_hi ? pad_d(acc, crop_lo, crop_hi) : acc;
  }
  return g;
}
}  // namespace

#define TPU_EDGE_PAD_BACKWARD(name, reflect)                                                    \
  TPU_LOWER(name) {                                                                             \
    return {edge_pad_backward(b, c.tensor("grad_output"), c.tensor("self").shape(), c.ints("padding"), \
                              reflect)};                                                        \
  }
TPU_EDGE_PAD_BACKWARD(reflection_pad1d_backward, true)
TPU_EDGE_PAD_BACKWARD(reflection_pad2d_backward, true)
TPU_EDGE_PAD_BACKWARD(reflection_pad3d_backward, true)
TPU_EDGE_PAD_BACKWARD(replication_pad1d_backward, false)
TPU_EDGE_PAD_BACKWARD(replication_pad2d_backward, false)
TPU_EDGE_PAD_BACKWARD(replication_pad3d_backward, false)
#undef TPU_EDGE_PAD_BACKWARD

// ---------------------------------------------------------------- unfold backward, channel shuffle
// Tensor.unfold's gradient: window w's element j goes back to position w * step + j of `dim`;
// one interior-padded copy of the grad per window offset j, summed.
TPU_LOWER(unfold_backward) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  Value g = b.convert(c.tensor("grad_in"), t);
  int64_t r = o.rank();
  int64_t dim = r == 0 ? 0 : norm_dim(c.int_("dim"), r);
  int64_t size = c.int_("size"), step = c.int_("step");
  if (o.numel() == 0 || g.type.numel() == 0) return {b.zeros(Type{t, o.shape})};
  if (r == 0) return {b.reshape(g, o.shape)};
  if (size > 256) throw Unsupported("unfold_backward: window larger than 256");
  int64_t nw = g.shape()[dim], len = o.shape[dim];
  Value acc = b.zeros(Type{t, o.shape});
  Value zero = b.constant_f(0, t);
  for (int64_t j = 0; j < size; ++j) {
    Shape st(g.rank(), 0), li = g.shape();
    st[g.rank() - 1] = j;
    li[g.rank() - 1] = j + 1;
    Value gj = b.reshape(b.slice(g, st, li), Shape(g.shape().begin(), g.shape().end() - 1));
    Shape lo(r, 0), hi(r, 0), in(r, 0);
    lo[dim] = j;
    in[dim] = step - 1;
    hi[dim] = len - (j + (nw - 1) * step + 1);
    acc = b.add(acc, b.pad(gj, zero, lo, hi, in));
  }
  return {acc};
}

// col2im (nn.functional.fold, the gradient of unfold/im2col): [N, C*kh*kw, L] -> [N, C, H, W],
// summing the blocks; each kernel offset (ki, kj) is one strided placement via interior padding
// (negative edge padding crops the positions that fall in the zero padding).
TPU_LOWER(col2im) {
  const Type& o = out_type(c);
  ElemType t = opmath(o.elem);
  Value x = b.convert(c.tensor("self"), t);
  const auto &ks = c.ints("kernel_size"), &dil = c.ints("dilation"), &pad = c.ints("padding"),
             &st = c.ints("stride");
  if (o.numel() == 0) return {b.zeros(Type{t, o.shape})};
  bool batched = x.rank() == 3;
  int64_t n = batched ? x.shape()[0] : 1;
  int64_t kh = ks[0], kw = ks[1];
  int64_t H = o.shape[o.rank() - 2], W = o.shape[o.rank() - 1];
  int64_t C = o.shape[o.rank() - 3];
  int64_t lh = (H + 2 * pad[0] - dil[0] * (kh - 1) - 1) / st[0] + 1;
  int64_t lw = (W + 2 * pad[1] - dil[1] * (kw - 1) - 1) / st[1] + 1;
  if (lh <= 0 || lw <= 0 || x.type.numel() == 0) return {b.zeros(Type{t, o.shape})};
  if (kh * kw > 1024) throw Unsupported("col2im: kernel with more than 1024 taps");
  Value blocks = b.reshape(x, {n, C, kh, kw, lh, lw});
  Value acc = b.zeros(Type{t, {n, C, H, W}});
  Value zero = b.constant_f(0, t);
  for (int64_t i = 0; i < kh; ++i) {
    for (int64_t j = 0; j < kw; ++j) {
      Value piece = b.reshape(b.slice(blocks, {0, 0, i, j, 0, 0}, {n, C, i + 1, j + 1, lh, lw}), {n, C, lh, lw});
      int64_t lo_h = i * dil[0] - pad[0], lo_w = j * dil[1] - pad[1];
      int64_t hi_h = H - (lo_h + (lh - 1) * st[0] + 1), hi_w = W - (lo_w + (lw - 1) * st[1] + 1);
      acc = b.add(acc, b.pad(piece, zero, {0, 0, lo_h, lo_w}, {0, 0, hi_h, hi_w}, {0, 0, st[0] - 1, st[1] - 1}));
    }
  }
  return {b.reshape(acc, o.shape)};
}

// im2col (nn.functional.unfold): [N, C, H, W] -> [N, C*kh*kw, L]; one strided slice of the
// zero-padded input per kernel offset.
TPU_LOWER(im2col) {
  const Type& o = out_type(c);
  ElemType t = o.elem;
  Value x = c.tensor("self");
  const auto &ks = c.ints("kernel_size"), &dil = c.ints("dilation"), &pad = c.ints("padding"),
             &st = c.ints("stride");
  if (o.numel() == 0) return {b.zeros(o)};
  bool batched = x.rank() == 4;
  const Shape& xs = x.shape();
  int64_t n = batched ? xs[0] : 1, C = xs[x.rank() - 3], H = xs[x.rank() - 2], W = xs[x.rank() - 1];
  int64_t kh = ks[0], kw = ks[1];
  int64_t lh = (H + 2 * pad[0] - dil[0] * (kh - 1) - 1) / st[0] + 1;
  int64_t lw = (W + 2 * pad[1] - dil[1] * (kw - 1) - 1) / st[1] + 1;
  if (lh <= 0 || lw <= 0) throw Unsupported("im2col: empty output");
  if (kh * kw > 1024) throw Unsupported("im2col: kernel with more than 1024 taps");
  Value xp = b.pad(b.reshape(x, {n, C, H, W}), b.constant_i(0, x.elem()), {0, 0, pad[0], pad[1]},
                   {0, 0, pad[0], pad[1]});
  std::vector<Value> taps;
  for (int64_t i = 0; i < kh; ++i)
    for (int64_t j = 0; j < kw; ++j) {
      int64_t h0 = i * dil[0], w0 = j * dil[1];
      Value tap = b.slice(xp, {0, 0, h0, w0}, {n, C, h0 + (lh - 1) * st[0] + 1, w0 + (lw - 1) * st[1] + 1},
                          {1, 1, st[0], st[1]});
      taps.push_back(b.reshape(tap, {n, C, 1, lh * lw}));
    }
  Value cols = b.concatenate(taps, 2);  // [n, C, kh*kw, L]
  return {b.convert(b.reshape(cols, o.shape), t)};
}

TPU_LOWER(channel_shuffle) {  // [N, g, C/g, *] -> [N, C/g, g, *]
  Value x = c.tensor("self");
  const Type& o = out_type(c);
  int64_t g = c.int_("groups");
  if (x.rank() < 3 || g <= 0 || x.shape()[1] % g) throw Unsupported("channel_shuffle: shape");
  if (o.numel() == 0) return {b.zeros(o)};
  Shape s = x.shape();
  Shape split{s[0], g, s[1] / g};
  for (size_t i = 2; i < s.size(); ++i) split.push_back(s[i]);
  std::vector<int64_t> perm(split.size());
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[1], perm[2]);
  return {b.reshape(b.transpose(b.reshape(x, split), perm), s)};
}

// ---------------------------------------------------------------- sort / topk
TPU_LOWER(sort) {
  Value x = c.tensor("self");
  bool desc = c.bool_("descending");
  if (x.rank() == 0) return {x, b.constant_i(0, I64)};
  int64_t dim = norm_dim(c.int_("dim", -1), x.rank());
  if (x.type.numel() == 0) return {x, b.zeros(Type{I64, x.shape()})};
  auto [v, i] = sort_with_indices(b, x, dim, desc);
  return {v, i};
}

TPU_LOWER(topk) {
  Value x = c.tensor("self");
  int64_t k = c.int_("k");
  bool largest = c.bool_("largest", true);
  const Type& o = out_type(c);
  if (o.numel() == 0) return {b.zeros(o), b.zeros(Type{I64, o.shape})};
  if (x.rank() == 0) return {x, b.constant_i(0, I64)};
  int64_t dim = norm_dim(c.int_("dim", -1), x.rank());
  auto [v, i] = sort_with_indices(b, x, dim, largest);
  Shape start(x.rank(), 0), limit = x.shape();
  limit[dim] = k;
  return {b.slice(v, start, limit), b.slice(i, start, limit)};
}

// ---------------------------------------------------------------- creation
TPU_LOWER(arange) {
  const Type& o = out_type(c);
  if (o.rank() != 1) throw Unsupported("arange: output is not 1-D");
  int64_t n = o.shape[0];
  if (n == 0) return {b.zeros(o)};
  // CPU computes start + i * step in acc_type: double for float/double (then casts), float for
  // half/bfloat16, int64 for integers.
  ElemType t = o.elem == ElemType::F32 || o.elem == ElemType::F64 ? ElemType::F64
               : is_float(o.elem)                                 ? ElemType::F32
                                                                  : I64;
  if (o.elem == ElemType::Pred) throw Unsupported("arange: bool output");
  Value start = c.has("start") ? scalar_value(b, c.arg("start"), t) : b.constant_i(0, t);
  Value step = c.has("step") ? scalar_value(b, c.arg("step"), t) : b.constant_i(1, t);
  Value i = b.iota(Type{t, {n}}, 0);
  if (t == ElemType::F32) i = b.convert(b.iota(Type{I64, {n}}, 0), t);
  Value v = b.add(b.broadcast_to(start, {n}), b.mul(b.broadcast_to(step, {n}), i));
  return {b.convert(v, o.elem)};
}

TPU_LOWER(linspace) {
  const Type& o = out_type(c);
  if (o.rank() != 1) throw Unsupported("linspace: output is not 1-D");
  int64_t n = o.shape[0];
  if (n == 0) return {b.zeros(o)};
  if (o.elem == ElemType::Pred) throw Unsupported("linspace: bool output");
  bool integral = !is_float(o.elem);
  // CPU: start/end converted to the output type; step and the math in the output type for
  // floats (bf16/f16 approximated in f32), in double for integers.
  ElemType st = integral ? o.elem : opmath(o.elem);
  ElemType t = integral ? ElemType::F64 : st;
  Value start = b.convert(scalar_value(b, c.arg("start"), st), t);
  if (n == 1) return {b.convert(b.broadcast_to(start, {1}), o.elem)};
  Value end = b.convert(scalar_value(b, c.arg("end"), st), t);
  Value step = b.div(b.sub(end, start), b.constant_i(n - 1, t));
  Value iota = b.convert(b.iota(Type{I64, {n}}, 0), t);
  Value stepv = b.broadcast_to(step, {n});
  Value lo = b.add(b.broadcast_to(start, {n}), b.mul(stepv, iota));
  Value rev = b.sub(b.constant_i(n - 1, t, {n}), iota);
  Value hi = b.sub(b.broadcast_to(end, {n}), b.mul(stepv, rev));
  Value first_half = b.compare(Cmp::LT, b.iota(Type{I64, {n}}, 0), b.constant_i(n / 2, I64, {n}));
  return {b.convert(b.select(first_half, lo, hi), o.elem)};
}

// ---- tril_indices / triu_indices: [2, N] (row, col) of the kept entries in row-major order,
// N from the meta function. Entry k's row comes from the closed form of the row-start counts
// (a square root in double, then corrected by exact integer comparisons), as CUDA does.
namespace {
// Rows of the triangle whose lengths change by `step` (+1 for tril, -1 for triu) per row from
// `first`; S(r) = r * first + step * r (r - 1) / 2 entries precede row r. Returns (row, entry
// offset within the row) for linear indices k (s64) that lie in this part.
std::pair<Value, Value> staircase(Builder& b, Value k, int64_t first, int64_t step) {
  const Shape& s = k.shape();
  auto ci = [&](int64_t v) { return b.constant_i(v, I64, s); };
  auto S = [&](Value r) {  // r * first + step * r * (r - 1) / 2
    Value tri = b.div(b.mul(r, b.sub(r, ci(1))), ci(2));
    return b.add(b.mul(r, ci(first)), step > 0 ? tri : b.neg(tri));
  };
  // step * r^2 + (2 first - step) r - 2k = 0, the root that is >= 0 and increasing in k.
  Value kd = b.convert(k, ElemType::F64);
  const double bq = 2.0 * static_cast<double>(first) - static_cast<double>(step);
  Value disc = b.add(b.constant_f(bq * bq, ElemType::F64, s), b.mul(b.constant_f(8.0 * static_cast<double>(step), ElemType::F64, s), kd));
  disc = b.max(disc, b.constant_f(0.0, ElemType::F64, s));
  Value root = b.div(b.sub(b.sqrt(disc), b.constant_f(bq, ElemType::F64, s)),
                     b.constant_f(2.0 * static_cast<double>(step), ElemType::F64, s));
  Value r = b.max(b.convert(b.floor(root), I64), ci(0));
  for (int i = 0; i < 2; ++i) {  // exact: S(r) <= k < S(r + 1)
    r = b.select(b.compare(Cmp::GT, S(r), k), b.max(b.sub(r, ci(1)), ci(0)), r);
    r = b.select(b.compare(Cmp::LE, S(b.add(r, ci(1))), k), b.add(r, ci(1)), r);
  }
  return {r, b.sub(k, S(r))};
}

Value tri_indices(Builder& b, const OpCall& c, bool lower) {
  const Type& o = out_type(c);
  if (o.rank() != 2 || o.shape[0] != 2) throw Unsupported("tri_indices: output is not [2, N]");
  const int64_t n = o.shape[1];
  if (n == 0) return b.zeros(o);
  const int64_t col = c.int_("col"), offset = c.int_("offset", 0);
  const Shape s{n};
  auto ci = [&](int64_t v) { return b.constant_i(v, I64, s); };
  Value k = b.iota(Type{I64, s}, 0);
  Value row, column;
  if (lower) {  // CPU: rows from max(0, -offset); row r keeps columns [0, min(col, r + offset + 1))
    const int64_t r0 = std::max<int64_t>(0, -offset);
    const int64_t first = std::min(col, r0 + offset + 1);  // >= 1 when n > 0
    const int64_t growing = col - first;                    // rows shorter than col
    const int64_t before_full = growing * first + growing * (growing - 1) / 2;
    auto [r, j] = staircase(b, k, first, 1);
    Value kr = b.sub(k, ci(before_full));
    Value in_stairs = b.compare(Cmp::LT, k, ci(before_full));
    row = b.add(b.select(in_stairs, r, b.add(ci(growing), b.div(kr, ci(col)))), ci(r0));
    column = b.select(in_stairs, j, b.rem(kr, ci(col)));
  } else {  // row r keeps columns [max(0, r + offset), col): full rows while r + offset <= 0
    const int64_t full = std::max<int64_t>(0, std::min<int64_t>(c.int_("row"), 1 - offset));
    const int64_t first = col - std::max<int64_t>(0, full + offset);  // length of the first shorter row
    auto [r, j] = staircase(b, b.max(b.sub(k, ci(full * col)), ci(0)), first, -1);
    Value in_full = b.compare(Cmp::LT, k, ci(full * col));
    Value rr = b.add(r, ci(full));
    row = b.select(in_full, b.div(k, ci(col)), rr);
    Value start = b.max(b.add(rr, ci(offset)), ci(0));
    column = b.select(in_full, b.rem(k, ci(col)), b.add(start, j));
  }
  Value both = b.concatenate({b.reshape(row, {1, n}), b.reshape(column, {1, n})}, 0);
  return b.convert(both, o.elem);
}
}  // namespace

TPU_LOWER(tril_indices) { return {tri_indices(b, c, true)}; }
TPU_LOWER(triu_indices) { return {tri_indices(b, c, false)}; }

// logspace, as CPU's kernel: start/end cast to the output type, the step and every exponent in
// double (each half counted from its own end, as linspace), pow in double (base rounded to float
// for integer outputs), then cast to the output type.
TPU_LOWER(logspace) {
  const Type& o = out_type(c);
  if (o.rank() != 1) throw Unsupported("logspace: output is not 1-D");
  const int64_t n = o.shape[0];
  if (n == 0) return {b.zeros(o)};
  if (o.elem == ElemType::Pred) throw Unsupported("logspace: bool output");
  const ElemType d = ElemType::F64;
  const bool integral = !is_float(o.elem);
  double base = c.double_("base", 10.0);
  if (integral) base = static_cast<double>(static_cast<float>(base));
  Value basev = b.constant_f(base, d, {n});
  if (n == 1) return {b.convert(b.pow(basev, b.broadcast_to(scalar_value(b, c.arg("start"), d), {1})), o.elem)};
  Value start = scalar_value(b, c.arg("start"), o.elem), end = scalar_value(b, c.arg("end"), o.elem);
  // end - start in C++ integer promotion (int for narrow types), then double
  Value diff = integral ? b.sub(b.convert(end, I64), b.convert(start, I64)) : b.sub(end, start);
  Value step = b.div(b.convert(diff, d), b.constant_i(n - 1, d));
  Value startd = b.convert(start, d), endd = b.convert(end, d);
  Value iota = b.convert(b.iota(Type{I64, {n}}, 0), d);
  Value stepv = b.broadcast_to(step, {n});
  Value lo = b.add(b.broadcast_to(startd, {n}), b.mul(stepv, iota));
  Value hi = b.sub(b.broadcast_to(endd, {n}), b.mul(stepv, b.sub(b.constant_i(n - 1, d, {n}), iota)));
  Value first_half = b.compare(Cmp::LT, b.iota(Type{I64, {n}}, 0), b.constant_i(n / 2, I64, {n}));
  return {b.convert(b.pow(basev, b.select(first_half, lo, hi)), o.elem)};
}

TPU_LOWER(eye) {
  const Type& o = out_type(c);
  if (o.rank() != 2) throw Unsupported("eye: output is not 2-D");
  if (o.numel() == 0) return {b.zeros(o)};
  Value row = b.iota(Type{I64, o.shape}, 0);
  Value col = b.iota(Type{I64, o.shape}, 1);
  Value eq = b.compare(Cmp::EQ, row, col);
  return {b.select(eq, b.constant_i(1, o.elem, o.shape), b.zeros(o))};
}

TPU_LOWER_WITH(fill, .elementwise = true, .writes_may_overlap = true, .complex = true) {
  const Type& o = out_type(c);
  return {operand(b, c.arg("value"), o.elem, o.shape)};
}

TPU_LOWER_WITH(zero, .elementwise = true, .writes_may_overlap = true, .complex = true) { return {b.zeros(out_type(c))}; }

}  // namespace tpu::lowering
