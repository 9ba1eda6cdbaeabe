// Indexing ops that produce new tensors: gather/scatter families, advanced indexing
// (index.Tensor / index_put), index_* along a dim, masked_fill/masked_scatter, take/put,
// embedding. All index math is done in s64; negative indices are wrapped where PyTorch allows
// them. Out-of-range indices (negative ones where PyTorch rejects them) raise through
// device-side checks (lowering.h check()) with the exception type and text of the CPU kernel;
// with checks off, gather clamps and scatter drops them.
#include <algorithm>
#include <functional>
#include <numeric>

#include "lowering.h"

namespace tpu::lowering {
namespace {

constexpr ElemType I64 = ElemType::S64;

std::vector<int64_t> range(int64_t n, int64_t from = 0) {
  std::vector<int64_t> v(static_cast<size_t>(std::max<int64_t>(n, 0)));
  std::iota(v.begin(), v.end(), from);
  return v;
}

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// The CPU kernel's range rule for an index argument: empty `msg` = unchecked.
struct Bound {
  bool neg_ok = true;  // [-size, size) instead of [0, size)
  CheckKind kind = CheckKind::Index;
  std::string msg;
};
std::string oob(int64_t dim, int64_t size, const std::string& prefix = "") {
  return prefix + "index out of bounds for dimension " + std::to_string(dim) + " with size " + std::to_string(size);
}

// idx as s64 with negative entries wrapped by `size`; checked against `bound`.
Value wrap_index(Builder& b, Value idx, int64_t size, const Bound& bound = {}) {
  idx = b.convert(idx, I64);
  if (!bound.msg.empty() && b.checking()) {
    Value lo = b.constant_i(bound.neg_ok ? -size : 0, I64, idx.shape());
    Value hi = b.constant_i(size, I64, idx.shape());
    check(b, b.or_(b.compare(Cmp::LT, idx, lo), b.compare(Cmp::GE, idx, hi)), bound.kind, bound.msg);
  }
  Value zero = b.constant_i(0, I64, idx.shape());
  Value sz = b.constant_i(size, I64, idx.shape());
  return b.select(b.compare(Cmp::LT, idx, zero), b.add(idx, sz), idx);
}

// Appends a trailing unit dim (the index vector dim) to x.
Value with_vector_dim(Builder& b, Value x) {
  Shape s = x.shape();
  s.push_back(1);
  return b.reshape(x, s);
}

// Full coordinates for gather/scatter along `dim`: for every element of `index` (rank r), the
// r-vector (i0, ..., index[...], ..., i_{r-1}). Result shape index.shape + [r], s64.
Value dim_coords(Builder& b, Value index, int64_t dim, int64_t dim_size) {
  int64_t r = index.rank();
  Type it{I64, index.shape()};
  std::vector<Value> parts;
  for (int64_t d = 0; d < r; ++d) {
    Value comp = d == dim ? wrap_index(b, index, dim_size, {false, CheckKind::Runtime, oob(dim, dim_size)})
                          : b.iota(it, d);
    parts.push_back(with_vector_dim(b, comp));
  }
  return b.concatenate(parts, r);
}

Value slice_to(Builder& b, Value x, const Shape& shape) {
  return b.slice(x, Shape(x.rank(), 0), shape);
}

std::string combine_for(const std::string& reduce, const char* op) {
  if (reduce.empty()) return "";
  if (reduce == "add" || reduce == "sum") return "add";
  if (reduce == "multiply" || reduce == "prod") return "multiply";
  if (reduce == "amax") return "maximum";
  if (reduce == "amin") return "minimum";
  throw Unsupported(std::string(op) + ": reduce='" + reduce + "'");
}

// Builder::scatter with an arbitrary combiner body (old, update) -> new. Needed because XLA's
// CPU backend does not propagate NaN through `maximum`/`minimum` inside scatter regions.
Value scatter_body(Builder& b, Value operand, Value indices, Value updates,
                   const std::vector<int64_t>& uwd, const std::vector<int64_t>& iwd,
                   const std::vector<int64_t>& sdod, int64_t index_vector_dim,
                   const std::function<Value(Value, Value)>& body) {
  Type st{operand.elem(), {}};
  std::string reg = b.region({st, st}, [&](const std::vector<Value>& a) {
    return std::vector<Value>{body(a[0], a[1])};
  });
  std::string dn = "scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [" +
                   Builder::ints(uwd) + "], inserted_window_dims = [" + Builder::ints(iwd) +
                   "], scatter_dims_to_operand_dims = [" + Builder::ints(sdod) +
                   "], index_vector_dim = " + std::to_string(index_vector_dim) +
                   ">, indices_are_sorted = false, unique_indices = false";
  return b.op_multi("scatter", {operand, indices, updates}, {operand.type}, dn, reg)[0];
}

// Scatter with `combine` ("" = overwrite, else a StableHLO binary op name); float
// maximum/minimum get an explicit NaN-propagating body (PyTorch semantics).
Value do_scatter(Builder& b, Value operand, Value indices, Value updates,
                 const std::vector<int64_t>& uwd, const std::vector<int64_t>& iwd,
                 const std::vector<int64_t>& sdod, int64_t ivd, const std::string& combine) {
  if (is_float(operand.elem()) && (combine == "maximum" || combine == "minimum")) {
    return scatter_body(b, operand, indices, updates, uwd, iwd, sdod, ivd, [&](Value x, Value y) {
      Value m = b.binary(combine, x, y);
      m = b.select(b.compare(Cmp::NE, y, y), y, m);
      return b.select(b.compare(Cmp::NE, x, x), x, m);
    });
  }
  return b.scatter(operand, indices, updates, uwd, iwd, sdod, ivd, combine);
}

// self.scatter_(dim, index, updates) with a combiner. `updates` already has index's shape and
// self's dtype. Handles 0-d self by viewing it as [1].
Value scatter_along(Builder& b, Value self, int64_t dim, Value index, Value updates,
                    const std::string& combine) {
  Shape self_shape = self.shape();
  if (index.type.numel() == 0) return self;
  if (self.rank() == 0) {
    int64_t n = index.type.numel();
    self = b.reshape(self, {1});
    index = b.reshape(index, {n});
    updates = b.reshape(updates, {n});
    dim = 0;
  } else if (index.rank() == 0) {
    index = b.reshape(index, Shape(self.rank(), 1));
    updates = b.reshape(updates, Shape(self.rank(), 1));
  }
  int64_t r = self.rank();
  Value coords = dim_coords(b, index, dim, self.shape()[dim]);
  Value out = do_scatter(b, self, coords, updates, {}, range(r), range(r), r, combine);
  return b.reshape(out, self_shape);
}

// The per-dim self-shaped source for scatter(src=...): src sliced to index's shape.
Value scatter_src(Builder& b, const OpCall& c, Value self, Value index) {
  Shape ishape = index.shape();
  if (c.has("src")) {
    Value src = b.convert(c.tensor("src"), self.elem());
    if (src.rank() == 0 || index.rank() == 0) return b.reshape(slice_to(b, b.reshape(src, {src.type.numel()}), {index.type.numel()}), ishape);
    return slice_to(b, src, ishape);
  }
  return operand(b, c.arg("value"), self.elem(), ishape);
}

// ---------------------------------------------------------------- advanced indexing
struct AdvIndex {
  std::vector<int64_t> adv;   // indexed dims of self (in order)
  std::vector<int64_t> rest;  // non-indexed dims of self (in order)
  Shape bshape;               // broadcast shape of the index tensors
  Value coords;               // bshape + [adv.size()], s64
  Shape result;               // shape of self[indices]
  std::vector<int64_t> offset_dims;  // positions of `rest` dims in `result`
};

Shape broadcast_shapes(const std::vector<Shape>& shapes) {
  size_t r = 0;
  for (const Shape& s : shapes) r = std::max(r, s.size());
  Shape out(r, 1);
  for (const Shape& s : shapes) {
    size_t off = r - s.size();
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] == 1) continue;
      if (out[off + i] != 1 && out[off + i] != s[i])
        throw Unsupported("index: index tensors do not broadcast");
      out[off + i] = s[i];
    }
  }
  return out;
}

AdvIndex adv_index(Builder& b, const Arg& indices, const Shape& self_shape) {
  AdvIndex a;
  int64_t r = static_cast<int64_t>(self_shape.size());
  const auto& list = indices.tensors;
  if (static_cast<int64_t>(list.size()) > r) throw Unsupported("index: too many indices");
  std::vector<Value> idx;
  for (int64_t d = 0; d < r; ++d) {
    if (d < static_cast<int64_t>(list.size()) && list[d].has_value()) {
      Value v = *list[d];
      if (v.elem() == ElemType::Pred || v.elem() == ElemType::U8)
        throw Unsupported("index: boolean mask index reached the lowering");
      if (!is_integral(v.elem())) throw Unsupported("index: non-integer index tensor");
      a.adv.push_back(d);
      idx.push_back(v);
    } else {
      a.rest.push_back(d);
    }
  }
  if (a.adv.empty()) return a;
  std::vector<Shape> shapes;
  for (const Value& v : idx) shapes.push_back(v.shape());
  a.bshape = broadcast_shapes(shapes);
  int64_t nb = static_cast<int64_t>(a.bshape.size());
  std::vector<Value> parts;
  for (size_t k = 0; k < idx.size(); ++k) {
    Value v = b.broadcast_to(b.convert(idx[k], I64), a.bshape);
    int64_t dk = a.adv[k];
    parts.push_back(with_vector_dim(b, wrap_index(b, v, self_shape[dk], {true, CheckKind::Index, oob(dk, self_shape[dk])})));
  }
  a.coords = b.concatenate(parts, nb);
  bool adjacent = a.adv.back() - a.adv.front() + 1 == static_cast<int64_t>(a.adv.size());
  // Adjacent advanced indices keep their place; otherwise the broadcast dims go first.
  int64_t insert_at = adjacent ? a.adv.front() : 0;
  int64_t pos = 0;
  size_t ri = 0;
  auto push_rest = [&](int64_t upto_dim) {
    while (ri < a.rest.size() && a.rest[ri] < upto_dim) {
      a.result.push_back(self_shape[a.rest[ri]]);
      a.offset_dims.push_back(pos++);
      ++ri;
    }
  };
  if (adjacent) push_rest(insert_at);
  for (int64_t d : a.bshape) {
    a.result.push_back(d);
    ++pos;
  }
  push_rest(r);
  return a;
}

Value index_gather(Builder& b, Value self, const AdvIndex& a) {
  Shape slice_sizes = self.shape();
  for (int64_t d : a.adv) slice_sizes[d] = 1;
  return b.gather(self, a.coords, a.offset_dims, a.adv, a.adv,
                  static_cast<int64_t>(a.bshape.size()), slice_sizes, a.result);
}

// `values` broadcast to `shape` (PyTorch also accepts extra leading unit dims).
Value broadcast_values(Builder& b, Value v, const Shape& shape) {
  Shape s = v.shape();
  while (s.size() > shape.size() && s.front() == 1) s.erase(s.begin());
  if (s.size() > shape.size()) throw Unsupported("index_put: values do not broadcast");
  return b.broadcast_to(b.reshape(v, s), shape);
}

Value index_put_mask(Builder& b, const OpCall& c);

std::vector<Value> lower_index_put_common(Builder& b, const OpCall& c) {
  Value self = c.tensor("self");
  for (const auto& t : c.arg("indices").tensors)
    if (t && (t->elem() == ElemType::Pred || t->elem() == ElemType::U8)) return {index_put_mask(b, c)};
  AdvIndex a = adv_index(b, c.arg("indices"), self.shape());
  Value values = b.convert(c.tensor("values"), self.elem());
  if (a.adv.empty()) {
    // self[...] = values (or += values)
    Value v = broadcast_values(b, values, self.shape());
    return {c.bool_("accumulate") ? b.add(self, v) : v};
  }
  if (numel(a.result) == 0) return {self};
  Value updates = broadcast_values(b, values, a.result);
  Value out = b.scatter(self, a.coords, updates, a.offset_dims, a.adv, a.adv,
                        static_cast<int64_t>(a.bshape.size()), c.bool_("accumulate") ? "add" : "");
  return {out};
}

Value prefix_sum_1d(Builder& b, Value x);

// self[..., mask, ...] = values (or +=) for one boolean mask covering dims [p, p + k) and no
// other index tensors: the i-th true position takes row i of values along dim p (the
// prefix-sum of the mask gives i), so no data-dependent shape is needed.
Value index_put_mask(Builder& b, const OpCall& c) {
  Value self = c.tensor("self");
  const auto& list = c.arg("indices").tensors;
  int64_t p = -1, nmask = 0;
  Value mask;
  for (size_t i = 0; i < list.size(); ++i) {
    if (!list[i]) continue;
    if (list[i]->elem() != ElemType::Pred && list[i]->elem() != ElemType::U8)
      throw Unsupported("index_put: boolean mask mixed with integer indices");
    if (++nmask > 1) throw Unsupported("index_put: several boolean masks");
    p = static_cast<int64_t>(i);
    mask = b.convert(*list[i], ElemType::Pred);
  }
  int64_t k = mask.rank();
  const Shape& ss = self.shape();
  if (p + k > self.rank()) throw Unsupported("index_put: mask has too many dims");
  for (int64_t d = 0; d < k; ++d)
    if (mask.shape()[d] != ss[p + d]) throw Unsupported("index_put: mask shape mismatch");
  bool acc = c.bool_("accumulate");
  Value values = b.convert(c.tensor("values"), self.elem());
  // Target shape of values: self[:p] + [C] + self[p+k:], C = values' count dim (or 1).
  Shape t(ss.begin(), ss.begin() + p);
  t.push_back(1);
  t.insert(t.end(), ss.begin() + p + k, ss.end());
  Shape vs = values.shape();
  while (vs.size() > t.size() && vs.front() == 1) vs.erase(vs.begin());
  if (vs.size() > t.size()) throw Unsupported("index_put: values do not broadcast");
  values = b.reshape(values, vs);
  int64_t off = static_cast<int64_t>(t.size() - vs.size());
  int64_t count = p >= off ? vs[p - off] : 1;
  t[p] = count;
  values = b.broadcast_to(values, t);
  Value upd;
  if (count == 1) {
    Shape u(ss.begin(), ss.begin() + p);
    for (int64_t d = 0; d < k; ++d) u.push_back(1);
    u.insert(u.end(), ss.begin() + p + k, ss.end());
    upd = b.broadcast_to(b.reshape(values, u), ss);
  } else {
    int64_t m = mask.type.numel();
    Value pos = prefix_sum_1d(b, b.convert(b.reshape(mask, {m}), I64));
    pos = b.clamp(b.constant_i(0, I64, {m}), b.sub(pos, b.constant_i(1, I64, {m})),
                  b.constant_i(count - 1, I64, {m}));
    Shape ps = mask.shape();
    ps.push_back(1);
    pos = b.reshape(pos, ps);
    std::vector<int64_t> offset_dims;
    for (int64_t d = 0; d < static_cast<int64_t>(ss.size()); ++d)
      if (d < p || d >= p + k) offset_dims.push_back(d);
    Shape slice = t;
    slice[p] = 1;
    upd = b.gather(values, pos, offset_dims, {p}, {p}, k, slice, ss);
  }
  std::vector<int64_t> mdims;
  for (int64_t d = 0; d < k; ++d) mdims.push_back(p + d);
  Value mb = b.broadcast_in_dim(mask, ss, mdims);
  if (acc) return b.add(self, b.select(mb, upd, b.zeros(self.type)));
  return b.select(mb, upd, self);
}

// Inclusive prefix sum of a 1-D value (Hillis-Steele, log2(n) steps).
Value prefix_sum_1d(Builder& b, Value x) {
  int64_t n = x.shape()[0];
  Value zero = b.constant_i(0, x.elem());
  for (int64_t s = 1; s < n; s *= 2) {
    Value shifted = b.pad(b.slice(x, {0}, {n - s}), zero, {s}, {0});
    x = b.add(x, shifted);
  }
  return x;
}

// Gathers rows of `table` along dim 0 at `idx` (any shape): result idx.shape + table.shape[1:].
Value take_rows(Builder& b, Value table, Value idx, const Bound& bound = {}) {
  int64_t ir = idx.rank();
  Shape slice_sizes = table.shape();
  slice_sizes[0] = 1;
  Shape result = idx.shape();
  for (int64_t d = 1; d < table.rank(); ++d) result.push_back(table.shape()[d]);
  Value coords = with_vector_dim(b, wrap_index(b, idx, table.shape()[0], bound));
  return b.gather(table, coords, range(table.rank() - 1, ir), {0}, {0}, ir, slice_sizes, result);
}

}  // namespace

// ---------------------------------------------------------------- index_select / gather
TPU_LOWER_WITH(index_select, .checked = true, .cpu_index_args = true, .complex = true) {
  Value self = c.tensor("self");
  Value index = c.tensor("index");
  const Type& o = out_type(c);
  if (o.numel() == 0) return {b.zeros(o)};
  if (self.rank() == 0) return {b.reshape(self, o.shape)};
  int64_t dim = norm_dim(c.int_("dim"), self.rank());
  int64_t n = index.type.numel();
  index = b.reshape(index, {n});
  Shape slice_sizes = self.shape();
  slice_sizes[dim] = 1;
  Shape result = self.shape();
  result[dim] = n;
  std::vector<int64_t> offset_dims;
  for (int64_t d = 0; d < self.rank(); ++d)
    if (d != dim) offset_dims.push_back(d);
  Value coords =
      with_vector_dim(b, wrap_index(b, index, self.shape()[dim], {false, CheckKind::Index, "index out of range in self"}));
  return {b.gather(self, coords, offset_dims, {dim}, {dim}, 1, slice_sizes, result)};
}

TPU_LOWER_INDEXING(gather) {
  Value self = c.tensor("self");
  Value index = c.tensor("index");
  const Type& o = out_type(c);
  if (o.numel() == 0) return {b.zeros(o)};
  int64_t dim = norm_dim(c.int_("dim"), self.rank());
  if (self.rank() == 0) return {b.broadcast_to(self, o.shape)};
  if (index.rank() == 0) index = b.reshape(index, Shape(self.rank(), 1));
  int64_t r = self.rank();
  Value coords = dim_coords(b, index, dim, self.shape()[dim]);
  Value g = b.gather(self, coords, {}, range(r), range(r), r, Shape(r, 1), index.shape());
  return {b.reshape(g, o.shape)};
}

// ---------------------------------------------------------------- scatter family
TPU_LOWER_INDEXING(scatter) {
  Value self = c.tensor("self");
  Value index = c.tensor("index");
  int64_t dim = norm_dim(c.int_("dim"), self.rank());
  Value upd = scatter_src(b, c, self, index);
  return {scatter_along(b, self, dim, index, upd, combine_for(c.str("reduce"), "scatter"))};
}

TPU_LOWER_INDEXING(scatter_add) {
  Value self = c.tensor("self");
  Value index = c.tensor("index");
  int64_t dim = norm_dim(c.int_("dim"), self.rank());
  Value upd = scatter_src(b, c, self, index);
  return {scatter_along(b, self, dim, index, upd, "add")};
}

TPU_LOWER_INDEXING(scatter_reduce) {
  Value self = c.tensor("self");
  Value index = c.tensor("index");
  ElemType t = self.elem();
  int64_t dim = norm_dim(c.int_("dim"), self.rank());
  std::string reduce = c.str("reduce");
  bool include_self = c.bool_("include_self", true);
  if (t == ElemType::Pred && reduce != "amax" && reduce != "amin")
    throw Unsupported("scatter_reduce on bool");
  Value src = scatter_src(b, c, self, index);
  if (index.type.numel() == 0) return {self};
  Value x = self;
  if (!include_self) {
    Value ident;
    if (reduce == "sum" || reduce == "mean") ident = b.constant_i(0, t, index.shape());
    else if (reduce == "prod") ident = b.constant_i(1, t, index.shape());
    else if (reduce == "amax") ident = b.lowest(t, index.shape());
    else if (reduce == "amin") ident = b.highest(t, index.shape());
    else throw Unsupported("scatter_reduce: reduce='" + reduce + "'");
    x = scatter_along(b, x, dim, index, ident, "");
  }
  if (reduce == "mean") {
    Value sum = scatter_along(b, x, dim, index, src, "add");
    Value count = b.constant_i(include_self ? 1 : 0, t, self.shape());
    count = scatter_along(b, count, dim, index, b.constant_i(1, t, index.shape()), "add");
    Value zero = b.constant_i(0, t, self.shape());
    Value one = b.constant_i(1, t, self.shape());
    count = b.select(b.compare(Cmp::EQ, count, zero), one, count);
    if (is_float(t)) {
      ElemType ot = opmath(t);
      return {b.convert(b.div(b.convert(sum, ot), b.convert(count, ot)), t)};
    }
    // Floor division (count > 0).
    Value q = b.div(sum, count);
    Value r = b.rem(sum, count);
    Value adjust = b.and_(b.compare(Cmp::NE, r, zero), b.compare(Cmp::LT, sum, zero));
    return {b.select(adjust, b.sub(q, one), q)};
  }
  return {scatter_along(b, x, dim, index, src, combine_for(reduce, "scatter_reduce"))};
}

// ---------------------------------------------------------------- advanced indexing
TPU_LOWER_WITH(index, .host_bool_indices = true, .checked = true, .cpu_index_args = true, .complex = true) {
  Value self = c.tensor("self");
  const Type& o = out_type(c);
  AdvIndex a = adv_index(b, c.arg("indices"), self.shape());
  if (a.adv.empty()) return {self};
  if (o.numel() == 0 || numel(a.result) == 0) return {b.zeros(o)};
  return {index_gather(b, self, a)};
}

TPU_LOWER_INDEXING(index_put) { return lower_index_put_common(b, c); }
TPU_LOWER_INDEXING(_index_put_impl) { return lower_index_put_common(b, c); }

// ---------------------------------------------------------------- index_* along a dim
namespace {
// self.index_*_(dim, index, source) as a scatter along dim; `source` has self's shape except
// size len(index) at `dim`.
Value index_scatter(Builder& b, Value self, int64_t dim, Value index, Value source,
                    const std::string& combine, CheckKind kind, const std::string& prefix,
                    const std::string& message = {}) {  // `message`: instead of prefix + oob()
  int64_t n = index.type.numel();
  if (n == 0) return self;
  Shape self_shape = self.shape();
  if (self.rank() == 0) {
    self = b.reshape(self, {1});
    source = b.reshape(source, {n});
    dim = 0;
  }
  index = b.reshape(index, {n});
  Shape src_shape = self.shape();
  src_shape[dim] = n;
  source = b.reshape(source, src_shape);
  std::vector<int64_t> window;
  for (int64_t d = 0; d < self.rank(); ++d)
    if (d != dim) window.push_back(d);
  int64_t size = self.shape()[dim];
  Value coords = with_vector_dim(b, wrap_index(b, index, size, {false, kind, message.empty() ? oob(dim, size, prefix) : message}));
  Value out = do_scatter(b, self, coords, source, window, {dim}, {dim}, 1, combine);
  return b.reshape(out, self_shape);
}
}  // namespace

// self.index_reduce_(dim, index, source, reduce, include_self): as CPU, indices must lie in
// [0, size) (IndexError "index out of range in self"); include_self=False first resets the indexed
// slices to the reduction's identity; mean divides by the count (self counted once when
// included; a floor division for integers).
TPU_LOWER_INDEXING(index_reduce) {
  Value self = c.tensor("self");
  const ElemType t = self.elem();
  const int64_t dim = self.rank() == 0 ? 0 : norm_dim(c.int_("dim"), self.rank());
  const std::string reduce = c.str("reduce");
  const bool include_self = c.bool_("include_self", true);
  Value index = c.tensor("index");
  Value src = b.convert(c.tensor("source"), t);
  const Shape& ss = src.shape();
  auto scatter = [&](Value into, Value upd, const std::string& combine) {
    return index_scatter(b, into, dim, index, upd, combine, CheckKind::Index, "", "index out of range in self");
  };
  if (reduce != "prod" && reduce != "mean" && reduce != "amax" && reduce != "amin")
    throw Unsupported("index_reduce: reduce='" + reduce + "'");
  if (t == ElemType::Pred) throw Unsupported("index_reduce on bool");
  Value x = self;
  if (!include_self) {
    Value ident = reduce == "prod"   ? b.constant_i(1, t, ss)
                  : reduce == "mean" ? b.constant_i(0, t, ss)
                  : reduce == "amax" ? b.lowest(t, ss)
                                     : b.highest(t, ss);
    x = scatter(x, ident, "");
  }
  if (reduce != "mean") return {scatter(x, src, reduce == "prod" ? "multiply" : reduce == "amax" ? "maximum" : "minimum")};
  Value sum = scatter(x, src, "add");
  Value count = scatter(b.constant_i(include_self ? 1 : 0, t, self.shape()), b.constant_i(1, t, ss), "add");
  Value zero = b.constant_i(0, t, self.shape()), one = b.constant_i(1, t, self.shape());
  count = b.select(b.compare(Cmp::EQ, count, zero), one, count);
  if (is_float(t)) {
    const ElemType ot = opmath(t);
    return {b.convert(b.div(b.convert(sum, ot), b.convert(count, ot)), t)};
  }
  Value q = b.div(sum, count), r = b.rem(sum, count);
  Value adjust = b.and_(b.compare(Cmp::NE, r, zero), b.compare(Cmp::LT, sum, zero));
  return {b.select(adjust, b.sub(q, one), q)};
}

TPU_LOWER_INDEXING(index_add) {
  Value self = c.tensor("self");
  ElemType t = self.elem();
  int64_t dim = norm_dim(c.int_("dim"), self.rank());
  Value src = c.tensor("source");
  if (c.has("alpha")) {
    ElemType ot = opmath(t);
    if (t == ElemType::Pred) ot = ElemType::Pred;
    Value s = b.convert(src, ot);
    if (ot == ElemType::Pred) {
      s = b.and_(s, operand(b, c.arg("alpha"), ot, s.shape()));
    } else {
      s = b.mul(s, operand(b, c.arg("alpha"), ot, s.shape()));
    }
    src = s;
  }
  src = b.convert(src, t);
  return {index_scatter(b, self, dim, c.tensor("index"), src, "add", CheckKind::Runtime, "")};
}

TPU_LOWER_INDEXING(index_copy) {
  Value self = c.tensor("self");
  int64_t dim = norm_dim(c.int_("dim"), self.rank());
  Value src = b.convert(c.tensor("source"), self.elem());
  return {index_scatter(b, self, dim, c.tensor("index"), src, "", CheckKind::Index, "index_copy_(): ")};
}

// torch_tpu::index_copy_at(self, dim, start, source) = index_copy(self, dim, arange(n) + start,
// source), n = source.size(dim): the static KV cache write (graph_passes.py proves the index is
// that run). One dynamic_update_slice, in place on the donated cache, instead of a scatter. The
// index range check is index_copy's (every row in [0, size) iff 0 <= start <= size - n); the slice
// would clamp a bad start where index_copy's scatter drops rows, so with checks off the scatter stays.
TPU_LOWER_INDEXING(index_copy_at) {
  Value self = c.tensor("self");
  const int64_t dim = norm_dim(c.int_("dim"), self.rank());
  Value src = b.convert(c.tensor("source"), self.elem());
  const int64_t n = src.shape().at(static_cast<size_t>(dim)), size = self.shape()[dim];
  Value start = b.reshape(b.convert(c.tensor("start"), I64), {});
  const std::string msg = oob(dim, size, "index_copy_(): ");
  if (n == 0) return {self};
  if (!b.checking()) {
    Value index = b.add(b.iota(Type{I64, {n}}, 0), b.broadcast_in_dim(start, {n}, {}));
    return {index_scatter(b, self, dim, index, src, "", CheckKind::Index, "index_copy_(): ")};
  }
  check(b, b.or_(b.compare(Cmp::LT, start, b.constant_i(0, I64)), b.compare(Cmp::GT, start, b.constant_i(size - n, I64))),
        CheckKind::Index, msg);
  std::vector<Value> starts(static_cast<size_t>(self.rank()), b.constant_i(0, I64));
  starts[static_cast<size_t>(dim)] = start;
  return {b.dynamic_update_slice(self, src, starts)};
}

TPU_LOWER_INDEXING(index_fill) {
  // Mask over positions along `dim` (no scatter: duplicates are harmless).
  Value self = c.tensor("self");
  Value index = c.tensor("index");
  int64_t n = index.type.numel();
  if (n == 0) return {self};
  if (self.rank() == 0) {
    Value v = operand(b, c.arg("value"), self.elem(), {});
    return {v};
  }
  int64_t dim = norm_dim(c.int_("dim"), self.rank());
  int64_t size = self.shape()[dim];
  Value idx = wrap_index(b, b.reshape(index, {n}), size, {true, CheckKind::Index, oob(dim, size)});
  Value ib = b.broadcast_in_dim(idx, {n, size}, {0});
  Value pos = b.iota(Type{I64, {n, size}}, 1);
  Value hit = b.reduce(b.compare(Cmp::EQ, ib, pos), b.constant_i(0, ElemType::Pred), {0}, "or");
  Value mask = b.broadcast_in_dim(hit, self.shape(), {dim});
  Value v = operand(b, c.arg("value"), self.elem(), self.shape());
  return {b.select(mask, v, self)};
}

// ---------------------------------------------------------------- masked ops
TPU_LOWER_COMPLEX(masked_fill) {
  const Type& o = out_type(c);
  Value self = b.broadcast_to(c.tensor("self"), o.shape);
  Value mask = b.broadcast_to(b.convert(c.tensor("mask"), ElemType::Pred), o.shape);
  Value v = operand(b, c.arg("value"), self.elem(), o.shape);
  return {b.select(mask, v, self)};
}

TPU_LOWER(masked_scatter) {
  const Type& o = out_type(c);
  Value self = b.broadcast_to(c.tensor("self"), o.shape);
  Value source = b.convert(c.tensor("source"), self.elem());
  int64_t n = o.numel();
  int64_t m = source.type.numel();
  if (n == 0 || m == 0) return {self};
  Value mask = b.reshape(b.broadcast_to(b.convert(c.tensor("mask"), ElemType::Pred), o.shape), {n});
  Value pos = prefix_sum_1d(b, b.convert(mask, I64));
  pos = b.sub(pos, b.constant_i(1, I64, {n}));
  pos = b.clamp(b.constant_i(0, I64, {n}), pos, b.constant_i(m - 1, I64, {n}));
  Value picked = take_rows(b, b.reshape(source, {m}), pos);
  Value flat = b.select(mask, picked, b.reshape(self, {n}));
  return {b.reshape(flat, o.shape)};
}

// ---------------------------------------------------------------- take / put / embedding
TPU_LOWER_INDEXING(take) {
  Value self = c.tensor("self");
  Value index = c.tensor("index");
  const Type& o = out_type(c);
  if (o.numel() == 0) return {b.zeros(o)};
  Value flat = b.reshape(self, {self.type.numel()});
  int64_t n = self.type.numel();
  std::string msg = "out of range: tried to access an index on a tensor of " + std::to_string(n) + " elements.";
  return {b.reshape(take_rows(b, flat, index, {true, CheckKind::Index, msg}), o.shape)};
}

TPU_LOWER_INDEXING(put) {
  Value self = c.tensor("self");
  Value index = c.tensor("index");
  int64_t n = self.type.numel();
  int64_t k = index.type.numel();
  if (k == 0 || n == 0) return {self};
  Value flat = b.reshape(self, {n});
  Value src = b.reshape(b.convert(c.tensor("source"), self.elem()), {k});
  std::string msg = "out of range: tried to access an index on a tensor of " + std::to_string(n) + " elements.";
  Value coords = with_vector_dim(b, wrap_index(b, b.reshape(index, {k}), n, {true, CheckKind::Index, msg}));
  Value out = b.scatter(flat, coords, src, {}, {0}, {0}, 1, c.bool_("accumulate") ? "add" : "");
  return {b.reshape(out, self.shape())};
}

TPU_LOWER_CHECKED(embedding) {
  Value weight = c.tensor("weight");
  Value indices = c.tensor("indices");
  const Type& o = out_type(c);
  if (o.numel() == 0) return {b.zeros(o)};
  if (weight.rank() < 1) throw Unsupported("embedding: 0-d weight");
  return {b.reshape(take_rows(b, weight, indices, {false, CheckKind::Index, "index out of range in self"}), o.shape)};
}

// repeat_interleave.Tensor given output_size (no host read, as CUDA): out[i] = #{j : cumsum(
// repeats)[j] <= i}, a histogram of the clipped cumsum, prefix-summed. Without output_size the
// size is the values' sum: the lowering refuses and the call takes the host-sync path (one counted
// read, as CUDA syncs; the CPU kernel's checks, negative repeats, apply).
TPU_HOST_SYNC(repeat_interleave);
TPU_LOWER(repeat_interleave) {
  if (!c.has("repeats") || !c.has("output_size"))
    throw Unsupported("repeat_interleave: the output size depends on the values");
  const Type& o = c.outs.at(0);
  const int64_t total = o.numel();
  Value r = c.tensor("repeats");
  const int64_t n = r.type.numel();
  if (total == 0 || n == 0) return {b.zeros(o)};
  Value cs = prefix_sum_1d(b, b.convert(b.reshape(r, {n}), I64));
  cs = b.clamp(b.constant_i(0, I64, {n}), cs, b.constant_i(total, I64, {n}));
  Value hist = b.scatter(b.zeros(Type{I64, {total + 1}}), b.reshape(cs, {n, 1}), b.constant_i(1, I64, {n}), {},
                         {0}, {0}, 1, "add");
  Value out = prefix_sum_1d(b, b.slice(hist, {0}, {total}));
  return {b.reshape(b.convert(out, o.elem), o.shape)};
}

}  // namespace tpu::lowering
